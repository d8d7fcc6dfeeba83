#ifndef COLIBRI_TOOLS_ROUTER_BENCH_H_
#define COLIBRI_TOOLS_ROUTER_BENCH_H_

// `colibri-bench router`: the same Forward calls through a running router
// (gRPC: client -> router -> expert nodes) and through the in-process engine
// (colibri::Engine on the same model, in this process), interleaved per token
// count in the same run. Prints p50/p99 of both, the added latency, the
// router's own stage times (route, aggregate, dispatch minus the slowest
// node), the router process's CPU time per call (from /proc, when its pid is
// given), the bytes of the node calls against the minimum (each node's rows
// once in the hidden dtype, and back once in the output dtype) and whether
// the two outputs are byte-identical. The floor printed beside it, an empty
// gRPC round trip, is measured twice: back to back, and after the same pause
// as the Forward calls (threads asleep, as they are for those). No assertion.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/routing.h"

namespace colibri {
namespace tools {

struct RouterBenchOptions {
  std::string model_dir;  // the model the router serves (also opened locally)
  std::string router;     // host:port of the router
  int router_pid = 0;     // > 0: read its CPU time from /proc/<pid>/stat
  int32_t layer = 0;
  std::vector<int64_t> tokens = {1, 8, 128};
  common::RoutingMode routing = common::RoutingMode::kLut;  // lut or gate
  int local_threads = 0;  // in-process engine threads; 0: one per CPU; < 0: skip the engine
  int warmup = 3;
  int repeat = 30;
  // Also time the same calls through a proxyless client (clients/cpp, the
  // router's core in this process) calling these nodes directly.
  std::vector<std::string> direct_nodes;
  bool bf16 = false;      // hidden states and output in bf16 (else f32)
  int64_t gap_us = 2000;  // pause before each call (both paths)
  // The router's calls over one ForwardStream (a decoding loop's session)
  // instead of unary Forward calls.
  bool stream = false;
  // The engine builds int8 tile records (Engine::Options::q8_records, its
  // weights locked for them, as the nodes' are), to compare with nodes
  // started with --q8_records.
  bool q8_records = false;
  int64_t node_stream_max_bytes = 0;  // the proxyless client's (ClientOptions::Direct)
  uint64_t seed = 1;
};

absl::Status RunRouterBench(const RouterBenchOptions& options, std::ostream& out);

}  // namespace tools
}  // namespace colibri

#endif  // COLIBRI_TOOLS_ROUTER_BENCH_H_
