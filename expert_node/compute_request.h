#ifndef COLIBRI_EXPERT_NODE_COMPUTE_REQUEST_H_
#define COLIBRI_EXPERT_NODE_COMPUTE_REQUEST_H_

// ExpertNode.Compute's request as the compute engine's input: its sizes
// checked against the bytes actually received before anything is
// allocated, bf16 widened to f32, the expert lists copied.
// Transport code (includes the generated proto); a pure function.

#include <cstdint>

#include "absl/status/status.h"
#include "colibri/v1/expert_node.pb.h"
#include "expert_node/compute_engine.h"

namespace colibri {
namespace expert_node {

inline constexpr size_t kMaxModelIdBytes = 256;

// The request's sizes, from the message alone, in time linear in its number
// of expert entries and with nothing allocated. INVALID_ARGUMENT naming the
// field: rows not [R, d_model] with R >= 0, a dtype other than f32/bf16, data
// bytes that do not hold the shape; more expert entries than the model's
// `total_experts`; an entry with another number of weights than row indices,
// or more output_rows or ranks; a model_id over kMaxModelIdBytes.
// RESOURCE_EXHAUSTED for more rows or row indices than `limits` (the engine
// checks them again). The service runs it on gRPC's thread before a call is
// counted against the memory budget, queued or merged with others;
// ParseComputeRequest runs it first.
absl::Status CheckComputeSizes(const colibri::v1::ComputeRequest& request, int64_t d_model, int64_t total_experts,
                               const ComputeEngine::Limits& limits);

// Fills `input` (keeping its check_finite) once CheckComputeSizes passes, so
// a refused request is never widened to f32 or copied. What the engine then
// validates (ranges, duplicates, ownership) it validates itself.
absl::Status ParseComputeRequest(const colibri::v1::ComputeRequest& request, int64_t d_model, int64_t total_experts,
                                 const ComputeEngine::Limits& limits, ComputeInput* input);

}  // namespace expert_node
}  // namespace colibri

#endif  // COLIBRI_EXPERT_NODE_COMPUTE_REQUEST_H_
