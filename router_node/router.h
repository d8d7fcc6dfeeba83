#ifndef COLIBRI_ROUTER_NODE_ROUTER_H_
#define COLIBRI_ROUTER_NODE_ROUTER_H_

// The router's core: one MoE layer for a batch of tokens.
//
//   validate → routes (lut | gate | client) → the layer's shared experts
//   appended to every token's routes (k' = k + n_shared slots per token) →
//   group rows by expert, each (token, rank j) a slot → backend computes
//   every slot → aggregate: y[t] = Σ_j slot[t·k' + j] in fp32, j = 0 first
//   → output dtype.
//
// The sum order is fixed by the routes alone, so the output is the same bits
// for any backend and any spread of experts over nodes (docs/ROUTER.md).
// Plain C++ in and out, no gRPC (router_service.cc is the transport).
// Thread-safe: Forward may run concurrently; the routing tables are
// immutable and the statistics are atomics.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "common/metrics.h"
#include "common/model_dir.h"
#include "common/routing.h"
#include "router_node/expert_backend.h"
#include "router_node/layer_batcher.h"

namespace colibri {
namespace router_node {

struct ForwardInput {
  int32_t layer = 0;
  absl::Span<const int32_t> token_ids;  // T ids (lut mode), else may be empty
  // Hidden states [num_tokens][cols] of `dtype` (f32, bf16 or f16), `bytes`
  // long; the memory must live until Forward returns.
  const void* hidden = nullptr;
  int64_t hidden_bytes = 0;
  common::DType hidden_dtype = common::DType::kF32;
  int64_t num_tokens = 0;
  int64_t cols = 0;
  common::RoutingMode routing = common::RoutingMode::kLut;
  // Client mode: top_k, expert_ids and weights as in common::Routes.
  int64_t client_top_k = 0;
  absl::Span<const int32_t> client_expert_ids;
  absl::Span<const float> client_weights;
  common::DType output_dtype = common::DType::kF32;  // f32, bf16 or f16
  // The caller's label for logs and traces, passed on to every node call: at
  // most kMaxRequestIdBytes.
  std::string request_id;
  // Kept by the router for as long as it holds anything of the call, which a
  // merged call (RouterOptions::batching) does after a caller that gave up
  // was answered: a server's memory reservation for the call goes here.
  std::shared_ptr<void> hold;
};
inline constexpr size_t kMaxRequestIdBytes = 256;

struct StageTimings {
  int64_t route_nanos = 0;
  int64_t dispatch_nanos = 0;  // until the backend returned (the slowest node)
  int64_t aggregate_nanos = 0;
  int64_t total_nanos = 0;
  // Merged with other callers (RouterOptions::batching): the wait before the
  // merged call was sent (part of dispatch), its callers and tokens.
  int64_t queue_nanos = 0;
  int64_t merged_callers = 0;
  int64_t merged_tokens = 0;
};

struct ForwardOutput {
  std::string output;  // [num_tokens][d_model] of output_dtype, raw bytes
  common::DType output_dtype = common::DType::kF32;
  common::Routes routes;  // the routes used
  StageTimings timings;
  BackendStats backend;  // the backend's node calls
};

// One stage of a Forward as clients see it (Router's Timing message):
// route, dispatch, aggregate, total, "queue" when it was merged with other
// callers or waited for them ("callers N tokens M"), and per node call
// "node:node-<i>" and
// "node_compute:node-<i>" (placed at the end of the call: a node reports
// how long its kernels ran, not when they started). Starts are from the
// beginning of the Forward.
struct TimingSpan {
  std::string stage;
  int64_t start_nanos = 0;
  int64_t nanos = 0;
  std::string detail;  // node calls: "experts 0,3 rows 5" (+ " retry", " hedge")
  int64_t rows = 0;    // node calls: rows sent, and the messages' bytes
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
};
std::vector<TimingSpan> TimingSpans(const ForwardOutput& output);

struct RouterOptions {
  int64_t max_tokens = 65536;                  // tokens of one Forward; beyond: RESOURCE_EXHAUSTED
  bool verify_checksums = true;                // of the gate and LUT files at load
  common::MetricsRegistry* metrics = nullptr;  // optional; must outlive the router
  // Merging concurrent calls of one layer (layer_batcher.h): on when
  // batching.window > 0. Its metrics are `metrics`. A merged call holds at
  // most min(batching.max_tokens, max_tokens) tokens: no node call is larger
  // than one Forward may be (the node calls' message limit follows max_tokens).
  BatchOptions batching;
};

class Router {
 public:
  // Loads the manifest and every layer's gate and LUT from `model_dir`.
  // Errors name the file and the reason. `backend` must outlive the router.
  static absl::StatusOr<std::unique_ptr<Router>> Create(const std::string& model_dir, ExpertBackend* backend,
                                                        const RouterOptions& options);

  // INVALID_ARGUMENT naming the field and value (layer, hidden shape/dtype/
  // bytes, token_ids length or an id ≥ vocab_size, client routes: top_k,
  // lengths, expert id range, an expert repeated for a token, non-finite
  // weight; non-finite hidden values in gate mode; output dtype);
  // RESOURCE_EXHAUSTED over max_tokens; the backend's errors otherwise.
  absl::StatusOr<ForwardOutput> Forward(const ForwardInput& input, CallControl& control);
  // The same, ending with done(result): on this thread for a bad request or
  // a synchronous backend, else on the thread of the last node reply, which
  // also aggregates. `input`'s memory and `control` must live until `done`
  // runs. Blocks only as long as the backend's ComputeAsync does.
  void ForwardAsync(const ForwardInput& input, CallControl& control,
                    std::function<void(absl::StatusOr<ForwardOutput>)> done);
  // The checks of `input` that need neither its values nor memory (layer,
  // dtypes, shape against its bytes, max_tokens, request_id): Forward's
  // errors for them, for a server to answer before it reserves memory.
  absl::Status CheckShape(const ForwardInput& input) const;

  const common::Manifest& manifest() const { return model_->manifest(); }
  const std::string& model_id() const { return model_->model_id(); }
  const std::string& model_dir() const { return model_->dir(); }
  int64_t max_tokens() const { return options_.max_tokens; }
  ExpertBackend& backend() { return *backend_; }

  // Token rows routed to (layer, expert) since start (a shared expert,
  // expert >= n_experts, counts every token), and requests served.
  int64_t tokens_routed(int64_t layer, int64_t expert) const;
  int64_t requests() const { return requests_.load(std::memory_order_relaxed); }
  // Calls queued to be merged with others (0 when batching is off).
  int64_t queued_calls() const { return batcher_ != nullptr ? batcher_->queued() : 0; }
  // Whether a merged call may still use the backend although every caller
  // was answered (LayerBatcher::idle): the backend must outlive the router
  // until this is false.
  bool backend_in_use() const { return batcher_ != nullptr && !batcher_->idle(); }

 private:
  struct Pending;  // a Forward between sending its work and aggregating
  Router(std::unique_ptr<common::ModelDir> model, ExpertBackend* backend, const RouterOptions& options);
  absl::Status Prepare(const ForwardInput& input, Pending* p) const;
  ForwardOutput Aggregate(Pending& p);
  absl::StatusOr<common::Routes> Route(const ForwardInput& input, const float* x) const;
  void CountRoutes(int32_t layer, const common::Routes& routes);

  // Constant after construction.
  const std::unique_ptr<common::ModelDir> model_;
  ExpertBackend* const backend_;
  const RouterOptions options_;
  std::vector<std::unique_ptr<common::LayerRouting>> routing_;  // [layer]
  std::vector<common::Counter*> token_counters_;                // [layer * n_experts + e], if metrics
  std::unique_ptr<LayerBatcher> batcher_;                       // if batching is on

  // Statistics (atomics).
  std::unique_ptr<std::atomic<int64_t>[]> tokens_;  // [layer * n_experts + e]
  std::atomic<int64_t> requests_{0};
};

}  // namespace router_node
}  // namespace colibri

#endif  // COLIBRI_ROUTER_NODE_ROUTER_H_
