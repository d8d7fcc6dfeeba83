// The C++ client (clients/cpp) against a real colibri-router with two real
// colibri-expert processes on 127.0.0.1:0: unary, async and streaming calls,
// routes and timings, bf16 on the wire, errors carrying the server's code and
// message, and a clear failure for a router that is not there; and the
// proxyless client (the router's core in the client) against the same nodes:
// the router's bytes, and no failed call when a replica is killed under load.

#include "clients/cpp/client.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <future>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include "clients/cpp/tensor.h"
#include "colibri/v1/expert_node.grpc.pb.h"
#include "tests/test_util.h"

namespace colibri {
namespace client {
namespace {

using colibri::testing::Binary;
using colibri::testing::ProcessGuard;
using colibri::testing::TempDir;

struct Cluster {
  TempDir dir;
  std::unique_ptr<ProcessGuard> a, b, router;
  int port = 0;
  int port_a = 0, port_b = 0;
  Cluster() {
    colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
    auto node = [&](const std::string& experts) {
      auto p = std::make_unique<ProcessGuard>(
          std::vector<std::string>{Binary("expert_node/colibri-expert"), "--model=" + (dir / "model"),
                                   "--experts=" + experts, "--listen=127.0.0.1:0", "--residency=paged", "--threads=1"});
      return p;
    };
    a = node("0-2");
    port_a = a->ReadPort();
    b = node("2-3");
    port_b = b->ReadPort();
    router = std::make_unique<ProcessGuard>(std::vector<std::string>{
        Binary("router_node/colibri-router"), "--model=" + (dir / "model"),
        "--experts_at=127.0.0.1:" + std::to_string(port_a) + ",127.0.0.1:" + std::to_string(port_b),
        "--listen=127.0.0.1:0"});
    port = router->ReadPort();
    // Serving once its health checks reached both nodes (slow builds, e.g. TSan, take a while).
    auto stub = v1::Router::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
    for (int i = 0; i < 300; ++i) {
      grpc::ClientContext context;
      v1::GetClusterStatusResponse status;
      if (stub->GetClusterStatus(&context, v1::GetClusterStatusRequest(), &status).ok() && status.serving()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  std::unique_ptr<Client> Connect() {
    ClientOptions options;
    options.target = "127.0.0.1:" + std::to_string(port);
    auto c = Client::Connect(options);
    REQUIRE(c.ok());
    return std::move(c).value();
  }
};

std::vector<float> Hidden(int64_t tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(tokens * 48);
  for (float& v : x) v = normal(rng);
  return x;
}

TEST_CASE("unary, async and client-routed calls agree, with routes and timings") {
  Cluster cluster;
  auto client = cluster.Connect();
  CHECK(client->model().d_model() == 48);
  CHECK(client->model().backend() == "distributed");
  const std::vector<float> x = Hidden(5, 1);
  ForwardArgs args;
  args.layer = 1;
  args.token_ids = {3, 14, 15, 9, 26};
  args.hidden = x;
  args.return_routes = true;
  args.return_timings = true;
  absl::StatusOr<ForwardResult> r = client->Forward(args);
  INFO(r.status());
  REQUIRE(r.ok());
  REQUIRE(r->output.size() == x.size());
  CHECK(r->routes.top_k == 2);
  CHECK(r->routes.expert_ids.size() == 10);
  std::set<std::string> stages;
  for (const Timing& t : r->timings) stages.insert(t.stage.substr(0, t.stage.find(':')));
  CHECK(stages == std::set<std::string>{"route", "dispatch", "aggregate", "total", "node", "node_compute"});

  ForwardArgs client_routed = args;
  client_routed.routing = Routing::kClient;
  client_routed.routes = r->routes;
  absl::StatusOr<ForwardResult> same = client->Forward(client_routed);
  REQUIRE(same.ok());
  CHECK(same->output == r->output);

  std::promise<absl::StatusOr<ForwardResult>> promise;
  client->ForwardAsync(args, [&](absl::StatusOr<ForwardResult> result) { promise.set_value(std::move(result)); });
  absl::StatusOr<ForwardResult> async = promise.get_future().get();
  REQUIRE(async.ok());
  CHECK(async->output == r->output);

  // bf16 both ways: the output is the f32 one rounded, from inputs rounded.
  ForwardArgs half = args;
  half.send_as = WireType::kBF16;
  half.output = WireType::kBF16;
  absl::StatusOr<ForwardResult> h = client->Forward(half);
  REQUIRE(h.ok());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    diff += std::pow(double(h->output[i]) - r->output[i], 2);
    norm += std::pow(double(r->output[i]), 2);
  }
  CHECK(std::sqrt(diff / norm) < 2e-2);

  absl::StatusOr<v1::GetClusterStatusResponse> status = client->ClusterStatus();
  REQUIRE(status.ok());
  CHECK(status->nodes_size() == 2);
  CHECK(status->serving());
}

std::string Loopback(int port) { return "127.0.0.1:" + std::to_string(port); }

std::unique_ptr<Client> ConnectDirect(const std::string& model_dir, const std::vector<std::string>& nodes,
                                      int64_t node_stream_max_bytes = 0) {
  ClientOptions options;
  options.direct.model_dir = model_dir;
  options.direct.nodes = nodes;
  options.direct.node_stream_max_bytes = node_stream_max_bytes;
  options.direct.node_timeout = absl::Seconds(2);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
  INFO(c.status().message());
  REQUIRE(c.ok());
  // Connect checks the nodes once; a slow (sanitizer) build may need the watcher's next rounds.
  for (int i = 0; i < 300; ++i) {
    absl::StatusOr<v1::GetClusterStatusResponse> status = (*c)->ClusterStatus();
    REQUIRE(status.ok());
    int live = 0;
    for (const v1::NodeStatus& n : status->nodes()) live += n.live();
    if (live == static_cast<int>(nodes.size())) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return std::move(c).value();
}

TEST_CASE("a proxyless client calls the nodes itself and answers byte for byte like the router") {
  Cluster cluster;
  auto routed = cluster.Connect();
  auto direct = ConnectDirect(cluster.dir / "model", {Loopback(cluster.port_a), Loopback(cluster.port_b)});
  CHECK(direct->proxyless());
  CHECK(direct->model().model_id() == routed->model().model_id());
  CHECK(direct->model().backend() == "distributed");
  for (int i = 0; i < 8; ++i) {
    const std::vector<float> x = Hidden(1 + i % 4 * 3, 40 + i);
    ForwardArgs args;
    args.layer = i % 2;
    for (size_t t = 0; t < x.size() / 48; ++t) args.token_ids.push_back(static_cast<int32_t>((t * 7 + i) % 64));
    args.hidden = x;
    args.routing = i % 3 == 0 ? Routing::kGate : Routing::kLut;
    args.output = i % 2 == 0 ? WireType::kF32 : WireType::kBF16;
    absl::StatusOr<ForwardResult> a = routed->Forward(args);
    absl::StatusOr<ForwardResult> b = direct->Forward(args);
    REQUIRE(a.ok());
    INFO(b.status().message());
    REQUIRE(b.ok());
    CHECK(a->output == b->output);
    std::promise<absl::StatusOr<ForwardResult>> promise;
    direct->ForwardAsync(args, [&](absl::StatusOr<ForwardResult> r) { promise.set_value(std::move(r)); });
    absl::StatusOr<ForwardResult> c = promise.get_future().get();
    REQUIRE(c.ok());
    CHECK(c->output == a->output);
  }
  auto session = direct->OpenSession();
  REQUIRE(session.ok());
  const std::vector<float> one_token = Hidden(1, 3);  // outlives the span in `bad`
  ForwardArgs bad;
  bad.layer = 9;
  bad.hidden = one_token;
  bad.token_ids = {1};
  absl::StatusOr<ForwardResult> refused = (*session)->Forward(bad);
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(refused.status().message()).find("layer 9") != std::string::npos);
  bad.layer = 1;
  CHECK((*session)->Forward(bad).ok());
  absl::StatusOr<v1::GetClusterStatusResponse> status = direct->ClusterStatus();
  REQUIRE(status.ok());
  REQUIRE(status->nodes_size() == 2);
  CHECK(status->nodes(0).address() == Loopback(cluster.port_a));  // the client is its own operator
  CHECK(status->serving());

  ClientOptions both;
  both.target = Loopback(cluster.port);
  both.direct.model_dir = cluster.dir / "model";
  CHECK(Client::Connect(both).status().code() == absl::StatusCode::kInvalidArgument);
  ClientOptions bad_mode;
  bad_mode.direct.model_dir = cluster.dir / "model";
  bad_mode.direct.nodes = {Loopback(cluster.port_a)};
  bad_mode.direct.node_replies = "sum";
  CHECK(Client::Connect(bad_mode).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("a client destroyed with ForwardAsync calls in flight waits for their results") {
  Cluster cluster;
  const std::vector<float> x = Hidden(3, 21);
  ForwardArgs args;
  args.layer = 0;
  args.token_ids = {5, 6, 7};
  args.hidden = x;
  for (const bool proxyless : {false, true}) {
    CAPTURE(proxyless);
    constexpr int kCalls = 16;
    std::atomic<int> ok{0}, answered{0};
    {
      std::unique_ptr<Client> client =
          proxyless ? ConnectDirect(cluster.dir / "model", {Loopback(cluster.port_a), Loopback(cluster.port_b)})
                    : cluster.Connect();
      for (int i = 0; i < kCalls; ++i) {
        client->ForwardAsync(args, [&](absl::StatusOr<ForwardResult> r) {
          ok.fetch_add(r.ok() ? 1 : 0);
          answered.fetch_add(1);
        });
      }
    }  // destroyed with the calls in flight
    for (int i = 0; i < 2000 && answered.load() < kCalls; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    CHECK(answered.load() == kCalls);
    CHECK(ok.load() == kCalls);
  }
}

TEST_CASE("kill -9 of a replica under load from proxyless clients fails no request") {
  // Node calls unary, and as messages on one stream per node.
  const int64_t stream_max = GENERATE(int64_t{0}, int64_t{64 << 10});
  Cluster cluster;
  // A third node with every expert: each expert has a replica beside node a or b.
  ProcessGuard c({Binary("expert_node/colibri-expert"), "--model=" + (cluster.dir / "model"), "--experts=all",
                  "--listen=127.0.0.1:0", "--residency=paged", "--threads=1"});
  const int port_c = c.ReadPort();
  auto direct = ConnectDirect(cluster.dir / "model",
                              {Loopback(cluster.port_a), Loopback(cluster.port_b), Loopback(port_c)}, stream_max);
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, failed{0};
  std::mutex mu;
  std::string first_error;
  std::vector<std::thread> clients;
  for (int t = 0; t < 3; ++t) {
    clients.emplace_back([&, t] {
      const std::vector<float> x = Hidden(4, 90 + t);
      ForwardArgs args;
      args.layer = t % 2;
      args.token_ids = {3, 17, 40, 63};
      args.hidden = x;
      args.routing = Routing::kGate;
      while (!stop.load()) {
        absl::StatusOr<ForwardResult> r = direct->Forward(args);
        if (r.ok()) {
          ok.fetch_add(1);
        } else {
          failed.fetch_add(1);
          std::lock_guard<std::mutex> lock(mu);
          if (first_error.empty()) first_error = r.status().ToString();
        }
      }
    });
  }
  auto wait_for_ok = [&](int more) {
    const int target = ok.load() + more;
    for (int i = 0; i < 2000 && ok.load() < target; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  };
  wait_for_ok(50);
  cluster.a->SignalAndWait(SIGKILL, std::chrono::seconds(10));
  wait_for_ok(150);
  stop.store(true);
  for (std::thread& t : clients) t.join();
  INFO(first_error);
  CHECK(failed.load() == 0);
  CHECK(ok.load() >= 200);
  std::printf("proxyless clients (node streams up to %lld bytes), kill -9 of a replica under load: %d ok, %d failed\n",
              static_cast<long long>(stream_max), ok.load(), failed.load());
  absl::StatusOr<v1::GetClusterStatusResponse> status = direct->ClusterStatus();
  REQUIRE(status.ok());
  CHECK(!status->nodes(0).live());
}

// ExpertNode.Reload on a node's admin endpoint.
grpc::Status Reload(int admin_port, const v1::ReloadRequest& request) {
  auto stub = v1::ExpertNode::NewStub(grpc::CreateChannel(Loopback(admin_port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::ReloadResponse response;
  return stub->Reload(&context, request, &response);
}

TEST_CASE("a proxyless client switches to a staged model version under load, never mixing versions") {
  TempDir dir;
  const tools::SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt");
  colibri::testing::MakeModel(synth, dir / "v1", common::DType::kBF16);
  colibri::testing::MakeModel(synth, dir / "v2", common::DType::kInt8);  // the same checkpoint, re-quantized
  std::vector<std::unique_ptr<ProcessGuard>> nodes;
  std::vector<int> ports, admin_ports;
  for (const char* experts : {"0-2", "2-3"}) {
    nodes.push_back(std::make_unique<ProcessGuard>(std::vector<std::string>{
        Binary("expert_node/colibri-expert"), "--model=" + (dir / "v1"), "--model_root=" + dir.path(),
        "--experts=" + std::string(experts), "--listen=127.0.0.1:0", "--admin_listen=127.0.0.1:0", "--threads=1"}));
    ports.push_back(nodes.back()->ReadPort());
    admin_ports.push_back(nodes.back()->ReadPort("admin on port "));
  }
  auto client = ConnectDirect(dir / "v1", {Loopback(ports[0]), Loopback(ports[1])});
  const std::string v1_id = client->model().model_id();
  const std::vector<float> x = Hidden(3, 7);
  ForwardArgs args;
  args.layer = 1;
  args.token_ids = {5, 22, 61};
  args.hidden = x;
  args.routing = Routing::kGate;
  absl::StatusOr<ForwardResult> before = client->Forward(args);
  REQUIRE(before.ok());

  // Not staged on the nodes yet: refused, naming what is missing; v1 serves on.
  absl::StatusOr<std::string> early = client->LoadModel(dir / "v2", absl::Seconds(1));
  CHECK(early.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(early.status().message()), Catch::Contains("has no live node"));
  absl::StatusOr<ForwardResult> still = client->Forward(args);
  REQUIRE(still.ok());
  CHECK(still->output == before->output);

  v1::ReloadRequest stage;
  stage.set_model_dir(dir / "v2");
  stage.set_keep_previous(true);
  for (int port : admin_ports) REQUIRE(Reload(port, stage).ok());
  // v2's own answer, from a client that loads it directly.
  absl::StatusOr<ForwardResult> v2_answer =
      ConnectDirect(dir / "v2", {Loopback(ports[0]), Loopback(ports[1])})->Forward(args);
  REQUIRE(v2_answer.ok());
  REQUIRE(v2_answer->output != before->output);

  std::atomic<bool> stop{false}, switched{false};
  std::atomic<int> v1_answers{0}, v2_answers{0}, other{0}, failed{0}, v1_after_switch{0};
  std::thread load([&] {
    while (!stop.load()) {
      const bool after = switched.load();  // read before the call: its answer must then be v2's
      absl::StatusOr<ForwardResult> r = client->Forward(args);
      if (!r.ok()) {
        ++failed;
      } else if (r->output == before->output) {
        ++v1_answers;
        v1_after_switch += after;
      } else if (r->output == v2_answer->output) {
        ++v2_answers;
      } else {
        ++other;
      }
    }
  });
  for (int i = 0; i < 2000 && v1_answers.load() < 20; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  absl::StatusOr<std::string> switched_to = client->LoadModel(dir / "v2");
  INFO(switched_to.status().message());
  REQUIRE(switched_to.ok());
  CHECK(*switched_to != v1_id);
  switched.store(true);
  v1::ReloadRequest drop;
  drop.set_drop_model_id(v1_id);
  for (int port : admin_ports) CHECK(Reload(port, drop).ok());
  const int v2_so_far = v2_answers.load();
  for (int i = 0; i < 2000 && v2_answers.load() < v2_so_far + 20; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  stop.store(true);
  load.join();
  std::printf("proxyless switch under load: %d answers of v1, %d of v2, %d of neither, %d failed\n", v1_answers.load(),
              v2_answers.load(), other.load(), failed.load());
  CHECK(failed.load() == 0);
  CHECK(other.load() == 0);
  CHECK(v1_after_switch.load() == 0);
  CHECK(v2_answers.load() >= v2_so_far + 20);
  CHECK(client->LoadModel(dir / "v2").value_or("") == *switched_to);  // already serving it: nothing to do
}

TEST_CASE("a session answers in order, reports a refused request and goes on") {
  Cluster cluster;
  auto client = cluster.Connect();
  auto session = client->OpenSession();
  REQUIRE(session.ok());
  const std::vector<float> x = Hidden(1, 2);
  ForwardArgs args;
  args.hidden = x;
  std::vector<std::vector<float>> outputs;
  for (int i = 0; i < 6; ++i) {
    args.layer = i % 2;
    args.token_ids = {i == 3 ? 64 : i};
    absl::StatusOr<ForwardResult> r = (*session)->Forward(args);
    if (i == 3) {
      REQUIRE(!r.ok());
      CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
      CHECK(r.status().message().find("token_ids[0] = 64") != absl::string_view::npos);
      continue;
    }
    INFO(r.status());
    REQUIRE(r.ok());
    // The same call unary gives the same bytes.
    absl::StatusOr<ForwardResult> unary = client->Forward(args);
    REQUIRE(unary.ok());
    CHECK(unary->output == r->output);
  }
  CHECK((*session)->Close().ok());
  CHECK((*session)->Forward(args).status().code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("a session call with no reply within the timeout ends DEADLINE_EXCEEDED, and Cancel ends one at once") {
  Cluster cluster;
  ClientOptions options;
  options.target = "127.0.0.1:" + std::to_string(cluster.port);
  options.timeout = absl::Seconds(2);  // room for the first calls on a loaded machine
  auto client = Client::Connect(options);
  REQUIRE(client.ok());
  const std::vector<float> x = Hidden(1, 2);
  ForwardArgs args;
  args.layer = 0;
  args.token_ids = {1};
  args.hidden = x;
  auto timed = (*client)->OpenSession();
  REQUIRE(timed.ok());
  REQUIRE((*timed)->Forward(args).ok());
  auto cancelled = (*client)->OpenSession();
  REQUIRE(cancelled.ok());
  REQUIRE((*cancelled)->Forward(args).ok());
  // A router that is stopped keeps its connection (the kernel answers for it) but answers nothing.
  cluster.router->Pause();
  const auto start = std::chrono::steady_clock::now();
  const absl::StatusOr<ForwardResult> late = (*timed)->Forward(args);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO(late.status() << " after " << waited << " s");
  CHECK(late.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(waited < 20);  // the timeout, not keepalive's 50 s nor forever
  CHECK((*timed)->Forward(args).status().code() == absl::StatusCode::kFailedPrecondition);  // closed
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    (*cancelled)->Cancel();
  });
  CHECK((*cancelled)->Forward(args).status().code() == absl::StatusCode::kCancelled);
  canceller.join();
  cluster.router->Signal(SIGCONT);

  // Proxyless: Cancel ends the Forward in progress (on nodes that answer
  // nothing it would end only at the node timeout, UNAVAILABLE), and every later one.
  auto direct = ConnectDirect(cluster.dir / "model", {Loopback(cluster.port_a), Loopback(cluster.port_b)});
  auto direct_session = direct->OpenSession();
  REQUIRE(direct_session.ok());
  REQUIRE((*direct_session)->Forward(args).ok());
  cluster.a->Pause();
  cluster.b->Pause();
  std::thread direct_canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    (*direct_session)->Cancel();
  });
  const absl::Status stopped = (*direct_session)->Forward(args).status();
  direct_canceller.join();
  cluster.a->Signal(SIGCONT);
  cluster.b->Signal(SIGCONT);
  INFO(stopped);
  CHECK(stopped.code() == absl::StatusCode::kCancelled);
  CHECK((*direct_session)->Forward(args).status().code() == absl::StatusCode::kCancelled);
  CHECK((*direct_session)->Close().code() == absl::StatusCode::kCancelled);  // as a router session's
}

TEST_CASE("errors carry the server's code and message, and a missing router fails Connect clearly") {
  Cluster cluster;
  auto client = cluster.Connect();
  const std::vector<float> x = Hidden(2, 3);
  ForwardArgs args;
  args.layer = 7;
  args.token_ids = {1, 2};
  args.hidden = x;
  absl::Status s = client->Forward(args).status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.message().find("layer 7 is outside [0, 2)") != absl::string_view::npos);
  args.layer = 0;
  args.hidden = absl::MakeConstSpan(x.data(), 47);
  s = client->Forward(args).status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.message().find("multiple of d_model 48") != absl::string_view::npos);

  ClientOptions nowhere;
  nowhere.target = "127.0.0.1:1";
  nowhere.connect_timeout = absl::Seconds(2);
  absl::StatusOr<std::unique_ptr<Client>> none = Client::Connect(nowhere);
  REQUIRE(!none.ok());
  CHECK(none.status().code() == absl::StatusCode::kUnavailable);
  CHECK(none.status().message().find("127.0.0.1:1") != absl::string_view::npos);
}

TEST_CASE("no timeout means no deadline, bad proxyless options are refused, a reply of the wrong size is an error") {
  Cluster cluster;
  ClientOptions forever;
  forever.target = "127.0.0.1:" + std::to_string(cluster.port);
  forever.timeout = forever.connect_timeout = absl::InfiniteDuration();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(forever);
  INFO(client.status().message());
  REQUIRE(client.ok());
  const std::vector<float> x = Hidden(3, 5);
  ForwardArgs args;
  args.layer = 0;
  args.token_ids = {1, 2, 3};
  args.hidden = x;
  args.return_routes = true;
  absl::StatusOr<ForwardResult> r = (*client)->Forward(args);
  INFO(r.status().message());
  REQUIRE(r.ok());

  // A reply for 2 tokens to a request of 3, or with routes for fewer: INTERNAL, not a short buffer.
  absl::StatusOr<v1::ForwardRequest> request = (*client)->MakeRequest(args);
  REQUIRE(request.ok());
  v1::ForwardResponse reply;
  reply.mutable_output()->set_dtype(v1::DATA_TYPE_F32);
  reply.mutable_output()->add_shape(2);
  reply.mutable_output()->add_shape(48);
  reply.mutable_output()->set_data(std::string(2 * 48 * 4, '\0'));
  absl::StatusOr<ForwardResult> short_reply = (*client)->ReadResponse(*request, reply);
  CHECK(short_reply.status().code() == absl::StatusCode::kInternal);
  CHECK_THAT(std::string(short_reply.status().message()), Catch::Contains("output is not [3, 48]"));
  reply.mutable_output()->set_shape(0, 3);
  reply.mutable_output()->set_data(std::string(3 * 48 * 4, '\0'));
  reply.mutable_routes()->set_top_k(2);
  reply.mutable_routes()->add_expert_ids(0);
  reply.mutable_routes()->add_weights(1.f);
  absl::StatusOr<ForwardResult> few_routes = (*client)->ReadResponse(*request, reply);
  CHECK(few_routes.status().code() == absl::StatusCode::kInternal);
  CHECK_THAT(std::string(few_routes.status().message()), Catch::Contains("routes are not 3 tokens x top_k 2"));

  ClientOptions direct;
  direct.direct.model_dir = cluster.dir / "model";
  direct.direct.nodes = {Loopback(cluster.port_a)};
  direct.direct.node_timeout = absl::ZeroDuration();
  absl::Status refused = Client::Connect(direct).status();
  CHECK(refused.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.message()), Catch::Contains("node_timeout 0 must be positive"));
  direct.direct.node_timeout = absl::Seconds(1);
  direct.direct.max_tokens = int64_t{1} << 40;
  refused = Client::Connect(direct).status();
  CHECK(refused.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.message()), Catch::Contains("max_tokens 1099511627776 is not in [1, 2^24]"));
  // The router's TLS fields are not the nodes': refused, not ignored (plaintext to the nodes).
  direct.direct.max_tokens = 64;
  direct.tls_cert_file = "client.crt";
  refused = Client::Connect(direct).status();
  CHECK(refused.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.message()), Catch::Contains("direct.node_tls_"));
  // Nodes with a router target: the nodes would be ignored.
  ClientOptions both = forever;
  both.direct.nodes = {Loopback(cluster.port_a)};
  refused = Client::Connect(both).status();
  CHECK(refused.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.message()), Catch::Contains("need direct.model_dir"));
  // A call over the proxyless token limit names the field the caller set.
  direct.tls_cert_file.clear();
  direct.direct.max_tokens = 2;
  absl::StatusOr<std::unique_ptr<Client>> small = Client::Connect(direct);
  REQUIRE(small.ok());
  const absl::Status over = (*small)->Forward(args).status();
  CHECK(over.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(over.message()), Catch::Contains("ClientOptions::direct.max_tokens"));

  // Nodes that answer but serve another model: the proxyless caller, its own
  // operator, is told which nodes and why (a router tells only its admins).
  tools::SynthOptions other_synth = colibri::testing::SmallSynth(cluster.dir / "other_ckpt");
  other_synth.seed = 8;
  colibri::testing::MakeModel(other_synth, cluster.dir / "other", common::DType::kBF16);
  ClientOptions other;
  other.direct.model_dir = cluster.dir / "other";
  other.direct.nodes = {Loopback(cluster.port_a), Loopback(cluster.port_b)};
  absl::StatusOr<std::unique_ptr<Client>> mismatched = Client::Connect(other);
  REQUIRE(mismatched.ok());
  // Until a health round reached node a (a slow build's first probe may time out instead).
  for (int i = 0; i < 300; ++i) {
    absl::StatusOr<v1::GetClusterStatusResponse> status = (*mismatched)->ClusterStatus();
    REQUIRE(status.ok());
    if (status->nodes(0).last_error().find("serves model") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const absl::Status unserved = (*mismatched)->Forward(args).status();
  INFO(unserved.message());
  CHECK(unserved.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(unserved.message()),
             Catch::Contains("nodes not live: " + Loopback(cluster.port_a) + ": serves model "));
}

TEST_CASE("tensor helpers pack and unpack f32, bf16 and f16") {
  const std::vector<float> v = {1.0f, -2.5f, 3.14159f, 1e-3f};
  absl::StatusOr<std::vector<float>> f = Unpack(PackF32(v, 2, 2));
  REQUIRE(f.ok());
  CHECK(*f == v);
  absl::StatusOr<std::vector<float>> b = Unpack(PackBf16(v, 2, 2));
  REQUIRE(b.ok());
  CHECK((*b)[0] == 1.0f);
  CHECK((*b)[1] == -2.5f);
  CHECK(std::abs((*b)[2] - 3.14159f) < 0.02f);
  v1::Tensor bad = PackF32(v, 2, 2);
  bad.mutable_data()->pop_back();
  CHECK(Unpack(bad).status().code() == absl::StatusCode::kInvalidArgument);
  v1::Tensor half;
  half.set_dtype(v1::DATA_TYPE_F16);
  half.add_shape(1);
  half.set_data(std::string("\x00\x3c", 2));  // 1.0 in f16
  absl::StatusOr<std::vector<float>> one = Unpack(half);
  REQUIRE(one.ok());
  CHECK((*one)[0] == 1.0f);
}

}  // namespace
}  // namespace client
}  // namespace colibri
