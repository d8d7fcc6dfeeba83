#ifndef COLIBRI_KERNELS_INT4_AVX512_H_
#define COLIBRI_KERNELS_INT4_AVX512_H_

// What the AVX-512 int4 block kernels share (block_avx512.cc: nibbles to
// f32; block_avx512_bf16.cc: nibbles times int8 activations). Include only
// from files compiled with the AVX-512 flags.

#include "kernels/x86_simd.h"

#include <cstdint>

namespace colibri {
namespace kernels {

// The zero points of one int4 row for TT tokens: corr[t] = Σ_g s_g·z_g·sums_t[g]
// with sums_t = sums + t * groups (the activations' per-group sums as the
// kernel multiplied them), 16 groups a vector with a masked tail.
template <int TT>
inline void Int4ZeroPoints(const float* scales, const uint8_t* zeros, int64_t groups, const float* sums, float* corr) {
  __m512 acc[TT];
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 m = groups - g >= 16 ? 0xffff : static_cast<__mmask16>((1u << (groups - g)) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(m, scales + g);
    const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, zeros + g)));
    const __m512 sz = _mm512_mul_ps(s, z);
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) acc[t] = _mm512_fmadd_ps(sz, _mm512_maskz_loadu_ps(m, sums + t * groups + g), acc[t]);
  }
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) corr[t] = _mm512_reduce_add_ps(acc[t]);
}

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_INT4_AVX512_H_
