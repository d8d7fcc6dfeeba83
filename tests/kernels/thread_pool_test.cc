// ThreadPool: every worker index runs once per job, a barrier holds every
// worker, and with caller_joins the caller is worker 0 (no thread of its own);
// too many threads, or threads the system cannot start, are an error, not an
// abort.

#include "kernels/thread_pool.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <fstream>
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

TEST_CASE("a pool of more threads than the limit is refused") {
  auto pool = ThreadPool::Create({ThreadPool::kMaxThreads + 1, -1, false});
  REQUIRE_FALSE(pool.ok());
  CHECK(pool.status().code() == absl::StatusCode::kInvalidArgument);
}

#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
TEST_CASE("threads the system cannot start are an error, and the ones started are stopped") {
  // In a child whose address space has room for a few thread stacks (8 MiB
  // each) but not 64: starting them fails with EAGAIN.
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    long pages = 0;
    std::ifstream("/proc/self/statm") >> pages;
    const rlim_t room = static_cast<rlim_t>(pages) * sysconf(_SC_PAGESIZE) + (rlim_t{48} << 20);
    const rlimit limit{room, room};
    if (setrlimit(RLIMIT_AS, &limit) != 0) _exit(2);
    auto pool = ThreadPool::Create({64, -1, false});
    const bool refused = !pool.ok() && pool.status().code() == absl::StatusCode::kResourceExhausted &&
                         pool.status().message().find("cannot start 64 threads") != absl::string_view::npos;
    _exit(refused ? 0 : 1);
  }
  // Bounded: a pool that cannot unwind its started threads aborts or hangs.
  int status = 0;
  pid_t done = 0;
  for (int i = 0; i < 3000 && (done = waitpid(child, &status, WNOHANG)) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (done == 0) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
    FAIL("the pool hung for 30 s after a thread could not be started");
  }
  REQUIRE(done == child);
  REQUIRE(WIFEXITED(status));  // not killed by an abort
  CHECK(WEXITSTATUS(status) == 0);
}
#endif

}  // namespace
}  // namespace kernels
}  // namespace colibri
