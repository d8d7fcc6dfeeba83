#ifndef COLIBRI_TOOLS_LOAD_BENCH_H_
#define COLIBRI_TOOLS_LOAD_BENCH_H_

// `colibri-bench run`: drives a router (or the in-process engine) with a
// decoding workload and reports what its users see.
//
// Workload: --concurrency clients, each running sequences of --seq_len
// steps; a step sends --batch_size tokens through --layers MoE layers, one
// Forward per layer, adding each output to the hidden state (the residual
// connection). Clients use one ForwardStream each (or unary calls). Reports
// throughput (tokens through all layers per second, and layer calls per
// second), per-call latency p50/p90/p99/max, per-stage p50 (route, dispatch,
// slowest node call and its compute, aggregate), the load on every expert,
// optionally a Chrome trace and a JSON summary, and optionally checks sample
// outputs against the reference MoE layer. No assertion, except --check.

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "common/routing.h"

namespace colibri {
namespace tools {

struct LoadBenchOptions {
  std::string router;                 // host:port, or
  std::string local_model;            // a model directory run in-process (colibri::Engine)
  std::string model_dir;              // for --check (the router's model); defaults to local_model
  int local_threads = 0;              // engine threads
  int64_t local_batch_window_us = 0;  // the engine's batch window (0: no merging)
  int64_t batch_size = 1;
  int64_t seq_len = 16;
  int64_t layers = 0;                                       // 0: all
  common::RoutingMode routing = common::RoutingMode::kLut;  // lut or gate
  int concurrency = 1;
  int warmup = 2;               // calls per client not measured
  int64_t repeat = 1;           // sequences per client (when duration == 0)
  double duration_seconds = 0;  // > 0: run for this long instead
  bool unary = false;           // unary calls instead of one stream per client
  // > 0: unary calls with this deadline, as a client that gives up would make
  // them; calls that end DEADLINE_EXCEEDED or CANCELLED are counted as
  // abandoned (not failures) and the run goes on.
  int deadline_ms = 0;
  std::string trace_path;  // Chrome trace JSON (at most trace_calls calls)
  int64_t trace_calls = 2000;
  bool json = false;         // print one JSON object instead of the tables
  int64_t check_tokens = 0;  // > 0: compare this many tokens per layer with the reference layer
  bool progress = true;      // a progress line on stderr for runs over 2 s
  uint64_t seed = 1;
  // > 0: the calls carry their own routes (client routing), each token's
  // top_k distinct experts drawn with probability proportional to
  // 1 / (e + 1)^zipf, weight 1/top_k each: a skewed load under control
  // (zipf 1.2 on 8 experts, top-2: expert 0 in about 35% of the slots).
  double zipf = 0;
};

// UNAVAILABLE if the router cannot be reached; FAILED_PRECONDITION if
// --check finds an output outside the weight type's tolerance; a request's
// error otherwise (the run stops at the first failed call).
absl::Status RunLoadBench(const LoadBenchOptions& options, std::ostream& out);

}  // namespace tools
}  // namespace colibri

#endif  // COLIBRI_TOOLS_LOAD_BENCH_H_
