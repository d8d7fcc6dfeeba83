#ifndef COLIBRI_KERNELS_TILE_BF16_AMX_H_
#define COLIBRI_KERNELS_TILE_BF16_AMX_H_

// The AMX bf16 block kernel's walk over a block, on a tile Machine
// (kernels/amx_tiles.h: the hardware's instructions or their emulation).
//
// The product needs no repacking in either operand:
//   C[t][j] = Σ_k x[t][k] · W[j][k]   (16 tokens × 16 outputs per tile)
//   A = 16 tokens × 32 inputs of x.bf16: 1 KiB of x.bf16_tiles, or rows of
//       x.bf16, stride cols · 2 bytes;
//   B = 16 input pairs × 16 outputs of W: the stored bf16 layout is already
//       [K/2][64][2] per block (common/weight_matrix.h), i.e. the pair rows
//       tdpbf16ps reads, at a stride of 256 bytes;
//   C = [16 tokens][16 outputs] f32: stored straight into out[t][64].

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/weight_matrix.h"
#include "kernels/amx_tiles.h"
#include "kernels/block_kernel.h"

namespace colibri {
namespace kernels {

// out[t * 64 + j] = Σ_k W[64·block + j][k] · x.bf16[t][k], on Machine's tiles.
// The BlockKernelFn contract for bf16 weights (kernels/block_kernel.h),
// except that the sums are the tiles' (f32, in the hardware's order; inputs
// and results below the normal range count as 0).
template <typename Machine>
void TileBf16AmxWith(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  const int64_t tokens = x.num_tokens, cols = x.cols;
  const uint8_t* weights = w.data + block * w.layout.block_bytes;
  const int64_t row_bytes = cols * static_cast<int64_t>(sizeof(uint16_t));
  constexpr int64_t kPairRow = 64 * 2 * sizeof(uint16_t);  // one input pair of the block's 64 outputs
  constexpr int64_t kPrefetchSteps = 8;                    // 8 × 2 KiB of this pass's weights ahead
  int configured0 = -1, configured1 = -1;
  for (int64_t t0 = 0; t0 < tokens; t0 += 32) {
    const int r0 = static_cast<int>(std::min<int64_t>(16, tokens - t0));
    const int r1 = static_cast<int>(std::clamp<int64_t>(tokens - t0 - 16, 0, 16));
    if (r0 != configured0 || r1 != configured1) {
      const AmxTileConfig config = AmxConfig2x2(r0, r1);
      Machine::Configure(config);
      configured0 = r0, configured1 = r1;
    }
    for (int64_t j0 = 0; j0 < 64; j0 += 32) {
      Machine::template Zero<0>();
      Machine::template Zero<1>();
      if (r1 > 0) {
        Machine::template Zero<2>();
        Machine::template Zero<3>();
      }
      // The first 32 tokens' passes read the block from memory, each the
      // half of every pair row it multiplies (2 of its 4 lines), prefetched
      // kPrefetchSteps k-steps on. (Whole pair rows in the first pass alone,
      // the second reading its half from L2, left the memory idle while the
      // second pass ran: 10-14% slower at 32 and 64 tokens.)
      const bool from_memory = t0 == 0;
      for (int64_t k = 0; k < cols; k += 32) {
        const uint8_t* b = weights + (k / 2) * kPairRow + j0 * 2 * sizeof(uint16_t);
        if (from_memory && k + 32 * kPrefetchSteps < cols) {
          const uint8_t* ahead = b + kPrefetchSteps * 16 * kPairRow;
          for (int64_t row = 0; row < 16; ++row) {
            Machine::Prefetch(ahead + row * kPairRow);
            Machine::Prefetch(ahead + row * kPairRow + 64);
          }
        }
        Machine::template Load<6>(b, kPairRow);
        Machine::template Load<7>(b + 16 * 2 * sizeof(uint16_t), kPairRow);
        const TileOperand a0 = ActivationTile(x.bf16, x.bf16_tiles, row_bytes, t0, k * 2);
        Machine::template Load<4>(a0.data, a0.stride);
        Machine::template DotBf16<0, 4, 6>();
        Machine::template DotBf16<1, 4, 7>();
        if (r1 > 0) {
          const TileOperand a1 = ActivationTile(x.bf16, x.bf16_tiles, row_bytes, t0 + 16, k * 2);
          Machine::template Load<5>(a1.data, a1.stride);
          Machine::template DotBf16<2, 5, 6>();
          Machine::template DotBf16<3, 5, 7>();
        }
      }
      constexpr int64_t kOutStride = 64 * sizeof(float);
      float* o = out + t0 * 64 + j0;
      Machine::template Store<0>(o, kOutStride);
      Machine::template Store<1>(o + 16, kOutStride);
      if (r1 > 0) {
        Machine::template Store<2>(o + 16 * 64, kOutStride);
        Machine::template Store<3>(o + 16 * 64 + 16, kOutStride);
      }
    }
  }
  Machine::Release();
}

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_TILE_BF16_AMX_H_
