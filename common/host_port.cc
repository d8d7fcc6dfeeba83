#include "common/host_port.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace colibri {
namespace common {

absl::Status CheckHostPort(absl::string_view address, absl::string_view what) {
  const size_t colon = address.rfind(':');
  const auto refuse = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", address, "' is not host:port (", why, ")"));
  };
  if (colon == absl::string_view::npos) return refuse("no port");
  if (colon == 0) return refuse("no host");
  int port = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 1 || port > 65535) {
    return refuse("the port must be a number in 1..65535");
  }
  return absl::OkStatus();
}

}  // namespace common
}  // namespace colibri
