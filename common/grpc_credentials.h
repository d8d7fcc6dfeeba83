#ifndef COLIBRI_COMMON_GRPC_CREDENTIALS_H_
#define COLIBRI_COMMON_GRPC_CREDENTIALS_H_

// TLS credentials from PEM files, for every Colibri server and client.
// Header-only so that only transport code (which links gRPC) includes grpcpp.
// Errors name the flag and the file; no key material is ever printed.

#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace colibri {
namespace common {

// The text of a PEM file; INVALID_ARGUMENT naming `flag` if it cannot be read
// or holds no PEM block.
inline absl::StatusOr<std::string> ReadPemFile(const std::string& path, const std::string& flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  if (text.str().find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is not a PEM file"));
  }
  return text.str();
}

// Server side: insecure (no files), TLS (cert + key), or mutual TLS (cert +
// key + client CA: only clients with a certificate signed by it get in).
// `prefix` is the flags' common prefix, e.g. "--tls" for --tls_cert.
inline absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFiles(
    const std::string& cert, const std::string& key, const std::string& client_ca, const std::string& prefix) {
  if (cert.empty() && key.empty()) {
    if (!client_ca.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, "_client_ca needs ", prefix, "_cert and ", prefix, "_key"));
    }
    return grpc::InsecureServerCredentials();
  }
  if (cert.empty() || key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("TLS needs both ", prefix, "_cert and ", prefix, "_key"));
  }
  const bool mutual = !client_ca.empty();
  grpc::SslServerCredentialsOptions ssl(mutual ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                               : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  auto cert_pem = ReadPemFile(cert, prefix + "_cert");
  if (!cert_pem.ok()) return cert_pem.status();
  auto key_pem = ReadPemFile(key, prefix + "_key");
  if (!key_pem.ok()) return key_pem.status();
  pair.cert_chain = *cert_pem;
  pair.private_key = *key_pem;
  ssl.pem_key_cert_pairs.push_back(pair);
  if (mutual) {
    auto ca_pem = ReadPemFile(client_ca, prefix + "_client_ca");
    if (!ca_pem.ok()) return ca_pem.status();
    ssl.pem_root_certs = *ca_pem;
  }
  return grpc::SslServerCredentials(ssl);
}

// Client side: insecure (no CA), TLS checking the server against `ca`, plus
// a client certificate (cert + key) for mutual TLS.
inline absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFromFiles(
    const std::string& ca, const std::string& cert, const std::string& key, const std::string& prefix) {
  if (ca.empty()) {
    if (!cert.empty() || !key.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("a client certificate needs ", prefix, "_ca as well"));
    }
    return grpc::InsecureChannelCredentials();
  }
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "_cert and ", prefix, "_key go together"));
  }
  grpc::SslCredentialsOptions ssl;
  auto ca_pem = ReadPemFile(ca, prefix + "_ca");
  if (!ca_pem.ok()) return ca_pem.status();
  ssl.pem_root_certs = *ca_pem;
  if (!cert.empty()) {
    auto cert_pem = ReadPemFile(cert, prefix + "_cert");
    if (!cert_pem.ok()) return cert_pem.status();
    auto key_pem = ReadPemFile(key, prefix + "_key");
    if (!key_pem.ok()) return key_pem.status();
    ssl.pem_cert_chain = *cert_pem;
    ssl.pem_private_key = *key_pem;
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_GRPC_CREDENTIALS_H_
