// colibri-reference: runs the scalar reference MoE layer on a model directory.
#include <iostream>

#include "absl/flags/flag.h"
#include "runtime/flags.h"
#include "tools/reference_run.h"

ABSL_FLAG(std::string, model, "", "Model directory (colibri-convert's output). Required.");
ABSL_FLAG(int64_t, layer, -1, "MoE layer to run; -1 runs every layer on the same inputs.");
ABSL_FLAG(std::string, routing, "lut",
          "Routing mode: lut (the converter's table, by token id) or gate "
          "(exact softmax top-k of the gate applied to the hidden state).");
ABSL_FLAG(int64_t, tokens, 8, "Number of sample tokens (random ids and N(0,1) hidden states) when no --inputs.");
ABSL_FLAG(uint64_t, seed, 1, "Seed for the sample tokens.");
ABSL_FLAG(std::string, inputs, "",
          "Optional safetensors file with token_ids (I32 [T]) and hidden_states (F32 [T, d_model]).");
ABSL_FLAG(std::string, output, "", "Optional safetensors file to write output, expert_ids and expert_weights to.");
ABSL_FLAG(bool, verify_checksums, true, "Verify each mapped file's checksum against the manifest.");
ABSL_FLAG(bool, compare_kernels, true,
          "Also run the optimized expert kernels on the same routes and print their "
          "time and relative error against the reference.");

int main(int argc, char** argv) {
  colibri::runtime::ParseFlags(
      argc, argv,
      "Runs Colibri's scalar reference MoE layer (routes + SwiGLU experts + weighted sum, in double) on a\n"
      "model directory and prints routes and timings. The oracle for every faster path.\n"
      "Example: colibri-reference --model model/ --layer 0 --routing gate --tokens 16");
  colibri::tools::ReferenceRunOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  if (options.model_dir.empty()) {
    std::cerr << "colibri-reference: --model is required (see --help)\n";
    return 2;
  }
  auto routing = colibri::common::ParseRoutingMode(absl::GetFlag(FLAGS_routing));
  if (!routing.ok() || *routing == colibri::common::RoutingMode::kClient) {
    std::cerr << "colibri-reference: --routing must be lut or gate\n";
    return 2;
  }
  options.routing = *routing;
  options.layer = absl::GetFlag(FLAGS_layer);
  options.tokens = absl::GetFlag(FLAGS_tokens);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.inputs_path = absl::GetFlag(FLAGS_inputs);
  options.output_path = absl::GetFlag(FLAGS_output);
  options.verify_checksums = absl::GetFlag(FLAGS_verify_checksums);
  options.compare_kernels = absl::GetFlag(FLAGS_compare_kernels);
  const absl::Status status = colibri::tools::RunReference(options, std::cout);
  if (!status.ok()) {
    std::cerr << "colibri-reference: " << status.message() << "\n";
    return 1;
  }
  return 0;
}
