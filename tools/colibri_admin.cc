// colibri-admin: operator commands against running routers and expert nodes
// (their admin endpoints). Rolls out a new version of the model with no
// failed request; see tools/rollout.h. Exit status: 0 done, 1 failed (rolled
// back where the steps say so), 2 usage error.

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_split.h"
#include "runtime/flags.h"
#include "tools/rollout.h"

ABSL_FLAG(std::string, model, "", "upgrade, stage, switch: the new version's model directory (as the servers see it).");
ABSL_FLAG(std::vector<std::string>, nodes, {},
          "upgrade, stage, drop: the expert nodes' admin endpoints, host:port,...");
ABSL_FLAG(std::string, router, "", "upgrade, switch: the router's admin endpoint, host:port.");
ABSL_FLAG(std::string, model_id, "", "drop: the model to release on the nodes.");
ABSL_FLAG(std::string, plan, "",
          "apply-plan: colibri-plan's output directory (its shards.txt: one shard per node, in --nodes order).");
ABSL_FLAG(int, settle_ms, 3000,
          "apply-plan without --router: how long the routers take to see a change (a few health intervals).");
ABSL_FLAG(int, timeout_s, 120, "Per step: how long a node may take to load, and the router to see the new version.");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA of the endpoints' certificates: TLS (else plaintext).");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (mutual TLS; an --admin_identities name).");
ABSL_FLAG(std::string, tls_key, "", "PEM key of --tls_cert.");
ABSL_FLAG(std::string, tls_server_name, "", "Name expected in the endpoints' certificates (default: the host).");

namespace {

constexpr char kUsage[] =
    "Operator commands for a Colibri cluster (admin endpoints: --admin_listen of nodes and routers).\n"
    "\n"
    "  colibri-admin upgrade --model DIR --nodes A,B,... --router R   stage, switch, drop (below), rolling back\n"
    "                                                                  on failure; zero failed requests\n"
    "  colibri-admin stage  --model DIR --nodes A,B,...   nodes load DIR beside the model in use and serve both\n"
    "  colibri-admin switch --model DIR --router R        the router serves DIR's model once every expert is live\n"
    "  colibri-admin drop   --model_id ID --nodes A,...   nodes release a model (the old one after a switch, or\n"
    "                                                     the new one to roll back a stage)\n"
    "  colibri-admin apply-plan --plan DIR --nodes A,B,... [--router R]\n"
    "                                       nodes take colibri-plan's shards: all grow to old + new, then shrink\n"
    "                                       to new, one at a time (waiting for R to see each step); zero failed\n"
    "                                       requests";

// The options named in the tools' errors, and the flags that set them.
const colibri::runtime::OptionFlags kOptionFlags = {
    {"RolloutOptions::tls_ca_file", "--tls_ca"},   {"RolloutOptions::tls_cert_file", "--tls_cert"},
    {"RolloutOptions::tls_key_file", "--tls_key"}, {"RolloutOptions::tls_server_name", "--tls_server_name"},
    {"RolloutOptions::nodes", "--nodes"},          {"RolloutOptions::router", "--router"},
};

}  // namespace

int main(int argc, char* argv[]) {
  const std::vector<char*> args = colibri::runtime::ParseFlags(argc, argv, kUsage);
  if (args.size() != 2) {
    std::cerr << "colibri-admin: give one command: upgrade, stage, switch, drop or apply-plan\n\n" << kUsage << "\n";
    return 2;
  }
  const std::string command = args[1];
  colibri::tools::RolloutOptions o;
  o.model_dir = absl::GetFlag(FLAGS_model);
  o.nodes = absl::GetFlag(FLAGS_nodes);
  o.router = absl::GetFlag(FLAGS_router);
  o.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  o.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  o.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  o.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  const int timeout_s = absl::GetFlag(FLAGS_timeout_s);
  if (timeout_s < 1 || timeout_s > 86400) {
    std::cerr << "colibri-admin: --timeout_s must be in [1, 86400], not " << timeout_s << "\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_settle_ms) < 0) {
    std::cerr << "colibri-admin: --settle_ms must be >= 0, not " << absl::GetFlag(FLAGS_settle_ms) << "\n";
    return 2;
  }
  const bool known =
      command == "upgrade" || command == "stage" || command == "switch" || command == "drop" || command == "apply-plan";
  if (known && command != "switch" && o.nodes.empty()) {
    std::cerr << "colibri-admin " << command << ": --nodes is required\n";
    return 2;
  }
  if ((command == "upgrade" || command == "switch") && o.router.empty()) {
    std::cerr << "colibri-admin " << command << ": --router is required\n";
    return 2;
  }
  if (command == "apply-plan") {
    const std::string plan = absl::GetFlag(FLAGS_plan);
    if (plan.empty()) {
      std::cerr << "colibri-admin apply-plan: --plan is required\n";
      return 2;
    }
    std::ifstream in(plan + "/shards.txt");
    std::vector<std::string> specs;
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string name, address, spec;
      if (fields >> name >> address >> spec) specs.push_back(spec);
    }
    if (specs.empty()) {
      std::cerr << "colibri-admin apply-plan: " << plan << "/shards.txt is missing or lists no shard\n";
      return 1;
    }
    const absl::Status s =
        colibri::tools::ApplyPlacement(o, specs, absl::Milliseconds(absl::GetFlag(FLAGS_settle_ms)), std::cout);
    if (!s.ok()) {
      std::cerr << "colibri-admin apply-plan: " << colibri::runtime::NameFlags(s, kOptionFlags).message() << "\n";
      return 1;
    }
    return 0;
  }
  const bool needs_model = command != "drop";
  if ((needs_model && o.model_dir.empty()) || (command == "drop" && absl::GetFlag(FLAGS_model_id).empty())) {
    std::cerr << "colibri-admin " << command << ": " << (needs_model ? "--model" : "--model_id") << " is required\n";
    return 2;
  }
  absl::Status s;
  std::string id;
  if (command == "upgrade") {
    s = colibri::tools::Rollout(o, std::cout);
  } else if (command == "stage") {
    s = colibri::tools::StageOnNodes(o, std::cout, &id);
    if (s.ok()) std::cout << "staged model " << id << "\n";
  } else if (command == "switch") {
    s = colibri::tools::SwitchRouter(o, std::cout, &id);
  } else if (command == "drop") {
    s = colibri::tools::DropOnNodes(o, absl::GetFlag(FLAGS_model_id), std::cout);
  } else {
    std::cerr << "colibri-admin: unknown command '" << command << "'\n\n" << kUsage << "\n";
    return 2;
  }
  if (!s.ok()) {
    std::cerr << "colibri-admin " << command << ": " << colibri::runtime::NameFlags(s, kOptionFlags).message() << "\n";
    return 1;
  }
  return 0;
}
