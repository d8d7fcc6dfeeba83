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
//   C = [16 tokens][16 outputs] f32: stored straight into out[t][64] (and
//       loaded from there again between chunks of the inputs, below).

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
//
// The inputs are walked in chunks of kTileBf16ChunkCols: every token group
// multiplies a chunk (128 KiB of the block: it stays in L2) before the next
// chunk starts, the partial sums waiting in `out` (stored and loaded again
// as they are, so the bits are those of one pass over all inputs).
// Unchunked, every later token group would read the block again from L3
// once it outgrows L2 (a 14336-input block is 1.75 MiB, 128 tokens of its
// activations 3.5 MiB). On an Intel Xeon (Emerald Rapids), one core, 128
// tokens, a 4096 × 14336 matrix took 52–70 ms unchunked against 30–37 ms in
// chunks of 1024 inputs (512: about the same; 256: 36–39), best of 7, the
// variants alternating. Up to 32 tokens (one token group) the chunks change
// only the order in which the two passes read the block's halves, and add a
// store and a load of the C tiles per chunk. With the L1 prefetch below, the
// Mixtral-shaped layer (2 threads, calls alternating with the unchunked walk
// without the L1 prefetch, medians of 20, two runs) took 4% less at 32
// tokens, 11–12% less at 128 and 17–21% less at 256; the same at 8.
inline constexpr int64_t kTileBf16ChunkCols = 1024;

// kChunkCols (a multiple of 32): the chunk, other than the default only in
// tests (which compare the bits with those of a single chunk).
template <typename Machine, int64_t kChunkCols = kTileBf16ChunkCols>
void TileBf16AmxWith(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  const int64_t tokens = x.num_tokens, cols = x.cols;
  const uint8_t* weights = w.data + block * w.layout.block_bytes;
  const int64_t row_bytes = cols * static_cast<int64_t>(sizeof(uint16_t));
  constexpr int64_t kPairRow = 64 * 2 * sizeof(uint16_t);  // one input pair of the block's 64 outputs
  constexpr int64_t kOutStride = 64 * sizeof(float);
  constexpr int64_t kPrefetchSteps = 16;  // to L2: 16 × 4 KiB of the block ahead
  constexpr int64_t kL1Steps = 2;
  // An integer, not a pointer: the lines ahead may lie past the block (the
  // next block's: often the next a worker walks, in a chunk of blocks of one
  // matrix) or past the matrix (not fetched).
  const uintptr_t matrix_end = reinterpret_cast<uintptr_t>(w.data) + w.layout.data_bytes;
  TokenGroups configured;
  for (int64_t k0 = 0; k0 < cols; k0 += kChunkCols) {
    const int64_t k1 = std::min(cols, k0 + kChunkCols);
    for (int64_t t0 = 0; t0 < tokens; t0 += 32) {
      const auto [r0, r1] = ConfigureTokenGroups<Machine>(tokens, t0, &configured);
      for (int64_t j0 = 0; j0 < 64; j0 += 32) {
        float* o = out + t0 * 64 + j0;
        if (k0 == 0) {
          Machine::template Zero<0>();
          Machine::template Zero<1>();
          if (r1 > 0) {
            Machine::template Zero<2>();
            Machine::template Zero<3>();
          }
        } else {
          Machine::template Load<0>(o, kOutStride);
          Machine::template Load<1>(o + 16, kOutStride);
          if (r1 > 0) {
            Machine::template Load<2>(o + 16 * 64, kOutStride);
            Machine::template Load<3>(o + 16 * 64 + 16, kOutStride);
          }
        }
        for (int64_t k = k0; k < k1; k += 32) {
          const uint8_t* b = weights + (k / 2) * kPairRow + j0 * 2 * sizeof(uint16_t);
          // The first token group's two passes read the chunk from memory,
          // each the half of every pair row it multiplies (2 of its 4
          // lines), prefetched to L2 kPrefetchSteps k-steps on. (Whole pair
          // rows in the first pass alone left the memory idle while the
          // second ran: 10-14% slower at 32 and 64 tokens.)
          const uintptr_t ahead = reinterpret_cast<uintptr_t>(b) + kPrefetchSteps * 16 * kPairRow;
          if (t0 == 0 && ahead + 16 * kPairRow <= matrix_end) {
            for (int64_t row = 0; row < 16; ++row) {
              Machine::Prefetch(reinterpret_cast<const void*>(ahead + row * kPairRow));
              Machine::Prefetch(reinterpret_cast<const void*>(ahead + row * kPairRow + 64));
            }
          }
          // Every pass: the lines of the B tiles kL1Steps on, to L1 (a
          // tile loaded from L2 waits for its 16 lines one after another).
          if (k + 32 * kL1Steps < k1) {
            for (int64_t row = 0; row < 16; ++row) {
              Machine::PrefetchL1(b + kL1Steps * 16 * kPairRow + row * kPairRow);
              Machine::PrefetchL1(b + kL1Steps * 16 * kPairRow + row * kPairRow + 64);
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
        Machine::template Store<0>(o, kOutStride);
        Machine::template Store<1>(o + 16, kOutStride);
        if (r1 > 0) {
          Machine::template Store<2>(o + 16 * 64, kOutStride);
          Machine::template Store<3>(o + 16 * 64 + 16, kOutStride);
        }
      }
    }
  }
  Machine::Release();
}

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_TILE_BF16_AMX_H_
