#include "kernels/expert_executor.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "kernels/kernel_profile.h"
#include "kernels/onednn_matmul.h"

namespace colibri {
namespace kernels {
namespace {

using common::kBlockRows;

constexpr size_t kAlign = 64;
// Chunks per worker in each phase of a call (RunSameShape).
constexpr int64_t kChunksPerWorker = 8;

size_t AlignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Carves typed, aligned arrays out of one workspace region.
class Arena {
 public:
  template <typename T>
  size_t Add(size_t count) {
    const size_t offset = size_;
    size_ = AlignUp(size_ + count * sizeof(T));
    return offset;
  }
  size_t size() const { return size_; }

 private:
  size_t size_ = 0;
};

// Which copy of the activations a task's tiles also read in tile order
// (kernels/block_kernel.h): the one AMX tiles multiply, if they run.
enum class TileOrder { kNone, kBf16, kQ8 };

// Where each array of a call lives in the workspace.
struct Plan {
  struct Task {
    size_t x_f32, x_bf16, x_sums, h_f32, h_bf16, h_sums;
    size_t x_q8, x_q8_scales, x_q8_sums, h_q8, h_q8_scales, h_q8_sums;  // int4 weights only
    size_t x_tiles, h_tiles;                                            // tile order only
    bool onednn;
    bool tiled;  // through the type's tile kernel, or dequantized to bf16 tiles
    TileOrder order;
  };
  std::vector<Task> tasks;
  size_t tile1, tile3, tile2, dequant1, dequant3;  // per worker, `tile_stride` bytes apart
  size_t tile_stride;
};

// Where one set of activations (the gathered x, or h) lives in the workspace.
struct ActsAt {
  size_t f32, bf16, sums, q8, q8_scales, q8_sums, tiles;
};

// The bytes of one row of the copy `order` names, of `cols` columns.
int64_t TileRowBytes(TileOrder order, int64_t cols) {
  return order == TileOrder::kQ8 ? cols : cols * static_cast<int64_t>(sizeof(uint16_t));
}

// Activations over `cols` columns of T rows stored at the given offsets (the
// int8 copy only when `q8`, the tile order copy only when `order` names one).
Activations Acts(uint8_t* base, const ActsAt& at, int64_t rows, int64_t cols, bool q8, TileOrder order) {
  Activations a;
  a.num_tokens = rows;
  a.cols = cols;
  a.f32 = reinterpret_cast<const float*>(base + at.f32);
  a.bf16 = reinterpret_cast<const uint16_t*>(base + at.bf16);
  a.group_sums = reinterpret_cast<const float*>(base + at.sums);
  if (q8) {
    a.q8 = reinterpret_cast<const int8_t*>(base + at.q8);
    a.q8_scales = reinterpret_cast<const float*>(base + at.q8_scales);
    a.q8_sums = reinterpret_cast<const float*>(base + at.q8_sums);
  }
  if (order == TileOrder::kBf16) a.bf16_tiles = base + at.tiles;
  if (order == TileOrder::kQ8) a.q8_tiles = base + at.tiles;
  return a;
}

// Fills the bf16 copy and the 64-group sums of `count` f32 values (count % 64
// == 0), and the int8 copy when q8 is non-null.
void Derive(const float* f32, int64_t count, uint16_t* bf16, float* sums, int8_t* q8, float* q8_scales,
            float* q8_sums) {
  for (int64_t i = 0; i < count; ++i) bf16[i] = common::FloatToBf16(f32[i]);
  for (int64_t g = 0; g < count / 64; ++g) {
    float s = 0.f;
    for (int64_t i = 0; i < 64; ++i) s += f32[g * 64 + i];
    sums[g] = s;
    if (q8 != nullptr) QuantizeGroupQ8(f32 + g * 64, q8 + g * 64, q8_scales + g, q8_sums + g);
  }
}

// One token's h over `count` intermediate entries starting at `first`
// (count % 64 == 0), as Activations arrays at those entries.
struct HAt {
  float* f32;
  uint16_t* bf16;
  float* sums;
  int8_t* q8;  // null: no int8 copy
  float* q8_scales;
  float* q8_sums;
};

// h = act(a, b) over `count` values of one token starting at intermediate
// entry `first`, plus h's bf16 copy, 64-group sums and (h.q8) int8 copy: the
// ISA's SwiGLU for plain experts, else the general activation with biases.
void Activate(SwiGluFn fn, const common::ExpertWeights& e, const float* a, const float* b, int64_t first, int64_t count,
              const HAt& h) {
  const bool plain = e.b1 == nullptr && e.activation.plain();
  const int64_t d_ff = e.w1.layout.rows;
  for (int64_t i = 0; i < count; i += 64) {
    if (plain) {
      fn(a + i, b + i, h.f32 + i, h.bf16 + i, h.sums + i / 64);
    } else {
      const int64_t f = first + i;
      GatedActivationScalar(e.activation, a + i, b + i, e.b1 != nullptr ? e.b1 + f : nullptr,
                            e.b3 != nullptr ? e.b3 + f : nullptr, std::clamp<int64_t>(d_ff - f, 0, 64), h.f32 + i,
                            h.bf16 + i, h.sums + i / 64);
    }
    if (h.q8 != nullptr) QuantizeGroupQ8(h.f32 + i, h.q8 + i, h.q8_scales + i / 64, h.q8_sums + i / 64);
  }
}

// Splits [0, total) of items with the given prefix costs into `parts`
// contiguous ranges of about equal cost; returns part p's [begin, end).
std::pair<int64_t, int64_t> Share(const std::vector<double>& prefix, int64_t parts, int64_t p) {
  const double total = prefix.back();
  auto first_at = [&](double cost) {
    return static_cast<int64_t>(std::lower_bound(prefix.begin(), prefix.end(), cost) - prefix.begin());
  };
  const int64_t n = static_cast<int64_t>(prefix.size()) - 1;
  const int64_t begin = p == 0 ? 0 : std::min(n, first_at(total * p / parts));
  const int64_t end = p == parts - 1 ? n : std::min(n, first_at(total * (p + 1) / parts));
  return {begin, end};
}

}  // namespace

namespace {

// The profile that resolves -1 thresholds for `kernels`: the machine's when
// they are the selected kernels' ISA, else the built-in defaults.
const KernelProfile& ProfileFor(const KernelTable& kernels) {
  static const KernelProfile defaults[] = {DefaultProfile(Isa::kScalar), DefaultProfile(Isa::kAvx2),
                                           DefaultProfile(Isa::kAvx512), DefaultProfile(Isa::kAvx512Bf16),
                                           DefaultProfile(Isa::kAvx512Amx)};
  return kernels.isa == SelectedIsa() ? SelectedProfile() : defaults[static_cast<int>(kernels.isa)];
}

}  // namespace

int64_t TileMinTokens(const ExecutorOptions& options, const KernelTable& kernels, common::DType type, bool records) {
  switch (type) {
    case common::DType::kBF16:
      if (kernels.TileFor(type) == nullptr) return 0;
      return options.bf16_tile_min_tokens >= 0 ? options.bf16_tile_min_tokens
                                               : ProfileFor(kernels).bf16_tile_min_tokens;
    case common::DType::kInt8:
      if (options.int8_tile_min_tokens >= 0) return options.int8_tile_min_tokens;
      return records ? ProfileFor(kernels).int8_records_tile_min_tokens : ProfileFor(kernels).int8_tile_min_tokens;
    case common::DType::kInt4:
      if (options.int4_tile_min_tokens >= 0) return options.int4_tile_min_tokens;
      return records ? ProfileFor(kernels).int4_records_tile_min_tokens : ProfileFor(kernels).int4_tile_min_tokens;
    default: return 0;
  }
}

int64_t OnednnMinTokens(const ExecutorOptions& options, const KernelTable& kernels) {
  return options.onednn_min_tokens >= 0 ? options.onednn_min_tokens : ProfileFor(kernels).onednn_min_tokens;
}

int64_t RowSplitLimit(const ExecutorOptions& options, const KernelTable& kernels, common::DType type, bool records) {
  const int64_t tiles = TileMinTokens(options, kernels, type, records);
  if (type != common::DType::kBF16 && type != common::DType::kF32) return tiles;
  int64_t onednn = OnednnMinTokens(options, kernels);
  if (onednn > 0 && !OnednnMatmulAvailable(type)) onednn = 0;  // never taken there (Plan)
  return tiles > 0 && onednn > 0 ? std::min(tiles, onednn) : std::max(tiles, onednn);
}

GroupedRoutes GroupByExpert(const common::Routes& routes, absl::Span<const common::ExpertWeights* const> experts,
                            bool to_slots) {
  GroupedRoutes g;
  g.rows.resize(experts.size());
  g.weights.resize(experts.size());
  g.slots.resize(experts.size());
  for (size_t s = 0; s < routes.expert_ids.size(); ++s) {
    const int32_t e = routes.expert_ids[s];
    g.rows[e].push_back(static_cast<int32_t>(s / routes.top_k));
    g.weights[e].push_back(routes.weights[s]);
    g.slots[e].push_back(static_cast<int32_t>(s));
  }
  for (size_t e = 0; e < experts.size(); ++e) {
    if (g.rows[e].empty()) continue;
    g.tasks.push_back({experts[e], g.rows[e].data(), g.weights[e].data(), static_cast<int64_t>(g.rows[e].size()),
                       to_slots ? g.slots[e].data() : nullptr});
  }
  return g;
}

uint8_t* Workspace::Reserve(size_t bytes) {
  if (bytes > capacity_) {
    buffer_.reset(new uint8_t[bytes + kAlign]);
    capacity_ = bytes;
  }
  const uintptr_t p = reinterpret_cast<uintptr_t>(buffer_.get());
  return reinterpret_cast<uint8_t*>((p + kAlign - 1) / kAlign * kAlign);
}

namespace {

// RunExperts for tasks whose experts all have one shape and weight type;
// false if options.should_stop stopped it.
bool RunSameShape(ThreadPool& pool, absl::Span<const ExpertTask> tasks, const float* x, int64_t d_model, float* dst,
                  Workspace& workspace, const ExecutorOptions& options) {
  if (tasks.empty()) return true;
  // Set by the first worker that sees should_stop; every worker then skips the rest.
  std::atomic<bool> stopped{false};
  auto stop = [&] {
    if (stopped.load(std::memory_order_relaxed)) return true;
    if (options.should_stop && options.should_stop()) stopped.store(true, std::memory_order_relaxed);
    return stopped.load(std::memory_order_relaxed);
  };
  const KernelTable& kernels = options.kernels != nullptr ? *options.kernels : SelectedKernels();
  const common::MatrixLayout& l1 = tasks[0].expert->w1.layout;  // [d_ff][d_model]
  const common::MatrixLayout& l2 = tasks[0].expert->w2.layout;  // [d_model][d_ff]
  const common::DType type = l1.dtype;
  const int64_t k1 = l1.padded_cols, k2 = l2.padded_cols;  // padded d_model, d_ff
  const int64_t blocks1 = l1.num_blocks(), blocks2 = l2.num_blocks();
  const BlockKernelFn block_kernel = kernels.For(type);
  const int64_t onednn_min_tokens = OnednnMinTokens(options, kernels);
  // A profile (or an explicit threshold) may name oneDNN where its matmul is missing: never there.
  const bool onednn_type = (type == common::DType::kBF16 || type == common::DType::kF32) && onednn_min_tokens > 0 &&
                           OnednnMatmulAvailable(type);
  const BlockKernelFn bf16_kernel = kernels.For(common::DType::kBF16);
  const TileKernelFn tile_kernel = kernels.TileFor(type);
  const TileKernelFn bf16_tiles = kernels.TileFor(common::DType::kBF16);  // AMX, where there are some
  // int4 and int8 block kernels may read the int8 copy of the activations (kernels/block_kernel.h).
  const bool q8 = type == common::DType::kInt4 || type == common::DType::kInt8;
  // A dequantized 64-row block in the bf16 stored layout, as a one-block matrix.
  const common::MatrixLayout tile_layout1 = common::ComputeMatrixLayout(common::DType::kBF16, kBlockRows, k1);
  const common::MatrixLayout tile_layout2 = common::ComputeMatrixLayout(common::DType::kBF16, kBlockRows, k2);

  Arena arena;
  Plan plan;
  int64_t max_rows = 0;
  bool any_onednn = false;
  for (const ExpertTask& t : tasks) {
    Plan::Task p{};
    p.x_f32 = arena.Add<float>(t.num_rows * k1);
    p.x_bf16 = arena.Add<uint16_t>(t.num_rows * k1);
    p.x_sums = arena.Add<float>(t.num_rows * k1 / 64);
    p.h_f32 = arena.Add<float>(t.num_rows * k2);
    p.h_bf16 = arena.Add<uint16_t>(t.num_rows * k2);
    p.h_sums = arena.Add<float>(t.num_rows * k2 / 64);
    if (q8) {
      p.x_q8 = arena.Add<int8_t>(t.num_rows * k1);
      p.x_q8_scales = arena.Add<float>(t.num_rows * k1 / 64);
      p.x_q8_sums = arena.Add<float>(t.num_rows * k1 / 64);
      p.h_q8 = arena.Add<int8_t>(t.num_rows * k2);
      p.h_q8_scales = arena.Add<float>(t.num_rows * k2 / 64);
      p.h_q8_sums = arena.Add<float>(t.num_rows * k2 / 64);
    }
    const int64_t kernel_rows = t.kernel_rows > 0 ? t.kernel_rows : t.num_rows;
    p.onednn = onednn_type && onednn_min_tokens > 0 && kernel_rows >= onednn_min_tokens;
    const int64_t tile_min_tokens = TileMinTokens(options, kernels, type, t.expert->w1.q8_records != nullptr);
    p.tiled = tile_min_tokens > 0 && kernel_rows >= tile_min_tokens;
    p.order = TileOrder::kNone;
    if (p.tiled && !p.onednn && kernels.isa == Isa::kAvx512Amx) {
      if (tile_kernel != nullptr) {
        p.order = type == common::DType::kBF16 ? TileOrder::kBf16 : TileOrder::kQ8;
      } else if (bf16_tiles != nullptr) {
        p.order = TileOrder::kBf16;  // blocks dequantized to bf16
      }
    }
    if (p.order != TileOrder::kNone) {
      p.x_tiles = arena.Add<uint8_t>(TileOrderBytes(t.num_rows, TileRowBytes(p.order, k1)));
      p.h_tiles = arena.Add<uint8_t>(TileOrderBytes(t.num_rows, TileRowBytes(p.order, k2)));
    }
    plan.tasks.push_back(p);
    max_rows = std::max(max_rows, t.num_rows);
    any_onednn |= p.onednn;
  }
  const int workers = pool.size();
  Arena tiles;
  // Output tiles: one 64-wide block per row, or a whole oneDNN slice.
  plan.tile1 = tiles.Add<float>(max_rows * (any_onednn ? std::max(k2, l2.padded_rows) : kBlockRows));
  plan.tile3 = tiles.Add<float>(max_rows * (any_onednn ? k2 : kBlockRows));
  plan.tile2 = plan.tile1;  // phase 2 reuses phase 1's tile
  // A bf16 tile, or an int8 tile kernel's scratch (whichever is larger).
  auto scratch = [](int64_t k) { return std::max<size_t>(kBlockRows * k * sizeof(uint16_t), TileQ8ScratchBytes(k)); };
  plan.dequant1 = tiles.Add<uint8_t>(scratch(std::max(k1, k2)));
  plan.dequant3 = tiles.Add<uint8_t>(scratch(k1));
  plan.tile_stride = tiles.size();
  const size_t tiles_at = arena.size();
  uint8_t* base = workspace.Reserve(tiles_at + tiles.size() * workers);

  // Cost of phase-1 items (expert e, block b): weight bytes, plus compute
  // that grows with the rows.
  std::vector<double> prefix1 = {0.0};
  for (const ExpertTask& t : tasks) {
    for (int64_t b = 0; b < blocks1; ++b) prefix1.push_back(prefix1.back() + 1.0 + t.num_rows / 8.0);
  }
  std::vector<double> prefix2(blocks2 + 1);
  for (int64_t c = 0; c <= blocks2; ++c) prefix2[c] = static_cast<double>(c);
  // Each phase's items are cut into chunks of about equal cost that the
  // workers claim from a counter, rather than one share each: a worker whose
  // CPU stalls (a vCPU the host deschedules) holds the barrier up by one chunk
  // at most while the others take the rest. The cuts depend only on the tasks
  // and the worker count, and a chunk is computed whole by whichever worker
  // claims it, so the results do not depend on who claims what.
  const int64_t chunks1 = std::min<int64_t>(static_cast<int64_t>(prefix1.size()) - 1, workers * kChunksPerWorker);
  const int64_t chunks2 = std::min<int64_t>(blocks2, workers * kChunksPerWorker);
  std::atomic<int64_t> next1{0}, next2{0};

  pool.Run([&](int w) {
    uint8_t* tile_base = base + tiles_at + plan.tile_stride * w;
    float* tile1 = reinterpret_cast<float*>(tile_base + plan.tile1);
    float* tile3 = reinterpret_cast<float*>(tile_base + plan.tile3);
    float* tile2 = reinterpret_cast<float*>(tile_base + plan.tile2);
    uint16_t* dequant1 = reinterpret_cast<uint16_t*>(tile_base + plan.dequant1);
    uint16_t* dequant3 = reinterpret_cast<uint16_t*>(tile_base + plan.dequant3);
    // out[T][64] = block b of `w` times `acts`, directly or through tiles:
    // the table's tile kernel (int8 tiles repacked in `tile`, AMX tiles for
    // bf16) where it has one, else the block dequantized to bf16 in `tile`
    // for the bf16 kernel (on AMX tiles where there are some).
    auto run_block = [&](bool tiled, const common::MatrixView& matrix, int64_t b, const Activations& acts,
                         uint16_t* tile, const common::MatrixLayout& tile_layout, float* out) {
      if (!tiled) {
        block_kernel(matrix, b, acts, out);
        return;
      }
      if (tile_kernel != nullptr) {
        tile_kernel(matrix, b, acts, reinterpret_cast<uint8_t*>(tile), out);
        return;
      }
      kernels.dequant_bf16(matrix, b, tile);
      const common::MatrixView dequantized{tile_layout, reinterpret_cast<const uint8_t*>(tile), nullptr, nullptr};
      if (bf16_tiles != nullptr) {
        bf16_tiles(dequantized, 0, acts, nullptr, out);
      } else {
        bf16_kernel(dequantized, 0, acts, out);
      }
    };

    // Phase 0: gather each expert's rows of x (zero padded) with their bf16 copy and sums.
    for (size_t e = w; e < tasks.size(); e += workers) {
      const ExpertTask& t = tasks[e];
      const Plan::Task& p = plan.tasks[e];
      float* xf = reinterpret_cast<float*>(base + p.x_f32);
      for (int64_t r = 0; r < t.num_rows; ++r) {
        const float* src = x + t.rows[r] * d_model;
        if (t.expert->weight_at_input) {  // FFN(w·x): the weight scales the input
          for (int64_t c = 0; c < d_model; ++c) xf[r * k1 + c] = t.weights[r] * src[c];
        } else {
          std::memcpy(xf + r * k1, src, d_model * sizeof(float));
        }
        std::fill(xf + r * k1 + d_model, xf + (r + 1) * k1, 0.f);
      }
      Derive(xf, t.num_rows * k1, reinterpret_cast<uint16_t*>(base + p.x_bf16),
             reinterpret_cast<float*>(base + p.x_sums), q8 ? reinterpret_cast<int8_t*>(base + p.x_q8) : nullptr,
             reinterpret_cast<float*>(base + p.x_q8_scales), reinterpret_cast<float*>(base + p.x_q8_sums));
      if (p.order != TileOrder::kNone) {
        const int64_t row_bytes = TileRowBytes(p.order, k1);
        const uint8_t* rows = base + (p.order == TileOrder::kQ8 ? p.x_q8 : p.x_bf16);
        for (int64_t r = 0; r < t.num_rows; ++r) {
          CopyToTileOrder(rows + r * row_bytes, r, 0, row_bytes, row_bytes, base + p.x_tiles);
        }
      }
    }
    pool.Barrier();

    // Phase 1: h = silu(W1·x) ⊙ W3·x, chunks of (expert, block) items.
    for (int64_t chunk; (chunk = next1.fetch_add(1, std::memory_order_relaxed)) < chunks1 && !stop();) {
      const auto [begin1, end1] = Share(prefix1, chunks1, chunk);
      for (int64_t item = begin1; item < end1 && !stop();) {
        const int64_t e = item / blocks1, b0 = item % blocks1;
        const int64_t b1 = std::min(blocks1, b0 + (end1 - item));  // this expert's run of blocks
        item += b1 - b0;
        const ExpertTask& t = tasks[e];
        const Plan::Task& p = plan.tasks[e];
        const Activations xa = Acts(base, {p.x_f32, p.x_bf16, p.x_sums, p.x_q8, p.x_q8_scales, p.x_q8_sums, p.x_tiles},
                                    t.num_rows, k1, q8, p.order);
        // Token r's h from intermediate entry f on.
        auto h_at = [&](int64_t r, int64_t f) {
          return HAt{reinterpret_cast<float*>(base + p.h_f32) + r * k2 + f,
                     reinterpret_cast<uint16_t*>(base + p.h_bf16) + r * k2 + f,
                     reinterpret_cast<float*>(base + p.h_sums) + r * (k2 / 64) + f / 64,
                     q8 ? reinterpret_cast<int8_t*>(base + p.h_q8) + r * k2 + f : nullptr,
                     reinterpret_cast<float*>(base + p.h_q8_scales) + r * (k2 / 64) + f / 64,
                     reinterpret_cast<float*>(base + p.h_q8_sums) + r * (k2 / 64) + f / 64};
        };
        if (p.onednn) {
          const int64_t n = (b1 - b0) * kBlockRows;
          const void* src = type == common::DType::kBF16 ? static_cast<const void*>(xa.bf16) : xa.f32;
          OnednnMatmul(type, t.num_rows, k1, n, src, t.expert->w1.data + b0 * l1.block_bytes, tile1, n);
          OnednnMatmul(type, t.num_rows, k1, n, src, t.expert->w3.data + b0 * l1.block_bytes, tile3, n);
          for (int64_t r = 0; r < t.num_rows; ++r) {
            Activate(kernels.swiglu, *t.expert, tile1 + r * n, tile3 + r * n, b0 * kBlockRows, n,
                     h_at(r, b0 * kBlockRows));
          }
          continue;
        }
        const int64_t h_row_bytes = TileRowBytes(p.order, k2);
        const uint8_t* h_rows = base + (p.order == TileOrder::kQ8 ? p.h_q8 : p.h_bf16);
        for (int64_t b = b0; b < b1 && !stop(); ++b) {
          run_block(p.tiled, t.expert->w1, b, xa, dequant1, tile_layout1, tile1);
          run_block(p.tiled, t.expert->w3, b, xa, dequant3, tile_layout1, tile3);
          for (int64_t r = 0; r < t.num_rows; ++r) {
            Activate(kernels.swiglu, *t.expert, tile1 + r * kBlockRows, tile3 + r * kBlockRows, b * kBlockRows,
                     kBlockRows, h_at(r, b * kBlockRows));
            if (p.order != TileOrder::kNone) {  // this block's 64 entries of h
              const int64_t first = TileRowBytes(p.order, b * kBlockRows);
              CopyToTileOrder(h_rows + r * h_row_bytes, r, first, TileRowBytes(p.order, kBlockRows), h_row_bytes,
                              base + p.h_tiles);
            }
          }
        }
      }
    }
    pool.Barrier();

    // Phase 2: chunks of dst's columns, each with every expert in task order.
    // dst[row][first, last) += weight · (y[row][0, last - first) + b2) for
    // the task's rows (weight 1 when it scaled the input instead).
    auto accumulate = [&](const ExpertTask& t, const float* y, int64_t stride, int64_t first, int64_t last) {
      const float* b2 = t.expert->b2;
      for (int64_t r = 0; r < t.num_rows; ++r) {
        float* out = dst + (t.out_rows != nullptr ? t.out_rows[r] : t.rows[r]) * d_model;
        const float weight = t.expert->weight_at_input ? 1.f : t.weights[r];
        if (b2 == nullptr) {
          for (int64_t c = first; c < last; ++c) out[c] += weight * y[r * stride + c - first];
        } else {
          for (int64_t c = first; c < last; ++c) out[c] += weight * (y[r * stride + c - first] + b2[c]);
        }
      }
    };
    for (int64_t chunk; (chunk = next2.fetch_add(1, std::memory_order_relaxed)) < chunks2 && !stop();) {
      const auto [c0, c1] = Share(prefix2, chunks2, chunk);
      for (size_t e = 0; e < tasks.size() && c0 < c1 && !stop(); ++e) {
        const ExpertTask& t = tasks[e];
        const Plan::Task& p = plan.tasks[e];
        const Activations ha = Acts(base, {p.h_f32, p.h_bf16, p.h_sums, p.h_q8, p.h_q8_scales, p.h_q8_sums, p.h_tiles},
                                    t.num_rows, k2, q8, p.order);
        if (p.onednn) {
          const int64_t n = (c1 - c0) * kBlockRows;
          const void* src = type == common::DType::kBF16 ? static_cast<const void*>(ha.bf16) : ha.f32;
          OnednnMatmul(type, t.num_rows, k2, n, src, t.expert->w2.data + c0 * l2.block_bytes, tile2, n);
          accumulate(t, tile2, n, c0 * kBlockRows, std::min(d_model, c1 * kBlockRows));
          continue;
        }
        for (int64_t c = c0; c < c1; ++c) {
          run_block(p.tiled, t.expert->w2, c, ha, dequant1, tile_layout2, tile1);
          accumulate(t, tile1, kBlockRows, c * kBlockRows, std::min(d_model, (c + 1) * kBlockRows));
        }
      }
    }
  });
  return !stopped.load();
}

}  // namespace

namespace {

bool SameShape(const ExpertTask& a, const ExpertTask& b) {
  return a.expert->w1.layout.rows == b.expert->w1.layout.rows && a.expert->w1.layout.dtype == b.expert->w1.layout.dtype;
}

}  // namespace

std::vector<ExpertTask> ExecutionOrder(absl::Span<const ExpertTask> tasks) {
  std::vector<ExpertTask> order;
  std::vector<bool> done(tasks.size(), false);
  for (size_t first = 0; first < tasks.size(); ++first) {
    if (done[first]) continue;
    for (size_t i = first; i < tasks.size(); ++i) {
      if (done[i] || !SameShape(tasks[i], tasks[first])) continue;
      done[i] = true;
      const ExpertTask& t = tasks[i];
      for (int64_t r = 0; r < t.num_rows || (r == 0 && t.num_rows == 0); r += kMaxTaskRows) {
        ExpertTask chunk = t;
        chunk.rows = t.rows + r;
        chunk.weights = t.weights + r;
        chunk.num_rows = std::min(kMaxTaskRows, t.num_rows - r);
        if (t.out_rows != nullptr) chunk.out_rows = t.out_rows + r;
        order.push_back(chunk);
      }
    }
  }
  return order;
}

size_t Q8RecordsFootprint(const common::ExpertWeights& expert, const KernelTable& kernels) {
  const common::DType type = expert.w1.layout.dtype;
  if ((type != common::DType::kInt8 && type != common::DType::kInt4) || kernels.TileFor(type) == nullptr) return 0;
  size_t bytes = 0;
  for (const common::MatrixView* view : {&expert.w1, &expert.w3, &expert.w2}) {
    bytes += common::AnonymousMemory::SizeFor(Q8RecordsBytes(view->layout));
  }
  return bytes;
}

absl::Status AttachQ8Records(common::ExpertWeights* expert, const KernelTable& kernels,
                             const common::AnonymousMemory::Options& options) {
  const common::DType type = expert->w1.layout.dtype;
  if (type != common::DType::kInt8 && type != common::DType::kInt4) {
    return absl::FailedPreconditionError(
        absl::StrCat("int8 tile records are for int8 or int4 weights, not ", common::DTypeName(type)));
  }
  if (kernels.TileFor(type) == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("the ", IsaName(kernels.isa), " kernels have no int8 tiles for ", common::DTypeName(type),
                     " (they need AVX512_VNNI and a profile that does not widen ", common::DTypeName(type), ")"));
  }
  for (common::MatrixView* view : {&expert->w1, &expert->w3, &expert->w2}) {
    COLIBRI_ASSIGN_OR_RETURN(auto memory, common::AnonymousMemory::Create(Q8RecordsBytes(view->layout), options));
    BuildQ8Records(*view, memory->data());
    view->q8_records = memory->data();
    expert->q8_records.push_back(std::move(memory));
  }
  return absl::OkStatus();
}

bool RunExperts(ThreadPool& pool, absl::Span<const ExpertTask> tasks, const float* x, int64_t d_model, float* dst,
                Workspace& workspace, const ExecutorOptions& options) {
  const std::vector<ExpertTask> order = ExecutionOrder(tasks);
  const absl::Span<const ExpertTask> all(order);
  size_t first = 0;
  for (size_t i = 1; i <= order.size(); ++i) {
    if (i < order.size() && SameShape(order[i], order[first])) continue;
    if (!RunSameShape(pool, all.subspan(first, i - first), x, d_model, dst, workspace, options)) return false;
    first = i;
  }
  return true;
}

}  // namespace kernels
}  // namespace colibri
