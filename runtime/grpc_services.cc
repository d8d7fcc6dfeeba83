#include "runtime/grpc_services.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>

#include "grpc/health/v1/health.pb.h"

namespace colibri {
namespace runtime {

void EnableStandardServices() {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // Touching the generated descriptor links health.pb.cc in and registers
  // its file with the generated pool, which the reflection service reads.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
}

void ApplyServerPolicy(grpc::ServerBuilder& builder) {
  grpc::ResourceQuota quota("colibri-sync-handlers");
  quota.SetMaxThreads(kMaxSyncServerThreads);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             static_cast<int>(kMinPingInterval.count()));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
}

void ApplyChannelKeepalive(grpc::ChannelArguments* args, std::chrono::milliseconds time,
                           std::chrono::milliseconds timeout) {
  args->SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(time.count()));
  args->SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, static_cast<int>(timeout.count()));
  args->SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args->SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);  // an idle channel keeps pinging
}

}  // namespace runtime
}  // namespace colibri
