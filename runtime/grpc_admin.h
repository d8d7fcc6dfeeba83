#ifndef COLIBRI_RUNTIME_GRPC_ADMIN_H_
#define COLIBRI_RUNTIME_GRPC_ADMIN_H_

// Who may make a server's admin calls (an expert node's Reload, the full
// GetNodeInfo / GetClusterStatus): callers on the server's admin listener — a
// second gRPC server, on loopback or an address the operator guards — and, on
// the data port, mutual-TLS peers whose certificate names an admin identity.
// Thread-safe (pure functions).

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/grpc_services.h"

namespace colibri {
namespace runtime {

// True if the call's peer presented a certificate (mutual TLS) whose subject
// alternative names or common name include one of `identities`.
bool PeerIsNamed(const grpc::CallbackServerContext& context, const std::vector<std::string>& identities);

// INVALID_ARGUMENT naming `prefix`admin_identities if identities are given
// without a client CA: without client certificates no caller has an identity.
absl::Status CheckAdminIdentities(const std::vector<std::string>& identities, const std::string& client_ca,
                                  const std::string& prefix);

// Starts the admin listener: `service` on `listen` with `credentials` (the
// data port's: TLS stays on if it is on there). Sets *port; UNAVAILABLE
// naming `prefix`admin_listen if it cannot listen. `service` must outlive it.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartAdminServer(const std::string& listen,
                                                               std::shared_ptr<grpc::ServerCredentials> credentials,
                                                               grpc::Service* service, int* port,
                                                               const std::string& prefix, const Keepalive& keepalive);

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_GRPC_ADMIN_H_
