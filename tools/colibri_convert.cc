// colibri-convert: Hugging Face MoE checkpoint -> Colibri model directory.
#include <iostream>

#include "absl/flags/flag.h"
#include "common/dtype.h"
#include "runtime/flags.h"
#include "tools/convert.h"

ABSL_FLAG(std::string, checkpoint, "", "Hugging Face checkpoint directory (config.json + *.safetensors). Required.");
ABSL_FLAG(std::string, out, "", "Model directory to write. Required.");
ABSL_FLAG(std::string, weight_type, "bf16",
          "Stored weight type: f32, bf16, f16, int8 (per-row symmetric) or "
          "int4 (groups of 64 inputs, asymmetric scale + zero point).");
ABSL_FLAG(std::string, calibration, "",
          "Optional safetensors file of recorded hidden states: 'token_ids' [N] and "
          "'hidden_states.L' [N, d_model] per MoE layer L. Tokens seen there are routed by their mean gate "
          "probabilities; others by their embedding.");
ABSL_FLAG(double, balance_loss_weight, 0.0,
          "alpha: subtract alpha*(freq_i - mean freq)^2 from over-used expert "
          "i's logit before the LUT's top-k (freq = share of routes over the vocabulary). 0 = off.");
ABSL_FLAG(bool, overwrite, false, "Replace a model directory already at --out.");
ABSL_FLAG(bool, progress, true, "Print a line per expert file written.");

int main(int argc, char** argv) {
  colibri::runtime::ParseFlags(
      argc, argv,
      "Converts a Hugging Face MoE checkpoint (Mixtral, Qwen2/Qwen3-MoE, OLMoE, DeepSeek-V2/V3, Kimi-K2,\n"
      "gpt-oss, Llama 4; f32, bf16, f16 or DeepSeek's block FP8) into a Colibri model directory: one file\n"
      "per (layer, expert), per-layer gate and routing LUT, and a manifest\n"
      "with every file's size and checksum. Streams tensor by tensor.\n"
      "Example: colibri-convert --checkpoint ckpt/ --out model/ --weight_type int4");
  colibri::tools::ConvertOptions options;
  options.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint);
  options.out_dir = absl::GetFlag(FLAGS_out);
  if (options.checkpoint_dir.empty() || options.out_dir.empty()) {
    std::cerr << "colibri-convert: --checkpoint and --out are required (see --help)\n";
    return 2;
  }
  auto type = colibri::common::ParseWeightType(absl::GetFlag(FLAGS_weight_type));
  if (!type.ok()) {
    std::cerr << "colibri-convert: --weight_type: " << type.status().message() << "\n";
    return 2;
  }
  options.weight_type = *type;
  options.calibration_path = absl::GetFlag(FLAGS_calibration);
  options.balance_loss_weight = absl::GetFlag(FLAGS_balance_loss_weight);
  options.overwrite = absl::GetFlag(FLAGS_overwrite);
  options.progress = absl::GetFlag(FLAGS_progress);
  const absl::Status status = colibri::tools::ConvertCheckpoint(options, std::cout);
  if (!status.ok()) {
    std::cerr << "colibri-convert: " << status.message() << "\n";
    return 1;
  }
  return 0;
}
