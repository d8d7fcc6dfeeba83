#ifndef COLIBRI_ROUTER_NODE_ROUTER_SERVICE_H_
#define COLIBRI_ROUTER_NODE_ROUTER_SERVICE_H_

// Transport for the Router service (proto/colibri/v1/router.proto): parse a
// request into the core's types (pointing into the request, no copy of the
// hidden states), route it and send its node calls, then — on the thread of
// the last node reply — aggregate, convert the status once and finish. A
// request whose routing is cheap (Options::inline_work) starts on gRPC's
// thread, the others on the service's workers; gRPC's threads never wait
// for a node. In local mode (experts computed in this process) every
// request runs on a worker. Cancelling a call cancels its node calls.
//
// GetClusterStatus names nodes by their index ("node-0", …) and says only
// whether they are down, unless the caller is an admin: a caller of the
// RouterAdminService (the admin listener) or a mutual-TLS peer named in
// Options::admin_identities, who gets addresses and the nodes' last errors.
// Thread-safe.

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "colibri/v1/router.grpc.pb.h"
#include "common/memory_budget.h"
#include "common/metrics.h"
#include "common/mutex.h"
#include "router_node/remote_backend.h"
#include "router_node/router.h"
#include "runtime/open_streams.h"

namespace colibri {
namespace router_node {

// What a LoadModel did: the model now serving, the one it replaced (equal
// when nothing changed), and whether every version replaced so far has been
// released (its last request ended within the call's timeout).
struct ModelSwitch {
  std::string model_id;
  std::string previous_model_id;
  bool previous_released = true;
};

// Forward and ForwardStream take their messages raw and parse them here
// (runtime/grpc_raw.h): a request that does not parse is answered
// INVALID_ARGUMENT — on a stream in its turn, and the stream reads on.
class RouterService final
    : public colibri::v1::Router::WithRawCallbackMethod_Forward<
          colibri::v1::Router::WithRawCallbackMethod_ForwardStream<colibri::v1::Router::WithCallbackMethod_GetModelInfo<
              colibri::v1::Router::WithCallbackMethod_GetClusterStatus<
                  colibri::v1::Router::WithCallbackMethod_LoadModel<colibri::v1::Router::Service>>>>> {
 public:
  struct Options {
    int workers = 8;                    // threads running Forward calls
    int64_t max_queued_requests = 256;  // waiting for a worker; beyond: RESOURCE_EXHAUSTED
    // Distributed mode: a request whose routing touches at most this many
    // values (T x d_model, times n_experts for gate routing) is routed on
    // gRPC's thread — no hand-over to a worker; about 1M is well under a
    // millisecond. 0: every request goes to a worker.
    int64_t inline_work = 1 << 20;
    // Budget for the memory of Forward calls being run (estimated from each
    // request's shape before parsing it); beyond: RESOURCE_EXHAUSTED. <= 0:
    // none (RouterServer derives one from max_tokens).
    int64_t max_inflight_bytes = 0;
    // A reply the client has not taken within this long (it stopped reading
    // while its connection stays up) cancels its call, freeing the memory the
    // call holds (runtime/call_timer.h). Zero: replies wait until the call's
    // deadline.
    absl::Duration send_timeout = absl::Seconds(60);
    bool debug = false;                          // log every call's stage timings to `log` (COLIBRI_DEBUG=1)
    std::ostream* log = nullptr;                 // must outlive the service
    common::MetricsRegistry* metrics = nullptr;  // optional; must outlive the service
    // Certificate identities (mutual TLS) that get the admin view of
    // GetClusterStatus, and may call LoadModel, on the data port (see RouterAdminService).
    std::vector<std::string> admin_identities;
    // LoadModel's work (RouterServer::LoadModel); `abandon` says whether the
    // caller has gone. Null: LoadModel is refused (FAILED_PRECONDITION).
    std::function<absl::StatusOr<ModelSwitch>(const std::string& model_dir, absl::Duration timeout,
                                              const std::function<bool()>& abandon)>
        load_model;
  };

  // Serves `router`'s model (a shared_ptr: see SwapRouter).
  RouterService(std::shared_ptr<Router> router, Options options);
  ~RouterService() override;  // runs the calls still queued, joins the workers

  // A ForwardRequest in, a ForwardResponse out (raw).
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;
  // ForwardRequests in, ForwardStreamResponses out (raw).
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ForwardStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const colibri::v1::GetModelInfoRequest* request,
                                         colibri::v1::GetModelInfoResponse* response) override;
  grpc::ServerUnaryReactor* GetClusterStatus(grpc::CallbackServerContext* context,
                                             const colibri::v1::GetClusterStatusRequest* request,
                                             colibri::v1::GetClusterStatusResponse* response) override;
  grpc::ServerUnaryReactor* LoadModel(grpc::CallbackServerContext* context,
                                      const colibri::v1::LoadModelRequest* request,
                                      colibri::v1::LoadModelResponse* response) override;

  // For a shutdown: every open ForwardStream reads no more requests, answers
  // the one it is running (if any) and then ends UNAVAILABLE ("the router is
  // shutting down"); streams opened later end so at once. A client reopens
  // its stream elsewhere instead of holding the drain until its deadline.
  void CloseStreams();

  // The memory a Forward call holds while it runs, for `values` hidden values
  // received as `hidden_bytes`: the hidden states and their f32 copy, the node
  // requests (the rows once per node: at most top_k + shared nodes), their
  // per-route replies and the per-route rows they are copied into (all alive
  // while the sum is taken), the f32 sum and the encoded output.
  static int64_t Footprint(int64_t hidden_bytes, int64_t values, const common::Manifest& m);

  // A request's end: its status, and the memory reservation of the call
  // (null if none was made), which the caller keeps until it has written the
  // reply (the request and reply are in that memory) — a client that never
  // reads its replies holds the budget, not memory outside it.
  using Done = std::function<void(absl::Status status, std::shared_ptr<void> held)>;
  // Starts one request on the calling thread (parse, route, send) and ends
  // with done(status, held) once `response` is filled, on this thread or on the
  // thread of the last node reply. `request`, `control` and `response` must
  // live until `done` runs; nothing of the service is touched once `done`
  // has been called, so it may destroy the service. Used by both RPCs.
  void StartForward(const colibri::v1::ForwardRequest& request, CallControl& control,
                    colibri::v1::ForwardResponse* response, Done done);
  // StartForward in two steps, for a request that waits for a worker: Admit
  // parses and checks it against the model version it will run on and
  // reserves its memory (so that waiting requests count against the budget);
  // the request's own error when it can never run (malformed, over
  // max_tokens), before the budget's; CANCELLED or DEADLINE_EXCEEDED when its
  // caller is gone already. RunAdmitted is the rest of StartForward.
  struct Admitted;
  absl::StatusOr<std::shared_ptr<Admitted>> Admit(const colibri::v1::ForwardRequest& request,
                                                  const CallControl& control);
  void RunAdmitted(std::shared_ptr<Admitted> admitted, const colibri::v1::ForwardRequest& request, CallControl& control,
                   colibri::v1::ForwardResponse* response, Done done);
  // GetModelInfo's and GetClusterStatus's answers (`admin`: node addresses
  // and errors), for callers without a server (a proxyless client).
  void FillModelInfo(colibri::v1::GetModelInfoResponse* response) const;
  void FillClusterStatus(colibri::v1::GetClusterStatusResponse* response, bool admin) const;
  // True when `request` may start on gRPC's thread (see Options::inline_work).
  bool RunsInline(const colibri::v1::ForwardRequest& request) const;
  // Queues `job` for a worker; false if the queue is full or the service is
  // stopping (then `job` is not run).
  bool Submit(std::function<void()> job);
  // Counts a finished call by method and code.
  void CountCall(const char* method, absl::StatusCode code);

  // The router core (model version) new requests use.
  std::shared_ptr<Router> router() const;
  // Serves `router` to new requests from now on; requests already started
  // finish on the one they started with, which is returned (its last user
  // releases it). A request never mixes two versions.
  std::shared_ptr<Router> SwapRouter(std::shared_ptr<Router> router);

 private:
  friend class RouterAdminService;
  grpc::ServerUnaryReactor* ClusterStatus(grpc::CallbackServerContext* context,
                                          colibri::v1::GetClusterStatusResponse* response, bool admin);
  grpc::ServerUnaryReactor* LoadModelAs(grpc::CallbackServerContext* context,
                                        const colibri::v1::LoadModelRequest* request,
                                        colibri::v1::LoadModelResponse* response, bool admin);

  class StreamReactor;  // one ForwardStream

  void WorkerLoop();
  void Record(const ForwardOutput& out, int64_t tokens, const std::string& request_id, int32_t layer);
  // Fills `response` from `out` (whose output it moves) and records the call.
  void Respond(const colibri::v1::ForwardRequest& request, const ForwardInput& in, int64_t d_model, ForwardOutput& out,
               colibri::v1::ForwardResponse* response);

  const Options options_;
  mutable common::Mutex router_mu_;
  std::shared_ptr<Router> router_ ABSL_GUARDED_BY(router_mu_);
  common::MemoryBudget budget_;
  common::Histogram* stage_[5] = {};  // route, dispatch, slowest_node, aggregate, total (if metrics)

  common::Mutex mu_;
  common::CondVar cv_;  // signalled when queue_ grows or stopping_ is set
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool load_running_ ABSL_GUARDED_BY(mu_) = false;
  std::thread load_thread_ ABSL_GUARDED_BY(mu_);  // the last LoadModel's, joined before the next
  std::vector<std::thread> workers_;

  runtime::OpenStreams<StreamReactor> streams_;  // the open ForwardStreams
};

// The Router service as the admin listener serves it: GetClusterStatus in
// full and LoadModel, for every caller that reaches it; nothing else
// (UNIMPLEMENTED).
// `service` must outlive it.
class RouterAdminService final : public colibri::v1::Router::CallbackService {
 public:
  explicit RouterAdminService(RouterService* service) : service_(service) {}
  // The model served, as on the data port (colibri-admin asks it around a switch).
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const colibri::v1::GetModelInfoRequest* request,
                                         colibri::v1::GetModelInfoResponse* response) override {
    return service_->GetModelInfo(context, request, response);
  }
  grpc::ServerUnaryReactor* GetClusterStatus(grpc::CallbackServerContext* context,
                                             const colibri::v1::GetClusterStatusRequest* request,
                                             colibri::v1::GetClusterStatusResponse* response) override;
  grpc::ServerUnaryReactor* LoadModel(grpc::CallbackServerContext* context,
                                      const colibri::v1::LoadModelRequest* request,
                                      colibri::v1::LoadModelResponse* response) override;

 private:
  RouterService* const service_;
};

}  // namespace router_node
}  // namespace colibri

#endif  // COLIBRI_ROUTER_NODE_ROUTER_SERVICE_H_
