#include "tools/prune.h"

#include <algorithm>
#include <filesystem>
#include <numeric>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/model_dir.h"
#include "common/routing.h"
#include "common/status_macros.h"
#include "tools/expert_load.h"
#include "tools/model_writer.h"

namespace colibri {
namespace tools {
namespace {

using common::DType;
// Copies an expert file with its header's expert id set to `new_id`.
absl::StatusOr<common::ManifestFile> CopyExpert(const common::ModelDir& model, int64_t layer, int64_t expert,
                                                int64_t new_id, const std::string& out_dir) {
  COLIBRI_ASSIGN_OR_RETURN(auto file, model.MapListedFile(common::ExpertFilePath(layer, expert), true));
  COLIBRI_ASSIGN_OR_RETURN(common::WeightFileLayout layout,
                           common::ParseHeader(file->data(), file->size(), file->path()));
  layout.expert = static_cast<int32_t>(new_id);
  const std::string rel = common::ExpertFilePath(layer, new_id);
  COLIBRI_ASSIGN_OR_RETURN(auto w, HashingWriter::Create(absl::StrCat(out_dir, "/", rel)));
  COLIBRI_RETURN_IF_ERROR(w->Write(common::SerializeHeader(layout).data(), common::kWeightFileHeaderBytes));
  COLIBRI_RETURN_IF_ERROR(
      w->Write(file->data() + common::kWeightFileHeaderBytes, file->size() - common::kWeightFileHeaderBytes));
  return w->Close(rel);
}

// The top-k sets of `routes`' tokens, as original expert ids via `ids_of` (null: as they are).
std::vector<std::set<int32_t>> Sets(const common::Routes& routes, const std::vector<int64_t>* ids_of) {
  std::vector<std::set<int32_t>> sets(routes.num_tokens());
  for (int64_t t = 0; t < routes.num_tokens(); ++t) {
    for (int64_t j = 0; j < routes.top_k; ++j) {
      const int32_t id = routes.expert_ids[t * routes.top_k + j];
      sets[t].insert(ids_of == nullptr ? id : static_cast<int32_t>((*ids_of)[id]));
    }
  }
  return sets;
}

}  // namespace

absl::Status PruneModel(const PruneOptions& o, std::ostream& log, PruneReport* report) {
  PruneReport local;
  PruneReport& rep = report != nullptr ? *report : local;
  if ((o.keep_top > 0) == (o.min_share > 0)) {
    return absl::InvalidArgumentError("give exactly one of PruneOptions::keep_top and PruneOptions::min_share");
  }
  if (o.load_path.empty() && o.calibration_path.empty()) {
    return absl::InvalidArgumentError(
        "no load: give the router's expert load (PruneOptions::load_path) or calibration records "
        "(PruneOptions::calibration_path)");
  }
  COLIBRI_ASSIGN_OR_RETURN(auto model, common::ModelDir::Open(o.model_dir));
  const common::Manifest& m = model->manifest();
  if (m.routing.n_group > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the model routes within ", m.routing.n_group,
        " expert groups (DeepSeek's n_group): dropping experts would break the groups; pruning it is not supported"));
  }
  const int64_t E = m.n_experts, K = m.top_k, L = m.n_layers;

  // Routing tables and, with calibration records, each record's original routes.
  std::vector<std::unique_ptr<common::LayerRouting>> routing(L);
  for (int64_t layer = 0; layer < L; ++layer) {
    COLIBRI_ASSIGN_OR_RETURN(routing[layer], model->LoadRouting(layer, /*verify_checksum=*/true));
  }
  CalibrationRoutes calibration;
  if (!o.calibration_path.empty()) {
    COLIBRI_ASSIGN_OR_RETURN(calibration, RouteCalibration(*model, routing, o.calibration_path));
  } else {
    calibration.hidden.resize(L);
    calibration.routes.resize(L);
  }
  const std::vector<std::vector<float>>& hidden = calibration.hidden;
  const std::vector<common::Routes>& before = calibration.routes;

  ExpertLoad load(L, std::vector<double>(E, 0.0));
  if (!o.load_path.empty()) {
    COLIBRI_RETURN_IF_ERROR(AddLoadFile(o.load_path, m.n_shared_experts, &load));
  } else {
    AddRoutes(calibration, &load);
  }

  // The kept experts: each layer's N most loaded.
  rep.layers.assign(L, {});
  std::vector<std::vector<int64_t>> by_load(L);
  int64_t n_keep = o.keep_top;
  for (int64_t layer = 0; layer < L; ++layer) {
    const double total = std::accumulate(load[layer].begin(), load[layer].end(), 0.0);
    if (!(total > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("no load for layer ", layer, " (",
                       o.load_path.empty() ? "no calibration records for it" : "nothing for it in the load file",
                       "): cannot tell which experts carry it"));
    }
    PruneLayerReport& lr = rep.layers[layer];
    lr.layer = layer;
    for (double c : load[layer]) lr.share.push_back(c / total);
    by_load[layer].resize(E);
    std::iota(by_load[layer].begin(), by_load[layer].end(), 0);
    std::stable_sort(by_load[layer].begin(), by_load[layer].end(),
                     [&](int64_t a, int64_t b) { return load[layer][a] > load[layer][b]; });
    if (o.min_share > 0) {
      n_keep = std::max<int64_t>(
          n_keep, std::count_if(lr.share.begin(), lr.share.end(), [&](double s) { return s >= o.min_share; }));
    }
  }
  if (n_keep < K || n_keep > E) {
    return absl::InvalidArgumentError(absl::StrCat("keeping ", n_keep, " experts per layer is outside [top_k ", K,
                                                   ", n_experts ", E, "]: every token needs top_k distinct experts"));
  }
  rep.n_experts_before = E;
  rep.n_experts_after = n_keep;

  if (std::error_code ec; std::filesystem::equivalent(o.model_dir, o.out_dir, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--out ", o.out_dir, " is the model directory itself: write the pruned model elsewhere"));
  }
  COLIBRI_ASSIGN_OR_RETURN(const std::unique_ptr<OutputDir> dir, OutputDir::Begin(o.out_dir, o.overwrite));
  common::Manifest out = m;
  out.n_experts = n_keep;
  out.files.clear();
  for (int64_t layer = 0; layer < L; ++layer) {
    PruneLayerReport& lr = rep.layers[layer];
    lr.kept.assign(by_load[layer].begin(), by_load[layer].begin() + n_keep);
    std::sort(lr.kept.begin(), lr.kept.end());
    std::vector<int64_t> new_id(E, -1);
    for (int64_t j = 0; j < n_keep; ++j) new_id[lr.kept[j]] = j;
    for (int64_t e = 0; e < E; ++e) {
      if (new_id[e] < 0) lr.dropped_share += lr.share[e];
    }
    std::error_code ec;
    std::filesystem::create_directories(
        std::filesystem::path(absl::StrCat(dir->path(), "/", common::LutFilePath(layer))).parent_path(), ec);

    // Gate: the kept rows (and bias entries); the shared gate as it is.
    const common::LayerRouting& r = *routing[layer];
    std::vector<float> gate, bias;
    for (int64_t e : lr.kept) {
      gate.insert(gate.end(), r.gate + e * m.d_model, r.gate + (e + 1) * m.d_model);
      if (r.bias != nullptr) bias.push_back(r.bias[e]);
    }
    std::vector<PlainSection> gate_sections = {{"gate", DType::kF32, n_keep, m.d_model, gate.data(), gate.size() * 4}};
    if (r.bias != nullptr) gate_sections.push_back({"bias", DType::kF32, 1, n_keep, bias.data(), bias.size() * 4});
    if (r.shared_gate != nullptr) {
      gate_sections.push_back({"shared_gate", DType::kF32, m.n_shared_experts, m.d_model, r.shared_gate,
                               static_cast<size_t>(m.n_shared_experts * m.d_model * 4)});
    }
    COLIBRI_ASSIGN_OR_RETURN(auto gate_file, WritePlainFile(dir->path(), common::GateFilePath(layer),
                                                            common::FileKind::kGate, layer, gate_sections));
    out.files.push_back(gate_file);

    // LUT: kept entries in order, filled with the most loaded kept experts at weight 0.
    std::vector<int32_t> ids(m.vocab_size * K);
    std::vector<float> weights(m.vocab_size * K);
    for (int64_t v = 0; v < m.vocab_size; ++v) {
      const int32_t* old_ids = r.lut_ids + v * K;
      const float* old_w = r.lut_weights + v * K;
      int32_t* row_ids = ids.data() + v * K;
      float* row_w = weights.data() + v * K;
      double sum_all = 0, sum_kept = 0;
      int64_t n = 0;
      for (int64_t j = 0; j < K; ++j) {
        sum_all += old_w[j];
        if (new_id[old_ids[j]] < 0) continue;
        row_ids[n] = static_cast<int32_t>(new_id[old_ids[j]]);
        row_w[n++] = old_w[j];
        sum_kept += old_w[j];
      }
      const int64_t kept_entries = n;
      lr.lut_rows_changed += kept_entries < K;
      for (int64_t e : by_load[layer]) {
        if (n == K) break;
        const int32_t id = static_cast<int32_t>(new_id[e]);
        if (id < 0 || std::find(row_ids, row_ids + n, id) != row_ids + n) continue;
        row_ids[n] = id;
        row_w[n++] = 0.f;
      }
      if (m.norm_topk_prob && kept_entries < K) {
        for (int64_t j = 0; j < K; ++j) {
          row_w[j] = kept_entries == 0 || !(sum_kept > 0) ? static_cast<float>(sum_all / K)
                                                          : static_cast<float>(row_w[j] * (sum_all / sum_kept));
        }
      }
    }
    COLIBRI_ASSIGN_OR_RETURN(
        auto lut_file, WritePlainFile(dir->path(), common::LutFilePath(layer), common::FileKind::kLut, layer,
                                      {{"ids", DType::kI32, m.vocab_size, K, ids.data(), ids.size() * 4},
                                       {"weights", DType::kF32, m.vocab_size, K, weights.data(), weights.size() * 4}}));
    out.files.push_back(lut_file);

    for (int64_t j = 0; j < n_keep; ++j) {
      COLIBRI_ASSIGN_OR_RETURN(auto file, CopyExpert(*model, layer, lr.kept[j], j, dir->path()));
      out.files.push_back(file);
    }
    for (int64_t s = 0; s < m.n_shared_experts; ++s) {
      COLIBRI_ASSIGN_OR_RETURN(auto file, CopyExpert(*model, layer, E + s, n_keep + s, dir->path()));
      out.files.push_back(file);
    }

    // The routing change on the calibration records: top-k sets (original ids) before and after.
    if (!hidden[layer].empty()) {
      const common::Routes after =
          common::RouteByGateSpec(m.routing, gate.data(), bias.empty() ? nullptr : bias.data(), n_keep, m.d_model, K,
                                  m.norm_topk_prob, hidden[layer].data(), before[layer].num_tokens());
      const auto sets_before = Sets(before[layer], nullptr);
      const auto sets_after = Sets(after, &lr.kept);
      lr.records = before[layer].num_tokens();
      for (int64_t t = 0; t < lr.records; ++t) lr.records_changed += sets_before[t] != sets_after[t];
    }
    log << absl::StrFormat(
        "layer %d: kept %d of %d experts [%s]; dropped experts carried %.2f%% of the load; %d of "
        "%d LUT rows changed",
        layer, n_keep, E, absl::StrJoin(lr.kept, ","), 100 * lr.dropped_share, lr.lut_rows_changed, m.vocab_size);
    if (lr.records > 0) {
      log << absl::StrFormat("; gate routing of %d calibration records: %.2f%% change their top-%d set", lr.records,
                             100.0 * lr.records_changed / lr.records, K);
    }
    log << "\n";
  }
  COLIBRI_RETURN_IF_ERROR(dir->Commit(out));
  log << absl::StrFormat("wrote %s: %d layers x %d routed experts (was %d)%s\n", o.out_dir, L, n_keep, E,
                         m.n_shared_experts > 0 ? absl::StrCat(" + ", m.n_shared_experts, " shared") : "");
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace colibri
