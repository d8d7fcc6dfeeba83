#include "router_node/forward_request.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace colibri {
namespace router_node {
namespace {

namespace v1 = colibri::v1;

absl::StatusOr<common::DType> ParseDType(v1::DataType t, bool unspecified_is_f32, const char* field) {
  if (t == v1::DATA_TYPE_UNSPECIFIED && unspecified_is_f32) return common::DType::kF32;
  if (t == v1::DATA_TYPE_F32 || t == v1::DATA_TYPE_BF16 || t == v1::DATA_TYPE_F16) {
    return static_cast<common::DType>(t);  // the same numbers (tensor.proto, common/dtype.h)
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " ", static_cast<int>(t), " is not supported (f32, bf16 or f16)"));
}

}  // namespace

colibri::v1::RoutingMode ToProtoRoutingMode(common::RoutingMode mode) {
  switch (mode) {
    case common::RoutingMode::kLut: return v1::ROUTING_MODE_LUT;
    case common::RoutingMode::kGate: return v1::ROUTING_MODE_GATE;
    case common::RoutingMode::kClient: return v1::ROUTING_MODE_CLIENT;
  }
  return v1::ROUTING_MODE_UNSPECIFIED;
}

absl::StatusOr<ForwardInput> ParseForwardRequest(const v1::ForwardRequest& request) {
  ForwardInput in;
  in.layer = request.layer();
  in.token_ids = absl::MakeConstSpan(request.token_ids().data(), request.token_ids().size());
  const v1::Tensor& h = request.hidden();
  if (h.shape_size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("hidden.shape has ", h.shape_size(), " dims; must be [T, d_model]"));
  }
  in.num_tokens = h.shape(0);
  in.cols = h.shape(1);
  COLIBRI_ASSIGN_OR_RETURN(in.hidden_dtype, ParseDType(h.dtype(), false, "hidden.dtype"));
  in.hidden = h.data().data();
  in.hidden_bytes = static_cast<int64_t>(h.data().size());
  switch (request.routing()) {
    case v1::ROUTING_MODE_UNSPECIFIED:
    case v1::ROUTING_MODE_LUT: in.routing = common::RoutingMode::kLut; break;
    case v1::ROUTING_MODE_GATE: in.routing = common::RoutingMode::kGate; break;
    case v1::ROUTING_MODE_CLIENT:
      in.routing = common::RoutingMode::kClient;
      in.client_top_k = request.routes().top_k();
      in.client_expert_ids =
          absl::MakeConstSpan(request.routes().expert_ids().data(), request.routes().expert_ids().size());
      in.client_weights = absl::MakeConstSpan(request.routes().weights().data(), request.routes().weights().size());
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("routing ", static_cast<int>(request.routing()), " is not a known mode (lut, gate, client)"));
  }
  COLIBRI_ASSIGN_OR_RETURN(in.output_dtype, ParseDType(request.output_dtype(), true, "output_dtype"));
  in.request_id = request.request_id();
  return in;
}

}  // namespace router_node
}  // namespace colibri
