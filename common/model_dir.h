#ifndef COLIBRI_COMMON_MODEL_DIR_H_
#define COLIBRI_COMMON_MODEL_DIR_H_

// A converted model directory (docs/MODEL_FORMAT.md), opened read-only.
// Open() reads and validates manifest.json only; weights are mapped on demand,
// one (layer, expert) file or one layer's routing tables at a time, so an
// expert node maps exactly the shard it owns.
//
// Every file must resolve inside the directory (symlinks to elsewhere are
// refused without saying what they point at; regular files only: FIFOs and
// devices are refused before anything waits on them). Every load checks the
// file against the manifest (listed, size) and its own
// header (kind, layer, expert, section shapes and dtypes); with
// verify_checksum it also hashes the mapped bytes. Any fault is refused with
// the file's path and the reason: NOT_FOUND for a missing file,
// INVALID_ARGUMENT for a corrupt one (DATA_LOSS for a checksum mismatch).
// A ModelDir is immutable after Open and safe to share between threads.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/anonymous_memory.h"
#include "common/manifest.h"
#include "common/mapped_file.h"
#include "common/weight_matrix.h"

namespace colibri {
namespace common {

// One expert's three matrices (and biases, if the model has them), as views
// into the mapping `file` owns, or into `copy` after CopyExpertToMemory, and
// how the model applies them (from the manifest):
//   FFN(x) = W2·act(W1·x + b1, W3·x + b3) + b2      (Activation in manifest.h)
// with a routing weight w, w·FFN(x) — or FFN(w·x) when weight_at_input.
struct ExpertWeights {
  int64_t layer = 0;
  int64_t expert = 0;
  MatrixView w1;                 // gate_proj [d_ff][d_model]
  MatrixView w3;                 // up_proj   [d_ff][d_model]
  MatrixView w2;                 // down_proj [d_model][d_ff]
  const float* b1 = nullptr;     // [d_ff], or null for no biases (then b3 and b2 are null too)
  const float* b3 = nullptr;     // [d_ff]
  const float* b2 = nullptr;     // [d_model]
  Activation activation;         // SwiGLU by default
  bool weight_at_input = false;  // a routed expert of a model whose routing.weight_at_input
  std::unique_ptr<MappedFile> file;
  std::unique_ptr<AnonymousMemory> copy;
  // What the views' q8_records point into, when they were built.
  std::vector<std::unique_ptr<AnonymousMemory>> q8_records;
};

// DATA_LOSS naming the expert and its file when that file shrank while it
// was mapped (MappedFile::faulted: reads past its new end were given zeros,
// so what was computed from it is wrong), ending with `remedy`; OK if not
// (and for an expert copied to memory).
absl::Status CheckIntact(const ExpertWeights& expert, absl::string_view remedy);

// Copies the expert's file into anonymous memory (huge pages and/or one NUMA
// node), points the views there and releases the file mapping. On failure
// the expert is unchanged. REQUIRES: `expert` still has its file.
absl::Status CopyExpertToMemory(ExpertWeights* expert, const AnonymousMemory::Options& options);

// One layer's routing tables, as views into private copies of its files
// (each read once from its file, then checked: a file replaced or truncated
// in place, meanwhile or later, changes nothing here).
struct LayerRouting {
  int64_t layer = 0;
  const float* gate = nullptr;         // f32 [n_experts][d_model]
  const float* shared_gate = nullptr;  // f32 [n_shared_experts][d_model] if manifest.shared_gate, else null
  const float* bias = nullptr;         // f32 [n_experts] if manifest.routing.has_bias(), else null
  const int32_t* lut_ids = nullptr;    // [vocab_size][top_k], each < n_experts
  const float* lut_weights = nullptr;  // [vocab_size][top_k], finite
  std::vector<uint8_t> gate_file;      // the files' bytes
  std::vector<uint8_t> lut_file;
};

class ModelDir {
 public:
  static absl::StatusOr<std::unique_ptr<ModelDir>> Open(const std::string& dir);

  const Manifest& manifest() const { return manifest_; }
  const std::string& dir() const { return dir_; }
  // Identity of the model: the checksum of manifest.json's bytes (which lists
  // every file's checksum).
  const std::string& model_id() const { return model_id_; }

  // REQUIRES for both loads: nothing; out-of-range layer/expert (expert <
  // total_experts(): shared experts load like routed ones) is INVALID_ARGUMENT.
  absl::StatusOr<std::unique_ptr<ExpertWeights>> LoadExpert(int64_t layer, int64_t expert, bool verify_checksum) const;
  absl::StatusOr<std::unique_ptr<LayerRouting>> LoadRouting(int64_t layer, bool verify_checksum) const;

  // Maps a file listed in the manifest and checks its size and, optionally,
  // its checksum against the listing. The mapping comes guarded
  // (MappedFile::Guard) while guard slots are free: a file that shrinks while
  // it is read is then DATA_LOSS here, in LoadExpert, LoadRouting and
  // CopyExpertToMemory, and faulted() for later readers, not SIGBUS.
  absl::StatusOr<std::unique_ptr<MappedFile>> MapListedFile(const std::string& relative_path,
                                                            bool verify_checksum) const;

  // The same mapping (listed, confined to the directory, guarded) with no
  // check of its size or contents: for a validator that reports each check.
  absl::StatusOr<std::unique_ptr<MappedFile>> MapListedFileUnchecked(const std::string& relative_path) const;

 private:
  ModelDir(std::string dir, Manifest manifest, std::string model_id)
      : dir_(std::move(dir)), manifest_(std::move(manifest)), model_id_(std::move(model_id)) {}

  const std::string dir_;
  const Manifest manifest_;
  const std::string model_id_;
};

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_MODEL_DIR_H_
