#include "common/allocator.h"

#include <malloc.h>

#include <algorithm>

#include "common/cpu_affinity.h"

namespace colibri {
namespace common {

void TuneAllocatorForServer() {
  // Blocks below 32 MiB come from the heap (a decode or prefill call's
  // buffers: 128 Mixtral tokens are 2 MiB); larger ones are mapped and go back
  // to the system on free, and the top of a heap is given back beyond 256 MiB
  // free — so one huge request does not leave its memory with the process.
  // mallopt's result is advisory: on failure the defaults stay and only
  // speed changes.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest dynamic threshold, fixed
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  // One arena per CPU the process may run on (glibc's default is eight):
  // each arena keeps the freed blocks of the threads that used it, so with
  // dozens of gRPC and worker threads the default let a router under a soak
  // with large refused requests settle at 144 MiB instead of 61 MiB
  // (scripts/soak.sh, docs/RELIABILITY.md), with no loss of throughput.
  mallopt(M_ARENA_MAX, std::max<int>(2, static_cast<int>(ThreadCpus().size())));
}

}  // namespace common
}  // namespace colibri
