#include "tools/kernel_bench.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/model_dir.h"
#include "common/routing.h"
#include "common/status_macros.h"
#include "kernels/bandwidth.h"
#include "kernels/dispatch.h"
#include "kernels/expert_executor.h"
#include "kernels/kernel_profile.h"
#include "kernels/thread_pool.h"

namespace colibri {
namespace tools {
namespace {

size_t MatrixBytes(const common::MatrixView& m) {
  return m.layout.data_bytes + m.layout.scale_bytes + m.layout.zero_bytes;
}

size_t ExpertBytes(const common::ExpertWeights& e) { return MatrixBytes(e.w1) + MatrixBytes(e.w3) + MatrixBytes(e.w2); }

// Multiply-adds x 2 of one row through the expert's three matrices.
double FfnFlops(const common::ExpertWeights& e) { return 2.0 * 3.0 * e.w1.layout.rows * e.w1.layout.cols; }

struct Timing {
  double median_ms = 0, p99_ms = 0, max_ms = 0;
  // With a probe: the time to read `bytes` at the bandwidth of the probe
  // pass just before each call (median), and the median of call / that.
  double floor_ms = 0, x_floor = 0;
};

// The middle value, or the mean of the two middle ones (as Python's
// statistics.median, which the PyTorch baseline uses).
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Times `repeat` calls of fn after `warmup`. With `probe`, a bandwidth pass
// precedes every timed call (it also leaves the caches cold, as the other
// layers of a real step would).
Timing Time(const std::function<void()>& fn, int warmup, int repeat, kernels::ReadProbe* probe = nullptr,
            size_t bytes = 0) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms, floors, ratios;
  for (int i = 0; i < repeat; ++i) {
    if (probe != nullptr) floors.push_back(bytes / (probe->Pass() * 1e9) * 1e3);
    const auto start = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    if (probe != nullptr) ratios.push_back(ms.back() / floors.back());
  }
  Timing t;
  if (probe != nullptr) {
    t.floor_ms = Median(floors);
    t.x_floor = Median(ratios);
  }
  t.median_ms = Median(ms);
  std::sort(ms.begin(), ms.end());
  t.p99_ms = ms[std::min(ms.size() - 1, static_cast<size_t>(std::ceil(0.99 * ms.size())) - 1)];
  t.max_ms = ms.back();
  return t;
}

}  // namespace

absl::Status RunKernelBench(const KernelBenchOptions& o, std::ostream& out) {
  COLIBRI_ASSIGN_OR_RETURN(auto model, common::ModelDir::Open(o.model_dir));
  const common::Manifest& m = model->manifest();
  COLIBRI_ASSIGN_OR_RETURN(auto routing, model->LoadRouting(o.layer, false));
  std::vector<std::unique_ptr<common::ExpertWeights>> experts;
  for (int64_t e = 0; e < m.total_experts(); ++e) {  // shared experts too: every token runs them
    COLIBRI_ASSIGN_OR_RETURN(auto w, model->LoadExpert(o.layer, e, false));
    if (o.hugepages) COLIBRI_RETURN_IF_ERROR(common::CopyExpertToMemory(w.get(), {}));
    if (o.q8_records) {
      if (absl::Status s = kernels::AttachQ8Records(w.get(), kernels::SelectedKernels(), {}); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("--q8_records: ", s.message()));
      }
    }
    experts.push_back(std::move(w));
  }
  COLIBRI_ASSIGN_OR_RETURN(auto pool, kernels::ThreadPool::Create({o.threads, -1, true}));
  const kernels::KernelTable& table = kernels::SelectedKernels();
  kernels::Workspace workspace;
  kernels::ExecutorOptions exec;
  exec.onednn_min_tokens = o.onednn_min_tokens;
  if (o.dequant_min_tokens >= 0) {
    exec.int8_tile_min_tokens = o.dequant_min_tokens;
    exec.int4_tile_min_tokens = o.dequant_min_tokens;
  }
  exec.bf16_tile_min_tokens = o.amx_min_tokens;
  const kernels::BandwidthResult before = kernels::MeasureReadBandwidth(*pool);
  if (before.best_gbps <= 0) return absl::ResourceExhaustedError("cannot map 1 GiB for the bandwidth probe");
  const std::unique_ptr<kernels::ReadProbe> probe = kernels::ReadProbe::Create(*pool, size_t{512} << 20);
  if (probe == nullptr) return absl::ResourceExhaustedError("cannot map 512 MiB for the interleaved bandwidth probe");
  out << absl::StrFormat("# model %s layer %d: %s, %d experts, top-%d, d_model %d, d_ff %d%s, %s weights%s\n",
                         o.model_dir, o.layer, m.architecture, m.n_experts, m.top_k, m.d_model, m.d_ff,
                         m.n_shared_experts > 0
                             ? absl::StrFormat(", %d shared expert(s) of d_ff %d", m.n_shared_experts, m.shared_d_ff)
                             : "",
                         common::DTypeName(m.weight_type), o.hugepages ? " (copied to huge pages)" : " (mapped file)");
  if (o.q8_records) out << "# int8 tile records built once for every matrix (--q8_records): no repacking per call\n";
  const kernels::KernelProfile& profile = kernels::SelectedProfile();
  out << absl::StrFormat("# %d threads; kernels %s\n", pool->size(), kernels::DescribeProfile(profile));
  if (o.onednn_min_tokens >= 0 || o.dequant_min_tokens >= 0 || o.amx_min_tokens >= 0) {
    out << absl::StrFormat(
        "# overridden here: oneDNN from %d rows, AMX tiles from %d rows (bf16), tiles from %d rows (int8) / %d "
        "(int4); 0 = never\n",
        kernels::OnednnMinTokens(exec, table), kernels::TileMinTokens(exec, table, common::DType::kBF16, false),
        kernels::TileMinTokens(exec, table, common::DType::kInt8, o.q8_records),
        kernels::TileMinTokens(exec, table, common::DType::kInt4, o.q8_records));
  }
  out << absl::StrFormat("# why (cpu %s):\n", kernels::CpuSignature());
  for (const std::string& line : profile.evidence) out << "#   " << line << "\n";
  out << absl::StrFormat("# read bandwidth before: best %.1f GB/s, median %.1f GB/s\n", before.best_gbps,
                         before.median_gbps);
  if (!o.json) {
    out << absl::StrFormat("%-8s %-6s %-7s %5s %10s %10s %7s %8s %8s %9s %9s %9s %8s\n", "impl", "dtype", "case", "T",
                           "median_ms", "p99_ms", "p99/p50", "GB/s", "frac_bw", "GFLOP/s", "MB_read", "floor_ms",
                           "x_floor");
  }
  // floor_ms / x_floor: the time to read the expert's (layer case: the
  // touched experts') bytes at the bandwidth of a probe pass run just before each call — the
  // memory-bound limit of a decode step at that moment — and the median of
  // call time / that floor.
  auto report = [&](const char* label, int64_t tokens, const Timing& t, size_t bytes, double flops) {
    const double gbps = bytes / (t.median_ms * 1e-3) / 1e9;
    const double gflops = flops / (t.median_ms * 1e-3) / 1e9;
    if (o.json) {
      out << absl::StrFormat(
          "{\"impl\":\"colibri-%s\",\"dtype\":\"%s\",\"case\":\"%s\",\"T\":%d,\"median_ms\":%.4f,\"p99_ms\":%.4f,"
          "\"max_ms\":%.4f,\"gbps\":%.2f,\"frac_bw\":%.3f,\"gflops\":%.1f,\"bw_gbps\":%.2f,\"mb_read\":%.1f,"
          "\"floor_ms\":%.4f,\"x_floor\":%.3f}\n",
          kernels::IsaName(table.isa), common::DTypeName(m.weight_type), label, tokens, t.median_ms, t.p99_ms, t.max_ms,
          gbps, gbps / before.best_gbps, gflops, before.best_gbps, bytes / 1e6, t.floor_ms, t.x_floor);
    } else {
      out << absl::StrFormat("%-8s %-6s %-7s %5d %10.3f %10.3f %7.2f %8.1f %8.3f %9.1f %9.1f %9s %8s\n", "colibri",
                             common::DTypeName(m.weight_type), label, tokens, t.median_ms, t.p99_ms,
                             t.p99_ms / t.median_ms, gbps, gbps / before.best_gbps, gflops, bytes / 1e6,
                             t.floor_ms > 0 ? absl::StrFormat("%.3f", t.floor_ms) : "-",
                             t.x_floor > 0 ? absl::StrFormat("%.3f", t.x_floor) : "-");
    }
    out.flush();
  };

  for (int64_t tokens : o.tokens) {
    std::mt19937 rng(o.seed + tokens);
    std::normal_distribution<float> normal;
    std::vector<float> x(tokens * m.d_model), dst(tokens * m.d_model);
    for (float& v : x) v = normal(rng);
    if (o.single_expert) {
      std::vector<int32_t> rows(tokens);
      std::vector<float> ones(tokens, 1.0f);
      for (int64_t t = 0; t < tokens; ++t) rows[t] = static_cast<int32_t>(t);
      const kernels::ExpertTask task{experts[0].get(), rows.data(), ones.data(), tokens};
      // A probe pass before each call, as for the layer: re-read back to
      // back, an expert smaller than the last-level cache would come from it.
      const Timing t =
          Time([&] { kernels::RunExperts(*pool, {task}, x.data(), m.d_model, dst.data(), workspace, exec); }, o.warmup,
               o.repeat, probe.get(), ExpertBytes(*experts[0]));
      report("expert", tokens, t, ExpertBytes(*experts[0]), FfnFlops(*experts[0]) * tokens);
    }
    // The full layer with the gate's real top-k routes and the shared
    // experts, one task per expert run.
    const common::Routes routes =
        common::AppendSharedExperts(common::RouteByGateSpec(m.routing, routing->gate, routing->bias, m.n_experts,
                                                            m.d_model, m.top_k, m.norm_topk_prob, x.data(), tokens),
                                    m.n_experts, m.n_shared_experts, routing->shared_gate, m.d_model, x.data());
    std::vector<const common::ExpertWeights*> all;
    for (const auto& e : experts) all.push_back(e.get());
    const kernels::GroupedRoutes grouped = kernels::GroupByExpert(routes, all);
    size_t bytes = 0;
    double flops = 0;
    for (const kernels::ExpertTask& task : grouped.tasks) {
      bytes += ExpertBytes(*task.expert);
      flops += FfnFlops(*task.expert) * task.num_rows;
    }
    const Timing t =
        Time([&] { kernels::RunExperts(*pool, grouped.tasks, x.data(), m.d_model, dst.data(), workspace, exec); },
             o.warmup, o.repeat, probe.get(), bytes);
    report("layer", tokens, t, bytes, flops);
  }
  const kernels::BandwidthResult after = kernels::MeasureReadBandwidth(*pool);
  out << absl::StrFormat("# read bandwidth after: best %.1f GB/s, median %.1f GB/s (frac_bw uses 'before')\n",
                         after.best_gbps, after.median_gbps);
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace colibri
