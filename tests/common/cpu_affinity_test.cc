#include "common/cpu_affinity.h"

#include <sched.h>

#include <catch2/catch.hpp>
#include <thread>
#include <vector>

namespace colibri {
namespace common {
namespace {

TEST_CASE("ThreadCpus lists the CPUs sched_getaffinity reports", "[cpu_affinity]") {
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof(set), &set) == 0);  // hosts of up to 1 024 CPUs
  std::vector<int> expected;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) expected.push_back(c);
  }
  CHECK(ThreadCpus() == expected);
}

TEST_CASE("PinThread restricts the calling thread only", "[cpu_affinity]") {
  const std::vector<int> all = ThreadCpus();
  REQUIRE_FALSE(all.empty());
  bool pinned = false;  // Catch's assertions stay on the test's thread
  std::vector<int> pinned_seen;
  std::vector<int> others_seen;
  std::thread worker([&] {
    pinned = PinThread({all.back()});
    pinned_seen = ThreadCpus();
    std::thread child([&] { others_seen = ThreadCpus(); });  // inherits the pin
    child.join();
  });
  worker.join();
  REQUIRE(pinned);
  CHECK(pinned_seen == std::vector<int>{all.back()});
  CHECK(others_seen == std::vector<int>{all.back()});
  CHECK(ThreadCpus() == all);  // this thread was not moved
}

TEST_CASE("PinThread refuses nothing to pin to", "[cpu_affinity]") {
  CHECK_FALSE(PinThread({}));
  CHECK_FALSE(PinThread({-1}));
}

}  // namespace
}  // namespace common
}  // namespace colibri
