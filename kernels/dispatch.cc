#include "kernels/dispatch.h"

#include <cpuid.h>

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
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
      t.swiglu = SwiGluAvx512;
      t.dequant_bf16 = DequantBf16Avx512;
      set(DType::kF32, BlockF32Avx512);
      set(DType::kBF16, isa == Isa::kAvx512Bf16 ? BlockBf16Avx512Bf16 : BlockBf16Avx512);
      set(DType::kF16, BlockF16Avx512);
      set(DType::kInt8, isa == Isa::kAvx512Bf16 ? BlockInt8Avx512Vnni : BlockInt8Avx512);
      set(DType::kInt4, isa == Isa::kAvx512Bf16 ? BlockInt4Avx512Vnni : BlockInt4Avx512);
      if (isa == Isa::kAvx512Bf16) {
        t.tile[static_cast<int>(DType::kInt8)] = TileInt8Vnni;
        t.tile[static_cast<int>(DType::kInt4)] = TileInt4Vnni;
      }
      break;
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
  }
  return "unknown";
}

absl::StatusOr<Isa> ParseIsa(const std::string& name) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (name == IsaName(isa)) return isa;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown ISA '", name, "' (expected scalar, avx2, avx512 or avx512_bf16)"));
}

Isa DetectIsa() {
  static const Isa detected = [] {
    uint32_t a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return Isa::kScalar;
    const bool osxsave = c & bit_OSXSAVE, fma = c & bit_FMA, f16c = c & bit_F16C, avx = c & bit_AVX;
    if (!osxsave || !avx) return Isa::kScalar;
    const uint64_t xcr0 = Xgetbv();
    const bool ymm_state = (xcr0 & 0x6) == 0x6, zmm_state = (xcr0 & 0xe6) == 0xe6;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return Isa::kScalar;
    const bool avx2 = b & bit_AVX2;
    const bool avx512 = (b & bit_AVX512F) && (b & bit_AVX512BW) && (b & bit_AVX512VL) && (b & bit_AVX512DQ);
    if (!(ymm_state && avx2 && fma && f16c)) return Isa::kScalar;
    if (!(zmm_state && avx512)) return Isa::kAvx2;
    uint32_t a1 = 0, b1, c1, d1;
    __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
    const bool avx512_bf16 = a1 & (1u << 5), avx512_vnni = c & bit_AVX512VNNI;  // c: leaf 7 subleaf 0
    return avx512_bf16 && avx512_vnni ? Isa::kAvx512Bf16 : Isa::kAvx512;
  }();
  return detected;
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
      if (type == DType::kBF16 || type == DType::kInt8 || type == DType::kInt4)
        return KernelsFor(Isa::kAvx512).For(type);
      return nullptr;
    default: return nullptr;
  }
}

const KernelTable& KernelsFor(Isa isa) {
  static const KernelTable tables[] = {MakeTable(Isa::kScalar), MakeTable(Isa::kAvx2), MakeTable(Isa::kAvx512),
                                       MakeTable(Isa::kAvx512Bf16)};
  return tables[static_cast<int>(isa)];
}

Isa SelectedIsa() {
  static const Isa selected = [] {
    Isa isa = DetectIsa();
    if (const char* cap = std::getenv("COLIBRI_MAX_ISA"); cap != nullptr && *cap != '\0') {
      auto parsed = ParseIsa(cap);
      if (!parsed.ok()) {
        std::fprintf(stderr, "colibri: ignoring COLIBRI_MAX_ISA: %s\n", std::string(parsed.status().message()).c_str());
      } else if (*parsed < isa) {
        isa = *parsed;
      }
    }
    return isa;
  }();
  return selected;
}

const KernelTable& SelectedKernels() {
  static const KernelTable selected = ProfiledTable(SelectedProfile());
  return selected;
}

}  // namespace kernels
}  // namespace colibri
