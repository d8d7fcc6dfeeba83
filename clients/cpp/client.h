#ifndef COLIBRI_CLIENTS_CPP_CLIENT_H_
#define COLIBRI_CLIENTS_CPP_CLIENT_H_

// colibri::client — the C++ client of the Router service, for LLM servers
// that call Colibri for every MoE layer of every token.
//
//   auto client = colibri::client::Client::Connect({"127.0.0.1:50051"});
//   colibri::client::ForwardArgs args;
//   args.layer = 0;
//   args.token_ids = {42};
//   args.hidden = hidden;                       // [T * d_model] f32
//   absl::StatusOr<ForwardResult> r = (*client)->Forward(args);
//   // r->output: [T * d_model] f32, whatever dtype travelled
//
// For a decoding loop, a Session keeps one ForwardStream open and sends
// every layer's call on it (no per-call set-up).
//
// Proxyless: with ClientOptions::direct instead of a target, the client runs
// the router's core itself — routes, plan, calls to the expert nodes, the
// sum — with the router's health checks, failover, hedging and node-reply
// modes: one network hop per layer instead of two. It reads the model's
// gates and LUTs from direct.model_dir (the directory the nodes serve), and
// switches versions with LoadModel. Errors are absl::Status with
// the server's code and message ("token_ids[1] = 64 is outside [0, 64)"),
// or UNAVAILABLE / DEADLINE_EXCEEDED from the transport.
// Client is thread-safe; a Session is used by one thread at a time.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "colibri/v1/router.grpc.pb.h"

namespace colibri {
namespace router_node {
class CallControl;
}  // namespace router_node
namespace runtime {
class CallTimer;
}  // namespace runtime
namespace client {

struct ClientOptions {
  std::string target;                                  // host:port of the router (any gRPC target)
  absl::Duration timeout = absl::Seconds(30);          // deadline of each unary call, and of each
                                                       // Session Forward and Close
  absl::Duration connect_timeout = absl::Seconds(10);  // deadline of Connect's GetModelInfo
  // TLS: a CA (PEM file) turns it on; cert + key add a client certificate
  // (mutual TLS); server_name overrides the name checked in the router's
  // certificate.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;
  int64_t max_message_bytes = int64_t{1} << 30;

  // Proxyless mode (leave `target` empty): the model directory and the nodes,
  // as colibri-router's --model, --experts_at / --cluster_file and node flags.
  struct Direct {
    std::string model_dir;
    std::vector<std::string> nodes;  // host:port of each expert node
    std::string cluster_file;        // or: one host:port per line, re-read on change
    absl::Duration node_timeout = absl::Seconds(5);
    absl::Duration hedge_after = absl::ZeroDuration();  // 0: no hedging
    int64_t node_stream_max_bytes = 0;                  // as --node_stream_max_bytes (0: unary calls only)
    std::string node_replies = "exact";                 // exact, partial or per_expert
    int64_t max_tokens = 65536;
    // Concurrent Forward calls of one layer from this client's threads are
    // merged, as colibri-router's --batch_window_us / --batch_max_tokens
    // (0: off).
    absl::Duration batch_window = absl::Milliseconds(5);
    int64_t batch_max_tokens = 256;
    std::string node_tls_ca_file;  // TLS to the nodes, as --node_tls_*
    std::string node_tls_cert_file;
    std::string node_tls_key_file;
    std::string node_tls_server_name;
  };
  Direct direct;
};

enum class Routing { kLut, kGate, kClient };
enum class WireType { kF32, kBF16 };  // how hidden states / outputs travel

struct Routes {
  int32_t top_k = 0;
  std::vector<int32_t> expert_ids;  // [T * top_k]
  std::vector<float> weights;       // [T * top_k]
};

struct Timing {
  std::string stage;  // route, dispatch, aggregate, total, node:ADDR, node_compute:ADDR
  int64_t start_nanos = 0;
  int64_t nanos = 0;
  std::string detail;  // node calls: "experts 0,3 rows 5"
};

struct ForwardArgs {
  int32_t layer = 0;
  std::vector<int32_t> token_ids;     // one per token; needed for lut routing
  absl::Span<const float> hidden;     // [T * d_model] f32; T = hidden.size() / d_model
  WireType send_as = WireType::kF32;  // kBF16 halves the request (rounds the inputs)
  Routing routing = Routing::kLut;
  Routes routes;                     // kClient only
  WireType output = WireType::kF32;  // kBF16 halves the reply (rounds the output)
  std::string request_id;
  bool return_routes = false;
  bool return_timings = false;
};

struct ForwardResult {
  std::vector<float> output;    // [T * d_model]
  Routes routes;                // when return_routes
  std::vector<Timing> timings;  // when return_timings
};

class Session;

class Client {
 public:
  // Opens a channel and asks the router for its model (GetModelInfo), so a
  // wrong address fails here: UNAVAILABLE / DEADLINE_EXCEEDED naming the
  // target; INVALID_ARGUMENT for unreadable TLS files. Proxyless: loads the
  // model's routing and checks the nodes once (nodes that are down are
  // retried in the background); INVALID_ARGUMENT for both or neither of
  // target and direct.model_dir, errors of the model or the node list.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();

  bool proxyless() const { return direct_ != nullptr; }
  // One layer, synchronously, with the options' timeout.
  absl::StatusOr<ForwardResult> Forward(const ForwardArgs& args);
  // The same without blocking: `done` runs once (keep it short) on a gRPC
  // or batching thread, or on this thread for a request refused at once —
  // proxyless, also on the thread of another caller of the same layer whose
  // call sent a merged call that failed at once (do not hold a lock `done`
  // takes while calling Forward or ForwardAsync).
  // `args.hidden` is copied before this returns. The client may be destroyed
  // with calls in flight: ~Client waits until each has its result (its
  // `done` then runs on, the client no longer touched). Do not destroy the
  // client inside a `done`: other calls' `done`s may be queued behind it on
  // that thread, and ~Client would wait for them forever.
  void ForwardAsync(const ForwardArgs& args, std::function<void(absl::StatusOr<ForwardResult>)> done);
  // A ForwardStream for a decoding loop. The stream has no deadline of its
  // own; each of its Forward calls (and its Close) is bounded by the
  // options' timeout, past which the stream is cancelled (see Session). A
  // broken stream fails its next Forward. The client must outlive the
  // session's Forward calls (destroying a session after its client is fine).
  absl::StatusOr<std::unique_ptr<Session>> OpenSession();

  // The model at Connect. LoadModel keeps its shape; model_id is Connect's.
  const colibri::v1::GetModelInfoResponse& model() const { return model_; }

  // Proxyless only: switches to the model version in `model_dir` (same
  // shape, another model_id), as colibri-router's LoadModel does. It waits,
  // up to `timeout`, until every expert has a live node serving the new
  // version: stage it on the nodes first (colibri-admin stage: they serve
  // both), switch the clients, then drop the old one. A request is answered
  // entirely by the version it started on; later ones by the new version.
  // Then it waits, up to `timeout` again, for calls still running on the old
  // version, which it releases. Returns the model_id now served (unchanged
  // if `model_dir` holds the current one). FAILED_PRECONDITION for a router
  // client or a change of shape; UNAVAILABLE naming the first expert without
  // a live node, and the old version serves on; errors of the model
  // directory.
  absl::StatusOr<std::string> LoadModel(const std::string& model_dir, absl::Duration timeout = absl::Seconds(30));
  absl::StatusOr<colibri::v1::GetClusterStatusResponse> ClusterStatus();

  // The request Forward sends (for callers that keep their own stubs).
  absl::StatusOr<colibri::v1::ForwardRequest> MakeRequest(const ForwardArgs& args) const;
  // The reply to `request` as a result (INTERNAL if it does not match the
  // request's token count, the model's d_model or, when routes were asked
  // for, T × top_k routes).
  absl::StatusOr<ForwardResult> ReadResponse(const colibri::v1::ForwardRequest& request,
                                             const colibri::v1::ForwardResponse& response) const;

 private:
  struct Direct;  // proxyless: the router's core in this process
  Client(ClientOptions options, std::unique_ptr<colibri::v1::Router::Stub> stub);
  static absl::StatusOr<std::unique_ptr<Client>> ConnectDirect(const ClientOptions& options);

  friend class Session;
  // Proxyless: one Forward through the router's core, under `control`.
  absl::StatusOr<ForwardResult> ForwardDirect(const ForwardArgs& args, router_node::CallControl& control);
  // A proxyless call's error as this client's caller (its own operator)
  // should read it: options named as it set them, nodes not live by address and why.
  absl::Status DirectError(const absl::Status& status) const;
  // ForwardAsync calls between their start and their result; ~Client waits for none.
  void AsyncStarted();
  void AsyncEnded();

  const ClientOptions options_;
  std::mutex async_mu_;
  std::condition_variable async_cv_;
  int64_t async_in_flight_ = 0;                      // guarded by async_mu_
  std::unique_ptr<colibri::v1::Router::Stub> stub_;  // null when proxyless
  std::unique_ptr<Direct> direct_;                   // null unless proxyless
  colibri::v1::GetModelInfoResponse model_;          // constant after Connect
};

class Session {
 public:
  ~Session();  // half-closes and finishes the stream

  // Sends one request and reads its reply (in order). A request the router
  // refused returns its status; the stream stays usable. A broken stream
  // returns its final status and every later call fails. No reply within
  // ClientOptions::timeout: the stream is cancelled (a stream's replies come
  // in order, so the others cannot be had either) and this call returns
  // DEADLINE_EXCEEDED; open a new session. (Proxyless: each Forward is the
  // client's Forward.)
  absl::StatusOr<ForwardResult> Forward(const ForwardArgs& args);
  // Half-closes and returns the stream's final status, waiting at most
  // ClientOptions::timeout for the router to end it. Idempotent.
  absl::Status Close();
  // Cancels the stream: a Forward or Close blocked on another thread returns
  // CANCELLED, and the session is broken. Thread-safe, unlike the others.
  // (Proxyless: the Forward in progress returns CANCELLED, and so does every
  // later one.)
  void Cancel();

 private:
  friend class Client;
  // Proxyless: context and stream null.
  Session(
      const Client* client, std::unique_ptr<grpc::ClientContext> context,
      std::unique_ptr<grpc::ClientReaderWriter<colibri::v1::ForwardRequest, colibri::v1::ForwardStreamResponse>> stream,
      absl::Duration timeout);

  const Client* client_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<colibri::v1::ForwardRequest, colibri::v1::ForwardStreamResponse>> stream_;
  std::atomic<bool> timed_out_{false};         // set by timer_'s callback
  std::unique_ptr<runtime::CallTimer> timer_;  // destroyed first: it calls back into context_ and timed_out_
  bool closed_ = false;
  absl::Status final_;
  // Proxyless: the Forward in progress, for Cancel.
  std::mutex direct_mu_;
  router_node::CallControl* direct_call_ = nullptr;  // guarded by direct_mu_
  bool cancelled_ = false;                           // guarded by direct_mu_
};

}  // namespace client
}  // namespace colibri

#endif  // COLIBRI_CLIENTS_CPP_CLIENT_H_
