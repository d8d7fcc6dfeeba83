#ifndef COLIBRI_COMMON_WEIGHT_FILE_H_
#define COLIBRI_COMMON_WEIGHT_FILE_H_

// The binary files of a model directory (docs/MODEL_FORMAT.md): a 4 KiB
// header followed by named sections, each starting on a 4 KiB boundary so the
// kernels can use a section in place from a read-only mapping.
//
// Header (little-endian, kWeightFileHeaderBytes long, zero padded):
//   magic "COLIBRIW", u32 version (1), u32 kind, i32 layer, i32 expert
//   (-1 for per-layer files), u32 section count, u32 reserved, then
//   `count` entries of {char name[24], u32 dtype, u32 reserved, u64 offset,
//   u64 size, i64 rows, i64 cols}.
//
// An expert file holds w1, w3, w2 (+ ".scales" / ".zeros" for int8/int4) in
// that order, then f32 biases b1, b3 [1][d_ff], b2 [1][d_model] when the
// manifest says the experts have them; a gate file one section "gate" (f32 [n_experts][d_model]); a
// LUT file "ids" (i32 [vocab][top_k]) and "weights" (f32 [vocab][top_k]).
// Pure functions; thread-safe.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace colibri {
namespace common {

inline constexpr size_t kWeightFileHeaderBytes = 4096;
inline constexpr size_t kSectionAlignment = 4096;
inline constexpr uint32_t kWeightFileVersion = 1;
inline constexpr size_t kMaxSectionName = 23;
inline constexpr size_t kMaxSections = 63;  // entries that fit the header

enum class FileKind : uint32_t { kExpert = 1, kGate = 2, kLut = 3 };

struct Section {
  std::string name;
  DType dtype = DType::kF32;
  uint64_t offset = 0;  // from the start of the file; multiple of 4096
  uint64_t size = 0;    // bytes
  int64_t rows = 0;
  int64_t cols = 0;
};

struct WeightFileLayout {
  FileKind kind = FileKind::kExpert;
  int32_t layer = 0;
  int32_t expert = -1;
  std::vector<Section> sections;  // in file order
  uint64_t file_size = 0;         // header + sections, last one padded to 4 KiB

  // nullptr if there is no section of that name.
  const Section* Find(const std::string& name) const;
};

// Assigns aligned offsets to `sections` (their name, dtype, size, rows, cols
// filled in) and computes file_size. REQUIRES: names of at most 23 bytes, at
// most kMaxSections sections.
WeightFileLayout PlanWeightFile(FileKind kind, int32_t layer, int32_t expert, std::vector<Section> sections);

// The header bytes (kWeightFileHeaderBytes long) for `layout`.
std::string SerializeHeader(const WeightFileLayout& layout);

// Parses and checks the header of a file of `file_size` bytes whose first
// bytes are `data`: magic, version, kind, section names, known dtypes,
// alignment, sections inside the file and not overlapping, and file_size equal
// to what the sections imply. INVALID_ARGUMENT naming `path` and the fault.
absl::StatusOr<WeightFileLayout> ParseHeader(const uint8_t* data, size_t file_size, const std::string& path);

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_WEIGHT_FILE_H_
