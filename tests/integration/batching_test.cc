// Merging concurrent calls (docs/ROUTER.md, "Merging concurrent calls") with
// real processes on 127.0.0.1: a router that merges, in front of two
// replicated nodes, under concurrent streams of different token counts,
// layers, routing modes (client routes too) and dtypes. Every answer must be
// the local engine's bytes; a replica killed (kill -9) under merged load, and
// callers that give up early, must fail none of the others.

#include <signal.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdio>

#include "common/half.h"
#include "tests/integration/cluster.h"

namespace colibri {
namespace {

using namespace colibri::testing;  // NOLINT: the cluster helpers
namespace v1 = colibri::v1;

// SmallSynth's shape: 2 layers, 4 experts, top-2, vocab 64.
constexpr int kTopK = 2;
constexpr int kExperts = 4;

// Request `n` of the mix: 1, 2, 3 or 5 tokens, layer 0 or 1, lut, gate or
// client routes, f32 or bf16 in and out.
v1::ForwardRequest Mixed(int n) {
  static const int kTokens[] = {1, 2, 1, 3, 1, 5};
  const int tokens = kTokens[n % 6];
  std::vector<int32_t> ids;
  for (int t = 0; t < tokens; ++t) ids.push_back((n * 13 + t * 7) % 64);
  const v1::RoutingMode routing = n % 3 == 0   ? v1::ROUTING_MODE_LUT
                                  : n % 3 == 1 ? v1::ROUTING_MODE_GATE
                                               : v1::ROUTING_MODE_CLIENT;
  v1::ForwardRequest r = Request(n % 2, ids, 100 + n, routing);
  r.set_return_timings(true);
  if (routing == v1::ROUTING_MODE_CLIENT) {
    v1::Routes* routes = r.mutable_routes();
    routes->set_top_k(kTopK);
    for (int t = 0; t < tokens; ++t) {
      for (int j = 0; j < kTopK; ++j) {
        routes->add_expert_ids((n + t + 2 * j) % kExperts);
        routes->add_weights(0.4f + 0.3f * static_cast<float>(j));
      }
    }
  }
  if (n % 4 == 1) {  // bf16 in and out
    const std::string& f32 = r.hidden().data();
    std::string bf16(f32.size() / 2, '\0');
    for (size_t i = 0; i < f32.size() / 4; ++i) {
      float v;
      std::memcpy(&v, &f32[4 * i], 4);
      const uint16_t h = common::FloatToBf16(v);
      std::memcpy(&bf16[2 * i], &h, 2);
    }
    r.mutable_hidden()->set_dtype(v1::DATA_TYPE_BF16);
    r.mutable_hidden()->set_data(bf16);
    r.set_output_dtype(v1::DATA_TYPE_BF16);
  }
  return r;
}

constexpr int kMix = 24;

std::vector<v1::ForwardRequest> MixedRequests() {
  std::vector<v1::ForwardRequest> requests;
  for (int n = 0; n < kMix; ++n) requests.push_back(Mixed(n));
  return requests;
}

// "callers N" of the response's queue span: how many calls it was merged with (1: alone).
int MergedCallers(const v1::ForwardResponse& response) {
  for (const v1::Timing& t : response.timings()) {
    if (t.stage() == "queue") return std::atoi(t.detail().c_str() + std::string("callers ").size());
  }
  return 0;
}

// Streams of the mix from `threads` clients, every answer compared with the local one.
struct MixedLoad : AnswerLoad {
  std::vector<std::string> local;
  std::atomic<int> ok{0}, wrong{0}, merged{0}, told_experts{0};

  void Start(int port, int threads) {
    AnswerLoad::Start(
        port, threads, [](int c, int i) { return Mixed((c * 5 + i) % kMix); },
        [this](int c, int i, const v1::ForwardResponse& response, bool) {
          ++ok;
          if (response.output().data() != local[(c * 5 + i) % kMix]) ++wrong;
          if (MergedCallers(response) <= 1) return;
          ++merged;
          for (const v1::Timing& t : response.timings()) {  // a merged call's experts are not one caller's
            if (t.detail().find("experts") != std::string::npos) ++told_experts;
          }
        });
  }
};

TEST_CASE("merged calls from concurrent streams each answer the local engine's bytes, through a kill -9") {
  Model model(common::DType::kBF16);
  const std::vector<std::string> local = LocalAnswers(model.path, MixedRequests());
  Proc a = StartNode(model.path, "all");
  Proc b = StartNode(model.path, "all");
  Proc router = StartRouter(
      {"--model=" + model.path, "--experts_at=" + Address(a.port) + "," + Address(b.port), "--batch_window_us=2000"});
  auto stub = Connect(router.port);

  MixedLoad load;
  load.local = local;
  load.Start(router.port, 6);
  REQUIRE(WaitFor([&] { return load.ok > 300 && load.merged > 20; }));
  const int before_kill = load.ok;
  a.process->Signal(SIGKILL);
  REQUIRE(WaitFor([&] { return load.ok > before_kill + 300; }));
  load.Stop();
  std::printf("merged load, kill -9 of a replica: %d answers (%d merged with others), %d wrong, %d failed\n",
              load.ok.load(), load.merged.load(), load.wrong.load(), load.failed.load());
  INFO("first error: " << load.first_error);
  CHECK(load.failed == 0);
  CHECK(load.wrong == 0);
  CHECK(load.merged > 0);
  CHECK(load.told_experts == 0);  // a merged caller's node spans name no experts
}

TEST_CASE("callers that give up while merged fail none of the calls merged with them") {
  Model model(common::DType::kBF16);
  const std::vector<std::string> local = LocalAnswers(model.path, MixedRequests());
  Proc a = StartNode(model.path, "all");
  // What is tested is the calls, not health checks: a check is given time
  // even on a slow (sanitizer) build under this load.
  Proc router = StartRouter({"--model=" + model.path, "--experts_at=" + Address(a.port), "--batch_window_us=2000",
                             "--health_timeout_ms=10000"});

  MixedLoad load;
  load.local = local;
  load.Start(router.port, 4);
  // Two clients whose deadlines end while their calls are queued or merged.
  std::atomic<bool> stop{false};
  std::atomic<int> gave_up{0}, answered{0};
  std::vector<std::thread> quitters;
  for (int c = 0; c < 2; ++c) {
    quitters.emplace_back([&, c] {
      auto stub = Connect(router.port);
      for (int i = 0; !stop; ++i) {
        v1::ForwardResponse response;
        const grpc::Status s = Call(*stub, Mixed((c + 3 * i) % kMix), &response, std::chrono::milliseconds(1));
        s.ok() ? ++answered : ++gave_up;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));  // a caller, not a flood
      }
    });
  }
  REQUIRE(WaitFor([&] { return load.ok > 300 && gave_up > 50; }));
  stop = true;
  for (std::thread& t : quitters) t.join();
  load.Stop();
  std::printf(
      "merged load with 1 ms callers: %d answers (%d merged), %d wrong, %d failed; quitters %d gave up, %d "
      "answered\n",
      load.ok.load(), load.merged.load(), load.wrong.load(), load.failed.load(), gave_up.load(), answered.load());
  INFO("first error: " << load.first_error);
  CHECK(load.failed == 0);
  CHECK(load.wrong == 0);
  // The router still serves, and the node was never taken out of the map.
  auto stub = Connect(router.port);
  CHECK(Status(*stub).nodes(0).live());
}

}  // namespace
}  // namespace colibri
