#include "kernels/reference_moe.h"

#include <algorithm>
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

// h = g · sigmoid(alpha · g) · (u + up_offset), g = min(a, limit), u = clamp(b, ±limit).
double Activate(const common::Activation& act, double a, double b) {
  const double g = std::min(a, act.limit), u = std::clamp(b, -act.limit, act.limit);
  return g / (1.0 + std::exp(-act.alpha * g)) * (u + act.up_offset);
}

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
      const double a = Dot(row1.data(), xr, d_model) + (expert.b1 != nullptr ? expert.b1[f] : 0.0);
      const double b = Dot(row3.data(), xr, d_model) + (expert.b3 != nullptr ? expert.b3[f] : 0.0);
      act[r * d_ff + f] = Activate(expert.activation, a, b);
    }
  }
  for (int64_t c = 0; c < d_model; ++c) {
    common::DecodeRow(expert.w2, c, row2.data());
    const double bias = expert.b2 != nullptr ? expert.b2[c] : 0.0;
    for (int64_t r = 0; r < num_rows; ++r) out[r * d_model + c] = Dot(row2.data(), &act[r * d_ff], d_ff) + bias;
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
    // The input rows, times the weight when it applies to the input (rounded
    // to f32 as the fast path's input is; the rest stays in double).
    const bool at_input = experts[e]->weight_at_input;
    std::vector<float> rows(slots.size() * d_model);
    for (size_t i = 0; i < slots.size(); ++i) {
      const float* src = x + (slots[i] / k) * d_model;
      const float w = at_input ? routes.weights[slots[i]] : 1.f;
      for (int64_t c = 0; c < d_model; ++c) rows[i * d_model + c] = at_input ? w * src[c] : src[c];
    }
    std::vector<double> out(slots.size() * d_model);
    ReferenceExpertFfn(*experts[e], rows.data(), static_cast<int64_t>(slots.size()), out.data());
    for (size_t i = 0; i < slots.size(); ++i) {
      std::copy(&out[i * d_model], &out[(i + 1) * d_model], &contribution[slots[i] * d_model]);
    }
  }
  std::vector<double> weight(num_tokens * k);  // of the output: 1 where it scaled the input
  for (int64_t s = 0; s < num_tokens * k; ++s) {
    const common::ExpertWeights* e = experts[routes.expert_ids[s]];
    weight[s] = e != nullptr && e->weight_at_input ? 1.0 : routes.weights[s];
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t c = 0; c < d_model; ++c) {
      double acc = 0.0;
      for (int64_t j = 0; j < k; ++j) acc += weight[t * k + j] * contribution[(t * k + j) * d_model + c];
      y[t * d_model + c] = static_cast<float>(acc);
    }
  }
}

}  // namespace kernels
}  // namespace colibri
