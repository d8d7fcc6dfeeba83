#include "common/weight_file.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace colibri {
namespace common {
namespace {

constexpr char kMagic[8] = {'C', 'O', 'L', 'I', 'B', 'R', 'I', 'W'};
constexpr size_t kFixedBytes = 32;
constexpr size_t kEntryBytes = 64;
static_assert(kMaxSections == (kWeightFileHeaderBytes - kFixedBytes) / kEntryBytes, "header capacity");

uint64_t AlignUp(uint64_t x) { return (x + kSectionAlignment - 1) / kSectionAlignment * kSectionAlignment; }

template <typename T>
void Put(std::string* out, size_t at, T value) {
  std::memcpy(&(*out)[at], &value, sizeof(T));  // x86-64: host order is little-endian
}

template <typename T>
T Get(const uint8_t* p, size_t at) {
  T value;
  std::memcpy(&value, p + at, sizeof(T));
  return value;
}

}  // namespace

const Section* WeightFileLayout::Find(const std::string& name) const {
  for (const Section& s : sections) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

WeightFileLayout PlanWeightFile(FileKind kind, int32_t layer, int32_t expert, std::vector<Section> sections) {
  WeightFileLayout layout;
  layout.kind = kind;
  layout.layer = layer;
  layout.expert = expert;
  uint64_t offset = kWeightFileHeaderBytes;
  for (Section& s : sections) {
    s.offset = offset;
    offset = AlignUp(offset + s.size);
  }
  layout.sections = std::move(sections);
  layout.file_size = offset;
  return layout;
}

std::string SerializeHeader(const WeightFileLayout& layout) {
  std::string out(kWeightFileHeaderBytes, '\0');
  std::memcpy(&out[0], kMagic, sizeof(kMagic));
  Put<uint32_t>(&out, 8, kWeightFileVersion);
  Put<uint32_t>(&out, 12, static_cast<uint32_t>(layout.kind));
  Put<int32_t>(&out, 16, layout.layer);
  Put<int32_t>(&out, 20, layout.expert);
  Put<uint32_t>(&out, 24, static_cast<uint32_t>(layout.sections.size()));
  for (size_t i = 0; i < layout.sections.size() && i < kMaxSections; ++i) {
    const Section& s = layout.sections[i];
    const size_t at = kFixedBytes + i * kEntryBytes;
    std::memcpy(&out[at], s.name.data(), std::min(s.name.size(), kMaxSectionName));
    Put<uint32_t>(&out, at + 24, static_cast<uint32_t>(s.dtype));
    Put<uint64_t>(&out, at + 32, s.offset);
    Put<uint64_t>(&out, at + 40, s.size);
    Put<int64_t>(&out, at + 48, s.rows);
    Put<int64_t>(&out, at + 56, s.cols);
  }
  return out;
}

absl::StatusOr<WeightFileLayout> ParseHeader(const uint8_t* data, size_t file_size, const std::string& path) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("bad weight file ", path, ": ", why));
  };
  if (file_size < kWeightFileHeaderBytes) {
    return bad(absl::StrCat("file is ", file_size, " bytes, shorter than its ", kWeightFileHeaderBytes,
                            "-byte header (truncated?)"));
  }
  if (std::memcmp(data, kMagic, sizeof(kMagic)) != 0) return bad("wrong magic (not a Colibri weight file)");
  const uint32_t version = Get<uint32_t>(data, 8);
  if (version != kWeightFileVersion) {
    return bad(absl::StrCat("unsupported version ", version, " (this build reads ", kWeightFileVersion, ")"));
  }
  WeightFileLayout layout;
  const uint32_t kind = Get<uint32_t>(data, 12);
  if (kind < 1 || kind > 3) return bad(absl::StrCat("unknown file kind ", kind));
  layout.kind = static_cast<FileKind>(kind);
  layout.layer = Get<int32_t>(data, 16);
  layout.expert = Get<int32_t>(data, 20);
  const uint32_t count = Get<uint32_t>(data, 24);
  if (count > kMaxSections) return bad(absl::StrCat("section count ", count, " exceeds ", kMaxSections));
  uint64_t end_of_previous = kWeightFileHeaderBytes;
  for (uint32_t i = 0; i < count; ++i) {
    const uint8_t* e = data + kFixedBytes + i * kEntryBytes;
    Section s;
    const char* name = reinterpret_cast<const char*>(e);
    s.name.assign(name, strnlen(name, kMaxSectionName));
    const uint32_t dtype = Get<uint32_t>(e, 24);
    if (!IsKnownDTypeCode(dtype)) {
      return bad(absl::StrCat("section '", s.name, "' has unknown dtype code ", dtype));
    }
    s.dtype = static_cast<DType>(dtype);
    s.offset = Get<uint64_t>(e, 32);
    s.size = Get<uint64_t>(e, 40);
    s.rows = Get<int64_t>(e, 48);
    s.cols = Get<int64_t>(e, 56);
    if (s.offset % kSectionAlignment != 0) {
      return bad(absl::StrCat("section '", s.name, "' offset ", s.offset, " is not 4 KiB aligned"));
    }
    if (s.offset < end_of_previous) {
      return bad(absl::StrCat("section '", s.name, "' at ", s.offset, " overlaps the previous one"));
    }
    if (s.size > file_size || s.offset > file_size - s.size) {
      return bad(absl::StrCat("section '", s.name, "' [", s.offset, ", +", s.size, ") runs past the end of the ",
                              file_size, "-byte file (truncated?)"));
    }
    if (s.rows < 0 || s.cols < 0) return bad(absl::StrCat("section '", s.name, "' has a negative shape"));
    end_of_previous = s.offset + s.size;
    layout.sections.push_back(std::move(s));
  }
  layout.file_size = AlignUp(end_of_previous);
  if (layout.file_size != file_size) {
    return bad(absl::StrCat("file is ", file_size, " bytes but its sections imply ", layout.file_size));
  }
  return layout;
}

}  // namespace common
}  // namespace colibri
