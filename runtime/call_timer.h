#ifndef COLIBRI_RUNTIME_CALL_TIMER_H_
#define COLIBRI_RUNTIME_CALL_TIMER_H_

// A time limit on one step of a gRPC call that the call's own deadline does
// not bound: the call is cancelled when the step takes longer.
//
// - A server's send of one reply (router_service.cc, --send_timeout_ms): a
//   client that stops reading its replies while its connection stays healthy
//   (it answers pings, so keepalive does not close it) would otherwise keep
//   the call, and the memory it holds, until the call's deadline — forever if
//   it has none (HTTP/2 flow control makes a reply wait once the client's
//   window is full). The limit is on the whole reply, not on the time between
//   two pieces of it: a client reading slower than reply size / timeout is
//   cancelled too.
// - A client's wait for one reply on a stream that carries many
//   (clients/cpp Session): the stream's deadline would bound the session,
//   not each request.
//
// Start() when the step begins, Done() when it ends; Start and Done
// alternate, from one thread at a time. A step not Done within the timeout
// runs `cancel` (TryCancel on the call's context, which may be called from
// any thread). A zero timeout never cancels. The timer runs on gRPC's
// threads and calls `cancel` only until the CallTimer is destroyed: destroy
// it before the context.

#include <grpcpp/alarm.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace colibri {
namespace runtime {

class CallTimer {
 public:
  CallTimer(std::function<void()> cancel, absl::Duration timeout);
  ~CallTimer();
  CallTimer(const CallTimer&) = delete;
  CallTimer& operator=(const CallTimer&) = delete;

  void Start();
  void Done();

 private:
  struct Call {  // shared with the timers' callbacks, which may run after the CallTimer is gone
    common::Mutex mu;
    std::function<void()> cancel ABSL_GUARDED_BY(mu);  // empty once destroyed
    uint64_t armed ABSL_GUARDED_BY(mu) = 0;  // the step being timed (0: none); a timer of another one does nothing
  };
  const absl::Duration timeout_;
  const std::shared_ptr<Call> call_;
  uint64_t steps_ = 0;
  std::unique_ptr<grpc::Alarm> alarm_;  // the last step's timer; destroying it cancels it unless it fired
};

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_CALL_TIMER_H_
