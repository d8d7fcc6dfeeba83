// Block kernels with AVX512_BF16 (vdpbf16ps) and AVX512_VNNI (vpdpbusd);
// this file's own compile flags add -mavx512bf16 -mavx512vnni to the AVX-512
// ones.
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
// read the chunk from L2 instead of memory. The weights are prefetched into
// L2 kStreamAheadBytes ahead (x86_simd.h).

#include "kernels/x86_simd.h"

#include <algorithm>
#include <cstring>

#include "kernels/block_kernel.h"
#include "kernels/int4_avx512.h"
#include "kernels/int_tiles.h"

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
    PrefetchStreamAhead<4>(p);
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

// int4 weights on the int8 copy of x (AVX512_VNNI). A row's 64 bytes at a
// time hold two 64-input groups g, g + 1 (32 bytes each: byte j holds input
// j in its low nibble, input j + 32 in its high). The low and the high
// nibbles (0..15, unsigned) take two vpdpbusd against x.q8's inputs 0-31 and
// 32-63 of both groups (signed, arranged once per pair and token): sixteen
// int32 lanes of Σ q·xq, exact, lanes 0-7 group g's and 8-15 group g + 1's;
// acc += (s · xs) · those, the products s_g · xs_g made 16 groups at a time
// and spread to their lanes with one vpermps. The zero points come off at
// the end: Σ_g s_g·z_g·q8_sums_g (q8_sums = xs · Σ xq), 16 groups a vector.
// An odd last group runs alone in the low half (the high half adds 0). The
// result is the scalar reference on x' = xq · xs, with f32 sums: ~10
// operations per 128 weights, half of what the same in ymm takes, so int4
// streams at nearer the memory's rate where 512-bit operations are
// single-pumped (Zen 5, Intel).
// Groups g and g + 1 (with kLast, g alone) of R rows and TT tokens:
// acc[r][t] += (Σ q·xq per lane) · (s · xs) spread to the pair's lanes.
template <int R, int TT, bool kLast>
inline __attribute__((always_inline)) void Int4Pair(const uint8_t* rows, int64_t K, const int8_t* xq, int64_t g,
                                                    __m512i lanes, const __m512 (&sxs)[R][TT], __m512 (&acc)[R][TT]) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  // The next R rows (R * K / 2 bytes), R * 64 bytes a pair of groups.
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(rows + R * (K / 2) + g * 32 * R + 64 * i), _MM_HINT_T1);
  }
  __m512i xl[TT], xh[TT];
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
    const __m512i a = _mm512_loadu_si512(xq + t * K + g * 64);
    const __m512i b = kLast ? _mm512_setzero_si512() : _mm512_loadu_si512(xq + t * K + g * 64 + 64);
    xl[t] = _mm512_shuffle_i64x2(a, b, 0x44);
    xh[t] = _mm512_shuffle_i64x2(a, b, 0xee);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const uint8_t* p = rows + r * (K / 2) + g * 32;
    const __m512i v = kLast ? _mm512_maskz_loadu_epi8(0xffffffffull, p) : _mm512_loadu_si512(p);
    const __m512i lo = _mm512_and_si512(v, low);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl[t]), hi, xh[t]);
      acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(lanes, sxs[r][t]), acc[r][t]);
    }
  }
}

template <int R, int TT>
void Int4Tile(const common::MatrixView& w, int64_t block, const Activations& x, int64_t r0, int64_t t0, float* out) {
  const int64_t K = x.cols, groups = w.layout.groups, n0 = block * kBlockRows + r0;
  const uint8_t* rows = w.data + block * w.layout.block_bytes + r0 * (K / 2);
  const float* scales = w.scales + n0 * groups;
  const uint8_t* zeros = w.zeros + n0 * groups;
  const int8_t* xq = x.q8 + t0 * K;
  const float* xs = x.q8_scales + t0 * groups;
  const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i two = _mm512_set1_epi32(2);
  __m512 acc[R][TT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  for (int64_t g16 = 0; g16 < groups; g16 += 16) {
    const int64_t n = std::min<int64_t>(16, groups - g16);
    const __mmask16 m = n == 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1);
    // The next R rows' scales and zero points (R * groups of each) at the
    // same pace: their first use would otherwise wait on memory with the
    // whole chunk behind it.
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(scales + R * groups + g16 * R + 16 * i), _MM_HINT_T1);
    }
    _mm_prefetch(reinterpret_cast<const char*>(zeros + R * groups + g16 * R), _MM_HINT_T1);
    __m512 sxs[R][TT];  // s_g · xs_g of groups g16 .. g16 + 15
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      const __m512 xsv = _mm512_maskz_loadu_ps(m, xs + t * groups + g16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) sxs[r][t] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, scales + r * groups + g16), xsv);
    }
    __m512i lanes = spread;
    int64_t j = 0;
    for (; j + 1 < n; j += 2, lanes = _mm512_add_epi32(lanes, two)) {
      Int4Pair<R, TT, false>(rows, K, xq, g16 + j, lanes, sxs, acc);
    }
    if (j < n) Int4Pair<R, TT, true>(rows, K, xq, g16 + j, lanes, sxs, acc);
  }
  // Zero points: Σ_g (s_g·z_g)·q8_sums[t][g].
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float corr[TT];
    Int4ZeroPoints<TT>(scales + r * groups, zeros + r * groups, groups, x.q8_sums + t0 * groups, corr);
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) out[(t0 + t) * kBlockRows + r0 + r] = _mm512_reduce_add_ps(acc[r][t]) - corr[t];
  }
}

// int8 weights on the int8 copy of x (AVX512_VNNI). vpdpbusd multiplies
// unsigned bytes by signed ones, so each 64-byte group of a row is flipped to
// w + 128 (one xor) and multiplied by x.q8's group (signed): sixteen int32
// lanes of Σ (w + 128)·xq, exact (at most 4 · 255 · 127 per lane and group);
// acc += xs_g · those. The 128s come off at the end, the same for every row:
// 128 · Σ_g xs_g·Σ xq_g = 128 · Σ_g q8_sums_g. Then × the row's scale. The
// result is BlockInt8Scalar on x' = xq · xs, with f32 sums: ~5 zmm operations
// per 64 weights and token against ~10 widening them to f32.
template <int R, int TT>
void Int8Tile(const common::MatrixView& w, int64_t block, const Activations& x, int64_t r0, int64_t t0, float* out) {
  const int64_t K = x.cols, groups = K / 64;
  const int8_t* rows = reinterpret_cast<const int8_t*>(w.data + block * w.layout.block_bytes) + r0 * K;
  const float* scales = w.scales + block * kBlockRows + r0;
  const int8_t* xq = x.q8 + t0 * K;
  const float* xs = x.q8_scales + t0 * groups;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R][TT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    // The next R rows (R * K bytes, contiguous), R lines a group: all of
    // them are in flight by the time this tile ends.
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(rows + R * K + g * 64 * R + 64 * i), _MM_HINT_T1);
    }
    __m512i xv[TT];
    __m512 sv[TT];
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      xv[t] = _mm512_loadu_si512(xq + t * K + g * 64);
      sv[t] = _mm512_set1_ps(xs[t * groups + g]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(rows + r * K + g * 64), flip);
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, xv[t]);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sv[t], acc[r][t]);
      }
    }
  }
  float corr[TT];
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
    __m512 c = _mm512_setzero_ps();
    const float* sums = x.q8_sums + (t0 + t) * groups;
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 m = groups - g >= 16 ? 0xffff : static_cast<__mmask16>((1u << (groups - g)) - 1);
      c = _mm512_add_ps(c, _mm512_maskz_loadu_ps(m, sums + g));
    }
    corr[t] = 128.f * _mm512_reduce_add_ps(c);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      out[(t0 + t) * kBlockRows + r0 + r] = scales[r] * (_mm512_reduce_add_ps(acc[r][t]) - corr[t]);
    }
  }
}

}  // namespace

// int8 at T = 1 reads one row at a time, in memory order, prefetching the
// next: one core streaming from memory kept up better that way than with 4
// rows side by side (4 streams, and 4 more prefetched; docs/PERFORMANCE.md).
// int4 takes 8 rows at T = 1: its rows are half as long, and its arithmetic,
// not only the memory, sets its rate (8 rows ran 51 GB/s in cache on one Zen 5
// core, 4 rows ~41).
void BlockInt8Avx512Vnni(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  static constexpr IntTileFn kTiles[4] = {Int8Tile<2, 1>, Int8Tile<2, 2>, Int8Tile<2, 3>, Int8Tile<2, 4>};
  RunIntTiles(Int8Tile<1, 1>, 1, kTiles, w, block, x, out);
}

void BlockInt4Avx512Vnni(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  static constexpr IntTileFn kTiles[4] = {Int4Tile<2, 1>, Int4Tile<2, 2>, Int4Tile<2, 3>, Int4Tile<2, 4>};
  RunIntTiles(Int4Tile<8, 1>, 8, kTiles, w, block, x, out);
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
