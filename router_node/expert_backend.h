#ifndef COLIBRI_ROUTER_NODE_EXPERT_BACKEND_H_
#define COLIBRI_ROUTER_NODE_EXPERT_BACKEND_H_

// The seam between the router's core and wherever experts run: "compute
// these rows of these experts for layer L". Two implementations: in-process
// (LocalBackend: the kernels on this process's weights) and remote
// (RemoteBackend: ExpertNode calls over gRPC). Both write each (token, expert)
// result to its own slot, exactly weight · FFN_e(x[row]); the core then sums a
// token's slots in route order, so the answer does not depend on the backend
// or on how experts are spread over nodes. A backend may also fill a run of
// one token's slots with their sum: the run's fold (in route order) in its
// first slot and -0.0 in the others — x + -0.0 is x for every float, so the
// core's fold then gives the same bits as if each slot had been written.

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace colibri {
namespace router_node {

// The deadline and cancellation of one request, shared by the transport
// (which cancels when the client goes away) and the backend (which cancels
// its node calls). Thread-safe.
class CallControl {
 public:
  explicit CallControl(absl::Time deadline = absl::InfiniteFuture()) : deadline_(deadline) {}
  CallControl(const CallControl&) = delete;
  CallControl& operator=(const CallControl&) = delete;

  absl::Time deadline() const { return deadline_; }
  bool cancelled() const;
  // Marks the request cancelled and runs every registered hook once, on this
  // thread, outside the control's lock (a hook may call RemoveHook).
  void Cancel();
  // Runs `hook` on Cancel() — at once, on this thread, if already cancelled.
  // The returned id removes it. RemoveHook returns only when no hook is
  // running, except on the thread running the hooks (where it does not wait).
  int AddHook(std::function<void()> hook);
  void RemoveHook(int id);

 private:
  const absl::Time deadline_;
  mutable common::Mutex mu_;
  common::CondVar hooks_done_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::thread::id running_ ABSL_GUARDED_BY(mu_);  // the thread running the hooks, if any
  int next_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, std::function<void()>> hooks_ ABSL_GUARDED_BY(mu_);
};

// One expert's share of a layer call.
struct ExpertWork {
  int32_t expert = 0;
  std::vector<int32_t> rows;   // token rows of LayerWork::x, ascending
  std::vector<float> weights;  // routing weight per row
  std::vector<int32_t> slots;  // where each row's result goes: t * top_k + j
  // The row count that chooses the node's kernel; 0: rows.size()
  // (kernels::ExpertTask::kernel_rows): set where several callers' rows
  // are merged into one work.
  int64_t kernel_rows = 0;
};

struct LayerWork {
  int32_t layer = 0;
  const float* x = nullptr;  // [num_tokens][d_model], f32; lives until Compute returns
  // The same rows as the client sent them when that was bf16 (x is their
  // exact widening), else null: remote backends send these, half the bytes,
  // and the nodes widen them to the same f32 values.
  const uint16_t* x_bf16 = nullptr;
  int64_t num_tokens = 0;
  int64_t num_slots = 0;  // num_tokens * top_k (slots per token: routed + shared experts)
  // The caller rounds each token's sum to bf16: a backend that returns a
  // token's whole sum (below) may return it already rounded.
  bool bf16_output = false;
  std::vector<ExpertWork> experts;  // ascending expert id, each non-empty
  std::string request_id;
};

// What a backend did for one layer call, for timings and traces.
struct NodeCallRecord {
  std::string node;         // address, or "local"
  int64_t start_nanos = 0;  // from the start of Compute
  int64_t end_nanos = 0;
  int64_t rows = 0;  // token rows sent
  int64_t experts = 0;
  std::string experts_list;  // "0,3": the expert ids of the call
  int attempt = 0;           // 0 first try, 1 the retry on another replica
  bool hedge = false;        // a hedge: sent because the planned call was slow
  absl::StatusCode code = absl::StatusCode::kOk;
  int64_t node_compute_nanos = 0;  // the node's own kernel time, when known
  int64_t bytes_sent = 0;          // the serialized request and reply (remote calls)
  int64_t bytes_received = 0;
};

struct BackendStats {
  std::vector<NodeCallRecord> calls;
  int retries = 0;  // node calls retried on another replica
};

class ExpertBackend {
 public:
  virtual ~ExpertBackend() = default;

  // For every work w and index i, writes w.weights[i] · FFN_{w.expert}(x[w.rows[i]])
  // to contributions[w.slots[i]] ([num_slots][d_model] f32). Other slots are
  // not touched. On error the contents are unspecified and the status says
  // which layer/expert failed: UNAVAILABLE (no live node serves it),
  // DEADLINE_EXCEEDED, CANCELLED, INTERNAL (a node refused planned work).
  // `stats` (may be null) receives what was done. Thread-safe.
  virtual absl::Status Compute(const LayerWork& work, float* contributions, CallControl& control,
                               BackendStats* stats) = 0;

  // The same, ending with done(status) instead of returning: `work`,
  // `contributions`, `control` and `stats` must live until `done` runs,
  // which is exactly once, on this thread or on another (for the remote
  // backend: the thread that delivered the last node reply). The default
  // calls Compute on this thread.
  virtual void ComputeAsync(const LayerWork& work, float* contributions, CallControl& control, BackendStats* stats,
                            std::function<void(absl::Status)> done) {
    done(Compute(work, contributions, control, stats));
  }

  // True when ComputeAsync returns before the experts have run (it only
  // sends them work), so it may be called from a thread that must not block.
  virtual bool asynchronous() const { return false; }

  // True when every expert of `work` has fewer rows than the count at which
  // the kernels of any node that may compute it change (their
  // row_split_limit): its rows may then share one kernel pass with other
  // callers' rows of the same expert, in a work whose kernel_rows is the
  // largest caller's count, and keep their bits. The default: never.
  virtual bool Mergeable(const LayerWork& work) const { return false; }

  // "local" or "distributed".
  virtual std::string kind() const = 0;
};

}  // namespace router_node
}  // namespace colibri

#endif  // COLIBRI_ROUTER_NODE_EXPERT_BACKEND_H_
