#ifndef COLIBRI_TOOLS_PLACEMENT_H_
#define COLIBRI_TOOLS_PLACEMENT_H_

// colibri-plan's planner: which experts each expert node owns, with extra
// replicas of the hot ones, so that in every layer the busiest node's
// expected work is close to the mean, within every node's memory
// (docs/TOOLS.md, "colibri-plan"). Pure logic: no I/O.
//
// The model: a layer call waits for its slowest node, and a node's work in
// a layer is what it reads (decode) or computes (prefill) for its experts:
// both grow with the rows times the expert's size. An expert's work is its
// load (expected rows: routed token slots; a shared expert gets every token)
// times its weight bytes, split evenly among its copies (the router spreads
// a replicated expert's work over them: docs/ROUTER.md, "Replicas"). The
// plan minimizes, layer by layer, the largest node's share of the layer's
// work:
//   1. one copy of every (layer, expert) must fit: else FAILED_PRECONDITION
//      saying how many bytes are missing;
//   2. copies: while a layer's busiest node is above target_ratio x the
//      mean, the layer's heaviest expert per copy (with fewer copies than
//      nodes and max_replicas) gets one more, if the spare memory (all
//      nodes' memory minus one copy of everything) holds it and the packing
//      (3) then lowers that layer's busiest node — the worst layer first, so
//      layers share the spare memory;
//   3. packing, layer by layer: copies by expected work, heaviest first
//      (ties: lower expert id), each to the node that does not hold that
//      expert yet with the least work in the layer among those that keep
//      their memory's share of the later layers' copies free — then any node
//      with room; a node on another host than the expert's other copies
//      first, when hosts are given. A first copy that fits nowhere fails the
//      plan (RESOURCE_EXHAUSTED naming it); a replica that fits nowhere is
//      dropped.
// Deterministic: the same inputs give the same plan.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace colibri {
namespace tools {

struct PlanNode {
  std::string name;          // e.g. "node-0"; names the node in the table
  std::string address;       // host:port, for the cluster file (may be empty)
  int64_t memory_bytes = 0;  // for expert weights
  std::string host;          // replicas of an expert go to different hosts first; empty: one per node
};

struct PlanInput {
  int64_t n_layers = 0;
  int64_t n_experts = 0;  // routed; shared experts are ids n_experts..
  int64_t n_shared_experts = 0;
  // [layer][expert id, shared included]: expected rows per unit of time
  // (routed token slots; for a shared expert, the layer's tokens); weighted
  // by `bytes` into work.
  std::vector<std::vector<double>> load;
  std::vector<std::vector<int64_t>> bytes;  // [layer][expert id]: its weight file's size
};

struct PlanOptions {
  std::vector<PlanNode> nodes;
  int max_replicas = 0;        // copies of one expert at most; 0: one per node
  double target_ratio = 1.05;  // stop adding replicas to a layer once its max/mean is at most this
};

struct Placement {
  std::vector<std::vector<std::pair<int64_t, int64_t>>> owned;  // [node] (layer, expert), sorted
  std::vector<int64_t> bytes;                                   // [node] weight bytes
  std::vector<std::vector<int>> replicas;                       // [layer][expert]: copies
  std::vector<std::vector<double>> share;  // [node][layer]: share of the layer's work (copies split evenly)
  std::vector<double> max_over_mean;       // [layer]: busiest node's work / the mean over nodes
};

// INVALID_ARGUMENT for inconsistent input (sizes, no nodes, a negative load
// or memory, a layer with no load).
absl::StatusOr<Placement> PlanPlacement(const PlanInput& input, const PlanOptions& options);

// The shares and max/mean of a given assignment (`owned` per node), e.g. a
// contiguous split, under the same model. REQUIRES: every pair in range.
Placement Evaluate(const PlanInput& input, std::vector<std::vector<std::pair<int64_t, int64_t>>> owned);

// The contiguous split the Helm chart's "even" assignment makes: node i owns
// routed experts [i·E/N, (i+1)·E/N) of every layer (remainder to the first
// nodes), and the shared experts go with node 0.
std::vector<std::vector<std::pair<int64_t, int64_t>>> ContiguousSplit(const PlanInput& input, int64_t n_nodes);

// "512 B", "3.0 KiB", "1.50 GiB": bytes for people.
std::string FormatBytes(int64_t bytes);

// `owned` (one node's pairs, sorted) as a --experts shard spec
// (expert_node/shard_spec.h): runs of layers with the same experts as one
// clause, "layer:0-3/expert:0-2,5;layer:4/expert:1". Empty for no pair —
// which, given to a node, means every expert: never write it as a spec.
std::string ShardSpecText(const std::vector<std::pair<int64_t, int64_t>>& owned);

}  // namespace tools
}  // namespace colibri

#endif  // COLIBRI_TOOLS_PLACEMENT_H_
