#include "common/cpu_affinity.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>

namespace colibri {
namespace common {
namespace {

// A cpu_set_t of `n` CPUs, allocated to its size.
class DynamicCpuSet {
 public:
  explicit DynamicCpuSet(int n) : bytes_(CPU_ALLOC_SIZE(n)), set_(CPU_ALLOC(n)) {
    if (set_ != nullptr) CPU_ZERO_S(bytes_, set_);
  }
  ~DynamicCpuSet() {
    if (set_ != nullptr) CPU_FREE(set_);
  }
  DynamicCpuSet(const DynamicCpuSet&) = delete;
  DynamicCpuSet& operator=(const DynamicCpuSet&) = delete;

  bool ok() const { return set_ != nullptr; }
  size_t bytes() const { return bytes_; }
  cpu_set_t* get() const { return set_; }

 private:
  const size_t bytes_;
  cpu_set_t* const set_;
};

// The largest set tried: Linux's NR_CPUS is at most 8 192 today.
constexpr int kMaxCpus = 1 << 16;

}  // namespace

std::vector<int> ThreadCpus() {
  for (int n = CPU_SETSIZE; n <= kMaxCpus; n *= 2) {
    DynamicCpuSet set(n);
    if (!set.ok()) return {};
    if (sched_getaffinity(0, set.bytes(), set.get()) == 0) {
      std::vector<int> cpus;
      for (int c = 0; c < n; ++c) {
        if (CPU_ISSET_S(c, set.bytes(), set.get())) cpus.push_back(c);
      }
      return cpus;
    }
    if (errno != EINVAL) return {};  // EINVAL: the kernel's set is larger
  }
  return {};
}

bool PinThread(const std::vector<int>& cpus) {
  if (cpus.empty()) return false;
  const int highest = *std::max_element(cpus.begin(), cpus.end());
  if (highest < 0) return false;
  DynamicCpuSet set(std::max(CPU_SETSIZE, highest + 1));
  if (!set.ok()) return false;
  for (const int c : cpus) {
    if (c >= 0) CPU_SET_S(c, set.bytes(), set.get());
  }
  return sched_setaffinity(0, set.bytes(), set.get()) == 0;
}

}  // namespace common
}  // namespace colibri
