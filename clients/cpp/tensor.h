#ifndef COLIBRI_CLIENTS_CPP_TENSOR_H_
#define COLIBRI_CLIENTS_CPP_TENSOR_H_

// Packing hidden states into colibri.v1.Tensor and back. Pure functions.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "colibri/v1/tensor.pb.h"

namespace colibri {
namespace client {

// [rows][cols] f32 values as an f32 tensor (exact).
colibri::v1::Tensor PackF32(absl::Span<const float> values, int64_t rows, int64_t cols);
// ... as a bf16 tensor: each value rounded to nearest even (NaN stays NaN).
colibri::v1::Tensor PackBf16(absl::Span<const float> values, int64_t rows, int64_t cols);
// An f32, bf16 or f16 tensor as f32 values (16-bit types widen exactly).
// INVALID_ARGUMENT for another dtype or bytes that do not match the shape.
absl::StatusOr<std::vector<float>> Unpack(const colibri::v1::Tensor& tensor);

}  // namespace client
}  // namespace colibri

#endif  // COLIBRI_CLIENTS_CPP_TENSOR_H_
