#ifndef COLIBRI_ROUTER_NODE_LAYER_BATCHER_H_
#define COLIBRI_ROUTER_NODE_LAYER_BATCHER_H_

// Dynamic batching: concurrent calls for the same layer share one backend
// call, so each expert's weights are read once for all of them.
//
// A call joins its layer's queue. The queue is sent as one merged call when
// no merged call of that layer is in flight (or, on an asynchronous backend,
// each one in flight has been out for StallThreshold: a node that hangs holds it until
// the node timeout, and the queue then goes beside it, so callers that other
// replicas can serve are not held) and either it holds as many
// callers as were active when the layer's last merged call ended (its
// callers still there plus those queued meanwhile: so a lone caller goes at
// once, and a group of callers that come back together is not split), or it
// holds max_tokens tokens, or `window` has passed since its oldest caller
// came or the layer's last merged call ended, whichever is later. While
// a merged call is in flight the queue waits for it: the backend computes
// one call at a time anyway, and the next one then carries every caller
// that arrived meanwhile.
//
// The merged call concatenates the callers' rows; each expert is one work
// whose kernel_rows is the largest caller's row count, so with callers that
// ExpertBackend::Mergeable accepts every row runs the kernel its caller's own
// call would run, and every slot is the same bits as without merging. Each
// caller gets exactly its own slots back.
//
// A merged call that fails is sent again caller by caller, so a failure one
// caller causes (rows a node refuses, an expert only it needs without a
// live node) is its own; so is a merged call whose experts' nodes changed
// since it was queued (Mergeable no longer holds).
//
// A caller is never held past its own deadline or cancellation: at its
// deadline (DEADLINE_EXCEEDED) or cancellation (CANCELLED) it is answered
// at once, queued or in flight, and the others go on; a merged call is
// cancelled only when all its callers are gone, and its deadline is the
// latest of theirs. Thread-safe.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "router_node/expert_backend.h"

namespace colibri {
namespace router_node {

// How long the merged calls of a layer in flight hold its queue back, given
// `typical`, the moving average of the layer's merged calls' durations
// (zero before the first ends): 4 × typical, at least stall_after and at
// most 4 × stall_after. A busy node whose calls take 600 ms is not taken for
// a hung one (sending the queue beside its calls would only add to its
// work, and slow every call more); a hung one still lets the queue go
// within 4 × stall_after.
absl::Duration StallThreshold(absl::Duration stall_after, absl::Duration typical);

struct BatchOptions {
  // > 0: merging on, and the longest a caller waits for others while no
  // merged call of its layer is in flight. 0: off.
  absl::Duration window = absl::ZeroDuration();
  int64_t max_tokens = 256;  // tokens of one merged call; a caller with more is not merged
  // A merged call out this long — or, when the layer's merged calls have
  // been taking longer, StallThreshold's — no longer holds its layer's queue back.
  absl::Duration stall_after = absl::Milliseconds(500);
  common::MetricsRegistry* metrics = nullptr;  // optional; must outlive the batcher
};

// How a caller's call was merged, for its timings.
struct BatchInfo {
  int64_t queue_nanos = 0;  // from Submit until its merged call was sent
  int64_t callers = 0;      // callers in that merged call
  int64_t tokens = 0;       // their tokens
};

// One caller's layer call, prepared by the router.
struct BatchCall {
  const LayerWork* work = nullptr;  // its rows (x, and x_bf16 when set) and experts
  float* slots = nullptr;           // receives its [num_slots][d_model] results
  BackendStats* stats = nullptr;    // receives the merged call's node calls
  BatchInfo* info = nullptr;
  CallControl* control = nullptr;  // must live until `done` runs
  // Keeps work (and the memory its x and x_bf16 point to), slots, stats and
  // info alive as long as the batcher holds the call: a merged call may still
  // read them after the caller was answered (cancelled, past its deadline).
  std::shared_ptr<void> keep;
  std::function<void(absl::Status)> done;  // exactly once
};

class LayerBatcher {
 public:
  // `backend` must outlive the batcher and its merged calls (idle()).
  // REQUIRES: options.window > 0.
  LayerBatcher(ExpertBackend* backend, int64_t n_layers, int64_t d_model, const BatchOptions& options);
  // Stops the batcher's threads. REQUIRES: every submitted call done (each
  // holds what owns the batcher, e.g. its router, until then).
  ~LayerBatcher();
  LayerBatcher(const LayerBatcher&) = delete;
  LayerBatcher& operator=(const LayerBatcher&) = delete;

  // Whether `work` may be merged: at most max_tokens tokens, at least one
  // expert, and the backend's Mergeable.
  bool Accepts(const LayerWork& work) const;

  // Queues `call` (REQUIRES: Accepts(*call.work)). `done` runs on this
  // thread, the batcher's, or the one that delivers the merged call's result.
  void Submit(BatchCall call);

  // Whether no merged call is alive: none is waiting to be sent, being sent
  // or computed, or being answered. A merged call whose callers were all
  // answered (cancelled, past their deadlines) may still use the backend:
  // whoever owns the backend must not destroy it before this is true.
  bool idle() const;

  // Callers waiting in the queues (not yet in a merged call).
  int64_t queued() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace router_node
}  // namespace colibri

#endif  // COLIBRI_ROUTER_NODE_LAYER_BATCHER_H_
