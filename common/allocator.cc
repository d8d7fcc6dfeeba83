#include "common/allocator.h"

#include <malloc.h>

namespace colibri {
namespace common {

void TuneAllocatorForServer() {
  // Blocks below 1 GiB come from the heap (a thread arena's heaps are capped
  // at 64 MiB, so bigger blocks there are still mapped) and the top of the
  // heap is given back only beyond 2 GiB free. mallopt's result is advisory:
  // on failure the defaults stay and only speed changes.
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 0x7fffffff);  // the largest value (2 GiB) mallopt takes
}

}  // namespace common
}  // namespace colibri
