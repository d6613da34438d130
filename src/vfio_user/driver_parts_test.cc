// The client driver's parts on their own: its shared-memory allocator, its set of memory shared
// in place, and its wake-ups (the doorbell wake-up of a sleeping reactor, the IrqWaiter).
#include <gtest/gtest.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "gdkv/queue.h"
#include "vfio_user/in_place_set.h"
#include "vfio_user/nvme_defs.h"
#include "vfio_user/shm_allocator.h"
#include "vfio_user/wakeups.h"

namespace gdkv::vfio_user {
namespace {

using std::chrono::milliseconds;

// ---- ShmAllocator ----

class Shm : public ::testing::Test {
 protected:
  static constexpr size_t kSize = 64 * 1024;
  void SetUp() override { a_.init(mem_.data(), kSize); }
  std::byte* base() { return mem_.data(); }
  alignas(64) std::array<std::byte, kSize> mem_{};
  ShmAllocator a_;
};

TEST_F(Shm, BlocksAreAlignedInsideAndComeBackCoalesced) {
  std::vector<void*> got;
  for (int i = 0; i < 16; ++i) {
    void* p = a_.alloc(100 + i, 1);  // rounded up to 64-byte multiples, 64-byte aligned
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    EXPECT_TRUE(a_.contains(p, 100 + i));
    got.push_back(p);
  }
  EXPECT_FALSE(a_.contains(base() + kSize - 8, 16));  // runs past the end
  EXPECT_FALSE(a_.contains(mem_.data() - 64, 8));
  // Freed out of order, every block merges back: the whole region is one extent again.
  for (size_t i = 0; i < got.size(); i += 2) a_.free(got[i]);
  for (size_t i = 1; i < got.size(); i += 2) a_.free(got[i]);
  void* all = a_.alloc(kSize, 64);
  EXPECT_EQ(all, base());
  EXPECT_EQ(a_.alloc(64, 64), nullptr);  // full
  a_.free(all);
  a_.free(nullptr);  // nothing
}

TEST_F(Shm, AllocWaitGetsWhatAnotherThreadFrees) {
  void* all = a_.alloc(kSize, 64);
  ASSERT_NE(all, nullptr);
  std::thread t([&] {
    std::this_thread::sleep_for(milliseconds(50));
    a_.free(all);
  });
  const auto t0 = std::chrono::steady_clock::now();
  void* p = a_.alloc_wait(4096, 64, milliseconds(5000));
  t.join();
  EXPECT_EQ(p, base());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(4000));
  // More than the region can ever hold: at once, no wait.
  EXPECT_EQ(a_.alloc_wait(kSize + 1, 64, milliseconds(5000)), nullptr);
  // Full and nobody frees: the bounded wait ends empty.
  void* rest = a_.alloc(kSize - 4096, 64);
  ASSERT_NE(rest, nullptr);
  EXPECT_EQ(a_.alloc_wait(64, 64, milliseconds(20)), nullptr);
}

TEST_F(Shm, AllocUpToGivesTheLargestExtentNoShorterThanTheMinimum) {
  void* a = a_.alloc(kSize / 2, 64);
  void* b = a_.alloc(kSize / 4, 64);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  size_t got = 0;
  // kSize / 4 is free at the end: a request for more gets that much.
  void* p = a_.alloc_up_to(kSize, 1, false, milliseconds(0), &got);
  EXPECT_EQ(p, base() + kSize * 3 / 4);
  EXPECT_EQ(got, kSize / 4);
  a_.free(p);
  EXPECT_EQ(a_.alloc_up_to(kSize, kSize / 2, false, milliseconds(0), &got), nullptr);
  EXPECT_EQ(got, 0u);
  // The whole request where it fits.
  EXPECT_EQ(a_.alloc_up_to(1024, 1, false, milliseconds(0), &got), base() + kSize * 3 / 4);
  EXPECT_EQ(got, 1024u);
}

TEST_F(Shm, ShrinkGivesTheTailBack) {
  void* p = a_.alloc(kSize, 64);
  ASSERT_NE(p, nullptr);
  a_.shrink(p, 100);  // keeps 128 (a multiple of 64)
  void* q = a_.alloc(kSize - 128, 64);
  EXPECT_EQ(q, base() + 128);
  a_.shrink(q, kSize);  // keeping more than it has: nothing changes
  EXPECT_EQ(a_.alloc(64, 64), nullptr);
}

TEST_F(Shm, PoisonedHandsOutNothingAndWakesWaiters) {
  void* p = a_.alloc(kSize, 64);
  ASSERT_NE(p, nullptr);
  std::thread t([&] {
    std::this_thread::sleep_for(milliseconds(50));
    a_.poison();
  });
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(a_.alloc_wait(64, 64, milliseconds(5000)), nullptr);
  t.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(4000));
  a_.free(p);  // a no-op: a command may still write there
  EXPECT_EQ(a_.alloc(64, 64), nullptr);
  size_t got = 1;
  EXPECT_EQ(a_.alloc_up_to(64, 64, false, milliseconds(0), &got), nullptr);
  EXPECT_EQ(got, 0u);
}

// ---- InPlaceSet ----

TEST(InPlaceSet, SegmentsCountTheirSharesAndTouchingOnesJoin) {
  InPlaceSet s;
  EXPECT_FALSE(s.contains(reinterpret_cast<void*>(0x1000), 1));
  s.insert(0x10000, 0x1000);
  s.insert(0x11000, 0x1000);  // touches the first
  s.insert(0x20000, 0x1000);
  auto at = [](uint64_t a) { return reinterpret_cast<void*>(a); };
  EXPECT_TRUE(s.contains(at(0x10000), 0x2000));   // across the two touching segments
  EXPECT_FALSE(s.contains(at(0x10000), 0x2001));  // one byte past them
  EXPECT_FALSE(s.contains(at(0x11800), 0xF000));  // across the gap
  EXPECT_FALSE(s.contains(at(0xF000), 0x1001));   // starts before
  EXPECT_TRUE(s.contains(at(0x20800), 0x800));
  using Gaps = std::vector<std::pair<uint64_t, uint64_t>>;
  EXPECT_EQ(s.gaps(0xF000, 0x22000),
            (Gaps{{0xF000, 0x10000}, {0x12000, 0x20000}, {0x21000, 0x22000}}));
  EXPECT_EQ(s.gaps(0x10800, 0x11800), Gaps{});

  // Two shares over the first segment, one over the second: a segment goes with its last share.
  EXPECT_TRUE(s.count(0x10000, 0x11000, +1).empty());
  EXPECT_TRUE(s.count(0x10000, 0x12000, +1).empty());
  EXPECT_TRUE(s.count(0x20000, 0x21000, +1).empty());
  using Gone = std::vector<std::pair<uint64_t, uint64_t>>;
  EXPECT_EQ(s.count(0x10000, 0x12000, -1), (Gone{{0x11000, 0x1000}}));
  EXPECT_TRUE(s.contains(at(0x10000), 0x1000));
  EXPECT_FALSE(s.contains(at(0x11000), 1));
  EXPECT_EQ(s.count(0x10000, 0x11000, -1), (Gone{{0x10000, 0x1000}}));
  EXPECT_EQ(s.count(0x20000, 0x21000, -1), (Gone{{0x20000, 0x1000}}));
  EXPECT_FALSE(s.contains(at(0x20000), 1));
}

// ---- wake-ups ----

uint64_t drain(int fd) {
  uint64_t v = 0;
  return ::read(fd, &v, sizeof(v)) == sizeof(v) ? v : 0;
}

TEST(Wakeups, OnlyTheThreadThatFlipsTheWordSignalsTheDoorbell) {
  UniqueFd efd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  ASSERT_TRUE(efd.valid());
  alignas(8) uint32_t words[2] = {0, 0};  // the sleeping word, then the waker's CPU
  register_doorbell(&words[0], efd.get());
  (void)take_woke_reactor();

  wake_reactor(&words[0]);  // the reactor is awake: nothing to do
  EXPECT_EQ(drain(efd.get()), 0u);
  EXPECT_FALSE(take_woke_reactor());

  words[0] = 1;  // it sleeps
  wake_reactor(&words[0]);
  EXPECT_EQ(words[0], 0u);
  EXPECT_EQ(drain(efd.get()), 1u);
  EXPECT_GE(words[1], 1u);  // this thread's CPU word (2 + CPU, or 1)
  EXPECT_TRUE(take_woke_reactor());
  EXPECT_FALSE(take_woke_reactor());  // asked once

  unregister_doorbell(&words[0]);
  words[0] = 1;
  wake_reactor(&words[0]);  // no doorbell known for the word any more: the word still flips
  EXPECT_EQ(words[0], 0u);
  EXPECT_EQ(drain(efd.get()), 0u);
  (void)take_woke_reactor();
}

TEST(IrqWaiter, SpinsUntilSpinsStopPayingAndNotRightAfterAWakeUp) {
  alignas(8) uint32_t arm = 0;
  IrqWaiter w(UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)), &arm,
              std::chrono::microseconds(20));
  (void)take_woke_reactor();
  EXPECT_EQ(w.spin(), std::chrono::microseconds(20));
  for (uint32_t i = 0; i < IrqWaiter::kMissLimit; ++i) w.spun(false);
  int spins = 0;
  for (uint32_t i = 0; i < 2 * IrqWaiter::kRetrySpin; ++i) spins += w.spin().count() != 0;
  EXPECT_EQ(spins, 2);  // one wait in kRetrySpin looks again
  w.spun(true);         // a spin saw its completion: spinning pays again
  EXPECT_EQ(w.spin(), std::chrono::microseconds(20));

  alignas(8) uint32_t words[2] = {1, 0};
  wake_reactor(&words[0]);  // this thread woke a reactor: its next wait does not spin
  EXPECT_EQ(w.spin().count(), 0);
  EXPECT_EQ(w.spin(), std::chrono::microseconds(20));
}

TEST(IrqWaiter, BlockArmsTheQueueAndReturnsOnTheInterruptOrAfterItsBound) {
  const uint32_t depth = 8;
  const QueueLayout l = QueueLayout::for_depth(depth);
  void* block = std::aligned_alloc(4096, (l.total + 4095) / 4096 * 4096);
  ASSERT_NE(block, nullptr);
  std::memset(block, 0, l.total);
  const QueueRef q = QueueRef::over(block, depth, 1);
  UniqueFd efd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  const int fd = efd.get();
  alignas(8) uint32_t arm = 0;
  IrqWaiter w(std::move(efd), &arm, std::chrono::nanoseconds(0));

  // No completion and no interrupt: back after its bound (1 ms), having armed the queue.
  auto t0 = std::chrono::steady_clock::now();
  w.block(q, 0);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(500));
  EXPECT_GE(arm, 1u);

  // An interrupt: back at once, the eventfd read.
  const uint64_t one = 1;
  ASSERT_EQ(::write(fd, &one, sizeof(one)), static_cast<ssize_t>(sizeof(one)));
  t0 = std::chrono::steady_clock::now();
  w.block(q, 0);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(500));
  EXPECT_EQ(drain(fd), 0u);

  // Two threads: one sleeps on the eventfd, the other on the futex; both come back.
  std::atomic<int> back{0};
  std::thread a([&] {
    w.block(q, 0);
    back.fetch_add(1);
  });
  std::thread b([&] {
    w.block(q, 0);
    back.fetch_add(1);
  });
  a.join();
  b.join();
  EXPECT_EQ(back.load(), 2);
  std::free(block);
}

}  // namespace
}  // namespace gdkv::vfio_user
