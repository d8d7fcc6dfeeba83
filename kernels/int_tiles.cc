#include "kernels/int_tiles.h"

#include <algorithm>

namespace colibri {
namespace kernels {

void RunIntTiles(IntTileFn single, int single_rows, const IntTileFn (&tiles)[4], const common::MatrixView& w,
                 int64_t block, const Activations& x, float* out) {
  const int64_t T = x.num_tokens;
  if (T == 1) {
    for (int64_t r0 = 0; r0 < common::kBlockRows; r0 += single_rows) single(w, block, x, r0, 0, out);
    return;
  }
  for (int64_t r0 = 0; r0 < common::kBlockRows; r0 += 2) {
    for (int64_t t0 = 0; t0 < T; t0 += 4) tiles[std::min<int64_t>(4, T - t0) - 1](w, block, x, r0, t0, out);
  }
}

}  // namespace kernels
}  // namespace colibri
