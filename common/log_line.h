#ifndef COLIBRI_COMMON_LOG_LINE_H_
#define COLIBRI_COMMON_LOG_LINE_H_

// How the libraries write a line to the std::ostream their user gives them
// for events (a server's runtime::LogLines, std::cerr, a test's
// ostringstream). They log from many threads at once, and every insertion
// into a std::ostream writes its formatting state (the field width), so a
// shared stream is safe only if every line goes through one lock.

#include <ostream>

#include "absl/strings/string_view.h"

namespace colibri {
namespace common {

// Writes `line` and a newline to `log` (nothing if null) under one
// process-wide lock, and flushes it. Thread-safe.
void LogLine(std::ostream* log, absl::string_view line);

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_LOG_LINE_H_
