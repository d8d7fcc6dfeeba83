#ifndef COLIBRI_COMMON_ROUTING_H_
#define COLIBRI_COMMON_ROUTING_H_

// The routing modes, and the exact routing of two of them:
//   gate: p = softmax(G·x); the k largest (ties toward the lower expert id);
//         weights renormalized to sum 1 when `normalize`.
//   lut : the converter's precomputed routes for a token id; an id outside
//         [0, vocab_size) is INVALID_ARGUMENT, never wrapped.
// Logits and softmax are computed in double and rounded once, so these are
// the reference routes every faster path is checked against. Pure functions.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace colibri {
namespace common {

// Where a layer's routes come from: the converter's table indexed by token id
// (lut), the layer's gate applied to the hidden state (gate), or the caller
// (client). The one vocabulary of the router, the tools and the benchmarks;
// the proto and the C++ client have their own enums, mapped to this one at
// their boundary (router_node/forward_request.cc, tools/load_bench.cc).
enum class RoutingMode { kLut, kGate, kClient };

// "lut", "gate" or "client".
const char* RoutingModeName(RoutingMode mode);

// The mode with that name; INVALID_ARGUMENT naming the accepted ones otherwise.
absl::StatusOr<RoutingMode> ParseRoutingMode(absl::string_view name);

// Routes of T tokens: expert_ids[t * top_k + j], weights[t * top_k + j], with
// j = 0 the largest weight.
struct Routes {
  int64_t top_k = 0;
  std::vector<int32_t> expert_ids;
  std::vector<float> weights;

  int64_t num_tokens() const { return top_k == 0 ? 0 : static_cast<int64_t>(expert_ids.size()) / top_k; }
};

// Softmax over `logits[0..n_experts)`, then top-k. Writes k ids and weights.
// REQUIRES: 1 <= top_k <= n_experts, finite logits.
void TopKSoftmax(const double* logits, int64_t n_experts, int64_t top_k, bool normalize, int32_t* ids, float* weights);

// The general form: the k experts ranked highest by `rank` (ties toward the
// lower id), weighted by softmax(`logits`) of those experts — renormalized
// over the k when `normalize`. TopKSoftmax is SelectTopK(logits, logits, ...).
void SelectTopK(const double* rank, const double* logits, int64_t n_experts, int64_t top_k, bool normalize,
                int32_t* ids, float* weights);

// logits[e] = sum_i gate[e][i] * x[i], accumulated in double in a fixed
// order (eight interleaved partial sums, then the tail). Compiled per ISA:
// where the CPU has FMA the products may be fused into the sums, so the last
// bits of a logit can differ between CPUs (never between runs or processes
// on one machine, so distributed and local answers stay equal).
void GateLogits(const float* gate, int64_t n_experts, int64_t d_model, const float* x, double* logits);

// Gate routing of T rows of x ([T][d_model]).
Routes RouteByGate(const float* gate, int64_t n_experts, int64_t d_model, int64_t top_k, bool normalize, const float* x,
                   int64_t num_tokens);

// How a family's gate scores and picks experts beyond softmax top-k
// (docs/MODEL_FAMILIES.md). The default — softmax over all experts, one
// group, no bias, no scaling — is what RouteByGate computes.
struct RoutingSpec {
  enum class Scoring { kSoftmax, kSigmoid };
  enum class GroupScore { kMax, kTopTwoSum };
  Scoring scoring = Scoring::kSoftmax;
  // Experts form n_group contiguous groups of n_experts / n_group; experts are
  // chosen from the topk_group groups with the best group score only (the
  // others' choice scores are set to 0, as the Hugging Face code does).
  int64_t n_group = 1;
  int64_t topk_group = 1;
  GroupScore group_score = GroupScore::kMax;
  // The gate file's per-expert "bias" section, one of: added to the scores
  // for choosing only (DeepSeek-V3's e_score_correction_bias), or added to
  // the logits before scoring (gpt-oss's router bias). Never both.
  bool correction_bias = false;
  bool logit_bias = false;
  // The k weights (renormalized first when the model says so) times this.
  double scaling = 1.0;
  // Where a routed expert's weight applies: to its output (y += w·FFN(x),
  // every family but one) or to its input (y += FFN(w·x): Llama 4).
  bool weight_at_input = false;

  bool has_bias() const { return correction_bias || logit_bias; }
  bool plain() const {
    return scoring == Scoring::kSoftmax && n_group == 1 && !has_bias() && scaling == 1.0 && !weight_at_input;
  }
};

// One token under `spec`: scores s from `logits` (+ bias when
// spec.logit_bias; softmax over all experts or sigmoid of each), choice
// c = s (+ bias when spec.correction_bias), groups masked, the
// k best by c (ties toward the lower id, groups toward the lower index), in
// descending c — ranked by the (biased) logit instead where that is the same
// order, so saturated scores make no ties; weights s of those, divided by
// their sum (plus 1e-20 for sigmoid scores, as DeepSeek-V3) when `normalize`,
// times spec.scaling — in double, rounded once. (Softmax over all experts
// renormalized over the k equals gpt-oss's softmax over the k logits.)
// `choice_offset` (may be null) is added to c before groups are scored: the
// LUT builder's balancing penalty, which moves choices and never weights;
// with it, masked groups' choices are −∞ rather than 0, so balancing never
// leaves the kept groups.
// REQUIRES: n_experts % n_group == 0, 1 <= topk_group <= n_group, 1 <= top_k
// <= n_experts, bias non-null when spec.has_bias().
void RouteBySpec(const RoutingSpec& spec, const double* logits, const float* bias, int64_t n_experts, int64_t top_k,
                 bool normalize, int32_t* ids, float* weights, const double* choice_offset = nullptr);

// The logits whose scores under `spec` (with the layer's bias) are `scores`:
// log s (softmax; exact up to a constant, which softmax ignores) or
// log(s / (1 − s)) (sigmoid), minus the logit bias. Scores are clamped away
// from 0 and 1 first. The LUT builder routes a token by the mean scores of
// its calibration records through this.
void LogitsOfScores(const RoutingSpec& spec, const double* scores, const float* bias, int64_t n_experts,
                    double* logits);

// Scores under `spec` of `logits` (+ the logit bias): softmax over all or
// sigmoid of each, in double.
void ScoresOfLogits(const RoutingSpec& spec, const double* logits, const float* bias, int64_t n_experts,
                    double* scores);

// Gate routing of T rows of x under `spec`: RouteByGate when spec.plain().
Routes RouteByGateSpec(const RoutingSpec& spec, const float* gate, const float* bias, int64_t n_experts,
                       int64_t d_model, int64_t top_k, bool normalize, const float* x, int64_t num_tokens);

// `routes` with every token's shared experts after its k routed ones: the
// result has top_k = k + n_shared, and token t's entry k + s is expert
// n_experts + s with weight sigmoid(shared_gate[s] · x[t]) (dot product and
// sigmoid in double, rounded once) when `shared_gate` is non-null
// ([n_shared][d_model]), else 1. x is [num_tokens][d_model]. Pure.
Routes AppendSharedExperts(const Routes& routes, int64_t n_experts, int64_t n_shared, const float* shared_gate,
                           int64_t d_model, const float* x);

// LUT routing: rows of lut_ids/lut_weights ([vocab_size][top_k]).
absl::StatusOr<Routes> RouteByLut(const int32_t* lut_ids, const float* lut_weights, int64_t vocab_size, int64_t top_k,
                                  absl::Span<const int32_t> token_ids);

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_ROUTING_H_
