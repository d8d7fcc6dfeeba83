// colibri-expert as a real process on 127.0.0.1:0: it reports SERVING over
// grpc.health.v1 once loaded, a reload under concurrent load fails no call,
// and SIGTERM drains it to exit status 0. The process is killed on any
// failure (ProcessGuard).

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "colibri/v1/expert_node.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/test_util.h"

namespace colibri {
namespace expert_node {
namespace {

using colibri::testing::TempDir;
namespace v1 = colibri::v1;

// A child process started with its stdout on a pipe; killed when destroyed.
class ProcessGuard {
 public:
  explicit ProcessGuard(const std::vector<std::string>& argv) {
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    pid_ = fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      std::vector<char*> args;
      for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
  }
  ~ProcessGuard() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ != nullptr) fclose(out_);
  }
  // The next line of the child's stdout ("" at EOF).
  std::string ReadLine() {
    char line[512];
    return fgets(line, sizeof(line), out_) != nullptr ? std::string(line) : std::string();
  }
  // Sends `sig` and waits up to `timeout` for the exit status (-1: still running, then killed).
  int SignalAndWait(int sig, std::chrono::seconds timeout) {
    kill(pid_, sig);
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < until) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
};

TEST_CASE("colibri-expert serves, reloads under load with no failed call, and exits 0 on SIGTERM") {
  TempDir dir;
  const tools::SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt");
  colibri::testing::MakeModel(synth, dir / "root/a", common::DType::kBF16);
  colibri::testing::MakeModel(synth, dir / "root/b", common::DType::kInt4);
  ProcessGuard node({std::string(COLIBRI_BINARY_DIR) + "/expert_node/colibri-expert", "--model=" + (dir / "root/a"),
                     "--experts=layer:0/expert:0-1", "--listen=127.0.0.1:0", "--nomlock", "--threads=2"});
  const std::string line = node.ReadLine();
  INFO("first line: " << line);
  const size_t at = line.find("listening on port ");
  REQUIRE(at != std::string::npos);
  const int port = std::stoi(line.substr(at + 18));
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());

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
  for (int i = 0; i < 3; ++i) {
    v1::ReloadRequest reload;
    reload.set_model_dir(i % 2 == 0 ? dir / "root/b" : dir / "root/a");
    v1::ReloadResponse response;
    grpc::ClientContext context;
    const grpc::Status s = stub->Reload(&context, reload, &response);
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
