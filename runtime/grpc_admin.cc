#include "runtime/grpc_admin.h"

#include <grpc/grpc_security_constants.h>
#include <grpcpp/security/auth_context.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "runtime/grpc_services.h"

namespace colibri {
namespace runtime {

bool PeerIsNamed(const grpc::CallbackServerContext& context, const std::vector<std::string>& identities) {
  if (identities.empty()) return false;
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return false;
  for (const char* property : {GRPC_X509_SAN_PROPERTY_NAME, GRPC_X509_CN_PROPERTY_NAME}) {
    for (const grpc::string_ref& value : auth->FindPropertyValues(property)) {
      if (std::find(identities.begin(), identities.end(), std::string(value.data(), value.size())) !=
          identities.end()) {
        return true;
      }
    }
  }
  return false;
}

absl::Status CheckAdminIdentities(const std::vector<std::string>& identities, const std::string& client_ca,
                                  const std::string& prefix) {
  if (identities.empty() || !client_ca.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(prefix, "admin_identities needs mutual TLS (", prefix,
                                                 "tls_client_ca_file): without client certificates no caller has "
                                                 "an identity"));
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartAdminServer(const std::string& listen,
                                                               std::shared_ptr<grpc::ServerCredentials> credentials,
                                                               grpc::Service* service, int* port,
                                                               const std::string& prefix, const Keepalive& keepalive) {
  grpc::ServerBuilder builder;
  ApplyServerPolicy(builder, keepalive);
  builder.AddListeningPort(listen, std::move(credentials), port);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", listen, " (", prefix, "admin_listen)"));
  }
  return server;
}

}  // namespace runtime
}  // namespace colibri
