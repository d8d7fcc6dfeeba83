#ifndef COLIBRI_KERNELS_INT_TILES_H_
#define COLIBRI_KERNELS_INT_TILES_H_

// How the VNNI int8/int4 block kernels (block_avx2_vnni.cc,
// block_avx512_bf16.cc) walk a 64-row block: tile functions of R rows × TT
// tokens, called over every (row, token). Compiled without ISA flags
// (int_tiles.cc) so that no ISA file's copy of it can reach another's.

#include <cstdint>

#include "kernels/block_kernel.h"

namespace colibri {
namespace kernels {

// out[t][r0 .. r0 + R) for tokens [t0, t0 + TT) of block `block` (R and TT
// are the tile function's own).
using IntTileFn = void (*)(const common::MatrixView& w, int64_t block, const Activations& x, int64_t r0, int64_t t0,
                           float* out);

// T = 1: `single` over rows [0, 64) in steps of `single_rows`. Otherwise 2
// rows at a time (outer: each pair of rows comes from memory once, then from
// L1/L2 for every further token tile) times token tiles of up to 4:
// tiles[n - 1] takes n tokens, on rows r0, r0 + 1. The tile functions must
// give each (row, token) the same operations in the same order whatever the
// tile, so that a token's bits depend only on its own inputs.
void RunIntTiles(IntTileFn single, int single_rows, const IntTileFn (&tiles)[4], const common::MatrixView& w,
                 int64_t block, const Activations& x, float* out);

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_INT_TILES_H_
