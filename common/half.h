#ifndef COLIBRI_COMMON_HALF_H_
#define COLIBRI_COMMON_HALF_H_

// Scalar conversions between f32 and the 16-bit floats bf16 and f16, and the
// 8-bit float e4m3 (FP8 "e4m3fn" of DeepSeek-V3's checkpoints: 1 sign, 4
// exponent bits with bias 7, 3 mantissa bits, no infinities, NaN = S.1111.111,
// largest 448).
// Conversions to bf16 and f16 round to nearest, ties to even; NaN stays NaN,
// overflow goes to infinity. Header-only (target colibri::half), so that the
// C++ client can convert tensors without linking colibri::common. Pure and
// thread-safe.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

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

inline float Fp8E4m3ToFloat(uint8_t v) {
  const float sign = (v & 0x80) != 0 ? -1.0f : 1.0f;
  const int exponent = (v >> 3) & 0xf, mantissa = v & 0x7;
  if (exponent == 15 && mantissa == 7) return std::numeric_limits<float>::quiet_NaN();
  if (exponent == 0) return sign * static_cast<float>(mantissa) * 0x1p-9f;  // subnormal: m · 2^-9
  return sign * std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
}

// Round to nearest, ties to even; beyond ±448 saturates to ±448 (e4m3fn has
// no infinity); NaN stays NaN.
inline uint8_t FloatToFp8E4m3(float f) {
  const uint8_t sign = (FloatBits(f) >> 24) & 0x80;
  const float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7f;
  if (a >= 448.0f) return sign | 0x7e;
  if (a < 0x1p-6f) {  // subnormal range: multiples of 2^-9 (8 · 2^-9 is the smallest normal, code 0x08)
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  }
  int e = 0;
  const float fraction = std::frexp(a, &e);  // a = fraction · 2^e, fraction in [0.5, 1)
  int exponent = e + 6;                      // a = (1 + m/8) · 2^(exponent - 7)
  int mantissa = static_cast<int>(std::nearbyint((fraction * 2.0f - 1.0f) * 8.0f));
  if (mantissa == 8) {
    mantissa = 0;
    ++exponent;
  }
  if (exponent > 15 || (exponent == 15 && mantissa == 7)) return sign | 0x7e;
  return sign | static_cast<uint8_t>(exponent << 3 | mantissa);
}

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_HALF_H_
