#include "tools/model_writer.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/numbers.h"
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

constexpr char kStagingPrefix[] = ".colibri-partial-";    // + pid: the model being written
constexpr char kPreviousPrefix[] = ".colibri-previous-";  // + pid: the one it replaces, while it does

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
  const bool has_model = fs::exists(out / common::kManifestFileName, ec);
  if (has_model && !overwrite) {
    return absl::FailedPreconditionError(
        absl::StrCat(out_dir, " already holds a model directory; pass --overwrite to replace it"));
  }
  fs::create_directories(out, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", out_dir, ": ", ec.message()));
  // What runs that were killed left: their staging directories, and the
  // previous model's parts once a model is in place again.
  for (auto it = fs::directory_iterator(out, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename();
    for (const char* prefix : {kStagingPrefix, kPreviousPrefix}) {
      int pid = 0;
      if (name.rfind(prefix, 0) != 0 || !absl::SimpleAtoi(name.substr(std::strlen(prefix)), &pid)) continue;
      const bool dead = ::kill(pid, 0) != 0 && errno == ESRCH;
      if (dead && (prefix == kStagingPrefix || has_model)) {
        std::error_code ignored;
        fs::remove_all(it->path(), ignored);
      }
    }
  }
  // Inside out_dir: one file system, so every move is a rename.
  const std::string staging = (out / absl::StrCat(kStagingPrefix, ::getpid())).string();
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
  const fs::path out(out_dir_), staging(staging_), manifest_name(common::kManifestFileName);
  const fs::path previous = out / absl::StrCat(kPreviousPrefix, ::getpid());
  std::error_code ec;
  fs::remove_all(previous, ec);
  fs::create_directories(previous, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", previous.string(), ": ", ec.message()));
  // Moves made so far, undone in reverse if a later one fails: the model
  // that was there is put back.
  std::vector<std::pair<fs::path, fs::path>> done;
  auto move = [&](const fs::path& from, const fs::path& to) {
    fs::rename(from, to, ec);
    if (!ec) done.push_back({from, to});
    return !ec;
  };
  bool moved = true;
  if (fs::exists(out / manifest_name)) moved = move(out / manifest_name, previous / manifest_name);
  for (const fs::path& old : LayerDirs(out)) moved = moved && move(old, previous / old.filename());
  for (const fs::path& layer : LayerDirs(staging)) moved = moved && move(layer, out / layer.filename());
  moved = moved && move(staging / manifest_name, out / manifest_name);
  if (!moved) {
    const std::string why = ec.message();
    bool restored = true;
    for (auto it = done.rbegin(); it != done.rend(); ++it) {
      fs::rename(it->second, it->first, ec);
      restored = restored && !ec;
    }
    if (!restored) {  // what could not go back stays where it is, named
      return absl::InternalError(absl::StrCat("cannot move the new model into ", out_dir_, " (", why,
                                              "), nor all of the old one back: its parts are in ", previous.string()));
    }
    fs::remove_all(previous, ec);
    return absl::InternalError(
        absl::StrCat("cannot move the new model into ", out_dir_, " (", why, "); the model there is as it was"));
  }
  fs::remove_all(previous, ec);
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace colibri
