#ifndef COLIBRI_ROUTER_NODE_REMOTE_ROUTER_H_
#define COLIBRI_ROUTER_NODE_REMOTE_ROUTER_H_

// The router's core over expert nodes: a RemoteBackend set up for the model
// in `model_dir` (its id and shape from the manifest; the nodes and
// policies from `remote`) and a Router on it. colibri-router runs one in
// distributed mode; a proxyless client runs one in its own process.

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "router_node/remote_backend.h"
#include "router_node/router.h"

namespace colibri {
namespace router_node {

struct RemoteRouter {
  std::unique_ptr<RemoteBackend> backend;
  std::unique_ptr<Router> router;  // declared after the backend it uses: destroyed first
};

// Whether `version` may still be used: a request holds it (each holds the
// version it started on), or a merged call its callers left still runs on
// its backend (Router::backend_in_use). One that is not may be destroyed.
bool InUse(const std::shared_ptr<RemoteRouter>& version);

// Waits until no merged call uses `version`'s backend, for the end of a
// server or client whose requests have all ended: such a call ends within
// its node calls' deadlines, at once when it was cancelled.
void AwaitIdle(const RemoteRouter& version);

// `remote`'s model fields (model_id, shape) and max_message_bytes are set
// here; `router.metrics` also goes to the backend. Errors as
// RemoteBackend::Create and Router::Create.
absl::StatusOr<RemoteRouter> MakeRemoteRouter(const std::string& model_dir, RemoteOptions remote,
                                              const RouterOptions& router);

// The version in `model_dir`, ready to take over from `current`: built with
// MakeRemoteRouter, then health-checked until every expert has a live node
// serving its model_id (nodes load it beside the old one first:
// ExpertNode.Reload with keep_previous), for up to `timeout`. A RemoteRouter
// with null members when `model_dir` holds current's model_id (nothing to
// switch). FAILED_PRECONDITION when the shape differs (d_model, layers,
// experts, top_k, vocabulary: callers would see it change mid-stream);
// UNAVAILABLE naming the first expert without a live node (and a node's last
// error) when the timeout passes, or "shutting down" as soon as *stop (if
// given) becomes true; CANCELLED as soon as `abandon` (if given) says true
// (the caller gone). Blocks; the caller swaps the result in, then calls
// its backend's Publish() (until then its health rounds leave the gauges and
// the node up/down log to the serving version).
absl::StatusOr<RemoteRouter> PrepareVersion(const Router& current, const std::string& model_dir,
                                            const RemoteOptions& remote, const RouterOptions& router,
                                            absl::Duration timeout, const std::atomic<bool>* stop = nullptr,
                                            const std::function<bool()>& abandon = {});

}  // namespace router_node
}  // namespace colibri

#endif  // COLIBRI_ROUTER_NODE_REMOTE_ROUTER_H_
