#ifndef COLIBRI_KERNELS_BANDWIDTH_H_
#define COLIBRI_KERNELS_BANDWIDTH_H_

// Measures this machine's memory read bandwidth the way the kernels read
// weights: every pool worker streams its share of a buffer much larger than
// the caches (anonymous memory, MADV_HUGEPAGE) with the widest loads the CPU
// has. Benchmarks report kernel GB/s as a fraction of this figure measured in
// the same run, never against a fixed number (the VM's bandwidth moves).

#include <cstddef>
#include <cstdint>
#include <memory>

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

// The same probe, keeping its buffer, for one pass at a time: a benchmark can
// interleave passes with the calls it times, so each call is compared with
// the bandwidth of the moment (on a VM it moves by 2x within a minute).
// Not thread-safe; the pool must outlive it.
class ReadProbe {
 public:
  // Null if the buffer cannot be mapped.
  static std::unique_ptr<ReadProbe> Create(ThreadPool& pool, size_t bytes);
  ~ReadProbe();
  ReadProbe(const ReadProbe&) = delete;
  ReadProbe& operator=(const ReadProbe&) = delete;

  // One pass over the buffer by every worker; GB/s.
  double Pass();

 private:
  ReadProbe(ThreadPool& pool, uint8_t* buffer, size_t bytes, size_t share)
      : pool_(pool), buffer_(buffer), bytes_(bytes), share_(share) {}
  ThreadPool& pool_;
  uint8_t* const buffer_;
  const size_t bytes_;
  const size_t share_;  // bytes per worker
};

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_BANDWIDTH_H_
