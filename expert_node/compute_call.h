#ifndef COLIBRI_EXPERT_NODE_COMPUTE_CALL_H_
#define COLIBRI_EXPERT_NODE_COMPUTE_CALL_H_

// ExpertService's record of one Compute call, shared by its two files:
// expert_service.cc (the unary call, the compute thread) and
// compute_stream.cc (calls that arrive on a ComputeStream). Not for other code.

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <functional>
#include <memory>

#include "colibri/v1/expert_node.pb.h"
#include "common/memory_budget.h"
#include "expert_node/compute_engine.h"
#include "expert_node/expert_service.h"
#include "expert_node/paged_weights.h"

namespace colibri {
namespace expert_node {

// One Compute call, from its arrival until it is answered. The request and
// response stay alive until `answer` has run.
struct ExpertService::ComputeCall {
  // How the call came: its deadline, whether its caller gave up, and how it
  // is answered (once; `response` filled when the status is OK). `answer`
  // gets the call's reservation: it holds it until the answer has been sent,
  // so answers a slow reader has not taken count against the budget.
  std::chrono::system_clock::time_point deadline = std::chrono::system_clock::time_point::max();
  std::function<bool()> cancelled;
  std::function<void(const grpc::Status&, common::MemoryBudget::Reservation)> answer;
  const colibri::v1::ComputeRequest* request = nullptr;
  colibri::v1::ComputeResponse* response = nullptr;
  colibri::v1::DataType output_dtype = colibri::v1::DATA_TYPE_UNSPECIFIED;
  common::MemoryBudget::Reservation reservation;  // handed to `answer` (released if the call is dropped unanswered)
  PagedWeights::Pin pin;                          // paged residency: the call's experts, read in and kept
  ProcessIo io;                                   // paged residency: faults and reads before the first step
  std::chrono::steady_clock::time_point queued = std::chrono::steady_clock::now();
  int64_t queue_nanos = 0;
  int64_t entries = 0;     // (expert, row index) pairs
  int64_t rows = 0;        // rows the request says it carries
  bool mergeable = false;  // one slice, one output row per entry: may share a pass (RunTogether)
  ComputeInput input;
  std::unique_ptr<PreparedCall> prepared;
};

}  // namespace expert_node
}  // namespace colibri

#endif  // COLIBRI_EXPERT_NODE_COMPUTE_CALL_H_
