#ifndef COLIBRI_COMMON_METRICS_H_
#define COLIBRI_COMMON_METRICS_H_

// Prometheus metrics on prometheus-cpp (Debian's prometheus-cpp-dev): a
// registry of counters, gauges and histograms with labels, looked up by name.
// Metric objects live as long as the registry; Get* returns the same object
// for the same name + labels. runtime::MetricsServer exposes the registry
// over HTTP. Thread-safe (prometheus-cpp's metrics are atomics; lookups take
// its registry's and families' mutexes).

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace colibri {
namespace common {

using Labels = std::map<std::string, std::string>;
using Counter = prometheus::Counter;      // Increment(v), Value()
using Gauge = prometheus::Gauge;          // Set(v), Increment(v), Value()
using Histogram = prometheus::Histogram;  // Observe(v)

class MetricsRegistry {
 public:
  MetricsRegistry() : registry_(std::make_shared<prometheus::Registry>()) {}

  // A name is one metric type; `help` is used the first time a name is seen.
  Counter* GetCounter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge* GetGauge(const std::string& name, const std::string& help, const Labels& labels = {});
  // `upper_bounds` (ascending; +Inf implied) is used the first time a name +
  // labels is seen.
  Histogram* GetHistogram(const std::string& name, const std::string& help, const Labels& labels,
                          const std::vector<double>& upper_bounds);

  // Every metric in the Prometheus text format (0.0.4).
  std::string Render() const;

  // What an exposer registers.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

 private:
  const std::shared_ptr<prometheus::Registry> registry_;
};

// Latency buckets in seconds, 100 µs to 10 s.
std::vector<double> LatencyBuckets();

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_METRICS_H_
