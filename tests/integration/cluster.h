#ifndef COLIBRI_TESTS_INTEGRATION_CLUSTER_H_
#define COLIBRI_TESTS_INTEGRATION_CLUSTER_H_

// Helpers for tests that run colibri-expert and colibri-router as real
// processes on 127.0.0.1 (ProcessGuard kills them when the test ends, however
// it ends): start them, call the router, poll for a condition, and drive a
// steady load from client threads.

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "colibri/v1/router.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/test_util.h"

namespace colibri {
namespace testing {

namespace v1 = colibri::v1;
using Clock = std::chrono::steady_clock;

inline constexpr int64_t kDModel = 48;  // SmallSynth's

inline std::string Address(int port) { return "127.0.0.1:" + std::to_string(port); }

struct Proc {
  std::unique_ptr<ProcessGuard> process;
  int port = 0;
};

inline Proc StartNode(const std::string& model, const std::string& experts, int port = 0,
                      const std::vector<std::string>& extra = {}) {
  Proc p;
  std::vector<std::string> args = {Binary("expert_node/colibri-expert"), "--model=" + model,  "--experts=" + experts,
                                   "--listen=" + Address(port),          "--residency=paged", "--threads=1"};
  args.insert(args.end(), extra.begin(), extra.end());
  p.process = std::make_unique<ProcessGuard>(args);
  p.port = p.process->ReadPort();
  return p;
}

inline Proc StartRouter(std::vector<std::string> args, int port = 0) {
  // A health check a loaded machine (a sanitizer build, -j2) answers late
  // must not take a node out of the map under a test that counts failures;
  // first, so that a test's own value (later on the line) wins.
  args.insert(args.begin(), "--health_timeout_ms=5000");
  args.insert(args.begin(), Binary("router_node/colibri-router"));
  args.push_back("--listen=" + Address(port));
  if (std::none_of(args.begin(), args.end(),
                   [](const std::string& a) { return a.rfind("--health_interval_ms", 0) == 0; })) {
    args.push_back("--health_interval_ms=100");
  }
  Proc p;
  p.process = std::make_unique<ProcessGuard>(args);
  p.port = p.process->ReadPort();
  // A distributed router serves once its health checks reached the nodes
  // (slow builds, e.g. TSan, take a while); tests that expect it not to
  // serve wait for that themselves.
  auto stub = v1::Router::NewStub(grpc::CreateChannel(Address(p.port), grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 200; ++i) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::GetClusterStatusResponse status;
    if (stub->GetClusterStatus(&context, v1::GetClusterStatusRequest(), &status).ok() && status.serving()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return p;
}

inline std::unique_ptr<v1::Router::Stub> Connect(int port) {
  return v1::Router::NewStub(grpc::CreateChannel(Address(port), grpc::InsecureChannelCredentials()));
}

inline v1::ForwardRequest Request(int32_t layer, const std::vector<int32_t>& ids, uint32_t seed,
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

inline grpc::Status Call(v1::Router::Stub& stub, const v1::ForwardRequest& request, v1::ForwardResponse* response,
                         std::chrono::milliseconds timeout = std::chrono::milliseconds(10000)) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  return stub.Forward(&context, request, response);
}

inline v1::GetClusterStatusResponse Status(v1::Router::Stub& stub) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::GetClusterStatusResponse status;
  REQUIRE(stub.GetClusterStatus(&context, v1::GetClusterStatusRequest(), &status).ok());
  return status;
}

// grpc.health.v1's answer for `service` ("": the server as a whole).
inline grpc::health::v1::HealthCheckResponse::ServingStatus Health(int port, const std::string& service = "") {
  auto health =
      grpc::health::v1::Health::NewStub(grpc::CreateChannel(Address(port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  REQUIRE(health->Check(&context, request, &response).ok());
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

// The answers (output bytes) of a local-mode router on `model` to `requests`.
inline std::vector<std::string> LocalAnswers(const std::string& model,
                                             const std::vector<v1::ForwardRequest>& requests) {
  Proc local = StartRouter({"--local=" + model, "--threads=1"});
  auto stub = Connect(local.port);
  std::vector<std::string> answers;
  for (const v1::ForwardRequest& request : requests) {
    v1::ForwardResponse response;
    REQUIRE(Call(*stub, request, &response).ok());
    answers.push_back(response.output().data());
  }
  return answers;
}

// Runs a shell command with its output to the file `out`, prints both, and
// returns its exit status.
inline int RunCommand(const std::string& command, const std::string& out) {
  const int status = std::system((command + " >" + out + " 2>&1").c_str());
  std::printf("%s -> %d:\n%s", command.c_str(), WEXITSTATUS(status), ReadFile(out).c_str());
  return WEXITSTATUS(status);
}

struct Model {
  TempDir dir;
  std::string path;
  explicit Model(common::DType type) : path(dir / "model") {
    colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), path, type);
  }
};

// Sends request(c, i) from `threads` clients c until Stop(), i = 0, 1, …
// per client, counting failures (the first error kept); every answer goes to
// check(c, i, response, flag), flag being what flag() returned just
// before that call was sent. `check` runs on the client threads.
struct AnswerLoad {
  std::atomic<bool> stop{false};
  std::atomic<int> failed{0};
  std::string first_error;
  std::mutex mu;
  std::vector<std::thread> clients;

  void Start(
      int port, int threads, std::function<v1::ForwardRequest(int, int)> request,
      std::function<void(int, int, const v1::ForwardResponse&, bool)> check,
      std::function<bool()> flag = [] { return false; }) {
    for (int c = 0; c < threads; ++c) {
      clients.emplace_back([this, port, c, request, check, flag] {
        auto stub = Connect(port);
        for (int i = 0; !stop; ++i) {
          const bool flagged = flag();
          v1::ForwardResponse response;
          const grpc::Status s = Call(*stub, request(c, i), &response);
          if (s.ok()) {
            check(c, i, response, flagged);
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

// Gate-routed calls of 4 tokens on alternating layers from `threads`
// clients until Stop(), counted by outcome.
struct Load : AnswerLoad {
  std::atomic<int> ok{0};

  void Start(int port, int threads) {
    AnswerLoad::Start(
        port, threads,
        [](int c, int i) {
          return Request(i % 2, {static_cast<int32_t>((i * 7 + c) % 64), 3, 9, 33}, i, v1::ROUTING_MODE_GATE);
        },
        [this](int, int, const v1::ForwardResponse&, bool) { ++ok; });
  }
};

}  // namespace testing
}  // namespace colibri

#endif  // COLIBRI_TESTS_INTEGRATION_CLUSTER_H_
