#ifndef COLIBRI_COMMON_ANONYMOUS_MEMORY_H_
#define COLIBRI_COMMON_ANONYMOUS_MEMORY_H_

// Anonymous memory for copies of weights: optionally bound to one NUMA node
// (libnuma's mbind policy) and advised for transparent huge pages. Used when
// the page cache's 4 KiB pages or its NUMA placement are not good enough
// (docs/KERNELS.md). Owns the mapping; not copyable; thread-compatible.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace colibri {
namespace common {

class AnonymousMemory {
 public:
  struct Options {
    bool hugepages = true;  // reserved 2 MiB pages (MAP_HUGETLB) if available, else MADV_HUGEPAGE
    int numa_node = -1;     // >= 0: bind the pages to that node before first touch
  };

  // RESOURCE_EXHAUSTED if the memory cannot be mapped; UNAVAILABLE if a NUMA
  // node was asked for and libnuma reports no NUMA support.
  static absl::StatusOr<std::unique_ptr<AnonymousMemory>> Create(size_t bytes, const Options& options);
  // The size() Create(bytes) maps: whole 2 MiB pages, at least one.
  static size_t SizeFor(size_t bytes);
  ~AnonymousMemory();
  AnonymousMemory(const AnonymousMemory&) = delete;
  AnonymousMemory& operator=(const AnonymousMemory&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // What was applied, for the log: e.g. "hugetlb 2 MiB pages, NUMA node 0" or "transparent huge pages advised".
  const std::string& description() const { return description_; }

 private:
  AnonymousMemory(uint8_t* data, size_t size, std::string description)
      : data_(data), size_(size), description_(std::move(description)) {}

  uint8_t* const data_;
  const size_t size_;
  const std::string description_;
};

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_ANONYMOUS_MEMORY_H_
