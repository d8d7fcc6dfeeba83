#ifndef COLIBRI_KERNELS_BLOCK_KERNEL_H_
#define COLIBRI_KERNELS_BLOCK_KERNEL_H_

// The one primitive every weight type and ISA implements (vocabulary in
// kernels/README.md): one 64-row block of a weight matrix times T tokens.
//
//   out[t * 64 + j] = Σ_{k < x.cols} W[64·block + j][k] · x[t][k]   (t < T, j < 64)
//
// W is a common::MatrixView in the stored layout (common/weight_matrix.h):
// dequantization happens in registers, nothing is written but `out`.
// Activations are read as f32, except that bf16 weights multiply the bf16
// copy x.bf16 (every variant, the scalar one included, so all bf16 variants
// compute the same products) and the VNNI int4 and int8 variants
// (ReadsQ8() in kernels/dispatch.h) multiply the int8 copy x.q8 (their
// oracle: the scalar variant on q8 · scale). Accumulation is f32 in an order
// fixed by the variant: the same inputs always give the same bits. Pure compute: no
// allocation, no threads, no Status; thread-safe.

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/weight_matrix.h"

namespace colibri {
namespace kernels {

// The activations of T tokens, prepared once and read by every block.
struct Activations {
  int64_t num_tokens = 0;             // T
  int64_t cols = 0;                   // padded K (a multiple of 64); entries past the real K are 0
  const float* f32 = nullptr;         // [T][cols], rows 64-byte aligned
  const uint16_t* bf16 = nullptr;     // [T][cols], f32 rounded to bf16 (nearest even)
  const float* group_sums = nullptr;  // [T][cols / 64]: Σ_k of f32 over each 64-input group
  // The int8 copy integer dot products read (QuantizeGroupQ8 per 64-input
  // group; set by the executor for int4 and int8 weights): q8 [T][cols], q8_scales and
  // q8_sums [T][cols / 64]. x' = q8 · scale is what those kernels multiply.
  const int8_t* q8 = nullptr;
  const float* q8_scales = nullptr;
  const float* q8_sums = nullptr;
  // Optional: bf16 and q8 again in tile order (TileOrderBytes below), which
  // the AMX tile kernels read instead of the rows where it is set.
  const uint8_t* bf16_tiles = nullptr;
  const uint8_t* q8_tiles = nullptr;
};

// Tile order: rows of `row_bytes` bytes (a multiple of 64: cols · 2 for
// bf16, cols for q8) as, per group of 16 tokens, per 64 bytes of a row, the
// 16 rows' 64 bytes together: each AMX A operand (16 tokens × 64 bytes) is
// then 1 KiB in one piece. Read from the rows, a tile's 16 rows lie
// row_bytes apart — a multiple of 4 KiB for the usual model widths — and
// fall into one L1 set: on an Intel Xeon (Emerald Rapids) the AMX bf16 walk
// over a 4096 × 4096 matrix at 128 tokens took 16.8 ms so, 12.6 in tile
// order. A last group with fewer than 16 tokens leaves its unused rows as
// they are (a tile of fewer rows never reads them).
inline int64_t TileOrderBytes(int64_t tokens, int64_t row_bytes) { return (tokens + 15) / 16 * 16 * row_bytes; }
// Copies bytes [first, first + count) of token t's row `row` (multiples of
// 64) to their places in `tiles`.
inline void CopyToTileOrder(const void* row, int64_t t, int64_t first, int64_t count, int64_t row_bytes,
                            uint8_t* tiles) {
  const auto* src = static_cast<const uint8_t*>(row);
  for (int64_t at = first; at < first + count; at += 64) {
    std::memcpy(tiles + ((t / 16) * (row_bytes / 64) + at / 64) * 1024 + (t % 16) * 64, src + at, 64);
  }
}

// One 64-input group to int8, symmetric: scale = max|x| / 127 (0 for an
// all-zero group), q[i] = round(x[i] / scale) (nearest even) in [-127, 127],
// *sum = scale · Σ q. A group with a non-finite value gets q = 0 and a NaN
// scale and sum, so results stay non-finite as f32 math would leave them. Pure.
void QuantizeGroupQ8(const float* x, int8_t* q, float* scale, float* sum);

// REQUIRES: w.layout.padded_cols == x.cols, block < w.layout.num_blocks(),
// out has T * 64 floats, and the pointers of x that the dtype reads are set.
using BlockKernelFn = void (*)(const common::MatrixView& w, int64_t block, const Activations& x, float* out);

// The readable scalar reference of every block kernel (kernels/block_scalar.cc):
// the oracle the ISA variants are tested against.
void BlockF32Scalar(const common::MatrixView& w, int64_t block, const Activations& x, float* out);
void BlockBf16Scalar(const common::MatrixView& w, int64_t block, const Activations& x, float* out);
void BlockF16Scalar(const common::MatrixView& w, int64_t block, const Activations& x, float* out);
void BlockInt8Scalar(const common::MatrixView& w, int64_t block, const Activations& x, float* out);
void BlockInt4Scalar(const common::MatrixView& w, int64_t block, const Activations& x, float* out);

// AVX2 + FMA + F16C (kernels/block_avx2.cc).
void BlockF32Avx2(const common::MatrixView& w, int64_t block, const Activations& x, float* out);
void BlockBf16Avx2(const common::MatrixView& w, int64_t block, const Activations& x, float* out);
void BlockF16Avx2(const common::MatrixView& w, int64_t block, const Activations& x, float* out);
void BlockInt8Avx2(const common::MatrixView& w, int64_t block, const Activations& x, float* out);
void BlockInt4Avx2(const common::MatrixView& w, int64_t block, const Activations& x, float* out);

// AVX2 with AVX-VNNI (the VEX vpdpbusd; kernels/block_avx2_vnni.cc): int8 and
// int4 weights on the int8 copy x.q8 in 8-lane vectors, BlockInt8Scalar /
// BlockInt4Scalar on x' = q8 · scale like the AVX512_VNNI variants below.
// REQUIRES: the CPU has AVX-VNNI (HasAvxVnni()); x.q8, q8_scales, q8_sums set.
void BlockInt8Avx2Vnni(const common::MatrixView& w, int64_t block, const Activations& x, float* out);
void BlockInt4Avx2Vnni(const common::MatrixView& w, int64_t block, const Activations& x, float* out);

// AVX-512 F/BW/VL/DQ (kernels/block_avx512.cc).
void BlockF32Avx512(const common::MatrixView& w, int64_t block, const Activations& x, float* out);
void BlockBf16Avx512(const common::MatrixView& w, int64_t block, const Activations& x, float* out);
void BlockF16Avx512(const common::MatrixView& w, int64_t block, const Activations& x, float* out);
void BlockInt8Avx512(const common::MatrixView& w, int64_t block, const Activations& x, float* out);
void BlockInt4Avx512(const common::MatrixView& w, int64_t block, const Activations& x, float* out);

// AVX-512 with AVX512_BF16 (vdpbf16ps) and AVX512_VNNI (vpdpbusd)
// (kernels/block_avx512_bf16.cc). The int4 and int8 variants multiply the
// int8 copy x.q8 (integer dot products per group): they compute
// BlockInt4Scalar / BlockInt8Scalar on the activations x' = q8 · scale.
// REQUIRES for them: x.q8, q8_scales, q8_sums set.
void BlockBf16Avx512Bf16(const common::MatrixView& w, int64_t block, const Activations& x, float* out);
void BlockInt4Avx512Vnni(const common::MatrixView& w, int64_t block, const Activations& x, float* out);
// int8 weights on the int8 copy x.q8, the same way: BlockInt8Scalar on x'.
void BlockInt8Avx512Vnni(const common::MatrixView& w, int64_t block, const Activations& x, float* out);

// A block kernel that first repacks the block, k-chunk by k-chunk, into
// `scratch` (for many tokens: the repacking is paid once per block, not per
// token). The same contract as BlockKernelFn otherwise.
// REQUIRES: scratch holds TileQ8ScratchBytes(x.cols) bytes, 64-byte aligned.
using TileKernelFn = void (*)(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* scratch,
                              float* out);
// The int8 tiles' layout (kernels/tile_q8_vnni.cc): per 64-input group, 16
// steps of [64 rows][4 bytes], then f32 [64] scales and [64] zero terms;
// kTileQ8ChunkGroups groups at a time.
inline constexpr int64_t kTileQ8ChunkGroups = 32;
inline constexpr int64_t kTileQ8RecordBytes = 16 * 64 * 4 + 2 * 64 * sizeof(float);
// Records built once for an int4 matrix keep the nibbles packed: per group 8
// step pairs of [64 rows][4 bytes], step s in the low nibbles and step s + 8
// in the high ones, then the same scales: 2.5 KiB per 64 × 64 weights, not 4.5.
inline constexpr int64_t kTileQ4PackedRecordBytes = 8 * 64 * 4 + 2 * 64 * sizeof(float);
// The bytes of one group's record in a matrix's built records (MatrixView::q8_records).
inline constexpr int64_t BuiltQ8RecordBytes(common::DType type) {
  return type == common::DType::kInt4 ? kTileQ4PackedRecordBytes : kTileQ8RecordBytes;
}
inline constexpr size_t TileQ8ScratchBytes(int64_t cols) {
  return static_cast<size_t>((cols / 64 < kTileQ8ChunkGroups ? cols / 64 : kTileQ8ChunkGroups) * kTileQ8RecordBytes);
}

// int8 / int4 weights repacked to int8 tiles that vpdpbusd reads down the
// rows (AVX512_VNNI; kernels/tile_q8_vnni.cc), times x.q8: BlockInt8Scalar /
// BlockInt4Scalar on x' = q8 · scale, like the VNNI block kernels, with the
// f32 sums in another order. REQUIRES: x.q8, q8_scales, q8_sums set.
void TileInt8Vnni(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* scratch, float* out);
void TileInt4Vnni(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* scratch, float* out);

// The pieces of the int8 tiles the AMX ones reuse (kernels/tile_q8_vnni.cc;
// REQUIRE AVX-512): groups [g0, g1) of block `block` of an int8/int4 matrix
// repacked into `records` (kTileQ8RecordBytes each, 64-byte aligned), and
// int8's last step, out = row scale · (out − 128 · Σ_g x.q8_sums), which
// takes off the 128 the repacking added to every weight.
void RepackQ8Records(const common::MatrixView& w, int64_t block, int64_t g0, int64_t g1, uint8_t* records);
// Bytes of a whole int8/int4 matrix's built records: every block's groups'
// records, block after block (groups = padded_cols / 64), int4's packed.
inline size_t Q8RecordsBytes(const common::MatrixLayout& l) {
  return static_cast<size_t>(l.num_blocks() * (l.padded_cols / 64) * BuiltQ8RecordBytes(l.dtype));
}
// Fills `records` (Q8RecordsBytes(w.layout) bytes, 64-byte aligned) with the
// whole matrix in that layout (int4: packed): what MatrixView::q8_records
// points to. The tile kernels give the same bits with it as without.
// REQUIRES AVX-512.
void BuildQ8Records(const common::MatrixView& w, uint8_t* records);
// `groups` packed int4 records → the per-call layout (kTileQ8RecordBytes
// each), for the AMX tiles, whose operands are bytes in memory.
void UnpackQ4Records(const uint8_t* packed, int64_t groups, uint8_t* records);
void FinishTileInt8(const common::MatrixView& w, int64_t block, const Activations& x, float* out);

// int8 / int4 weights on AMX tiles (tdpbsud; kernels/tile_q8_amx.h): the
// int8 tiles' records times x.q8, 16 tokens × 16 outputs × one 64-input
// group per instruction; per group the exact int32 sums go to f32 as the
// VNNI tiles do, so the result is TileInt8Vnni's / TileInt4Vnni's bit for
// bit. REQUIRES: the avx512_amx level; as TileInt8Vnni otherwise.
void TileInt8Amx(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* scratch, float* out);
void TileInt4Amx(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* scratch, float* out);

// bf16 weights on AMX tiles (tdpbf16ps; kernels/tile_bf16_amx.{h,cc}): the
// stored bf16 layout times x.bf16 as they are, 16 tokens × 16 outputs per
// tile; `scratch` is not used. BlockBf16Scalar within the block tolerance,
// the f32 sums in the tiles' order (inputs and results below the normal
// range count as 0). REQUIRES: the avx512_amx level (DetectIsa(): AMX-BF16
// present and its tile state granted by the kernel).
void TileBf16Amx(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* scratch, float* out);
// TILERELEASE: this thread's tile state back to its initial one (after a
// self-check that faulted midway). REQUIRES: as TileBf16Amx.
void ReleaseTilesAmx();

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_BLOCK_KERNEL_H_
