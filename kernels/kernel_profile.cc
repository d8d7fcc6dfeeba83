#include "kernels/kernel_profile.h"

#include <cpuid.h>
#include <fcntl.h>
#include <immintrin.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/half.h"
#include "common/model_dir.h"
#include "common/small_file.h"
#include "common/status_macros.h"
#include "common/user_cache.h"
#include "common/weight_matrix.h"
#include "kernels/expert_executor.h"
#include "kernels/onednn_matmul.h"
#include "kernels/thread_pool.h"

namespace colibri {
namespace kernels {
namespace {

using common::DType;

// Bumped whenever the candidates, their speed or the way they are timed
// change, so a cache written by another version is not read.
constexpr int kProfileVersion = 12;
constexpr int64_t kMaxProfileBytes = 1 << 20;  // a profile is a few KiB: anything larger is not one

// Whether this build's timings say anything about the host: sanitizers and
// -O0 slow the hand-written kernels many times over and leave oneDNN (a
// system library) as fast as ever, so such a build would write a profile
// that is wrong for every other process reading the host's file.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || !defined(__OPTIMIZE__)
constexpr bool kTimingBuild = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
constexpr bool kTimingBuild = false;
#else
constexpr bool kTimingBuild = true;
#endif
#else
constexpr bool kTimingBuild = true;
#endif
// d_model and d_ff of the synthetic experts: small ones (in cache: compute
// decides) for the row thresholds, large ones (100 MB at bf16: streamed from
// memory, as decode does) for the choice of block kernel and the AMX bf16 and
// int8-tile thresholds.
constexpr int64_t kSmallDim = 1024, kLargeDim = 4096;
constexpr int64_t kRows[] = {2, 4, 8, 16, 32, 64, 128};        // rows per expert timed for thresholds
constexpr int64_t kStreamedRows[] = {2, 4, 6, 8, 16, 32, 64};  // the same on the large expert (wins go on beyond)
constexpr double kMargin = 0.9;                                // an alternative must take < 90% of the time

// One expert's matrices encoded from random f32 values, owning its bytes.
struct SynthMatrix {
  std::vector<uint8_t> data, zeros;
  std::vector<float> scales;
  common::MatrixView view;
};

SynthMatrix Encode(DType type, int64_t rows, int64_t cols, uint32_t& seed) {
  SynthMatrix m;
  const common::MatrixLayout layout = common::ComputeMatrixLayout(type, rows, cols);
  m.data.resize(layout.data_bytes);
  m.scales.resize(layout.scale_bytes / sizeof(float));
  m.zeros.resize(layout.zero_bytes);
  std::vector<float> src(common::kBlockRows * cols);
  for (int64_t b = 0; b < layout.num_blocks(); ++b) {
    for (float& v : src) {  // xorshift32: uniform in [-0.1, 0.1), fast enough for 50M values
      seed ^= seed << 13, seed ^= seed >> 17, seed ^= seed << 5;
      v = (static_cast<float>(seed >> 8) * (1.f / 16777216.f) - 0.5f) * 0.2f;
    }
    common::EncodeBlock(layout, src.data(), b, m.data.data() + b * layout.block_bytes, m.scales.data(), m.zeros.data());
  }
  m.view = {layout, m.data.data(), m.scales.empty() ? nullptr : m.scales.data(),
            m.zeros.empty() ? nullptr : m.zeros.data()};
  return m;
}

struct SynthExpert {
  SynthMatrix w1, w3, w2;
  common::ExpertWeights weights;
};

std::unique_ptr<SynthExpert> MakeExpert(DType type, int64_t dim, uint32_t& seed) {
  auto e = std::make_unique<SynthExpert>();
  e->w1 = Encode(type, dim, dim, seed);
  e->w3 = Encode(type, dim, dim, seed);
  e->w2 = Encode(type, dim, dim, seed);
  e->weights.w1 = e->w1.view;
  e->weights.w3 = e->w3.view;
  e->weights.w2 = e->w2.view;
  return e;
}

// Whether the CPU has CLFLUSHOPT (cpuid leaf 7, EBX bit 23).
bool HasClflushopt() {
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 23)) != 0;
}

// Drops the lines of `bytes` from `p` out of every cache level, so that the
// next read comes from memory. REQUIRES: HasClflushopt().
__attribute__((target("clflushopt"))) void FlushFromCaches(const void* p, size_t bytes) {
  if (p == nullptr) return;
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t line = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}; line < end; line += 64) {
    _mm_clflushopt(reinterpret_cast<void*>(line));
  }
  _mm_sfence();
}

// All a matrix's bytes the kernels read: data, scales, zero points, records.
void FlushFromCaches(const common::MatrixView& m) {
  FlushFromCaches(m.data, m.layout.data_bytes);
  FlushFromCaches(m.scales, m.layout.scale_bytes);
  FlushFromCaches(m.zeros, m.layout.zero_bytes);
  if (m.q8_records != nullptr) FlushFromCaches(m.q8_records, Q8RecordsBytes(m.layout));
}

// Times RunExperts on synthetic rows.
class Timer {
 public:
  // from_memory: every timed run reads the expert's weights from memory, as
  // a real layer's runs do (where the CPU can flush them: CLFLUSHOPT). The
  // large expert (100 MB at bf16) would otherwise come from the last-level
  // cache where that is larger (300 MiB on an Intel Xeon we measured), where
  // the own kernels fare better against the tiles than in a layer.
  Timer(ThreadPool* pool, int64_t dim, bool from_memory = false)
      : pool_(pool), dim_(dim), from_memory_(from_memory && HasClflushopt()) {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.f, 1.f);
    x_.resize(128 * dim);
    for (float& v : x_) v = normal(rng);
    dst_.resize(x_.size());
    for (int32_t i = 0; i < 128; ++i) indices_.push_back(i);
    route_weights_.assign(128, 1.f);
  }

  // Two configurations on `rows` rows of one expert, runs alternating (so
  // a burst of other work on the CPU slows both), the fastest of 6 each
  // after a warm-up: the least disturbed run. {base ms, alternative ms}.
  std::pair<double, double> Compare(const common::ExpertWeights& expert, int64_t rows, const ExecutorOptions& base,
                                    const ExecutorOptions& alternative) {
    const ExpertTask task{&expert, indices_.data(), route_weights_.data(), rows};
    double best[2] = {1e30, 1e30};
    for (int run = 0; run < 7; ++run) {
      for (int i = 0; i < 2; ++i) {
        if (from_memory_) {
          for (const common::MatrixView* m : {&expert.w1, &expert.w3, &expert.w2}) FlushFromCaches(*m);
        }
        const auto start = std::chrono::steady_clock::now();
        RunExperts(*pool_, {&task, 1}, x_.data(), dim_, dst_.data(), workspace_, i == 0 ? base : alternative);
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
        if (run > 0) best[i] = std::min(best[i], ms);
      }
    }
    return {best[0], best[1]};
  }

 private:
  ThreadPool* pool_;
  int64_t dim_;
  bool from_memory_;
  std::vector<float> x_, dst_, route_weights_;
  std::vector<int32_t> indices_;
  Workspace workspace_;
};

// The smallest measured row count from which the alternative wins at every
// larger one too; 0 if it does not win at the largest.
int64_t Threshold(absl::Span<const int64_t> rows, const std::vector<bool>& wins) {
  int64_t threshold = 0;
  for (size_t i = wins.size(); i-- > 0;) {
    if (!wins[i]) break;
    threshold = rows[i];
  }
  return threshold;
}

// Times `base` against `alternative` at every count of `counts`; returns the
// alternative's threshold and adds one evidence line per count.
int64_t MeasureThreshold(Timer& timer, const common::ExpertWeights& expert, const ExecutorOptions& base,
                         const ExecutorOptions& alternative, const std::string& what, const std::string& base_name,
                         const std::string& alternative_name, KernelProfile* profile,
                         absl::Span<const int64_t> counts = kRows) {
  std::vector<bool> wins;
  for (int64_t rows : counts) {
    const auto [b, a] = timer.Compare(expert, rows, base, alternative);
    wins.push_back(a < kMargin * b);
    profile->evidence.push_back(
        absl::StrFormat("%s rows=%d: %s %.3f ms, %s %.3f ms", what, rows, base_name, b, alternative_name, a));
  }
  return Threshold(counts, wins);
}

// Where the profile lives: the file COLIBRI_KERNEL_PROFILE names (the
// operator's, kChosen), else one per CPU and ISA in the user's cache
// (kCache); an empty path where there is no cache directory.
std::pair<std::string, ProfileFile> ProfilePath() {
  if (const char* path = std::getenv("COLIBRI_KERNEL_PROFILE"); path != nullptr && *path != '\0') {
    return {path, ProfileFile::kChosen};
  }
  const std::string dir = common::UserCacheDir();
  if (dir.empty()) return {"", ProfileFile::kCache};
  // A VM may hide AVX-VNNI from a CPU that has it: the avx2 kernels differ by it.
  const bool vnni = SelectedIsa() == Isa::kAvx2 && HasAvxVnni();
  return {absl::StrCat(dir, "/kernels-v", kProfileVersion, "-", CpuSignature(), "-", IsaName(SelectedIsa()),
                       vnni ? "+avxvnni" : "", ".txt"),
          ProfileFile::kCache};
}

// The text of `path` opened read-only, under a shared lock (a process
// measuring holds the exclusive one); an error if it cannot be opened or read.
// flock(fd, operation) retried until `wait` has passed: 0 once locked, else
// the error (ETIMEDOUT when another process kept it). A process stopped or
// hung holding the lock must not stall every other one.
int LockWithin(int fd, int operation, absl::Duration wait) {
  const absl::Time give_up = absl::Now() + wait;
  while (flock(fd, operation | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) return errno;
    if (absl::Now() >= give_up) return ETIMEDOUT;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return 0;
}

constexpr absl::Duration kLockWait = absl::Seconds(60);

absl::StatusOr<std::string> ReadOnly(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  (void)LockWithin(fd, LOCK_SH, kLockWait);  // best effort: a file that cannot be locked is read as it is
  absl::StatusOr<std::string> text = common::ReadSmallFd(fd, path, kMaxProfileBytes);
  close(fd);  // also drops the lock
  return text;
}

// The profile of a build that does not time (kTimingBuild): the one cached
// in `path` where it holds one for this CPU, else the defaults. Never
// measured or written.
KernelProfile CachedOrDefaultProfile(const std::string& path, Isa isa) {
  if (const absl::StatusOr<std::string> text = ReadOnly(path); text.ok()) {  // "" opens nothing
    auto cached = ParseProfile(*text, isa);
    if (cached.ok()) {
      cached->source = absl::StrCat("cached in ", path);
      return *cached;
    }
  }
  KernelProfile p = DefaultProfile(isa);
  p.source = "defaults (a sanitizer or unoptimized build does not measure, and no profile was cached)";
  return p;
}

}  // namespace

absl::StatusOr<KernelProfile> LoadOrMeasureProfile(const std::string& path, Isa isa, ProfileFile whose,
                                                   absl::Duration lock_wait) {
  std::error_code ignored;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ignored);
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0644);
  if (fd < 0 && (errno == EROFS || errno == EACCES)) {
    // A profile pinned on a read-only mount (a Kubernetes ConfigMap): used as
    // it is, never measured over.
    const int error = errno;
    const absl::StatusOr<std::string> text = ReadOnly(path);
    if (!text.ok()) return absl::UnavailableError(absl::StrCat("cannot open ", path, ": ", std::strerror(error)));
    auto pinned = ParseProfile(*text, isa);
    if (!pinned.ok()) {
      return absl::UnavailableError(
          absl::StrCat(path, " is read-only and not a profile for this CPU: ", pinned.status().message()));
    }
    pinned->source = absl::StrCat("pinned in ", path, " (read-only)");
    return pinned;
  }
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { close(fd); }  // also drops the lock
  } closer{fd};
  if (const int error = LockWithin(fd, LOCK_EX, lock_wait); error != 0) {
    if (error != ETIMEDOUT)
      return absl::UnavailableError(absl::StrCat("cannot lock ", path, ": ", std::strerror(error)));
    const std::string held =
        absl::StrCat(path, " stayed locked by another process for ", absl::FormatDuration(lock_wait));
    if (whose == ProfileFile::kChosen) {  // pinned by an operator: used as written, never measured instead
      COLIBRI_ASSIGN_OR_RETURN(const std::string text, common::ReadSmallFd(fd, path, kMaxProfileBytes));
      auto pinned = ParseProfile(text, isa);
      if (!pinned.ok()) {
        return absl::UnavailableError(absl::StrCat(
            held, " and, read without the lock, is not a profile for this CPU: ", pinned.status().message()));
      }
      pinned->source = absl::StrCat("pinned in ", path, " (read without its lock: ", held, ")");
      std::fprintf(stderr, "colibri: kernel profile %s\n", pinned->source.c_str());
      return pinned;
    }
    KernelProfile profile = MeasureProfile(isa);
    profile.source = absl::StrCat("measured, not cached (", held, ")");
    std::fprintf(stderr, "colibri: kernel profile %s\n", profile.source.c_str());
    return profile;
  }
  COLIBRI_ASSIGN_OR_RETURN(const std::string text, common::ReadSmallFd(fd, path, kMaxProfileBytes));
  if (!text.empty()) {
    auto cached = ParseProfile(text, isa);
    if (cached.ok()) {
      cached->source = absl::StrCat("cached in ", path);
      return cached;
    }
    if (whose == ProfileFile::kChosen) {
      return absl::UnavailableError(absl::StrCat(path, " (COLIBRI_KERNEL_PROFILE) is not a profile for this CPU: ",
                                                 cached.status().message(), "; left as it is"));
    }
    std::fprintf(stderr, "colibri: re-measuring the kernel profile: %s: %s\n", path.c_str(),
                 std::string(cached.status().message()).c_str());
  }
  KernelProfile profile = MeasureProfile(isa);
  const std::string out = SerializeProfile(profile);
  if (ftruncate(fd, 0) != 0 || pwrite(fd, out.data(), out.size(), 0) != static_cast<ssize_t>(out.size()) ||
      fsync(fd) != 0) {
    // Measured once is enough: this process uses it, and the others measure
    // for themselves rather than read part of it.
    profile.source = absl::StrCat("measured, not cached (cannot write ", path, ": ", std::strerror(errno), ")");
    if (ftruncate(fd, 0) != 0) profile.source += "; the file may hold part of it";
    std::fprintf(stderr, "colibri: kernel profile %s\n", profile.source.c_str());
    return profile;
  }
  profile.source = absl::StrCat("measured, cached in ", path);
  return profile;
}

KernelTable ProfiledTable(const KernelProfile& profile) {
  KernelTable table = KernelsFor(profile.isa);
  for (auto [type, widen] : {std::pair{DType::kBF16, profile.bf16_widen}, std::pair{DType::kInt8, profile.int8_widen},
                             std::pair{DType::kInt4, profile.int4_widen}}) {
    const BlockKernelFn widened = WidenedKernel(profile.isa, type);
    if (!widen || widened == nullptr) continue;
    table.block[static_cast<int>(type)] = widened;
    // A widened int8/int4 type keeps its activations in f32: its tiles are
    // bf16 ones (bf16 activations), not int8 tiles (int8 activations). bf16
    // reads x.bf16 either way and keeps its AMX tiles.
    if (type != DType::kBF16) table.tile[static_cast<int>(type)] = nullptr;
  }
  return table;
}

std::string DescribeProfile(const KernelProfile& p) {
  auto rows = [](int64_t n) { return n > 0 ? absl::StrCat("from ", n, " rows") : std::string("never"); };
  // A tile threshold, and the one with records where it differs.
  auto tile_rows = [&](int64_t n, int64_t with_records) {
    if (with_records == n) return rows(n);
    return absl::StrCat(rows(n), " (", with_records > 0 ? absl::StrCat(with_records) : "never", " with records)");
  };
  const KernelTable table = ProfiledTable(p);
  auto kernel = [&](DType type, bool widen, const char* instruction) {
    if (p.isa == Isa::kScalar) return "scalar";
    return WidenedKernel(p.isa, type) != nullptr && !widen ? instruction : "widened to f32 + FMA";
  };
  auto tiles = [&](DType type) {
    if (table.TileFor(type) == nullptr) return "bf16 tiles ";
    return p.isa == Isa::kAvx512Amx ? "AMX int8 tiles " : "int8 tiles ";
  };
  std::string amx;
  if (table.TileFor(DType::kBF16) != nullptr) {
    amx = absl::StrCat("; bf16 on AMX tiles ", rows(p.bf16_tile_min_tokens));
  } else if (p.isa == SelectedIsa()) {  // a profile of another ISA (a test's) says nothing about AMX here
    amx = absl::StrCat("; AMX tiles not available: ", AmxAbsence());
  }
  return absl::StrCat(
      IsaName(p.isa), ": bf16 ", kernel(DType::kBF16, p.bf16_widen, "vdpbf16ps"), ", int8 ",
      kernel(DType::kInt8, p.int8_widen, "vpdpbusd"), ", int4 ", kernel(DType::kInt4, p.int4_widen, "vpdpbusd"),
      "; oneDNN ", rows(p.onednn_min_tokens), amx, "; int8 on ", tiles(DType::kInt8),
      tile_rows(p.int8_tile_min_tokens, p.int8_records_tile_min_tokens), ", int4 on ", tiles(DType::kInt4),
      tile_rows(p.int4_tile_min_tokens, p.int4_records_tile_min_tokens), "; ", p.source);
}

KernelProfile DefaultProfile(Isa isa) {
  KernelProfile p;
  p.isa = isa;
  const bool vnni = isa >= Isa::kAvx512Bf16;
  // The int8 vpdpbusd kernel adds the activations' int8 rounding to int8's
  // ~0.5% and was within 10% of widening on the Mixtral-shaped layer where
  // we measured it (AMD Zen 5): it is chosen only where it wins clearly.
  // The thresholds are the break-even points measured for the default
  // kernels on a Mixtral-shaped expert: bf16 tiles for int8 (widened), and
  // for int4 int8 tiles with VNNI, else bf16 ones.
  p.int8_widen = vnni;  // so int8 takes bf16 tiles (ProfiledTable)
  p.int8_tile_min_tokens = 12;
  p.int4_tile_min_tokens = vnni ? 16 : 4;
  // Records are never measured here: the same thresholds.
  p.int8_records_tile_min_tokens = p.int8_tile_min_tokens;
  p.int4_records_tile_min_tokens = p.int4_tile_min_tokens;
  // AMX tiles from one full tile of tokens (16 rows); the measured profile
  // replaces it with where they win on the machine.
  p.bf16_tile_min_tokens = isa == Isa::kAvx512Amx ? 16 : 0;
  p.source = "defaults";
  return p;
}

std::string MatmulWidthDependence(MatmulFn matmul, DType type, int64_t cols, absl::Span<const int64_t> token_counts) {
  constexpr int64_t kBlocks = 16;
  constexpr int64_t kRuns[] = {1, 2, 3, 5, 5};  // blocks per run, in order: the 16 again
  const int64_t width = kBlocks * common::kBlockRows;
  uint32_t seed = 7;
  const SynthMatrix w = Encode(type, width, cols, seed);
  for (const int64_t tokens : token_counts) {
    std::vector<float> x(tokens * cols);
    std::vector<uint16_t> x_bf16(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      seed ^= seed << 13, seed ^= seed >> 17, seed ^= seed << 5;
      x[i] = static_cast<float>(seed >> 8) * (1.f / 16777216.f) - 0.5f;
      x_bf16[i] = common::FloatToBf16(x[i]);
    }
    const void* src = type == DType::kBF16 ? static_cast<const void*>(x_bf16.data()) : x.data();
    std::vector<float> whole(tokens * width), runs(tokens * width);
    matmul(type, tokens, cols, width, src, w.view.data, whole.data(), width);
    int64_t b0 = 0;
    for (const int64_t blocks : kRuns) {
      matmul(type, tokens, cols, blocks * common::kBlockRows, src, w.view.data + b0 * w.view.layout.block_bytes,
             runs.data() + b0 * common::kBlockRows, width);
      b0 += blocks;
    }
    for (size_t i = 0; i < whole.size(); ++i) {
      if (std::memcmp(&whole[i], &runs[i], sizeof(float)) != 0) {
        return absl::StrFormat(
            "%s, %d tokens, %d inputs: output [%d][%d] is %a in one run of %d blocks, %a in runs of "
            "1, 2, 3, 5 and 5 blocks",
            common::DTypeName(type), tokens, cols, i / width, i % width, whole[i], kBlocks, runs[i]);
      }
    }
  }
  return "";
}

KernelProfile MeasureProfile(Isa isa) {
  const auto start = std::chrono::steady_clock::now();
  KernelProfile profile = DefaultProfile(isa);
  profile.source = "measured";
  if (isa == Isa::kScalar) return profile;               // one implementation of everything
  auto pool = ThreadPool::Create({1, -1, false, true});  // the measuring thread runs the jobs itself
  if (!pool.ok()) {
    profile.source = absl::StrCat("defaults (no thread for measuring: ", pool.status().message(), ")");
    return profile;
  }
  uint32_t seed = 2024;
  ExecutorOptions hand;  // hand-written block kernels only
  const KernelTable dot_table = KernelsFor(isa);
  hand.onednn_min_tokens = hand.bf16_tile_min_tokens = hand.int8_tile_min_tokens = hand.int4_tile_min_tokens = 0;

  // Where vdpbf16ps / vpdpbusd kernels exist, each against widening the
  // weights to f32 + FMA, on a large expert: bf16 at 32 rows (it also runs
  // the int8/int4 tiles and long prompts), int8/int4 at 1 and 8 rows
  // together (decode, below their tile thresholds). The default stays unless
  // the other takes under 90% of its time.
  {
    Timer large(pool->get(), kLargeDim, /*from_memory=*/true);
    struct Pair {
      DType type;
      std::vector<int64_t> rows;
      const char* dot_name;
      bool* widen;
    };
    for (const Pair& c : {Pair{DType::kBF16, {32}, "vdpbf16ps", &profile.bf16_widen},
                          Pair{DType::kInt8, {1, 8}, "vpdpbusd", &profile.int8_widen},
                          Pair{DType::kInt4, {1, 8}, "vpdpbusd", &profile.int4_widen}}) {
      const BlockKernelFn widened_kernel = WidenedKernel(isa, c.type);
      if (widened_kernel == nullptr) continue;
      const auto expert = MakeExpert(c.type, kLargeDim, seed);
      KernelTable widened = dot_table;
      widened.block[static_cast<int>(c.type)] = widened_kernel;
      ExecutorOptions dot = hand, fma = hand;
      dot.kernels = &dot_table;
      fma.kernels = &widened;
      double dot_ms = 0, fma_ms = 0;
      for (int64_t rows : c.rows) {
        const auto [d, f] = large.Compare(expert->weights, rows, dot, fma);
        dot_ms += d, fma_ms += f;
      }
      *c.widen = *c.widen ? !(dot_ms < kMargin * fma_ms) : fma_ms < kMargin * dot_ms;
      profile.evidence.push_back(absl::StrFormat("%s block %dx%d rows=%s: %s %.3f ms, widened+fma %.3f ms",
                                                 common::DTypeName(c.type), kLargeDim, kLargeDim,
                                                 absl::StrJoin(c.rows, "+"), c.dot_name, dot_ms, fma_ms));
    }
  }
  Timer timer(pool->get(), kSmallDim);
  const auto bf16 = MakeExpert(DType::kBF16, kSmallDim, seed);
  const auto int8 = MakeExpert(DType::kInt8, kSmallDim, seed);
  const auto int4 = MakeExpert(DType::kInt4, kSmallDim, seed);
  const KernelTable chosen = ProfiledTable(profile);
  hand.kernels = &chosen;

  // bf16 on AMX tiles against its block kernel, on the large expert streamed
  // from memory (as a prefill reads it); oneDNN is then timed against the
  // faster of the two.
  if (chosen.TileFor(DType::kBF16) != nullptr) {
    Timer large(pool->get(), kLargeDim, /*from_memory=*/true);
    const auto expert = MakeExpert(DType::kBF16, kLargeDim, seed);
    ExecutorOptions amx = hand;
    amx.bf16_tile_min_tokens = 1;
    profile.bf16_tile_min_tokens =
        MeasureThreshold(large, expert->weights, hand, amx, absl::StrFormat("bf16 %dx%d", kLargeDim, kLargeDim),
                         "own kernel", "AMX tiles", &profile, kStreamedRows);
    hand.bf16_tile_min_tokens = profile.bf16_tile_min_tokens;
  }

  // bf16 (and f32) through oneDNN from some number of rows, where its bits
  // do not depend on how the executor's chunks cut the outputs.
  std::string width_dependence;  // why not, if not: the first reason found
  for (DType type : {DType::kBF16, DType::kF32}) {
    if (!width_dependence.empty()) break;
    if (!OnednnMatmulAvailable(type)) {
      width_dependence = absl::StrCat("oneDNN has no optimized ", common::DTypeName(type), " matmul on this CPU");
    } else if (std::string d = MatmulWidthDependence(OnednnMatmul, type, kSmallDim, kRows); !d.empty()) {
      width_dependence = absl::StrCat("its bits depend on the width of a run (", d, ")");
    }
  }
  if (width_dependence.empty()) {
    ExecutorOptions onednn = hand;
    onednn.onednn_min_tokens = 1;
    profile.onednn_min_tokens =
        MeasureThreshold(timer, bf16->weights, hand, onednn, "bf16 matmul", "hand-written", "oneDNN", &profile);
  } else {
    profile.onednn_min_tokens = 0;
    profile.evidence.push_back(absl::StrCat("oneDNN not used: ", width_dependence));
  }

  // int8 / int4: their own kernels against tiles. bf16 tiles (dequantized)
  // on the small expert; int8 tiles on the large one, streamed from memory as
  // in a real layer: repacking reads 64 rows across, which costs there what
  // it does not in cache (in cache they win from 8 rows, streamed from ~16).
  for (DType type : {DType::kInt8, DType::kInt4}) {
    ExecutorOptions tiles = hand;
    (type == DType::kInt8 ? tiles.int8_tile_min_tokens : tiles.int4_tile_min_tokens) = 1;
    int64_t threshold = 0;
    int64_t records_threshold = 0;
    if (chosen.TileFor(type) != nullptr) {
      Timer large(pool->get(), kLargeDim, /*from_memory=*/true);
      const auto expert = MakeExpert(type, kLargeDim, seed);
      const std::string what = absl::StrFormat("%s %dx%d", common::DTypeName(type), kLargeDim, kLargeDim);
      const char* tile_name = isa == Isa::kAvx512Amx ? "AMX int8 tiles" : "int8 tiles";
      threshold =
          MeasureThreshold(large, expert->weights, hand, tiles, what, "own kernel", tile_name, &profile, kStreamedRows);
      // Again with the expert's records built: the tiles then read them in place.
      const absl::Status built = AttachQ8Records(&expert->weights, chosen, {});
      if (built.ok()) {
        records_threshold = MeasureThreshold(large, expert->weights, hand, tiles, what + " with records", "own kernel",
                                             tile_name, &profile, kStreamedRows);
      } else {
        records_threshold = threshold;
        profile.evidence.push_back(absl::StrCat(what, " with records: not measured (", built.message(), ")"));
      }
    } else {
      const auto& expert = type == DType::kInt8 ? int8 : int4;
      threshold = MeasureThreshold(timer, expert->weights, hand, tiles, common::DTypeName(type), "own kernel",
                                   "bf16 tiles", &profile);
      records_threshold = threshold;  // no int8 tiles: no records
    }
    (type == DType::kInt8 ? profile.int8_tile_min_tokens : profile.int4_tile_min_tokens) = threshold;
    (type == DType::kInt8 ? profile.int8_records_tile_min_tokens : profile.int4_records_tile_min_tokens) =
        records_threshold;
  }
  profile.evidence.push_back(absl::StrFormat(
      "measured in %.2f s%s", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
      HasClflushopt() ? "" : " (the large expert not flushed from the caches between runs: no CLFLUSHOPT)"));
  return profile;
}

std::string SerializeProfile(const KernelProfile& p) {
  std::string out = absl::StrCat(
      "isa ", IsaName(p.isa), "\nbf16_widen ", p.bf16_widen ? 1 : 0, "\nint8_widen ", p.int8_widen ? 1 : 0,
      "\nint4_widen ", p.int4_widen ? 1 : 0, "\nonednn_min_tokens ", p.onednn_min_tokens, "\nbf16_tile_min_tokens ",
      p.bf16_tile_min_tokens, "\nint8_tile_min_tokens ", p.int8_tile_min_tokens, "\nint4_tile_min_tokens ",
      p.int4_tile_min_tokens, "\nint8_records_tile_min_tokens ", p.int8_records_tile_min_tokens,
      "\nint4_records_tile_min_tokens ", p.int4_records_tile_min_tokens, "\n");
  for (const std::string& line : p.evidence) absl::StrAppend(&out, "evidence ", line, "\n");
  return out;
}

std::string ProfileChoices(const KernelProfile& p) {
  KernelProfile choices = p;
  choices.evidence.clear();
  const std::string text = SerializeProfile(choices);
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  return absl::StrJoin(lines, ", ");
}

absl::StatusOr<KernelProfile> ParseProfile(const std::string& text, Isa isa) {
  KernelProfile p = DefaultProfile(isa);
  p.source = "parsed";
  int found = 0;
  int line_number = 0;
  std::optional<int64_t> int8_records, int4_records;  // optional keys
  std::set<std::string> seen;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_number;
    // A file written by hand may end its lines in "\r\n" or spaces.
    const absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty()) continue;
    const std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(line, absl::MaxSplits(' ', 1));
    const std::string key(kv.first);
    const std::string value(absl::StripAsciiWhitespace(kv.second));
    auto bad = [&] { return absl::InvalidArgumentError(absl::StrCat("line ", line_number, " '", line, "'")); };
    int64_t number = 0;
    if (key == "evidence") {
      p.evidence.push_back(value);
    } else if (!seen.insert(key).second) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_number, " '", line, "': a second ", key));
    } else if (key == "isa") {
      if (value != IsaName(isa)) {
        return absl::InvalidArgumentError(absl::StrCat("profile of ISA ", value, ", not ", IsaName(isa)));
      }
      ++found;
    } else if (!absl::SimpleAtoi(value, &number) || number < 0) {
      return bad();
    } else if ((key == "bf16_widen" || key == "int8_widen" || key == "int4_widen") && number <= 1) {
      const DType type = key == "bf16_widen" ? DType::kBF16 : key == "int8_widen" ? DType::kInt8 : DType::kInt4;
      if (number == 1 && WidenedKernel(isa, type) == nullptr) return bad();  // nothing to replace there
      (type == DType::kBF16 ? p.bf16_widen : type == DType::kInt8 ? p.int8_widen : p.int4_widen) = number == 1;
      ++found;
    } else if (key == "onednn_min_tokens") {
      p.onednn_min_tokens = number, ++found;
    } else if (key == "bf16_tile_min_tokens") {
      if (number > 0 && KernelsFor(isa).TileFor(DType::kBF16) == nullptr) return bad();  // no bf16 tiles there
      p.bf16_tile_min_tokens = number, ++found;
    } else if (key == "int8_tile_min_tokens") {
      p.int8_tile_min_tokens = number, ++found;
    } else if (key == "int4_tile_min_tokens") {
      p.int4_tile_min_tokens = number, ++found;
    } else if (key == "int8_records_tile_min_tokens") {
      int8_records = number;
    } else if (key == "int4_records_tile_min_tokens") {
      int4_records = number;
    } else {
      return bad();
    }
  }
  if (found != 8) return absl::InvalidArgumentError("incomplete: needs isa, three *_widen and four thresholds");
  // A profile written before records had thresholds of their own: theirs are the others.
  p.int8_records_tile_min_tokens = int8_records.value_or(p.int8_tile_min_tokens);
  p.int4_records_tile_min_tokens = int4_records.value_or(p.int4_tile_min_tokens);
  return p;
}

std::string CpuSignature() {
  uint32_t a = 0, b = 0, c = 0, d = 0;
  __get_cpuid(0, &a, &b, &c, &d);
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  __get_cpuid(1, &a, &b, &c, &d);
  const uint32_t base_family = (a >> 8) & 0xf, family = base_family + (base_family == 0xf ? (a >> 20) & 0xff : 0);
  const uint32_t model = ((a >> 4) & 0xf) | (base_family >= 6 ? ((a >> 16) & 0xf) << 4 : 0);
  return absl::StrCat(vendor, "-", family, "-", model, "-", a & 0xf);
}

const KernelProfile& SelectedProfile() {
  static const KernelProfile selected = [] {
    const Isa isa = SelectedIsa();
    const auto [path, whose] = ProfilePath();
    if (path == "off") {
      KernelProfile p = DefaultProfile(isa);
      p.source = "defaults (COLIBRI_KERNEL_PROFILE=off)";
      return p;
    }
    if (!kTimingBuild) return CachedOrDefaultProfile(path, isa);
    absl::Status why = absl::UnavailableError("neither HOME nor XDG_CACHE_HOME is set");
    if (!path.empty()) {
      auto loaded = LoadOrMeasureProfile(path, isa, whose);
      if (loaded.ok()) return *loaded;
      why = loaded.status();
    }
    KernelProfile p = MeasureProfile(isa);
    p.source = absl::StrCat("measured, not cached (", why.message(), ")");
    std::fprintf(stderr, "colibri: kernel profile %s; set COLIBRI_KERNEL_PROFILE to a writable file\n",
                 p.source.c_str());
    return p;
  }();
  return selected;
}

}  // namespace kernels
}  // namespace colibri
