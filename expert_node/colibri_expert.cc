// colibri-expert: an expert node. Flags -> ServerOptions -> ExpertServer;
// then waits for signals: SIGHUP reloads the weights, SIGTERM/SIGINT drain
// in-flight calls and exit.
#include <glog/logging.h>
#include <signal.h>

#include <chrono>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "common/allocator.h"
#include "common/cgroup_limits.h"
#include "expert_node/expert_server.h"
#include "kernels/kernel_profile.h"
#include "runtime/flags.h"
#include "runtime/grpc_services.h"
#include "runtime/logging.h"

ABSL_FLAG(std::string, model, "", "Model directory (colibri-convert's output). Required.");
ABSL_FLAG(std::string, experts, "all",
          "Experts this node owns: all | 0-3 | 1,3,5-7 | layer:0-15/expert:0-3 | "
          "clauses joined by ';'.");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "host:port to serve on; port 0 picks a free port (printed).");
ABSL_FLAG(std::string, model_root, "",
          "Reload may only load model directories inside this one. Empty (the default): Reload may only re-shard "
          "the loaded model.");
ABSL_FLAG(int, threads, 0,
          "Compute threads (0: one per allowed CPU, of --numa_node if set, at most the cgroup's CPU quota).");
ABSL_FLAG(int, numa_node, -1, "Bind compute threads and weight copies to this NUMA node (-1: no binding).");
ABSL_FLAG(bool, numa_node_auto, false,
          "Bind to the NUMA node of the CPUs this process may run on (one socket's CPUs, "
          "e.g. as Kubernetes' topology manager assigned them); refused if they span several nodes.");
ABSL_FLAG(bool, verify_checksums, true,
          "Verify every owned file's checksum at load and reload (files unchanged since they were verified, by "
          "size, inode, mtime and ctime, are not hashed again: see --verify_cache).");
ABSL_FLAG(std::string, verify_cache, "",
          "Where verified files are remembered: empty (the default) = MODEL/.colibri-verified if the model "
          "directory is writable, else ~/.cache/colibri; 'off' = hash every file at every start; or a file.");
ABSL_FLAG(std::string, residency, "locked",
          "Where the weights live: locked (the mapped files, locked in RAM; never change them in place), copy (the "
          "node's own locked copy; a start pays for the copy) or paged (the mapped files, not locked: the kernel "
          "reads them on use and may drop them; see --memory_budget).");
ABSL_FLAG(int64_t, memory_budget, 0,
          "With --residency paged: bytes of expert files kept in memory; beyond, the least recently used experts "
          "are evicted (each call's experts are read in as it arrives). 0: no limit.");
ABSL_FLAG(bool, require_mlock, false, "Fail at start if the weights cannot be locked (instead of warning).");
ABSL_FLAG(bool, hugepages, false,
          "Copy the weights into huge-page memory: reserved 2 MiB pages if the host has them free, else transparent "
          "huge pages.");
ABSL_FLAG(bool, q8_records, false,
          "int8/int4 models: build the int8 tile kernels' records of every matrix at load (a second copy, ~1.1 bytes "
          "a weight for int8, ~0.63 for int4, locked with the weights), so calls on tiles do not repack the weights, "
          "and take tiles from the "
          "kernel profile's thresholds for records (other row counts than without: the last bits of those rows "
          "differ). Needs AVX512_VNNI and --residency locked or copy (or paged with --hugepages / --numa_node).");
ABSL_FLAG(bool, check_finite, false, "Refuse requests whose rows hold NaN or Inf.");
ABSL_FLAG(int64_t, max_rows, 65536, "Most token rows one Compute call may carry (RESOURCE_EXHAUSTED beyond).");
ABSL_FLAG(int64_t, max_queued_calls, 64, "Compute calls waiting for the compute thread (RESOURCE_EXHAUSTED beyond).");
ABSL_FLAG(int64_t, max_inflight_bytes, 0,
          "Memory budget of the Compute calls in flight (requests, f32 rows, outputs; estimated from each request "
          "on arrival): a call beyond it gets RESOURCE_EXHAUSTED. 0: room for two calls of --max_rows rows, within "
          "what the weights leave of the cgroup's memory limit (less 256 MiB for the process).");
ABSL_FLAG(int64_t, max_message_bytes, 0,
          "Largest request or reply in bytes; 0 derives it from d_model and --max_rows.");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: serve TLS (with --tls_key).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "", "PEM CA: require client certificates signed by it (mutual TLS).");
ABSL_FLAG(std::string, admin_listen, "",
          "host:port of the admin listener (Reload, GetNodeInfo in full), with --listen's TLS settings; keep it on "
          "loopback or a guarded address. Empty (the default): no admin listener.");
ABSL_FLAG(std::vector<std::string>, admin_identities, {},
          "With mutual TLS: certificate identities (subject alternative names or common name) that may make "
          "admin calls on --listen too, comma-separated.");
ABSL_FLAG(int, metrics_port, -1, "Serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a port; -1 off).");
ABSL_FLAG(std::string, metrics_host, "", "IP address the metrics endpoint listens on (default: the host of --listen).");
ABSL_FLAG(int, keepalive_interval_ms, colibri::runtime::kKeepaliveTime.count(),
          "Ping clients (routers) this often, also on idle connections (at least 1000).");
ABSL_FLAG(int, keepalive_timeout_ms, colibri::runtime::kKeepaliveTimeout.count(),
          "Close a client's connection whose ping is not answered within this long: its calls end, and the memory "
          "they hold is freed. At least 1000; below ~5000 an idle router's connection is closed now and then (it "
          "reconnects).");
ABSL_FLAG(int, inject_delay_ms, 0,
          "Fault injection for tests and benchmarks: a Compute call waits this long "
          "before it runs (a slow node); 0: off.");
ABSL_FLAG(bool, merge_calls, true,
          "Run queued Compute calls of one layer (from several routers or clients) as one pass, reading each "
          "expert once; every answer keeps its bits.");
ABSL_FLAG(int, inject_delay_every, 1, "With --inject_delay_ms: delay every Nth Compute call (1: all of them).");
ABSL_FLAG(std::string, log_format, "text",
          "Log lines on stderr: text (glog's: level, time, thread, file:line, message) or json (one object per line).");
ABSL_FLAG(std::string, log_level, "info", "Least severe level logged: info, warning or error.");
ABSL_FLAG(int, drain_seconds, 10, "On SIGTERM, how long in-flight calls may take before they are cancelled.");

namespace {

// The options named in the library's errors, and the flags that set them.
const colibri::runtime::OptionFlags kOptionFlags = {
    {"shard spec", "--experts"},
    {"ServerOptions::limits.max_rows", "--max_rows"},
    {"ServerOptions::max_message_bytes", "--max_message_bytes"},
    {"ServerOptions::max_queued_calls", "--max_queued_calls"},
    {"ServerOptions::keepalive.interval", "--keepalive_interval_ms"},
    {"ServerOptions::keepalive.timeout", "--keepalive_timeout_ms"},
    {"ServerOptions::tls_cert_file", "--tls_cert"},
    {"ServerOptions::tls_key_file", "--tls_key"},
    {"ServerOptions::tls_client_ca_file", "--tls_client_ca"},
    {"ServerOptions::admin_listen", "--admin_listen"},
    {"ServerOptions::admin_identities", "--admin_identities"},
    {"StoreOptions::require_mlock", "--require_mlock"},
    {"StoreOptions::q8_records", "--q8_records"},
    {"StoreOptions::residency", "--residency"},
    {"ServerOptions::memory_budget", "--memory_budget"},
    {"ThreadPool::Options::numa_node", "--numa_node"},
    {"StoreOptions::hugepages", "--hugepages"},
    {"StoreOptions::numa_node", "--numa_node"},
    {"ServerOptions::max_inflight_bytes", "--max_inflight_bytes"},
    {"StoreOptions::memory_limit", "the memory limit"},
};

}  // namespace

int main(int argc, char** argv) {
  colibri::common::TuneAllocatorForServer();
  colibri::runtime::ParseFlags(
      argc, argv,
      "Colibri expert node: owns a shard of a model's experts (mapped, verified, locked, optionally on one NUMA\n"
      "node) and computes them for the router over gRPC (colibri.v1.ExpertNode), with grpc.health.v1 and server\n"
      "reflection. SIGHUP reloads the weights; SIGTERM drains and exits.\n"
      "Example: colibri-expert --model model/ --experts 0-3 --listen 0.0.0.0:50061");
  if (absl::Status s =
          colibri::runtime::InitLogging(argv[0], absl::GetFlag(FLAGS_log_format), absl::GetFlag(FLAGS_log_level));
      !s.ok()) {
    std::cerr << "colibri-expert: " << s.message() << "\n";
    return 2;
  }
  colibri::expert_node::ServerOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  if (options.model_dir.empty()) {
    std::cerr << "colibri-expert: --model is required (see --help)\n";
    return 2;
  }
  auto shard = colibri::expert_node::ShardSpec::Parse(absl::GetFlag(FLAGS_experts));
  if (!shard.ok()) {
    std::cerr << "colibri-expert: " << colibri::runtime::NameFlags(shard.status(), kOptionFlags).message() << "\n";
    return 2;
  }
  options.store.shard = *shard;
  options.store.verify_checksums = absl::GetFlag(FLAGS_verify_checksums);
  options.store.verify_cache = absl::GetFlag(FLAGS_verify_cache);
  options.store.verify_threads =
      absl::GetFlag(FLAGS_threads) > 0 ? absl::GetFlag(FLAGS_threads) : colibri::common::UsableCpus();
  auto residency = colibri::expert_node::ParseResidency(absl::GetFlag(FLAGS_residency));
  if (!residency.ok()) {
    std::cerr << "colibri-expert: " << colibri::runtime::NameFlags(residency.status(), kOptionFlags).message() << "\n";
    return 2;
  }
  options.store.residency = *residency;
  options.memory_budget = absl::GetFlag(FLAGS_memory_budget);
  options.store.require_mlock = absl::GetFlag(FLAGS_require_mlock);
  options.store.hugepages = absl::GetFlag(FLAGS_hugepages);
  options.store.q8_records = absl::GetFlag(FLAGS_q8_records);
  options.store.numa_node = absl::GetFlag(FLAGS_numa_node);
  // Past the cgroup's memory limit the kernel kills the node: loads that
  // would pass it are refused, and the default in-flight budget stays within it.
  if (const colibri::common::CgroupLimits cgroup = colibri::common::ReadCgroupLimits(); cgroup.memory_bytes >= 0) {
    options.store.memory_limit = cgroup.memory_bytes;
    options.store.memory_limit_source = cgroup.memory_file;
    LOG(INFO) << "colibri-expert: memory limit " << cgroup.memory_bytes << " bytes (" << cgroup.memory_file << ")";
  }
  if (absl::GetFlag(FLAGS_numa_node_auto)) {
    if (options.store.numa_node >= 0) {
      std::cerr << "colibri-expert: --numa_node and --numa_node_auto exclude each other\n";
      return 2;
    }
    absl::StatusOr<int> node = colibri::kernels::ThreadPool::NumaNodeOfAllowedCpus();
    if (!node.ok()) {
      std::cerr << "colibri-expert: --numa_node_auto: "
                << colibri::runtime::NameFlags(node.status(), kOptionFlags).message() << "\n";
      return 1;
    }
    options.store.numa_node = *node;
    if (*node < 0) {
      LOG(WARNING) << "colibri-expert: --numa_node_auto: libnuma reports no NUMA support (a kernel without it, or "
                      "get_mempolicy refused: in a container, grant CAP_SYS_NICE): nothing is bound";
    } else {
      LOG(INFO) << "colibri-expert: --numa_node_auto: NUMA node " << *node;
    }
  }
  options.listen = absl::GetFlag(FLAGS_listen);
  options.model_root = absl::GetFlag(FLAGS_model_root);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.check_finite = absl::GetFlag(FLAGS_check_finite);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.limits.max_rows = absl::GetFlag(FLAGS_max_rows);
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  options.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  options.keepalive.interval = std::chrono::milliseconds(absl::GetFlag(FLAGS_keepalive_interval_ms));
  options.keepalive.timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_keepalive_timeout_ms));
  options.admin_listen = absl::GetFlag(FLAGS_admin_listen);
  options.admin_identities = absl::GetFlag(FLAGS_admin_identities);
  options.max_queued_calls = absl::GetFlag(FLAGS_max_queued_calls);
  options.max_inflight_bytes = absl::GetFlag(FLAGS_max_inflight_bytes);
  options.merge_calls = absl::GetFlag(FLAGS_merge_calls);
  options.inject_delay_ms = absl::GetFlag(FLAGS_inject_delay_ms);
  options.inject_delay_every = absl::GetFlag(FLAGS_inject_delay_every);

  // Block the signals we handle before any thread starts, so sigwait sees them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  colibri::runtime::LogLines log;  // the libraries' events, into glog
  auto server = colibri::expert_node::ExpertServer::Create(options, &log);
  if (!server.ok()) {
    LOG(ERROR) << "colibri-expert: " << colibri::runtime::NameFlags(server.status(), kOptionFlags).message();
    return 1;
  }
  std::cout << "colibri-expert: listening on port " << (*server)->port() << std::endl;
  std::cout << "colibri-expert: kernels " << colibri::kernels::DescribeProfile(colibri::kernels::SelectedProfile())
            << std::endl;
  if ((*server)->admin_port() >= 0) {
    std::cout << "colibri-expert: admin on port " << (*server)->admin_port() << std::endl;
  }
  if ((*server)->metrics_port() >= 0) {
    std::cout << "colibri-expert: metrics on port " << (*server)->metrics_port() << std::endl;
  }
  for (;;) {
    int sig = 0;
    sigwait(&signals, &sig);
    if (sig == SIGHUP) {
      const absl::Status s = (*server)->Reload();
      if (s.ok()) {
        LOG(INFO) << "colibri-expert: SIGHUP reload: ok";
      } else {
        LOG(ERROR) << "colibri-expert: SIGHUP reload failed: " << s.message();
      }
      continue;
    }
    LOG(INFO) << "colibri-expert: draining and stopping";
    (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(absl::GetFlag(FLAGS_drain_seconds)));
    return 0;
  }
}
