// Mutual TLS end to end, with real processes: an expert node and a router,
// both requiring client certificates signed by the test CA. A client with
// such a certificate is served; a client without one, with one from another
// CA, or in plaintext is refused; a router without its client certificate
// cannot use the node. Certificates come from scripts/make_test_certs.sh.

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "colibri/v1/router.grpc.pb.h"
#include "tests/test_util.h"

namespace colibri {
namespace {

using colibri::testing::Binary;
using colibri::testing::ProcessGuard;
using colibri::testing::TempDir;
namespace v1 = colibri::v1;

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void MakeCerts(const std::string& dir) {
  const std::string command = "bash " + std::string(COLIBRI_SOURCE_DIR) + "/scripts/make_test_certs.sh " + dir;
  REQUIRE(std::system(command.c_str()) == 0);
}

// A GetModelInfo call with the given credentials; the status.
grpc::Status Call(int port, std::shared_ptr<grpc::ChannelCredentials> credentials) {
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride("localhost");
  auto stub = v1::Router::NewStub(grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port), credentials, args));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::GetModelInfoResponse info;
  return stub->GetModelInfo(&context, v1::GetModelInfoRequest(), &info);
}

std::shared_ptr<grpc::ChannelCredentials> Tls(const std::string& ca, const std::string& cert, const std::string& key) {
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = Read(ca);
  if (!cert.empty()) {
    o.pem_cert_chain = Read(cert);
    o.pem_private_key = Read(key);
  }
  return grpc::SslCredentials(o);
}

TEST_CASE("mutual TLS: only clients with a CA-signed certificate reach the router, and the router the node") {
  TempDir dir;
  MakeCerts(dir / "certs");
  MakeCerts(dir / "rogue");  // another CA, same names
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  const std::string c = dir / "certs";
  ProcessGuard node({Binary("expert_node/colibri-expert"), "--model=" + (dir / "model"), "--listen=127.0.0.1:0",
                     "--residency=paged", "--threads=1", "--tls_cert=" + c + "/server.crt",
                     "--tls_key=" + c + "/server.key", "--tls_client_ca=" + c + "/ca.crt"});
  const int node_port = node.ReadPort();
  auto router_args = [&](bool with_client_cert) {
    std::vector<std::string> a = {Binary("router_node/colibri-router"),
                                  "--model=" + (dir / "model"),
                                  "--experts_at=127.0.0.1:" + std::to_string(node_port),
                                  "--listen=127.0.0.1:0",
                                  "--tls_cert=" + c + "/server.crt",
                                  "--tls_key=" + c + "/server.key",
                                  "--tls_client_ca=" + c + "/ca.crt",
                                  "--node_tls_ca=" + c + "/ca.crt",
                                  "--node_tls_server_name=localhost",
                                  "--health_interval_ms=100"};
    if (with_client_cert) {
      a.push_back("--node_tls_cert=" + c + "/client.crt");
      a.push_back("--node_tls_key=" + c + "/client.key");
    }
    return a;
  };
  ProcessGuard router(router_args(true));
  const int port = router.ReadPort();

  const grpc::Status good = Call(port, Tls(c + "/ca.crt", c + "/client.crt", c + "/client.key"));
  INFO(good.error_message());
  CHECK(good.ok());
  const grpc::Status no_cert = Call(port, Tls(c + "/ca.crt", "", ""));
  const std::string r = dir / "rogue";
  const grpc::Status rogue = Call(port, Tls(c + "/ca.crt", r + "/client.crt", r + "/client.key"));
  const grpc::Status plain = Call(port, grpc::InsecureChannelCredentials());
  CHECK(no_cert.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(rogue.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(plain.error_code() == grpc::StatusCode::UNAVAILABLE);

  // The router reached the node through mutual TLS: a Forward works.
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride("localhost");
  auto stub = v1::Router::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(port), Tls(c + "/ca.crt", c + "/client.crt", c + "/client.key"), args));
  v1::ForwardRequest request;
  request.set_layer(0);
  request.add_token_ids(3);
  request.mutable_hidden()->set_dtype(v1::DATA_TYPE_F32);
  request.mutable_hidden()->add_shape(1);
  request.mutable_hidden()->add_shape(48);
  request.mutable_hidden()->set_data(std::string(48 * 4, '\0'));
  v1::ForwardResponse response;
  grpc::Status forward;
  for (int i = 0; i < 100; ++i) {  // the router's first health check may still be running
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    forward = stub->Forward(&context, request, &response);
    if (forward.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  INFO(forward.error_message());
  CHECK(forward.ok());

  // A router without the client certificate cannot use the node.
  ProcessGuard bare(router_args(false));
  const int bare_port = bare.ReadPort();
  auto bare_stub = v1::Router::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(bare_port), Tls(c + "/ca.crt", c + "/client.crt", c + "/client.key"), args));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  const grpc::Status refused = bare_stub->Forward(&context, request, &response);
  INFO(refused.error_message());
  CHECK(refused.error_code() == grpc::StatusCode::UNAVAILABLE);
  std::printf(
      "mutual TLS: CA-signed client ok; no certificate: %d, other CA: %d, plaintext: %d; "
      "router without client certificate: %d (%s)\n",
      static_cast<int>(no_cert.error_code()), static_cast<int>(rogue.error_code()),
      static_cast<int>(plain.error_code()), static_cast<int>(refused.error_code()), refused.error_message().c_str());
}

}  // namespace
}  // namespace colibri
