#ifndef COLIBRI_RUNTIME_GRPC_STATUS_H_
#define COLIBRI_RUNTIME_GRPC_STATUS_H_

// absl::Status -> grpc::Status, the one conversion every *_service.cc uses;
// a status code received as a number.
// absl's canonical codes have the same numbers as gRPC's.

#include <grpcpp/support/status.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace colibri {
namespace runtime {

// A status code a peer sent as a number (a stream reply's `code`): gRPC's
// own codes 1..16 as they are, anything else UNKNOWN (not a StatusCode).
inline grpc::StatusCode StatusCodeFromWire(int32_t code) {
  return code >= 1 && code <= 16 ? static_cast<grpc::StatusCode>(code) : grpc::StatusCode::UNKNOWN;
}

inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_GRPC_STATUS_H_
