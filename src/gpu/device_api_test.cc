// The device API (gdkv/device.cuh) compiled as host code and driven by many CPU threads against an
// in-process controller with the memory backend and the host copy engine: the same submission and
// completion code GPU threads run. The warp algorithm runs over a group of CPU threads with the
// warp's five operations (ballot, shfl, ...), so the batch path is tested here too.
#include "gdkv/device.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/controller.h"
#include "gdkv/copy_engine.h"
#include "gdkv/key.h"
#include "gpu/region_cache.h"
#include "gpu/split_queue.h"

namespace gdkv {
namespace {

using nvme::Status;
constexpr std::byte kPoison{0xA5};

Key key_of(uint32_t owner, uint32_t i) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "k%03u-%06u", owner, i);
  return Key::from_bytes(buf, std::strlen(buf));
}

std::vector<std::byte> random_value(std::mt19937_64& rng, size_t max_len) {
  std::vector<std::byte> v(rng() % (max_len + 1));
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

// Lanes of a simulated warp: CPU threads that meet at a barrier for every collective operation.
// The group is the lanes at the set bits of `mask` (any of 64), as a GPU warp group formed from a
// mask: a sparse mask has lanes that are not 0..n-1.
class CpuLanes {
 public:
  explicit CpuLanes(uint64_t mask)
      : mask_(mask), barrier_(static_cast<ptrdiff_t>(std::popcount(mask))), vals_(64) {}
  // The first `n` lanes.
  static uint64_t first(uint32_t n) { return n == 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1; }
  uint64_t mask() const { return mask_; }
  // The lane ids of the group, lowest first.
  std::vector<uint32_t> lanes() const {
    std::vector<uint32_t> v;
    for (uint32_t i = 0; i < 64; ++i) {
      if (mask_ >> i & 1) v.push_back(i);
    }
    return v;
  }
  // Every lane a shfl read from (the batch leaders), in any order.
  std::vector<uint32_t> shfl_sources() const {
    std::lock_guard lk(mu_);
    return sources_;
  }

 private:
  friend class CpuGroup;
  uint64_t mask_;
  std::barrier<> barrier_;
  std::vector<uint64_t> vals_;  // by lane id
  mutable std::mutex mu_;
  std::vector<uint32_t> sources_;
};

// One lane's view: the Group interface of device.cuh.
class CpuGroup {
 public:
  CpuGroup(CpuLanes& lanes, uint32_t lane) : s_(lanes), lane_(lane) {}
  uint64_t mask() const { return s_.mask_; }
  uint32_t lane() const { return lane_; }
  uint64_t ballot(bool p) const {
    s_.vals_[lane_] = p ? 1 : 0;
    s_.barrier_.arrive_and_wait();
    uint64_t m = 0;
    for (uint32_t i = 0; i < 64; ++i) {
      if (s_.mask_ >> i & 1) m |= s_.vals_[i] << i;
    }
    s_.barrier_.arrive_and_wait();
    return m;
  }
  uint32_t shfl(uint32_t v, uint32_t src_lane) const {
    if (lane_ == src_lane) {
      std::lock_guard lk(s_.mu_);
      s_.sources_.push_back(src_lane);
    }
    s_.vals_[lane_] = v;
    s_.barrier_.arrive_and_wait();
    const auto r = static_cast<uint32_t>(s_.vals_[src_lane]);
    s_.barrier_.arrive_and_wait();
    return r;
  }
  void sync() const { s_.barrier_.arrive_and_wait(); }

 private:
  CpuLanes& s_;
  uint32_t lane_;
};

class DeviceApiTest : public ::testing::Test {
 protected:
  void start(uint32_t reactors = 2, uint32_t namespaces = 2) {
    ControllerOptions o;
    o.reactors = reactors;
    o.namespaces = namespaces;
    ctl_ = std::make_unique<Controller>(make_memory_backend(), o);
  }
  QueueRef queue(uint32_t depth, bool strict = false) {
    QueueOptions qo;
    qo.depth = depth;
    qo.strict_regions = strict;
    return ctl_->create_queue(qo).value();
  }
  void TearDown() override { ctl_.reset(); }

  std::unique_ptr<Controller> ctl_;
};

// Many threads, one queue each and one shared queue: every opcode device.cuh has a helper for,
// random values, poisoned destinations, every byte compared.
TEST_F(DeviceApiTest, ThreadsPutGetExistsDelete) {
  start();
  const QueueRef shared = queue(64);
  constexpr uint32_t kThreads = 8;
  constexpr uint32_t kKeys = 300;
  constexpr size_t kMaxValue = 9000;
  std::atomic<uint32_t> failures{0};
  std::vector<std::thread> threads;
  std::vector<QueueRef> own;
  for (uint32_t t = 0; t < kThreads; ++t) own.push_back(queue(t % 2 ? 8 : 32));
  for (uint32_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t * 7919 + 1);
      auto expect = [&](bool cond, const char* what, uint32_t i) {
        if (!cond) {
          if (failures.fetch_add(1) < 10)
            ADD_FAILURE() << what << " (thread " << t << ", key " << i << ")";
        }
      };
      std::vector<std::byte> dst(kMaxValue + 64);
      for (uint32_t i = 0; i < kKeys; ++i) {
        const QueueRef& q = (i % 3 == 0) ? shared : own[t];
        const Key k = key_of(t, i);
        const std::vector<std::byte> v = random_value(rng, kMaxValue);
        CmdResult r = device::put(q, k, v.data(), static_cast<uint32_t>(v.size()));
        expect(r.ok(), "put", i);
        r = device::put(q, k, v.data(), static_cast<uint32_t>(v.size()), nvme::kStoreMustNotExist);
        expect(r.status == Status::kKeyExists, "put must-not-exist on an existing key", i);

        std::fill(dst.begin(), dst.end(), kPoison);
        r = device::get(q, k, dst.data(), static_cast<uint32_t>(kMaxValue));
        expect(r.ok() && r.dw0 == v.size(), "get", i);
        expect(std::equal(v.begin(), v.end(), dst.begin()), "value bytes", i);
        expect(std::all_of(dst.begin() + static_cast<ptrdiff_t>(v.size()), dst.end(),
                           [](std::byte b) { return b == kPoison; }),
               "bytes past the value untouched", i);

        // A short buffer gets the first bytes, success, and the full length in DW0.
        const uint32_t cap = static_cast<uint32_t>(v.size() / 2);
        std::fill(dst.begin(), dst.end(), kPoison);
        r = device::get(q, k, dst.data(), cap);
        expect(r.ok() && r.dw0 == v.size(), "short get", i);
        expect(std::equal(v.begin(), v.begin() + cap, dst.begin()) && dst[cap] == kPoison,
               "short get bytes", i);

        expect(device::exists(q, k).ok(), "exists", i);
        if (i % 2 == 0) {
          expect(device::del(q, k).ok(), "delete", i);
          expect(device::exists(q, k).status == Status::kKeyNotExist, "exists after delete", i);
          expect(device::get(q, k, dst.data(), 16).status == Status::kKeyNotExist,
                 "get after delete", i);
          expect(device::del(q, k).status == Status::kKeyNotExist, "delete twice", i);
          r = device::put(q, k, v.data(), static_cast<uint32_t>(v.size()), nvme::kStoreMustExist);
          expect(r.status == Status::kKeyNotExist, "put must-exist on a missing key", i);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0u);
}

// The split API: fill the queue (depth - 1 in flight, then back-pressure), then reap them all.
TEST_F(DeviceApiTest, SplitSubmitBackPressureAndPoll) {
  start(1);
  constexpr uint32_t kDepth = 16;
  const QueueRef q = queue(kDepth);
  std::vector<std::vector<std::byte>> values;
  std::mt19937_64 rng(42);
  for (uint32_t i = 0; i < 100; ++i) {
    values.push_back(random_value(rng, 3000));
    ASSERT_TRUE(
        device::put(q, key_of(900, i), values[i].data(), static_cast<uint32_t>(values[i].size()))
            .ok());
  }
  std::vector<std::vector<std::byte>> dst(100, std::vector<std::byte>(3000, kPoison));
  uint32_t next = 0;
  while (next < 100) {
    std::vector<std::pair<uint32_t, uint16_t>> inflight;
    uint16_t cid = 0;
    while (next < 100 &&
           device::try_submit(q, device::make_retrieve(key_of(900, next), dst[next].data(), 3000),
                              &cid)) {
      inflight.emplace_back(next++, cid);
    }
    // At most depth - 1 commands in flight; the queue pushes back after that.
    ASSERT_LE(inflight.size(), kDepth - 1);
    if (next < 100) {
      ASSERT_EQ(inflight.size(), kDepth - 1);
    }
    for (auto [i, c] : inflight) {
      while (!device::poll(q, c)) {
      }
      const CmdResult r = device::wait(q, c);
      ASSERT_TRUE(r.ok());
      ASSERT_EQ(r.dw0, values[i].size());
      ASSERT_TRUE(std::equal(values[i].begin(), values[i].end(), dst[i].begin())) << i;
    }
  }
}

// The warp algorithm over CPU thread groups: partial batches (a tiny queue, several groups on it,
// some lanes inactive), one ticket grab and one doorbell per round.
TEST_F(DeviceApiTest, GroupExecuteBatches) {
  start(2);
  const QueueRef q = queue(8);  // 7 credits for 4 groups of 8 lanes: rounds take what they get
  constexpr uint32_t kGroups = 4;
  constexpr uint32_t kLanes = 8;
  constexpr uint32_t kRounds = 40;
  std::atomic<uint32_t> failures{0};
  std::vector<std::unique_ptr<CpuLanes>> groups;
  for (uint32_t g = 0; g < kGroups; ++g) {
    groups.push_back(std::make_unique<CpuLanes>(CpuLanes::first(kLanes)));
  }
  std::vector<std::thread> threads;
  for (uint32_t g = 0; g < kGroups; ++g) {
    for (uint32_t l = 0; l < kLanes; ++l) {
      threads.emplace_back([&, g, l] {
        const CpuGroup grp(*groups[g], l);
        std::mt19937_64 rng(g * 100 + l);
        std::vector<std::byte> dst(2100);
        auto expect = [&](bool cond, const char* what, uint32_t i) {
          if (!cond && failures.fetch_add(1) < 10) {
            ADD_FAILURE() << what << " (group " << g << ", lane " << l << ", round " << i << ")";
          }
        };
        for (uint32_t i = 0; i < kRounds; ++i) {
          const bool active = (i + l) % 5 != 0;
          const Key k = key_of(g * kLanes + l, i);
          const std::vector<std::byte> v = random_value(rng, 2048);
          CmdResult r = device::group_execute(
              grp, q, device::make_store(k, v.data(), static_cast<uint32_t>(v.size())), active);
          expect(!active || r.ok(), "group put", i);
          std::fill(dst.begin(), dst.end(), kPoison);
          r = device::group_execute(grp, q, device::make_retrieve(k, dst.data(), 2100), active);
          if (active) {
            expect(r.ok() && r.dw0 == v.size(), "group get", i);
            expect(std::equal(v.begin(), v.end(), dst.begin()) && dst[v.size()] == kPoison,
                   "group get bytes", i);
          } else {
            expect(dst[0] == kPoison, "inactive lane untouched", i);
          }
          r = device::group_execute(grp, q, device::make_exist(k), true);
          expect(active ? r.ok() : r.status == Status::kKeyNotExist, "group exists", i);
          r = device::group_execute(grp, q, device::make_delete(k), active && i % 2 == 0);
          expect(!(active && i % 2 == 0) || r.ok(), "group delete", i);
        }
      });
    }
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0u);
}

// A group formed from a sparse, non-contiguous mask (no lane 0, gaps, lanes up to 63), as a warp
// group in one branch of a divergent if: the leader that takes the tickets and rings is the lowest
// lane of the batch, a lane of the mask, never lane 0. Two such groups share a queue.
TEST_F(DeviceApiTest, GroupExecuteSparseMask) {
  start(2);
  const QueueRef q = queue(64);  // deep enough that every lane of both groups gets a credit
  const uint64_t masks[2] = {0x8000'0400'0030'0940ull, 0x0000'2000'0800'0006ull};
  constexpr uint32_t kRounds = 30;
  std::atomic<uint32_t> failures{0};
  std::vector<std::unique_ptr<CpuLanes>> groups;
  for (uint64_t m : masks) groups.push_back(std::make_unique<CpuLanes>(m));
  std::vector<std::thread> threads;
  for (uint32_t g = 0; g < 2; ++g) {
    for (uint32_t l : groups[g]->lanes()) {
      threads.emplace_back([&, g, l] {
        const CpuGroup grp(*groups[g], l);
        std::mt19937_64 rng(g * 1000 + l);
        std::vector<std::byte> dst(1100);
        auto expect = [&](bool cond, const char* what, uint32_t i) {
          if (!cond && failures.fetch_add(1) < 10) {
            ADD_FAILURE() << what << " (group " << g << ", lane " << l << ", round " << i << ")";
          }
        };
        for (uint32_t i = 0; i < kRounds; ++i) {
          const Key k = key_of(800 + g * 64 + l, i);
          const std::vector<std::byte> v = random_value(rng, 1024);
          CmdResult r = device::group_execute(
              grp, q, device::make_store(k, v.data(), static_cast<uint32_t>(v.size())), true);
          expect(r.ok(), "sparse group put", i);
          std::fill(dst.begin(), dst.end(), kPoison);
          r = device::group_execute(grp, q, device::make_retrieve(k, dst.data(), 1100), true);
          expect(r.ok() && r.dw0 == v.size() && std::equal(v.begin(), v.end(), dst.begin()) &&
                     dst[v.size()] == kPoison,
                 "sparse group get", i);
        }
      });
    }
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0u);
  for (uint32_t g = 0; g < 2; ++g) {
    const std::vector<uint32_t> src = groups[g]->shfl_sources();
    const uint32_t lowest = groups[g]->lanes().front();
    ASSERT_NE(lowest, 0u);
    EXPECT_EQ(src.size(), 2u * kRounds) << "one batch per call: every lane got a credit";
    EXPECT_TRUE(std::all_of(src.begin(), src.end(), [&](uint32_t s) { return s == lowest; }))
        << "group " << g << ": the leader is the lowest lane of the mask (" << lowest << ")";
  }
}

// The same sparse group with its lowest lanes inactive: the leader moves to the lowest lane that
// has a request, still a lane of the mask.
TEST_F(DeviceApiTest, GroupExecuteSparseMaskLeaderSkipsInactiveLanes) {
  start(1);
  const QueueRef q = queue(32);
  const uint64_t mask = 0x0001'0000'0024'0a00ull;  // lanes 9, 11, 18, 21, 48
  CpuLanes group(mask);
  const std::vector<uint32_t> lanes = group.lanes();
  std::atomic<uint32_t> failures{0};
  std::vector<std::thread> threads;
  for (uint32_t l : lanes) {
    threads.emplace_back([&, l] {
      const CpuGroup grp(group, l);
      const bool active = l >= 18;  // lanes 9 and 11 have nothing to do
      const Key k = key_of(950, l);
      const uint8_t byte = static_cast<uint8_t>(l);
      CmdResult r = device::group_execute(grp, q, device::make_store(k, &byte, 1), active);
      if (active && !r.ok()) failures.fetch_add(1);
      r = device::group_execute(grp, q, device::make_exist(k), true);
      if (active ? !r.ok() : r.status != Status::kKeyNotExist) failures.fetch_add(1);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0u);
  EXPECT_EQ(group.shfl_sources(), (std::vector<uint32_t>{18, 9}));
}

TEST_F(DeviceApiTest, ListScatterRetrieveAndPrefetch) {
  start(1, 3);
  const QueueRef q = queue(32);
  constexpr uint32_t ns = 3;
  std::vector<Key> keys;
  for (uint32_t i = 0; i < 20; ++i) keys.push_back(key_of(500, 19 - i));
  for (const Key& k : keys) {
    ASSERT_TRUE(device::put(q, k, k.bytes, k.len, 0, ns).ok());
  }
  std::sort(keys.begin(), keys.end());

  // List from the 6th key on, into a buffer that fits 10 entries.
  const uint32_t entry = nvme::key_list_entry_size(keys[0].len);
  std::vector<std::byte> list(sizeof(nvme::KeyListHeader) + 10 * entry + 3, kPoison);
  CmdResult r = device::execute(
      q, device::make_list(keys[5], list.data(), static_cast<uint32_t>(list.size()), ns));
  ASSERT_TRUE(r.ok()) << nvme::status_name(r.status);
  uint32_t count = 0;
  std::memcpy(&count, list.data(), 4);
  ASSERT_EQ(count, 10u);
  for (uint32_t i = 0; i < count; ++i) {
    const std::byte* e = list.data() + 4 + i * entry;
    uint16_t len = 0;
    std::memcpy(&len, e, 2);
    ASSERT_EQ(Key::from_bytes(e + 2, len), keys[5 + i]);
  }
  EXPECT_EQ(r.dw0, 10u);
  // List from the first key: start at the smallest key there is.
  const uint8_t zero = 0;
  r = device::execute(q, device::make_list(Key::from_bytes(&zero, 1), list.data(), 4 + entry, ns));
  ASSERT_TRUE(r.ok()) << nvme::status_name(r.status);
  EXPECT_EQ(r.dw0, 1u);
  uint16_t len0 = 0;
  std::memcpy(&len0, list.data() + 4, 2);
  EXPECT_EQ(Key::from_bytes(list.data() + 6, len0), keys[0]);

  // Scatter: one 3000-byte value into three places, the way one block lands in per-layer slots.
  std::mt19937_64 rng(7);
  std::vector<std::byte> v(3000);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  const Key sk = key_of(501, 0);
  ASSERT_TRUE(device::put(q, sk, v.data(), 3000, 0, ns).ok());
  std::vector<std::byte> a(1000, kPoison), b(1000, kPoison), c(1200, kPoison);
  struct {
    nvme::ScatterHeader h;
    nvme::ScatterEntry e[3];
  } desc{{3, 0},
         {{reinterpret_cast<uint64_t>(a.data()), 2000, 1000},
          {reinterpret_cast<uint64_t>(b.data()), 0, 1000},
          {reinterpret_cast<uint64_t>(c.data()), 1800, 1200}}};
  r = device::execute(q, device::make_scatter_retrieve(sk, &desc, sizeof(desc), ns));
  ASSERT_TRUE(r.ok()) << nvme::status_name(r.status);
  EXPECT_EQ(r.dw0, 3000u);
  EXPECT_TRUE(std::equal(a.begin(), a.end(), v.begin() + 2000));
  EXPECT_TRUE(std::equal(b.begin(), b.end(), v.begin()));
  EXPECT_TRUE(std::equal(c.begin(), c.end(), v.begin() + 1800));

  // Prefetch: a key list in List's layout; the memory backend treats it as a hint.
  std::vector<std::byte> pf(4 + 2 * entry);
  const uint32_t two = 2;
  std::memcpy(pf.data(), &two, 4);
  for (uint32_t i = 0; i < 2; ++i) {
    const uint16_t l = keys[i].len;
    std::memcpy(pf.data() + 4 + i * entry, &l, 2);
    std::memcpy(pf.data() + 6 + i * entry, keys[i].bytes, l);
  }
  r = device::execute(q, device::make_prefetch(pf.data(), static_cast<uint32_t>(pf.size()), ns));
  EXPECT_TRUE(r.ok()) << nvme::status_name(r.status);
}

// The layout DeviceQueue builds: the controller's block keeps the rings and doorbells, the
// requesters' bookkeeping lives in a separate block (device memory on a GPU). The controller's own
// bookkeeping area is poisoned, so this fails if the controller reads anything but sq, cq and db.
TEST_F(DeviceApiTest, SplitLayoutControllerTouchesOnlyRingsAndDoorbells) {
  start(2);
  constexpr uint32_t kDepth = 64;
  const QueueRef host = queue(kDepth);
  const QueueLayout l = QueueLayout::for_depth(kDepth);
  std::memset(host.sq_seq, 0xEE, l.doorbells - l.sq_seq);  // sq_seq .. QueueControl
  const size_t bytes = gpu::control_bytes(kDepth);
  auto* control = static_cast<unsigned char*>(std::aligned_alloc(64, (bytes + 63) & ~size_t{63}));
  ASSERT_NE(control, nullptr);
  std::memset(control, 0, bytes);
  const QueueRef q = gpu::with_control(host, control);
  ASSERT_EQ(q.sq, host.sq);
  ASSERT_EQ(q.cq, host.cq);
  ASSERT_EQ(q.db, host.db);

  std::atomic<uint32_t> failures{0};
  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t + 100);
      std::vector<std::byte> dst(1100);
      for (uint32_t i = 0; i < 200; ++i) {
        const Key k = key_of(700 + t, i);
        const std::vector<std::byte> v = random_value(rng, 1024);
        bool ok = device::put(q, k, v.data(), static_cast<uint32_t>(v.size())).ok();
        std::fill(dst.begin(), dst.end(), kPoison);
        const CmdResult r = device::get(q, k, dst.data(), 1100);
        ok = ok && r.ok() && r.dw0 == v.size() && std::equal(v.begin(), v.end(), dst.begin()) &&
             dst[v.size()] == kPoison;
        ok = ok && device::del(q, k).ok() && device::exists(q, k).status == Status::kKeyNotExist;
        if (!ok) failures.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0u);
  // The controller's copy of the bookkeeping was never written either.
  const auto* area = reinterpret_cast<const unsigned char*>(host.sq_seq);
  EXPECT_TRUE(std::all_of(area, area + (l.doorbells - l.sq_seq),
                          [](unsigned char b) { return b == 0xEE; }));
  ctl_->destroy_queue(host);
  std::free(control);
}

TEST_F(DeviceApiTest, BadInputGetsAStatus) {
  start(1);
  const QueueRef q = queue(16);
  std::byte buf[64];
  Key none;  // length 0
  EXPECT_EQ(device::get(q, none, buf, 64).status, Status::kInvalidKeySize);
  Key too_long = key_of(1, 1);
  too_long.len = 17;
  EXPECT_EQ(device::put(q, too_long, buf, 64).status, Status::kInvalidKeySize);
  EXPECT_EQ(device::exists(q, key_of(1, 1), 0).status, Status::kInvalidNamespace);
  EXPECT_EQ(device::exists(q, key_of(1, 1), 9).status, Status::kInvalidNamespace);
  nvme::Sqe bad = device::make_exist(key_of(1, 1));
  bad.opcode = 0x7F;
  EXPECT_EQ(device::execute(q, bad).status, Status::kInvalidOpcode);
  EXPECT_EQ(device::put(q, key_of(1, 1), buf, 64, nvme::kStoreMustExist | nvme::kStoreMustNotExist)
                .status,
            Status::kInvalidField);
}

// Strict queues accept only registered memory: out-of-range data pointers fail with a status and
// no byte outside the registered region moves. A region registered as device memory reaches the
// copy engine as such (the host engine refuses it with 04h).
TEST_F(DeviceApiTest, RegisteredRegionsAreEnforced) {
  start(2);
  const QueueRef q = queue(32, /*strict=*/true);
  std::vector<std::byte> arena(3 * 4096, kPoison);
  std::byte* region = arena.data() + 4096;  // [4096, 8192) registered; the rest is a guard
  ASSERT_TRUE(ctl_->register_memory(region, 4096, MemKind::kHost));
  std::byte* fake_device = arena.data() + 2 * 4096 + 1024;
  ASSERT_TRUE(ctl_->register_memory(fake_device, 1024, MemKind::kDevice));

  std::mt19937_64 rng(3);
  std::vector<std::byte> v(2000);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  std::memcpy(region, v.data(), v.size());
  const Key k = key_of(2, 2);
  ASSERT_TRUE(device::put(q, k, region, 2000).ok());  // source inside the region: fine
  std::fill(region, region + 4096, kPoison);

  constexpr int kThreads = 4;
  std::atomic<uint32_t> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        auto fail_unless = [&](bool c) {
          if (!c) failures.fetch_add(1);
        };
        // Straddles the region's end, starts before it, lies wholly outside it, null.
        fail_unless(device::get(q, k, region + 3000, 2000).status == Status::kDataTransferError);
        fail_unless(device::get(q, k, region - 8, 100).status == Status::kDataTransferError);
        fail_unless(device::get(q, k, arena.data(), 100).status == Status::kDataTransferError);
        fail_unless(!device::get(q, k, nullptr, 100).ok());
        fail_unless(device::put(q, k, arena.data(), 100).status == Status::kDataTransferError);
        // Device-kind memory through the host engine: refused as a data transfer error.
        fail_unless(device::get(q, k, fake_device, 1000).status == Status::kDataTransferError);
        // In range: fine.
        fail_unless(device::get(q, k, region + 1000, 2000).ok());
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0u);
  EXPECT_TRUE(std::equal(v.begin(), v.end(), region + 1000));
  // Nothing outside the registered host region was written.
  EXPECT_TRUE(
      std::all_of(arena.data(), arena.data() + 4096, [](std::byte b) { return b == kPoison; }));
  EXPECT_TRUE(std::all_of(arena.data() + 2 * 4096, arena.data() + 3 * 4096,
                          [](std::byte b) { return b == kPoison; }));
  // Unregistered: the same pointer is now refused.
  ASSERT_TRUE(ctl_->unregister_memory(region));
  EXPECT_EQ(device::get(q, k, region, 100).status, Status::kDataTransferError);
}

// The copy engine's per-region cache of pointer attributes: one question per region, every time
// for memory in no region, the oldest region forgotten past the limit.
TEST(RegionCache, AsksOncePerRegion) {
  gpu::RegionCache<int> cache;
  int asked = 0;
  auto ask = [&](const void*) { return ++asked; };
  char a[2], b[2];
  EXPECT_EQ(cache.lookup(7, a, ask), 1);
  EXPECT_EQ(cache.lookup(7, a + 1, ask), 1);  // same region, no question
  EXPECT_EQ(cache.lookup(8, b, ask), 2);
  EXPECT_EQ(cache.lookup(7, a, ask), 1);
  EXPECT_EQ(asked, 2);
  EXPECT_EQ(cache.lookup(0, a, ask), 3);  // not a region: asked each time
  EXPECT_EQ(cache.lookup(0, a, ask), 4);
  for (uint64_t r = 100; r < 100 + gpu::RegionCache<int>::kMaxRegions; ++r) cache.lookup(r, a, ask);
  EXPECT_EQ(cache.size(), gpu::RegionCache<int>::kMaxRegions);
  const int before = asked;
  cache.lookup(7, a, ask);  // forgotten (oldest): asked again
  EXPECT_EQ(asked, before + 1);
}

// Memcpy, recording the region ids the controller puts in each segment.
class RegionRecordingEngine final : public CopyEngine {
 public:
  explicit RegionRecordingEngine(std::vector<std::pair<uint64_t, uint64_t>>* seen, std::mutex* mu)
      : seen_(seen), mu_(mu) {}
  void submit(CopyJob* job) override {
    for (uint32_t i = 0; i < job->count; ++i) {
      const CopySegment& s = job->segs[i];
      std::memcpy(s.dst, s.src, s.len);
      std::lock_guard lk(*mu_);
      seen_->emplace_back(s.dst_region, s.src_region);
    }
    job->done(job, Status::kSuccess);
  }
  bool poll() override { return false; }
  const char* name() const override { return "region-recording"; }

 private:
  std::vector<std::pair<uint64_t, uint64_t>>* seen_;
  std::mutex* mu_;
};

// The controller names the registered region of each requester end, the same id for every command
// into it and a new one after it is registered again; the staging pool has an id of its own.
TEST(RegionCache, ControllerNamesRegionsInSegments) {
  std::vector<std::pair<uint64_t, uint64_t>> seen;
  std::mutex mu;
  ControllerOptions o;
  o.copy_engine = [&](uint32_t) { return std::make_unique<RegionRecordingEngine>(&seen, &mu); };
  o.staging_pool_bytes = 1 << 20;
  o.staging_alloc = [](size_t n) { return std::aligned_alloc(4096, n); };
  o.staging_free = [](void* p, size_t) { std::free(p); };
  Controller ctl(make_memory_backend(), o);
  const QueueRef q = ctl.create_queue({16, true}).value();
  std::vector<std::byte> buf(8192);
  ASSERT_TRUE(ctl.register_memory(buf.data(), buf.size(), MemKind::kHost));
  const Key k = key_of(3, 3);
  ASSERT_TRUE(device::put(q, k, buf.data(), 3000).ok());  // host, one segment: no copy
  auto last = [&] {
    std::lock_guard lk(mu);
    return seen.empty() ? std::pair<uint64_t, uint64_t>{} : seen.back();
  };
  ASSERT_TRUE(device::get(q, k, buf.data() + 4096, 4096).ok());
  const auto first = last();
  EXPECT_NE(first.first, 0u) << "the destination's registered region";
  ASSERT_TRUE(device::get(q, k, buf.data() + 100, 3000).ok());
  EXPECT_EQ(last().first, first.first);
  // A List is staged: it is copied out of the staging pool, which has its own id.
  const uint8_t zero = 0;
  ASSERT_TRUE(
      device::execute(q, device::make_list(Key::from_bytes(&zero, 1), buf.data(), 512)).ok());
  EXPECT_EQ(last().first, first.first);
  EXPECT_NE(last().second, 0u);
  EXPECT_NE(last().second, first.first);
  // Registered again: a new id, so nothing learned about the old memory is reused.
  ASSERT_TRUE(ctl.unregister_memory(buf.data()));
  ASSERT_TRUE(ctl.register_memory(buf.data(), buf.size(), MemKind::kHost));
  ASSERT_TRUE(device::get(q, k, buf.data(), 4096).ok());
  EXPECT_NE(last().first, 0u);
  EXPECT_NE(last().first, first.first);
  ctl.destroy_queue(q);
}

}  // namespace
}  // namespace gdkv
