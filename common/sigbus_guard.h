#ifndef COLIBRI_COMMON_SIGBUS_GUARD_H_
#define COLIBRI_COMMON_SIGBUS_GUARD_H_

// Mapped files that may be truncated while the process reads them (weights
// served from their mapping, not a copy). Reading a mapped page past a
// file's new end raises SIGBUS, which kills a process by default. A guarded
// range instead gets that page replaced by a page of zeros (the read goes on)
// and is marked faulted; whoever computed from it checks Faulted() afterwards
// and discards the result. Other faults go to the SIGBUS handler that was
// in place when the guard's was first installed (a program that links
// Colibri keeps its own: install it before the first Register), called as
// the kernel would (its mask, SA_NODEFER, SA_RESETHAND once), else take the
// default action (the process dies, as it should for a bug). A handler
// installed after that is replaced by the guard's at the next Register and
// not called.
//
// Process-wide: Register installs a SIGBUS handler (SA_SIGINFO, SA_ONSTACK:
// a Go program's handler must run on the signal stack) if it is not
// installed already. A thread that blocks SIGBUS gets no guard (the kernel
// kills the process on such a fault): the threads Colibri starts unblock it. Register/Unregister/Faulted are
// thread-safe and lock-free; the handler is async-signal-safe (atomics and mmap). At most kSlots ranges are guarded at
// once; beyond that Register returns -1 and the range stays unguarded. REQUIRES: a range is not unmapped while a thread
// may still read it (the owner unregisters, then unmaps, once no reader is left).

#include <cstddef>

namespace colibri {
namespace common {

class SigbusGuard {
 public:
  static constexpr int kSlots = 65536;  // 1.5 MiB; a node of 48 layers x 256 experts maps 12 288 files

  // The slot guarding [data, data + size), or -1 if every slot is taken.
  static int Register(const void* data, size_t size);
  static void Unregister(int slot);
  // True once a SIGBUS hit the slot's range (its data is then partly zeros).
  static bool Faulted(int slot);
  // Unblocks SIGBUS on the calling thread, whose mask it may have inherited
  // from a program that blocks every signal: a thread that reads guarded
  // ranges calls it first.
  static void UnblockHere();
};

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_SIGBUS_GUARD_H_
