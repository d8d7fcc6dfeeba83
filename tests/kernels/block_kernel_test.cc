// Every block kernel variant the CPU allows, against the scalar reference:
// every weight type, ragged shapes (padded rows and columns), T from 1 to
// 129; a named tolerance, a guard against all-zero outputs, bitwise reruns.

#include "kernels/block_kernel.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/dispatch.h"
#include "kernels/swiglu.h"
#include "kernels/tile_bf16_amx.h"
#include "kernels/tile_q8_amx.h"
#include "tests/kernels/amx_emulator.h"

namespace colibri {
namespace kernels {
namespace {

using common::DType;

// |variant − reference| ≤ kRelTolerance · Σ_k |w_k · x_k| (kernels/README.md).
constexpr double kRelTolerance = 1e-5;

struct Matrix {
  std::vector<uint8_t> data;
  std::vector<float> scales;
  std::vector<uint8_t> zeros;
  common::MatrixView view;
};

Matrix MakeMatrix(DType type, int64_t rows, int64_t cols, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 0.1f);
  std::vector<float> w(rows * cols);
  for (float& v : w) v = normal(rng);
  Matrix m;
  const common::MatrixLayout l = common::ComputeMatrixLayout(type, rows, cols);
  m.data.resize(l.data_bytes);
  m.scales.resize(l.scale_bytes / 4);
  m.zeros.resize(l.zero_bytes);
  std::vector<float> block_src(common::kBlockRows * cols, 0.f);
  for (int64_t b = 0; b < l.num_blocks(); ++b) {
    common::EncodeBlock(l, w.data() + b * common::kBlockRows * cols, b, m.data.data() + b * l.block_bytes,
                        m.scales.data(), m.zeros.data());
  }
  m.view = {l, m.data.data(), m.scales.empty() ? nullptr : m.scales.data(), m.zeros.empty() ? nullptr : m.zeros.data()};
  return m;
}

struct Inputs {
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  std::vector<float> sums;
  std::vector<int8_t> q8;
  std::vector<float> q8_scales, q8_sums;
  std::vector<uint8_t> bf16_tiles, q8_tiles;  // in tile order: `acts` does not point to them
  Activations acts;
};

// in.acts, with the copies in tile order that the AMX tile kernels read instead.
Activations InTileOrder(const Inputs& in) {
  Activations a = in.acts;
  a.bf16_tiles = in.bf16_tiles.data();
  a.q8_tiles = in.q8_tiles.data();
  return a;
}

void Point(Inputs* in) {
  in->acts.f32 = in->f32.data();
  in->acts.bf16 = in->bf16.data();
  in->acts.group_sums = in->sums.data();
  in->acts.q8 = in->q8.data();
  in->acts.q8_scales = in->q8_scales.data();
  in->acts.q8_sums = in->q8_sums.data();
}

Inputs MakeInputs(int64_t tokens, int64_t cols, int64_t padded_cols, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  Inputs in;
  in.f32.assign(tokens * padded_cols, 0.f);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < cols; ++k) in.f32[t * padded_cols + k] = normal(rng);
  }
  for (float v : in.f32) in.bf16.push_back(common::FloatToBf16(v));
  const int64_t groups = tokens * padded_cols / 64;
  in.q8.resize(tokens * padded_cols);
  in.q8_scales.resize(groups);
  in.q8_sums.resize(groups);
  for (int64_t g = 0; g < groups; ++g) {
    float s = 0;
    for (int i = 0; i < 64; ++i) s += in.f32[g * 64 + i];
    in.sums.push_back(s);
    QuantizeGroupQ8(&in.f32[g * 64], &in.q8[g * 64], &in.q8_scales[g], &in.q8_sums[g]);
  }
  // Unused rows of a last partial group hold a marker a kernel must not read.
  in.bf16_tiles.assign(TileOrderBytes(tokens, padded_cols * 2), 0x7f);
  in.q8_tiles.assign(TileOrderBytes(tokens, padded_cols), 0x7f);
  for (int64_t t = 0; t < tokens; ++t) {
    CopyToTileOrder(&in.bf16[t * padded_cols], t, 0, padded_cols * 2, padded_cols * 2, in.bf16_tiles.data());
    CopyToTileOrder(&in.q8[t * padded_cols], t, 0, padded_cols, padded_cols, in.q8_tiles.data());
  }
  in.acts.num_tokens = tokens;
  in.acts.cols = padded_cols;
  Point(&in);
  return in;
}

// `in` with f32 = the int8 copy's values q8 · scale (and their group sums).
Inputs DequantizedQ8(const Inputs& in) {
  Inputs out = in;
  for (size_t i = 0; i < out.f32.size(); ++i) out.f32[i] = in.q8[i] * in.q8_scales[i / 64];
  for (size_t g = 0; g < out.sums.size(); ++g) {
    float s = 0;
    for (int i = 0; i < 64; ++i) s += out.f32[g * 64 + i];
    out.sums[g] = s;
  }
  Point(&out);
  return out;
}

// Σ_k |w_k x_k| for output j of block b, token t (the scale of rounding
// errors), on the bf16 copy of x when `bf16`.
double Magnitude(const common::MatrixView& w, int64_t row, const Inputs& in, int64_t t, bool bf16) {
  if (row >= w.layout.rows) return 0.0;
  std::vector<float> decoded(w.layout.cols);
  common::DecodeRow(w, row, decoded.data());
  double m = 0;
  for (int64_t k = 0; k < w.layout.cols; ++k) {
    const size_t i = t * w.layout.padded_cols + k;
    const double xv = bf16 ? common::Bf16ToFloat(in.bf16[i]) : in.f32[i];
    m += std::fabs(decoded[k] * xv);
  }
  return m;
}

// `in` reduced to its last token: a kernel's bits for a token must not
// depend on T or on where the token sits in the batch.
Inputs LastToken(const Inputs& in, int64_t tokens) {
  const int64_t K = in.acts.cols, groups = K / 64, t = tokens - 1;
  Inputs last = in;
  last.acts.num_tokens = 1;
  last.acts.f32 = in.f32.data() + t * K;
  last.acts.bf16 = in.bf16.data() + t * K;
  last.acts.group_sums = in.sums.data() + t * groups;
  last.acts.q8 = in.q8.data() + t * K;
  last.acts.q8_scales = in.q8_scales.data() + t * groups;
  last.acts.q8_sums = in.q8_sums.data() + t * groups;
  return last;
}

// Block b's outputs `actual` against the oracle's `expected` (both [T][64])
// within kRelTolerance of the products' magnitude on `oracle_in`; padding
// rows must be 0. `what` names the kernel and the case in a failure.
void CheckBlock(const std::string& what, const Matrix& m, int64_t b, const Inputs& oracle_in, bool bf16_acts,
                const std::vector<float>& expected, const std::vector<float>& actual, bool* nonzero) {
  for (int64_t t = 0; t < oracle_in.acts.num_tokens; ++t) {
    for (int64_t j = 0; j < 64; ++j) {
      const int64_t row = b * 64 + j;
      const double bound = kRelTolerance * Magnitude(m.view, row, oracle_in, t, bf16_acts) + 1e-30;
      const float e = expected[t * 64 + j], a = actual[t * 64 + j];
      if (std::fabs(double(a) - e) > bound) {
        FAIL(what << " block " << b << " token " << t << " row " << j << ": " << a << " vs reference " << e
                  << " (bound " << bound << ")");
      }
      if (row >= m.view.layout.rows) REQUIRE(a == 0.f);  // padding rows stay zero
      *nonzero |= a != 0.f;
    }
  }
}

// The tables to test: every level the CPU has, plus the plain AVX2 int8 and
// int4 kernels where AVX-VNNI replaces them in the avx2 table.
constexpr const char* kPlainAvx2 = "avx2 without AVX-VNNI";
std::vector<std::pair<std::string, KernelTable>> TablesToTest() {
  std::vector<std::pair<std::string, KernelTable>> tables;
  for (int isa_code = static_cast<int>(Isa::kAvx2); isa_code <= static_cast<int>(DetectIsa()); ++isa_code) {
    tables.emplace_back(IsaName(static_cast<Isa>(isa_code)), KernelsFor(static_cast<Isa>(isa_code)));
  }
  if (HasAvxVnni()) {
    KernelTable plain = KernelsFor(Isa::kAvx2);
    plain.block[static_cast<int>(DType::kInt8)] = BlockInt8Avx2;
    plain.block[static_cast<int>(DType::kInt4)] = BlockInt4Avx2;
    tables.emplace_back(kPlainAvx2, plain);
  }
  return tables;
}

TEST_CASE("every block kernel variant matches the scalar reference") {
  std::mt19937 rng(1234);
  // {rows, cols}: ragged; 300 columns are 5 groups of 64 (an odd count).
  // 1100 columns are 18 groups: the vector loops over groups and their tails.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{64, 64}, {130, 200}, {64, 300}, {70, 1100}};
  int variants_tested = 0;
  for (const auto& [name, table] : TablesToTest()) {
    const bool plain_int = name == kPlainAvx2;
    const KernelTable& reference = KernelsFor(Isa::kScalar);
    for (DType type : {DType::kF32, DType::kBF16, DType::kF16, DType::kInt8, DType::kInt4}) {
      if (plain_int && type != DType::kInt8 && type != DType::kInt4) continue;  // the avx2 table's own
      ++variants_tested;
      // The VNNI int4 and int8 kernels multiply x.q8: their oracle is the
      // scalar reference on those activations.
      const bool q8_acts = ReadsQ8(table.For(type));
      for (const auto& [rows, cols] : shapes) {
        const Matrix m = MakeMatrix(type, rows, cols, rng);
        for (int64_t tokens : {1, 2, 3, 7, 8, 64, 129}) {
          if (cols >= 1000 && tokens > 8) continue;  // keep the scalar oracle quick
          const Inputs in = MakeInputs(tokens, cols, m.view.layout.padded_cols, rng);
          const Inputs dequantized = DequantizedQ8(in);
          const Inputs& oracle_in = q8_acts ? dequantized : in;
          const Activations& oracle_acts = oracle_in.acts;
          const Inputs last = LastToken(in, tokens);
          const std::string what =
              absl::StrCat(name, " ", common::DTypeName(type), " [", rows, " x ", cols, "] T=", tokens);
          std::vector<float> expected(tokens * 64), actual(tokens * 64), again(tokens * 64), alone(64);
          bool nonzero = false;
          for (int64_t b = 0; b < m.view.layout.num_blocks(); ++b) {
            reference.For(type)(m.view, b, oracle_acts, expected.data());
            table.For(type)(m.view, b, in.acts, actual.data());
            table.For(type)(m.view, b, in.acts, again.data());
            REQUIRE(actual == again);  // bitwise deterministic
            table.For(type)(m.view, b, last.acts, alone.data());
            INFO(what << " block " << b << ": the last token alone");
            REQUIRE(std::equal(alone.begin(), alone.end(), actual.begin() + (tokens - 1) * 64));
            CheckBlock(what, m, b, oracle_in, type == DType::kBF16, expected, actual, &nonzero);
          }
          REQUIRE(nonzero);
        }
      }
    }
  }
  if (DetectIsa() == Isa::kScalar) WARN("this CPU has no AVX2: only the scalar kernels exist here");
  if (DetectIsa() >= Isa::kAvx2 && !HasAvxVnni()) WARN("this CPU has no AVX-VNNI: the avx2 VNNI kernels are untested");
  CHECK(variants_tested == 5 * static_cast<int>(DetectIsa()) + (HasAvxVnni() ? 2 : 0));
}

TEST_CASE("every block kernel variant with no token rows reads and writes nothing") {
  std::mt19937 rng(99);
  for (const auto& [name, table] : TablesToTest()) {
    for (DType type : {DType::kF32, DType::kBF16, DType::kF16, DType::kInt8, DType::kInt4}) {
      if (table.For(type) == nullptr) continue;
      const Matrix m = MakeMatrix(type, 64, 128, rng);
      Inputs in = MakeInputs(1, 128, m.view.layout.padded_cols, rng);
      in.acts.num_tokens = 0;  // an expert no row was routed to (the executor keeps such tasks)
      std::vector<float> out(64, 7.f);
      table.For(type)(m.view, 0, in.acts, out.data());
      INFO(name << " " << common::DTypeName(type));
      CHECK(std::all_of(out.begin(), out.end(), [](float v) { return v == 7.f; }));
    }
  }
}

TEST_CASE("the avx2 table runs int8 and int4 on AVX-VNNI exactly where the CPU has it") {
  if (DetectIsa() < Isa::kAvx2) return;
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  bool listed = false;  // the kernel's name for the cpuid bit
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) == 0) {
      listed = (line + " ").find(" avx_vnni ") != std::string::npos;
      break;
    }
  }
  CHECK(HasAvxVnni() == listed);
  CHECK(KernelsFor(Isa::kAvx2).For(DType::kInt8) == (listed ? BlockInt8Avx2Vnni : BlockInt8Avx2));
  CHECK(KernelsFor(Isa::kAvx2).For(DType::kInt4) == (listed ? BlockInt4Avx2Vnni : BlockInt4Avx2));
  CHECK(WidenedKernel(Isa::kAvx2, DType::kInt8) == (listed ? BlockInt8Avx2 : nullptr));
}

// Tile kernel `tile` of `type` against the scalar reference (on the int8
// activations for int8/int4, on the bf16 ones for bf16), over ragged shapes
// and token counts that leave partial tiles; `name` labels failures.
void CheckTileKernel(const std::string& name, DType type, TileKernelFn tile, std::mt19937& rng) {
  // {rows, cols}: ragged; 2200 columns make two k-chunks of a repacked int8 block.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{64, 64}, {130, 200}, {70, 1000}, {64, 2200}};
  const bool bf16 = type == DType::kBF16;
  for (const auto& [rows, cols] : shapes) {
    const Matrix m = MakeMatrix(type, rows, cols, rng);
    const int64_t K = m.view.layout.padded_cols;
    std::vector<uint8_t> buffer(TileQ8ScratchBytes(K) + 64);
    uint8_t* scratch = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64;
    for (int64_t tokens : {1, 2, 3, 4, 7, 17, 33, 64}) {
      if (cols >= 1000 && tokens > 7) continue;  // keep the scalar oracle quick
      const Inputs in = MakeInputs(tokens, cols, K, rng);
      const Inputs dequantized = DequantizedQ8(in);
      const Inputs& oracle_in = bf16 ? in : dequantized;
      const Inputs last = LastToken(in, tokens);
      const std::string what =
          absl::StrCat(name, " tile ", common::DTypeName(type), " [", rows, " x ", cols, "] T=", tokens);
      std::vector<float> expected(tokens * 64), actual(tokens * 64), again(tokens * 64), alone(64);
      bool nonzero = false;
      for (int64_t b = 0; b < m.view.layout.num_blocks(); ++b) {
        KernelsFor(Isa::kScalar).For(type)(m.view, b, oracle_in.acts, expected.data());
        tile(m.view, b, in.acts, scratch, actual.data());
        tile(m.view, b, in.acts, scratch, again.data());
        REQUIRE(actual == again);  // bitwise deterministic
        tile(m.view, b, InTileOrder(in), scratch, again.data());
        INFO(what << " block " << b << ": the activations in tile order");
        REQUIRE(actual == again);
        tile(m.view, b, last.acts, scratch, alone.data());
        INFO(what << " block " << b << ": the last token alone");
        REQUIRE(std::equal(alone.begin(), alone.end(), actual.begin() + (tokens - 1) * 64));
        CheckBlock(what, m, b, oracle_in, bf16, expected, actual, &nonzero);
      }
      REQUIRE(nonzero);
    }
  }
}

TEST_CASE("every tile kernel matches the scalar reference") {
  std::mt19937 rng(4321);
  int kernels_tested = 0;
  for (int isa_code = static_cast<int>(Isa::kAvx2); isa_code <= static_cast<int>(DetectIsa()); ++isa_code) {
    const KernelTable& table = KernelsFor(static_cast<Isa>(isa_code));
    for (DType type : {DType::kBF16, DType::kInt8, DType::kInt4}) {
      if (table.TileFor(type) == nullptr) continue;
      ++kernels_tested;
      CheckTileKernel(IsaName(table.isa), type, table.TileFor(type), rng);
    }
  }
  // int8 tiles exist with AVX512_VNNI (the avx512_bf16 level and above),
  // AMX bf16 tiles at avx512_amx.
  if (DetectIsa() < Isa::kAvx512Bf16) WARN("this CPU has no AVX512_VNNI: no int8 tile kernel to test here");
  if (DetectIsa() < Isa::kAvx512Amx) {
    WARN("no AMX here (or the kernel refused its tile state): the AMX tile kernels run on emulated tiles only");
  }
  const int vnni_levels = std::max(0, static_cast<int>(DetectIsa()) - static_cast<int>(Isa::kAvx512Bf16) + 1);
  CHECK(kernels_tested == 2 * vnni_levels + (DetectIsa() >= Isa::kAvx512Amx ? 1 : 0));
}

// The hardware kernel's walk on emulated tiles (tests/kernels/amx_emulator.h).
void TileBf16AmxEmulated(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t*, float* out) {
  TileBf16AmxWith<EmulatedTiles>(w, block, x, out);
}

// While it lives, the emulated tiles' prefetches must point into
// [begin, begin + bytes), and those to L1 into [l1, l1 + l1_bytes).
class PrefetchBounds {
 public:
  PrefetchBounds(const void* begin, size_t bytes, const void* l1, size_t l1_bytes) {
    EmulatedTiles::State& s = EmulatedTiles::state();
    s.prefetch_begin = reinterpret_cast<uintptr_t>(begin), s.prefetch_end = s.prefetch_begin + bytes;
    s.l1_begin = reinterpret_cast<uintptr_t>(l1), s.l1_end = s.l1_begin + l1_bytes;
  }
  ~PrefetchBounds() {
    EmulatedTiles::State& s = EmulatedTiles::state();
    s.prefetch_begin = s.l1_begin = 0, s.prefetch_end = s.l1_end = UINTPTR_MAX;
  }
  PrefetchBounds(const PrefetchBounds&) = delete;
  PrefetchBounds& operator=(const PrefetchBounds&) = delete;
};

TEST_CASE("the AMX bf16 tile walk matches the scalar reference on emulated tiles") {
  std::mt19937 rng(8642);
  CheckTileKernel("emulated AMX", DType::kBF16, TileBf16AmxEmulated, rng);
  // Token counts around the 16- and 32-row tiles, with a guard after the
  // outputs: rows past T are neither read (the inputs are exactly T rows,
  // which AddressSanitizer checks) nor written. 2200 columns are three
  // chunks of the walk (kTileBf16ChunkCols), whose partial sums wait in the
  // output between chunks: every token group's, the tail's too, with the
  // bits of a walk in one chunk. Prefetches stay in the matrix, those to L1
  // in the block.
  for (const auto& [rows, cols, token_counts] :
       {std::tuple<int64_t, int64_t, std::vector<int64_t>>{128, 96, {15, 16, 31, 32, 47, 48, 129}},
        {64, 2200, {17, 47}}}) {
    const Matrix m = MakeMatrix(DType::kBF16, rows, cols, rng);
    const int64_t K = m.view.layout.padded_cols;
    for (int64_t tokens : token_counts) {
      const Inputs in = MakeInputs(tokens, cols, K, rng);
      const Inputs last = LastToken(in, tokens);
      std::vector<float> expected(tokens * 64), actual(tokens * 64 + 64, -7.f), alone(64);
      bool nonzero = false;
      for (int64_t b = 0; b < m.view.layout.num_blocks(); ++b) {
        const std::string what = absl::StrCat("emulated AMX [", rows, " x ", cols, "] T=", tokens, " block ", b);
        BlockBf16Scalar(m.view, b, in.acts, expected.data());
        const EmulatedTiles::State before = EmulatedTiles::state();
        {
          const PrefetchBounds bounds(m.view.data, m.view.layout.data_bytes,
                                      m.view.data + b * m.view.layout.block_bytes, m.view.layout.block_bytes);
          TileBf16AmxEmulated(m.view, b, in.acts, nullptr, actual.data());
        }
        const EmulatedTiles::State& after = EmulatedTiles::state();
        // Two output groups per token group, for each k-step of 32.
        CHECK(after.dot_products - before.dot_products == 4 * ((tokens + 15) / 16) * (K / 32));
        if (K > kTileBf16ChunkCols) {  // some lines ahead in both caches
          CHECK(after.prefetches > before.prefetches);
          CHECK(after.l1_prefetches > before.l1_prefetches);
        }
        std::vector<float> one_chunk(tokens * 64);
        TileBf16AmxWith<EmulatedTiles, 1 << 20>(m.view, b, in.acts, one_chunk.data());
        INFO(what << ": in one chunk");
        REQUIRE(std::equal(one_chunk.begin(), one_chunk.end(), actual.begin()));
        CHECK(std::all_of(actual.end() - 64, actual.end(), [](float v) { return v == -7.f; }));
        CheckBlock(what, m, b, in, true, expected, std::vector<float>(actual.begin(), actual.end() - 64), &nonzero);
        std::vector<float> tiled(tokens * 64);
        TileBf16AmxEmulated(m.view, b, InTileOrder(in), nullptr, tiled.data());
        INFO(what << ": the activations in tile order");
        REQUIRE(std::equal(tiled.begin(), tiled.end(), actual.begin()));
        TileBf16AmxEmulated(m.view, b, last.acts, nullptr, alone.data());
        INFO(what << ": the last token alone");
        REQUIRE(std::equal(alone.begin(), alone.end(), actual.begin() + (tokens - 1) * 64));
      }
      REQUIRE(nonzero);
    }
  }
  // The walk leaves the tiles released, as the hardware kernel does.
  CHECK_FALSE(EmulatedTiles::state().configured);
}

// The hardware kernels' walks on emulated tiles.
void TileInt8AmxEmulated(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* scratch,
                         float* out) {
  TileQ8AmxWith<EmulatedTiles, false>(w, block, x, scratch, out);
}
void TileInt4AmxEmulated(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* scratch,
                         float* out) {
  TileQ8AmxWith<EmulatedTiles, true>(w, block, x, scratch, out);
}

TEST_CASE("the AMX int8 and int4 tile walks give the VNNI tiles' bits on emulated tiles") {
  if (DetectIsa() < Isa::kAvx512Bf16) {  // the repacking is AVX-512 code, the VNNI tiles the reference
    WARN("this CPU has no AVX512_VNNI: the AMX int8/int4 walks are not tested here");
    return;
  }
  std::mt19937 rng(97531);
  for (auto [type, emulated] : {std::pair<DType, TileKernelFn>{DType::kInt8, TileInt8AmxEmulated},
                                std::pair<DType, TileKernelFn>{DType::kInt4, TileInt4AmxEmulated}}) {
    CheckTileKernel("emulated AMX", type, emulated, rng);
    // Token counts around the 16- and 32-row tiles, over two repacked chunks
    // (35 groups), bit for bit against the VNNI tiles, with a guard after
    // the outputs.
    const Matrix m = MakeMatrix(type, 128, 2200, rng);
    const int64_t K = m.view.layout.padded_cols;
    std::vector<uint8_t> buffer(TileQ8ScratchBytes(K) + 64);
    uint8_t* scratch = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64;
    for (int64_t tokens : {1, 15, 16, 17, 31, 32, 33, 47, 64, 129}) {
      const Inputs in = MakeInputs(tokens, 2200, K, rng);
      std::vector<float> expected(tokens * 64), actual(tokens * 64 + 64, -7.f);
      for (int64_t b = 0; b < m.view.layout.num_blocks(); ++b) {
        INFO(common::DTypeName(type) << " T=" << tokens << " block " << b);
        KernelsFor(Isa::kAvx512Bf16).TileFor(type)(m.view, b, in.acts, scratch, expected.data());
        const int64_t before = EmulatedTiles::state().dot_products;
        emulated(m.view, b, in.acts, scratch, actual.data());
        // Two output groups per token group, for each of the 35 groups and both halves of the 64 outputs.
        CHECK(EmulatedTiles::state().dot_products - before == 2 * ((tokens + 15) / 16) * 35 * 2);
        CHECK(std::all_of(actual.end() - 64, actual.end(), [](float v) { return v == -7.f; }));
        REQUIRE(std::equal(expected.begin(), expected.end(), actual.begin()));
        emulated(m.view, b, InTileOrder(in), scratch, actual.data());
        REQUIRE(std::equal(expected.begin(), expected.end(), actual.begin()));
        CHECK(std::all_of(actual.end() - 64, actual.end(), [](float v) { return v == -7.f; }));
      }
    }
    CHECK(Q8TileSelfCheck(type, emulated));
  }
  CHECK_FALSE(EmulatedTiles::state().configured);
}

TEST_CASE("int8 tile records built once (int4's packed) give the bits of the per-call repacking, which they replace") {
  if (DetectIsa() < Isa::kAvx512Bf16) {
    WARN("this CPU has no AVX512_VNNI: no int8 tiles, no records to test here");
    return;
  }
  std::mt19937 rng(8642);
  for (DType type : {DType::kInt8, DType::kInt4}) {
    const Matrix m = MakeMatrix(type, 130, 2200, rng);  // 3 blocks (padded rows), 35 groups: two chunks
    const int64_t K = m.view.layout.padded_cols;
    // int4's records keep the nibbles packed: 2.5 KiB per 64 × 64 weights, not int8's 4.5.
    CHECK(Q8RecordsBytes(m.view.layout) ==
          static_cast<size_t>(m.view.layout.num_blocks() * (K / 64) * (type == DType::kInt4 ? 2560 : 4608)));
    std::vector<uint8_t> records_buffer(Q8RecordsBytes(m.view.layout) + 64);
    uint8_t* records = records_buffer.data() + (64 - reinterpret_cast<uintptr_t>(records_buffer.data()) % 64) % 64;
    BuildQ8Records(m.view, records);
    common::MatrixView with_records = m.view;
    with_records.q8_records = records;
    std::vector<uint8_t> buffer(TileQ8ScratchBytes(K) + 64);
    uint8_t* scratch = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64;
    const TileKernelFn vnni = KernelsFor(Isa::kAvx512Bf16).TileFor(type);
    const TileKernelFn amx = type == DType::kInt8 ? TileInt8AmxEmulated : TileInt4AmxEmulated;
    for (int64_t tokens : {1, 2, 3, 5, 7, 17, 64, 129}) {  // every token tile of the VNNI kernel
      const Inputs in = MakeInputs(tokens, 2200, K, rng);
      for (int64_t b = 0; b < m.view.layout.num_blocks(); ++b) {
        for (auto [name, kernel] : {std::pair<const char*, TileKernelFn>{"VNNI", vnni}, {"emulated AMX", amx}}) {
          INFO(name << " " << common::DTypeName(type) << " T=" << tokens << " block " << b);
          std::vector<float> repacked(tokens * 64), read(tokens * 64 + 64, -7.f);
          // The emulated walk prefetches the next chunk of the rows, or of the records.
          const int64_t prefetches = EmulatedTiles::state().prefetches;
          {
            const PrefetchBounds rows(m.view.data, m.view.layout.data_bytes, nullptr, 0);
            kernel(m.view, b, in.acts, scratch, repacked.data());
          }
          std::fill(buffer.begin(), buffer.end(), uint8_t{0xa5});
          {
            const PrefetchBounds read_records(records, Q8RecordsBytes(m.view.layout), nullptr, 0);
            kernel(with_records, b, in.acts, scratch, read.data());
          }
          if (kernel == amx) CHECK(EmulatedTiles::state().prefetches > prefetches);
          // Nothing repacked (the AMX tiles unpack int4's packed records into the scratch, from cache).
          if (type == DType::kInt8 || kernel == vnni) {
            CHECK(std::all_of(buffer.begin(), buffer.end(), [](uint8_t v) { return v == 0xa5; }));
          }
          CHECK(std::all_of(read.end() - 64, read.end(), [](float v) { return v == -7.f; }));
          REQUIRE(std::equal(repacked.begin(), repacked.end(), read.begin()));
        }
      }
    }
  }
  CHECK_FALSE(EmulatedTiles::state().configured);
}

// The scalar bf16 kernel with one output of one token off by one unit in
// the last place: what the self-check must catch.
void OffByOneUlp(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t*, float* out) {
  BlockBf16Scalar(w, block, x, out);
  out[16 * 64 + 63] = std::nextafter(out[16 * 64 + 63], INFINITY);
}

// The VNNI int8 tiles with one output of one token off by one unit in the
// last place.
void Int8TilesOffByOneUlp(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* scratch,
                          float* out) {
  TileInt8Vnni(w, block, x, scratch, out);
  out[16 * 64 + 63] = std::nextafter(out[16 * 64 + 63], INFINITY);
}

TEST_CASE("the int8 tile self-check catches one wrong output") {
  if (DetectIsa() < Isa::kAvx512Bf16) {
    WARN("this CPU has no AVX512_VNNI: the int8 tile self-check is not tested here");
    return;
  }
  CHECK(Q8TileSelfCheck(DType::kInt8, TileInt8Vnni));
  CHECK_FALSE(Q8TileSelfCheck(DType::kInt8, Int8TilesOffByOneUlp));
  if (DetectIsa() >= Isa::kAvx512Amx) {
    CHECK(Q8TileSelfCheck(DType::kInt8, TileInt8Amx));
    CHECK(Q8TileSelfCheck(DType::kInt4, TileInt4Amx));
  }
}

TEST_CASE("the bf16 tile self-check passes the AMX walk and catches one wrong output") {
  CHECK(Bf16TileSelfCheck(TileBf16AmxEmulated));
  CHECK(Bf16TileSelfCheck([](const common::MatrixView& w, int64_t block, const Activations& x, uint8_t*, float* out) {
    BlockBf16Scalar(w, block, x, out);
  }));
  CHECK_FALSE(Bf16TileSelfCheck(OffByOneUlp));
  if (DetectIsa() >= Isa::kAvx512Amx) CHECK(Bf16TileSelfCheck(TileBf16Amx));
}

TEST_CASE("a 64-input group quantizes to int8 by its largest magnitude") {
  float x[64];
  for (int i = 0; i < 64; ++i) x[i] = 0.01f * (i - 20);  // max |x| = 0.43 at i = 63
  int8_t q[64];
  float scale = -1, sum = -1;
  QuantizeGroupQ8(x, q, &scale, &sum);
  CHECK(scale == x[63] / 127.f);
  CHECK(q[63] == 127);
  CHECK(q[20] == 0);
  int total = 0;
  for (int i = 0; i < 64; ++i) {
    CHECK(std::fabs(q[i] * scale - x[i]) <= scale / 2 * 1.0001f);  // round to nearest
    total += q[i];
  }
  CHECK(sum == scale * static_cast<float>(total));
  float zeros[64] = {};
  QuantizeGroupQ8(zeros, q, &scale, &sum);
  CHECK(scale == 0.f);
  CHECK(sum == 0.f);
  for (int8_t v : q) CHECK(v == 0);
}

TEST_CASE("every SwiGLU variant matches the scalar one") {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.f, 3.f);
  float a[64], b[64];
  for (int round = 0; round < 50; ++round) {
    for (int i = 0; i < 64; ++i) {
      a[i] = normal(rng);
      b[i] = normal(rng);
    }
    if (round == 0) {  // the extremes of SiLU
      a[0] = 0.f, a[1] = 100.f, a[2] = -100.f, a[3] = 1000.f, a[4] = -1000.f, a[5] = 1e-30f;
    }
    float h_ref[64], sum_ref;
    uint16_t bf_ref[64];
    SwiGluScalar(a, b, h_ref, bf_ref, &sum_ref);
    for (int isa_code = static_cast<int>(Isa::kAvx2); isa_code <= static_cast<int>(DetectIsa()); ++isa_code) {
      const KernelTable& table = KernelsFor(static_cast<Isa>(isa_code));
      float h[64], sum;
      uint16_t bf[64];
      table.swiglu(a, b, h, bf, &sum);
      double magnitude = 0;
      for (int i = 0; i < 64; ++i) {
        INFO(IsaName(table.isa) << " a=" << a[i] << " b=" << b[i]);
        REQUIRE(std::isfinite(h[i]));
        REQUIRE(std::fabs(h[i] - h_ref[i]) <= 5e-7 * std::fabs(h_ref[i]) + 1e-30);
        REQUIRE(bf[i] == common::FloatToBf16(h[i]));  // its own h, rounded to nearest even
        magnitude += std::fabs(h_ref[i]);
      }
      REQUIRE(std::fabs(sum - sum_ref) <= 1e-5 * magnitude);
    }
  }
}

TEST_CASE("int8 and int4 blocks dequantize to bf16 tiles exactly, in every variant") {
  std::mt19937 rng(77);
  for (DType type : {DType::kInt8, DType::kInt4}) {
    for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{64, 64}, {130, 200}, {64, 4096}}) {
      const Matrix m = MakeMatrix(type, rows, cols, rng);
      const int64_t k = m.view.layout.padded_cols;
      std::vector<float> decoded(cols);
      for (int64_t b = 0; b < m.view.layout.num_blocks(); ++b) {
        std::vector<uint16_t> expected(64 * k, 0);
        for (int64_t j = 0; j < 64 && b * 64 + j < rows; ++j) {
          common::DecodeRow(m.view, b * 64 + j, decoded.data());
          for (int64_t c = 0; c < cols; ++c) expected[((c / 2) * 64 + j) * 2 + c % 2] = common::FloatToBf16(decoded[c]);
        }
        for (int isa_code = 0; isa_code <= static_cast<int>(DetectIsa()); ++isa_code) {
          const KernelTable& table = KernelsFor(static_cast<Isa>(isa_code));
          std::vector<uint16_t> tile(64 * k, 0xffff);
          table.dequant_bf16(m.view, b, tile.data());
          INFO(IsaName(table.isa) << " " << common::DTypeName(type) << " [" << rows << " x " << cols << "] block "
                                  << b);
          REQUIRE(tile == expected);
        }
      }
    }
  }
}

TEST_CASE("ISA names parse and the cap never exceeds the CPU") {
  for (Isa isa : kIsas) {
    auto parsed = ParseIsa(IsaName(isa));
    REQUIRE(parsed.ok());
    CHECK(*parsed == isa);
  }
  CHECK_FALSE(ParseIsa("sse9").ok());
  CHECK(*ParseIsa(" AVX2\n") == Isa::kAvx2);  // as an environment variable may carry it
  CHECK(SelectedKernels().isa <= DetectIsa());
  for (DType type : {DType::kF32, DType::kBF16, DType::kF16, DType::kInt8, DType::kInt4}) {
    CHECK(SelectedKernels().For(type) != nullptr);
  }
}

}  // namespace
}  // namespace kernels
}  // namespace colibri
