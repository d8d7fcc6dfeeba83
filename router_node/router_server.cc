#include "router_node/router_server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <filesystem>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/cgroup_limits.h"
#include "common/log_line.h"
#include "common/status_macros.h"
#include "runtime/grpc_admin.h"
#include "runtime/grpc_credentials.h"
#include "runtime/grpc_services.h"
#include "runtime/message_limits.h"

namespace colibri {
namespace router_node {
namespace {
// The name standard health clients may ask for, beside "".
const char* const kService = colibri::v1::Router::service_full_name();
}  // namespace

absl::StatusOr<std::unique_ptr<RouterServer>> RouterServer::Create(RouterServerOptions options, std::ostream* log) {
  if (options.model_dir.empty()) return absl::InvalidArgumentError("RouterServerOptions::model_dir is required");
  COLIBRI_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                           runtime::ServerCredentialsFromFiles(options.tls_cert_file, options.tls_key_file,
                                                               options.tls_client_ca_file, "RouterServerOptions::"));
  COLIBRI_RETURN_IF_ERROR(runtime::CheckAdminIdentities(options.service.admin_identities, options.tls_client_ca_file,
                                                        "RouterServerOptions::service."));
  COLIBRI_RETURN_IF_ERROR(runtime::ValidateKeepalive(options.keepalive, "RouterServerOptions::"));
  if (options.service.send_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("RouterServerOptions::service.send_timeout ",
                                                   absl::FormatDuration(options.service.send_timeout),
                                                   " is negative (0 turns it off)"));
  }
  if (options.service.max_queued_requests < 1) {
    return absl::InvalidArgumentError(absl::StrCat("RouterServerOptions::service.max_queued_requests ",
                                                   options.service.max_queued_requests,
                                                   " must be at least 1 (0 refuses every request that waits for "
                                                   "a worker: with --local, every request)"));
  }
  std::unique_ptr<RouterServer> s(new RouterServer());
  s->log_ = log;
  std::shared_ptr<Router> router;
  if (options.local) {
    options.engine.max_tokens = options.router.max_tokens;
    options.engine.verify_checksums = options.router.verify_checksums;
    options.engine.batch_window = options.router.batching.window;
    options.engine.batch_max_tokens = options.router.batching.max_tokens;
    options.engine.metrics = &s->metrics_;
    options.engine.log = log;
    COLIBRI_ASSIGN_OR_RETURN(s->engine_, Engine::Open(options.model_dir, options.engine));
    router = std::shared_ptr<Router>(&s->engine_->router(), [](Router*) {});  // the engine owns it
  } else {
    options.remote.log = log;
    options.remote.keepalive = options.keepalive;
    options.router.metrics = &s->metrics_;
    COLIBRI_ASSIGN_OR_RETURN(RemoteRouter remote, MakeRemoteRouter(options.model_dir, options.remote, options.router));
    common::MutexLock lock(&s->load_mu_);
    s->remote_ = std::make_shared<RemoteRouter>(std::move(remote));
    router = std::shared_ptr<Router>(s->remote_, s->remote_->router.get());  // keeps the whole version alive
    RouterServer* server = s.get();
    options.service.load_model = [server](const std::string& dir, absl::Duration timeout,
                                          const std::function<bool()>& abandon) -> absl::StatusOr<ModelSwitch> {
      return server->LoadModel(dir, timeout, abandon, /*wait_again=*/true);
    };
  }
  if (options.metrics_port >= 0) {
    COLIBRI_ASSIGN_OR_RETURN(s->metrics_server_,
                             runtime::MetricsServer::Create(runtime::MetricsHost(options.metrics_host, options.listen),
                                                            options.metrics_port, &s->metrics_));
    s->metrics_port_ = s->metrics_server_->port();
  }
  options.service.metrics = &s->metrics_;
  options.service.log = log;
  const common::Manifest& m = router->manifest();
  // A reply is up to max_tokens f32 rows of d_model, each with its routes
  // when asked (return_routes: an expert id of at most 5 bytes and a weight
  // of 4 per route).
  const int64_t route_bytes = 9 * (m.top_k + m.n_shared_experts);
  if (const int64_t most = runtime::MaxF32RowsPerMessage(m.d_model, route_bytes); options.router.max_tokens > most) {
    return absl::InvalidArgumentError(absl::StrCat("RouterOptions::max_tokens ", options.router.max_tokens,
                                                   ": replies of that many tokens of d_model ", m.d_model,
                                                   " in f32 with their routes would pass gRPC's 2 GiB message limit "
                                                   "(at most ",
                                                   most, ")"));
  }
  if (options.service.max_inflight_bytes <= 0) {  // room for two requests of max_tokens f32 hidden states
    const int64_t values = options.router.max_tokens * m.d_model;
    options.service.max_inflight_bytes = 2 * RouterService::Footprint(values * 4, values, m);
    constexpr int64_t kLeast = int64_t{16} << 20;
    const int64_t weights = s->engine_ != nullptr ? s->engine_->resident_bytes() : 0;
    if (const int64_t room = options.memory_limit - weights - common::kProcessMemoryBytes;
        options.memory_limit >= 0 && room < options.service.max_inflight_bytes) {
      options.service.max_inflight_bytes = std::max(room, kLeast);
      common::LogLine(log, absl::StrCat("in-flight budget ", options.service.max_inflight_bytes,
                                        " bytes (max_inflight_bytes), within the memory limit of ",
                                        options.memory_limit, " bytes"));
    }
  }
  s->options_ = options;
  s->service_ = std::make_unique<RouterService>(router, options.service);

  runtime::EnableStandardServices();
  grpc::ServerBuilder builder;
  runtime::ApplyServerPolicy(builder, options.keepalive);
  builder.AddListeningPort(options.listen, credentials, &s->port_);
  // Largest call: max_tokens hidden states in f32 plus token ids and client
  // routes (4 + 8 * top_k bytes per token), and framing.
  const int64_t derived = options.router.max_tokens * (m.d_model * 4 + 4 + 8 * m.top_k) + (1 << 20);
  const int64_t max_bytes = std::min<int64_t>(options.max_message_bytes > 0 ? options.max_message_bytes : derived,
                                              std::numeric_limits<int>::max());
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(max_bytes));
  builder.RegisterService(s->service_.get());
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  }
  // Not serving until the nodes say so (gRPC's health service starts at SERVING).
  if (!options.local) runtime::SetServing(s->server_->GetHealthCheckService(), kService, false);
  if (!options.admin_listen.empty()) {
    s->admin_service_ = std::make_unique<RouterAdminService>(s->service_.get());
    COLIBRI_ASSIGN_OR_RETURN(s->admin_server_,
                             runtime::StartAdminServer(options.admin_listen, credentials, s->admin_service_.get(),
                                                       &s->admin_port_, "RouterServerOptions::", options.keepalive));
  }
  grpc::HealthCheckServiceInterface* health = s->server_->GetHealthCheckService();
  if (!options.local) {
    common::MutexLock lock(&s->load_mu_);
    s->remote_->backend->SetServingListener([health](bool serving) { runtime::SetServing(health, kService, serving); });
  } else {
    runtime::SetServing(health, kService, true);
  }
  return s;
}

void RouterServer::CheckNodesNow() {
  if (engine_ != nullptr) return;
  std::shared_ptr<RemoteRouter> remote;
  {
    common::MutexLock lock(&load_mu_);
    remote = remote_;
  }
  remote->backend->CheckNow();
}

namespace {

// OK when `dir` may be loaded: inside `root` (symlinks resolved), or — with
// no root — the configured model directory itself.
absl::Status MayLoad(const std::string& dir, const std::string& root, const std::string& configured) {
  std::error_code ec, root_ec;
  const std::filesystem::path real = std::filesystem::canonical(dir, ec);
  if (ec) return absl::NotFoundError(absl::StrCat("model_dir is not an existing directory: ", ec.message()));
  if (root.empty()) {
    if (real == std::filesystem::canonical(configured, root_ec)) return absl::OkStatus();
    return absl::PermissionDeniedError(
        "without a model root (RouterServerOptions::model_root) the router may only re-read its configured model "
        "directory");
  }
  const std::filesystem::path base = std::filesystem::canonical(root, root_ec);
  if (!root_ec) {
    auto [end, unused] = std::mismatch(base.begin(), base.end(), real.begin(), real.end());
    if (end == base.end()) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      "model_dir is not inside the router's model root (RouterServerOptions::model_root)");
}

}  // namespace

bool RouterServer::ReleaseRetired() {
  std::vector<std::shared_ptr<RemoteRouter>> kept;
  for (std::shared_ptr<RemoteRouter>& r : retired_) {
    if (InUse(r)) kept.push_back(std::move(r));
  }
  retired_ = std::move(kept);  // the others are destroyed here, on this thread
  return retired_.empty();
}

absl::StatusOr<ModelSwitch> RouterServer::LoadModel(const std::string& model_dir, absl::Duration timeout,
                                                    const std::function<bool()>& abandon, bool wait_again) {
  if (engine_ != nullptr) {
    return absl::FailedPreconditionError("a local-mode router cannot switch models: restart it with the new model");
  }
  if (!load_mu_.TryLock()) return absl::AbortedError("another LoadModel is in progress");
  if (stopping_.load()) {  // a version installed now would outlive Shutdown's stop of the backend
    load_mu_.Unlock();
    return absl::UnavailableError("the router is shutting down");
  }
  absl::StatusOr<ModelSwitch> result = LoadModelLocked(model_dir, timeout, abandon, wait_again);
  metrics_
      .GetCounter("colibri_router_model_loads_total", "LoadModel calls by result.",
                  {{"result", result.ok() ? "ok" : "failed"}})
      ->Increment();
  load_mu_.Unlock();
  return result;
}

absl::StatusOr<ModelSwitch> RouterServer::LoadModelLocked(const std::string& model_dir, absl::Duration timeout,
                                                          const std::function<bool()>& abandon, bool wait_again) {
  COLIBRI_RETURN_IF_ERROR(MayLoad(model_dir, options_.model_root, options_.model_dir));
  // Not service_->router(): a reference held here would keep the old version
  // from being released below.
  const Router& current = *remote_->router;
  const std::string previous_id = current.model_id();
  COLIBRI_ASSIGN_OR_RETURN(RemoteRouter next, PrepareVersion(current, model_dir, options_.remote, options_.router,
                                                             timeout, &stopping_, abandon));
  // Nothing to switch: the versions replaced before get their wait again if asked.
  if (next.router == nullptr) {
    return ModelSwitch{previous_id, previous_id, wait_again ? DrainRetired(timeout, abandon) : ReleaseRetired()};
  }
  if (abandon && abandon()) {
    return absl::CancelledError(absl::StrCat("the load was given up before the switch: model ", next.router->model_id(),
                                             " not switched to, ", previous_id, " serves on"));
  }
  auto version = std::make_shared<RemoteRouter>(std::move(next));
  std::shared_ptr<RemoteRouter> old = std::move(remote_);
  remote_ = version;
  service_->SwapRouter(std::shared_ptr<Router>(version, version->router.get()));
  old->backend->Stop();         // its health watcher and listener; its requests still finish on its map
  version->backend->Publish();  // after the old one's last round: the gauges are the new one's
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  version->backend->SetServingListener([health](bool serving) { runtime::SetServing(health, kService, serving); });
  retired_.push_back(std::move(old));
  common::LogLine(log_, absl::StrCat("colibri-router: now serving model ", version->router->model_id(), " from ",
                                     model_dir, " (was ", previous_id, ")"));
  return ModelSwitch{version->router->model_id(), previous_id, DrainRetired(timeout, abandon)};
}

bool RouterServer::DrainRetired(absl::Duration timeout, const std::function<bool()>& abandon) {
  // The old versions' requests finish on them; each is released once they
  // have (or, if some take longer, at the next load or at shutdown). A
  // shutdown does not wait for this, nor a caller gone: what is left is
  // released later.
  const absl::Time until = absl::Now() + timeout;
  bool released = ReleaseRetired();
  while (!released && absl::Now() < until && !stopping_.load() && !(abandon && abandon())) {
    absl::SleepFor(absl::Milliseconds(20));
    released = ReleaseRetired();
  }
  return released;
}

void RouterServer::Shutdown(std::chrono::system_clock::time_point deadline) {
  std::call_once(shutdown_once_, [&] {
    metrics_server_.reset();  // first: its slowest client must not delay the drain
    stopping_.store(true);    // a LoadModel waiting for old requests stops waiting
    {
      common::MutexLock lock(&load_mu_);                 // waits for a LoadModel running
      if (remote_ != nullptr) remote_->backend->Stop();  // no health callback into the server from here on
    }
    runtime::SetServing(server_->GetHealthCheckService(), kService, false);
    service_->CloseStreams();  // open streams would otherwise hold the drain until its deadline
    if (admin_server_ != nullptr) admin_server_->Shutdown(deadline);
    server_->Shutdown(deadline);  // waits for in-flight calls; cancels them at the deadline
    server_->Wait();
    server_.reset();  // the services must outlive the servers
    admin_server_.reset();
    admin_service_.reset();
    service_.reset();  // joins the workers
    common::MutexLock lock(&load_mu_);
    // No request runs any more; merged calls their callers left may still.
    for (const std::shared_ptr<RemoteRouter>& r : retired_) AwaitIdle(*r);
    retired_.clear();
    if (remote_ != nullptr) AwaitIdle(*remote_);
  });
}

RouterServer::~RouterServer() {
  if (server_ != nullptr) Shutdown(std::chrono::system_clock::now());
}

}  // namespace router_node
}  // namespace colibri
