#include "common/routing.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace colibri {
namespace common {

const char* RoutingModeName(RoutingMode mode) {
  switch (mode) {
    case RoutingMode::kLut: return "lut";
    case RoutingMode::kGate: return "gate";
    case RoutingMode::kClient: return "client";
  }
  return "?";
}

absl::StatusOr<RoutingMode> ParseRoutingMode(absl::string_view name) {
  for (const RoutingMode mode : {RoutingMode::kLut, RoutingMode::kGate, RoutingMode::kClient}) {
    if (name == RoutingModeName(mode)) return mode;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown routing mode '", name, "' (lut, gate or client)"));
}

void SelectTopK(const double* rank, const double* logits, int64_t n_experts, int64_t top_k, bool normalize,
                int32_t* ids, float* weights) {
  std::vector<int32_t> order(n_experts);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                    [&](int32_t a, int32_t b) { return rank[a] > rank[b] || (rank[a] == rank[b] && a < b); });
  const double max_logit = *std::max_element(logits, logits + n_experts);
  double total = 0.0;
  for (int64_t e = 0; e < n_experts; ++e) total += std::exp(logits[e] - max_logit);
  double chosen = 0.0;
  for (int64_t j = 0; j < top_k; ++j) chosen += std::exp(logits[order[j]] - max_logit);
  for (int64_t j = 0; j < top_k; ++j) {
    ids[j] = order[j];
    weights[j] = static_cast<float>(std::exp(logits[order[j]] - max_logit) / (normalize ? chosen : total));
  }
}

void TopKSoftmax(const double* logits, int64_t n_experts, int64_t top_k, bool normalize, int32_t* ids, float* weights) {
  // Ranking by logit is ranking by probability, without rounding ties.
  SelectTopK(logits, logits, n_experts, top_k, normalize, ids, weights);
}

// Cloned per ISA (the loop vectorizes to 8 doubles an AVX-512 op), chosen at
// load time by an ifunc resolver — except under ThreadSanitizer, whose runtime
// is not up yet while the program is relocated (the resolver would crash it).
#if defined(__SANITIZE_THREAD__)
#define COLIBRI_GATE_CLONES
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define COLIBRI_GATE_CLONES
#endif
#endif
#ifndef COLIBRI_GATE_CLONES
#define COLIBRI_GATE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
COLIBRI_GATE_CLONES void GateLogits(const float* gate, int64_t n_experts, int64_t d_model, const float* x,
                                    double* logits) {
  // Eight interleaved partial sums, added pairwise at the end: a fixed order
  // the compiler can vectorize (one running sum is bound by the add's
  // latency: 1.7 ms for DeepSeek-V3's 256 x 7168 gate here, 0.3 ms this way).
  constexpr int64_t kLanes = 8;
  for (int64_t e = 0; e < n_experts; ++e) {
    const float* g = gate + e * d_model;
    double acc[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= d_model; i += kLanes) {
      for (int64_t j = 0; j < kLanes; ++j) acc[j] += static_cast<double>(g[i + j]) * x[i + j];
    }
    double total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < d_model; ++i) total += static_cast<double>(g[i]) * x[i];
    logits[e] = total;
  }
}

Routes RouteByGate(const float* gate, int64_t n_experts, int64_t d_model, int64_t top_k, bool normalize, const float* x,
                   int64_t num_tokens) {
  return RouteByGateSpec(RoutingSpec{}, gate, nullptr, n_experts, d_model, top_k, normalize, x, num_tokens);
}

absl::StatusOr<Routes> RouteByLut(const int32_t* lut_ids, const float* lut_weights, int64_t vocab_size, int64_t top_k,
                                  absl::Span<const int32_t> token_ids) {
  Routes routes;
  routes.top_k = top_k;
  routes.expert_ids.reserve(token_ids.size() * top_k);
  routes.weights.reserve(token_ids.size() * top_k);
  for (size_t t = 0; t < token_ids.size(); ++t) {
    const int32_t id = token_ids[t];
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_ids[", t, "] = ", id, " is outside the LUT's vocabulary [0, ", vocab_size, ")"));
    }
    routes.expert_ids.insert(routes.expert_ids.end(), lut_ids + id * top_k, lut_ids + (id + 1) * top_k);
    routes.weights.insert(routes.weights.end(), lut_weights + id * top_k, lut_weights + (id + 1) * top_k);
  }
  return routes;
}

void ScoresOfLogits(const RoutingSpec& spec, const double* logits, const float* bias, int64_t n_experts,
                    double* scores) {
  const int64_t n = n_experts;
  std::vector<double> logit(logits, logits + n);
  if (spec.logit_bias) {
    for (int64_t e = 0; e < n; ++e) logit[e] += static_cast<double>(bias[e]);
  }
  if (spec.scoring == RoutingSpec::Scoring::kSigmoid) {
    for (int64_t e = 0; e < n; ++e) scores[e] = 1.0 / (1.0 + std::exp(-logit[e]));
    return;
  }
  const double max_logit = *std::max_element(logit.begin(), logit.end());
  double total = 0.0;
  for (int64_t e = 0; e < n; ++e) total += std::exp(logit[e] - max_logit);
  for (int64_t e = 0; e < n; ++e) scores[e] = std::exp(logit[e] - max_logit) / total;
}

void LogitsOfScores(const RoutingSpec& spec, const double* scores, const float* bias, int64_t n_experts,
                    double* logits) {
  constexpr double kTiny = 1e-300, kBelowOne = 1.0 - 1e-16;
  for (int64_t e = 0; e < n_experts; ++e) {
    const double s = std::max(scores[e], kTiny);
    logits[e] = spec.scoring == RoutingSpec::Scoring::kSigmoid
                    ? std::log(std::min(s, kBelowOne) / (1.0 - std::min(s, kBelowOne)))
                    : std::log(s);
    if (spec.logit_bias) logits[e] -= static_cast<double>(bias[e]);
  }
}

void RouteBySpec(const RoutingSpec& spec, const double* logits, const float* bias, int64_t n_experts, int64_t top_k,
                 bool normalize, int32_t* ids, float* weights, const double* choice_offset) {
  const int64_t n = n_experts;
  std::vector<double> score(n), choice(n);
  ScoresOfLogits(spec, logits, bias, n, score.data());
  // Where the choice is the score alone, and groups (if any) are scored by
  // their best member, the (biased) logit ranks the same: sigmoid and
  // softmax are increasing. It ranks without the ties that saturation makes
  // of distinct logits (a sigmoid is 1.0 in double from a logit of ~36.7, a
  // softmax 0 at ~745 below the top), as Hugging Face ranks Llama 4 and
  // gpt-oss: by logit.
  const bool by_logit = !spec.correction_bias && choice_offset == nullptr &&
                        (spec.n_group <= 1 || spec.group_score == RoutingSpec::GroupScore::kMax);
  for (int64_t e = 0; e < n; ++e) {
    choice[e] = by_logit ? logits[e] + (spec.logit_bias ? static_cast<double>(bias[e]) : 0.0)
                         : score[e] + (spec.correction_bias ? static_cast<double>(bias[e]) : 0.0) +
                               (choice_offset != nullptr ? choice_offset[e] : 0.0);
  }
  if (spec.n_group > 1) {
    const int64_t size = n / spec.n_group;
    std::vector<double> group(spec.n_group);
    for (int64_t g = 0; g < spec.n_group; ++g) {  // the group's best and second-best choice
      double best = -std::numeric_limits<double>::infinity(), second = best;
      for (int64_t e = g * size; e < (g + 1) * size; ++e) {
        if (choice[e] > best) {
          second = best;
          best = choice[e];
        } else if (choice[e] > second) {
          second = choice[e];
        }
      }
      group[g] = spec.group_score == RoutingSpec::GroupScore::kTopTwoSum && size > 1 ? best + second : best;
    }
    std::vector<int64_t> order(spec.n_group);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return group[a] > group[b]; });
    // 0.0 as Hugging Face does on scores; on logits, or with an offset
    // (balancing), which can push kept choices below 0, -inf: below every kept one.
    const double masked = by_logit || choice_offset != nullptr ? -std::numeric_limits<double>::infinity() : 0.0;
    for (int64_t r = spec.topk_group; r < spec.n_group; ++r) {
      std::fill(choice.begin() + order[r] * size, choice.begin() + (order[r] + 1) * size, masked);
    }
  }
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return choice[a] > choice[b]; });
  double sum = 0.0;
  for (int64_t j = 0; j < top_k; ++j) sum += score[order[j]];
  // Sigmoid scores are divided by their sum plus 1e-20, as DeepSeek-V3's
  // code does (it matters when the chosen scores sum below ~1e-13, and keeps
  // all-zero scores at weight 0). Softmax scores never sum to 0 (the top one
  // is at least 1/n), and their families add nothing.
  if (spec.scoring == RoutingSpec::Scoring::kSigmoid) sum += 1e-20;
  for (int64_t j = 0; j < top_k; ++j) {
    ids[j] = order[j];
    const double w = normalize ? score[order[j]] / sum : score[order[j]];
    weights[j] = static_cast<float>(w * spec.scaling);
  }
}

namespace {

// Routes of `tokens` tokens with `top_k` zeroed entries each.
Routes SizedRoutes(int64_t tokens, int64_t top_k) {
  Routes routes;
  routes.top_k = top_k;
  routes.expert_ids.resize(tokens * top_k);
  routes.weights.resize(tokens * top_k);
  return routes;
}

}  // namespace

Routes RouteByGateSpec(const RoutingSpec& spec, const float* gate, const float* bias, int64_t n_experts,
                       int64_t d_model, int64_t top_k, bool normalize, const float* x, int64_t num_tokens) {
  Routes routes = SizedRoutes(num_tokens, top_k);
  std::vector<double> logits(n_experts);
  for (int64_t t = 0; t < num_tokens; ++t) {
    GateLogits(gate, n_experts, d_model, x + t * d_model, logits.data());
    int32_t* ids = &routes.expert_ids[t * top_k];
    float* weights = &routes.weights[t * top_k];
    if (spec.plain()) {  // the softmax top-k every other path is checked against, unchanged
      TopKSoftmax(logits.data(), n_experts, top_k, normalize, ids, weights);
    } else {
      RouteBySpec(spec, logits.data(), bias, n_experts, top_k, normalize, ids, weights);
    }
  }
  return routes;
}

Routes AppendSharedExperts(const Routes& routes, int64_t n_experts, int64_t n_shared, const float* shared_gate,
                           int64_t d_model, const float* x) {
  const int64_t k = routes.top_k, tokens = routes.num_tokens(), width = k + n_shared;
  Routes out = SizedRoutes(tokens, width);
  std::vector<double> logit(n_shared);
  for (int64_t t = 0; t < tokens; ++t) {
    std::copy_n(routes.expert_ids.begin() + t * k, k, out.expert_ids.begin() + t * width);
    std::copy_n(routes.weights.begin() + t * k, k, out.weights.begin() + t * width);
    if (shared_gate != nullptr) GateLogits(shared_gate, n_shared, d_model, x + t * d_model, logit.data());
    for (int64_t s = 0; s < n_shared; ++s) {
      out.expert_ids[t * width + k + s] = static_cast<int32_t>(n_experts + s);
      out.weights[t * width + k + s] =
          shared_gate != nullptr ? static_cast<float>(1.0 / (1.0 + std::exp(-logit[s]))) : 1.0f;
    }
  }
  return out;
}

}  // namespace common
}  // namespace colibri
