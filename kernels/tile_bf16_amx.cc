// The AMX bf16 block kernel on the hardware (kernels/tile_bf16_amx.h has the
// walk; this file the instructions). Inline assembly rather than the
// <immintrin.h> macros: GCC's paste the tile number as text, which a
// template parameter cannot be; "%c" prints an immediate as a bare number.
// Runs only where DetectIsa() found AMX and the kernel granted the tile
// state (kernels/dispatch.cc).

#include "kernels/tile_bf16_amx.h"

#include <xmmintrin.h>

namespace colibri {
namespace kernels {
namespace {

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
  static void Prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
  static void Release() { __asm__ volatile("tilerelease" ::); }
};

}  // namespace

void TileBf16Amx(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* /*scratch*/, float* out) {
  TileBf16AmxWith<HardwareTiles>(w, block, x, out);
}

}  // namespace kernels
}  // namespace colibri
