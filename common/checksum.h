#ifndef COLIBRI_COMMON_CHECKSUM_H_
#define COLIBRI_COMMON_CHECKSUM_H_

// File checksums for model directories: XXH3-128 (libxxhash), written as
// "xxh3_128:<32 lowercase hex digits>". XXH3 verifies a 90 GB model at memory
// speed; it detects corruption, not tampering (see docs/MODEL_FORMAT.md).
// A Checksummer is not thread-safe; the free functions are.

#include <cstddef>
#include <string>

struct XXH3_state_s;

namespace colibri {
namespace common {

inline constexpr char kChecksumPrefix[] = "xxh3_128:";

class Checksummer {
 public:
  Checksummer();
  ~Checksummer();
  Checksummer(const Checksummer&) = delete;
  Checksummer& operator=(const Checksummer&) = delete;

  void Update(const void* data, size_t size);
  // The checksum of every byte passed to Update so far.
  std::string Finish() const;

 private:
  XXH3_state_s* state_;
};

std::string ChecksumBytes(const void* data, size_t size);

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_CHECKSUM_H_
