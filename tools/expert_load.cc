#include "tools/expert_load.h"

#include <cmath>
#include <fstream>
#include <regex>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "tools/hf_checkpoint.h"

namespace colibri {
namespace tools {

absl::Status AddLoadFile(const std::string& path, int64_t shared_experts, ExpertLoad* load) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read the load file ", path));
  const std::regex metric(R"(^colibri_router_expert_tokens_total\{(.*)\}\s+([0-9.eE+]+)\s*$)");
  const std::regex layer_label(R"(layer="(\d+)\")"), expert_label(R"(expert="(\d+)\")");
  std::string line;
  int64_t number = 0, used = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.empty() || line[0] == '#') continue;
    int64_t layer = -1, expert = -1;
    double count = -1;
    std::smatch m, l, e;
    if (std::regex_match(line, m, metric)) {
      const std::string labels = m[1];
      if (!std::regex_search(labels, l, layer_label) || !std::regex_search(labels, e, expert_label)) continue;
      if (!absl::SimpleAtoi(l[1].str(), &layer) || !absl::SimpleAtoi(e[1].str(), &expert) ||
          !absl::SimpleAtod(m[2].str(), &count) || !std::isfinite(count)) {
        return absl::InvalidArgumentError(
            absl::StrCat("load file ", path, " line ", number, ": a layer, expert or count that is not a number"));
      }
      // A shared expert (id n_experts and up) gets every token: nothing to place or prune.
      const int64_t routed = static_cast<int64_t>((*load)[0].size());
      if (expert >= routed && expert < routed + shared_experts) continue;
    } else if (line.rfind("colibri_", 0) == 0) {
      continue;  // another metric of the page
    } else {
      std::istringstream fields(line);
      std::string rest;
      if (!(fields >> layer >> expert >> count) || (fields >> rest)) {
        return absl::InvalidArgumentError(
            absl::StrCat("load file ", path, " line ", number, ": expected 'layer expert count' or a metric line"));
      }
    }
    if (layer < 0 || layer >= static_cast<int64_t>(load->size()) || expert < 0 ||
        expert >= static_cast<int64_t>((*load)[0].size()) || !(count >= 0)) {
      return absl::InvalidArgumentError(absl::StrCat("load file ", path, " line ", number, ": layer ", layer,
                                                     " expert ", expert, " count ", count,
                                                     " is outside the model's layers and routed experts"));
    }
    (*load)[layer][expert] += count;
    ++used;
  }
  if (used == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "load file ", path, " has no colibri_router_expert_tokens_total sample or 'layer expert count' line"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CalibrationRoutes> RouteCalibration(const common::ModelDir& model,
                                                   const std::vector<std::unique_ptr<common::LayerRouting>>& routing,
                                                   const std::string& path) {
  const common::Manifest& m = model.manifest();
  COLIBRI_ASSIGN_OR_RETURN(auto file, common::SafetensorsFile::Open(path));
  CalibrationRoutes out;
  out.hidden.resize(m.n_layers);
  out.routes.resize(m.n_layers);
  for (int64_t layer = 0; layer < m.n_layers; ++layer) {
    const std::string name = absl::StrCat("hidden_states.", layer);
    const common::SafetensorsTensor* h = file->Find(name);
    if (h == nullptr) continue;
    if (h->shape.size() != 2 || h->shape[1] != m.d_model ||
        (h->dtype != "F32" && h->dtype != "BF16" && h->dtype != "F16")) {
      return absl::InvalidArgumentError(
          absl::StrCat("calibration file ", path, ": '", name, "' must be F32/BF16/F16 [records, ", m.d_model, "]"));
    }
    out.hidden[layer].resize(h->shape[0] * m.d_model);
    HfCheckpoint::RowsToFloat(*h, 0, h->shape[0], out.hidden[layer].data());
    out.routes[layer] =
        common::RouteByGateSpec(m.routing, routing[layer]->gate, routing[layer]->bias, m.n_experts, m.d_model, m.top_k,
                                m.norm_topk_prob, out.hidden[layer].data(), h->shape[0]);
  }
  return out;
}

void AddRoutes(const CalibrationRoutes& routes, ExpertLoad* load) {
  for (size_t layer = 0; layer < routes.routes.size() && layer < load->size(); ++layer) {
    for (const int32_t id : routes.routes[layer].expert_ids) (*load)[layer][id] += 1;
  }
}

}  // namespace tools
}  // namespace colibri
