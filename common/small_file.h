#ifndef COLIBRI_COMMON_SMALL_FILE_H_
#define COLIBRI_COMMON_SMALL_FILE_H_

// Reading a small file that someone else controls (a cluster file, a PEM
// certificate, a cache) whole, without letting its type or size stall or
// exhaust the process: a FIFO would block the open or the read forever, a
// device such as /dev/zero never end. Thread-safe.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace colibri {
namespace common {

struct SmallFileOptions {
  int64_t max_bytes = 1 << 20;
  bool follow_symlinks = true;  // false: a symlink at `path` is refused (ELOOP)
};

// The file's bytes. NOT_FOUND if it does not exist; FAILED_PRECONDITION if it
// is not a regular file or holds more than max_bytes; UNAVAILABLE if it
// cannot be opened or read. Messages name the path and the reason.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, const SmallFileOptions& options = {});

// The same for a file the caller has open (e.g. under a lock it holds), read
// from its start whatever the descriptor's offset; `path` names it in errors.
absl::StatusOr<std::string> ReadSmallFd(int fd, const std::string& path, int64_t max_bytes);

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_SMALL_FILE_H_
