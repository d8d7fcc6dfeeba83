#ifndef COLIBRI_ROUTER_NODE_NODE_CHANNEL_H_
#define COLIBRI_ROUTER_NODE_NODE_CHANNEL_H_

// How the router's remote backend reaches one expert node: the node's two
// calls, started asynchronously, and cancellation. Production uses the gRPC
// stub (GrpcNodeChannel); tests substitute scripted fake nodes
// (tests/router_node/fake_node.h) to drive retries, hedging and deadlines
// in one process without sleeping.

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>

#include "colibri/v1/expert_node.grpc.pb.h"

namespace colibri {
namespace router_node {

class NodeChannel {
 public:
  using Done = std::function<void(grpc::Status)>;
  virtual ~NodeChannel() = default;

  // Start the call; `done` runs exactly once when it has ended, on any
  // thread, possibly before the call returns. `context` carries the deadline;
  // it, the request and the response live until `done` has run.
  virtual void Compute(grpc::ClientContext* context, const colibri::v1::ComputeRequest* request,
                       colibri::v1::ComputeResponse* response, Done done) = 0;
  virtual void GetNodeInfo(grpc::ClientContext* context, const colibri::v1::GetNodeInfoRequest* request,
                           colibri::v1::GetNodeInfoResponse* response, Done done) = 0;
  // Ends a call started with `context` early (its `done` gets CANCELLED, or
  // its own result if it had one already). Harmless for an ended call and
  // for an unknown context (the caller does not cancel calls not started).
  virtual void Cancel(grpc::ClientContext* context) = 0;
  // A channel that lost its node waits before it connects again (gRPC's
  // reconnect backoff, up to a second here): from this call on it connects
  // at once, so that a probe of a node that came back finds it.
  virtual void ResetBackoff() {}
};

// Makes the channel to one node, from its "host:port".
using NodeConnector = std::function<std::unique_ptr<NodeChannel>(const std::string& address)>;

// NodeChannel over gRPC's callback API. Its owner may be dropped inside one
// of its calls' callbacks (a client destroyed while a reply is delivered, a
// stream's last holder), so it keeps gRPC's callback queue alive for the
// process (runtime/grpc_callback_queue.h).
class GrpcNodeChannel final : public NodeChannel {
 public:
  explicit GrpcNodeChannel(std::shared_ptr<grpc::Channel> channel);
  void Compute(grpc::ClientContext* context, const colibri::v1::ComputeRequest* request,
               colibri::v1::ComputeResponse* response, Done done) override {
    stub_->async()->Compute(context, request, response, std::move(done));
  }
  void GetNodeInfo(grpc::ClientContext* context, const colibri::v1::GetNodeInfoRequest* request,
                   colibri::v1::GetNodeInfoResponse* response, Done done) override {
    stub_->async()->GetNodeInfo(context, request, response, std::move(done));
  }
  void Cancel(grpc::ClientContext* context) override { context->TryCancel(); }
  void ResetBackoff() override { grpc::experimental::ChannelResetConnectionBackoff(channel_.get()); }

 private:
  const std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<colibri::v1::ExpertNode::Stub> stub_;
};

}  // namespace router_node
}  // namespace colibri

#endif  // COLIBRI_ROUTER_NODE_NODE_CHANNEL_H_
