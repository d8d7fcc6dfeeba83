#include "runtime/grpc_credentials.h"

#include "absl/strings/str_cat.h"
#include "common/small_file.h"

namespace colibri {
namespace runtime {

absl::StatusOr<std::string> ReadPemFile(const std::string& path, const std::string& option) {
  absl::StatusOr<std::string> text = common::ReadSmallFile(path);
  if (!text.ok()) return absl::InvalidArgumentError(absl::StrCat(option, ": cannot read ", text.status().message()));
  if (text->find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(option, ": ", path, " is not a PEM file"));
  }
  return text;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFiles(const std::string& cert,
                                                                                    const std::string& key,
                                                                                    const std::string& client_ca,
                                                                                    const std::string& prefix) {
  if (cert.empty() && key.empty()) {
    if (!client_ca.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, "tls_client_ca_file needs ", prefix, "tls_cert_file and ", prefix, "tls_key_file"));
    }
    return grpc::InsecureServerCredentials();
  }
  if (cert.empty() || key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS needs both ", prefix, "tls_cert_file and ", prefix, "tls_key_file"));
  }
  const bool mutual = !client_ca.empty();
  grpc::SslServerCredentialsOptions ssl(mutual ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                               : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  auto cert_pem = ReadPemFile(cert, prefix + "tls_cert_file");
  if (!cert_pem.ok()) return cert_pem.status();
  auto key_pem = ReadPemFile(key, prefix + "tls_key_file");
  if (!key_pem.ok()) return key_pem.status();
  pair.cert_chain = *cert_pem;
  pair.private_key = *key_pem;
  ssl.pem_key_cert_pairs.push_back(pair);
  if (mutual) {
    auto ca_pem = ReadPemFile(client_ca, prefix + "tls_client_ca_file");
    if (!ca_pem.ok()) return ca_pem.status();
    ssl.pem_root_certs = *ca_pem;
  }
  return grpc::SslServerCredentials(ssl);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFromFiles(
    const std::string& ca, const std::string& cert, const std::string& key, const std::string& server_name,
    const std::string& prefix, grpc::ChannelArguments* args) {
  if (ca.empty()) {
    if (!cert.empty() || !key.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("a client certificate needs ", prefix, "tls_ca_file as well"));
    }
    if (!server_name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, "tls_server_name needs ", prefix,
                                                     "tls_ca_file as well (without a CA the connection is not TLS)"));
    }
    return grpc::InsecureChannelCredentials();
  }
  if (!server_name.empty()) args->SetSslTargetNameOverride(server_name);
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "tls_cert_file and ", prefix, "tls_key_file go together"));
  }
  grpc::SslCredentialsOptions ssl;
  auto ca_pem = ReadPemFile(ca, prefix + "tls_ca_file");
  if (!ca_pem.ok()) return ca_pem.status();
  ssl.pem_root_certs = *ca_pem;
  if (!cert.empty()) {
    auto cert_pem = ReadPemFile(cert, prefix + "tls_cert_file");
    if (!cert_pem.ok()) return cert_pem.status();
    auto key_pem = ReadPemFile(key, prefix + "tls_key_file");
    if (!key_pem.ok()) return key_pem.status();
    ssl.pem_cert_chain = *cert_pem;
    ssl.pem_private_key = *key_pem;
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace runtime
}  // namespace colibri
