#include "tools/validate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/checksum.h"
#include "common/file_verifier.h"
#include "common/manifest.h"
#include "common/mapped_file.h"
#include "common/model_dir.h"
#include "common/weight_file.h"
#include "common/weight_matrix.h"

namespace colibri {
namespace tools {
namespace {

namespace fs = std::filesystem;
using common::DType;
using common::FileKind;
using Problems = std::vector<std::string>;

// Counts faults of one kind over many elements and describes only the first,
// so a matrix full of NaNs is one problem, not millions.
class Tally {
 public:
  explicit Tally(std::string what) : what_(std::move(what)) {}

  // `where` is a callable returning a description; it runs for the first fault only.
  template <typename Where>
  void Add(const Where& where) {
    if (count_++ == 0) first_ = where();
  }
  void Flush(Problems* problems) const {
    if (count_ > 0) problems->push_back(absl::StrCat(count_, " ", what_, " (first at ", first_, ")"));
  }

 private:
  const std::string what_;
  int64_t count_ = 0;
  std::string first_;
};

// The role a file has in the model's layout: what its header must say.
struct Role {
  FileKind kind;
  int64_t layer;
  int64_t expert;  // -1 for per-layer files
};

std::string RoleName(FileKind kind, int64_t layer, int64_t expert) {
  const char* kind_name = kind == FileKind::kExpert ? "expert" : kind == FileKind::kGate ? "gate" : "lut";
  return absl::StrCat(kind_name, " file of layer ", layer,
                      expert >= 0 ? absl::StrCat(" expert ", expert) : std::string());
}

// The reason in `status` without the "bad weight file <path>: " prefix that
// common/ puts in front (the report names the file already).
std::string Reason(const absl::Status& status, const std::string& full_path) {
  const std::string message(status.message());
  const std::string prefix = absl::StrCat("bad weight file ", full_path, ": ");
  return absl::StartsWith(message, prefix) ? message.substr(prefix.size()) : message;
}

// A listed file, mapped, with its header if that parsed and matches the role.
struct OpenedFile {
  std::string full_path;
  std::unique_ptr<common::MappedFile> file;        // null if it could not be mapped
  std::optional<common::WeightFileLayout> layout;  // set only if contents can be checked
  bool size_ok = false;
  Problems problems;
};

// Checks 2 and 5: existence, size, checksum, header, identity, alignment.
// `role` is null for a listed file the layout has no place for.
OpenedFile OpenListedFile(const common::ModelDir& model, const std::string& path, const Role* role,
                          const ValidateOptions& options, ValidationReport* report) {
  OpenedFile out;
  out.full_path = absl::StrCat(model.dir(), "/", path);
  const common::ManifestFile* listed = model.manifest().FindFile(path);
  if (listed == nullptr) {  // ParseManifest refuses this; kept so nothing is assumed
    out.problems.push_back("required file is not listed in the manifest");
    return out;
  }
  ++report->files_checked;
  auto file = model.MapListedFileUnchecked(path);
  if (!file.ok()) {
    out.problems.push_back(file.status().code() == absl::StatusCode::kNotFound ? std::string("missing")
                                                                               : std::string(file.status().message()));
    return out;
  }
  out.file = std::move(*file);
  const common::MappedFile& f = *out.file;
  report->bytes_checked += f.size();
  out.size_ok = f.size() == listed->size;
  if (!out.size_ok) {
    out.problems.push_back(absl::StrCat("size is ", f.size(), " bytes, the manifest says ", listed->size,
                                        f.size() < listed->size ? " (truncated?)" : ""));
  }
  if (options.checksums) {
    const std::string actual = common::ChecksumBytes(f.data(), f.size());
    if (actual != listed->checksum) {
      out.problems.push_back(absl::StrCat("checksum ", actual, " does not match the manifest's ", listed->checksum));
    }
  }
  if (f.faulted()) {  // read as zeros past the new end: nothing more to say of it
    out.problems.push_back("the file shrank while it was being read");
    return out;
  }
  if (role == nullptr) {
    out.problems.push_back("unexpected file (no role in this model's layout)");
    return out;
  }
  auto layout = common::ParseHeader(f.data(), f.size(), out.full_path);
  if (!layout.ok()) {
    // ParseHeader refuses a misaligned section outright; name the check it failed.
    const std::string why = Reason(layout.status(), out.full_path);
    out.problems.push_back(absl::StrCat(absl::StrContains(why, "aligned") ? "alignment: " : "header: ", why));
    return out;
  }
  bool usable = true;
  for (const common::Section& s : layout->sections) {
    if (s.offset % common::kSectionAlignment != 0) {
      out.problems.push_back(absl::StrCat("alignment: section '", s.name, "' offset ", s.offset,
                                          " is not a multiple of ", common::kSectionAlignment));
      usable = false;
    }
  }
  if (layout->kind != role->kind || layout->layer != role->layer || layout->expert != role->expert) {
    out.problems.push_back(absl::StrCat("header says ", RoleName(layout->kind, layout->layer, layout->expert),
                                        ", expected ", RoleName(role->kind, role->layer, role->expert)));
    usable = false;
  }
  if (usable) out.layout = std::move(*layout);
  return out;
}

// Check 3, values: finite scales >= 0 and zero points <= 15 for int8/int4,
// finite weights otherwise.
void CheckMatrix(const std::string& name, const common::MatrixView& view, Problems* problems) {
  const common::MatrixLayout& l = view.layout;
  if (view.scales != nullptr) {
    Tally scales(absl::StrCat(name, ".scales not finite or negative"));
    Tally zeros(absl::StrCat(name, ".zeros above 15"));
    for (int64_t r = 0; r < l.rows; ++r) {
      for (int64_t g = 0; g < l.groups; ++g) {
        const int64_t i = r * l.groups + g;
        auto where = [&] { return absl::StrCat("row ", r, " group ", g); };
        if (!(std::isfinite(view.scales[i]) && view.scales[i] >= 0.f)) scales.Add(where);
        if (view.zeros != nullptr && view.zeros[i] > 15) zeros.Add(where);
      }
    }
    for (const Tally* tally : {&scales, &zeros}) tally->Flush(problems);
    return;
  }
  Tally values(absl::StrCat(name, " weights not finite"));
  std::vector<float> row(static_cast<size_t>(l.cols));
  for (int64_t r = 0; r < l.rows; ++r) {
    common::DecodeRow(view, r, row.data());
    for (int64_t c = 0; c < l.cols; ++c) {
      if (!std::isfinite(row[c])) values.Add([&] { return absl::StrCat("row ", r, " col ", c); });
    }
  }
  values.Flush(problems);
}

// Check 3: the runtime's own loader decides the sections, then the values.
void CheckExpert(const common::ModelDir& model, int64_t layer, int64_t expert, OpenedFile* f) {
  auto weights = model.LoadExpert(layer, expert, /*verify_checksum=*/false);
  if (!weights.ok()) {
    f->problems.push_back(absl::StrCat("sections: ", Reason(weights.status(), f->full_path)));
    return;
  }
  CheckMatrix("w1", (*weights)->w1, &f->problems);
  CheckMatrix("w3", (*weights)->w3, &f->problems);
  CheckMatrix("w2", (*weights)->w2, &f->problems);
}

// The bytes of section `name` if it is a [rows][cols] array of the 4-byte
// `dtype` filling exactly its size; otherwise nullptr and a problem.
const uint8_t* Section4(const OpenedFile& f, const std::string& name, DType dtype, int64_t rows, int64_t cols,
                        Problems* problems) {
  const common::Section* s = f.layout->Find(name);
  if (s == nullptr) {
    problems->push_back(absl::StrCat("sections: no section '", name, "'"));
    return nullptr;
  }
  const uint64_t size = static_cast<uint64_t>(rows * cols) * 4;
  if (s->dtype != dtype || s->rows != rows || s->cols != cols || s->size != size) {
    problems->push_back(absl::StrCat("sections: '", name, "' is ", common::DTypeName(s->dtype), " [", s->rows, " x ",
                                     s->cols, "] in ", s->size, " bytes, expected ", common::DTypeName(dtype), " [",
                                     rows, " x ", cols, "] in ", size));
    return nullptr;
  }
  return f.file->data() + s->offset;
}

// Check 4, gate: f32 [n_experts][d_model] (and, with a shared-expert gate,
// "shared_gate" f32 [n_shared_experts][d_model]), every element finite.
void CheckGate(const common::Manifest& m, OpenedFile* f) {
  Tally bad("gate weights not finite");
  // Counts the non-finite elements of f32 [rows][cols] section `name` in
  // `bad` (row r named `row_name` r, or element i `row_name` i for one row);
  // false if the section is unusable.
  auto check = [&](const char* name, int64_t rows, int64_t cols, const char* row_name) {
    const uint8_t* bytes = Section4(*f, name, DType::kF32, rows, cols, &f->problems);
    if (bytes == nullptr) return false;
    const auto* values = reinterpret_cast<const float*>(bytes);
    for (int64_t i = 0; i < rows * cols; ++i) {
      if (!std::isfinite(values[i])) {
        bad.Add([&] {
          return rows == 1 ? absl::StrCat(row_name, i) : absl::StrCat(row_name, i / cols, " col ", i % cols);
        });
      }
    }
    return true;
  };
  if (m.routing.has_bias() && !check("bias", 1, m.n_experts, "bias of expert ")) return;
  if (m.shared_gate && !check("shared_gate", m.n_shared_experts, m.d_model, "shared expert ")) return;
  if (!check("gate", m.n_experts, m.d_model, "expert ")) return;
  bad.Flush(&f->problems);
}

// Check 4, LUT: per token, top_k distinct ids in [0, n_experts) and finite
// weights >= 0 that sum to 1 (times the routing's scaling) when the manifest
// says they are normalized.
void CheckLut(const common::Manifest& m, OpenedFile* f) {
  const int64_t k = m.top_k;
  const auto* ids = reinterpret_cast<const int32_t*>(Section4(*f, "ids", DType::kI32, m.vocab_size, k, &f->problems));
  const auto* weights =
      reinterpret_cast<const float*>(Section4(*f, "weights", DType::kF32, m.vocab_size, k, &f->problems));
  Tally range(absl::StrCat("expert ids outside [0, ", m.n_experts, ")"));
  Tally repeats("tokens routed twice to one expert");
  Tally non_finite("route weights not finite");
  Tally negative("route weights negative");
  Tally sums(absl::StrCat("tokens whose weights do not sum to ", m.routing.scaling, " (norm_topk_prob)"));
  for (int64_t t = 0; t < m.vocab_size; ++t) {
    bool repeated = false, finite = true;
    double sum = 0.0;
    for (int64_t j = 0; ids != nullptr && j < k; ++j) {
      const int32_t id = ids[t * k + j];
      if (id < 0 || id >= m.n_experts) range.Add([&] { return absl::StrCat("token ", t, " slot ", j, ": ", id); });
      for (int64_t i = 0; i < j; ++i) repeated = repeated || ids[t * k + i] == id;
    }
    if (repeated) repeats.Add([&] { return absl::StrCat("token ", t); });
    for (int64_t j = 0; weights != nullptr && j < k; ++j) {
      const float w = weights[t * k + j];
      auto where = [&] { return absl::StrCat("token ", t, " slot ", j, ": ", w); };
      if (!std::isfinite(w)) {
        non_finite.Add(where);
        finite = false;
      } else if (w < 0.f) {
        negative.Add(where);
      }
      sum += w;
    }
    if (weights != nullptr && m.norm_topk_prob && finite &&
        std::fabs(sum - m.routing.scaling) > 1e-4 * m.routing.scaling) {
      sums.Add([&] { return absl::StrFormat("token %d: sum %.6g", t, sum); });
    }
  }
  for (const Tally* tally : {&range, &repeats, &non_finite, &negative, &sums}) tally->Flush(&f->problems);
}

// Logs one file's verdict and moves its problems into the report.
void Emit(const std::string& path, Problems problems, ValidationReport* report, std::ostream& log) {
  if (problems.empty()) {
    log << "ok " << path << std::endl;
    return;
  }
  log << "FAIL " << path << ": " << absl::StrJoin(problems, "; ") << std::endl;
  for (std::string& p : problems) report->issues.push_back({path, std::move(p)});
}

// Check 6: every file in the tree, except manifest.json, must be listed.
void CheckTree(const std::string& dir, const common::Manifest& m, ValidationReport* report, std::ostream& log) {
  std::set<std::string> listed;
  for (const common::ManifestFile& f : m.files) {
    listed.insert(fs::path(f.path).lexically_normal().generic_string());
  }
  std::vector<std::string> unlisted;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, ec);
  for (; !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    std::error_code type_ec;
    if (it->is_directory(type_ec)) continue;
    const std::string relative = it->path().lexically_relative(dir).generic_string();
    // The verified-files cache a node keeps next to the model is not part of it.
    if (relative == common::kManifestFileName || relative == common::kVerifiedCacheFileName) continue;
    if (listed.count(relative) == 0) unlisted.push_back(relative);
  }
  if (ec) Emit(".", {absl::StrCat("cannot list the directory: ", ec.message())}, report, log);
  std::sort(unlisted.begin(), unlisted.end());
  for (const std::string& path : unlisted) Emit(path, {"not listed in the manifest"}, report, log);
}

// The closing block of the log; `model` is null when the manifest did not parse.
void PrintSummary(const std::string& dir, const common::ModelDir* model, const ValidationReport& report, double seconds,
                  std::ostream& log) {
  log << "\ndirectory     " << dir << "\n";
  if (model != nullptr) {
    const common::Manifest& m = model->manifest();
    log << "model id      " << model->model_id() << "\n"
        << "architecture  " << m.architecture << "\n"
        << absl::StrFormat("shape         %d layers x %d experts, d_model %d, d_ff %d, top_k %d, vocab %d\n",
                           m.n_layers, m.n_experts, m.d_model, m.d_ff, m.top_k, m.vocab_size)
        << "weight type   " << common::DTypeName(m.weight_type) << "\n";
  }
  log << absl::StrFormat("checked       %d files, %d bytes (%.1f MiB) in %.2f s\n", report.files_checked,
                         report.bytes_checked, report.bytes_checked / 1048576.0, seconds);
  log << (report.ok() ? std::string("VALID") : absl::StrCat("INVALID: ", report.issues.size(), " problem(s)"))
      << std::endl;
}

}  // namespace

ValidationReport ValidateModelDir(const std::string& dir, const ValidateOptions& options, std::ostream& log) {
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  ValidationReport report;
  auto opened = common::ModelDir::Open(dir);
  if (!opened.ok()) {
    Emit(common::kManifestFileName, {std::string(opened.status().message())}, &report, log);
    PrintSummary(dir, nullptr, report, elapsed(), log);
    return report;
  }
  const common::ModelDir& model = **opened;
  const common::Manifest& m = model.manifest();

  std::set<std::string> with_role;
  // Checks 2 and 5 for the file at `path`, then `contents(&file)` if its header is usable.
  auto check = [&](const std::string& path, const Role& role, const auto& contents) {
    OpenedFile f = OpenListedFile(model, path, &role, options, &report);
    if (f.layout) contents(&f);
    Emit(path, std::move(f.problems), &report, log);
    with_role.insert(path);
  };
  for (int64_t layer = 0; layer < m.n_layers; ++layer) {
    check(common::GateFilePath(layer), {FileKind::kGate, layer, -1}, [&](OpenedFile* f) { CheckGate(m, f); });
    check(common::LutFilePath(layer), {FileKind::kLut, layer, -1}, [&](OpenedFile* f) { CheckLut(m, f); });
    for (int64_t expert = 0; expert < m.total_experts(); ++expert) {  // shared experts too
      check(common::ExpertFilePath(layer, expert), {FileKind::kExpert, layer, expert}, [&](OpenedFile* f) {
        f->file.reset();  // LoadExpert maps the file again, and would only repeat a size fault
        if (f->size_ok) CheckExpert(model, layer, expert, f);
      });
    }
  }
  for (const common::ManifestFile& listed : m.files) {
    if (with_role.count(listed.path) != 0) continue;
    OpenedFile f = OpenListedFile(model, listed.path, /*role=*/nullptr, options, &report);
    Emit(listed.path, std::move(f.problems), &report, log);
  }
  CheckTree(dir, m, &report, log);
  PrintSummary(dir, &model, report, elapsed(), log);
  return report;
}

}  // namespace tools
}  // namespace colibri
