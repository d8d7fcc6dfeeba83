#ifndef COLIBRI_TOOLS_REFERENCE_RUN_H_
#define COLIBRI_TOOLS_REFERENCE_RUN_H_

// Runs the scalar reference MoE layer (kernels/reference_moe.h) on a model
// directory: load the layer's routing tables and the experts the routes use,
// route (lut, gate or given), compute. Used by colibri-reference, the demo and
// the golden-vector tests. Thread-compatible.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/model_dir.h"
#include "common/routing.h"

namespace colibri {
namespace tools {

struct ReferenceResult {
  common::Routes routes;      // the routed experts (what the gate or LUT chose)
  common::Routes all_routes;  // with the layer's shared experts appended (== routes without them)
  std::vector<float> output;  // [T][d_model]
  double load_seconds = 0;    // routing tables + experts mapped (and verified)
  double route_seconds = 0;
  double compute_seconds = 0;
};

// x is [token_ids.size()][d_model]. `mode` is lut or gate. INVALID_ARGUMENT
// for client mode (the reference has no caller's routes), a bad layer or a
// token id outside the vocabulary (lut mode); load errors as ModelDir's.
absl::StatusOr<ReferenceResult> ReferenceForward(const common::ModelDir& model, int64_t layer, common::RoutingMode mode,
                                                 absl::Span<const int32_t> token_ids, const float* x,
                                                 bool verify_checksums);

struct ReferenceRunOptions {
  std::string model_dir;
  int64_t layer = -1;                                       // -1: every layer
  common::RoutingMode routing = common::RoutingMode::kLut;  // lut or gate
  int64_t tokens = 8;                                       // sample tokens when no inputs file
  uint64_t seed = 1;
  std::string inputs_path;  // safetensors: token_ids I32 [T], hidden_states F32 [T, d_model]
  std::string output_path;  // safetensors: output, expert_ids, expert_weights (last layer run)
  bool verify_checksums = true;
  // Also run the optimized expert executor (kernels/expert_executor.h) on
  // the same routes and report its time and its error against the reference.
  bool compare_kernels = true;
};

// Prints what it did and how long each step took.
absl::Status RunReference(const ReferenceRunOptions& options, std::ostream& log);

}  // namespace tools
}  // namespace colibri

#endif  // COLIBRI_TOOLS_REFERENCE_RUN_H_
