#include "router_node/remote_router.h"

#include "common/model_dir.h"
#include "common/status_macros.h"

namespace colibri {
namespace router_node {

absl::StatusOr<RemoteRouter> MakeRemoteRouter(const std::string& model_dir, RemoteOptions remote,
                                              const RouterOptions& router) {
  COLIBRI_ASSIGN_OR_RETURN(std::unique_ptr<common::ModelDir> model, common::ModelDir::Open(model_dir));
  const common::Manifest& m = model->manifest();
  remote.model_id = model->model_id();
  remote.n_layers = m.n_layers;
  remote.n_experts = m.n_experts;
  remote.n_shared_experts = m.n_shared_experts;
  remote.d_model = m.d_model;
  // A node's reply holds up to top_k + shared rows per token, f32.
  remote.max_message_bytes = router.max_tokens * m.d_model * 4 * (m.top_k + m.n_shared_experts) + (1 << 20);
  remote.metrics = router.metrics;
  RemoteRouter r;
  COLIBRI_ASSIGN_OR_RETURN(r.backend, RemoteBackend::Create(remote));
  COLIBRI_ASSIGN_OR_RETURN(r.router, Router::Create(model_dir, r.backend.get(), router));
  return r;
}

}  // namespace router_node
}  // namespace colibri
