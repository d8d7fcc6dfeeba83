#ifndef COLIBRI_TOOLS_LUT_BUILDER_H_
#define COLIBRI_TOOLS_LUT_BUILDER_H_

// Builds one layer's routing lookup table (docs/MODEL_FORMAT.md, "How the LUT is built"): for every
// token id, top_k expert ids and weights.
//
// Each token's logits are the gate applied to its embedding row or, for
// tokens that appear in the calibration records, the logits whose scores are
// the mean of the token's records' scores (common::LogitsOfScores: for softmax
// top-k, log of the mean softmax probability), so the LUT routes a token where
// its real hidden states went on average. Routing those logits is the
// family's own (`spec`: common::RouteBySpec — scoring, bias, groups, scaling;
// softmax top-k when plain).
//
// Balancing (balance_loss_weight α > 0): from the unbalanced routes, expert
// i's share of all routes over the vocabulary is freq_i (Σ freq = 1); every
// over-used expert (freq_i > 1/n_experts) has α·(freq_i − 1/n_experts)²
// subtracted from its logit (softmax top-k) or from its choice score (any
// other spec, before groups are scored: as DeepSeek-V3's correction bias
// moves choices), and the routes are taken again. The stored weights are the
// unpenalized ones of the chosen experts, so balancing changes where tokens
// go, not how much an expert's answer counts.
//
// Agreement: the share of inputs whose LUT top-k set equals the exact gate's
// top-k set for that input — the calibration records when given, otherwise
// each token's embedding.
//
// Memory: O((calibration records + calibrated tokens) × n_experts) plus one
// chunk of embedding rows; the embedding is read once, twice with balancing.
// Pure computation; thread-compatible.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/routing.h"

namespace colibri {
namespace tools {

struct LutInputs {
  const float* gate = nullptr;  // [n_experts][d_model]
  int64_t n_experts = 0;
  int64_t d_model = 0;
  int64_t top_k = 0;
  bool normalize = true;
  common::RoutingSpec spec;     // default: softmax top-k
  const float* bias = nullptr;  // [n_experts] when spec.has_bias()
  int64_t vocab_size = 0;
  // Writes rows [first, first + n) of the embedding as f32 into `out`.
  std::function<void(int64_t first, int64_t n, float* out)> embedding_rows;
  absl::Span<const int32_t> calibration_tokens;  // may be empty
  const float* calibration_hidden = nullptr;     // [calibration_tokens.size()][d_model]
  double balance_loss_weight = 0.0;
};

struct LutResult {
  std::vector<int32_t> ids;          // [vocab_size][top_k]
  std::vector<float> weights;        // [vocab_size][top_k]
  std::vector<int64_t> load_before;  // routes per expert over the vocabulary, unbalanced
  std::vector<int64_t> load_after;   // the same for the stored LUT
  int64_t compared = 0;              // inputs compared with exact gate routing
  int64_t agree_before = 0;          // of those, equal top-k sets before balancing
  int64_t agree_after = 0;           // ... and for the stored LUT
  int64_t calibrated_tokens = 0;     // token ids routed from calibration records
};

// INVALID_ARGUMENT for a calibration token id outside [0, vocab_size) (naming
// the record) or a negative/non-finite balance weight.
absl::StatusOr<LutResult> BuildLut(const LutInputs& in);

}  // namespace tools
}  // namespace colibri

#endif  // COLIBRI_TOOLS_LUT_BUILDER_H_
