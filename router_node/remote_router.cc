#include "router_node/remote_router.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/model_dir.h"
#include "common/status_macros.h"

namespace colibri {
namespace router_node {

bool InUse(const std::shared_ptr<RemoteRouter>& version) {
  return version.use_count() > 1 || version->router->backend_in_use();
}

void AwaitIdle(const RemoteRouter& version) {
  while (version.router->backend_in_use()) absl::SleepFor(absl::Milliseconds(1));
}

absl::StatusOr<RemoteRouter> MakeRemoteRouter(const std::string& model_dir, RemoteOptions remote,
                                              const RouterOptions& router) {
  COLIBRI_ASSIGN_OR_RETURN(std::unique_ptr<common::ModelDir> model, common::ModelDir::Open(model_dir));
  const common::Manifest& m = model->manifest();
  remote.model_id = model->model_id();
  remote.n_layers = m.n_layers;
  remote.n_experts = m.n_experts;
  remote.n_shared_experts = m.n_shared_experts;
  remote.d_model = m.d_model;
  // A node's reply holds up to top_k + shared rows per token, f32. (Tokens
  // clamped to Router::Create's range, which refuses any other value.)
  const int64_t tokens = std::clamp<int64_t>(router.max_tokens, 1, int64_t{1} << 24);
  remote.max_message_bytes = tokens * m.d_model * 4 * (m.top_k + m.n_shared_experts) + (1 << 20);
  remote.metrics = router.metrics;
  RemoteRouter r;
  COLIBRI_ASSIGN_OR_RETURN(r.backend, RemoteBackend::Create(remote));
  COLIBRI_ASSIGN_OR_RETURN(r.router, Router::Create(model_dir, r.backend.get(), router));
  return r;
}

absl::StatusOr<RemoteRouter> PrepareVersion(const Router& current, const std::string& model_dir,
                                            const RemoteOptions& remote, const RouterOptions& router,
                                            absl::Duration timeout, const std::atomic<bool>* stop,
                                            const std::function<bool()>& abandon) {
  RemoteOptions quiet = remote;  // the serving version's gauges and log stay its own until the swap
  quiet.publish = false;
  COLIBRI_ASSIGN_OR_RETURN(RemoteRouter next, MakeRemoteRouter(model_dir, quiet, router));
  if (next.router->model_id() == current.model_id()) return RemoteRouter{};
  const common::Manifest& a = current.manifest();
  const common::Manifest& b = next.router->manifest();
  if (a.d_model != b.d_model || a.n_layers != b.n_layers || a.n_experts != b.n_experts ||
      a.n_shared_experts != b.n_shared_experts || a.top_k != b.top_k || a.vocab_size != b.vocab_size) {
    return absl::FailedPreconditionError(
        "the new model's shape (d_model, layers, experts, top_k, vocabulary) differs from the one serving: clients "
        "would see it change mid-stream; roll out a change of shape as a new cluster (blue/green)");
  }
  const absl::Time deadline = absl::Now() + timeout;
  while (!next.backend->serving() && absl::Now() < deadline) {
    if (stop != nullptr && stop->load()) {
      return absl::UnavailableError("the router is shutting down: model " + next.router->model_id() +
                                    " not switched to");
    }
    if (abandon && abandon()) {
      return absl::CancelledError("the load was given up while the nodes were awaited: model " +
                                  next.router->model_id() + " not switched to");
    }
    absl::SleepFor(std::min(remote.health_interval, absl::Milliseconds(100)));
    next.backend->CheckNow();
  }
  if (next.backend->serving()) return next;
  const auto uncovered = next.backend->map()->FirstUncovered();
  std::string why;
  for (const NodeStatusView& n : next.backend->Nodes()) {
    if (!n.live && !n.last_error.empty()) {
      why = absl::StrCat("; ", n.address, ": ", n.last_error);
      break;
    }
  }
  return absl::UnavailableError(absl::StrCat(
      "model ", next.router->model_id(), " is not served: layer ", uncovered ? uncovered->first : -1, " expert ",
      uncovered ? uncovered->second : -1, " has no live node serving it after ", absl::FormatDuration(timeout),
      " (load it on the nodes first: ExpertNode.Reload with keep_previous)", why, "; the old version serves on"));
}

}  // namespace router_node
}  // namespace colibri
