#ifndef COLIBRI_ROUTER_NODE_NODE_STREAM_H_
#define COLIBRI_ROUTER_NODE_NODE_STREAM_H_

// A NodeChannel that keeps one ExpertNode.ComputeStream open to its node and
// sends each small Compute call as a message on it: on an open stream a call
// costs one message each way, not a new HTTP/2 stream with its headers and
// trailers (docs/PERFORMANCE.md measures the difference). Calls whose request
// is larger than `max_stream_bytes` — bandwidth-bound, and not to queue
// behind each other on one stream — and GetNodeInfo are unary calls.
//
// The stream is opened by the first call and again by the first call after
// it ended. A call's deadline (its context's) is kept here: when it passes,
// the call ends DEADLINE_EXCEEDED and the node is told to drop it; Cancel
// ends it CANCELLED and tells the node likewise. When the stream breaks
// (the node died or restarted), its calls without an answer end UNAVAILABLE,
// for the caller to retry. A node that does not serve ComputeStream
// (UNIMPLEMENTED: an older build) gets that stream's calls again as unary
// calls, and every later one. A reply that cannot be parsed ends the
// stream (cancelled 200 ms after the failed read, unless it ended by
// then) and its calls UNAVAILABLE. Thread-safe.

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>

#include "router_node/node_channel.h"

namespace colibri {
namespace router_node {

class StreamNodeChannel final : public NodeChannel {
 public:
  StreamNodeChannel(std::shared_ptr<grpc::Channel> channel, int64_t max_stream_bytes);
  // Cancels the stream; calls still on it end UNAVAILABLE (on gRPC's thread,
  // possibly after this returns).
  ~StreamNodeChannel() override;

  void Compute(grpc::ClientContext* context, const colibri::v1::ComputeRequest* request,
               colibri::v1::ComputeResponse* response, Done done) override;
  void GetNodeInfo(grpc::ClientContext* context, const colibri::v1::GetNodeInfoRequest* request,
                   colibri::v1::GetNodeInfoResponse* response, Done done) override;
  // For a call on the stream: ends it CANCELLED now. Otherwise as
  // GrpcNodeChannel (a unary call, or an unknown or ended one: harmless).
  void Cancel(grpc::ClientContext* context) override;
  void ResetBackoff() override;

  struct State;  // shared with the streams, which may outlive the channel
  class Stream;  // one ComputeStream

 private:
  std::shared_ptr<State> state_;
};

}  // namespace router_node
}  // namespace colibri

#endif  // COLIBRI_ROUTER_NODE_NODE_STREAM_H_
