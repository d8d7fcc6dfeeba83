#include "common/log_line.h"

#include "common/mutex.h"

namespace colibri {
namespace common {

void LogLine(std::ostream* log, absl::string_view line) {
  if (log == nullptr) return;
  static Mutex* const mu = new Mutex();  // never destroyed: threads may log during exit
  MutexLock lock(mu);
  log->write(line.data(), static_cast<std::streamsize>(line.size()));
  log->put('\n');
  log->flush();
}

}  // namespace common
}  // namespace colibri
