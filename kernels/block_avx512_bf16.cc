// Block kernels with AVX512_BF16 (vdpbf16ps); this file's own compile flags
// add -mavx512bf16 to the AVX-512 ones.
//
// bf16 weights:
// The stored layout [K/2][64][2] is the VNNI-pair layout vdpbf16ps reads: the
// 4 zmm of input pair p hold, per 32-bit lane, (w[2p], w[2p+1]) of 16
// consecutive outputs. A tile of up to 6 tokens keeps 4 accumulators per token
// (its 64 outputs); per pair it loads the 4 weight vectors once and, for each
// token, broadcasts the 32-bit pair (x[t][2p], x[t][2p+1]) of x.bf16 and does
// acc += w_even·x_even + w_odd·x_odd with one vdpbf16ps per vector: 24
// accumulators + 4 weights + 1 broadcast registers. Pairs run in increasing
// order, so each token's bits depend on nothing but its own inputs (not on T
// or on its place in the batch). When T needs more than one tile, k is split
// into chunks of 256 KiB of weights and all tiles run over a chunk before the
// next one (partial sums wait in `out`, exactly), so tiles after the first
// read the chunk from L2 instead of memory.

#include "kernels/x86_simd.h"

#include <algorithm>
#include <cstring>

#include "kernels/block_kernel.h"

namespace colibri {
namespace kernels {
namespace {

using common::kBlockRows;

constexpr int64_t kMaxTile = 6;             // tokens per tile
constexpr int64_t kChunkBytes = 256 << 10;  // weights per k-chunk when T > kMaxTile
constexpr int64_t kPairBytes = 64 * 2 * 2;  // one input pair of the block: 4 zmm

inline __m512bh AsBf16(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// Tokens [t0, t0 + TT), inputs [k0, k1) (even bounds).
template <int TT>
void Tile(const uint8_t* wb, const Activations& x, int64_t t0, int64_t k0, int64_t k1, float* out) {
  float* o = out + t0 * kBlockRows;
  __m512 acc[TT][4];
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      acc[t][i] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o + t * kBlockRows + 16 * i);
    }
  }
  const uint16_t* xs = x.bf16 + t0 * x.cols;
  const uint8_t* p = wb + (k0 / 2) * kPairBytes;
  for (int64_t k = k0; k < k1; k += 2, p += kPairBytes) {
    __m512bh w[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) w[i] = AsBf16(_mm512_loadu_si512(p + 64 * i));
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      int32_t pair;
      std::memcpy(&pair, xs + t * x.cols + k, 4);
      const __m512bh xv = AsBf16(_mm512_set1_epi32(pair));
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) acc[t][i] = _mm512_dpbf16_ps(acc[t][i], w[i], xv);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(o + t * kBlockRows + 16 * i, acc[t][i]);
  }
}

using TileFn = void (*)(const uint8_t*, const Activations&, int64_t, int64_t, int64_t, float*);
constexpr TileFn kTiles[kMaxTile] = {Tile<1>, Tile<2>, Tile<3>, Tile<4>, Tile<5>, Tile<6>};

// int4 weights, on the bf16 copy of x. Per row and 64-input group (32
// bytes: byte j holds input j in its low nibble, input j + 32 in its high),
// the 32 bytes widen to 32 words; each nibble plus (15 − zero) indexes a
// 31-entry table of bf16(i − 15), so the word holds w̃ = q − zero exactly (an
// integer in [−15, 15]); two vdpbf16ps take inputs 0-31 and 32-63 against
// 32 consecutive x.bf16 each (pair order matches), and acc += scale · dot.
// Every product w̃·x̃ is exact in f32: the result is Σ_g s_g Σ_k w̃ x̃ with f32
// sums — the scalar reference on bf16(x), in another order. ~3 zmm ops per
// 16 weights, against ~5 converting nibbles to f32 (block_avx512.cc).
template <int R, int TT>
void Int4Tile(const common::MatrixView& w, int64_t block, const Activations& x, int64_t r0, int64_t t0, float* out) {
  const int64_t K = x.cols, groups = w.layout.groups, n0 = block * kBlockRows + r0;
  const uint8_t* rows = w.data + block * w.layout.block_bytes + r0 * (K / 2);
  const float* scales = w.scales + n0 * groups;
  const uint8_t* zeros = w.zeros + n0 * groups;
  const uint16_t* xs = x.bf16 + t0 * K;
  alignas(64) static constexpr uint16_t kTable[32] = {  // bf16(i − 15), i < 31
      0xc170, 0xc160, 0xc150, 0xc140, 0xc130, 0xc120, 0xc110, 0xc100, 0xc0e0, 0xc0c0, 0xc0a0,
      0xc080, 0xc040, 0xc000, 0xbf80, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0,
      0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x0000};
  const __m512i table = _mm512_load_si512(kTable);
  const __m512i low = _mm512_set1_epi16(0x0f);
  __m512 acc[R][TT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    // The next R rows (R * K / 2 bytes), R * 32 bytes a group.
#pragma GCC unroll 8
    for (int i = 0; i < R / 2; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(rows + R * (K / 2) + g * 32 * R + 64 * i), _MM_HINT_T1);
    }
    __m512bh xl[TT], xh[TT];
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      xl[t] = AsBf16(_mm512_loadu_si512(xs + t * K + g * 64));
      xh[t] = AsBf16(_mm512_loadu_si512(xs + t * K + g * 64 + 32));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i v =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + r * (K / 2) + g * 32)));
      const __m512i shift = _mm512_set1_epi16(static_cast<int16_t>(15 - zeros[r * groups + g]));
      const __m512bh wl = AsBf16(_mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_and_si512(v, low), shift), table));
      const __m512bh wh = AsBf16(_mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_srli_epi16(v, 4), shift), table));
      const __m512 s = _mm512_set1_ps(scales[r * groups + g]);
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        const __m512 dot = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), wl, xl[t]), wh, xh[t]);
        acc[r][t] = _mm512_fmadd_ps(s, dot, acc[r][t]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) out[(t0 + t) * kBlockRows + r0 + r] = _mm512_reduce_add_ps(acc[r][t]);
  }
}

using Int4TileFn = void (*)(const common::MatrixView&, int64_t, const Activations&, int64_t, int64_t, float*);

}  // namespace

void BlockInt4Avx512Bf16(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  // T = 1: 4 rows a tile; else token tiles of up to 4 (outer, so the tile's
  // x stays in cache) times 2 rows. Each (row, token) sees the same
  // operations in the same order either way.
  const int64_t T = x.num_tokens;
  if (T == 1) {
    for (int64_t r0 = 0; r0 < kBlockRows; r0 += 4) Int4Tile<4, 1>(w, block, x, r0, 0, out);
    return;
  }
  constexpr Int4TileFn kInt4Tiles[4] = {Int4Tile<2, 1>, Int4Tile<2, 2>, Int4Tile<2, 3>, Int4Tile<2, 4>};
  for (int64_t t0 = 0; t0 < T; t0 += 4) {
    const Int4TileFn tile = kInt4Tiles[std::min<int64_t>(4, T - t0) - 1];
    for (int64_t r0 = 0; r0 < kBlockRows; r0 += 2) tile(w, block, x, r0, t0, out);
  }
}

void BlockBf16Avx512Bf16(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  const int64_t K = x.cols, T = x.num_tokens;
  const int64_t chunk = T <= kMaxTile ? K : std::max<int64_t>(64, kChunkBytes / (kPairBytes / 2) / 64 * 64);
  const uint8_t* wb = w.data + block * w.layout.block_bytes;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = std::min(K, k0 + chunk);
    for (int64_t t0 = 0; t0 < T; t0 += kMaxTile) kTiles[std::min(kMaxTile, T - t0) - 1](wb, x, t0, k0, k1, out);
  }
}

}  // namespace kernels
}  // namespace colibri
