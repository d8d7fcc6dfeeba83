#include "common/manifest.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/json_depth.h"
#include "nlohmann/json.hpp"

namespace colibri {
namespace common {
namespace {

using Json = nlohmann::json;

// The lowest version that holds `m` (kManifestFormatVersion's comment).
int FormatVersionOf(const Manifest& m) {
  if (m.routing.logit_bias || m.routing.weight_at_input || !m.activation.plain() || m.expert_biases) return 3;
  return m.n_shared_experts > 0 || !m.routing.plain() ? 2 : 1;
}

}  // namespace

const ManifestFile* Manifest::FindFile(const std::string& path) const {
  for (const ManifestFile& f : files) {
    if (f.path == path) return &f;
  }
  return nullptr;
}

std::string ExpertFilePath(int64_t layer, int64_t expert) {
  return absl::StrFormat("layer_%03d/expert_%03d.bin", layer, expert);
}
std::string GateFilePath(int64_t layer) { return absl::StrFormat("layer_%03d/gate.bin", layer); }
std::string LutFilePath(int64_t layer) { return absl::StrFormat("layer_%03d/lut.bin", layer); }

std::string ManifestToJson(const Manifest& m) {
  Json files = Json::array();
  for (const ManifestFile& f : m.files) {
    files.push_back({{"path", f.path}, {"size", f.size}, {"checksum", f.checksum}});
  }
  Json j = {
      {"format", "colibri-model"},
      {"format_version", FormatVersionOf(m)},
      {"architecture", m.architecture},
      {"d_model", m.d_model},
      {"d_ff", m.d_ff},
      {"n_layers", m.n_layers},
      {"n_experts", m.n_experts},
      {"top_k", m.top_k},
      {"norm_topk_prob", m.norm_topk_prob},
      {"vocab_size", m.vocab_size},
      {"weight_type", DTypeName(m.weight_type)},
      {"hf_layers", m.hf_layers},
      {"lut", {{"source", m.lut_source}, {"balance_loss_weight", m.balance_loss_weight}}},
      {"files", files},
  };
  if (m.n_shared_experts > 0) {
    j["shared_experts"] = {{"count", m.n_shared_experts}, {"d_ff", m.shared_d_ff}, {"gated", m.shared_gate}};
  }
  if (!m.routing.plain()) {
    const RoutingSpec& r = m.routing;
    j["routing"] = {
        {"scoring", r.scoring == RoutingSpec::Scoring::kSigmoid ? "sigmoid" : "softmax"},
        {"n_group", r.n_group},
        {"topk_group", r.topk_group},
        {"group_score", r.group_score == RoutingSpec::GroupScore::kTopTwoSum ? "top2_sum" : "max"},
        {"correction_bias", r.correction_bias},
        {"logit_bias", r.logit_bias},
        {"scaling", r.scaling},
        {"weight_at", r.weight_at_input ? "input" : "output"},
    };
  }
  if (!m.activation.plain() || m.expert_biases) {
    const Activation& a = m.activation;
    j["experts"] = {
        {"activation",
         {{"alpha", a.alpha},
          {"limit", std::isinf(a.limit) ? Json(nullptr) : Json(a.limit)},
          {"up_offset", a.up_offset}}},
        {"biases", m.expert_biases},
    };
  }
  return j.dump(2) + "\n";
}

absl::StatusOr<Manifest> ParseManifest(absl::string_view json, const std::string& path) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("bad manifest ", path, ": ", why));
  };
  // Bounds first: the parser builds the whole document, ~80 bytes per
  // nested bracket, so a hostile one could exhaust memory before failing.
  if (static_cast<int64_t>(json.size()) > kMaxManifestBytes) {
    return bad(absl::StrCat(json.size(), " bytes, more than a manifest may hold (", kMaxManifestBytes, ")"));
  }
  if (const int depth = JsonDepth(json); depth > kMaxJsonDepth) {
    return bad(absl::StrCat("nested ", depth, " levels deep, more than a manifest may be (", kMaxJsonDepth, ")"));
  }
  Json j = Json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  auto integer = [&](const char* key, int64_t lo, int64_t hi, int64_t* out) -> absl::Status {
    auto it = j.find(key);
    if (it == j.end() || !it->is_number_integer()) return bad(absl::StrCat("missing integer '", key, "'"));
    const int64_t v = it->get<int64_t>();
    if (v < lo || v > hi) return bad(absl::StrCat("'", key, "' = ", v, " is outside [", lo, ", ", hi, "]"));
    *out = v;
    return absl::OkStatus();
  };
  Manifest m;
  if (!j.contains("format") || !j["format"].is_string() || j["format"].get<std::string>() != "colibri-model") {
    return bad("'format' is not \"colibri-model\"");
  }
  int64_t version = 0;
  if (auto s = integer("format_version", 0, INT32_MAX, &version); !s.ok()) return s;
  if (version < 1 || version > kManifestFormatVersion) {
    return bad(
        absl::StrCat("unsupported format_version ", version, " (this build reads 1 to ", kManifestFormatVersion, ")"));
  }
  m.format_version = static_cast<int>(version);
  for (auto [key, lo, hi, out] :
       {std::tuple{"d_model", int64_t{1}, kMaxDim, &m.d_model}, std::tuple{"d_ff", int64_t{1}, kMaxDim, &m.d_ff},
        std::tuple{"n_layers", int64_t{1}, kMaxLayers, &m.n_layers},
        std::tuple{"n_experts", int64_t{1}, kMaxExperts, &m.n_experts},
        std::tuple{"top_k", int64_t{1}, kMaxExperts, &m.top_k},
        std::tuple{"vocab_size", int64_t{1}, kMaxVocab, &m.vocab_size}}) {
    if (auto s = integer(key, lo, hi, out); !s.ok()) return s;
  }
  if (m.top_k > m.n_experts) {
    return bad(absl::StrCat("top_k ", m.top_k, " exceeds n_experts ", m.n_experts));
  }
  if (!j.contains("architecture") || !j["architecture"].is_string()) return bad("missing string 'architecture'");
  m.architecture = j["architecture"].get<std::string>();
  if (!j.contains("norm_topk_prob") || !j["norm_topk_prob"].is_boolean())
    return bad("missing boolean 'norm_topk_prob'");
  m.norm_topk_prob = j["norm_topk_prob"].get<bool>();
  if (!j.contains("weight_type") || !j["weight_type"].is_string()) return bad("missing string 'weight_type'");
  auto type = ParseWeightType(j["weight_type"].get<std::string>());
  if (!type.ok()) return bad(std::string(type.status().message()));
  m.weight_type = *type;
  if (j.contains("hf_layers") && j["hf_layers"].is_array()) {
    for (const Json& v : j["hf_layers"]) {
      if (!v.is_number_integer()) return bad("'hf_layers' holds a non-integer");
      m.hf_layers.push_back(v.get<int64_t>());
    }
  }
  if (j.contains("shared_experts")) {
    const Json& shared = j["shared_experts"];
    if (version < 2) return bad("'shared_experts' needs format_version 2");
    if (!shared.is_object() || !shared.contains("count") || !shared["count"].is_number_integer() ||
        !shared.contains("d_ff") || !shared["d_ff"].is_number_integer() || !shared.contains("gated") ||
        !shared["gated"].is_boolean()) {
      return bad("'shared_experts' needs integer count and d_ff and boolean gated");
    }
    m.n_shared_experts = shared["count"].get<int64_t>();
    m.shared_d_ff = shared["d_ff"].get<int64_t>();
    m.shared_gate = shared["gated"].get<bool>();
    if (m.n_shared_experts < 1 || m.n_shared_experts > kMaxExperts - m.n_experts) {
      return bad(absl::StrCat("'shared_experts.count' = ", m.n_shared_experts, " is outside [1, ",
                              kMaxExperts - m.n_experts, "]"));
    }
    if (m.shared_d_ff < 1 || m.shared_d_ff > kMaxDim) {
      return bad(absl::StrCat("'shared_experts.d_ff' = ", m.shared_d_ff, " is outside [1, ", kMaxDim, "]"));
    }
  }
  if (j.contains("routing")) {
    const Json& r = j["routing"];
    if (version < 2) return bad("'routing' needs format_version 2");
    if (!r.is_object() || !r.contains("scoring") || !r["scoring"].is_string() || !r.contains("n_group") ||
        !r["n_group"].is_number_integer() || !r.contains("topk_group") || !r["topk_group"].is_number_integer() ||
        !r.contains("group_score") || !r["group_score"].is_string() || !r.contains("correction_bias") ||
        !r["correction_bias"].is_boolean() || !r.contains("scaling") || !r["scaling"].is_number()) {
      return bad(
          "'routing' needs string scoring and group_score, integer n_group and topk_group, boolean "
          "correction_bias and number scaling");
    }
    RoutingSpec& spec = m.routing;
    const std::string scoring = r["scoring"].get<std::string>(), group_score = r["group_score"].get<std::string>();
    if (scoring != "softmax" && scoring != "sigmoid") return bad("'routing.scoring' must be softmax or sigmoid");
    if (group_score != "max" && group_score != "top2_sum") return bad("'routing.group_score' must be max or top2_sum");
    spec.scoring = scoring == "sigmoid" ? RoutingSpec::Scoring::kSigmoid : RoutingSpec::Scoring::kSoftmax;
    spec.group_score = group_score == "top2_sum" ? RoutingSpec::GroupScore::kTopTwoSum : RoutingSpec::GroupScore::kMax;
    spec.n_group = r["n_group"].get<int64_t>();
    spec.topk_group = r["topk_group"].get<int64_t>();
    spec.correction_bias = r["correction_bias"].get<bool>();
    spec.scaling = r["scaling"].get<double>();
    // Version 3's keys, optional (absent: false / output).
    if (r.contains("logit_bias")) {
      if (!r["logit_bias"].is_boolean()) return bad("'routing.logit_bias' must be a boolean");
      spec.logit_bias = r["logit_bias"].get<bool>();
    }
    if (r.contains("weight_at")) {
      if (r["weight_at"] != "input" && r["weight_at"] != "output") {
        return bad("'routing.weight_at' must be input or output");
      }
      spec.weight_at_input = r["weight_at"] == "input";
    }
    if ((spec.logit_bias || spec.weight_at_input) && version < 3) {
      return bad("'routing.logit_bias' and 'routing.weight_at' = input need format_version 3");
    }
    if (spec.correction_bias && spec.logit_bias) {
      return bad("'routing': correction_bias and logit_bias cannot both be set (one bias section)");
    }
    if (spec.n_group < 1 || m.n_experts % spec.n_group != 0 || spec.topk_group < 1 || spec.topk_group > spec.n_group ||
        m.top_k > spec.topk_group * (m.n_experts / spec.n_group)) {
      return bad(absl::StrCat("'routing': n_group ", spec.n_group, " and topk_group ", spec.topk_group,
                              " must divide the ", m.n_experts, " experts and keep at least top_k ", m.top_k));
    }
    if (!(spec.scaling > 0 && spec.scaling <= std::numeric_limits<float>::max())) {
      return bad("'routing.scaling' must be > 0 and fit a float");  // route weights are f32
    }
  }
  if (j.contains("experts")) {
    const Json& e = j["experts"];
    if (version < 3) return bad("'experts' needs format_version 3");
    if (!e.is_object() || !e.contains("activation") || !e["activation"].is_object() || !e.contains("biases") ||
        !e["biases"].is_boolean()) {
      return bad("'experts' needs object activation and boolean biases");
    }
    const Json& a = e["activation"];
    if (!a.contains("alpha") || !a["alpha"].is_number() || !a.contains("limit") ||
        !(a["limit"].is_number() || a["limit"].is_null()) || !a.contains("up_offset") || !a["up_offset"].is_number()) {
      return bad("'experts.activation' needs number alpha and up_offset and number-or-null limit");
    }
    m.activation.alpha = a["alpha"].get<double>();
    if (!a["limit"].is_null()) m.activation.limit = a["limit"].get<double>();
    m.activation.up_offset = a["up_offset"].get<double>();
    m.expert_biases = e["biases"].get<bool>();
    if (!std::isfinite(m.activation.alpha) || !std::isfinite(m.activation.up_offset) || !(m.activation.limit > 0)) {
      return bad("'experts.activation': alpha and up_offset must be finite, limit > 0 or null");
    }
  }
  if (static_cast<int64_t>(m.hf_layers.size()) != m.n_layers) {
    return bad(absl::StrCat("'hf_layers' has ", m.hf_layers.size(), " entries, n_layers is ", m.n_layers));
  }
  if (j.contains("lut") && j["lut"].is_object()) {
    const Json& source = j["lut"]["source"];
    if (source.is_string()) m.lut_source = source.get<std::string>();
    const Json& alpha = j["lut"]["balance_loss_weight"];
    if (alpha.is_number()) m.balance_loss_weight = alpha.get<double>();
  }
  if (!j.contains("files") || !j["files"].is_array()) return bad("missing array 'files'");
  std::set<std::string> seen;
  for (const Json& f : j["files"]) {
    if (!f.is_object() || !f.contains("path") || !f["path"].is_string() || !f.contains("size") ||
        !f["size"].is_number_unsigned() || !f.contains("checksum") || !f["checksum"].is_string()) {
      return bad(absl::StrCat("malformed entry ", seen.size(),
                              " in 'files' (needs string path, unsigned size, "
                              "string checksum)"));
    }
    ManifestFile file{f["path"].get<std::string>(), f["size"].get<uint64_t>(), f["checksum"].get<std::string>()};
    if (file.path.empty() || file.path[0] == '/' || absl::StrContains(file.path, "..")) {
      return bad(absl::StrCat("file path '", file.path, "' must be relative and stay inside the directory"));
    }
    if (!seen.insert(file.path).second) return bad(absl::StrCat("file '", file.path, "' listed twice"));
    m.files.push_back(std::move(file));
  }
  for (int64_t layer = 0; layer < m.n_layers; ++layer) {
    std::vector<std::string> required = {GateFilePath(layer), LutFilePath(layer)};
    for (int64_t e = 0; e < m.total_experts(); ++e) required.push_back(ExpertFilePath(layer, e));
    for (const std::string& p : required) {
      if (!seen.count(p)) return bad(absl::StrCat("required file '", p, "' is not listed"));
    }
  }
  return m;
}

}  // namespace common
}  // namespace colibri
