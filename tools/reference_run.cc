#include "tools/reference_run.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "kernels/expert_executor.h"
#include "kernels/reference_moe.h"
#include "kernels/thread_pool.h"

namespace colibri {
namespace tools {
namespace {

double Since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

absl::Status ReadInputs(const std::string& path, int64_t d_model, std::vector<int32_t>* tokens, std::vector<float>* x) {
  COLIBRI_ASSIGN_OR_RETURN(auto file, common::SafetensorsFile::Open(path));
  const common::SafetensorsTensor* ids = file->Find("token_ids");
  const common::SafetensorsTensor* hidden = file->Find("hidden_states");
  if (ids == nullptr || ids->dtype != "I32" || ids->shape.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": needs an I32 [T] tensor 'token_ids'"));
  }
  const int64_t t = ids->shape[0];
  if (hidden == nullptr || hidden->dtype != "F32" || hidden->shape != std::vector<int64_t>{t, d_model}) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": needs an F32 [", t, ", ", d_model, "] tensor 'hidden_states'"));
  }
  tokens->resize(t);
  std::memcpy(tokens->data(), ids->data, ids->nbytes);
  x->resize(t * d_model);
  std::memcpy(x->data(), hidden->data, hidden->nbytes);
  return absl::OkStatus();
}

absl::Status WriteOutputs(const std::string& path, const ReferenceResult& r, int64_t d_model) {
  const int64_t t = r.routes.num_tokens(), k = r.routes.top_k;
  COLIBRI_ASSIGN_OR_RETURN(auto w, common::SafetensorsWriter::Create(path, {{"expert_ids", "I32", {t, k}},
                                                                            {"expert_weights", "F32", {t, k}},
                                                                            {"output", "F32", {t, d_model}}}));
  COLIBRI_RETURN_IF_ERROR(w->Append(r.routes.expert_ids.data(), r.routes.expert_ids.size() * 4));
  COLIBRI_RETURN_IF_ERROR(w->Append(r.routes.weights.data(), r.routes.weights.size() * 4));
  COLIBRI_RETURN_IF_ERROR(w->Append(r.output.data(), r.output.size() * 4));
  return w->Close();
}

struct KernelCheck {
  double seconds = 0;
  double relative_l2 = 0;  // against the reference output
};

// Runs the layer again through the expert executor on the same routes.
absl::StatusOr<KernelCheck> CheckKernels(const common::ModelDir& model, int64_t layer, const ReferenceResult& r,
                                         const float* x, kernels::ThreadPool& pool) {
  const common::Manifest& m = model.manifest();
  std::vector<std::unique_ptr<common::ExpertWeights>> owned(m.total_experts());
  std::vector<const common::ExpertWeights*> experts(m.total_experts(), nullptr);
  for (int32_t e : r.all_routes.expert_ids) {
    if (owned[e] != nullptr) continue;
    COLIBRI_ASSIGN_OR_RETURN(owned[e], model.LoadExpert(layer, e, /*verify_checksum=*/false));
    experts[e] = owned[e].get();
  }
  const kernels::GroupedRoutes grouped = kernels::GroupByExpert(r.all_routes, experts);
  std::vector<float> y(r.output.size(), 0.f);
  kernels::Workspace workspace;
  const auto start = std::chrono::steady_clock::now();
  kernels::RunExperts(pool, grouped.tasks, x, m.d_model, y.data(), workspace);
  KernelCheck check;
  check.seconds = Since(start);
  double diff = 0, norm = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    diff += (double(y[i]) - r.output[i]) * (double(y[i]) - r.output[i]);
    norm += double(r.output[i]) * r.output[i];
  }
  check.relative_l2 = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  return check;
}

}  // namespace

absl::StatusOr<ReferenceResult> ReferenceForward(const common::ModelDir& model, int64_t layer, common::RoutingMode mode,
                                                 absl::Span<const int32_t> token_ids, const float* x,
                                                 bool verify_checksums) {
  if (mode == common::RoutingMode::kClient) {
    return absl::InvalidArgumentError("the reference layer routes by lut or gate, not client");
  }
  const common::Manifest& m = model.manifest();
  ReferenceResult r;
  auto start = std::chrono::steady_clock::now();
  COLIBRI_ASSIGN_OR_RETURN(auto routing, model.LoadRouting(layer, verify_checksums));
  r.load_seconds += Since(start);

  start = std::chrono::steady_clock::now();
  if (mode == common::RoutingMode::kLut) {
    COLIBRI_ASSIGN_OR_RETURN(
        r.routes, common::RouteByLut(routing->lut_ids, routing->lut_weights, m.vocab_size, m.top_k, token_ids));
  } else {
    r.routes = common::RouteByGateSpec(m.routing, routing->gate, routing->bias, m.n_experts, m.d_model, m.top_k,
                                       m.norm_topk_prob, x, static_cast<int64_t>(token_ids.size()));
  }
  r.all_routes = m.n_shared_experts > 0 ? common::AppendSharedExperts(r.routes, m.n_experts, m.n_shared_experts,
                                                                      routing->shared_gate, m.d_model, x)
                                        : r.routes;
  r.route_seconds = Since(start);

  start = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<common::ExpertWeights>> owned(m.total_experts());
  std::vector<const common::ExpertWeights*> experts(m.total_experts(), nullptr);
  for (int32_t e : r.all_routes.expert_ids) {
    if (owned[e] != nullptr) continue;
    COLIBRI_ASSIGN_OR_RETURN(owned[e], model.LoadExpert(layer, e, verify_checksums));
    experts[e] = owned[e].get();
  }
  r.load_seconds += Since(start);

  start = std::chrono::steady_clock::now();
  r.output.resize(token_ids.size() * m.d_model);
  kernels::ReferenceMoeLayer(experts, r.all_routes, x, m.d_model, r.output.data());
  r.compute_seconds = Since(start);
  return r;
}

absl::Status RunReference(const ReferenceRunOptions& o, std::ostream& log) {
  auto start = std::chrono::steady_clock::now();
  COLIBRI_ASSIGN_OR_RETURN(auto model, common::ModelDir::Open(o.model_dir));
  const common::Manifest& m = model->manifest();
  log << absl::StrFormat(
      "model %s: %s, %d layers x %d experts, d_model %d, d_ff %d, top-%d, %s weights "
      "(manifest read in %.3f s)\n",
      o.model_dir, m.architecture, m.n_layers, m.n_experts, m.d_model, m.d_ff, m.top_k,
      common::DTypeName(m.weight_type), Since(start));
  std::vector<int32_t> tokens;
  std::vector<float> x;
  if (!o.inputs_path.empty()) {
    COLIBRI_RETURN_IF_ERROR(ReadInputs(o.inputs_path, m.d_model, &tokens, &x));
  } else {
    std::mt19937_64 rng(o.seed);
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(m.vocab_size - 1));
    std::normal_distribution<float> normal;
    for (int64_t t = 0; t < o.tokens; ++t) tokens.push_back(token(rng));
    for (int64_t i = 0; i < o.tokens * m.d_model; ++i) x.push_back(normal(rng));
  }
  log << absl::StrFormat("%d tokens (ids %s%s), routing %s\n", tokens.size(),
                         absl::StrJoin(tokens.begin(), tokens.begin() + std::min<size_t>(8, tokens.size()), " "),
                         tokens.size() > 8 ? " ..." : "", common::RoutingModeName(o.routing));
  if (tokens.empty()) return absl::InvalidArgumentError("no tokens to run (--tokens must be at least 1)");
  if (o.layer < -1 || o.layer >= m.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat("--layer ", o.layer, " is outside [0, ", m.n_layers, ")"));
  }
  const int64_t first = o.layer < 0 ? 0 : o.layer;
  const int64_t last = o.layer < 0 ? m.n_layers - 1 : o.layer;
  std::unique_ptr<kernels::ThreadPool> pool;
  if (o.compare_kernels) {
    COLIBRI_ASSIGN_OR_RETURN(pool, kernels::ThreadPool::Create({}));
  }
  ReferenceResult r;
  for (int64_t layer = first; layer <= last; ++layer) {
    COLIBRI_ASSIGN_OR_RETURN(r, ReferenceForward(*model, layer, o.routing, tokens, x.data(), o.verify_checksums));
    double norm = 0;
    for (float v : r.output) norm += static_cast<double>(v) * v;
    log << absl::StrFormat(
        "layer %d: load %.3f s%s, route %.6f s, reference compute %.3f s; token 0 -> experts "
        "[%s] weights [%s]; |y| = %.4g\n",
        layer, r.load_seconds, o.verify_checksums ? " (checksums verified)" : "", r.route_seconds, r.compute_seconds,
        absl::StrJoin(r.routes.expert_ids.begin(), r.routes.expert_ids.begin() + m.top_k, " "),
        absl::StrJoin(r.routes.weights.begin(), r.routes.weights.begin() + m.top_k, " ",
                      [](std::string* out, float w) { absl::StrAppend(out, absl::StrFormat("%.4f", w)); }),
        std::sqrt(norm));
    if (pool != nullptr) {
      COLIBRI_ASSIGN_OR_RETURN(const KernelCheck check, CheckKernels(*model, layer, r, x.data(), *pool));
      log << absl::StrFormat("layer %d: expert kernels (%s, %d threads) %.3f s, relative L2 error vs reference %.3g\n",
                             layer, kernels::IsaName(kernels::SelectedKernels().isa), pool->size(), check.seconds,
                             check.relative_l2);
    }
  }
  if (!o.output_path.empty()) {
    COLIBRI_RETURN_IF_ERROR(WriteOutputs(o.output_path, r, m.d_model));
    log << "wrote layer " << last << "'s output and routes to " << o.output_path << "\n";
  }
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace colibri
