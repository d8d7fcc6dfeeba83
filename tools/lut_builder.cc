#include "tools/lut_builder.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/routing.h"

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

// The LUT of a model whose routing is not softmax top-k: every token id routed
// as the gate routes its embedding row.
absl::StatusOr<LutResult> BuildLutBySpec(const LutInputs& in) {
  const int64_t n = in.n_experts, k = in.top_k, d = in.d_model, vocab = in.vocab_size;
  if (!in.calibration_tokens.empty() || in.balance_loss_weight > 0.0) {
    return absl::InvalidArgumentError(
        "calibration and balancing are defined for softmax routing only; this model's gate routes otherwise");
  }
  LutResult out;
  out.ids.resize(vocab * k);
  out.weights.resize(vocab * k);
  out.load_before.assign(n, 0);
  std::vector<float> rows(kEmbeddingChunk * d);
  std::vector<double> logits(n);
  for (int64_t first = 0; first < vocab; first += kEmbeddingChunk) {
    const int64_t count = std::min(kEmbeddingChunk, vocab - first);
    in.embedding_rows(first, count, rows.data());
    for (int64_t v = first; v < first + count; ++v) {
      common::GateLogits(in.gate, n, d, &rows[(v - first) * d], logits.data());
      if (!AllFinite(logits.data(), n)) {
        return absl::InvalidArgumentError(absl::StrCat("embedding row ", v, " is not finite"));
      }
      common::RouteBySpec(in.spec, logits.data(), in.bias, n, k, in.normalize, &out.ids[v * k], &out.weights[v * k]);
      for (int64_t j = 0; j < k; ++j) ++out.load_before[out.ids[v * k + j]];
    }
  }
  out.load_after = out.load_before;
  out.compared = out.agree_before = out.agree_after = vocab;  // these are the exact gate's routes
  return out;
}

}  // namespace

absl::StatusOr<LutResult> BuildLut(const LutInputs& in) {
  const int64_t n = in.n_experts, k = in.top_k, d = in.d_model, vocab = in.vocab_size;
  if (!(in.balance_loss_weight >= 0.0) || !std::isfinite(in.balance_loss_weight)) {
    return absl::InvalidArgumentError(
        absl::StrCat("balance loss weight ", in.balance_loss_weight, " must be finite and >= 0"));
  }
  if (!in.spec.plain()) return BuildLutBySpec(in);
  // logits[v * n + e]
  std::vector<double> logits(vocab * n);
  std::vector<double> prob_sum(vocab * n, 0.0);
  std::vector<int64_t> records(vocab, 0);
  std::vector<double> record_logits(in.calibration_tokens.size() * n);
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
    const double max_logit = *std::max_element(l, l + n);
    double total = 0.0;
    for (int64_t e = 0; e < n; ++e) total += std::exp(l[e] - max_logit);
    for (int64_t e = 0; e < n; ++e) prob_sum[token * n + e] += std::exp(l[e] - max_logit) / total;
    ++records[token];
  }
  std::vector<float> rows(kEmbeddingChunk * d);
  for (int64_t first = 0; first < vocab; first += kEmbeddingChunk) {
    const int64_t count = std::min(kEmbeddingChunk, vocab - first);
    bool need_embedding = false;
    for (int64_t v = first; v < first + count; ++v) need_embedding |= records[v] == 0;
    if (need_embedding) in.embedding_rows(first, count, rows.data());
    for (int64_t v = first; v < first + count; ++v) {
      if (records[v] == 0) {
        common::GateLogits(in.gate, n, d, &rows[(v - first) * d], &logits[v * n]);
        if (!AllFinite(&logits[v * n], n)) {
          return absl::InvalidArgumentError(absl::StrCat("embedding row ", v, " is not finite"));
        }
      } else {
        for (int64_t e = 0; e < n; ++e) {
          logits[v * n + e] = std::log(std::max(prob_sum[v * n + e] / records[v], 1e-300));
        }
      }
    }
  }

  LutResult out;
  out.calibrated_tokens = std::count_if(records.begin(), records.end(), [](int64_t c) { return c > 0; });
  std::vector<int32_t> before(vocab * k);
  out.ids.resize(vocab * k);
  out.weights.resize(vocab * k);
  out.load_before.assign(n, 0);
  out.load_after.assign(n, 0);
  for (int64_t v = 0; v < vocab; ++v) {
    common::SelectTopK(&logits[v * n], &logits[v * n], n, k, in.normalize, &before[v * k], &out.weights[v * k]);
    for (int64_t j = 0; j < k; ++j) ++out.load_before[before[v * k + j]];
  }
  out.ids = before;
  if (in.balance_loss_weight > 0.0) {
    const double mean = 1.0 / n;
    std::vector<double> penalty(n, 0.0);
    for (int64_t e = 0; e < n; ++e) {
      const double freq = static_cast<double>(out.load_before[e]) / (vocab * k);
      if (freq > mean) penalty[e] = in.balance_loss_weight * (freq - mean) * (freq - mean);
    }
    std::vector<double> rank(n);
    for (int64_t v = 0; v < vocab; ++v) {
      for (int64_t e = 0; e < n; ++e) rank[e] = logits[v * n + e] - penalty[e];
      common::SelectTopK(rank.data(), &logits[v * n], n, k, in.normalize, &out.ids[v * k], &out.weights[v * k]);
    }
  }
  for (int32_t e : out.ids) ++out.load_after[e];

  // Agreement with exact gate routing on the LUT's source inputs.
  std::vector<int32_t> exact(k);
  std::vector<float> unused(k);
  if (!in.calibration_tokens.empty()) {
    for (size_t r = 0; r < in.calibration_tokens.size(); ++r) {
      common::TopKSoftmax(&record_logits[r * n], n, k, in.normalize, exact.data(), unused.data());
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
