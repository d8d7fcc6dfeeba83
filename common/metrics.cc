#include "common/metrics.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace colibri {
namespace common {
namespace {

void AtomicAdd(std::atomic<double>* target, double v) {
  double current = target->load(std::memory_order_relaxed);
  while (!target->compare_exchange_weak(current, current + v, std::memory_order_relaxed)) {
  }
}

// {a="x",b="y"} with values escaped as the text format requires; "" if none.
std::string RenderLabels(const Labels& labels, const std::string& extra = "") {
  std::string out;
  for (const auto& [k, v] : labels) {
    absl::StrAppend(&out, out.empty() ? "" : ",", k, "=\"",
                    absl::StrReplaceAll(v, {{"\\", "\\\\"}, {"\"", "\\\""}, {"\n", "\\n"}}), "\"");
  }
  if (!extra.empty()) absl::StrAppend(&out, out.empty() ? "" : ",", extra);
  return out.empty() ? "" : absl::StrCat("{", out, "}");
}

std::string Number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return absl::StrCat(v);
}

}  // namespace

void Counter::Add(double v) { AtomicAdd(&value_, v); }
void Gauge::Add(double v) { AtomicAdd(&value_, v); }

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0);
}

void Histogram::Observe(double v) {
  const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  counts_[bucket].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(&sum_, v);
  count_.fetch_add(1, std::memory_order_relaxed);
}

MetricsRegistry::Family& MetricsRegistry::FamilyFor(const std::string& name, const std::string& help,
                                                    const char* type) {
  Family& f = families_[name];
  if (f.type.empty()) {
    f.help = help;
    f.type = type;
  }
  return f;
}

Counter* MetricsRegistry::GetCounter(const std::string& name, const std::string& help, const Labels& labels) {
  MutexLock lock(&mu_);
  auto& slot = FamilyFor(name, help, "counter").counters[RenderLabels(labels)];
  if (slot == nullptr) slot = std::make_unique<Counter>();
  return slot.get();
}

Gauge* MetricsRegistry::GetGauge(const std::string& name, const std::string& help, const Labels& labels) {
  MutexLock lock(&mu_);
  auto& slot = FamilyFor(name, help, "gauge").gauges[RenderLabels(labels)];
  if (slot == nullptr) slot = std::make_unique<Gauge>();
  return slot.get();
}

Histogram* MetricsRegistry::GetHistogram(const std::string& name, const std::string& help, const Labels& labels,
                                         const std::vector<double>& upper_bounds) {
  MutexLock lock(&mu_);
  Family& f = FamilyFor(name, help, "histogram");
  auto& slot = f.histograms[RenderLabels(labels)];
  if (slot == nullptr) slot = std::make_unique<Histogram>(upper_bounds);
  return slot.get();
}

std::string MetricsRegistry::Render() const {
  MutexLock lock(&mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    absl::StrAppend(&out, "# HELP ", name, " ", f.help, "\n# TYPE ", name, " ", f.type, "\n");
    for (const auto& [labels, c] : f.counters) absl::StrAppend(&out, name, labels, " ", Number(c->value()), "\n");
    for (const auto& [labels, g] : f.gauges) absl::StrAppend(&out, name, labels, " ", Number(g->value()), "\n");
    for (const auto& [labels, h] : f.histograms) {
      // Re-open the rendered label set to add "le".
      const std::string inner = labels.empty() ? "" : labels.substr(1, labels.size() - 2);
      auto with_le = [&](const std::string& le) {
        return absl::StrCat("{", inner, inner.empty() ? "" : ",", "le=\"", le, "\"}");
      };
      uint64_t cumulative = 0;
      for (size_t i = 0; i <= h->bounds_.size(); ++i) {
        cumulative += h->counts_[i].load(std::memory_order_relaxed);
        const std::string le = i < h->bounds_.size() ? Number(h->bounds_[i]) : "+Inf";
        absl::StrAppend(&out, name, "_bucket", with_le(le), " ", cumulative, "\n");
      }
      absl::StrAppend(&out, name, "_sum", labels, " ", Number(h->sum_.load()), "\n");
      absl::StrAppend(&out, name, "_count", labels, " ", h->count_.load(), "\n");
    }
  }
  return out;
}

std::vector<double> LatencyBuckets() {
  return {1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0};
}

}  // namespace common
}  // namespace colibri
