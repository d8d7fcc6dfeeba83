#ifndef COLIBRI_RUNTIME_GRPC_SERVICES_H_
#define COLIBRI_RUNTIME_GRPC_SERVICES_H_

// The standard services every Colibri server offers beside its own:
// grpc.health.v1.Health (gRPC's built-in implementation) and server
// reflection, so that standard tools (grpcurl, grpc_health_probe, the
// kubelet's gRPC probe) work without .proto files.

namespace colibri {
namespace runtime {

// Call before building a server (process-wide; idempotent). Also registers
// grpc.health.v1's descriptors in the process's descriptor pool: gRPC's own
// health service does not, and without them a reflection client asking for
// grpc.health.v1.Health gets "Symbol not found" although the service is listed.
void EnableStandardServices();

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_GRPC_SERVICES_H_
