#include "common/small_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace colibri {
namespace common {

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, const SmallFileOptions& options) {
  // O_NONBLOCK: opening a FIFO with no writer returns at once (and is then refused).
  const int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | (options.follow_symlinks ? 0 : O_NOFOLLOW);
  const int fd = ::open(path.c_str(), flags);
  if (fd < 0) {
    const int error = errno;
    const std::string why = absl::StrCat(path, ": cannot open: ", std::strerror(error));
    return error == ENOENT ? absl::NotFoundError(why) : absl::UnavailableError(why);
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  return ReadSmallFd(fd, path, options.max_bytes);
}

absl::StatusOr<std::string> ReadSmallFd(int fd, const std::string& path, int64_t max_bytes) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return absl::UnavailableError(absl::StrCat(path, ": cannot stat: ", std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) return absl::FailedPreconditionError(absl::StrCat(path, " is not a regular file"));
  if (st.st_size > max_bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " holds ", st.st_size, " bytes, more than the ", max_bytes, " it may"));
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::pread(fd, &text[got], text.size() - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::UnavailableError(absl::StrCat(path, ": cannot read: ", std::strerror(errno)));
    if (n == 0) break;  // shrunk since fstat: what is there
    got += static_cast<size_t>(n);
  }
  text.resize(got);
  return text;
}

}  // namespace common
}  // namespace colibri
