// AVX2 + FMA + F16C dequantization to a bf16 tile (contract in
// kernels/dequant.h). Compiled with -mavx2 -mfma -mf16c only: no AVX-512.
// bf16 rounding is integer arithmetic (RoundBf16High), the same bits as
// common::FloatToBf16 on finite values, and each f32 is computed as
// scale * float(q) (int8) or scale * float(q - zero) (int4), exactly as
// common::DecodeRow does, so every bit matches the scalar oracle.
//
// One 32-byte store holds the (k, k+1) pairs of 8 rows, so the kernels work
// on 8 rows at a time and transpose:
//  * int8: an in-lane 8 x 8 transpose of 16-bit words (each word = the
//    (k, k+1) byte pair of one row) turns 8 rows x 32 inputs into 16 vectors
//    of one pair x 8 rows; each is widened, split into even / odd k by shifts,
//    converted, scaled by the 8 row scales, rounded and merged.
//  * int4: per (row, group) there are only 16 values: the row's table
//    bf16(scale * (q - zero)), q < 16, is computed once as two 16-byte vpshufb
//    tables (low and high bytes of the bf16), the 64 nibbles of the group are
//    looked up and the bytes interleaved into (k, k+1) pairs; an 8 x 8
//    transpose of 32-bit pairs then gives the stores.
// The next 8-row group is prefetched into L2 along the way (see PrefetchL2).

#include "kernels/x86_simd.h"

#include <cstdint>

#include "kernels/dequant.h"

namespace colibri {
namespace kernels {
namespace {

using common::kBlockRows;

constexpr int64_t kPairStride = 2 * kBlockRows;  // uint16_t between the pairs p and p+1 of a row

// f32 -> bf16, round to nearest even, with the result in the high 16 bits of
// each lane (the low 16 are garbage). Finite inputs only. Same bits as
// FloatToBf16's bits + 0x7fff + lsb, without a shift: t = bits + 0x8000 rounds
// every case right except an exact tie (low half 0x8000), which it rounds up;
// a tie leaves t's low half 0, so y = t + 0xffff has bit 16 equal to t's
// exactly for ties (else flipped), and clearing t's bit 16 there rounds the
// tie to even.
inline __m256i RoundBf16High(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i t = _mm256_add_epi32(bits, _mm256_set1_epi32(0x8000));
  const __m256i y = _mm256_add_epi32(bits, _mm256_set1_epi32(0x17fff));  // t + 0xffff
  return _mm256_andnot_si256(_mm256_and_si256(y, _mm256_set1_epi32(0x10000)), t);
}

// The first two stages of an 8 x 8 transpose of 32-bit lanes, in-lane:
// u[4i+m] lane L = col 4L+m of rows 4i..4i+3 (cols 4L..4L+3 in lane L of v).
inline void Transpose32Stage12(const __m256i (&v)[8], __m256i (&u)[8]) {
  __m256i t[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
}

inline void Store(uint16_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }

// Prefetches into L2 `lines` 64-byte lines from base + offset (may lie past
// the block, even past the matrix: a prefetch never faults). The rows of an
// 8-row group are contiguous, so each step prefetches its share of the next
// group.
inline void PrefetchL2(const void* base, int64_t offset, int lines) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(base) + offset;  // no out-of-range pointer
  for (int i = 0; i < lines; ++i) _mm_prefetch(reinterpret_cast<const char*>(p + 64 * i), _MM_HINT_T1);
}

void DequantInt8(const common::MatrixView& w, int64_t block, uint16_t* tile) {
  const int64_t K = w.layout.padded_cols;
  const int8_t* data = reinterpret_cast<const int8_t*>(w.data + block * w.layout.block_bytes);
  const float* scales = w.scales + block * kBlockRows;
  for (int64_t j0 = 0; j0 < kBlockRows; j0 += 8) {
    const __m256 scale = _mm256_loadu_ps(scales + j0);
    const int8_t* rows = data + j0 * K;
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      PrefetchL2(rows, 8 * K + 8 * k0, 4);  // 8K bytes in K/32 steps
      // 8 rows x 16 words (word c = inputs k0+2c, k0+2c+1), transposed in
      // lane: col[c] lane L = word 8L+c of rows 0..7.
      __m256i v[8], t[8], col[8];
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) v[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + r * K + k0));
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {  // t[2i] lane L: words 8L..8L+3 of rows 2i, 2i+1
        t[2 * i] = _mm256_unpacklo_epi16(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi16(v[2 * i], v[2 * i + 1]);
      }
#pragma GCC unroll 2
      for (int i = 0; i < 2; ++i) {  // v[4i+m] lane L: words 8L+2m, 8L+2m+1 of rows 4i..4i+3
        v[4 * i] = _mm256_unpacklo_epi32(t[4 * i], t[4 * i + 2]);
        v[4 * i + 1] = _mm256_unpackhi_epi32(t[4 * i], t[4 * i + 2]);
        v[4 * i + 2] = _mm256_unpacklo_epi32(t[4 * i + 1], t[4 * i + 3]);
        v[4 * i + 3] = _mm256_unpackhi_epi32(t[4 * i + 1], t[4 * i + 3]);
      }
#pragma GCC unroll 4
      for (int m = 0; m < 4; ++m) {
        col[2 * m] = _mm256_unpacklo_epi64(v[m], v[4 + m]);
        col[2 * m + 1] = _mm256_unpackhi_epi64(v[m], v[4 + m]);
      }
      uint16_t* out = tile + (k0 / 2) * kPairStride + 2 * j0;
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) {
        const __m128i words = c < 8 ? _mm256_castsi256_si128(col[c]) : _mm256_extracti128_si256(col[c - 8], 1);
        // Lane r: byte k (low) and k+1 (high) of row j0+r, sign-extended.
        const __m256i x = _mm256_cvtepi16_epi32(words);
        const __m256 even = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(x, 24), 24));
        const __m256 odd = _mm256_cvtepi32_ps(_mm256_srai_epi32(x, 8));
        const __m256i re = RoundBf16High(_mm256_mul_ps(scale, even));
        const __m256i ro = RoundBf16High(_mm256_mul_ps(scale, odd));
        Store(out + c * kPairStride, _mm256_blend_epi16(_mm256_srli_epi32(re, 16), ro, 0xaa));
      }
    }
  }
}

void DequantInt4(const common::MatrixView& w, int64_t block, uint16_t* tile) {
  const int64_t K = w.layout.padded_cols, groups = w.layout.groups;
  const uint8_t* data = w.data + block * w.layout.block_bytes;
  const __m256i iota0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i iota1 = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  // Per lane: the low bytes (2) of the bf16 halves of 4 lanes to bytes 0-3
  // (or 8-11), their high bytes (3) to bytes 4-7 (or 12-15), zeros elsewhere.
  const __m256i gather0 = _mm256_setr_epi8(2, 6, 10, 14, 3, 7, 11, 15, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                           2, 6, 10, 14, 3, 7, 11, 15, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i gather1 = _mm256_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 2, 6, 10, 14, 3, 7, 11, 15,  //
                                           -1, -1, -1, -1, -1, -1, -1, -1, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i low_table = _mm256_setr_epi32(0, 4, 2, 6, 0, 4, 2, 6);
  const __m256i high_table = _mm256_setr_epi32(1, 5, 3, 7, 1, 5, 3, 7);
  // First pair of the 4 pairs of lane 0 of each looked-up vector (lane 1: +8).
  constexpr int kFirstPair[4] = {0, 4, 16, 20};
  for (int64_t j0 = 0; j0 < kBlockRows; j0 += 8) {
    const int64_t n0 = block * kBlockRows + j0;
    for (int64_t g = 0; g < groups; ++g) {
      PrefetchL2(data, (j0 + 8) * (K / 2) + 256 * g, 4);  // 4K bytes in K/64 steps
      __m256i a[4][8];                                    // [set][row]: 32-bit (k, k+1) pairs, see kFirstPair
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) {
        const int64_t sz = (n0 + r) * groups + g;
        const __m256 s = _mm256_set1_ps(w.scales[sz]);
        const __m256i z = _mm256_set1_epi32(w.zeros[sz]);
        const __m256i r0 = RoundBf16High(_mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(iota0, z))));
        const __m256i r1 = RoundBf16High(_mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(iota1, z))));
        // Lane 0 dwords: low bytes q0-3, high q0-3, low q8-11, high q8-11;
        // lane 1: the same for q4-7 and q12-15.
        const __m256i b = _mm256_or_si256(_mm256_shuffle_epi8(r0, gather0), _mm256_shuffle_epi8(r1, gather1));
        const __m256i lo_t = _mm256_permutevar8x32_epi32(b, low_table);   // low bytes of q0-15, both lanes
        const __m256i hi_t = _mm256_permutevar8x32_epi32(b, high_table);  // high bytes
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + (j0 + r) * (K / 2) + g * 32));
        const __m256i q0 = _mm256_and_si256(raw, nibble);                        // inputs 0..31
        const __m256i q1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);  // inputs 32..63
        const __m256i l0 = _mm256_shuffle_epi8(lo_t, q0), h0 = _mm256_shuffle_epi8(hi_t, q0);
        const __m256i l1 = _mm256_shuffle_epi8(lo_t, q1), h1 = _mm256_shuffle_epi8(hi_t, q1);
        a[0][r] = _mm256_unpacklo_epi8(l0, h0);  // pairs 0-3 | 8-11
        a[1][r] = _mm256_unpackhi_epi8(l0, h0);  // pairs 4-7 | 12-15
        a[2][r] = _mm256_unpacklo_epi8(l1, h1);  // pairs 16-19 | 24-27
        a[3][r] = _mm256_unpackhi_epi8(l1, h1);  // pairs 20-23 | 28-31
      }
      uint16_t* out = tile + g * 32 * kPairStride + 2 * j0;
#pragma GCC unroll 4
      for (int set = 0; set < 4; ++set) {
        __m256i u[8];
        Transpose32Stage12(a[set], u);
        uint16_t* o = out + kFirstPair[set] * kPairStride;
#pragma GCC unroll 4
        for (int m = 0; m < 4; ++m) {
          Store(o + m * kPairStride, _mm256_permute2x128_si256(u[m], u[4 + m], 0x20));
          Store(o + (8 + m) * kPairStride, _mm256_permute2x128_si256(u[m], u[4 + m], 0x31));
        }
      }
    }
  }
}

}  // namespace

void DequantBf16Avx2(const common::MatrixView& w, int64_t block, uint16_t* tile) {
  if (w.layout.dtype == common::DType::kInt4) {
    DequantInt4(w, block, tile);
  } else {
    DequantInt8(w, block, tile);
  }
}

}  // namespace kernels
}  // namespace colibri
