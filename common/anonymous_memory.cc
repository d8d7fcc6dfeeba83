#include "common/anonymous_memory.h"

#include <numa.h>
#include <numaif.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace colibri {
namespace common {
namespace {

// MADV_POPULATE_WRITE (Linux 5.14; Debian 12 runs 6.1): fault every page in
// now and report failure as an error. Older kernels return EINVAL, and the
// caller falls back to transparent huge pages.
constexpr int kMadvPopulateWrite = 23;

// Binds [p, p + size) to `node` before its first touch. The kernel refuses
// (EINVAL) a node without memory, offline, or outside the memory nodes the
// process's cpuset allows; libnuma's numa_tonode_memory would only print
// that to stderr and leave the pages wherever the default policy puts them.
absl::Status BindToNode(void* p, size_t size, int node) {
  bitmask* mask = numa_allocate_nodemask();
  numa_bitmask_setbit(mask, static_cast<unsigned>(node));
  const long bound = mbind(p, size, MPOL_BIND, mask->maskp, mask->size + 1, 0);
  const int error = errno;
  numa_free_nodemask(mask);
  if (bound == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("cannot bind memory to NUMA node ", node, ": ", std::strerror(error),
                   " (a node without memory, offline, or outside the memory nodes this process's cpuset allows)"));
}

}  // namespace

size_t AnonymousMemory::SizeFor(size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  return std::max(kHuge, (bytes + kHuge - 1) / kHuge * kHuge);
}

absl::StatusOr<std::unique_ptr<AnonymousMemory>> AnonymousMemory::Create(size_t bytes, const Options& options) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t size = SizeFor(bytes);
  if (options.numa_node >= 0 && numa_available() < 0) {
    return absl::UnavailableError(
        absl::StrCat("NUMA node ", options.numa_node, " requested but libnuma reports no NUMA support"));
  }
  if (options.numa_node > numa_max_node()) {
    return absl::InvalidArgumentError(
        absl::StrCat("NUMA node ", options.numa_node, " does not exist (max ", numa_max_node(), ")"));
  }
  if (options.hugepages) {
    // Reserved 2 MiB pages first (hugetlbfs: a Kubernetes pod's
    // hugepages-2Mi resources, or vm.nr_hugepages), populated here — after
    // the NUMA binding — so a shortage is an error now, not a SIGBUS later.
    void* h = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (h != MAP_FAILED) {
      if (options.numa_node >= 0) {
        if (absl::Status bound = BindToNode(h, size, options.numa_node); !bound.ok()) {
          munmap(h, size);
          return bound;
        }
      }
      if (madvise(h, size, kMadvPopulateWrite) == 0) {
        std::string description = "hugetlb 2 MiB pages";
        if (options.numa_node >= 0) absl::StrAppend(&description, ", NUMA node ", options.numa_node);
        return std::unique_ptr<AnonymousMemory>(new AnonymousMemory(static_cast<uint8_t*>(h), size, description));
      }
      munmap(h, size);  // not enough reserved pages (on that node): transparent huge pages instead
    }
  }
  // Map 2 MiB more and trim, so the region starts on a huge-page boundary
  // (an unaligned start gets few or no transparent huge pages).
  void* raw = mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot map ", size, " bytes: ", std::strerror(errno)));
  }
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHuge - 1) / kHuge * kHuge;
  if (aligned > start) munmap(raw, aligned - start);
  if (start + kHuge > aligned) munmap(reinterpret_cast<void*>(aligned + size), start + kHuge - aligned);
  void* p = reinterpret_cast<void*>(aligned);
  std::string description;
  if (options.hugepages) {
    description = madvise(p, size, MADV_HUGEPAGE) == 0
                      ? "transparent huge pages advised"
                      : absl::StrCat("huge pages refused (", std::strerror(errno), ")");
  } else {
    description = "4 KiB pages";
  }
  if (options.numa_node >= 0) {
    if (absl::Status bound = BindToNode(p, size, options.numa_node); !bound.ok()) {
      munmap(p, size);
      return bound;
    }
    absl::StrAppend(&description, ", NUMA node ", options.numa_node);
  }
  return std::unique_ptr<AnonymousMemory>(new AnonymousMemory(static_cast<uint8_t*>(p), size, description));
}

AnonymousMemory::~AnonymousMemory() { munmap(data_, size_); }

}  // namespace common
}  // namespace colibri
