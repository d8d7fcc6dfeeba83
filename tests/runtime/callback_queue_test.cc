// runtime::KeepCallbackQueue, in a process with no gRPC server (whose
// reference would hide the fault): channels whose last owner is dropped
// inside their own call's callback, many times over, and the process goes on.
// Without the kept reference gRPC 1.51 shuts its callback queue down from one
// of the queue's own threads there and the process aborts.

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "runtime/grpc_callback_queue.h"

namespace colibri {
namespace runtime {
namespace {

TEST_CASE("a channel released inside its own call's callback does not take the callback queue down") {
  KeepCallbackQueue();
  KeepCallbackQueue();  // later calls are free
  for (int i = 0; i < 200; ++i) {
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
    // The callback holds the last reference to the call, its stub and channel, and drops it.
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
}

}  // namespace
}  // namespace runtime
}  // namespace colibri
