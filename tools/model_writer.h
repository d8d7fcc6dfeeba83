#ifndef COLIBRI_TOOLS_MODEL_WRITER_H_
#define COLIBRI_TOOLS_MODEL_WRITER_H_

// Writing a model directory (docs/MODEL_FORMAT.md), shared by the tools that
// make one (colibri-convert, colibri-prune): files written sequentially and
// hashed as they go, small gate/LUT files from memory, the output directory
// prepared, and manifest.json written last through a rename so an
// interrupted run never leaves a loadable directory. Errors are INTERNAL
// naming the path (FAILED_PRECONDITION for an existing model without
// overwrite). Thread-compatible.

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/checksum.h"
#include "common/dtype.h"
#include "common/manifest.h"
#include "common/weight_file.h"

namespace colibri {
namespace tools {

// Writes a file sequentially, hashing every byte, so the manifest's checksum
// costs no second read.
class HashingWriter {
 public:
  static absl::StatusOr<std::unique_ptr<HashingWriter>> Create(const std::string& path);
  ~HashingWriter();
  absl::Status Write(const void* data, size_t size);
  // Zero-fills up to `offset`.
  absl::Status PadTo(uint64_t offset);
  // Flushes and closes; the manifest entry for `relative_path`.
  absl::StatusOr<common::ManifestFile> Close(const std::string& relative_path);

 private:
  HashingWriter(std::string path, std::FILE* f) : path_(std::move(path)), file_(f) {}
  std::string path_;
  std::FILE* file_;
  common::Checksummer sum_;
  uint64_t size_ = 0;
};

struct PlainSection {
  std::string name;
  common::DType dtype;
  int64_t rows, cols;
  const void* data;
  size_t size;
};

// A gate or LUT file (`rel` in `out_dir`): small sections held in memory.
absl::StatusOr<common::ManifestFile> WritePlainFile(const std::string& out_dir, const std::string& rel,
                                                    common::FileKind kind, int64_t layer,
                                                    const std::vector<PlainSection>& plain);

// Creates `out_dir`; refuses one that holds a model unless `overwrite`, and
// then removes its manifest and layer directories first.
absl::Status PrepareOutputDir(const std::string& out_dir, bool overwrite);

// Writes `manifest` as out_dir/manifest.json (through a temporary file and a rename).
absl::Status WriteManifest(const std::string& out_dir, const common::Manifest& manifest);

}  // namespace tools
}  // namespace colibri

#endif  // COLIBRI_TOOLS_MODEL_WRITER_H_
