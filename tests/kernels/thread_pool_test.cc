// ThreadPool: every worker index runs once per job, a barrier holds every
// worker, and with caller_joins the caller is worker 0 (no thread of its own).

#include "kernels/thread_pool.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <thread>
#include <vector>

namespace colibri {
namespace kernels {
namespace {

TEST_CASE("a job runs once on every worker index, worker 0 on the caller when it joins") {
  const bool joins = GENERATE(false, true);
  const int threads = GENERATE(1, 3);
  CAPTURE(joins, threads);
  auto pool = ThreadPool::Create({threads, -1, /*pin=*/false, joins});
  REQUIRE(pool.ok());
  REQUIRE((*pool)->size() == threads);
  for (int round = 0; round < 50; ++round) {
    std::vector<std::atomic<int>> runs(threads);
    std::vector<std::thread::id> ids(threads);
    std::atomic<int> before{0}, after_barrier_saw{0};
    (*pool)->Run([&](int w) {
      runs[w].fetch_add(1);
      ids[w] = std::this_thread::get_id();
      before.fetch_add(1);
      (*pool)->Barrier();
      after_barrier_saw.fetch_add(before.load() == threads ? 1 : 0);
    });
    for (int w = 0; w < threads; ++w) CHECK(runs[w].load() == 1);
    CHECK(after_barrier_saw.load() == threads);
    CHECK((ids[0] == std::this_thread::get_id()) == joins);
    for (int w = 1; w < threads; ++w) CHECK(ids[w] != std::this_thread::get_id());
  }
}

}  // namespace
}  // namespace kernels
}  // namespace colibri
