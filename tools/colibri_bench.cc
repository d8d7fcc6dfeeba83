// colibri-bench: Colibri's benchmarks. `colibri-bench kernels --model DIR`
// times the expert kernels on one layer next to the measured bandwidth;
// `colibri-bench router --model DIR --router HOST:PORT` times a running
// router against the in-process engine.
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/flags.h"
#include "tools/kernel_bench.h"
#include "tools/router_bench.h"

ABSL_FLAG(std::string, model, "", "Model directory (colibri-convert's output). Required.");
ABSL_FLAG(int64_t, layer, 0, "MoE layer to time.");
ABSL_FLAG(std::string, tokens, "1,8,32,128", "Comma-separated token counts T.");
ABSL_FLAG(int, threads, 0, "Compute threads (0: one per allowed CPU).");
ABSL_FLAG(int, warmup, 3, "Untimed calls before each measurement.");
ABSL_FLAG(int, repeat, 30, "Timed calls per measurement (median and p99 are over these).");
ABSL_FLAG(int64_t, onednn_min_tokens, 0, "bf16/f32 experts with at least this many rows use oneDNN; 0 = never.");
ABSL_FLAG(int64_t, dequant_min_tokens, -1,
          "int8/int4 experts with at least this many rows dequantize each block once to a bf16 tile; 0 = never; "
          "-1 = the executor's per-type defaults.");
ABSL_FLAG(bool, hugepages, true, "Copy the weights into MADV_HUGEPAGE memory (as the bandwidth probe reads).");
ABSL_FLAG(bool, single_expert, true, "Also time expert 0 alone.");
ABSL_FLAG(std::string, router, "", "router: host:port of the router to time.");
ABSL_FLAG(int, router_pid, 0, "router: the router's pid, to report its CPU time per call (0: not reported).");
ABSL_FLAG(std::string, routing, "lut", "router: routing mode of the calls, lut or gate.");
ABSL_FLAG(bool, json, false, "One JSON object per result instead of the table.");

int main(int argc, char** argv) {
  std::vector<char*> args = colibri::common::ParseFlags(argc, argv,
      "Colibri benchmarks. Subcommands:\n"
      "  kernels  time the expert executor on one layer (one expert alone, then the full layer with real\n"
      "           top-k routes) at each --tokens, next to this machine's read bandwidth measured in the\n"
      "           same run. Example: colibri-bench kernels --model model/ --tokens 1,8,32,128\n"
      "  router   the same Forward calls through a running router and through the in-process engine on\n"
      "           --model, interleaved: p50/p99 of both, the added latency, the router's own stage times\n"
      "           and CPU, and whether the outputs are identical.\n"
      "           Example: colibri-bench router --model model/ --router 127.0.0.1:50051 --tokens 1,8,128");
  const std::string command = args.size() == 2 ? args[1] : "";
  if (command != "kernels" && command != "router") {
    std::cerr << "colibri-bench: expected the subcommand 'kernels' or 'router' (see --help)\n";
    return 2;
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
    r.routing = absl::GetFlag(FLAGS_routing);
    r.local_threads = absl::GetFlag(FLAGS_threads);
    r.warmup = absl::GetFlag(FLAGS_warmup);
    r.repeat = std::max(1, absl::GetFlag(FLAGS_repeat));
    if (r.router.empty() || (r.routing != "lut" && r.routing != "gate")) {
      std::cerr << "colibri-bench: router needs --router HOST:PORT and --routing lut|gate\n";
      return 2;
    }
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
  options.hugepages = absl::GetFlag(FLAGS_hugepages);
  options.single_expert = absl::GetFlag(FLAGS_single_expert);
  options.json = absl::GetFlag(FLAGS_json);
  const absl::Status status = colibri::tools::RunKernelBench(options, std::cout);
  if (!status.ok()) {
    std::cerr << "colibri-bench: " << status.message() << "\n";
    return 1;
  }
  return 0;
}
