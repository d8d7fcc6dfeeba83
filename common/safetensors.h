#ifndef COLIBRI_COMMON_SAFETENSORS_H_
#define COLIBRI_COMMON_SAFETENSORS_H_

// Reader and streaming writer for the safetensors format:
//   u64 little-endian header length N | N bytes of JSON header | data buffer
// The JSON maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]}
// (offsets relative to the data buffer) plus an optional "__metadata__".
//
// The reader maps the file (zero copy) and validates everything a hostile file
// could get wrong before handing out a pointer: header length within the
// file, well-formed JSON, known dtype, non-negative shape, byte size equal to
// numel x element size (overflow-checked), offsets inside the data buffer and
// no two tensors overlapping. Errors are INVALID_ARGUMENT naming the file and
// the tensor.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/mapped_file.h"

namespace colibri {
namespace common {

// Largest JSON header the reader accepts (the format's own reference limit).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100u << 20;

struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // as in the file: "F32", "BF16", "F16", "I32", ...
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // absolute byte offset of the data in the file
  uint64_t nbytes = 0;
  const uint8_t* data = nullptr;  // points into the mapping; null from ParseHeader

  int64_t numel() const;
};

// Bytes per element of a safetensors dtype string; 0 if unknown.
size_t SafetensorsElementSize(const std::string& dtype);

// Parses and validates the header of a safetensors image of `file_size` bytes
// whose first bytes are `prefix` (at least the 8-byte length plus the header;
// pass the whole mapping). `what` names the file in messages.
absl::StatusOr<std::vector<SafetensorsTensor>> ParseSafetensorsHeader(const uint8_t* prefix, size_t prefix_size,
                                                                      uint64_t file_size, const std::string& what);

class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  // Sorted by name. Pointers stay valid while this object lives.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // nullptr if absent.
  const SafetensorsTensor* Find(const std::string& name) const;
  const std::string& path() const { return file_->path(); }
  // Drops bytes [offset, offset + length) of the file from this process's
  // RSS (see MappedFile::DropPages).
  void ReleaseRange(uint64_t offset, uint64_t length) const;

 private:
  SafetensorsFile(std::unique_ptr<MappedFile> file, std::vector<SafetensorsTensor> tensors);

  std::unique_ptr<MappedFile> file_;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t> index_;
};

// Writes a safetensors file whose tensors are all declared up front, then
// streamed in declaration order through Append, so no tensor needs to be in
// memory whole. Not thread-safe.
class SafetensorsWriter {
 public:
  struct Spec {
    std::string name;
    std::string dtype;  // "F32", "BF16", "F16", "I32", "I64"
    std::vector<int64_t> shape;
  };

  // INVALID_ARGUMENT for an unknown dtype or a duplicate name; the OS error
  // with the path if the file cannot be created.
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, std::vector<Spec> specs, const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();

  // Appends raw little-endian bytes; tensors are contiguous in spec order.
  absl::Status Append(const void* data, size_t size);
  // FAILED_PRECONDITION if fewer or more bytes than declared were appended.
  absl::Status Close();

 private:
  SafetensorsWriter(std::string path, std::FILE* file, uint64_t expected)
      : path_(std::move(path)), file_(file), expected_(expected) {}

  std::string path_;
  std::FILE* file_;
  uint64_t expected_;
  uint64_t written_ = 0;
};

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_SAFETENSORS_H_
