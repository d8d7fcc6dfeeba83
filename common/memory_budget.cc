#include "common/memory_budget.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace colibri {
namespace common {

MemoryBudget::Reservation::Reservation(Reservation&& other) noexcept
    : in_use_(std::move(other.in_use_)), bytes_(std::exchange(other.bytes_, 0)) {}

MemoryBudget::Reservation& MemoryBudget::Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    if (in_use_ != nullptr) in_use_->fetch_sub(bytes_, std::memory_order_relaxed);
    in_use_ = std::move(other.in_use_);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

MemoryBudget::Reservation::~Reservation() {
  if (in_use_ != nullptr) in_use_->fetch_sub(bytes_, std::memory_order_relaxed);
}

absl::StatusOr<MemoryBudget::Reservation> MemoryBudget::Reserve(int64_t bytes, const std::string& what) {
  int64_t current = in_use_->load(std::memory_order_relaxed);
  do {
    if (limit_ > 0 && bytes > limit_) {  // not even alone: waiting cannot help
      return absl::ResourceExhaustedError(absl::StrCat(what, " needs ~", bytes, " bytes, more than the whole ", limit_,
                                                       "-byte budget for requests in flight (", option_,
                                                       "): send smaller requests, or raise the budget"));
    }
    if (limit_ > 0 && current + bytes > limit_) {
      return absl::ResourceExhaustedError(absl::StrCat(what, " needs ~", bytes, " bytes; ", current, " of the ", limit_,
                                                       "-byte budget for requests in flight are in use (", option_,
                                                       "); retry later or send smaller requests"));
    }
  } while (!in_use_->compare_exchange_weak(current, current + bytes, std::memory_order_relaxed));
  return Reservation(in_use_, bytes);
}

}  // namespace common
}  // namespace colibri
