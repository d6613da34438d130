// Latency histograms with log-linear buckets (16 per power of two, ~6% relative error), from 1 ns
// to hours. Histogram is a plain value (merge, percentiles); HistogramRecorder is its concurrent
// twin: one writer thread records with relaxed atomics while others take snapshots.
#pragma once

#include <array>
#include <atomic>
#include <bit>
#include <cstdint>

namespace gdkv {

namespace detail {
inline constexpr uint32_t kHistBuckets = 976;
constexpr uint32_t hist_bucket(uint64_t v) noexcept {
  if (v < 32) return static_cast<uint32_t>(v);
  const uint32_t e = static_cast<uint32_t>(63 - std::countl_zero(v)) - 4;
  return e * 16 + static_cast<uint32_t>(v >> e);
}
constexpr uint64_t hist_lower(uint32_t idx) noexcept {
  if (idx < 32) return idx;
  const uint32_t e = idx / 16 - 1;
  return static_cast<uint64_t>(idx % 16 + 16) << e;
}
}  // namespace detail

class Histogram {
 public:
  void record(uint64_t v) noexcept {
    ++counts_[detail::hist_bucket(v)];
    ++count_;
    sum_ += v;
    if (v > max_) max_ = v;
  }
  void merge(const Histogram& o) noexcept {
    for (uint32_t i = 0; i < detail::kHistBuckets; ++i) counts_[i] += o.counts_[i];
    count_ += o.count_;
    sum_ += o.sum_;
    if (o.max_ > max_) max_ = o.max_;
  }
  uint64_t count() const noexcept { return count_; }
  uint64_t sum() const noexcept { return sum_; }
  uint64_t max() const noexcept { return max_; }
  double mean() const noexcept { return count_ ? static_cast<double>(sum_) / count_ : 0.0; }
  // The value at quantile q in [0, 1] (a bucket's lower bound; the max for q = 1).
  uint64_t percentile(double q) const noexcept {
    if (count_ == 0) return 0;
    if (q >= 1.0) return max_;
    uint64_t rank = static_cast<uint64_t>(q * static_cast<double>(count_));
    uint64_t seen = 0;
    for (uint32_t i = 0; i < detail::kHistBuckets; ++i) {
      seen += counts_[i];
      if (seen > rank) return detail::hist_lower(i);
    }
    return max_;
  }
  // Counts per bucket, and each bucket's lower bound: for Prometheus-style exposition.
  uint64_t bucket_count(uint32_t i) const noexcept { return counts_[i]; }
  static constexpr uint32_t buckets() noexcept { return detail::kHistBuckets; }
  static constexpr uint64_t bucket_lower(uint32_t i) noexcept { return detail::hist_lower(i); }

 private:
  friend class HistogramRecorder;
  std::array<uint64_t, detail::kHistBuckets> counts_{};
  uint64_t count_ = 0;
  uint64_t sum_ = 0;
  uint64_t max_ = 0;
};

class HistogramRecorder {
 public:
  // Single writer.
  void record(uint64_t v) noexcept {
    bump(counts_[detail::hist_bucket(v)], 1);
    bump(count_, 1);
    bump(sum_, v);
    if (v > max_.load(std::memory_order_relaxed)) max_.store(v, std::memory_order_relaxed);
  }
  Histogram snapshot() const noexcept {
    Histogram h;
    for (uint32_t i = 0; i < detail::kHistBuckets; ++i) {
      h.counts_[i] = counts_[i].load(std::memory_order_relaxed);
    }
    h.count_ = count_.load(std::memory_order_relaxed);
    h.sum_ = sum_.load(std::memory_order_relaxed);
    h.max_ = max_.load(std::memory_order_relaxed);
    return h;
  }

 private:
  static void bump(std::atomic<uint64_t>& a, uint64_t by) noexcept {
    a.store(a.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
  }
  std::array<std::atomic<uint64_t>, detail::kHistBuckets> counts_{};
  std::atomic<uint64_t> count_{0};
  std::atomic<uint64_t> sum_{0};
  std::atomic<uint64_t> max_{0};
};

}  // namespace gdkv
