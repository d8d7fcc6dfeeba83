#ifndef COLIBRI_COMMON_MEMORY_BUDGET_H_
#define COLIBRI_COMMON_MEMORY_BUDGET_H_

// A per-process budget for the memory of requests in flight. A server
// estimates what a request will hold (its bytes, the copies and outputs it
// makes) from its shape before allocating anything, reserves that, and
// releases it when the request is done; a reservation that would exceed the
// limit is refused with RESOURCE_EXHAUSTED, so concurrent large requests
// cannot together exhaust the process. Thread-safe (one atomic).

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace colibri {
namespace common {

class MemoryBudget {
 public:
  // Holds bytes of the budget until destroyed (or moved from). It may
  // outlive the budget (it shares the budget's count): work that ends after
  // its server (a merged call its callers left) still gives its bytes back.
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& other) noexcept;
    Reservation& operator=(Reservation&& other) noexcept;
    ~Reservation();

   private:
    friend class MemoryBudget;
    Reservation(std::shared_ptr<std::atomic<int64_t>> in_use, int64_t bytes)
        : in_use_(std::move(in_use)), bytes_(bytes) {}
    std::shared_ptr<std::atomic<int64_t>> in_use_;
    int64_t bytes_ = 0;
  };

  // `limit_bytes` <= 0: no limit (reservations are still counted).
  // `option` names the setting in errors, e.g. "--max_inflight_bytes".
  MemoryBudget(int64_t limit_bytes, std::string option) : limit_(limit_bytes), option_(std::move(option)) {}

  // RESOURCE_EXHAUSTED naming `what`, the sizes and the option when `bytes`
  // more would exceed the limit.
  absl::StatusOr<Reservation> Reserve(int64_t bytes, const std::string& what);

  int64_t in_use() const { return in_use_->load(std::memory_order_relaxed); }
  int64_t limit() const { return limit_; }

 private:
  const int64_t limit_;
  const std::string option_;
  const std::shared_ptr<std::atomic<int64_t>> in_use_ = std::make_shared<std::atomic<int64_t>>(0);
};

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_MEMORY_BUDGET_H_
