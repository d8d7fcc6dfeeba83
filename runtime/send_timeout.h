#ifndef COLIBRI_RUNTIME_SEND_TIMEOUT_H_
#define COLIBRI_RUNTIME_SEND_TIMEOUT_H_

// A time limit on sending one reply of a server call: a client that stops
// reading its replies while its connection stays healthy (it answers pings,
// so keepalive does not close it) would otherwise keep the call, and the
// memory the call holds (its request, the reply, the server's budget for
// both), until the call's deadline — forever if it has none. HTTP/2 flow
// control makes a reply wait once the client's window is full.
//
// Start() before each StartWrite/Finish, Done() in OnWriteDone: a reply whose
// whole send is not done within the timeout has its call cancelled
// (TryCancel: the client sees CANCELLED, the server's OnCancel and OnDone
// run). The limit is on the whole reply, not on the time between two pieces
// of it: a client reading steadily but slower than reply size / timeout is
// cancelled too. A zero timeout never cancels. Start and Done are called in
// the reactor's order (a write is started after the previous one's
// OnWriteDone); the timer runs on gRPC's threads, and touches the call only
// until the SendTimeout is destroyed (in the reactor's OnDone).

#include <grpcpp/alarm.h>
#include <grpcpp/server_context.h>

#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace colibri {
namespace runtime {

class SendTimeout {
 public:
  SendTimeout(grpc::CallbackServerContext* context, absl::Duration timeout);
  ~SendTimeout();
  SendTimeout(const SendTimeout&) = delete;
  SendTimeout& operator=(const SendTimeout&) = delete;

  void Start();
  void Done();

 private:
  struct Call {  // shared with the timers' callbacks, which may run after the reactor is gone
    common::Mutex mu;
    grpc::CallbackServerContext* context ABSL_GUARDED_BY(mu);  // null once the reactor is done
    uint64_t armed ABSL_GUARDED_BY(mu) = 0;  // the send being timed (0: none); a timer of another one does nothing
  };
  const absl::Duration timeout_;
  const std::shared_ptr<Call> call_;
  uint64_t sends_ = 0;
  std::unique_ptr<grpc::Alarm> alarm_;  // the last send's timer; destroying it cancels it unless it fired
};

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_SEND_TIMEOUT_H_
