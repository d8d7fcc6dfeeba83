#include "tools/lut_builder.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/routing.h"
#include "common/status_macros.h"

namespace colibri {
namespace tools {
namespace {

constexpr int64_t kEmbeddingChunk = 256;  // rows converted at a time

bool SameSet(const int32_t* a, const int32_t* b, int64_t k) {
  std::vector<int32_t> x(a, a + k), y(b, b + k);
  std::sort(x.begin(), x.end());
  std::sort(y.begin(), y.end());
  return x == y;
}

bool AllFinite(const double* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(v[i])) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<LutResult> BuildLut(const LutInputs& in) {
  const int64_t n = in.n_experts, k = in.top_k, d = in.d_model, vocab = in.vocab_size;
  if (!(in.balance_loss_weight >= 0.0) || !std::isfinite(in.balance_loss_weight)) {
    return absl::InvalidArgumentError(
        absl::StrCat("balance loss weight ", in.balance_loss_weight, " must be finite and >= 0"));
  }
  const bool plain = in.spec.plain();
  // One token's routes from its logits, with `penalty` (may be null)
  // subtracted from the choice: from the logits for softmax top-k, from the
  // choice scores under any other spec.
  std::vector<double> rank(n), offset(n);
  auto route = [&](const double* logits, const double* penalty, int32_t* ids, float* weights) {
    if (plain) {
      if (penalty != nullptr) {
        for (int64_t e = 0; e < n; ++e) rank[e] = logits[e] - penalty[e];
      }
      common::SelectTopK(penalty != nullptr ? rank.data() : logits, logits, n, k, in.normalize, ids, weights);
      return;
    }
    if (penalty != nullptr) {
      for (int64_t e = 0; e < n; ++e) offset[e] = -penalty[e];
    }
    common::RouteBySpec(in.spec, logits, in.bias, n, k, in.normalize, ids, weights,
                        penalty != nullptr ? offset.data() : nullptr);
  };

  // Calibrated tokens: the mean of their records' scores.
  std::vector<double> record_logits(in.calibration_tokens.size() * n), scores(n);
  std::map<int32_t, std::pair<std::vector<double>, int64_t>> calibrated;  // token -> (score sum, records)
  for (size_t r = 0; r < in.calibration_tokens.size(); ++r) {
    const int32_t token = in.calibration_tokens[r];
    if (token < 0 || token >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("calibration record ", r, " has token id ", token, ", outside [0, ", vocab, ")"));
    }
    double* l = &record_logits[r * n];
    common::GateLogits(in.gate, n, d, in.calibration_hidden + r * d, l);
    if (!AllFinite(l, n)) {
      return absl::InvalidArgumentError(absl::StrCat("calibration record ", r, "'s hidden state is not finite"));
    }
    common::ScoresOfLogits(in.spec, l, in.bias, n, scores.data());
    auto& [sum, count] = calibrated[token];
    sum.resize(n, 0.0);
    for (int64_t e = 0; e < n; ++e) sum[e] += scores[e];
    ++count;
  }

  // Every token's logits, chunk by chunk (the embedding is read once per pass):
  // the gate applied to its embedding row, or the logits of its mean scores.
  std::vector<float> rows(kEmbeddingChunk * d);
  std::vector<double> logits(kEmbeddingChunk * n), mean(n);
  auto for_each_token = [&](const std::function<void(int64_t v, const double* logits)>& fn) -> absl::Status {
    for (int64_t first = 0; first < vocab; first += kEmbeddingChunk) {
      const int64_t count = std::min(kEmbeddingChunk, vocab - first);
      bool need_embedding = false;
      for (int64_t v = first; v < first + count; ++v) need_embedding |= calibrated.count(v) == 0;
      if (need_embedding) in.embedding_rows(first, count, rows.data());
      for (int64_t v = first; v < first + count; ++v) {
        double* l = &logits[(v - first) * n];
        if (auto it = calibrated.find(v); it != calibrated.end()) {
          for (int64_t e = 0; e < n; ++e) mean[e] = it->second.first[e] / it->second.second;
          common::LogitsOfScores(in.spec, mean.data(), in.bias, n, l);
        } else {
          common::GateLogits(in.gate, n, d, &rows[(v - first) * d], l);
          if (!AllFinite(l, n)) return absl::InvalidArgumentError(absl::StrCat("embedding row ", v, " is not finite"));
        }
        fn(v, l);
      }
    }
    return absl::OkStatus();
  };

  LutResult out;
  out.calibrated_tokens = static_cast<int64_t>(calibrated.size());
  std::vector<int32_t> before(vocab * k);
  out.weights.resize(vocab * k);
  out.load_before.assign(n, 0);
  out.load_after.assign(n, 0);
  COLIBRI_RETURN_IF_ERROR(for_each_token([&](int64_t v, const double* l) {
    route(l, nullptr, &before[v * k], &out.weights[v * k]);
    for (int64_t j = 0; j < k; ++j) ++out.load_before[before[v * k + j]];
  }));
  out.ids = before;
  if (in.balance_loss_weight > 0.0) {  // a second pass with the over-used experts penalized
    const double target = 1.0 / n;
    std::vector<double> penalty(n, 0.0);
    for (int64_t e = 0; e < n; ++e) {
      const double freq = static_cast<double>(out.load_before[e]) / (vocab * k);
      if (freq > target) penalty[e] = in.balance_loss_weight * (freq - target) * (freq - target);
    }
    COLIBRI_RETURN_IF_ERROR(for_each_token(
        [&](int64_t v, const double* l) { route(l, penalty.data(), &out.ids[v * k], &out.weights[v * k]); }));
  }
  for (int32_t e : out.ids) ++out.load_after[e];

  // Agreement with exact gate routing on the LUT's source inputs.
  std::vector<int32_t> exact(k);
  std::vector<float> unused(k);
  if (!in.calibration_tokens.empty()) {
    for (size_t r = 0; r < in.calibration_tokens.size(); ++r) {
      route(&record_logits[r * n], nullptr, exact.data(), unused.data());
      const int32_t token = in.calibration_tokens[r];
      out.agree_before += SameSet(exact.data(), &before[token * k], k);
      out.agree_after += SameSet(exact.data(), &out.ids[token * k], k);
      ++out.compared;
    }
  } else {
    for (int64_t v = 0; v < vocab; ++v) {  // the unbalanced routes are the exact gate's
      out.agree_before += 1;
      out.agree_after += SameSet(&before[v * k], &out.ids[v * k], k);
      ++out.compared;
    }
  }
  return out;
}

}  // namespace tools
}  // namespace colibri
