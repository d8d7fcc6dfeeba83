#ifndef COLIBRI_COMMON_HALF_H_
#define COLIBRI_COMMON_HALF_H_

// Scalar conversions between f32 and the 16-bit floats bf16 and f16.
// Conversions to bf16 and f16 round to nearest, ties to even; NaN stays NaN,
// overflow goes to infinity. Header-only (target colibri::half), so that the
// C++ client can convert tensors without linking colibri::common. Pure and
// thread-safe.

#include <cstdint>
#include <cstring>

namespace colibri {
namespace common {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(uint32_t{h} << 16); }

inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign, force quiet.
    return static_cast<uint16_t>((u >> 16) | 0x40u);
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in f32
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return BitsToFloat(FloatBits(magnitude) | sign);
  }
  if (exponent == 31) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline uint16_t FloatToF16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) {  // Inf or NaN (NaN stays quiet NaN)
    return static_cast<uint16_t>(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0u));
  }
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520
  if (a < 0x38800000u) {                                               // below 2^-14: f16 subnormal or zero.
    // Adding 0.5f puts the f16 subnormal grid (2^-24) at the f32 ulp, so the
    // FPU's own round-to-nearest-even does the rounding.
    const float shifted = BitsToFloat(a) + 0.5f;
    return static_cast<uint16_t>(sign | (FloatBits(shifted) - 0x3f000000u));
  }
  const uint32_t odd = (a >> 13) & 1u;
  a += 0xc8000fffu + odd;  // rebias exponent 127 -> 15 and round to nearest even
  return static_cast<uint16_t>(sign | (a >> 13));
}

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_HALF_H_
