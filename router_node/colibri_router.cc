// colibri-router: the router node. Flags -> RouterServerOptions ->
// RouterServer; then waits for SIGTERM/SIGINT (drain in-flight calls, exit 0)
// or SIGHUP (re-check the expert nodes now, and re-read --model: a new
// version there is rolled out as by Router.LoadModel).
#include <glog/logging.h>
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/allocator.h"
#include "common/cgroup_limits.h"
#include "kernels/kernel_profile.h"
#include "router_node/router_server.h"
#include "runtime/flags.h"
#include "runtime/grpc_services.h"
#include "runtime/logging.h"

ABSL_FLAG(std::string, model, "",
          "Model directory (colibri-convert's output): manifest, gates, LUTs. Required "
          "unless --local is given.");
ABSL_FLAG(std::string, local, "",
          "Local (embedded) mode: run every expert of this model directory in this process "
          "instead of on expert nodes.");
ABSL_FLAG(std::string, experts_at, "", "Expert nodes, host:port,...; what each serves is asked from the node.");
ABSL_FLAG(std::string, cluster_file, "",
          "Or: a file of expert node addresses, one host:port per line ('#' "
          "comments); re-read when it changes.");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "host:port to serve on; port 0 picks a free port (printed).");
ABSL_FLAG(int64_t, max_tokens, 65536, "Most tokens one Forward call may carry (RESOURCE_EXHAUSTED beyond).");
ABSL_FLAG(int64_t, batch_window_us, 5000,
          "Merge concurrent Forward calls of one layer into one call per node (docs/ROUTER.md, \"Merging "
          "concurrent calls\"): the longest a call waits for the others expected with it; 0: no merging.");
ABSL_FLAG(int64_t, batch_max_tokens, 256, "Most tokens of one merged call; a call with more is not merged.");
ABSL_FLAG(int, workers, 8, "Threads running Forward calls (each waits for its nodes, so more than cores is fine).");
ABSL_FLAG(int64_t, max_inflight_bytes, 0,
          "Memory budget of the Forward calls being run (estimated from each request's size before parsing): a call "
          "beyond it gets RESOURCE_EXHAUSTED. 0: room for two requests of --max_tokens tokens, within the cgroup's "
          "memory limit (less 256 MiB for the process and, with --local, the weights).");
ABSL_FLAG(int, send_timeout_ms, 60000,
          "Cancel a call whose reply the client has not taken whole within this long (it stopped reading), freeing "
          "the memory the call holds; 0: wait for the call's deadline.");
ABSL_FLAG(int64_t, max_queued_requests, 256, "Forward calls waiting for a worker (RESOURCE_EXHAUSTED beyond).");
ABSL_FLAG(int64_t, max_message_bytes, 0,
          "Largest client request or reply; 0 derives it from the model and "
          "--max_tokens.");
ABSL_FLAG(bool, verify_checksums, true,
          "Verify the gate and LUT files' (and in --local, the experts') checksums at "
          "start.");
ABSL_FLAG(int, node_timeout_ms, 5000,
          "Deadline of one node call attempt (capped by the client's); a node that "
          "misses it is failed over.");
ABSL_FLAG(int, hedge_after_ms, 0,
          "Hedged calls: when a node has not answered a layer call within this, send its "
          "work to another replica too and take the first answer (0: off; set near the nodes' p95 latency).");
ABSL_FLAG(int64_t, node_stream_max_bytes, 0,
          "> 0: node calls of at most this many request bytes travel as messages on one open stream per node, "
          "larger ones as calls of their own. 0: every node call on its own (docs/PERFORMANCE.md compares them).");
ABSL_FLAG(std::string, node_replies, "exact",
          "What nodes send back: exact (a token's route prefix on one node as one summed row, other entries one "
          "row each: the local engine's bits for any shard map), partial (one row per token and node: fewest "
          "bytes, exact only when a token's experts sit on one node), per_expert (one row per token and expert).");
ABSL_FLAG(std::string, split_rows, "exact",
          "When a replicated expert's rows of one call are split among its replicas: exact (only where no bit of "
          "the answer changes: below every replica's kernel row threshold), always, or never.");
ABSL_FLAG(int64_t, split_min_rows, 16,
          "Fewest rows of one expert in a call worth splitting among its replicas (below it each replica would "
          "mostly re-read the same weights).");
ABSL_FLAG(int, health_interval_ms, 500, "How often every expert node is asked GetNodeInfo (health and shard map).");
ABSL_FLAG(int, health_timeout_ms, 1000, "Deadline of one health check.");
ABSL_FLAG(std::string, node_tls_ca, "", "PEM CA: call the expert nodes over TLS, checking their certificates.");
ABSL_FLAG(std::string, node_tls_cert, "", "PEM client certificate for the nodes (mutual TLS), with --node_tls_key.");
ABSL_FLAG(std::string, node_tls_key, "", "PEM private key of --node_tls_cert.");
ABSL_FLAG(std::string, node_tls_server_name, "", "Name expected in the nodes' certificates (default: the host).");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: serve clients over TLS (with --tls_key).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "", "PEM CA: require client certificates signed by it (mutual TLS).");
ABSL_FLAG(int, threads, 0, "--local: compute threads (0: one per allowed CPU, of --numa_node if set).");
ABSL_FLAG(int, numa_node, -1, "--local: bind compute threads and weight copies to this NUMA node (-1: none).");
ABSL_FLAG(bool, mlock, false, "--local: lock the weights in RAM (a warning if refused).");
ABSL_FLAG(
    bool, hugepages, false,
    "--local: copy the weights into huge-page memory (reserved 2 MiB pages if free, else transparent huge pages).");
ABSL_FLAG(bool, q8_records, false,
          "--local, int8/int4 models: build int8 tile records at load, as colibri-expert --q8_records (needs "
          "--mlock, --hugepages or --numa_node).");
ABSL_FLAG(std::string, model_root, "",
          "Router.LoadModel may switch to model directories inside this one; empty (the default): only to --model "
          "re-read (e.g. a symlink switched to a new version).");
ABSL_FLAG(std::string, admin_listen, "",
          "host:port of the admin listener (GetClusterStatus with node addresses and errors), with --listen's TLS "
          "settings; keep it on loopback or a guarded address. Empty (the default): none.");
ABSL_FLAG(std::vector<std::string>, admin_identities, {},
          "With mutual TLS: client certificate identities (subject alternative names or common name) that get the "
          "admin view on --listen too, comma-separated.");
ABSL_FLAG(int, metrics_port, -1, "Serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a port; -1 off).");
ABSL_FLAG(std::string, metrics_host, "", "IP address the metrics endpoint listens on (default: the host of --listen).");
ABSL_FLAG(int, keepalive_interval_ms, colibri::runtime::kKeepaliveTime.count(),
          "Ping clients and nodes this often, also on idle connections (at least 1000).");
ABSL_FLAG(int, keepalive_timeout_ms, colibri::runtime::kKeepaliveTimeout.count(),
          "Close a client's or node's connection whose ping is not answered within this long: its calls end, and "
          "the memory they hold is freed (a node is reconnected). At least 1000; below ~5000 an idle gRPC C++ "
          "client's connection is closed now and then (it reconnects at its next call).");
ABSL_FLAG(std::string, log_format, "text",
          "Log lines on stderr: text (glog's: level, time, thread, file:line, message) or json (one object per line).");
ABSL_FLAG(std::string, log_level, "info", "Least severe level logged: info, warning or error.");
ABSL_FLAG(int, drain_seconds, 10, "On SIGTERM, how long in-flight calls may take before they are cancelled.");

namespace {

// The options named in the libraries' errors, and the flags that set them.
const colibri::runtime::OptionFlags kOptionFlags = {
    {"RouterOptions::max_tokens", "--max_tokens"},
    {"StoreOptions::q8_records", "--q8_records"},
    {"BatchOptions::max_tokens", "--batch_max_tokens"},
    {"RouterServerOptions::model_dir", "--model"},
    {"RouterServerOptions::tls_cert_file", "--tls_cert"},
    {"RouterServerOptions::tls_key_file", "--tls_key"},
    {"RouterServerOptions::tls_client_ca_file", "--tls_client_ca"},
    {"RouterServerOptions::admin_listen", "--admin_listen"},
    {"RouterServerOptions::model_root", "--model_root"},
    {"RouterServerOptions::service.admin_identities", "--admin_identities"},
    {"RouterServerOptions::keepalive.interval", "--keepalive_interval_ms"},
    {"RouterServerOptions::service.send_timeout", "--send_timeout_ms"},
    {"RouterServerOptions::service.max_queued_requests", "--max_queued_requests"},
    {"RouterServerOptions::keepalive.timeout", "--keepalive_timeout_ms"},
    {"RemoteOptions::addresses", "--experts_at"},
    {"RemoteOptions::cluster_file", "--cluster_file"},
    {"RemoteOptions::node_stream_max_bytes", "--node_stream_max_bytes"},
    {"RemoteOptions::node_timeout", "--node_timeout_ms"},
    {"RemoteOptions::health_interval", "--health_interval_ms"},
    {"RemoteOptions::health_timeout", "--health_timeout_ms"},
    {"RemoteOptions::tls_ca_file", "--node_tls_ca"},
    {"RemoteOptions::tls_cert_file", "--node_tls_cert"},
    {"RemoteOptions::tls_key_file", "--node_tls_key"},
    {"RemoteOptions::tls_server_name", "--node_tls_server_name"},
    {"ThreadPool::Options::numa_node", "--numa_node"},
    {"Engine::Options::lock_memory, hugepages and numa_node", "--mlock, --hugepages and --numa_node"},
};

}  // namespace

int main(int argc, char** argv) {
  colibri::common::TuneAllocatorForServer();
  colibri::runtime::ParseFlags(
      argc, argv,
      "Colibri router: serves colibri.v1.Router (Forward, ForwardStream, GetModelInfo, GetClusterStatus) with\n"
      "grpc.health.v1 and reflection. Routes each token (lut | gate | client), sends the rows to the expert nodes\n"
      "that own its experts (one call per node per layer) and returns the weighted sum; or, with --local, runs the\n"
      "experts in-process. COLIBRI_DEBUG=1 logs every call's stage timings to stderr.\n"
      "Examples: colibri-router --model model/ --experts_at 10.0.0.1:50061,10.0.0.2:50061 --listen 0.0.0.0:50051\n"
      "          colibri-router --local model/ --listen 127.0.0.1:50051");
  if (absl::Status s =
          colibri::runtime::InitLogging(argv[0], absl::GetFlag(FLAGS_log_format), absl::GetFlag(FLAGS_log_level));
      !s.ok()) {
    std::cerr << "colibri-router: " << s.message() << "\n";
    return 2;
  }
  colibri::router_node::RouterServerOptions o;
  const std::string local = absl::GetFlag(FLAGS_local);
  o.local = !local.empty();
  o.model_dir = absl::GetFlag(FLAGS_model).empty() ? local : absl::GetFlag(FLAGS_model);
  if (o.model_dir.empty()) {
    std::cerr << "colibri-router: --model or --local is required (see --help)\n";
    return 2;
  }
  if (o.local && !absl::GetFlag(FLAGS_model).empty() && absl::GetFlag(FLAGS_model) != local) {
    std::cerr << "colibri-router: --model and --local name different directories\n";
    return 2;
  }
  const std::string experts_at = absl::GetFlag(FLAGS_experts_at);
  if (!experts_at.empty()) o.remote.addresses = absl::StrSplit(experts_at, ',', absl::SkipWhitespace());
  o.remote.cluster_file = absl::GetFlag(FLAGS_cluster_file);
  if (o.local != (o.remote.addresses.empty() && o.remote.cluster_file.empty())) {
    std::cerr << "colibri-router: give exactly one of --local, --experts_at, --cluster_file\n";
    return 2;
  }
  o.listen = absl::GetFlag(FLAGS_listen);
  o.router.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  o.router.verify_checksums = absl::GetFlag(FLAGS_verify_checksums);
  o.router.batching.window = absl::Microseconds(std::max<int64_t>(0, absl::GetFlag(FLAGS_batch_window_us)));
  o.router.batching.max_tokens = absl::GetFlag(FLAGS_batch_max_tokens);
  o.service.workers = absl::GetFlag(FLAGS_workers);
  o.service.max_queued_requests = absl::GetFlag(FLAGS_max_queued_requests);
  o.service.max_inflight_bytes = absl::GetFlag(FLAGS_max_inflight_bytes);
  if (const colibri::common::CgroupLimits cgroup = colibri::common::ReadCgroupLimits(); cgroup.memory_bytes >= 0) {
    o.memory_limit = cgroup.memory_bytes;  // past it the kernel kills the router: the default budget stays within
    o.engine.memory_limit = cgroup.memory_bytes;  // and with --local, a load that would pass it is refused
    o.engine.memory_limit_source = cgroup.memory_file;
    LOG(INFO) << "colibri-router: memory limit " << cgroup.memory_bytes << " bytes (" << cgroup.memory_file << ")";
  }
  o.service.send_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_send_timeout_ms));
  const char* debug = std::getenv("COLIBRI_DEBUG");
  o.service.debug = debug != nullptr && std::string(debug) != "0" && std::string(debug) != "";
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  o.remote.node_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_node_timeout_ms));
  o.remote.health_interval = absl::Milliseconds(absl::GetFlag(FLAGS_health_interval_ms));
  o.remote.hedge_after = absl::Milliseconds(absl::GetFlag(FLAGS_hedge_after_ms));
  o.remote.node_stream_max_bytes = std::max<int64_t>(0, absl::GetFlag(FLAGS_node_stream_max_bytes));
  if (const auto replies = colibri::router_node::ParseNodeReplies(absl::GetFlag(FLAGS_node_replies))) {
    o.remote.replies = *replies;
  } else {
    std::cerr << "colibri-router: --node_replies must be exact, partial or per_expert\n";
    return 2;
  }
  if (const auto split = colibri::router_node::ParseRowSplit(absl::GetFlag(FLAGS_split_rows))) {
    o.remote.row_split.mode = *split;
  } else {
    std::cerr << "colibri-router: --split_rows must be exact, always or never\n";
    return 2;
  }
  o.remote.row_split.min_rows = absl::GetFlag(FLAGS_split_min_rows);
  o.remote.health_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_health_timeout_ms));
  o.remote.tls_ca_file = absl::GetFlag(FLAGS_node_tls_ca);
  o.remote.tls_cert_file = absl::GetFlag(FLAGS_node_tls_cert);
  o.remote.tls_key_file = absl::GetFlag(FLAGS_node_tls_key);
  o.remote.tls_server_name = absl::GetFlag(FLAGS_node_tls_server_name);
  o.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  o.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  o.engine.threads = absl::GetFlag(FLAGS_threads);
  o.engine.numa_node = absl::GetFlag(FLAGS_numa_node);
  o.engine.lock_memory = absl::GetFlag(FLAGS_mlock);
  o.engine.hugepages = absl::GetFlag(FLAGS_hugepages);
  o.engine.q8_records = absl::GetFlag(FLAGS_q8_records);
  o.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  o.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  o.keepalive.interval = std::chrono::milliseconds(absl::GetFlag(FLAGS_keepalive_interval_ms));
  o.keepalive.timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_keepalive_timeout_ms));
  o.admin_listen = absl::GetFlag(FLAGS_admin_listen);
  o.model_root = absl::GetFlag(FLAGS_model_root);
  o.service.admin_identities = absl::GetFlag(FLAGS_admin_identities);

  sigset_t signals;  // blocked before any thread starts, so sigwait sees them
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  colibri::runtime::LogLines log;  // the libraries' events, into glog
  auto server = colibri::router_node::RouterServer::Create(o, &log);
  if (!server.ok()) {
    LOG(ERROR) << "colibri-router: " << colibri::runtime::NameFlags(server.status(), kOptionFlags).message();
    return 1;
  }
  std::cout << "colibri-router: listening on port " << (*server)->port() << " ("
            << (o.local ? "local experts" : "expert nodes") << ")" << std::endl;
  if (o.local) {
    std::cout << "colibri-router: kernels " << colibri::kernels::DescribeProfile(colibri::kernels::SelectedProfile())
              << std::endl;
  }
  if ((*server)->admin_port() >= 0) {
    std::cout << "colibri-router: admin on port " << (*server)->admin_port() << std::endl;
  }
  if ((*server)->metrics_port() >= 0) {
    std::cout << "colibri-router: metrics on port " << (*server)->metrics_port() << std::endl;
  }
  for (;;) {
    int sig = 0;
    sigwait(&signals, &sig);
    if (sig == SIGHUP) {
      (*server)->CheckNodesNow();
      if (!o.local) {  // --model re-read: a new version there (a switched symlink) is rolled out
        // SIGTERM or SIGINT (blocked, so pending until sigwait takes them)
        // ends the load's waits: the drain below must not wait 30 s for it.
        const auto stop_pending = [] {
          sigset_t pending;
          sigpending(&pending);
          return sigismember(&pending, SIGTERM) == 1 || sigismember(&pending, SIGINT) == 1;
        };
        const auto ids = (*server)->LoadModel(o.model_dir, absl::Seconds(30), stop_pending);
        if (!ids.ok() && absl::IsCancelled(ids.status()) && stop_pending()) {  // not an error: stopping
          LOG(WARNING) << "colibri-router: SIGHUP: stopping: " << ids.status().message();
        } else if (!ids.ok()) {
          LOG(ERROR) << "colibri-router: SIGHUP: " << ids.status().message();
        } else if (ids->model_id != ids->previous_model_id) {
          LOG(INFO) << "colibri-router: SIGHUP: now serving model " << ids->model_id;
        }
      }
      continue;
    }
    LOG(INFO) << "colibri-router: draining and stopping";
    (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(absl::GetFlag(FLAGS_drain_seconds)));
    return 0;
  }
}
