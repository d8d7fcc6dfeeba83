// runtime::KeepCallbackQueue, in a process with no gRPC server (whose
// reference would hide the fault): channels whose last owner is dropped
// inside their own call's callback, many times over, leave gRPC's callback
// queue (and its threads) in place. Without the kept reference gRPC 1.51
// shuts the queue down from one of its own threads there: the threads
// change, and often the process aborts.

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "runtime/grpc_callback_queue.h"

namespace colibri {
namespace runtime {
namespace {

// The tasks of this process that gRPC named "nexting_thread": the threads
// of its callback queue. A queue shut down and made again has other ones.
std::set<std::string> QueueThreads() {
  std::set<std::string> tids;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    std::getline(comm, name);
    if (name.rfind("nexting_thread", 0) == 0) tids.insert(task.path().filename());
  }
  return tids;
}

// One call on a channel of its own that fails at once; its callback holds
// the last reference to the call, its stub and its channel, and drops it.
void CallAndDropInCallback() {
  struct Call {
    grpc::GenericStub stub{grpc::CreateChannel("unix:/nonexistent/colibri-test", grpc::InsecureChannelCredentials())};
    grpc::ClientContext context;
    grpc::Slice empty;
    grpc::ByteBuffer request{&empty, 1}, response;
  };
  auto call = std::make_shared<Call>();
  call->context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(1));
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::StatusCode code = grpc::StatusCode::OK;
  Call* raw = call.get();
  raw->stub.UnaryCall(&raw->context, "/colibri.Test/Never", grpc::StubOptions(), &raw->request, &raw->response,
                      [&, owned = std::move(call)](grpc::Status s) mutable {
                        owned.reset();
                        std::lock_guard<std::mutex> lock(mu);
                        code = s.error_code();
                        done = true;
                        cv.notify_all();
                      });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  CHECK(code != grpc::StatusCode::OK);
}

TEST_CASE("a channel released inside its own call's callback does not take the callback queue down") {
  KeepCallbackQueue();
  KeepCallbackQueue();  // later calls are free
  CallAndDropInCallback();
  // The queue's threads are still there after every release: it was never
  // shut down (that joins them; a new queue has new ones). A thread may take
  // its name a moment after it starts, so one seen later joins the set.
  std::set<std::string> threads = QueueThreads();
  for (int i = 0; i < 500 && threads.empty(); ++i) {  // on a loaded machine a thread is named late
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    threads = QueueThreads();
  }
  REQUIRE_FALSE(threads.empty());
  for (int i = 0; i < 50; ++i) {
    CallAndDropInCallback();
    const std::set<std::string> now = QueueThreads();
    INFO("release " << i);
    REQUIRE(std::includes(now.begin(), now.end(), threads.begin(), threads.end()));
    threads = now;
  }
}

}  // namespace
}  // namespace runtime
}  // namespace colibri
