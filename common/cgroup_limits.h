#ifndef COLIBRI_COMMON_CGROUP_LIMITS_H_
#define COLIBRI_COMMON_CGROUP_LIMITS_H_

// The memory and CPU limits the process's control groups set (a container's,
// a systemd unit's MemoryMax= / CPUQuota=, Kubernetes' resources.limits).
// Past the memory limit the kernel kills the process (locked weights cannot
// be reclaimed), and past the CPU quota it stops every thread until the next
// period: the expert node and the router size what they can from these.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace colibri {
namespace common {

struct CgroupLimits {
  // The lowest limit on the way from the process's cgroup up to the root of
  // the hierarchy it sees: cgroup v2's memory.max and cpu.max, or v1's
  // memory.limit_in_bytes and cpu.cfs_quota_us / cpu.cfs_period_us.
  int64_t memory_bytes = -1;  // -1: none
  double cpus = -1;           // CPUs' worth of time per period; -1: none
  std::string memory_file;    // where each was read, for messages
  std::string cpu_file;
};

// Reads them from /proc/self/cgroup and /sys/fs/cgroup; `root` prefixes both
// paths (tests). Files that are missing or unreadable count as no limit.
CgroupLimits ReadCgroupLimits(const std::string& root = "");

// Memory kept under a limit for the process itself (code, gRPC, threads),
// beside its weights and the calls in flight.
constexpr int64_t kProcessMemoryBytes = int64_t{256} << 20;

// The text of a kernel file such as /proc/self/cgroup or a cgroup's
// memory.max, at most `max_bytes` of it; nullopt if it cannot be opened.
// Such files report a size of 0: they are read to their end.
std::optional<std::string> ReadKernelFile(const std::string& path, size_t max_bytes);

// The threads to run by default on `allowed_cpus` CPUs under a quota of
// `cpus` (-1: none): one per allowed CPU, at most the quota rounded up, at
// least 1.
int DefaultThreads(size_t allowed_cpus, double cpus);

// The number of CPUs the process may use (its affinity), bounded by its
// cgroup's CPU quota: the default for threads that are not pinned.
int UsableCpus();

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_CGROUP_LIMITS_H_
