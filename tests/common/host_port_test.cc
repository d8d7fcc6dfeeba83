// Node addresses: host:port, each part checked.
#include "common/host_port.h"

#include <catch2/catch.hpp>

namespace colibri {
namespace common {
namespace {

TEST_CASE("node addresses are host:port with a port in 1..65535") {
  for (const char* good : {"127.0.0.1:50061", "expert-0.colibri:1", "[::1]:65535", "[fe80::1%eth0]:80"}) {
    INFO(good);
    CHECK(CheckHostPort(good, "address").ok());
  }
  for (const char* bad : {"", "nodeA", ":5000", "127.0.0.1:", "127.0.0.1:abc", "127.0.0.1:0", "127.0.0.1:65536",
                          "127.0.0.1:-1", "[::1]"}) {
    INFO(bad);
    const absl::Status s = CheckHostPort(bad, "address");
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(s.message().find("is not host:port") != absl::string_view::npos);
  }
}

}  // namespace
}  // namespace common
}  // namespace colibri
