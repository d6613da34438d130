// Metrics: the samples every component reports, for Prometheus text on /metrics and `gdkv stat`.
//
// A component appends samples to a vector in collect(); names are bare (the exposition adds the
// `gdkv_` prefix). Collecting takes no lock on any request path: components keep relaxed atomic
// counters and read them here. Thread-safe as far as each component's collect() is.
#pragma once

#include <atomic>
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
using MetricLabels = std::vector<std::pair<std::string, std::string>>;

// How every component writes its samples: each gets the writer's labels, then its own.
//   MetricWriter w(out, {{"backend", "memory"}});
//   w.counter("backend_ops_total", "ops submitted to the backend", ops_);  // a relaxed load
//   w.gauge("backend_keys", "keys stored", keys, {{"tier", "near"}});
class MetricWriter {
 public:
  explicit MetricWriter(MetricList& out, MetricLabels labels = {})
      : out_(out), labels_(std::move(labels)) {}

  void counter(const char* name, const char* help, double v, MetricLabels extra = {}) {
    add(name, help, MetricType::kCounter, v, std::move(extra));
  }
  void counter(const char* name, const char* help, const std::atomic<uint64_t>& v,
               MetricLabels extra = {}) {
    counter(name, help, load(v), std::move(extra));
  }
  void gauge(const char* name, const char* help, double v, MetricLabels extra = {}) {
    add(name, help, MetricType::kGauge, v, std::move(extra));
  }
  void gauge(const char* name, const char* help, const std::atomic<uint64_t>& v,
             MetricLabels extra = {}) {
    gauge(name, help, load(v), std::move(extra));
  }
  void add(const char* name, const char* help, MetricType type, double v, MetricLabels extra = {}) {
    Metric m{name, help, type, labels_, v};
    for (auto& l : extra) m.labels.push_back(std::move(l));
    out_.push_back(std::move(m));
  }

 private:
  static double load(const std::atomic<uint64_t>& v) {
    return static_cast<double>(v.load(std::memory_order_relaxed));
  }

  MetricList& out_;
  MetricLabels labels_;
};

}  // namespace gdkv
