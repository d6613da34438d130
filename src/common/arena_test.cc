#include "common/arena.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <vector>

namespace gdkv {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// Hooks that count regions, so a test can see when the arena grows and when it gives back.
struct Hooks {
  int allocs = 0, frees = 0;
  std::set<void*> live;
  Arena::Options options(size_t step, uint64_t limit = 0) {
    Arena::Options o;
    o.step_bytes = o.first_step_bytes = step;
    o.limit_bytes = limit;
    o.alloc = [this](size_t n) {
      ++allocs;
      void* p = std::aligned_alloc(4096, n);
      live.insert(p);
      return p;
    };
    o.free = [this](void* p, size_t) {
      ++frees;
      live.erase(p);
      std::free(p);
    };
    return o;
  }
};

TEST(Arena, GrowsInStepsAndReusesReleasedExtents) {
  Hooks h;
  {
    Arena a(h.options(8 * kMiB));
    std::vector<void*> v;
    for (int i = 0; i < 8; ++i) v.push_back(a.allocate(2 * kMiB));  // two regions of 8 MiB
    for (void* p : v) ASSERT_NE(p, nullptr);
    EXPECT_EQ(h.allocs, 2);
    EXPECT_EQ(a.reserved_bytes(), 16 * kMiB);
    EXPECT_EQ(a.used_bytes(), 16 * kMiB);
    // Churn: release and allocate again, many times; no region is added or given back.
    for (int round = 0; round < 100; ++round) {
      const size_t i = static_cast<size_t>(round) % v.size();
      a.release(v[i], 2 * kMiB);
      v[i] = a.allocate(2 * kMiB);
      ASSERT_NE(v[i], nullptr);
    }
    EXPECT_EQ(h.allocs, 2);
    EXPECT_EQ(h.frees, 0);
    EXPECT_EQ(a.regions_allocated(), 2u);
    for (void* p : v) a.release(p, 2 * kMiB);
    EXPECT_EQ(a.used_bytes(), 0u);
    EXPECT_EQ(a.reserved_bytes(), 16 * kMiB);  // kept, not returned page by page
    // Released neighbours merged: a whole region's worth fits again without growing.
    void* whole = a.allocate(8 * kMiB);
    EXPECT_NE(whole, nullptr);
    EXPECT_EQ(h.allocs, 2);
    a.release(whole, 8 * kMiB);
  }
  EXPECT_EQ(h.frees, 2);  // regions go back with the arena
  EXPECT_TRUE(h.live.empty());
}

TEST(Arena, RegionsDoubleFromTheFirstStepToTheStep) {
  Hooks h;
  Arena::Options o = h.options(16 * kMiB);
  o.first_step_bytes = 2 * kMiB;
  Arena a(std::move(o));
  std::vector<void*> v;
  for (int i = 0; i < 24; ++i) v.push_back(a.allocate(2 * kMiB));
  // 2, 2, 4, 8, 16, 16 MiB: 48 MiB in six regions.
  EXPECT_EQ(h.allocs, 6);
  EXPECT_EQ(a.reserved_bytes(), 48 * kMiB);
  for (void* p : v) a.release(p, 2 * kMiB);
}

TEST(Arena, LimitBoundsRegionsAndFreeRegionsMakeRoomForLargerRequests) {
  Hooks h;
  Arena a(h.options(4 * kMiB, 8 * kMiB));
  void* x = a.allocate(3 * kMiB);
  void* y = a.allocate(3 * kMiB);
  ASSERT_NE(x, nullptr);
  ASSERT_NE(y, nullptr);
  EXPECT_EQ(a.reserved_bytes(), 8 * kMiB);
  EXPECT_EQ(a.allocate(3 * kMiB), nullptr);  // full: the limit holds
  EXPECT_EQ(a.allocate(9 * kMiB), nullptr);  // larger than the limit
  // Both regions free, but a 6 MiB extent fits in neither: they go back for one that fits.
  a.release(x, 3 * kMiB);
  a.release(y, 3 * kMiB);
  void* z = a.allocate(6 * kMiB);
  ASSERT_NE(z, nullptr);
  EXPECT_LE(a.reserved_bytes(), 8 * kMiB);
  EXPECT_GE(h.frees, 1);
  a.release(z, 6 * kMiB);
}

TEST(Arena, BadSizesAndFailingHook) {
  Arena a(Arena::Options{});
  void* p = a.allocate(0);  // counts as one byte
  void* q = a.allocate(0);
  ASSERT_NE(p, nullptr);
  ASSERT_NE(q, nullptr);
  EXPECT_NE(p, q);
  EXPECT_EQ(a.used_bytes(), 128u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  a.release(q, 0);
  const uint64_t reserved = a.reserved_bytes();
  EXPECT_EQ(a.allocate(SIZE_MAX), nullptr);
  EXPECT_EQ(a.allocate(SIZE_MAX - 10), nullptr);
  // Sizes whose rounding to a region would wrap: refused before any region is made.
  EXPECT_EQ(a.allocate(SIZE_MAX - (size_t{64} << 20)), nullptr);
  EXPECT_EQ(a.allocate(SIZE_MAX - (size_t{1} << 20)), nullptr);
  EXPECT_EQ(a.reserved_bytes(), reserved);
  a.release(p, 0);
  a.release(nullptr, 10);
  EXPECT_EQ(a.used_bytes(), 0u);

  Arena::Options o;
  o.alloc = [](size_t) -> void* { return nullptr; };
  o.free = [](void*, size_t) {};
  Arena failing(o);
  EXPECT_EQ(failing.allocate(100), nullptr);
  EXPECT_EQ(failing.reserved_bytes(), 0u);
}

// The default regions are faulted in by the arena: writing an extent afterwards takes no page
// fault (getrusage's minor faults, this thread's process).
TEST(Arena, DefaultRegionsArePreparedBeforeUse) {
  Arena::Options o;
  o.first_step_bytes = o.step_bytes;
  Arena a(o);
  void* warm = a.allocate(1);  // grows the first 64 MiB region
  ASSERT_NE(warm, nullptr);
  const long before = [] {
    rusage u{};
    ::getrusage(RUSAGE_SELF, &u);
    return u.ru_minflt;
  }();
  std::vector<void*> v;
  for (int i = 0; i < 16; ++i) {
    void* p = a.allocate(2 * kMiB);
    ASSERT_NE(p, nullptr);
    std::memset(p, i, 2 * kMiB);
    v.push_back(p);
  }
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  // 32 MiB written: 8192 faults with 4 KiB pages had the memory been fresh. Under ASan its shadow
  // (a byte per eight) faults in on the first write: 1024 pages for 32 MiB, allowed for.
  long allowed = 64;
#if defined(__SANITIZE_ADDRESS__)
  allowed += (32 << 20) / 8 / 4096;
#endif
  EXPECT_LT(u.ru_minflt - before, allowed) << "faults while writing prepared memory";
  EXPECT_EQ(a.regions_allocated(), 1u);
  for (void* p : v) a.release(p, 2 * kMiB);
  a.release(warm, 1);
}

TEST(Arena, RandomChurnKeepsExtentsDistinct) {
  Hooks h;
  Arena a(h.options(kMiB, 16 * kMiB));
  std::mt19937 rng(7);
  struct Live {
    std::byte* p;
    size_t n;
  };
  std::vector<Live> live;
  for (int i = 0; i < 20000; ++i) {
    if (!live.empty() && rng() % 2 == 0) {
      const size_t k = rng() % live.size();
      a.release(live[k].p, live[k].n);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
      continue;
    }
    const size_t n = 1 + rng() % 300000;
    auto* p = static_cast<std::byte*>(a.allocate(n));
    if (p == nullptr) continue;  // full: the limit holds
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    std::memset(p, 0xAB, n);  // ASan catches a write past the region
    live.push_back({p, n});
  }
  EXPECT_LE(a.reserved_bytes(), 16 * kMiB);
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  for (const Live& l : live) {
    ranges.emplace_back(reinterpret_cast<uintptr_t>(l.p), reinterpret_cast<uintptr_t>(l.p) + l.n);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) EXPECT_LE(ranges[i - 1].second, ranges[i].first);
  for (const Live& l : live) a.release(l.p, l.n);
  EXPECT_EQ(a.used_bytes(), 0u);
}

}  // namespace
}  // namespace gdkv
