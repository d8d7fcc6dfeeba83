#include "common/cgroup_limits.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/cpu_affinity.h"

namespace colibri {
namespace common {

std::optional<std::string> ReadKernelFile(const std::string& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::string text(max_bytes, '\0');
  in.read(text.data(), static_cast<std::streamsize>(max_bytes));
  text.resize(static_cast<size_t>(in.gcount()));
  return text;
}

namespace {

std::optional<std::string> ReadLine(const std::string& path) {
  std::optional<std::string> text = ReadKernelFile(path, 4096);
  if (!text.has_value()) return std::nullopt;
  return std::string(absl::StripAsciiWhitespace(*text));
}

// Values of at least 2^62 (v1's "no limit" is 2^63 rounded down to a page).
std::optional<int64_t> ParseBytes(const std::string& text) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(text, &v) || v < 0 || v >= (int64_t{1} << 62)) return std::nullopt;
  return v;
}

// "max 100000" or "150000 100000" (v2's cpu.max).
std::optional<double> ParseCpuMax(const std::string& text) {
  const std::vector<std::string> parts = absl::StrSplit(text, ' ', absl::SkipEmpty());
  int64_t quota = 0, period = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &quota) || !absl::SimpleAtoi(parts[1], &period) || quota <= 0 ||
      period <= 0) {
    return std::nullopt;
  }
  return static_cast<double>(quota) / static_cast<double>(period);
}

// `path` and each of its parents up to "/".
std::vector<std::string> SelfAndParents(std::string path) {
  std::vector<std::string> out;
  while (!path.empty() && path.back() == '/') path.pop_back();
  for (;;) {
    out.push_back(path.empty() ? "/" : path);
    const size_t slash = path.rfind('/');
    if (path.empty() || slash == std::string::npos) break;
    path.resize(slash);
  }
  return out;
}

// Takes the lowest value found in `file` in `dir` + each level of `path`.
template <typename T, typename Parse>
void LowestOnTheWay(const std::string& dir, const std::string& path, const std::string& file, Parse parse, T* value,
                    std::string* where) {
  for (const std::string& level : SelfAndParents(path)) {
    const std::string full = dir + (level == "/" ? "" : level) + "/" + file;
    const std::optional<std::string> text = ReadLine(full);
    if (!text.has_value()) continue;
    if (const auto v = parse(*text); v.has_value() && (*value < 0 || *v < *value)) {
      *value = *v;
      *where = full;
    }
  }
}

}  // namespace

CgroupLimits ReadCgroupLimits(const std::string& root) {
  CgroupLimits limits;
  const std::optional<std::string> self = ReadKernelFile(root + "/proc/self/cgroup", 1 << 16);
  if (!self.has_value()) return limits;
  const std::string mount = root + "/sys/fs/cgroup";
  const auto v1_cpu = [&](const std::string& dir, const std::string& path) {
    const std::string base = mount + "/" + dir;
    for (const std::string& level : SelfAndParents(path)) {
      const std::string prefix = base + (level == "/" ? "" : level) + "/";
      const std::optional<std::string> quota = ReadLine(prefix + "cpu.cfs_quota_us");
      const std::optional<std::string> period = ReadLine(prefix + "cpu.cfs_period_us");
      if (!quota.has_value() || !period.has_value()) continue;
      if (const auto v = ParseCpuMax(*quota + " " + *period); v.has_value() && (limits.cpus < 0 || *v < limits.cpus)) {
        limits.cpus = *v;
        limits.cpu_file = prefix + "cpu.cfs_quota_us";
      }
    }
  };
  for (absl::string_view line : absl::StrSplit(*self, '\n', absl::SkipEmpty())) {
    // hierarchy-ID:controller-list:path
    const std::vector<std::string> fields = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (fields.size() != 3) continue;
    const std::string& path = fields[2];
    if (fields[0] == "0" && fields[1].empty()) {  // v2: the unified hierarchy
      const std::string dir = ReadLine(mount + "/cgroup.controllers").has_value() ? mount : mount + "/unified";
      LowestOnTheWay(dir, path, "memory.max", ParseBytes, &limits.memory_bytes, &limits.memory_file);
      LowestOnTheWay(dir, path, "cpu.max", ParseCpuMax, &limits.cpus, &limits.cpu_file);
      continue;
    }
    const std::vector<std::string> controllers = absl::StrSplit(fields[1], ',');
    const auto has = [&](const char* c) {
      return std::find(controllers.begin(), controllers.end(), c) != controllers.end();
    };
    if (has("memory")) {
      LowestOnTheWay(mount + "/memory", path, "memory.limit_in_bytes", ParseBytes, &limits.memory_bytes,
                     &limits.memory_file);
    }
    if (has("cpu")) v1_cpu(fields[1], path);
    if (has("cpu") && fields[1] != "cpu") v1_cpu("cpu", path);  // also mounted as plain "cpu" on some hosts
  }
  return limits;
}

int DefaultThreads(size_t allowed_cpus, double cpus) {
  int64_t n = static_cast<int64_t>(std::max<size_t>(1, allowed_cpus));
  if (cpus > 0) n = std::min<int64_t>(n, static_cast<int64_t>(std::ceil(cpus - 1e-9)));
  return static_cast<int>(std::max<int64_t>(1, n));
}

int UsableCpus() { return DefaultThreads(ThreadCpus().size(), ReadCgroupLimits().cpus); }

}  // namespace common
}  // namespace colibri
