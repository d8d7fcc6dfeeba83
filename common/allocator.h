#ifndef COLIBRI_COMMON_ALLOCATOR_H_
#define COLIBRI_COMMON_ALLOCATOR_H_

// Process-wide malloc settings for the servers (colibri-router,
// colibri-expert): every call allocates and frees buffers of megabytes (rows,
// per-expert outputs, serialized messages). With glibc's defaults those come
// from fresh mmaps and go back on free, so every call page-faults them in
// again — measured at 15-50 ms per T=128 Mixtral-sized call on this machine
// (docs/PERFORMANCE.md). Keeping them (up to 32 MiB each) in the heap
// removes that; larger blocks are mapped and returned on free, and the heap
// gives back more than 256 MiB of free memory at its top, so a rare huge
// request does not leave its memory with the process.
// Call once at the top of main(), before threads start. Library code
// (colibri::Engine) does not touch the embedding program's allocator.

namespace colibri {
namespace common {

void TuneAllocatorForServer();

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_ALLOCATOR_H_
