#ifndef COLIBRI_COMMON_DTYPE_H_
#define COLIBRI_COMMON_DTYPE_H_

// Element types; the scalar conversions between them are in common/half.h
// (included here).
//
// Weight types are f32, bf16, f16, int8 (per-row symmetric) and int4 (groups of
// 64 along the input dimension, asymmetric); u8 and i32 appear only inside
// model files (int4 zero points, LUT expert ids). All functions are pure and
// thread-safe.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/half.h"

namespace colibri {
namespace common {

// Numeric codes are stored in model files: never renumber.
enum class DType : uint32_t {
  kF32 = 1,
  kBF16 = 2,
  kF16 = 3,
  kInt8 = 4,
  kInt4 = 5,
  kU8 = 6,
  kI32 = 7,
};

// "f32", "bf16", "f16", "int8", "int4", "u8", "i32"; "unknown(<code>)" otherwise.
std::string DTypeName(DType type);

// Parses a weight type name as printed by DTypeName (f32|bf16|f16|int8|int4).
// INVALID_ARGUMENT naming the text for anything else.
absl::StatusOr<DType> ParseWeightType(absl::string_view name);

// True for the five types a model's weights may have.
bool IsWeightType(DType type);

// True if `code` is one of the DType values above.
bool IsKnownDTypeCode(uint32_t code);

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_DTYPE_H_
