#ifndef COLIBRI_TOOLS_KERNEL_BENCH_H_
#define COLIBRI_TOOLS_KERNEL_BENCH_H_

// `colibri-bench kernels`: times the expert executor on one layer of a model
// directory — one expert alone, and the full layer with real top-k routes —
// at several token counts, next to this machine's read bandwidth measured in
// the same run (before and after). Prints median/p99 latency, GB/s of weight
// bytes read, GFLOP/s and the fraction of the bandwidth. No assertion: a
// benchmark reports, it does not judge.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace colibri {
namespace tools {

struct KernelBenchOptions {
  std::string model_dir;
  int64_t layer = 0;
  std::vector<int64_t> tokens = {1, 8, 32, 128};
  int threads = 0;  // 0: one per allowed CPU
  int warmup = 3;
  int repeat = 30;
  uint64_t seed = 1;
  int64_t onednn_min_tokens = -1;   // as ExecutorOptions; 0 never uses oneDNN; -1: the kernel profile
  int64_t dequant_min_tokens = -1;  // int8/int4 bf16 tiles from this many rows; -1: the kernel profile; 0: never
  int64_t amx_min_tokens = -1;      // bf16 AMX tiles from this many rows (where there are some); as above
  bool hugepages = true;            // copy weights to MADV_HUGEPAGE anonymous memory
  // int8/int4: build each matrix's int8 tile records once (kernels::BuildQ8Records,
  // a second copy in memory), so the tile kernels do not repack per call.
  bool q8_records = false;
  bool single_expert = true;  // also time expert 0 alone
  bool json = false;          // one JSON object per result line
};

absl::Status RunKernelBench(const KernelBenchOptions& options, std::ostream& out);

}  // namespace tools
}  // namespace colibri

#endif  // COLIBRI_TOOLS_KERNEL_BENCH_H_
