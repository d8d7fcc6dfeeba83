// The router's core through colibri::Engine (in-process experts): every
// routing mode against the double-precision reference MoE layer, the three
// modes' agreement, dtypes, statistics, and every malformed request refused
// with INVALID_ARGUMENT naming the field.

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <limits>
#include <random>

#include "absl/strings/match.h"
#include "common/cgroup_limits.h"
#include "common/model_dir.h"
#include "kernels/reference_moe.h"
#include "router_node/engine.h"
#include "tests/test_util.h"

namespace colibri {
namespace router_node {
namespace {

using colibri::testing::TempDir;
using common::DType;

std::vector<float> Hidden(int64_t tokens, int64_t d_model, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(tokens * d_model);
  for (float& v : x) v = normal(rng);
  return x;
}

std::vector<float> AsFloats(const std::string& bytes) {
  std::vector<float> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

double RelativeL2(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

// The reference layer for the given routes, from the model's files.
std::vector<float> Reference(const std::string& dir, int32_t layer, const common::Routes& routes,
                             const std::vector<float>& x) {
  auto model = common::ModelDir::Open(dir);
  REQUIRE(model.ok());
  std::vector<std::unique_ptr<common::ExpertWeights>> owned;
  std::vector<const common::ExpertWeights*> experts;
  for (int64_t e = 0; e < (*model)->manifest().n_experts; ++e) {
    auto w = (*model)->LoadExpert(layer, e, false);
    REQUIRE(w.ok());
    owned.push_back(std::move(w).value());
    experts.push_back(owned.back().get());
  }
  const int64_t d = (*model)->manifest().d_model;
  std::vector<float> y(x.size());
  kernels::ReferenceMoeLayer(experts, routes, x.data(), d, y.data());
  return y;
}

struct Fixture {
  TempDir dir;
  std::string model_dir = dir / "model";
  std::unique_ptr<Engine> engine;
  explicit Fixture(DType weight_type = DType::kF32) {
    colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), model_dir, weight_type);
    Engine::Options options;
    options.threads = 2;
    options.max_tokens = 100;
    auto e = Engine::Open(model_dir, options);
    REQUIRE(e.ok());
    engine = std::move(e).value();
  }
  ForwardInput Input(int32_t layer, const std::vector<int32_t>& ids, const std::vector<float>& x) const {
    ForwardInput in;
    in.layer = layer;
    in.token_ids = ids;
    in.hidden = x.data();
    in.hidden_bytes = static_cast<int64_t>(x.size() * 4);
    in.num_tokens = static_cast<int64_t>(ids.size());
    in.cols = 48;
    return in;
  }
};

TEST_CASE("lut, gate and client routing match the reference MoE layer") {
  Fixture f;
  const std::vector<int32_t> ids = {0, 5, 63, 17, 5, 42, 8};
  const std::vector<float> x = Hidden(7, 48, 1);
  auto model = common::ModelDir::Open(f.model_dir);
  REQUIRE(model.ok());
  for (int32_t layer = 0; layer < 2; ++layer) {
    auto tables = (*model)->LoadRouting(layer, false);
    REQUIRE(tables.ok());

    ForwardInput in = f.Input(layer, ids, x);
    auto lut = f.engine->Forward(in);
    REQUIRE(lut.ok());
    auto expected_routes = common::RouteByLut((*tables)->lut_ids, (*tables)->lut_weights, 64, 2, ids);
    REQUIRE(expected_routes.ok());
    CHECK(lut->routes.expert_ids == expected_routes->expert_ids);
    CHECK(lut->routes.weights == expected_routes->weights);
    const std::vector<float> y_lut = AsFloats(lut->output);
    CHECK(RelativeL2(y_lut, Reference(f.model_dir, layer, lut->routes, x)) < 2e-5);

    in.routing = common::RoutingMode::kGate;
    auto gate = f.engine->Forward(in);
    REQUIRE(gate.ok());
    const common::Routes gate_routes = common::RouteByGate((*tables)->gate, 4, 48, 2, true, x.data(), 7);
    CHECK(gate->routes.expert_ids == gate_routes.expert_ids);
    CHECK(RelativeL2(AsFloats(gate->output), Reference(f.model_dir, layer, gate_routes, x)) < 2e-5);

    // The LUT's routes sent as client routes give the same bits.
    in.routing = common::RoutingMode::kClient;
    in.client_top_k = 2;
    in.client_expert_ids = lut->routes.expert_ids;
    in.client_weights = lut->routes.weights;
    auto client = f.engine->Forward(in);
    REQUIRE(client.ok());
    CHECK(client->output == lut->output);
  }
  // Routing statistics count every (token, expert).
  int64_t total = 0;
  for (int64_t l = 0; l < 2; ++l) {
    for (int64_t e = 0; e < 4; ++e) total += f.engine->router().tokens_routed(l, e);
  }
  CHECK(total == 2 * 3 * 7 * 2);
  CHECK(f.engine->router().requests() == 6);
}

TEST_CASE("bf16 and f16 inputs and outputs round once from the fp32 result") {
  Fixture f(DType::kBF16);
  const std::vector<int32_t> ids = {3, 9, 27};
  std::vector<float> x = Hidden(3, 48, 2);
  for (float& v : x) v = common::Bf16ToFloat(common::FloatToBf16(v));  // exactly representable in bf16
  auto f32 = f.engine->Forward(f.Input(0, ids, x));
  REQUIRE(f32.ok());
  const std::vector<float> y = AsFloats(f32->output);

  std::vector<uint16_t> x_bf16(x.size());
  for (size_t i = 0; i < x.size(); ++i) x_bf16[i] = common::FloatToBf16(x[i]);
  ForwardInput in = f.Input(0, ids, x);
  in.hidden = x_bf16.data();
  in.hidden_bytes = static_cast<int64_t>(x_bf16.size() * 2);
  in.hidden_dtype = DType::kBF16;
  for (DType out_type : {DType::kBF16, DType::kF16}) {
    in.output_dtype = out_type;
    auto half = f.engine->Forward(in);
    REQUIRE(half.ok());
    REQUIRE(half->output.size() == y.size() * 2);
    for (size_t i = 0; i < y.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, half->output.data() + 2 * i, 2);
      CHECK(h == (out_type == DType::kBF16 ? common::FloatToBf16(y[i]) : common::FloatToF16(y[i])));
    }
  }
  // An empty batch is a valid call with an empty answer.
  auto empty = f.engine->Forward(f.Input(1, {}, {}));
  REQUIRE(empty.ok());
  CHECK(empty->output.empty());
}

void ExpectInvalid(const absl::StatusOr<ForwardOutput>& r, const std::string& needle) {
  INFO("status: " << r.status());
  REQUIRE(!r.ok());
  CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(r.status().message().find(needle) != absl::string_view::npos);
}

TEST_CASE("malformed requests get INVALID_ARGUMENT naming the field and value") {
  Fixture f;
  const std::vector<float> x = Hidden(2, 48, 3);
  const std::vector<int32_t> ids = {1, 2};
  ExpectInvalid(f.engine->Forward(f.Input(0, {1, 64}, x)), "token_ids[1] = 64");
  ExpectInvalid(f.engine->Forward(f.Input(0, {1, -1}, x)), "token_ids[1] = -1");
  ExpectInvalid(f.engine->Forward(f.Input(2, ids, x)), "layer 2");
  ExpectInvalid(f.engine->Forward(f.Input(-1, ids, x)), "layer -1");

  ForwardInput in = f.Input(0, ids, x);
  in.token_ids = absl::MakeConstSpan(ids.data(), 1);
  ExpectInvalid(f.engine->Forward(in), "token_ids has 1");
  in = f.Input(0, ids, x);
  in.cols = 47;
  ExpectInvalid(f.engine->Forward(in), "hidden.shape [2, 47]");
  in = f.Input(0, ids, x);
  in.hidden_bytes -= 4;
  ExpectInvalid(f.engine->Forward(in), "hidden.data has 380 bytes");
  in = f.Input(0, ids, x);
  in.hidden_dtype = DType::kInt8;
  ExpectInvalid(f.engine->Forward(in), "hidden.dtype int8");
  in = f.Input(0, ids, x);
  in.output_dtype = DType::kInt4;
  ExpectInvalid(f.engine->Forward(in), "output_dtype int4");

  in = f.Input(0, ids, x);
  in.routing = common::RoutingMode::kClient;
  in.client_top_k = 2;
  std::vector<int32_t> experts = {0, 1, 2, 3};
  std::vector<float> weights = {0.5f, 0.5f, 0.5f, 0.5f};
  in.client_expert_ids = experts;
  in.client_weights = weights;
  REQUIRE(f.engine->Forward(in).ok());
  experts[3] = 4;
  ExpectInvalid(f.engine->Forward(in), "routes.expert_ids[3] = 4");
  experts[3] = -2;
  ExpectInvalid(f.engine->Forward(in), "routes.expert_ids[3] = -2");
  experts[3] = 2;
  ExpectInvalid(f.engine->Forward(in), "expert repeated for token 1");
  experts[3] = 3;
  weights[1] = std::numeric_limits<float>::quiet_NaN();
  ExpectInvalid(f.engine->Forward(in), "routes.weights[1] = nan");
  weights[1] = std::numeric_limits<float>::infinity();
  ExpectInvalid(f.engine->Forward(in), "routes.weights[1] = inf");
  weights[1] = -0.25f;
  ExpectInvalid(f.engine->Forward(in), "routes.weights[1] = -0.25 is not a finite number >= 0");
  weights[1] = 0.0f;
  REQUIRE(f.engine->Forward(in).ok());
  weights[1] = 0.5f;
  in.client_expert_ids = absl::MakeConstSpan(experts.data(), 3);
  ExpectInvalid(f.engine->Forward(in), "routes.expert_ids has 3 entries");
  in.client_expert_ids = experts;
  in.client_top_k = 1;
  ExpectInvalid(f.engine->Forward(in), "routes.top_k = 1");

  std::vector<float> bad = x;
  bad[50] = std::numeric_limits<float>::infinity();
  in = f.Input(0, ids, bad);
  in.routing = common::RoutingMode::kGate;
  ExpectInvalid(f.engine->Forward(in), "hidden[1][2] = inf is not finite");
  bad[50] = std::numeric_limits<float>::quiet_NaN();
  in = f.Input(0, ids, bad);  // lut: refused too, not passed on to the experts
  ExpectInvalid(f.engine->Forward(in), "hidden[1][2] = nan is not finite");
  in = f.Input(0, ids, x);
  in.request_id = std::string(kMaxRequestIdBytes, 'r');
  REQUIRE(f.engine->Forward(in).ok());
  in.request_id += 'r';
  ExpectInvalid(f.engine->Forward(in), "request_id is 257 bytes; at most 256");

  const std::vector<int32_t> many(101, 1);
  const std::vector<float> big = Hidden(101, 48, 4);
  auto over = f.engine->Forward(f.Input(0, many, big));
  REQUIRE(!over.ok());
  CHECK(over.status().code() == absl::StatusCode::kResourceExhausted);
}

TEST_CASE("the f32 convenience call equals the general call") {
  Fixture f;
  const std::vector<int32_t> ids = {4, 4, 60};
  const std::vector<float> x = Hidden(3, 48, 5);
  std::vector<float> y(3 * 48);
  REQUIRE(f.engine->Forward(1, ids, x, absl::MakeSpan(y)).ok());
  auto general = f.engine->Forward(f.Input(1, ids, x));
  REQUIRE(general.ok());
  CHECK(AsFloats(general->output) == y);
  std::vector<float> small(10);
  CHECK(f.engine->Forward(1, ids, x, absl::MakeSpan(small)).code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Engine::Open refuses a missing or corrupt model directory with the reason") {
  TempDir dir;
  auto missing = Engine::Open(dir / "nope", {});
  REQUIRE(!missing.ok());
  CHECK(missing.status().message().find("nope") != absl::string_view::npos);

  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kF32);
  colibri::testing::FlipByte(dir / "model/layer_001/lut.bin", 5000);
  auto corrupt = Engine::Open(dir / "model", {});
  REQUIRE(!corrupt.ok());
  CHECK(corrupt.status().message().find("lut.bin") != absl::string_view::npos);
}

TEST_CASE("an engine whose mapped weight file shrank in place answers DATA_LOSS, not zeros") {
  Fixture f(DType::kBF16);
  const std::vector<int32_t> ids = {1, 2, 3};
  const std::vector<float> x(3 * 48, 0.25f);
  std::vector<float> out(x.size());
  REQUIRE(f.engine->Forward(0, ids, x, absl::MakeSpan(out)).ok());
  for (int e = 0; e < 8; ++e) {  // the header stays; every weight page is gone
    const std::string file = f.model_dir + "/layer_000/expert_00" + std::to_string(e) + ".bin";
    if (std::filesystem::exists(file)) std::filesystem::resize_file(file, 4096);
  }
  const absl::Status lost = f.engine->Forward(0, ids, x, absl::MakeSpan(out));
  INFO(lost.message());
  CHECK(lost.code() == absl::StatusCode::kDataLoss);
  CHECK(absl::StrContains(lost.message(), "/layer_000/expert_00"));
  CHECK(absl::StrContains(lost.message(), "shrank"));
  CHECK(f.engine->Forward(1, ids, x, absl::MakeSpan(out)).ok());  // the other layer's files are intact
}

TEST_CASE("Engine::Open refuses locked weights that would pass the memory limit, before locking them") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kBF16);
  Engine::Options options;
  options.threads = 1;
  options.lock_memory = true;
  options.memory_limit = -1;  // none
  int64_t held = 0;
  {
    auto unlimited = Engine::Open(dir / "model", options);
    REQUIRE(unlimited.ok());
    held = (*unlimited)->resident_bytes();
  }
  REQUIRE(held > 0);
  options.memory_limit_source = "/sys/fs/cgroup/test/memory.max";
  options.memory_limit = held + common::kProcessMemoryBytes - 1;
  auto refused = Engine::Open(dir / "model", options);
  INFO(refused.status().message());
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(refused.status().message(), "pass the memory limit"));
  CHECK(absl::StrContains(refused.status().message(), "/sys/fs/cgroup/test/memory.max"));
  CHECK(absl::StrContains(refused.status().message(), "Engine::Options::lock_memory"));
  options.memory_limit = held + common::kProcessMemoryBytes;
  CHECK(Engine::Open(dir / "model", options).ok());
  // Mapped weights are the kernel's to reclaim: not checked.
  options.lock_memory = false;
  options.memory_limit = 1;
  auto mapped = Engine::Open(dir / "model", options);
  REQUIRE(mapped.ok());
  CHECK((*mapped)->resident_bytes() == 0);
}

}  // namespace
}  // namespace router_node
}  // namespace colibri
