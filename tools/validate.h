#ifndef COLIBRI_TOOLS_VALIDATE_H_
#define COLIBRI_TOOLS_VALIDATE_H_

// colibri-validate's logic: checks a converted model directory
// (docs/MODEL_FORMAT.md) against its manifest and reports every
// fault it finds, so a broken conversion or a damaged copy is caught before
// any node maps it.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace colibri {
namespace tools {

struct ValidationIssue {
  std::string path;     // relative to the model directory, or "manifest.json"
  std::string problem;  // one sentence, without the path
};

struct ValidationReport {
  std::vector<ValidationIssue> issues;  // empty == valid
  int64_t files_checked = 0;            // files listed in the manifest that were examined
  uint64_t bytes_checked = 0;           // bytes of those files that could be mapped

  bool ok() const { return issues.empty(); }
};

struct ValidateOptions {
  // Hash every listed file and compare with the manifest. Off, the check reads
  // only headers, scales, routing tables and float weights (still every byte
  // of f32/bf16/f16 weights).
  bool checksums = true;
};

// Checks the model directory `dir`:
//   1. manifest.json parses (common::ModelDir::Open). If it does not, that is
//      the only issue reported and nothing else is examined.
//   2. every listed file exists, has the listed size and (with
//      options.checksums) the listed checksum, its header parses, and its
//      kind/layer/expert match its role (layer_LLL/expert_EEE.bin,
//      layer_LLL/gate.bin, layer_LLL/lut.bin); a listed file with no role is
//      an "unexpected file".
//   3. expert files load (common::ModelDir::LoadExpert: sections w1/w3/w2 and
//      their .scales/.zeros with the manifest's dtype and shapes); int8/int4
//      scales are finite and >= 0, int4 zero points <= 15, f32/bf16/f16
//      weights finite.
//   4. gate: f32 [n_experts][d_model], finite. LUT: ids i32 and weights f32
//      [vocab_size][top_k]; ids in [0, n_experts) and distinct within a
//      token's row; weights finite and >= 0, and summing to 1 (within 1e-4)
//      per row when the manifest's norm_topk_prob is set.
//   5. every section offset is 4 KiB aligned ("alignment").
//   6. every file under `dir` (recursively, except manifest.json) is listed;
//      one that is not is an issue "not listed in the manifest".
// Never stops at the first fault: each file gets every problem that can be
// found in it (content checks 3 and 4 are skipped for a file that cannot be
// mapped or whose header is unusable, and for an expert file of the wrong size).
//
// Writes to `log` one line per examined file, "ok <path>" or
// "FAIL <path>: <problem>[; <problem>...]", as it goes (layer by layer), then
// a summary: model id, architecture, shape, weight type, files and bytes
// checked, time, and "VALID" or "INVALID: N problem(s)".
//
// Never aborts on bad data. Thread-compatible: `log` must not be written by
// others during the call.
ValidationReport ValidateModelDir(const std::string& dir, const ValidateOptions& options, std::ostream& log);

}  // namespace tools
}  // namespace colibri

#endif  // COLIBRI_TOOLS_VALIDATE_H_
