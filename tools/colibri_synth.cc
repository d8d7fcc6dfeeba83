// colibri-synth: writes a synthetic Hugging Face MoE checkpoint (tools/synth.h).
// Flags and nothing else: flags -> SynthOptions -> WriteSyntheticCheckpoint.
// Exit codes: 0 success, 1 the write failed, 2 bad flags (Abseil itself exits
// 1 on a flag value it cannot parse, e.g. --layers=abc).

#include <chrono>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/dtype.h"
#include "runtime/flags.h"
#include "tools/synth.h"

ABSL_FLAG(std::string, out, "",
          "Required. Directory to write config.json and the *.safetensors files to; created if "
          "missing. Refused if it already holds a config.json, unless --overwrite.");
ABSL_FLAG(std::string, naming, "mixtral",
          "Tensor names and config.json layout to imitate: mixtral (block_sparse_moe, w1/w3/w2), "
          "qwen2_moe, qwen3_moe, olmoe, deepseek_v2 or deepseek_v3 (mlp, gate_proj/up_proj/down_proj), gpt_oss "
          "(mlp.router with bias, fused interleaved experts with biases) or llama4 (language_model. prefix, "
          "feed_forward.router, fused experts, shared_expert), with each family's config keys and routing.");
ABSL_FLAG(int64_t, n_group, 1, "deepseek_v2/v3: expert groups (n_group).");
ABSL_FLAG(int64_t, topk_group, 1, "deepseek_v2/v3: groups experts are chosen from (topk_group).");
ABSL_FLAG(double, routed_scaling_factor, 1.0, "deepseek_v2/v3: routed_scaling_factor.");
ABSL_FLAG(int64_t, interleave_moe_layer_step, 1, "llama4: every this-many-th decoder layer is MoE, the others dense.");
ABSL_FLAG(double, swiglu_limit, 7.0, "gpt_oss: swiglu_limit, the clamp of the experts' activation.");
ABSL_FLAG(bool, fp8, false,
          "deepseek_v3: write the expert and MLP projections in DeepSeek-V3's block FP8 (F8_E4M3 + "
          "weight_scale_inv per 128 x 128 block).");
ABSL_FLAG(int64_t, d_model, 256, "Hidden size (hidden_size).");
ABSL_FLAG(int64_t, d_ff, 512,
          "Expert intermediate size (intermediate_size; moe_intermediate_size for qwen2_moe/qwen3_moe).");
ABSL_FLAG(int64_t, layers, 2, "Number of decoder layers (num_hidden_layers), --dense_layers included.");
ABSL_FLAG(int64_t, dense_layers, 0,
          "qwen2_moe/qwen3_moe/deepseek_v2/deepseek_v3: the first N decoder layers are dense MLPs (mlp_only_layers or "
          "first_k_dense_replace, width 2 * d_ff); "
          "the converter skips them.");
ABSL_FLAG(int64_t, shared_d_ff, 0,
          "qwen2_moe: give every MoE layer a shared expert of this width with its sigmoid gate "
          "(shared_expert_intermediate_size); deepseek_v2/v3: ungated shared experts, a multiple of d_ff "
          "(n_shared_experts x d_ff); 0: none.");
ABSL_FLAG(int64_t, experts, 8, "Experts per layer.");
ABSL_FLAG(int64_t, top_k, 2, "Experts each token is routed to (num_experts_per_tok), 1..experts.");
ABSL_FLAG(int64_t, vocab, 1000, "Vocabulary size: rows of model.embed_tokens.weight.");
ABSL_FLAG(std::string, dtype, "bf16", "Weight dtype: f32, bf16 or f16.");
ABSL_FLAG(bool, norm_topk_prob, false,
          "Written to config.json for qwen2_moe and olmoe (renormalize the top-k routing "
          "weights); Mixtral always renormalizes and ignores this flag.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the weights. The same seed gives the same values whatever --shards is.");
ABSL_FLAG(int32_t, shards, 1,
          "Number of *.safetensors files, 1..layers+1. Above 1, files are named "
          "model-0000i-of-0000N.safetensors and listed in model.safetensors.index.json.");
ABSL_FLAG(bool, overwrite, false, "Replace an existing checkpoint in --out (and an existing --calibration file).");
ABSL_FLAG(std::string, calibration, "",
          "Optional path of a calibration safetensors file to write as well: token_ids and, per "
          "layer, simulated hidden states (hidden_states.L). Needs --calibration_records.");
ABSL_FLAG(int64_t, calibration_records, 0, "Number of tokens (rows) in the calibration file.");

namespace {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

int Fail(int code, const absl::Status& status) {
  std::cerr << "colibri-synth: " << status.message() << std::endl;
  return code;
}

}  // namespace

int main(int argc, char* argv[]) {
  const std::vector<char*> positional = colibri::runtime::ParseFlags(
      argc, argv,
      "Writes a synthetic Hugging Face Mixture-of-Experts checkpoint (config.json plus seeded "
      "random weights in safetensors files) so tests, demos and benchmarks need no download. "
      "Tensors are generated and streamed in chunks, so even a full-size Mixtral-8x7B layer "
      "needs little memory. Values depend only on --seed and the shapes, not on --shards.\n"
      "Example:\n"
      "  colibri-synth --out=/tmp/mixtral-1l --d_model=4096 --d_ff=14336 --layers=1 "
      "--experts=8 --vocab=32000 --dtype=bf16 --shards=2");
  if (positional.size() > 1) {
    return Fail(kExitUsage,
                absl::InvalidArgumentError(absl::StrCat("unexpected argument '", positional[1], "' (see --help)")));
  }
  colibri::tools::SynthOptions options;
  options.out_dir = absl::GetFlag(FLAGS_out);
  if (options.out_dir.empty()) {
    return Fail(kExitUsage, absl::InvalidArgumentError("--out is required (see --help)"));
  }
  const absl::StatusOr<colibri::common::DType> dtype = colibri::common::ParseWeightType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return Fail(kExitUsage, dtype.status());
  options.dtype = *dtype;
  options.overwrite = absl::GetFlag(FLAGS_overwrite);
  options.naming = absl::GetFlag(FLAGS_naming);
  options.d_model = absl::GetFlag(FLAGS_d_model);
  options.d_ff = absl::GetFlag(FLAGS_d_ff);
  options.n_layers = absl::GetFlag(FLAGS_layers);
  options.dense_layers = absl::GetFlag(FLAGS_dense_layers);
  options.shared_d_ff = absl::GetFlag(FLAGS_shared_d_ff);
  options.n_group = absl::GetFlag(FLAGS_n_group);
  options.topk_group = absl::GetFlag(FLAGS_topk_group);
  options.routed_scaling_factor = absl::GetFlag(FLAGS_routed_scaling_factor);
  options.fp8 = absl::GetFlag(FLAGS_fp8);
  options.interleave_moe_layer_step = absl::GetFlag(FLAGS_interleave_moe_layer_step);
  options.swiglu_limit = absl::GetFlag(FLAGS_swiglu_limit);
  options.n_experts = absl::GetFlag(FLAGS_experts);
  options.top_k = absl::GetFlag(FLAGS_top_k);
  options.vocab_size = absl::GetFlag(FLAGS_vocab);
  options.norm_topk_prob = absl::GetFlag(FLAGS_norm_topk_prob);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.shards = absl::GetFlag(FLAGS_shards);
  options.calibration_path = absl::GetFlag(FLAGS_calibration);
  options.calibration_records = absl::GetFlag(FLAGS_calibration_records);
  if (options.calibration_path.empty() != (options.calibration_records == 0)) {
    return Fail(kExitUsage, absl::InvalidArgumentError("--calibration and --calibration_records > 0 go together"));
  }
  // Validation rejects int8 / int4 too: a Hugging Face checkpoint holds float weights.
  if (absl::Status status = colibri::tools::ValidateSynthOptions(options); !status.ok()) {
    return Fail(kExitUsage, status);
  }

  const auto start = std::chrono::steady_clock::now();
  if (absl::Status status = colibri::tools::WriteSyntheticCheckpoint(options, std::cout); !status.ok()) {
    return Fail(kExitFailure, status);
  }
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  std::cout << absl::StrFormat(
                   "colibri-synth: wrote a %s checkpoint (layers %d, experts %d, %s) to %s in "
                   "%.1f s",
                   options.naming, options.n_layers, options.n_experts, colibri::common::DTypeName(options.dtype),
                   options.out_dir, elapsed.count())
            << std::endl;
  return 0;
}
