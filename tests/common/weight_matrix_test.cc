#include "common/weight_matrix.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace colibri {
namespace common {
namespace {

struct Encoded {
  std::vector<uint8_t> data;
  std::vector<float> scales;
  std::vector<uint8_t> zeros;
  MatrixView view;
};

Encoded Encode(DType type, int64_t rows, int64_t cols, const std::vector<float>& w) {
  Encoded e;
  const MatrixLayout l = ComputeMatrixLayout(type, rows, cols);
  e.data.assign(l.data_bytes, 0xAB);
  e.scales.assign(l.scale_bytes / 4, -1.f);
  e.zeros.assign(l.zero_bytes, 0xAB);
  for (int64_t b = 0; b < l.num_blocks(); ++b) {
    EncodeBlock(l, w.data() + b * kBlockRows * cols, b, e.data.data() + b * l.block_bytes, e.scales.data(),
                e.zeros.data());
  }
  e.view = {l, e.data.data(), e.scales.data(), e.zeros.data()};
  return e;
}

TEST_CASE("every weight type decodes within its documented error bound") {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 0.05f);
  for (DType type : {DType::kF32, DType::kBF16, DType::kF16, DType::kInt8, DType::kInt4}) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{5, 1}, {5, 63}, {70, 64}, {64, 65}, {130, 130}}) {
      std::vector<float> w(rows * cols);
      for (float& v : w) v = normal(rng);
      w[0] = 0.3f;  // an outlier in the first group
      const Encoded e = Encode(type, rows, cols, w);
      std::vector<float> out(cols);
      bool any_nonzero = false;
      for (int64_t r = 0; r < rows; ++r) {
        DecodeRow(e.view, r, out.data());
        float amax = 0.f;
        for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(w[r * cols + c]));
        const float bound = MaxEncodingError(e.view, r, amax);
        for (int64_t c = 0; c < cols; ++c) {
          INFO(DTypeName(type) << " cols " << cols << " row " << r << " col " << c);
          REQUIRE(std::fabs(out[c] - w[r * cols + c]) <= bound);
          any_nonzero |= out[c] != 0.f;
        }
      }
      CHECK(any_nonzero);
      if (type == DType::kF32) CHECK(MaxEncodingError(e.view, 0, 1.f) == 0.f);
    }
  }
}

TEST_CASE("layouts pad rows and columns to 64 and store scales and zero points") {
  const MatrixLayout i8 = ComputeMatrixLayout(DType::kInt8, 3, 65);
  CHECK(i8.padded_rows == 64);
  CHECK(i8.padded_cols == 128);
  CHECK(i8.block_bytes == 64 * 128);
  CHECK(i8.scale_bytes == 64 * 4);
  CHECK(i8.zero_bytes == 0);
  const MatrixLayout i4 = ComputeMatrixLayout(DType::kInt4, 3, 65);
  CHECK(i4.groups == 2);
  CHECK(i4.block_bytes == 64 * 64);
  CHECK(i4.scale_bytes == 64 * 2 * 4);
  CHECK(i4.zero_bytes == 64 * 2);
  const MatrixLayout bf = ComputeMatrixLayout(DType::kBF16, 14336, 4096);
  CHECK(bf.data_bytes == size_t{14336} * 4096 * 2);
  CHECK(bf.num_blocks() == 224);
}

TEST_CASE("float layouts are oneDNN's blocked formats") {
  // Small integers: exact in every float type.
  const int64_t rows = 70, cols = 40;
  std::vector<float> w(rows * cols);
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t k = 0; k < cols; ++k) w[n * cols + k] = static_cast<float>((n % 31) * 4 + k % 4);
  }
  for (DType type : {DType::kF32, DType::kBF16, DType::kF16}) {
    const Encoded e = Encode(type, rows, cols, w);
    const int64_t K = 64;  // padded cols
    for (int64_t n : {0, 5, 63, 64, 69}) {
      for (int64_t k : {0, 1, 2, 39}) {
        float v = 0;
        if (type == DType::kF32) {
          std::memcpy(&v, &e.data[((n / 64 * K + k) * 64 + n % 64) * 4], 4);  // BA16a64b
        } else {
          uint16_t h;
          const size_t i = type == DType::kBF16 ? ((n / 64 * (K / 2) + k / 2) * 64 + n % 64) * 2 + k % 2  // BA16a64b2a
                                                : (n / 64 * K + k) * 64 + n % 64;
          std::memcpy(&h, &e.data[i * 2], 2);
          v = type == DType::kBF16 ? Bf16ToFloat(h) : F16ToFloat(h);
        }
        INFO(DTypeName(type) << " n " << n << " k " << k);
        CHECK(v == w[n * cols + k]);
      }
    }
  }
}

TEST_CASE("int4 keeps zero exact, packs low nibble first and pads with the zero point") {
  // One group: values from -1 to 2 in steps of 0.2, plus exact zeros.
  std::vector<float> w(70, 0.f);
  for (int c = 0; c < 16; ++c) w[c] = -1.f + 0.2f * c;
  w[20] = 0.f;
  const Encoded e = Encode(DType::kInt4, 1, 70, w);
  std::vector<float> out(70);
  DecodeRow(e.view, 0, out.data());
  CHECK(out[20] == 0.f);
  CHECK(out[69] == 0.f);
  const int q0 = e.data[0] & 0x0f, q1 = e.data[0] >> 4;
  CHECK(q0 == 0);  // input 0, the minimum of the group, in the low nibble of byte 0
  CHECK(q1 == 5);  // input 32 (= 0.0) in its high nibble: the zero point
  CHECK(e.zeros[0] == 5);
  CHECK((e.data[1] & 0x0f) == 1);  // input 1 = -0.8 -> q = 1
  // Padding (cols 70..127) decodes to exactly zero: q == zero point.
  const int zero_second_group = e.zeros[1];
  CHECK((e.data[32 + 31] >> 4) == zero_second_group);
}

TEST_CASE("all-zero and constant rows encode without dividing by zero") {
  for (DType type : {DType::kInt8, DType::kInt4}) {
    std::vector<float> w(2 * 64, 0.f);
    for (int c = 64; c < 128; ++c) w[c] = 0.25f;
    const Encoded e = Encode(type, 2, 64, w);
    std::vector<float> out(64);
    DecodeRow(e.view, 0, out.data());
    for (float v : out) CHECK(v == 0.f);
    DecodeRow(e.view, 1, out.data());
    for (float v : out) CHECK(std::fabs(v - 0.25f) <= MaxEncodingError(e.view, 1, 0.25f));
  }
}

}  // namespace
}  // namespace common
}  // namespace colibri
