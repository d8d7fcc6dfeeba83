#ifndef COLIBRI_KERNELS_SWIGLU_H_
#define COLIBRI_KERNELS_SWIGLU_H_

// The SwiGLU combine of one 64-wide block of one token, fused with what the
// down projection needs from it:
//   h[i] = silu(a[i]) · b[i] = a[i] / (1 + e^-a[i]) · b[i]    (i < 64)
//   h_bf16[i] = bf16(h[i]) (nearest even),  *h_sum = Σ_i h[i]
// The scalar variant uses std::exp; the SIMD variants a polynomial e^x with
// a relative error below 2e-7 (tested). Pure; thread-safe.

#include <cstdint>

#include "common/manifest.h"

namespace colibri {
namespace kernels {

using SwiGluFn = void (*)(const float* a, const float* b, float* h, uint16_t* h_bf16, float* h_sum);

void SwiGluScalar(const float* a, const float* b, float* h, uint16_t* h_bf16, float* h_sum);
void SwiGluAvx2(const float* a, const float* b, float* h, uint16_t* h_bf16, float* h_sum);
void SwiGluAvx512(const float* a, const float* b, float* h, uint16_t* h_bf16, float* h_sum);

// The same block for any common::Activation, with the biases of the block's
// 64 intermediate entries (b1, b3 null: none):
//   h[i] = act(a[i] + b1[i], b[i] + b3[i])   for i < valid, 0 for valid <= i < 64
// (entries past d_ff are padding and must stay 0 whatever the biases).
// Scalar, in f32 with std::exp: it runs once per token and intermediate
// entry, d_model times less often than the matrix products around it.
void GatedActivationScalar(const common::Activation& act, const float* a, const float* b, const float* b1,
                           const float* b3, int64_t valid, float* h, uint16_t* h_bf16, float* h_sum);

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_SWIGLU_H_
