#ifndef COLIBRI_ROUTER_NODE_REMOTE_ROUTER_H_
#define COLIBRI_ROUTER_NODE_REMOTE_ROUTER_H_

// The router's core over expert nodes: a RemoteBackend set up for the model
// in `model_dir` (its id and shape from the manifest; the nodes and
// policies from `remote`) and a Router on it. colibri-router runs one in
// distributed mode; a proxyless client runs one in its own process.

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

// `remote`'s model fields (model_id, shape) and max_message_bytes are set
// here; `router.metrics` also goes to the backend. Errors as
// RemoteBackend::Create and Router::Create.
absl::StatusOr<RemoteRouter> MakeRemoteRouter(const std::string& model_dir, RemoteOptions remote,
                                              const RouterOptions& router);

}  // namespace router_node
}  // namespace colibri

#endif  // COLIBRI_ROUTER_NODE_REMOTE_ROUTER_H_
