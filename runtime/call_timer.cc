#include "runtime/call_timer.h"

#include <utility>

namespace colibri {
namespace runtime {

CallTimer::CallTimer(std::function<void()> cancel, absl::Duration timeout)
    : timeout_(timeout), call_(std::make_shared<Call>()) {
  common::MutexLock lock(&call_->mu);
  call_->cancel = std::move(cancel);
}

CallTimer::~CallTimer() {
  common::MutexLock lock(&call_->mu);
  call_->cancel = nullptr;  // a timer that fired already finds no call
}

void CallTimer::Start() {
  if (timeout_ <= absl::ZeroDuration()) return;
  const uint64_t step = ++steps_;
  {
    common::MutexLock lock(&call_->mu);
    call_->armed = step;
  }
  alarm_ = std::make_unique<grpc::Alarm>();
  alarm_->Set(absl::ToChronoTime(absl::Now() + timeout_), [call = call_, step](bool fired) {
    if (!fired) return;  // cancelled: the step was done in time, or the call is over
    common::MutexLock lock(&call->mu);
    if (call->cancel && call->armed == step) call->cancel();
  });
}

void CallTimer::Done() {
  if (timeout_ <= absl::ZeroDuration()) return;
  {
    common::MutexLock lock(&call_->mu);
    call_->armed = 0;  // a timer that fired meanwhile is too late
  }
  alarm_.reset();
}

}  // namespace runtime
}  // namespace colibri
