#include "runtime/grpc_callback_queue.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>

namespace colibri {
namespace runtime {

// The channel holding the reference, never destroyed. A global with external
// linkage, so it stays reachable for LeakSanitizer (which scans globals) and
// the store cannot be optimized away.
std::shared_ptr<grpc::Channel>* kept_callback_queue_channel = nullptr;

void KeepCallbackQueue() {
  static const bool kept = [] {
    auto* channel = new std::shared_ptr<grpc::Channel>(
        grpc::CreateChannel("unix:/nonexistent/colibri-callback-queue", grpc::InsecureChannelCredentials()));
    grpc::GenericStub stub(*channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now());  // fails at once: only the queue is wanted
    grpc::Slice empty;
    grpc::ByteBuffer request(&empty, 1), response;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    stub.UnaryCall(&context, "/colibri.CallbackQueue/Keep", grpc::StubOptions(), &request, &response,
                   [&](grpc::Status) {
                     std::lock_guard<std::mutex> lock(mu);
                     done = true;
                     cv.notify_all();
                   });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    kept_callback_queue_channel = channel;
    return true;
  }();
  (void)kept;
}

}  // namespace runtime
}  // namespace colibri
