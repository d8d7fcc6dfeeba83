#ifndef COLIBRI_KERNELS_KERNEL_PROFILE_H_
#define COLIBRI_KERNELS_KERNEL_PROFILE_H_

// Which implementation runs where several could compute the same product,
// chosen by timing them on this machine: the bf16, int8 and int4 block kernels
// (vdpbf16ps / vpdpbusd or widening to f32 + FMA), from how many rows an expert's bf16/f32 matmuls go
// through oneDNN, from how many rows bf16 experts run on AMX tiles, and from
// how many rows int8/int4 experts run on tiles (int8 tiles with AVX512_VNNI,
// else bf16 ones).
// The fastest differs by CPU (vdpbf16ps is twice the FMA rate on AMD Zen and
// half of it on some Intel Xeons; oneDNN uses AMX tiles where they exist).
//
// The choices change the bits of results, and every process of a host must
// agree (a distributed answer equals the local one byte for byte only when
// router and nodes run the same kernels). So the profile is measured once per
// host and CPU and cached in a file that every process reads, under an
// exclusive lock while the first one measures:
//   $COLIBRI_KERNEL_PROFILE         a file path, or "off" for the built-in
//                                   defaults (no measurement)
//   else $XDG_CACHE_HOME/colibri/ or $HOME/.cache/colibri/
//        kernels-v<N>-<cpu signature>-<isa>[+avxvnni].txt (the latter at
//        the avx2 level on a CPU with AVX-VNNI)
// Where no file can be written the process measures for itself and says so
// on stderr once (processes may then disagree; point them at one file).
// A sanitizer or unoptimized (-O0) build never measures: its timings say
// nothing of the host. It reads the file if it holds a profile, else it
// uses the defaults.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "kernels/dispatch.h"

namespace colibri {
namespace kernels {

struct KernelProfile {
  Isa isa = Isa::kScalar;
  // Block kernels that widen the weights to f32 + FMA instead of the dot
  // product instructions (vdpbf16ps for bf16, vpdpbusd for int8/int4), where
  // the level has both (WidenedKernel(): avx512_bf16, and avx2 with AVX-VNNI
  // for int8/int4).
  bool bf16_widen = false;
  bool int8_widen = false;
  bool int4_widen = false;
  int64_t onednn_min_tokens = 0;     // bf16/f32 experts with at least this many rows use oneDNN; 0: never
  int64_t bf16_tile_min_tokens = 0;  // bf16 experts on AMX tiles from this many rows; 0: never
  int64_t int8_tile_min_tokens = 0;
  int64_t int4_tile_min_tokens = 0;  // int8/int4 experts on tiles from this many rows; 0: never
  // The same for experts whose int8 tile records are built (AttachQ8Records):
  // with no repacking per call, tiles can pay from fewer rows. Where the
  // kernels have no int8 tiles (no records either), equal to the above.
  int64_t int8_records_tile_min_tokens = 0;
  int64_t int4_records_tile_min_tokens = 0;
  std::string source;                 // "measured", "cached in PATH", "defaults (...)"
  std::vector<std::string> evidence;  // one line per comparison timed: what won and by how much
};

// The built-in choices for `isa` (what the measured ones replace).
KernelProfile DefaultProfile(Isa isa);

// Times the candidates on synthetic experts (one thread, the fastest of 6
// alternating runs each after a warm-up; five to seven seconds: docs/KERNELS.md)
// and keeps an alternative only where it is at least 10% faster — and, for
// a row threshold, at that row count and every larger one measured.
KernelProfile MeasureProfile(Isa isa);

// A matmul as the executor calls oneDNN (OnednnMatmul's signature).
using MatmulFn = void (*)(common::DType type, int64_t num_tokens, int64_t cols, int64_t n, const void* src,
                          const void* weights, float* dst, int64_t ldd);

// The executor hands oneDNN runs of whole 64-row blocks whose widths follow
// its chunks, and those follow the thread count and the other experts of a
// call: a node's answer equals the local engine's byte for byte only if the
// bits of an output do not depend on the width of the run it was computed in.
// Checks that for `matmul` on a synthetic `type` matrix (bf16 or f32) of
// `cols` inputs and 16 blocks of outputs, for each of `token_counts`: every
// output computed in runs of 1, 2, 3, 5 and 5 blocks equals the same output of
// one run over all 16. Returns "" if so, else what differed (type, tokens,
// the run and the first output that differed). MeasureProfile uses oneDNN
// only where this holds (tests pass a fake matmul).
std::string MatmulWidthDependence(MatmulFn matmul, common::DType type, int64_t cols,
                                  absl::Span<const int64_t> token_counts);

// The file format: "key value" lines (isa, bf16_widen, int8_widen,
// int4_widen, onednn_min_tokens, bf16_tile_min_tokens,
// int8_tile_min_tokens, int4_tile_min_tokens, int8_records_tile_min_tokens
// and int4_records_tile_min_tokens — these two optional: absent, they equal
// the int8/int4 ones — then "evidence ..." lines).
std::string SerializeProfile(const KernelProfile& profile);
// INVALID_ARGUMENT naming the bad line; a profile of another ISA is refused.
absl::StatusOr<KernelProfile> ParseProfile(const std::string& text, Isa isa);

// Whose file a profile is read from: the per-CPU cache, or one an operator
// named (COLIBRI_KERNEL_PROFILE), which is never measured over.
enum class ProfileFile { kCache, kChosen };

// Reads the profile of `isa` cached at `path`, or (no file or an empty one;
// for kCache also one that is not a profile of `isa`) measures it and writes
// it there, holding an exclusive lock on the file throughout so concurrent
// processes measure once. A file that can only be read (a read-only mount)
// is used as written if it parses as a profile of `isa`. FAILED_PRECONDITION
// naming the path where it is not a regular file or holds over 1 MiB;
// UNAVAILABLE naming it where it cannot be opened, locked or read, is
// read-only and not such a profile, or is kChosen and not such a profile
// (left as it is). A profile measured but not written is
// returned (its source says so), the file emptied. The lock is waited for
// at most `lock_wait` (measuring takes seconds; a process stopped or hung
// with the lock must not stall every other): then a kChosen file is read
// without the lock and used if it is such a profile (else UNAVAILABLE), and
// a cache's profile is measured for this process alone, the file untouched;
// a line on stderr says which.
absl::StatusOr<KernelProfile> LoadOrMeasureProfile(const std::string& path, Isa isa,
                                                   ProfileFile whose = ProfileFile::kCache,
                                                   absl::Duration lock_wait = absl::Seconds(60));

// One line for logs: "avx512_bf16: bf16 vdpbf16ps, int8 vpdpbusd, int4
// vpdpbusd; oneDNN never; int8 on int8 tiles from 64 rows (8 with records),
// int4 on int8 tiles from 16 rows (4 with records); <source>" (and "bf16 on
// AMX tiles from N rows" at avx512_amx).
std::string DescribeProfile(const KernelProfile& profile);

// The choices alone, on one line ("isa avx512_bf16, bf16_widen 0, …"): equal
// for two processes exactly when they run the same kernels (no evidence, no
// source). Nodes report it (GetNodeInfo.kernel_profile) for routers to compare.
std::string ProfileChoices(const KernelProfile& profile);

// KernelsFor(profile.isa) with the profile's choice of block kernels (a
// widened int8/int4 type also loses its int8 tiles: it takes bf16 ones).
KernelTable ProfiledTable(const KernelProfile& profile);

// The CPU's identity for the cache file name: vendor, family, model and
// stepping from cpuid, e.g. "AuthenticAMD-26-2-1".
std::string CpuSignature();

// The profile of SelectedIsa() (SelectedKernels() is its table): from the cache (measured and written the
// first time), decided once per process.
const KernelProfile& SelectedProfile();

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_KERNEL_PROFILE_H_
