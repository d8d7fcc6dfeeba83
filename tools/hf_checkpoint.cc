#include "tools/hf_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/json_depth.h"
#include "common/manifest.h"
#include "common/small_file.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace colibri {
namespace tools {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

// config.json and the shard index: a few hundred KB at most (DeepSeek-V3's
// index, 90 000 tensor names, is ~9 MB).
absl::StatusOr<Json> ReadJson(const std::string& path) {
  COLIBRI_ASSIGN_OR_RETURN(const std::string text, common::ReadSmallFile(path, {int64_t{256} << 20}));
  if (const int depth = common::JsonDepth(text); depth > common::kMaxJsonDepth) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " nests ", depth, " levels deep, more than ", common::kMaxJsonDepth));
  }
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a JSON object"));
  }
  return j;
}

// "<prefix><N><suffix>" -> N, or -1.
int64_t LayerOf(const std::string& name, absl::string_view prefix, absl::string_view suffix) {
  if (!absl::StartsWith(name, prefix) || !absl::EndsWith(name, suffix)) return -1;
  const size_t begin = prefix.size();
  if (name.size() < begin + suffix.size()) return -1;
  const std::string digits = name.substr(begin, name.size() - suffix.size() - begin);
  // Canonical decimal only ("7", not "07" or "+7"): GateName() must rebuild the same name.
  if (digits.empty() || digits.size() > 9 || (digits.size() > 1 && digits[0] == '0')) return -1;
  for (char c : digits) {
    if (c < '0' || c > '9') return -1;
  }
  int64_t layer = -1;
  return absl::SimpleAtoi(digits, &layer) ? layer : -1;
}

// The gate (router) tensor of each naming: it marks a layer as MoE.
struct GateNaming {
  Naming naming;
  const char* prefix;
  const char* suffix;
};
constexpr GateNaming kGateNamings[] = {
    {Naming::kMixtral, "model.layers.", ".block_sparse_moe.gate.weight"},
    {Naming::kQwenMoe, "model.layers.", ".mlp.gate.weight"},
    {Naming::kGptOss, "model.layers.", ".mlp.router.weight"},
    {Naming::kLlama4, "model.layers.", ".feed_forward.router.weight"},
    {Naming::kLlama4, "language_model.model.layers.", ".feed_forward.router.weight"},
};
constexpr int64_t kFp8Block = 128;                          // DeepSeek-V3's weight_block_size
constexpr double kGptOssAlpha = 1.702, kGptOssLimit = 7.0;  // GptOssExperts' constants
// DeepseekV3Config's defaults, for keys a config.json leaves out.
constexpr int64_t kDeepseekV3Groups = 8, kDeepseekV3TopkGroups = 4;
constexpr double kDeepseekV3Scaling = 2.5;

bool Fused(Naming n) { return n == Naming::kGptOss || n == Naming::kLlama4; }

// Element `i` of an F32/BF16/F16 tensor, as f32.
float ElementAt(const common::SafetensorsTensor& t, int64_t i) {
  if (t.dtype == "F32") {
    float v;
    std::memcpy(&v, t.data + 4 * i, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, t.data + 2 * i, 2);
  return t.dtype == "BF16" ? common::Bf16ToFloat(h) : common::F16ToFloat(h);
}

std::string ModelType(const Json& config) {
  return config.contains("model_type") && config["model_type"].is_string() ? config["model_type"].get<std::string>()
                                                                           : "";
}

// The MoE layers config.json describes, when it does: Qwen2-MoE / Qwen3-MoE,
// layer l when it is not in mlp_only_layers and (l + 1) % decoder_sparse_step
// == 0; DeepSeek, layer l when l >= first_k_dense_replace and l %
// moe_layer_freq == 0 (their modeling code). They must be the layers that
// have a gate tensor.
absl::Status CheckSparseLayers(const Json& config, const std::string& dir, const std::vector<int64_t>& moe_layers) {
  const bool qwen = config.contains("decoder_sparse_step");
  const bool deepseek = config.contains("first_k_dense_replace");
  const bool llama4 = config.contains("interleave_moe_layer_step") || config.contains("moe_layers");
  if ((!qwen && !deepseek && !llama4) || !config.contains("num_hidden_layers")) return absl::OkStatus();
  // Layer counts and steps: at most common::kMaxLayers, what a manifest may hold.
  auto positive = [&](const char* key, int64_t fallback, int64_t minimum) -> absl::StatusOr<int64_t> {
    if (!config.contains(key)) return fallback;
    if (!config[key].is_number_integer() || config[key].get<int64_t>() < minimum ||
        config[key].get<int64_t>() > common::kMaxLayers) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, "/config.json: ", key, " must be an integer in [", minimum, ", ", common::kMaxLayers, "]"));
    }
    return config[key].get<int64_t>();
  };
  COLIBRI_ASSIGN_OR_RETURN(const int64_t layers, positive("num_hidden_layers", 0, 1));
  auto layer_list = [&](const char* key) -> absl::StatusOr<std::set<int64_t>> {
    std::set<int64_t> listed;
    if (!config.contains(key) || config[key].is_null()) return listed;
    const auto bad = absl::InvalidArgumentError(absl::StrCat(dir, "/config.json: ", key, " must be a list of layers"));
    if (!config[key].is_array()) return bad;
    for (const Json& l : config[key]) {
      if (!l.is_number_integer()) return bad;
      listed.insert(l.get<int64_t>());
    }
    return listed;
  };
  COLIBRI_ASSIGN_OR_RETURN(const std::set<int64_t> dense, layer_list("mlp_only_layers"));
  std::vector<int64_t> expected;
  std::string keys;
  if (llama4) {  // Llama4TextConfig: moe_layers, else every interleave_moe_layer_step-th layer
    COLIBRI_ASSIGN_OR_RETURN(const std::set<int64_t> listed, layer_list("moe_layers"));
    COLIBRI_ASSIGN_OR_RETURN(const int64_t step, positive("interleave_moe_layer_step", 1, 1));
    const bool explicit_list = config.contains("moe_layers") && !config["moe_layers"].is_null();
    for (int64_t l = 0; l < layers; ++l) {
      if (explicit_list ? listed.count(l) > 0 : (l + 1) % step == 0) expected.push_back(l);
    }
    keys = explicit_list ? "num_hidden_layers and moe_layers" : "num_hidden_layers and interleave_moe_layer_step";
  } else if (qwen) {
    COLIBRI_ASSIGN_OR_RETURN(const int64_t step, positive("decoder_sparse_step", 1, 1));
    for (int64_t l = 0; l < layers; ++l) {
      if (dense.count(l) == 0 && (l + 1) % step == 0) expected.push_back(l);
    }
    keys = "num_hidden_layers, decoder_sparse_step and mlp_only_layers";
  } else {
    COLIBRI_ASSIGN_OR_RETURN(const int64_t first, positive("first_k_dense_replace", 0, 0));
    COLIBRI_ASSIGN_OR_RETURN(const int64_t freq, positive("moe_layer_freq", 1, 1));
    for (int64_t l = first; l < layers; ++l) {
      if (l % freq == 0) expected.push_back(l);
    }
    keys = "num_hidden_layers, first_k_dense_replace and moe_layer_freq";
  }
  if (expected != moe_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, "/config.json: ", keys, " make layers [", absl::StrJoin(expected, ","),
                     "] MoE, but the gate tensors are in layers [", absl::StrJoin(moe_layers, ","), "]"));
  }
  return absl::OkStatus();
}

// The model families whose MoE block the converter and the runtime reproduce
// exactly (docs/MODEL_FAMILIES.md).
constexpr const char* kSupportedModelTypes[] = {"mixtral",     "qwen2_moe", "qwen3_moe", "olmoe",  "deepseek_v2",
                                                "deepseek_v3", "kimi_k2",   "gpt_oss",   "llama4", "llama4_text"};

// DeepSeek-V3's FP8 checkpoints: quant_method fp8, fmt e4m3, 128 x 128 blocks
// (weights F8_E4M3 with f32 `_scale_inv` tensors).
bool IsBlockFp8(const Json& config) {
  if (!config.contains("quantization_config")) return false;
  const Json& q = config["quantization_config"];
  return q.is_object() && q.contains("quant_method") && q["quant_method"] == "fp8" &&
         (!q.contains("fmt") || q["fmt"] == "e4m3") &&
         (!q.contains("weight_block_size") || q["weight_block_size"] == Json::array({128, 128}));
}

bool IsDeepseekV3(const Json& config) {
  return config.contains("model_type") && (config["model_type"] == "deepseek_v3" || config["model_type"] == "kimi_k2");
}

// Refuses what the converter would otherwise turn into a model that computes
// something else: a model_type outside the list, quantized weights other than
// block FP8 (gpt-oss's MXFP4 among them), and routing or activation keys a
// family's modeling code does not give the meaning the runtime implements.
absl::Status CheckSupported(const Json& config, const std::string& dir) {
  const std::string where = dir + "/config.json";
  std::string type;
  if (config.contains("model_type") && config["model_type"].is_string()) {  // a non-string one is ignored
    type = config["model_type"].get<std::string>();
    if (std::find(std::begin(kSupportedModelTypes), std::end(kSupportedModelTypes), type) ==
        std::end(kSupportedModelTypes)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": model_type '", type,
                                                     "' is not supported: Colibri converts ",
                                                     absl::StrJoin(kSupportedModelTypes, ", "),
                                                     " checkpoints (other families' routing and activations are not "
                                                     "implemented; docs/MODEL_FAMILIES.md)"));
    }
  }
  if (config.contains("quantization_config") && !IsBlockFp8(config)) {
    const Json& q = config["quantization_config"];
    const std::string method = q.is_object() && q.contains("quant_method") && q["quant_method"].is_string()
                                   ? q["quant_method"].get<std::string>()
                                   : "?";
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": quantization_config (quant_method '", method,
        "') is not supported: Colibri reads f32/bf16/f16 and DeepSeek's block FP8 (fp8, e4m3, 128 x 128 blocks)",
        method == "mxfp4" ? "; dequantize MXFP4 first (transformers: from_pretrained(..., quantization_config="
                            "Mxfp4Config(dequantize=True)), then save_pretrained)"
                          : ""));
  }
  auto refuse = [&](const char* key, const char* why) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", key, " = ", config[key].dump(), ": ", why));
  };
  if (type == "gpt_oss") return absl::OkStatus();  // its experts ignore hidden_act; constants read in Open
  // Every other family's expert MLPs apply ACT2FN[hidden_act], where "swish" is SiLU too.
  if (config.contains("hidden_act") && config["hidden_act"] != "silu" && config["hidden_act"] != "swish") {
    return refuse("hidden_act", "Colibri's experts are SwiGLU (silu)");
  }
  if (type == "llama4" || type == "llama4_text") return absl::OkStatus();
  const bool deepseek_v2 = type == "deepseek_v2", deepseek_v3 = IsDeepseekV3(config);
  if (deepseek_v3) {  // sigmoid scores, the correction bias, groups by the sum of their top two (noaux_tc)
    if (config.contains("scoring_func") && config["scoring_func"] != "sigmoid") {
      return refuse("scoring_func", "DeepSeek-V3's routing is sigmoid");
    }
    if (config.contains("topk_method") && config["topk_method"] != "noaux_tc") {
      return refuse("topk_method", "DeepSeek-V3's routing is noaux_tc");
    }
    return absl::OkStatus();
  }
  if (config.contains("scoring_func") && config["scoring_func"] != "softmax") {
    return refuse("scoring_func", "not supported for this model_type (softmax only)");
  }
  if (deepseek_v2) {
    if (config.contains("topk_method") && config["topk_method"] != "greedy" &&
        config["topk_method"] != "group_limited_greedy") {
      return refuse("topk_method", "not supported (greedy or group_limited_greedy)");
    }
    // Hugging Face's DeepSeek-V2 code never renormalizes; DeepSeek's own
    // code does when norm_topk_prob is set: with the two disagreeing, refuse.
    if (config.contains("norm_topk_prob") && config["norm_topk_prob"] == true) {
      return refuse("norm_topk_prob", "not supported for deepseek_v2 (its implementations disagree on it)");
    }
    if (config.contains("mlp_bias") && config["mlp_bias"] == true) {
      return refuse("mlp_bias", "MLP biases are not supported for deepseek_v2");
    }
    return absl::OkStatus();
  }
  for (const char* key : {"n_group", "topk_group"}) {
    if (config.contains(key) && config[key] != 1) return refuse(key, "group-limited routing is not supported");
  }
  if (config.contains("topk_method") && config["topk_method"] != "greedy") {
    return refuse("topk_method", "not supported (greedy only)");
  }
  if (config.contains("routed_scaling_factor") && config["routed_scaling_factor"] != 1.0) {
    return refuse("routed_scaling_factor", "not supported for this model_type (1 only)");
  }
  return absl::OkStatus();
}

// The gate's routing for DeepSeek models, from config.json; gpt-oss's
// router bias (softmax over the top-k logits = softmax top-k renormalized);
// Llama 4's sigmoid of the chosen logits, applied to the experts' input; the
// default (softmax top-k) for the others.
absl::StatusOr<common::RoutingSpec> RoutingOf(const Json& config, const std::string& dir, int64_t n_experts,
                                              int64_t top_k) {
  common::RoutingSpec spec;
  const std::string type = ModelType(config);
  if (type == "gpt_oss") {
    spec.logit_bias = true;
    return spec;
  }
  if (type == "llama4" || type == "llama4_text") {
    spec.scoring = common::RoutingSpec::Scoring::kSigmoid;
    spec.weight_at_input = true;
    return spec;
  }
  const bool deepseek_v3 = IsDeepseekV3(config);
  const bool deepseek_v2 = config.contains("model_type") && config["model_type"] == "deepseek_v2";
  if (!deepseek_v2 && !deepseek_v3) return spec;
  auto integer = [&](const char* key, int64_t fallback) -> absl::StatusOr<int64_t> {
    if (!config.contains(key)) return fallback;
    if (!config[key].is_number_integer()) {
      return absl::InvalidArgumentError(absl::StrCat(dir, "/config.json: ", key, " must be an integer"));
    }
    return config[key].get<int64_t>();
  };
  const bool grouped =
      deepseek_v3 || (config.contains("topk_method") && config["topk_method"] == "group_limited_greedy");
  if (grouped) {  // a key left out has its configuration class's default (DeepseekV3Config: 8 and 4)
    COLIBRI_ASSIGN_OR_RETURN(spec.n_group, integer("n_group", deepseek_v3 ? kDeepseekV3Groups : 1));
    COLIBRI_ASSIGN_OR_RETURN(spec.topk_group, integer("topk_group", deepseek_v3 ? kDeepseekV3TopkGroups : 1));
    if (spec.n_group < 1 || n_experts % spec.n_group != 0 || spec.topk_group < 1 || spec.topk_group > spec.n_group ||
        top_k > spec.topk_group * (n_experts / spec.n_group)) {
      return absl::InvalidArgumentError(absl::StrCat(dir, "/config.json: n_group = ", spec.n_group,
                                                     " and topk_group = ", spec.topk_group, " do not fit ", n_experts,
                                                     " experts and num_experts_per_tok = ", top_k));
    }
  }
  if (deepseek_v3) {
    spec.scoring = common::RoutingSpec::Scoring::kSigmoid;
    spec.group_score = common::RoutingSpec::GroupScore::kTopTwoSum;
    spec.correction_bias = true;
    spec.scaling = kDeepseekV3Scaling;  // DeepseekV3Config's, unless config.json says
  }
  if (config.contains("routed_scaling_factor")) {
    const Json& factor = config["routed_scaling_factor"];
    if (!factor.is_number() ||
        !(factor.get<double>() > 0 && factor.get<double>() <= std::numeric_limits<float>::max())) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, "/config.json: routed_scaling_factor must be a positive number that fits a float"));
    }
    spec.scaling = config["routed_scaling_factor"].get<double>();
  }
  return spec;
}

// Tensors of a layout the converter cannot read (block-quantized weights and
// their scales; a routing correction bias outside DeepSeek-V3), named in the error.
absl::Status CheckTensorNames(const std::vector<std::unique_ptr<common::SafetensorsFile>>& files, bool bias_ok,
                              bool block_fp8) {
  for (const auto& file : files) {
    for (const auto& t : file->tensors()) {
      for (const char* suffix : {"_scale_inv", "_blocks", "_scales", ".e_score_correction_bias"}) {
        const bool allowed = (bias_ok && absl::EndsWith(t.name, ".e_score_correction_bias")) ||
                             (block_fp8 && absl::EndsWith(t.name, ".weight_scale_inv"));
        if (absl::EndsWith(t.name, suffix) && !allowed) {
          const bool mxfp4 = absl::EndsWith(t.name, "_blocks") || absl::EndsWith(t.name, "_scales");
          return absl::InvalidArgumentError(absl::StrCat(
              "tensor '", t.name, "' in ", file->path(),
              mxfp4 ? ": MXFP4 weights are not supported; dequantize first (transformers: from_pretrained(..., "
                      "quantization_config=Mxfp4Config(dequantize=True)), then save_pretrained)"
                    : ": FP8 block scales outside DeepSeek-V3's FP8 and routing correction biases outside "
                      "DeepSeek-V3 are not supported"));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<HfCheckpoint>> HfCheckpoint::Open(const std::string& dir) {
  std::unique_ptr<HfCheckpoint> ckpt(new HfCheckpoint());
  COLIBRI_ASSIGN_OR_RETURN(Json config, ReadJson(dir + "/config.json"));
  if (ModelType(config) == "llama4" && config.contains("text_config") && config["text_config"].is_object()) {
    // Llama4ForConditionalGeneration: the text model's keys are under text_config.
    Json text = config["text_config"];
    text["model_type"] = "llama4";
    if (config.contains("quantization_config")) text["quantization_config"] = config["quantization_config"];
    config = std::move(text);
  }
  COLIBRI_RETURN_IF_ERROR(CheckSupported(config, dir));

  // Shards: the index's, else model.safetensors, else every *.safetensors.
  std::vector<std::string> shard_files;
  Json weight_map;
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::error_code ec;
  if (fs::exists(index_path, ec)) {
    COLIBRI_ASSIGN_OR_RETURN(Json index, ReadJson(index_path));
    if (!index.contains("weight_map") || !index["weight_map"].is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, " has no 'weight_map' object"));
    }
    weight_map = index["weight_map"];
    std::set<std::string> unique;
    for (const auto& [name, file] : weight_map.items()) {
      if (!file.is_string() || absl::StrContains(file.get<std::string>(), "/")) {
        return absl::InvalidArgumentError(absl::StrCat(index_path, ": bad shard name for '", name, "'"));
      }
      unique.insert(file.get<std::string>());
    }
    shard_files.assign(unique.begin(), unique.end());
  } else if (fs::exists(dir + "/model.safetensors", ec)) {
    shard_files.push_back("model.safetensors");
  } else {
    for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
      if (it->path().extension() == ".safetensors") shard_files.push_back(it->path().filename());
    }
    std::sort(shard_files.begin(), shard_files.end());
  }
  if (shard_files.empty()) {
    return absl::NotFoundError(absl::StrCat("no *.safetensors files in ", dir));
  }
  for (const std::string& file : shard_files) {
    COLIBRI_ASSIGN_OR_RETURN(auto shard, common::SafetensorsFile::Open(dir + "/" + file));
    ckpt->files_.push_back(std::move(shard));
  }
  for (const auto& [name, file] : weight_map.items()) {
    const common::SafetensorsFile* holder = ckpt->FileOf(name);
    if (holder == nullptr || fs::path(holder->path()).filename() != file.get<std::string>()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, " says '", name, "' is in ", file.get<std::string>(), " but it is not there"));
    }
  }

  COLIBRI_RETURN_IF_ERROR(CheckTensorNames(ckpt->files_, IsDeepseekV3(config), IsBlockFp8(config)));

  // Naming and MoE layers, from the gate tensors present. Layers past
  // num_hidden_layers are not the model's (DeepSeek-V3's multi-token
  // prediction module is stored as layer 61 of 61): the modeling code
  // ignores them, and so does this.
  HfModelShape& s = ckpt->shape_;
  const int64_t layer_count = config.contains("num_hidden_layers") && config["num_hidden_layers"].is_number_integer()
                                  ? config["num_hidden_layers"].get<int64_t>()
                                  : std::numeric_limits<int64_t>::max();
  std::vector<std::set<int64_t>> found(std::size(kGateNamings));
  for (const auto& file : ckpt->files_) {
    for (const auto& t : file->tensors()) {
      for (size_t n = 0; n < std::size(kGateNamings); ++n) {
        const int64_t l = LayerOf(t.name, kGateNamings[n].prefix, kGateNamings[n].suffix);
        if (l >= 0 && l < layer_count) found[n].insert(l);
      }
    }
  }
  std::vector<std::string> namings;
  size_t which = 0;
  for (size_t n = 0; n < std::size(kGateNamings); ++n) {
    namings.push_back(absl::StrCat(kGateNamings[n].prefix, "N", kGateNamings[n].suffix, ": ", found[n].size()));
    if (!found[n].empty()) which = n;
  }
  if (std::count_if(found.begin(), found.end(), [](const auto& f) { return !f.empty(); }) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(dir,
                                                   ": expected MoE gate tensors in exactly one naming; found layers "
                                                   "with ",
                                                   absl::StrJoin(namings, ", ")));
  }
  s.naming = kGateNamings[which].naming;
  s.layer_prefix = kGateNamings[which].prefix;
  s.moe_layers.assign(found[which].begin(), found[which].end());
  s.model_type = ModelType(config);
  if (s.model_type.empty() && s.naming == Naming::kQwenMoe) {  // Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek differ
    return absl::InvalidArgumentError(absl::StrCat(dir, "/config.json: no model_type, and gates named like '",
                                                   kGateNamings[which].prefix, "N", kGateNamings[which].suffix,
                                                   "' are several families' (qwen2_moe, qwen3_moe, olmoe, deepseek_v2, "
                                                   "deepseek_v3): say which"));
  }
  if (s.model_type.empty()) s.model_type = "mixtral";
  // gpt-oss and Llama 4 are told apart from the others by their tensors as
  // much as by model_type: the two must agree.
  const bool gpt_oss_type = s.model_type == "gpt_oss";
  const bool llama4_type = s.model_type == "llama4" || s.model_type == "llama4_text";
  if (gpt_oss_type != (s.naming == Naming::kGptOss) || llama4_type != (s.naming == Naming::kLlama4)) {
    return absl::InvalidArgumentError(absl::StrCat(dir, "/config.json: model_type '", s.model_type,
                                                   "' does not match the tensors' naming (gates named like '",
                                                   kGateNamings[which].prefix, "N", kGateNamings[which].suffix, "')"));
  }

  const common::SafetensorsFile* gate_file = ckpt->FileOf(ckpt->GateName(s.moe_layers[0]));
  if (gate_file == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("missing tensor '", ckpt->GateName(s.moe_layers[0]), "'"));
  }
  const common::SafetensorsTensor* gate = gate_file->Find(ckpt->GateName(s.moe_layers[0]));
  if (gate->shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", gate->name, "' is not a matrix"));
  }
  s.n_experts = gate->shape[0];
  s.d_model = gate->shape[1];
  const std::string w1 = ckpt->ExpertName(s.moe_layers[0], 0, ExpertMatrix::kW1);
  const common::SafetensorsFile* w1_file = ckpt->FileOf(w1);
  if (w1_file == nullptr) return absl::InvalidArgumentError(absl::StrCat("missing tensor '", w1, "'"));
  const auto* w1_tensor = w1_file->Find(w1);
  if (Fused(s.naming)) {  // gate_up_proj [E, d_model, 2 d_ff]
    if (w1_tensor->shape.size() != 3 || w1_tensor->shape[0] != s.n_experts || w1_tensor->shape[1] != s.d_model ||
        w1_tensor->shape[2] % 2 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", w1, "' is not [", s.n_experts, ", ", s.d_model, ", 2 x d_ff]"));
    }
    s.d_ff = w1_tensor->shape[2] / 2;
  } else {
    if (w1_tensor->shape.size() != 2 || w1_tensor->shape[1] != s.d_model) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", w1, "' is not [d_ff, ", s.d_model, "]"));
    }
    s.d_ff = w1_tensor->shape[0];
  }
  const std::string embed_name = ckpt->EmbeddingName();
  const common::SafetensorsFile* embed_file = ckpt->FileOf(embed_name);
  if (embed_file == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("missing tensor '", embed_name, "' (needed for the LUT)"));
  }
  const auto* embed = embed_file->Find(embed_name);
  if (embed->shape.size() != 2 || embed->shape[1] != s.d_model) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", embed_name, "' is not [vocab, ", s.d_model, "]"));
  }
  s.vocab_size = embed->shape[0];

  // Sizes a model directory can hold (common/manifest.h).
  for (const auto& [what, value, limit] :
       {std::tuple{"n_experts", s.n_experts, common::kMaxExperts}, std::tuple{"d_model", s.d_model, common::kMaxDim},
        std::tuple{"d_ff", s.d_ff, common::kMaxDim}, std::tuple{"vocab_size", s.vocab_size, common::kMaxVocab},
        std::tuple{"MoE layers", static_cast<int64_t>(s.moe_layers.size()), common::kMaxLayers}}) {
    if (value < 1 || value > limit) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, ": ", what, " = ", value, " is outside [1, ", limit, "] (from the tensors' shapes)"));
    }
  }
  // config.json must agree with the tensors where it speaks.
  auto check = [&](const char* key, int64_t actual) -> absl::Status {
    if (config.contains(key) && config[key].is_number_integer() && config[key].get<int64_t>() != actual) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, "/config.json: ", key, " = ", config[key].get<int64_t>(), " but the tensors say ", actual));
    }
    return absl::OkStatus();
  };
  COLIBRI_RETURN_IF_ERROR(check("hidden_size", s.d_model));
  COLIBRI_RETURN_IF_ERROR(check("vocab_size", s.vocab_size));
  COLIBRI_RETURN_IF_ERROR(check(config.contains("num_local_experts")  ? "num_local_experts"
                                : config.contains("n_routed_experts") ? "n_routed_experts"
                                                                      : "num_experts",
                                s.n_experts));
  // Families with dense layers too (Qwen2-MoE, Qwen3-MoE) give the experts'
  // width as moe_intermediate_size; intermediate_size is then the dense MLPs'.
  COLIBRI_RETURN_IF_ERROR(
      check(config.contains("moe_intermediate_size") ? "moe_intermediate_size" : "intermediate_size", s.d_ff));
  COLIBRI_RETURN_IF_ERROR(CheckSparseLayers(config, dir, s.moe_layers));

  // The shared expert (Qwen2-MoE: mlp.shared_expert, gated; DeepSeek:
  // mlp.shared_experts, one MLP for all of them), sized by its tensors;
  // config.json must agree.
  std::string shared;
  if (s.naming == Naming::kLlama4) {  // Llama4TextMoe always has its (ungated) shared expert
    s.shared_prefix = "shared_expert";
    shared = ckpt->ExpertName(s.moe_layers[0], s.n_experts, ExpertMatrix::kW1);
    const common::SafetensorsFile* f = ckpt->FileOf(shared);
    if (f == nullptr) return absl::InvalidArgumentError(absl::StrCat("missing tensor '", shared, "'"));
    const common::SafetensorsTensor* t = f->Find(shared);
    if (t->shape.size() != 2 || t->shape[1] != s.d_model || t->shape[0] < 1 || t->shape[0] > common::kMaxDim) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", shared, "' is not [d_ff, ", s.d_model, "]"));
    }
    s.n_shared_experts = 1;
    s.shared_d_ff = t->shape[0];
  }
  // Of the families named like Qwen, Qwen2-MoE has a shared expert with a
  // sigmoid gate and DeepSeek ungated shared experts; Qwen3-MoE and OLMoE
  // have none, and their modeling code ignores such tensors, as this does.
  const bool deepseek_type = s.model_type == "deepseek_v2" || IsDeepseekV3(config);
  if (s.naming == Naming::kQwenMoe && (s.model_type == "qwen2_moe" || deepseek_type)) {
    s.shared_prefix = deepseek_type ? "shared_experts" : "shared_expert";
    shared = ckpt->ExpertName(s.moe_layers[0], s.n_experts, ExpertMatrix::kW1);
    if (const common::SafetensorsFile* f = ckpt->FileOf(shared); f != nullptr) {
      const common::SafetensorsTensor* t = f->Find(shared);
      if (t->shape.size() != 2 || t->shape[1] != s.d_model || t->shape[0] < 1 || t->shape[0] > common::kMaxDim) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", shared, "' is not [d_ff, ", s.d_model, "]"));
      }
      s.n_shared_experts = 1;
      s.shared_d_ff = t->shape[0];
      s.shared_gate = !deepseek_type;
      if (s.shared_gate && ckpt->FileOf(ckpt->SharedGateName(s.moe_layers[0])) == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("missing tensor '", ckpt->SharedGateName(s.moe_layers[0]),
                                                       "' (Qwen2-MoE's shared expert is gated)"));
      }
    }
    if (config.contains("n_shared_experts") && config["n_shared_experts"].is_number_integer() &&
        (config["n_shared_experts"].get<int64_t>() < 0 ||
         config["n_shared_experts"].get<int64_t>() > common::kMaxExperts ||
         config["n_shared_experts"].get<int64_t>() * s.d_ff != s.shared_d_ff)) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, "/config.json: n_shared_experts = ", config["n_shared_experts"].get<int64_t>(),
                       " experts of moe_intermediate_size ", s.d_ff, " but the shared expert tensors are ",
                       s.shared_d_ff, " wide", s.shared_d_ff == 0 ? absl::StrCat(" (no '", shared, "')") : ""));
    }
    if (config.contains("shared_expert_intermediate_size") &&
        config["shared_expert_intermediate_size"].is_number_integer() &&
        config["shared_expert_intermediate_size"].get<int64_t>() != s.shared_d_ff) {
      return absl::InvalidArgumentError(absl::StrCat(
          dir,
          "/config.json: shared_expert_intermediate_size = ", config["shared_expert_intermediate_size"].get<int64_t>(),
          " but the tensors say ", s.shared_d_ff, s.shared_d_ff == 0 ? absl::StrCat(" (no '", shared, "')") : ""));
    }
  }
  if (!config.contains("num_experts_per_tok") || !config["num_experts_per_tok"].is_number_integer()) {
    return absl::InvalidArgumentError(absl::StrCat(dir, "/config.json: missing integer num_experts_per_tok"));
  }
  s.top_k = config["num_experts_per_tok"].get<int64_t>();
  if (s.top_k < 1 || s.top_k > s.n_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, "/config.json: num_experts_per_tok = ", s.top_k, " is outside [1, ", s.n_experts, "]"));
  }
  COLIBRI_ASSIGN_OR_RETURN(s.routing, RoutingOf(config, dir, s.n_experts, s.top_k));
  // Mixtral always renormalizes the top-k weights (gpt-oss's softmax over the
  // top-k logits is the same); Llama 4 never; Qwen-MoE and OLMoE say so.
  // DeepSeek-V3 renormalizes unless config.json says not (DeepseekV3Config's default).
  s.norm_topk_prob = s.naming == Naming::kMixtral || s.naming == Naming::kGptOss ||
                     (s.naming != Naming::kLlama4 && config.contains("norm_topk_prob") &&
                      config["norm_topk_prob"].is_boolean() && config["norm_topk_prob"].get<bool>()) ||
                     (IsDeepseekV3(config) && !config.contains("norm_topk_prob"));
  if (s.naming == Naming::kGptOss) {  // clamped SwiGLU with biases (GptOssExperts)
    s.expert_biases = true;
    s.activation.up_offset = 1.0;
    for (auto [key, out, fallback] : {std::tuple{"swiglu_alpha", &s.activation.alpha, kGptOssAlpha},
                                      std::tuple{"swiglu_limit", &s.activation.limit, kGptOssLimit}}) {
      *out = fallback;
      if (!config.contains(key)) continue;
      const Json& value = config[key];
      if (!value.is_number() || !(value.get<double>() > 0) || !std::isfinite(value.get<double>())) {
        return absl::InvalidArgumentError(absl::StrCat(dir, "/config.json: ", key, " must be a positive number"));
      }
      *out = value.get<double>();
    }
  }
  // Fused tensors hold every expert of a layer: check each layer's shapes
  // (and gpt-oss's biases) now, before anything is written.
  if (Fused(s.naming)) {
    for (int64_t layer : s.moe_layers) {
      for (ExpertMatrix matrix : {ExpertMatrix::kW1, ExpertMatrix::kW2}) {
        COLIBRI_RETURN_IF_ERROR(ckpt->Expert(layer, 0, matrix).status());
        if (s.expert_biases) COLIBRI_RETURN_IF_ERROR(ckpt->ExpertBias(layer, 0, matrix).status());
      }
    }
  }
  return ckpt;
}

std::string HfCheckpoint::GateName(int64_t layer) const {
  for (const GateNaming& n : kGateNamings) {
    if (n.naming == shape_.naming && shape_.layer_prefix == n.prefix) return absl::StrCat(n.prefix, layer, n.suffix);
  }
  return "";  // unreachable: Open sets a naming of the table
}

std::string HfCheckpoint::ExpertName(int64_t layer, int64_t expert, ExpertMatrix which) const {
  static const char* kMixtral[] = {"w1", "w3", "w2"};
  static const char* kQwen[] = {"gate_proj", "up_proj", "down_proj"};
  const int i = static_cast<int>(which);
  const std::string base = absl::StrCat(shape_.layer_prefix, layer);
  switch (shape_.naming) {
    case Naming::kMixtral: return absl::StrCat(base, ".block_sparse_moe.experts.", expert, ".", kMixtral[i], ".weight");
    case Naming::kGptOss:
    case Naming::kLlama4: {
      const char* block = shape_.naming == Naming::kGptOss ? ".mlp." : ".feed_forward.";
      if (expert >= shape_.n_experts) return absl::StrCat(base, block, shape_.shared_prefix, ".", kQwen[i], ".weight");
      return absl::StrCat(base, block, "experts.", which == ExpertMatrix::kW2 ? "down_proj" : "gate_up_proj");
    }
    case Naming::kQwenMoe: break;
  }
  if (expert >= shape_.n_experts) {
    return absl::StrCat(base, ".mlp.", shape_.shared_prefix, ".", kQwen[i], ".weight");
  }
  return absl::StrCat(base, ".mlp.experts.", expert, ".", kQwen[i], ".weight");
}

std::string HfCheckpoint::SharedGateName(int64_t layer) const {
  return absl::StrCat(shape_.layer_prefix, layer, ".mlp.shared_expert_gate.weight");
}

std::string HfCheckpoint::BiasName(int64_t layer) const {
  return absl::StrCat(shape_.layer_prefix, layer,
                      shape_.naming == Naming::kGptOss ? ".mlp.router.bias" : ".mlp.gate.e_score_correction_bias");
}

std::string HfCheckpoint::EmbeddingName() const {
  // "<...>model.layers." -> "<...>model.embed_tokens.weight"
  return absl::StrCat(shape_.layer_prefix.substr(0, shape_.layer_prefix.size() - std::string("layers.").size()),
                      "embed_tokens.weight");
}

absl::StatusOr<ExpertSource> HfCheckpoint::Expert(int64_t layer, int64_t expert, ExpertMatrix which) const {
  const HfModelShape& s = shape_;
  const int64_t d_ff = expert < s.n_experts ? s.d_ff : s.shared_d_ff;
  ExpertSource src;
  src.ckpt_ = this;
  src.expert_ = expert;
  src.rows_ = which == ExpertMatrix::kW2 ? s.d_model : d_ff;
  src.cols_ = which == ExpertMatrix::kW2 ? d_ff : s.d_model;
  const std::string name = ExpertName(layer, expert, which);
  if (!Fused(s.naming) || expert >= s.n_experts) {
    COLIBRI_ASSIGN_OR_RETURN(src.tensor_, Matrix(name, src.rows_, src.cols_));
    src.scale_ = ScaleOf(*src.tensor_);
    return src;
  }
  // Fused: gate_up_proj [E, d_model, 2 d_ff], down_proj [E, d_ff, d_model];
  // row r of the matrix is column offset + stride·r of the expert's slice.
  const common::SafetensorsFile* file = FileOf(name);
  if (file == nullptr) return absl::InvalidArgumentError(absl::StrCat("missing tensor '", name, "'"));
  src.tensor_ = file->Find(name);
  const std::vector<int64_t> expected = {s.n_experts, src.cols_, which == ExpertMatrix::kW2 ? s.d_model : 2 * d_ff};
  if ((src.tensor_->dtype != "F32" && src.tensor_->dtype != "BF16" && src.tensor_->dtype != "F16") ||
      src.tensor_->shape != expected) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' in ", file->path(), " is ", src.tensor_->dtype,
                                                   " [", absl::StrJoin(src.tensor_->shape, ", "),
                                                   "], expected F32/BF16/F16 [", absl::StrJoin(expected, ", "), "]"));
  }
  src.fused_ = true;
  const bool interleaved = s.naming == Naming::kGptOss;  // gate_up[..., ::2], [..., 1::2]; Llama 4: halves
  if (which != ExpertMatrix::kW2) {
    src.stride_ = interleaved ? 2 : 1;
    src.offset_ = which == ExpertMatrix::kW1 ? 0 : (interleaved ? 1 : d_ff);
  }
  return src;
}

absl::StatusOr<std::vector<float>> HfCheckpoint::ExpertBias(int64_t layer, int64_t expert, ExpertMatrix which) const {
  // gpt-oss: gate_up_proj_bias [E, 2 d_ff] (interleaved like the weights), down_proj_bias [E, d_model].
  const std::string name = ExpertName(layer, expert, which) + "_bias";
  const int64_t n = which == ExpertMatrix::kW2 ? shape_.d_model : shape_.d_ff;
  const int64_t width = which == ExpertMatrix::kW2 ? n : 2 * n;
  const common::SafetensorsFile* file = FileOf(name);
  if (file == nullptr) return absl::InvalidArgumentError(absl::StrCat("missing tensor '", name, "'"));
  const common::SafetensorsTensor* t = file->Find(name);
  if ((t->dtype != "F32" && t->dtype != "BF16" && t->dtype != "F16") ||
      t->shape != std::vector<int64_t>{shape_.n_experts, width}) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' in ", file->path(), " is ", t->dtype, " [",
                                                   absl::StrJoin(t->shape, ", "), "], expected F32/BF16/F16 [",
                                                   shape_.n_experts, ", ", width, "]"));
  }
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t column = which == ExpertMatrix::kW2 ? i : which == ExpertMatrix::kW1 ? 2 * i : 2 * i + 1;
    out[i] = ElementAt(*t, expert * width + column);
    if (!std::isfinite(out[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "' has a non-finite value at [", expert, ", ", column, "]"));
    }
  }
  return out;
}

std::string ExpertSource::Where(int64_t row, int64_t col) const {
  if (!fused_) return absl::StrCat("[", row, ", ", col, "]");
  return absl::StrCat("[", expert_, ", ", col, ", ", offset_ + stride_ * row, "]");
}

void ExpertSource::Rows(int64_t first, int64_t n, float* out) const {
  if (!fused_) {
    HfCheckpoint::RowsToFloat(*tensor_, first, n, out, scale_);
    ckpt_->ReleaseRows(*tensor_, first, n);
    return;
  }
  const int64_t width = tensor_->shape[2];
  const int64_t slice = expert_ * cols_ * width;
  auto gather = [&](auto decode) {  // one decode per dtype, chosen once
    for (int64_t c = 0; c < cols_; ++c) {
      const int64_t row = slice + c * width + offset_;
      for (int64_t r = 0; r < n; ++r) out[r * cols_ + c] = decode(row + stride_ * (first + r));
    }
  };
  const uint8_t* data = tensor_->data;
  auto half = [data](int64_t i) {
    uint16_t h;
    std::memcpy(&h, data + 2 * i, 2);
    return h;
  };
  if (tensor_->dtype == "F32") {
    gather([data](int64_t i) {
      float v;
      std::memcpy(&v, data + 4 * i, 4);
      return v;
    });
  } else if (tensor_->dtype == "BF16") {
    gather([&](int64_t i) { return common::Bf16ToFloat(half(i)); });
  } else {
    gather([&](int64_t i) { return common::F16ToFloat(half(i)); });
  }
  if (first + n >= rows_) ckpt_->ReleaseRows(*tensor_, expert_, 1);  // the slice is "row" expert of the tensor
}

const common::SafetensorsFile* HfCheckpoint::FileOf(const std::string& name) const {
  for (const auto& file : files_) {
    if (file->Find(name) != nullptr) return file.get();
  }
  return nullptr;
}

absl::StatusOr<const common::SafetensorsTensor*> HfCheckpoint::Matrix(const std::string& name, int64_t rows,
                                                                      int64_t cols) const {
  const common::SafetensorsFile* file = FileOf(name);
  if (file == nullptr) return absl::InvalidArgumentError(absl::StrCat("missing tensor '", name, "'"));
  const common::SafetensorsTensor* t = file->Find(name);
  if (t->dtype != "F32" && t->dtype != "BF16" && t->dtype != "F16" && t->dtype != "F8_E4M3") {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' in ", file->path(), " has dtype ", t->dtype,
                                                   "; supported: F32, BF16, F16, F8_E4M3 with block scales"));
  }
  if (t->shape != std::vector<int64_t>{rows, cols}) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' in ", file->path(), " has shape [",
                                                   absl::StrJoin(t->shape, ", "), "], expected [", rows, ", ", cols,
                                                   "]"));
  }
  if (t->dtype == "F8_E4M3") {  // DeepSeek-V3's FP8: one f32 scale per 128 x 128 block
    const std::string scale_name = name + "_scale_inv";
    const common::SafetensorsFile* scale_file = FileOf(scale_name);
    if (scale_file == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "' is F8_E4M3 but its block scales '", scale_name, "' are missing"));
    }
    const common::SafetensorsTensor* scale = scale_file->Find(scale_name);
    const std::vector<int64_t> blocks = {(rows + kFp8Block - 1) / kFp8Block, (cols + kFp8Block - 1) / kFp8Block};
    if ((scale->dtype != "F32" && scale->dtype != "BF16") || scale->shape != blocks) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", scale_name, "' is ", scale->dtype, " [",
                                                     absl::StrJoin(scale->shape, ", "), "], expected F32 [",
                                                     absl::StrJoin(blocks, ", "), "] (one scale per 128 x 128 block)"));
    }
  }
  return t;
}

const common::SafetensorsTensor* HfCheckpoint::ScaleOf(const common::SafetensorsTensor& tensor) const {
  if (tensor.dtype != "F8_E4M3") return nullptr;
  const common::SafetensorsFile* file = FileOf(tensor.name + "_scale_inv");
  return file == nullptr ? nullptr : file->Find(tensor.name + "_scale_inv");
}

absl::StatusOr<std::vector<float>> HfCheckpoint::Vector(const std::string& name, int64_t n) const {
  const common::SafetensorsFile* file = FileOf(name);
  if (file == nullptr) return absl::InvalidArgumentError(absl::StrCat("missing tensor '", name, "'"));
  const common::SafetensorsTensor* t = file->Find(name);
  if ((t->dtype != "F32" && t->dtype != "BF16" && t->dtype != "F16") || t->shape != std::vector<int64_t>{n}) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' in ", file->path(), " is ", t->dtype, " [",
                                                   absl::StrJoin(t->shape, ", "), "], expected F32/BF16/F16 [", n,
                                                   "]"));
  }
  common::SafetensorsTensor row = *t;
  row.shape = {1, n};
  std::vector<float> out(n);
  RowsToFloat(row, 0, 1, out.data());
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(out[i])) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has a non-finite value at [", i, "]"));
    }
  }
  return out;
}

void HfCheckpoint::RowsToFloat(const common::SafetensorsTensor& t, int64_t first, int64_t n, float* out,
                               const common::SafetensorsTensor* scale_inv) {
  const int64_t cols = t.shape[1];
  const int64_t count = n * cols;
  if (t.dtype == "F8_E4M3") {  // W[i][j] = e4m3(W8[i][j]) · scale_inv[i / 128][j / 128], in f32 (exact)
    const int64_t block_cols = scale_inv->shape[1];
    std::vector<float> scales(block_cols);
    int64_t scale_row = -1;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t row = first + r;
      if (row / kFp8Block != scale_row) {
        scale_row = row / kFp8Block;
        RowsToFloat(*scale_inv, scale_row, 1, scales.data());
      }
      const uint8_t* src = t.data + row * cols;
      for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = common::Fp8E4m3ToFloat(src[c]) * scales[c / kFp8Block];
    }
    return;
  }
  const uint8_t* src = t.data + first * cols * (t.dtype == "F32" ? 4 : 2);
  if (t.dtype == "F32") {
    std::memcpy(out, src, count * sizeof(float));
    return;
  }
  const bool bf16 = t.dtype == "BF16";
  for (int64_t i = 0; i < count; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, 2);
    out[i] = bf16 ? common::Bf16ToFloat(h) : common::F16ToFloat(h);
  }
}

void HfCheckpoint::ReleaseRows(const common::SafetensorsTensor& t, int64_t first, int64_t n) const {
  const uint64_t row_bytes = t.nbytes / std::max<int64_t>(1, t.shape[0]);
  for (const auto& file : files_) {
    if (file->Find(t.name) == &t) file->ReleaseRange(t.offset + first * row_bytes, n * row_bytes);
  }
}

}  // namespace tools
}  // namespace colibri
