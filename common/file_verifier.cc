#include "common/file_verifier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checksum.h"
#include "common/parallel_for.h"
#include "common/small_file.h"
#include "common/user_cache.h"

namespace colibri {
namespace common {
namespace {

constexpr char kCacheHeader[] = "colibri-verified 1";
// File times come from a coarse clock (one tick: 1-10 ms).
constexpr int64_t kRacyNs = 100'000'000;

struct Remembered {
  std::string checksum;
  FileIdentity identity;
};
using Cache = std::map<std::string, Remembered>;  // by path relative to the model directory

// Reads the cache; a missing file is an empty cache, a malformed one is
// ignored with a note (it is rewritten on save), and so is anything but a
// regular file of at most 64 MiB, or a symlink (a model directory may come
// from anyone: a FIFO there would block the load, /dev/zero exhaust memory).
Cache ReadCache(const std::string& path, std::string* note) {
  Cache cache;
  const absl::StatusOr<std::string> text = ReadSmallFile(path, {/*max_bytes=*/64 << 20, /*follow_symlinks=*/false});
  if (!text.ok()) {
    if (!absl::IsNotFound(text.status())) *note = absl::StrCat(text.status().message(), " (ignored)");
    return cache;
  }
  std::istringstream in(*text);
  std::string line;
  if (!std::getline(in, line) || line != kCacheHeader) {
    *note = absl::StrCat(path, " is not a verified-files cache (ignored)");
    return cache;
  }
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    Remembered r;
    std::string relative;
    FileIdentity& id = r.identity;
    if (!(fields >> r.checksum >> id.device >> id.inode >> id.size >> id.mtime_ns >> id.ctime_ns >> relative)) {
      *note = absl::StrCat(path, " has a malformed line (ignored)");
      continue;
    }
    cache[relative] = r;
  }
  return cache;
}

// Writes to a temporary file and renames it over `path`, so a reader sees
// the old list or the new one, never a part. The temporary file is created
// anew (O_EXCL, not following a symlink planted under its name).
bool WriteCache(const std::string& path, const Cache& cache, std::string* note) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  std::string text = absl::StrCat(kCacheHeader, "\n");
  for (const auto& [relative, r] : cache) {
    const FileIdentity& id = r.identity;
    absl::StrAppend(&text, r.checksum, " ", id.device, " ", id.inode, " ", id.size, " ", id.mtime_ns, " ", id.ctime_ns,
                    " ", relative, "\n");
  }
  ::unlink(tmp.c_str());  // one left by an earlier process of this pid (removes a symlink, not its target)
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  bool written = fd >= 0;
  for (size_t at = 0; written && at < text.size();) {
    const ssize_t n = ::write(fd, text.data() + at, text.size() - at);
    if (n < 0 && errno == EINTR) continue;
    written = n > 0;
    if (written) at += n;
  }
  if (fd >= 0 && ::close(fd) != 0) written = false;
  if (!written) {
    *note = absl::StrCat("cannot write ", tmp, " (verified files not remembered)");
    if (fd >= 0) ::unlink(tmp.c_str());
    return false;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    *note = absl::StrCat("cannot rename ", tmp, " to ", path, " (verified files not remembered)");
    std::filesystem::remove(tmp, ec);
    return false;
  }
  return true;
}

std::string RelativeTo(const std::string& dir, const std::string& path) {
  const std::string prefix = absl::StrCat(dir, "/");
  return path.compare(0, prefix.size(), prefix) == 0 ? path.substr(prefix.size()) : path;
}

}  // namespace

std::string DefaultVerifiedCachePath(const std::string& dir) {
  if (::access(dir.c_str(), W_OK) == 0) return absl::StrCat(dir, "/", kVerifiedCacheFileName);
  const std::string base = UserCacheDir();
  if (base.empty()) return "";
  std::error_code ec;
  std::string real = std::filesystem::canonical(dir, ec).string();
  if (ec) real = dir;
  // "xxh3_128:" and 16 of the 32 hex digits: unique enough for a cache name.
  const std::string id = ChecksumBytes(real.data(), real.size()).substr(sizeof(kChecksumPrefix) - 1, 16);
  return absl::StrCat(base, "/verified-", id, ".txt");
}

std::string VerifyReport::Describe() const {
  std::string line = absl::StrFormat("verified %d files (%.2f GB) in %.2f s on %d thread%s", files_hashed,
                                     bytes_hashed / 1e9, seconds, threads, threads == 1 ? "" : "s");
  absl::StrAppendFormat(&line, "; %d files (%.2f GB) unchanged since verified", files_remembered,
                        bytes_remembered / 1e9);
  absl::StrAppend(&line, cache_path.empty() ? " (no verified-files cache)" : absl::StrCat(" (cache ", cache_path, ")"));
  if (!cache_note.empty()) absl::StrAppend(&line, "; ", cache_note);
  return line;
}

absl::StatusOr<VerifyReport> VerifyMappedFiles(const ModelDir& model, absl::Span<const MappedFile* const> files,
                                               const VerifyOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  VerifyReport report;
  report.cache_path = options.cache_path.empty()    ? DefaultVerifiedCachePath(model.dir())
                      : options.cache_path == "off" ? ""
                                                    : options.cache_path;
  Cache cache;
  if (!report.cache_path.empty()) cache = ReadCache(report.cache_path, &report.cache_note);

  std::vector<std::string> relative(files.size());
  std::vector<const ManifestFile*> listed(files.size());
  std::vector<size_t> to_hash;
  for (size_t i = 0; i < files.size(); ++i) {
    relative[i] = RelativeTo(model.dir(), files[i]->path());
    listed[i] = model.manifest().FindFile(relative[i]);
    if (listed[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(files[i]->path(), " is not listed in the manifest"));
    }
    auto it = cache.find(relative[i]);
    if (it != cache.end() && it->second.checksum == listed[i]->checksum &&
        it->second.identity == files[i]->identity()) {
      ++report.files_remembered;
      report.bytes_remembered += files[i]->size();
    } else {
      to_hash.push_back(i);
    }
  }

  // Whole files per thread, largest first, so one big file does not start last.
  std::sort(to_hash.begin(), to_hash.end(), [&](size_t a, size_t b) { return files[a]->size() > files[b]->size(); });
  std::vector<std::string> actual(files.size());
  report.threads = static_cast<int>(std::clamp<size_t>(options.threads, 1, std::max<size_t>(1, to_hash.size())));
  ParallelFor(to_hash.size(), report.threads, [&](size_t k) {
    const MappedFile& f = *files[to_hash[k]];
    actual[to_hash[k]] = ChecksumBytes(f.data(), f.size());
  });

  timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  const int64_t now_ns = now.tv_sec * 1000000000LL + now.tv_nsec;
  std::sort(to_hash.begin(), to_hash.end());
  for (size_t i : to_hash) {
    if (actual[i] != listed[i]->checksum) {
      return absl::DataLossError(absl::StrCat("bad weight file ", files[i]->path(), ": checksum ", actual[i],
                                              " does not match the manifest's ", listed[i]->checksum));
    }
    ++report.files_hashed;
    report.bytes_hashed += files[i]->size();
    // A file changed within the same clock tick as the one verified would
    // keep its identity: files changed less than kRacyNs before now are
    // not remembered (git's "racy" rule).
    if (now_ns - files[i]->identity().ctime_ns >= kRacyNs) {
      cache[relative[i]] = {listed[i]->checksum, files[i]->identity()};
    }
  }
  if (!report.cache_path.empty() && !to_hash.empty()) WriteCache(report.cache_path, cache, &report.cache_note);
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace common
}  // namespace colibri
