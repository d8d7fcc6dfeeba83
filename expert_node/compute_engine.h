#ifndef COLIBRI_EXPERT_NODE_COMPUTE_ENGINE_H_
#define COLIBRI_EXPERT_NODE_COMPUTE_ENGINE_H_

// The expert node's core: validate one Compute call against the current
// weight set and run it on the node's thread pool. Plain C++ types in and
// out; no gRPC (expert_service.cc is the transport).
//
// The output is, per row, the weighted partial sum over the call's experts
// (rows no expert references stay zero), computed by kernels::RunExperts in
// the call's expert order — so a node's answer for a set of experts equals
// the in-process executor's answer for the same tasks, bit for bit.
// A call can also run in slices (Prepare, then RunSlice until it says done):
// the expert service interleaves the slices of concurrent calls so that one
// long call cannot starve the others; the answer is the same bit for bit.
// Thread-safe: slices are serialized on the pool; a call holds its weight set
// until it is destroyed, so a reload never changes weights under a call.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "expert_node/expert_store.h"
#include "kernels/expert_executor.h"
#include "kernels/thread_pool.h"

namespace colibri {
namespace expert_node {

struct ExpertWork {
  int32_t expert = 0;
  std::vector<int32_t> row_indices;  // into ComputeInput::rows
  std::vector<float> weights;        // one per row index
  // Grouped output only (ComputeInput::num_output_rows > 0): per row index
  // the output row it is added into, and its rank (the order of additions).
  std::vector<int32_t> output_rows;
  std::vector<int32_t> ranks;
  // >= 0: the row count that chooses the kernel; 0: row_indices.size()
  // (kernels::ExpertTask::kernel_rows).
  int64_t kernel_rows = 0;
};

struct ComputeInput {
  int32_t layer = 0;
  int64_t num_rows = 0;
  std::vector<float> rows;  // [num_rows][d_model], f32
  std::vector<ExpertWork> experts;
  std::string model_id;       // empty, or must equal the loaded model's id
  bool check_finite = false;  // refuse NaN/Inf in rows
  // false: output row i = Σ over experts of weight · FFN(rows[i]) ([num_rows]
  // rows). true: one output row per (expert, row index) in request order —
  // experts[0]'s row indices first — each exactly weight · FFN(row), so the
  // router can sum a token's experts in route order whatever the shard map.
  bool per_expert_output = false;
  // > 0 (per_expert_output false): grouped output — num_output_rows rows,
  // row o the entries with output_rows o added in ascending rank, the first
  // copied (proto/colibri/v1/expert_node.proto, ComputeRequest).
  int64_t num_output_rows = 0;
  // Polled while computing (kernels::ExecutorOptions::should_stop); true
  // abandons the call: Compute returns CANCELLED. Null: never.
  std::function<bool()> should_stop;
};

// A validated call, computed in slices by ComputeEngine::RunSlice. Points
// into its ComputeInput, which must outlive it.
struct PreparedCall {
  std::shared_ptr<const WeightSet> set;
  std::vector<int32_t> slots;  // per-entry output: output row of each (expert, row index)
  // Grouped output: entries (indices into the per-entry output) in the
  // order they are folded, and where each output row's run of them starts.
  std::vector<int32_t> fold_order;
  std::vector<int32_t> fold_start;         // [num_output_rows + 1]
  std::vector<kernels::ExpertTask> tasks;  // kernels::ExecutionOrder of the call's tasks
  size_t next = 0;                         // first task not yet run
  const float* rows = nullptr;
  std::function<bool()> should_stop;
  std::vector<float> output;
  int64_t compute_nanos = 0;  // summed over the slices run so far
  int64_t num_rows = 0;       // of `rows`
  bool per_entry = false;     // one output row per (expert, row index): per_expert_output or grouped
};

struct ComputeOutput {
  std::vector<float> output;  // [num_rows or Σ row indices][d_model]
  uint64_t weights_version = 0;
  int64_t compute_nanos = 0;
};

class ComputeEngine {
 public:
  struct Limits {
    int64_t max_rows = 65536;           // rows of one call
    int64_t max_row_indices = 1 << 20;  // Σ over experts
  };

  // `store` and `pool` must outlive the engine. `advise_reads`: Prepare asks
  // the kernel to start reading the call's experts that are mapped and not
  // locked (MADV_WILLNEED); off where something else reads them in first
  // (PagedWeights, for paged residency), so the call does not ask again.
  ComputeEngine(ExpertStore* store, kernels::ThreadPool* pool, Limits limits, bool advise_reads = true);

  // INVALID_ARGUMENT (bad layer, negative row count, rows size, expert id
  // outside the model, row index, duplicate expert or index, weights length,
  // non-finite weight or — with check_finite — row value),
  // FAILED_PRECONDITION (expert not owned, naming it; model_id mismatch),
  // RESOURCE_EXHAUSTED (more rows or row indices than the limits). Each
  // message names the field and the value. CANCELLED when in.should_stop
  // stopped the computation (the pool is free again within one block).
  // DATA_LOSS when a weight file served from the page cache shrank under the
  // call (common/sigbus_guard.h: the lost pages read as zeros; the result is
  // discarded).
  absl::StatusOr<ComputeOutput> Compute(const ComputeInput& input);

  // Compute in steps: Prepare validates (the same errors as Compute) and
  // allocates the output; each RunSlice runs the call's next tasks, about
  // `slice_rows` (expert, row) pairs, at least one task of at most
  // kernels::kMaxTaskRows rows; true when the call is complete (then
  // Finish), CANCELLED if should_stop stopped it.
  absl::StatusOr<std::unique_ptr<PreparedCall>> Prepare(const ComputeInput& input);
  absl::StatusOr<bool> RunSlice(PreparedCall& call, int64_t slice_rows);
  static ComputeOutput Finish(PreparedCall& call);

  // Runs several prepared calls as one executor pass, so that an expert
  // several of them need is read once: each expert's rows of all the calls
  // form one task wherever each call's own row count for it is below the
  // kernels' row threshold (kernels::RowSplitLimit; kernel_rows is the
  // largest), else the call's task stays its own. Every call's output is
  // then the bits it gets alone. Returns one status per call: OK (the call
  // is complete: Finish it), CANCELLED for all when every call's should_stop
  // stopped the pass, DATA_LOSS as RunSlice for a call whose own experts'
  // file shrank.
  // REQUIRES: calls share one weight set, none has run a slice, all have
  // per_entry output (a call summing its experts into its rows adds them in
  // its own order, which a shared pass would not keep).
  std::vector<absl::Status> RunMerged(absl::Span<PreparedCall* const> calls);

  const Limits& limits() const { return limits_; }

 private:
  // RunExperts on the pool with the engine's workspace; false if stopped.
  bool Run(absl::Span<const kernels::ExpertTask> tasks, const float* rows, int64_t d_model, float* output,
           const std::function<bool()>& should_stop);
  // CANCELLED when not `completed`; DATA_LOSS when a task's weight file shrank under it.
  static absl::Status Check(bool completed, absl::Span<const kernels::ExpertTask> tasks);

  ExpertStore* const store_;
  kernels::ThreadPool* const pool_;
  const Limits limits_;
  const bool advise_reads_;
  common::Mutex workspace_mu_;
  kernels::Workspace workspace_ ABSL_GUARDED_BY(workspace_mu_);
};

}  // namespace expert_node
}  // namespace colibri

#endif  // COLIBRI_EXPERT_NODE_COMPUTE_ENGINE_H_
