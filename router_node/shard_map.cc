#include "router_node/shard_map.h"

#include <map>

#include "absl/strings/str_cat.h"

namespace colibri {
namespace router_node {

ShardMap::ShardMap(int64_t n_layers, int64_t n_experts, std::vector<NodeState> nodes)
    : n_experts_(n_experts), nodes_(std::move(nodes)), replicas_(n_layers * n_experts) {
  for (size_t n = 0; n < nodes_.size(); ++n) {
    if (!nodes_[n].live) continue;
    for (const auto& [layer, expert] : nodes_[n].owned) {
      if (layer < 0 || layer >= n_layers || expert < 0 || expert >= n_experts) continue;
      std::vector<int>& r = replicas_[layer * n_experts + expert];
      if (r.empty() || r.back() != static_cast<int>(n)) r.push_back(static_cast<int>(n));
    }
  }
}

std::optional<std::pair<int64_t, int64_t>> ShardMap::FirstUncovered() const {
  for (size_t i = 0; i < replicas_.size(); ++i) {
    if (replicas_[i].empty())
      return std::make_pair(static_cast<int64_t>(i) / n_experts_, static_cast<int64_t>(i) % n_experts_);
  }
  return std::nullopt;
}

absl::StatusOr<std::vector<NodeCall>> PlanNodeCalls(const ShardMap& map, int32_t layer,
                                                    const std::vector<ExpertWork>& experts,
                                                    const std::vector<int>& works, absl::Span<const int> load,
                                                    const std::set<int>& excluded) {
  std::map<int, NodeCall> calls;
  for (const int w : works) {
    const int32_t expert = experts[w].expert;
    int best = -1;
    for (const int n : map.replicas(layer, expert)) {
      if (excluded.count(n) > 0) continue;
      if (best < 0 || load[n] < load[best] || (load[n] == load[best] && calls.count(n) > 0 && calls.count(best) == 0)) {
        best = n;
      }
    }
    if (best < 0) {
      std::string why;
      for (const NodeState& node : map.nodes()) {
        for (const auto& [l, e] : node.owned) {
          if (l != layer || e != expert) continue;
          const int n = static_cast<int>(&node - map.nodes().data());
          // Nodes by index: addresses and their errors (which name addresses) are for admins
          // (GetClusterStatus on the admin listener) and the router's log.
          absl::StrAppend(&why, why.empty() ? " (" : "; ", "node-", n, ": ",
                          excluded.count(n) > 0 ? "failed this request" : "down");
        }
      }
      if (why.empty()) {
        // No node that ever answered owns it: say which nodes could not be asked.
        for (const NodeState& node : map.nodes()) {
          if (!node.live && node.owned.empty()) {
            const int n = static_cast<int>(&node - map.nodes().data());
            absl::StrAppend(&why, why.empty() ? " (not reachable: " : ", ", "node-", n);
          }
        }
        why = why.empty() ? " (no configured node owns it)" : why + ")";
      } else {
        why += ")";
      }
      return absl::UnavailableError(
          absl::StrCat("layer ", layer, " expert ", expert, ": no live expert node serves it", why));
    }
    NodeCall& call = calls[best];
    call.node = best;
    call.works.push_back(w);
  }
  std::vector<NodeCall> out;
  for (auto& [node, call] : calls) out.push_back(std::move(call));
  return out;
}

}  // namespace router_node
}  // namespace colibri
