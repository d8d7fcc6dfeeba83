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

}  // namespace kernels
}  // namespace colibri
