#include "expert_node/compute_request.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace colibri {
namespace expert_node {
namespace {

namespace v1 = colibri::v1;

// rows (checked by CheckComputeSizes) -> f32.
void ParseRows(const v1::Tensor& t, int64_t d_model, ComputeInput* in) {
  const int64_t count = t.shape(0) * d_model;
  in->num_rows = t.shape(0);
  in->rows.resize(count);
  if (t.dtype() == v1::DATA_TYPE_F32) {
    if (count > 0) std::memcpy(in->rows.data(), t.data().data(), count * 4);  // no rows: no buffer to copy to
    return;
  }
  for (int64_t i = 0; i < count; ++i) {
    uint16_t h;
    std::memcpy(&h, t.data().data() + 2 * i, 2);
    in->rows[i] = common::Bf16ToFloat(h);
  }
}

}  // namespace

absl::Status CheckComputeSizes(const v1::ComputeRequest& request, int64_t d_model, int64_t total_experts,
                               const ComputeEngine::Limits& limits) {
  const v1::Tensor& t = request.rows();
  if (t.shape_size() != 2 || t.shape(0) < 0 || t.shape(1) != d_model) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows: shape has ", t.shape_size(), " dims",
                     t.shape_size() == 2 ? absl::StrCat(" [", t.shape(0), ", ", t.shape(1), "]") : "", "; must be [R, ",
                     d_model, "]"));
  }
  int64_t element = 0;
  if (t.dtype() == v1::DATA_TYPE_F32) element = 4;
  if (t.dtype() == v1::DATA_TYPE_BF16) element = 2;
  if (element == 0) {
    return absl::InvalidArgumentError(absl::StrCat("rows: dtype ", static_cast<int>(t.dtype()), " (",
                                                   v1::DataType_Name(t.dtype()), ") is not supported (f32 or bf16)"));
  }
  // R <= bytes received, so R * d_model * element cannot overflow for any message gRPC accepted.
  const int64_t received = static_cast<int64_t>(t.data().size());
  if (t.shape(0) > received || t.shape(0) * d_model * element != received) {
    return absl::InvalidArgumentError(absl::StrCat("rows: ", received, " bytes do not hold [", t.shape(0), ", ",
                                                   d_model, "] values of ", element, " bytes"));
  }
  if (t.shape(0) > limits.max_rows) {
    return absl::ResourceExhaustedError(
        absl::StrCat("rows: ", t.shape(0), " rows exceed the limit of ", limits.max_rows));
  }
  if (request.model_id().size() > kMaxModelIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("model_id is ", request.model_id().size(), " bytes; at most ", kMaxModelIdBytes));
  }
  if (request.experts_size() > total_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts: ", request.experts_size(), " entries; the model has ", total_experts, " experts"));
  }
  int64_t indices = 0;
  for (int w = 0; w < request.experts_size(); ++w) {
    const v1::ExpertWork& e = request.experts(w);
    if (e.weights_size() != e.row_indices_size()) {
      return absl::InvalidArgumentError(absl::StrCat("experts[", w, "] (expert ", e.expert(),
                                                     "): ", e.row_indices_size(), " row indices but ", e.weights_size(),
                                                     " weights"));
    }
    if (e.output_rows_size() > e.row_indices_size() || e.ranks_size() > e.row_indices_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "experts[", w, "] (expert ", e.expert(), "): ", e.row_indices_size(), " row indices but ",
          e.output_rows_size(), " output_rows and ", e.ranks_size(), " ranks (at most one each per row index)"));
    }
    indices += e.row_indices_size();
  }
  if (indices > limits.max_row_indices) {
    return absl::ResourceExhaustedError(absl::StrCat("experts: more than ", limits.max_row_indices, " row indices"));
  }
  // The reply is bounded like the request (the message limit is sized for
  // max_rows rows): checked before any compute, not found when sending.
  // (More grouped rows than row indices cannot all be filled: Prepare
  // refuses them as INVALID_ARGUMENT.)
  if (request.per_expert_output() && indices > limits.max_rows) {
    return absl::ResourceExhaustedError(absl::StrCat("per_expert_output: the reply would have ", indices,
                                                     " rows (one per row index), over the limit of ", limits.max_rows));
  }
  if (request.num_output_rows() > limits.max_rows && request.num_output_rows() <= indices) {
    return absl::ResourceExhaustedError(absl::StrCat("num_output_rows: the reply would have ",
                                                     request.num_output_rows(), " rows, over the limit of ",
                                                     limits.max_rows));
  }
  return absl::OkStatus();
}

absl::Status ParseComputeRequest(const v1::ComputeRequest& request, int64_t d_model, int64_t total_experts,
                                 const ComputeEngine::Limits& limits, ComputeInput* input) {
  if (absl::Status s = CheckComputeSizes(request, d_model, total_experts, limits); !s.ok()) return s;
  input->layer = request.layer();
  input->model_id = request.model_id();
  input->per_expert_output = request.per_expert_output();
  input->num_output_rows = request.num_output_rows();
  ParseRows(request.rows(), d_model, input);
  input->experts.clear();
  for (const v1::ExpertWork& w : request.experts()) {
    input->experts.push_back({w.expert(),
                              {w.row_indices().begin(), w.row_indices().end()},
                              {w.weights().begin(), w.weights().end()},
                              {w.output_rows().begin(), w.output_rows().end()},
                              {w.ranks().begin(), w.ranks().end()},
                              w.kernel_rows()});
  }
  return absl::OkStatus();
}

}  // namespace expert_node
}  // namespace colibri
