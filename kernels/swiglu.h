#ifndef COLIBRI_KERNELS_SWIGLU_H_
#define COLIBRI_KERNELS_SWIGLU_H_

// The SwiGLU combine of one 64-wide block of one token, fused with what the
// down projection needs from it:
//   h[i] = silu(a[i]) · b[i] = a[i] / (1 + e^-a[i]) · b[i]    (i < 64)
//   h_bf16[i] = bf16(h[i]) (nearest even),  *h_sum = Σ_i h[i]
// The scalar variant uses std::exp; the SIMD variants a polynomial e^x with
// a relative error below 2e-7 (tested). Pure; thread-safe.

#include <cstdint>

namespace colibri {
namespace kernels {

using SwiGluFn = void (*)(const float* a, const float* b, float* h, uint16_t* h_bf16, float* h_sum);

void SwiGluScalar(const float* a, const float* b, float* h, uint16_t* h_bf16, float* h_sum);
void SwiGluAvx2(const float* a, const float* b, float* h, uint16_t* h_bf16, float* h_sum);
void SwiGluAvx512(const float* a, const float* b, float* h, uint16_t* h_bf16, float* h_sum);

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_SWIGLU_H_
