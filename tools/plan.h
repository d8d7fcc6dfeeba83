#ifndef COLIBRI_TOOLS_PLAN_H_
#define COLIBRI_TOOLS_PLAN_H_

// colibri-plan: a placement of a model's experts on expert nodes from the
// experts' load (tools/placement.h for the planner, docs/TOOLS.md for the
// tool). Prints a table — per node its experts, bytes and expected share of
// each layer's rows; per layer the plan's busiest node against the mean,
// beside the contiguous split's — and, with an output directory, writes:
//   shards.txt        "name address spec" per node (address "-" if unknown)
//   <name>.experts    the node's --experts spec alone
//   cluster.txt       the nodes' addresses, for colibri-router --cluster_file
//                     (only when every node has one)
//   values-plan.yaml  Helm values: one shard (StatefulSet) per node, with
//                     assignment: explicit and the specs

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tools/expert_load.h"
#include "tools/placement.h"

namespace colibri {
namespace tools {

// "64GiB", "512MiB", "1.5TiB", "24G" (binary units either way) or bytes.
absl::StatusOr<int64_t> ParseBytes(absl::string_view text);

// The nodes: `nodes` is a count ("4": node-0..3) or addresses
// ("10.0.0.5:50061,10.0.0.6:50061"), each with `memory`; nodes_per_host > 0
// puts nodes i and j on one host when i / nodes_per_host == j /
// nodes_per_host (e.g. one node per socket). Or `node_file`: lines
// "address memory [host]" ('#' comments), for nodes that differ.
absl::StatusOr<std::vector<PlanNode>> ParseNodes(const std::string& nodes, const std::string& memory,
                                                 int64_t nodes_per_host, const std::string& node_file);

struct PlanToolOptions {
  std::string model_dir;
  std::vector<PlanNode> nodes;
  // The load, one of: a load file (tools/expert_load.h), calibration
  // records, or already fetched (a live router's GetClusterStatus).
  std::string load_path;
  std::string calibration_path;
  ExpertLoad load;  // [n_layers][n_experts] when fetched; else empty
  int max_replicas = 0;
  double target_ratio = 1.05;
  std::string out_dir;  // empty: print only
};

// Plans, prints, writes. `placement` (may be null) receives the plan.
absl::Status MakePlan(const PlanToolOptions& options, std::ostream& log, Placement* placement = nullptr);

}  // namespace tools
}  // namespace colibri

#endif  // COLIBRI_TOOLS_PLAN_H_
