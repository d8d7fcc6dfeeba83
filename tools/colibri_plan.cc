// colibri-plan: places a model's experts on expert nodes from their load,
// with replicas of the hot ones; see tools/plan.h and docs/TOOLS.md. Exit
// status: 0 planned, 1 refused or failed (the reason on stderr), 2 usage
// error.

#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "common/model_dir.h"
#include "runtime/flags.h"
#include "tools/plan.h"
#include "tools/rollout.h"

ABSL_FLAG(std::string, model, "", "Model directory. Required.");
ABSL_FLAG(std::string, nodes, "",
          "The expert nodes: a count (4) or their addresses (host:port,...), each with --node_memory.");
ABSL_FLAG(std::string, node_memory, "", "Memory for expert weights on each node of --nodes (e.g. 64GiB).");
ABSL_FLAG(int64_t, nodes_per_host, 0,
          "Nodes i and j of --nodes share a host when i / N == j / N (one node per socket); replicas of an "
          "expert go to different hosts first. 0: every node its own host.");
ABSL_FLAG(std::string, node_file, "", "Instead of --nodes: lines 'address memory [host]' ('#' comments).");
ABSL_FLAG(std::string, load, "",
          "Expert load: a saved /metrics page of the router (colibri_router_expert_tokens_total), or lines "
          "'layer expert count'.");
ABSL_FLAG(std::string, calibration, "",
          "Or: calibration records (colibri-convert's format: hidden_states.L), routed through the model's gate.");
ABSL_FLAG(std::string, router, "", "Or: a live router's admin endpoint (host:port): its GetClusterStatus load.");
ABSL_FLAG(std::string, tls_ca, "", "--router: PEM CA of its certificate: TLS (else plaintext).");
ABSL_FLAG(std::string, tls_cert, "", "--router: PEM client certificate (mutual TLS).");
ABSL_FLAG(std::string, tls_key, "", "--router: PEM key of --tls_cert.");
ABSL_FLAG(std::string, tls_server_name, "",
          "--router: name expected in its certificate (default: the host; e.g. the Service's name through a "
          "port-forward).");
ABSL_FLAG(int, max_replicas, 0, "Most copies of one expert (0: one per node).");
ABSL_FLAG(double, target_ratio, 1.05,
          "Stop adding replicas to a layer once its busiest node's expected rows are at most this x the mean.");
ABSL_FLAG(std::string, out, "", "Directory for shards.txt, <node>.experts, cluster.txt and values-plan.yaml.");

namespace {

const colibri::runtime::OptionFlags kOptionFlags = {
    {"PlanToolOptions::load_path", "--load"},
    {"PlanToolOptions::calibration_path", "--calibration"},
    {"PlanToolOptions::max_replicas", "--max_replicas"},
    {"PlanToolOptions::target_ratio", "--target_ratio"},
};

}  // namespace

int main(int argc, char* argv[]) {
  colibri::runtime::ParseFlags(
      argc, argv,
      "Places a model's experts on expert nodes from their load, replicating the hot ones, so every layer's\n"
      "busiest node is near the mean, within each node's memory (docs/TOOLS.md).\n"
      "  colibri-plan --model DIR (--nodes N|ADDR,... --node_memory SIZE | --node_file F)\n"
      "               (--load FILE | --calibration FILE | --router HOST:PORT) [--out DIR]");
  colibri::tools::PlanToolOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  if (options.model_dir.empty()) {
    std::cerr << "colibri-plan: --model is required (see --help)\n";
    return 2;
  }
  auto nodes = colibri::tools::ParseNodes(absl::GetFlag(FLAGS_nodes), absl::GetFlag(FLAGS_node_memory),
                                          absl::GetFlag(FLAGS_nodes_per_host), absl::GetFlag(FLAGS_node_file));
  if (!nodes.ok()) {
    std::cerr << "colibri-plan: " << nodes.status().message() << "\n";
    return 2;
  }
  options.nodes = *std::move(nodes);
  options.load_path = absl::GetFlag(FLAGS_load);
  options.calibration_path = absl::GetFlag(FLAGS_calibration);
  if (const std::string router = absl::GetFlag(FLAGS_router); !router.empty()) {
    auto model = colibri::common::ModelDir::Open(options.model_dir);
    if (!model.ok()) {
      std::cerr << "colibri-plan: " << model.status().message() << "\n";
      return 1;
    }
    colibri::tools::RolloutOptions call;
    call.router = router;
    call.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
    call.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
    call.tls_key_file = absl::GetFlag(FLAGS_tls_key);
    call.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
    call.timeout = absl::Seconds(30);
    const colibri::common::Manifest& m = (*model)->manifest();
    auto load = colibri::tools::FetchExpertLoad(call, m.n_layers, m.n_experts, m.n_shared_experts);
    if (!load.ok()) {
      std::cerr << "colibri-plan: " << load.status().message() << "\n";
      return 1;
    }
    options.load = *std::move(load);
  }
  options.max_replicas = absl::GetFlag(FLAGS_max_replicas);
  options.target_ratio = absl::GetFlag(FLAGS_target_ratio);
  options.out_dir = absl::GetFlag(FLAGS_out);
  const absl::Status s = colibri::tools::MakePlan(options, std::cout);
  if (!s.ok()) {
    std::cerr << "colibri-plan: " << colibri::runtime::NameFlags(s, kOptionFlags).message() << "\n";
    return 1;
  }
  return 0;
}
