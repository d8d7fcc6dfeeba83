#ifndef COLIBRI_COMMON_MUTEX_H_
#define COLIBRI_COMMON_MUTEX_H_

// Mutex, MutexLock and CondVar: std::mutex and std::condition_variable with
// Clang's thread-safety annotations, so that `ABSL_GUARDED_BY(mu_)` and
// `ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_)` are checked by the compiler
// (-Wthread-safety, on in every clang build: see the top-level CMakeLists.txt).
//
// Why not absl::Mutex, which carries the same annotations: Debian's Abseil is
// not built with ThreadSanitizer, so TSan cannot see absl::Mutex's
// synchronization and reports races that are not there; std::mutex goes
// through pthreads, which TSan intercepts. The interface follows absl::Mutex
// (Lock/Unlock, MutexLock, CondVar::Wait) so that a later switch is a rename.
//
// Waiting on a condition: write the loop out, so the analysis sees that the
// guarded state is read under the lock (a predicate lambda is analysed as a
// separate function that holds nothing):
//   MutexLock lock(&mu_);
//   while (queue_.empty() && !stopping_) cv_.Wait(&mu_);

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"

namespace colibri {
namespace common {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  // True if the lock was taken (without blocking).
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `*mu` for its scope. REQUIRES: `mu` outlives the MutexLock.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A condition variable used with one Mutex. Wake-ups may be spurious: wait in
// a loop that re-checks the condition. Thread-safe.
class CondVar {
 public:
  // Releases *mu, waits for a Signal/SignalAll, takes *mu again.
  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // *mu stays held, as the caller expects
  }

  // As Wait, for at most `timeout`; true if it returned because time ran out.
  // An infinite timeout waits like Wait (and returns false).
  bool WaitWithTimeout(Mutex* mu, absl::Duration timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (timeout == absl::InfiniteDuration()) {
      Wait(mu);
      return false;
    }
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool timed_out = cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout)) == std::cv_status::timeout;
    lock.release();
    return timed_out;
  }

  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

// A one-shot event, like absl::Notification but visible to ThreadSanitizer:
// Notify once; WaitForNotification returns once it has been notified. The
// waiter may destroy it as soon as WaitForNotification returns.
class Notification {
 public:
  void Notify() {
    MutexLock lock(&mu_);
    notified_ = true;
    cv_.SignalAll();
  }
  void WaitForNotification() {
    MutexLock lock(&mu_);
    while (!notified_) cv_.Wait(&mu_);
  }
  bool HasBeenNotified() {
    MutexLock lock(&mu_);
    return notified_;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  bool notified_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_MUTEX_H_
