#include "expert_node/expert_server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <filesystem>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/cgroup_limits.h"
#include "common/log_line.h"
#include "common/status_macros.h"
#include "expert_node/expert_service.h"
#include "kernels/dispatch.h"
#include "kernels/kernel_profile.h"
#include "runtime/grpc_admin.h"
#include "runtime/grpc_credentials.h"
#include "runtime/grpc_services.h"
#include "runtime/message_limits.h"

namespace colibri {
namespace expert_node {

namespace {

// The name standard health clients may ask for, beside "".
const char* const kService = colibri::v1::ExpertNode::service_full_name();

// Insecure, TLS, or mutual TLS, from the options.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(const ServerOptions& o) {
  return runtime::ServerCredentialsFromFiles(o.tls_cert_file, o.tls_key_file, o.tls_client_ca_file, "ServerOptions::");
}

}  // namespace

absl::StatusOr<std::unique_ptr<ExpertServer>> ExpertServer::Create(const ServerOptions& options, std::ostream* log) {
  COLIBRI_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials, Credentials(options));
  COLIBRI_RETURN_IF_ERROR(
      runtime::CheckAdminIdentities(options.admin_identities, options.tls_client_ca_file, "ServerOptions::"));
  COLIBRI_RETURN_IF_ERROR(runtime::ValidateKeepalive(options.keepalive, "ServerOptions::"));
  if (options.memory_budget > 0 && options.store.residency != Residency::kPaged) {
    return absl::InvalidArgumentError(absl::StrCat("ServerOptions::memory_budget ", options.memory_budget,
                                                   " needs paged residency (StoreOptions::residency paged, not ",
                                                   ResidencyName(options.store.residency), ")"));
  }
  if (options.memory_budget > 0 && (options.store.hugepages || options.store.numa_node >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ServerOptions::memory_budget ", options.memory_budget,
        " has no effect with StoreOptions::hugepages or numa_node: the weights are then copied into the node's memory "
        "whole, not paged from the files"));
  }
  // The limits first, from the manifest: a bad one is refused before the weights are read.
  COLIBRI_ASSIGN_OR_RETURN(std::unique_ptr<common::ModelDir> model, common::ModelDir::Open(options.model_dir));
  const common::Manifest& m = model->manifest();
  const int64_t d_model = m.d_model, routes = m.top_k + m.n_shared_experts;
  if (options.limits.max_rows < 1 || options.limits.max_rows > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ServerOptions::limits.max_rows ", options.limits.max_rows, " must be in [1, 2^24]"));
  }
  if (options.max_queued_calls < 1) {
    return absl::InvalidArgumentError(absl::StrCat("ServerOptions::max_queued_calls ", options.max_queued_calls,
                                                   " must be at least 1 (every call waits in the queue for the "
                                                   "compute thread)"));
  }
  if (options.limits.max_row_indices < 1 || options.limits.max_row_indices > (int64_t{1} << 28)) {
    return absl::InvalidArgumentError(absl::StrCat("ServerOptions::limits.max_row_indices ",
                                                   options.limits.max_row_indices, " must be in [1, 2^28]"));
  }
  // A reply is up to max_rows f32 rows of d_model.
  if (const int64_t most = runtime::MaxF32RowsPerMessage(d_model); options.limits.max_rows > most) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ServerOptions::limits.max_rows ", options.limits.max_rows, ": replies of that many rows of d_model ", d_model,
        " in f32 would pass gRPC's 2 GiB message limit (at most ", most, ")"));
  }
  // Largest call: max_rows f32 rows of d_model in (or out), plus the expert
  // lists and framing. A smaller explicit limit would let a call be computed
  // whose reply cannot be sent (and end a ComputeStream with it).
  const int64_t derived = options.limits.max_rows * d_model * 4 + options.limits.max_row_indices * 8 + (1 << 20);
  if (options.max_message_bytes > 0 && options.max_message_bytes < derived) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ServerOptions::max_message_bytes ", options.max_message_bytes, " is below the ", derived,
        " bytes a reply of ServerOptions::limits.max_rows ", options.limits.max_rows, " f32 rows of d_model ", d_model,
        " (and limits.max_row_indices ", options.limits.max_row_indices, ") may take; lower limits.max_rows"));
  }
  // Default budget: room for two calls of max_rows f32 rows, and for one
  // whose rows each go to all of a token's experts with a reply per token (a
  // router's call of max_rows tokens to a node that holds all their
  // experts): a call the router's limits allow is never larger than the
  // whole budget. Under a memory limit it takes what the weights leave, and
  // at least one call of max_rows rows must fit beside them.
  const int64_t rows = options.limits.max_rows;
  const int64_t plain = ExpertService::Footprint(rows * d_model * 4, rows * d_model, 0, rows, d_model);
  const int64_t routed =
      ExpertService::Footprint(rows * d_model * 4, rows * d_model, rows * routes, rows * (routes + 1), d_model);
  StoreOptions store = options.store;
  if (options.max_inflight_bytes > (int64_t{1} << 56)) {
    return absl::InvalidArgumentError(absl::StrCat("ServerOptions::max_inflight_bytes ", options.max_inflight_bytes,
                                                   " is beyond any memory (at most 2^56)"));
  }
  store.memory_reserve =
      common::kProcessMemoryBytes + (options.max_inflight_bytes > 0 ? options.max_inflight_bytes : plain);
  store.memory_advice =
      "Raise the limit, serve fewer experts, lower the in-flight budget (ServerOptions::max_inflight_bytes, "
      "ServerOptions::limits.max_rows), or use StoreOptions::residency paged (the mapped files, which the kernel may "
      "reclaim)";

  std::unique_ptr<ExpertServer> s(new ExpertServer());
  // The compute thread (ExpertService) is the pool's worker 0: a call wakes
  // one thread fewer. Made first: a NUMA node it cannot use is refused before the weights are read.
  COLIBRI_ASSIGN_OR_RETURN(s->pool_, kernels::ThreadPool::Create({options.threads, options.store.numa_node,
                                                                  /*pin=*/true, /*caller_joins=*/true}));
  COLIBRI_ASSIGN_OR_RETURN(s->store_, ExpertStore::Create(std::move(model), store, log));
  int64_t budget = options.max_inflight_bytes > 0 ? options.max_inflight_bytes : std::max(2 * plain, routed);
  if (store.memory_limit >= 0) {
    // What the weights as loaded leave (copies that missed reserved huge
    // pages count now); of it, room for a second version of them where that
    // still leaves one call.
    const int64_t weights = s->store_->ResidentBytes();
    const int64_t room = store.memory_limit - weights - common::kProcessMemoryBytes;
    if (const int64_t least = options.max_inflight_bytes > 0 ? options.max_inflight_bytes : plain; room < least) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the weights as loaded, ", weights, " bytes, leave ", room, " bytes of the memory limit of ",
          store.memory_limit, " (less 256 MiB for the process) for calls in flight, below the ", least,
          " bytes of ServerOptions::max_inflight_bytes (or of one call of ServerOptions::limits.max_rows rows)"));
    }
    const bool second = room - weights >= plain;
    if (const int64_t cap = second ? room - weights : room; options.max_inflight_bytes <= 0 && budget > cap) {
      budget = cap;
      common::LogLine(
          log, absl::StrCat("in-flight budget ", budget, " bytes (max_inflight_bytes), within the memory limit of ",
                            store.memory_limit, " bytes beside ", weights, " bytes of weights",
                            second ? " and room for a second version of them"
                                   : "; no room for a second version of them: a reload that copies the "
                                     "weights again or maps other files is refused"));
    }
    if (budget < routed) {
      common::LogLine(log,
                      absl::StrCat("WARNING: the in-flight budget is below the ", routed,
                                   " bytes of a router's largest call (limits.max_rows tokens, each to its ", routes,
                                   " experts here): such calls are refused RESOURCE_EXHAUSTED; raise the "
                                   "memory limit or lower the router's max_tokens"));
    }
  }
  s->store_->SetMemoryReserve(common::kProcessMemoryBytes + budget);
  if (options.store.residency == Residency::kPaged) {
    s->paged_ = std::make_unique<PagedWeights>(PagedWeights::Options{options.memory_budget, &s->metrics_});
  }
  s->engine_ = std::make_unique<ComputeEngine>(s->store_.get(), s->pool_.get(), options.limits,
                                               /*advise_reads=*/s->paged_ == nullptr);
  ExpertService::Options service_options;
  service_options.model_root = options.model_root;  // empty: Reload cannot load another directory
  service_options.check_finite = options.check_finite;
  service_options.max_queued_calls = options.max_queued_calls;
  service_options.max_inflight_bytes = budget;
  service_options.threads = s->pool_->size();
  service_options.kernel_isa = kernels::IsaName(kernels::SelectedKernels().isa);
  service_options.kernel_profile = kernels::ProfileChoices(kernels::SelectedProfile());
  service_options.numa_node = options.store.numa_node;
  service_options.admin_identities = options.admin_identities;
  service_options.metrics = &s->metrics_;
  service_options.paged = s->paged_.get();
  service_options.merge_calls = options.merge_calls;
  service_options.inject_delay_ms = options.inject_delay_ms;
  service_options.inject_delay_every = options.inject_delay_every;
  if (options.metrics_port >= 0) {
    COLIBRI_ASSIGN_OR_RETURN(s->metrics_server_,
                             runtime::MetricsServer::Create(runtime::MetricsHost(options.metrics_host, options.listen),
                                                            options.metrics_port, &s->metrics_));
    s->metrics_port_ = s->metrics_server_->port();
  }
  s->service_ = std::make_unique<ExpertService>(s->store_.get(), s->engine_.get(), service_options);

  runtime::EnableStandardServices();
  grpc::ServerBuilder builder;
  runtime::ApplyServerPolicy(builder, options.keepalive);
  builder.AddListeningPort(options.listen, credentials, &s->port_);
  const int64_t max_bytes = std::min<int64_t>(options.max_message_bytes > 0 ? options.max_message_bytes : derived,
                                              std::numeric_limits<int>::max());
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(max_bytes));
  // The limit is fixed now: a reload may bring a larger d_model only while
  // a call of limits.max_rows rows of it still fits (never below the loaded
  // model's, whose calls the limit was set for, capped at 2 GiB or not).
  s->store_->SetMaxDModel(
      std::max(d_model, (max_bytes - options.limits.max_row_indices * 8 - (1 << 20)) / (options.limits.max_rows * 4)));
  builder.RegisterService(s->service_.get());
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  }
  if (!options.admin_listen.empty()) {
    s->admin_service_ = std::make_unique<AdminService>(s->service_.get());
    COLIBRI_ASSIGN_OR_RETURN(s->admin_server_,
                             runtime::StartAdminServer(options.admin_listen, credentials, s->admin_service_.get(),
                                                       &s->admin_port_, "ServerOptions::", options.keepalive));
  }
  // Every owned expert is mapped and verified (or copied) by now; locking may still run (ExpertStore).
  runtime::SetServing(s->server_->GetHealthCheckService(), kService, true);
  return s;
}

absl::Status ExpertServer::Reload() { return service_->ReloadNow("", std::nullopt); }

void ExpertServer::Shutdown(std::chrono::system_clock::time_point deadline) {
  std::call_once(shutdown_once_, [&] {
    metrics_server_.reset();  // first: its slowest client must not delay the drain
    runtime::SetServing(server_->GetHealthCheckService(), kService, false);
    service_->CloseStreams();  // else an open stream keeps the drain waiting to its deadline
    if (admin_server_ != nullptr) admin_server_->Shutdown(deadline);
    server_->Shutdown(deadline);  // waits for in-flight calls (the compute thread still runs)
    server_->Wait();
    server_.reset();  // the services must outlive the servers
    admin_server_.reset();
    admin_service_.reset();
    service_.reset();  // finishes anything still queued, joins its threads
  });
}

ExpertServer::~ExpertServer() {
  if (server_ != nullptr) Shutdown(std::chrono::system_clock::now());
}

}  // namespace expert_node
}  // namespace colibri
