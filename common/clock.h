#ifndef COLIBRI_COMMON_CLOCK_H_
#define COLIBRI_COMMON_CLOCK_H_

// Time for code whose timing tests must control: Now() and one-shot timers.
// Clock::Real() is the wall clock (absl::Now) with one timer thread for the
// process; tests pass a manual clock that moves only when they say
// (tests/router_node/fake_node.h), so hedging and deadlines are tested
// without sleeping. Thread-safe.

#include <functional>
#include <memory>

#include "absl/time/time.h"

namespace colibri {
namespace common {

class Clock {
 public:
  // Destroying a timer cancels it: its function is not run after the
  // destructor returns, unless it was already due and taken to run (then the
  // destructor does not wait for it, so a timer may be destroyed from inside
  // its own function; the function may run just after the destructor
  // returns, so it must check that it is still wanted).
  class Timer {
   public:
    virtual ~Timer() = default;
  };

  virtual ~Clock() = default;
  virtual absl::Time Now() = 0;
  // Runs `fn` once, at `at` or soon after, on the clock's own thread — never
  // inside this call, even when `at` has passed.
  virtual std::unique_ptr<Timer> At(absl::Time at, std::function<void()> fn) = 0;

  // The wall clock; its timer thread starts on the first At(). Never destroyed.
  static Clock* Real();
};

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_CLOCK_H_
