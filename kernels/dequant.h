#ifndef COLIBRI_KERNELS_DEQUANT_H_
#define COLIBRI_KERNELS_DEQUANT_H_

// Dequantization of one 64-row int8 / int4 block into a bf16 tile, for many
// tokens: the executor expands a block once per call into a small per-worker
// tile in the bf16 stored layout, then runs the bf16 block kernel
// (vdpbf16ps) on that tile for all T tokens, instead of converting every
// weight to f32 once per token tile (vocabulary in kernels/README.md).
//
// Contract: writes block `block` of the int8 or int4 matrix `w` into `tile`
// in the bf16 stored layout of one 64-row block ([K/2][64][2]):
//
//   tile[((k/2)*64 + j)*2 + k%2] = bf16(w(64*block + j, k))
//
// for k < w.layout.padded_cols, j < 64, where w(n, k) is exactly the value
// common::DecodeRow gives — scale[n] * static_cast<float>(q) for int8,
// scale[n][g] * static_cast<float>(q - zero[n][g]) for int4 — and padding
// rows/columns give 0 (the same formula on the encoder's padding). The f32
// value is rounded to bf16 to nearest, ties to even (common::FloatToBf16;
// the values are finite, so no variant handles NaN). Every variant writes
// the same bits.
//
// REQUIRES: w.layout.dtype is kInt8 or kInt4, block < w.layout.num_blocks(),
// tile has 64 * w.layout.padded_cols uint16_t (any alignment; 64-byte
// aligned is faster). Pure compute, deterministic, no allocation,
// thread-safe.

#include <cstdint>

#include "common/weight_matrix.h"

namespace colibri {
namespace kernels {

using DequantBf16Fn = void (*)(const common::MatrixView& w, int64_t block, uint16_t* tile);

// The readable reference (kernels/dequant_scalar.cc): the oracle.
void DequantBf16Scalar(const common::MatrixView& w, int64_t block, uint16_t* tile);
// AVX2 + FMA + F16C (kernels/dequant_avx2.cc).
void DequantBf16Avx2(const common::MatrixView& w, int64_t block, uint16_t* tile);
// AVX-512 F/BW/VL/DQ, without avx512_bf16 (kernels/dequant_avx512.cc).
void DequantBf16Avx512(const common::MatrixView& w, int64_t block, uint16_t* tile);

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_DEQUANT_H_
