#include <algorithm>
#include <cmath>

#include "common/dtype.h"
#include "kernels/swiglu.h"

namespace colibri {
namespace kernels {

void SwiGluScalar(const float* a, const float* b, float* h, uint16_t* h_bf16, float* h_sum) {
  float sum = 0.f;
  for (int i = 0; i < 64; ++i) {
    h[i] = a[i] / (1.f + std::exp(-a[i])) * b[i];
    h_bf16[i] = common::FloatToBf16(h[i]);
    sum += h[i];
  }
  *h_sum = sum;
}

void GatedActivationScalar(const common::Activation& act, const float* a, const float* b, const float* b1,
                           const float* b3, int64_t valid, float* h, uint16_t* h_bf16, float* h_sum) {
  const float alpha = static_cast<float>(act.alpha), up_offset = static_cast<float>(act.up_offset);
  const float limit = static_cast<float>(act.limit);  // +inf stays +inf: min/max are then no-ops
  float sum = 0.f;
  for (int64_t i = 0; i < 64; ++i) {
    if (i >= valid) {
      h[i] = 0.f;
    } else {
      const float g = std::min(a[i] + (b1 != nullptr ? b1[i] : 0.f), limit);
      const float u = std::clamp(b[i] + (b3 != nullptr ? b3[i] : 0.f), -limit, limit);
      h[i] = g / (1.f + std::exp(-alpha * g)) * (u + up_offset);
    }
    h_bf16[i] = common::FloatToBf16(h[i]);
    sum += h[i];
  }
  *h_sum = sum;
}

}  // namespace kernels
}  // namespace colibri
