#ifndef COLIBRI_TOOLS_PRUNE_H_
#define COLIBRI_TOOLS_PRUNE_H_

// colibri-prune: a smaller model directory with only the experts that carry
// the load (docs/TOOLS.md, "colibri-prune", for the exact semantics).
//
// Load per (layer, expert) comes from the router's metrics (a saved /metrics
// page: colibri_router_expert_tokens_total{layer,expert}, or plain lines
// "layer expert count") or from calibration records routed through the
// model's own gate. Each layer keeps the same number N of routed experts (the
// format has one n_experts): the N most loaded (ties to the lower id), N from
// keep_top or, with min_share, the largest number of experts of any layer
// whose share of that layer's routed slots is at least min_share. Kept
// experts are renumbered 0..N-1 in their original order; shared experts
// follow unchanged. The gate keeps the kept experts' rows (and bias
// entries), so gate routing is the original family's routing restricted to
// the kept experts. Each LUT row keeps its kept entries in order, scaled to
// the row's original sum when the model renormalizes (else as stored), and
// is filled to top_k with the layer's most loaded kept experts not in it,
// at weight 0 (a row with no kept entry, in a renormalizing model: the fills
// share the row's sum equally).
//
// Refused (INVALID_ARGUMENT, naming the reason): routing with expert groups
// (DeepSeek's n_group > 1: the groups would no longer be whole), N < top_k or
// N > n_experts, no load for a layer, a malformed load or calibration file.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace colibri {
namespace tools {

struct PruneOptions {
  std::string model_dir;
  std::string out_dir;
  bool overwrite = false;
  std::string load_path;         // router metrics page or "layer expert count" lines
  std::string calibration_path;  // token_ids + hidden_states.L (colibri-convert's format)
  int64_t keep_top = 0;          // > 0: keep this many routed experts per layer
  double min_share = 0;          // > 0 (keep_top 0): see above
};

struct PruneLayerReport {
  int64_t layer = 0;
  std::vector<int64_t> kept;     // original ids, ascending
  std::vector<double> share;     // per original expert: share of the layer's routed slots
  double dropped_share = 0;      // load share of the dropped experts
  int64_t lut_rows_changed = 0;  // LUT rows (tokens) with at least one dropped expert
  int64_t records = 0;           // calibration records routed through the gate (0: none)
  int64_t records_changed = 0;   // ... whose top-k set differs after pruning
};

struct PruneReport {
  int64_t n_experts_before = 0;
  int64_t n_experts_after = 0;
  std::vector<PruneLayerReport> layers;
};

// Writes the pruned model to out_dir (FAILED_PRECONDITION if it holds a
// model and !overwrite) and prints the report to `log`.
absl::Status PruneModel(const PruneOptions& options, std::ostream& log, PruneReport* report = nullptr);

}  // namespace tools
}  // namespace colibri

#endif  // COLIBRI_TOOLS_PRUNE_H_
