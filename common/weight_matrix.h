#ifndef COLIBRI_COMMON_WEIGHT_MATRIX_H_
#define COLIBRI_COMMON_WEIGHT_MATRIX_H_

// How one weight matrix (W1, W3 or W2 of an expert) is stored, and the scalar
// encoder/decoder for every weight type. The layout is what the kernels read
// directly from the mapped file (docs/MODEL_FORMAT.md), so a kernel never
// reorders or dequantizes weights to memory.
//
// W has `rows` = output features N and `cols` = input features K (PyTorch's
// [out, in]). Both are padded with zeros: padded_rows = N rounded up to 64
// (one "block" = 64 consecutive outputs, the unit of work of every kernel),
// padded_cols = K rounded up to 64. For W of N x K and B = W^T (K x N, the
// weights of a oneDNN matmul y = x·B):
//
//   f32  : [N/64][K][64]      w(n,k) at ((n/64)*K + k)*64 + n%64
//          = oneDNN format BA16a64b of B (no reorder at call time)
//   bf16 : [N/64][K/2][64][2] w(n,k) at (((n/64)*(K/2) + k/2)*64 + n%64)*2 + k%2
//          = oneDNN format BA16a64b2a of B (the VNNI pairs vdpbf16ps reads)
//   f16  : [N/64][K][64], like f32
//   int8 : row-major i8 [N][K], w = scale[n] * q, q in [-127, 127],
//          scale = max|w_row| / 127 (symmetric); scales f32 [N]
//   int4 : row-major, K/2 bytes a row; within each group of 64 inputs, byte j
//          (j < 32) holds input j in its low nibble and input j+32 in its high
//          nibble; w = scale[n][g] * (q - zero[n][g]), q, zero in [0, 15]; the
//          range [min(w,0), max(w,0)] is split in 15 steps so 0 is exact;
//          scales f32 [N][K/64], zeros u8 [N][K/64]. Padding decodes to 0.
//
// (N, K above are the padded sizes.) Worst-case absolute error per weight,
// documented and tested: bf16 |w|·2^-9, f16 |w|·2^-11 (normal range), int8
// scale/2, int4 scale/2 of its group; MaxEncodingError returns a bound with
// a little slack.
//
// All functions are pure; views do not own memory.

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace colibri {
namespace common {

inline constexpr int64_t kBlockRows = 64;      // outputs per kernel work item
inline constexpr int64_t kInt4GroupSize = 64;  // inputs per int4 scale/zero
inline constexpr int64_t kColPadding = 64;

struct MatrixLayout {
  DType dtype = DType::kF32;
  int64_t rows = 0;         // N
  int64_t cols = 0;         // K
  int64_t padded_rows = 0;  // N rounded up to 64
  int64_t padded_cols = 0;  // K rounded up to 64
  int64_t groups = 0;       // int4: scale/zero groups per row; int8: 1; else 0
  size_t block_bytes = 0;   // bytes of one 64-row block of data
  size_t data_bytes = 0;    // padded_rows / 64 * block_bytes
  size_t scale_bytes = 0;   // f32 scales (int8: [padded_rows], int4: [padded_rows][groups])
  size_t zero_bytes = 0;    // u8 zero points (int4 only: [padded_rows][groups])

  int64_t num_blocks() const { return padded_rows / kBlockRows; }
};

// REQUIRES: IsWeightType(dtype), rows > 0, cols > 0.
MatrixLayout ComputeMatrixLayout(DType dtype, int64_t rows, int64_t cols);

// A stored matrix: pointers into a mapped file (or any buffer).
struct MatrixView {
  MatrixLayout layout;
  const uint8_t* data = nullptr;
  const float* scales = nullptr;   // int8 / int4 only
  const uint8_t* zeros = nullptr;  // int4 only
  // int8 / int4 only, optional: the whole matrix already in the layout of the
  // int8 tile kernels (kernels::BuildQ8Records), which then read it instead
  // of repacking each block per call. Null: repacked per call.
  const uint8_t* q8_records = nullptr;
};

// Encodes the 64-row block `block` of a matrix laid out as `layout` from f32
// `src` (row-major [rows_in_block][cols], rows_in_block = min(64, rows -
// 64*block)) into `block_data` (layout.block_bytes, that block's bytes) and
// the whole-matrix `scales` and `zeros`. Blocks are independent, so a large
// matrix can be encoded block by block; padding rows and columns are written.
void EncodeBlock(const MatrixLayout& layout, const float* src, int64_t block, uint8_t* block_data, float* scales,
                 uint8_t* zeros);

// Decodes row `row` (< layout.rows) into `out[0..cols)` as f32, the exact
// stored value.
void DecodeRow(const MatrixView& view, int64_t row, float* out);

// Bound on the error EncodeBlock made on row `row`, whose original values
// had max |w| = `row_abs_max` (used for bf16/f16).
float MaxEncodingError(const MatrixView& view, int64_t row, float row_abs_max);

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_WEIGHT_MATRIX_H_
