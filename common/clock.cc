#include "common/clock.h"

#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/time/clock.h"
#include "common/mutex.h"

namespace colibri {
namespace common {
namespace {

// absl::Now() and a thread that runs due timers in order, each outside the lock.
class RealClock final : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }

  std::unique_ptr<Timer> At(absl::Time at, std::function<void()> fn) override {
    MutexLock lock(&mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
    const int64_t id = next_id_++;
    const bool earliest = timers_.empty() || at < timers_.begin()->first.first;
    timers_.emplace(std::make_pair(at, id), std::move(fn));
    if (earliest) cv_.Signal();
    return std::make_unique<Handle>(this, at, id);
  }

 private:
  using Key = std::pair<absl::Time, int64_t>;  // (when, id): ids keep equal times in order

  class Handle final : public Timer {
   public:
    Handle(RealClock* clock, absl::Time at, int64_t id) : clock_(clock), key_(at, id) {}
    ~Handle() override {
      MutexLock lock(&clock_->mu_);
      clock_->timers_.erase(key_);
    }

   private:
    RealClock* const clock_;
    const Key key_;
  };

  void Loop() {  // runs for the process
    mu_.Lock();
    for (;;) {
      if (timers_.empty()) {
        cv_.Wait(&mu_);
        continue;
      }
      const absl::Duration left = timers_.begin()->first.first - absl::Now();
      if (left > absl::ZeroDuration()) {
        cv_.WaitWithTimeout(&mu_, left);
        continue;
      }
      std::function<void()> fn = std::move(timers_.begin()->second);
      timers_.erase(timers_.begin());
      mu_.Unlock();
      fn();
      fn = nullptr;  // its captures are released outside the lock too
      mu_.Lock();
    }
  }

  Mutex mu_;
  CondVar cv_;
  std::map<Key, std::function<void()>> timers_ ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

Clock* Clock::Real() {
  static Clock* const clock = new RealClock();  // never destroyed: its thread runs for the process
  return clock;
}

}  // namespace common
}  // namespace colibri
