// The reactor's staging pool: the buddy allocator alone, and a controller whose staging memory
// comes from one pool per reactor, allocated once however many commands stage.
#include "controller/staging_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/controller.h"
#include "gdkv/device.cuh"
#include "gdkv/key.h"

namespace gdkv {
namespace {

struct Arena {
  explicit Arena(size_t n) : bytes(n), p(static_cast<std::byte*>(std::aligned_alloc(4096, n))) {}
  ~Arena() { std::free(p); }
  size_t bytes;
  std::byte* p;
};

TEST(StagingPool, BlocksArePowersOfTwoInsideTheArena) {
  Arena a(1 << 20);
  StagingPool pool(a.p, a.bytes);
  std::byte* b1 = pool.alloc(1);
  std::byte* b2 = pool.alloc(4097);    // 8 KiB
  std::byte* b3 = pool.alloc(100000);  // 128 KiB
  ASSERT_TRUE(b1 && b2 && b3);
  EXPECT_EQ(pool.bytes_in_use(), 4096u + 8192u + 131072u);
  for (std::byte* b : {b1, b2, b3}) {
    EXPECT_TRUE(pool.owns(b));
    EXPECT_EQ((b - a.p) % 4096, 0);
  }
  EXPECT_EQ((b2 - a.p) % 8192, 0);
  EXPECT_EQ((b3 - a.p) % 131072, 0);
  // No overlap: fill each and check the others.
  std::memset(b1, 1, 4096);
  std::memset(b2, 2, 8192);
  std::memset(b3, 3, 131072);
  EXPECT_TRUE(std::all_of(b1, b1 + 4096, [](std::byte x) { return x == std::byte{1}; }));
  EXPECT_TRUE(std::all_of(b2, b2 + 8192, [](std::byte x) { return x == std::byte{2}; }));
  pool.free(b2);
  pool.free(b1);
  pool.free(b3);
  EXPECT_EQ(pool.bytes_in_use(), 0u);
  // Everything merged back: the whole arena is one block again.
  std::byte* all = pool.alloc(1 << 20);
  EXPECT_EQ(all, a.p);
  EXPECT_EQ(pool.alloc(1), nullptr);
  pool.free(all);
  EXPECT_EQ(pool.alloc((1 << 20) + 1), nullptr);  // larger than the pool
  EXPECT_EQ(pool.failed_allocs(), 2u);
  EXPECT_FALSE(pool.owns(a.p + a.bytes));
}

TEST(StagingPool, FullThenFreedInAnyOrderMergesBack) {
  Arena a(256 * 4096);
  StagingPool pool(a.p, a.bytes);
  std::vector<std::byte*> blocks;
  while (std::byte* b = pool.alloc(4096)) blocks.push_back(b);
  ASSERT_EQ(blocks.size(), 256u);
  std::mt19937 rng(5);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  for (std::byte* b : blocks) pool.free(b);
  EXPECT_EQ(pool.bytes_in_use(), 0u);
  EXPECT_EQ(pool.alloc(a.bytes), a.p);
}

TEST(StagingPool, RandomAllocFreeNeverOverlaps) {
  constexpr size_t kBytes = 4 << 20;
  Arena a(kBytes);
  StagingPool pool(a.p, kBytes);
  std::vector<uint16_t> owner(kBytes / 4096, 0);  // per 4 KiB page: which live block, 0 none
  struct Live {
    std::byte* p;
    size_t n;
    uint16_t id;
  };
  std::vector<Live> live;
  std::mt19937_64 rng(9);
  uint16_t next_id = 1;
  for (int i = 0; i < 20000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      const size_t n = 1 + rng() % (rng() % 4 == 0 ? (1 << 20) : 20000);
      std::byte* p = pool.alloc(n);
      if (p == nullptr) continue;
      const size_t rounded = std::max<size_t>(4096, std::bit_ceil(n));
      const size_t first = static_cast<size_t>(p - a.p) / 4096;
      ASSERT_LE(first * 4096 + rounded, kBytes);
      for (size_t pg = first; pg < first + rounded / 4096; ++pg) {
        ASSERT_EQ(owner[pg], 0) << "overlap at page " << pg;
        owner[pg] = next_id;
      }
      live.push_back({p, rounded, next_id});
      next_id = static_cast<uint16_t>(next_id % 60000 + 1);
    } else {
      const size_t k = rng() % live.size();
      const size_t first = static_cast<size_t>(live[k].p - a.p) / 4096;
      for (size_t pg = first; pg < first + live[k].n / 4096; ++pg) owner[pg] = 0;
      pool.free(live[k].p);
      live[k] = live.back();
      live.pop_back();
    }
  }
  for (const Live& l : live) pool.free(l.p);
  EXPECT_EQ(pool.bytes_in_use(), 0u);
  EXPECT_EQ(pool.alloc(kBytes), a.p);
}

Key key_of(uint32_t t, uint32_t i) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "sp%02u-%06u", t, i);
  return Key::from_bytes(buf, std::strlen(buf));
}

// Every staged command (List results up to 2 MiB, scatter descriptors and values) takes its
// memory from its reactor's pool: staging_alloc runs once per reactor, at start, and never again.
TEST(StagingPool, ControllerAllocatesOncePerReactor) {
  static std::atomic<uint32_t> allocs{0};
  static std::atomic<uint32_t> frees{0};
  allocs = 0;
  frees = 0;
  ControllerOptions o;
  o.reactors = 2;
  o.staging_pool_bytes = 8 << 20;
  o.staging_alloc = [](size_t n) {
    allocs.fetch_add(1);
    return std::aligned_alloc(4096, n);
  };
  o.staging_free = [](void* p, size_t) {
    frees.fetch_add(1);
    std::free(p);
  };
  auto ctl = std::make_unique<Controller>(make_memory_backend(), o);
  EXPECT_EQ(allocs.load(), 2u);
  constexpr uint32_t kThreads = 4;
  constexpr uint32_t kKeys = 40;
  std::vector<QueueRef> queues;
  for (uint32_t t = 0; t < kThreads; ++t) queues.push_back(ctl->create_queue({16, false}).value());
  std::atomic<uint32_t> failures{0};
  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const QueueRef& q = queues[t];
      std::mt19937_64 rng(t + 1);
      std::vector<std::byte> v(6000);
      for (auto& b : v) b = static_cast<std::byte>(rng());
      for (uint32_t i = 0; i < kKeys; ++i) {
        if (!device::put(q, key_of(t, i), v.data(), static_cast<uint32_t>(v.size())).ok()) {
          failures.fetch_add(1);
        }
      }
      std::vector<std::byte> list((2 << 20) + 100);
      std::vector<std::byte> x(3000), y(3000);
      for (uint32_t round = 0; round < 50; ++round) {
        // A List into a 2 MiB buffer (staged, larger than what a command keeps), and a small one.
        const uint32_t cap = round % 2 ? static_cast<uint32_t>(list.size()) : 200;
        CmdResult r = device::execute(q, device::make_list(key_of(t, 0), list.data(), cap));
        if (!r.ok() || r.dw0 == 0) failures.fetch_add(1);
        // Scatter: descriptors and the value are staged.
        struct {
          nvme::ScatterHeader h;
          nvme::ScatterEntry e[2];
        } desc{{2, 0},
               {{reinterpret_cast<uint64_t>(x.data()), 0, 3000},
                {reinterpret_cast<uint64_t>(y.data()), 3000, 3000}}};
        std::fill(x.begin(), x.end(), std::byte{0});
        std::fill(y.begin(), y.end(), std::byte{0});
        r = device::execute(
            q, device::make_scatter_retrieve(key_of(t, round % kKeys), &desc, sizeof(desc)));
        if (!r.ok() || !std::equal(x.begin(), x.end(), v.begin()) ||
            !std::equal(y.begin(), y.end(), v.begin() + 3000)) {
          failures.fetch_add(1);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0u);
  EXPECT_EQ(allocs.load(), 2u) << "no staging allocation per command";
  EXPECT_EQ(frees.load(), 0u);
  for (const QueueRef& q : queues) ctl->destroy_queue(q);
  ctl.reset();
  EXPECT_EQ(frees.load(), 2u);
}

}  // namespace
}  // namespace gdkv
