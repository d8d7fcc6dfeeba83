#include "common/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/json_depth.h"
#include "nlohmann/json.hpp"

namespace colibri {
namespace common {
namespace {

using Json = nlohmann::json;

absl::Status Bad(const std::string& what, const std::string& detail) {
  return absl::InvalidArgumentError(absl::StrCat("malformed safetensors file ", what, ": ", detail));
}

uint64_t ReadLe64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// numel * element size with overflow checks; false on overflow.
bool CheckedBytes(const std::vector<int64_t>& shape, size_t element_size, uint64_t* out) {
  unsigned __int128 n = element_size;
  for (int64_t d : shape) {
    n *= static_cast<uint64_t>(d);
    if (n > (unsigned __int128)UINT64_MAX) return false;
  }
  *out = static_cast<uint64_t>(n);
  return true;
}

}  // namespace

int64_t SafetensorsTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t SafetensorsElementSize(const std::string& dtype) {
  static const std::map<std::string, size_t> kSizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},  {"I32", 4},     {"I16", 2},    {"I8", 1},
      {"U64", 8}, {"U32", 4}, {"U16", 2}, {"U8", 1},   {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  auto it = kSizes.find(dtype);
  return it == kSizes.end() ? 0 : it->second;
}

absl::StatusOr<std::vector<SafetensorsTensor>> ParseSafetensorsHeader(const uint8_t* prefix, size_t prefix_size,
                                                                      uint64_t file_size, const std::string& what) {
  if (file_size < 8 || prefix_size < 8) {
    return Bad(what, absl::StrCat("file is ", file_size, " bytes, shorter than the 8-byte header length"));
  }
  const uint64_t header_len = ReadLe64(prefix);
  if (header_len > kMaxSafetensorsHeaderBytes) {
    return Bad(what, absl::StrCat("header length ", header_len, " exceeds the limit of ", kMaxSafetensorsHeaderBytes,
                                  " bytes"));
  }
  if (header_len > file_size - 8 || header_len > prefix_size - 8) {
    return Bad(what, absl::StrCat("header length ", header_len, " runs past the end of the ", file_size,
                                  "-byte file (truncated?)"));
  }
  const uint64_t data_size = file_size - 8 - header_len;
  const absl::string_view text(reinterpret_cast<const char*>(prefix + 8), header_len);
  if (const int depth = JsonDepth(text); depth > kMaxJsonDepth) {
    return Bad(what, absl::StrCat("header nests ", depth, " levels deep, more than ", kMaxJsonDepth));
  }
  Json header = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) return Bad(what, "header is not valid JSON");
  if (!header.is_object()) return Bad(what, "header is not a JSON object");

  std::vector<SafetensorsTensor> tensors;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string& name = it.key();
    const Json& entry = it.value();
    auto bad = [&](const std::string& detail) { return Bad(what, absl::StrCat("tensor '", name, "': ", detail)); };
    if (!entry.is_object()) return bad("entry is not an object");
    auto dtype = entry.find("dtype");
    auto shape = entry.find("shape");
    auto offsets = entry.find("data_offsets");
    if (dtype == entry.end() || !dtype->is_string()) return bad("missing or non-string 'dtype'");
    if (shape == entry.end() || !shape->is_array()) return bad("missing or non-array 'shape'");
    if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2) {
      return bad("'data_offsets' must be an array of two integers");
    }
    SafetensorsTensor t;
    t.name = name;
    t.dtype = dtype->get<std::string>();
    const size_t element_size = SafetensorsElementSize(t.dtype);
    if (element_size == 0) return bad(absl::StrCat("unknown dtype '", t.dtype, "'"));
    for (const Json& d : *shape) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) {
        return bad(absl::StrCat("a shape entry (", d.type_name(), ") is not a non-negative integer"));
      }
      t.shape.push_back(d.get<int64_t>());
    }
    for (const Json& o : *offsets) {
      if (!o.is_number_unsigned() && !(o.is_number_integer() && o.get<int64_t>() >= 0)) {
        return bad(absl::StrCat("a data offset (", o.type_name(), ") is not a non-negative integer"));
      }
    }
    const uint64_t begin = (*offsets)[0].get<uint64_t>();
    const uint64_t end = (*offsets)[1].get<uint64_t>();
    if (end < begin) return bad(absl::StrCat("data_offsets [", begin, ", ", end, "] end before begin"));
    if (end > data_size) {
      return bad(absl::StrCat("data_offsets [", begin, ", ", end, "] run past the ", data_size,
                              "-byte data buffer (truncated file?)"));
    }
    uint64_t expected = 0;
    if (!CheckedBytes(t.shape, element_size, &expected)) return bad("shape overflows 64 bits");
    if (end - begin != expected) {
      return bad(absl::StrCat("data_offsets span ", end - begin, " bytes but shape [", absl::StrJoin(t.shape, ", "),
                              "] of ", t.dtype, " needs ", expected));
    }
    t.offset = 8 + header_len + begin;
    t.nbytes = expected;
    tensors.push_back(std::move(t));
  }
  // No two tensors may share bytes.
  std::vector<const SafetensorsTensor*> by_offset;
  for (const auto& t : tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) { return a->offset < b->offset; });
  const SafetensorsTensor* furthest = nullptr;  // the non-empty tensor reaching furthest so far
  for (const SafetensorsTensor* cur : by_offset) {
    if (cur->nbytes == 0) continue;
    if (furthest != nullptr && cur->offset < furthest->offset + furthest->nbytes) {
      return Bad(what, absl::StrCat("tensors '", furthest->name, "' and '", cur->name, "' overlap"));
    }
    if (furthest == nullptr || cur->offset + cur->nbytes > furthest->offset + furthest->nbytes) furthest = cur;
  }
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return tensors;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  auto file = MappedFile::Open(path);
  if (!file.ok()) return file.status();
  auto tensors = ParseSafetensorsHeader((*file)->data(), (*file)->size(), (*file)->size(), path);
  if (!tensors.ok()) return tensors.status();
  return std::unique_ptr<SafetensorsFile>(new SafetensorsFile(std::move(file).value(), std::move(tensors).value()));
}

SafetensorsFile::SafetensorsFile(std::unique_ptr<MappedFile> file, std::vector<SafetensorsTensor> tensors)
    : file_(std::move(file)), tensors_(std::move(tensors)) {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    tensors_[i].data = file_->data() + tensors_[i].offset;
    index_[tensors_[i].name] = i;
  }
}

const SafetensorsTensor* SafetensorsFile::Find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void SafetensorsFile::ReleaseRange(uint64_t offset, uint64_t length) const { file_->DropPages(offset, length); }

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, std::vector<Spec> specs, const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const Spec& spec : specs) {
    const size_t element_size = SafetensorsElementSize(spec.dtype);
    if (element_size == 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", spec.name, "': unknown dtype '", spec.dtype, "'"));
    }
    if (!names.insert(spec.name).second || spec.name == "__metadata__") {
      return absl::InvalidArgumentError(absl::StrCat("duplicate tensor name '", spec.name, "'"));
    }
    uint64_t nbytes = 0;
    if (!CheckedBytes(spec.shape, element_size, &nbytes)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", spec.name, "': shape overflows"));
    }
    header[spec.name] = {{"dtype", spec.dtype}, {"shape", spec.shape}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data buffer 8-byte aligned
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    return absl::InternalError(absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  }
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * i));
  std::unique_ptr<SafetensorsWriter> writer(new SafetensorsWriter(path, f, offset));
  if (std::fwrite(len, 1, 8, f) != 8 || std::fwrite(text.data(), 1, text.size(), f) != text.size()) {
    return absl::InternalError(absl::StrCat("write error in ", path));
  }
  return writer;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

absl::Status SafetensorsWriter::Append(const void* data, size_t size) {
  if (file_ == nullptr) return absl::FailedPreconditionError(absl::StrCat(path_, " is closed"));
  if (written_ + size > expected_) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": appending ", size, " bytes exceeds the declared ", expected_));
  }
  if (std::fwrite(data, 1, size, file_) != size) {
    return absl::InternalError(absl::StrCat("write error in ", path_, ": ", std::strerror(errno)));
  }
  written_ += size;
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Close() {
  if (file_ == nullptr) return absl::FailedPreconditionError(absl::StrCat(path_, " is closed"));
  const bool flush_failed = std::fclose(file_) != 0;
  file_ = nullptr;
  if (flush_failed) return absl::InternalError(absl::StrCat("cannot flush ", path_));
  if (written_ != expected_) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": ", written_, " bytes written but the header declares ", expected_));
  }
  return absl::OkStatus();
}

}  // namespace common
}  // namespace colibri
