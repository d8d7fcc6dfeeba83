#include "common/checksum.h"

#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace colibri {
namespace common {
namespace {

std::string Format(XXH128_hash_t h) {
  return absl::StrFormat("%s%016x%016x", kChecksumPrefix, h.high64, h.low64);
}

}  // namespace

Checksummer::Checksummer() : state_(XXH3_createState()) {
  XXH3_128bits_reset(state_);
}

Checksummer::~Checksummer() { XXH3_freeState(state_); }

void Checksummer::Update(const void* data, size_t size) {
  XXH3_128bits_update(state_, data, size);
}

std::string Checksummer::Finish() const { return Format(XXH3_128bits_digest(state_)); }

std::string ChecksumBytes(const void* data, size_t size) {
  return Format(XXH3_128bits(data, size));
}

absl::StatusOr<std::string> ChecksumFile(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const std::string message = absl::StrCat("cannot open ", path, ": ", std::strerror(errno));
    return errno == ENOENT ? absl::NotFoundError(message) : absl::InternalError(message);
  }
  Checksummer sum;
  std::vector<char> buffer(1 << 20);
  size_t n;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), f)) > 0) sum.Update(buffer.data(), n);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return absl::InternalError(absl::StrCat("read error in ", path));
  return sum.Finish();
}

}  // namespace common
}  // namespace colibri
