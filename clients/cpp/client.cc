#include "clients/cpp/client.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "clients/cpp/tensor.h"
#include "common/mutex.h"
#include "router_node/remote_backend.h"
#include "router_node/remote_router.h"
#include "router_node/router_service.h"
#include "runtime/call_timer.h"
#include "runtime/flags.h"
#include "runtime/grpc_callback_queue.h"
#include "runtime/grpc_credentials.h"
#include "runtime/grpc_services.h"
#include "runtime/grpc_status.h"

namespace colibri {
namespace client {
namespace {

namespace v1 = colibri::v1;

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// An infinite timeout sets no deadline (adding it to a clock would overflow).
void SetDeadline(grpc::ClientContext* context, absl::Duration timeout) {
  if (timeout == absl::InfiniteDuration()) return;
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace

// The router's core, its remote backend and its request handling
// (RouterService::StartForward: parse, route, send, aggregate) — no server.
struct Client::Direct {
  router_node::RemoteOptions remote;  // as Connect set them: LoadModel builds the next version with them
  router_node::RouterOptions router;
  common::Mutex load_mu;  // one LoadModel at a time
  // The version serving, and earlier ones whose requests may still run: each
  // request holds the version it started on (RouterService::router()); a
  // retired one is destroyed by LoadModel once nothing uses it
  // (router_node::InUse), never on a request's callback thread (which its
  // own backend runs).
  std::shared_ptr<router_node::RemoteRouter> current ABSL_GUARDED_BY(load_mu);
  std::vector<std::shared_ptr<router_node::RemoteRouter>> retired ABSL_GUARDED_BY(load_mu);
  std::unique_ptr<router_node::RouterService> service;  // declared last: destroyed before the versions

  // Once every request has ended (~Client waits for them).
  ~Direct() {
    service.reset();
    common::MutexLock lock(&load_mu);
    for (const auto& r : retired) router_node::AwaitIdle(*r);
    if (current != nullptr) router_node::AwaitIdle(*current);
  }

  // Destroys the retired versions nothing uses; true if none is left.
  bool ReleaseRetired() ABSL_EXCLUSIVE_LOCKS_REQUIRED(load_mu) {
    std::vector<std::shared_ptr<router_node::RemoteRouter>> kept;
    for (std::shared_ptr<router_node::RemoteRouter>& r : retired) {
      if (router_node::InUse(r)) kept.push_back(std::move(r));
    }
    retired = std::move(kept);
    return retired.empty();
  }

  // Runs one request; `done` gets the status once `response` is filled.
  void Start(const v1::ForwardRequest& request, router_node::CallControl& control, v1::ForwardResponse* response,
             std::function<void(absl::Status)> done) {
    // The reply is the caller's as soon as it is filled: nothing to keep the reservation for.
    service->StartForward(request, control, response,
                          [done = std::move(done)](absl::Status s, std::shared_ptr<void> held) {
                            held.reset();
                            done(s);
                          });
  }
};

Client::Client(ClientOptions options, std::unique_ptr<v1::Router::Stub> stub)
    : options_(std::move(options)), stub_(std::move(stub)) {}

Client::~Client() {
  std::unique_lock<std::mutex> lock(async_mu_);
  async_cv_.wait(lock, [&] { return async_in_flight_ == 0; });
}

void Client::AsyncStarted() {
  std::lock_guard<std::mutex> lock(async_mu_);
  ++async_in_flight_;
}

void Client::AsyncEnded() {
  std::lock_guard<std::mutex> lock(async_mu_);
  if (--async_in_flight_ == 0) async_cv_.notify_all();
}

namespace {

// The router core's options named in its errors, and the ClientOptions fields that set them.
const runtime::OptionFlags kDirectFields = {
    {"RemoteOptions::addresses", "ClientOptions::direct.nodes"},
    {"RemoteOptions::cluster_file", "ClientOptions::direct.cluster_file"},
    {"RemoteOptions::node_stream_max_bytes", "ClientOptions::direct.node_stream_max_bytes"},
    {"RemoteOptions::tls_ca_file", "ClientOptions::direct.node_tls_ca_file"},
    {"RemoteOptions::tls_cert_file", "ClientOptions::direct.node_tls_cert_file"},
    {"RemoteOptions::tls_key_file", "ClientOptions::direct.node_tls_key_file"},
    {"RemoteOptions::tls_server_name", "ClientOptions::direct.node_tls_server_name"},
    {"RouterOptions::max_tokens", "ClientOptions::direct.max_tokens"},
    {"BatchOptions::max_tokens", "ClientOptions::direct.batch_max_tokens"},
};

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::ConnectDirect(const ClientOptions& options) {
  const ClientOptions::Direct& d = options.direct;
  router_node::RemoteOptions remote;
  remote.addresses = d.nodes;
  remote.cluster_file = d.cluster_file;
  remote.node_timeout = d.node_timeout;
  remote.hedge_after = d.hedge_after;
  remote.node_stream_max_bytes = std::max<int64_t>(0, d.node_stream_max_bytes);
  const std::optional<router_node::NodeReplies> replies = router_node::ParseNodeReplies(d.node_replies);
  if (!replies.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions::direct.node_replies '", d.node_replies, "' must be exact, partial or per_expert"));
  }
  remote.replies = *replies;
  remote.tls_ca_file = d.node_tls_ca_file;
  remote.tls_cert_file = d.node_tls_cert_file;
  remote.tls_key_file = d.node_tls_key_file;
  remote.tls_server_name = d.node_tls_server_name;
  // Checked here as the C API checks them: a node timeout of 0 would take
  // every node out on its first call.
  if (d.node_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions::direct.node_timeout ", absl::FormatDuration(d.node_timeout), " must be positive"));
  }
  if (d.hedge_after < absl::ZeroDuration() || d.batch_window < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("ClientOptions::direct.hedge_after and batch_window must not be negative");
  }
  for (const auto& [value, name] : {std::pair{d.max_tokens, "max_tokens"}, {d.batch_max_tokens, "batch_max_tokens"}}) {
    if (value < 1 || value > (int64_t{1} << 24)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ClientOptions::direct.", name, " ", value, " is not in [1, 2^24]"));
    }
  }
  router_node::RouterOptions router;
  router.max_tokens = d.max_tokens;
  router.batching.window = d.batch_window;
  router.batching.max_tokens = d.batch_max_tokens;
  auto direct = std::make_unique<Direct>();
  absl::StatusOr<router_node::RemoteRouter> core = router_node::MakeRemoteRouter(d.model_dir, remote, router);
  if (!core.ok()) return runtime::NameFlags(core.status(), kDirectFields);
  direct->remote = remote;
  direct->router = router;
  auto version = std::make_shared<router_node::RemoteRouter>(std::move(*core));
  router_node::RouterService::Options service;
  service.workers = 1;  // requests start on the caller's thread; this one takes none
  direct->service = std::make_unique<router_node::RouterService>(
      std::shared_ptr<router_node::Router>(version, version->router.get()), service);
  {
    common::MutexLock lock(&direct->load_mu);
    direct->current = std::move(version);
  }
  std::unique_ptr<Client> client(new Client(options, nullptr));
  direct->service->FillModelInfo(&client->model_);
  client->direct_ = std::move(direct);
  return client;
}

absl::StatusOr<std::string> Client::LoadModel(const std::string& model_dir, absl::Duration timeout) {
  if (direct_ == nullptr) {
    return absl::FailedPreconditionError(
        "Client::LoadModel is for proxyless clients; a router switches models itself (colibri-admin switch)");
  }
  Direct& d = *direct_;
  common::MutexLock lock(&d.load_mu);
  absl::StatusOr<router_node::RemoteRouter> next =
      router_node::PrepareVersion(*d.current->router, model_dir, d.remote, d.router, timeout);
  if (!next.ok()) return next.status();
  if (next->router == nullptr) return d.current->router->model_id();
  auto version = std::make_shared<router_node::RemoteRouter>(std::move(*next));
  std::shared_ptr<router_node::RemoteRouter> old = std::move(d.current);
  d.current = version;
  d.service->SwapRouter(std::shared_ptr<router_node::Router>(version, version->router.get()));
  old->backend->Stop();         // its health checks; its requests still finish on it
  version->backend->Publish();  // after the old one's last round: the gauges are the new one's
  d.retired.push_back(std::move(old));
  const absl::Time drain_until = absl::Now() + timeout;
  while (!d.ReleaseRetired() && absl::Now() < drain_until) absl::SleepFor(absl::Milliseconds(20));
  return version->router->model_id();
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (options.target.empty() == options.direct.model_dir.empty()) {
    return absl::InvalidArgumentError(
        "client: give either a target (host:port of the router) or direct.model_dir and nodes (proxyless)");
  }
  if (!options.direct.model_dir.empty()) {
    // The router's TLS fields would be ignored: the nodes are called with direct.node_tls_*.
    for (const std::string* field :
         {&options.tls_ca_file, &options.tls_cert_file, &options.tls_key_file, &options.tls_server_name}) {
      if (!field->empty()) {
        return absl::InvalidArgumentError(
            "client: ClientOptions::tls_* secure the calls to a router; a proxyless client calls the nodes, "
            "with ClientOptions::direct.node_tls_*");
      }
    }
    return ConnectDirect(options);
  }
  if (!options.direct.nodes.empty() || !options.direct.cluster_file.empty()) {
    return absl::InvalidArgumentError(
        "client: direct.nodes and direct.cluster_file need direct.model_dir (proxyless) and no target; with a "
        "target, the router calls the nodes");
  }
  grpc::ChannelArguments args;
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      runtime::ChannelCredentialsFromFiles(options.tls_ca_file, options.tls_cert_file, options.tls_key_file,
                                           options.tls_server_name, "ClientOptions::", &args);
  if (!credentials.ok()) return credentials.status();
  const int max_bytes = static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX));
  args.SetMaxReceiveMessageSize(max_bytes);
  args.SetMaxSendMessageSize(max_bytes);
  runtime::ApplyChannelReconnect(&args);  // a router that restarts is reached again within a second
  runtime::ApplyChannelKeepalive(&args);  // a router gone silent is noticed and reconnected
  runtime::KeepCallbackQueue();           // ForwardAsync's callback may drop the channel's last owner
  auto channel = grpc::CreateCustomChannel(options.target, *credentials, args);
  std::unique_ptr<Client> client(new Client(options, v1::Router::NewStub(channel)));
  grpc::ClientContext context;
  SetDeadline(&context, options.connect_timeout);
  const grpc::Status s = client->stub_->GetModelInfo(&context, v1::GetModelInfoRequest(), &client->model_);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("router ", options.target, ": ", s.error_message()));
  }
  return client;
}

absl::StatusOr<v1::ForwardRequest> Client::MakeRequest(const ForwardArgs& args) const {
  const int64_t d_model = model_.d_model();
  if (d_model <= 0 || args.hidden.size() % d_model != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden holds ", args.hidden.size(), " values, not a multiple of d_model ", d_model));
  }
  const int64_t tokens = static_cast<int64_t>(args.hidden.size()) / d_model;
  v1::ForwardRequest r;
  r.set_layer(args.layer);
  r.mutable_token_ids()->Add(args.token_ids.begin(), args.token_ids.end());
  *r.mutable_hidden() =
      args.send_as == WireType::kBF16 ? PackBf16(args.hidden, tokens, d_model) : PackF32(args.hidden, tokens, d_model);
  switch (args.routing) {
    case Routing::kLut: r.set_routing(v1::ROUTING_MODE_LUT); break;
    case Routing::kGate: r.set_routing(v1::ROUTING_MODE_GATE); break;
    case Routing::kClient:
      r.set_routing(v1::ROUTING_MODE_CLIENT);
      r.mutable_routes()->set_top_k(args.routes.top_k);
      r.mutable_routes()->mutable_expert_ids()->Add(args.routes.expert_ids.begin(), args.routes.expert_ids.end());
      r.mutable_routes()->mutable_weights()->Add(args.routes.weights.begin(), args.routes.weights.end());
      break;
  }
  r.set_output_dtype(args.output == WireType::kBF16 ? v1::DATA_TYPE_BF16 : v1::DATA_TYPE_F32);
  r.set_request_id(args.request_id);
  r.set_return_routes(args.return_routes);
  r.set_return_timings(args.return_timings);
  return r;
}

absl::StatusOr<ForwardResult> Client::ReadResponse(const v1::ForwardRequest& request,
                                                   const v1::ForwardResponse& response) const {
  ForwardResult result;
  absl::StatusOr<std::vector<float>> output = Unpack(response.output());
  if (!output.ok()) return absl::InternalError(absl::StrCat("router reply: ", output.status().message()));
  const int64_t tokens = request.hidden().shape_size() > 0 ? request.hidden().shape(0) : 0;
  if (response.output().shape_size() != 2 || response.output().shape(0) != tokens ||
      response.output().shape(1) != model_.d_model()) {
    return absl::InternalError(absl::StrCat("router reply: output is not [", tokens, ", ", model_.d_model(), "]"));
  }
  if (request.return_routes()) {
    const int64_t routes = tokens * response.routes().top_k();
    if (response.routes().top_k() < 0 || response.routes().expert_ids_size() != routes ||
        response.routes().weights_size() != routes) {
      return absl::InternalError(
          absl::StrCat("router reply: routes are not ", tokens, " tokens x top_k ", response.routes().top_k()));
    }
  }
  result.output = std::move(*output);
  result.routes.top_k = response.routes().top_k();
  result.routes.expert_ids.assign(response.routes().expert_ids().begin(), response.routes().expert_ids().end());
  result.routes.weights.assign(response.routes().weights().begin(), response.routes().weights().end());
  for (const v1::Timing& t : response.timings()) {
    result.timings.push_back({t.stage(), t.start_nanos(), t.nanos(), t.detail()});
  }
  return result;
}

absl::StatusOr<ForwardResult> Client::Forward(const ForwardArgs& args) {
  if (direct_ != nullptr) {
    router_node::CallControl control(absl::Now() + options_.timeout);
    return ForwardDirect(args, control);
  }
  absl::StatusOr<v1::ForwardRequest> request = MakeRequest(args);
  if (!request.ok()) return request.status();
  v1::ForwardResponse response;
  grpc::ClientContext context;
  SetDeadline(&context, options_.timeout);
  const grpc::Status s = stub_->Forward(&context, *request, &response);
  if (!s.ok()) return FromGrpc(s);
  return ReadResponse(*request, response);
}

absl::StatusOr<ForwardResult> Client::ForwardDirect(const ForwardArgs& args, router_node::CallControl& control) {
  absl::StatusOr<v1::ForwardRequest> request = MakeRequest(args);
  if (!request.ok()) return request.status();
  v1::ForwardResponse response;
  common::Notification finished;
  absl::Status status;
  direct_->Start(*request, control, &response, [&](absl::Status s) {
    status = std::move(s);
    finished.Notify();
  });
  finished.WaitForNotification();
  if (!status.ok()) return DirectError(status);
  return ReadResponse(*request, response);
}

absl::Status Client::DirectError(const absl::Status& status) const {
  return runtime::NameFlags(router_node::WithNodeProblems(status, direct_->service->router()->backend()),
                            kDirectFields);
}

void Client::ForwardAsync(const ForwardArgs& args, std::function<void(absl::StatusOr<ForwardResult>)> done) {
  absl::StatusOr<v1::ForwardRequest> request = MakeRequest(args);
  if (!request.ok()) {
    done(request.status());
    return;
  }
  struct Call {
    grpc::ClientContext context;
    v1::ForwardRequest request;
    v1::ForwardResponse response;
    std::function<void(absl::StatusOr<ForwardResult>)> done;
  };
  if (direct_ != nullptr) {
    struct DirectCall {
      explicit DirectCall(absl::Time deadline) : control(deadline) {}
      router_node::CallControl control;
      v1::ForwardRequest request;
      v1::ForwardResponse response;
    };
    auto call = std::make_shared<DirectCall>(absl::Now() + options_.timeout);
    call->request = std::move(*request);
    AsyncStarted();
    direct_->Start(call->request, call->control, &call->response, [this, call, done = std::move(done)](absl::Status s) {
      absl::StatusOr<ForwardResult> result = s.ok() ? ReadResponse(call->request, call->response) : DirectError(s);
      AsyncEnded();  // `this` is not touched after this
      done(std::move(result));
    });
    return;
  }
  auto* call = new Call();
  call->request = std::move(*request);
  call->done = std::move(done);
  SetDeadline(&call->context, options_.timeout);
  AsyncStarted();
  stub_->async()->Forward(&call->context, &call->request, &call->response, [this, call](grpc::Status s) {
    std::unique_ptr<Call> owned(call);
    absl::StatusOr<ForwardResult> result = s.ok() ? ReadResponse(owned->request, owned->response) : FromGrpc(s);
    AsyncEnded();  // `this` is not touched after this
    owned->done(std::move(result));
  });
}

absl::StatusOr<std::unique_ptr<Session>> Client::OpenSession() {
  if (direct_ != nullptr) return std::unique_ptr<Session>(new Session(this, nullptr, nullptr, options_.timeout));
  auto context = std::make_unique<grpc::ClientContext>();
  auto stream = stub_->ForwardStream(context.get());
  if (stream == nullptr) return absl::UnavailableError("router: cannot open ForwardStream");
  return std::unique_ptr<Session>(new Session(this, std::move(context), std::move(stream), options_.timeout));
}

absl::StatusOr<v1::GetClusterStatusResponse> Client::ClusterStatus() {
  if (direct_ != nullptr) {
    v1::GetClusterStatusResponse response;
    direct_->service->FillClusterStatus(&response, /*admin=*/true);  // the client is its own operator
    return response;
  }
  grpc::ClientContext context;
  SetDeadline(&context, options_.timeout);
  v1::GetClusterStatusResponse response;
  const grpc::Status s = stub_->GetClusterStatus(&context, v1::GetClusterStatusRequest(), &response);
  if (!s.ok()) return FromGrpc(s);
  return response;
}

Session::Session(const Client* client, std::unique_ptr<grpc::ClientContext> context,
                 std::unique_ptr<grpc::ClientReaderWriter<v1::ForwardRequest, v1::ForwardStreamResponse>> stream,
                 absl::Duration timeout)
    : client_(client), context_(std::move(context)), stream_(std::move(stream)) {
  if (context_ == nullptr) return;  // proxyless: each Forward is the client's, with its deadline
  timer_ = std::make_unique<runtime::CallTimer>(
      [this] {
        timed_out_.store(true);
        context_->TryCancel();
      },
      timeout);
}

absl::StatusOr<ForwardResult> Session::Forward(const ForwardArgs& args) {
  if (closed_) return absl::FailedPreconditionError(absl::StrCat("session closed: ", final_.ToString()));
  if (stream_ == nullptr) {  // proxyless: the client's Forward, under a control Cancel can reach
    router_node::CallControl control(absl::Now() + client_->options_.timeout);
    {
      std::lock_guard<std::mutex> lock(direct_mu_);
      if (cancelled_) return absl::CancelledError("the session was cancelled");
      direct_call_ = &control;
    }
    absl::StatusOr<ForwardResult> result = const_cast<Client*>(client_)->ForwardDirect(args, control);
    std::lock_guard<std::mutex> lock(direct_mu_);
    direct_call_ = nullptr;
    return result;
  }
  absl::StatusOr<v1::ForwardRequest> request = client_->MakeRequest(args);
  if (!request.ok()) return request.status();
  v1::ForwardStreamResponse reply;
  timer_->Start();
  const bool answered = stream_->Write(*request) && stream_->Read(&reply);
  timer_->Done();
  if (!answered) {
    const absl::Status s = Close();  // DEADLINE_EXCEEDED if the timer cancelled the stream
    return s.ok() ? absl::UnavailableError("stream ended before the reply") : s;
  }
  if (reply.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(runtime::StatusCodeFromWire(reply.code())), reply.message());
  }
  return client_->ReadResponse(*request, reply.response());
}

absl::Status Session::Close() {
  if (closed_) return final_;
  closed_ = true;
  if (stream_ == nullptr) {  // proxyless: nothing to close; a cancelled session ends CANCELLED, as a stream would
    std::lock_guard<std::mutex> lock(direct_mu_);
    if (cancelled_) final_ = absl::CancelledError("the session was cancelled (Session::Cancel)");
    return final_;
  }
  timer_->Start();  // a router that never ends the stream has it cancelled
  stream_->WritesDone();
  v1::ForwardStreamResponse unread;
  while (stream_->Read(&unread)) {
  }
  timer_->Done();
  final_ = FromGrpc(stream_->Finish());
  if (!final_.ok() && timed_out_.load()) {
    final_ = absl::DeadlineExceededError(
        "the session's stream was cancelled: no reply within the client's timeout (ClientOptions::timeout)");
  }
  return final_;
}

void Session::Cancel() {
  if (context_ != nullptr) {
    context_->TryCancel();
    return;
  }
  std::lock_guard<std::mutex> lock(direct_mu_);  // held: the control stays alive while cancelled
  cancelled_ = true;
  if (direct_call_ != nullptr) direct_call_->Cancel();
}

Session::~Session() {
  if (!closed_ && stream_ != nullptr) {
    context_->TryCancel();
    (void)Close();
  }
}

}  // namespace client
}  // namespace colibri
