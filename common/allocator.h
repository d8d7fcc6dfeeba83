#ifndef COLIBRI_COMMON_ALLOCATOR_H_
#define COLIBRI_COMMON_ALLOCATOR_H_

// Process-wide malloc settings for the servers (colibri-router,
// colibri-expert): every call allocates and frees buffers of megabytes (rows,
// per-expert outputs, serialized messages). With glibc's defaults those come
// from fresh mmaps and go back on free, so every call page-faults them in
// again — measured at 15-50 ms per T=128 Mixtral-sized call on this machine
// (docs/PERFORMANCE.md). Keeping them in the heap removes that; the cost is
// that freed memory stays with the process (up to the largest call's
// working set), which a server reaches in its first calls anyway.
// Call once at the top of main(), before threads start. Library code
// (colibri::Engine) does not touch the embedding program's allocator.

namespace colibri {
namespace common {

void TuneAllocatorForServer();

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_ALLOCATOR_H_
