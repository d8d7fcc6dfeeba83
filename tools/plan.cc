#include "tools/plan.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/host_port.h"
#include "common/model_dir.h"
#include "common/status_macros.h"

namespace colibri {
namespace tools {
namespace {

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

// The plan's files in out_dir (plan.h).
absl::Status WriteOutputs(const std::string& dir, const std::vector<PlanNode>& nodes, const Placement& p) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  // What an earlier plan wrote there and this one may not: a stale
  // cluster.txt would send a router to the old nodes.
  for (auto it = std::filesystem::directory_iterator(dir, ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec)) {
    const std::string name = it->path().filename();
    if (name != "cluster.txt" && !absl::EndsWith(name, ".experts")) continue;
    if (std::error_code removed; !std::filesystem::remove(it->path(), removed) && removed) {
      return absl::InternalError(absl::StrCat("cannot remove ", it->path().string(), ": ", removed.message()));
    }
  }
  if (ec) return absl::InternalError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
  std::string shards, cluster, values;
  bool all_addresses = true;
  absl::StrAppend(&values,
                  "# Helm values written by colibri-plan: one expert shard (StatefulSet) per planned node.\n"
                  "# The plan's replicas are its own; the release's experts.replicasPerShard (not set\n"
                  "# here) runs that many pods of each shard.\n"
                  "experts:\n  shards: ",
                  nodes.size(), "\n  assignment: explicit\n  shardExperts:\n");
  for (size_t n = 0; n < nodes.size(); ++n) {
    const std::string spec = ShardSpecText(p.owned[n]);
    absl::StrAppend(&shards, nodes[n].name, " ", nodes[n].address.empty() ? "-" : nodes[n].address, " ", spec, "\n");
    absl::StrAppend(&values, "    - \"", spec, "\"\n");
    COLIBRI_RETURN_IF_ERROR(WriteText(absl::StrCat(dir, "/", nodes[n].name, ".experts"), spec + "\n"));
    all_addresses = all_addresses && !nodes[n].address.empty();
    absl::StrAppend(&cluster, nodes[n].address, "\n");
  }
  COLIBRI_RETURN_IF_ERROR(WriteText(dir + "/shards.txt", shards));
  COLIBRI_RETURN_IF_ERROR(WriteText(dir + "/values-plan.yaml", values));
  if (all_addresses) COLIBRI_RETURN_IF_ERROR(WriteText(dir + "/cluster.txt", cluster));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> ParseBytes(absl::string_view text) {
  const std::string t = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  size_t end = 0;
  while (end < t.size() && (absl::ascii_isdigit(t[end]) || t[end] == '.')) ++end;
  double value = 0;
  if (end == 0 || !absl::SimpleAtod(t.substr(0, end), &value)) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not a size (e.g. 64GiB, 512MiB, 1000000)"));
  }
  // "" or "b"; else k, m, g or t, alone or with "b" or "ib": binary units either way.
  const std::string unit(absl::StripAsciiWhitespace(t.substr(end)));
  double scale = 1;
  if (!unit.empty() && unit != "b") {
    const size_t prefix = std::string("kmgt").find(unit[0]);
    const std::string rest = unit.substr(1);
    if (prefix == std::string::npos || !(rest.empty() || rest == "b" || rest == "ib")) {
      return absl::InvalidArgumentError(absl::StrCat("'", text, "': unknown unit (B, KiB, MiB, GiB or TiB)"));
    }
    scale = std::ldexp(1.0, 10 * static_cast<int>(prefix + 1));
  }
  // At most 1 PiB a node (so that the sum over 4096 nodes fits in 64 bits).
  if (!(value * scale <= std::ldexp(1.0, 50))) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is more than 1 PiB"));
  }
  return static_cast<int64_t>(std::llround(value * scale));
}

namespace {

// Addresses the router takes from a cluster file: host:port, each once.
absl::Status CheckAddresses(const std::vector<PlanNode>& nodes) {
  std::set<std::string> seen;
  for (const PlanNode& node : nodes) {
    if (node.address.empty()) continue;
    COLIBRI_RETURN_IF_ERROR(common::CheckHostPort(node.address, "node address"));
    if (!seen.insert(node.address).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("node address '", node.address, "' is given twice: one node serves one shard"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PlanNode>> ParseNodeList(const std::string& nodes, const std::string& memory,
                                                    int64_t nodes_per_host, const std::string& node_file) {
  std::vector<PlanNode> out;
  if (!node_file.empty()) {
    if (!nodes.empty()) return absl::InvalidArgumentError("give the nodes once: a node file or a node list");
    std::ifstream in(node_file);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read the node file ", node_file));
    std::string line;
    for (int number = 1; std::getline(in, line); ++number) {
      line = line.substr(0, line.find('#'));
      std::istringstream fields(line);
      std::string address, size, host, rest;
      if (!(fields >> address)) continue;
      if (!(fields >> size) || (fields >> host && fields >> rest)) {
        return absl::InvalidArgumentError(
            absl::StrCat("node file ", node_file, " line ", number, ": expected 'address memory [host]'"));
      }
      absl::StatusOr<int64_t> bytes = ParseBytes(size);
      if (!bytes.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("node file ", node_file, " line ", number, ": ", bytes.status().message()));
      }
      out.push_back({absl::StrCat("node-", out.size()), address, *bytes, host});
    }
    if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("node file ", node_file, " lists no node"));
    return out;
  }
  if (nodes.empty()) return absl::InvalidArgumentError("no nodes: give a count, addresses or a node file");
  COLIBRI_ASSIGN_OR_RETURN(const int64_t bytes, ParseBytes(memory));
  std::vector<std::string> addresses;
  int64_t count = 0;
  if (!absl::SimpleAtoi(nodes, &count)) {
    for (absl::string_view a : absl::StrSplit(nodes, ',', absl::SkipWhitespace())) {
      addresses.emplace_back(absl::StripAsciiWhitespace(a));
    }
    count = static_cast<int64_t>(addresses.size());
  }
  if (count <= 0 || count > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("'", nodes, "': between 1 and 4096 nodes"));
  }
  for (int64_t n = 0; n < count; ++n) {
    const std::string host = nodes_per_host > 0 ? absl::StrCat("host-", n / nodes_per_host) : "";
    out.push_back({absl::StrCat("node-", n), addresses.empty() ? "" : addresses[n], bytes, host});
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<PlanNode>> ParseNodes(const std::string& nodes, const std::string& memory,
                                                 int64_t nodes_per_host, const std::string& node_file) {
  COLIBRI_ASSIGN_OR_RETURN(std::vector<PlanNode> out, ParseNodeList(nodes, memory, nodes_per_host, node_file));
  COLIBRI_RETURN_IF_ERROR(CheckAddresses(out));
  return out;
}

absl::Status MakePlan(const PlanToolOptions& o, std::ostream& log, Placement* placement) {
  COLIBRI_ASSIGN_OR_RETURN(auto model, common::ModelDir::Open(o.model_dir));
  const common::Manifest& m = model->manifest();
  const int64_t L = m.n_layers, E = m.n_experts, X = m.total_experts();

  ExpertLoad load = o.load;
  const int sources = !o.load.empty() + !o.load_path.empty() + !o.calibration_path.empty();
  if (sources != 1) {
    return absl::InvalidArgumentError(
        "give the experts' load once: a load file (PlanToolOptions::load_path), calibration records "
        "(PlanToolOptions::calibration_path) or a live router's");
  }
  if (!o.load_path.empty()) {
    load.assign(L, std::vector<double>(E, 0.0));
    COLIBRI_RETURN_IF_ERROR(AddLoadFile(o.load_path, m.n_shared_experts, &load));
  } else if (!o.calibration_path.empty()) {
    std::vector<std::unique_ptr<common::LayerRouting>> routing(L);
    for (int64_t layer = 0; layer < L; ++layer) {
      COLIBRI_ASSIGN_OR_RETURN(routing[layer], model->LoadRouting(layer, /*verify_checksum=*/true));
    }
    COLIBRI_ASSIGN_OR_RETURN(CalibrationRoutes routes, RouteCalibration(*model, routing, o.calibration_path));
    load.assign(L, std::vector<double>(E, 0.0));
    AddRoutes(routes, &load);
  }
  if (static_cast<int64_t>(load.size()) != L) {
    return absl::InvalidArgumentError(absl::StrCat("the load has ", load.size(), " layers, the model ", L));
  }

  PlanInput in;
  in.n_layers = L;
  in.n_experts = E;
  in.n_shared_experts = m.n_shared_experts;
  in.load.assign(L, std::vector<double>(X, 0.0));
  in.bytes.assign(L, std::vector<int64_t>(X, 0));
  for (int64_t l = 0; l < L; ++l) {
    if (static_cast<int64_t>(load[l].size()) != E) {
      return absl::InvalidArgumentError(
          absl::StrCat("the load of layer ", l, " has ", load[l].size(), " experts, the model ", E));
    }
    // A shared expert computes every token: the layer's routed slots / top_k.
    const double tokens = std::accumulate(load[l].begin(), load[l].end(), 0.0) / m.top_k;
    for (int64_t e = 0; e < X; ++e) in.load[l][e] = e < E ? load[l][e] : tokens;
  }
  std::map<std::string, int64_t> sizes;
  for (const common::ManifestFile& f : m.files) sizes[f.path] = static_cast<int64_t>(f.size);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t e = 0; e < X; ++e) in.bytes[l][e] = sizes[common::ExpertFilePath(l, e)];
  }

  if (o.max_replicas < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("PlanToolOptions::max_replicas must be >= 0 (0: one per node), not ", o.max_replicas));
  }
  if (!(o.target_ratio >= 1.0 && o.target_ratio < 1e6)) {  // NaN fails too
    return absl::InvalidArgumentError(
        absl::StrCat("PlanToolOptions::target_ratio must be a number >= 1, not ", o.target_ratio));
  }
  PlanOptions po;
  po.nodes = o.nodes;
  po.max_replicas = o.max_replicas;
  po.target_ratio = o.target_ratio;
  COLIBRI_ASSIGN_OR_RETURN(Placement plan, PlanPlacement(in, po));
  const Placement naive = Evaluate(in, ContiguousSplit(in, static_cast<int64_t>(o.nodes.size())));

  // The table.
  const int64_t N = static_cast<int64_t>(o.nodes.size());
  log << absl::StrFormat("%-10s %-22s %8s %12s %12s %10s %10s\n", "node", "address", "experts", "bytes", "memory",
                         "mean share", "max share");
  for (int64_t n = 0; n < N; ++n) {
    const std::vector<double>& s = plan.share[n];
    log << absl::StrFormat("%-10s %-22s %8d %12s %12s %9.1f%% %9.1f%%\n", o.nodes[n].name,
                           o.nodes[n].address.empty() ? "-" : o.nodes[n].address, plan.owned[n].size(),
                           FormatBytes(plan.bytes[n]), FormatBytes(o.nodes[n].memory_bytes),
                           100 * std::accumulate(s.begin(), s.end(), 0.0) / L,
                           100 * *std::max_element(s.begin(), s.end()));
  }
  log << absl::StrFormat("%-6s %10s %16s %16s\n", "layer", "replicas", "plan max/mean", "split max/mean");
  double worst_plan = 0, worst_naive = 0;
  for (int64_t l = 0; l < L; ++l) {
    int copies = 0;
    for (int64_t e = 0; e < X; ++e) copies += plan.replicas[l][e];
    log << absl::StrFormat("%-6d %10d %16.3f %16.3f\n", l, copies - X, plan.max_over_mean[l], naive.max_over_mean[l]);
    worst_plan = std::max(worst_plan, plan.max_over_mean[l]);
    worst_naive = std::max(worst_naive, naive.max_over_mean[l]);
  }
  log << absl::StrFormat("worst layer: busiest node %.3f x the mean with the plan, %.3f with the contiguous split\n",
                         worst_plan, worst_naive);
  for (int64_t n = 0; n < N; ++n) {
    if (plan.owned[n].empty()) {
      // An empty --experts spec would mean every expert: refuse rather than write one.
      return absl::FailedPreconditionError(absl::StrCat(
          o.nodes[n].name, " gets no expert: the model's copies do not reach every node; plan for fewer nodes",
          o.max_replicas > 0 ? " or allow more copies (PlanToolOptions::max_replicas)" : ""));
    }
  }
  if (!o.out_dir.empty()) {
    COLIBRI_RETURN_IF_ERROR(WriteOutputs(o.out_dir, o.nodes, plan));
    log << "wrote " << o.out_dir << "/shards.txt, <node>.experts, values-plan.yaml"
        << (std::all_of(o.nodes.begin(), o.nodes.end(), [](const PlanNode& n) { return !n.address.empty(); })
                ? ", cluster.txt"
                : "")
        << "\n";
  }
  if (placement != nullptr) *placement = std::move(plan);
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace colibri
