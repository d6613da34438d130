#include <gtest/gtest.h>

#include <random>

#include "gdkv/histogram.h"

namespace gdkv {
namespace {

TEST(Histogram, BucketsAreMonotonicAndTight) {
  uint32_t prev = 0;
  for (uint64_t v = 0; v < 100000; v += 7) {
    uint32_t b = detail::hist_bucket(v);
    ASSERT_GE(b, prev);
    ASSERT_LE(Histogram::bucket_lower(b), v);
    ASSERT_LT(v - Histogram::bucket_lower(b), v / 16 + 1) << v;
    prev = b;
  }
  EXPECT_LT(detail::hist_bucket(~0ull), detail::kHistBuckets);
}

TEST(Histogram, Percentiles) {
  Histogram h;
  for (uint64_t v = 1; v <= 10000; ++v) h.record(v);
  EXPECT_NEAR(static_cast<double>(h.percentile(0.5)), 5000, 5000 * 0.07);
  EXPECT_NEAR(static_cast<double>(h.percentile(0.99)), 9900, 9900 * 0.07);
  EXPECT_EQ(h.percentile(1.0), 10000u);
  EXPECT_EQ(h.count(), 10000u);
  HistogramRecorder rec;
  for (uint64_t v = 1; v <= 10000; ++v) rec.record(v);
  Histogram s = rec.snapshot();
  EXPECT_EQ(s.percentile(0.5), h.percentile(0.5));
  s.merge(h);
  EXPECT_EQ(s.count(), 20000u);
}

}  // namespace
}  // namespace gdkv
