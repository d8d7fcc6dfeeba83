#ifndef COLIBRI_COMMON_METRICS_H_
#define COLIBRI_COMMON_METRICS_H_

// A small Prometheus metrics registry (text exposition format 0.0.4):
// counters, gauges and histograms with labels. Metric objects live as long
// as the registry; Get* returns the same object for the same name + labels.
// Thread-safe: updates are lock-free atomics, Get*/Render take a mutex.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"

namespace colibri {
namespace common {

using Labels = std::map<std::string, std::string>;

class Counter {
 public:
  void Add(double v = 1.0);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double v);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void Observe(double v);

 private:
  friend class MetricsRegistry;
  const std::vector<double> bounds_;                 // ascending; +Inf implied
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // per bucket (not cumulative), + the +Inf one
  std::atomic<double> sum_{0.0};
  std::atomic<uint64_t> count_{0};
};

class MetricsRegistry {
 public:
  Counter* GetCounter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge* GetGauge(const std::string& name, const std::string& help, const Labels& labels = {});
  // `upper_bounds` is used the first time a name is seen.
  Histogram* GetHistogram(const std::string& name, const std::string& help, const Labels& labels,
                          const std::vector<double>& upper_bounds);

  // Every metric in the Prometheus text format, sorted by name.
  std::string Render() const;

 private:
  struct Family {
    std::string help;
    std::string type;                                          // counter, gauge, histogram
    std::map<std::string, std::unique_ptr<Counter>> counters;  // key: rendered labels
    std::map<std::string, std::unique_ptr<Gauge>> gauges;
    std::map<std::string, std::unique_ptr<Histogram>> histograms;
  };
  Family& FamilyFor(const std::string& name, const std::string& help, const char* type)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable Mutex mu_;
  std::map<std::string, Family> families_ ABSL_GUARDED_BY(mu_);
};

// Latency buckets in seconds, 100 µs to 10 s.
std::vector<double> LatencyBuckets();

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_METRICS_H_
