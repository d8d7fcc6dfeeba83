#include "common/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/sigbus_guard.h"

namespace colibri {
namespace common {
namespace {

absl::Status OsError(int err, const std::string& what, const std::string& path) {
  const std::string message = absl::StrCat(what, " ", path, ": ", std::strerror(err));
  switch (err) {
    case ENOENT: return absl::NotFoundError(message);
    case EACCES:
    case EPERM: return absl::PermissionDeniedError(message);
    default: return absl::InternalError(message);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<MappedFile>> MappedFile::Open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer (the regular-file
  // check below refuses it); it changes nothing for regular files.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return OsError(errno, "cannot open", path);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return OsError(err, "cannot stat", path);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat("not a regular file: ", path));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* data = nullptr;
  if (size > 0) {
    data = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE | MAP_NORESERVE, fd, 0);
    if (data == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return OsError(err, "cannot mmap", path);
    }
  }
  ::close(fd);  // the mapping keeps the file alive
  const FileIdentity identity{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), size,
                              st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec,
                              st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec};
  return std::unique_ptr<MappedFile>(new MappedFile(path, static_cast<const uint8_t*>(data), size, identity));
}

MappedFile::~MappedFile() {
  SigbusGuard::Unregister(guard_slot_);  // before the range can be mapped again by anyone
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

bool MappedFile::Guard() {
  if (guard_slot_ < 0) guard_slot_ = SigbusGuard::Register(data_, size_);
  return guard_slot_ >= 0;
}

bool MappedFile::faulted() const { return SigbusGuard::Faulted(guard_slot_); }

void MappedFile::DropPages(size_t offset, size_t length) const {
  if (data_ == nullptr || offset >= size_) return;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t begin = offset / page * page;
  const size_t end = std::min(size_, offset + length);
  // Best effort: failure only means the pages stay resident.
  (void)::madvise(const_cast<uint8_t*>(data_) + begin, end - begin, MADV_DONTNEED);
}

void MappedFile::Evict() const {
  if (data_ == nullptr) return;
  (void)::madvise(const_cast<uint8_t*>(data_), size_, MADV_DONTNEED);
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return;
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

size_t MappedFile::ResidentBytes() const {
  if (data_ == nullptr) return 0;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in_core((size_ + page - 1) / page);
  if (::mincore(const_cast<uint8_t*>(data_), size_, in_core.data()) != 0) return 0;
  size_t pages = 0;
  for (unsigned char c : in_core) pages += c & 1;
  return std::min(size_, pages * page);
}

}  // namespace common
}  // namespace colibri
