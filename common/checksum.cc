#include "common/checksum.h"

#include <xxhash.h>

#include "absl/strings/str_format.h"

namespace colibri {
namespace common {
namespace {

std::string Format(XXH128_hash_t h) { return absl::StrFormat("%s%016x%016x", kChecksumPrefix, h.high64, h.low64); }

}  // namespace

Checksummer::Checksummer() : state_(XXH3_createState()) { XXH3_128bits_reset(state_); }

Checksummer::~Checksummer() { XXH3_freeState(state_); }

void Checksummer::Update(const void* data, size_t size) { XXH3_128bits_update(state_, data, size); }

std::string Checksummer::Finish() const { return Format(XXH3_128bits_digest(state_)); }

std::string ChecksumBytes(const void* data, size_t size) { return Format(XXH3_128bits(data, size)); }

}  // namespace common
}  // namespace colibri
