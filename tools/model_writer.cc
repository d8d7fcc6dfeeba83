#include "tools/model_writer.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace colibri {
namespace tools {

namespace fs = std::filesystem;

absl::StatusOr<std::unique_ptr<HashingWriter>> HashingWriter::Create(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return absl::InternalError(absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  return std::unique_ptr<HashingWriter>(new HashingWriter(path, f));
}

HashingWriter::~HashingWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

absl::Status HashingWriter::Write(const void* data, size_t size) {
  if (std::fwrite(data, 1, size, file_) != size) {
    return absl::InternalError(absl::StrCat("write error in ", path_, ": ", std::strerror(errno)));
  }
  sum_.Update(data, size);
  size_ += size;
  return absl::OkStatus();
}

absl::Status HashingWriter::PadTo(uint64_t offset) {
  static const char kZeros[4096] = {};
  while (size_ < offset) {
    COLIBRI_RETURN_IF_ERROR(Write(kZeros, std::min<uint64_t>(sizeof(kZeros), offset - size_)));
  }
  return absl::OkStatus();
}

absl::StatusOr<common::ManifestFile> HashingWriter::Close(const std::string& relative_path) {
  const bool failed = std::fclose(file_) != 0;
  file_ = nullptr;
  if (failed) return absl::InternalError(absl::StrCat("cannot flush ", path_));
  return common::ManifestFile{relative_path, size_, sum_.Finish()};
}

absl::StatusOr<common::ManifestFile> WritePlainFile(const std::string& out_dir, const std::string& rel,
                                                    common::FileKind kind, int64_t layer,
                                                    const std::vector<PlainSection>& plain) {
  std::vector<common::Section> sections;
  for (const PlainSection& p : plain) sections.push_back({p.name, p.dtype, 0, p.size, p.rows, p.cols});
  const common::WeightFileLayout layout = common::PlanWeightFile(kind, layer, -1, sections);
  COLIBRI_ASSIGN_OR_RETURN(auto w, HashingWriter::Create(out_dir + "/" + rel));
  COLIBRI_RETURN_IF_ERROR(w->Write(common::SerializeHeader(layout).data(), common::kWeightFileHeaderBytes));
  for (size_t i = 0; i < plain.size(); ++i) {
    COLIBRI_RETURN_IF_ERROR(w->PadTo(layout.sections[i].offset));
    COLIBRI_RETURN_IF_ERROR(w->Write(plain[i].data, plain[i].size));
  }
  COLIBRI_RETURN_IF_ERROR(w->PadTo(layout.file_size));
  return w->Close(rel);
}

absl::Status PrepareOutputDir(const std::string& out_dir, bool overwrite) {
  std::error_code ec;
  const fs::path out(out_dir);
  if (fs::exists(out / common::kManifestFileName, ec) && !overwrite) {
    return absl::FailedPreconditionError(
        absl::StrCat(out_dir, " already holds a model directory; pass --overwrite to replace it"));
  }
  fs::create_directories(out, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", out_dir, ": ", ec.message()));
  fs::remove(out / common::kManifestFileName, ec);
  std::vector<fs::path> stale;
  for (auto it = fs::directory_iterator(out, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename();
    if (name.rfind("layer_", 0) == 0 && it->is_directory(ec)) stale.push_back(it->path());
  }
  for (const fs::path& p : stale) fs::remove_all(p, ec);
  return absl::OkStatus();
}

absl::Status WriteManifest(const std::string& out_dir, const common::Manifest& manifest) {
  const std::string text = common::ManifestToJson(manifest);
  const std::string tmp = absl::StrCat(out_dir, "/", common::kManifestFileName, ".tmp");
  {
    COLIBRI_ASSIGN_OR_RETURN(auto w, HashingWriter::Create(tmp));
    COLIBRI_RETURN_IF_ERROR(w->Write(text.data(), text.size()));
    COLIBRI_RETURN_IF_ERROR(w->Close(common::kManifestFileName).status());
  }
  std::error_code ec;
  fs::rename(tmp, absl::StrCat(out_dir, "/", common::kManifestFileName), ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot rename ", tmp, ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace colibri
