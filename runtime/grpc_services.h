#ifndef COLIBRI_RUNTIME_GRPC_SERVICES_H_
#define COLIBRI_RUNTIME_GRPC_SERVICES_H_

// The standard services every Colibri server offers beside its own:
// grpc.health.v1.Health (gRPC's built-in implementation) and server
// reflection, so that standard tools (grpcurl, grpc_health_probe, the
// kubelet's gRPC probe) work without .proto files; and the settings every
// Colibri server and channel share (a thread cap, keepalive).

#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/channel_arguments.h>

#include <chrono>
#include <string>

#include "absl/status/status.h"

namespace colibri {
namespace runtime {

// Call before building a server (process-wide; idempotent). Also registers
// grpc.health.v1's descriptors in the process's descriptor pool: gRPC's own
// health service does not, and without them a reflection client asking for
// grpc.health.v1.Health gets "Symbol not found" although the service is listed.
void EnableStandardServices();

// Sets what grpc.health.v1 answers for the server as a whole ("") and for
// `service` (its full name, e.g. "colibri.v1.Router"): standard health
// clients ask for either. gRPC's health service knows only "" by itself,
// and says SERVING for it from the start.
void SetServing(grpc::HealthCheckServiceInterface* health, const std::string& service, bool serving);

// The threads a server may run synchronous handlers on. Reflection (and
// any other synchronous service) holds one thread per open stream; without a
// cap a peer opening streams makes the process start threads until thread
// creation fails, which ends it. At the cap a new call is refused at once
// with RESOURCE_EXHAUSTED ("Server Threadpool Exhausted"); Colibri's own
// services run on the callback API and are not counted.
inline constexpr int kMaxSyncServerThreads = 64;

// Keepalive. A peer that vanishes without closing its connections (a host
// powered off, a network partition, a process stopped) leaves them open:
// calls on them wait for their deadlines (a server's calls from a client
// that has none, forever, with the memory they hold), and a node that comes
// back at the same address is not reconnected until TCP gives up, ~15
// minutes on Linux. So every Colibri server and every channel Colibri opens
// pings its peer every `interval`, also with no call in flight, and closes
// the connection when a ping is not answered within `timeout` (its calls end
// UNAVAILABLE or CANCELLED; a channel then reconnects). Servers accept pings
// as often as every kMinPingInterval (gRPC's default, 5 minutes, answers
// more frequent ones with GOAWAY "too_many_pings"). The timeout is generous:
// gRPC 1.51 reads an idle client channel only from its backup poller, every
// 5 s, so an answer may wait that long to be seen.
inline constexpr std::chrono::milliseconds kKeepaliveTime{30000};
inline constexpr std::chrono::milliseconds kKeepaliveTimeout{20000};
inline constexpr std::chrono::milliseconds kMinPingInterval{1000};

struct Keepalive {
  std::chrono::milliseconds interval = kKeepaliveTime;    // between pings; >= kMinPingInterval
  std::chrono::milliseconds timeout = kKeepaliveTimeout;  // for a ping's answer
};

// INVALID_ARGUMENT naming `prefix`keepalive.interval or .timeout if either is
// out of range: below kMinPingInterval (pings more frequent than that
// Colibri's own servers refuse) or above a day. A timeout under ~5 s drops
// idle gRPC C++ clients' connections now and then (see above); they
// reconnect at their next call.
absl::Status ValidateKeepalive(const Keepalive& keepalive, const std::string& prefix);

// For every Colibri server: the cap on synchronous handlers' threads
// (kMaxSyncServerThreads, a ResourceQuota of its own), the keepalive pings
// it sends and those it accepts.
void ApplyServerPolicy(grpc::ServerBuilder& builder, const Keepalive& keepalive = {});

// Keepalive pings on a channel to a Colibri server.
void ApplyChannelKeepalive(grpc::ChannelArguments* args, const Keepalive& keepalive = {});

// How long one connection attempt of a Colibri channel may take.
inline constexpr std::chrono::milliseconds kConnectTimeout{5000};

// Reconnection of a channel to a Colibri server: a peer that comes back is
// reached again within a second (backoff from 100 ms to 1 s, not gRPC's up
// to 2 minutes), and each attempt has kConnectTimeout. (gRPC C-core takes
// GRPC_ARG_MIN_RECONNECT_BACKOFF_MS as that attempt's timeout, not as a
// backoff: at 100 ms a handshake on a loaded host would fail.)
void ApplyChannelReconnect(grpc::ChannelArguments* args);

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_GRPC_SERVICES_H_
