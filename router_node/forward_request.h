#ifndef COLIBRI_ROUTER_NODE_FORWARD_REQUEST_H_
#define COLIBRI_ROUTER_NODE_FORWARD_REQUEST_H_

// Router.Forward's request as the core's input, without copying: the
// returned ForwardInput points into `request` (hidden bytes, token ids,
// client routes), which must outlive it. Only what the proto cannot say is
// checked here (tensor rank, dtypes, routing mode); Router::Forward checks
// the rest. Transport code (includes the generated proto); a pure function.

#include "absl/status/statusor.h"
#include "colibri/v1/router.pb.h"
#include "router_node/router.h"

namespace colibri {
namespace router_node {

// INVALID_ARGUMENT naming the field: hidden not 2-D, a hidden or output
// dtype other than f32/bf16/f16, an unknown routing mode.
absl::StatusOr<ForwardInput> ParseForwardRequest(const colibri::v1::ForwardRequest& request);

// The proto's value for a routing mode (the inverse of what
// ParseForwardRequest reads; ROUTING_MODE_UNSPECIFIED is read as lut).
colibri::v1::RoutingMode ToProtoRoutingMode(common::RoutingMode mode);

}  // namespace router_node
}  // namespace colibri

#endif  // COLIBRI_ROUTER_NODE_FORWARD_REQUEST_H_
