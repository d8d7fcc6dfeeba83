// The ping policy of Colibri's servers (runtime::ApplyServerPolicy) accepts
// the keepalive pings of Colibri's channels (runtime::ApplyChannelKeepalive)
// on a connection with no call open. gRPC's default server policy takes a
// ping more often than every 5 minutes without data as a strike and closes
// the connection (GOAWAY "too_many_pings") after the third: every idle
// channel between Colibri's processes would be dropped and reconnected over
// and over. Here the channel pings every second for 8 s, against a server
// with the policy (kept) and, to show that the check can fail, one without
// (dropped after ~4 s).

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <memory>
#include <string>

#include "runtime/grpc_services.h"

namespace colibri {
namespace runtime {
namespace {

// Whether an idle channel pinging every second lost its connection within 8 s.
bool IdleChannelDropped(bool server_policy) {
  grpc::EnableDefaultHealthCheckService(true);  // a service to serve
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  if (server_policy) ApplyServerPolicy(builder, Keepalive{std::chrono::seconds(30), std::chrono::seconds(20)});
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  REQUIRE(server != nullptr);
  grpc::ChannelArguments args;
  ApplyChannelKeepalive(&args, Keepalive{std::chrono::seconds(1), std::chrono::seconds(5)});
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args);
  REQUIRE(channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)));
  const bool changed =
      channel->WaitForStateChange(GRPC_CHANNEL_READY, std::chrono::system_clock::now() + std::chrono::seconds(8));
  server->Shutdown(std::chrono::system_clock::now());
  return changed;
}

TEST_CASE("keepalive: servers keep an idle channel that pings every second, gRPC's default policy does not") {
  CHECK_FALSE(IdleChannelDropped(/*server_policy=*/true));
  CHECK(IdleChannelDropped(/*server_policy=*/false));
}

}  // namespace
}  // namespace runtime
}  // namespace colibri
