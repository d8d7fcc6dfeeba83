#ifndef COLIBRI_EXPERT_NODE_EXPERT_SERVICE_H_
#define COLIBRI_EXPERT_NODE_EXPERT_SERVICE_H_

// Transport for the ExpertNode service (proto/colibri/v1/expert_node.proto):
// a Compute call — unary, or one message of a ComputeStream
// (expert_node/compute_stream.cc) — is queued for the one compute thread, which parses,
// validates and computes it in slices of about kSliceRows (expert, row)
// pairs, taking the queued calls in turn (round robin): a small call waits
// for at most one slice of each call ahead of it, however long those are.
// A call of at most one slice that finds the node idle (nothing queued,
// nothing running) runs at once on the gRPC thread that received it — the
// decode case, spared the hand-over to the compute thread; one step runs at
// a time either way. Reload calls load on a thread of their own; each
// status is converted once and the reactor finished.
//
// Admin calls — Reload, and GetNodeInfo's model_dir and last_reload_error —
// are for admins only: callers of the AdminService (served on the admin
// listener) and, on the data port, peers whose mutual-TLS certificate names
// one of Options::admin_identities. Anyone else gets PERMISSION_DENIED for
// Reload and GetNodeInfo without those two fields.
// Thread-safe.

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "colibri/v1/expert_node.grpc.pb.h"
#include "common/memory_budget.h"
#include "common/metrics.h"
#include "common/mutex.h"
#include "expert_node/compute_engine.h"
#include "expert_node/expert_store.h"
#include "expert_node/paged_weights.h"
#include "runtime/open_streams.h"

namespace colibri {
namespace expert_node {

// Compute and ComputeStream take their messages raw and parse them here
// (runtime/grpc_raw.h): a call that does not parse is answered
// INVALID_ARGUMENT naming the type, and a ComputeStream carrying one ends
// INVALID_ARGUMENT once the calls before it are answered.
class ExpertService final
    : public colibri::v1::ExpertNode::WithRawCallbackMethod_Compute<
          colibri::v1::ExpertNode::WithRawCallbackMethod_ComputeStream<
              colibri::v1::ExpertNode::WithCallbackMethod_GetNodeInfo<
                  colibri::v1::ExpertNode::WithCallbackMethod_Reload<colibri::v1::ExpertNode::Service>>>> {
 public:
  static constexpr int64_t kSliceRows = 256;
  // Most entries, and most rows, of one pass that merges queued calls; most calls in it.
  static constexpr int64_t kMergeRows = 1024;
  static constexpr size_t kMergeCalls = 64;

  struct Options {
    std::string model_root;  // Reload's model_dir must resolve inside it
    bool check_finite = false;
    int64_t max_queued_calls = 64;
    // Budget for the memory of Compute calls in flight (their requests, f32
    // rows, outputs and encodings, estimated from the request on arrival);
    // beyond: RESOURCE_EXHAUSTED. <= 0: none.
    int64_t max_inflight_bytes = 0;
    int threads = 0;
    std::string kernel_isa;
    std::string kernel_profile;  // kernels::ProfileChoices of the profile in use
    int numa_node = -1;
    // Certificate identities (subject alternative names or common name) that
    // may make admin calls on the data port; needs mutual TLS to mean anything.
    std::vector<std::string> admin_identities;
    common::MetricsRegistry* metrics = nullptr;  // optional; must outlive the service
    // Paged residency: prefetches and pins each call's experts on arrival
    // (expert_node/paged_weights.h). Optional; must outlive the service.
    PagedWeights* paged = nullptr;
    // Queued calls of one layer and model that have not started, each of one
    // slice with an output row per entry (what routers send), run as one
    // executor pass (ComputeEngine::RunMerged): an expert several of them
    // need is read once, and each answer keeps its bits.
    bool merge_calls = true;
    int inject_delay_ms = 0;     // fault injection (tests, benchmarks): sleep this long before a Compute ...
    int inject_delay_every = 1;  // ... every this many calls (1: all)
  };

  // The memory a Compute call holds in flight: its rows as received
  // (`rows_bytes`, `values` values), their f32 copy, the expert lists'
  // copies (`indices` row indices and weights), the f32 output of
  // `output_rows` rows and its encoding.
  static int64_t Footprint(int64_t rows_bytes, int64_t values, int64_t indices, int64_t output_rows, int64_t d_model);

  // `store` and `engine` must outlive the service.
  ExpertService(ExpertStore* store, ComputeEngine* engine, Options options);
  ~ExpertService() override;  // finishes queued calls with UNAVAILABLE, joins threads

  // A ComputeRequest in, a ComputeResponse out (raw).
  grpc::ServerUnaryReactor* Compute(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;
  // ComputeStreamRequests in, ComputeStreamResponses out (raw).
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ComputeStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* GetNodeInfo(grpc::CallbackServerContext* context,
                                        const colibri::v1::GetNodeInfoRequest* request,
                                        colibri::v1::GetNodeInfoResponse* response) override;
  grpc::ServerUnaryReactor* Reload(grpc::CallbackServerContext* context, const colibri::v1::ReloadRequest* request,
                                   colibri::v1::ReloadResponse* response) override;

  // For the node's shutdown, before the server's: open ComputeStreams read no
  // more calls and finish once those in flight are answered (a stream would
  // otherwise stay open, and the server's drain wait for it to the end). Streams
  // opened after it are finished at once.
  void CloseStreams();

  // The reload both the RPC and SIGHUP use: reloads the store and records the
  // outcome (GetNodeInfo.last_reload_error, metrics). Blocks for the load.
  // `abandon`: as ExpertStore::Reload's (the RPC's caller gone).
  absl::Status ReloadNow(const std::string& model_dir, const std::optional<ShardSpec>& shard,
                         bool keep_previous = false, const std::function<bool()>& abandon = {});

 private:
  friend class AdminService;
  grpc::ServerUnaryReactor* NodeInfo(grpc::CallbackServerContext* context, colibri::v1::GetNodeInfoResponse* response,
                                     bool admin);
  grpc::ServerUnaryReactor* ReloadAs(grpc::CallbackServerContext* context, const colibri::v1::ReloadRequest* request,
                                     colibri::v1::ReloadResponse* response, bool admin);
  struct ComputeCall;   // one Compute call in flight
  class StreamReactor;  // one ComputeStream (compute_stream.cc)
  // Checks the call's sizes and budget, then runs it at once (an idle node,
  // one slice) or queues it; answers it on failure.
  void Admit(std::shared_ptr<ComputeCall> call);
  void ComputeLoop();
  // Parses and prepares the call; false when it was answered instead (an
  // error, cancelled, past its deadline).
  bool Start(ComputeCall& call);
  // The call's next slice (its first starts it; run=false answers UNAVAILABLE);
  // true when it has been answered.
  bool Step(ComputeCall& call, bool run);
  // Starts the calls and runs them as one pass, answering each.
  // REQUIRES: each is mergeable and not started.
  void RunTogether(std::vector<std::shared_ptr<ComputeCall>>& calls);
  // Answers a computed call: output and metrics (its weight bytes and paging
  // only if it had its pass to itself: a merged pass counts them once).
  void Complete(ComputeCall& call, bool own_pass);
  void AddWeightBytes(const WeightSet& set, const std::set<std::pair<int64_t, int64_t>>& experts);
  // Counts the call by method and status code, then finishes it.
  void Finish(grpc::ServerUnaryReactor* reactor, const char* method, const grpc::Status& status);
  // The same for a Compute call, however it came.
  void Answer(ComputeCall& call, grpc::Status status);
  void CountCall(const char* method, const grpc::Status& status);
  void UpdateWeightGauges();
  void SetLockedGauge(const WeightSet& set);  // colibri_expert_locked_bytes of `set`
  // Paged residency metrics after a call that started with `before` sampled.
  void ObservePaging(const ProcessIo& before);
  // Why a call cannot be queued now (the node is stopping, or the queue holds
  // max_queued_calls live calls), if it cannot.
  std::optional<grpc::Status> QueueRefusalLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why `call` is not to be computed: its caller cancelled, or its deadline
  // passed. nullopt while it is live.
  static std::optional<grpc::Status> GaveUp(const ComputeCall& call);
  // Answers now the queued calls not started whose callers gave up (they
  // would wait their turn for it), which frees their room in the budget.
  // Returns how many.
  int AnswerAbandoned() ABSL_LOCKS_EXCLUDED(mu_);
  // The colibri_expert_queued_calls gauge, after queue_ changed.
  void QueueChanged() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  ExpertStore* const store_;
  ComputeEngine* const engine_;
  const Options options_;
  common::MemoryBudget budget_;

  common::Mutex mu_;
  common::CondVar cv_;  // signalled when queue_ grows or stopping_ is set
  std::deque<std::shared_ptr<ComputeCall>> queue_ ABSL_GUARDED_BY(mu_);  // the queued calls
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // a step is running (compute thread, or a small call inline)
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::string last_reload_error_ ABSL_GUARDED_BY(mu_);
  bool reload_running_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reload_thread_ ABSL_GUARDED_BY(mu_);  // the last reload's worker, joined before the next
  std::thread compute_thread_;
  runtime::OpenStreams<StreamReactor> streams_;  // the open ComputeStreams
  int64_t computes_ = 0;                         // whoever holds busy_: calls run, for inject_delay_every
};

// The ExpertNode service as the admin listener serves it: GetNodeInfo in full
// and Reload, for every caller that reaches it (the listener is the access
// control: loopback, or its own address the operator guards); Compute is not
// served there (UNIMPLEMENTED). `service` must outlive it.
class AdminService final : public colibri::v1::ExpertNode::CallbackService {
 public:
  explicit AdminService(ExpertService* service) : service_(service) {}

  grpc::ServerUnaryReactor* GetNodeInfo(grpc::CallbackServerContext* context,
                                        const colibri::v1::GetNodeInfoRequest* request,
                                        colibri::v1::GetNodeInfoResponse* response) override;
  grpc::ServerUnaryReactor* Reload(grpc::CallbackServerContext* context, const colibri::v1::ReloadRequest* request,
                                   colibri::v1::ReloadResponse* response) override;

 private:
  ExpertService* const service_;
};

}  // namespace expert_node
}  // namespace colibri

#endif  // COLIBRI_EXPERT_NODE_EXPERT_SERVICE_H_
