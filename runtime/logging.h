#ifndef COLIBRI_RUNTIME_LOGGING_H_
#define COLIBRI_RUNTIME_LOGGING_H_

// The servers' logging: glog (Debian's libgoogle-glog-dev) to stderr, with
// levels (INFO, WARNING, ERROR) and, optionally, one JSON object per line
// for log collectors. The libraries below the servers write their events to
// a std::ostream they are given (an embedding program can pass its own);
// the servers give them a LogLines, which hands each line to glog: lines
// starting "WARNING: " or "ERROR: " at that level, the rest at INFO.
// InitLogging once in main(), before threads start; everything else is
// thread-safe.

#include <memory>
#include <ostream>
#include <streambuf>
#include <string>

#include "absl/status/status.h"

namespace colibri {
namespace runtime {

// `format`: "text" (glog's own line prefix: level, time, thread, file:line)
// or "json" ({"time","level","thread","file","line","message"} per line).
// `min_level`: "info", "warning" or "error". INVALID_ARGUMENT naming
// --log_format / --log_level for anything else.
absl::Status InitLogging(const char* argv0, const std::string& format, const std::string& min_level);

// A std::ostream whose complete lines go to glog (see above). Each line is
// assembled per thread and logged at once; threads that share one write
// their lines through common::LogLine (as the libraries do), since the
// stream's own formatting state is shared.
class LogLines : public std::ostream {
 public:
  LogLines();
  ~LogLines() override;

 private:
  class Buffer;
  std::unique_ptr<Buffer> buffer_;
};

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_LOGGING_H_
