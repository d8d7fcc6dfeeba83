#include "router_node/node_channel.h"

#include <utility>

#include "runtime/grpc_callback_queue.h"

namespace colibri {
namespace router_node {

GrpcNodeChannel::GrpcNodeChannel(std::shared_ptr<grpc::Channel> channel)
    : stub_(colibri::v1::ExpertNode::NewStub(std::move(channel))) {
  runtime::KeepCallbackQueue();
}

}  // namespace router_node
}  // namespace colibri
