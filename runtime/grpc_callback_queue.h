#ifndef COLIBRI_RUNTIME_GRPC_CALLBACK_QUEUE_H_
#define COLIBRI_RUNTIME_GRPC_CALLBACK_QUEUE_H_

// gRPC 1.51 runs the callbacks of its callback API, where the polling engine
// does not run them in the background (epoll1, the default on Linux), on one
// process-wide completion queue with its own threads. Every channel that has
// made a callback call holds a reference to that queue; when the last one is
// released the queue is shut down and its threads joined. If that release
// happens inside a callback — a call's last owner dropped there, e.g. a
// client destroyed while a reply is still being delivered — a queue thread
// joins itself: the join fails, the queue is freed under the running thread
// and the process aborts (grpc/grpc#32584). A running callback server holds
// a reference too, so it bites processes that are only clients (the
// proxyless client, tools) and clients whose server stopped first (a router
// shutting down with node calls or streams still ending).

namespace colibri {
namespace runtime {

// Takes a reference to that queue for the rest of the process (a channel that
// is never destroyed makes one callback call), so no release inside a
// callback can be the last. Call it before making callback calls; the first
// call costs one failed call on a local channel, later calls nothing.
// Thread-safe.
void KeepCallbackQueue();

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_GRPC_CALLBACK_QUEUE_H_
