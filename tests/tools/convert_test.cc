#include "tools/convert.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <regex>
#include <sstream>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/model_dir.h"
#include "common/safetensors.h"
#include "tests/test_util.h"
#include "tools/hf_checkpoint.h"
#include "tools/synth.h"
#include "tools/validate.h"

namespace colibri {
namespace tools {
namespace {

using colibri::testing::TempDir;
using common::DType;

bool Contains(const absl::Status& s, const std::string& needle) {
  return s.message().find(needle) != absl::string_view::npos;
}

ValidationReport Validate(const std::string& dir) {
  std::ostringstream log;
  return ValidateModelDir(dir, ValidateOptions{}, log);
}

// Every stored weight equals the checkpoint's within the type's error bound.
void CheckWeightsAgainstCheckpoint(const std::string& ckpt_dir, const std::string& model_dir) {
  auto ckpt = HfCheckpoint::Open(ckpt_dir);
  REQUIRE(ckpt.ok());
  auto model = common::ModelDir::Open(model_dir);
  REQUIRE(model.ok());
  const common::Manifest& m = (*model)->manifest();
  for (int64_t layer = 0; layer < m.n_layers; ++layer) {
    for (int64_t e = 0; e < m.total_experts(); ++e) {  // shared experts too
      auto w = (*model)->LoadExpert(layer, e, true);
      REQUIRE(w.ok());
      const std::pair<ExpertMatrix, const common::MatrixView*> mats[] = {
          {ExpertMatrix::kW1, &(*w)->w1}, {ExpertMatrix::kW3, &(*w)->w3}, {ExpertMatrix::kW2, &(*w)->w2}};
      for (const auto& [which, view] : mats) {
        const int64_t rows = view->layout.rows, cols = view->layout.cols;
        auto src = (*ckpt)->Matrix((*ckpt)->ExpertName(m.hf_layers[layer], e, which), rows, cols);
        REQUIRE(src.ok());
        std::vector<float> expected(rows * cols), row(cols);
        HfCheckpoint::RowsToFloat(**src, 0, rows, expected.data(), (*ckpt)->ScaleOf(**src));
        for (int64_t r = 0; r < rows; ++r) {
          common::DecodeRow(*view, r, row.data());
          float amax = 0;
          for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(expected[r * cols + c]));
          const float bound = common::MaxEncodingError(*view, r, amax);
          for (int64_t c = 0; c < cols; ++c) REQUIRE(std::fabs(row[c] - expected[r * cols + c]) <= bound);
        }
      }
    }
  }
}

// Writes `synth` (unless its config.json exists), converts it to `out_dir` as
// `type`, checks that the validator finds nothing and opens the result;
// REQUIREs that every step succeeds.
std::unique_ptr<common::ModelDir> SynthConvertOpen(const SynthOptions& synth, const std::string& out_dir, DType type) {
  std::ostringstream log;
  if (!std::filesystem::exists(synth.out_dir + "/config.json")) REQUIRE(WriteSyntheticCheckpoint(synth, log).ok());
  ConvertOptions o;
  o.checkpoint_dir = synth.out_dir;
  o.out_dir = out_dir;
  o.weight_type = type;
  o.progress = false;
  const absl::Status s = ConvertCheckpoint(o, log);
  INFO(s.message());
  REQUIRE(s.ok());
  const ValidationReport v = Validate(out_dir);
  for (const auto& issue : v.issues) FAIL_CHECK(issue.path << ": " << issue.problem);
  auto model = common::ModelDir::Open(out_dir);
  REQUIRE(model.ok());
  return std::move(model).value();
}

// Converts `ckpt_dir` to `out_dir` after replacing `pattern` in its
// config.json (the original text `config`, where it must occur) by
// `replacement`; the conversion's status.
absl::Status ConvertEditedConfig(const std::string& ckpt_dir, const std::string& config, const std::string& pattern,
                                 const std::string& replacement, const std::string& out_dir) {
  const std::regex key(pattern);
  REQUIRE(std::regex_search(config, key));
  std::ofstream(ckpt_dir + "/config.json") << std::regex_replace(config, key, replacement);
  ConvertOptions o;
  o.checkpoint_dir = ckpt_dir;
  o.out_dir = out_dir;
  o.progress = false;
  std::ostringstream log;
  return ConvertCheckpoint(o, log);
}

TEST_CASE("synth, convert and validate round trip for both namings and every weight type") {
  for (const char* naming : {"mixtral", "olmoe", "qwen2_moe"}) {
    TempDir dir;
    SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt", naming);
    synth.dtype = DType::kBF16;
    synth.shards = 3;  // index json + several files
    synth.norm_topk_prob = std::string(naming) == "qwen2_moe";
    std::ostringstream log;
    REQUIRE(WriteSyntheticCheckpoint(synth, log).ok());
    for (DType type : {DType::kF32, DType::kBF16, DType::kF16, DType::kInt8, DType::kInt4}) {
      INFO(naming << " -> " << common::DTypeName(type));
      ConvertOptions o;
      o.checkpoint_dir = synth.out_dir;
      o.out_dir = dir / ("model_" + common::DTypeName(type));
      o.weight_type = type;
      o.progress = false;
      ConvertReport report;
      const absl::Status s = ConvertCheckpoint(o, log, &report);
      INFO(s.message());
      REQUIRE(s.ok());
      REQUIRE(report.layers.size() == 2);
      CHECK(report.layers[0].lut.agree_after == report.layers[0].lut.compared);  // no balancing
      const ValidationReport v = Validate(o.out_dir);
      for (const auto& issue : v.issues) FAIL_CHECK(issue.path << ": " << issue.problem);
      CHECK(v.ok());
      auto model = common::ModelDir::Open(o.out_dir);
      REQUIRE(model.ok());
      CHECK((*model)->manifest().norm_topk_prob == (std::string(naming) == "mixtral" || synth.norm_topk_prob));
      CHECK((*model)->manifest().architecture == naming);
      CheckWeightsAgainstCheckpoint(synth.out_dir, o.out_dir);
    }
  }
}

TEST_CASE("the validator refuses a listed file that resolves outside the model directory, as the loader does") {
  TempDir dir;
  SynthConvertOpen(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kF32);
  const std::string lut = dir / ("model/" + common::LutFilePath(0));
  std::filesystem::copy_file(lut, dir / "elsewhere.bin");  // the same bytes: only the place is wrong
  std::filesystem::remove(lut);
  std::filesystem::create_symlink(dir / "elsewhere.bin", lut);
  const ValidationReport v = Validate(dir / "model");
  REQUIRE(v.issues.size() == 1);
  CHECK(v.issues[0].problem.find("resolves outside the model directory") != std::string::npos);
}

TEST_CASE("a Qwen3-MoE checkpoint converts its MoE layers and skips the dense ones") {
  TempDir dir;
  SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt", "qwen3_moe");
  synth.n_layers = 3;
  synth.dense_layers = 1;  // decoder layer 0 is a dense MLP of width 2 * d_ff
  synth.norm_topk_prob = true;
  const auto model = SynthConvertOpen(synth, dir / "model", DType::kF32);
  const common::Manifest& m = model->manifest();
  CHECK(m.architecture == "qwen3_moe");
  CHECK(m.n_layers == 2);
  CHECK(m.hf_layers == std::vector<int64_t>{1, 2});
  CHECK(m.d_ff == synth.d_ff);  // moe_intermediate_size, not intermediate_size
  CHECK(m.norm_topk_prob);
  CheckWeightsAgainstCheckpoint(synth.out_dir, dir / "model");

  // config.json must agree with the tensors about which layers are MoE.
  const absl::Status refused =
      ConvertEditedConfig(synth.out_dir, colibri::testing::ReadFile(synth.out_dir + "/config.json"),
                          R"("mlp_only_layers":\s*\[\s*0\s*\])", R"("mlp_only_layers": [])", dir / "model2");
  CHECK(refused.code() == absl::StatusCode::kInvalidArgument);
  CHECK(Contains(refused, "mlp_only_layers make layers [0,1,2] MoE, but the gate tensors are in layers [1,2]"));
}

TEST_CASE("a DeepSeek-V2-Lite-shaped checkpoint converts with its ungated shared experts and dense first layer") {
  TempDir dir;
  SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt", "deepseek_v2");
  synth.n_layers = 3;
  synth.dense_layers = 1;
  synth.shared_d_ff = 2 * synth.d_ff;  // n_shared_experts = 2, one MLP
  const auto model = SynthConvertOpen(synth, dir / "model", DType::kBF16);
  const common::Manifest& m = model->manifest();
  CHECK(m.architecture == "deepseek_v2");
  CHECK(m.hf_layers == std::vector<int64_t>{1, 2});
  CHECK_FALSE(m.norm_topk_prob);
  CHECK(m.n_shared_experts == 1);
  CHECK(m.shared_d_ff == 2 * synth.d_ff);
  CHECK_FALSE(m.shared_gate);
  CheckWeightsAgainstCheckpoint(synth.out_dir, dir / "model");

  const std::string config = colibri::testing::ReadFile(synth.out_dir + "/config.json");
  for (const auto& [from, to, message] :
       {std::tuple{R"("first_k_dense_replace":\s*1)", R"("first_k_dense_replace": 0)",
                   "first_k_dense_replace and moe_layer_freq make layers [0,1,2] MoE"},
        std::tuple{R"("n_shared_experts":\s*2)", R"("n_shared_experts": 3)",
                   "n_shared_experts = 3 experts of moe_intermediate_size"},
        std::tuple{R"("n_shared_experts":\s*2)", R"("n_shared_experts": 9223372036854775807)",
                   "n_shared_experts = 9223372036854775807 experts"},
        std::tuple{R"("num_hidden_layers":\s*3)", R"("num_hidden_layers": 1000000000000)",
                   "num_hidden_layers must be an integer in [1, 4096]"}}) {
    INFO(message);
    CHECK(Contains(ConvertEditedConfig(synth.out_dir, config, from, to, dir / "refused"), message));
  }
}

TEST_CASE("a DeepSeek-V3-shaped checkpoint converts with its sigmoid group-limited routing and correction bias") {
  TempDir dir;
  SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt", "deepseek_v3");
  synth.n_layers = 3;
  synth.dense_layers = 1;
  synth.shared_d_ff = synth.d_ff;
  synth.n_experts = 8;
  synth.n_group = 4;
  synth.topk_group = 2;
  synth.routed_scaling_factor = 2.5;
  synth.norm_topk_prob = true;
  const auto model = SynthConvertOpen(synth, dir / "model", DType::kF32);
  const common::Manifest& m = model->manifest();
  CHECK(m.format_version == 2);
  CHECK(m.routing.scoring == common::RoutingSpec::Scoring::kSigmoid);
  CHECK(m.routing.group_score == common::RoutingSpec::GroupScore::kTopTwoSum);
  CHECK(m.routing.n_group == 4);
  CHECK(m.routing.topk_group == 2);
  CHECK(m.routing.correction_bias);
  CHECK(m.routing.scaling == 2.5);
  CHECK(m.norm_topk_prob);
  auto routing = model->LoadRouting(0, true);
  REQUIRE(routing.ok());
  REQUIRE((*routing)->bias != nullptr);
  CheckWeightsAgainstCheckpoint(synth.out_dir, dir / "model");
  const std::string original_config = colibri::testing::ReadFile(synth.out_dir + "/config.json");
  CHECK(Contains(ConvertEditedConfig(synth.out_dir, original_config, R"("routed_scaling_factor":\s*2.5)",
                                     R"("routed_scaling_factor": 1e39)", dir / "refused"),
                 "routed_scaling_factor must be a positive number that fits a float"));
  std::ofstream(synth.out_dir + "/config.json", std::ios::trunc) << original_config;
  {  // Layers past num_hidden_layers (V3's multi-token prediction layer) are not the model's: left out.
    const absl::Status s = ConvertEditedConfig(synth.out_dir, original_config, R"("num_hidden_layers":\s*3)",
                                               R"("num_hidden_layers": 2)", dir / "model_two");
    std::ofstream(synth.out_dir + "/config.json", std::ios::trunc) << original_config;
    INFO(s.message());
    REQUIRE(s.ok());
    auto two = common::ModelDir::Open(dir / "model_two");
    REQUIRE(two.ok());
    CHECK((*two)->manifest().n_layers == 1);  // layer 1 of the checkpoint; its layer 2 is past the model's end
  }
  {  // Keys left out take DeepseekV3Config's defaults: 8 groups, 4 kept, scaling 2.5, renormalized.
    std::string trimmed = original_config;
    for (const char* key : {"n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob"}) {
      trimmed = std::regex_replace(trimmed, std::regex(std::string(R"(\s*")") + key + R"(":\s*[^,}]+,?)"), "");
    }
    SynthOptions defaults = synth;
    defaults.out_dir = dir / "ckpt_defaults";
    defaults.n_experts = 16;  // 8 groups of 2
    std::ostringstream log;
    REQUIRE(WriteSyntheticCheckpoint(defaults, log).ok());
    std::string defaults_config =
        std::regex_replace(trimmed, std::regex(R"("n_routed_experts":\s*8)"), R"("n_routed_experts": 16)");
    std::ofstream(defaults.out_dir + "/config.json", std::ios::trunc) << defaults_config;
    const auto defaulted = SynthConvertOpen(defaults, dir / "model_defaults", DType::kF32);
    CHECK(defaulted->manifest().routing.n_group == 8);
    CHECK(defaulted->manifest().routing.topk_group == 4);
    CHECK(defaulted->manifest().routing.scaling == 2.5);
    CHECK(defaulted->manifest().norm_topk_prob);
  }
  {  // A manifest's scaling must fit the f32 route weights it multiplies.
    const std::string manifest = dir / "model/manifest.json";
    const std::string good = colibri::testing::ReadFile(manifest);
    std::ofstream(manifest, std::ios::trunc)
        << std::regex_replace(good, std::regex(R"("scaling":\s*2.5)"), R"("scaling": 1e39)");
    CHECK(Contains(common::ModelDir::Open(dir / "model").status(), "'routing.scaling' must be > 0 and fit a float"));
    std::ofstream(manifest, std::ios::trunc) << good;
  }
  // The same checkpoint in DeepSeek-V3's block FP8 dequantizes exactly.
  SynthOptions fp8 = synth;
  fp8.fp8 = true;
  fp8.out_dir = dir / "ckpt_fp8";
  SynthConvertOpen(fp8, dir / "model_fp8", DType::kF32);
  CheckWeightsAgainstCheckpoint(fp8.out_dir, dir / "model_fp8");
  {
    auto ckpt = HfCheckpoint::Open(fp8.out_dir);
    REQUIRE(ckpt.ok());
    const std::string name = (*ckpt)->ExpertName(1, 3, ExpertMatrix::kW2);
    auto w2 = (*ckpt)->Matrix(name, synth.d_model, synth.d_ff);
    REQUIRE(w2.ok());
    REQUIRE((*ckpt)->ScaleOf(**w2) != nullptr);
    std::vector<float> rows(synth.d_model * synth.d_ff);
    HfCheckpoint::RowsToFloat(**w2, 0, synth.d_model, rows.data(), (*ckpt)->ScaleOf(**w2));
    // Element [0][0] by hand: its byte times block (0, 0)'s scale.
    const common::SafetensorsTensor* scale = (*ckpt)->ScaleOf(**w2);
    float s00 = 0;
    std::memcpy(&s00, scale->data, 4);
    CHECK(rows[0] == common::Fp8E4m3ToFloat((*w2)->data[0]) * s00);
  }
}

TEST_CASE("the LUT of a non-softmax gate balances and calibrates with the family's own scoring") {
  TempDir dir;
  SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt", "deepseek_v3");
  synth.n_experts = 8;
  synth.n_group = 4;
  synth.topk_group = 2;
  synth.norm_topk_prob = true;
  synth.vocab_size = 512;
  synth.calibration_path = dir / "calib.safetensors";
  synth.calibration_records = 300;
  std::ostringstream log;
  REQUIRE(WriteSyntheticCheckpoint(synth, log).ok());
  auto spread = [](const std::vector<int64_t>& load) {
    return *std::max_element(load.begin(), load.end()) - *std::min_element(load.begin(), load.end());
  };
  ConvertOptions o;
  o.checkpoint_dir = synth.out_dir;
  o.progress = false;
  o.out_dir = dir / "balanced";
  o.balance_loss_weight = 20.0;  // in sigmoid-score units: (0.05 over the mean)² · 20 = 0.05
  ConvertReport balanced;
  const absl::Status s = ConvertCheckpoint(o, log, &balanced);
  INFO(s.message());
  REQUIRE(s.ok());
  for (const LayerReport& layer : balanced.layers) {
    const LutResult& lut = layer.lut;
    CHECK(lut.agree_before == lut.compared);  // unbalanced: the exact gate's routes
    CHECK(lut.agree_after < lut.compared);    // balancing moved some tokens
    CHECK(spread(lut.load_after) < spread(lut.load_before));
  }
  CHECK(Validate(o.out_dir).ok());

  o.out_dir = dir / "calibrated";
  o.balance_loss_weight = 0;
  o.calibration_path = synth.calibration_path;
  ConvertReport calibrated;
  REQUIRE(ConvertCheckpoint(o, log, &calibrated).ok());
  for (const LayerReport& layer : calibrated.layers) {
    CHECK(layer.lut_source == "calibration");
    CHECK(layer.lut.calibrated_tokens > 100);
    CHECK(layer.lut.compared == 300);
    CHECK(layer.lut.agree_after > layer.lut.compared / 2);  // mean scores route most records as the gate does
  }
  CHECK(Validate(o.out_dir).ok());
}

// Fused experts are split and transposed: checked element by element
// against the synthesizer's generator (tools/synth.h), not the converter's reader.
TEST_CASE("gpt-oss's and Llama 4's fused experts convert to W1, W3, W2 (and biases) exactly") {
  TempDir dir;
  for (const std::string naming : {"gpt_oss", "llama4"}) {
    INFO(naming);
    SynthOptions synth = colibri::testing::SmallSynth(dir / (naming + "_ckpt"), naming);
    synth.dtype = DType::kF32;
    synth.d_ff = 40;
    synth.n_layers = 2;
    const bool gpt_oss = naming == "gpt_oss";
    if (!gpt_oss) synth.interleave_moe_layer_step = 2;  // decoder layer 1 is the one MoE layer
    const auto model = SynthConvertOpen(synth, dir / (naming + "_model"), DType::kF32);
    const common::Manifest& m = model->manifest();
    CHECK(m.format_version == 3);  // logit bias, weight at the input, expert biases: version 3 only
    CHECK(m.architecture == (gpt_oss ? "gpt_oss" : "llama4"));
    CHECK(m.hf_layers == (gpt_oss ? std::vector<int64_t>{0, 1} : std::vector<int64_t>{1}));
    CHECK(m.d_ff == 40);
    CHECK(m.expert_biases == gpt_oss);
    CHECK(m.routing.logit_bias == gpt_oss);
    CHECK(m.routing.weight_at_input == !gpt_oss);
    CHECK(m.norm_topk_prob == gpt_oss);
    CHECK(m.activation.plain() == !gpt_oss);
    CHECK(m.n_shared_experts == (gpt_oss ? 0 : 1));
    const int64_t hf = m.hf_layers[0], e = 2, H = m.d_model, I = m.d_ff;
    const std::string block = gpt_oss ? absl::StrCat("model.layers.", hf, ".mlp.")
                                      : absl::StrCat("language_model.model.layers.", hf, ".feed_forward.");
    auto synth_value = [&](const std::string& name, int64_t index, double scale) {
      return tools::SynthUniform(synth.seed, block + name, index) * static_cast<float>(scale);
    };
    const double in_scale = std::sqrt(3.0 / H), ff_scale = std::sqrt(3.0 / I);
    auto w = model->LoadExpert(0, e, true);
    REQUIRE(w.ok());
    std::vector<float> row(std::max(H, I));
    for (int64_t f : {int64_t{0}, int64_t{17}, I - 1}) {
      const int64_t gate_col = gpt_oss ? 2 * f : f, up_col = gpt_oss ? 2 * f + 1 : I + f;
      common::DecodeRow((*w)->w1, f, row.data());
      for (int64_t h : {int64_t{0}, H - 1}) {
        CHECK(row[h] == synth_value("experts.gate_up_proj", (e * H + h) * 2 * I + gate_col, in_scale));
      }
      common::DecodeRow((*w)->w3, f, row.data());
      CHECK(row[5] == synth_value("experts.gate_up_proj", (e * H + 5) * 2 * I + up_col, in_scale));
      if (gpt_oss) {
        CHECK((*w)->b1[f] == synth_value("experts.gate_up_proj_bias", e * 2 * I + gate_col, 0.5));
        CHECK((*w)->b3[f] == synth_value("experts.gate_up_proj_bias", e * 2 * I + up_col, 0.5));
      }
    }
    for (int64_t h : {int64_t{0}, H - 1}) {
      common::DecodeRow((*w)->w2, h, row.data());
      CHECK(row[7] == synth_value("experts.down_proj", (e * I + 7) * H + h, ff_scale));
      if (gpt_oss) CHECK((*w)->b2[h] == synth_value("experts.down_proj_bias", e * H + h, 0.5));
    }
    auto routing = model->LoadRouting(0, true);
    REQUIRE(routing.ok());
    CHECK(((*routing)->bias != nullptr) == gpt_oss);
    if (gpt_oss) CHECK((*routing)->bias[3] == synth_value("router.bias", 3, 0.5));
  }
}

TEST_CASE("fused-expert checkpoints with a missing or misshapen tensor are refused by name") {
  TempDir dir;
  SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt", "gpt_oss");
  synth.dtype = DType::kF32;
  std::ostringstream log;
  REQUIRE(WriteSyntheticCheckpoint(synth, log).ok());
  const std::string config = colibri::testing::ReadFile(synth.out_dir + "/config.json");
  // The same tensors under a config that changes the expert count: the fused tensors no longer fit.
  const std::string name = "model.layers.0.mlp.experts.down_proj_bias";
  ConvertOptions o;
  o.checkpoint_dir = synth.out_dir;
  o.out_dir = dir / "model";
  o.progress = false;
  {
    auto file = common::SafetensorsFile::Open(synth.out_dir + "/model.safetensors");
    REQUIRE(file.ok());
    REQUIRE((*file)->Find(name) != nullptr);
  }
  // Rewrite the checkpoint without the down projection's bias.
  std::vector<common::SafetensorsWriter::Spec> specs;
  std::vector<std::vector<uint8_t>> data;
  {
    auto file = common::SafetensorsFile::Open(synth.out_dir + "/model.safetensors");
    REQUIRE(file.ok());
    for (const auto& t : (*file)->tensors()) {
      if (t.name == name) continue;
      specs.push_back({t.name, t.dtype, t.shape});
      data.emplace_back(t.data, t.data + t.nbytes);
    }
  }
  std::filesystem::create_directories(dir / "broken");
  std::filesystem::copy_file(synth.out_dir + "/config.json", dir / "broken/config.json");
  auto w = common::SafetensorsWriter::Create(dir / "broken/model.safetensors", specs);
  REQUIRE(w.ok());
  for (const auto& bytes : data) REQUIRE((*w)->Append(bytes.data(), bytes.size()).ok());
  REQUIRE((*w)->Close().ok());
  o.checkpoint_dir = dir / "broken";
  CHECK(Contains(ConvertCheckpoint(o, log), "missing tensor '" + name + "'"));
  CHECK_FALSE(std::filesystem::exists(dir / "model/manifest.json"));
  // A config whose expert count contradicts the fused tensors.
  std::ofstream(dir / "broken/config.json", std::ios::trunc)
      << std::regex_replace(config, std::regex("\"num_local_experts\": \\d+"), "\"num_local_experts\": 3");
  CHECK(Contains(ConvertCheckpoint(o, log), "num_local_experts = 3 but the tensors say"));
}

TEST_CASE("a Qwen2-MoE shared expert becomes expert n_experts with its sigmoid gate") {
  TempDir dir;
  SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt", "qwen2_moe");
  synth.shared_d_ff = 176;  // wider than the routed experts (80), not a multiple of 64
  for (DType type : {DType::kF32, DType::kInt4}) {
    const std::string out_dir = dir / ("model_" + common::DTypeName(type));
    const auto model = SynthConvertOpen(synth, out_dir, type);
    const common::Manifest& m = model->manifest();
    CHECK(m.format_version == 2);
    CHECK(m.n_shared_experts == 1);
    CHECK(m.shared_d_ff == 176);
    CHECK(m.shared_gate);
    auto routing = model->LoadRouting(1, true);
    REQUIRE(routing.ok());
    REQUIRE((*routing)->shared_gate != nullptr);
    CheckWeightsAgainstCheckpoint(synth.out_dir, out_dir);
  }
  // config.json must agree with the tensors about the shared expert.
  CHECK(Contains(ConvertEditedConfig(synth.out_dir, colibri::testing::ReadFile(synth.out_dir + "/config.json"),
                                     R"("shared_expert_intermediate_size":\s*176)",
                                     R"("shared_expert_intermediate_size": 64)", dir / "refused"),
                 "shared_expert_intermediate_size = 64 but the tensors say 176"));
  // Its shared expert is gated: a checkpoint without the gate is refused, naming it.
  std::filesystem::create_directories(dir / "no_gate");
  std::filesystem::copy_file(synth.out_dir + "/config.json", dir / "no_gate/config.json");
  {
    auto file = common::SafetensorsFile::Open(synth.out_dir + "/model.safetensors");
    REQUIRE(file.ok());
    std::vector<common::SafetensorsWriter::Spec> kept;
    for (const auto& t : (*file)->tensors()) {
      if (t.name.find("shared_expert_gate") == std::string::npos) kept.push_back({t.name, t.dtype, t.shape});
    }
    auto w = common::SafetensorsWriter::Create(dir / "no_gate/model.safetensors", kept);
    REQUIRE(w.ok());
    for (const auto& spec : kept) {
      const common::SafetensorsTensor* t = (*file)->Find(spec.name);
      REQUIRE((*w)->Append(t->data, t->nbytes).ok());
    }
    REQUIRE((*w)->Close().ok());
  }
  ConvertOptions o;
  o.checkpoint_dir = dir / "no_gate";
  o.out_dir = dir / "no_gate_model";
  o.progress = false;
  std::ostringstream log;
  CHECK(Contains(ConvertCheckpoint(o, log), "missing tensor 'model.layers.0.mlp.shared_expert_gate.weight'"));
}

TEST_CASE("converting over an existing model needs overwrite") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kBF16);
  ConvertOptions o;
  o.checkpoint_dir = dir / "ckpt";
  o.out_dir = dir / "model";
  o.progress = false;
  std::ostringstream log;
  const absl::Status s = ConvertCheckpoint(o, log);
  CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(Contains(s, "--overwrite"));

  // A conversion that fails in its last layer leaves the model there whole.
  const std::string model_id = [&] {
    auto model = common::ModelDir::Open(dir / "model");
    REQUIRE(model.ok());
    return (*model)->model_id();
  }();
  std::string dropped;
  std::vector<common::SafetensorsWriter::Spec> specs;
  std::vector<std::vector<uint8_t>> data;
  {
    auto file = common::SafetensorsFile::Open(dir / "ckpt/model.safetensors");
    REQUIRE(file.ok());
    for (const auto& t : (*file)->tensors()) {
      if (t.name.find("layers.1.") != std::string::npos && t.name.find("experts") != std::string::npos)
        dropped = t.name;
    }
    for (const auto& t : (*file)->tensors()) {
      if (t.name == dropped) continue;
      specs.push_back({t.name, t.dtype, t.shape});
      data.emplace_back(t.data, t.data + t.nbytes);
    }
  }
  REQUIRE_FALSE(dropped.empty());
  std::filesystem::create_directories(dir / "broken");
  std::filesystem::copy_file(dir / "ckpt/config.json", dir / "broken/config.json");
  auto w = common::SafetensorsWriter::Create(dir / "broken/model.safetensors", specs);
  REQUIRE(w.ok());
  for (const auto& bytes : data) REQUIRE((*w)->Append(bytes.data(), bytes.size()).ok());
  REQUIRE((*w)->Close().ok());
  o.checkpoint_dir = dir / "broken";
  o.overwrite = true;
  CHECK(Contains(ConvertCheckpoint(o, log), dropped));
  auto kept = common::ModelDir::Open(dir / "model");
  REQUIRE(kept.ok());
  CHECK((*kept)->model_id() == model_id);
  CHECK((*kept)->LoadExpert(1, 3, /*verify_checksum=*/true).ok());
  for (const auto& entry : std::filesystem::directory_iterator(dir / "model")) {
    CHECK(entry.path().filename().string().rfind(".colibri-", 0) == std::string::npos);  // no staging left
  }
  // A killed run's staging directory is removed by the next run.
  const std::string stale = dir / "model/.colibri-partial-999999999";
  std::filesystem::create_directories(stale);
  // With --overwrite and a good checkpoint, the model is replaced.
  o.checkpoint_dir = dir / "ckpt";
  o.weight_type = DType::kInt8;
  REQUIRE(ConvertCheckpoint(o, log).ok());
  auto replaced = common::ModelDir::Open(dir / "model");
  REQUIRE(replaced.ok());
  CHECK((*replaced)->manifest().weight_type == DType::kInt8);
  CHECK_FALSE(std::filesystem::exists(stale));
  for (const auto& entry : std::filesystem::directory_iterator(dir / "model")) {
    CHECK(entry.path().filename().string().rfind(".colibri-", 0) == std::string::npos);
  }
}

// A one-layer Mixtral-naming checkpoint whose gate favours expert 0: every
// embedding has a positive component along dimension 0 and expert 0's gate
// row weighs it heavily.
void WriteImbalancedCheckpoint(const std::string& dir) {
  constexpr int64_t kVocab = 512, kDim = 16, kFf = 32, kExperts = 4;
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << R"({"model_type":"mixtral","num_experts_per_tok":1})";
  std::vector<common::SafetensorsWriter::Spec> specs = {
      {"model.embed_tokens.weight", "F32", {kVocab, kDim}},
      {"model.layers.0.block_sparse_moe.gate.weight", "F32", {kExperts, kDim}}};
  for (int e = 0; e < kExperts; ++e) {
    const std::string p = "model.layers.0.block_sparse_moe.experts." + std::to_string(e) + ".";
    specs.push_back({p + "w1.weight", "F32", {kFf, kDim}});
    specs.push_back({p + "w2.weight", "F32", {kDim, kFf}});
    specs.push_back({p + "w3.weight", "F32", {kFf, kDim}});
  }
  auto w = common::SafetensorsWriter::Create(dir + "/model.safetensors", specs);
  REQUIRE(w.ok());
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (const auto& spec : specs) {
    std::vector<float> values(spec.shape[0] * spec.shape[1]);
    for (float& v : values) v = normal(rng) * 0.3f;
    if (spec.name == "model.embed_tokens.weight") {
      for (int64_t v = 0; v < kVocab; ++v) values[v * kDim] += 1.0f;
    } else if (spec.name == "model.layers.0.block_sparse_moe.gate.weight") {
      values[0] += 1.5f;
    }
    REQUIRE((*w)->Append(values.data(), values.size() * 4).ok());
  }
  REQUIRE((*w)->Close().ok());
}

TEST_CASE("balancing evens out the load of an imbalanced gate") {
  TempDir dir;
  WriteImbalancedCheckpoint(dir / "ckpt");
  auto spread = [](const std::vector<int64_t>& load) {
    return *std::max_element(load.begin(), load.end()) - *std::min_element(load.begin(), load.end());
  };
  ConvertOptions o;
  o.checkpoint_dir = dir / "ckpt";
  o.out_dir = dir / "balanced";
  o.balance_loss_weight = 1.0;
  o.progress = false;
  std::ostringstream log;
  ConvertReport report;
  const absl::Status s = ConvertCheckpoint(o, log, &report);
  INFO(s.message() << "\n" << log.str());
  REQUIRE(s.ok());
  const LutResult& lut = report.layers[0].lut;
  CHECK(lut.load_before[0] > 512 / 2);  // the imbalance is real
  CHECK(spread(lut.load_after) < spread(lut.load_before));
  CHECK(lut.load_after[0] < lut.load_before[0]);
  CHECK(lut.agree_before == lut.compared);
  CHECK(lut.agree_after < lut.compared);      // balancing moved some tokens ...
  CHECK(lut.agree_after > lut.compared / 2);  // ... not most of them
  CHECK(Validate(o.out_dir).ok());
  auto model = common::ModelDir::Open(o.out_dir);
  REQUIRE(model.ok());
  CHECK((*model)->manifest().balance_loss_weight == 1.0);

  o.balance_loss_weight = -1;
  o.overwrite = true;
  CHECK(Contains(ConvertCheckpoint(o, log), "balance loss weight -1"));
}

TEST_CASE("calibration records steer the LUT toward where recorded hidden states went") {
  TempDir dir;
  SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt");
  synth.vocab_size = 512;
  synth.n_experts = 8;
  synth.calibration_path = dir / "calib.safetensors";
  synth.calibration_records = 300;
  std::ostringstream log;
  REQUIRE(WriteSyntheticCheckpoint(synth, log).ok());
  ConvertOptions o;
  o.checkpoint_dir = synth.out_dir;
  o.progress = false;
  o.out_dir = dir / "calibrated";
  o.calibration_path = synth.calibration_path;
  ConvertReport calibrated;
  REQUIRE(ConvertCheckpoint(o, log, &calibrated).ok());
  for (const LayerReport& layer : calibrated.layers) {
    const LutResult& c = layer.lut;
    CHECK(layer.lut_source == "calibration");
    CHECK(c.calibrated_tokens > 100);
    CHECK(c.compared == 300);
    CHECK(c.agree_after > c.compared / 2);  // mean routing matches most records
  }
  CHECK(Validate(o.out_dir).ok());
  auto model = common::ModelDir::Open(o.out_dir);
  REQUIRE(model.ok());
  CHECK((*model)->manifest().lut_source == "calibration");
}

// Writes a one-layer Mixtral-naming checkpoint by hand, with `mutate` able to
// change a spec (shape or dtype) before the file is written.
void WriteHandCheckpoint(const std::string& dir,
                         const std::function<void(std::vector<common::SafetensorsWriter::Spec>*)>& mutate) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << R"({"model_type":"mixtral","hidden_size":8,"intermediate_size":16,)"
                                         R"("num_local_experts":2,"num_experts_per_tok":1,"vocab_size":4})";
  std::vector<common::SafetensorsWriter::Spec> specs = {{"model.embed_tokens.weight", "F32", {4, 8}},
                                                        {"model.layers.0.block_sparse_moe.gate.weight", "F32", {2, 8}}};
  for (int e = 0; e < 2; ++e) {
    const std::string p = "model.layers.0.block_sparse_moe.experts." + std::to_string(e) + ".";
    specs.push_back({p + "w1.weight", "F32", {16, 8}});
    specs.push_back({p + "w2.weight", "F32", {8, 16}});
    specs.push_back({p + "w3.weight", "F32", {16, 8}});
  }
  mutate(&specs);
  auto w = common::SafetensorsWriter::Create(dir + "/model.safetensors", specs);
  REQUIRE(w.ok());
  for (const auto& spec : specs) {
    int64_t n = common::SafetensorsElementSize(spec.dtype);
    for (int64_t d : spec.shape) n *= d;
    std::vector<uint8_t> bytes(n, 0x3c);
    REQUIRE((*w)->Append(bytes.data(), bytes.size()).ok());
  }
  REQUIRE((*w)->Close().ok());
}

absl::Status ConvertHand(const TempDir& dir, DType type = DType::kBF16) {
  ConvertOptions o;
  o.checkpoint_dir = dir / "ckpt";
  o.out_dir = dir / "model";
  o.weight_type = type;
  o.progress = false;
  std::ostringstream log;
  return ConvertCheckpoint(o, log);
}

TEST_CASE("the converter refuses model families and features it does not reproduce, naming the key or tensor") {
  const std::string base = R"("hidden_size":8,"intermediate_size":16,"num_local_experts":2,"num_experts_per_tok":1,)"
                           R"("vocab_size":4)";
  for (const auto& [config, message] :
       {std::pair{R"({"model_type":"dbrx",)" + base + "}", "model_type 'dbrx' is not supported"},
        std::pair{R"({"model_type":"llama4",)" + base + "}", "model_type 'llama4' does not match the tensors' naming"},
        std::pair{R"({"model_type":"deepseek_v3","scoring_func":"softmax",)" + base + "}",
                  "scoring_func = \"softmax\": DeepSeek-V3's routing is sigmoid"},
        std::pair{R"({"model_type":"gpt_oss",)" + base + "}",
                  "model_type 'gpt_oss' does not match the tensors' naming"},
        std::pair{R"({"model_type":"gpt_oss","quantization_config":{"quant_method":"mxfp4"},)" + base + "}",
                  "quantization_config (quant_method 'mxfp4') is not supported: Colibri reads f32/bf16/f16 and "
                  "DeepSeek's block FP8 (fp8, e4m3, 128 x 128 blocks); dequantize MXFP4 first"},
        std::pair{R"({"model_type":"llama4","hidden_act":"gelu",)" + base + "}",
                  "hidden_act = \"gelu\": Colibri's experts are SwiGLU"},
        std::pair{R"({"model_type":"mixtral","hidden_act":"gelu",)" + base + "}",
                  "hidden_act = \"gelu\": Colibri's experts are SwiGLU"},
        std::pair{R"({"model_type":"deepseek_v3","hidden_act":"relu",)" + base + "}",
                  "hidden_act = \"relu\": Colibri's experts are SwiGLU"},
        std::pair{R"({"model_type":"deepseek_v2","mlp_bias":true,)" + base + "}",
                  "mlp_bias = true: MLP biases are not supported for deepseek_v2"},
        std::pair{
            R"({"model_type":"mixtral","quantization_config":{"quant_method":"fp8","weight_block_size":[64,64]},)" +
                base + "}",
            "quantization_config (quant_method 'fp8') is not supported"},
        std::pair{R"({"model_type":"qwen3_moe","scoring_func":"sigmoid",)" + base + "}",
                  "scoring_func = \"sigmoid\": not supported for this model_type"},
        std::pair{R"({"model_type":"qwen3_moe","n_group":8,)" + base + "}", "n_group = 8"},
        std::pair{R"({"model_type":"qwen3_moe","routed_scaling_factor":2.5,)" + base + "}",
                  "routed_scaling_factor = 2.5"},
        std::pair{R"({"model_type":"deepseek_v2","topk_method":"noaux_tc",)" + base + "}",
                  "topk_method = \"noaux_tc\": not supported (greedy or group_limited_greedy)"},
        std::pair{R"({"model_type":"qwen3_moe","topk_method":"group_limited_greedy",)" + base + "}",
                  "topk_method = \"group_limited_greedy\": not supported (greedy only)"},
        std::pair{R"({"model_type":"deepseek_v2","norm_topk_prob":true,)" + base + "}",
                  "norm_topk_prob = true: not supported for deepseek_v2"}}) {
    TempDir dir;
    WriteHandCheckpoint(dir / "ckpt", [](auto*) {});
    std::ofstream(dir / "ckpt/config.json", std::ios::trunc) << config;
    const absl::Status s = ConvertHand(dir);
    INFO(s.message());
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(Contains(s, message));
    CHECK_FALSE(std::filesystem::exists(dir / "model/manifest.json"));
  }
  {  // Gates named mlp.gate are several families': without a model_type, which is not guessed.
    TempDir dir;
    WriteHandCheckpoint(dir / "ckpt", [](auto* specs) {
      for (auto& spec : *specs) {
        if (spec.name == "model.layers.0.block_sparse_moe.gate.weight") spec.name = "model.layers.0.mlp.gate.weight";
      }
    });
    std::ofstream(dir / "ckpt/config.json", std::ios::trunc) << "{" << base << "}";
    CHECK(Contains(ConvertHand(dir), "config.json: no model_type, and gates named like 'model.layers.N.mlp.gate"));
  }
  for (const char* tensor : {"model.layers.0.block_sparse_moe.experts.0.w1.weight_scale_inv",
                             "model.layers.0.block_sparse_moe.experts.0.w1.weight_blocks",
                             "model.layers.0.block_sparse_moe.gate.e_score_correction_bias"}) {
    TempDir dir;
    WriteHandCheckpoint(dir / "ckpt", [&](auto* specs) { specs->push_back({tensor, "F32", {1, 1}}); });
    const absl::Status s = ConvertHand(dir);
    INFO(s.message());
    CHECK(Contains(s, std::string("tensor '") + tensor + "'"));
    CHECK_FALSE(std::filesystem::exists(dir / "model/manifest.json"));
  }
}

TEST_CASE("the converter refuses bad checkpoints with a clear message") {
  {
    TempDir dir;
    WriteHandCheckpoint(dir / "ckpt", [](auto*) {});
    const absl::Status s = ConvertHand(dir);
    INFO(s.message());
    CHECK(s.ok());
  }
  {
    TempDir dir;
    WriteHandCheckpoint(dir / "ckpt", [](auto* specs) { specs->pop_back(); });  // expert 1 w3 missing
    const absl::Status s = ConvertHand(dir);
    CHECK(Contains(s, "missing tensor 'model.layers.0.block_sparse_moe.experts.1.w3.weight'"));
    CHECK_FALSE(std::filesystem::exists(dir / "model/manifest.json"));
  }
  {
    TempDir dir;
    WriteHandCheckpoint(dir / "ckpt", [](auto* specs) { (*specs)[3].shape = {8, 15}; });  // expert 0 w2
    const absl::Status s = ConvertHand(dir);
    CHECK(Contains(s, "experts.0.w2.weight"));
    CHECK(Contains(s, "has shape [8, 15], expected [8, 16]"));
  }
  {
    TempDir dir;
    WriteHandCheckpoint(dir / "ckpt", [](auto* specs) { (*specs)[2].dtype = "I32"; });  // expert 0 w1
    const absl::Status s = ConvertHand(dir);
    CHECK(Contains(s, "dtype I32"));
  }
  {
    TempDir dir;
    WriteHandCheckpoint(dir / "ckpt", [](auto* specs) { (*specs)[2].dtype = "F8_E4M3"; });  // FP8 without scales
    const absl::Status s = ConvertHand(dir);
    CHECK(Contains(s, "'model.layers.0.block_sparse_moe.experts.0.w1.weight' is F8_E4M3 but its block scales"));
  }
  {
    TempDir dir;
    WriteHandCheckpoint(dir / "ckpt", [](auto*) {});
    std::ofstream(dir / "ckpt/model.safetensors", std::ios::trunc) << "garbage that is not a header";
    const absl::Status s = ConvertHand(dir);
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(Contains(s, "model.safetensors"));
  }
  {
    TempDir dir;
    WriteHandCheckpoint(dir / "ckpt", [](auto*) {});
    std::ofstream(dir / "ckpt/config.json", std::ios::trunc)
        << R"({"model_type":"mixtral","hidden_size":9,"num_experts_per_tok":1})";
    CHECK(Contains(ConvertHand(dir), "hidden_size = 9 but the tensors say 8"));
  }
  for (const auto& [tensor, element, message] :
       {std::tuple{"model.embed_tokens.weight", 8, "embedding row 1 is not finite"},
        std::tuple{"model.layers.0.block_sparse_moe.experts.1.w2.weight", 1,
                   "experts.1.w2.weight' has a non-finite value at [0, 1]"}}) {
    TempDir dir;
    WriteHandCheckpoint(dir / "ckpt", [](auto*) {});
    uint64_t offset = 0;
    {
      auto file = common::SafetensorsFile::Open(dir / "ckpt/model.safetensors");
      REQUIRE(file.ok());
      offset = (*file)->Find(tensor)->offset + 4 * element;
    }
    colibri::testing::WriteBytesAt(dir / "ckpt/model.safetensors", offset, std::string(4, '\xff'));  // NaN
    CHECK(Contains(ConvertHand(dir), message));
  }
  {
    TempDir dir;  // finite in the checkpoint, infinite in the weight type: refused, not written as Inf
    WriteHandCheckpoint(dir / "ckpt", [](auto*) {});
    uint64_t offset = 0;
    {
      auto file = common::SafetensorsFile::Open(dir / "ckpt/model.safetensors");
      REQUIRE(file.ok());
      offset = (*file)->Find("model.layers.0.block_sparse_moe.experts.1.w1.weight")->offset + 4 * 9;
    }
    const float big = 1e5f;  // above f16's largest, 65504
    colibri::testing::WriteBytesAt(dir / "ckpt/model.safetensors", offset,
                                   std::string(reinterpret_cast<const char*>(&big), 4));
    CHECK(ConvertHand(dir, DType::kBF16).ok());
    std::filesystem::remove_all(dir / "model");
    const absl::Status s = ConvertHand(dir, DType::kF16);
    INFO(s.message());
    CHECK(Contains(s, "experts.1.w1.weight' holds 100000 at [1, 1], which does not fit weight type f16"));
    CHECK_FALSE(std::filesystem::exists(dir / "model/manifest.json"));
  }
  {
    TempDir dir;  // a config.json nested deeper than any config is: refused before it is parsed
    WriteHandCheckpoint(dir / "ckpt", [](auto*) {});
    std::ofstream(dir / "ckpt/config.json", std::ios::trunc) << std::string(100000, '[') << std::string(100000, ']');
    CHECK(Contains(ConvertHand(dir), "config.json nests 100000 levels deep, more than 16"));
  }
  {
    TempDir dir;  // a non-canonical layer number: no gate recognized, no crash
    WriteHandCheckpoint(dir / "ckpt",
                        [](auto* specs) { (*specs)[1].name = "model.layers.00.block_sparse_moe.gate.weight"; });
    CHECK(Contains(ConvertHand(dir), "expected MoE gate tensors in exactly one naming"));
  }
  {
    TempDir dir;  // a config field of the wrong type
    WriteHandCheckpoint(dir / "ckpt", [](auto*) {});
    std::ofstream(dir / "ckpt/config.json", std::ios::trunc)
        << R"({"model_type":7,"num_experts_per_tok":1,"norm_topk_prob":"yes"})";
    const absl::Status s = ConvertHand(dir);
    INFO(s.message());
    CHECK(s.ok());  // informational fields of the wrong type are ignored; the tensors decide
  }
  {
    TempDir dir;
    CHECK(ConvertHand(dir).code() == absl::StatusCode::kNotFound);  // no checkpoint at all
  }
}

}  // namespace
}  // namespace tools
}  // namespace colibri
