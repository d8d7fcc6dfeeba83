#ifndef COLIBRI_EXPERT_NODE_COMPUTE_REQUEST_H_
#define COLIBRI_EXPERT_NODE_COMPUTE_REQUEST_H_

// ExpertNode.Compute's request as the compute engine's input: the rows
// tensor checked against the bytes actually received before anything is
// allocated, bf16 widened to f32, the expert lists copied. What the engine
// then validates (ranges, duplicates, ownership) it validates itself.
// Transport code (includes the generated proto); a pure function.

#include <cstdint>

#include "absl/status/status.h"
#include "colibri/v1/expert_node.pb.h"
#include "expert_node/compute_engine.h"

namespace colibri {
namespace expert_node {

// Fills `input` (keeping its check_finite). INVALID_ARGUMENT naming the
// field: rows not [R, d_model], a dtype other than f32/bf16, or data bytes
// that do not hold the shape. RESOURCE_EXHAUSTED, before anything is
// allocated, for more rows or row indices than `limits` (the engine checks
// them again; refusing here keeps a refused request from first being widened
// to f32 and copied).
absl::Status ParseComputeRequest(const colibri::v1::ComputeRequest& request, int64_t d_model,
                                 const ComputeEngine::Limits& limits, ComputeInput* input);

}  // namespace expert_node
}  // namespace colibri

#endif  // COLIBRI_EXPERT_NODE_COMPUTE_REQUEST_H_
