#include "clients/cpp/tensor.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/half.h"

namespace colibri {
namespace client {

namespace v1 = colibri::v1;

// Tensor data is little-endian (tensor.proto); the copies below are the
// host's bytes, which is the same thing only on a little-endian host.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "colibri::client packs tensors in host byte order");

v1::Tensor PackF32(absl::Span<const float> values, int64_t rows, int64_t cols) {
  v1::Tensor t;
  t.set_dtype(v1::DATA_TYPE_F32);
  t.add_shape(rows);
  t.add_shape(cols);
  t.set_data(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  return t;
}

v1::Tensor PackBf16(absl::Span<const float> values, int64_t rows, int64_t cols) {
  v1::Tensor t;
  t.set_dtype(v1::DATA_TYPE_BF16);
  t.add_shape(rows);
  t.add_shape(cols);
  std::string* data = t.mutable_data();
  data->resize(values.size() * 2);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t h = common::FloatToBf16(values[i]);
    std::memcpy(&(*data)[2 * i], &h, 2);
  }
  return t;
}

absl::StatusOr<std::vector<float>> Unpack(const v1::Tensor& t) {
  int64_t count = 1;
  for (const int64_t d : t.shape()) {
    if (d < 0 || (d > 0 && count > (int64_t{1} << 40) / d)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor: bad shape dimension ", d));
    }
    count *= d;
  }
  const int64_t element = t.dtype() == v1::DATA_TYPE_F32                                        ? 4
                          : (t.dtype() == v1::DATA_TYPE_BF16 || t.dtype() == v1::DATA_TYPE_F16) ? 2
                                                                                                : 0;
  if (element == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor: dtype ", v1::DataType_Name(t.dtype()), " is not f32/bf16/f16"));
  }
  if (static_cast<int64_t>(t.data().size()) != count * element) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor: ", t.data().size(), " bytes for ", count, " values of ", element, " bytes"));
  }
  std::vector<float> out(count);
  if (element == 4) {
    if (count > 0) std::memcpy(out.data(), t.data().data(), count * 4);
    return out;
  }
  for (int64_t i = 0; i < count; ++i) {
    uint16_t h;
    std::memcpy(&h, t.data().data() + 2 * i, 2);
    out[i] = t.dtype() == v1::DATA_TYPE_BF16 ? common::Bf16ToFloat(h) : common::F16ToFloat(h);
  }
  return out;
}

}  // namespace client
}  // namespace colibri
