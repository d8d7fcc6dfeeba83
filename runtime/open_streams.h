#ifndef COLIBRI_RUNTIME_OPEN_STREAMS_H_
#define COLIBRI_RUNTIME_OPEN_STREAMS_H_

// The open streams of a gRPC service, for its shutdown. A stream reactor is
// added when the service creates it and removed in its OnDone, before it
// deletes itself; CloseAll calls its Close() on every open one, and Add tells
// the service to close the ones created afterwards. Close() may finish a
// stream: gRPC then schedules its OnDone, never runs it inline, so the set
// stays valid while CloseAll walks it under the lock. Thread-safe.

#include <set>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"

namespace colibri {
namespace runtime {

template <typename Reactor>  // has void Close()
class OpenStreams {
 public:
  // Adds `reactor`; false when CloseAll has already run (the caller closes it).
  bool Add(Reactor* reactor) {
    common::MutexLock lock(&mu_);
    streams_.insert(reactor);
    return !closed_;
  }
  void Remove(Reactor* reactor) {
    common::MutexLock lock(&mu_);
    streams_.erase(reactor);
  }
  void CloseAll() {
    common::MutexLock lock(&mu_);
    closed_ = true;
    for (Reactor* reactor : streams_) reactor->Close();
  }

 private:
  common::Mutex mu_;
  std::set<Reactor*> streams_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_OPEN_STREAMS_H_
