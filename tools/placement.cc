#include "tools/placement.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace colibri {
namespace tools {
namespace {

using Owned = std::vector<std::vector<std::pair<int64_t, int64_t>>>;

double Sum(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0); }

// One copy of an expert to place in a layer.
struct Copy {
  int64_t expert;
  int copy;     // 0: the first (must be placed)
  double work;  // its expected work: the expert's / copies
};

// The layer's copies, heaviest first (ties: lower expert, lower copy).
std::vector<Copy> Copies(const std::vector<double>& load, const std::vector<int>& replicas) {
  std::vector<Copy> copies;
  for (size_t e = 0; e < load.size(); ++e) {
    for (int c = 0; c < replicas[e]; ++c) copies.push_back({static_cast<int64_t>(e), c, load[e] / replicas[e]});
  }
  std::stable_sort(copies.begin(), copies.end(), [](const Copy& a, const Copy& b) { return a.work > b.work; });
  return copies;
}

std::string Ranges(const std::vector<int64_t>& ids) {
  std::string out;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    absl::StrAppend(&out, out.empty() ? "" : ",", ids[i], j > i ? absl::StrCat("-", ids[j]) : "");
    i = j + 1;
  }
  return out;
}

// Packing (placement.h, step 3) of the copies `replicas` gives; a replica that
// fits nowhere is dropped. RESOURCE_EXHAUSTED when a first copy fits nowhere.
absl::StatusOr<Owned> Pack(const PlanInput& in, const PlanOptions& o, const std::vector<std::vector<int>>& replicas,
                           int64_t memory) {
  const int64_t N = static_cast<int64_t>(o.nodes.size());
  const int64_t L = in.n_layers, X = in.n_experts + in.n_shared_experts;
  Owned owned(N);
  std::vector<int64_t> used(N, 0);
  int64_t placed = 0, later = 0;  // bytes placed; bytes of the layers after this one
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t e = 0; e < X; ++e) later += in.bytes[l][e] * replicas[l][e];
  }
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t e = 0; e < X; ++e) later -= in.bytes[l][e] * replicas[l][e];
    // What each node keeps free for the later layers: its memory's share of them.
    std::vector<double> reserve(N);
    for (int64_t n = 0; n < N; ++n) {
      reserve[n] = static_cast<double>(o.nodes[n].memory_bytes) / memory * static_cast<double>(later);
    }
    std::vector<double> work(N, 0.0);              // each node's in this layer
    std::map<int64_t, std::set<int64_t>> holders;  // expert -> nodes holding it in this layer
    for (const Copy& c : Copies(in.load[l], replicas[l])) {
      const int64_t b = in.bytes[l][c.expert];
      std::set<std::string> hosts;
      for (const int64_t n : holders[c.expert]) {
        hosts.insert(o.nodes[n].host.empty() ? o.nodes[n].name : o.nodes[n].host);
      }
      int64_t best = -1;
      auto key = [&](int64_t n) {
        const std::string& host = o.nodes[n].host.empty() ? o.nodes[n].name : o.nodes[n].host;
        const bool eats_reserve = static_cast<double>(used[n] + b) + reserve[n] > o.nodes[n].memory_bytes;
        return std::make_tuple(eats_reserve, hosts.count(host) > 0, work[n],
                               static_cast<double>(used[n]) / o.nodes[n].memory_bytes, n);
      };
      for (int64_t n = 0; n < N; ++n) {
        if (holders[c.expert].count(n) > 0 || used[n] + b > o.nodes[n].memory_bytes) continue;
        if (best < 0 || key(n) < key(best)) best = n;
      }
      if (best < 0) {
        if (c.copy > 0) continue;  // a replica: drop it
        return absl::ResourceExhaustedError(absl::StrCat(
            "layer ", l, " expert ", c.expert, " (", FormatBytes(b), ") fits on no node: the memory left is in pieces ",
            "smaller than it (", FormatBytes(memory - placed), " free in all); give the nodes more memory"));
      }
      owned[best].emplace_back(l, c.expert);
      holders[c.expert].insert(best);
      used[best] += b;
      work[best] += c.work;
      placed += b;
    }
  }
  return owned;
}

}  // namespace

std::string FormatBytes(int64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  if (bytes < (1 << 20)) return absl::StrFormat("%.1f KiB", bytes / 1024.0);
  if (bytes < (1 << 30)) return absl::StrFormat("%.1f MiB", bytes / double(1 << 20));
  return absl::StrFormat("%.2f GiB", bytes / double(1 << 30));
}

namespace {

// `in` with each expert's load weighted by its size: the work of a copy, what
// a node reads (decode) or computes (prefill) for it, both proportional to
// rows x weight bytes.
PlanInput Weighted(PlanInput in) {
  for (int64_t l = 0; l < in.n_layers; ++l) {
    for (size_t e = 0; e < in.load[l].size(); ++e) in.load[l][e] *= static_cast<double>(in.bytes[l][e]);
  }
  return in;
}

// Evaluate on an already weighted input.
Placement EvaluateWork(const PlanInput& in, Owned owned) {
  Placement p;
  const int64_t N = static_cast<int64_t>(owned.size());
  p.replicas.assign(in.n_layers, std::vector<int>(in.n_experts + in.n_shared_experts, 0));
  for (auto& node : owned) {
    std::sort(node.begin(), node.end());
    for (const auto& [l, e] : node) ++p.replicas[l][e];
  }
  p.bytes.assign(N, 0);
  p.share.assign(N, std::vector<double>(in.n_layers, 0.0));
  p.max_over_mean.assign(in.n_layers, 0.0);
  std::vector<double> total(in.n_layers);
  for (int64_t l = 0; l < in.n_layers; ++l) total[l] = Sum(in.load[l]);
  for (int64_t n = 0; n < N; ++n) {
    for (const auto& [l, e] : owned[n]) {
      p.bytes[n] += in.bytes[l][e];
      if (total[l] > 0) p.share[n][l] += in.load[l][e] / p.replicas[l][e] / total[l];
    }
  }
  for (int64_t l = 0; l < in.n_layers; ++l) {
    for (int64_t n = 0; n < N; ++n) p.max_over_mean[l] = std::max(p.max_over_mean[l], p.share[n][l] * N);
  }
  p.owned = std::move(owned);
  return p;
}

}  // namespace

Placement Evaluate(const PlanInput& in, Owned owned) { return EvaluateWork(Weighted(in), std::move(owned)); }

Owned ContiguousSplit(const PlanInput& in, int64_t n_nodes) {
  Owned owned(n_nodes);
  const int64_t base = in.n_experts / n_nodes, extra = in.n_experts % n_nodes;
  for (int64_t n = 0; n < n_nodes; ++n) {
    const int64_t first = n * base + std::min(n, extra), count = base + (n < extra ? 1 : 0);
    for (int64_t l = 0; l < in.n_layers; ++l) {
      for (int64_t e = first; e < first + count; ++e) owned[n].emplace_back(l, e);
      if (n == 0) {
        for (int64_t s = 0; s < in.n_shared_experts; ++s) owned[n].emplace_back(l, in.n_experts + s);
      }
    }
    std::sort(owned[n].begin(), owned[n].end());
  }
  return owned;
}

absl::StatusOr<Placement> PlanPlacement(const PlanInput& in, const PlanOptions& o) {
  const int64_t N = static_cast<int64_t>(o.nodes.size());
  const int64_t L = in.n_layers, X = in.n_experts + in.n_shared_experts;
  if (N == 0) return absl::InvalidArgumentError("no nodes to place the experts on");
  if (L <= 0 || in.n_experts <= 0 || static_cast<int64_t>(in.load.size()) != L ||
      static_cast<int64_t>(in.bytes.size()) != L) {
    return absl::InvalidArgumentError("PlanInput: load and bytes must have one entry per layer");
  }
  int64_t need = 0, memory = 0;
  for (int64_t l = 0; l < L; ++l) {
    if (static_cast<int64_t>(in.load[l].size()) != X || static_cast<int64_t>(in.bytes[l].size()) != X) {
      return absl::InvalidArgumentError(
          absl::StrCat("PlanInput: layer ", l, " needs load and bytes for ", X, " experts (routed and shared)"));
    }
    for (int64_t e = 0; e < X; ++e) {
      if (!(in.load[l][e] >= 0) || in.bytes[l][e] < 0) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", l, " expert ", e, ": negative load or size"));
      }
      need += in.bytes[l][e];
    }
    if (!(Sum(in.load[l]) > 0)) {
      return absl::InvalidArgumentError(absl::StrCat("no load for layer ", l, ": nothing to balance it by"));
    }
  }
  for (const PlanNode& node : o.nodes) {
    if (node.memory_bytes <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(node.name, ": memory must be positive"));
    }
    memory += node.memory_bytes;
  }
  if (need > memory) {
    return absl::FailedPreconditionError(absl::StrCat(
        "one copy of every expert takes ", FormatBytes(need), "; the ", N, " nodes have ", FormatBytes(memory), ": ",
        FormatBytes(need - memory), " missing (add nodes or memory, or prune the model)"));
  }

  // 2. Replicas, the worst layer first, while the spare memory lasts; each
  // judged by the packing it leads to.
  const PlanInput work = Weighted(in);
  const int max_copies = static_cast<int>(o.max_replicas > 0 ? std::min<int64_t>(o.max_replicas, N) : N);
  std::vector<std::vector<int>> replicas(L, std::vector<int>(X, 1));
  COLIBRI_ASSIGN_OR_RETURN(Owned owned, Pack(work, o, replicas, memory));
  Placement best = EvaluateWork(work, owned);
  std::vector<bool> done(L, false);
  int64_t spare = memory - need;
  while (true) {
    int64_t worst = -1;
    for (int64_t l = 0; l < L; ++l) {
      if (!done[l] && best.max_over_mean[l] > o.target_ratio &&
          (worst < 0 || best.max_over_mean[l] > best.max_over_mean[worst])) {
        worst = l;
      }
    }
    if (worst < 0) break;
    int64_t heaviest = -1;
    for (int64_t e = 0; e < X; ++e) {
      if (replicas[worst][e] >= max_copies || work.bytes[worst][e] > spare) continue;
      const double per_copy = work.load[worst][e] / replicas[worst][e];
      if (heaviest < 0 || per_copy > work.load[worst][heaviest] / replicas[worst][heaviest]) heaviest = e;
    }
    if (heaviest < 0) {
      done[worst] = true;
      continue;
    }
    ++replicas[worst][heaviest];
    absl::StatusOr<Owned> packed = Pack(work, o, replicas, memory);
    Placement candidate = packed.ok() ? EvaluateWork(work, *packed) : Placement{};
    // Kept only if it lowers the layer's busiest node and every copy asked
    // for was placed (a packing that drops one is not taken: the loop only
    // ever adds copies, so it ends).
    if (!packed.ok() || candidate.replicas != replicas || candidate.max_over_mean[worst] >= best.max_over_mean[worst]) {
      --replicas[worst][heaviest];
      done[worst] = true;
      continue;
    }
    spare -= work.bytes[worst][heaviest];
    best = std::move(candidate);
  }
  return best;
}

std::string ShardSpecText(const std::vector<std::pair<int64_t, int64_t>>& owned) {
  std::map<int64_t, std::vector<int64_t>> by_layer;
  for (const auto& [l, e] : owned) by_layer[l].push_back(e);
  for (auto& [l, experts] : by_layer) std::sort(experts.begin(), experts.end());
  std::vector<std::string> clauses;
  for (auto it = by_layer.begin(); it != by_layer.end();) {
    auto end = std::next(it);
    int64_t last = it->first;
    while (end != by_layer.end() && end->first == last + 1 && end->second == it->second) {
      last = end->first;
      ++end;
    }
    clauses.push_back(absl::StrCat("layer:", it->first, last > it->first ? absl::StrCat("-", last) : "",
                                   "/expert:", Ranges(it->second)));
    it = end;
  }
  return absl::StrJoin(clauses, ";");
}

}  // namespace tools
}  // namespace colibri
