// AVX-512 (F/BW/VL/DQ) dequantization to a bf16 tile (contract in
// kernels/dequant.h). Compiled with the AVX-512 flags only: no avx512_bf16,
// so bf16 rounding is integer arithmetic (bits + 0x7fff + lsb, high half),
// the same as common::FloatToBf16 on finite values. Each f32 is computed as
// scale * float(q) (int8) or scale * float(q - zero) (int4), exactly as
// common::DecodeRow does, so every bit matches the scalar oracle.
//
// The output interleaves the rows: one 64-byte line of the tile holds the
// (k, k+1) pairs of 16 rows, so every variant works on 16 rows at a time and
// transposes.
//  * int8: a 16 x 16 transpose of 16-bit words (each word = the (k, k+1)
//    byte pair of one row) turns 16 rows x 32 inputs into 16 vectors of one
//    pair x 16 rows; each is widened, split into even / odd k, converted,
//    scaled by the 16 row scales, rounded and merged into one line.
//  * int4: per (row, group) there are only 16 values, so the row's table
//    bf16(scale * (q - zero)), q < 16, is computed in one vector and the 64
//    nibbles of the group are looked up with two vpermw (16-bit lanes: the
//    (k, k+1) pairs come out in order); a 16 x 16 transpose of 32-bit pairs
//    then gives the lines.

#include "kernels/x86_simd.h"

#include <cstdint>

#include "kernels/dequant.h"

namespace colibri {
namespace kernels {
namespace {

using common::kBlockRows;

// f32 -> bf16, round to nearest even: the result is the high 16 bits of each
// lane (the low 16 are garbage). Finite inputs only.
inline __m512i RoundBf16High(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
}

// col[c] = word c of the 16 rows p + r * stride (32 bytes each), r < 16:
// a 16 x 16 transpose of 16-bit words in four unpack stages.
inline void TransposeWords16x16(const int8_t* p, int64_t stride, __m256i (&col)[16]) {
  __m256i v[16], t[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) v[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + r * stride));
  // t[2i] lane L: cols 8L..8L+3 of rows 2i, 2i+1; t[2i+1]: cols 8L+4..8L+7.
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm256_unpacklo_epi16(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi16(v[2 * i], v[2 * i + 1]);
  }
  // v[4i+m] lane L: cols 8L+2m, 8L+2m+1 of rows 4i..4i+3.
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    v[4 * i] = _mm256_unpacklo_epi32(t[4 * i], t[4 * i + 2]);
    v[4 * i + 1] = _mm256_unpackhi_epi32(t[4 * i], t[4 * i + 2]);
    v[4 * i + 2] = _mm256_unpacklo_epi32(t[4 * i + 1], t[4 * i + 3]);
    v[4 * i + 3] = _mm256_unpackhi_epi32(t[4 * i + 1], t[4 * i + 3]);
  }
  // Rows 0-7 and 8-15 of cols 8L+2m (lo) and 8L+2m+1 (hi), then the lanes.
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) {
    const __m256i lo0 = _mm256_unpacklo_epi64(v[m], v[4 + m]);
    const __m256i hi0 = _mm256_unpackhi_epi64(v[m], v[4 + m]);
    const __m256i lo1 = _mm256_unpacklo_epi64(v[8 + m], v[12 + m]);
    const __m256i hi1 = _mm256_unpackhi_epi64(v[8 + m], v[12 + m]);
    col[2 * m] = _mm256_permute2x128_si256(lo0, lo1, 0x20);
    col[2 * m + 1] = _mm256_permute2x128_si256(hi0, hi1, 0x20);
    col[8 + 2 * m] = _mm256_permute2x128_si256(lo0, lo1, 0x31);
    col[9 + 2 * m] = _mm256_permute2x128_si256(hi0, hi1, 0x31);
  }
}

// Stores column c of the 16 x 16 matrix of 32-bit lanes v[row][c] at
// dst + c * stride (uint16_t units): the standard four-stage transpose.
inline void TransposeStore16x16(const __m512i (&v)[16], uint16_t* dst, int64_t stride) {
  __m512i t[16], u[16];
  // t[2i] lane L: cols 4L, 4L+1 of rows 2i, 2i+1; t[2i+1]: cols 4L+2, 4L+3.
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  // u[4i+m] lane L: col 4L+m of rows 4i..4i+3.
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // Col 4L+m = lane L of u[m], u[4+m], u[8+m], u[12+m].
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88);  // lanes 0, 2
    const __m512i y0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xdd);  // lanes 1, 3
    const __m512i x1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xdd);
    _mm512_storeu_si512(dst + m * stride, _mm512_shuffle_i32x4(x0, x1, 0x88));
    _mm512_storeu_si512(dst + (4 + m) * stride, _mm512_shuffle_i32x4(y0, y1, 0x88));
    _mm512_storeu_si512(dst + (8 + m) * stride, _mm512_shuffle_i32x4(x0, x1, 0xdd));
    _mm512_storeu_si512(dst + (12 + m) * stride, _mm512_shuffle_i32x4(y0, y1, 0xdd));
  }
}

constexpr int64_t kPairStride = 2 * kBlockRows;  // uint16_t between the lines of pairs p and p+1

void DequantInt8(const common::MatrixView& w, int64_t block, uint16_t* tile) {
  const int64_t K = w.layout.padded_cols;
  const int8_t* data = reinterpret_cast<const int8_t*>(w.data + block * w.layout.block_bytes);
  const float* scales = w.scales + block * kBlockRows;
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t j0 = 0; j0 < kBlockRows; j0 += 16) {
    const __m512 scale = _mm512_loadu_ps(scales + j0);
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      __m256i col[16];
      TransposeWords16x16(data + j0 * K + k0, K, col);
      uint16_t* out = tile + (k0 / 2) * kPairStride + 2 * j0;
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) {
        // Lane r: byte k (low) and k+1 (high) of row j0+r, sign-extended.
        const __m512i x = _mm512_cvtepi16_epi32(col[c]);
        const __m512 even = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(x, 24), 24));
        const __m512 odd = _mm512_cvtepi32_ps(_mm512_srai_epi32(x, 8));
        const __m512i re = RoundBf16High(_mm512_mul_ps(scale, even));
        const __m512i ro = RoundBf16High(_mm512_mul_ps(scale, odd));
        // (ro & 0xffff0000) | (re >> 16)
        const __m512i pair = _mm512_ternarylogic_epi32(ro, odd_mask, _mm512_srli_epi32(re, 16), 0xea);
        _mm512_storeu_si512(out + c * kPairStride, pair);
      }
    }
  }
}

void DequantInt4(const common::MatrixView& w, int64_t block, uint16_t* tile) {
  const int64_t K = w.layout.padded_cols, groups = w.layout.groups;
  const uint8_t* data = w.data + block * w.layout.block_bytes;
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // Copies the high word of each 32-bit lane to both of its words.
  const __m512i dup_high = _mm512_set4_epi32(0x0f0e0f0e, 0x0b0a0b0a, 0x07060706, 0x03020302);
  for (int64_t j0 = 0; j0 < kBlockRows; j0 += 16) {
    const int64_t n0 = block * kBlockRows + j0;
    for (int64_t g = 0; g < groups; ++g) {
      __m512i lo[16], hi[16];  // row r: pairs 0..15 / 16..31 of the group
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        const int64_t sz = (n0 + r) * groups + g;
        const __m512 v = _mm512_mul_ps(_mm512_set1_ps(w.scales[sz]),
                                       _mm512_cvtepi32_ps(_mm512_sub_epi32(iota, _mm512_set1_epi32(w.zeros[sz]))));
        // Words 2q and 2q+1: bf16(scale * (q - zero)).
        const __m512i table = _mm512_shuffle_epi8(RoundBf16High(v), dup_high);
        const __m512i raw = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + (j0 + r) * (K / 2) + g * 32)));
        // vpermw reads index bits 0-4: 2 * low nibble (inputs 0..31), and
        // 2 * high nibble + bit 3 (inputs 32..63; either word of the lane).
        lo[r] = _mm512_permutexvar_epi16(_mm512_slli_epi16(raw, 1), table);
        hi[r] = _mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 3), table);
      }
      uint16_t* out = tile + g * 32 * kPairStride + 2 * j0;
      TransposeStore16x16(lo, out, kPairStride);
      TransposeStore16x16(hi, out + 16 * kPairStride, kPairStride);
    }
  }
}

}  // namespace

void DequantBf16Avx512(const common::MatrixView& w, int64_t block, uint16_t* tile) {
  if (w.layout.dtype == common::DType::kInt4) {
    DequantInt4(w, block, tile);
  } else {
    DequantInt8(w, block, tile);
  }
}

}  // namespace kernels
}  // namespace colibri
