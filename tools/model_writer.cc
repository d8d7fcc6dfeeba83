#include "tools/model_writer.h"

#include <unistd.h>

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

namespace {

// Writes `manifest` as dir/manifest.json (through a temporary file and a rename).
absl::Status WriteManifest(const std::string& dir, const common::Manifest& manifest) {
  const std::string text = common::ManifestToJson(manifest);
  const std::string tmp = absl::StrCat(dir, "/", common::kManifestFileName, ".tmp");
  {
    COLIBRI_ASSIGN_OR_RETURN(auto w, HashingWriter::Create(tmp));
    COLIBRI_RETURN_IF_ERROR(w->Write(text.data(), text.size()));
    COLIBRI_RETURN_IF_ERROR(w->Close(common::kManifestFileName).status());
  }
  std::error_code ec;
  fs::rename(tmp, absl::StrCat(dir, "/", common::kManifestFileName), ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot rename ", tmp, ": ", ec.message()));
  return absl::OkStatus();
}

// The layer directories in `dir`.
std::vector<fs::path> LayerDirs(const fs::path& dir) {
  std::vector<fs::path> layers;
  std::error_code ec;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename();
    if (name.rfind("layer_", 0) == 0 && it->is_directory(ec)) layers.push_back(it->path());
  }
  return layers;
}

}  // namespace

absl::StatusOr<std::unique_ptr<OutputDir>> OutputDir::Begin(const std::string& out_dir, bool overwrite) {
  std::error_code ec;
  const fs::path out(out_dir);
  if (fs::exists(out / common::kManifestFileName, ec) && !overwrite) {
    return absl::FailedPreconditionError(
        absl::StrCat(out_dir, " already holds a model directory; pass --overwrite to replace it"));
  }
  // Beside out_dir (one file system: the moves are renames), not inside it.
  const std::string staging =
      absl::StrCat(out.has_filename() ? out.string() : out.parent_path().string(), ".partial-", ::getpid());
  fs::remove_all(staging, ec);
  fs::create_directories(staging, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", staging, ": ", ec.message()));
  return std::unique_ptr<OutputDir>(new OutputDir(out_dir, staging));
}

OutputDir::~OutputDir() {
  std::error_code ec;
  fs::remove_all(staging_, ec);
}

absl::Status OutputDir::Commit(const common::Manifest& manifest) {
  COLIBRI_RETURN_IF_ERROR(WriteManifest(staging_, manifest));
  std::error_code ec;
  const fs::path out(out_dir_);
  fs::create_directories(out, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", out_dir_, ": ", ec.message()));
  auto failed = [&](const std::string& what) {
    return absl::InternalError(absl::StrCat("cannot ", what, ": ", ec.message()));
  };
  fs::remove(out / common::kManifestFileName, ec);
  if (ec) return failed(absl::StrCat("remove ", (out / common::kManifestFileName).string()));
  for (const fs::path& old : LayerDirs(out)) {
    fs::remove_all(old, ec);
    if (ec) return failed(absl::StrCat("remove ", old.string()));
  }
  for (const fs::path& layer : LayerDirs(staging_)) {
    fs::rename(layer, out / layer.filename(), ec);
    if (ec) return failed(absl::StrCat("move ", layer.string(), " into ", out_dir_));
  }
  fs::rename(fs::path(staging_) / common::kManifestFileName, out / common::kManifestFileName, ec);
  if (ec) return failed(absl::StrCat("move the manifest into ", out_dir_));
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace colibri
