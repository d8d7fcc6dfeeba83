#ifndef COLIBRI_ROUTER_NODE_LOCAL_BACKEND_H_
#define COLIBRI_ROUTER_NODE_LOCAL_BACKEND_H_

// The in-process ExpertBackend: the expert node's store and the kernels on
// this process's thread pool, no serialization. The same executor an expert
// node runs, writing each (token, expert) result to its slot — so local and
// distributed answers are the same bits.

#include <deque>
#include <string>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "expert_node/expert_store.h"
#include "kernels/expert_executor.h"
#include "kernels/thread_pool.h"
#include "router_node/expert_backend.h"

namespace colibri {
namespace router_node {

class LocalBackend final : public ExpertBackend {
 public:
  // `store` and `pool` must outlive the backend.
  LocalBackend(expert_node::ExpertStore* store, kernels::ThreadPool* pool) : store_(store), pool_(pool) {}

  // FAILED_PRECONDITION naming the layer and expert if the store does not
  // own one the work needs; CANCELLED / DEADLINE_EXCEEDED checked before
  // the kernels start, also while the call waits its turn (a running layer
  // is not interrupted). Calls are serialized on the pool in the order they
  // came (a plain mutex would let a caller that comes straight back take it
  // again and again, leaving others waiting for seconds).
  absl::Status Compute(const LayerWork& work, float* contributions, CallControl& control, BackendStats* stats) override;
  bool Mergeable(const LayerWork& work) const override;
  std::string kind() const override { return "local"; }

 private:
  expert_node::ExpertStore* const store_;
  kernels::ThreadPool* const pool_;
  // Drops `me` from the front of the line, if it is there, and wakes the next.
  void LeaveTurn(const void* me);

  // The callers waiting or running, in arrival order: the front one runs.
  common::Mutex turn_mu_;
  common::CondVar turn_cv_;  // signalled when the front leaves
  std::deque<const void*> turns_ ABSL_GUARDED_BY(turn_mu_);
  common::Mutex mu_;  // held by the front caller while it runs
  kernels::Workspace workspace_ ABSL_GUARDED_BY(mu_);
};

}  // namespace router_node
}  // namespace colibri

#endif  // COLIBRI_ROUTER_NODE_LOCAL_BACKEND_H_
