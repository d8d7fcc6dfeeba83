// colibri-validate: checks a converted model directory; see tools/validate.h.
// Exit status: 0 valid, 1 invalid, 2 usage error (absl itself exits 1 on an
// unknown or malformed flag, before this code runs).

#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "runtime/flags.h"
#include "tools/validate.h"

ABSL_FLAG(std::string, model, "", "Model directory to check (or give it as the only argument).");
ABSL_FLAG(bool, checksums, true, "Hash every file and compare with manifest.json (--nochecksums to skip).");

namespace {

constexpr char kUsage[] =
    "Checks a converted Colibri model directory and reports every fault found.\n"
    "\n"
    "  colibri-validate --model DIR [--nochecksums]\n"
    "  colibri-validate DIR\n"
    "\n"
    "Checks: manifest.json parses; every listed file exists with the listed size and\n"
    "checksum; headers parse and name the file's layer/expert; sections are 4 KiB\n"
    "aligned with the dtype and shape the manifest implies; weights and scales are\n"
    "finite (scales >= 0, int4 zero points <= 15); gate weights finite; LUT expert\n"
    "ids in range and distinct per token, weights finite, >= 0 and summing to 1 when\n"
    "norm_topk_prob; no file in the directory is missing from the manifest.\n"
    "Exit status: 0 valid, 1 invalid, 2 usage error.";

}  // namespace

int main(int argc, char* argv[]) {
  const std::vector<char*> args = colibri::runtime::ParseFlags(argc, argv, kUsage);
  std::string dir = absl::GetFlag(FLAGS_model);
  if (args.size() > 2 || (args.size() == 2 && !dir.empty() && dir != args[1])) {
    std::cerr << "colibri-validate: give one model directory, as --model DIR or as the argument\n";
    return 2;
  }
  if (args.size() == 2) dir = args[1];
  if (dir.empty()) {
    std::cerr << "colibri-validate: --model DIR is required\n\n" << kUsage << "\n";
    return 2;
  }
  colibri::tools::ValidateOptions options;
  options.checksums = absl::GetFlag(FLAGS_checksums);
  const colibri::tools::ValidationReport report = colibri::tools::ValidateModelDir(dir, options, std::cout);
  return report.ok() ? 0 : 1;
}
