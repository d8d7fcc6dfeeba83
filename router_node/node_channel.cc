#include "router_node/node_channel.h"

#include <utility>

#include "runtime/grpc_callback_queue.h"

namespace colibri {
namespace router_node {

GrpcNodeChannel::GrpcNodeChannel(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)), stub_(colibri::v1::ExpertNode::NewStub(channel_)) {
  runtime::KeepCallbackQueue();
}

}  // namespace router_node
}  // namespace colibri
