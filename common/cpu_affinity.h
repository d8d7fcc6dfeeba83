#ifndef COLIBRI_COMMON_CPU_AFFINITY_H_
#define COLIBRI_COMMON_CPU_AFFINITY_H_

// The calling thread's CPU affinity, on hosts of any size. glibc's fixed
// cpu_set_t holds 1 024 CPUs, and the kernel refuses a set smaller than its
// own (EINVAL) on a host with more; these size the set to the kernel's.

#include <vector>

namespace colibri {
namespace common {

// The CPUs the calling thread may run on, ascending; empty if the kernel
// does not say.
std::vector<int> ThreadCpus();

// Restricts the calling thread to `cpus` (not empty). Best effort: false if
// the kernel refused (e.g. a CPU outside the process's cgroup).
bool PinThread(const std::vector<int>& cpus);

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_CPU_AFFINITY_H_
