#ifndef COLIBRI_TOOLS_MODEL_WRITER_H_
#define COLIBRI_TOOLS_MODEL_WRITER_H_

// Writing a model directory (docs/MODEL_FORMAT.md), shared by the tools that
// make one (colibri-convert, colibri-prune): files written sequentially and
// hashed as they go, small gate/LUT files from memory, and the directory
// written beside the output and moved in whole at the end, manifest.json
// last, so an interrupted or failed run never leaves a loadable directory
// of mixed parts nor destroys the one there. Errors are INTERNAL
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

// A model directory being written. Everything goes to a staging directory
// inside it (path(): `out_dir`/.colibri-partial-<pid>, on the same file
// system, so moves are renames); Commit moves the result in. Until then the
// model in `out_dir` is as it was, so a run that fails halfway (a bad tensor
// in the last layer) leaves the model an earlier run wrote there; destroyed
// without Commit, the staging directory is removed. Begin removes what
// killed runs left (their pids are gone).
class OutputDir {
 public:
  // Refuses an `out_dir` that holds a model unless `overwrite`.
  static absl::StatusOr<std::unique_ptr<OutputDir>> Begin(const std::string& out_dir, bool overwrite);
  ~OutputDir();
  OutputDir(const OutputDir&) = delete;
  OutputDir& operator=(const OutputDir&) = delete;

  // Where the files go until Commit.
  const std::string& path() const { return staging_; }
  // Writes `manifest` (through a temporary file and a rename), then
  // replaces out_dir's model: its manifest and layer directories move aside
  // (.colibri-previous-<pid>), the new layer directories move in, the
  // manifest last, and the old parts are removed. If a move fails, the moves
  // made are undone: the old model is back (INTERNAL says so). Other files
  // in out_dir are kept.
  absl::Status Commit(const common::Manifest& manifest);

 private:
  OutputDir(std::string out_dir, std::string staging) : out_dir_(std::move(out_dir)), staging_(std::move(staging)) {}
  const std::string out_dir_, staging_;
};

}  // namespace tools
}  // namespace colibri

#endif  // COLIBRI_TOOLS_MODEL_WRITER_H_
