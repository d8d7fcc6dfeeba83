#ifndef COLIBRI_KERNELS_BANDWIDTH_H_
#define COLIBRI_KERNELS_BANDWIDTH_H_

// Measures this machine's memory read bandwidth the way the kernels read
// weights: every pool worker streams its share of a buffer much larger than
// the caches (anonymous memory, MADV_HUGEPAGE) with the widest loads the CPU
// has. Benchmarks report kernel GB/s as a fraction of this figure measured in
// the same run, never against a fixed number (the VM's bandwidth moves).

#include <cstddef>

#include "kernels/thread_pool.h"

namespace colibri {
namespace kernels {

struct BandwidthResult {
  double best_gbps = 0;  // best of the passes
  double median_gbps = 0;
};

// Streams `bytes` (split over the workers) `passes` times after one warm-up
// pass. Returns zeros if the buffer cannot be mapped or passes < 1.
BandwidthResult MeasureReadBandwidth(ThreadPool& pool, size_t bytes = size_t{1} << 30, int passes = 7);

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_BANDWIDTH_H_
