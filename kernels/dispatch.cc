#include "kernels/dispatch.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/weight_matrix.h"
#include "kernels/fault_guard.h"
#include "kernels/kernel_profile.h"

namespace colibri {
namespace kernels {
namespace {

using common::DType;

uint64_t Xgetbv() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t{edx} << 32) | eax;
}

// Linux hands the AMX tile data state (8 KiB a thread) only to processes
// that ask for it (5.16 and later); without it the first tile instruction
// faults. Asked once, for the whole process; a refusal is said once.
bool AmxTilesGranted() {
  constexpr long kArchReqXcompPerm = 0x1023;  // <asm/prctl.h>
  constexpr long kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0) return true;
  std::fprintf(stderr,
               "colibri: the CPU has AMX but the kernel refused its tile state (arch_prctl "
               "ARCH_REQ_XCOMP_PERM: %s); using avx512_bf16\n",
               std::strerror(errno));
  return false;
}

// Whether a self-check's `out` equals `expected` bit for bit; else the first
// difference on stderr.
bool Agrees(const std::string& type, const std::vector<float>& out, const std::vector<float>& expected,
            const char* expected_name) {
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == expected[i]) continue;
    std::fprintf(stderr, "colibri: the %s tile kernel's self-check failed (token %ld, output %ld: %.9g, %s %.9g)\n",
                 type.c_str(), static_cast<long>(i / common::kBlockRows), static_cast<long>(i % common::kBlockRows),
                 out[i], expected_name, expected[i]);
    return false;
  }
  return true;
}

}  // namespace

// The AMX kernels cannot run on the machines they are developed on (their
// walks are tested on emulated tiles): DetectIsa runs these self-checks
// before a process uses them, from its own initialization, so they call no
// function that asks DetectIsa() (KernelsFor, HasAvxVnni, SelectedIsa).
bool Bf16TileSelfCheck(TileKernelFn tile) {
  using common::kBlockRows;
  // 47 tokens: two full groups of 16 and one of 15 (the tiles reconfigured
  // between passes); 2176 inputs: three chunks of the walk, the last a short
  // one (kernels/tile_bf16_amx.h), so the partial sums go through `out` on
  // the hardware too. Integers of at most 5 · 2 · 2176 in every sum: exact
  // in any order the hardware adds them.
  constexpr int64_t kCols = 2176, kTokens = 47;
  const common::MatrixLayout layout = common::ComputeMatrixLayout(DType::kBF16, kBlockRows, kCols);
  std::vector<float> w(kBlockRows * kCols), x(kTokens * kCols);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(static_cast<int>(i * 7 % 5) - 2);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i * 3 % 11) - 5);
  std::vector<uint8_t> data(layout.block_bytes);
  common::EncodeBlock(layout, w.data(), 0, data.data(), nullptr, nullptr);
  std::vector<uint16_t> x_bf16(x.size());
  for (size_t i = 0; i < x.size(); ++i) x_bf16[i] = common::FloatToBf16(x[i]);
  Activations acts;
  acts.num_tokens = kTokens;
  acts.cols = kCols;
  acts.bf16 = x_bf16.data();
  std::vector<float> out(kTokens * kBlockRows), expected(kTokens * kBlockRows);
  tile(common::MatrixView{layout, data.data(), nullptr, nullptr}, 0, acts, nullptr, out.data());
  for (int64_t t = 0; t < kTokens; ++t) {
    for (int64_t j = 0; j < kBlockRows; ++j) {
      float& sum = expected[t * kBlockRows + j];
      for (int64_t k = 0; k < kCols; ++k) sum += w[j * kCols + k] * x[t * kCols + k];
    }
  }
  return Agrees("bf16", out, expected, "expected");
}

bool Q8TileSelfCheck(DType type, TileKernelFn tile) {
  using common::kBlockRows;
  // 33 groups: two repacked chunks.
  constexpr int64_t kCols = 33 * 64, kTokens = 47, kGroups = kCols / 64;
  const common::MatrixLayout layout = common::ComputeMatrixLayout(type, kBlockRows, kCols);
  std::vector<float> w(kBlockRows * kCols), x(kTokens * kCols);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(static_cast<int>(i * 7919 % 255) - 127) / 64.f;
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i * 104729 % 201) - 100) / 32.f;
  std::vector<uint8_t> data(layout.data_bytes), zeros(layout.zero_bytes);
  std::vector<float> scales(layout.scale_bytes / sizeof(float));
  common::EncodeBlock(layout, w.data(), 0, data.data(), scales.data(), zeros.data());
  std::vector<int8_t> q8(x.size());
  std::vector<float> q8_scales(kTokens * kGroups), q8_sums(kTokens * kGroups);
  for (int64_t g = 0; g < kTokens * kGroups; ++g) QuantizeGroupQ8(&x[g * 64], &q8[g * 64], &q8_scales[g], &q8_sums[g]);
  Activations acts;
  acts.num_tokens = kTokens;
  acts.cols = kCols;
  acts.f32 = x.data();
  acts.q8 = q8.data();
  acts.q8_scales = q8_scales.data();
  acts.q8_sums = q8_sums.data();
  const common::MatrixView view{layout, data.data(), scales.data(), zeros.data()};
  struct alignas(64) Line {
    uint8_t bytes[64];
  };
  std::vector<Line> scratch(TileQ8ScratchBytes(kCols) / sizeof(Line));
  std::vector<float> out(kTokens * kBlockRows), expected(kTokens * kBlockRows);
  tile(view, 0, acts, scratch[0].bytes, out.data());
  // Not KernelsFor(): DetectIsa() runs this while it initializes, and the
  // tables ask DetectIsa() (HasAvxVnni); nothing here may.
  (type == DType::kInt4 ? TileInt4Vnni : TileInt8Vnni)(view, 0, acts, scratch[0].bytes, expected.data());
  return Agrees(common::DTypeName(type), out, expected, "the VNNI tiles'");
}

namespace {

KernelTable MakeTable(Isa isa) {
  KernelTable t;
  t.isa = isa;
  auto set = [&](DType type, BlockKernelFn fn) { t.block[static_cast<int>(type)] = fn; };
  switch (isa) {
    case Isa::kScalar:
      t.swiglu = SwiGluScalar;
      t.dequant_bf16 = DequantBf16Scalar;
      set(DType::kF32, BlockF32Scalar);
      set(DType::kBF16, BlockBf16Scalar);
      set(DType::kF16, BlockF16Scalar);
      set(DType::kInt8, BlockInt8Scalar);
      set(DType::kInt4, BlockInt4Scalar);
      break;
    case Isa::kAvx2:
      t.swiglu = SwiGluAvx2;
      t.dequant_bf16 = DequantBf16Avx2;
      set(DType::kF32, BlockF32Avx2);
      set(DType::kBF16, BlockBf16Avx2);
      set(DType::kF16, BlockF16Avx2);
      set(DType::kInt8, HasAvxVnni() ? BlockInt8Avx2Vnni : BlockInt8Avx2);
      set(DType::kInt4, HasAvxVnni() ? BlockInt4Avx2Vnni : BlockInt4Avx2);
      break;
    case Isa::kAvx512:
    case Isa::kAvx512Bf16:
    case Isa::kAvx512Amx: {
      const bool dot = isa >= Isa::kAvx512Bf16;  // vdpbf16ps and vpdpbusd
      t.swiglu = SwiGluAvx512;
      t.dequant_bf16 = DequantBf16Avx512;
      set(DType::kF32, BlockF32Avx512);
      set(DType::kBF16, dot ? BlockBf16Avx512Bf16 : BlockBf16Avx512);
      set(DType::kF16, BlockF16Avx512);
      set(DType::kInt8, dot ? BlockInt8Avx512Vnni : BlockInt8Avx512);
      set(DType::kInt4, dot ? BlockInt4Avx512Vnni : BlockInt4Avx512);
      if (dot) {
        t.tile[static_cast<int>(DType::kInt8)] = TileInt8Vnni;
        t.tile[static_cast<int>(DType::kInt4)] = TileInt4Vnni;
      }
      if (isa == Isa::kAvx512Amx) {
        t.tile[static_cast<int>(DType::kBF16)] = TileBf16Amx;
        t.tile[static_cast<int>(DType::kInt8)] = TileInt8Amx;
        t.tile[static_cast<int>(DType::kInt4)] = TileInt4Amx;
      }
      break;
    }
  }
  return t;
}

}  // namespace

std::string IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAvx512Amx: return "avx512_amx";
  }
  return "unknown";
}

absl::StatusOr<Isa> ParseIsa(const std::string& name) {
  const std::string lower = absl::AsciiStrToLower(absl::StripAsciiWhitespace(name));
  for (Isa isa : kIsas) {
    if (lower == IsaName(isa)) return isa;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown ISA '", name, "' (expected scalar, avx2, avx512, avx512_bf16 or avx512_amx)"));
}

namespace {

// COLIBRI_MAX_ISA, read once; an unknown name is ignored, said on stderr.
std::optional<Isa> IsaCap() {
  static const std::optional<Isa> cap = []() -> std::optional<Isa> {
    const char* name = std::getenv("COLIBRI_MAX_ISA");
    if (name == nullptr || *name == '\0') return std::nullopt;
    absl::StatusOr<Isa> parsed = ParseIsa(name);
    if (parsed.ok()) return *parsed;
    std::fprintf(stderr, "colibri: ignoring COLIBRI_MAX_ISA: %s\n", std::string(parsed.status().message()).c_str());
    return std::nullopt;
  }();
  return cap;
}

// What DetectIsa found, once: the ISA and, below avx512_amx, why the AMX
// tile kernels are not used.
struct Detection {
  Isa isa = Isa::kScalar;
  std::string no_amx;
  bool cpu_amx = false;  // the CPU has AMX (used or not)
};

Detection Detect() {
  uint32_t a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return {Isa::kScalar, "the CPU has no cpuid leaf 1"};
  const bool osxsave = c & bit_OSXSAVE, fma = c & bit_FMA, f16c = c & bit_F16C, avx = c & bit_AVX;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return {Isa::kScalar, "the CPU has no cpuid leaf 7"};
  // d: leaf 7 subleaf 0. AMX-BF16 is bit 22, AMX-TILE bit 24, AMX-INT8 bit 25.
  const bool cpu_amx = (d & (1u << 22)) && (d & (1u << 24)) && (d & (1u << 25));
  // A level without AMX: `reason` where the CPU has AMX, else that it has none.
  auto below = [cpu_amx](Isa isa, const char* reason) {
    return Detection{isa, cpu_amx ? reason : "the CPU has no AMX", cpu_amx};
  };
  if (!osxsave || !avx) return below(Isa::kScalar, "the OS does not enable AVX");
  const uint64_t xcr0 = Xgetbv();
  const bool ymm_state = (xcr0 & 0x6) == 0x6, zmm_state = (xcr0 & 0xe6) == 0xe6;
  const bool avx2 = b & bit_AVX2;
  const bool avx512 = (b & bit_AVX512F) && (b & bit_AVX512BW) && (b & bit_AVX512VL) && (b & bit_AVX512DQ);
  if (!(ymm_state && avx2 && fma && f16c)) return below(Isa::kScalar, "AVX2 is not usable here");
  if (!(zmm_state && avx512)) return below(Isa::kAvx2, "AVX-512 is not usable here");
  uint32_t a1 = 0, b1, c1, d1;
  __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
  const bool avx512_bf16 = a1 & (1u << 5), avx512_vnni = c & bit_AVX512VNNI;  // c: leaf 7 subleaf 0
  if (!(avx512_bf16 && avx512_vnni)) {
    return below(Isa::kAvx512, "the CPU has AMX but not AVX512_BF16 and AVX512_VNNI");
  }
  if (!cpu_amx) return below(Isa::kAvx512Bf16, "");
  // Capped below AMX: no tile state is asked for and no tile instruction runs.
  if (const std::optional<Isa> cap = IsaCap(); cap.has_value() && *cap < Isa::kAvx512Amx) {
    return {Isa::kAvx512Bf16, absl::StrCat("not probed: COLIBRI_MAX_ISA caps the kernels at ", IsaName(*cap)), true};
  }
  // XCR0 bits 17 and 18: the tile configuration and data the OS saves.
  if ((xcr0 & (3u << 17)) != (3u << 17)) {
    return {Isa::kAvx512Bf16, "the OS does not enable the AMX state (XCR0)", true};
  }
  if (!AmxTilesGranted()) return {Isa::kAvx512Bf16, "Linux refused the tile state (arch_prctl)", true};
  // Run where a tile instruction the CPU or the OS refuses (never seen on
  // the machines these kernels were written on) is a failed check, not a
  // process killed at start-up.
  bool passed = false;
  const int fault = RunCatchingFaults(
      [] {
        return Bf16TileSelfCheck(TileBf16Amx) && Q8TileSelfCheck(DType::kInt8, TileInt8Amx) &&
               Q8TileSelfCheck(DType::kInt4, TileInt4Amx);
      },
      &passed);
  if (fault != 0) {
    bool released = false;
    RunCatchingFaults(
        [] {
          ReleaseTilesAmx();
          return true;
        },
        &released);  // the tile state a fault left
    std::fprintf(stderr,
                 "colibri: a tile kernel's self-check crashed (signal %d): not using the AMX tile kernels; "
                 "using avx512_bf16\n",
                 fault);
    return {Isa::kAvx512Bf16, absl::StrCat("a tile kernel's start-up self-check crashed (signal ", fault, ")"), true};
  }
  if (!passed) {
    std::fprintf(stderr, "colibri: not using the AMX tile kernels; using avx512_bf16\n");
    return {Isa::kAvx512Bf16, "a tile kernel's start-up self-check failed", true};
  }
  return {Isa::kAvx512Amx, "", true};
}

const Detection& Detected() {
  static const Detection detected = Detect();
  return detected;
}

}  // namespace

Isa DetectIsa() { return Detected().isa; }

std::string AmxAbsence() {
  if (SelectedIsa() == Isa::kAvx512Amx) return "";
  if (!Detected().no_amx.empty()) return Detected().no_amx;
  return absl::StrCat("COLIBRI_MAX_ISA caps the kernels at ", IsaName(SelectedIsa()));
}

bool HasAvxVnni() {
  static const bool has = [] {
    if (DetectIsa() < Isa::kAvx2) return false;  // AVX2 and the ymm state checked there
    uint32_t a = 0, b, c, d;
    __get_cpuid_count(7, 1, &a, &b, &c, &d);
    return (a & (1u << 4)) != 0;  // leaf 7 subleaf 1, eax bit 4: AVX-VNNI
  }();
  return has;
}

bool ReadsQ8(BlockKernelFn fn) {
  return fn == BlockInt8Avx512Vnni || fn == BlockInt4Avx512Vnni || fn == BlockInt8Avx2Vnni || fn == BlockInt4Avx2Vnni;
}

BlockKernelFn WidenedKernel(Isa isa, DType type) {
  const BlockKernelFn own = KernelsFor(isa).For(type);
  switch (isa) {
    case Isa::kAvx2:
      if (own == BlockInt8Avx2Vnni) return BlockInt8Avx2;
      if (own == BlockInt4Avx2Vnni) return BlockInt4Avx2;
      return nullptr;
    case Isa::kAvx512Bf16:
    case Isa::kAvx512Amx:
      if (type == DType::kBF16 || type == DType::kInt8 || type == DType::kInt4)
        return KernelsFor(Isa::kAvx512).For(type);
      return nullptr;
    default: return nullptr;
  }
}

const KernelTable& KernelsFor(Isa isa) {
  static const KernelTable tables[] = {MakeTable(Isa::kScalar), MakeTable(Isa::kAvx2), MakeTable(Isa::kAvx512),
                                       MakeTable(Isa::kAvx512Bf16), MakeTable(Isa::kAvx512Amx)};
  return tables[static_cast<int>(isa)];
}

Isa SelectedIsa() {
  static const Isa selected = std::min(DetectIsa(), IsaCap().value_or(Isa::kAvx512Amx));
  return selected;
}

bool KeepOneDnnOffAmx() { return Detected().cpu_amx && SelectedIsa() < Isa::kAvx512Amx; }

const KernelTable& SelectedKernels() {
  static const KernelTable selected = ProfiledTable(SelectedProfile());
  return selected;
}

}  // namespace kernels
}  // namespace colibri
