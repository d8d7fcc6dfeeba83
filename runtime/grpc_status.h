#ifndef COLIBRI_RUNTIME_GRPC_STATUS_H_
#define COLIBRI_RUNTIME_GRPC_STATUS_H_

// absl::Status -> grpc::Status, the one conversion every *_service.cc uses.
// absl's canonical codes have the same numbers as gRPC's.

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"

namespace colibri {
namespace runtime {

inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_GRPC_STATUS_H_
