#include "tools/expert_load.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <regex>
#include <sstream>
#include <vector>

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
  constexpr char kMetric[] = "colibri_router_expert_tokens_total";
  const std::regex metric(R"(^colibri_router_expert_tokens_total\{(.*)\}\s+([0-9.eE+]+)(\s+-?\d+)?\s*$)");
  // Any other sample of a Prometheus page (a name, labels, a value, a time): skipped.
  const std::regex other_sample(R"(^[a-zA-Z_:][a-zA-Z0-9_:]*(\{.*\})?\s+\S+(\s+\S+)?\s*$)");
  const std::regex layer_label(R"(layer="(\d+)\")"), expert_label(R"(expert="(\d+)\")");
  const int64_t routed = load->empty() ? 0 : static_cast<int64_t>((*load)[0].size());
  std::vector<bool> sampled(load->size() * routed, false);  // the (layer, expert) pairs a page gave
  std::string line;
  int64_t number = 0, used = 0, samples = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.empty() || line[0] == '#') continue;
    if (line.size() > 4096) {  // no sample is that long (std::regex would recurse through it)
      return absl::InvalidArgumentError(
          absl::StrCat("load file ", path, " line ", number, ": ", line.size(), " characters, more than any sample"));
    }
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
      if (expert >= routed && expert < routed + shared_experts) continue;
      ++samples;
      if (layer >= 0 && layer < static_cast<int64_t>(load->size()) && expert >= 0 && expert < routed) {
        sampled[layer * routed + expert] = true;
      }
    } else if (line.rfind(kMetric, 0) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("load file ", path, " line ", number, ": a ", kMetric,
                                                     " sample that does not parse (a page cut short?): ", line));
    } else if (std::regex_match(line, other_sample)) {
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
  // A router's page has a sample for every (layer, expert), 0 included: one
  // missing is a page cut short or another model's, not an idle expert.
  if (samples > 0) {
    for (size_t i = 0; i < sampled.size(); ++i) {
      if (!sampled[i]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "load file ", path, " has no ", kMetric, " sample for layer ", i / routed, " expert ", i % routed,
            " (a router's page has one for every expert of its model: is the page cut short, or of another model?)"));
      }
    }
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
    const std::vector<float>& x = out.hidden[layer];
    if (const auto bad = std::find_if(x.begin(), x.end(), [](float v) { return !std::isfinite(v); }); bad != x.end()) {
      const int64_t at = bad - x.begin();
      return absl::InvalidArgumentError(absl::StrCat("calibration file ", path, ": '", name, "' record ",
                                                     at / m.d_model, " has a value that is not finite (", *bad,
                                                     " at column ", at % m.d_model, ")"));
    }
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
