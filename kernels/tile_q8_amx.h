#ifndef COLIBRI_KERNELS_TILE_Q8_AMX_H_
#define COLIBRI_KERNELS_TILE_Q8_AMX_H_

// The AMX int8/int4 block kernels' walk over a block, on a tile Machine
// (kernels/amx_tiles.h: the hardware's instructions or their emulation).
//
// The weights are repacked, 32 groups at a time, into the records of the
// VNNI int8 tiles (RepackQ8Records, kernels/tile_q8_vnni.cc): per 64-input
// group, 16 steps of [64 rows][4 bytes] — which is tdpbsud's B operand as
// it stands: 16 rows of input quads × 16 outputs, 256 bytes apart, at a
// 64-byte offset per 16 outputs. Weights are unsigned there (int8 + 128,
// int4 nibbles 0..15), the activations x.q8 signed: tdpbsud, A signed.
//   A = 16 tokens × one 64-input group of x.q8: 1 KiB of x.q8_tiles, or
//       rows of x.q8, stride cols;
//   C = [16 tokens][16 outputs] int32, the group's exact dot products.
// One instruction is a whole group, and every group has its own activation
// scale per token, so each group's C tiles are stored to a small buffer and
// added to `out` in f32 exactly as the VNNI tiles add theirs
// (acc = fma(dot, xs, acc); int4: fma(−s·z, q8_sum, fma(dot, s · xs, acc))),
// in group order: the same bits as TileInt8Vnni / TileInt4Vnni.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/weight_matrix.h"
#include "kernels/amx_tiles.h"
#include "kernels/block_kernel.h"

namespace colibri {
namespace kernels {

template <typename Machine, bool kInt4>
void TileQ8AmxWith(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* scratch, float* out) {
  using common::kBlockRows;
  constexpr int64_t kStep = kBlockRows * 4;       // one step of a record: 64 rows × 4 inputs
  constexpr int64_t kGroupBytes = 16 * kStep;     // the steps of one group; then int4's s and s·z
  constexpr int64_t kRowBytes = kInt4 ? 32 : 64;  // one group of one stored row
  const int64_t T = x.num_tokens, K = x.cols, groups = K / 64;
  const uint8_t* base = w.data + block * w.layout.block_bytes;
  alignas(64) int32_t dots[32][32];  // C of two token groups × 32 outputs
  std::fill(out, out + T * kBlockRows, 0.f);
  TokenGroups configured;
  // Records built ahead (BuildQ8Records) are read in place, front to back;
  // int4's, packed, are unpacked a chunk at a time into `scratch` (in cache).
  const int64_t record_bytes = BuiltQ8RecordBytes(w.layout.dtype);
  const uint8_t* records = w.q8_records != nullptr ? w.q8_records + block * groups * record_bytes : nullptr;
  for (int64_t g0 = 0; g0 < groups; g0 += kTileQ8ChunkGroups) {
    const int64_t g1 = std::min(groups, g0 + kTileQ8ChunkGroups);
    const uint8_t* chunk = records != nullptr && !kInt4 ? records + g0 * kTileQ8RecordBytes : scratch;
    if (records == nullptr) {
      RepackQ8Records(w, block, g0, g1, scratch);
    } else if (kInt4) {
      UnpackQ4Records(records + g0 * record_bytes, g1 - g0, scratch);
    }
    // The next chunk (this block's, or the next block's first), prefetched
    // to L2 during the last token groups' pass: of the stored rows (64 rows
    // read across are streams no hardware prefetcher follows), or of the
    // records, which follow this chunk's. (Without it, on one 4096 × 4096
    // matrix at 8 tokens, reading the records in place took longer than
    // repacking the rows: the tile loads waited on memory.)
    const bool last_chunk = g1 == groups;
    const uint8_t* next = last_chunk ? base + w.layout.block_bytes : base + g1 * kRowBytes;
    const int64_t next_groups = std::min(kTileQ8ChunkGroups, last_chunk ? groups : groups - g1);
    const int64_t lines_per_row = (next_groups * kRowBytes + 63) / 64;
    const uint8_t* next_records = records != nullptr ? records + g1 * record_bytes : nullptr;
    const int64_t record_lines = next_groups * record_bytes / 64;
    const bool prefetch = !(last_chunk && block + 1 == w.layout.num_blocks());
    for (int64_t t0 = 0; t0 < T; t0 += 32) {
      const auto [r0, r1] = ConfigureTokenGroups<Machine>(T, t0, &configured);
      const bool fetching = prefetch && t0 + 32 >= T;
      for (int64_t g = g0; g < g1; ++g) {
        if (fetching && records == nullptr) {  // this group's share of the 64 rows
          for (int64_t r = (g - g0) * kBlockRows / (g1 - g0); r < (g - g0 + 1) * kBlockRows / (g1 - g0); ++r) {
            for (int64_t l = 0; l < lines_per_row; ++l) Machine::Prefetch(next + r * (K / 64) * kRowBytes + l * 64);
          }
        } else if (fetching) {  // this group's share of the records' lines
          for (int64_t l = (g - g0) * record_lines / (g1 - g0); l < (g - g0 + 1) * record_lines / (g1 - g0); ++l) {
            Machine::Prefetch(next_records + l * 64);
          }
        }
        const uint8_t* record = chunk + (g - g0) * kTileQ8RecordBytes;
        const TileOperand a0 = ActivationTile(x.q8, x.q8_tiles, K, t0, g * 64);
        Machine::template Load<4>(a0.data, a0.stride);
        if (r1 > 0) {
          const TileOperand a1 = ActivationTile(x.q8, x.q8_tiles, K, t0 + 16, g * 64);
          Machine::template Load<5>(a1.data, a1.stride);
        }
        for (int64_t j0 = 0; j0 < kBlockRows; j0 += 32) {
          Machine::template Zero<0>();
          Machine::template Zero<1>();
          Machine::template Load<6>(record + j0 * 4, kStep);
          Machine::template Load<7>(record + (j0 + 16) * 4, kStep);
          Machine::template DotS8U8<0, 4, 6>();
          Machine::template DotS8U8<1, 4, 7>();
          Machine::template Store<0>(&dots[0][0], sizeof(dots[0]));
          Machine::template Store<1>(&dots[0][16], sizeof(dots[0]));
          if (r1 > 0) {
            Machine::template Zero<2>();
            Machine::template Zero<3>();
            Machine::template DotS8U8<2, 5, 6>();
            Machine::template DotS8U8<3, 5, 7>();
            Machine::template Store<2>(&dots[16][0], sizeof(dots[0]));
            Machine::template Store<3>(&dots[16][16], sizeof(dots[0]));
          }
          // int4: the group's s, then s·z 64 floats on, copied so that the
          // compiler knows `out` cannot alias them (and vectorizes the loop).
          alignas(64) float s[32], sz[32];
          if constexpr (kInt4) {
            const float* record_s = reinterpret_cast<const float*>(record + kGroupBytes) + j0;
            std::copy(record_s, record_s + 32, s);
            std::copy(record_s + 64, record_s + 96, sz);
          }
          for (int t = 0; t < r0 + r1; ++t) {
            const float xs = x.q8_scales[(t0 + t) * groups + g];
            float* acc = out + (t0 + t) * kBlockRows + j0;
            if constexpr (kInt4) {
              const float sum = x.q8_sums[(t0 + t) * groups + g];
              for (int n = 0; n < 32; ++n) {
                const float scale = s[n] * xs;
                acc[n] = std::fma(-sz[n], sum, std::fma(static_cast<float>(dots[t][n]), scale, acc[n]));
              }
            } else {
              for (int n = 0; n < 32; ++n) acc[n] = std::fma(static_cast<float>(dots[t][n]), xs, acc[n]);
            }
          }
        }
      }
    }
  }
  Machine::Release();
  if (!kInt4) FinishTileInt8(w, block, x, out);
}

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_TILE_Q8_AMX_H_
