#include "router_node/shard_map.h"

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace colibri {
namespace router_node {

ShardMap::ShardMap(int64_t n_layers, int64_t n_experts, std::vector<NodeState> nodes)
    : n_experts_(n_experts),
      nodes_(std::move(nodes)),
      replicas_(n_layers * n_experts),
      fallbacks_(n_layers * n_experts) {
  for (size_t n = 0; n < nodes_.size(); ++n) {
    if (!nodes_[n].live && !nodes_[n].suspect) continue;
    std::vector<std::vector<int>>& lists = nodes_[n].live ? replicas_ : fallbacks_;
    for (const auto& [layer, expert] : nodes_[n].owned) {
      if (layer < 0 || layer >= n_layers || expert < 0 || expert >= n_experts) continue;
      std::vector<int>& r = lists[layer * n_experts + expert];
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

std::optional<RowSplit> ParseRowSplit(absl::string_view name) {
  if (name == "never") return RowSplit::kNever;
  if (name == "exact") return RowSplit::kExact;
  if (name == "always") return RowSplit::kAlways;
  return std::nullopt;
}

namespace {

// Every work of `experts` in order, work w cut into count[w] consecutive
// runs of its rows, as even as possible; each part keeps the whole's kernel
// row count, so a node runs the kernel it would for the whole.
void CutWorks(const std::vector<ExpertWork>& experts, const std::vector<int64_t>& count,
              std::vector<ExpertWork>* parts) {
  parts->clear();
  for (size_t w = 0; w < experts.size(); ++w) {
    const ExpertWork& src = experts[w];
    const int64_t rows = static_cast<int64_t>(src.rows.size());
    if (count[w] == 1) {
      parts->push_back(src);
      continue;
    }
    for (int64_t p = 0; p < count[w]; ++p) {
      const int64_t begin = rows * p / count[w], end = rows * (p + 1) / count[w];
      ExpertWork part;
      part.expert = src.expert;
      part.kernel_rows = src.kernel_rows > 0 ? src.kernel_rows : rows;
      part.rows.assign(src.rows.begin() + begin, src.rows.begin() + end);
      part.weights.assign(src.weights.begin() + begin, src.weights.begin() + end);
      part.slots.assign(src.slots.begin() + begin, src.slots.begin() + end);
      parts->push_back(std::move(part));
    }
  }
}

}  // namespace

bool SplitAmongReplicas(const ShardMap& map, int32_t layer, const std::vector<ExpertWork>& experts,
                        const RowSplitOptions& options, std::vector<ExpertWork>* parts) {
  if (options.mode == RowSplit::kNever) return false;
  // Per work, how many parts (1: whole).
  std::vector<int64_t> count(experts.size(), 1);
  bool any = false;
  for (size_t w = 0; w < experts.size(); ++w) {
    const int64_t rows = static_cast<int64_t>(experts[w].rows.size());
    if (rows < std::max<int64_t>(options.min_rows, 2)) continue;
    // The count that picks the kernel: a part keeps it, so the whole and its parts run the same one.
    const int64_t kernel_rows = experts[w].kernel_rows > 0 ? experts[w].kernel_rows : rows;
    const std::vector<int>& replicas = map.replicas(layer, experts[w].expert);
    if (replicas.size() < 2) continue;
    bool exact = true;
    for (const int n : replicas) exact = exact && BelowRowSplitLimit(map.nodes()[n], kernel_rows);
    if (options.mode == RowSplit::kExact && !exact) continue;
    count[w] = std::min<int64_t>(static_cast<int64_t>(replicas.size()), rows);
    any = true;
  }
  if (!any) return false;
  CutWorks(experts, count, parts);
  return true;
}

bool SplitOverNodeLimits(const ShardMap& map, int32_t layer, const std::vector<ExpertWork>& experts,
                         std::vector<ExpertWork>* parts) {
  std::vector<int64_t> count(experts.size(), 1);
  bool any = false;
  for (size_t w = 0; w < experts.size(); ++w) {
    const int64_t rows = static_cast<int64_t>(experts[w].rows.size());
    // The smallest limit of a node the work may go to (a node that reports none has none).
    int64_t limit = std::numeric_limits<int64_t>::max();
    for (const std::vector<int>* nodes :
         {&map.replicas(layer, experts[w].expert), &map.fallbacks(layer, experts[w].expert)}) {
      for (const int n : *nodes) {
        for (const int64_t l : {map.nodes()[n].max_rows, map.nodes()[n].max_row_indices}) {
          if (l > 0) limit = std::min(limit, l);
        }
      }
    }
    // Runs of half a limit: a run and the node's next call fit its budget (RemoteBackend's NewCalls).
    const int64_t run = std::max<int64_t>(limit / 2, 1);
    if (rows <= run) continue;
    count[w] = (rows + run - 1) / run;
    any = true;
  }
  if (!any) return false;
  CutWorks(experts, count, parts);
  return true;
}

absl::StatusOr<std::vector<NodeCall>> PlanNodeCalls(const ShardMap& map, int32_t layer,
                                                    const std::vector<ExpertWork>& experts,
                                                    const std::vector<int>& works, absl::Span<const int> load,
                                                    const std::set<int>& excluded, const std::set<int>& avoided,
                                                    uint32_t rotation, bool use_fallbacks) {
  std::map<int, NodeCall> calls;
  std::set<std::pair<int32_t, int>> given;  // (expert, node): a part of the expert is planned there
  for (const int w : works) {
    const int32_t expert = experts[w].expert;
    // The best candidate of `nodes` not excluded, or -1.
    auto choose = [&](const std::vector<int>& nodes) {
      const size_t R = nodes.size();
      // The rank of the candidate at position i: lower is better.
      auto rank = [&](size_t i) {
        const int n = nodes[i];
        return std::make_tuple(avoided.count(n), given.count({expert, n}), load[n], calls.count(n) == 0,
                               (i + R - rotation % R) % R);
      };
      int best = -1;
      size_t best_at = 0;
      for (size_t i = 0; i < R; ++i) {
        if (excluded.count(nodes[i]) > 0) continue;
        if (best < 0 || rank(i) < rank(best_at)) {
          best = nodes[i];
          best_at = i;
        }
      }
      return best;
    };
    int best = choose(map.replicas(layer, expert));
    if (best < 0 && use_fallbacks) best = choose(map.fallbacks(layer, expert));
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
    given.insert({expert, best});
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
