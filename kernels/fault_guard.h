#ifndef COLIBRI_KERNELS_FAULT_GUARD_H_
#define COLIBRI_KERNELS_FAULT_GUARD_H_

// Runs code that may fault on a CPU or OS it has never run on (the AMX tile
// self-checks at start-up, kernels/dispatch.cc): SIGILL or SIGSEGV raised
// on the calling thread while `fn` runs ends `fn` instead of the process.
//
// For short, self-contained code only: what `fn` allocated before the fault
// is leaked, and it must hold no lock across a possible fault. A fault on
// another thread meanwhile goes to the handler installed before (the
// process's own, or the default). Calls are serialized (the handlers are
// process-wide).

#include <functional>

namespace colibri {
namespace kernels {

// 0 when `fn` returned (*result holds its value), else the signal that
// ended it (*result untouched).
int RunCatchingFaults(const std::function<bool()>& fn, bool* result);

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_FAULT_GUARD_H_
