#include "runtime/metrics_server.h"

#include <exception>
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
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(exposer), ports[0]));
}

MetricsServer::MetricsServer(std::unique_ptr<prometheus::Exposer> exposer, int port)
    : exposer_(std::move(exposer)), port_(port) {}

MetricsServer::~MetricsServer() = default;

}  // namespace runtime
}  // namespace colibri
