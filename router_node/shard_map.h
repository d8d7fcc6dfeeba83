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
#include "absl/strings/string_view.h"
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
  // GetNodeInfo's row_split_limit: below it, a row's result does not depend
  // on the expert's row count in the call; -1: never depends on it; 0: unknown.
  int64_t row_split_limit = 0;
  bool reads_kernel_rows = false;  // GetNodeInfo's: rows of several callers may share an entry
  // Not live only because a call failed on it since its last health probe
  // (a probe may yet find it live: a call that outlived the node timeout on
  // a node that was only slow). Such a node is a fallback (ShardMap::fallbacks).
  bool suspect = false;
  // GetNodeInfo's size limits of one Compute call: rows sent and returned,
  // and row indices; 0: not reported (no limit known).
  int64_t max_rows = 0;
  int64_t max_row_indices = 0;
};

// Whether an expert's `rows` rows on `node` are below its row_split_limit:
// each row then gets the same bits whatever rows are beside it (an unknown
// limit: no).
inline bool BelowRowSplitLimit(const NodeState& node, int64_t rows) {
  return node.row_split_limit < 0 || rows < node.row_split_limit;
}

class ShardMap {
 public:
  // Owned pairs outside [0, n_layers) x [0, n_experts) are ignored.
  ShardMap(int64_t n_layers, int64_t n_experts, std::vector<NodeState> nodes);

  // Indices (into nodes()) of the live nodes serving (layer, expert), ascending.
  // REQUIRES: layer and expert in range.
  const std::vector<int>& replicas(int64_t layer, int64_t expert) const {
    return replicas_[layer * n_experts_ + expert];
  }
  // Indices of the suspect nodes (NodeState::suspect) that served (layer,
  // expert) at their last probe, ascending: planned on only where no live
  // replica is left, rather than failing the request until the next health
  // round. REQUIRES: layer and expert in range.
  const std::vector<int>& fallbacks(int64_t layer, int64_t expert) const {
    return fallbacks_[layer * n_experts_ + expert];
  }
  const std::vector<NodeState>& nodes() const { return nodes_; }
  // The first (layer, expert) no live node serves, if any.
  std::optional<std::pair<int64_t, int64_t>> FirstUncovered() const;

 private:
  int64_t n_experts_;
  std::vector<NodeState> nodes_;
  std::vector<std::vector<int>> replicas_;   // [layer * n_experts + expert]
  std::vector<std::vector<int>> fallbacks_;  // [layer * n_experts + expert]
};

// When an expert's rows in one layer call are split among its replicas
// (RowSplitOptions::mode): never; only where no row's bits change (below
// every replica's row_split_limit, none of them unknown); or whenever it has
// the rows.
enum class RowSplit { kNever, kExact, kAlways };

// "never", "exact", "always"; nullopt for anything else.
std::optional<RowSplit> ParseRowSplit(absl::string_view name);

struct RowSplitOptions {
  RowSplit mode = RowSplit::kExact;
  // Fewest rows of one expert worth splitting: below it a node's time for
  // the expert is mostly the read of its weights, which each replica would
  // pay again (docs/ROUTER.md, "Replicas").
  int64_t min_rows = 16;
};

// Splits the works of experts that have at least options.min_rows rows and
// two or more live replicas into one part per replica (at most one per row):
// consecutive runs of their rows, as even as possible, each an ExpertWork of
// the same expert. Returns false (and leaves `parts` alone) when nothing is
// split; else `parts` holds every work, split or not, ascending by expert.
bool SplitAmongReplicas(const ShardMap& map, int32_t layer, const std::vector<ExpertWork>& experts,
                        const RowSplitOptions& options, std::vector<ExpertWork>* parts);

// Splits the works with more rows than half of what some node serving their
// expert (a replica or a fallback) takes in one call (NodeState::max_rows
// and max_row_indices) into consecutive runs of their rows, each within that
// half, keeping the whole work's kernel_rows (so each node chooses the kernel
// it would for the whole). Half: remote_dispatch.cc sends a node a call over
// its limits as pieces, one after another, each within half of them, since
// two such fit the node's budget for calls in flight. Runs that meet on one
// node in a call within its limits are one entry again, as the whole was.
// Returns false (and leaves `parts` alone) when nothing is split; else
// `parts` holds every work, split or not, in order. A work split so may get
// other last bits than whole where the node's kernel for its row count is
// not row by row (docs/ROUTER.md, "Node size limits").
bool SplitOverNodeLimits(const ShardMap& map, int32_t layer, const std::vector<ExpertWork>& experts,
                         std::vector<ExpertWork>* parts);

// One node's share of a layer call.
struct NodeCall {
  int node = 0;            // index into ShardMap::nodes()
  std::vector<int> works;  // indices into LayerWork::experts, ascending
};

// Assigns each work in `works` (indices into `experts`) to a live replica of
// its expert that is not in `excluded`: one not in `avoided` (nodes that
// answered but not as the map expected, used only where nothing else serves
// the expert), then one not yet given another part of the same expert by
// this plan, then the least loaded (`load[node]`: calls in flight), then one
// this plan already calls (fewer calls), then the first of the expert's
// replicas in their order rotated by `rotation` (the lowest index for 0), so
// that calls with equal loads and successive rotations take the replicas in
// turn. Where every live replica is excluded (or none is left), the same
// choice among the expert's fallbacks (ShardMap::fallbacks) not excluded,
// with `use_fallbacks` (a hedge does without: it goes to live replicas only).
// Returns one NodeCall per
// node used, ascending by node. UNAVAILABLE naming the layer and the expert —
// and why its nodes are out — when an expert has no replica left.
// REQUIRES: load.size() == nodes().size().
absl::StatusOr<std::vector<NodeCall>> PlanNodeCalls(const ShardMap& map, int32_t layer,
                                                    const std::vector<ExpertWork>& experts,
                                                    const std::vector<int>& works, absl::Span<const int> load,
                                                    const std::set<int>& excluded, const std::set<int>& avoided = {},
                                                    uint32_t rotation = 0, bool use_fallbacks = true);

}  // namespace router_node
}  // namespace colibri

#endif  // COLIBRI_ROUTER_NODE_SHARD_MAP_H_
