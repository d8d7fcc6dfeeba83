// The memory budget for requests in flight: reservations add up, one that
// would exceed the limit is refused naming the sizes and the option, and
// bytes come back when a reservation is destroyed or moved over.

#include "common/memory_budget.h"

#include <catch2/catch.hpp>
#include <optional>
#include <utility>

namespace colibri {
namespace common {
namespace {

TEST_CASE("a memory budget refuses what would exceed it and takes bytes back on release") {
  MemoryBudget budget(1000, "--max_inflight_bytes");
  absl::StatusOr<MemoryBudget::Reservation> a = budget.Reserve(600, "call a");
  REQUIRE(a.ok());
  CHECK(budget.in_use() == 600);
  const absl::StatusOr<MemoryBudget::Reservation> b = budget.Reserve(500, "call b");
  REQUIRE_FALSE(b.ok());
  CHECK(b.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(b.status().message().find("call b needs ~500 bytes; 600 of the 1000-byte budget") != absl::string_view::npos);
  CHECK(b.status().message().find("--max_inflight_bytes") != absl::string_view::npos);
  CHECK(budget.in_use() == 600);  // a refusal reserves nothing
  // One larger than the whole budget can never fit: not "retry later".
  const absl::StatusOr<MemoryBudget::Reservation> never = budget.Reserve(1001, "call d");
  REQUIRE_FALSE(never.ok());
  CHECK(never.status().message().find("call d needs ~1001 bytes, more than the whole 1000-byte budget") !=
        absl::string_view::npos);
  CHECK(never.status().message().find("retry later") == absl::string_view::npos);
  {
    MemoryBudget::Reservation moved = *std::move(a);
    CHECK(budget.in_use() == 600);  // moving keeps one reservation
    absl::StatusOr<MemoryBudget::Reservation> c = budget.Reserve(400, "call c");
    REQUIRE(c.ok());
    CHECK(budget.in_use() == 1000);
    moved = *std::move(c);  // the 600 go back, the 400 stay
    CHECK(budget.in_use() == 400);
  }
  CHECK(budget.in_use() == 0);
  MemoryBudget unlimited(0, "x");
  absl::StatusOr<MemoryBudget::Reservation> big = unlimited.Reserve(int64_t{1} << 50, "huge");
  CHECK(big.ok());
  CHECK(unlimited.in_use() == int64_t{1} << 50);
}

TEST_CASE("a reservation may outlive its budget") {
  std::optional<MemoryBudget::Reservation> late;
  {
    MemoryBudget budget(100, "x");
    auto r = budget.Reserve(60, "a call");
    REQUIRE(r.ok());
    late = std::move(*r);
    CHECK(budget.in_use() == 60);
  }
  late.reset();  // gives its bytes back to a count the budget no longer reads (ASan: no use after free)
}

}  // namespace
}  // namespace common
}  // namespace colibri
