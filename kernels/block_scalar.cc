// Scalar reference block kernels: the plainest loops that follow the stored
// layouts (common/weight_matrix.h). Each output is a single f32 sum over k in
// increasing order.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/block_kernel.h"

namespace colibri {
namespace kernels {
namespace {

using common::kBlockRows;

template <typename Weight>
void BlockScalar(const common::MatrixView& w, int64_t block, const Activations& x, float* out, Weight weight) {
  for (int64_t t = 0; t < x.num_tokens; ++t) {
    for (int64_t j = 0; j < kBlockRows; ++j) {
      float acc = 0.f;
      for (int64_t k = 0; k < x.cols; ++k) acc += weight(j, k) * x.f32[t * x.cols + k];
      out[t * kBlockRows + j] = acc;
    }
  }
}

uint16_t Half(const uint8_t* p, size_t i) {
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return h;
}

}  // namespace

void QuantizeGroupQ8(const float* x, int8_t* q, float* scale, float* sum) {
  float amax = 0.f;
  bool finite = true;
  for (int i = 0; i < 64; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    finite = finite && std::isfinite(x[i]);
  }
  if (!finite) {  // NaN scale and sum: the group's products come out NaN, as they would in f32
    std::fill(q, q + 64, int8_t{0});
    *scale = *sum = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float s = amax / 127.f;
  int32_t total = 0;
  for (int i = 0; i < 64; ++i) {
    const int32_t v = s > 0.f ? static_cast<int32_t>(std::nearbyint(x[i] / s)) : 0;
    q[i] = static_cast<int8_t>(std::clamp(v, -127, 127));
    total += q[i];
  }
  *scale = s;
  *sum = s * static_cast<float>(total);
}

void BlockF32Scalar(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  const uint8_t* b = w.data + block * w.layout.block_bytes;
  BlockScalar(w, block, x, out, [&](int64_t j, int64_t k) {
    float v;
    std::memcpy(&v, b + 4 * (k * kBlockRows + j), 4);  // [K][64]
    return v;
  });
}

void BlockF16Scalar(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  const uint8_t* b = w.data + block * w.layout.block_bytes;
  BlockScalar(w, block, x, out, [&](int64_t j, int64_t k) { return common::F16ToFloat(Half(b, k * kBlockRows + j)); });
}

void BlockBf16Scalar(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  const uint8_t* b = w.data + block * w.layout.block_bytes;
  for (int64_t t = 0; t < x.num_tokens; ++t) {
    for (int64_t j = 0; j < kBlockRows; ++j) {
      float acc = 0.f;
      for (int64_t k = 0; k < x.cols; ++k) {  // [K/2][64][2]
        const float wv = common::Bf16ToFloat(Half(b, ((k / 2) * kBlockRows + j) * 2 + k % 2));
        acc += wv * common::Bf16ToFloat(x.bf16[t * x.cols + k]);
      }
      out[t * kBlockRows + j] = acc;
    }
  }
}

void BlockInt8Scalar(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  const int64_t K = w.layout.padded_cols;
  const int8_t* q = reinterpret_cast<const int8_t*>(w.data + block * w.layout.block_bytes);
  const float* scales = w.scales + block * kBlockRows;
  for (int64_t t = 0; t < x.num_tokens; ++t) {
    for (int64_t j = 0; j < kBlockRows; ++j) {
      float acc = 0.f;  // Σ q·x, scaled once
      for (int64_t k = 0; k < K; ++k) acc += static_cast<float>(q[j * K + k]) * x.f32[t * x.cols + k];
      out[t * kBlockRows + j] = scales[j] * acc;
    }
  }
}

void BlockInt4Scalar(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  const int64_t K = w.layout.padded_cols, groups = w.layout.groups;
  const uint8_t* data = w.data + block * w.layout.block_bytes;
  for (int64_t t = 0; t < x.num_tokens; ++t) {
    const float* xt = x.f32 + t * x.cols;
    for (int64_t j = 0; j < kBlockRows; ++j) {
      const uint8_t* row = data + j * (K / 2);
      const int64_t n = block * kBlockRows + j;
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        // Σ_k s·(q_k − z)·x_k = s·(Σ_k q_k·x_k − z·Σ_k x_k)
        float dot = 0.f;
        for (int64_t i = 0; i < 32; ++i) {
          const uint8_t byte = row[g * 32 + i];
          dot += static_cast<float>(byte & 0x0f) * xt[g * 64 + i];
          dot += static_cast<float>(byte >> 4) * xt[g * 64 + 32 + i];
        }
        const float zero = static_cast<float>(w.zeros[n * groups + g]);
        acc += w.scales[n * groups + g] * (dot - zero * x.group_sums[t * groups + g]);
      }
      out[t * kBlockRows + j] = acc;
    }
  }
}

}  // namespace kernels
}  // namespace colibri
