#include "runtime/send_timeout.h"

namespace colibri {
namespace runtime {

SendTimeout::SendTimeout(grpc::CallbackServerContext* context, absl::Duration timeout)
    : timeout_(timeout), call_(std::make_shared<Call>()) {
  common::MutexLock lock(&call_->mu);
  call_->context = context;
}

SendTimeout::~SendTimeout() {
  common::MutexLock lock(&call_->mu);
  call_->context = nullptr;  // a timer that fired already finds no call
}

void SendTimeout::Start() {
  if (timeout_ <= absl::ZeroDuration()) return;
  const uint64_t send = ++sends_;
  {
    common::MutexLock lock(&call_->mu);
    call_->armed = send;
  }
  alarm_ = std::make_unique<grpc::Alarm>();
  alarm_->Set(absl::ToChronoTime(absl::Now() + timeout_), [call = call_, send](bool fired) {
    if (!fired) return;  // cancelled: the send was done in time, or the call is over
    common::MutexLock lock(&call->mu);
    if (call->context != nullptr && call->armed == send) call->context->TryCancel();
  });
}

void SendTimeout::Done() {
  if (timeout_ <= absl::ZeroDuration()) return;
  {
    common::MutexLock lock(&call_->mu);
    call_->armed = 0;  // a timer that fired meanwhile is too late
  }
  alarm_.reset();
}

}  // namespace runtime
}  // namespace colibri
