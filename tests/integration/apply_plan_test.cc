// A placement from colibri-plan applied to a running cluster under load, both
// ways docs/RELIABILITY.md gives: nodes reloading their new shards
// (colibri-admin apply-plan: grow, then shrink) on a split with no replica,
// and nodes restarted one at a time with their new shard specs where every
// shard has two nodes. Zero failed requests, and every answer equal byte for
// byte to the local engine's — including batches of 37 tokens, whose
// replicated experts' rows the router splits between their copies.
#include <algorithm>
#include <catch2/catch.hpp>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>

#include "colibri/v1/expert_node.grpc.pb.h"
#include "tests/integration/cluster.h"
#include "tools/rollout.h"

namespace colibri {
namespace testing {
namespace {

// The built-in kernel profile at most at the avx512_bf16 level (no oneDNN,
// no AMX tiles: bf16 has no row threshold), set before anything selects
// kernels and passed on to the nodes and the router. Where a host's kernels
// have a bf16 threshold (a measured profile with oneDNN from a few rows; AMX
// tiles from 16 rows, as many as the router's fewest rows worth splitting),
// no split of a 37-token batch's rows is exact, and the router makes none.
const bool kBuiltInProfile = [] {
  return setenv("COLIBRI_KERNEL_PROFILE", "off", 1) == 0 && setenv("COLIBRI_MAX_ISA", "avx512_bf16", 0) == 0;
}();

constexpr int kRequests = 8;

v1::ForwardRequest Nth(int i) {
  std::vector<int32_t> ids;
  const int tokens = i % 4 == 3 ? 37 : 1 + i % 4;
  for (int t = 0; t < tokens; ++t) ids.push_back((i * 13 + t * 7) % 64);
  return Request(i % 2, ids, 900 + i);
}

std::vector<std::string> LocalAnswers(const std::string& model) {
  std::vector<v1::ForwardRequest> requests;
  for (int i = 0; i < kRequests; ++i) requests.push_back(Nth(i));
  return testing::LocalAnswers(model, requests);
}

// Clients sending the requests in turn, each answer compared with the local one.
struct CheckedLoad : AnswerLoad {
  std::atomic<int> exact{0}, differ{0};

  void Start(int port, const std::vector<std::string>& expected) {
    AnswerLoad::Start(
        port, 3, [](int c, int i) { return Nth((c + i) % kRequests); },
        [this, &expected](int c, int i, const v1::ForwardResponse& r, bool) {
          ++(r.output().data() == expected[(c + i) % kRequests] ? exact : differ);
        });
  }
};

// colibri-plan for two nodes of 3 experts' memory per layer, expert 0 taking
// 60% of the load in both layers: its specs, one per node.
std::vector<std::string> Plan(const TempDir& root, const std::string& model) {
  {
    std::ofstream load(root / "load.txt");
    for (int layer = 0; layer < 2; ++layer) {
      load << layer << " 0 600\n" << layer << " 1 200\n" << layer << " 2 100\n" << layer << " 3 100\n";
    }
  }
  std::ifstream expert(model + "/layer_000/expert_000.bin", std::ios::binary | std::ios::ate);
  const int64_t memory = 6 * static_cast<int64_t>(expert.tellg()) + 4096;
  REQUIRE(RunCommand(Binary("tools/colibri-plan") + " --model=" + model + " --nodes=2 --node_memory=" +
                         std::to_string(memory) + " --load=" + root / "load.txt" + " --out=" + root / "plan",
                     root / "plan.txt") == 0);
  CHECK(ReadFile(root / "plan.txt").find("busiest node 1.000 x the mean with the plan") != std::string::npos);
  std::vector<std::string> specs;
  for (const char* node : {"node-0", "node-1"}) {
    std::string spec = ReadFile(root / "plan/" + node + ".experts");
    specs.push_back(spec.substr(0, spec.find('\n')));
  }
  return specs;
}

template <typename Owned>
std::string Text(const Owned& owned_experts) {
  std::string owned;
  for (const v1::OwnedExperts& layer : owned_experts) {
    owned += "layer " + std::to_string(layer.layer()) + ":";
    for (const int32_t e : layer.experts()) owned += " " + std::to_string(e);
    owned += ";";
  }
  return owned;
}

// What a node says it owns.
std::string Owned(int port) {
  auto stub = v1::ExpertNode::NewStub(grpc::CreateChannel(Address(port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::GetNodeInfoResponse info;
  REQUIRE(stub->GetNodeInfo(&context, v1::GetNodeInfoRequest(), &info).ok());
  return Text(info.owned());
}

int LiveCopies(v1::Router::Stub& router, int32_t layer, int32_t expert) {
  const v1::GetClusterStatusResponse status = Status(router);
  for (const v1::ExpertLoad& e : status.experts()) {
    if (e.layer() == layer && e.expert() == expert) return e.live_replicas();
  }
  return -1;
}

void Report(const char* what, CheckedLoad& load) {
  std::printf("%s under 3 clients: %d exact answers, %d different, %d failed\n", what, load.exact.load(),
              load.differ.load(), load.failed.load());
  INFO("first error: " << load.first_error);
  CHECK(load.failed == 0);
  CHECK(load.differ == 0);
}

TEST_CASE("a plan applied by reloading the nodes' shards under load fails no request and keeps the bits") {
  TempDir root;
  const std::string model = root / "model";
  MakeModel(SmallSynth(root / "ckpt"), model, common::DType::kBF16);
  const std::vector<std::string> expected = LocalAnswers(model);
  const std::vector<std::string> specs = Plan(root, model);

  // Experts 0 and 2 | 1 and 3: the plan (0-1 | 0,2-3) makes both nodes grow, then shrink.
  Proc x = StartNode(model, "0,2", 0, {"--admin_listen=127.0.0.1:0"});
  const int x_admin = x.process->ReadPort("admin on port ");
  Proc y = StartNode(model, "1,3", 0, {"--admin_listen=127.0.0.1:0"});
  const int y_admin = y.process->ReadPort("admin on port ");
  Proc router = StartRouter({"--model=" + model, "--admin_listen=127.0.0.1:0", "--metrics_port=0",
                             "--metrics_host=127.0.0.1", "--experts_at=" + Address(x.port) + "," + Address(y.port)});
  const int router_admin = router.process->ReadPort("admin on port ");
  const int metrics_port = router.process->ReadPort("metrics on port ");
  auto stub = Connect(router.port);

  CheckedLoad load;
  load.Start(router.port, expected);
  REQUIRE(WaitFor([&] { return load.exact > 30; }));
  CHECK(RunCommand(Binary("tools/colibri-admin") + " apply-plan --plan=" + root / "plan" +
                       " --nodes=" + Address(x_admin) + "," + Address(y_admin) + " --router=" + Address(router_admin) +
                       " --timeout_s=30",
                   root / "apply.txt") == 0);
  const int before = load.exact;
  CHECK(WaitFor([&] { return load.exact > before + 60; }));
  load.Stop();
  Report("apply-plan (grow, then shrink)", load);

  CHECK(LiveCopies(*stub, 0, 0) == 2);  // the hot expert on both nodes
  CHECK(LiveCopies(*stub, 1, 0) == 2);
  // A 37-token batch alone has its replicated experts' rows split between
  // the copies, and keeps the bits. (Under the load the router may merge it
  // with other clients' calls into a batch too big to split exactly.)
  auto splits = [&] {  // the counter appears with the first split
    return std::max(0.0, Metric(HttpGet(metrics_port, "/metrics"), "colibri_router_split_layer_calls_total"));
  };
  const double splits_before = splits();
  for (const int i : {3, 7}) {
    v1::ForwardResponse response;
    REQUIRE(Call(*stub, Nth(i), &response).ok());
    CHECK(response.output().data() == expected[i]);
  }
  CHECK(splits() > splits_before);
  CHECK(Owned(x_admin) != Owned(y_admin));
  const std::string applied = ReadFile(root / "apply.txt");
  CHECK(applied.find("placement applied to 2 nodes") != std::string::npos);
  CHECK(applied.find("shrink: node " + Address(x_admin)) != std::string::npos);
  CHECK(applied.find("shrink: node " + Address(y_admin)) != std::string::npos);

  // A plan that leaves experts 2 and 3 on no node is refused before any node changes.
  const std::string x_owned = Owned(x_admin), y_owned = Owned(y_admin);
  std::filesystem::create_directories(root / "bad_plan");
  { std::ofstream(root / "bad_plan/shards.txt") << "node-0 a 0-1\nnode-1 b 0-1\n"; }
  CHECK(RunCommand(Binary("tools/colibri-admin") + " apply-plan --plan=" + root / "bad_plan" +
                       " --nodes=" + Address(x_admin) + "," + Address(y_admin) + " --router=" + Address(router_admin),
                   root / "bad.txt") == 1);
  CHECK(ReadFile(root / "bad.txt").find("expert 2 on no node") != std::string::npos);
  CHECK(Owned(x_admin) == x_owned);
  CHECK(Owned(y_admin) == y_owned);
}

// A log whose lines are handed to `on_line` as they are written.
class LineLog : public std::streambuf {
 public:
  explicit LineLog(std::function<void(const std::string&)> on_line) : on_line_(std::move(on_line)) {}
  std::string text;

 protected:
  int overflow(int c) override {
    if (c == EOF) return 0;
    text.push_back(static_cast<char>(c));
    line_.push_back(static_cast<char>(c));
    if (c == '\n') {
      on_line_(line_);
      line_.clear();
    }
    return c;
  }

 private:
  std::function<void(const std::string&)> on_line_;
  std::string line_;
};

TEST_CASE("apply-plan stops before a shrink would drop the last copy of an expert on a node that died") {
  TempDir root;
  const std::string model = root / "model";
  MakeModel(SmallSynth(root / "ckpt"), model, common::DType::kBF16);
  Proc x = StartNode(model, "all", 0, {"--admin_listen=127.0.0.1:0"});
  const int x_admin = x.process->ReadPort("admin on port ");
  Proc y = StartNode(model, "all", 0, {"--admin_listen=127.0.0.1:0"});
  const int y_admin = y.process->ReadPort("admin on port ");
  Proc router = StartRouter({"--model=" + model, "--admin_listen=127.0.0.1:0", "--health_interval_ms=100",
                             "--experts_at=" + Address(x.port) + "," + Address(y.port)});
  const int router_admin = router.process->ReadPort("admin on port ");
  const std::string y_before = Owned(y_admin);

  // x shrinks to 0-1 and dies as soon as it has; y would then drop 2-3's last copies.
  tools::RolloutOptions options;
  options.nodes = {Address(x_admin), Address(y_admin)};
  options.router = Address(router_admin);
  options.timeout = absl::Seconds(30);
  LineLog lines([&](const std::string& line) {
    if (line.rfind("shrink: node " + Address(x_admin), 0) == 0)
      x.process->SignalAndWait(SIGKILL, std::chrono::seconds(10));
  });
  std::ostream log(&lines);
  const absl::Status applied = tools::ApplyPlacement(options, {"0-1", "2-3"}, absl::Seconds(1), log);
  INFO(lines.text);
  INFO(applied.message());
  CHECK(applied.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(applied.message().find("shrink: node " + Address(y_admin) + " would drop layer 0 expert 0") !=
        std::string::npos);
  CHECK(Owned(y_admin) == y_before);  // y kept every expert
  CHECK(lines.text.find("placement applied") == std::string::npos);
  // One endpoint given for two shards: refused before any node is asked.
  options.nodes = {Address(y_admin), Address(y_admin)};
  CHECK(tools::ApplyPlacement(options, {"0-1", "2-3"}, absl::Seconds(1), log).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(Owned(y_admin) == y_before);
}

TEST_CASE("a plan applied by restarting nodes one at a time, two per shard, fails no request and keeps the bits") {
  TempDir root;
  const std::string model = root / "model";
  MakeModel(SmallSynth(root / "ckpt"), model, common::DType::kBF16);
  const std::vector<std::string> expected = LocalAnswers(model);
  const std::vector<std::string> specs = Plan(root, model);

  // Shard 0 (experts 0-1) on nodes 0 and 2, shard 1 (2-3) on nodes 1 and 3.
  std::vector<Proc> nodes;
  std::string addresses;
  for (int n = 0; n < 4; ++n) {
    nodes.push_back(StartNode(model, n % 2 == 0 ? "0-1" : "2-3"));
    addresses += (n == 0 ? "" : ",") + Address(nodes[n].port);
  }
  Proc router = StartRouter({"--model=" + model, "--experts_at=" + addresses});
  auto stub = Connect(router.port);

  CheckedLoad load;
  load.Start(router.port, expected);
  REQUIRE(WaitFor([&] { return load.exact > 30; }));
  // One node of each shard, then the other: every expert keeps a live copy throughout.
  for (int n = 0; n < 4; ++n) {
    const int port = nodes[n].port;
    REQUIRE(nodes[n].process->SignalAndWait(SIGTERM, std::chrono::seconds(60)) == 0);  // gone before its port is reused
    nodes[n] = StartNode(model, specs[n % 2], port);
    const std::string owned = Owned(port);
    REQUIRE(WaitFor([&] {
      const v1::NodeStatus node = Status(*stub).nodes(n);  // node-<n>: the router's order of --experts_at
      return node.live() && Text(node.owned()) == owned;
    }));
    if (n == 1) {
      // The new shards serve beside the old ones: the hot expert has a third copy.
      CHECK(WaitFor([&] { return LiveCopies(*stub, 0, 0) == 3; }));
    }
    const int before = load.exact;
    CHECK(WaitFor([&] { return load.exact > before + 20; }));
  }
  load.Stop();
  Report("restarts one node at a time", load);
  CHECK(LiveCopies(*stub, 0, 0) == 4);  // on every node now
  CHECK(LiveCopies(*stub, 0, 1) == 2);
}

}  // namespace
}  // namespace testing
}  // namespace colibri
