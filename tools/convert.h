#ifndef COLIBRI_TOOLS_CONVERT_H_
#define COLIBRI_TOOLS_CONVERT_H_

// colibri-convert: Hugging Face MoE checkpoint -> Colibri model directory
// (docs/MODEL_FORMAT.md). Streams tensor by tensor: each source tensor is
// mapped, encoded in row chunks, written with its checksum computed on the
// fly, and released, so peak memory is about one tensor's f32 chunk plus the
// LUT's logits, never the checkpoint. manifest.json is written last (via a
// rename), so an interrupted conversion leaves no loadable directory.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "tools/lut_builder.h"

namespace colibri {
namespace tools {

struct ConvertOptions {
  std::string checkpoint_dir;
  std::string out_dir;
  common::DType weight_type = common::DType::kBF16;
  // Optional safetensors file of recorded hidden states: `token_ids` (I32 or
  // I64 [N]) and, per MoE layer L, `hidden_states.L` (F32/BF16/F16 [N, d_model]).
  std::string calibration_path;
  double balance_loss_weight = 0.0;
  bool overwrite = false;  // replace a model directory already at out_dir
  bool progress = true;    // a line per expert file
};

struct LayerReport {
  int64_t layer = 0;
  int64_t hf_layer = 0;
  std::string lut_source;         // "embedding" or "calibration"
  LutResult lut;                  // loads and agreement (ids/weights cleared)
  double max_weight_error = 0.0;  // max |w - stored w| over the layer's experts
  double max_abs_weight = 0.0;    // max |w| over the layer's experts
};

struct ConvertReport {
  std::vector<LayerReport> layers;
  int64_t files = 0;
  uint64_t bytes = 0;
};

// INVALID_ARGUMENT / NOT_FOUND naming the file or tensor for bad input
// (see HfCheckpoint::Open, missing tensors, shape mismatches, unsupported
// dtypes, a malformed calibration file); FAILED_PRECONDITION if out_dir
// already holds a model and !overwrite; INTERNAL with the path on I/O errors.
absl::Status ConvertCheckpoint(const ConvertOptions& options, std::ostream& log, ConvertReport* report = nullptr);

}  // namespace tools
}  // namespace colibri

#endif  // COLIBRI_TOOLS_CONVERT_H_
