#ifndef COLIBRI_TOOLS_SYNTH_H_
#define COLIBRI_TOOLS_SYNTH_H_

// Synthetic Hugging Face MoE checkpoints: a config.json plus safetensors files
// of seeded random weights, so tests, demos and benchmarks need no download.
//
// Tensors (no attention, no lm_head: only what an MoE runtime reads):
//   model.embed_tokens.weight [vocab, d_model]   model.norm.weight [d_model]
//   model.layers.N.input_layernorm.weight [d_model]
//   mixtral:   model.layers.N.block_sparse_moe.gate.weight [n_experts, d_model]
//              model.layers.N.block_sparse_moe.experts.E.{w1,w3}.weight [d_ff, d_model]
//              model.layers.N.block_sparse_moe.experts.E.w2.weight [d_model, d_ff]
//   qwen2_moe, qwen3_moe, olmoe, deepseek_v2: the same under model.layers.N.mlp.{gate,
//              experts.E.gate_proj, experts.E.up_proj, experts.E.down_proj}.weight;
//              a dense layer (dense_layers) has model.layers.N.mlp.{gate_proj,
//              up_proj}.weight [2 d_ff, d_model] and down_proj.weight [d_model, 2 d_ff]
//   gpt_oss:   model.layers.N.mlp.router.{weight [n_experts, d_model], bias [n_experts]}
//              model.layers.N.mlp.experts.gate_up_proj [n_experts, d_model, 2 d_ff]
//              (gate and up interleaved), gate_up_proj_bias [n_experts, 2 d_ff],
//              down_proj [n_experts, d_ff, d_model], down_proj_bias [n_experts, d_model]
//   llama4:    everything under language_model. (Llama4ForConditionalGeneration);
//              language_model.model.layers.N.feed_forward.{router.weight,
//              experts.gate_up_proj (gate, then up), experts.down_proj} as gpt_oss,
//              shared_expert.{gate,up,down}_proj.weight of width d_ff; a dense
//              layer (interleave_moe_layer_step) has feed_forward.{gate,up,down}_proj
//              of width 2 d_ff
//
// Values do not depend on the shard count or on how the writer chunks rows:
// element i (row-major) of tensor NAME is SynthUniform(seed, NAME, i) times
// sqrt(3) for the embedding (unit variance), sqrt(3 / d_model) for the gate,
// w1 / w3 (gate_proj / up_proj, gate_up_proj), sqrt(3 / d_ff) for w2
// (down_proj), 0.5 for gpt-oss's biases, computed in f32 and rounded to the
// dtype (nearest even); norm weights are 1.0.
//
// Every tensor is generated and written in row chunks of at most 16 MiB, so
// memory stays bounded for any size (a full Mixtral-8x7B layer included).

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"

namespace colibri {
namespace tools {

// Upper bounds ValidateSynthOptions enforces (they keep every size far from
// 64-bit overflow and every token id inside int32).
inline constexpr int64_t kSynthMaxDim = int64_t{1} << 20;  // d_model, d_ff
inline constexpr int64_t kSynthMaxVocab = int64_t{1} << 24;
inline constexpr int64_t kSynthMaxLayers = 4096;
inline constexpr int64_t kSynthMaxExperts = 4096;
inline constexpr int64_t kSynthMaxCalibrationRecords = int64_t{1} << 24;

struct SynthOptions {
  // Created if missing (mkdir -p). Refused if it already holds a config.json,
  // unless `overwrite`.
  std::string out_dir;
  bool overwrite = false;
  // "mixtral" | "qwen2_moe" | "qwen3_moe" | "olmoe" | "deepseek_v2" | "deepseek_v3" | "gpt_oss" | "llama4"
  std::string naming = "mixtral";
  int64_t d_model = 256;
  int64_t d_ff = 512;    // each expert's (moe_intermediate_size for the Qwen namings)
  int64_t n_layers = 2;  // decoder layers (num_hidden_layers), dense ones included
  // qwen2_moe, qwen3_moe, deepseek_v2: the first `dense_layers` decoder
  // layers are dense MLPs (mlp_only_layers, or first_k_dense_replace;
  // mlp.{gate,up,down}_proj of width intermediate_size = 2 * d_ff), the rest
  // MoE. REQUIRES < n_layers.
  int64_t dense_layers = 0;
  // qwen2_moe: > 0 gives every MoE layer a shared expert of this width
  // (mlp.shared_expert.{gate,up,down}_proj, shared_expert_intermediate_size)
  // and its sigmoid gate mlp.shared_expert_gate.weight [1, d_model].
  // deepseek_v2/v3: a multiple of d_ff, written as mlp.shared_experts.*
  // (ungated) with n_shared_experts = shared_d_ff / d_ff.
  int64_t shared_d_ff = 0;
  // deepseek_v2/v3 routing: experts in n_group groups, chosen from the best
  // topk_group (V2 with n_group > 1: group_limited_greedy), weights times
  // routed_scaling_factor. deepseek_v3 also writes mlp.gate.e_score_correction_bias
  // (f32 [n_experts], SynthUniform * 0.1), sigmoid scoring and norm_topk_prob.
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  // deepseek_v3: the expert, shared expert and dense MLP projections in
  // DeepSeek-V3's block FP8 (F8_E4M3 and f32 `_scale_inv` per 128 x 128 block,
  // quantization_config fp8); the gate, bias and embedding stay in `dtype`.
  bool fp8 = false;
  // llama4: decoder layer l is MoE when (l + 1) % interleave_moe_layer_step
  // == 0, else dense (feed_forward.{gate,up,down}_proj, intermediate_size_mlp
  // = 2 * d_ff).
  int64_t interleave_moe_layer_step = 1;
  // gpt_oss: config.json's swiglu_limit (the clamp of the activation); small
  // values make tests exercise the clamp.
  double swiglu_limit = 7.0;
  int64_t n_experts = 8;
  int64_t top_k = 2;
  int64_t vocab_size = 1000;
  common::DType dtype = common::DType::kBF16;  // kF32 | kBF16 | kF16
  // Written to config.json for qwen2_moe, qwen3_moe and olmoe. Mixtral always
  // renormalizes its top-k weights and has no such field: ignored there.
  bool norm_topk_prob = false;
  uint64_t seed = 1;
  // 1: model.safetensors alone. S > 1: model-0000i-of-0000S.safetensors plus
  // model.safetensors.index.json; each shard holds a contiguous run of layers
  // (the embedding and final norm go to the first), balanced by bytes.
  int shards = 1;
  // Optional calibration file, written only if the path is non-empty and
  // calibration_records > 0 (N below). A safetensors file with
  //   token_ids        I32 [N]: token r = ((SynthBits(seed + 1,
  //                    "calib.token_ids", r) >> 32) * vocab_size) >> 32
  //   hidden_states.L  F32 [N, d_model] for each MoE layer L in [0, n_layers -
  //                    dense_layers) (the converter's numbering): element (r, j) =
  //                    embed[token r][j] (as stored, after dtype rounding) +
  //                    0.5f * SynthUniform(seed + 1, "calib.L", r * d_model + j) * sqrt(3)
  // simulating hidden states recorded at each MoE layer's input. Refused if
  // the file exists, unless `overwrite`; its parent directory is created.
  std::string calibration_path;
  int64_t calibration_records = 0;
};

// OK, or INVALID_ARGUMENT naming the first bad field and its value: empty
// out_dir, unknown naming, dense_layers outside [0, n_layers) or set for a
// naming without dense layers, shared_d_ff outside [0, kSynthMaxDim] or set
// for a naming other than qwen2_moe, a dimension outside [1, its kSynthMax*], top_k
// outside [1, n_experts], a dtype other than f32/bf16/f16, shards outside
// [1, n_layers + 1], calibration_records outside [0, kSynthMaxCalibrationRecords].
absl::Status ValidateSynthOptions(const SynthOptions& options);

// Validates `options`, then writes the tensor files, the index (if sharded),
// the calibration file (if any) and config.json last, so a directory with a
// config.json holds a complete checkpoint. An earlier run's config.json,
// model.safetensors and index in out_dir are removed first (so none shadows
// this run's files; other model-*-of-N shards are left alone). Writes one
// line per file written to `log`, plus one per tensor of 64 MiB or more.
// Errors: INVALID_ARGUMENT from validation; ALREADY_EXISTS for an existing
// config.json or calibration file without `overwrite`; otherwise a status
// carrying the OS error and naming the path. Files written before a failure
// are left in place. Thread-compatible: concurrent calls need distinct paths.
absl::Status WriteSyntheticCheckpoint(const SynthOptions& options, std::ostream& log);

// The counter-based generator behind every value: one SplitMix64 step (add
// 0x9E3779B97F4A7C15, then its 30/27/31 xor-shift-multiply finalizer) from the
// state (seed ^ FNV-1a-64(name)) + index * 0x9E3779B97F4A7C15. Pure.
uint64_t SynthBits(uint64_t seed, absl::string_view name, uint64_t index);

// The top 24 bits of SynthBits mapped onto [-1, 1) (k / 2^23 - 1, exact in f32).
float SynthUniform(uint64_t seed, absl::string_view name, uint64_t index);

}  // namespace tools
}  // namespace colibri

#endif  // COLIBRI_TOOLS_SYNTH_H_
