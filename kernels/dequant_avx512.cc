// AVX-512 (F/BW/VL/DQ) dequantization to a bf16 tile (contract in
// kernels/dequant.h). Compiled with the AVX-512 flags only: no avx512_bf16,
// so bf16 rounding is integer arithmetic (RoundBf16High), the same bits as
// common::FloatToBf16 on finite values. Each f32 is computed as
// scale * float(q) (int8) or scale * float(q - zero) (int4), exactly as
// common::DecodeRow does, so every bit matches the scalar oracle.
//
// One 64-byte line of the tile holds the (k, k+1) pairs of 16 rows, so both
// kernels work on 16 rows at a time and transpose; each line is written once,
// whole.
//  * int8: per 64 inputs, the 16 rows' 64-byte lines are loaded once and
//    transposed as bytes (four in-lane unpack stages); each 16-byte column
//    (one input, 16 rows) is widened, converted, scaled by the 16 row scales
//    and rounded, and an even and an odd column are merged into one line.
//    ~10.5 cycles per 32 weights on Zen 4, bound by the vector ports (widen,
//    convert, multiply, round; ~2.5 of it the transposes).
//  * int4: per (row, group) there are only 16 values, so the row's table
//    bf16(scale * (q - zero)), q < 16, is one vector, and the group's 64
//    nibbles are looked up with two vpermw (16-bit lanes: the (k, k+1) pairs
//    come out in order); a 16 x 16 transpose of the 32-bit pairs gives the
//    lines. ~7 cycles per 32 weights, half of it the transpose.
// The next 16-row group is prefetched into L2 along the way (see PrefetchL2).

#include "kernels/x86_simd.h"

#include <cstdint>

#include "kernels/dequant.h"

namespace colibri {
namespace kernels {
namespace {

using common::kBlockRows;

// f32 -> bf16, round to nearest even, with the result in the high 16 bits of
// each lane (the low 16 are garbage). Finite inputs only. Same bits as
// FloatToBf16's bits + 0x7fff + lsb, in three ops on any vector port (no
// shift, no mask register: on Zen 4 both compete with the shuffles):
// t = bits + 0x8000 rounds every case right except an exact tie (low half
// 0x8000), which it rounds up; a tie leaves t's low half 0, so y = t + 0xffff
// has bit 16 equal to t's exactly for ties (else flipped), and clearing t's
// bit 16 there rounds the tie to even.
inline __m512i RoundBf16High(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i t = _mm512_add_epi32(bits, _mm512_set1_epi32(0x8000));
  const __m512i y = _mm512_add_epi32(bits, _mm512_set1_epi32(0x17fff));      // t + 0xffff
  return _mm512_ternarylogic_epi32(t, y, _mm512_set1_epi32(0x10000), 0x70);  // t & ~(y & 0x10000)
}

// 32-bit lane i: bf16(even_i) | bf16(odd_i) << 16.
inline __m512i PackPairs(__m512 even, __m512 odd) {
  // Word 2i: high word of even lane i; word 2i+1: high word of odd lane i.
  const __m512i high_words = _mm512_set_epi16(63, 31, 61, 29, 59, 27, 57, 25, 55, 23, 53, 21, 51, 19, 49, 17,  //
                                              47, 15, 45, 13, 43, 11, 41, 9, 39, 7, 37, 5, 35, 3, 33, 1);
  return _mm512_permutex2var_epi16(RoundBf16High(even), high_words, RoundBf16High(odd));
}

// 128-bit lane L of v.
template <int L>
inline __m128i Lane(__m512i v) {
  if constexpr (L == 0) return _mm512_castsi512_si128(v);
  return _mm512_extracti32x4_epi32(v, L);
}

// col[c] lane L = byte 16L + c of the 16 rows p + r * stride (64 bytes each),
// r < 16: four in-lane unpack stages, a 16 x 16 byte transpose per lane.
inline void TransposeBytes16x64(const int8_t* p, int64_t stride, __m512i (&col)[16]) {
  __m512i v[16], t[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) v[r] = _mm512_loadu_si512(p + r * stride);
    // t[2i+h] word w: byte 8h+w of rows 2i, 2i+1.
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi8(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi8(v[2 * i], v[2 * i + 1]);
  }
  // v[4i+e] dword d: byte 4e+d of rows 4i..4i+3.
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      v[4 * i + 2 * h] = _mm512_unpacklo_epi16(t[4 * i + h], t[4 * i + 2 + h]);
      v[4 * i + 2 * h + 1] = _mm512_unpackhi_epi16(t[4 * i + h], t[4 * i + 2 + h]);
    }
  }
  // t[8g+f] qword x: byte 2f+x of rows 8g..8g+7.
#pragma GCC unroll 2
  for (int g = 0; g < 2; ++g) {
#pragma GCC unroll 4
    for (int e = 0; e < 4; ++e) {
      t[8 * g + 2 * e] = _mm512_unpacklo_epi32(v[8 * g + e], v[8 * g + 4 + e]);
      t[8 * g + 2 * e + 1] = _mm512_unpackhi_epi32(v[8 * g + e], v[8 * g + 4 + e]);
    }
  }
#pragma GCC unroll 8
  for (int f = 0; f < 8; ++f) {
    col[2 * f] = _mm512_unpacklo_epi64(t[f], t[8 + f]);
    col[2 * f + 1] = _mm512_unpackhi_epi64(t[f], t[8 + f]);
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

// Prefetches into L2 `lines` 64-byte lines from base + offset (may lie past
// the block, even past the matrix: a prefetch never faults). The rows of a
// 16-row group are contiguous, so each step prefetches its share of the next
// group: cold blocks measured int4 29.8 -> 24.3 us, int8 32.1 -> 30.7 us
// (64 x 4096); into L1 instead was slower.
inline void PrefetchL2(const void* base, int64_t offset, int lines) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(base) + offset;  // no out-of-range pointer
  for (int i = 0; i < lines; ++i) _mm_prefetch(reinterpret_cast<const char*>(p + 64 * i), _MM_HINT_T1);
}

// The 16 inputs 16L + c of 16 rows (col[c] lane L, see TransposeBytes16x64)
// as 8 lines of (even, odd) pairs at out + f * kPairStride.
template <int L>
inline void Int8Lane(const __m512i (&col)[16], __m512 scale, uint16_t* out) {
#pragma GCC unroll 8
  for (int f = 0; f < 8; ++f) {
    const __m512 even = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(Lane<L>(col[2 * f])));
    const __m512 odd = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(Lane<L>(col[2 * f + 1])));
    _mm512_storeu_si512(out + f * kPairStride, PackPairs(_mm512_mul_ps(scale, even), _mm512_mul_ps(scale, odd)));
  }
}

void DequantInt8(const common::MatrixView& w, int64_t block, uint16_t* tile) {
  const int64_t K = w.layout.padded_cols;
  const int8_t* data = reinterpret_cast<const int8_t*>(w.data + block * w.layout.block_bytes);
  const float* scales = w.scales + block * kBlockRows;
  for (int64_t j0 = 0; j0 < kBlockRows; j0 += 16) {
    const __m512 scale = _mm512_loadu_ps(scales + j0);
    for (int64_t k0 = 0; k0 < K; k0 += 64) {
      PrefetchL2(data, (j0 + 16) * K + 16 * k0, 16);  // 16K bytes in K/64 steps
      __m512i col[16];
      TransposeBytes16x64(data + j0 * K + k0, K, col);
      uint16_t* out = tile + (k0 / 2) * kPairStride + 2 * j0;
      Int8Lane<0>(col, scale, out);
      Int8Lane<1>(col, scale, out + 8 * kPairStride);
      Int8Lane<2>(col, scale, out + 16 * kPairStride);
      Int8Lane<3>(col, scale, out + 24 * kPairStride);
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
      PrefetchL2(data, (j0 + 16) * (K / 2) + 512 * g, 8);  // 8K bytes in K/64 steps
      __m512i lo[16], hi[16];                              // row r: pairs 0..15 / 16..31 of the group
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
        lo[r] = _mm512_permutexvar_epi16(_mm512_add_epi16(raw, raw), table);
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
