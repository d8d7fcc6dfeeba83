#include "common/model_dir.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/small_file.h"
#include "common/status_macros.h"
#include "common/weight_file.h"

namespace colibri {
namespace common {
namespace {

// A file's bytes as the checks read them: a mapping's, or a private copy's.
struct FileBytes {
  const uint8_t* data;
  size_t size;
  const std::string& path;
};

FileBytes BytesOf(const MappedFile& file) { return {file.data(), file.size(), file.path()}; }

absl::Status CheckChecksum(const FileBytes& file, const ManifestFile& listed) {
  const std::string actual = ChecksumBytes(file.data, file.size);
  if (actual == listed.checksum) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat("bad weight file ", file.path, ": checksum ", actual,
                                          " does not match the manifest's ", listed.checksum));
}

// Checks that `layout` has section `name` of `dtype` holding exactly `size`
// bytes of a [rows][cols] array, and returns a pointer to its bytes.
absl::StatusOr<const uint8_t*> SectionData(const FileBytes& file, const WeightFileLayout& layout,
                                           const std::string& name, DType dtype, int64_t rows, int64_t cols,
                                           uint64_t size) {
  const Section* s = layout.Find(name);
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("bad weight file ", file.path, ": ", why));
  };
  if (s == nullptr) return bad(absl::StrCat("no section '", name, "'"));
  if (s->dtype != dtype) {
    return bad(absl::StrCat("section '", name, "' is ", DTypeName(s->dtype), ", expected ", DTypeName(dtype)));
  }
  if (s->rows != rows || s->cols != cols || s->size != size) {
    return bad(absl::StrCat("section '", name, "' is [", s->rows, " x ", s->cols, "] in ", s->size,
                            " bytes, expected [", rows, " x ", cols, "] in ", size));
  }
  return file.data + s->offset;
}

// Section `name` as f32 [rows][cols], every element finite (a gate file's
// gate, bias and shared_gate; an expert file's biases).
absl::StatusOr<const float*> FiniteF32Section(const FileBytes& file, const WeightFileLayout& layout,
                                              const std::string& name, int64_t rows, int64_t cols) {
  COLIBRI_ASSIGN_OR_RETURN(const uint8_t* bytes,
                           SectionData(file, layout, name, DType::kF32, rows, cols, rows * cols * 4));
  const auto* values = reinterpret_cast<const float*>(bytes);
  for (int64_t i = 0; i < rows * cols; ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad weight file ", file.path, ": ", name, " element ", i, " is not finite"));
    }
  }
  return values;
}

absl::StatusOr<MatrixView> MatrixSection(const FileBytes& file, const WeightFileLayout& layout, const std::string& name,
                                         DType dtype, int64_t rows, int64_t cols) {
  MatrixView view;
  view.layout = ComputeMatrixLayout(dtype, rows, cols);
  const MatrixLayout& l = view.layout;
  COLIBRI_ASSIGN_OR_RETURN(view.data, SectionData(file, layout, name, dtype, rows, cols, l.data_bytes));
  if (l.scale_bytes > 0) {
    COLIBRI_ASSIGN_OR_RETURN(const uint8_t* scales, SectionData(file, layout, name + ".scales", DType::kF32,
                                                                l.padded_rows, l.groups, l.scale_bytes));
    view.scales = reinterpret_cast<const float*>(scales);
    for (int64_t i = 0; i < l.padded_rows * l.groups; ++i) {
      if (!(std::isfinite(view.scales[i]) && view.scales[i] >= 0.f)) {
        return absl::InvalidArgumentError(
            absl::StrCat("bad weight file ", file.path, ": ", name, ".scales[", i, "] is negative or not finite"));
      }
    }
  }
  if (l.zero_bytes > 0) {
    COLIBRI_ASSIGN_OR_RETURN(
        view.zeros, SectionData(file, layout, name + ".zeros", DType::kU8, l.padded_rows, l.groups, l.zero_bytes));
    for (int64_t i = 0; i < l.padded_rows * l.groups; ++i) {
      if (view.zeros[i] > 15) {
        return absl::InvalidArgumentError(absl::StrCat("bad weight file ", file.path, ": ", name, ".zeros[", i,
                                                       "] = ", view.zeros[i], " is above 15"));
      }
    }
  }
  return view;
}

// OK if `path` does not resolve (symlinks followed) outside `dir`; a path
// that does not resolve at all is left to the open that follows. The error
// says nothing about the target.
absl::Status ConfinedTo(const std::string& dir, const std::string& path) {
  std::error_code ec, dir_ec;
  const std::filesystem::path real = std::filesystem::canonical(path, ec);
  const std::filesystem::path root = std::filesystem::canonical(dir, dir_ec);
  if (ec || dir_ec) return absl::OkStatus();
  auto [end, unused] = std::mismatch(root.begin(), root.end(), real.begin(), real.end());
  if (end == root.end()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(path, " resolves outside the model directory (a symlink?)"));
}

absl::Status CheckIdentity(const WeightFileLayout& layout, const std::string& path, FileKind kind, int64_t layer,
                           int64_t expert) {
  if (layout.kind != kind || layout.layer != layer || layout.expert != expert) {
    return absl::InvalidArgumentError(absl::StrCat("bad weight file ", path, ": header says kind ",
                                                   static_cast<uint32_t>(layout.kind), " layer ", layout.layer,
                                                   " expert ", layout.expert, ", expected kind ",
                                                   static_cast<uint32_t>(kind), " layer ", layer, " expert ", expert));
  }
  return absl::OkStatus();
}

absl::Status ChangedWhileRead(const std::string& path) {
  return absl::DataLossError(
      absl::StrCat("weight file ", path, " shrank while it was being read (replaced in place?)"));
}

// `p`, a pointer into `file`'s mapping, rebased into `copy` of the file.
template <typename T>
T* Rebase(T* p, const MappedFile& file, const AnonymousMemory& copy) {
  if (p == nullptr) return nullptr;
  return reinterpret_cast<T*>(copy.data() + (reinterpret_cast<const uint8_t*>(p) - file.data()));
}

// Validates one layer's routing files and points `routing`'s tables into them.
absl::Status ParseRouting(const Manifest& m, const FileBytes& gate, const FileBytes& lut, LayerRouting* routing) {
  const int64_t layer = routing->layer;
  COLIBRI_ASSIGN_OR_RETURN(WeightFileLayout gate_layout, ParseHeader(gate.data, gate.size, gate.path));
  COLIBRI_RETURN_IF_ERROR(CheckIdentity(gate_layout, gate.path, FileKind::kGate, layer, -1));
  COLIBRI_ASSIGN_OR_RETURN(routing->gate, FiniteF32Section(gate, gate_layout, "gate", m.n_experts, m.d_model));
  if (m.routing.has_bias()) {
    COLIBRI_ASSIGN_OR_RETURN(routing->bias, FiniteF32Section(gate, gate_layout, "bias", 1, m.n_experts));
  }
  if (m.shared_gate) {
    COLIBRI_ASSIGN_OR_RETURN(routing->shared_gate,
                             FiniteF32Section(gate, gate_layout, "shared_gate", m.n_shared_experts, m.d_model));
  }

  COLIBRI_ASSIGN_OR_RETURN(WeightFileLayout lut_layout, ParseHeader(lut.data, lut.size, lut.path));
  COLIBRI_RETURN_IF_ERROR(CheckIdentity(lut_layout, lut.path, FileKind::kLut, layer, -1));
  const uint64_t entries = m.vocab_size * m.top_k;
  COLIBRI_ASSIGN_OR_RETURN(const uint8_t* ids,
                           SectionData(lut, lut_layout, "ids", DType::kI32, m.vocab_size, m.top_k, entries * 4));
  COLIBRI_ASSIGN_OR_RETURN(const uint8_t* weights,
                           SectionData(lut, lut_layout, "weights", DType::kF32, m.vocab_size, m.top_k, entries * 4));
  routing->lut_ids = reinterpret_cast<const int32_t*>(ids);
  routing->lut_weights = reinterpret_cast<const float*>(weights);
  std::vector<int64_t> last_token(m.n_experts, -1);  // per expert: the last token routed to it
  for (uint64_t i = 0; i < entries; ++i) {
    if (routing->lut_ids[i] < 0 || routing->lut_ids[i] >= m.n_experts) {
      return absl::InvalidArgumentError(absl::StrCat("bad weight file ", lut.path, ": token ", i / m.top_k,
                                                     " routes to expert ", routing->lut_ids[i], ", outside [0, ",
                                                     m.n_experts, ")"));
    }
    if (!std::isfinite(routing->lut_weights[i]) || routing->lut_weights[i] < 0.f) {
      return absl::InvalidArgumentError(absl::StrCat("bad weight file ", lut.path, ": token ", i / m.top_k,
                                                     " has route weight ", routing->lut_weights[i],
                                                     " (must be finite and >= 0)"));
    }
    const int64_t token = static_cast<int64_t>(i / m.top_k);
    if (last_token[routing->lut_ids[i]] == token) {
      return absl::InvalidArgumentError(absl::StrCat("bad weight file ", lut.path, ": token ", token,
                                                     " routes to expert ", routing->lut_ids[i], " twice"));
    }
    last_token[routing->lut_ids[i]] = token;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelDir>> ModelDir::Open(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kManifestFileName);
  COLIBRI_RETURN_IF_ERROR(ConfinedTo(dir, path));
  // Read once: parsed and hashed from one private copy, so a manifest
  // rewritten meanwhile cannot give an id of bytes that were not parsed (nor,
  // truncated, a SIGBUS as a mapping would).
  auto file = ReadSmallFile(path, {kMaxManifestBytes, /*follow_symlinks=*/true});
  if (!file.ok()) {
    return absl::Status(file.status().code(),
                        absl::StrCat("not a model directory (no readable manifest): ", file.status().message()));
  }
  const absl::string_view text = *file;
  COLIBRI_ASSIGN_OR_RETURN(Manifest manifest, ParseManifest(text, path));
  std::string id = ChecksumBytes(text.data(), text.size());
  return std::unique_ptr<ModelDir>(new ModelDir(dir, std::move(manifest), std::move(id)));
}

absl::StatusOr<std::unique_ptr<MappedFile>> ModelDir::MapListedFileUnchecked(const std::string& relative_path) const {
  const std::string path = absl::StrCat(dir_, "/", relative_path);
  if (manifest_.FindFile(relative_path) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not listed in the manifest"));
  }
  COLIBRI_RETURN_IF_ERROR(ConfinedTo(dir_, path));
  COLIBRI_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path));
  // A file truncated in place while it is read (here or by the caller) then
  // reads as zeros and turns faulted(), instead of killing the process.
  file->Guard();
  return file;
}

absl::StatusOr<std::unique_ptr<MappedFile>> ModelDir::MapListedFile(const std::string& relative_path,
                                                                    bool verify_checksum) const {
  COLIBRI_ASSIGN_OR_RETURN(auto file, MapListedFileUnchecked(relative_path));
  const ManifestFile* listed = manifest_.FindFile(relative_path);
  const std::string path = absl::StrCat(dir_, "/", relative_path);
  if (file->size() != listed->size) {
    return absl::InvalidArgumentError(absl::StrCat("bad weight file ", path, ": size ", file->size(),
                                                   " bytes, manifest says ", listed->size, " (truncated?)"));
  }
  if (verify_checksum) {
    const absl::Status checked = CheckChecksum(BytesOf(*file), *listed);
    if (file->faulted()) return ChangedWhileRead(path);
    COLIBRI_RETURN_IF_ERROR(checked);
  }
  return file;
}

absl::StatusOr<std::unique_ptr<ExpertWeights>> ModelDir::LoadExpert(int64_t layer, int64_t expert,
                                                                    bool verify_checksum) const {
  const Manifest& m = manifest_;
  if (layer < 0 || layer >= m.n_layers || expert < 0 || expert >= m.total_experts()) {
    return absl::InvalidArgumentError(absl::StrCat("no expert (layer ", layer, ", expert ", expert, ") in a model of ",
                                                   m.n_layers, " layers x ", m.total_experts(), " experts"));
  }
  const int64_t d_ff = m.ExpertDff(expert);
  auto weights = std::make_unique<ExpertWeights>();
  weights->layer = layer;
  weights->expert = expert;
  COLIBRI_ASSIGN_OR_RETURN(weights->file, MapListedFile(ExpertFilePath(layer, expert), verify_checksum));
  const FileBytes file = BytesOf(*weights->file);
  COLIBRI_ASSIGN_OR_RETURN(WeightFileLayout layout, ParseHeader(file.data, file.size, file.path));
  COLIBRI_RETURN_IF_ERROR(CheckIdentity(layout, file.path, FileKind::kExpert, layer, expert));
  COLIBRI_ASSIGN_OR_RETURN(weights->w1, MatrixSection(file, layout, "w1", m.weight_type, d_ff, m.d_model));
  COLIBRI_ASSIGN_OR_RETURN(weights->w3, MatrixSection(file, layout, "w3", m.weight_type, d_ff, m.d_model));
  COLIBRI_ASSIGN_OR_RETURN(weights->w2, MatrixSection(file, layout, "w2", m.weight_type, m.d_model, d_ff));
  if (m.expert_biases && expert < m.n_experts) {  // routed experts' (gpt-oss has no shared ones)
    COLIBRI_ASSIGN_OR_RETURN(weights->b1, FiniteF32Section(file, layout, "b1", 1, d_ff));
    COLIBRI_ASSIGN_OR_RETURN(weights->b3, FiniteF32Section(file, layout, "b3", 1, d_ff));
    COLIBRI_ASSIGN_OR_RETURN(weights->b2, FiniteF32Section(file, layout, "b2", 1, m.d_model));
  }
  weights->activation = m.activation;
  weights->weight_at_input = m.routing.weight_at_input && expert < m.n_experts;
  if (weights->file->faulted()) return ChangedWhileRead(file.path);  // zeros may have passed the checks
  return weights;
}

absl::Status CheckIntact(const ExpertWeights& expert, absl::string_view remedy) {
  if (expert.file == nullptr || !expert.file->faulted()) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat("layer ", expert.layer, " expert ", expert.expert, ": its weight file ",
                                          expert.file->path(), " shrank while it was served from the page cache ",
                                          "(changed in place): ", remedy));
}

absl::Status CopyExpertToMemory(ExpertWeights* e, const AnonymousMemory::Options& options) {
  const MappedFile& file = *e->file;
  COLIBRI_ASSIGN_OR_RETURN(auto copy, AnonymousMemory::Create(file.size(), options));
  std::memcpy(copy->data(), file.data(), file.size());
  if (file.faulted()) return ChangedWhileRead(file.path());
  for (MatrixView* m : {&e->w1, &e->w3, &e->w2}) {
    m->data = Rebase(m->data, file, *copy);
    m->scales = Rebase(m->scales, file, *copy);
    m->zeros = Rebase(m->zeros, file, *copy);
  }
  for (const float** bias : {&e->b1, &e->b3, &e->b2}) *bias = Rebase(*bias, file, *copy);
  e->copy = std::move(copy);
  e->file.reset();
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LayerRouting>> ModelDir::LoadRouting(int64_t layer, bool verify_checksum) const {
  if (layer < 0 || layer >= manifest_.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is out of range [0, ", manifest_.n_layers, ")"));
  }
  // The router keeps the tables for its lifetime: they are read from their
  // files once, into private copies, and checked there — so a file replaced
  // or truncated in place, then or later, changes nothing the router reads.
  auto routing = std::make_unique<LayerRouting>();
  routing->layer = layer;
  for (auto [relative_path, copy] :
       {std::pair{GateFilePath(layer), &routing->gate_file}, std::pair{LutFilePath(layer), &routing->lut_file}}) {
    COLIBRI_ASSIGN_OR_RETURN(auto file, MapListedFile(relative_path, /*verify_checksum=*/false));
    copy->assign(file->data(), file->data() + file->size());
    if (file->faulted()) return ChangedWhileRead(file->path());
    if (verify_checksum) {
      COLIBRI_RETURN_IF_ERROR(
          CheckChecksum({copy->data(), copy->size(), file->path()}, *manifest_.FindFile(relative_path)));
    }
  }
  const std::string gate_path = absl::StrCat(dir_, "/", GateFilePath(layer));
  const std::string lut_path = absl::StrCat(dir_, "/", LutFilePath(layer));
  COLIBRI_RETURN_IF_ERROR(ParseRouting(manifest_, {routing->gate_file.data(), routing->gate_file.size(), gate_path},
                                       {routing->lut_file.data(), routing->lut_file.size(), lut_path}, routing.get()));
  return routing;
}

}  // namespace common
}  // namespace colibri
