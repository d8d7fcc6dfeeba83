#ifndef COLIBRI_KERNELS_DISPATCH_H_
#define COLIBRI_KERNELS_DISPATCH_H_

// Runtime ISA dispatch: one binary runs on AVX2-only and AVX-512 machines.
// The CPU's best ISA comes from cpuid (and the OS's xgetbv); the environment
// variable COLIBRI_MAX_ISA=scalar|avx2|avx512|avx512_bf16|avx512_amx caps it, so every
// variant can be tested on one machine. AVX-VNNI is a feature of the avx2
// table, not a level (many AVX-512 CPUs lack it): HasAvxVnni(). Tables are
// immutable; thread-safe.

#include <string>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "kernels/block_kernel.h"
#include "kernels/dequant.h"
#include "kernels/swiglu.h"

namespace colibri {
namespace kernels {

// Ordered: a higher ISA implies every lower one.
// kAvx512Bf16: AVX-512 F/BW/VL/DQ plus AVX512_BF16 and AVX512_VNNI (every CPU
// with the first has the second: Cooper Lake, Sapphire Rapids, Zen 4 and later).
// kAvx512Amx: that plus AMX-TILE and AMX-BF16 (Sapphire Rapids and later),
// with the tile state enabled by the OS and granted to this process.
enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAvx512Amx = 4 };
inline constexpr Isa kIsas[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAvx512Amx};

std::string IsaName(Isa isa);                           // "scalar", "avx2", ...
absl::StatusOr<Isa> ParseIsa(const std::string& name);  // INVALID_ARGUMENT naming it

// The best ISA this CPU and OS support. Where the CPU has AMX, the first
// call asks Linux for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM,
// process-wide) and runs the AMX tile kernels' self-checks below; where
// either fails it says why on stderr once and returns kAvx512Bf16. With
// COLIBRI_MAX_ISA below avx512_amx it does neither (kAvx512Bf16 at most):
// the cap also keeps the tile instructions from running at all.
Isa DetectIsa();

// Why the AMX tile kernels are not in use ("the CPU has no AMX", "Linux
// refused the tile state (arch_prctl)", a failed self-check, or
// COLIBRI_MAX_ISA); empty where SelectedIsa() is kAvx512Amx.
std::string AmxAbsence();

// Whether bf16 tile kernel `tile` multiplies one block of small integers by
// 17 tokens exactly as plain loops do (every product and sum is exact in
// f32, so any summation order must agree); the first difference is named on
// stderr.
bool Bf16TileSelfCheck(TileKernelFn tile);
// Whether int8 / int4 (`type`) tile kernel `tile` gives the VNNI tiles'
// bits (TileInt8Vnni / TileInt4Vnni) on one block of 33 input groups (two
// repacked chunks) by 17 tokens; the first difference is named on stderr.
// REQUIRES: DetectIsa() >= kAvx512Bf16.
bool Q8TileSelfCheck(common::DType type, TileKernelFn tile);

// Whether the CPU has AVX-VNNI (the VEX-encoded vpdpbusd) beside AVX2: the
// avx2 table then runs int8 and int4 weights on BlockInt8Avx2Vnni /
// BlockInt4Avx2Vnni. (Many AVX-512 CPUs lack it; the avx512 levels do not
// use it.)
bool HasAvxVnni();

// Whether block kernel `fn` multiplies the int8 copy x.q8 (the VNNI int8 and
// int4 kernels: their oracle is the scalar kernel on q8 · scale).
bool ReadsQ8(BlockKernelFn fn);

// The block kernel of `type` that widens the weights to f32 + FMA, where
// `isa`'s table runs that type on a dot-product instruction instead
// (vdpbf16ps, vpdpbusd): the alternative the kernel profile times. Null where
// there is none.
BlockKernelFn WidenedKernel(Isa isa, common::DType type);

struct KernelTable {
  Isa isa = Isa::kScalar;
  // Indexed by common::DType code; null for non-weight types.
  BlockKernelFn block[8] = {};
  SwiGluFn swiglu = nullptr;
  DequantBf16Fn dequant_bf16 = nullptr;  // int8/int4 block -> bf16 tile
  // Indexed like `block`: int8/int4 through int8 tiles where the ISA has them
  // (avx512_bf16: VNNI), else null and dequant_bf16 + the bf16 kernel serve;
  // bf16 on AMX tiles at avx512_amx, else null (no bf16 tiles).
  TileKernelFn tile[8] = {};

  BlockKernelFn For(common::DType type) const { return block[static_cast<int>(type)]; }
  TileKernelFn TileFor(common::DType type) const { return tile[static_cast<int>(type)]; }
};

// The table of `isa`. REQUIRES: isa <= DetectIsa().
const KernelTable& KernelsFor(Isa isa);

// min(DetectIsa(), COLIBRI_MAX_ISA), decided once per process. An unknown
// COLIBRI_MAX_ISA value is reported on stderr once and ignored.
Isa SelectedIsa();
// True where the CPU has AMX and this process does not use it (COLIBRI_MAX_ISA
// below avx512_amx, the tile state refused, a failed self-check): oneDNN is
// then kept off its AMX kernels too (kernels/onednn_matmul.cc). Only AMX:
// oneDNN's bf16 matmul needs AVX-512, so a lower cap does not lower it.
bool KeepOneDnnOffAmx();

// The table of SelectedIsa() with the variants the machine's kernel profile
// chose (kernels/kernel_profile.h: measured once per host, then cached).
const KernelTable& SelectedKernels();

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_DISPATCH_H_
