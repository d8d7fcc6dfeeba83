#ifndef COLIBRI_ROUTER_NODE_REMOTE_BACKEND_INTERNAL_H_
#define COLIBRI_ROUTER_NODE_REMOTE_BACKEND_INTERNAL_H_

// RemoteBackend's private types, shared by its two files:
// remote_backend.cc (the node set, health checks, the shard map) and
// remote_dispatch.cc (one layer's node calls: plan, send, hedge, retry,
// scatter). Not for other code.

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "colibri/v1/expert_node.grpc.pb.h"
#include "common/mutex.h"
#include "router_node/remote_backend.h"

namespace colibri {
namespace router_node {

namespace v1 = colibri::v1;

struct RemoteBackend::Node {
  std::string address;
  std::unique_ptr<NodeChannel> channel;
  std::atomic<int> in_flight{0};
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> failed{0};
  // Until then (the clock's Unix nanoseconds) the node is a last resort: it
  // answered RESOURCE_EXHAUSTED (busy, not broken: it stays in the map), and
  // by load alone it would look the least busy, its refusals coming back at
  // once. Atomic: every layer call's plan reads it.
  std::atomic<int64_t> busy_until_nanos{std::numeric_limits<int64_t>::min()};

  common::Mutex mu;
  bool live ABSL_GUARDED_BY(mu) = false;
  uint64_t downs ABSL_GUARDED_BY(mu) = 0;    // times MarkDown took the node out
  int late_probes ABSL_GUARDED_BY(mu) = 0;   // health probes in a row that ran out of time
  bool suspect ABSL_GUARDED_BY(mu) = false;  // NodeState::suspect: taken out by a call, not yet probed
  std::string last_error ABSL_GUARDED_BY(mu) = "not checked yet";
  std::vector<std::pair<int64_t, int64_t>> owned ABSL_GUARDED_BY(mu);
  uint64_t weights_version ABSL_GUARDED_BY(mu) = 0;
  int64_t row_split_limit ABSL_GUARDED_BY(mu) = 0;
  bool reads_kernel_rows ABSL_GUARDED_BY(mu) = false;
  int64_t max_rows ABSL_GUARDED_BY(mu) = 0;  // GetNodeInfo's size limits of one call (0: none reported)
  int64_t max_row_indices ABSL_GUARDED_BY(mu) = 0;
  std::string kernel_profile ABSL_GUARDED_BY(mu);  // as the node reported it
};

struct RemoteBackend::Topology {
  std::vector<std::shared_ptr<Node>> nodes;
  std::shared_ptr<const ShardMap> map;
};

// One Compute call: sent, or waiting behind its node's call before it (`next`).
struct RemoteBackend::Call {
  int node = 0;
  std::shared_ptr<Node> node_ref;
  int attempt = 0;     // 0 the first try, 1 the retry
  bool hedge = false;  // sent because the planned call was slow
  // The call to the same node sent when this one ends (a node's share split
  // for its size limits goes one call at a time); null for none.
  Call* next = nullptr;
  bool chained = false;           // sent after another call of its node's share (some call's `next`)
  bool queued = false;            // handed to Send already, with the rest of its chain
  std::atomic<bool> sent{false};  // handed to its node's channel (set by Send, before the channel has it)
  bool client_deadline = false;   // its deadline is the client's, not the node timeout
  // How it ends if it is never sent: cancelled, or with the failure of the
  // call before it (its node failed: the retry takes its works).
  grpc::Status unsent_status{grpc::StatusCode::CANCELLED, "cancelled before it was sent"};
  // Written once by the call's callback under its Dispatch's lock (a comment,
  // not ABSL_GUARDED_BY: the analysis cannot name that lock from here).
  bool done = false;
  // Send and Cancel meet here: a call cancelled before Send reaches it is
  // never sent, one cancelled while Send hands it to the channel is
  // cancelled by Send after, and one sent is cancelled by Cancel.
  enum SendState { kUnsent, kSending, kSent, kCancelWanted };
  std::atomic<int> send_state{kUnsent};
  std::string address;
  std::string name;  // "node-<index>": how replies and errors name the node (addresses are for admins)
  NodeCall plan;
  // The reply's rows: row o fills the slots group_slots[group_start[o] ..
  // group_start[o + 1]) — the first gets the row, the others -0.0.
  std::vector<int32_t> group_slots;
  std::vector<int32_t> group_start;
  grpc::ClientContext context;
  v1::ComputeRequest request;
  v1::ComputeResponse response;
  grpc::Status status;
  int64_t bytes_sent = 0;  // the serialized request
  int64_t start_nanos = 0;
  int64_t end_nanos = 0;
};

inline int64_t NanosSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace router_node
}  // namespace colibri

#endif  // COLIBRI_ROUTER_NODE_REMOTE_BACKEND_INTERNAL_H_
