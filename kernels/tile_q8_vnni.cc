// int8 and int4 blocks through int8 tiles (AVX512_VNNI); this file's own
// compile flags add -mavx512vnni to the AVX-512 ones.
//
// The block kernels of block_avx512_bf16.cc multiply a row by a token along
// the row (sixteen int32 lanes of one output, summed at the end): at many
// rows per expert that costs ~3 operations per 64 weights and token. Here a
// 64-row block is first repacked, k-chunk by k-chunk, into the layout
// vpdpbusd reads down the rows: per 64-input group, 16 steps of
// [64 rows][4 inputs] bytes (4 zmm of 16 rows each). Per step, a token's 4
// int8 inputs are broadcast and one vpdpbusd per zmm adds 4 products to 16
// outputs: 64 multiply-adds an operation, no horizontal sums. Per group the
// exact int32 sums go to f32 once (acc += dot · xs_g, int4: · s_g too, minus
// the zero points). Repacking is paid once per block and call, so it pays
// from some tens of rows on (~16 with weights streamed from memory on Zen 5):
// the kernel profile measures where.
//
// The sums are those of the block kernels: BlockInt8Scalar / BlockInt4Scalar
// on x' = xq · xs, per group exact, then f32 in group order. A token's bits
// depend only on its own inputs (not on T, its tile, or the chunking: partial
// sums wait in `out`, exactly).

#include "kernels/x86_simd.h"

#include <algorithm>
#include <cstring>

#include "kernels/block_kernel.h"

namespace colibri {
namespace kernels {
namespace {

using common::kBlockRows;

constexpr int64_t kStepBytes = kBlockRows * 4;                    // one step: 64 rows x 4 inputs
constexpr int64_t kGroupBytes = 16 * kStepBytes;                  // one 64-input group of the block
constexpr int64_t kRecordBytes = kTileQ8RecordBytes;              // + int4's s_g and s_g·z_g per row
constexpr int64_t kPackedRecordBytes = kTileQ4PackedRecordBytes;  // int4 records built once: nibbles packed
constexpr int64_t kPackedGroupBytes = 8 * kStepBytes;
constexpr int64_t kChunkGroups = kTileQ8ChunkGroups;  // groups repacked at a time (~144 KiB: stays in L2)
static_assert(kRecordBytes == kGroupBytes + 2 * 64 * sizeof(float) && kRecordBytes % 64 == 0);
static_assert(kPackedRecordBytes == kPackedGroupBytes + 2 * 64 * sizeof(float) && kPackedRecordBytes % 64 == 0);
// Tokens per tile: up to 3 over all 64 rows (4 zmm a step: 12 int32 + 12 f32
// accumulators), 4 to 6 over 32 rows at a time (2 zmm: up to 12 + 12), which
// loads half the weights per product from L2.
constexpr int kMaxTokens = 6;

// 16 zmm, one per row (64 inputs each) -> 16 zmm, one per 4-input step (16 rows
// each): a 16 x 16 transpose of 32-bit elements.
inline void Transpose16(__m512i (&v)[16]) {
  __m512i a[16], b[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {
    b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  // Now b[4q + j] holds, per 128-bit lane L, element 4L + j of rows 4q..4q+3.
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m512i lo01 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x44);  // lanes 0,1 of rows 0-3, 4-7
    const __m512i hi01 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xee);  // lanes 2,3
    const __m512i lo23 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x44);
    const __m512i hi23 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xee);
    v[j] = _mm512_shuffle_i32x4(lo01, lo23, 0x88);       // lane 0: element j of all 16 rows
    v[4 + j] = _mm512_shuffle_i32x4(lo01, lo23, 0xdd);   // lane 1: element 4 + j
    v[8 + j] = _mm512_shuffle_i32x4(hi01, hi23, 0x88);   // lane 2
    v[12 + j] = _mm512_shuffle_i32x4(hi01, hi23, 0xdd);  // lane 3
  }
}

// Groups [g0, g1) of the block's rows into `tile`, a record per group. A
// row's group as 64 unsigned bytes: int8 weights + 128 (one xor), int4 nibbles
// 0..15 with input j of the group at byte j.
template <bool kInt4>
void Repack(const common::MatrixView& w, int64_t block, int64_t K, int64_t g0, int64_t g1, uint8_t* tile) {
  const int64_t groups = w.layout.groups;
  const uint8_t* base = w.data + block * w.layout.block_bytes;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int64_t g = g0; g < g1; ++g) {
    uint8_t* record = tile + (g - g0) * kRecordBytes;
    for (int q = 0; q < 4; ++q) {  // rows 16q .. 16q + 15
      __m512i v[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const int64_t r = 16 * q + i;
        if (kInt4) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + r * (K / 2) + g * 32));
          const __m256i lo = _mm256_and_si256(packed, low);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
          v[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        } else {
          v[i] = _mm512_xor_si512(_mm512_loadu_si512(base + r * K + g * 64), flip);
        }
      }
      Transpose16(v);
#pragma GCC unroll 16
      for (int s = 0; s < 16; ++s) _mm512_store_si512(record + s * kStepBytes + q * 64, v[s]);
    }
  }
  if (!kInt4) return;
  // Each record's s_g and s_g·z_g of its 64 rows. Stored row by row (a row's
  // groups side by side): 16 rows × 16 groups at a time, transposed.
  const int64_t n0 = block * kBlockRows;
  for (int q = 0; q < 4; ++q) {
    for (int64_t gb = g0; gb < g1; gb += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, g1 - gb));
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      __m512i s[16], z[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const int64_t at = (n0 + 16 * q + i) * groups + gb;
        s[i] = _mm512_castps_si512(_mm512_maskz_loadu_ps(mask, w.scales + at));
        z[i] = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, w.zeros + at));
      }
      Transpose16(s);
      Transpose16(z);
      for (int j = 0; j < n; ++j) {
        float* m = reinterpret_cast<float*>(tile + (gb - g0 + j) * kRecordBytes + kGroupBytes) + 16 * q;
        const __m512 scale = _mm512_castsi512_ps(s[j]);
        _mm512_store_ps(m, scale);
        _mm512_store_ps(m + 64, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(z[j])));
      }
    }
  }
}

// Lines [first, end) of the weights the next Repack reads: 64-byte lines,
// `per_row` a row from row0 on, rows `row_bytes` apart. Reading the rows
// across is 64 streams that no hardware prefetcher follows, so the last
// token tiles of a chunk prefetch the next chunk to L2 while they multiply:
// memory and compute overlap, and Repack reads from L2. (The first tiles
// would be too early: at many tokens the activations pass through L2 between.)
struct Ahead {
  const uint8_t* row0 = nullptr;
  int64_t row_bytes = 0, per_row = 1, first = 0, end = 0;
};
constexpr int64_t kFetchTiles = 4;  // the last this many token tiles share the prefetching

// Tokens [t0, t0 + TT), rows [16·v0, 16·(v0 + NV)), over the repacked groups
// [g0, g1): acc (in `out`, in the order of the block kernels' output:
// out[t * 64 + row]) += the groups' sums. int8: Σ_g xs_g·dot_g (the row scale
// and the 128s come off at the end); int4: Σ_g s_g·xs_g·dot_g −
// s_g·z_g·q8_sums_g. The same operations per (row, token) whatever TT and NV.
// kPacked (int4 records built once): a step pair's bytes hold step s in the
// low nibbles and s + 8 in the high ones, split in registers; the int32 sums
// are exact, so the bits are those of the unpacked records.
template <bool kInt4, bool kPacked, int TT, int NV>
void Multiply(const uint8_t* tile, const Activations& x, int64_t t0, int64_t g0, int64_t g1, const Ahead& ahead, int v0,
              float* out) {
  static_assert(kInt4 || !kPacked);
  constexpr int64_t kRecord = kPacked ? kPackedRecordBytes : kRecordBytes;
  constexpr int64_t kSteps = kPacked ? kPackedGroupBytes : kGroupBytes;  // where the scales start
  const int64_t K = x.cols, groups = K / 64;
  float* o = out + t0 * kBlockRows;
  __m512 acc[TT][NV];
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i)
      acc[t][i] = g0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o + t * kBlockRows + 16 * (v0 + i));
  }
  const int64_t fetch_per_group = (ahead.end - ahead.first + (g1 - g0) - 1) / (g1 - g0);
  int64_t line = ahead.first;
  for (int64_t g = g0; g < g1; ++g) {
    for (const int64_t end = std::min(ahead.end, line + fetch_per_group); line < end; ++line) {
      const uint8_t* p = ahead.row0 + (line / ahead.per_row) * ahead.row_bytes + (line % ahead.per_row) * 64;
      _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
    }
    const uint8_t* record = tile + (g - g0) * kRecord;
    const int8_t* xq = x.q8 + t0 * K + g * 64;
    __m512i dot[TT][NV];
    if constexpr (kPacked) {
      const __m512i low = _mm512_set1_epi8(0x0f);
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        __m512i xlo[TT], xhi[TT];
#pragma GCC unroll 8
        for (int t = 0; t < TT; ++t) {
          int32_t four;
          std::memcpy(&four, xq + t * K + 4 * s, 4);
          xlo[t] = _mm512_set1_epi32(four);
          std::memcpy(&four, xq + t * K + 4 * (s + 8), 4);
          xhi[t] = _mm512_set1_epi32(four);
        }
#pragma GCC unroll 4
        for (int i = 0; i < NV; ++i) {
          const __m512i both = _mm512_load_si512(record + s * kStepBytes + 64 * (v0 + i));
          const __m512i lo = _mm512_and_si512(both, low);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(both, 4), low);
#pragma GCC unroll 8
          for (int t = 0; t < TT; ++t) {
            dot[t][i] = _mm512_dpbusd_epi32(s == 0 ? _mm512_setzero_si512() : dot[t][i], lo, xlo[t]);
            dot[t][i] = _mm512_dpbusd_epi32(dot[t][i], hi, xhi[t]);
          }
        }
      }
    } else {
#pragma GCC unroll 16
      for (int s = 0; s < 16; ++s) {
        __m512i xv[TT];
#pragma GCC unroll 8
        for (int t = 0; t < TT; ++t) {
          int32_t four;
          std::memcpy(&four, xq + t * K + 4 * s, 4);
          xv[t] = _mm512_set1_epi32(four);
        }
#pragma GCC unroll 4
        for (int i = 0; i < NV; ++i) {
          const __m512i wv = _mm512_load_si512(record + s * kStepBytes + 64 * (v0 + i));
#pragma GCC unroll 8
          for (int t = 0; t < TT; ++t) {
            dot[t][i] = _mm512_dpbusd_epi32(s == 0 ? _mm512_setzero_si512() : dot[t][i], wv, xv[t]);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      const __m512 xs = _mm512_set1_ps(x.q8_scales[(t0 + t) * groups + g]);
      const __m512 sums = _mm512_set1_ps(kInt4 ? x.q8_sums[(t0 + t) * groups + g] : 0.f);
#pragma GCC unroll 4
      for (int i = 0; i < NV; ++i) {
        const __m512 d = _mm512_cvtepi32_ps(dot[t][i]);
        if (kInt4) {
          const float* m = reinterpret_cast<const float*>(record + kSteps) + 16 * (v0 + i);
          const __m512 scale = _mm512_mul_ps(_mm512_load_ps(m), xs);
          acc[t][i] = _mm512_fnmadd_ps(_mm512_load_ps(m + 64), sums, _mm512_fmadd_ps(d, scale, acc[t][i]));
        } else {
          acc[t][i] = _mm512_fmadd_ps(d, xs, acc[t][i]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(o + t * kBlockRows + 16 * (v0 + i), acc[t][i]);
  }
}

using MultiplyFn = void (*)(const uint8_t*, const Activations&, int64_t, int64_t, int64_t, const Ahead&, int, float*);
// n tokens: Tiles<...>[n - 1], over all rows (n <= 3) or over each half.
template <bool kInt4, bool kPacked>
constexpr MultiplyFn kTiles[kMaxTokens] = {Multiply<kInt4, kPacked, 1, 4>, Multiply<kInt4, kPacked, 2, 4>,
                                           Multiply<kInt4, kPacked, 3, 4>, Multiply<kInt4, kPacked, 4, 2>,
                                           Multiply<kInt4, kPacked, 5, 2>, Multiply<kInt4, kPacked, 6, 2>};

template <bool kInt4>
void Run(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* scratch, float* out) {
  const int64_t K = x.cols, T = x.num_tokens, groups = K / 64;
  constexpr int64_t kGroupRowBytes = kInt4 ? 32 : 64;  // a group of one row, stored
  const uint8_t* base = w.data + block * w.layout.block_bytes;
  // Records built ahead (BuildQ8Records): this block's, read in place (int4's packed).
  const int64_t record_bytes = BuiltQ8RecordBytes(w.layout.dtype);
  const uint8_t* records = w.q8_records != nullptr ? w.q8_records + block * groups * record_bytes : nullptr;
  const MultiplyFn* tiles_of = records != nullptr && kInt4 ? kTiles<kInt4, kInt4> : kTiles<kInt4, false>;
  for (int64_t g0 = 0; g0 < groups; g0 += kChunkGroups) {
    const int64_t g1 = std::min(groups, g0 + kChunkGroups);
    // The next chunk: this block's, or after the last one the next block's first.
    const int64_t next_groups = g1 < groups ? std::min(kChunkGroups, groups - g1) : std::min(kChunkGroups, groups);
    Ahead ahead;
    if (records != nullptr) {  // the next chunk's records follow this one's
      ahead.row0 = records + g1 * record_bytes;
      ahead.per_row = next_groups * record_bytes / 64;
    } else {
      ahead.row_bytes = K / 64 * kGroupRowBytes;
      ahead.row0 = g1 < groups ? base + g1 * kGroupRowBytes : base + w.layout.block_bytes;
      ahead.per_row = (next_groups * kGroupRowBytes + 63) / 64;
    }
    const bool last = g1 == groups && block + 1 == w.layout.num_blocks();  // nothing of the matrix follows
    const int64_t rows_ahead = records != nullptr ? 1 : kBlockRows;
    const int64_t lines = last ? 0 : rows_ahead * ahead.per_row, tiles = (T + kMaxTokens - 1) / kMaxTokens;
    const int64_t fetching = std::min(tiles, kFetchTiles);
    const uint8_t* chunk = records != nullptr ? records + g0 * record_bytes : scratch;
    if (records == nullptr) Repack<kInt4>(w, block, K, g0, g1, scratch);
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t t0 = tile * kMaxTokens, j = tile - (tiles - fetching);  // j-th of the prefetching tiles
      Ahead part = ahead;
      part.first = j < 0 ? 0 : lines * j / fetching;
      part.end = j < 0 ? 0 : lines * (j + 1) / fetching;
      const int64_t n = std::min<int64_t>(kMaxTokens, T - t0);
      if (n <= 3) {
        tiles_of[n - 1](chunk, x, t0, g0, g1, part, 0, out);
      } else {  // rows 0-31, then 32-63, each with half the lines to prefetch
        Ahead second = part;
        part.end = second.first = (part.first + part.end) / 2;
        tiles_of[n - 1](chunk, x, t0, g0, g1, part, 0, out);
        tiles_of[n - 1](chunk, x, t0, g0, g1, second, 2, out);
      }
    }
  }
  if (!kInt4) FinishTileInt8(w, block, x, out);
}

}  // namespace

void RepackQ8Records(const common::MatrixView& w, int64_t block, int64_t g0, int64_t g1, uint8_t* records) {
  if (w.layout.dtype == common::DType::kInt4) {
    Repack<true>(w, block, w.layout.padded_cols, g0, g1, records);
  } else {
    Repack<false>(w, block, w.layout.padded_cols, g0, g1, records);
  }
}

void BuildQ8Records(const common::MatrixView& w, uint8_t* records) {
  const int64_t groups = w.layout.padded_cols / 64;
  if (w.layout.dtype != common::DType::kInt4) {
    for (int64_t b = 0; b < w.layout.num_blocks(); ++b)
      RepackQ8Records(w, b, 0, groups, records + b * groups * kRecordBytes);
    return;
  }
  // int4: each group repacked as per call, then its steps s and s + 8 packed into one step's bytes.
  alignas(64) uint8_t record[kRecordBytes];
  uint8_t* packed = records;
  for (int64_t b = 0; b < w.layout.num_blocks(); ++b) {
    for (int64_t g0 = 0; g0 < groups; ++g0, packed += kPackedRecordBytes) {
      RepackQ8Records(w, b, g0, g0 + 1, record);
      for (int64_t at = 0; at < kPackedGroupBytes; at += 64) {
        const __m512i lo = _mm512_load_si512(record + at);
        const __m512i hi = _mm512_load_si512(record + kPackedGroupBytes + at);  // bytes 0..15: no carry
        _mm512_store_si512(packed + at, _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)));
      }
      std::memcpy(packed + kPackedGroupBytes, record + kGroupBytes, kRecordBytes - kGroupBytes);
    }
  }
}

void UnpackQ4Records(const uint8_t* packed, int64_t groups, uint8_t* records) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t g = 0; g < groups; ++g, packed += kPackedRecordBytes, records += kRecordBytes) {
    for (int64_t at = 0; at < kPackedGroupBytes; at += 64) {
      const __m512i both = _mm512_load_si512(packed + at);
      _mm512_store_si512(records + at, _mm512_and_si512(both, low));
      _mm512_store_si512(records + kPackedGroupBytes + at, _mm512_and_si512(_mm512_srli_epi16(both, 4), low));
    }
    std::memcpy(records + kGroupBytes, packed + kPackedGroupBytes, kRecordBytes - kGroupBytes);
  }
}

void FinishTileInt8(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  // out = scale_row · (acc − 128 · Σ_g q8_sums_g), as the block kernel does.
  const int64_t T = x.num_tokens, groups = x.cols / 64;
  const float* scales = w.scales + block * kBlockRows;
  for (int64_t t = 0; t < T; ++t) {
    __m512 c = _mm512_setzero_ps();
    const float* sums = x.q8_sums + t * groups;
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 m = groups - g >= 16 ? 0xffff : static_cast<__mmask16>((1u << (groups - g)) - 1);
      c = _mm512_add_ps(c, _mm512_maskz_loadu_ps(m, sums + g));
    }
    const __m512 corr = _mm512_set1_ps(128.f * _mm512_reduce_add_ps(c));
    for (int i = 0; i < 4; ++i) {
      float* o = out + t * kBlockRows + 16 * i;
      _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(scales + 16 * i), _mm512_sub_ps(_mm512_loadu_ps(o), corr)));
    }
  }
}

void TileInt8Vnni(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* scratch, float* out) {
  Run<false>(w, block, x, scratch, out);
}

void TileInt4Vnni(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* scratch, float* out) {
  Run<true>(w, block, x, scratch, out);
}

}  // namespace kernels
}  // namespace colibri
