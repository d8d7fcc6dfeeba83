// colibri-prune: writes a model directory with only the experts that carry
// the load; see tools/prune.h and docs/TOOLS.md. Exit status: 0 written,
// 1 refused or failed (the reason on stderr), 2 usage error.

#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "runtime/flags.h"
#include "tools/prune.h"

ABSL_FLAG(std::string, model, "", "Model directory to prune. Required.");
ABSL_FLAG(std::string, out, "", "Where to write the pruned model directory. Required.");
ABSL_FLAG(bool, overwrite, false, "Replace a model directory already at --out.");
ABSL_FLAG(std::string, load, "",
          "Expert load: a saved /metrics page of the router (colibri_router_expert_tokens_total), or lines "
          "'layer expert count'.");
ABSL_FLAG(std::string, calibration, "",
          "Calibration records (colibri-convert's format: token_ids, hidden_states.L): routed through the gate "
          "for the load when --load is not given, and for the report of how routing changes.");
ABSL_FLAG(int64_t, keep_top, 0, "Keep this many routed experts per layer: the most loaded.");
ABSL_FLAG(double, min_share, 0,
          "Instead of --keep_top: keep, in every layer, as many experts as the layer with the most experts whose "
          "share of its routed slots is at least this (e.g. 0.02).");

namespace {

const colibri::runtime::OptionFlags kOptionFlags = {
    {"PruneOptions::keep_top", "--keep_top"},
    {"PruneOptions::min_share", "--min_share"},
    {"PruneOptions::load_path", "--load"},
    {"PruneOptions::calibration_path", "--calibration"},
};

}  // namespace

int main(int argc, char* argv[]) {
  colibri::runtime::ParseFlags(
      argc, argv,
      "Writes a pruned copy of a model directory: per layer, the most loaded routed experts (shared experts\n"
      "are kept), renumbered, with the gate and LUT restricted to them (docs/TOOLS.md).\n"
      "  colibri-prune --model DIR --out DIR2 (--load FILE | --calibration FILE) (--keep_top N | --min_share S)");
  colibri::tools::PruneOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  options.out_dir = absl::GetFlag(FLAGS_out);
  if (options.model_dir.empty() || options.out_dir.empty()) {
    std::cerr << "colibri-prune: --model and --out are required (see --help)\n";
    return 2;
  }
  options.overwrite = absl::GetFlag(FLAGS_overwrite);
  options.load_path = absl::GetFlag(FLAGS_load);
  options.calibration_path = absl::GetFlag(FLAGS_calibration);
  options.keep_top = absl::GetFlag(FLAGS_keep_top);
  options.min_share = absl::GetFlag(FLAGS_min_share);
  const absl::Status s = colibri::tools::PruneModel(options, std::cout);
  if (!s.ok()) {
    std::cerr << "colibri-prune: " << colibri::runtime::NameFlags(s, kOptionFlags).message() << "\n";
    return 1;
  }
  return 0;
}
