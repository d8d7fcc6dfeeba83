#ifndef COLIBRI_COMMON_PARALLEL_FOR_H_
#define COLIBRI_COMMON_PARALLEL_FOR_H_

// ParallelFor: a few long, independent tasks (hashing files, copying experts)
// spread over short-lived threads. Not a thread pool: the compute path has
// kernels::ThreadPool.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <functional>
#include <system_error>
#include <thread>
#include <vector>

#include "common/sigbus_guard.h"

namespace colibri {
namespace common {

// Runs fn(i) for every i in [0, n) on up to `threads` threads, the caller's
// included, each taking the next index in turn (give the longest tasks the
// lowest indices; fewer threads where the system cannot start more). Returns
// when all are done. `fn` must be thread-safe.
inline void ParallelFor(size_t n, int threads, const std::function<void(size_t)>& fn) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) fn(i);
  };
  std::vector<std::thread> helpers;
  try {
    for (size_t t = 1; t < std::min<size_t>(static_cast<size_t>(std::max(threads, 1)), n); ++t) {
      helpers.emplace_back([&work] {
        SigbusGuard::UnblockHere();  // helpers may read mapped files
        work();
      });
    }
  } catch (const std::system_error&) {  // no more threads (EAGAIN): the ones started and the caller do it all
  }
  work();
  for (std::thread& t : helpers) t.join();
}

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_PARALLEL_FOR_H_
