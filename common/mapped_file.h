#ifndef COLIBRI_COMMON_MAPPED_FILE_H_
#define COLIBRI_COMMON_MAPPED_FILE_H_

// A whole file mapped read-only (MAP_PRIVATE | MAP_NORESERVE). Zero copy: views
// into it point at the page cache. Thread-safe for concurrent reads; the
// mapping lives until the MappedFile is destroyed, so every view derived from
// data() must not outlive it.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace colibri {
namespace common {

// What identifies a file's contents without reading them: a file rewritten
// in place, replaced or touched gets a new ctime (which no unprivileged call
// can set back) and usually a new mtime, inode or size.
struct FileIdentity {
  uint64_t device = 0;
  uint64_t inode = 0;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;

  bool operator==(const FileIdentity& o) const {
    return device == o.device && inode == o.inode && size == o.size && mtime_ns == o.mtime_ns && ctime_ns == o.ctime_ns;
  }
};

class MappedFile {
 public:
  // Maps `path`. NOT_FOUND / PERMISSION_DENIED / INTERNAL with the path and
  // the OS reason on failure. An empty file maps to data() == nullptr, size 0.
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path);

  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // The file as it was when mapped.
  const FileIdentity& identity() const { return identity_; }

  // Guards the mapping against truncation of the file (common/sigbus_guard.h):
  // a read past the file's new end then sees zeros instead of killing the
  // process, and faulted() turns true. For mappings that are served for a
  // long time (weights from the page cache); callers check faulted() after
  // using the data. False if no guard slot was free.
  bool Guard();
  bool faulted() const;

  // Drops the pages of [offset, offset+length) from this process's resident
  // set (MADV_DONTNEED); they are read again from the page cache if touched.
  // Used by streaming readers to keep peak RSS at one tensor, not one file.
  void DropPages(size_t offset, size_t length) const;

  // Drops the whole file from memory: this mapping's pages (MADV_DONTNEED)
  // and then the file's clean pages in the page cache that no other process
  // maps (posix_fadvise DONTNEED on the path). Touching the data afterwards
  // reads it from storage again. Best effort.
  void Evict() const;
  // Bytes of the file now in the page cache (mincore), a multiple of the
  // page size up to size(); 0 if unknown.
  size_t ResidentBytes() const;

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size, FileIdentity identity)
      : path_(std::move(path)), data_(data), size_(size), identity_(identity) {}

  const std::string path_;
  const uint8_t* const data_;
  const size_t size_;
  const FileIdentity identity_;
  int guard_slot_ = -1;
};

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_MAPPED_FILE_H_
