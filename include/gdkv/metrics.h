// Metrics: the samples every component reports, for Prometheus text on /metrics and `gdkv stat`.
//
// A component appends samples to a vector in collect(); names are bare (the exposition adds the
// `gdkv_` prefix). Collecting takes no lock on any request path: components keep relaxed atomic
// counters and read them here. Thread-safe as far as each component's collect() is.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace gdkv {

enum class MetricType : uint8_t { kCounter, kGauge };

struct Metric {
  std::string name;  // e.g. "backend_ops_total" (exposed as gdkv_backend_ops_total)
  std::string help;  // one line
  MetricType type = MetricType::kGauge;
  std::vector<std::pair<std::string, std::string>> labels;
  double value = 0;
};

using MetricList = std::vector<Metric>;

}  // namespace gdkv
