#include "runtime/metrics_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace colibri {
namespace runtime {
namespace {

constexpr int kPollMillis = 200;      // how often the accept loop checks for stop
constexpr size_t kMaxRequest = 8192;  // bytes of request head we read
constexpr int kReadTimeoutMillis = 2000;

void WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n <= 0) return;  // the client went away: nothing to do
    done += static_cast<size_t>(n);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Create(const std::string& host, int port,
                                                                     const common::MetricsRegistry* registry) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("metrics: socket: ", std::strerror(errno)));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1 ||
      ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 16) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("metrics: cannot listen on ", host, ":", port, ": ", why));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return std::unique_ptr<MetricsServer>(new MetricsServer(fd, ntohs(addr.sin_port), registry));
}

MetricsServer::MetricsServer(int fd, int port, const common::MetricsRegistry* registry)
    : fd_(fd), port_(port), registry_(registry) {
  thread_ = std::thread([this] { Serve(); });
}

MetricsServer::~MetricsServer() {
  stop_ = true;
  thread_.join();
  ::close(fd_);
}

void MetricsServer::Serve() {
  while (!stop_) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, kPollMillis) <= 0) continue;
    const int client = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    std::string request;
    char buffer[1024];
    while (request.size() < kMaxRequest && !absl::StrContains(request, "\r\n\r\n")) {
      pollfd c{client, POLLIN, 0};
      if (::poll(&c, 1, kReadTimeoutMillis) <= 0) break;
      const ssize_t n = ::recv(client, buffer, sizeof(buffer), 0);
      if (n <= 0) break;
      request.append(buffer, static_cast<size_t>(n));
    }
    std::string status = "404 Not Found", type = "text/plain", body = "not found\n";
    if (absl::StartsWith(request, "GET /metrics ") || absl::StartsWith(request, "GET /metrics?")) {
      status = "200 OK";
      type = "text/plain; version=0.0.4";
      body = registry_->Render();
    }
    WriteAll(client, absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type, "\r\nContent-Length: ", body.size(),
                                  "\r\nConnection: close\r\n\r\n", body));
    ::close(client);
  }
}

}  // namespace runtime
}  // namespace colibri
