// The expert executor (block kernels or oneDNN, thread pool, SwiGLU fusion,
// weighted accumulation) against the scalar reference MoE layer. Runs under
// the default ISA and, as separate ctest entries, under COLIBRI_MAX_ISA=avx2
// and =scalar.

#include "kernels/expert_executor.h"

#include <sched.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "common/model_dir.h"
#include "kernels/reference_moe.h"
#include "kernels/tile_bf16_amx.h"
#include "kernels/tile_q8_amx.h"
#include "tests/kernels/amx_emulator.h"
#include "tests/test_util.h"
#include "tools/convert.h"

namespace colibri {
namespace kernels {
namespace {

using colibri::testing::TempDir;
using common::DType;

// Relative L2 error of the layer output against the double-precision
// reference, by what the kernels multiply. Every kernel multiplies the exact
// stored weights; bf16 weights multiply the bf16-rounded activations (and
// h), and so do int8/int4 weights when they are dequantized to bf16 tiles
// (rounding the weights too); the VNNI int4 and int8 kernels and int8 tiles
// multiply activations quantized to int8 per 64-input group (x and h: ~1.3%
// here).
double Tolerance(common::DType type, int64_t rows, const ExecutorOptions& options) {
  constexpr double kExact = 2e-5, kBf16 = 1e-2, kInt8Activations = 2e-2;
  switch (type) {
    case DType::kBF16: return kBf16;
    case DType::kInt8:
    case DType::kInt4: {  // (an expert may get fewer rows than the call: the int8 kernel may be in play)
      if (ReadsQ8(SelectedKernels().For(type)) || SelectedKernels().TileFor(type) != nullptr) return kInt8Activations;
      const int64_t tile_min = TileMinTokens(options, SelectedKernels(), type, false);
      return tile_min > 0 && rows >= tile_min ? kBf16 : kExact;
    }
    default: return kExact;
  }
}

struct Layer {
  std::unique_ptr<common::ModelDir> model;
  std::vector<std::unique_ptr<common::ExpertWeights>> experts;
  std::unique_ptr<common::LayerRouting> routing;
};

Layer LoadLayer(const std::string& dir) {
  Layer l;
  auto model = common::ModelDir::Open(dir);
  REQUIRE(model.ok());
  l.model = std::move(model).value();
  for (int64_t e = 0; e < l.model->manifest().total_experts(); ++e) {  // shared experts too
    auto w = l.model->LoadExpert(0, e, false);
    REQUIRE(w.ok());
    l.experts.push_back(std::move(w).value());
  }
  auto routing = l.model->LoadRouting(0, false);
  REQUIRE(routing.ok());
  l.routing = std::move(routing).value();
  return l;
}

// Layer 0 of a model and 9 rows of x = cos(0.3 i) with their gate routes, as
// RunExperts tasks (held by pointer: the tasks point into the struct).
struct GateCall {
  Layer layer;
  std::vector<const common::ExpertWeights*> experts;
  int64_t d_model = 0;
  std::vector<float> x;
  GroupedRoutes tasks;
};

std::unique_ptr<GateCall> LoadGateCall(const std::string& dir) {
  auto c = std::make_unique<GateCall>();
  c->layer = LoadLayer(dir);
  for (const auto& e : c->layer.experts) c->experts.push_back(e.get());
  const common::Manifest& m = c->layer.model->manifest();
  constexpr int64_t kTokens = 9;
  c->d_model = m.d_model;
  c->x.resize(kTokens * m.d_model);
  for (size_t i = 0; i < c->x.size(); ++i) c->x[i] = std::cos(0.3 * static_cast<double>(i));
  const common::Routes routes =
      common::RouteByGate(c->layer.routing->gate, m.n_experts, m.d_model, m.top_k, true, c->x.data(), kTokens);
  c->tasks = GroupByExpert(routes, c->experts);
  return c;
}

double RelativeL2(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  REQUIRE(norm > 0);
  return std::sqrt(diff / norm);
}

// A one-layer checkpoint whose widths pad (d_model 200 to 256, d_ff 300 to
// 320), top-2 of n_experts, written to `dir`.
tools::SynthOptions WriteOddShapedCheckpoint(const std::string& dir, int64_t n_experts) {
  tools::SynthOptions synth = colibri::testing::SmallSynth(dir);
  synth.d_model = 200;
  synth.d_ff = 300;
  synth.n_layers = 1;
  synth.n_experts = n_experts;
  synth.top_k = 2;
  std::ostringstream log;
  REQUIRE(tools::WriteSyntheticCheckpoint(synth, log).ok());
  return synth;
}

// The checkpoint converted to `type` in `out_dir`; returns out_dir.
std::string ConvertTo(const tools::SynthOptions& synth, const std::string& out_dir, DType type) {
  tools::ConvertOptions convert;
  convert.checkpoint_dir = synth.out_dir;
  convert.out_dir = out_dir;
  convert.weight_type = type;
  convert.progress = false;
  std::ostringstream log;
  REQUIRE(tools::ConvertCheckpoint(convert, log).ok());
  return out_dir;
}

TEST_CASE("the expert executor matches the reference layer for every weight type and token count") {
  TempDir dir;
  const tools::SynthOptions synth = WriteOddShapedCheckpoint(dir / "ckpt", 6);
  auto pool1 = ThreadPool::Create({1, -1, false});
  auto pool2 = ThreadPool::Create({2, -1, true});
  auto pool3 = ThreadPool::Create({3, -1, false, /*caller_joins=*/true});  // as an expert node runs it
  REQUIRE(pool1.ok());
  REQUIRE(pool2.ok());
  REQUIRE(pool3.ok());
  INFO("kernels: " << IsaName(SelectedKernels().isa));
  for (DType type : {DType::kF32, DType::kBF16, DType::kF16, DType::kInt8, DType::kInt4}) {
    const Layer layer = LoadLayer(ConvertTo(synth, dir / common::DTypeName(type), type));
    std::vector<const common::ExpertWeights*> experts;
    for (const auto& e : layer.experts) experts.push_back(e.get());
    for (int64_t tokens : {1, 3, 17, 129}) {
      std::mt19937 rng(tokens);
      std::normal_distribution<float> normal;
      std::vector<float> x(tokens * synth.d_model);
      for (float& v : x) v = normal(rng);
      const common::Routes routes =
          common::RouteByGate(layer.routing->gate, synth.n_experts, synth.d_model, synth.top_k, true, x.data(), tokens);
      std::vector<float> expected(x.size());
      ReferenceMoeLayer(experts, routes, x.data(), synth.d_model, expected.data());
      const GroupedRoutes tasks = GroupByExpert(routes, experts);
      for (int64_t fast_min : {int64_t{0}, int64_t{16}}) {
        ExecutorOptions options;  // fast paths off, or on from 16 rows (oneDNN or dequantized tiles)
        options.onednn_min_tokens = fast_min;
        options.int8_tile_min_tokens = fast_min;
        options.int4_tile_min_tokens = fast_min;
        const bool fast = fast_min > 0 && tokens >= fast_min;
        const double tolerance = Tolerance(type, tokens, options);
        std::vector<float> y1(x.size(), 0.f), y2(x.size(), 0.f), y3(x.size(), 0.f), again(x.size(), 0.f);
        Workspace ws;
        RunExperts(**pool1, tasks.tasks, x.data(), synth.d_model, y1.data(), ws, options);
        RunExperts(**pool2, tasks.tasks, x.data(), synth.d_model, y2.data(), ws, options);
        RunExperts(**pool2, tasks.tasks, x.data(), synth.d_model, again.data(), ws, options);
        RunExperts(**pool3, tasks.tasks, x.data(), synth.d_model, y3.data(), ws, options);
        INFO(common::DTypeName(type) << " T=" << tokens << " fast paths from " << fast_min << " rows");
        const double err = RelativeL2(y2, expected);
        INFO("relative L2 error " << err);
        CHECK(err <= tolerance);
        CHECK(y2 == again);  // bitwise rerun
        const bool uses_onednn = fast && (type == DType::kBF16 || type == DType::kF32);
        if (!uses_onednn) {
          CHECK(y1 == y2);  // independent of the thread count
          CHECK(y3 == y2);
        } else {
          CHECK(RelativeL2(y1, expected) <= tolerance);
          CHECK(RelativeL2(y3, expected) <= tolerance);
        }
      }
    }
  }
}

// The AMX walks on emulated tiles (tests/kernels/amx_emulator.h), counting
// the calls that were given the activations in tile order.
std::atomic<int64_t> tile_order_calls{0};
void EmulatedBf16Tiles(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t*, float* out) {
  if (x.bf16_tiles != nullptr) tile_order_calls.fetch_add(1);
  TileBf16AmxWith<EmulatedTiles>(w, block, x, out);
}
template <bool kInt4>
void EmulatedQ8Tiles(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* scratch, float* out) {
  if (x.q8_tiles != nullptr) tile_order_calls.fetch_add(1);
  TileQ8AmxWith<EmulatedTiles, kInt4>(w, block, x, scratch, out);
}

TEST_CASE("the executor's tile-order copies of x and h give AMX tiles the bits of the rows (emulated tiles)") {
  // A table that says avx512_amx makes the executor write x and h in tile
  // order; the same table under another ISA name leaves them in rows. int8
  // and int4 run on bf16 tiles (dequantized: every table can) and, where the
  // CPU has AVX-512 for the repacking, on int8 tiles.
  TempDir dir;
  const tools::SynthOptions synth = WriteOddShapedCheckpoint(dir / "ckpt", 4);
  auto pool = ThreadPool::Create({2, -1, true});
  REQUIRE(pool.ok());
  for (DType type : {DType::kBF16, DType::kInt8, DType::kInt4}) {
    const Layer layer = LoadLayer(ConvertTo(synth, dir / common::DTypeName(type), type));
    std::vector<const common::ExpertWeights*> experts;
    for (const auto& e : layer.experts) experts.push_back(e.get());
    for (bool int8_tiles : {false, true}) {
      if (type == DType::kBF16 && int8_tiles) continue;
      if (int8_tiles && DetectIsa() < Isa::kAvx512) continue;
      KernelTable amx = KernelsFor(SelectedIsa());
      amx.isa = Isa::kAvx512Amx;
      amx.tile[static_cast<int>(DType::kBF16)] = EmulatedBf16Tiles;
      amx.tile[static_cast<int>(DType::kInt8)] = int8_tiles ? EmulatedQ8Tiles<false> : nullptr;
      amx.tile[static_cast<int>(DType::kInt4)] = int8_tiles ? EmulatedQ8Tiles<true> : nullptr;
      KernelTable rows = amx;
      rows.isa = Isa::kAvx512Bf16;
      for (int64_t tokens : {5, 23, 80}) {  // at 80, some expert has more than 32 rows: two token steps
        std::mt19937 rng(tokens);
        std::normal_distribution<float> normal;
        std::vector<float> x(tokens * synth.d_model);
        for (float& v : x) v = normal(rng);
        const common::Routes routes = common::RouteByGate(layer.routing->gate, synth.n_experts, synth.d_model,
                                                          synth.top_k, true, x.data(), tokens);
        const GroupedRoutes tasks = GroupByExpert(routes, experts);
        ExecutorOptions options;
        options.onednn_min_tokens = 0;
        options.bf16_tile_min_tokens = options.int8_tile_min_tokens = options.int4_tile_min_tokens = 1;
        std::vector<float> tiled(x.size(), 0.f), in_rows(x.size(), 0.f), expected(x.size());
        Workspace ws;
        options.kernels = &amx;
        tile_order_calls = 0;
        RunExperts(**pool, tasks.tasks, x.data(), synth.d_model, tiled.data(), ws, options);
        INFO(common::DTypeName(type) << (int8_tiles ? " on int8 tiles" : " on bf16 tiles") << " T=" << tokens);
        CHECK(tile_order_calls.load() > 0);
        options.kernels = &rows;
        tile_order_calls = 0;
        RunExperts(**pool, tasks.tasks, x.data(), synth.d_model, in_rows.data(), ws, options);
        CHECK(tile_order_calls.load() == 0);
        CHECK(tiled == in_rows);
        ReferenceMoeLayer(experts, routes, x.data(), synth.d_model, expected.data());
        CHECK(RelativeL2(tiled, expected) <= 2e-2);
        int64_t most_rows = 0;
        for (const ExpertTask& t : tasks.tasks) most_rows = std::max(most_rows, t.num_rows);
        if (tokens == 80) CHECK(most_rows > 32);
      }
    }
  }
}

TEST_CASE("the executor accumulates into dst and leaves unrouted rows alone") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kInt8);
  const Layer layer = LoadLayer(dir / "model");
  auto pool = ThreadPool::Create({2, -1, true});
  REQUIRE(pool.ok());
  std::vector<float> x(3 * 48, 0.5f), dst(3 * 48, 1.0f);
  const int32_t rows[1] = {1};
  const float weights[1] = {0.25f};
  const ExpertTask task{layer.experts[2].get(), rows, weights, 1};
  Workspace ws;
  RunExperts(**pool, {task}, x.data(), 48, dst.data(), ws);
  for (int i = 0; i < 48; ++i) {
    CHECK(dst[i] == 1.0f);
    CHECK(dst[2 * 48 + i] == 1.0f);
  }
  bool changed = false;
  for (int i = 48; i < 96; ++i) changed |= dst[i] != 1.0f;
  CHECK(changed);
  RunExperts(**pool, {}, x.data(), 48, dst.data(), ws);  // no tasks: nothing to do
}

TEST_CASE("experts of different widths in one call (a shared expert) match the reference in slots and in rows") {
  TempDir dir;
  tools::SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt", "qwen2_moe");
  synth.shared_d_ff = 176;  // routed experts are 80 wide
  for (DType type : {DType::kF32, DType::kInt8}) {
    INFO(common::DTypeName(type));
    const std::string model_dir = dir / ("model_" + common::DTypeName(type));
    colibri::testing::MakeModel(synth, model_dir, type);
    const Layer layer = LoadLayer(model_dir);
    const common::Manifest& m = layer.model->manifest();
    REQUIRE(m.n_shared_experts == 1);
    const int64_t tokens = 5;
    std::vector<float> x(tokens * m.d_model);
    for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37 * static_cast<double>(i));
    const common::Routes routed =
        common::RouteByGate(layer.routing->gate, m.n_experts, m.d_model, m.top_k, m.norm_topk_prob, x.data(), tokens);
    const common::Routes routes = common::AppendSharedExperts(routed, m.n_experts, m.n_shared_experts,
                                                              layer.routing->shared_gate, m.d_model, x.data());
    REQUIRE(routes.top_k == m.top_k + 1);
    std::vector<const common::ExpertWeights*> experts;
    for (const auto& e : layer.experts) experts.push_back(e.get());
    std::vector<float> expected(x.size());
    ReferenceMoeLayer(experts, routes, x.data(), m.d_model, expected.data());
    auto pool = ThreadPool::Create({2, -1, true});
    REQUIRE(pool.ok());
    Workspace ws;
    const GroupedRoutes rows = GroupByExpert(routes, experts);
    std::vector<float> y(x.size(), 0.f);
    RunExperts(**pool, rows.tasks, x.data(), m.d_model, y.data(), ws);
    CHECK(RelativeL2(y, expected) <= Tolerance(type, tokens, {}));
    const GroupedRoutes slots = GroupByExpert(routes, experts, /*to_slots=*/true);
    std::vector<float> per_slot(tokens * routes.top_k * m.d_model, 0.f);
    RunExperts(**pool, slots.tasks, x.data(), m.d_model, per_slot.data(), ws);
    std::vector<float> summed(x.size(), 0.f);
    for (int64_t s = 0; s < tokens * routes.top_k; ++s) {
      for (int64_t c = 0; c < m.d_model; ++c) summed[s / routes.top_k * m.d_model + c] += per_slot[s * m.d_model + c];
    }
    CHECK(RelativeL2(summed, expected) <= Tolerance(type, tokens, {}));
  }
}

TEST_CASE("gpt-oss's and Llama 4's experts (biases, clamped SwiGLU, weight at the input) match the reference") {
  TempDir dir;
  auto pool1 = ThreadPool::Create({1, -1, false});
  auto pool2 = ThreadPool::Create({2, -1, true});
  REQUIRE(pool1.ok());
  REQUIRE(pool2.ok());
  for (const char* naming : {"gpt_oss", "llama4"}) {
    tools::SynthOptions synth = colibri::testing::SmallSynth(dir / naming, naming);
    synth.d_ff = 72;  // not a multiple of 64: biases and padding of the second block
    if (std::string(naming) == "gpt_oss") {
      synth.top_k = 3;
      synth.swiglu_limit = 0.5;  // reached by many entries
    } else {
      synth.top_k = 1;
    }
    for (DType type : {DType::kF32, DType::kBF16, DType::kInt8, DType::kInt4}) {
      INFO(naming << " as " << common::DTypeName(type));
      const std::string model_dir = dir / (std::string(naming) + "_" + common::DTypeName(type));
      colibri::testing::MakeModel(synth, model_dir, type);
      const Layer layer = LoadLayer(model_dir);
      const common::Manifest& m = layer.model->manifest();
      REQUIRE(m.expert_biases == (std::string(naming) == "gpt_oss"));
      REQUIRE(m.routing.weight_at_input == (std::string(naming) == "llama4"));
      std::vector<const common::ExpertWeights*> experts;
      for (const auto& e : layer.experts) experts.push_back(e.get());
      for (int64_t tokens : {1, 7, 40}) {
        std::vector<float> x(tokens * m.d_model);
        for (size_t i = 0; i < x.size(); ++i) x[i] = 2.0 * std::sin(0.61 * static_cast<double>(i) + tokens);
        const common::Routes routes = common::AppendSharedExperts(
            common::RouteByGateSpec(m.routing, layer.routing->gate, layer.routing->bias, m.n_experts, m.d_model,
                                    m.top_k, m.norm_topk_prob, x.data(), tokens),
            m.n_experts, m.n_shared_experts, layer.routing->shared_gate, m.d_model, x.data());
        std::vector<float> expected(x.size());
        ReferenceMoeLayer(experts, routes, x.data(), m.d_model, expected.data());
        const GroupedRoutes tasks = GroupByExpert(routes, experts);
        for (int64_t fast_min : {int64_t{0}, int64_t{4}}) {
          ExecutorOptions options;
          options.onednn_min_tokens = options.int8_tile_min_tokens = options.int4_tile_min_tokens = fast_min;
          const double tolerance = Tolerance(type, tokens, options);
          std::vector<float> y1(x.size(), 0.f), y2(x.size(), 0.f);
          Workspace ws;
          RunExperts(**pool1, tasks.tasks, x.data(), m.d_model, y1.data(), ws, options);
          RunExperts(**pool2, tasks.tasks, x.data(), m.d_model, y2.data(), ws, options);
          INFO("T=" << tokens << " fast paths from " << fast_min << " rows");
          CHECK(RelativeL2(y2, expected) <= tolerance);
          CHECK(RelativeL2(y1, expected) <= tolerance);
        }
      }
    }
  }
}

TEST_CASE("rows merged into one task with kernel_rows get the bits of their own smaller tasks") {
  // Thresholds low enough that the merged row count crosses them: the
  // merged task must still run the kernel of each caller's own count.
  for (const DType type : {DType::kBF16, DType::kF32, DType::kInt8, DType::kInt4}) {
    CAPTURE(common::DTypeName(type));
    TempDir dir;
    colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", type);
    const Layer layer = LoadLayer(dir / "model");
    const int64_t d_model = layer.model->manifest().d_model;
    const common::ExpertWeights* expert = layer.experts[1].get();
    // Three callers of one expert with 1, 2 and 1 rows; kernels change from 3 rows on.
    ExecutorOptions options;
    options.onednn_min_tokens = options.int8_tile_min_tokens = options.int4_tile_min_tokens =
        options.bf16_tile_min_tokens = 3;  // bf16 tiles: AMX hosts only (ignored elsewhere)
    const int64_t tokens = 4;
    std::vector<float> x(tokens * d_model);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::sin(0.7 * static_cast<double>(i)));
    const std::vector<int32_t> rows = {0, 1, 2, 3};
    const std::vector<float> weights = {0.5f, -1.25f, 0.75f, 2.f};
    auto pool = ThreadPool::Create({2, -1, false});
    REQUIRE(pool.ok());
    Workspace ws;
    std::vector<float> alone(x.size(), 0.f), merged(x.size(), 0.f);
    const std::vector<std::pair<int, int>> callers = {{0, 1}, {1, 3}, {3, 4}};  // [begin, end) of rows
    for (const auto& [begin, end] : callers) {
      const ExpertTask task{expert, rows.data() + begin, weights.data() + begin, end - begin};
      REQUIRE(RunExperts(**pool, {task}, x.data(), d_model, alone.data(), ws, options));
    }
    const ExpertTask all{expert, rows.data(), weights.data(), tokens, nullptr, /*kernel_rows=*/2};
    REQUIRE(RunExperts(**pool, {all}, x.data(), d_model, merged.data(), ws, options));
    CHECK(merged == alone);
    // kernel_rows at the threshold runs the other kernel: the same values
    // within the type's tolerance.
    std::vector<float> crossed(x.size(), 0.f);
    const ExpertTask big{expert, rows.data(), weights.data(), tokens, nullptr, /*kernel_rows=*/3};
    REQUIRE(RunExperts(**pool, {big}, x.data(), d_model, crossed.data(), ws, options));
    CHECK(RelativeL2(crossed, alone) < Tolerance(type, 3, options) + 1e-2);
  }
}

TEST_CASE("should_stop abandons a call between blocks, and a call never stopped is unchanged") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kInt8);
  const auto call = LoadGateCall(dir / "model");
  const std::vector<float>& x = call->x;
  const GroupedRoutes& tasks = call->tasks;
  const int64_t d_model = call->d_model;
  auto pool = ThreadPool::Create({2, -1, false});
  REQUIRE(pool.ok());
  Workspace ws;
  std::vector<float> plain(x.size(), 0.f), polled(x.size(), 0.f), stopped(x.size(), 0.f);
  REQUIRE(RunExperts(**pool, tasks.tasks, x.data(), d_model, plain.data(), ws));
  std::atomic<int> polls{0};
  ExecutorOptions never;
  never.should_stop = [&] {
    ++polls;
    return false;
  };
  CHECK(RunExperts(**pool, tasks.tasks, x.data(), d_model, polled.data(), ws, never));
  CHECK(polled == plain);  // polling changes nothing
  const int polls_per_call = polls.load();
  CHECK(polls_per_call > static_cast<int>(tasks.tasks.size()));  // at least once per expert block
  polls = 0;
  ExecutorOptions soon;
  soon.should_stop = [&] { return ++polls > 2; };
  CHECK_FALSE(RunExperts(**pool, tasks.tasks, x.data(), d_model, stopped.data(), ws, soon));
  CHECK(polls.load() < polls_per_call);  // the rest of the call was skipped
}

TEST_CASE("a stalled worker holds a call up by one chunk of work: the other takes the rest, with the same bits") {
  TempDir dir;
  tools::SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt");
  synth.d_ff = 24 * 64;  // 24 blocks of W1/W3 per expert: many chunks to share
  colibri::testing::MakeModel(synth, dir / "model", DType::kBF16);
  const auto call = LoadGateCall(dir / "model");
  const std::vector<float>& x = call->x;
  const GroupedRoutes& tasks = call->tasks;
  const int64_t d_model = call->d_model;
  auto pool1 = ThreadPool::Create({1, -1, false});
  auto pool2 = ThreadPool::Create({2, -1, false});
  REQUIRE(pool1.ok());
  REQUIRE(pool2.ok());
  Workspace ws;
  // The polls (one per unit of work and per chunk) of the whole call on one worker.
  std::atomic<int> polls{0};
  // No oneDNN, whatever the host's profile: the width of its products
  // follows the chunks, and its bits may follow the width (docs/KERNELS.md).
  ExecutorOptions count;
  count.onednn_min_tokens = 0;
  count.should_stop = [&] {
    ++polls;
    return false;
  };
  std::vector<float> plain(x.size(), 0.f), stalled_run(x.size(), 0.f);
  REQUIRE(RunExperts(**pool1, tasks.tasks, x.data(), d_model, plain.data(), ws, count));
  const int whole_call = polls.load();
  // The first worker to poll stalls (as a descheduled vCPU would) until the
  // other has polled 60% of the whole call's count — more than its half —
  // before the barrier that ends the first phase: reachable only if it takes
  // over the stalled worker's work. A wait of 30 s bounds the test if not.
  std::mutex mu;
  std::condition_variable polled;
  std::thread::id stalled;
  int others = 0;
  bool timed_out = false;
  ExecutorOptions stall;
  stall.onednn_min_tokens = 0;
  stall.should_stop = [&] {
    std::unique_lock<std::mutex> lock(mu);
    if (stalled == std::thread::id()) {
      stalled = std::this_thread::get_id();
      timed_out = !polled.wait_for(lock, std::chrono::seconds(30), [&] { return others * 10 >= whole_call * 6; });
    } else if (std::this_thread::get_id() != stalled) {
      ++others;
      polled.notify_all();
    }
    return false;
  };
  REQUIRE(RunExperts(**pool2, tasks.tasks, x.data(), d_model, stalled_run.data(), ws, stall));
  INFO("polls of the whole call " << whole_call << ", by the worker that did not stall " << others);
  CHECK_FALSE(timed_out);
  CHECK(stalled_run == plain);  // who computed which chunk changes no bit
}

TEST_CASE("a thread pool runs every worker and its barrier orders phases") {
  auto pool = ThreadPool::Create({3, -1, false});
  REQUIRE(pool.ok());
  for (int round = 0; round < 50; ++round) {
    std::vector<int> stage(3, 0);
    std::atomic<int> violations{0};
    (*pool)->Run([&](int w) {
      stage[w] = 1;
      (*pool)->Barrier();
      for (int v : stage) violations += v != 1;
      (*pool)->Barrier();
      stage[w] = 2;
    });
    CHECK(violations == 0);
    CHECK(stage == std::vector<int>{2, 2, 2});
  }
  CHECK_FALSE(ThreadPool::Create({1, 4096, true}).ok());  // no such NUMA node
}

TEST_CASE("pinned workers run on exactly the CPU they were given") {
  auto pool = ThreadPool::Create({2, -1, true});
  REQUIRE(pool.ok());
  if (!(*pool)->pinned_per_cpu()) {
    WARN("a CPU quota below the CPUs this process may use: workers are not pinned one per CPU here");
    return;
  }
  std::vector<int> allowed(2, -1), on(2, -1);
  (*pool)->Run([&](int w) {
    cpu_set_t set;
    CPU_ZERO(&set);
    sched_getaffinity(0, sizeof(set), &set);
    allowed[w] = CPU_COUNT(&set);
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) on[w] = c;
    }
  });
  const std::vector<int>& cpus = (*pool)->cpus();
  for (int w = 0; w < 2; ++w) {
    CHECK(allowed[w] == 1);  // the affinity mask took effect
    CHECK(on[w] == cpus[w % cpus.size()]);
  }
}

}  // namespace
}  // namespace kernels
}  // namespace colibri
