// AVX-512 (F/BW/VL/DQ) block kernels (contract in kernels/block_kernel.h,
// vocabulary in kernels/README.md). Compiled with the AVX-512 flags only (no
// avx512_bf16, no VNNI); block_avx512_bf16.cc has the vdpbf16ps variant.
//
//  * Blocked float layouts (f32 and f16 [K][64], bf16 [K/2][64][2]): a tile of
//    up to 6 tokens (5 for bf16) keeps 4 zmm accumulators per token (its 64
//    outputs); per k the 4 weight vectors are loaded (f16 widened with
//    vcvtph2ps, bf16 pairs split into even/odd k by shift and mask) once and
//    multiplied into every token of the tile with a broadcast x value. When T
//    spans several tiles, k is walked in 256 KiB chunks of weights so later
//    tiles read the chunk from L2; partial sums wait in `out`, exactly. The
//    weights are prefetched into L2 kStreamAheadBytes ahead (x86_simd.h).
//  * int8 (row-major): one 16-lane accumulator per (row, token), reduced once
//    per row and scaled; 8 rows at a time at T=1, else 4 rows x up to 4 tokens.
//  * int4 (row-major, nibbles j / j+32 per byte): per 64-input group the
//    nibbles are widened and converted, a per-group dot product is scaled into
//    the accumulator, and the zero points are subtracted at the end as
//    Σ_g s·z·group_sum. The next rows are prefetched into L2 (measured: int8
//    21 -> 31 GB/s, int4 10 -> 15 GB/s on one core).
// Every output is summed in an order that depends on k only, so a token's
// bits do not depend on T or on the other tokens of the batch.

#include "kernels/x86_simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/block_kernel.h"
#include "kernels/int4_avx512.h"

namespace colibri {
namespace kernels {
namespace {

using common::kBlockRows;

// Weights of one k-chunk when T spans several tiles: well inside L2. (At one
// zmm FMA a cycle L3 keeps up too, and chunking measured neutral here; it
// bounds the L3 traffic when compute is faster or the other core streams.)
constexpr int64_t kChunkBytes = 256 << 10;

// ---------------------------------------------------------------------------
// Blocked float layouts.

// The accumulators of a tile: start at zero (first chunk) or where the
// previous chunk left them in `out`.
template <int TT>
inline void LoadAcc(__m512 (&acc)[TT][4], const float* out, bool first) {
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      acc[t][i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + t * kBlockRows + 16 * i);
    }
  }
}

template <int TT>
inline void StoreAcc(__m512 (&acc)[TT][4], float* out) {
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out + t * kBlockRows + 16 * i, acc[t][i]);
  }
}

// f32 [K][64]: the 64 weights of input k are 4 plain loads.
struct F32Weights {
  static constexpr int64_t kBytesPerK = 64 * 4;
  static inline void Load(const uint8_t* p, __m512 (&w)[4]) {
    const float* f = reinterpret_cast<const float*>(p);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) w[i] = _mm512_loadu_ps(f + 16 * i);
  }
};

// f16 [K][64]: 4 x 16 halfs converted by vcvtph2ps.
struct F16Weights {
  static constexpr int64_t kBytesPerK = 64 * 2;
  static inline void Load(const uint8_t* p, __m512 (&w)[4]) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      w[i] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * i)));
    }
  }
};

// Tokens [t0, t0 + TT), inputs [k0, k1): acc[t][i] += w_i(k) * x[t][k].
template <int TT, class Weights>
void FloatTile(const uint8_t* wb, const Activations& x, int64_t t0, int64_t k0, int64_t k1, float* out) {
  __m512 acc[TT][4];
  LoadAcc<TT>(acc, out + t0 * kBlockRows, k0 == 0);
  const float* xs = x.f32 + t0 * x.cols;
  const uint8_t* p = wb + k0 * Weights::kBytesPerK;
  for (int64_t k = k0; k < k1; ++k, p += Weights::kBytesPerK) {
    PrefetchStreamAhead<Weights::kBytesPerK / 64>(p);
    __m512 w[4];
    Weights::Load(p, w);
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      const __m512 xv = _mm512_set1_ps(xs[t * x.cols + k]);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) acc[t][i] = _mm512_fmadd_ps(w[i], xv, acc[t][i]);
    }
  }
  StoreAcc<TT>(acc, out + t0 * kBlockRows);
}

// bf16 [K/2][64][2] without vdpbf16ps: each 32-bit lane holds (w[2p], w[2p+1])
// of one output; the even weight is the lane shifted left by 16, the odd one
// the lane with its low half cleared, and likewise for the broadcast x pair.
// Even k then odd k, so the order is plain increasing k. Tiles of 5 tokens:
// 20 accumulators + 4 raw + 4 converted weights fit the 32 registers.
template <int TT>
void Bf16ShiftTile(const uint8_t* wb, const Activations& x, int64_t t0, int64_t k0, int64_t k1, float* out) {
  __m512 acc[TT][4];
  LoadAcc<TT>(acc, out + t0 * kBlockRows, k0 == 0);
  const uint16_t* xs = x.bf16 + t0 * x.cols;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const uint8_t* p = wb + k0 * 128;
  for (int64_t k = k0; k < k1; k += 2, p += 256) {
    PrefetchStreamAhead<4>(p);
    __m512i raw[4];
    __m512 w[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      raw[i] = _mm512_loadu_si512(p + 64 * i);
      w[i] = _mm512_castsi512_ps(_mm512_slli_epi32(raw[i], 16));
    }
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      int32_t pair;
      std::memcpy(&pair, xs + t * x.cols + k, 4);
      const __m512 xv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_set1_epi32(pair), 16));
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) acc[t][i] = _mm512_fmadd_ps(w[i], xv, acc[t][i]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) w[i] = _mm512_castsi512_ps(_mm512_and_si512(raw[i], high));
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      int32_t pair;
      std::memcpy(&pair, xs + t * x.cols + k, 4);
      const __m512 xv = _mm512_castsi512_ps(_mm512_and_si512(_mm512_set1_epi32(pair), high));
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) acc[t][i] = _mm512_fmadd_ps(w[i], xv, acc[t][i]);
    }
  }
  StoreAcc<TT>(acc, out + t0 * kBlockRows);
}

using TileFn = void (*)(const uint8_t*, const Activations&, int64_t, int64_t, int64_t, float*);

// Runs the tiles (tiles[n - 1] handles n tokens, n <= max_tile) over the
// k-chunks of one block. The chunking changes no result: each token's sums
// still see k in increasing order.
void RunBlocked(const common::MatrixView& w, int64_t block, const Activations& x, float* out, const TileFn* tiles,
                int64_t max_tile) {
  const int64_t K = x.cols, T = x.num_tokens;
  const int64_t bytes_per_k = static_cast<int64_t>(w.layout.block_bytes) / K;
  const int64_t chunk = T <= max_tile ? K : std::max<int64_t>(64, kChunkBytes / bytes_per_k / 64 * 64);
  const uint8_t* wb = w.data + block * w.layout.block_bytes;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = std::min(K, k0 + chunk);
    for (int64_t t0 = 0; t0 < T; t0 += max_tile) {
      tiles[std::min(max_tile, T - t0) - 1](wb, x, t0, k0, k1, out);
    }
  }
}

constexpr TileFn kF32Tiles[] = {FloatTile<1, F32Weights>, FloatTile<2, F32Weights>, FloatTile<3, F32Weights>,
                                FloatTile<4, F32Weights>, FloatTile<5, F32Weights>, FloatTile<6, F32Weights>};
constexpr TileFn kF16Tiles[] = {FloatTile<1, F16Weights>, FloatTile<2, F16Weights>, FloatTile<3, F16Weights>,
                                FloatTile<4, F16Weights>, FloatTile<5, F16Weights>, FloatTile<6, F16Weights>};
constexpr TileFn kBf16Tiles[] = {Bf16ShiftTile<1>, Bf16ShiftTile<2>, Bf16ShiftTile<3>, Bf16ShiftTile<4>,
                                 Bf16ShiftTile<5>};

// ---------------------------------------------------------------------------
// Row-major int8 / int4.

// Prefetch into L2 of base + offset (may lie past the block, even past the
// matrix: a prefetch never faults). Without it the R row streams at T = 1,
// each only K bytes long, got 21 GB/s for int8 (10 for int4) where a read
// probe got 31; with it, 31 (14-15). Into L1 instead it was slower (16).
inline void PrefetchL2(const void* base, int64_t offset) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + offset), _MM_HINT_T1);
}

// int8: rows [r0, r0 + R) of the block times tokens [t0, t0 + TT).
// Per 16 inputs: sign-extend 16 bytes to int32, convert, FMA with x; out =
// scale · Σ lanes. (3 zmm ops per 16 weights: ~31 GB/s on one core here.)
template <int R, int TT>
void Int8Tile(const int8_t* q, const float* scales, const Activations& x, int64_t r0, int64_t t0, float* out) {
  const int64_t K = x.cols;
  const int8_t* rows = q + r0 * K;
  const float* xs = x.f32 + t0 * K;
  __m512 acc[R][TT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; k += 16) {
    // The next R rows (R * K bytes), R * 16 bytes a step.
#pragma GCC unroll 8
    for (int i = 0; i < R / 4; ++i) PrefetchL2(rows, R * K + k * R + 64 * i);
    __m512 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + r * K + k));
      wv[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    }
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      const __m512 xv = _mm512_loadu_ps(xs + t * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      out[(t0 + t) * kBlockRows + r0 + r] = scales[r0 + r] * _mm512_reduce_add_ps(acc[r][t]);
    }
  }
}

// int4: per 64-input group g, dot = Σ q·x over the group (16 lanes: the low
// nibbles of bytes 0-15 (inputs 0-15), their high nibbles (inputs 32-47),
// then bytes 16-31 likewise), acc += s_g · dot. The zero points come off at
// the end: out = Σ lanes(acc) − Σ_g s_g·z_g·group_sum_g, 16 groups a vector.
// ~3.5 zmm ops per 16 weights (8 bytes): compute-bound near 15 GB/s on one
// core of a double-pumped AVX-512 core (a vpermps nibble lookup instead of
// and + vcvtdq2ps measured no faster).
template <int R, int TT>
void Int4Tile(const common::MatrixView& w, int64_t block, const Activations& x, int64_t r0, int64_t t0, float* out) {
  const int64_t K = x.cols, groups = w.layout.groups, n0 = block * kBlockRows + r0;
  const uint8_t* rows = w.data + block * w.layout.block_bytes + r0 * (K / 2);
  const float* scales = w.scales + n0 * groups;
  const uint8_t* zeros = w.zeros + n0 * groups;
  const float* xs = x.f32 + t0 * K;
  const __m512i low = _mm512_set1_epi32(0x0f);
  __m512 acc[R][TT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    // The next R rows (R * K / 2 bytes), R * 32 bytes a group.
#pragma GCC unroll 8
    for (int i = 0; i < R / 2; ++i) PrefetchL2(rows, R * (K / 2) + g * 32 * R + 64 * i);
    __m512 dot[R][TT];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // bytes 16h..16h+15: inputs 16h.. and 32+16h..
      __m512 lo[R], hi[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + r * (K / 2) + g * 32 + 16 * h));
        const __m512i v = _mm512_cvtepu8_epi32(b);
        lo[r] = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
        hi[r] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
      }
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        const __m512 xl = _mm512_loadu_ps(xs + t * K + g * 64 + 16 * h);
        const __m512 xh = _mm512_loadu_ps(xs + t * K + g * 64 + 32 + 16 * h);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          dot[r][t] = h == 0 ? _mm512_mul_ps(lo[r], xl) : _mm512_fmadd_ps(lo[r], xl, dot[r][t]);
          dot[r][t] = _mm512_fmadd_ps(hi[r], xh, dot[r][t]);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(scales[r * groups + g]);
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_fmadd_ps(s, dot[r][t], acc[r][t]);
    }
  }
  // Zero points: Σ_g (s_g·z_g)·group_sum[t][g].
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float corr[TT];
    Int4ZeroPoints<TT>(scales + r * groups, zeros + r * groups, groups, x.group_sums + t0 * groups, corr);
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) out[(t0 + t) * kBlockRows + r0 + r] = _mm512_reduce_add_ps(acc[r][t]) - corr[t];
  }
}

// Runs Tile<R1, 1> over the block at T = 1, else token tiles of up to 4
// (outer, so the tile's x stays in cache) times groups of R rows (inner).
// Either way each (row, token) sees the same operations in the same order.
template <int R1, int R, template <int, int> class Tile, class... Args>
void RunRows(const Activations& x, float* out, Args... args) {
  const int64_t T = x.num_tokens;
  if (T == 1) {
    for (int64_t r0 = 0; r0 < kBlockRows; r0 += R1) Tile<R1, 1>::Run(args..., x, r0, 0, out);
    return;
  }
  for (int64_t t0 = 0; t0 < T; t0 += 4) {
    const int64_t n = std::min<int64_t>(4, T - t0);
    for (int64_t r0 = 0; r0 < kBlockRows; r0 += R) {
      switch (n) {
        case 1: Tile<R, 1>::Run(args..., x, r0, t0, out); break;
        case 2: Tile<R, 2>::Run(args..., x, r0, t0, out); break;
        case 3: Tile<R, 3>::Run(args..., x, r0, t0, out); break;
        default: Tile<R, 4>::Run(args..., x, r0, t0, out); break;
      }
    }
  }
}

template <int R, int TT>
struct Int8TileOp {
  static void Run(const int8_t* q, const float* s, const Activations& x, int64_t r0, int64_t t0, float* out) {
    Int8Tile<R, TT>(q, s, x, r0, t0, out);
  }
};

template <int R, int TT>
struct Int4TileOp {
  static void Run(const common::MatrixView* w, int64_t block, const Activations& x, int64_t r0, int64_t t0,
                  float* out) {
    Int4Tile<R, TT>(*w, block, x, r0, t0, out);
  }
};

}  // namespace

void BlockF32Avx512(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  RunBlocked(w, block, x, out, kF32Tiles, 6);
}

void BlockF16Avx512(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  RunBlocked(w, block, x, out, kF16Tiles, 6);
}

void BlockBf16Avx512(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  RunBlocked(w, block, x, out, kBf16Tiles, 5);
}

void BlockInt8Avx512(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  const int8_t* q = reinterpret_cast<const int8_t*>(w.data + block * w.layout.block_bytes);
  RunRows<8, 4, Int8TileOp>(x, out, q, w.scales + block * kBlockRows);
}

void BlockInt4Avx512(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  RunRows<4, 2, Int4TileOp>(x, out, &w, block);
}

}  // namespace kernels
}  // namespace colibri
