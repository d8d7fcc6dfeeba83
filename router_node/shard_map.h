#ifndef COLIBRI_ROUTER_NODE_SHARD_MAP_H_
#define COLIBRI_ROUTER_NODE_SHARD_MAP_H_

// Which live expert node serves which (layer, expert), and the plan of one
// layer call: every expert's work assigned to one replica, experts grouped by
// node — the batch union, one call per node. Pure logic: no I/O, no threads.
// Immutable after construction, so shared freely between threads.

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "router_node/expert_backend.h"

namespace colibri {
namespace router_node {

// What the router knows of one node when the map is built.
struct NodeState {
  std::string address;
  bool live = false;
  std::string last_error;                          // why not live
  std::vector<std::pair<int64_t, int64_t>> owned;  // (layer, expert), as the node reported
};

class ShardMap {
 public:
  // Owned pairs outside [0, n_layers) x [0, n_experts) are ignored.
  ShardMap(int64_t n_layers, int64_t n_experts, std::vector<NodeState> nodes);

  // Indices (into nodes()) of the live nodes serving (layer, expert), ascending.
  // REQUIRES: layer and expert in range.
  const std::vector<int>& replicas(int64_t layer, int64_t expert) const {
    return replicas_[layer * n_experts_ + expert];
  }
  const std::vector<NodeState>& nodes() const { return nodes_; }
  // The first (layer, expert) no live node serves, if any.
  std::optional<std::pair<int64_t, int64_t>> FirstUncovered() const;

 private:
  int64_t n_experts_;
  std::vector<NodeState> nodes_;
  std::vector<std::vector<int>> replicas_;  // [layer * n_experts + expert]
};

// One node's share of a layer call.
struct NodeCall {
  int node = 0;            // index into ShardMap::nodes()
  std::vector<int> works;  // indices into LayerWork::experts, ascending
};

// Assigns each work in `works` (indices into `experts`) to a live replica of
// its expert that is not in `excluded`: the least loaded (`load[node]`: calls
// in flight), then one this plan already calls (fewer calls), then the
// lowest index. Returns one NodeCall per node used, ascending by node.
// UNAVAILABLE naming the layer and the expert — and why its nodes are out —
// when an expert has no replica left. REQUIRES: load.size() == nodes().size().
absl::StatusOr<std::vector<NodeCall>> PlanNodeCalls(const ShardMap& map, int32_t layer,
                                                    const std::vector<ExpertWork>& experts,
                                                    const std::vector<int>& works, absl::Span<const int> load,
                                                    const std::set<int>& excluded);

}  // namespace router_node
}  // namespace colibri

#endif  // COLIBRI_ROUTER_NODE_SHARD_MAP_H_
