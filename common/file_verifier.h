#ifndef COLIBRI_COMMON_FILE_VERIFIER_H_
#define COLIBRI_COMMON_FILE_VERIFIER_H_

// Verifies mapped files of a model directory against the checksums its
// manifest lists: on several threads, and remembering what was verified, so
// a restart on an unchanged model hashes nothing.
//
// The memory of verified files (the "verified cache") holds, per file, the
// checksum it matched and the file's identity then (device, inode, size,
// mtime, ctime: common/mapped_file.h). A file is taken as verified without
// hashing only if its mapping's identity and the manifest's checksum both
// equal the remembered ones; a file changed in any way since gets a new
// ctime and is hashed again (a file whose ctime is less than 0.1 s old when
// it is verified is not remembered: a change within the same clock tick
// would not show). The cache lives next to the model
// (<model>/.colibri-verified) where the directory is writable, else in
// $XDG_CACHE_HOME/colibri (or ~/.cache/colibri) under a name derived from
// the model directory's real path. It guards against accidents, not an
// attacker: whoever can write it could as well rewrite the model's files.
// Two processes saving at once keep one of the two lists; the files the
// other added are hashed again next time.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/mapped_file.h"
#include "common/model_dir.h"

namespace colibri {
namespace common {

inline constexpr char kVerifiedCacheFileName[] = ".colibri-verified";

struct VerifyOptions {
  int threads = 1;  // hashing threads (each takes whole files)
  // Where verified files are remembered: empty = the default place (above),
  // "off" = nowhere (every file is hashed), else this file.
  std::string cache_path;
};

struct VerifyReport {
  int64_t files_hashed = 0;
  uint64_t bytes_hashed = 0;
  int64_t files_remembered = 0;  // unchanged since verified: not hashed
  uint64_t bytes_remembered = 0;
  int threads = 1;
  double seconds = 0;
  std::string cache_path;  // empty: no cache
  std::string cache_note;  // why the cache could not be read or written, if so

  // One line for the log, e.g. "verified 8 files (2.82 GB) in 1.93 s on 2
  // threads; 0 unchanged since verified (cache /m/.colibri-verified)".
  std::string Describe() const;
};

// Checks every file in `files` (mapped from `model`'s directory and listed in
// its manifest) against its listed checksum. DATA_LOSS naming the file and
// both checksums on a mismatch (the first in `files` order); a cache that
// cannot be read or written is not an error (see cache_note).
absl::StatusOr<VerifyReport> VerifyMappedFiles(const ModelDir& model, absl::Span<const MappedFile* const> files,
                                               const VerifyOptions& options);

// The default cache file for the model directory `dir` (above).
std::string DefaultVerifiedCachePath(const std::string& dir);

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_FILE_VERIFIER_H_
