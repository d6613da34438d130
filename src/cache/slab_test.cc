#include "cache/slab.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>

namespace gdkv::cache {
namespace {

TEST(Slab, SizeClassesFitPowersOfTwoAndWasteLittle) {
  EXPECT_EQ(SlabAllocator::chunk_size(0), 64u);
  EXPECT_EQ(SlabAllocator::chunk_size(1), 64u);
  EXPECT_EQ(SlabAllocator::chunk_size(64), 64u);
  EXPECT_EQ(SlabAllocator::chunk_size(65), 80u);
  EXPECT_EQ(SlabAllocator::chunk_size(4096), 4096u);
  EXPECT_EQ(SlabAllocator::chunk_size(4097), 5120u);
  EXPECT_EQ(SlabAllocator::chunk_size(2u << 20), 2u << 20);
  for (size_t n = 1; n < (1u << 22); n = n * 9 / 8 + 1) {
    const size_t c = SlabAllocator::chunk_size(n);
    EXPECT_GE(c, n);
    if (n > 64) {
      EXPECT_LE(c, n + n / 4 + 1) << n;
    }
  }
}

// Pages are carved from arena regions the hook allocated; an empty page goes back to the arena,
// not to the hook, and the hook frees regions only when the allocator goes.
TEST(Slab, PagesComeFromHookRegionsAndStayPrepared) {
  struct Hooks {
    int allocs = 0, frees = 0;
    std::set<void*> live;
  } h;
  auto slab = SlabAllocator::create(
      [&](size_t n) {
        ++h.allocs;
        void* p = std::aligned_alloc(4096, n);
        h.live.insert(p);
        return p;
      },
      [&](void* p, size_t) {
        ++h.frees;
        h.live.erase(p);
        std::free(p);
      },
      64 * 1024, 256 * 1024);
  std::vector<std::shared_ptr<Buffer>> bufs;
  for (int i = 0; i < 64; ++i) {  // 64 x 4 KiB = 4 pages of 64 KiB = one 256 KiB region
    auto b = slab->allocate(4096);
    ASSERT_NE(b, nullptr);
    ASSERT_TRUE(b->from_slab());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data) % 4096, 0u);
    std::memset(b->data, i, 4096);
    bufs.push_back(b);
  }
  EXPECT_EQ(h.allocs, 1);
  EXPECT_EQ(slab->reserved_bytes(), 4u * 64 * 1024);
  EXPECT_EQ(slab->arena_bytes(), 256u * 1024);
  EXPECT_EQ(slab->chunk_bytes(), 64u * 4096);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(static_cast<int>(bufs[i]->data[4095]), i);
  bufs.clear();
  // One spare page stays for the class; the rest went back to the arena, not to the hook.
  EXPECT_EQ(h.frees, 0);
  EXPECT_EQ(slab->reserved_bytes(), 64u * 1024);
  EXPECT_EQ(slab->arena_bytes(), 256u * 1024);
  EXPECT_EQ(slab->chunk_bytes(), 0u);
  // Another class reuses those pages: no new region.
  for (int i = 0; i < 12; ++i) bufs.push_back(slab->allocate(16 * 1024));
  EXPECT_EQ(h.allocs, 1);
  EXPECT_EQ(slab->arena_growths(), 1u);
  bufs.clear();
  // Buffers keep the allocator alive: drop our handle first, then the last buffer.
  auto last = slab->allocate(100);
  slab.reset();
  last.reset();
  EXPECT_EQ(h.frees, h.allocs);
  EXPECT_TRUE(h.live.empty());
}

// With the default hook, 2 MiB values come from memory already faulted in, and a churn of new
// values (the cache's steady state: each new value replaces an evicted one) allocates nothing new.
TEST(Slab, DefaultPagesArePreparedAndRecycled) {
  auto slab = SlabAllocator::create(nullptr, nullptr, size_t{1} << 20);
  constexpr size_t kValue = size_t{2} << 20;
  std::vector<std::shared_ptr<Buffer>> live;
  for (int i = 0; i < 16; ++i) live.push_back(slab->allocate(kValue));  // 32 MiB
  live[0] = slab->allocate(kValue);  // a new value before the oldest goes: one page more
  const uint64_t arena = slab->arena_bytes();
  const uint64_t growths = slab->arena_growths();
  EXPECT_EQ(arena, SlabAllocator::kDefaultArenaStep);  // regions of 2, 2, 4, 8, 16 and 32 MiB
  rusage before{};
  ::getrusage(RUSAGE_SELF, &before);
  for (int i = 0; i < 200; ++i) {
    auto b = slab->allocate(kValue);
    ASSERT_NE(b, nullptr);
    ASSERT_TRUE(b->from_slab());
    std::memset(b->data, i, kValue);
    live[static_cast<size_t>(i + 1) % live.size()] = std::move(b);  // the oldest goes
  }
  rusage after{};
  ::getrusage(RUSAGE_SELF, &after);
  // 400 MiB written: 102400 faults with 4 KiB pages had each value been fresh memory.
  const long faults = after.ru_minflt - before.ru_minflt;
  std::printf("minor faults over 200 new 2 MiB slab values: %ld\n", faults);
  EXPECT_LT(faults, 200 * 8);
  EXPECT_EQ(slab->arena_bytes(), arena);
  EXPECT_EQ(slab->arena_growths(), growths);
}

TEST(Slab, FailingHookYieldsNull) {
  auto slab =
      SlabAllocator::create([](size_t) -> void* { return nullptr; }, [](void*, size_t) {}, 1 << 20);
  EXPECT_EQ(slab->allocate(4096), nullptr);
  auto heap = SlabAllocator::heap_buffer(10);
  ASSERT_NE(heap, nullptr);
  EXPECT_FALSE(heap->from_slab());
  EXPECT_EQ(heap->len, 10u);
}

TEST(Slab, RandomChurnKeepsChunksDistinct) {
  auto slab = SlabAllocator::create(nullptr, nullptr, 256 * 1024);
  std::mt19937 rng(5);
  std::vector<std::shared_ptr<Buffer>> live;
  for (int i = 0; i < 5000; ++i) {
    if (!live.empty() && rng() % 3 == 0) {
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(rng() % live.size()));
      continue;
    }
    const size_t n = 1 + rng() % 300000;
    auto b = slab->allocate(n);
    ASSERT_NE(b, nullptr);
    std::memset(b->data, 0xAB, n);  // ASan catches overlap with a neighbour's bounds
    live.push_back(b);
  }
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  for (auto& b : live) {
    const auto p = reinterpret_cast<uintptr_t>(b->data);
    ranges.emplace_back(p, p + b->len);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) EXPECT_LE(ranges[i - 1].second, ranges[i].first);
}

}  // namespace
}  // namespace gdkv::cache
