// SwiGLU combine with AVX2 + FMA.

#include "kernels/x86_simd.h"

#include "kernels/swiglu.h"

namespace colibri {
namespace kernels {
namespace {

// e^x as in swiglu_avx512.cc; 2^n is built in the exponent bits, with the
// input clamped so that n stays in the normal range (e^-88 ≈ 0, e^88 ≈ inf
// for SiLU's purpose: a / (1 + e^-a) is then 0 or a).
__m256 Exp(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

__m128i ToBf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  rounded = _mm256_blendv_epi8(rounded, quiet, nan);
  // Pack the 8 low halves of the 32-bit lanes (values < 65536, so no saturation issue with packus).
  const __m128i lo = _mm256_castsi256_si128(rounded), hi = _mm256_extracti128_si256(rounded, 1);
  return _mm_packus_epi32(lo, hi);
}

}  // namespace

void SwiGluAvx2(const float* a, const float* b, float* h, uint16_t* h_bf16, float* h_sum) {
  __m256 sum = _mm256_setzero_ps();
  for (int i = 0; i < 64; i += 8) {
    const __m256 av = _mm256_loadu_ps(a + i);
    const __m256 e = Exp(_mm256_sub_ps(_mm256_setzero_ps(), av));
    const __m256 hv = _mm256_mul_ps(_mm256_div_ps(av, _mm256_add_ps(_mm256_set1_ps(1.f), e)), _mm256_loadu_ps(b + i));
    _mm256_storeu_ps(h + i, hv);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h_bf16 + i), ToBf16(hv));
    sum = _mm256_add_ps(sum, hv);
  }
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  *h_sum = _mm_cvtss_f32(s);
}

}  // namespace kernels
}  // namespace colibri
