#ifndef COLIBRI_RUNTIME_METRICS_SERVER_H_
#define COLIBRI_RUNTIME_METRICS_SERVER_H_

// A minimal HTTP/1.1 endpoint for Prometheus: GET /metrics answers the
// registry's text exposition; anything else is 404. One thread, one request
// per connection, bounded request size and time. Stops (and joins) on
// destruction.

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/metrics.h"

namespace colibri {
namespace runtime {

class MetricsServer {
 public:
  // Listens on host:port (port 0 picks a free one). `registry` must outlive
  // the server. UNAVAILABLE naming the address if it cannot listen.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Create(const std::string& host, int port,
                                                               const common::MetricsRegistry* registry);
  ~MetricsServer();

  int port() const { return port_; }

 private:
  MetricsServer(int fd, int port, const common::MetricsRegistry* registry);
  void Serve();

  const int fd_;
  const int port_;
  const common::MetricsRegistry* const registry_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_METRICS_SERVER_H_
