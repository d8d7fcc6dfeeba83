#ifndef COLIBRI_RUNTIME_METRICS_SERVER_H_
#define COLIBRI_RUNTIME_METRICS_SERVER_H_

// The Prometheus endpoint: GET /metrics answers the registry's text
// exposition, through prometheus-cpp's exposer (civetweb). It runs
// kMetricsThreads worker threads and gives a client kMetricsRequestTimeoutMs
// to send its request, so idle or slow clients each hold one worker for at
// most that long: a scrape is not delayed while fewer than kMetricsThreads - 1
// of them are connected. Stops on destruction, within about that timeout
// even with such clients connected (a worker waits for a request that long;
// civetweb's accept loop, which polls in 2 s steps, is woken by connecting).

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics.h"

namespace prometheus {
class Exposer;
}

namespace colibri {
namespace runtime {

inline constexpr int kMetricsThreads = 32;
inline constexpr int kMetricsRequestTimeoutMs = 1000;

// The address metrics listen on: `metrics_host` if set, else the host of the
// gRPC address `listen` (host:port, [v6]:port): metrics are as reachable as
// the service, no more.
std::string MetricsHost(const std::string& metrics_host, const std::string& listen);

class MetricsServer {
 public:
  // Listens on host:port (an IP address; port 0 picks a free one).
  // `registry` must outlive the server. UNAVAILABLE naming the address if it
  // cannot listen.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Create(const std::string& host, int port,
                                                               const common::MetricsRegistry* registry);
  ~MetricsServer();

  int port() const { return port_; }

 private:
  MetricsServer(std::unique_ptr<prometheus::Exposer> exposer, std::string host, int port);

  std::unique_ptr<prometheus::Exposer> exposer_;
  const std::string host_;  // where a client can reach the listener (a wildcard becomes loopback)
  const int port_;
};

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_METRICS_SERVER_H_
