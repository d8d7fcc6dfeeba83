#ifndef COLIBRI_EXPERT_NODE_EXPERT_SERVER_H_
#define COLIBRI_EXPERT_NODE_EXPERT_SERVER_H_

// An expert node: the expert store, the compute pool and engine, and the
// gRPC server that exposes them (ExpertNode service, grpc.health.v1 health
// checking — SERVING once every owned expert is mapped, locked and verified —
// and server reflection). Create() returns a started server.
// Thread-safe; Shutdown() is idempotent and also run by the destructor.

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/metrics.h"
#include "expert_node/compute_engine.h"
#include "expert_node/expert_store.h"
#include "expert_node/paged_weights.h"
#include "kernels/thread_pool.h"
#include "runtime/grpc_services.h"
#include "runtime/metrics_server.h"

namespace grpc {
class Server;
}

namespace colibri {
namespace expert_node {

class AdminService;
class ExpertService;

struct ServerOptions {
  std::string listen = "127.0.0.1:0";  // host:port; port 0 picks a free one
  std::string model_dir;
  // Reload may only name directories inside it; empty (the default): Reload
  // may only re-shard the loaded model, never load another directory.
  std::string model_root;
  StoreOptions store;
  // Paged residency (store.residency kPaged): bytes of expert files kept in
  // memory; beyond, the least recently used are evicted. <= 0: no limit.
  int64_t memory_budget = 0;
  int threads = 0;                // compute threads (0: one per allowed CPU of the NUMA node)
  bool check_finite = false;      // refuse NaN/Inf in request rows
  int64_t max_message_bytes = 0;  // 0: from the model shape and limits.max_rows
  int64_t max_queued_calls = 64;  // beyond: RESOURCE_EXHAUSTED
  // Memory budget of the calls in flight (beyond: RESOURCE_EXHAUSTED); 0:
  // room for two calls of limits.max_rows f32 rows (rows, copy, output,
  // encoding), within what the weights leave of store.memory_limit (the
  // process's cgroup limit, set by the caller), 256 MiB kept for the process.
  // The weights must fit beside one such call, or this budget if set (else
  // FAILED_PRECONDITION before anything is copied or locked; see
  // StoreOptions::memory_limit).
  int64_t max_inflight_bytes = 0;
  ComputeEngine::Limits limits;
  // TLS: server certificate chain and key (PEM files); with a client CA as
  // well, mutual TLS: only clients with a certificate signed by it get in.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  // Admin calls (Reload; GetNodeInfo's paths and errors): served on
  // `admin_listen` (host:port, same TLS settings as `listen`; empty: no admin
  // listener), and on `listen` to mutual-TLS peers whose certificate names
  // one of `admin_identities` (needs tls_client_ca_file).
  std::string admin_listen;
  std::vector<std::string> admin_identities;
  bool merge_calls = true;       // ExpertService::Options::merge_calls
  int inject_delay_ms = 0;       // fault injection: a Compute sleeps this long first ...
  int inject_delay_every = 1;    // ... every this many calls
  int metrics_port = -1;         // >= 0: serve Prometheus /metrics on it (0 picks a free port)
  std::string metrics_host;      // empty: the host of `listen`
  runtime::Keepalive keepalive;  // pings to its clients (routers; runtime/grpc_services.h)
};

class ExpertServer {
 public:
  // `log` (may be null) must outlive the server; the store writes to it from
  // reload threads, one reload at a time.
  static absl::StatusOr<std::unique_ptr<ExpertServer>> Create(const ServerOptions& options, std::ostream* log);
  ~ExpertServer();

  int port() const { return port_; }
  int admin_port() const { return admin_port_; }      // -1 without an admin listener
  int metrics_port() const { return metrics_port_; }  // -1 without metrics

  // Reloads the current directory and shard (SIGHUP), recorded like an RPC
  // reload. REQUIRES: not shut down.
  absl::Status Reload();
  ExpertStore& store() { return *store_; }

  // Stops accepting calls, lets in-flight calls finish until `deadline`,
  // then cancels the rest.
  void Shutdown(std::chrono::system_clock::time_point deadline);

 private:
  ExpertServer() = default;

  common::MetricsRegistry metrics_;
  std::unique_ptr<runtime::MetricsServer> metrics_server_;
  std::unique_ptr<ExpertStore> store_;
  std::unique_ptr<kernels::ThreadPool> pool_;
  std::unique_ptr<ComputeEngine> engine_;
  std::unique_ptr<PagedWeights> paged_;  // paged residency only
  std::unique_ptr<ExpertService> service_;
  std::unique_ptr<AdminService> admin_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> admin_server_;
  int port_ = 0;
  int admin_port_ = -1;
  int metrics_port_ = -1;
  std::once_flag shutdown_once_;
};

}  // namespace expert_node
}  // namespace colibri

#endif  // COLIBRI_EXPERT_NODE_EXPERT_SERVER_H_
