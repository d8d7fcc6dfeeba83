#include "common/cgroup_limits.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>

#include "tests/test_util.h"

namespace colibri {
namespace common {
namespace {

void Write(const std::filesystem::path& path, const std::string& text) {
  std::filesystem::create_directories(path.parent_path());
  std::ofstream(path) << text;
}

TEST_CASE("cgroup v2 limits are the lowest from the process's cgroup up to the root", "[cgroup]") {
  testing::TempDir root;
  const std::filesystem::path fs = root.path() + "/sys/fs/cgroup";
  Write(root.path() + "/proc/self/cgroup", "0::/kubepods.slice/pod1/c1\n");
  Write(fs / "cgroup.controllers", "cpu memory\n");
  Write(fs / "kubepods.slice/memory.max", "68719476736\n");
  Write(fs / "kubepods.slice/pod1/memory.max", "max\n");
  Write(fs / "kubepods.slice/pod1/c1/memory.max", "34359738368\n");
  Write(fs / "kubepods.slice/cpu.max", "max 100000\n");
  Write(fs / "kubepods.slice/pod1/c1/cpu.max", "150000 100000\n");
  const CgroupLimits limits = ReadCgroupLimits(root.path());
  CHECK(limits.memory_bytes == 34359738368);
  CHECK(limits.memory_file == (fs / "kubepods.slice/pod1/c1/memory.max").string());
  CHECK(limits.cpus == Approx(1.5));
  CHECK(DefaultThreads(8, limits.cpus) == 2);

  // A parent's lower limit binds; a container that sees only its own
  // hierarchy (the path is not under the mount) reads the mount's root.
  Write(fs / "kubepods.slice/pod1/memory.max", "1073741824\n");
  CHECK(ReadCgroupLimits(root.path()).memory_bytes == 1073741824);
  Write(root.path() + "/proc/self/cgroup", "0::/not/here\n");
  Write(fs / "memory.max", "2147483648\n");
  CHECK(ReadCgroupLimits(root.path()).memory_bytes == 2147483648);
  CHECK(ReadCgroupLimits(root.path()).cpus == -1);
}

TEST_CASE("cgroup v1 limits, and none", "[cgroup]") {
  testing::TempDir root;
  const std::filesystem::path fs = root.path() + "/sys/fs/cgroup";
  Write(root.path() + "/proc/self/cgroup", "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n");
  Write(fs / "memory/memory.limit_in_bytes", "9223372036854771712\n");  // no limit
  Write(fs / "memory/docker/abc/memory.limit_in_bytes", "17179869184\n");
  Write(fs / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "400000\n");
  Write(fs / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n");
  Write(fs / "cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  Write(fs / "cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  CgroupLimits limits = ReadCgroupLimits(root.path());
  CHECK(limits.memory_bytes == 17179869184);
  CHECK(limits.cpus == Approx(4.0));

  Write(fs / "memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n");
  Write(fs / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n");
  limits = ReadCgroupLimits(root.path());
  CHECK(limits.memory_bytes == -1);
  CHECK(limits.cpus == -1);
  CHECK(ReadCgroupLimits(root.path() + "/nothing").memory_bytes == -1);
}

TEST_CASE("kernel files are read to their end although they report no size", "[cgroup]") {
  std::ifstream in("/proc/self/cgroup");
  std::string first;
  REQUIRE(std::getline(in, first));
  const std::optional<std::string> text = ReadKernelFile("/proc/self/cgroup", 1 << 16);
  REQUIRE(text.has_value());
  CHECK(text->rfind(first + "\n", 0) == 0);
  CHECK(ReadKernelFile("/proc/self/cgroup", 3)->size() == 3);
  CHECK_FALSE(ReadKernelFile("/nonexistent/file", 10).has_value());
  const CgroupLimits limits = ReadCgroupLimits();  // this host's: a limit, if any, names its file
  CHECK((limits.memory_bytes < 0) == limits.memory_file.empty());
  CHECK((limits.cpus < 0) == limits.cpu_file.empty());
}

TEST_CASE("default threads: one per allowed CPU, at most the quota rounded up", "[cgroup]") {
  CHECK(DefaultThreads(64, -1) == 64);
  CHECK(DefaultThreads(64, 4) == 4);
  CHECK(DefaultThreads(64, 0.5) == 1);
  CHECK(DefaultThreads(2, 8) == 2);
  CHECK(DefaultThreads(0, -1) == 1);
  CHECK(UsableCpus() >= 1);
}

}  // namespace
}  // namespace common
}  // namespace colibri
