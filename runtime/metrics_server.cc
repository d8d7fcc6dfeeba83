#include "runtime/metrics_server.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "prometheus/exposer.h"

namespace colibri {
namespace runtime {

std::string MetricsHost(const std::string& metrics_host, const std::string& listen) {
  if (!metrics_host.empty()) return metrics_host;
  std::string host = listen.substr(0, listen.rfind(':'));
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) host = host.substr(1, host.size() - 2);
  if (host.empty() || host == "localhost") return "127.0.0.1";
  return host;
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Create(const std::string& host, int port,
                                                                     const common::MetricsRegistry* registry) {
  const std::string address = absl::StrContains(host, ':') ? absl::StrCat("[", host, "]:", port)  // IPv6
                                                           : absl::StrCat(host, ":", port);
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    exposer = std::make_unique<prometheus::Exposer>(
        std::vector<std::string>{"listening_ports", address, "num_threads", std::to_string(kMetricsThreads),
                                 "request_timeout_ms", std::to_string(kMetricsRequestTimeoutMs)});
  } catch (const std::exception& e) {  // civetweb reports a failed bind by throwing
    return absl::UnavailableError(absl::StrCat("metrics: cannot listen on ", address, ": ", e.what()));
  }
  const std::vector<int> ports = exposer->GetListeningPorts();
  if (ports.empty()) return absl::UnavailableError(absl::StrCat("metrics: cannot listen on ", address));
  exposer->RegisterCollectable(registry->registry());
  const std::string reach = host == "0.0.0.0" ? "127.0.0.1" : host == "::" ? "::1" : host;
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(exposer), reach, ports[0]));
}

MetricsServer::MetricsServer(std::unique_ptr<prometheus::Exposer> exposer, std::string host, int port)
    : exposer_(std::move(exposer)), host_(std::move(host)), port_(port) {}

MetricsServer::~MetricsServer() {
  // civetweb's accept loop notices a stop only when its 2 s poll returns:
  // connect every 10 ms until the exposer is gone, so that it returns at once.
  std::atomic<bool> stopped{false};
  std::thread waker([this, &stopped] {
    addrinfo hints = {};
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* address = nullptr;
    if (::getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &address) != 0) return;
    while (!stopped.load()) {
      const int fd = ::socket(address->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd >= 0) {
        (void)::connect(fd, address->ai_addr, address->ai_addrlen);
        ::close(fd);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::freeaddrinfo(address);
  });
  exposer_.reset();
  stopped = true;
  waker.join();
}

}  // namespace runtime
}  // namespace colibri
