// The AMX tile kernels on the hardware: the walks of kernels/tile_bf16_amx.h
// and kernels/tile_q8_amx.h on kernels/amx_tiles.h's HardwareTiles. Compiled
// with the AVX-512 flags (the f32 steps between int8 tiles vectorize) and
// the AMX ones; run only where DetectIsa() found AMX, the kernel granted the
// tile state and the self-checks passed (kernels/dispatch.cc).

#include "kernels/tile_bf16_amx.h"
#include "kernels/tile_q8_amx.h"

namespace colibri {
namespace kernels {

void TileBf16Amx(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* /*scratch*/, float* out) {
  TileBf16AmxWith<HardwareTiles>(w, block, x, out);
}

void TileInt8Amx(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* scratch, float* out) {
  TileQ8AmxWith<HardwareTiles, false>(w, block, x, scratch, out);
}

void TileInt4Amx(const common::MatrixView& w, int64_t block, const Activations& x, uint8_t* scratch, float* out) {
  TileQ8AmxWith<HardwareTiles, true>(w, block, x, scratch, out);
}

void ReleaseTilesAmx() { HardwareTiles::Release(); }

}  // namespace kernels
}  // namespace colibri
