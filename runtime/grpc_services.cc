#include "runtime/grpc_services.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>

#include "absl/strings/str_cat.h"
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

void SetServing(grpc::HealthCheckServiceInterface* health, const std::string& service, bool serving) {
  health->SetServingStatus(service, serving);
  health->SetServingStatus("", serving);
}

absl::Status ValidateKeepalive(const Keepalive& keepalive, const std::string& prefix) {
  if (keepalive.interval < kMinPingInterval || keepalive.interval > std::chrono::hours(24)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "keepalive.interval ", keepalive.interval.count(),
                                                   " ms is outside [", kMinPingInterval.count(), " ms, 24 h]"));
  }
  if (keepalive.timeout < kMinPingInterval || keepalive.timeout > std::chrono::hours(24)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "keepalive.timeout ", keepalive.timeout.count(),
                                                   " ms is outside [", kMinPingInterval.count(), " ms, 24 h]"));
  }
  return absl::OkStatus();
}

namespace {

// The keepalive arguments servers and channels share.
template <typename SetInt>
void SetKeepalive(const Keepalive& keepalive, SetInt set) {
  set(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(keepalive.interval.count()));
  set(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, static_cast<int>(keepalive.timeout.count()));
  set(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  set(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);  // an idle connection keeps being pinged
}

}  // namespace

void ApplyServerPolicy(grpc::ServerBuilder& builder, const Keepalive& keepalive) {
  grpc::ResourceQuota quota("colibri-sync-handlers");
  quota.SetMaxThreads(kMaxSyncServerThreads);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             static_cast<int>(kMinPingInterval.count()));
  SetKeepalive(keepalive, [&](const char* name, int value) { builder.AddChannelArgument(name, value); });
}

void ApplyChannelKeepalive(grpc::ChannelArguments* args, const Keepalive& keepalive) {
  SetKeepalive(keepalive, [&](const char* name, int value) { args->SetInt(name, value); });
}

void ApplyChannelReconnect(grpc::ChannelArguments* args) {
  args->SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args->SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args->SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, static_cast<int>(kConnectTimeout.count()));
}

}  // namespace runtime
}  // namespace colibri
