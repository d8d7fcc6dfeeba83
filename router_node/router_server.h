#ifndef COLIBRI_ROUTER_NODE_ROUTER_SERVER_H_
#define COLIBRI_ROUTER_NODE_ROUTER_SERVER_H_

// A router: the core with its backend — in-process experts (local mode) or
// expert nodes over gRPC — and the gRPC server that exposes it (Router
// service, grpc.health.v1 — SERVING only while every (layer, expert) has a
// live node — and server reflection), plus optional Prometheus metrics.
// Create() returns a started server. Thread-safe; Shutdown() is idempotent
// and also run by the destructor.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "common/mutex.h"
#include "router_node/engine.h"
#include "router_node/remote_backend.h"
#include "router_node/remote_router.h"
#include "router_node/router.h"
#include "router_node/router_service.h"
#include "runtime/grpc_services.h"
#include "runtime/metrics_server.h"

namespace grpc {
class Server;
}

namespace colibri {
namespace router_node {

struct RouterServerOptions {
  std::string listen = "127.0.0.1:0";  // host:port; port 0 picks a free one
  std::string model_dir;               // the model (manifest, gates, LUTs); required
  // Local mode: run every expert in this process (Engine) instead of on nodes.
  bool local = false;
  Engine::Options engine;          // local mode: threads, NUMA, mlock
  RemoteOptions remote;            // distributed mode: nodes, timeouts, TLS to nodes (model fields are filled in)
  RouterOptions router;            // max_tokens, checksums
  RouterService::Options service;  // workers, queue, debug log
  int64_t max_message_bytes = 0;   // 0: derived from d_model, top_k and max_tokens
  // The memory this process may use (its cgroup's limit, set by the caller;
  // -1: none): the default service.max_inflight_bytes stays within it, less
  // 256 MiB for the process and, in local mode, the engine's resident weights.
  int64_t memory_limit = -1;
  // TLS for clients: certificate chain and key; with a client CA, mutual TLS.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  // Admin calls (GetClusterStatus with node addresses and errors): served on
  // `admin_listen` (host:port, same TLS settings; empty: none), and on
  // `listen` to mutual-TLS peers named in service.admin_identities.
  std::string admin_listen;
  // LoadModel may name model directories inside this one; empty: only
  // `model_dir` itself (re-read, e.g. a symlink switched to a new version).
  std::string model_root;
  int metrics_port = -1;     // >= 0: Prometheus /metrics on it (0 picks a port)
  std::string metrics_host;  // empty: the host of `listen`
  // Pings to clients and nodes (runtime/grpc_services.h); replaces remote.keepalive.
  runtime::Keepalive keepalive;
};

class RouterServer {
 public:
  // `log` (may be null) receives node up/down events and, with
  // service.debug, per-call timings; it must outlive the server.
  static absl::StatusOr<std::unique_ptr<RouterServer>> Create(RouterServerOptions options, std::ostream* log);
  ~RouterServer();

  int port() const { return port_; }
  int admin_port() const { return admin_port_; }      // -1 without an admin listener
  int metrics_port() const { return metrics_port_; }  // -1 without metrics
  // The model version serving new requests.
  std::shared_ptr<Router> router() const { return service_->router(); }
  // Distributed mode: a health round of the serving version's nodes now (and
  // the cluster file re-read). Local mode: nothing.
  void CheckNodesNow();

  // Switches to another version of the model (same shape) in `model_dir`
  // (see Router.LoadModel in proto/colibri/v1/router.proto): loads its gates
  // and LUTs beside the serving ones, waits up to `timeout` until every
  // (layer, expert) of it has a live node, then serves new requests with it;
  // waits (up to the same timeout) for the old version's requests to finish
  // and releases it (with nothing to switch and `wait_again`, waits so for
  // the versions replaced before: an RPC caller told they were not released
  // asks again this way). Returns the new and the replaced model_id, and
  // whether the replaced versions were released (ModelSwitch). Any failure
  // leaves the old version serving. One at a time (ABORTED otherwise).
  // `abandon` (may be empty) is asked while it waits for nodes and for old
  // requests, and just before the swap: once it says true — the RPC's
  // caller gave up, SIGTERM arrived — the waits end, and before the swap
  // the answer is CANCELLED and nothing switched (a caller that saw its
  // call fail must find the old version serving).
  absl::StatusOr<ModelSwitch> LoadModel(const std::string& model_dir, absl::Duration timeout,
                                        const std::function<bool()>& abandon = {}, bool wait_again = false);

  // Stops accepting calls, lets in-flight calls finish until `deadline`,
  // then cancels the rest (and their node calls).
  void Shutdown(std::chrono::system_clock::time_point deadline);

 private:
  RouterServer() = default;

  absl::StatusOr<ModelSwitch> LoadModelLocked(const std::string& model_dir, absl::Duration timeout,
                                              const std::function<bool()>& abandon, bool wait_again)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(load_mu_);
  // Destroys retired versions nothing uses any more; true if none is left.
  bool ReleaseRetired() ABSL_EXCLUSIVE_LOCKS_REQUIRED(load_mu_);
  // ReleaseRetired until none is left, for up to `timeout` (less when the
  // server stops or `abandon`, if set, says the caller is gone).
  bool DrainRetired(absl::Duration timeout, const std::function<bool()>& abandon)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(load_mu_);

  RouterServerOptions options_;  // as completed by Create (log, metrics)
  std::ostream* log_ = nullptr;
  common::MetricsRegistry metrics_;
  std::unique_ptr<runtime::MetricsServer> metrics_server_;
  std::unique_ptr<Engine> engine_;  // local mode
  // Distributed mode: the serving version (the service holds its router).
  common::Mutex load_mu_;              // one LoadModel at a time
  std::atomic<bool> stopping_{false};  // Shutdown has begun
  std::shared_ptr<RemoteRouter> remote_ ABSL_GUARDED_BY(load_mu_);
  // Replaced versions whose requests may still run; destroyed on the loading
  // thread (never a node's callback thread: a backend waits for its calls).
  std::vector<std::shared_ptr<RemoteRouter>> retired_ ABSL_GUARDED_BY(load_mu_);
  std::unique_ptr<RouterService> service_;
  std::unique_ptr<RouterAdminService> admin_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> admin_server_;
  int port_ = 0;
  int admin_port_ = -1;
  int metrics_port_ = -1;
  std::once_flag shutdown_once_;
};

}  // namespace router_node
}  // namespace colibri

#endif  // COLIBRI_ROUTER_NODE_ROUTER_SERVER_H_
