#include "common/dtype.h"

#include "absl/strings/str_cat.h"

namespace colibri {
namespace common {

std::string DTypeName(DType type) {
  switch (type) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kInt8: return "int8";
    case DType::kInt4: return "int4";
    case DType::kU8: return "u8";
    case DType::kI32: return "i32";
  }
  return absl::StrCat("unknown(", static_cast<uint32_t>(type), ")");
}

bool IsWeightType(DType type) {
  switch (type) {
    case DType::kF32:
    case DType::kBF16:
    case DType::kF16:
    case DType::kInt8:
    case DType::kInt4: return true;
    default: return false;
  }
}

bool IsKnownDTypeCode(uint32_t code) {
  return code >= static_cast<uint32_t>(DType::kF32) && code <= static_cast<uint32_t>(DType::kI32);
}

absl::StatusOr<DType> ParseWeightType(absl::string_view name) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kInt8, DType::kInt4}) {
    if (name == DTypeName(t)) return t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown weight type '", name, "' (expected f32, bf16, f16, int8 or int4)"));
}

}  // namespace common
}  // namespace colibri
