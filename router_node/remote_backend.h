#ifndef COLIBRI_ROUTER_NODE_REMOTE_BACKEND_H_
#define COLIBRI_ROUTER_NODE_REMOTE_BACKEND_H_

// The distributed ExpertBackend: expert nodes over gRPC (ExpertNode.Compute).
//
// Shard map: the router asks each configured node what it serves
// (GetNodeInfo) — no hand-written expert lists — and repeats that every
// `health_interval` on a watcher thread: a node is live when it answers, is
// READY and serves this router's model (same model_id and shape). A node
// whose planned call failed, unanswered by a hedge, with a retried code other
// than RESOURCE_EXHAUSTED or FAILED_PRECONDITION (and not because of the
// client's own deadline or cancel) is marked down at once; a health round
// follows `recheck_after` later (not a whole interval), and the node is back
// when it answers it. A busy node (RESOURCE_EXHAUSTED) stays in the map but
// is planned on only where no other replica serves an expert, by every layer
// call, for `recheck_after`; a node whose shard changed (FAILED_PRECONDITION)
// is so for the rest of that layer call, until the map is brought up to date.
// With a cluster file, the node list is re-read when the file changes.
//
// A layer call: each expert's work goes to its least-loaded live replica,
// experts grouped by node (one Compute call per node, each row sent once,
// replies as RemoteOptions::replies asks), all calls in flight at once on
// gRPC's callback API, each with deadline min(client deadline, now +
// node_timeout) — except where a node's share is over the size limits the
// node reports: it goes as several calls, one after another, each timed
// from its send (shard_map.h's SplitOverNodeLimits, remote_dispatch.cc). A
// call that fails with UNAVAILABLE, DEADLINE_EXCEEDED (the node timeout, not
// the client's), RESOURCE_EXHAUSTED, ABORTED, FAILED_PRECONDITION (a stale
// map), CANCELLED (by the node, not the client) or DATA_LOSS is retried once,
// for just its experts, on other replicas (not the failed node or that
// call's failed hedges; after FAILED_PRECONDITION the failed node where no
// other replica serves an expert — so too after a RESOURCE_EXHAUSTED that
// refused a call sent when its node's call before it ended), within the
// client's deadline; any other code from a node becomes INTERNAL. With
// hedge_after > 0 (timed once, from the attempt's start), the work of a
// first-attempt call sent and not answered by then is also sent to other
// replicas; the first complete answer is used and the others are
// cancelled. Cancelling the request cancels its node calls. No thread waits for a node: the layer
// ends on the thread of the reply that settles it (ComputeAsync).
//
// Implemented in remote_backend.cc (node set, health, map) and
// remote_dispatch.cc (one layer's calls), with private types in
// remote_backend_internal.h; with router_service.cc and router_server.cc
// this is the router's gRPC transport. Thread-safe.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "common/mutex.h"
#include "router_node/expert_backend.h"
#include "router_node/node_channel.h"
#include "router_node/shard_map.h"
#include "runtime/grpc_services.h"

namespace colibri {
namespace router_node {

// What nodes send back for a layer call (docs/ROUTER.md, "Node replies").
enum class NodeReplies {
  kPerExpert,  // one row per (token, expert): the router folds every route
  // A node holding the start of a token's route (ranks 0..m) returns their
  // sum (its fold is the router's); every other entry one row. Answers are
  // the local engine's bits for any shard map.
  kExact,
  // One row per (token, node): the fewest bytes. The local engine's bits when
  // every token's route is a prefix on one node plus single entries on the
  // others (e.g. all its experts on one node); otherwise within rounding.
  kPartial,
};
// "per_expert", "exact", "partial"; nullopt for anything else.
std::optional<NodeReplies> ParseNodeReplies(absl::string_view name);

struct RemoteOptions {
  std::vector<std::string> addresses;  // host:port of each expert node
  std::string cluster_file;            // or: one host:port per line ('#' comments), re-read on change
  // The model the router serves: nodes with another model_id or shape are not used.
  std::string model_id;
  int64_t n_layers = 0;
  int64_t n_experts = 0;         // routed experts per layer
  int64_t n_shared_experts = 0;  // shared experts: ids n_experts.. of every layer, placed like any expert
  int64_t d_model = 0;
  absl::Duration node_timeout = absl::Seconds(5);  // per node call attempt
  // > 0: when a node has not answered within this, send its work to another
  // replica as well and take whichever answers first (the other is
  // cancelled). Off by default; set it near the nodes' p95 call latency.
  absl::Duration hedge_after = absl::ZeroDuration();
  // > 0: calls whose request is at most this many bytes travel as messages
  // on one open ComputeStream per node (router_node/node_stream.h), larger
  // ones as unary calls. 0 (the default): every call unary — on the machines
  // measured, streams made node calls no faster and cost the router more CPU
  // (docs/PERFORMANCE.md). At most max_message_bytes / 32 (Create refuses
  // more): a message over the limit would break the stream and every call on it.
  int64_t node_stream_max_bytes = 0;
  NodeReplies replies = NodeReplies::kExact;
  // When a replicated expert's rows are split among its replicas (shard_map.h).
  RowSplitOptions row_split;
  absl::Duration health_interval = absl::Milliseconds(500);
  // After a failed call takes a node out of the map, the next health round
  // runs this long after the last one began instead of a whole interval: a
  // node that was only slow (its call outlived node_timeout) or that
  // restarted is back at once, while a dead or hung one fails its probe and
  // stays out. Rounds never run closer together than this. Also how long a
  // node that answered RESOURCE_EXHAUSTED is a last resort (see above).
  absl::Duration recheck_after = absl::Milliseconds(50);
  absl::Duration health_timeout = absl::Seconds(1);  // per GetNodeInfo
  int64_t max_message_bytes = 1 << 30;               // per node call, both ways
  // TLS to the nodes: a CA (PEM) enables it; cert + key add a client
  // certificate (mutual TLS); server_name overrides the name checked in the
  // node's certificate.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;
  runtime::Keepalive keepalive;                // pings on the node channels (runtime/grpc_services.h)
  common::MetricsRegistry* metrics = nullptr;  // optional; must outlive the backend
  std::ostream* log = nullptr;                 // node up/down events; optional; must outlive the backend
  // The live-node gauges and the node up/down log lines; false for a version
  // prepared beside the serving one (PrepareVersion), until Publish() at the
  // swap: it must not overwrite the serving version's figures.
  bool publish = true;
  // Tests: how to reach a node (default: a gRPC channel with the options
  // above) and the clock for hedging and deadlines (default: the wall clock).
  NodeConnector connect;
  common::Clock* clock = nullptr;  // must outlive the backend
};

// A node as GetClusterStatus shows it.
struct NodeStatusView {
  std::string address;
  bool live = false;
  std::string last_error;
  std::vector<std::pair<int64_t, int64_t>> owned;
  int in_flight = 0;
  int64_t calls = 0;
  int64_t failed_calls = 0;
  uint64_t weights_version = 0;
  std::string kernel_profile;  // the node's kernel choices (GetNodeInfo), empty if unknown
};

class RemoteBackend final : public ExpertBackend {
 public:
  // Opens channels to the nodes and runs one health round before returning
  // (so the map is known; nodes that are down are retried by the watcher).
  // INVALID_ARGUMENT for neither or both of addresses and cluster_file, an
  // unset model shape, an empty list or an address that is not host:port, or
  // bad TLS options or files; NOT_FOUND for a cluster file that cannot be read.
  static absl::StatusOr<std::unique_ptr<RemoteBackend>> Create(const RemoteOptions& options);
  ~RemoteBackend() override;  // Stop()s, then waits for the replies of cancelled node calls

  // Stops the health watcher and waits for a round in progress (CheckNow's
  // too); the map stays as it is, and no listener is called after Stop
  // returns. Idempotent.
  void Stop();

  absl::Status Compute(const LayerWork& work, float* contributions, CallControl& control, BackendStats* stats) override;
  // `done` runs on the thread that delivers the last reply needed (or on
  // this one when nothing could be sent). Never blocks.
  void ComputeAsync(const LayerWork& work, float* contributions, CallControl& control, BackendStats* stats,
                    std::function<void(absl::Status)> done) override;
  bool asynchronous() const override { return true; }
  // By the live replicas' row_split_limit; an expert with an unknown limit
  // (0), a replica that does not read kernel_rows, or no live replica is not
  // mergeable.
  bool Mergeable(const LayerWork& work) const override;
  std::string kind() const override { return "distributed"; }

  // Runs a health round now (also re-reads the cluster file) and returns
  // when it is done.
  void CheckNow();
  // Publishes from now on (RemoteOptions::publish): sets the gauges and logs
  // the nodes not live, with why, at once, then at every round.
  void Publish();
  // True when every (layer, expert) has a live node.
  bool serving() const;
  // Called at once with the current state, then after every health round in
  // which serving() changed (on the watcher thread, or the thread calling
  // CheckNow), one call at a time. It must not call back into this backend's
  // Stop, CheckNow or SetServingListener (they wait for the round calling it).
  void SetServingListener(std::function<void(bool)> listener);
  std::vector<NodeStatusView> Nodes() const;
  std::shared_ptr<const ShardMap> map() const;
  int64_t retries() const { return retries_.load(std::memory_order_relaxed); }
  int64_t hedges() const { return hedges_.load(std::memory_order_relaxed); }
  int64_t hedge_wins() const { return hedge_wins_.load(std::memory_order_relaxed); }

  struct Call;     // one Compute call in flight (remote_backend_internal.h)
  class Dispatch;  // one layer's calls (remote_dispatch.cc)

 private:
  struct Node;
  struct Topology;
  explicit RemoteBackend(RemoteOptions options)
      : options_(std::move(options)),
        clock_(options_.clock != nullptr ? options_.clock : common::Clock::Real()),
        rotation_(new std::atomic<uint32_t>[std::max<int64_t>(options_.n_layers, 1)]()) {}

  std::unique_ptr<NodeChannel> Connect(const std::string& address) const;
  absl::Status SetAddresses(const std::vector<std::string>& addresses) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HealthRound();
  void Rebuild() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkDown(const std::shared_ptr<Node>& node, const std::string& error);
  // The next health round runs recheck_after after the last one began, not
  // a whole interval: a layer call found an expert no node serves.
  void Recheck();
  // Logs (once per change) when the live nodes report different kernel
  // choices, and sets the colibri_router_kernel_profiles gauge.
  void CompareKernels(const Topology& topo);
  // The colibri_router_live_nodes gauge (`live` nodes) and CompareKernels.
  void PublishState(const Topology& topo, int live);
  std::shared_ptr<const Topology> topology() const;
  // Counts a node call made (before it is sent); CallEnded counts it ended
  // and records it in the metrics.
  void CallStarted();
  void CallEnded(const Call& call);

  // Constant after construction.
  const RemoteOptions options_;
  common::Clock* const clock_;
  struct ChannelSetup;  // the nodes' channel credentials and arguments (gRPC types, kept out of this header)
  std::shared_ptr<const ChannelSetup> channel_setup_;

  mutable common::Mutex mu_;
  common::CondVar stop_cv_;  // wakes the watcher on Stop() and for a recheck
  std::shared_ptr<const Topology> topology_ ABSL_GUARDED_BY(mu_);
  std::string cluster_file_seen_ ABSL_GUARDED_BY(mu_);  // ClusterFileSeen of its last read
  std::function<void(bool)> listener_ ABSL_GUARDED_BY(mu_);
  bool last_serving_ ABSL_GUARDED_BY(mu_) = false;
  std::string kernels_warned_ ABSL_GUARDED_BY(mu_);  // the last differing kernel choices logged

  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool recheck_ ABSL_GUARDED_BY(mu_) = false;  // a call took a node out since the last round began

  common::Mutex health_mu_;  // one health round at a time
  std::atomic<bool> publish_{true};
  std::atomic<int64_t> retries_{0};
  std::atomic<int64_t> hedges_{0};
  std::atomic<int64_t> hedge_wins_{0};
  // Per layer: PlanNodeCalls' turn among equally loaded replicas, advanced by each call of the layer.
  std::unique_ptr<std::atomic<uint32_t>[]> rotation_;
  common::Mutex calls_mu_;
  common::CondVar calls_cv_;
  int64_t outstanding_calls_ ABSL_GUARDED_BY(calls_mu_) = 0;  // started, callback not finished
  std::thread watcher_;
};

// For a caller that is its own operator (a proxyless client, the C API):
// an UNAVAILABLE `status` from `backend` (a RemoteBackend) with the nodes
// that are not live appended, by address and why ("serves model ...", "not
// ready", the health check's error), which a router keeps for its admins
// and its log. Any other status, or another backend: `status` as it is.
absl::Status WithNodeProblems(const absl::Status& status, ExpertBackend& backend);

}  // namespace router_node
}  // namespace colibri

#endif  // COLIBRI_ROUTER_NODE_REMOTE_BACKEND_H_
