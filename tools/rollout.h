#ifndef COLIBRI_TOOLS_ROLLOUT_H_
#define COLIBRI_TOOLS_ROLLOUT_H_

// A new version of the served model (same shape), rolled out with no failed
// request (colibri-admin; docs/RELIABILITY.md, "Upgrading the model"):
//
//   1. stage: every expert node loads the new directory beside the weights
//      in use (ExpertNode.Reload with keep_previous) and then serves both
//      versions, each to the calls that name its model_id;
//   2. switch: the router loads the new gates and LUTs (Router.LoadModel),
//      waits until every expert of the new version has a live node, serves
//      new requests with it, and lets the requests of the old version finish
//      on it — a request is answered by one version, never a mix;
//   3. drop: once the router reports the old version released (its
//      requests ended; asked again while they run), every node releases it
//      (Reload drop_model_id).
//
// A failure in 1 or 2 rolls back: the nodes that staged the new version drop
// it (making the old one current again) and the router keeps the old
// version; the old version serves throughout. A node or router whose call
// fails (its deadline, a lost connection) before it switched does not switch
// later (Reload and LoadModel abandon a load whose caller is gone); when the
// switch call fails, the router is asked what it serves, and the nodes roll
// back only if that is the old version (if the router cannot say, nothing is
// rolled back: the nodes serve both, right for either; the error says so).
// A failure in 3 leaves the old weights loaded on that node, nothing else
// (reported). A roll-back that fails names the nodes left serving both.
//
// Several routers in front of the same nodes: `stage`, then `switch` each
// router (SwitchRouter ends once that router has released the old version),
// then `drop` — not `upgrade`, whose drop would take the old version from
// the nodes while the other routers still serve it.
//
// Every call goes to admin endpoints (the nodes' and router's
// --admin_listen, or their data ports with an admin certificate).

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace colibri {
namespace tools {

struct RolloutOptions {
  std::string model_dir;                        // the new version, as the nodes and the router see it
  std::vector<std::string> nodes;               // host:port of every expert node's admin endpoint
  std::string router;                           // host:port of the router's admin endpoint (several routers: see above)
  absl::Duration timeout = absl::Seconds(120);  // per step: a node's load, the router's switch
  // TLS to the admin endpoints: a CA enables it; cert + key for mutual TLS.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;
};

// The three steps above, with progress lines on `log`. The error names the
// step, the endpoint and its answer, and says what was rolled back.
absl::Status Rollout(const RolloutOptions& options, std::ostream& log);
// The steps alone, for operators who reach one endpoint at a time (e.g.
// `kubectl exec` into each pod, whose admin listener is on its loopback).
// Stage returns the new model_id (via `model_id`).
absl::Status StageOnNodes(const RolloutOptions& options, std::ostream& log, std::string* model_id);
absl::Status SwitchRouter(const RolloutOptions& options, std::ostream& log, std::string* previous_model_id);
absl::Status DropOnNodes(const RolloutOptions& options, const std::string& model_id, std::ostream& log);

// A new placement (colibri-plan's shard specs, one per node in the order of
// options.nodes) applied to running nodes with no failed request, each node
// serving throughout (ExpertNode.Reload with a new `experts` selection):
//   1. grow: each node in turn loads the union of what it owns and its new
//      shard, so no expert loses a copy;
//   2. wait until the router (options.router, when given: its GetClusterStatus
//      counts every expert's live copies) sees every new copy — else wait
//      `settle`, a few of the routers' health intervals;
//   3. shrink: each node in turn loads exactly its new shard, and the next
//      waits until the router counts one copy fewer of each expert the node
//      dropped (without a router, `settle`); a call the router planned on
//      the old map is retried on a copy that remains. Before a node shrinks,
//      every expert it drops must be owned by another node that answers
//      GetNodeInfo then: one that died since it grew stops the shrinks
//      (FAILED_PRECONDITION naming the expert), rather than losing it.
// Every node needs memory for its union while it is grown. A failed grow
// stops there (the nodes grown keep a superset of their old shard: all is
// served) and says so; a failed shrink leaves that node with its union.
absl::Status ApplyPlacement(const RolloutOptions& options, const std::vector<std::string>& specs, absl::Duration settle,
                            std::ostream& log);

// The router's (options.router) routed token counts since it started, from
// GetClusterStatus: [layer][expert] for a model of n_layers x n_experts
// routed experts (its n_shared shared experts left out). FAILED_PRECONDITION
// when the router serves another shape; the call's error otherwise.
absl::StatusOr<std::vector<std::vector<double>>> FetchExpertLoad(const RolloutOptions& options, int64_t n_layers,
                                                                 int64_t n_experts, int64_t n_shared);

}  // namespace tools
}  // namespace colibri

#endif  // COLIBRI_TOOLS_ROLLOUT_H_
