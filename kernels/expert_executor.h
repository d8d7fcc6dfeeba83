#ifndef COLIBRI_KERNELS_EXPERT_EXECUTOR_H_
#define COLIBRI_KERNELS_EXPERT_EXECUTOR_H_

// Runs the SwiGLU experts of one call on a thread pool, all experts in one
// pass:  dst[row] += weight · W2·(silu(W1·x[row]) ⊙ W3·x[row])  for every
// (expert, row, weight) of the call — or, for an expert with biases or
// another activation, weight · FFN(x[row]) as common::ExpertWeights defines
// it (FFN(weight · x[row]) when the expert's weight_at_input).
//
// One job on the pool, three phases separated by two barriers per call (not
// per expert): (0) each expert's rows of x are gathered with their bf16 copy
// and group sums; (1) the 64-row blocks of every expert's W1 and W3, cut into
// chunks of about equal cost that the workers claim one at a time, each
// computing h = silu(W1·x) ⊙ W3·x for its blocks (fused: both matrices in
// one pass, SiLU and the product on the fly); (2) the 64-column blocks of dst,
// claimed the same way, each chunk running every expert's W2 for its columns
// and accumulating into dst in task order. A worker that stalls holds the
// call up by one chunk; the others take the rest. Every output element is
// computed whole by one worker in an order fixed by the inputs, so results
// are bitwise identical run to run, whoever claims what; with the
// hand-written kernels (the default) they are also independent of the number
// of threads.
// (oneDNN's slices depend on the thread count; we do not rely on its bits.)
//
// Kernels: the dispatch table's block kernels (hand-written, ISA-specific);
// bf16/f32 experts with at least `onednn_min_tokens` rows use oneDNN matmul
// on the same stored bytes instead (and, where the table has AMX tiles, bf16
// experts with at least `bf16_tile_min_tokens` rows run on them unless oneDNN
// takes them); int8/int4 experts with at least
// `int8_tile_min_tokens` / `int4_tile_min_tokens` rows go through tiles:
// each block repacked once per call to int8 tiles (AVX512_VNNI; on AMX
// tiles at avx512_amx), or else dequantized once to bf16 for the bf16 kernel
// (its AMX tiles where the table has them).
//
// The caller owns `Workspace` (grown to the largest call seen, then reused,
// so no activation-sized allocation in steady state; a call still builds a
// few small vectors of per-expert bookkeeping). Not thread-safe per
// Workspace; the pool serializes jobs.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/model_dir.h"
#include "common/routing.h"
#include "kernels/dispatch.h"
#include "kernels/thread_pool.h"

namespace colibri {
namespace kernels {

struct ExpertTask {
  const common::ExpertWeights* expert = nullptr;  // lives until Run returns
  const int32_t* rows = nullptr;                  // [num_rows] indices into x / dst
  const float* weights = nullptr;                 // [num_rows] routing weights
  int64_t num_rows = 0;
  // [num_rows] rows of dst the results go to; null: the same rows as `rows`.
  // With a distinct dst row per (row, expert) — a "slot" — each slot holds
  // exactly weight · FFN(x[row]) (FFN(weight · x[row]) for an expert whose
  // weight_at_input), whatever else the call computes: the
  // router's partition-independent sums are built from those.
  const int32_t* out_rows = nullptr;
  // The row count that chooses the kernel (oneDNN, bf16 tiles or the block
  // kernel); 0: num_rows. A task that merges several callers' rows of one
  // expert sets the largest caller's count, so each row runs the kernel its
  // caller's own call would; below RowSplitLimit that kernel gives every row
  // the same bits whatever the rows beside it.
  int64_t kernel_rows = 0;
};

// Scratch memory for Run, owned by the caller and reused across calls.
class Workspace {
 public:
  // A 64-byte aligned region of at least `bytes`, growing (and losing its
  // contents) only when a call needs more than any before.
  uint8_t* Reserve(size_t bytes);
  size_t capacity() const { return capacity_; }

 private:
  std::unique_ptr<uint8_t[]> buffer_;
  size_t capacity_ = 0;
};

struct ExecutorOptions {
  // bf16/f32 experts with at least this many rows go through oneDNN; 0 =
  // never. int8 / int4 experts with at least int8_tile_min_tokens /
  // int4_tile_min_tokens rows convert each 64-row block once per call into a
  // per-worker tile (in cache; never the whole matrix), so the conversion is
  // amortized over the rows: int8 tiles that vpdpbusd reads down the rows
  // where the kernel table has them (KernelTable::tile, AVX512_VNNI), else
  // bf16 tiles for the bf16 block kernel; 0 = never. -1 (the default): the machine's
  // kernel profile decides (kernels/kernel_profile.h: measured once per host
  // when `kernels` is SelectedKernels(), else the built-in defaults).
  int64_t onednn_min_tokens = -1;
  // bf16 experts with at least this many rows run on the table's bf16 tile
  // kernel (AMX, KernelTable::tile) where it has one; below oneDNN's
  // threshold where both apply. 0 = never, -1: the kernel profile decides.
  int64_t bf16_tile_min_tokens = -1;
  // A value >= 0 holds for every expert of the type; -1 takes the profile's
  // threshold for experts with int8 tile records (MatrixView::q8_records)
  // from its *_records_tile_min_tokens.
  int64_t int8_tile_min_tokens = -1;
  int64_t int4_tile_min_tokens = -1;
  const KernelTable* kernels = nullptr;  // null: SelectedKernels()
  // Polled by every worker before each unit of work (a 64-row block of an
  // expert in the first phase, a chunk of dst's columns in the second; a
  // oneDNN product runs its chunk whole); once it returns true the call's
  // remaining work is skipped and RunExperts returns false. It must be
  // thread-safe and cheap. Null: never stop.
  std::function<bool()> should_stop;
};

// The tile threshold `options` gives for `type` with `kernels` (resolving
// -1): bf16 or int8 tiles for int8/int4, AMX tiles for bf16 where `kernels`
// has them; 0 (never) for types that have none. `records`: for experts whose
// int8 tile records are built.
int64_t TileMinTokens(const ExecutorOptions& options, const KernelTable& kernels, common::DType type, bool records);
// The oneDNN threshold `options` gives with `kernels` (resolving -1).
int64_t OnednnMinTokens(const ExecutorOptions& options, const KernelTable& kernels);
// The smallest row count at which `type`'s kernel changes (its oneDNN or
// tile threshold, whichever is set and smaller), 0 when none does.
// Below it, a row's result is the same bits whatever the expert's row count.
// `records` as for TileMinTokens.
int64_t RowSplitLimit(const ExecutorOptions& options, const KernelTable& kernels, common::DType type, bool records);

// A layer's routes grouped by expert: the tasks RunExperts takes. `tasks`
// point into `rows` and `weights` (moving the struct keeps them valid; do not
// copy it).
struct GroupedRoutes {
  std::vector<std::vector<int32_t>> rows;   // [expert] token rows routed to it
  std::vector<std::vector<float>> weights;  // [expert] their routing weights
  std::vector<std::vector<int32_t>> slots;  // [expert] their route slots t * top_k + j
  std::vector<ExpertTask> tasks;            // one per routed expert, in expert id order
};

// With `to_slots`, each task writes its results to dst row t * top_k + j
// (out_rows = slots) instead of accumulating into row t: dst must then have
// T * top_k rows.
// REQUIRES: experts[e] is non-null for every routed expert id e (others may
// be null), ids < experts.size().
GroupedRoutes GroupByExpert(const common::Routes& routes, absl::Span<const common::ExpertWeights* const> experts,
                            bool to_slots = false);

// Builds the int8 tile records of the expert's three matrices
// (BuildQ8Records) in anonymous memory placed by `options`, points the views'
// q8_records at them and hands the memory to expert->q8_records. What a
// RunExperts call then computes is the same bits, without repacking.
// FAILED_PRECONDITION where `kernels` has no int8 tiles for the expert's type
// (not int8/int4, no AVX512_VNNI, or a profile that widens it), naming why;
// RESOURCE_EXHAUSTED if the memory cannot be mapped.
absl::Status AttachQ8Records(common::ExpertWeights* expert, const KernelTable& kernels,
                             const common::AnonymousMemory::Options& options);
// The bytes of anonymous memory AttachQ8Records would map for `expert`
// (0 where it would refuse): for a memory check before building them.
size_t Q8RecordsFootprint(const common::ExpertWeights& expert, const KernelTable& kernels);

// The tasks RunExperts actually runs, in its order: grouped by expert shape
// (d_ff and weight type) in order of first appearance, and each task of more
// than kMaxTaskRows rows split into consecutive tasks of at most that many.
// Running consecutive slices of this list with RunExperts, one after the
// other on the same dst, gives results identical bit for bit to one
// RunExperts call on `tasks`: how an expert node interleaves long calls.
inline constexpr int64_t kMaxTaskRows = 256;
std::vector<ExpertTask> ExecutionOrder(absl::Span<const ExpertTask> tasks);

// Runs ExecutionOrder(tasks): experts of different d_ff (a layer's shared
// experts) run as one pass per shape; results accumulate into dst, per dst
// row in that order.
// REQUIRES: every task's expert has the same d_model and weight type; rows <
// the number of rows of x, out_rows (or rows) < the number of rows of dst
// (both [rows][d_model], f32).
// Returns false if options.should_stop stopped the call (dst is then
// incomplete and must be discarded), true otherwise.
bool RunExperts(ThreadPool& pool, absl::Span<const ExpertTask> tasks, const float* x, int64_t d_model, float* dst,
                Workspace& workspace, const ExecutorOptions& options = {});

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_EXPERT_EXECUTOR_H_
