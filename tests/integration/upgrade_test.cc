// A model upgrade under load, as an operator runs it (colibri-admin upgrade):
// a router and two expert nodes serve v1 (bf16) to 3 concurrent clients; a
// v2 with a corrupt file is refused and v1 keeps serving; then v2 (the same
// checkpoint re-quantized to int8) is rolled out. Zero failed requests,
// every answer equal byte for byte to v1's or v2's local answer (never a
// mix), and after the roll-out every answer is v2's.
#include <catch2/catch.hpp>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "colibri/v1/expert_node.grpc.pb.h"
#include "colibri/v1/router.grpc.pb.h"
#include "tests/integration/cluster.h"

namespace colibri {
namespace testing {
namespace {

constexpr int kRequests = 12;

v1::ForwardRequest Nth(int i) {
  return Request(i % 2, {(i * 11) % 64, (i * 5 + 3) % 64}, 500 + i, v1::ROUTING_MODE_GATE);
}

// The answers of a local-mode router on `model` to the kRequests requests.
std::vector<std::string> LocalAnswers(const std::string& model) {
  std::vector<v1::ForwardRequest> requests;
  for (int i = 0; i < kRequests; ++i) requests.push_back(Nth(i));
  return testing::LocalAnswers(model, requests);
}

// Clients sending the requests in turn; each answer is classified as v1's, v2's or neither.
struct VersionedLoad : AnswerLoad {
  std::atomic<int> v1{0}, v2{0}, other{0};
  std::atomic<int> v1_after_switch{0};
  std::atomic<bool> switched{false};

  void Start(int port, const std::vector<std::string>& a, const std::vector<std::string>& b) {
    AnswerLoad::Start(
        port, 3, [](int c, int i) { return Nth((c + i) % kRequests); },
        [this, &a, &b](int c, int i, const v1::ForwardResponse& r, bool after) {
          const std::string& out = r.output().data();
          if (out == a[(c + i) % kRequests]) {
            ++v1;
            v1_after_switch += after;  // `switched` read before the call: its answer must then be v2's
          } else if (out == b[(c + i) % kRequests]) {
            ++v2;
          } else {
            ++other;
          }
        },
        [this] { return switched.load(); });
  }
};

int Admin(const std::string& args, const std::string& out) {
  return RunCommand(Binary("tools/colibri-admin") + " " + args, out);
}

// Router.LoadModel of `dir` on the router's admin port, waiting for nodes up
// to `timeout_ms`, the call's deadline `deadline` away.
grpc::StatusCode LoadModelOn(int admin_port, const std::string& dir, int timeout_ms, std::chrono::seconds deadline) {
  auto stub = v1::Router::NewStub(grpc::CreateChannel(Address(admin_port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + deadline);
  v1::LoadModelRequest request;
  request.set_model_dir(dir);
  request.set_timeout_ms(timeout_ms);
  v1::LoadModelResponse response;
  return stub->LoadModel(&context, request, &response).error_code();
}

std::vector<std::string> ModelIds(int admin_port) {
  auto stub = v1::ExpertNode::NewStub(grpc::CreateChannel(Address(admin_port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::GetNodeInfoResponse info;
  REQUIRE(stub->GetNodeInfo(&context, v1::GetNodeInfoRequest(), &info).ok());
  return {info.model_ids().begin(), info.model_ids().end()};
}

TEST_CASE("a model upgrade under load fails no request and never mixes versions, and a corrupt one is refused") {
  TempDir root;
  const tools::SynthOptions synth = SmallSynth(root / "ckpt");
  MakeModel(synth, root / "v1", common::DType::kBF16);
  MakeModel(synth, root / "v2", common::DType::kInt8);
  MakeModel(synth, root / "bad", common::DType::kInt8);
  FlipByte(root / "bad/layer_001/expert_003.bin", 9000);  // only the second node owns it
  const std::vector<std::string> a = LocalAnswers(root / "v1");
  const std::vector<std::string> b = LocalAnswers(root / "v2");
  REQUIRE(a[0] != b[0]);

  const std::vector<std::string> node_args = {"--model_root=" + root.path(), "--admin_listen=127.0.0.1:0"};
  Proc x = StartNode(root / "v1", "0-2", 0, node_args);
  const int x_admin = x.process->ReadPort("admin on port ");
  Proc y = StartNode(root / "v1", "2-3", 0, node_args);
  const int y_admin = y.process->ReadPort("admin on port ");
  Proc router = StartRouter({"--model=" + root / "v1", "--model_root=" + root.path(), "--admin_listen=127.0.0.1:0",
                             "--experts_at=" + Address(x.port) + "," + Address(y.port)});
  const int router_admin = router.process->ReadPort("admin on port ");
  const std::string endpoints =
      "--nodes=" + Address(x_admin) + "," + Address(y_admin) + " --router=" + Address(router_admin) + " --timeout_s=30";

  VersionedLoad load;
  load.Start(router.port, a, b);
  REQUIRE(WaitFor([&] { return load.v1 > 30; }));

  // A v2 with a corrupt file: the second node refuses it, the first drops
  // what it staged, nothing changes.
  CHECK(Admin("upgrade --model=" + root / "bad " + endpoints, root / "bad.txt") == 1);
  CHECK(ReadFile(root / "bad.txt").find("checksum") != std::string::npos);
  CHECK(ReadFile(root / "bad.txt").find("rolled back: the nodes serve the previous model") != std::string::npos);
  CHECK(ReadFile(root / "bad.txt").find("drop: node " + Address(x_admin)) != std::string::npos);
  CHECK(ModelIds(x_admin).size() == 1);
  CHECK(ModelIds(y_admin).size() == 1);
  int before = load.v1;
  CHECK(WaitFor([&] { return load.v1 > before + 30; }));
  CHECK(load.v2 == 0);

  // The router alone cannot switch to a model no node has loaded: it says which expert is missing.
  CHECK(Admin("switch --model=" + root / "v2 --router=" + Address(router_admin) + " --timeout_s=1",
              root / "switch.txt") == 1);
  CHECK(ReadFile(root / "switch.txt").find("has no live node") != std::string::npos);

  // The real v2.
  CHECK(Admin("upgrade --model=" + root / "v2 " + endpoints, root / "v2.txt") == 0);
  load.switched = true;
  before = load.v2;
  CHECK(WaitFor([&] { return load.v2 > before + 60; }));
  load.Stop();
  std::printf(
      "upgrade under 3 clients: %d answers of v1, %d of v2, %d of neither, %d failed; %d v1 answers to "
      "requests sent after the roll-out ended\n",
      load.v1.load(), load.v2.load(), load.other.load(), load.failed.load(), load.v1_after_switch.load());
  INFO("first error: " << load.first_error);
  CHECK(load.failed == 0);
  CHECK(load.other == 0);
  CHECK(load.v1_after_switch == 0);
  CHECK(ModelIds(x_admin).size() == 1);  // v1 dropped
  CHECK(ModelIds(y_admin).size() == 1);

  // The same again: nothing to switch, and no node holds v2 twice.
  CHECK(Admin("upgrade --model=" + root / "v2 " + endpoints, root / "again.txt") == 0);
  CHECK(ReadFile(root / "again.txt").find("already serves") != std::string::npos);
  CHECK(ModelIds(x_admin).size() == 1);
  CHECK(ModelIds(y_admin).size() == 1);
  // v1 staged beside v2 (the router's), then v2 staged again where a third
  // node cannot be reached: the roll-back drops nothing the nodes served
  // before, and the router's model stays on them.
  const std::string both = "--nodes=" + Address(x_admin) + "," + Address(y_admin);
  CHECK(Admin("stage --model=" + root / "v1 " + both + " --timeout_s=30", root / "stage.txt") == 0);
  CHECK(Admin("upgrade --model=" + root / "v2 " + both + ",127.0.0.1:1 --router=" + Address(router_admin) +
                  " --timeout_s=5",
              root / "unreachable.txt") == 1);
  INFO(ReadFile(root / "unreachable.txt"));
  CHECK(ReadFile(root / "unreachable.txt").find("drop: node") == std::string::npos);
  CHECK(ModelIds(x_admin).size() == 2);
  CHECK(ModelIds(y_admin).size() == 2);
  {
    v1::ForwardResponse response;
    auto stub = Connect(router.port);
    CHECK(Call(*stub, Nth(0), &response).ok());
    CHECK(response.output().data() == b[0]);
  }
  // Flags missing: a usage error (2), before any node is touched.
  CHECK(Admin("upgrade --model=" + root / "v2 --nodes=" + Address(x_admin), root / "usage.txt") == 2);
  CHECK(ReadFile(root / "usage.txt").find("--router is required") != std::string::npos);
}

TEST_CASE("a router whose LoadModel caller gave up before the switch does not switch later") {
  TempDir root;
  const tools::SynthOptions synth = SmallSynth(root / "ckpt");
  MakeModel(synth, root / "v1", common::DType::kBF16);
  MakeModel(synth, root / "v2", common::DType::kInt8);
  Proc node = StartNode(root / "v1", "0-3", 0, {"--model_root=" + root.path(), "--admin_listen=127.0.0.1:0"});
  const int node_admin = node.process->ReadPort("admin on port ");
  Proc router = StartRouter({"--model=" + root / "v1", "--model_root=" + root.path(), "--admin_listen=127.0.0.1:0",
                             "--experts_at=" + Address(node.port)});
  const int router_admin = router.process->ReadPort("admin on port ");
  auto router_stub =
      v1::Router::NewStub(grpc::CreateChannel(Address(router_admin), grpc::InsecureChannelCredentials()));
  const auto model = [&] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::GetModelInfoResponse info;
    REQUIRE(router_stub->GetModelInfo(&context, {}, &info).ok());
    return info.model_id();
  };
  const std::string v1_id = model();

  // The router waits (up to 30 s) for a node serving v2; its caller leaves after 1 s.
  CHECK(LoadModelOn(router_admin, root / "v2", 30000, std::chrono::seconds(1)) == grpc::StatusCode::DEADLINE_EXCEEDED);
  // Then the node serves v2 too: the router's wait would now end, but its caller is gone.
  auto node_stub =
      v1::ExpertNode::NewStub(grpc::CreateChannel(Address(node_admin), grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::ReloadRequest request;
    request.set_model_dir(root / "v2");
    request.set_keep_previous(true);
    v1::ReloadResponse response;
    REQUIRE(node_stub->Reload(&context, request, &response).ok());
  }
  // A router that went on would switch within a health round (100 ms here): it stays on v1.
  const absl::Time until = absl::Now() + absl::Seconds(3);
  while (absl::Now() < until) {
    REQUIRE(model() == v1_id);
    absl::SleepFor(absl::Milliseconds(100));
  }
  CHECK(ModelIds(node_admin).size() == 2);  // v2 beside v1, as staged
}

TEST_CASE("SIGTERM during a SIGHUP reload that waits for nodes drains and exits at once") {
  TempDir root;
  const tools::SynthOptions synth = SmallSynth(root / "ckpt");
  MakeModel(synth, root / "v1", common::DType::kBF16);
  MakeModel(synth, root / "v2", common::DType::kInt8);
  std::filesystem::create_directory_symlink(root / "v1", root / "current");
  Proc node = StartNode(root / "v1", "0-3", 0);
  Proc router = StartRouter({"--model=" + root / "current", "--experts_at=" + Address(node.port), "--drain_seconds=1"});
  // --model now holds v2, which no node serves: the SIGHUP's load waits up to 30 s for one.
  std::filesystem::remove(root / "current");
  std::filesystem::create_directory_symlink(root / "v2", root / "current");
  router.process->Signal(SIGHUP);
  absl::SleepFor(absl::Milliseconds(500));
  const absl::Time sent = absl::Now();
  CHECK(router.process->SignalAndWait(SIGTERM, std::chrono::seconds(10)) == 0);
  CHECK(absl::Now() - sent < absl::Seconds(8));
}

TEST_CASE("a version awaiting its nodes leaves the live-node gauge to the version serving") {
  TempDir root;
  const tools::SynthOptions synth = SmallSynth(root / "ckpt");
  MakeModel(synth, root / "v1", common::DType::kBF16);
  MakeModel(synth, root / "v2", common::DType::kInt8);
  Proc node = StartNode(root / "v1", "0-3", 0);
  Proc router = StartRouter({"--model=" + root / "v1", "--model_root=" + root.path(), "--admin_listen=127.0.0.1:0",
                             "--metrics_port=0", "--experts_at=" + Address(node.port)});
  const int router_admin = router.process->ReadPort("admin on port ");
  const int metrics = router.process->ReadPort("metrics on port ");
  REQUIRE(Metric(HttpGet(metrics, "/metrics"), "colibri_router_live_nodes") == 1);
  // v2 is on no node: the load waits its 3 s (its version's health rounds
  // find the node serving another model), then fails.
  std::thread load([&] { (void)LoadModelOn(router_admin, root / "v2", 3000, std::chrono::seconds(30)); });
  int samples = 0, live_one = 0;
  for (const absl::Time until = absl::Now() + absl::Seconds(2); absl::Now() < until; ++samples) {
    absl::SleepFor(absl::Milliseconds(100));
    live_one += Metric(HttpGet(metrics, "/metrics"), "colibri_router_live_nodes") == 1;
  }
  load.join();
  CHECK(live_one == samples);
  CHECK(Metric(HttpGet(metrics, "/metrics"), "colibri_router_live_nodes") == 1);
}

}  // namespace
}  // namespace testing
}  // namespace colibri
