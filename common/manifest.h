#ifndef COLIBRI_COMMON_MANIFEST_H_
#define COLIBRI_COMMON_MANIFEST_H_

// manifest.json of a model directory: the model's shape, weight type, how the
// LUT was built, and the size and checksum of every file
// (docs/MODEL_FORMAT.md). Plain data; ParseManifest validates every field.

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/routing.h"

namespace colibri {
namespace common {

// The newest format this build reads and writes. Version 2 adds shared
// experts and routing other than softmax top-k (scoring, groups, correction
// bias, scaling); version 3 the router's logit bias, the weight applied at the
// expert input, and expert biases / activations other than SwiGLU. A model is
// written as the lowest version that holds it, so older builds read it when
// they can and refuse it (never misread it) when they cannot.
inline constexpr int kManifestFormatVersion = 3;

// Limits of a model directory (they keep a hostile manifest from asking for
// absurd allocations; the converter refuses checkpoints beyond them).
inline constexpr int64_t kMaxDim = int64_t{1} << 20;  // d_model, d_ff
inline constexpr int64_t kMaxLayers = 4096;
inline constexpr int64_t kMaxExperts = 4096;
inline constexpr int64_t kMaxVocab = int64_t{1} << 24;
inline constexpr char kManifestFileName[] = "manifest.json";

struct ManifestFile {
  std::string path;  // relative to the model directory
  uint64_t size = 0;
  std::string checksum;  // "xxh3_128:<hex>"
};

// The experts' gated activation, from a = W1·x (+ b1) and b = W3·x (+ b3):
//   g = min(a, limit),  u = clamp(b, -limit, limit)
//   h = g · sigmoid(alpha · g) · (u + up_offset)
// SwiGLU (silu(a) · b) is alpha 1, no limit, up_offset 0; gpt-oss's clamped
// SwiGLU is alpha 1.702, limit 7, up_offset 1.
struct Activation {
  double alpha = 1.0;
  double limit = std::numeric_limits<double>::infinity();
  double up_offset = 0.0;

  bool plain() const { return alpha == 1.0 && limit == std::numeric_limits<double>::infinity() && up_offset == 0.0; }
  bool operator==(const Activation& o) const {
    return alpha == o.alpha && limit == o.limit && up_offset == o.up_offset;
  }
};

struct Manifest {
  int format_version = kManifestFormatVersion;  // as read; written: the lowest version that holds the model
  std::string architecture;                     // config.json's model_type: mixtral, qwen2_moe, olmoe
  int64_t d_model = 0;
  int64_t d_ff = 0;
  int64_t n_layers = 0;  // MoE layers, numbered 0..n_layers-1
  int64_t n_experts = 0;
  int64_t top_k = 0;
  bool norm_topk_prob = true;
  // Scoring, groups, correction bias and scaling of the gate (version 2's
  // "routing" object; the default is softmax top-k).
  RoutingSpec routing;
  int64_t vocab_size = 0;
  DType weight_type = DType::kBF16;
  // Shared experts: always on, for every token, after its routed experts.
  // They are experts n_experts .. total_experts() - 1 of every layer (their
  // files, shard specs and node calls work as for any expert), each
  // shared_d_ff wide; with shared_gate, shared expert s is scaled by
  // sigmoid(g_s · x) (section "shared_gate" [n_shared_experts][d_model] of the
  // gate file: Qwen2-MoE), else by 1 (DeepSeek).
  int64_t n_shared_experts = 0;
  int64_t shared_d_ff = 0;
  bool shared_gate = false;
  // Every expert's activation, and whether every routed expert's file holds
  // biases b1, b3 [d_ff] and b2 [d_model] (gpt-oss): FFN(x) = W2·h + b2.
  Activation activation;
  bool expert_biases = false;
  std::vector<int64_t> hf_layers;  // hf_layers[L] = checkpoint layer index of MoE layer L
  std::string lut_source;          // "embedding" or "calibration"
  double balance_loss_weight = 0.0;
  std::vector<ManifestFile> files;

  // nullptr if `path` is not listed.
  const ManifestFile* FindFile(const std::string& path) const;

  // Routed plus shared experts per layer.
  int64_t total_experts() const { return n_experts + n_shared_experts; }
  // The intermediate size of expert `expert` (routed: d_ff, shared: shared_d_ff).
  int64_t ExpertDff(int64_t expert) const { return expert < n_experts ? d_ff : shared_d_ff; }
};

// Relative paths of the files every model directory has.
std::string ExpertFilePath(int64_t layer, int64_t expert);  // layer_000/expert_000.bin
std::string GateFilePath(int64_t layer);                    // layer_000/gate.bin
std::string LutFilePath(int64_t layer);                     // layer_000/lut.bin

std::string ManifestToJson(const Manifest& manifest);

// The most bytes a manifest may hold (one of 15 000 files is ~2 MB).
inline constexpr int64_t kMaxManifestBytes = int64_t{64} << 20;

// INVALID_ARGUMENT naming `path` and the field for malformed JSON, a missing
// or out-of-range field, an unknown format version or weight type, an absolute
// or escaping file path, or a required file missing from the list.
absl::StatusOr<Manifest> ParseManifest(absl::string_view json, const std::string& path);

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_MANIFEST_H_
