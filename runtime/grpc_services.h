#ifndef COLIBRI_RUNTIME_GRPC_SERVICES_H_
#define COLIBRI_RUNTIME_GRPC_SERVICES_H_

// The standard services every Colibri server offers beside its own:
// grpc.health.v1.Health (gRPC's built-in implementation) and server
// reflection, so that standard tools (grpcurl, grpc_health_probe, the
// kubelet's gRPC probe) work without .proto files.

#include <grpcpp/server_builder.h>

namespace colibri {
namespace runtime {

// Call before building a server (process-wide; idempotent). Also registers
// grpc.health.v1's descriptors in the process's descriptor pool: gRPC's own
// health service does not, and without them a reflection client asking for
// grpc.health.v1.Health gets "Symbol not found" although the service is listed.
void EnableStandardServices();

// The threads a server may run synchronous handlers on. Reflection (and
// any other synchronous service) holds one thread per open stream; without a
// cap a peer opening streams makes the process start threads until thread
// creation fails, which ends it. At the cap a new call is refused at once
// with RESOURCE_EXHAUSTED ("Server Threadpool Exhausted"); Colibri's own
// services run on the callback API and are not counted.
inline constexpr int kMaxSyncServerThreads = 64;

// Applies kMaxSyncServerThreads to `builder` (a ResourceQuota of its own).
void LimitSyncThreads(grpc::ServerBuilder& builder);

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_GRPC_SERVICES_H_
