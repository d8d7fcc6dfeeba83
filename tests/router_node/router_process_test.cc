// colibri-router and colibri-expert as real processes on 127.0.0.1:0, called
// through the public Router service:
//  - a distributed router (2 nodes, experts split, one expert replicated)
//    answers byte for byte like a local router, in every routing mode;
//  - kill -9 of one of two replicas under load fails no request, and the node
//    is used again once it is back;
//  - with no replica left, requests fail UNAVAILABLE naming the layer and the
//    expert, health says NOT_SERVING, and both recover when the node returns;
//  - malformed requests get INVALID_ARGUMENT naming the field; ForwardStream
//    answers in order and survives a bad request.
// Every process is killed when its ProcessGuard goes out of scope.

#include <signal.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "colibri/v1/router.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/test_util.h"

namespace colibri {
namespace router_node {
namespace {

using colibri::testing::Binary;
using colibri::testing::ProcessGuard;
using colibri::testing::TempDir;
namespace v1 = colibri::v1;
using Clock = std::chrono::steady_clock;

constexpr int64_t kDModel = 48;

std::string Address(int port) { return "127.0.0.1:" + std::to_string(port); }

struct Proc {
  std::unique_ptr<ProcessGuard> process;
  int port = 0;
};

Proc StartNode(const std::string& model, const std::string& experts, int port = 0) {
  Proc p;
  p.process = std::make_unique<ProcessGuard>(std::vector<std::string>{
      Binary("expert_node/colibri-expert"), "--model=" + model, "--experts=" + experts,
      "--listen=" + Address(port), "--nomlock", "--threads=1"});
  p.port = p.process->ReadPort();
  return p;
}

Proc StartRouter(std::vector<std::string> args) {
  args.insert(args.begin(), Binary("router_node/colibri-router"));
  args.push_back("--listen=127.0.0.1:0");
  args.push_back("--health_interval_ms=100");
  Proc p;
  p.process = std::make_unique<ProcessGuard>(args);
  p.port = p.process->ReadPort();
  return p;
}

std::unique_ptr<v1::Router::Stub> Connect(int port) {
  return v1::Router::NewStub(grpc::CreateChannel(Address(port), grpc::InsecureChannelCredentials()));
}

v1::ForwardRequest Request(int32_t layer, const std::vector<int32_t>& ids, uint32_t seed,
                           v1::RoutingMode routing = v1::ROUTING_MODE_LUT) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(ids.size() * kDModel);
  for (float& v : x) v = normal(rng);
  v1::ForwardRequest r;
  r.set_layer(layer);
  for (const int32_t id : ids) r.add_token_ids(id);
  r.mutable_hidden()->set_dtype(v1::DATA_TYPE_F32);
  r.mutable_hidden()->add_shape(static_cast<int64_t>(ids.size()));
  r.mutable_hidden()->add_shape(kDModel);
  r.mutable_hidden()->set_data(reinterpret_cast<const char*>(x.data()), x.size() * 4);
  r.set_routing(routing);
  r.set_return_routes(true);
  return r;
}

grpc::Status Call(v1::Router::Stub& stub, const v1::ForwardRequest& request, v1::ForwardResponse* response,
                  std::chrono::milliseconds timeout = std::chrono::milliseconds(10000)) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  return stub.Forward(&context, request, response);
}

v1::GetClusterStatusResponse Status(v1::Router::Stub& stub) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::GetClusterStatusResponse status;
  REQUIRE(stub.GetClusterStatus(&context, v1::GetClusterStatusRequest(), &status).ok());
  return status;
}

grpc::health::v1::HealthCheckResponse::ServingStatus Health(int port) {
  auto health = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(Address(port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::health::v1::HealthCheckResponse response;
  REQUIRE(health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response).ok());
  return response.status();
}

// Polls `done` every 50 ms for up to 15 s; returns whether it became true.
template <typename F>
bool WaitFor(F done) {
  const auto until = Clock::now() + std::chrono::seconds(15);
  while (Clock::now() < until) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

struct Model {
  TempDir dir;
  std::string path;
  explicit Model(common::DType type) : path(dir / "model") {
    colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), path, type);
  }
};

TEST_CASE("a distributed router answers byte for byte like a local one, in every routing mode") {
  for (common::DType type : {common::DType::kBF16, common::DType::kInt4}) {
    Model model(type);
    Proc a = StartNode(model.path, "0-2");
    Proc b = StartNode(model.path, "2-3");  // expert 2 on both nodes
    Proc distributed = StartRouter({"--model=" + model.path, "--experts-at=" + Address(a.port) + "," + Address(b.port)});
    Proc local = StartRouter({"--local=" + model.path, "--threads=1"});
    auto remote_stub = Connect(distributed.port);
    auto local_stub = Connect(local.port);

    CHECK(Health(distributed.port) == grpc::health::v1::HealthCheckResponse::SERVING);
    const v1::GetClusterStatusResponse status = Status(*remote_stub);
    REQUIRE(status.nodes_size() == 2);
    CHECK(status.nodes(0).live());
    CHECK(status.nodes(1).live());
    CHECK(status.serving());
    CHECK(status.experts(2).live_replicas() == 2);  // layer 0 expert 2
    CHECK(status.experts(3).live_replicas() == 1);

    int compared = 0;
    for (int32_t layer = 0; layer < 2; ++layer) {
      for (const std::vector<int32_t>& ids :
           {std::vector<int32_t>{7}, std::vector<int32_t>{1, 2, 3, 4}, std::vector<int32_t>(37, 5)}) {
        std::vector<int32_t> varied = ids;
        for (size_t i = 0; i < varied.size(); ++i) varied[i] = (varied[i] + static_cast<int32_t>(i) * 13) % 64;
        for (v1::RoutingMode mode : {v1::ROUTING_MODE_LUT, v1::ROUTING_MODE_GATE}) {
          v1::ForwardRequest request = Request(layer, varied, 100 + compared, mode);
          v1::ForwardResponse remote, in_process;
          grpc::Status s = Call(*remote_stub, request, &remote);
          INFO(s.error_message());
          REQUIRE(s.ok());
          REQUIRE(Call(*local_stub, request, &in_process).ok());
          CHECK(remote.output().data() == in_process.output().data());
          CHECK(std::vector<int32_t>(remote.routes().expert_ids().begin(), remote.routes().expert_ids().end()) ==
                std::vector<int32_t>(in_process.routes().expert_ids().begin(), in_process.routes().expert_ids().end()));
          // The same routes sent by the client give the same bytes again.
          request.set_routing(v1::ROUTING_MODE_CLIENT);
          *request.mutable_routes() = remote.routes();
          v1::ForwardResponse client;
          REQUIRE(Call(*remote_stub, request, &client).ok());
          CHECK(client.output().data() == remote.output().data());
          ++compared;
        }
      }
    }
    std::printf("distributed vs local (%s): %d requests, byte-identical\n", common::DTypeName(type).c_str(), compared);
    // Both nodes did work: the plan really split the layer.
    const v1::GetClusterStatusResponse after = Status(*remote_stub);
    CHECK(after.nodes(0).calls() > 0);
    CHECK(after.nodes(1).calls() > 0);
  }
}

// Sends Forward calls from `threads` clients until `stop`; counts outcomes.
struct Load {
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, failed{0};
  std::string first_error;
  std::mutex mu;
  std::vector<std::thread> clients;

  void Start(int port, int threads) {
    for (int c = 0; c < threads; ++c) {
      clients.emplace_back([this, port, c] {
        auto stub = Connect(port);
        for (int i = 0; !stop; ++i) {
          const v1::ForwardRequest request =
              Request(i % 2, {static_cast<int32_t>((i * 7 + c) % 64), 3, 9, 33}, i, v1::ROUTING_MODE_GATE);
          v1::ForwardResponse response;
          const grpc::Status s = Call(*stub, request, &response);
          if (s.ok()) {
            ++ok;
          } else {
            ++failed;
            std::lock_guard<std::mutex> lock(mu);
            if (first_error.empty()) first_error = s.error_message();
          }
        }
      });
    }
  }
  void Stop() {
    stop = true;
    for (std::thread& t : clients) t.join();
  }
};

TEST_CASE("killing one of two replicas under load fails no request, and its return is picked up") {
  Model model(common::DType::kBF16);
  Proc a = StartNode(model.path, "all");
  Proc b = StartNode(model.path, "all");
  Proc router = StartRouter({"--model=" + model.path, "--experts_at=" + Address(a.port) + "," + Address(b.port)});
  auto stub = Connect(router.port);

  Load load;
  load.Start(router.port, 3);
  REQUIRE(WaitFor([&] { return load.ok > 50; }));
  const int before_kill = load.ok;
  a.process->Signal(SIGKILL);
  REQUIRE(WaitFor([&] { return load.ok > before_kill + 200; }));
  const int a_port = a.port;
  a = Proc();  // reaped
  CHECK(WaitFor([&] { return !Status(*stub).nodes(0).live(); }));
  // The node comes back on its port: the router uses it again, no restart.
  Proc again = StartNode(model.path, "all", a_port);
  CHECK(WaitFor([&] { return Status(*stub).nodes(0).live(); }));
  const int64_t calls_back = Status(*stub).nodes(0).calls();
  CHECK(WaitFor([&] { return Status(*stub).nodes(0).calls() > calls_back + 10; }));
  load.Stop();
  std::printf("kill -9 of a replica under load: %d requests ok, %d failed, retries %lld\n", load.ok.load(),
              load.failed.load(), static_cast<long long>(Status(*stub).retries()));
  INFO("first error: " << load.first_error);
  CHECK(load.failed == 0);
  CHECK(Health(router.port) == grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_CASE("with no replica left, requests fail UNAVAILABLE naming the expert, then recover") {
  Model model(common::DType::kBF16);
  Proc a = StartNode(model.path, "0-1");
  Proc b = StartNode(model.path, "2-3");
  Proc router = StartRouter({"--model=" + model.path, "--experts_at=" + Address(a.port) + "," + Address(b.port)});
  auto stub = Connect(router.port);

  v1::ForwardRequest needs_b = Request(1, {1, 2}, 1, v1::ROUTING_MODE_CLIENT);
  needs_b.mutable_routes()->set_top_k(2);
  for (int32_t e : {0, 3, 1, 2}) needs_b.mutable_routes()->add_expert_ids(e);
  for (int i = 0; i < 4; ++i) needs_b.mutable_routes()->add_weights(0.5f);
  v1::ForwardRequest only_a = needs_b;
  only_a.mutable_routes()->set_expert_ids(1, 1);
  only_a.mutable_routes()->set_expert_ids(3, 0);
  v1::ForwardResponse response;
  REQUIRE(Call(*stub, needs_b, &response).ok());

  const int b_port = b.port;
  b.process->Signal(SIGKILL);
  b = Proc();
  const auto start = Clock::now();
  const grpc::Status failed = Call(*stub, needs_b, &response, std::chrono::milliseconds(5000));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  INFO(failed.error_message());
  CHECK(failed.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(failed.error_message().find("layer 1 expert") != std::string::npos);
  CHECK(seconds < 5.0);
  // Experts on the live node still serve; health says not every expert is covered.
  CHECK(Call(*stub, only_a, &response).ok());
  CHECK(WaitFor([&] { return Health(router.port) == grpc::health::v1::HealthCheckResponse::NOT_SERVING; }));

  Proc again = StartNode(model.path, "2-3", b_port);
  CHECK(WaitFor([&] { return Call(*stub, needs_b, &response).ok(); }));
  CHECK(WaitFor([&] { return Health(router.port) == grpc::health::v1::HealthCheckResponse::SERVING; }));
  std::printf("no replica: UNAVAILABLE after %.3f s (\"%s\"), recovered after the node's return\n", seconds,
              failed.error_message().c_str());
}

TEST_CASE("a hung node (SIGSTOP) is failed over by the node timeout, and without a replica the client's deadline holds") {
  Model model(common::DType::kBF16);
  Proc a = StartNode(model.path, "all");
  Proc b = StartNode(model.path, "all");
  Proc router = StartRouter({"--model=" + model.path, "--experts_at=" + Address(a.port) + "," + Address(b.port),
                             "--node_timeout_ms=300"});
  auto stub = Connect(router.port);
  const v1::ForwardRequest request = Request(0, {1, 2, 3, 4, 5, 6, 7, 8}, 5, v1::ROUTING_MODE_GATE);
  v1::ForwardResponse response;
  REQUIRE(Call(*stub, request, &response).ok());

  a.process->Pause();  // alive (the socket accepts) but never answers
  int ok = 0;
  double slowest = 0;
  for (int i = 0; i < 10; ++i) {
    const auto start = Clock::now();
    const grpc::Status s = Call(*stub, request, &response, std::chrono::milliseconds(5000));
    slowest = std::max(slowest, std::chrono::duration<double>(Clock::now() - start).count());
    INFO(s.error_message());
    CHECK(s.ok());
    ok += s.ok();
  }
  CHECK(slowest < 3.0);

  b.process->Pause();  // now no replica answers: the client's 500 ms deadline bounds the call
  const auto start = Clock::now();
  const grpc::Status s = Call(*stub, request, &response, std::chrono::milliseconds(500));
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  INFO(s.error_message());
  CHECK((s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED || s.error_code() == grpc::StatusCode::UNAVAILABLE));
  CHECK(waited < 2.0);
  a.process->Signal(SIGCONT);
  b.process->Signal(SIGCONT);
  CHECK(WaitFor([&] { return Call(*stub, request, &response).ok(); }));
  std::printf("SIGSTOPped replica: %d/10 calls ok (slowest %.3f s); both stopped: code %d after %.3f s\n", ok, slowest,
              static_cast<int>(s.error_code()), waited);
}

TEST_CASE("the router exports Prometheus metrics: requests, stages, tokens per expert, node calls") {
  Model model(common::DType::kBF16);
  Proc a = StartNode(model.path, "all");
  Proc router = StartRouter({"--model=" + model.path, "--experts_at=" + Address(a.port), "--metrics_port=0",
                             "--metrics_host=127.0.0.1"});
  const std::string line = router.process->ReadLine();
  INFO(line);
  REQUIRE(line.find("metrics on port ") != std::string::npos);
  const int metrics_port = std::stoi(line.substr(line.find("metrics on port ") + 16));
  auto stub = Connect(router.port);
  v1::ForwardResponse response;
  REQUIRE(Call(*stub, Request(0, {1, 2, 3}, 1), &response).ok());
  CHECK(!Call(*stub, Request(0, {99}, 1), &response).ok());
  const std::string metrics = colibri::testing::HttpGet(metrics_port, "/metrics");
  INFO(metrics);
  CHECK(metrics.find("colibri_router_requests_total{code=\"0\",method=\"Forward\"} 1") != std::string::npos);
  CHECK(metrics.find("colibri_router_requests_total{code=\"3\",method=\"Forward\"} 1") != std::string::npos);
  for (const char* stage : {"route", "dispatch", "slowest_node", "aggregate", "total"}) {
    CHECK(metrics.find(std::string("colibri_router_stage_seconds_count{stage=\"") + stage + "\"} 1") !=
          std::string::npos);
  }
  CHECK(metrics.find("colibri_router_expert_tokens_total{expert=\"0\",layer=\"0\"}") != std::string::npos);
  CHECK(metrics.find("colibri_router_node_calls_total{code=\"0\",node=\"" + Address(a.port) + "\"} 1") !=
        std::string::npos);
  CHECK(metrics.find("colibri_router_live_nodes 1") != std::string::npos);
}

TEST_CASE("malformed requests get INVALID_ARGUMENT naming the field, and a stream survives one") {
  Model model(common::DType::kF32);
  Proc router = StartRouter({"--local=" + model.path, "--threads=1"});
  auto stub = Connect(router.port);
  auto expect = [&](const v1::ForwardRequest& request, const std::string& needle) {
    v1::ForwardResponse response;
    const grpc::Status s = Call(*stub, request, &response);
    INFO("expected '" << needle << "', got: " << s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(s.error_message().find(needle) != std::string::npos);
  };
  expect(Request(0, {1, 64}, 1), "token_ids[1] = 64");
  expect(Request(5, {1}, 1), "layer 5");
  v1::ForwardRequest r = Request(0, {1, 2}, 1);
  r.mutable_hidden()->set_shape(1, 47);
  expect(r, "hidden.shape [2, 47]");
  r = Request(0, {1, 2}, 1);
  r.mutable_hidden()->mutable_data()->resize(10);
  expect(r, "hidden.data has 10 bytes");
  r = Request(0, {1, 2}, 1);
  r.set_routing(static_cast<v1::RoutingMode>(9));
  expect(r, "routing 9");
  r = Request(0, {1}, 1, v1::ROUTING_MODE_CLIENT);
  r.mutable_routes()->set_top_k(2);
  r.mutable_routes()->add_expert_ids(1);
  r.mutable_routes()->add_expert_ids(1);
  r.mutable_routes()->add_weights(0.5f);
  r.mutable_routes()->add_weights(0.5f);
  expect(r, "expert repeated for token 0");
  r.mutable_routes()->set_expert_ids(1, 9);
  expect(r, "routes.expert_ids[1] = 9");
  r.mutable_routes()->set_expert_ids(1, 2);
  r.mutable_routes()->set_weights(0, std::numeric_limits<float>::quiet_NaN());
  expect(r, "routes.weights[0] = nan");

  // A stream: replies in order, the bad one carries its error, the stream goes on.
  grpc::ClientContext context;
  auto stream = stub->ForwardStream(&context);
  for (int i = 0; i < 6; ++i) {
    v1::ForwardRequest request = Request(i % 2, {static_cast<int32_t>(i == 3 ? 99 : i)}, i);
    request.set_request_id("req-" + std::to_string(i));
    REQUIRE(stream->Write(request));
  }
  stream->WritesDone();
  v1::ForwardStreamResponse reply;
  for (int i = 0; i < 6; ++i) {
    REQUIRE(stream->Read(&reply));
    CHECK(reply.request_id() == "req-" + std::to_string(i));
    if (i == 3) {
      CHECK(reply.code() == static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
      CHECK(reply.message().find("token_ids[0] = 99") != std::string::npos);
    } else {
      CHECK(reply.code() == 0);
      CHECK(reply.response().output().data().size() == kDModel * 4);
    }
  }
  CHECK(!stream->Read(&reply));
  CHECK(stream->Finish().ok());

  grpc::ClientContext info_context;
  v1::GetModelInfoResponse info;
  REQUIRE(stub->GetModelInfo(&info_context, v1::GetModelInfoRequest(), &info).ok());
  CHECK(info.d_model() == kDModel);
  CHECK(info.n_experts() == 4);
  CHECK(info.vocab_size() == 64);
  CHECK(info.backend() == "local");
  CHECK(info.model_id().rfind("xxh3_128:", 0) == 0);
  CHECK(router.process->SignalAndWait(SIGTERM, std::chrono::seconds(15)) == 0);
}

}  // namespace
}  // namespace router_node
}  // namespace colibri
