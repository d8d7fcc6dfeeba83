#include "common/allocator.h"

#include <malloc.h>

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
}

}  // namespace common
}  // namespace colibri
