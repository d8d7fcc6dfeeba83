#include "router_node/router_service.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <ostream>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/log_line.h"
#include "common/mutex.h"
#include "common/status_macros.h"
#include "router_node/forward_request.h"
#include "runtime/call_timer.h"
#include "runtime/grpc_admin.h"
#include "runtime/grpc_raw.h"
#include "runtime/grpc_status.h"

namespace colibri {
namespace router_node {
namespace {

namespace v1 = colibri::v1;

absl::Time DeadlineOf(const grpc::CallbackServerContext* context) {
  const auto d = context->deadline();
  if (d >= std::chrono::system_clock::time_point::max() - std::chrono::hours(24 * 365)) return absl::InfiniteFuture();
  return absl::FromChrono(d);
}

void AddTiming(v1::ForwardResponse* response, const TimingSpan& span) {
  v1::Timing* t = response->add_timings();
  t->set_stage(span.stage);
  t->set_start_nanos(span.start_nanos);
  t->set_nanos(span.nanos);
  t->set_detail(span.detail);
  t->set_rows(span.rows);
  t->set_bytes_sent(span.bytes_sent);
  t->set_bytes_received(span.bytes_received);
}

// From the request's bytes alone: its shape is not trusted yet.
int64_t ForwardFootprint(const v1::ForwardRequest& r, const common::Manifest& m) {
  const int64_t bytes = static_cast<int64_t>(r.hidden().data().size());
  return RouterService::Footprint(bytes, bytes / (r.hidden().dtype() == v1::DATA_TYPE_F32 ? 4 : 2), m);
}

int64_t SlowestNodeNanos(const ForwardOutput& out) {
  int64_t slowest = 0;
  for (const NodeCallRecord& c : out.backend.calls) slowest = std::max(slowest, c.end_nanos - c.start_nanos);
  return slowest;
}

// A unary Forward: cancelled with the client, or when its reply is not sent
// within the send timeout; deleted when gRPC is done with it.
class ForwardReactor final : public grpc::ServerUnaryReactor {
 public:
  // `request` is parsed (and freed) in Start; `response` gets the reply.
  ForwardReactor(RouterService* service, grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                 grpc::ByteBuffer* response, absl::Duration send_timeout)
      : service_(service),
        raw_request_(const_cast<grpc::ByteBuffer*>(request)),  // gRPC's, in the call's arena: ours to clear
        raw_response_(response),
        control_(DeadlineOf(context)),
        send_timeout_([context] { context->TryCancel(); }, send_timeout) {}

  void Start() {
    if (absl::Status parsed = runtime::ParseRaw(raw_request_, &request_); !parsed.ok()) return Done(parsed);
    if (service_->RunsInline(request_)) return Run();
    absl::StatusOr<std::shared_ptr<RouterService::Admitted>> admitted = service_->Admit(request_, control_);
    if (!admitted.ok()) return Done(admitted.status());
    if (!service_->Submit([this, a = *std::move(admitted)]() mutable {
          service_->RunAdmitted(std::move(a), request_, control_, &response_,
                                [this](absl::Status s, std::shared_ptr<void> held) { Done(s, std::move(held)); });
        })) {
      Done(absl::ResourceExhaustedError("router queue full or shutting down; retry"));
    }
  }

  void OnCancel() override { control_.Cancel(); }
  void OnDone() override { delete this; }  // the reply is sent (or the call is over): `held_` goes with it

 private:
  void Run() {
    service_->StartForward(request_, control_, &response_,
                           [this](absl::Status s, std::shared_ptr<void> held) { Done(s, std::move(held)); });
  }
  void Done(absl::Status s, std::shared_ptr<void> held = nullptr) {
    held_ = std::move(held);
    if (s.ok()) s = runtime::SerializeRaw(response_, raw_response_);
    response_ = v1::ForwardResponse();  // held once, serialized
    service_->CountCall("Forward", s.code());
    send_timeout_.Start();
    Finish(runtime::ToGrpcStatus(s));
  }

  RouterService* const service_;
  grpc::ByteBuffer* const raw_request_;
  grpc::ByteBuffer* const raw_response_;
  v1::ForwardRequest request_;
  v1::ForwardResponse response_;
  CallControl control_;
  std::shared_ptr<void> held_;  // the call's memory reservation, until the reply is sent
  runtime::CallTimer send_timeout_;
};

}  // namespace

// ForwardStream: read a request, run it, write its reply, read the next — in
// order, one at a time. Close (the router's shutdown) ends it after the reply
// in progress, or at once while it waits for a request. Holds keep it alive:
// the read loop's, one while a read is being started, one while a request
// runs and its reply is written; the last one released finishes the stream.
// Deleted when gRPC is done with it.
class RouterService::StreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StreamReactor(RouterService* service, grpc::CallbackServerContext* context)
      : service_(service),
        deadline_(DeadlineOf(context)),
        send_timeout_([context] { context->TryCancel(); }, service->options_.send_timeout) {}

  // Starts the first read (after the service has registered the stream).
  void Begin() { ReadNext(); }
  void Close() {
    EndLoop(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the router is shutting down: open a new stream"));
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed (or the call ended): every reply has been written
      EndLoop(grpc::Status::OK);
      return;
    }
    auto control = std::make_shared<CallControl>(deadline_);
    bool cancelled = false;
    {
      common::MutexLock lock(&mu_);
      if (loop_ended_) return;  // closed while the read was outstanding
      ++holds_;                 // the request's, until its reply is written
      cancelled = cancelled_;
      current_ = control;
    }
    if (cancelled) control->Cancel();
    // One that does not parse is answered in its turn (with no request_id).
    if (absl::Status parsed = runtime::ParseRaw(&raw_request_, &request_); !parsed.ok()) return Done(parsed, nullptr);
    if (service_->RunsInline(request_)) return Run(*control, nullptr);
    absl::StatusOr<std::shared_ptr<RouterService::Admitted>> admitted = service_->Admit(request_, *control);
    if (!admitted.ok()) return Done(admitted.status(), nullptr);
    if (!service_->Submit([this, control, a = *std::move(admitted)]() mutable { Run(*control, std::move(a)); })) {
      Done(absl::ResourceExhaustedError("router queue full or shutting down; retry"), nullptr);
    }
  }
  void OnWriteDone(bool ok) override {
    send_timeout_.Done();
    if (!ok) {
      reply_held_.reset();  // see Done
      EndLoop(grpc::Status(grpc::StatusCode::CANCELLED, "stream write failed"));
    } else {
      // Fresh messages, not Clear(): an idle stream keeps no large request's buffers.
      request_ = v1::ForwardRequest();
      raw_reply_.Clear();
      reply_held_.reset();  // once the memory it counts is gone, before the next request may set it
      ReadNext();
    }
    Release();  // the request's
  }
  void OnCancel() override {
    std::shared_ptr<CallControl> current;
    {
      common::MutexLock lock(&mu_);
      cancelled_ = true;
      current = current_;
    }
    if (current != nullptr) current->Cancel();  // outside mu_: the request may end inside Cancel
  }
  void OnDone() override {
    service_->streams_.Remove(this);
    delete this;
  }

 private:
  // The next read, unless the loop has ended.
  void ReadNext() {
    {
      common::MutexLock lock(&mu_);
      if (loop_ended_) return;
      ++holds_;  // a Close or a half-close while StartRead runs cannot finish the stream under it
    }
    StartRead(&raw_request_);
    Release();
  }
  // Ends the read loop (once) with the stream's final status.
  void EndLoop(const grpc::Status& status) {
    {
      common::MutexLock lock(&mu_);
      if (loop_ended_) return;
      loop_ended_ = true;
      end_status_ = status;
    }
    Release();  // the loop's
  }
  void Release() {
    grpc::Status status;
    {
      common::MutexLock lock(&mu_);
      if (--holds_ > 0) return;
      status = end_status_;
    }
    Finish(status);
  }

  // Runs request_: admitted already if it waited for a worker, else admitted here.
  void Run(CallControl& control, std::shared_ptr<RouterService::Admitted> admitted) {
    auto done = [this](absl::Status s, std::shared_ptr<void> held) { Done(s, std::move(held)); };
    if (admitted == nullptr) {
      service_->StartForward(request_, control, reply_.mutable_response(), std::move(done));
    } else {
      service_->RunAdmitted(std::move(admitted), request_, control, reply_.mutable_response(), std::move(done));
    }
  }
  // The request's end: its control is dropped (it lives in current_ until
  // here), and its reply written; the call's reservation is kept until the
  // write is done (OnWriteDone), as the request and reply live until then.
  void Done(const absl::Status& s, std::shared_ptr<void> held) {
    std::shared_ptr<CallControl> control;
    {
      common::MutexLock lock(&mu_);
      control.swap(current_);
    }
    reply_held_ = std::move(held);
    Reply(s);
  }
  void Reply(absl::Status s) {
    v1::ForwardStreamResponse reply;
    reply.Swap(&reply_);  // reply_ starts empty for the next request
    reply.set_code(static_cast<int32_t>(s.code()));
    reply.set_message(std::string(s.message()));
    // A request_id over the limit is refused; its echo is cut to the limit
    // (at a character's start: a proto string must stay UTF-8), so an
    // oversized id is not sent back outside the memory budget.
    const std::string& id = request_.request_id();
    size_t keep = std::min(id.size(), kMaxRequestIdBytes);
    while (keep < id.size() && keep > 0 && (static_cast<unsigned char>(id[keep]) & 0xC0) == 0x80) --keep;
    reply.set_request_id(id.substr(0, keep));
    if (!s.ok()) reply.clear_response();
    if (absl::Status serialized = runtime::SerializeRaw(reply, &raw_reply_); !serialized.ok()) {
      s = serialized;
      reply = v1::ForwardStreamResponse();
      reply.set_code(static_cast<int32_t>(serialized.code()));
      reply.set_message(std::string(serialized.message()));
      (void)runtime::SerializeRaw(reply, &raw_reply_);
    }
    service_->CountCall("ForwardStream", s.code());
    send_timeout_.Start();
    StartWrite(&raw_reply_);
  }

  RouterService* const service_;
  const absl::Time deadline_;
  grpc::ByteBuffer raw_request_;  // read into, then parsed into request_
  v1::ForwardRequest request_;
  v1::ForwardStreamResponse reply_;  // filled by the request's run, serialized into raw_reply_
  grpc::ByteBuffer raw_reply_;
  std::shared_ptr<void> reply_held_;  // the reservation of the request whose reply is being written
  runtime::CallTimer send_timeout_;   // of the reply being written
  common::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::shared_ptr<CallControl> current_ ABSL_GUARDED_BY(mu_);  // the request being run
  int holds_ ABSL_GUARDED_BY(mu_) = 1;                         // the read loop's, + see above
  bool loop_ended_ ABSL_GUARDED_BY(mu_) = false;               // no more reads: half-closed, closed or broken
  grpc::Status end_status_ ABSL_GUARDED_BY(mu_);               // the stream's, once the last hold is released
};

int64_t RouterService::Footprint(int64_t hidden_bytes, int64_t values, const common::Manifest& m) {
  const int64_t routes = m.top_k + m.n_shared_experts;
  return hidden_bytes + values * 4 * (3 + 3 * routes);
}

RouterService::RouterService(std::shared_ptr<Router> router, Options options)
    : options_(std::move(options)),
      router_(std::move(router)),
      budget_(options_.max_inflight_bytes, "the router's --max_inflight_bytes") {
  if (options_.metrics != nullptr) {
    const char* stages[5] = {"route", "dispatch", "slowest_node", "aggregate", "total"};
    for (int i = 0; i < 5; ++i) {
      stage_[i] = options_.metrics->GetHistogram("colibri_router_stage_seconds",
                                                 "Time of each stage of a Forward call (slowest_node: the slowest "
                                                 "node call of the layer).",
                                                 {{"stage", stages[i]}}, common::LatencyBuckets());
    }
  }
  for (int i = 0; i < std::max(1, options_.workers); ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

RouterService::~RouterService() {
  std::thread load;
  {
    common::MutexLock lock(&mu_);
    stopping_ = true;
    load = std::move(load_thread_);
  }
  cv_.SignalAll();
  for (std::thread& t : workers_) t.join();
  if (load.joinable()) load.join();
}

bool RouterService::Submit(std::function<void()> job) {
  {
    common::MutexLock lock(&mu_);
    if (stopping_ || static_cast<int64_t>(queue_.size()) >= options_.max_queued_requests) return false;
    queue_.push_back(std::move(job));
  }
  cv_.Signal();
  return true;
}

void RouterService::WorkerLoop() {
  for (;;) {
    std::function<void()> job;
    {
      common::MutexLock lock(&mu_);
      while (!stopping_ && queue_.empty()) cv_.Wait(&mu_);
      if (queue_.empty()) return;  // stopping and drained
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job();
  }
}

void RouterService::CountCall(const char* method, absl::StatusCode code) {
  if (options_.metrics == nullptr) return;
  options_.metrics
      ->GetCounter("colibri_router_requests_total", "Router calls by method and status code.",
                   {{"method", method}, {"code", std::to_string(static_cast<int>(code))}})
      ->Increment();
}

std::shared_ptr<Router> RouterService::router() const {
  common::MutexLock lock(&router_mu_);
  return router_;
}

std::shared_ptr<Router> RouterService::SwapRouter(std::shared_ptr<Router> router) {
  common::MutexLock lock(&router_mu_);
  router_.swap(router);
  return router;
}

bool RouterService::RunsInline(const v1::ForwardRequest& request) const {
  const std::shared_ptr<Router> router = this->router();
  if (!router->backend().asynchronous()) return false;
  const common::Manifest& m = router->manifest();
  // The work before the first node call: widening the hidden states, and for
  // gate routing the logits (d_model x n_experts per token).
  int64_t work = static_cast<int64_t>(request.hidden().data().size()) / 2;
  if (request.routing() == v1::ROUTING_MODE_GATE) work *= m.n_experts;
  return work <= options_.inline_work;
}

struct RouterService::Admitted {
  // The whole request is answered by the model version it starts with: a
  // version swapped in meanwhile serves the next requests.
  std::shared_ptr<Router> router;
  ForwardInput in;
  common::MemoryBudget::Reservation held;
};

absl::StatusOr<std::shared_ptr<RouterService::Admitted>> RouterService::Admit(const v1::ForwardRequest& request,
                                                                              const CallControl& control) {
  if (control.cancelled()) return absl::CancelledError("cancelled before it ran");
  if (absl::Now() > control.deadline()) return absl::DeadlineExceededError("deadline passed before it ran");
  auto a = std::make_shared<Admitted>();
  a->router = this->router();
  COLIBRI_ASSIGN_OR_RETURN(a->in, ParseForwardRequest(request));
  COLIBRI_RETURN_IF_ERROR(a->router->CheckShape(a->in));
  COLIBRI_ASSIGN_OR_RETURN(a->held,
                           budget_.Reserve(ForwardFootprint(request, a->router->manifest()), "this Forward call"));
  return a;
}

void RouterService::StartForward(const v1::ForwardRequest& request, CallControl& control, v1::ForwardResponse* response,
                                 Done done) {
  absl::StatusOr<std::shared_ptr<Admitted>> admitted = Admit(request, control);
  if (!admitted.ok()) return done(admitted.status(), nullptr);
  RunAdmitted(*std::move(admitted), request, control, response, std::move(done));
}

void RouterService::RunAdmitted(std::shared_ptr<Admitted> a, const v1::ForwardRequest& request, CallControl& control,
                                v1::ForwardResponse* response, Done done) {
  absl::Status late;
  if (control.cancelled()) late = absl::CancelledError("cancelled before it ran");
  if (late.ok() && absl::Now() > control.deadline()) late = absl::DeadlineExceededError("deadline passed while queued");
  if (!late.ok()) {
    a.reset();  // its memory given back before `done`, which may end the service
    return done(late, nullptr);
  }
  Router& core = *a->router;
  // The reservation lasts as long as the router holds the call (a merged
  // call may hold its rows after it was answered), not only until `done`.
  a->in.hold = std::make_shared<common::MemoryBudget::Reservation>(std::move(a->held));
  const ForwardInput& in = a->in;  // both owned by `a`, which the callback owns from here
  core.ForwardAsync(
      in, control,
      [this, &request, response, a = std::move(a), done = std::move(done)](absl::StatusOr<ForwardOutput> out) mutable {
        if (out.ok()) Respond(request, a->in, a->router->manifest().d_model, *out, response);
        // Nothing of the service is touched once `done` runs: it may end the service (a
        // proxyless client destroyed by its caller as soon as its last call is answered).
        // The reservation outlives it (MemoryBudget), and the router's own reference may
        // last longer than the caller's.
        std::shared_ptr<void> held = std::move(a->in.hold);
        a->router.reset();
        done(out.ok() ? absl::OkStatus() : out.status(), std::move(held));
      });
}

void RouterService::Respond(const v1::ForwardRequest& request, const ForwardInput& in, int64_t d_model,
                            ForwardOutput& out, v1::ForwardResponse* response) {
  v1::Tensor* t = response->mutable_output();
  t->set_dtype(static_cast<v1::DataType>(out.output_dtype));
  t->add_shape(in.num_tokens);
  t->add_shape(d_model);
  t->set_data(std::move(out.output));
  if (request.return_routes()) {
    v1::Routes* r = response->mutable_routes();
    r->set_top_k(static_cast<int32_t>(out.routes.top_k));
    r->mutable_expert_ids()->Add(out.routes.expert_ids.begin(), out.routes.expert_ids.end());
    r->mutable_weights()->Add(out.routes.weights.begin(), out.routes.weights.end());
  }
  if (request.return_timings()) {
    for (const TimingSpan& span : TimingSpans(out)) AddTiming(response, span);
  }
  Record(out, in.num_tokens, in.request_id, in.layer);
}

void RouterService::Record(const ForwardOutput& out, int64_t tokens, const std::string& request_id, int32_t layer) {
  if (stage_[0] != nullptr) {
    stage_[0]->Observe(out.timings.route_nanos * 1e-9);
    stage_[1]->Observe(out.timings.dispatch_nanos * 1e-9);
    stage_[2]->Observe(SlowestNodeNanos(out) * 1e-9);
    stage_[3]->Observe(out.timings.aggregate_nanos * 1e-9);
    stage_[4]->Observe(out.timings.total_nanos * 1e-9);
  }
  if (!options_.debug || options_.log == nullptr) return;
  std::string line = absl::StrCat(
      "colibri-router: request '", absl::CEscape(request_id), "' layer ", layer, " tokens ", tokens, ": route ",
      out.timings.route_nanos / 1000, " us, dispatch ", out.timings.dispatch_nanos / 1000, " us, aggregate ",
      out.timings.aggregate_nanos / 1000, " us, total ", out.timings.total_nanos / 1000, " us; nodes:");
  for (const NodeCallRecord& c : out.backend.calls) {
    absl::StrAppend(&line, " ", c.node, (c.attempt > 0 ? " (retry)" : ""), (c.hedge ? " (hedge)" : ""), " ",
                    (c.end_nanos - c.start_nanos) / 1000, " us (compute ", c.node_compute_nanos / 1000, " us, ", c.rows,
                    " rows, ", c.experts, " experts)");
  }
  common::LogLine(options_.log, line);
}

grpc::ServerUnaryReactor* RouterService::Forward(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                                 grpc::ByteBuffer* response) {
  auto* reactor = new ForwardReactor(this, context, request, response, options_.send_timeout);
  reactor->Start();
  return reactor;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* RouterService::ForwardStream(
    grpc::CallbackServerContext* context) {
  auto* reactor = new StreamReactor(this, context);
  // After Begin (or Close) the stream may finish and be deleted at any time: nothing touches it after.
  if (streams_.Add(reactor)) {
    reactor->Begin();
  } else {
    reactor->Close();  // the router is shutting down: finished without reading
  }
  return reactor;
}

void RouterService::CloseStreams() { streams_.CloseAll(); }

grpc::ServerUnaryReactor* RouterService::GetModelInfo(grpc::CallbackServerContext* context,
                                                      const v1::GetModelInfoRequest*,
                                                      v1::GetModelInfoResponse* response) {
  FillModelInfo(response);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  CountCall("GetModelInfo", absl::StatusCode::kOk);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

void RouterService::FillModelInfo(v1::GetModelInfoResponse* response) const {
  const std::shared_ptr<Router> router = this->router();
  const common::Manifest& m = router->manifest();
  response->set_model_id(router->model_id());
  response->set_architecture(m.architecture);
  response->set_d_model(static_cast<int32_t>(m.d_model));
  response->set_d_ff(static_cast<int32_t>(m.d_ff));
  response->set_n_layers(static_cast<int32_t>(m.n_layers));
  response->set_n_experts(static_cast<int32_t>(m.n_experts));
  response->set_n_shared_experts(static_cast<int32_t>(m.n_shared_experts));
  response->set_shared_d_ff(static_cast<int32_t>(m.shared_d_ff));
  response->set_top_k(static_cast<int32_t>(m.top_k));
  response->set_norm_topk_prob(m.norm_topk_prob);
  response->set_vocab_size(static_cast<int32_t>(m.vocab_size));
  response->set_weight_type(common::DTypeName(m.weight_type));
  for (const common::RoutingMode mode :
       {common::RoutingMode::kLut, common::RoutingMode::kGate, common::RoutingMode::kClient}) {
    response->add_routing_modes(ToProtoRoutingMode(mode));
  }
  response->set_backend(router->backend().kind());
  response->set_max_tokens(static_cast<int32_t>(router->max_tokens()));
}

grpc::ServerUnaryReactor* RouterService::GetClusterStatus(grpc::CallbackServerContext* context,
                                                          const v1::GetClusterStatusRequest*,
                                                          v1::GetClusterStatusResponse* response) {
  return ClusterStatus(context, response, runtime::PeerIsNamed(*context, options_.admin_identities));
}

grpc::ServerUnaryReactor* RouterAdminService::GetClusterStatus(grpc::CallbackServerContext* context,
                                                               const v1::GetClusterStatusRequest*,
                                                               v1::GetClusterStatusResponse* response) {
  return service_->ClusterStatus(context, response, /*admin=*/true);
}

grpc::ServerUnaryReactor* RouterService::LoadModel(grpc::CallbackServerContext* context,
                                                   const v1::LoadModelRequest* request,
                                                   v1::LoadModelResponse* response) {
  return LoadModelAs(context, request, response, runtime::PeerIsNamed(*context, options_.admin_identities));
}

grpc::ServerUnaryReactor* RouterAdminService::LoadModel(grpc::CallbackServerContext* context,
                                                        const v1::LoadModelRequest* request,
                                                        v1::LoadModelResponse* response) {
  return service_->LoadModelAs(context, request, response, /*admin=*/true);
}

grpc::ServerUnaryReactor* RouterService::LoadModelAs(grpc::CallbackServerContext* context,
                                                     const v1::LoadModelRequest* request,
                                                     v1::LoadModelResponse* response, bool admin) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto finish = [this, reactor](const absl::Status& s) {
    CountCall("LoadModel", s.code());
    reactor->Finish(runtime::ToGrpcStatus(s));
  };
  if (!admin) {
    finish(absl::PermissionDeniedError(
        "LoadModel is an admin call: make it on the router's admin listener (colibri-router --admin_listen) or "
        "with a client certificate named in --admin_identities"));
    return reactor;
  }
  if (!options_.load_model) {
    finish(
        absl::FailedPreconditionError("this router cannot switch models (local mode: restart it with the new model)"));
    return reactor;
  }
  common::MutexLock lock(&mu_);
  if (stopping_ || load_running_) {
    finish(stopping_ ? absl::UnavailableError("the router is shutting down")
                     : absl::AbortedError("another LoadModel is in progress"));
    return reactor;
  }
  if (load_thread_.joinable()) load_thread_.join();  // finished: it cleared load_running_
  load_running_ = true;
  // Loading and waiting for the nodes take seconds: never on a gRPC thread.
  const absl::Duration timeout = absl::Milliseconds(request->timeout_ms() > 0 ? request->timeout_ms() : 30000);
  load_thread_ = std::thread([this, context, finish, response, dir = request->model_dir(), timeout] {
    absl::StatusOr<ModelSwitch> ids = options_.load_model(dir, timeout, [context] { return context->IsCancelled(); });
    if (ids.ok()) {
      response->set_model_id(ids->model_id);
      response->set_previous_model_id(ids->previous_model_id);
      response->set_previous_released(ids->previous_released);
    }
    {
      common::MutexLock guard(&mu_);
      load_running_ = false;
    }
    finish(ids.status());
  });
  return reactor;
}

grpc::ServerUnaryReactor* RouterService::ClusterStatus(grpc::CallbackServerContext* context,
                                                       v1::GetClusterStatusResponse* response, bool admin) {
  FillClusterStatus(response, admin);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  CountCall("GetClusterStatus", absl::StatusCode::kOk);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

void RouterService::FillClusterStatus(v1::GetClusterStatusResponse* response, bool admin) const {
  const std::shared_ptr<Router> router = this->router();
  const common::Manifest& m = router->manifest();
  std::shared_ptr<const ShardMap> map;
  if (auto* remote = dynamic_cast<RemoteBackend*>(&router->backend()); remote != nullptr) {
    map = remote->map();
    int index = 0;
    for (const NodeStatusView& n : remote->Nodes()) {
      v1::NodeStatus* s = response->add_nodes();
      // Addresses and errors (which name addresses) are the cluster's layout: admins only.
      s->set_address(admin ? n.address : absl::StrCat("node-", index));
      ++index;
      s->set_live(n.live);
      s->set_in_flight(n.in_flight);
      s->set_calls(n.calls);
      s->set_failed_calls(n.failed_calls);
      if (!n.last_error.empty()) s->set_last_error(admin ? n.last_error : "down (details: admin callers)");
      s->set_weights_version(n.weights_version);
      s->set_kernel_profile(n.kernel_profile);
      v1::OwnedExperts* owned = nullptr;
      for (const auto& [layer, expert] : n.owned) {
        if (owned == nullptr || owned->layer() != layer) {
          owned = s->add_owned();
          owned->set_layer(static_cast<int32_t>(layer));
        }
        owned->add_experts(static_cast<int32_t>(expert));
      }
    }
    response->set_retries(remote->retries());
  }
  bool serving = true;
  for (int64_t layer = 0; layer < m.n_layers; ++layer) {
    for (int64_t expert = 0; expert < m.total_experts(); ++expert) {  // shared experts last
      v1::ExpertLoad* e = response->add_experts();
      e->set_layer(static_cast<int32_t>(layer));
      e->set_expert(static_cast<int32_t>(expert));
      e->set_tokens(router->tokens_routed(layer, expert));
      // In-process experts are always there.
      const int replicas = map != nullptr ? static_cast<int>(map->replicas(layer, expert).size()) : 1;
      e->set_live_replicas(replicas);
      serving = serving && replicas > 0;
    }
  }
  response->set_serving(serving);
  response->set_requests(router->requests());
}

}  // namespace router_node
}  // namespace colibri
