// Scalar reference dequantization (contract in kernels/dequant.h): one loop
// over (row, input) that decodes w(n, k) exactly as common::DecodeRow does and
// stores its bf16 rounding at the bf16 stored-layout position.

#include "common/dtype.h"
#include "kernels/dequant.h"

namespace colibri {
namespace kernels {

using common::kBlockRows;
using common::kInt4GroupSize;

void DequantBf16Scalar(const common::MatrixView& w, int64_t block, uint16_t* tile) {
  const int64_t K = w.layout.padded_cols, groups = w.layout.groups;
  const bool int4 = w.layout.dtype == common::DType::kInt4;
  const uint8_t* data = w.data + block * w.layout.block_bytes;
  for (int64_t j = 0; j < kBlockRows; ++j) {
    const int64_t n = block * kBlockRows + j;
    for (int64_t k = 0; k < K; ++k) {
      float v;
      if (int4) {
        // Row of K/2 bytes; in group g, byte i holds input i (low nibble)
        // and input i + 32 (high nibble).
        const int64_t g = k / kInt4GroupSize, i = k % kInt4GroupSize;
        const uint8_t byte = data[j * (K / 2) + g * 32 + i % 32];
        const int q = i < 32 ? byte & 0x0f : byte >> 4;
        v = w.scales[n * groups + g] * static_cast<float>(q - static_cast<int>(w.zeros[n * groups + g]));
      } else {
        const int8_t q = static_cast<int8_t>(data[j * K + k]);
        v = w.scales[n] * static_cast<float>(q);
      }
      tile[((k / 2) * kBlockRows + j) * 2 + k % 2] = common::FloatToBf16(v);
    }
  }
}

}  // namespace kernels
}  // namespace colibri
