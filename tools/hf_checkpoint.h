#ifndef COLIBRI_TOOLS_HF_CHECKPOINT_H_
#define COLIBRI_TOOLS_HF_CHECKPOINT_H_

// A Hugging Face MoE checkpoint on disk: config.json plus one
// model.safetensors or several shards listed in model.safetensors.index.json.
// Reads four namings (docs/MODEL_FAMILIES.md):
//   Mixtral   model.layers.N.block_sparse_moe.{gate, experts.E.w1,w2,w3}.weight
//   mlp       model.layers.N.mlp.{gate, experts.E.gate_proj,up_proj,down_proj}.weight
//             (Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, Kimi-K2)
//   gpt-oss   model.layers.N.mlp.{router.weight, router.bias,
//             experts.gate_up_proj [E,H,2I] (gate and up interleaved), _bias,
//             experts.down_proj [E,I,H], _bias}
//   Llama 4   [language_model.]model.layers.N.feed_forward.{router.weight,
//             experts.gate_up_proj [E,H,2I] (gate, then up), experts.down_proj
//             [E,I,H], shared_expert.*}
// MoE layers are the layers that have a gate (router) tensor; the shape is
// taken from the tensors and checked against config.json (moe_intermediate_size
// where present; the MoE layers that decoder_sparse_step / mlp_only_layers,
// first_k_dense_replace / moe_layer_freq or moe_layers /
// interleave_moe_layer_step describe). Shards are mapped, not read: tensors are
// converted a chunk at a time and released, so memory stays near one chunk.
// Immutable after Open; thread-compatible.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/manifest.h"
#include "common/routing.h"
#include "common/safetensors.h"

namespace colibri {
namespace tools {

enum class Naming { kMixtral, kQwenMoe, kGptOss, kLlama4 };

struct HfModelShape {
  std::string model_type;  // config.json's, e.g. mixtral, qwen2_moe, qwen3_moe, olmoe
  Naming naming = Naming::kMixtral;
  std::string layer_prefix = "model.layers.";  // "language_model.model.layers." in Llama 4's multimodal checkpoints
  int64_t d_model = 0;
  int64_t d_ff = 0;
  int64_t n_experts = 0;
  // The shared expert, at most one per layer, expert index n_experts:
  // Qwen2-MoE's model.layers.N.mlp.shared_expert.* (width
  // shared_expert_intermediate_size), gated by mlp.shared_expert_gate, or
  // DeepSeek's ungated mlp.shared_experts.* (width n_shared_experts x
  // moe_intermediate_size, one MLP).
  std::string shared_prefix = "shared_expert";  // the tensors' name under mlp.
  int64_t n_shared_experts = 0;
  int64_t shared_d_ff = 0;
  bool shared_gate = false;
  int64_t top_k = 0;
  bool norm_topk_prob = true;
  common::RoutingSpec routing;    // DeepSeek's, gpt-oss's and Llama 4's routing; else softmax top-k
  common::Activation activation;  // gpt-oss's clamped SwiGLU; else SwiGLU
  bool expert_biases = false;     // gpt-oss: gate_up_proj_bias and down_proj_bias
  int64_t vocab_size = 0;
  std::vector<int64_t> moe_layers;  // checkpoint layer indices with a gate, ascending
};

// Which matrix of an expert.
enum class ExpertMatrix { kW1, kW3, kW2 };

class HfCheckpoint;

// One expert matrix in Colibri's [out][in] layout (W1, W3: [d_ff][d_model];
// W2: [d_model][d_ff]), read from its own tensor or from the expert's slice
// of a fused [E, in, out'] tensor (transposed, with gate and up picked out).
class ExpertSource {
 public:
  const std::string& name() const { return tensor_->name; }  // the checkpoint tensor
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  // Rows [first, first + n) as f32 ([n][cols]), then released from memory.
  void Rows(int64_t first, int64_t n, float* out) const;
  // The checkpoint tensor's index of element (row, col) of the matrix, as
  // "[i, j]" or, in a fused tensor, "[expert, i, j]" (for error messages).
  std::string Where(int64_t row, int64_t col) const;

 private:
  friend class HfCheckpoint;
  const HfCheckpoint* ckpt_ = nullptr;
  const common::SafetensorsTensor* tensor_ = nullptr;
  const common::SafetensorsTensor* scale_ = nullptr;  // F8_E4M3 block scales
  bool fused_ = false;
  int64_t expert_ = 0, rows_ = 0, cols_ = 0;
  int64_t offset_ = 0, stride_ = 1;  // fused: row r is column offset_ + stride_ * r of the slice
};

class HfCheckpoint {
 public:
  // INVALID_ARGUMENT / NOT_FOUND naming the file for a missing or malformed
  // config, index or shard, a shard the index names that does not exist, no
  // gate tensors, or config values that contradict the tensors.
  static absl::StatusOr<std::unique_ptr<HfCheckpoint>> Open(const std::string& dir);

  const HfModelShape& shape() const { return shape_; }

  std::string GateName(int64_t hf_layer) const;
  // expert >= n_experts names the shared expert's tensors; for fused experts
  // the layer's fused tensor (gate_up_proj for W1 and W3).
  std::string ExpertName(int64_t hf_layer, int64_t expert, ExpertMatrix which) const;
  std::string SharedGateName(int64_t hf_layer) const;
  // The gate's per-expert bias, [n_experts]: DeepSeek-V3's correction bias
  // or gpt-oss's router bias.
  std::string BiasName(int64_t hf_layer) const;
  std::string EmbeddingName() const;

  // The expert's matrix, checked like Matrix (fused tensors: F32/BF16/F16
  // [E, in, out']); INVALID_ARGUMENT naming the tensor otherwise.
  absl::StatusOr<ExpertSource> Expert(int64_t hf_layer, int64_t expert, ExpertMatrix which) const;
  // A routed expert's bias for `which` (b1, b3: [d_ff], b2: [d_model]) when
  // shape().expert_biases, as f32, every value finite.
  absl::StatusOr<std::vector<float>> ExpertBias(int64_t hf_layer, int64_t expert, ExpertMatrix which) const;

  // The tensor named `name`, checked to be F32, BF16, F16 — or F8_E4M3 with
  // its block scales `<name>_scale_inv` (f32 [ceil(rows/128), ceil(cols/128)]:
  // DeepSeek-V3's FP8) — and of shape [rows, cols]. INVALID_ARGUMENT naming
  // the tensor and file otherwise (missing tensor or scales, wrong shape,
  // unsupported dtype).
  absl::StatusOr<const common::SafetensorsTensor*> Matrix(const std::string& name, int64_t rows, int64_t cols) const;

  // The 1-D tensor `name` of `n` F32/BF16/F16 values, as f32, every one
  // finite; INVALID_ARGUMENT naming the tensor otherwise.
  absl::StatusOr<std::vector<float>> Vector(const std::string& name, int64_t n) const;

  // The block scales of an F8_E4M3 matrix from Matrix(); null for other dtypes.
  const common::SafetensorsTensor* ScaleOf(const common::SafetensorsTensor& tensor) const;

  // Converts rows [first, first + n) of a matrix from Matrix() to f32; an
  // F8_E4M3 matrix needs its `scale_inv` (ScaleOf) and is dequantized exactly.
  static void RowsToFloat(const common::SafetensorsTensor& tensor, int64_t first, int64_t n, float* out,
                          const common::SafetensorsTensor* scale_inv = nullptr);

  // Drops rows [first, first + n) of a matrix from Matrix() from this
  // process's memory (they are read again from the page cache if touched).
  void ReleaseRows(const common::SafetensorsTensor& tensor, int64_t first, int64_t n) const;

 private:
  HfCheckpoint() = default;
  const common::SafetensorsFile* FileOf(const std::string& name) const;

  HfModelShape shape_;
  std::vector<std::unique_ptr<common::SafetensorsFile>> files_;
};

}  // namespace tools
}  // namespace colibri

#endif  // COLIBRI_TOOLS_HF_CHECKPOINT_H_
