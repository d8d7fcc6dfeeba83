#ifndef COLIBRI_TOOLS_EXPERT_LOAD_H_
#define COLIBRI_TOOLS_EXPERT_LOAD_H_

// How much work each routed expert of a model gets, for the tools that act
// on it (colibri-prune keeps the loaded experts, colibri-plan places them):
// token slots routed to (layer, expert), from
//   - a load file: a saved router /metrics page
//     (colibri_router_expert_tokens_total{layer,expert} v) or lines
//     "layer expert count" ('#' starts a comment);
//   - calibration records (colibri-convert's format: hidden_states.L
//     [records, d_model] F32/BF16/F16) routed through the model's own gate;
//   - a live router's GetClusterStatus (tools/rollout.h, FetchExpertLoad).

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_dir.h"
#include "common/routing.h"

namespace colibri {
namespace tools {

using ExpertLoad = std::vector<std::vector<double>>;  // [layer][routed expert]: token slots

// Adds the file's counts to `load` (sized [n_layers][n_experts]). The file
// is 'layer expert count' lines or a router's Prometheus page, whose
// colibri_router_expert_tokens_total samples are read (one of the
// `shared_experts`, ids n_experts and up, is skipped) and every other sample
// skipped. NOT_FOUND if unreadable; INVALID_ARGUMENT naming the line for a
// malformed line or a layer/expert outside the model, for a file with no
// count, and for a page without a sample of every (layer, routed expert): a
// router exports them all, so one missing is a page cut short.
absl::Status AddLoadFile(const std::string& path, int64_t shared_experts, ExpertLoad* load);

// Calibration records routed through each layer's gate: the records' hidden
// states (f32) and their routes, per layer (empty for a layer the file has
// no hidden_states for). INVALID_ARGUMENT for a tensor of the wrong shape
// or type, or with a value that is not finite.
struct CalibrationRoutes {
  std::vector<std::vector<float>> hidden;  // [layer][records * d_model]
  std::vector<common::Routes> routes;      // [layer]
};
absl::StatusOr<CalibrationRoutes> RouteCalibration(const common::ModelDir& model,
                                                   const std::vector<std::unique_ptr<common::LayerRouting>>& routing,
                                                   const std::string& path);

// Adds one slot per routed (record, expert) of `routes` to `load`.
void AddRoutes(const CalibrationRoutes& routes, ExpertLoad* load);

}  // namespace tools
}  // namespace colibri

#endif  // COLIBRI_TOOLS_EXPERT_LOAD_H_
