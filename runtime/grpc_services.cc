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

void LimitSyncThreads(grpc::ServerBuilder& builder) {
  grpc::ResourceQuota quota("colibri-sync-handlers");
  quota.SetMaxThreads(kMaxSyncServerThreads);
  builder.SetResourceQuota(quota);
}

}  // namespace runtime
}  // namespace colibri
