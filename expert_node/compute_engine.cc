#include "expert_node/compute_engine.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status_macros.h"

namespace colibri {
namespace expert_node {

ComputeEngine::ComputeEngine(ExpertStore* store, kernels::ThreadPool* pool, Limits limits, bool advise_reads)
    : store_(store), pool_(pool), limits_(limits), advise_reads_(advise_reads) {}

absl::StatusOr<ComputeOutput> ComputeEngine::Compute(const ComputeInput& in) {
  COLIBRI_ASSIGN_OR_RETURN(std::unique_ptr<PreparedCall> call, Prepare(in));
  for (;;) {
    COLIBRI_ASSIGN_OR_RETURN(const bool done, RunSlice(*call, std::numeric_limits<int64_t>::max()));
    if (done) return Finish(*call);
  }
}

absl::StatusOr<std::unique_ptr<PreparedCall>> ComputeEngine::Prepare(const ComputeInput& in) {
  auto call = std::make_unique<PreparedCall>();
  call->set = store_->ForModel(in.model_id);  // held by the call
  if (call->set == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("model_id '", in.model_id, "' does not match this node's model '",
                                                      store_->Current()->model().model_id(), "'"));
  }
  const WeightSet* set = call->set.get();
  const common::Manifest& m = set->model().manifest();
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
  const bool grouped = in.num_output_rows > 0;
  if (in.num_output_rows < 0 || (grouped && in.per_expert_output)) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_output_rows = ", in.num_output_rows, " must be >= 0, and 0 with per_expert_output"));
  }
  std::vector<kernels::ExpertTask> tasks;
  std::vector<int32_t>& slots = call->slots;
  struct Entry {
    int32_t output_row, rank, index;
  };
  std::vector<Entry> entries;  // grouped output
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
    if (work.kernel_rows < 0) {
      return absl::InvalidArgumentError(absl::StrCat("experts[", w, "] (expert ", work.expert,
                                                     "): kernel_rows = ", work.kernel_rows, " is negative"));
    }
    auto weights = set->Find(in.layer, work.expert);
    if (!weights.ok()) return weights.status();
    if (work.row_indices.size() != work.weights.size()) {
      return absl::InvalidArgumentError(absl::StrCat("experts[", w, "] (expert ", work.expert,
                                                     "): ", work.row_indices.size(), " row indices but ",
                                                     work.weights.size(), " weights"));
    }
    if (work.output_rows.size() != (grouped ? work.row_indices.size() : 0) ||
        work.ranks.size() != work.output_rows.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("experts[", w, "] (expert ", work.expert, "): ", work.output_rows.size(), " output_rows and ",
                       work.ranks.size(), " ranks; ",
                       grouped ? "one each per row index with num_output_rows" : "none without num_output_rows"));
    }
    for (size_t i = 0; i < work.output_rows.size(); ++i) {
      if (work.output_rows[i] < 0 || work.output_rows[i] >= in.num_output_rows || work.ranks[i] < 0) {
        return absl::InvalidArgumentError(absl::StrCat("experts[", w, "]: output_rows[", i, "] = ", work.output_rows[i],
                                                       " (must be in [0, ", in.num_output_rows, ")), ranks[", i,
                                                       "] = ", work.ranks[i], " (must be >= 0)"));
      }
      entries.push_back({work.output_rows[i], work.ranks[i], static_cast<int32_t>(indices + i)});
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
      tasks.push_back({*weights, work.row_indices.data(), work.weights.data(),
                       static_cast<int64_t>(work.row_indices.size()), nullptr, work.kernel_rows});
    }
  }
  if (grouped) {
    // Every output row is named by an entry, so there are no more rows than
    // entries; checked before sizing anything by num_output_rows.
    if (in.num_output_rows > indices) {
      return absl::InvalidArgumentError(absl::StrCat("num_output_rows = ", in.num_output_rows, " exceeds the ", indices,
                                                     " row indices that could fill them"));
    }
    std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      return a.output_row != b.output_row ? a.output_row < b.output_row : a.rank < b.rank;
    });
    call->fold_start.assign(in.num_output_rows + 1, 0);
    for (size_t i = 0; i < entries.size(); ++i) {
      if (i > 0 && entries[i].output_row == entries[i - 1].output_row && entries[i].rank == entries[i - 1].rank) {
        return absl::InvalidArgumentError(
            absl::StrCat("output row ", entries[i].output_row, ": rank ", entries[i].rank, " given twice"));
      }
      ++call->fold_start[entries[i].output_row + 1];
      call->fold_order.push_back(entries[i].index);
    }
    for (int64_t o = 0; o < in.num_output_rows; ++o) {
      if (call->fold_start[o + 1] == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("output row ", o, " of ", in.num_output_rows, " is named by no entry"));
      }
      call->fold_start[o + 1] += call->fold_start[o];
    }
  }
  if (in.per_expert_output || grouped) {
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
    if (advise_reads_ && t.expert->file != nullptr && !set->locked()) {
      madvise(const_cast<uint8_t*>(t.expert->file->data()), t.expert->file->size(), MADV_WILLNEED);
    }
  }
  call->output.assign((in.per_expert_output || grouped ? indices : in.num_rows) * m.d_model, 0.f);
  call->tasks = kernels::ExecutionOrder(tasks);
  call->rows = in.rows.data();
  call->num_rows = in.num_rows;
  call->per_entry = in.per_expert_output || grouped;
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
  const absl::Span<const kernels::ExpertTask> slice =
      absl::MakeConstSpan(call.tasks).subspan(call.next, end - call.next);
  const bool completed =
      Run(slice, call.rows, call.set->model().manifest().d_model, call.output.data(), call.should_stop);
  call.compute_nanos +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  COLIBRI_RETURN_IF_ERROR(Check(completed, slice));
  call.next = end;
  return call.next == call.tasks.size();
}

bool ComputeEngine::Run(absl::Span<const kernels::ExpertTask> tasks, const float* rows, int64_t d_model, float* output,
                        const std::function<bool()>& should_stop) {
  common::MutexLock lock(&workspace_mu_);
  kernels::ExecutorOptions options;
  options.should_stop = should_stop;
  return kernels::RunExperts(*pool_, tasks, rows, d_model, output, workspace_, options);
}

absl::Status ComputeEngine::Check(bool completed, absl::Span<const kernels::ExpertTask> tasks) {
  if (!completed) return absl::CancelledError("the call was abandoned during compute (cancelled or past its deadline)");
  for (const kernels::ExpertTask& t : tasks) {
    COLIBRI_RETURN_IF_ERROR(common::CheckIntact(*t.expert, "the node must be reloaded with intact files"));
  }
  return absl::OkStatus();
}

std::vector<absl::Status> ComputeEngine::RunMerged(absl::Span<PreparedCall* const> calls) {
  const int64_t d = calls[0]->set->model().manifest().d_model;
  // The calls' rows one after the other, and their outputs likewise.
  std::vector<int64_t> row_base, out_base;
  int64_t rows = 0, outputs = 0;
  for (const PreparedCall* c : calls) {
    row_base.push_back(rows);
    out_base.push_back(outputs);
    rows += c->num_rows;
    outputs += static_cast<int64_t>(c->output.size()) / d;
  }
  std::vector<float> x(rows * d), out(outputs * d, 0.f);
  for (size_t i = 0; i < calls.size(); ++i)
    std::copy_n(calls[i]->rows, calls[i]->num_rows * d, x.data() + row_base[i] * d);
  // One work per expert where the calls' counts allow, else one per call's task.
  struct Work {
    explicit Work(const common::ExpertWeights* e) : expert(e) {}
    const common::ExpertWeights* expert;
    std::vector<int32_t> rows, out_rows;
    std::vector<float> weights;
    int64_t kernel_rows = 0;
  };
  std::vector<Work> works;
  std::map<const common::ExpertWeights*, size_t> shared;  // expert -> its merged work
  const kernels::KernelTable& kernels = kernels::SelectedKernels();
  for (size_t i = 0; i < calls.size(); ++i) {
    for (const kernels::ExpertTask& t : calls[i]->tasks) {
      const int64_t own = t.kernel_rows > 0 ? t.kernel_rows : t.num_rows;
      const int64_t limit = kernels::RowSplitLimit(kernels::ExecutorOptions{}, kernels, t.expert->w1.layout.dtype,
                                                   t.expert->w1.q8_records != nullptr);
      size_t w = works.size();
      if (limit <= 0 || own < limit) {
        const auto [at, added] = shared.emplace(t.expert, works.size());
        w = at->second;
        if (added) works.emplace_back(t.expert);
      } else {
        works.emplace_back(t.expert);
      }
      Work& work = works[w];
      for (int64_t r = 0; r < t.num_rows; ++r) {
        work.rows.push_back(static_cast<int32_t>(t.rows[r] + row_base[i]));
        work.out_rows.push_back(static_cast<int32_t>(t.out_rows[r] + out_base[i]));
        work.weights.push_back(t.weights[r]);
      }
      work.kernel_rows = std::max(work.kernel_rows, own);
    }
  }
  std::vector<kernels::ExpertTask> tasks;
  for (const Work& w : works) {
    tasks.push_back({w.expert, w.rows.data(), w.weights.data(), static_cast<int64_t>(w.rows.size()), w.out_rows.data(),
                     w.kernel_rows});
  }
  // The pass stops only when every caller has given up.
  auto stop = [calls] {
    return std::all_of(calls.begin(), calls.end(),
                       [](const PreparedCall* c) { return c->should_stop != nullptr && c->should_stop(); });
  };
  const auto start = std::chrono::steady_clock::now();
  const bool completed = Run(tasks, x.data(), d, out.data(), stop);
  const int64_t nanos =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  std::vector<absl::Status> status;
  for (size_t i = 0; i < calls.size(); ++i) {
    PreparedCall& c = *calls[i];
    status.push_back(Check(completed, c.tasks));
    if (!status.back().ok()) continue;
    std::copy_n(out.data() + out_base[i] * d, c.output.size(), c.output.data());
    c.compute_nanos += nanos;
    c.next = c.tasks.size();
  }
  return status;
}

ComputeOutput ComputeEngine::Finish(PreparedCall& call) {
  ComputeOutput out;
  if (call.fold_start.empty()) {
    out.output = std::move(call.output);
  } else {
    // Each output row: its entries in rank order, the first copied and the
    // others added one by one (the router's fold over a route).
    const int64_t d = call.set->model().manifest().d_model;
    const int64_t rows = static_cast<int64_t>(call.fold_start.size()) - 1;
    out.output.resize(rows * d);
    for (int64_t o = 0; o < rows; ++o) {
      float* dst = out.output.data() + o * d;
      const int32_t* e = call.fold_order.data() + call.fold_start[o];
      const int32_t n = call.fold_start[o + 1] - call.fold_start[o];
      std::memcpy(dst, call.output.data() + int64_t{e[0]} * d, d * sizeof(float));
      for (int32_t i = 1; i < n; ++i) {
        const float* src = call.output.data() + int64_t{e[i]} * d;
        for (int64_t c = 0; c < d; ++c) dst[c] += src[c];
      }
    }
  }
  out.weights_version = call.set->version();
  out.compute_nanos = call.compute_nanos;
  return out;
}

}  // namespace expert_node
}  // namespace colibri
