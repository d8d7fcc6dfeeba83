#ifndef COLIBRI_RUNTIME_GRPC_CREDENTIALS_H_
#define COLIBRI_RUNTIME_GRPC_CREDENTIALS_H_

// TLS credentials from PEM files, for every Colibri server and client.
// The files come from an options struct with the fields tls_cert_file,
// tls_key_file, tls_client_ca_file (servers) or tls_ca_file, tls_cert_file,
// tls_key_file, tls_server_name (clients); `prefix` is that struct's name
// with "::", e.g.
// "ServerOptions::", and errors name the field and the file. No key material
// is ever printed. Thread-safe (pure functions).

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace colibri {
namespace runtime {

// The text of a PEM file; INVALID_ARGUMENT naming `option` if it cannot be
// read or holds no PEM block.
absl::StatusOr<std::string> ReadPemFile(const std::string& path, const std::string& option);

// Server side: insecure (no files), TLS (cert + key), or mutual TLS (cert +
// key + client CA: only clients with a certificate signed by it get in).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFiles(const std::string& cert,
                                                                                    const std::string& key,
                                                                                    const std::string& client_ca,
                                                                                    const std::string& prefix);

// Client side: insecure (no CA), TLS checking the server against `ca`, plus
// a client certificate (cert + key) for mutual TLS. A `server_name` (the name
// checked in the server's certificate instead of the target's host) is set on
// *args; without a CA it is refused, as is a certificate: the connection would
// not be TLS, and a caller who named a certificate expects it to be.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFromFiles(
    const std::string& ca, const std::string& cert, const std::string& key, const std::string& server_name,
    const std::string& prefix, grpc::ChannelArguments* args);

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_GRPC_CREDENTIALS_H_
