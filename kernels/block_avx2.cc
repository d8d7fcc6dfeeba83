// AVX2 + FMA + F16C block kernels (contract in kernels/block_kernel.h,
// vocabulary in kernels/README.md). This file is compiled with -mavx2 -mfma
// -mf16c only: it is the path for machines without AVX-512 and must not use
// any AVX-512 instruction.
//
// Two loop shapes, one per family of stored layouts:
//  * k-major blocks (f32 and f16 [K][64], bf16 [K/2][64][2]): a register tile
//    of NT tokens x 8·NV outputs; per k, weight vectors are loaded (and
//    widened) once for all NT tokens and multiplied by broadcast x[t][k].
//    Each output has one accumulator summed in increasing k. At T = 1 this is
//    a single in-order pass over the block: memory bound.
//  * row-major blocks (int8, int4): a tile of R rows x NT tokens with per-row
//    8-lane accumulators, reduced horizontally once (see RowTile). Widening
//    8 weights to f32 costs 2-3.5 vector ops, so at T = 1 these are bound by
//    the core about as much as by memory.
// K is walked in chunks of kChunk inputs so that a chunk's weights stay in
// L2 while every token tile uses them; partial sums cross chunks exactly (in
// `out`, or in a stack buffer of 8-lane vectors). So the summation order of
// an output depends on K only — not on T, on the tiling or on the other
// tokens of the batch — and the same inputs always give the same bits.

#include "kernels/x86_simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/block_kernel.h"

namespace colibri {
namespace kernels {
namespace {

using common::kBlockRows;

constexpr int64_t kChunk = 512;  // inputs per K chunk: a multiple of 64
constexpr int kRowTokens = 4;    // row-major kernels: tokens per token tile
static_assert(kChunk % common::kInt4GroupSize == 0, "chunks hold whole int4 groups");

// Lanes are added in a fixed order: (l, l+4), then (l, l+2), then (0, 1).
inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 LoadF16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 bytes at p, zero- or sign-extended to 8 int32 lanes.
inline __m128i Load8Bytes(const void* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }

// Tiles of the k-major kernels: out[t0+t][8·v0 + i] for t < NT, i < 8·NV.
// NT x NV accumulators, NV weight vectors and one broadcast fit in 16 ymm.
constexpr int KMajorVectors(int nt) { return nt == 1 ? 8 : nt == 2 ? 4 : 2; }

struct KMajorArgs {
  const uint8_t* block;  // the block's weights
  const Activations* x;
  float* out;
};

// f32 and f16 ([K][64]): per k, 8·NV consecutive weights; out (+)= W·x over
// [k0, k1) for NT tokens from t0 (`first`: start from 0 instead of out).
template <bool kHalf>
struct KMajorFloat {
  static constexpr int kMaxTokens = 6;  // 6 x 16 outputs: 12 accumulators
  static constexpr int64_t kBytes = kHalf ? 2 : 4;

  static __m256 LoadWeights(const uint8_t* p) {
    return kHalf ? LoadF16x8(p) : _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }

  template <int NT, int NV>
  static void Tile(const KMajorArgs& a, int64_t t0, int v0, int64_t k0, int64_t k1, bool first) {
    const int64_t K = a.x->cols;
    const float* x = a.x->f32 + t0 * K;
    float* out = a.out + t0 * kBlockRows + 8 * v0;
    __m256 acc[NT][NV];
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v)
        acc[t][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + t * kBlockRows + 8 * v);
    const uint8_t* wk = a.block + (k0 * kBlockRows + 8 * v0) * kBytes;
    for (int64_t k = k0; k < k1; ++k, wk += kBlockRows * kBytes) {
      // Hold the smaller operand set (NT broadcasts or NV weight vectors) in
      // registers and load the other just before use: <= 16 ymm live.
      if constexpr (NT <= NV) {
        __m256 xt[NT];
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) xt[t] = _mm256_broadcast_ss(x + t * K + k);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) {
          const __m256 w = LoadWeights(wk + 8 * v * kBytes);
#pragma GCC unroll 8
          for (int t = 0; t < NT; ++t) acc[t][v] = _mm256_fmadd_ps(w, xt[t], acc[t][v]);
        }
      } else {
        __m256 w[NV];
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) w[v] = LoadWeights(wk + 8 * v * kBytes);
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) {
          const __m256 xt = _mm256_broadcast_ss(x + t * K + k);
#pragma GCC unroll 8
          for (int v = 0; v < NV; ++v) acc[t][v] = _mm256_fmadd_ps(w[v], xt, acc[t][v]);
        }
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + t * kBlockRows + 8 * v, acc[t][v]);
  }
};

// bf16 ([K/2][64][2]): a 32-bit lane holds (even k, odd k) of one output, and
// so does a 32-bit pair of x.bf16. `<< 16` gives the even value as f32, the
// mask 0xffff0000 the odd one; the even product is added before the odd one.
struct KMajorBf16 {
  static constexpr int kMaxTokens = 3;  // 6 accumulators + 6 split x + 2 split w

  template <int NT, int NV>
  static void Tile(const KMajorArgs& a, int64_t t0, int v0, int64_t k0, int64_t k1, bool first) {
    const int64_t K = a.x->cols;
    const uint16_t* x = a.x->bf16 + t0 * K;
    float* out = a.out + t0 * kBlockRows + 8 * v0;
    const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    __m256 acc[NT][NV];
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v)
        acc[t][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + t * kBlockRows + 8 * v);
    const uint8_t* wk = a.block + (k0 * kBlockRows + 16 * v0) * 2;
    for (int64_t k = k0; k < k1; k += 2, wk += 2 * kBlockRows * 2) {
      __m256 xe[NT], xo[NT];
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) {
        int32_t pair;
        std::memcpy(&pair, x + t * K + k, sizeof(pair));
        const __m256i xp = _mm256_set1_epi32(pair);
        xe[t] = _mm256_castsi256_ps(_mm256_slli_epi32(xp, 16));
        xo[t] = _mm256_castsi256_ps(_mm256_and_si256(xp, odd_mask));
      }
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) {
        const __m256i wp = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 32 * v));
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wp, 16));
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wp, odd_mask));
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) {
          acc[t][v] = _mm256_fmadd_ps(we, xe[t], acc[t][v]);
          acc[t][v] = _mm256_fmadd_ps(wo, xo[t], acc[t][v]);
        }
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + t * kBlockRows + 8 * v, acc[t][v]);
  }
};

// Runs the tiles of `tokens` (<= NT) tokens from t0 over all 64 outputs.
template <typename P, int NT>
void KMajorTokens(int64_t tokens, const KMajorArgs& a, int64_t t0, int64_t k0, int64_t k1) {
  if constexpr (NT > 1) {
    if (tokens < NT) return KMajorTokens<P, NT - 1>(tokens, a, t0, k0, k1);
  }
  constexpr int NV = KMajorVectors(NT);
  for (int v0 = 0; v0 < 8; v0 += NV) P::template Tile<NT, NV>(a, t0, v0, k0, k1, k0 == 0);
}

template <typename P>
void KMajorBlock(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  if (x.num_tokens == 0) return;  // no row to read, no output to write
  const KMajorArgs a{w.data + block * w.layout.block_bytes, &x, out};
  for (int64_t k0 = 0; k0 < x.cols; k0 += kChunk) {
    const int64_t k1 = std::min(x.cols, k0 + kChunk);
    // Token 0 alone (all 64 outputs in one pass) reads the chunk from memory
    // in order; the other tokens find it in L2.
    KMajorTokens<P, 1>(1, a, 0, k0, k1);
    for (int64_t t0 = 1; t0 < x.num_tokens; t0 += P::kMaxTokens) {
      const int64_t tokens = std::min<int64_t>(P::kMaxTokens, x.num_tokens - t0);
      KMajorTokens<P, P::kMaxTokens>(tokens, a, t0, k0, k1);
    }
  }
}

// Row-major kernels (int8, int4): a tile is R rows x NT tokens (R = 4, 2, 1
// for NT = 1, 2, 3+: R rows share each x load). Per 64-input group a row's
// weights come as 4 pairs of 8-lane vectors (a, b); per row and token the a
// and b products go to two partial sums (two short FMA chains, independent
// across groups), then acc += (scale ·) (Σa + Σb); acc is reduced
// horizontally once. While a tile runs, the same groups of the next tile's
// rows are prefetched into L2, so the weights stream at the rate they are
// used. Up to kStreamTokens tokens a tile runs over the whole K (the block
// is read once, in memory order); with more, K is chunked so x of the token
// tile stays in L1, and acc waits between chunks in `state`,
// state[(row * kRowTokens + t) * 8 + lane].
constexpr int64_t kStreamTokens = 2;

struct RowArgs {
  const uint8_t* block;  // row r at block + r * row_bytes
  int64_t row_bytes;
  const float* x;  // x.f32 of the tile's first token
  int64_t K;
  const float* scales;  // int4: this block's [64][groups]
  int64_t groups;
  float* state;
};

// int8: 64 bytes a group; pair c = inputs [16c, 16c+8) and [16c+8, 16c+16),
// sign-extended to int32 and converted. The row scale is applied at the end.
struct Int8Group {
  static constexpr int64_t kBytes = 64;
  static constexpr bool kScaled = false;
  static constexpr int OffsetA(int c) { return 16 * c; }
  static constexpr int OffsetB(int c) { return 16 * c + 8; }
  static void Pair(const uint8_t* group, int c, __m256* a, __m256* b) {
    *a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(Load8Bytes(group + 16 * c)));
    *b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(Load8Bytes(group + 16 * c + 8)));
  }
};

// int4: 32 bytes a group; byte i holds input i (low nibble) and i+32 (high).
// Pair c: bytes [8c, 8c+8) zero-extended to int32; & 15 gives inputs 8c..,
// >> 4 inputs 8c+32... Each group is scaled; the zero points are subtracted
// once per row at the end with the group sums (Int4ZeroTerm).
struct Int4Group {
  static constexpr int64_t kBytes = 32;
  static constexpr bool kScaled = true;
  static constexpr int OffsetA(int c) { return 8 * c; }
  static constexpr int OffsetB(int c) { return 8 * c + 32; }
  static void Pair(const uint8_t* group, int c, __m256* a, __m256* b) {
    const __m256i bytes = _mm256_cvtepu8_epi32(Load8Bytes(group + 8 * c));
    *a = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0x0f)));
    *b = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
  }
};

// acc of rows [r0, r0 + R) x NT tokens (+)= the groups [g0, g1) (`first`:
// from 0, else from state).
template <typename P, int R, int NT>
void RowTile(const RowArgs& a, int r0, int64_t g0, int64_t g1, bool first) {
  __m256 acc[R][NT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t)
      acc[r][t] = first ? _mm256_setzero_ps() : _mm256_load_ps(a.state + ((r0 + r) * kRowTokens + t) * 8);
  const uint8_t* q = a.block + r0 * a.row_bytes;
  const uint8_t* next = r0 + R < kBlockRows ? q + R * a.row_bytes : nullptr;
  for (int64_t g = g0; g < g1; ++g) {
    if (next != nullptr) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(next + r * a.row_bytes + g * P::kBytes), _MM_HINT_T1);
      }
    }
    const float* xg = a.x + g * 64;
    __m256 sa[R][NT], sb[R][NT];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m256 wa, wb;
        P::Pair(q + r * a.row_bytes + g * P::kBytes, c, &wa, &wb);
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) {
          const __m256 xa = _mm256_loadu_ps(xg + t * a.K + P::OffsetA(c));
          const __m256 xb = _mm256_loadu_ps(xg + t * a.K + P::OffsetB(c));
          sa[r][t] = c == 0 ? _mm256_mul_ps(wa, xa) : _mm256_fmadd_ps(wa, xa, sa[r][t]);
          sb[r][t] = c == 0 ? _mm256_mul_ps(wb, xb) : _mm256_fmadd_ps(wb, xb, sb[r][t]);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) {
        const __m256 sum = _mm256_add_ps(sa[r][t], sb[r][t]);
        if constexpr (P::kScaled) {
          const __m256 scale = _mm256_broadcast_ss(a.scales + (r0 + r) * a.groups + g);
          acc[r][t] = _mm256_fmadd_ps(scale, sum, acc[r][t]);
        } else {
          acc[r][t] = _mm256_add_ps(acc[r][t], sum);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) _mm256_store_ps(a.state + ((r0 + r) * kRowTokens + t) * 8, acc[r][t]);
}

// Runs `tokens` (<= NT) tokens over all rows and the groups [g0, g1).
// 3·R·NT accumulators and a pair of weights fit in 16 ymm.
template <typename P, int NT>
void RowTokens(int tokens, const RowArgs& a, int64_t g0, int64_t g1) {
  if constexpr (NT > 1) {
    if (tokens < NT) return RowTokens<P, NT - 1>(tokens, a, g0, g1);
  }
  constexpr int R = NT == 1 ? 4 : NT == 2 ? 2 : 1;
  for (int r0 = 0; r0 < kBlockRows; r0 += R) RowTile<P, R, NT>(a, r0, g0, g1, g0 == 0);
}

// Σ_g scale_g · zero_g · group_sum_g of one row and token, 8 groups at a time.
float Int4ZeroTerm(const float* scales, const uint8_t* zeros, const float* group_sums, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(Load8Bytes(zeros + g)));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(scales + g), z), _mm256_loadu_ps(group_sums + g), acc);
  }
  float sum = HorizontalSum(acc);
  for (; g < groups; ++g) sum += scales[g] * static_cast<float>(zeros[g]) * group_sums[g];
  return sum;
}

// Token tiles of kRowTokens, K chunks, rows. `finish(row, token, Σ lanes)`
// gives the output.
template <typename P, typename Finish>
void RowBlock(const common::MatrixView& w, int64_t block, const Activations& x, float* out, Finish finish) {
  alignas(32) float state[kBlockRows * kRowTokens * 8];
  RowArgs a{w.data + block * w.layout.block_bytes,
            static_cast<int64_t>(w.layout.block_bytes / kBlockRows),
            nullptr,
            x.cols,
            w.scales + block * kBlockRows * w.layout.groups,
            w.layout.groups,
            state};
  const int64_t groups = x.cols / 64;
  const int64_t chunk = x.num_tokens <= kStreamTokens ? groups : kChunk / 64;
  for (int64_t t0 = 0; t0 < x.num_tokens; t0 += kRowTokens) {
    const int tokens = static_cast<int>(std::min<int64_t>(kRowTokens, x.num_tokens - t0));
    a.x = x.f32 + t0 * x.cols;
    for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
      RowTokens<P, kRowTokens>(tokens, a, g0, std::min(groups, g0 + chunk));
    }
    for (int t = 0; t < tokens; ++t) {
      for (int r = 0; r < kBlockRows; ++r) {
        const float dot = HorizontalSum(_mm256_load_ps(state + (r * kRowTokens + t) * 8));
        out[(t0 + t) * kBlockRows + r] = finish(r, t0 + t, dot);
      }
    }
  }
}

}  // namespace

void BlockF32Avx2(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  KMajorBlock<KMajorFloat<false>>(w, block, x, out);
}

void BlockF16Avx2(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  KMajorBlock<KMajorFloat<true>>(w, block, x, out);
}

void BlockBf16Avx2(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  KMajorBlock<KMajorBf16>(w, block, x, out);
}

void BlockInt8Avx2(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  const float* scales = w.scales + block * kBlockRows;
  RowBlock<Int8Group>(w, block, x, out, [&](int r, int64_t, float dot) { return scales[r] * dot; });
}

void BlockInt4Avx2(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  const int64_t groups = w.layout.groups;
  const float* scales = w.scales + block * kBlockRows * groups;
  const uint8_t* zeros = w.zeros + block * kBlockRows * groups;
  RowBlock<Int4Group>(w, block, x, out, [&](int r, int64_t t, float dot) {
    return dot - Int4ZeroTerm(scales + r * groups, zeros + r * groups, x.group_sums + t * groups, groups);
  });
}

}  // namespace kernels
}  // namespace colibri
