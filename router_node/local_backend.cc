#include "router_node/local_backend.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace colibri {
namespace router_node {

absl::Status LocalBackend::Compute(const LayerWork& work, float* contributions, CallControl& control,
                                   BackendStats* stats) {
  const auto start = std::chrono::steady_clock::now();
  const std::shared_ptr<const expert_node::WeightSet> set = store_->Current();  // held until we return
  std::vector<kernels::ExpertTask> tasks;
  tasks.reserve(work.experts.size());
  for (const ExpertWork& w : work.experts) {
    absl::StatusOr<const common::ExpertWeights*> weights = set->Find(work.layer, w.expert);
    if (!weights.ok()) return weights.status();
    tasks.push_back({*weights, w.rows.data(), w.weights.data(), static_cast<int64_t>(w.rows.size()), w.slots.data(),
                     w.kernel_rows});
  }
  // Wait for this call's turn; a call cancelled or past its deadline meanwhile leaves the line.
  const char place = 0;  // this call's place in line: an address no other call in flight has
  const void* const me = &place;
  {
    common::MutexLock lock(&turn_mu_);
    turns_.push_back(me);
    while (turns_.front() != me) {
      if (control.cancelled() || absl::Now() > control.deadline()) {
        turns_.erase(std::find(turns_.begin(), turns_.end(), me));  // behind the front: in the line
        break;
      }
      // Cancellation sends no signal here: look again every 10 ms.
      turn_cv_.WaitWithTimeout(&turn_mu_, std::min(absl::Milliseconds(10), control.deadline() - absl::Now()));
    }
  }
  // Leaves the front of the line (if there) when the call returns.
  const auto leave = absl::MakeCleanup([this, me] { LeaveTurn(me); });
  if (control.cancelled()) return absl::CancelledError("cancelled before the experts ran");
  if (absl::Now() > control.deadline()) {
    return absl::DeadlineExceededError(absl::StrCat("deadline passed before layer ", work.layer, " ran"));
  }
  common::MutexLock lock(&mu_);
  const auto begin = std::chrono::steady_clock::now();
  kernels::RunExperts(*pool_, tasks, work.x, set->model().manifest().d_model, contributions, workspace_);
  for (const kernels::ExpertTask& t : tasks) {  // a file truncated under the mapping gave zeros: not an answer
    COLIBRI_RETURN_IF_ERROR(
        common::CheckIntact(*t.expert, "open the engine again (or restart the router) with intact files"));
  }
  if (stats != nullptr) {
    NodeCallRecord r;
    r.node = "local";
    r.start_nanos = std::chrono::duration_cast<std::chrono::nanoseconds>(begin - start).count();
    r.end_nanos =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
    r.rows = work.num_tokens;
    r.experts = static_cast<int64_t>(tasks.size());
    for (const ExpertWork& w : work.experts) {
      absl::StrAppend(&r.experts_list, r.experts_list.empty() ? "" : ",", w.expert);
    }
    r.node_compute_nanos = r.end_nanos - r.start_nanos;
    stats->calls.push_back(r);
  }
  return absl::OkStatus();
}

void LocalBackend::LeaveTurn(const void* me) {
  common::MutexLock lock(&turn_mu_);
  if (!turns_.empty() && turns_.front() == me) {
    turns_.pop_front();
    turn_cv_.SignalAll();
  }
}

bool LocalBackend::Mergeable(const LayerWork& work) const {
  const std::shared_ptr<const expert_node::WeightSet> set = store_->Current();
  for (const ExpertWork& w : work.experts) {
    absl::StatusOr<const common::ExpertWeights*> weights = set->Find(work.layer, w.expert);
    if (!weights.ok()) return false;
    // Compute runs the executor with its default options.
    const int64_t limit = kernels::RowSplitLimit(kernels::ExecutorOptions{}, kernels::SelectedKernels(),
                                                 (*weights)->w1.layout.dtype, (*weights)->w1.q8_records != nullptr);
    if (limit > 0 && static_cast<int64_t>(w.rows.size()) >= limit) return false;
  }
  return true;
}

}  // namespace router_node
}  // namespace colibri
