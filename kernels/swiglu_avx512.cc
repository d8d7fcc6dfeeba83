// SwiGLU combine with AVX-512 (compiled with -mavx512f/bw/vl/dq).

#include "kernels/x86_simd.h"

#include "kernels/swiglu.h"

namespace colibri {
namespace kernels {
namespace {

// e^x: x = n·ln2 + r with |r| <= ln2/2 (two-part ln2), e^r by a degree-6
// Taylor/minimax polynomial, then scaled by 2^n with vscalefps (which gives
// 0 / inf at the extremes, and keeps NaN).
__m512 Exp(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// f32 -> bf16, round to nearest even; NaN stays a quiet NaN.
__m256i ToBf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(rounded);
}

}  // namespace

void SwiGluAvx512(const float* a, const float* b, float* h, uint16_t* h_bf16, float* h_sum) {
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < 64; i += 16) {
    const __m512 av = _mm512_loadu_ps(a + i);
    const __m512 e = Exp(_mm512_sub_ps(_mm512_setzero_ps(), av));
    const __m512 hv = _mm512_mul_ps(_mm512_div_ps(av, _mm512_add_ps(_mm512_set1_ps(1.f), e)), _mm512_loadu_ps(b + i));
    _mm512_storeu_ps(h + i, hv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h_bf16 + i), ToBf16(hv));
    sum = _mm512_add_ps(sum, hv);
  }
  *h_sum = _mm512_reduce_add_ps(sum);
}

}  // namespace kernels
}  // namespace colibri
