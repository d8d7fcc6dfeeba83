#ifndef COLIBRI_COMMON_WEIGHT_MATRIX_H_
#define COLIBRI_COMMON_WEIGHT_MATRIX_H_

// How one weight matrix (W1, W3 or W2 of an expert) is stored, and the scalar
// encoder/decoder for every weight type. The layout is what the kernels read
// directly from the mapped file (docs/MODEL_FORMAT.md):
//
//   rows = output features, cols = input features (PyTorch's [out, in]).
//   Each row is padded with zeros to `padded_cols` = cols rounded up to 64, so
//   SIMD kernels never see a ragged weight row.
//   f32 / bf16 / f16 : data[rows][padded_cols] of that type.
//   int8             : data int8[rows][padded_cols], w = scale[row] * q,
//                      scale = max|w_row| / 127 (symmetric, q in [-127, 127]).
//   int4             : groups of 64 inputs; data u8[rows][padded_cols / 2],
//                      element 2j in the low nibble of byte j, 2j+1 in the high;
//                      w = scale[row][g] * (q - zero[row][g]), q and zero in
//                      [0, 15]; the range [min(w,0), max(w,0)] is split in 15
//                      steps, so 0 is exact. Padding holds q = zero (value 0).
//
// Worst-case absolute error per weight (documented bound, tested):
//   bf16: |w| * 2^-9, f16: |w| * 2^-11 (normal range), int8: scale / 2,
//   int4: scale / 2 of its group.
//
// All functions are pure; views do not own memory.

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace colibri {
namespace common {

inline constexpr int64_t kInt4GroupSize = 64;
inline constexpr int64_t kRowPadding = 64;  // elements

struct MatrixLayout {
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t padded_cols = 0;
  int64_t groups = 0;       // int4: scale/zero groups per row; int8: 1; else 0
  size_t row_bytes = 0;     // bytes of one stored data row
  size_t data_bytes = 0;    // rows * row_bytes
  size_t scale_bytes = 0;   // f32 scales (int8: [rows], int4: [rows][groups])
  size_t zero_bytes = 0;    // u8 zero points (int4 only: [rows][groups])
};

// REQUIRES: IsWeightType(dtype), rows > 0, cols > 0.
MatrixLayout ComputeMatrixLayout(DType dtype, int64_t rows, int64_t cols);

// A stored matrix: pointers into a mapped file (or any buffer).
struct MatrixView {
  MatrixLayout layout;
  const uint8_t* data = nullptr;
  const float* scales = nullptr;  // int8 / int4 only
  const uint8_t* zeros = nullptr;  // int4 only
};

// Encodes `n` consecutive rows of f32 `src` (row-major [n][cols]) starting at
// row `first_row` into the three destination regions of a whole matrix laid
// out as `layout` (which must be large enough). Rows are independent, so a
// large matrix can be encoded chunk by chunk.
void EncodeRows(const MatrixLayout& layout, const float* src, int64_t first_row, int64_t n,
                uint8_t* data, float* scales, uint8_t* zeros);

// Decodes row `row` into `out[0..cols)` as f32 (the exact stored value).
void DecodeRow(const MatrixView& view, int64_t row, float* out);

// Largest absolute error EncodeRows may make on row `row` of `view`'s
// original values, per the bounds above; `row_abs_max` is max|w| of that row
// (used for bf16/f16). Used by tests and the converter's report.
float MaxEncodingError(const MatrixView& view, int64_t row, float row_abs_max);

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_WEIGHT_MATRIX_H_
