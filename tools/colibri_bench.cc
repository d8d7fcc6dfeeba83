// colibri-bench: Colibri's benchmarks. `colibri-bench kernels --model DIR`
// times the expert kernels on one layer next to the measured bandwidth;
// `colibri-bench router --model DIR --router HOST:PORT` times a running
// router against the in-process engine.
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/routing.h"
#include "runtime/flags.h"
#include "tools/kernel_bench.h"
#include "tools/load_bench.h"
#include "tools/router_bench.h"

ABSL_FLAG(std::string, model, "", "Model directory (colibri-convert's output). Required.");
ABSL_FLAG(int64_t, layer, 0, "MoE layer to time.");
ABSL_FLAG(std::string, tokens, "1,8,32,128", "Comma-separated token counts T.");
ABSL_FLAG(int, threads, 0, "Compute threads (0: one per allowed CPU).");
ABSL_FLAG(int, warmup, 3, "Untimed calls before each measurement (run: per client).");
ABSL_FLAG(int, repeat, 30, "Timed calls per measurement (median and p99 are over these); run: sequences per client.");
ABSL_FLAG(int64_t, onednn_min_tokens, -1,
          "bf16/f32 experts with at least this many rows use oneDNN; 0 = never; -1 = the machine's kernel profile.");
ABSL_FLAG(int64_t, dequant_min_tokens, -1,
          "int8/int4 experts with at least this many rows dequantize each block once to a bf16 tile; 0 = never; "
          "-1 = the machine's kernel profile.");
ABSL_FLAG(int64_t, amx_min_tokens, -1,
          "bf16 experts with at least this many rows run on AMX tiles (where the CPU has them); 0 = never; "
          "-1 = the machine's kernel profile.");
ABSL_FLAG(bool, hugepages, true,
          "Copy the weights into huge-page memory, reserved 2 MiB pages if free, else transparent huge pages (as the "
          "bandwidth probe reads).");
ABSL_FLAG(bool, q8_records, false,
          "kernels, int8/int4 models: build each matrix's int8 tile records once, beside the weights (a second "
          "copy), so the tile kernels read them instead of repacking per call. router: the same for the "
          "in-process engine (to compare with nodes started with --q8_records).");
ABSL_FLAG(bool, single_expert, true, "Also time expert 0 alone.");
ABSL_FLAG(std::string, router, "", "router, run: host:port of the router to time.");
ABSL_FLAG(int, router_pid, 0, "router: the router's pid, to report its CPU time per call (0: not reported).");
ABSL_FLAG(std::string, direct_nodes, "",
          "router: also time the calls through a proxyless client calling these nodes (host:port,...) directly.");
ABSL_FLAG(int64_t, node_stream_max_bytes, 0,
          "router: the proxyless client's --node_stream_max_bytes (> 0: node calls up to this size on one open "
          "stream per node; 0: every call on its own).");
ABSL_FLAG(bool, bf16, false, "router: send hidden states and ask for the output in bf16 (else f32).");
ABSL_FLAG(bool, stream, false,
          "router: send the router's calls over one ForwardStream (as a decoding loop's session does) instead of "
          "unary Forward calls.");
ABSL_FLAG(int64_t, gap_us, 2000, "router: pause before each call, both paths (idle threads sleep, as between layers).");
ABSL_FLAG(std::string, routing, "lut", "router, run: routing mode of the calls, lut or gate.");
ABSL_FLAG(std::string, local, "", "run: drive the in-process engine on this model directory instead of --router.");
ABSL_FLAG(int64_t, batch_size, 1, "run: tokens per Forward call.");
ABSL_FLAG(
    int64_t, batch_window_us, 0,
    "run --local: merge the streams' concurrent calls of a layer in the engine, as colibri-router's flag (0: off).");
ABSL_FLAG(int64_t, seq_len, 16, "run: decoding steps per sequence (each step calls every layer).");
ABSL_FLAG(int64_t, layers, 0, "run: MoE layers per step (0: all of the model's).");
ABSL_FLAG(int, concurrency, 1, "run: client threads, each with its own stream.");
ABSL_FLAG(double, duration, 0, "run: seconds to run (0: --repeat sequences per client instead).");
ABSL_FLAG(bool, unary, false, "run: unary Forward calls instead of one ForwardStream per client.");
ABSL_FLAG(int, deadline_ms, 0,
          "run: unary calls with this deadline; calls that miss it are counted as abandoned, "
          "not failed (a client that gives up).");
ABSL_FLAG(std::string, trace, "", "run: write a Chrome trace (chrome://tracing, Perfetto) of the calls to this file.");
ABSL_FLAG(int64_t, trace_calls, 2000, "run: most calls written to --trace.");
ABSL_FLAG(int64_t, check, 0,
          "run: afterwards, compare this many tokens per layer with the reference MoE layer "
          "(needs --model for a router); exit 1 if outside the weight type's tolerance.");
ABSL_FLAG(bool, progress, true, "run: a progress line on stderr for runs of 2 s or more.");
ABSL_FLAG(double, zipf, 0,
          "run: > 0: the calls carry their own routes (client routing), experts drawn with probability "
          "proportional to 1/(e+1)^zipf (1.2 on 8 experts, top-2: expert 0 in ~35% of the slots).");
ABSL_FLAG(uint64_t, seed, 1, "run: seed of the token ids and hidden states.");
ABSL_FLAG(bool, json, false, "One JSON object per result instead of the table.");

namespace {

// --routing, if it is a mode the benchmarks run (lut or gate).
std::optional<colibri::common::RoutingMode> BenchRouting() {
  auto mode = colibri::common::ParseRoutingMode(absl::GetFlag(FLAGS_routing));
  if (!mode.ok() || *mode == colibri::common::RoutingMode::kClient) return std::nullopt;
  return *mode;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args = colibri::runtime::ParseFlags(
      argc, argv,
      "Colibri benchmarks. Subcommands:\n"
      "  kernels  time the expert executor on one layer (one expert alone, then the full layer with real\n"
      "           top-k routes) at each --tokens, next to this machine's read bandwidth measured in the\n"
      "           same run. Example: colibri-bench kernels --model model/ --tokens 1,8,32,128\n"
      "  router   the same Forward calls through a running router and through the in-process engine on\n"
      "           --model, interleaved: p50/p99 of both, the added latency, the router's own stage times\n"
      "           and CPU, and whether the outputs are identical.\n"
      "           Example: colibri-bench router --model model/ --router 127.0.0.1:50051 --tokens 1,8,128\n"
      "  run      drive a router (--router) or the in-process engine (--local) with a decoding workload:\n"
      "           throughput, latency percentiles, per-stage times, expert load, --trace, --json, --check.\n"
      "           Example: colibri-bench run --router 127.0.0.1:50051 --concurrency 2 --duration 10 --trace t.json");
  const std::string command = args.size() == 2 ? args[1] : "";
  if (command != "kernels" && command != "router" && command != "run") {
    std::cerr << "colibri-bench: expected the subcommand 'kernels', 'router' or 'run' (see --help)\n";
    return 2;
  }
  if (command == "run") {
    colibri::tools::LoadBenchOptions r;
    r.router = absl::GetFlag(FLAGS_router);
    r.local_model = absl::GetFlag(FLAGS_local);
    r.model_dir = absl::GetFlag(FLAGS_model);
    r.local_threads = absl::GetFlag(FLAGS_threads);
    r.local_batch_window_us = absl::GetFlag(FLAGS_batch_window_us);
    r.batch_size = absl::GetFlag(FLAGS_batch_size);
    r.seq_len = absl::GetFlag(FLAGS_seq_len);
    r.layers = absl::GetFlag(FLAGS_layers);
    r.concurrency = absl::GetFlag(FLAGS_concurrency);
    r.warmup = absl::GetFlag(FLAGS_warmup);
    r.repeat = std::max(1, absl::GetFlag(FLAGS_repeat));
    r.duration_seconds = absl::GetFlag(FLAGS_duration);
    r.unary = absl::GetFlag(FLAGS_unary);
    r.deadline_ms = absl::GetFlag(FLAGS_deadline_ms);
    r.seed = absl::GetFlag(FLAGS_seed);
    r.zipf = absl::GetFlag(FLAGS_zipf);
    r.trace_path = absl::GetFlag(FLAGS_trace);
    r.trace_calls = absl::GetFlag(FLAGS_trace_calls);
    r.json = absl::GetFlag(FLAGS_json);
    r.check_tokens = absl::GetFlag(FLAGS_check);
    r.progress = absl::GetFlag(FLAGS_progress);
    const std::optional<colibri::common::RoutingMode> routing = BenchRouting();
    if (!routing.has_value()) {
      std::cerr << "colibri-bench: --routing must be lut or gate\n";
      return 2;
    }
    r.routing = *routing;
    const absl::Status status = colibri::tools::RunLoadBench(r, std::cout);
    if (!status.ok()) {
      std::cerr << "colibri-bench: " << status.message() << "\n";
      return 1;
    }
    return 0;
  }
  colibri::tools::KernelBenchOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  if (options.model_dir.empty()) {
    std::cerr << "colibri-bench: --model is required\n";
    return 2;
  }
  options.tokens.clear();
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_tokens), ',')) {
    int64_t t = 0;
    if (!absl::SimpleAtoi(part, &t) || t < 1) {
      std::cerr << "colibri-bench: --tokens: '" << part << "' is not a positive integer\n";
      return 2;
    }
    options.tokens.push_back(t);
  }
  if (command == "router") {
    colibri::tools::RouterBenchOptions r;
    r.model_dir = options.model_dir;
    r.router = absl::GetFlag(FLAGS_router);
    r.router_pid = absl::GetFlag(FLAGS_router_pid);
    r.layer = static_cast<int32_t>(absl::GetFlag(FLAGS_layer));
    r.tokens = options.tokens;
    r.local_threads = absl::GetFlag(FLAGS_threads);
    r.warmup = absl::GetFlag(FLAGS_warmup);
    r.repeat = std::max(1, absl::GetFlag(FLAGS_repeat));
    r.bf16 = absl::GetFlag(FLAGS_bf16);
    for (absl::string_view node : absl::StrSplit(absl::GetFlag(FLAGS_direct_nodes), ',', absl::SkipEmpty())) {
      r.direct_nodes.emplace_back(node);
    }
    r.gap_us = std::max<int64_t>(0, absl::GetFlag(FLAGS_gap_us));
    r.stream = absl::GetFlag(FLAGS_stream);
    r.q8_records = absl::GetFlag(FLAGS_q8_records);
    r.node_stream_max_bytes = absl::GetFlag(FLAGS_node_stream_max_bytes);
    const std::optional<colibri::common::RoutingMode> routing = BenchRouting();
    if (r.router.empty() || !routing.has_value()) {
      std::cerr << "colibri-bench: router needs --router HOST:PORT and --routing lut|gate\n";
      return 2;
    }
    r.routing = *routing;
    const absl::Status status = colibri::tools::RunRouterBench(r, std::cout);
    if (!status.ok()) {
      std::cerr << "colibri-bench: " << status.message() << "\n";
      return 1;
    }
    return 0;
  }
  options.layer = absl::GetFlag(FLAGS_layer);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.warmup = absl::GetFlag(FLAGS_warmup);
  options.repeat = std::max(1, absl::GetFlag(FLAGS_repeat));
  options.onednn_min_tokens = absl::GetFlag(FLAGS_onednn_min_tokens);
  options.dequant_min_tokens = absl::GetFlag(FLAGS_dequant_min_tokens);
  options.amx_min_tokens = absl::GetFlag(FLAGS_amx_min_tokens);
  options.hugepages = absl::GetFlag(FLAGS_hugepages);
  options.q8_records = absl::GetFlag(FLAGS_q8_records);
  options.single_expert = absl::GetFlag(FLAGS_single_expert);
  options.json = absl::GetFlag(FLAGS_json);
  const absl::Status status = colibri::tools::RunKernelBench(options, std::cout);
  if (!status.ok()) {
    std::cerr << "colibri-bench: " << status.message() << "\n";
    return 1;
  }
  return 0;
}
