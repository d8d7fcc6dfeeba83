#include "kernels/reference_moe.h"

#include <cmath>
#include <vector>

namespace colibri {
namespace kernels {
namespace {

double Dot(const float* w, const double* x, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(w[i]) * x[i];
  return acc;
}

double Silu(double v) { return v / (1.0 + std::exp(-v)); }

}  // namespace

void ReferenceExpertFfn(const common::ExpertWeights& expert, const float* x, int64_t num_rows, double* out) {
  const int64_t d_model = expert.w1.layout.cols;
  const int64_t d_ff = expert.w1.layout.rows;
  std::vector<double> xd(x, x + num_rows * d_model);
  std::vector<double> act(num_rows * d_ff);
  std::vector<float> row1(d_model), row3(d_model), row2(d_ff);
  for (int64_t f = 0; f < d_ff; ++f) {  // decode each weight row once, use it for every token
    common::DecodeRow(expert.w1, f, row1.data());
    common::DecodeRow(expert.w3, f, row3.data());
    for (int64_t r = 0; r < num_rows; ++r) {
      const double* xr = &xd[r * d_model];
      act[r * d_ff + f] = Silu(Dot(row1.data(), xr, d_model)) * Dot(row3.data(), xr, d_model);
    }
  }
  for (int64_t c = 0; c < d_model; ++c) {
    common::DecodeRow(expert.w2, c, row2.data());
    for (int64_t r = 0; r < num_rows; ++r) out[r * d_model + c] = Dot(row2.data(), &act[r * d_ff], d_ff);
  }
}

void ReferenceMoeLayer(absl::Span<const common::ExpertWeights* const> experts, const common::Routes& routes,
                       const float* x, int64_t d_model, float* y) {
  const int64_t num_tokens = routes.num_tokens();
  const int64_t k = routes.top_k;
  // contribution[(t * k + j) * d_model + c] = FFN_{e_tj}(x_t)[c]
  std::vector<double> contribution(num_tokens * k * d_model);
  for (size_t e = 0; e < experts.size(); ++e) {
    std::vector<int64_t> slots;  // t * k + j of every route to e
    for (int64_t s = 0; s < num_tokens * k; ++s) {
      if (routes.expert_ids[s] == static_cast<int32_t>(e)) slots.push_back(s);
    }
    if (slots.empty()) continue;
    std::vector<float> rows(slots.size() * d_model);
    for (size_t i = 0; i < slots.size(); ++i) {
      const float* src = x + (slots[i] / k) * d_model;
      std::copy(src, src + d_model, &rows[i * d_model]);
    }
    std::vector<double> out(slots.size() * d_model);
    ReferenceExpertFfn(*experts[e], rows.data(), static_cast<int64_t>(slots.size()), out.data());
    for (size_t i = 0; i < slots.size(); ++i) {
      std::copy(&out[i * d_model], &out[(i + 1) * d_model], &contribution[slots[i] * d_model]);
    }
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t c = 0; c < d_model; ++c) {
      double acc = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        acc += static_cast<double>(routes.weights[t * k + j]) * contribution[(t * k + j) * d_model + c];
      }
      y[t * d_model + c] = static_cast<float>(acc);
    }
  }
}

}  // namespace kernels
}  // namespace colibri
