// Anonymous memory for weight copies: reserved 2 MiB pages when the system
// has enough free (HugePages_Free in /proc/meminfo), transparent huge pages
// otherwise, 4 KiB pages when not asked; always writable and 2 MiB aligned.

#include "common/anonymous_memory.h"

#include <numa.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <fstream>
#include <string>

namespace colibri {
namespace common {
namespace {

int64_t FreeHugePages() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t value = 0;
  while (in >> key >> value) {
    if (key == "HugePages_Free:") return value;
    in.ignore(256, '\n');
  }
  return 0;
}

void FillAndCheck(AnonymousMemory& m) {
  CHECK(reinterpret_cast<uintptr_t>(m.data()) % (2 << 20) == 0);
  for (size_t i = 0; i < m.size(); i += 4096) m.data()[i] = static_cast<uint8_t>(i >> 12);
  for (size_t i = 0; i < m.size(); i += 4096) REQUIRE(m.data()[i] == static_cast<uint8_t>(i >> 12));
}

TEST_CASE("huge-page memory uses reserved pages when there are enough, else transparent ones") {
  const int64_t free_before = FreeHugePages();
  auto m = AnonymousMemory::Create(3 << 20, {/*hugepages=*/true, /*numa_node=*/-1});
  REQUIRE(m.ok());
  CHECK((*m)->size() == (4u << 20));
  INFO((*m)->description() << "; free 2 MiB pages before: " << free_before);
  if (free_before >= 2) {
    CHECK((*m)->description() == "hugetlb 2 MiB pages");
    CHECK(FreeHugePages() == free_before - 2);
  } else {
    CHECK((*m)->description().find("huge pages") != std::string::npos);
    CHECK((*m)->description().find("hugetlb") == std::string::npos);
  }
  FillAndCheck(**m);
  m->reset();
  CHECK(FreeHugePages() == free_before);

  auto plain = AnonymousMemory::Create(100, {/*hugepages=*/false, /*numa_node=*/-1});
  REQUIRE(plain.ok());
  CHECK((*plain)->description() == "4 KiB pages");
  FillAndCheck(**plain);
}

TEST_CASE("memory bound to a NUMA node is bound or refused by name, never silently placed elsewhere") {
  if (numa_available() < 0) {
    WARN("libnuma reports no NUMA support here: NUMA binding untested");
    return;
  }
  auto bound = AnonymousMemory::Create(100, {/*hugepages=*/false, /*numa_node=*/0});
  REQUIRE(bound.ok());
  CHECK((*bound)->description() == "4 KiB pages, NUMA node 0");
  FillAndCheck(**bound);
  const auto missing = AnonymousMemory::Create(100, {/*hugepages=*/false, /*numa_node=*/numa_max_node() + 1});
  INFO(missing.status().message());
  CHECK(missing.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(missing.status().message().find("does not exist") != std::string::npos);
}

}  // namespace
}  // namespace common
}  // namespace colibri
