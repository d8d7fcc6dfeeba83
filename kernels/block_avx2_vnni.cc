// int8 and int4 block kernels for AVX2 machines with AVX-VNNI (the VEX form
// of vpdpbusd: Intel's Alder Lake and later client cores, Sierra Forest, AMD
// Zen 5). This file is compiled with the AVX2 flags plus -mavxvnni and must
// not use AVX-512: dispatch.cc puts these kernels in the avx2 table only where
// cpuid reports AVX-VNNI.
//
// They compute what the AVX512_VNNI ones in block_avx512_bf16.cc compute —
// integer dot products of the weights against the int8 copy x.q8, one group
// of 64 inputs at a time, scaled and summed in f32 — in 8-lane vectors: the
// scalar reference on x' = q8 · scale within the same bound, but not the same
// bits as the AVX-512 kernels (the lanes are summed in another order).
//
// Tiles: T = 1 one row at a time for int8 (in memory order, as the AVX-512
// kernel; docs/PERFORMANCE.md) and 4 rows for int4; otherwise 2 rows times
// up to 4 tokens, the pair of rows read from memory once and from L1 for each
// further token tile. Every (row, token) sees the same operations in the same
// order either way, so a token's bits depend only on its own inputs. While a
// tile runs, the next tile's rows (past the block's end: the next block's)
// are prefetched into L2.

#include "kernels/x86_simd.h"

#include <cstdint>

#include "kernels/block_kernel.h"
#include "kernels/int_tiles.h"

namespace colibri {
namespace kernels {
namespace {

using common::kBlockRows;

// Lanes are added in a fixed order: (l, l+4), then (l, l+2), then (0, 1).
inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i Load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Σ_g a[g] (· b[g]) over `groups`, 8 groups a vector, then the tail in order.
float DotGroups(const float* a, const uint8_t* zeros, const float* b, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 z =
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(zeros + g))));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(a + g), z), _mm256_loadu_ps(b + g), acc);
  }
  float sum = HorizontalSum(acc);
  for (; g < groups; ++g) sum += a[g] * static_cast<float>(zeros[g]) * b[g];
  return sum;
}

// Σ_g sums[g], 8 groups a vector, then the tail in order.
float SumGroups(const float* sums, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(sums + g));
  float sum = HorizontalSum(acc);
  for (; g < groups; ++g) sum += sums[g];
  return sum;
}

// int8: per row and 64-input group, the 64 bytes flipped to w + 128
// (unsigned) take two vpdpbusd against x.q8's group: eight int32 lanes of
// Σ (w + 128)·xq, exact (at most 8 · 255 · 127 per lane); acc += xs_g · those.
// The 128s come off at the end (128 · Σ_g q8_sums_g, the same for every row),
// then × the row's scale: BlockInt8Scalar on x'.
template <int R, int TT>
void Int8Tile(const common::MatrixView& w, int64_t block, const Activations& x, int64_t r0, int64_t t0, float* out) {
  const int64_t K = x.cols, groups = K / 64;
  const int8_t* rows = reinterpret_cast<const int8_t*>(w.data + block * w.layout.block_bytes) + r0 * K;
  const float* scales = w.scales + block * kBlockRows + r0;
  const int8_t* xq = x.q8 + t0 * K;
  const float* xs = x.q8_scales + t0 * groups;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[R][TT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    // The next R rows (R * K bytes), R lines a group.
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(rows + R * K + g * 64 * R + 64 * i), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i lo = _mm256_xor_si256(Load32(rows + r * K + g * 64), flip);
      const __m256i hi = _mm256_xor_si256(Load32(rows + r * K + g * 64 + 32), flip);
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        const int8_t* xg = xq + t * K + g * 64;
        const __m256i dot = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, Load32(xg)), hi,
                                                    Load32(xg + 32));
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xs[t * groups + g]), acc[r][t]);
      }
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
    const float corr = 128.f * SumGroups(x.q8_sums + (t0 + t) * groups, groups);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) out[(t0 + t) * kBlockRows + r0 + r] = scales[r] * (HorizontalSum(acc[r][t]) - corr);
  }
}

// int4: per row and 64-input group (32 bytes: byte j holds input j in its low
// nibble, input j + 32 in its high), the low and the high nibbles (0..15,
// unsigned) take two vpdpbusd against x.q8's inputs 0-31 and 32-63: eight
// int32 lanes of Σ q·xq, exact; acc += (s_g · xs_g) · those. The zero points
// come off at the end: Σ_g s_g·z_g·q8_sums_g. BlockInt4Scalar on x'.
template <int R, int TT>
void Int4Tile(const common::MatrixView& w, int64_t block, const Activations& x, int64_t r0, int64_t t0, float* out) {
  const int64_t K = x.cols, groups = w.layout.groups, n0 = block * kBlockRows + r0;
  const uint8_t* rows = w.data + block * w.layout.block_bytes + r0 * (K / 2);
  const float* scales = w.scales + n0 * groups;
  const uint8_t* zeros = w.zeros + n0 * groups;
  const int8_t* xq = x.q8 + t0 * K;
  const float* xs = x.q8_scales + t0 * groups;
  const __m256i low = _mm256_set1_epi8(0x0f);
  __m256 acc[R][TT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    // The next R rows (R * K / 2 bytes), R * 32 bytes a group.
#pragma GCC unroll 8
    for (int i = 0; i < R / 2; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(rows + R * (K / 2) + g * 32 * R + 64 * i), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i v = Load32(rows + r * (K / 2) + g * 32);
      const __m256i lo = _mm256_and_si256(v, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      const float s = scales[r * groups + g];
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        const int8_t* xg = xq + t * K + g * 64;
        const __m256i dot = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, Load32(xg)), hi,
                                                    Load32(xg + 32));
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s * xs[t * groups + g]), acc[r][t]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      const float corr = DotGroups(scales + r * groups, zeros + r * groups, x.q8_sums + (t0 + t) * groups, groups);
      out[(t0 + t) * kBlockRows + r0 + r] = HorizontalSum(acc[r][t]) - corr;
    }
  }
}

}  // namespace

void BlockInt8Avx2Vnni(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  static constexpr IntTileFn kTiles[4] = {Int8Tile<2, 1>, Int8Tile<2, 2>, Int8Tile<2, 3>, Int8Tile<2, 4>};
  RunIntTiles(Int8Tile<1, 1>, 1, kTiles, w, block, x, out);
}

void BlockInt4Avx2Vnni(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  static constexpr IntTileFn kTiles[4] = {Int4Tile<2, 1>, Int4Tile<2, 2>, Int4Tile<2, 3>, Int4Tile<2, 4>};
  RunIntTiles(Int4Tile<4, 1>, 4, kTiles, w, block, x, out);
}

}  // namespace kernels
}  // namespace colibri
