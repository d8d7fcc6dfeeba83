#ifndef COLIBRI_KERNELS_AMX_TILES_H_
#define COLIBRI_KERNELS_AMX_TILES_H_

// What the AMX tile kernels (kernels/tile_bf16_amx.h, kernels/tile_q8_amx.h)
// share: the tile configuration and the tile "machine" their walks are
// written against, so that one body serves the hardware (HardwareTiles
// below, run by kernels/tile_amx.cc) and a scalar emulation of the same
// instructions (tests/kernels/amx_emulator.h), which checks the walks —
// addresses, strides, tails, tile shapes — on CPUs without AMX.
//
// A Machine provides (static members):
//   Configure(const AmxTileConfig&)             ldtilecfg
//   Zero<t>(), Load<t>(ptr, stride), Store<t>(ptr, stride)
//   DotBf16<c, a, b>()                          c += a · b, bf16 pairs (tdpbf16ps)
//   DotS8U8<c, a, b>()                          c += a · b, signed a × unsigned b bytes (tdpbsud)
//   Prefetch(ptr), PrefetchL1(ptr)              hints (to L2, to L1); may do nothing
//   Release()                                   tilerelease
//
// Both walks use the same eight tiles: 0–3 accumulate two token groups ×
// two groups of 16 outputs, 4–5 hold the two token groups' activations
// (16 rows × 64 bytes: 32 bf16 or 64 int8 inputs), 6–7 two groups of 16
// outputs of the weights (16 rows of input pairs or quads × 64 bytes). A
// token group shorter than 16 (the tail of T) is configured with fewer rows,
// so no row past T is read or written. The activations are read in tile
// order where the caller made that copy (Activations::bf16_tiles, q8_tiles).

#include "kernels/x86_simd.h"

#include <algorithm>
#include <cstdint>

namespace colibri {
namespace kernels {

// The 64-byte operand of ldtilecfg (palette 1).
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved0[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of each tile; 0: unused
  uint8_t rows[16] = {};    // rows of each tile; 0: unused
};
static_assert(sizeof(AmxTileConfig) == 64, "ldtilecfg reads 64 bytes");

// The tile shapes above for token groups of r0 and r1 rows (r1 = 0: one
// group; its tiles 2, 3 and 5 are then unused).
inline AmxTileConfig AmxConfig2x2(int r0, int r1) {
  AmxTileConfig c;
  auto set = [&c](int tile, int rows) {
    c.rows[tile] = static_cast<uint8_t>(rows);
    c.colsb[tile] = static_cast<uint16_t>(rows > 0 ? 64 : 0);
  };
  set(0, r0), set(1, r0), set(2, r1), set(3, r1);  // C: rows × 16 f32 / int32
  set(4, r0), set(5, r1);                          // A: rows × 64 bytes of activations
  set(6, 16), set(7, 16);                          // B: 16 pairs / quads × 16 outputs
  return c;
}

// The rows of the two token groups from t0 (a multiple of 32) of T tokens:
// r0 of the first 16, r1 of the next 16 (0: none).
struct TokenGroups {
  int r0 = -1, r1 = -1;
};
// Configures Machine's tiles for the token groups from t0 unless
// `configured` (initially {-1, -1}) says they already are; returns them.
template <typename Machine>
TokenGroups ConfigureTokenGroups(int64_t tokens, int64_t t0, TokenGroups* configured) {
  const TokenGroups groups{static_cast<int>(std::min<int64_t>(16, tokens - t0)),
                           static_cast<int>(std::clamp<int64_t>(tokens - t0 - 16, 0, 16))};
  if (groups.r0 != configured->r0 || groups.r1 != configured->r1) {
    Machine::Configure(AmxConfig2x2(groups.r0, groups.r1));
    *configured = groups;
  }
  return groups;
}

// Where the A operand of the 16 tokens from t0 (a multiple of 16) at byte
// `at` (a multiple of 64) of their rows lies, and its stride: in the tile
// order copy where there is one (kernels/block_kernel.h), else in the rows.
struct TileOperand {
  const void* data;
  int64_t stride;
};
inline TileOperand ActivationTile(const void* rows, const uint8_t* tiles, int64_t row_bytes, int64_t t0, int64_t at) {
  if (tiles != nullptr) return {tiles + ((t0 / 16) * (row_bytes / 64) + at / 64) * 1024, 64};
  return {static_cast<const uint8_t*>(rows) + t0 * row_bytes + at, row_bytes};
}

// The instructions themselves. Inline assembly rather than the
// <immintrin.h> macros: GCC's paste the tile number as text, which a
// template parameter cannot be; "%c" prints an immediate as a bare number.
// (The operand order is AT&T's: B, A, C; the encodings were compared with
// those of GCC's _tile_dpbf16ps / _tile_dpbsud.) Only for CPUs where
// DetectIsa() returned avx512_amx (kernels/dispatch.cc).
struct HardwareTiles {
  static void Configure(const AmxTileConfig& config) { __asm__ volatile("ldtilecfg %0" ::"m"(config)); }
  template <int kTile>
  static void Zero() {
    __asm__ volatile("tilezero %%tmm%c0" ::"i"(kTile));
  }
  template <int kTile>
  static void Load(const void* base, int64_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(kTile) : "memory");
  }
  template <int kTile>
  static void Store(void* base, int64_t stride) {
    __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(kTile) : "memory");
  }
  template <int kC, int kA, int kB>
  static void DotBf16() {
    __asm__ volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(kC), "i"(kA), "i"(kB));
  }
  template <int kC, int kA, int kB>
  static void DotS8U8() {
    __asm__ volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(kC), "i"(kA), "i"(kB));
  }
  static void Prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
  static void PrefetchL1(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
  static void Release() { __asm__ volatile("tilerelease" ::); }
};

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_AMX_TILES_H_
