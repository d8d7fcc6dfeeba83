#include "expert_node/compute_engine.h"

#include <sys/mman.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status_macros.h"

namespace colibri {
namespace expert_node {

ComputeEngine::ComputeEngine(ExpertStore* store, kernels::ThreadPool* pool, Limits limits)
    : store_(store), pool_(pool), limits_(limits) {}

absl::StatusOr<ComputeOutput> ComputeEngine::Compute(const ComputeInput& in) {
  COLIBRI_ASSIGN_OR_RETURN(std::unique_ptr<PreparedCall> call, Prepare(in));
  for (;;) {
    COLIBRI_ASSIGN_OR_RETURN(const bool done, RunSlice(*call, std::numeric_limits<int64_t>::max()));
    if (done) return Finish(*call);
  }
}

absl::StatusOr<std::unique_ptr<PreparedCall>> ComputeEngine::Prepare(const ComputeInput& in) {
  auto call = std::make_unique<PreparedCall>();
  call->set = store_->Current();  // held by the call
  const WeightSet* set = call->set.get();
  const common::Manifest& m = set->model().manifest();
  if (!in.model_id.empty() && in.model_id != set->model().model_id()) {
    return absl::FailedPreconditionError(
        absl::StrCat("model_id '", in.model_id, "' does not match this node's model '", set->model().model_id(), "'"));
  }
  if (in.layer < 0 || in.layer >= m.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", in.layer, " is outside [0, ", m.n_layers, ")"));
  }
  if (in.num_rows < 0) return absl::InvalidArgumentError(absl::StrCat("rows: ", in.num_rows, " rows"));
  if (in.num_rows > limits_.max_rows) {
    return absl::ResourceExhaustedError(
        absl::StrCat("rows: ", in.num_rows, " rows exceed the limit of ", limits_.max_rows));
  }
  if (static_cast<int64_t>(in.rows.size()) != in.num_rows * m.d_model) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows: ", in.rows.size(), " values for ", in.num_rows, " rows of d_model ", m.d_model));
  }
  if (in.check_finite) {
    for (size_t i = 0; i < in.rows.size(); ++i) {
      if (!std::isfinite(in.rows[i])) {
        return absl::InvalidArgumentError(absl::StrCat("rows[", i / m.d_model, "][", i % m.d_model, "] is not finite"));
      }
    }
  }
  std::vector<kernels::ExpertTask> tasks;
  std::vector<int32_t>& slots = call->slots;
  std::set<int32_t> experts_seen;
  int64_t indices = 0;
  for (size_t w = 0; w < in.experts.size(); ++w) {
    const ExpertWork& work = in.experts[w];
    if (!experts_seen.insert(work.expert).second) {
      return absl::InvalidArgumentError(absl::StrCat("experts[", w, "]: expert ", work.expert, " is listed twice"));
    }
    if (work.expert < 0 || work.expert >= m.total_experts()) {
      return absl::InvalidArgumentError(
          absl::StrCat("experts[", w, "]: expert ", work.expert, " is outside [0, ", m.total_experts(), ")"));
    }
    auto weights = set->Find(in.layer, work.expert);
    if (!weights.ok()) return weights.status();
    if (work.row_indices.size() != work.weights.size()) {
      return absl::InvalidArgumentError(absl::StrCat("experts[", w, "] (expert ", work.expert,
                                                     "): ", work.row_indices.size(), " row indices but ",
                                                     work.weights.size(), " weights"));
    }
    indices += static_cast<int64_t>(work.row_indices.size());
    if (indices > limits_.max_row_indices) {
      return absl::ResourceExhaustedError(absl::StrCat("experts: more than ", limits_.max_row_indices, " row indices"));
    }
    std::set<int32_t> rows_seen;
    for (size_t i = 0; i < work.row_indices.size(); ++i) {
      const int32_t r = work.row_indices[i];
      if (r < 0 || r >= in.num_rows) {
        return absl::InvalidArgumentError(
            absl::StrCat("experts[", w, "].row_indices[", i, "] = ", r, " is outside [0, ", in.num_rows, ")"));
      }
      if (!rows_seen.insert(r).second) {
        return absl::InvalidArgumentError(absl::StrCat("experts[", w, "].row_indices[", i, "] = ", r, " is repeated"));
      }
      if (!std::isfinite(work.weights[i])) {
        return absl::InvalidArgumentError(absl::StrCat("experts[", w, "].weights[", i, "] is not finite"));
      }
    }
    if (!work.row_indices.empty()) {
      tasks.push_back(
          {*weights, work.row_indices.data(), work.weights.data(), static_cast<int64_t>(work.row_indices.size())});
    }
  }
  if (in.per_expert_output) {
    slots.resize(indices);
    for (int64_t i = 0; i < indices; ++i) slots[i] = static_cast<int32_t>(i);
    int64_t first = 0;
    for (kernels::ExpertTask& t : tasks) {
      t.out_rows = slots.data() + first;
      first += t.num_rows;
    }
  }
  // Ask the kernel to start reading any page-cache weights of this call now
  // (a no-op for weights locked in RAM or copied to anonymous memory).
  for (const kernels::ExpertTask& t : tasks) {
    if (t.expert->file != nullptr && !set->locked()) {
      madvise(const_cast<uint8_t*>(t.expert->file->data()), t.expert->file->size(), MADV_WILLNEED);
    }
  }
  call->output.assign((in.per_expert_output ? indices : in.num_rows) * m.d_model, 0.f);
  call->tasks = kernels::ExecutionOrder(tasks);
  call->rows = in.rows.data();
  call->should_stop = in.should_stop;
  return call;
}

absl::StatusOr<bool> ComputeEngine::RunSlice(PreparedCall& call, int64_t slice_rows) {
  size_t end = call.next;
  int64_t rows = 0;
  while (end < call.tasks.size() && (end == call.next || rows + call.tasks[end].num_rows <= slice_rows)) {
    rows += call.tasks[end].num_rows;
    ++end;
  }
  const auto start = std::chrono::steady_clock::now();
  bool completed = false;
  {
    common::MutexLock lock(&workspace_mu_);
    kernels::ExecutorOptions options;
    options.should_stop = call.should_stop;
    const absl::Span<const kernels::ExpertTask> slice =
        absl::MakeConstSpan(call.tasks).subspan(call.next, end - call.next);
    completed = kernels::RunExperts(*pool_, slice, call.rows, call.set->model().manifest().d_model, call.output.data(),
                                    workspace_, options);
  }
  call.compute_nanos +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  if (!completed) return absl::CancelledError("the call was abandoned during compute (cancelled or past its deadline)");
  for (size_t i = call.next; i < end; ++i) {
    const common::ExpertWeights& e = *call.tasks[i].expert;
    if (e.file != nullptr && e.file->faulted()) {
      return absl::DataLossError(absl::StrCat(
          "layer ", e.layer, " expert ", e.expert,
          ": its weight file shrank while the node served it from the page cache (changed in place); the node "
          "must be reloaded with intact files"));
    }
  }
  call.next = end;
  return call.next == call.tasks.size();
}

ComputeOutput ComputeEngine::Finish(PreparedCall& call) {
  ComputeOutput out;
  out.output = std::move(call.output);
  out.weights_version = call.set->version();
  out.compute_nanos = call.compute_nanos;
  return out;
}

}  // namespace expert_node
}  // namespace colibri
