#ifndef COLIBRI_KERNELS_REFERENCE_MOE_H_
#define COLIBRI_KERNELS_REFERENCE_MOE_H_

// The scalar reference MoE layer: the oracle every faster path is tested
// against, itself tested against an independent PyTorch computation
// (tests/kernels/reference_moe_test.cc).
//
//   FFN_e(x) = W2_e · ( silu(W1_e · x) ⊙ (W3_e · x) )
//   y        = Σ_{j<k} w_j · FFN_{e_j}(x)
// or, for experts with biases, another activation or the weight at the
// input, the general form common::ExpertWeights states.
//
// Weights are decoded to their exact stored values; every dot product, the
// SiLU, the product and the weighted sum are computed in double and rounded to
// f32 once, at the end. Simple and obviously right, not fast. Pure compute;
// allocates its own scratch; thread-compatible.

#include <cstdint>

#include "absl/types/span.h"
#include "common/model_dir.h"
#include "common/routing.h"

namespace colibri {
namespace kernels {

// out[r][c] = FFN(x[r])[c] for r < num_rows, in double.
// REQUIRES: x is [num_rows][d_model], out has num_rows * d_model entries.
void ReferenceExpertFfn(const common::ExpertWeights& expert, const float* x, int64_t num_rows, double* out);

// y[t] = Σ_j routes.weights[t][j] · FFN_{routes.expert_ids[t][j]}(x[t]).
// `experts[e]` is expert e of the layer; it may be null only if no route uses e.
// REQUIRES: every routed id < experts.size(); x and y are [num_tokens][d_model].
void ReferenceMoeLayer(absl::Span<const common::ExpertWeights* const> experts, const common::Routes& routes,
                       const float* x, int64_t d_model, float* y);

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_REFERENCE_MOE_H_
