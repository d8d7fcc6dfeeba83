#ifndef COLIBRI_COMMON_HOST_PORT_H_
#define COLIBRI_COMMON_HOST_PORT_H_

// Node addresses as Colibri takes them (--experts_at, cluster files, plans):
// host:port, the host a name, an IPv4 address or [an IPv6 address], the
// port 1..65535.

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace colibri {
namespace common {

// OK for host:port; else INVALID_ARGUMENT "<what> '<address>' is not
// host:port (…)" saying what is wrong.
absl::Status CheckHostPort(absl::string_view address, absl::string_view what);

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_HOST_PORT_H_
