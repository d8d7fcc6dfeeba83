// colibri-health: one grpc.health.v1 Check against a Colibri server, with the
// same TLS files the pod serves with — the probe Kubernetes runs (exec) where
// its built-in gRPC probe cannot, because that one does not speak TLS.
// Exit status: 0 SERVING, 1 anything else (the reason on stderr), 2 usage.

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "runtime/flags.h"
#include "runtime/grpc_credentials.h"

ABSL_FLAG(std::string, target, "", "Required. host:port of the server to check.");
ABSL_FLAG(std::string, service, "", "Service name to check (empty: the server as a whole).");
ABSL_FLAG(std::string, tls_ca, "", "CA that signed the server's certificate (empty: plaintext).");
ABSL_FLAG(std::string, tls_cert, "", "Client certificate, for servers that require one (mutual TLS).");
ABSL_FLAG(std::string, tls_key, "", "Its private key.");
ABSL_FLAG(std::string, tls_server_name, "", "Name expected in the server's certificate (default: the target's host).");
ABSL_FLAG(int, timeout_ms, 2000, "Give up after this long.");

namespace {

constexpr char kUsage[] =
    "One grpc.health.v1 Check against a Colibri server (plaintext, TLS or mutual TLS).\n"
    "\n"
    "  colibri-health --target 127.0.0.1:50061 [--tls_ca ca.crt [--tls_cert tls.crt --tls_key tls.key]]\n"
    "\n"
    "Exit status: 0 SERVING, 1 not serving or unreachable (the reason on stderr), 2 usage error.";

// The TLS options as runtime::ChannelCredentialsFromFiles's errors name them, and their flags.
const colibri::runtime::OptionFlags kOptionFlags = {
    {"HealthOptions::tls_ca_file", "--tls_ca"},
    {"HealthOptions::tls_cert_file", "--tls_cert"},
    {"HealthOptions::tls_key_file", "--tls_key"},
    {"HealthOptions::tls_server_name", "--tls_server_name"},
};

}  // namespace

int main(int argc, char* argv[]) {
  const std::vector<char*> args = colibri::runtime::ParseFlags(argc, argv, kUsage);
  const std::string target = absl::GetFlag(FLAGS_target);
  if (target.empty() || args.size() > 1) {
    std::cerr << "colibri-health: give the server as --target host:port (and no other arguments)\n";
    return 2;
  }
  grpc::ChannelArguments channel_args;
  auto credentials = colibri::runtime::ChannelCredentialsFromFiles(
      absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
      absl::GetFlag(FLAGS_tls_server_name), "HealthOptions::", &channel_args);
  if (!credentials.ok()) {
    std::cerr << "colibri-health: " << colibri::runtime::NameFlags(credentials.status(), kOptionFlags).message()
              << "\n";
    return 2;
  }
  auto stub = grpc::health::v1::Health::NewStub(grpc::CreateCustomChannel(target, *credentials, channel_args));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms)));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(absl::GetFlag(FLAGS_service));
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status s = stub->Check(&context, request, &response);
  if (!s.ok()) {
    std::cerr << "colibri-health: " << target << ": " << s.error_message() << " (gRPC code " << s.error_code() << ")\n";
    return 1;
  }
  if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    std::cerr << "colibri-health: " << target << " is "
              << grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status()) << "\n";
    return 1;
  }
  std::cout << "SERVING\n";
  return 0;
}
