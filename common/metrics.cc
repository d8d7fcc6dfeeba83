#include "common/metrics.h"

#include "prometheus/text_serializer.h"

namespace colibri {
namespace common {

Counter* MetricsRegistry::GetCounter(const std::string& name, const std::string& help, const Labels& labels) {
  return &prometheus::BuildCounter().Name(name).Help(help).Register(*registry_).Add(labels);
}

Gauge* MetricsRegistry::GetGauge(const std::string& name, const std::string& help, const Labels& labels) {
  return &prometheus::BuildGauge().Name(name).Help(help).Register(*registry_).Add(labels);
}

Histogram* MetricsRegistry::GetHistogram(const std::string& name, const std::string& help, const Labels& labels,
                                         const std::vector<double>& upper_bounds) {
  return &prometheus::BuildHistogram().Name(name).Help(help).Register(*registry_).Add(labels, upper_bounds);
}

std::string MetricsRegistry::Render() const { return prometheus::TextSerializer().Serialize(registry_->Collect()); }

std::vector<double> LatencyBuckets() {
  return {1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0};
}

}  // namespace common
}  // namespace colibri
