#include "runtime/grpc_callback_queue.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>

namespace colibri {
namespace runtime {

void KeepCallbackQueue() {
  // Never destroyed, so its reference to the queue lasts as long as the
  // process (and reachable from here: not a leak to LeakSanitizer).
  static const std::shared_ptr<grpc::Channel>* const kept = [] {
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
    return channel;
  }();
  (void)kept;
}

}  // namespace runtime
}  // namespace colibri
