#include "common/dtype.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <limits>

namespace colibri {
namespace common {
namespace {

TEST_CASE("bf16 conversion rounds to nearest even and keeps specials") {
  CHECK(FloatToBf16(1.0f) == 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  CHECK(FloatToBf16(1.0f + 0x1p-8f) == 0x3f80);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even): rounds up.
  CHECK(FloatToBf16(1.0f + 3 * 0x1p-8f) == 0x3f82);
  CHECK(FloatToBf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81);  // above halfway
  CHECK(FloatToBf16(-2.0f) == 0xc000);
  CHECK(FloatToBf16(std::numeric_limits<float>::infinity()) == 0x7f80);
  CHECK(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  CHECK(FloatToBf16(std::numeric_limits<float>::max()) == 0x7f80);  // overflows to inf
}

TEST_CASE("every bf16 value survives a round trip through f32") {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    REQUIRE(FloatToBf16(f) == h);
  }
}

TEST_CASE("every f16 value survives a round trip through f32") {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = F16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      REQUIRE(std::isnan(F16ToFloat(FloatToF16(f))));
      continue;
    }
    REQUIRE(FloatToF16(f) == h);
  }
}

TEST_CASE("f16 conversion rounds to nearest even, saturates to inf and handles subnormals") {
  CHECK(F16ToFloat(0x3c00) == 1.0f);
  CHECK(FloatToF16(65504.0f) == 0x7bff);  // largest finite
  CHECK(FloatToF16(65519.0f) == 0x7bff);  // below the halfway point
  CHECK(FloatToF16(65520.0f) == 0x7c00);  // halfway to 65536: ties to even = inf
  CHECK(FloatToF16(1e9f) == 0x7c00);
  CHECK(FloatToF16(-1e9f) == 0xfc00);
  CHECK(F16ToFloat(0x0001) == 0x1p-24f);  // smallest subnormal
  CHECK(FloatToF16(0x1p-24f) == 0x0001);
  CHECK(FloatToF16(0x1p-25f) == 0x0000);         // halfway to the smallest subnormal: even (0)
  CHECK(FloatToF16(0x1.8p-24f) == 0x0002);       // 1.5 ulp: ties to even (2)
  CHECK(FloatToF16(1.0f + 0x1p-11f) == 0x3c00);  // halfway: even
  CHECK(FloatToF16(1.0f + 3 * 0x1p-11f) == 0x3c02);
  CHECK(FloatToF16(-0.0f) == 0x8000);
}

TEST_CASE("weight type names parse back and unknown names are refused") {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kInt8, DType::kInt4}) {
    auto parsed = ParseWeightType(DTypeName(t));
    REQUIRE(parsed.ok());
    CHECK(*parsed == t);
  }
  auto bad = ParseWeightType("int3");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("int3") != absl::string_view::npos);
}

}  // namespace
}  // namespace common
}  // namespace colibri
