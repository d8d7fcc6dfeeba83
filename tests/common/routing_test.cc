#include "common/routing.h"

#include <catch2/catch.hpp>
#include <cmath>

namespace colibri {
namespace common {
namespace {

TEST_CASE("gate top-k picks the largest probabilities and renormalizes them") {
  const double logits[4] = {1.0, 2.0, 3.0, 4.0};
  int32_t ids[2];
  float w[2];
  TopKSoftmax(logits, 4, 2, /*normalize=*/true, ids, w);
  CHECK(ids[0] == 3);
  CHECK(ids[1] == 2);
  // Renormalized over the two: e^4 / (e^4 + e^3) = 1 / (1 + e^-1).
  CHECK(w[0] == Approx(1.0 / (1.0 + std::exp(-1.0))).epsilon(1e-7));
  CHECK(w[1] == Approx(1.0 / (1.0 + std::exp(1.0))).epsilon(1e-7));
}

TEST_CASE("gate top-k without renormalization keeps the softmax probabilities") {
  const double logits[4] = {1.0, 2.0, 3.0, 4.0};
  const double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0) + std::exp(4.0);
  int32_t ids[2];
  float w[2];
  TopKSoftmax(logits, 4, 2, /*normalize=*/false, ids, w);
  CHECK(ids[0] == 3);
  CHECK(w[0] == Approx(std::exp(4.0) / z).epsilon(1e-7));
  CHECK(w[1] == Approx(std::exp(3.0) / z).epsilon(1e-7));
  CHECK(w[0] + w[1] < 1.0f);
}

TEST_CASE("ties in the gate break toward the lower expert id") {
  const double logits[5] = {0.5, 2.0, 2.0, 0.5, 2.0};
  int32_t ids[3];
  float w[3];
  TopKSoftmax(logits, 5, 3, true, ids, w);
  CHECK(ids[0] == 1);
  CHECK(ids[1] == 2);
  CHECK(ids[2] == 4);
  CHECK(w[0] == Approx(1.0 / 3));
  const double flat[4] = {0, 0, 0, 0};
  int32_t two[2];
  TopKSoftmax(flat, 4, 2, false, two, w);
  CHECK(two[0] == 0);
  CHECK(two[1] == 1);
  CHECK(w[0] == Approx(0.25));
}

TEST_CASE("route by gate applies the gate matrix to each token") {
  // 3 experts, d_model 2: logits = [x0, x1, x0 + x1].
  const float gate[6] = {1, 0, 0, 1, 1, 1};
  const float x[4] = {1, 2, -3, 1};
  const Routes r = RouteByGate(gate, 3, 2, 1, true, x, 2);
  REQUIRE(r.num_tokens() == 2);
  CHECK(r.expert_ids[0] == 2);  // 3 > 2 > 1
  CHECK(r.expert_ids[1] == 1);  // 1 > -2 > -3
  CHECK(r.weights[0] == 1.0f);
}

TEST_CASE("LUT routing copies rows and refuses an out-of-range token id naming it") {
  const int32_t ids[6] = {0, 1, 2, 3, 1, 0};
  const float weights[6] = {0.6f, 0.4f, 0.7f, 0.3f, 0.5f, 0.5f};
  const int32_t tokens[3] = {2, 0, 1};
  auto r = RouteByLut(ids, weights, 3, 2, tokens);
  REQUIRE(r.ok());
  CHECK(r->expert_ids == std::vector<int32_t>{1, 0, 0, 1, 2, 3});
  CHECK(r->weights[2] == 0.6f);
  for (int32_t bad : {3, -1, 1 << 30}) {
    const int32_t t[2] = {0, bad};
    auto e = RouteByLut(ids, weights, 3, 2, t);
    REQUIRE(e.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(e.status().message().find("token_ids[1] = " + std::to_string(bad)) != absl::string_view::npos);
  }
}

TEST_CASE("sigmoid routing chooses by the biased scores and weighs by the unbiased ones, scaled") {
  // Scores s = sigmoid(l): 0.5, ~0.731, ~0.269, ~0.881. The bias lifts expert 2
  // above expert 1 for choosing; the weights stay s, renormalized, times 2.5.
  const double logits[4] = {0.0, 1.0, -1.0, 2.0};
  const float bias[4] = {0.0f, 0.0f, 0.5f, 0.0f};
  RoutingSpec spec;
  spec.scoring = RoutingSpec::Scoring::kSigmoid;
  spec.correction_bias = true;
  spec.scaling = 2.5;
  int32_t ids[2];
  float weights[2];
  RouteBySpec(spec, logits, bias, 4, 2, /*normalize=*/true, ids, weights);
  CHECK(ids[0] == 3);
  CHECK(ids[1] == 2);  // 0.269 + 0.5 > 0.731
  const double s3 = 1 / (1 + std::exp(-2.0)), s2 = 1 / (1 + std::exp(1.0));
  CHECK(weights[0] == static_cast<float>(s3 / (s3 + s2) * 2.5));
  CHECK(weights[1] == static_cast<float>(s2 / (s3 + s2) * 2.5));
}

TEST_CASE("sigmoid scores that are all 0 give zero weights, not NaN, when renormalized") {
  const double logits[4] = {-1000.0, -2000.0, -3000.0, -4000.0};  // sigmoid underflows to exactly 0
  RoutingSpec spec;
  spec.scoring = RoutingSpec::Scoring::kSigmoid;
  int32_t ids[2];
  float weights[2];
  RouteBySpec(spec, logits, nullptr, 4, 2, /*normalize=*/true, ids, weights);
  CHECK(ids[0] == 0);
  CHECK(ids[1] == 1);
  CHECK(weights[0] == 0.0f);
  CHECK(weights[1] == 0.0f);
}

TEST_CASE("group-limited routing keeps the best groups by their top-two sum or their maximum") {
  // Softmax scores ~ proportional to exp(l). Groups of 2: {0,1} {2,3} {4,5}.
  // By maximum, group {4,5} (expert 4 alone is the largest) and {0,1} win;
  // by top-two sum, {2,3} (two good experts) beats {4,5}.
  const double logits[6] = {1.0, 0.9, 1.5, 1.5, 2.0, -5.0};
  RoutingSpec spec;
  spec.n_group = 3;
  spec.topk_group = 1;
  int32_t ids[2];
  float weights[2];
  RouteBySpec(spec, logits, nullptr, 6, 2, false, ids, weights);
  CHECK(ids[0] == 4);
  CHECK(ids[1] == 5);  // only group {4,5} is kept
  spec.group_score = RoutingSpec::GroupScore::kTopTwoSum;
  spec.topk_group = 1;
  RouteBySpec(spec, logits, nullptr, 6, 2, false, ids, weights);
  CHECK(ids[0] == 2);  // {2,3}: e^1.5 + e^1.5 > e^2 + e^-5
  CHECK(ids[1] == 3);  // the tie between 2 and 3 goes to the lower id first
  double total = 0;
  for (double l : logits) total += std::exp(l);
  CHECK(weights[0] == static_cast<float>(std::exp(1.5) / total));  // softmax over all experts, not renormalized
}

TEST_CASE("a logit bias moves the logits before scoring: gpt-oss's softmax over the top-k biased logits") {
  const double logits[4] = {0.0, 1.0, -1.0, 0.5};
  const float bias[4] = {0.0f, 0.0f, 3.0f, 0.0f};  // expert 2: -1 + 3 = 2, the largest
  RoutingSpec spec;
  spec.logit_bias = true;
  CHECK_FALSE(spec.plain());
  int32_t ids[2];
  float weights[2];
  RouteBySpec(spec, logits, bias, 4, 2, /*normalize=*/true, ids, weights);
  CHECK(ids[0] == 2);
  CHECK(ids[1] == 1);
  // softmax over the two chosen biased logits (2 and 1), as GptOssTopKRouter computes it
  CHECK(weights[0] == Approx(std::exp(2.0) / (std::exp(2.0) + std::exp(1.0))).epsilon(1e-7));
  CHECK(weights[1] == Approx(std::exp(1.0) / (std::exp(2.0) + std::exp(1.0))).epsilon(1e-7));
}

TEST_CASE("Llama 4's routing: top-k by logit, weighted by the sigmoid of each, never renormalized") {
  const double logits[3] = {0.25, -2.0, 1.5};
  RoutingSpec spec;
  spec.scoring = RoutingSpec::Scoring::kSigmoid;
  spec.weight_at_input = true;
  CHECK_FALSE(spec.plain());
  int32_t id;
  float weight;
  RouteBySpec(spec, logits, nullptr, 3, 1, /*normalize=*/false, &id, &weight);
  CHECK(id == 2);
  CHECK(weight == static_cast<float>(1 / (1 + std::exp(-1.5))));
}

TEST_CASE("logits whose sigmoids saturate to 1.0 still rank by logit, as Hugging Face's top-k on logits") {
  const double logits[3] = {38.0, 45.0, -1.0};  // sigmoid(38) == sigmoid(45) == 1.0 in double
  RoutingSpec spec;
  spec.scoring = RoutingSpec::Scoring::kSigmoid;
  spec.weight_at_input = true;
  int32_t id;
  float weight;
  RouteBySpec(spec, logits, nullptr, 3, 1, /*normalize=*/false, &id, &weight);
  CHECK(id == 1);
  CHECK(weight == 1.0f);
}

TEST_CASE("renormalized sigmoid scores are divided by their sum plus 1e-20, as DeepSeek-V3's code") {
  const double tiny = std::log(1e-20);  // sigmoid(tiny) ~ 1e-20
  const double logits[3] = {tiny, tiny, -1000.0};
  const float bias[3] = {0.0f, 0.0f, 0.0f};
  RoutingSpec spec;
  spec.scoring = RoutingSpec::Scoring::kSigmoid;
  spec.correction_bias = true;
  spec.scaling = 2.5;
  int32_t ids[2];
  float weights[2];
  RouteBySpec(spec, logits, bias, 3, 2, /*normalize=*/true, ids, weights);
  const double s = 1 / (1 + std::exp(-tiny));
  CHECK(weights[0] == static_cast<float>(s / (2 * s + 1e-20) * 2.5));  // ~2.5 / 3, not 2.5 / 2
  CHECK(weights[0] < 0.9f);
}

TEST_CASE("the default routing spec is plain softmax top-k and routes exactly as the gate") {
  RoutingSpec spec;
  CHECK(spec.plain());
  const float gate[3 * 2] = {1, 0, 0, 1, 1, 1};
  const float x[2 * 2] = {0.5f, -1.0f, 2.0f, 0.25f};
  const Routes a = RouteByGate(gate, 3, 2, 2, true, x, 2);
  const Routes b = RouteByGateSpec(spec, gate, nullptr, 3, 2, 2, true, x, 2);
  CHECK(a.expert_ids == b.expert_ids);
  CHECK(a.weights == b.weights);
}

}  // namespace
}  // namespace common
}  // namespace colibri
