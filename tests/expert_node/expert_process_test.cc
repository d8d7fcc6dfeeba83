// colibri-expert as a real process on 127.0.0.1:0: it reports SERVING over
// grpc.health.v1 once loaded, a reload under concurrent load fails no call,
// and SIGTERM drains it to exit status 0. The process is killed on any
// failure (ProcessGuard).

#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <thread>

#include "colibri/v1/expert_node.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/test_util.h"

namespace colibri {
namespace expert_node {
namespace {

using colibri::testing::TempDir;
namespace v1 = colibri::v1;

using colibri::testing::ProcessGuard;

TEST_CASE("colibri-expert serves, reloads under load with no failed call, and exits 0 on SIGTERM") {
  TempDir dir;
  const tools::SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt");
  colibri::testing::MakeModel(synth, dir / "root/a", common::DType::kBF16);
  colibri::testing::MakeModel(synth, dir / "root/b", common::DType::kInt4);
  ProcessGuard node({std::string(COLIBRI_BINARY_DIR) + "/expert_node/colibri-expert", "--model=" + (dir / "root/a"),
                     "--experts=layer:0/expert:0-1", "--listen=127.0.0.1:0", "--residency=paged", "--threads=2",
                     "--model_root=" + (dir / "root"), "--admin_listen=127.0.0.1:0"});
  const int port = node.ReadPort();
  const int admin_port = node.ReadPort("admin on port ");
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  auto admin = v1::ExpertNode::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(admin_port), grpc::InsecureChannelCredentials()));

  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::health::v1::HealthCheckResponse status;
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    REQUIRE(health->Check(&context, grpc::health::v1::HealthCheckRequest(), &status).ok());
  }
  CHECK(status.status() == grpc::health::v1::HealthCheckResponse::SERVING);

  auto stub = v1::ExpertNode::NewStub(channel);
  std::vector<float> rows(2 * 48, 0.5f);
  v1::ComputeRequest request;
  request.mutable_rows()->set_dtype(v1::DATA_TYPE_F32);
  request.mutable_rows()->add_shape(2);
  request.mutable_rows()->add_shape(48);
  request.mutable_rows()->set_data(reinterpret_cast<const char*>(rows.data()), rows.size() * 4);
  v1::ExpertWork* work = request.add_experts();
  work->set_expert(1);
  work->add_row_indices(0);
  work->add_row_indices(1);
  work->add_weights(0.5f);
  work->add_weights(0.5f);
  std::atomic<bool> stop{false};
  std::atomic<int> calls{0}, failures{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 2; ++c) {
    clients.emplace_back([&] {
      while (!stop) {
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
        v1::ComputeResponse response;
        if (!stub->Compute(&context, request, &response).ok()) ++failures;
        ++calls;
      }
    });
  }
  // Reloads happen while calls are running: wait for calls before each one.
  auto calls_advance = [&] {
    const int before = calls;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (calls < before + 3 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  };
  for (int i = 0; i < 3; ++i) {
    calls_advance();
    v1::ReloadRequest reload;
    reload.set_model_dir(i % 2 == 0 ? dir / "root/b" : dir / "root/a");
    v1::ReloadResponse response;
    grpc::ClientContext context;
    const grpc::Status s = admin->Reload(&context, reload, &response);
    INFO(s.error_message());
    CHECK(s.ok());
  }
  stop = true;
  for (std::thread& t : clients) t.join();
  std::printf("colibri-expert process: %d calls during 3 reloads, %d failed\n", calls.load(), failures.load());
  CHECK(calls > 0);
  CHECK(failures == 0);
  CHECK(node.SignalAndWait(SIGTERM, std::chrono::seconds(15)) == 0);
}

}  // namespace
}  // namespace expert_node
}  // namespace colibri
