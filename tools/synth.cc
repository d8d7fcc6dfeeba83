#include "tools/synth.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace colibri {
namespace tools {
namespace {

namespace fs = std::filesystem;
using common::DType;
using common::SafetensorsWriter;
using Json = nlohmann::json;

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kChunkBytes = uint64_t{16} << 20;     // per Append (but at least one row)
constexpr uint64_t kProgressBytes = uint64_t{64} << 20;  // log each tensor at least this big
constexpr char kEmbedName[] = "model.embed_tokens.weight";
constexpr char kLlama4Prefix[] = "language_model.";  // Llama4ForConditionalGeneration's text model
constexpr float kSqrt3 = 1.7320508075688772f;

uint64_t Fnv1a64(absl::string_view text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

uint64_t Mix(uint64_t seed, uint64_t name_hash, uint64_t index) {  // SplitMix64
  uint64_t z = (seed ^ name_hash) + index * kGolden + kGolden;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

float ToUniform(uint64_t bits) { return static_cast<float>(bits >> 40) * (1.0f / 8388608.0f) - 1.0f; }

void StoreLe(uint32_t bits, size_t size, uint8_t* out) {
  for (size_t i = 0; i < size; ++i) out[i] = static_cast<uint8_t>(bits >> (8 * i));
}

// REQUIRES (for the helpers below): type is kF32, kBF16 or kF16 (validated).
struct Encoding {
  const char* safetensors;
  const char* torch;
  size_t size;
};

Encoding EncodingOf(DType type) {
  if (type == DType::kF32) return {"F32", "float32", 4};
  if (type == DType::kBF16) return {"BF16", "bfloat16", 2};
  return {"F16", "float16", 2};
}

uint32_t Encode(DType type, float value) {
  if (type == DType::kF32) return common::FloatBits(value);
  return type == DType::kBF16 ? common::FloatToBf16(value) : common::FloatToF16(value);
}

float RoundTo(DType type, float value) {
  if (type == DType::kBF16) return common::Bf16ToFloat(common::FloatToBf16(value));
  if (type == DType::kF16) return common::F16ToFloat(common::FloatToF16(value));
  return value;
}

// One tensor to stream. fill(first, count, out) writes row-major elements
// [first, first + count) as little-endian bytes at `out`; the writer always
// passes whole rows (first and count are multiples of shape.back()).
struct TensorJob {
  SafetensorsWriter::Spec spec;
  size_t element_size = 0;
  uint64_t nbytes = 0;
  int64_t group = 0;  // shard placement: 0 = embedding and final norm, L + 1 = layer L
  std::function<void(uint64_t first, uint64_t count, uint8_t* out)> fill;
};

TensorJob MakeJob(std::string name, const char* dtype, std::vector<int64_t> shape, size_t element_size, int64_t group) {
  uint64_t nbytes = element_size;
  for (int64_t d : shape) nbytes *= static_cast<uint64_t>(d);
  return {{std::move(name), dtype, std::move(shape)}, element_size, nbytes, group, nullptr};
}

// A weight: SynthUniform(seed, name, i) * scale rounded to the dtype; 1.0 everywhere if scale == 0.
TensorJob WeightJob(const SynthOptions& o, std::string name, std::vector<int64_t> shape, float scale, int64_t group) {
  const Encoding enc = EncodingOf(o.dtype);
  TensorJob job = MakeJob(name, enc.safetensors, std::move(shape), enc.size, group);
  job.fill = [type = o.dtype, seed = o.seed, hash = Fnv1a64(name), scale, size = enc.size](
                 uint64_t first, uint64_t count, uint8_t* out) {
    for (uint64_t k = 0; k < count; ++k) {
      const float v = scale == 0.0f ? 1.0f : ToUniform(Mix(seed, hash, first + k)) * scale;
      StoreLe(Encode(type, v), size, out + k * size);
    }
  };
  return job;
}

// A projection weight in DeepSeek-V3's block FP8: `name` F8_E4M3 [rows, cols]
// and `name`_scale_inv F32 [ceil(rows/128), ceil(cols/128)]. Block (i, j)'s
// scale is scale / 448 times 1, 1.25, 1.5 or 1.75 (seeded), so every value
// SynthUniform · scale fits e4m3; element = e4m3(value / block scale), rounded
// to nearest even. The dequantized weight is e4m3 · scale_inv, exactly.
void AddFp8Jobs(const SynthOptions& o, const std::string& name, int64_t rows, int64_t cols, float scale, int64_t group,
                std::vector<TensorJob>* jobs) {
  constexpr int64_t kBlock = 128;
  const int64_t block_cols = (cols + kBlock - 1) / kBlock;
  const std::string scale_name = name + "_scale_inv";
  auto block_scale = [seed = o.seed, hash = Fnv1a64(scale_name), scale, block_cols](int64_t bi, int64_t bj) {
    return scale / 448.0f * (1.0f + static_cast<float>(Mix(seed, hash, bi * block_cols + bj) >> 62) * 0.25f);
  };
  TensorJob weight = MakeJob(name, "F8_E4M3", {rows, cols}, 1, group);
  weight.fill = [seed = o.seed, hash = Fnv1a64(name), scale, cols, block_scale](uint64_t first, uint64_t count,
                                                                                uint8_t* out) {
    for (uint64_t k = 0; k < count; ++k) {
      const int64_t i = static_cast<int64_t>((first + k) / cols), j = static_cast<int64_t>((first + k) % cols);
      const float v = ToUniform(Mix(seed, hash, first + k)) * scale;
      out[k] = common::FloatToFp8E4m3(v / block_scale(i / kBlock, j / kBlock));
    }
  };
  jobs->push_back(std::move(weight));
  TensorJob scales = MakeJob(scale_name, "F32", {(rows + kBlock - 1) / kBlock, block_cols}, 4, group);
  scales.fill = [block_scale, block_cols](uint64_t first, uint64_t count, uint8_t* out) {
    for (uint64_t k = 0; k < count; ++k) {
      const int64_t bi = static_cast<int64_t>((first + k) / block_cols),
                    bj = static_cast<int64_t>((first + k) % block_cols);
      StoreLe(common::FloatBits(block_scale(bi, bj)), 4, out + 4 * k);
    }
  };
  jobs->push_back(std::move(scales));
}

// Whether decoder layer `l` is dense (an MLP, not MoE).
bool DenseLayer(const SynthOptions& o, int64_t l) {
  return o.naming == "llama4" ? (l + 1) % o.interleave_moe_layer_step != 0 : l < o.dense_layers;
}

std::vector<TensorJob> WeightJobs(const SynthOptions& o) {
  const float in_scale = static_cast<float>(std::sqrt(3.0 / static_cast<double>(o.d_model)));
  const float ff_scale = static_cast<float>(std::sqrt(3.0 / static_cast<double>(o.d_ff)));
  const bool mixtral = o.naming == "mixtral", gpt_oss = o.naming == "gpt_oss", llama4 = o.naming == "llama4";
  const std::string prefix = llama4 ? kLlama4Prefix : "";
  std::vector<TensorJob> jobs;
  auto add = [&](std::string name, std::vector<int64_t> shape, float scale, int64_t group) {
    jobs.push_back(WeightJob(o, std::move(name), std::move(shape), scale, group));
  };
  // Expert, shared expert and dense MLP projections: FP8 with block scales when o.fp8.
  auto add_projection = [&](std::string name, std::vector<int64_t> shape, float scale, int64_t group) {
    if (o.fp8) {
      AddFp8Jobs(o, name, shape[0], shape[1], scale, group, &jobs);
    } else {
      add(std::move(name), std::move(shape), scale, group);
    }
  };
  add(prefix + kEmbedName, {o.vocab_size, o.d_model}, kSqrt3, 0);
  add(prefix + "model.norm.weight", {o.d_model}, 0.0f, 0);
  for (int64_t l = 0, g = 1; l < o.n_layers; ++l, ++g) {
    const std::string layer = absl::StrCat(prefix, "model.layers.", l, ".");
    const std::string block = layer + (mixtral ? "block_sparse_moe." : llama4 ? "feed_forward." : "mlp.");
    add(layer + "input_layernorm.weight", {o.d_model}, 0.0f, g);
    if (DenseLayer(o, l)) {  // a dense MLP: not part of any MoE layer
      const int64_t width = 2 * o.d_ff;
      add_projection(block + "gate_proj.weight", {width, o.d_model}, in_scale, g);
      add_projection(block + "up_proj.weight", {width, o.d_model}, in_scale, g);
      add_projection(block + "down_proj.weight", {o.d_model, width}, ff_scale, g);
      continue;
    }
    if (gpt_oss ||
        llama4) {  // a router and fused experts: gate_up_proj [E, d_model, 2 d_ff], down_proj [E, d_ff, d_model]
      add(block + "router.weight", {o.n_experts, o.d_model}, in_scale, g);
      add(block + "experts.gate_up_proj", {o.n_experts, o.d_model, 2 * o.d_ff}, in_scale, g);
      add(block + "experts.down_proj", {o.n_experts, o.d_ff, o.d_model}, ff_scale, g);
      if (gpt_oss) {  // biases of the router and of every projection
        add(block + "router.bias", {o.n_experts}, 0.5f, g);
        add(block + "experts.gate_up_proj_bias", {o.n_experts, 2 * o.d_ff}, 0.5f, g);
        add(block + "experts.down_proj_bias", {o.n_experts, o.d_model}, 0.5f, g);
      } else {  // Llama 4's shared expert, as wide as the routed ones
        add(block + "shared_expert.gate_proj.weight", {o.d_ff, o.d_model}, in_scale, g);
        add(block + "shared_expert.up_proj.weight", {o.d_ff, o.d_model}, in_scale, g);
        add(block + "shared_expert.down_proj.weight", {o.d_model, o.d_ff}, ff_scale, g);
      }
      continue;
    }
    add(block + "gate.weight", {o.n_experts, o.d_model}, in_scale, g);
    if (o.naming == "deepseek_v3") {  // the correction bias is stored in f32, whatever the weights' dtype
      SynthOptions f32 = o;
      f32.dtype = DType::kF32;
      jobs.push_back(WeightJob(f32, block + "gate.e_score_correction_bias", {o.n_experts}, 0.1f, g));
    }
    if (o.shared_d_ff > 0) {  // Qwen2-MoE: shared_expert with its gate; DeepSeek: shared_experts, ungated
      const float shared_scale = static_cast<float>(std::sqrt(3.0 / static_cast<double>(o.shared_d_ff)));
      const std::string shared = block + (o.naming == "qwen2_moe" ? "shared_expert." : "shared_experts.");
      add_projection(shared + "gate_proj.weight", {o.shared_d_ff, o.d_model}, in_scale, g);
      add_projection(shared + "up_proj.weight", {o.shared_d_ff, o.d_model}, in_scale, g);
      add_projection(shared + "down_proj.weight", {o.d_model, o.shared_d_ff}, shared_scale, g);
      if (o.naming == "qwen2_moe") add(block + "shared_expert_gate.weight", {1, o.d_model}, in_scale, g);
    }
    for (int64_t e = 0; e < o.n_experts; ++e) {
      const std::string ex = absl::StrCat(block, "experts.", e, ".");
      add_projection(ex + (mixtral ? "w1.weight" : "gate_proj.weight"), {o.d_ff, o.d_model}, in_scale, g);
      add_projection(ex + (mixtral ? "w3.weight" : "up_proj.weight"), {o.d_ff, o.d_model}, in_scale, g);
      add_projection(ex + (mixtral ? "w2.weight" : "down_proj.weight"), {o.d_model, o.d_ff}, ff_scale, g);
    }
  }
  return jobs;
}

// The calibration file's tensors, as documented on SynthOptions.
std::vector<TensorJob> CalibrationJobs(const SynthOptions& o) {
  const uint64_t d = static_cast<uint64_t>(o.d_model);
  const uint64_t vocab = static_cast<uint64_t>(o.vocab_size), seed = o.seed;
  const DType type = o.dtype;
  const uint64_t token_hash = Fnv1a64("calib.token_ids");
  const uint64_t embed_hash = Fnv1a64((o.naming == "llama4" ? kLlama4Prefix : "") + std::string(kEmbedName));
  auto token = [=](uint64_t r) { return ((Mix(seed + 1, token_hash, r) >> 32) * vocab) >> 32; };
  std::vector<TensorJob> jobs;
  jobs.push_back(MakeJob("token_ids", "I32", {o.calibration_records}, 4, 0));
  jobs.back().fill = [=](uint64_t first, uint64_t count, uint8_t* out) {
    for (uint64_t k = 0; k < count; ++k) {
      StoreLe(static_cast<uint32_t>(token(first + k)), 4, out + 4 * k);
    }
  };
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < o.n_layers; ++l) moe_layers += DenseLayer(o, l) ? 0 : 1;
  for (int64_t l = 0; l < moe_layers; ++l) {
    jobs.push_back(MakeJob(absl::StrCat("hidden_states.", l), "F32", {o.calibration_records, o.d_model}, 4, 0));
    jobs.back().fill = [=, noise_hash = Fnv1a64(absl::StrCat("calib.", l))](uint64_t first, uint64_t count,
                                                                            uint8_t* out) {
      for (uint64_t r = first / d; r < (first + count) / d; ++r) {
        const uint64_t embed_row = token(r) * d;
        for (uint64_t j = 0; j < d; ++j) {
          const float embed = RoundTo(type, ToUniform(Mix(seed, embed_hash, embed_row + j)) * kSqrt3);
          const float noise = ToUniform(Mix(seed + 1, noise_hash, r * d + j)) * kSqrt3;
          StoreLe(common::FloatBits(embed + 0.5f * noise), 4, out + 4 * (r * d + j - first));
        }
      }
    };
  }
  return jobs;
}

// Shard of each group: contiguous runs, none empty, each closed at the group
// boundary nearest to its equal share of the bytes.
std::vector<int> AssignShards(const std::vector<TensorJob>& jobs, int64_t groups, int shards) {
  std::vector<double> bytes(groups, 0.0);
  double total = 0.0;
  for (const TensorJob& job : jobs) {
    bytes[job.group] += static_cast<double>(job.nbytes);
    total += static_cast<double>(job.nbytes);
  }
  std::vector<int> shard_of(groups);
  int s = 0;
  double done = 0.0;
  for (int64_t g = 0; g < groups; ++g) {
    shard_of[g] = s;
    done += bytes[g];
    if (s == shards - 1 || g + 1 == groups) continue;
    const double target = total * (s + 1) / shards;
    const bool must = groups - g - 1 == shards - s - 1;  // one group left per shard
    if (must || target - done <= done + bytes[g + 1] - target) ++s;
  }
  return shard_of;
}

std::string Mib(uint64_t bytes) { return absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1 << 20)); }

// Streams `jobs` into a new safetensors file at `path`, whole rows at a time,
// at most kChunkBytes (or one row) per Append.
absl::Status WriteTensorFile(const std::string& path, const std::vector<const TensorJob*>& jobs, std::ostream& log) {
  std::vector<SafetensorsWriter::Spec> specs;
  uint64_t file_bytes = 0;
  for (const TensorJob* job : jobs) {
    specs.push_back(job->spec);
    file_bytes += job->nbytes;
  }
  COLIBRI_ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::Create(path, std::move(specs), {{"format", "pt"}}));
  std::vector<uint8_t> buffer;
  uint64_t written = 0;
  for (const TensorJob* job : jobs) {
    const uint64_t numel = job->nbytes / job->element_size;
    const uint64_t row = static_cast<uint64_t>(job->spec.shape.back());
    const uint64_t chunk = row * std::max<uint64_t>(1, kChunkBytes / (row * job->element_size));
    for (uint64_t first = 0; first < numel; first += chunk) {
      const uint64_t count = std::min(chunk, numel - first);
      buffer.resize(count * job->element_size);
      job->fill(first, count, buffer.data());
      COLIBRI_RETURN_IF_ERROR(writer->Append(buffer.data(), buffer.size()));
    }
    written += job->nbytes;
    if (job->nbytes >= kProgressBytes) {
      log << absl::StrFormat("  %s (%s): %.0f%% of %s", job->spec.name, Mib(job->nbytes), 100.0 * written / file_bytes,
                             path)
          << std::endl;
    }
  }
  COLIBRI_RETURN_IF_ERROR(writer->Close());
  log << "wrote " << path << " (" << jobs.size() << " tensors, " << Mib(file_bytes) << ")" << std::endl;
  return absl::OkStatus();
}

Json ConfigJson(const SynthOptions& o) {
  Json c = {{"model_type", o.naming},
            {"hidden_size", o.d_model},
            {"intermediate_size", o.d_ff},
            {"num_hidden_layers", o.n_layers},
            {"num_experts_per_tok", o.top_k},
            {"vocab_size", o.vocab_size},
            {"torch_dtype", EncodingOf(o.dtype).torch}};
  if (o.naming == "mixtral") {
    c["architectures"] = Json::array({"MixtralForCausalLM"});
    c["num_local_experts"] = o.n_experts;
    return c;
  }
  if (o.naming == "gpt_oss") {
    c["architectures"] = Json::array({"GptOssForCausalLM"});
    c["num_local_experts"] = o.n_experts;
    c["swiglu_limit"] = o.swiglu_limit;
    return c;
  }
  if (o.naming == "llama4") {  // Llama4ForConditionalGeneration: the text model's keys in text_config
    c["model_type"] = "llama4_text";
    c["num_local_experts"] = o.n_experts;
    c["intermediate_size_mlp"] = 2 * o.d_ff;  // the dense layers' MLP width
    c["interleave_moe_layer_step"] = o.interleave_moe_layer_step;
    c["hidden_act"] = "silu";
    return {{"model_type", "llama4"},
            {"architectures", Json::array({"Llama4ForConditionalGeneration"})},
            {"torch_dtype", c["torch_dtype"]},
            {"text_config", c}};
  }
  if (o.naming == "deepseek_v2" || o.naming == "deepseek_v3") {
    const bool v3 = o.naming == "deepseek_v3";
    c["architectures"] = Json::array({v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM"});
    c["intermediate_size"] = 2 * o.d_ff;  // the dense layers' MLP width
    c["moe_intermediate_size"] = o.d_ff;
    c["n_routed_experts"] = o.n_experts;
    c["n_shared_experts"] = o.shared_d_ff / o.d_ff;
    c["first_k_dense_replace"] = o.dense_layers;
    c["moe_layer_freq"] = 1;
    // V2: softmax, greedy or group-limited (group score = max), never renormalized;
    // V3: sigmoid, correction bias, groups by the sum of their top two (noaux_tc).
    c["topk_method"] = v3 ? "noaux_tc" : o.n_group > 1 ? "group_limited_greedy" : "greedy";
    c["n_group"] = o.n_group;
    c["topk_group"] = o.topk_group;
    c["scoring_func"] = v3 ? "sigmoid" : "softmax";
    c["norm_topk_prob"] = v3 && o.norm_topk_prob;
    c["routed_scaling_factor"] = o.routed_scaling_factor;
    if (o.fp8) {
      c["quantization_config"] = {{"activation_scheme", "dynamic"},
                                  {"fmt", "e4m3"},
                                  {"quant_method", "fp8"},
                                  {"weight_block_size", Json::array({128, 128})}};
    }
    return c;
  }
  c["num_experts"] = o.n_experts;
  c["norm_topk_prob"] = o.norm_topk_prob;
  if (o.naming == "olmoe") {
    c["architectures"] = Json::array({"OlmoeForCausalLM"});
    return c;
  }
  c["architectures"] = Json::array({o.naming == "qwen3_moe" ? "Qwen3MoeForCausalLM" : "Qwen2MoeForCausalLM"});
  c["intermediate_size"] = 2 * o.d_ff;  // the dense layers' MLP width
  c["moe_intermediate_size"] = o.d_ff;
  c["decoder_sparse_step"] = 1;
  c["mlp_only_layers"] = Json::array();
  for (int64_t l = 0; l < o.dense_layers; ++l) c["mlp_only_layers"].push_back(l);
  if (o.naming == "qwen2_moe") c["shared_expert_intermediate_size"] = o.shared_d_ff;
  return c;
}

absl::Status OsError(const std::error_code& ec, absl::string_view what, const fs::path& path) {
  return absl::ErrnoToStatus(ec.value(), absl::StrCat(what, " ", path.string()));
}

absl::Status MakeDirs(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);  // ENOTDIR if `dir` is a file
  return ec ? OsError(ec, "cannot create directory", dir) : absl::OkStatus();
}

absl::Status RefuseExisting(const fs::path& path, bool overwrite, const char* what) {
  std::error_code ec;
  const bool exists = fs::exists(path, ec);
  if (ec) return OsError(ec, "cannot stat", path);
  if (!exists || overwrite) return absl::OkStatus();
  return absl::AlreadyExistsError(
      absl::StrCat(path.string(), " already exists (", what, "); set overwrite to replace it"));
}

// Removes the files a loader looks for first, so a stale one never shadows
// this run's (a previous run's unreferenced model-*-of-N shards may remain).
absl::Status RemoveCheckpointFiles(const fs::path& dir) {
  for (const char* name : {"config.json", "model.safetensors", "model.safetensors.index.json"}) {
    std::error_code ec;
    if (!fs::remove(dir / name, ec) && ec) return OsError(ec, "cannot remove", dir / name);
  }
  return absl::OkStatus();
}

absl::Status WriteTextFile(const std::string& path, const std::string& text, std::ostream& log) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return absl::ErrnoToStatus(errno, absl::StrCat("cannot create ", path));
  const bool wrote = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int write_errno = errno;
  if (std::fclose(f) != 0 || !wrote) {
    return absl::ErrnoToStatus(wrote ? errno : write_errno, absl::StrCat("cannot write ", path));
  }
  log << "wrote " << path << " (" << text.size() << " bytes)" << std::endl;
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateSynthOptions(const SynthOptions& o) {
  if (o.out_dir.empty()) return absl::InvalidArgumentError("out_dir is empty");
  const bool deepseek = o.naming == "deepseek_v2" || o.naming == "deepseek_v3";
  const bool with_dense = o.naming == "qwen2_moe" || o.naming == "qwen3_moe" || deepseek;
  if (o.naming != "mixtral" && o.naming != "olmoe" && o.naming != "gpt_oss" && o.naming != "llama4" && !with_dense) {
    return absl::InvalidArgumentError(absl::StrCat("naming = '", o.naming,
                                                   "': expected mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, "
                                                   "deepseek_v3, gpt_oss or llama4"));
  }
  if (o.interleave_moe_layer_step != 1 &&
      (o.naming != "llama4" || o.interleave_moe_layer_step < 1 || o.interleave_moe_layer_step > o.n_layers)) {
    return absl::InvalidArgumentError(absl::StrCat("interleave_moe_layer_step = ", o.interleave_moe_layer_step,
                                                   ": expected 1, or for llama4 a value in [1, n_layers]"));
  }
  if (o.swiglu_limit != 7.0 && (o.naming != "gpt_oss" || !(o.swiglu_limit > 0) || !std::isfinite(o.swiglu_limit))) {
    return absl::InvalidArgumentError(
        absl::StrCat("swiglu_limit = ", o.swiglu_limit, ": expected 7, or for gpt_oss a positive number"));
  }
  if (o.dense_layers != 0 && (!with_dense || o.dense_layers < 0 || o.dense_layers >= o.n_layers)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dense_layers = ", o.dense_layers,
        ": expected 0, or for qwen2_moe/qwen3_moe/deepseek_v2/v3 a value in [0, n_layers = ", o.n_layers, ")"));
  }
  const bool shared_ok = o.naming == "qwen2_moe" || (deepseek && o.d_ff > 0 && o.shared_d_ff % o.d_ff == 0);
  if (o.shared_d_ff != 0 && (!shared_ok || o.shared_d_ff < 0 || o.shared_d_ff > kSynthMaxDim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared_d_ff = ", o.shared_d_ff, ": expected 0, or for qwen2_moe a value in [1, ", kSynthMaxDim,
                     "], for deepseek_v2/v3 a multiple of d_ff (n_shared_experts x moe_intermediate_size)"));
  }
  const bool groups_ok = deepseek && o.n_group >= 1 && o.n_experts % o.n_group == 0 && o.topk_group >= 1 &&
                         o.topk_group <= o.n_group && o.top_k <= o.topk_group * (o.n_experts / o.n_group);
  if ((o.n_group != 1 || o.topk_group != 1) && !groups_ok) {
    return absl::InvalidArgumentError(absl::StrCat("n_group = ", o.n_group, ", topk_group = ", o.topk_group,
                                                   ": expected 1 and 1, or for deepseek_v2/v3 groups that divide the ",
                                                   "experts and keep at least top_k"));
  }
  if (o.fp8 && o.naming != "deepseek_v3") {
    return absl::InvalidArgumentError("fp8: block FP8 weights are written for deepseek_v3 only");
  }
  if (o.routed_scaling_factor != 1.0 &&
      (!deepseek || !(o.routed_scaling_factor > 0) || !std::isfinite(o.routed_scaling_factor))) {
    return absl::InvalidArgumentError(absl::StrCat("routed_scaling_factor = ", o.routed_scaling_factor,
                                                   ": expected 1, or for deepseek_v2/v3 a positive number"));
  }
  struct Range {
    const char* field;
    int64_t value, low, high;
  };
  // In this order, so top_k and shards are checked against valid bounds.
  for (const Range& r :
       {Range{"d_model", o.d_model, 1, kSynthMaxDim}, Range{"d_ff", o.d_ff, 1, kSynthMaxDim},
        Range{"n_layers", o.n_layers, 1, kSynthMaxLayers}, Range{"n_experts", o.n_experts, 1, kSynthMaxExperts},
        Range{"top_k", o.top_k, 1, o.n_experts}, Range{"vocab_size", o.vocab_size, 1, kSynthMaxVocab},
        Range{"shards", o.shards, 1, o.n_layers + 1},
        Range{"calibration_records", o.calibration_records, 0, kSynthMaxCalibrationRecords}}) {
    if (r.value < r.low || r.value > r.high) {
      return absl::InvalidArgumentError(
          absl::StrCat(r.field, " = ", r.value, ": expected a value in [", r.low, ", ", r.high, "]"));
    }
  }
  if (o.dtype != DType::kF32 && o.dtype != DType::kBF16 && o.dtype != DType::kF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype = ", common::DTypeName(o.dtype), ": expected f32, bf16 or f16"));
  }
  return absl::OkStatus();
}

absl::Status WriteSyntheticCheckpoint(const SynthOptions& o, std::ostream& log) {
  COLIBRI_RETURN_IF_ERROR(ValidateSynthOptions(o));
  const fs::path dir(o.out_dir);
  COLIBRI_RETURN_IF_ERROR(MakeDirs(dir));
  COLIBRI_RETURN_IF_ERROR(RefuseExisting(dir / "config.json", o.overwrite, "a checkpoint"));
  const bool calibrate = !o.calibration_path.empty() && o.calibration_records > 0;
  const fs::path calibration(o.calibration_path);
  if (calibrate) {
    COLIBRI_RETURN_IF_ERROR(RefuseExisting(calibration, o.overwrite, "a calibration file"));
    if (calibration.has_parent_path()) {
      COLIBRI_RETURN_IF_ERROR(MakeDirs(calibration.parent_path()));
    }
  }
  COLIBRI_RETURN_IF_ERROR(RemoveCheckpointFiles(dir));

  const std::vector<TensorJob> jobs = WeightJobs(o);
  const std::vector<int> shard_of = AssignShards(jobs, o.n_layers + 1, o.shards);
  std::vector<std::vector<const TensorJob*>> per_shard(o.shards);
  for (const TensorJob& job : jobs) per_shard[shard_of[job.group]].push_back(&job);
  Json weight_map = Json::object();
  uint64_t total_size = 0;
  for (int s = 0; s < o.shards; ++s) {
    const std::string file = o.shards == 1 ? std::string("model.safetensors")
                                           : absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, o.shards);
    COLIBRI_RETURN_IF_ERROR(WriteTensorFile((dir / file).string(), per_shard[s], log));
    for (const TensorJob* job : per_shard[s]) {
      weight_map[job->spec.name] = file;
      total_size += job->nbytes;
    }
  }
  if (o.shards > 1) {
    const Json index = {{"metadata", {{"total_size", total_size}}}, {"weight_map", weight_map}};
    COLIBRI_RETURN_IF_ERROR(WriteTextFile((dir / "model.safetensors.index.json").string(), index.dump(2) + "\n", log));
  }
  if (calibrate) {
    const std::vector<TensorJob> calibration_jobs = CalibrationJobs(o);
    std::vector<const TensorJob*> all;
    for (const TensorJob& job : calibration_jobs) all.push_back(&job);
    COLIBRI_RETURN_IF_ERROR(WriteTensorFile(calibration.string(), all, log));
  }
  return WriteTextFile((dir / "config.json").string(), ConfigJson(o).dump(2) + "\n", log);
}

uint64_t SynthBits(uint64_t seed, absl::string_view name, uint64_t index) { return Mix(seed, Fnv1a64(name), index); }

float SynthUniform(uint64_t seed, absl::string_view name, uint64_t index) {
  return ToUniform(SynthBits(seed, name, index));
}

}  // namespace tools
}  // namespace colibri
