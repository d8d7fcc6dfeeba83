#include "router_node/router_server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "runtime/grpc_admin.h"
#include "runtime/grpc_credentials.h"
#include "runtime/grpc_services.h"

namespace colibri {
namespace router_node {

absl::StatusOr<std::unique_ptr<RouterServer>> RouterServer::Create(RouterServerOptions options, std::ostream* log) {
  if (options.model_dir.empty()) return absl::InvalidArgumentError("RouterServerOptions::model_dir is required");
  COLIBRI_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                           runtime::ServerCredentialsFromFiles(options.tls_cert_file, options.tls_key_file,
                                                               options.tls_client_ca_file, "RouterServerOptions::"));
  COLIBRI_RETURN_IF_ERROR(runtime::CheckAdminIdentities(options.service.admin_identities, options.tls_client_ca_file,
                                                        "RouterServerOptions::service."));
  std::unique_ptr<RouterServer> s(new RouterServer());
  if (options.local) {
    options.engine.max_tokens = options.router.max_tokens;
    options.engine.verify_checksums = options.router.verify_checksums;
    options.engine.metrics = &s->metrics_;
    options.engine.log = log;
    COLIBRI_ASSIGN_OR_RETURN(s->engine_, Engine::Open(options.model_dir, options.engine));
    s->router_ = &s->engine_->router();
  } else {
    options.remote.log = log;
    options.router.metrics = &s->metrics_;
    COLIBRI_ASSIGN_OR_RETURN(s->remote_, MakeRemoteRouter(options.model_dir, options.remote, options.router));
    s->router_ = s->remote_.router.get();
  }
  if (options.metrics_port >= 0) {
    COLIBRI_ASSIGN_OR_RETURN(s->metrics_server_,
                             runtime::MetricsServer::Create(runtime::MetricsHost(options.metrics_host, options.listen),
                                                            options.metrics_port, &s->metrics_));
    s->metrics_port_ = s->metrics_server_->port();
  }
  options.service.metrics = &s->metrics_;
  options.service.remote = s->remote_.backend.get();
  options.service.log = log;
  if (options.service.max_inflight_bytes <= 0) {  // room for two requests of max_tokens f32 hidden states
    const common::Manifest& m = s->router_->manifest();
    const int64_t values = options.router.max_tokens * m.d_model;
    options.service.max_inflight_bytes = 2 * RouterService::Footprint(values * 4, values, m);
  }
  s->service_ = std::make_unique<RouterService>(s->router_, options.service);

  runtime::EnableStandardServices();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, credentials, &s->port_);
  // Largest call: max_tokens hidden states in f32 plus token ids and client
  // routes (4 + 8 * top_k bytes per token), and framing.
  const common::Manifest& m = s->router_->manifest();
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
  if (!options.admin_listen.empty()) {
    s->admin_service_ = std::make_unique<RouterAdminService>(s->service_.get());
    COLIBRI_ASSIGN_OR_RETURN(s->admin_server_,
                             runtime::StartAdminServer(options.admin_listen, credentials, s->admin_service_.get(),
                                                       &s->admin_port_, "RouterServerOptions::"));
  }
  grpc::HealthCheckServiceInterface* health = s->server_->GetHealthCheckService();
  if (s->remote_.backend != nullptr) {
    s->remote_.backend->SetServingListener([health](bool serving) { health->SetServingStatus(serving); });
  } else {
    health->SetServingStatus(true);
  }
  return s;
}

void RouterServer::Shutdown(std::chrono::system_clock::time_point deadline) {
  std::call_once(shutdown_once_, [&] {
    metrics_server_.reset();                                  // first: its slowest client must not delay the drain
    if (remote_.backend != nullptr) remote_.backend->Stop();  // no health callback into the server from here on
    server_->GetHealthCheckService()->SetServingStatus(false);
    if (admin_server_ != nullptr) admin_server_->Shutdown(deadline);
    server_->Shutdown(deadline);  // waits for in-flight calls; cancels them at the deadline
    server_->Wait();
    server_.reset();  // the services must outlive the servers
    admin_server_.reset();
    admin_service_.reset();
    service_.reset();  // joins the workers
  });
}

RouterServer::~RouterServer() {
  if (server_ != nullptr) Shutdown(std::chrono::system_clock::now());
}

}  // namespace router_node
}  // namespace colibri
