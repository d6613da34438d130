// The cache decorator: hits, single flight, prefetch (chain prediction and the vendor opcode),
// write-through consistency under forced interleavings and under random races, through the
// backend interface and end to end through the controller and Client.
#include <gtest/gtest.h>

#include <atomic>
#include <barrier>
#include <mutex>
#include <random>
#include <thread>

#include "backend_params.h"
#include "cache_test_util.h"
#include "gdkv/cache.h"
#include "gdkv/client.h"
#include "gdkv/commands.h"
#include "gdkv/controller.h"

namespace gdkv {
namespace {

using nvme::Status;
using test::GateBackend;
using test::metric;
using test::SyncOp;

Key key(const std::string& s) { return *Key::from_string(s); }

Key block_key(int chain, int i) {
  char name[17];
  std::snprintf(name, sizeof(name), "c%03d-block%05d", chain, i);
  return key(name);
}

std::string block_value(const Key& k, size_t n = 4096) {
  std::string v(n, '\0');
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>(k.bytes[i % k.len] + i / 7);
  return v;
}

struct Fixture {
  std::shared_ptr<Backend> memory;
  std::shared_ptr<GateBackend> gate;
  std::shared_ptr<Backend> cache;
  explicit Fixture(CacheOptions o = {}, MemoryBackendOptions mo = {}) {
    memory = make_memory_backend(mo);
    gate = std::make_shared<GateBackend>(memory);
    cache = make_cached_backend(gate, o).value();
  }
  std::string get(const Key& k, Status* s = nullptr) {
    SyncOp op(BackendOpKind::kGet, k);
    const Status st = op.run(*cache);
    if (s != nullptr) *s = st;
    return st == Status::kSuccess ? op.value() : std::string();
  }
};

TEST(Cache, HitsAreServedWithoutTheBackend) {
  Fixture f;
  ASSERT_EQ(test::put(*f.memory, key("a"), "alpha"), Status::kSuccess);
  EXPECT_EQ(f.get(key("a")), "alpha");
  EXPECT_EQ(f.get(key("a")), "alpha");
  EXPECT_EQ(f.get(key("a")), "alpha");
  EXPECT_EQ(f.gate->count(BackendOpKind::kGet), 1u);
  EXPECT_EQ(metric(*f.cache, "cache_hits_total"), 2);
  EXPECT_EQ(metric(*f.cache, "cache_misses_total"), 1);
  Status s;
  f.get(key("nothing"), &s);
  EXPECT_EQ(s, Status::kKeyNotExist);
  // A write-through Store fills the cache: the next read is a hit.
  ASSERT_EQ(test::put(*f.cache, key("b"), "beta"), Status::kSuccess);
  EXPECT_EQ(f.get(key("b")), "beta");
  EXPECT_EQ(f.gate->count(BackendOpKind::kGet), 2u);
  // Exist is answered from the cache when it can be.
  SyncOp ex(BackendOpKind::kExists, key("b"));
  EXPECT_EQ(ex.run(*f.cache), Status::kSuccess);
  EXPECT_EQ(f.gate->count(BackendOpKind::kExists), 0u);
}

// Another node deleted a key from the shared backend: the notification drops the cached copy
// (without it the cache would keep serving it), and a lost-notifications signal drops them all.
// The cache passes both on to whoever sits above it, and unregisters when it goes.
TEST(Cache, DeletesByOtherNodesDropCachedCopies) {
  auto gate = std::make_shared<GateBackend>(make_memory_backend());
  gate->forward_removals(false);  // the deletes below play other nodes': only fire() tells
  std::vector<std::pair<uint32_t, std::string>> seen;
  {
    auto cache = make_cached_backend(gate, {}).value();
    ASSERT_TRUE(gate->has_handler());
    cache->set_invalidation_handler(
        [&](uint32_t ns, const Key& k) { seen.emplace_back(ns, std::string(k.view())); });
    const Key a = *Key::from_string("remote-a"), b = *Key::from_string("remote-b");
    ASSERT_EQ(test::put(*cache, a, "value-a"), Status::kSuccess);
    ASSERT_EQ(test::put(*cache, b, "value-b"), Status::kSuccess);
    // Deleted behind the cache's back: it still serves its copies.
    SyncOp da(BackendOpKind::kDelete, a), db(BackendOpKind::kDelete, b);
    ASSERT_EQ(da.run(*gate), Status::kSuccess);
    ASSERT_EQ(db.run(*gate), Status::kSuccess);
    SyncOp stale(BackendOpKind::kGet, a);
    ASSERT_EQ(stale.run(*cache), Status::kSuccess);
    EXPECT_EQ(stale.value(), "value-a");
    const uint64_t reads = gate->count(BackendOpKind::kGet);
    gate->fire(1, a);
    SyncOp ga(BackendOpKind::kGet, a);
    EXPECT_EQ(ga.run(*cache), Status::kKeyNotExist);
    EXPECT_EQ(gate->count(BackendOpKind::kGet), reads + 1);
    SyncOp gb(BackendOpKind::kGet, b);  // a notification for another namespace drops nothing
    gate->fire(2, b);
    ASSERT_EQ(gb.run(*cache), Status::kSuccess);
    gate->fire(0, Key{});  // notifications were lost: everything goes
    SyncOp gb2(BackendOpKind::kGet, b);
    EXPECT_EQ(gb2.run(*cache), Status::kKeyNotExist);
    EXPECT_EQ(metric(*cache, "cache_remote_invalidations_total"), 3);
    EXPECT_EQ(metric(*cache, "cache_entries"), 0);
  }
  EXPECT_FALSE(gate->has_handler());
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[0], (std::pair<uint32_t, std::string>{1, "remote-a"}));
  EXPECT_EQ(seen[2].first, 0u);
}

// A key the store removed (evicted by its own policy, or deleted behind the cache's back in this
// process) leaves the cache too, and is passed on to the cache's removal handler: gdkvd serves
// what the store holds, and its /removed feed is true.
TEST(Cache, KeysTheStoreRemovedLeaveTheCache) {
  MemoryBackendOptions mo;
  mo.capacity_bytes = 64 << 10;
  CacheOptions co;
  co.capacity_bytes = 1 << 20;  // the cache holds more than the store
  Fixture f(co, mo);
  std::vector<std::string> removed;
  std::mutex mu;
  f.cache->set_removal_handler([&](uint32_t, const Key& k) {
    std::lock_guard lk(mu);
    removed.emplace_back(std::string(k.view()));
  });
  auto name = [](int i) {
    char n[16];
    std::snprintf(n, sizeof(n), "store-%02d", i);
    return std::string(n);
  };
  for (int i = 0; i < 16; ++i) {  // 128 KiB: the store evicts the oldest half
    ASSERT_EQ(test::put(*f.cache, key(name(i).c_str()), block_value(key("v"), 8 << 10)),
              Status::kSuccess);
  }
  Status s;
  f.get(key(name(0).c_str()), &s);
  EXPECT_EQ(s, Status::kKeyNotExist) << "the cache served a value the store evicted";
  EXPECT_EQ(f.get(key(name(15).c_str())), block_value(key("v"), 8 << 10));
  SyncOp del(BackendOpKind::kDelete, key(name(15).c_str()));
  ASSERT_EQ(del.run(*f.memory), Status::kSuccess);  // behind the cache's back
  f.get(key(name(15).c_str()), &s);
  EXPECT_EQ(s, Status::kKeyNotExist);
  f.cache->set_removal_handler(nullptr);
  std::lock_guard lk(mu);
  ASSERT_GE(removed.size(), 2u);
  EXPECT_EQ(removed.front(), name(0));
  EXPECT_EQ(removed.back(), name(15));
}

TEST(Cache, ViewsOutliveEviction) {
  CacheOptions o;
  o.capacity_bytes = 8192;
  Fixture f(o);
  ASSERT_EQ(test::put(*f.cache, key("x"), block_value(key("x"))), Status::kSuccess);
  SyncOp held(BackendOpKind::kGet, key("x"));
  ASSERT_EQ(held.run(*f.cache), Status::kSuccess);
  // Push x out; the view taken before still reads the right bytes (ASan checks the memory).
  for (int i = 0; i < 8; ++i) {
    const Key k = block_key(0, i);
    ASSERT_EQ(test::put(*f.cache, k, block_value(k)), Status::kSuccess);
  }
  EXPECT_GT(metric(*f.cache, "cache_evictions_total"), 0);
  EXPECT_EQ(held.value(), block_value(key("x")));
  EXPECT_LE(metric(*f.cache, "cache_bytes"), 8192);
}

TEST(Cache, SixteenConcurrentMissesMakeOneBackendRead) {
  Fixture f;
  ASSERT_EQ(test::put(*f.memory, key("shared"), "prefix-block"), Status::kSuccess);
  f.gate->hold_done(BackendOpKind::kGet, true);
  std::vector<std::unique_ptr<SyncOp>> ops;
  for (int i = 0; i < 16; ++i)
    ops.push_back(std::make_unique<SyncOp>(BackendOpKind::kGet, key("shared")));
  std::barrier sync(16);
  std::vector<std::thread> ts;
  for (int i = 0; i < 16; ++i) {
    ts.emplace_back([&, i] {
      sync.arrive_and_wait();
      ops[i]->submit(*f.cache);
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(f.gate->count(BackendOpKind::kGet), 1u);
  EXPECT_EQ(f.gate->held_dones(), 1u);
  f.gate->release_all_dones();
  for (auto& op : ops) {
    ASSERT_TRUE(op->wait());
    EXPECT_EQ(op->status, Status::kSuccess);
    EXPECT_EQ(op->value(), "prefix-block");
  }
  EXPECT_EQ(metric(*f.cache, "cache_single_flight_merges_total"), 15);
}

TEST(Cache, SingleFlightThroughTheController) {
  MemoryBackendOptions mo;
  mo.delay_us = 20000;  // every backend op takes 20 ms: the 16 Retrieves overlap
  auto memory = make_memory_backend(mo);
  auto gate = std::make_shared<GateBackend>(memory);
  auto cache = make_cached_backend(gate).value();
  ASSERT_EQ(test::put(*memory, key("shared"), block_value(key("shared"))), Status::kSuccess);
  auto client = Client::open(cache).value();
  std::vector<std::vector<std::byte>> bufs(16, std::vector<std::byte>(4096));
  std::vector<uint16_t> cids;
  const Key k = key("shared");
  for (auto& b : bufs)
    cids.push_back(client->start(cmd::retrieve(k.bytes, k.len, b.data(), 4096)).value());
  for (size_t i = 0; i < cids.size(); ++i) {
    CmdResult r = client->wait(cids[i]);
    ASSERT_TRUE(r.ok()) << describe(r);
    EXPECT_EQ(r.dw0, 4096u);
    EXPECT_EQ(test::string_of(bufs[i]), block_value(k));
  }
  EXPECT_EQ(gate->count(BackendOpKind::kGet), 1u);
}

// Stores a chain of blocks through the cache (which learns their order), then reads it back in
// order from a slow backend. Returns the cache's metrics after the reads.
MetricList run_chain(uint32_t depth, uint64_t* backend_gets) {
  MemoryBackendOptions mo;
  mo.delay_us = 1000;
  auto memory = make_memory_backend(mo);
  auto gate = std::make_shared<GateBackend>(memory);
  CacheOptions o;
  o.capacity_bytes = 8 * 4096;  // far less than the chain: reads must go to the backend
  o.prefetch_depth = depth;
  auto cache = make_cached_backend(gate, o).value();
  auto client = Client::open(cache).value();
  constexpr int kBlocks = 64;
  for (int i = 0; i < kBlocks; ++i) {
    const Key k = block_key(1, i);
    EXPECT_TRUE(client->put(k, test::bytes_of(block_value(k))).ok());
  }
  std::vector<std::byte> buf(4096);
  for (int i = 0; i < kBlocks; ++i) {
    const Key k = block_key(1, i);
    CmdResult r = client->get(k, std::span(buf));
    EXPECT_TRUE(r.ok()) << i << ": " << describe(r);
    EXPECT_EQ(test::string_of(buf), block_value(k)) << i;
  }
  cache->drain();
  *backend_gets = gate->count(BackendOpKind::kGet);
  MetricList ms;
  cache->collect(ms);
  return ms;
}

TEST(Cache, ChainPrefetchTurnsMissesIntoHits) {
  uint64_t gets_off = 0, gets_on = 0;
  const MetricList off = run_chain(0, &gets_off);
  const MetricList on = run_chain(4, &gets_on);
  const double hits_off = metric(off, "cache_hits_total");
  const double hits_on = metric(on, "cache_hits_total");
  const double issued = metric(on, "cache_prefetch_issued_total", "source=chain");
  const double used = metric(on, "cache_prefetch_used_total");
  std::printf("prefetch off: %.0f hits; on: %.0f hits, %.0f issued, %.0f used, %.0f wasted\n",
              hits_off, hits_on, issued, used, metric(on, "cache_prefetch_wasted_total"));
  EXPECT_LE(hits_off, 8);  // at most the blocks still cached from the Stores
  EXPECT_EQ(metric(off, "cache_prefetch_issued_total", "source=chain"), 0);
  // With prefetch nearly every block is fetched ahead: hits, or reads that join a prefetch.
  EXPECT_GE(issued, 50);
  EXPECT_GE(used, 50);
  // Whether a prefetched block is already in (a hit) or still in flight (the read joins it) when
  // the reader asks depends on scheduling: under ASan on two busy cores 33 of 64 were hits. `used`
  // above is the deterministic count; here, only that prefetch made hits at all.
  EXPECT_GE(hits_on, 16);
  EXPECT_GT(hits_on, hits_off);
  EXPECT_LE(used, issued);
  // Prefetch reads replace demand reads rather than adding to them.
  EXPECT_LE(gets_on, gets_off + 8);
}

TEST(Cache, PrefetchOpcodeWarmsTheCache) {
  MemoryBackendOptions mo;
  mo.delay_us = 2000;
  auto memory = make_memory_backend(mo);
  auto gate = std::make_shared<GateBackend>(memory);
  CacheOptions o;
  o.prefetch_depth = 0;  // hints only
  auto cache = make_cached_backend(gate, o).value();
  std::vector<Key> keys;
  for (int i = 0; i < 16; ++i) {
    keys.push_back(block_key(2, i));
    ASSERT_EQ(test::put(*memory, keys.back(), block_value(keys.back())), Status::kSuccess);
  }
  auto client = Client::open(cache).value();
  CmdResult r = client->prefetch(keys);
  ASSERT_TRUE(r.ok()) << describe(r);
  ASSERT_TRUE(test::eventually([&] {
    return metric(*cache, "cache_prefetch_issued_total", "source=hint") == 16 &&
           metric(*cache, "cache_prefetch_inflight") == 0;
  }));
  std::vector<std::byte> buf(4096);
  for (const Key& k : keys) {
    ASSERT_TRUE(client->get(k, std::span(buf)).ok());
    EXPECT_EQ(test::string_of(buf), block_value(k));
  }
  EXPECT_EQ(metric(*cache, "cache_hits_total"), 16);
  EXPECT_EQ(metric(*cache, "cache_prefetch_used_total"), 16);
  EXPECT_EQ(metric(*cache, "cache_prefetch_accuracy"), 1.0);
  EXPECT_EQ(gate->count(BackendOpKind::kGet), 16u);
  // Hints for keys the backend lacks are counted as failed, not as data.
  const Key absent = key("absent");
  ASSERT_TRUE(client->prefetch(std::span(&absent, 1)).ok());
  ASSERT_TRUE(test::eventually([&] { return metric(*cache, "cache_prefetch_failed_total") == 1; }));
}

TEST(Cache, PrefetchIsBoundedAndDemandGoesFirst) {
  MemoryBackendOptions mo;
  mo.delay_us = 5000;
  auto memory = make_memory_backend(mo);
  auto gate = std::make_shared<GateBackend>(memory);
  CacheOptions o;
  o.max_prefetch_inflight = 2;
  o.prefetch_queue = 10;
  auto cache = make_cached_backend(gate, o).value();
  ASSERT_EQ(test::put(*memory, key("demand"), "now"), Status::kSuccess);
  // No read completes until the counts are taken (the backend's delay alone did not hold them
  // on a loaded machine: one prefetch finished and the queue had 9).
  gate->hold_done(BackendOpKind::kGet, true);
  std::vector<Key> hint;
  for (int i = 0; i < 20; ++i) hint.push_back(block_key(3, i));
  cache->prefetch(1, hint);
  // Two reads in flight, ten queued, eight dropped.
  ASSERT_TRUE(test::eventually([&] { return gate->held_dones() == 2; }));
  EXPECT_EQ(metric(*cache, "cache_prefetch_inflight"), 2);
  EXPECT_EQ(metric(*cache, "cache_prefetch_queued"), 10);
  EXPECT_EQ(metric(*cache, "cache_prefetch_dropped_total"), 8);
  // A demand read is sent to the backend at once, not behind the queued prefetches.
  const uint64_t before = gate->count(BackendOpKind::kGet);
  SyncOp d(BackendOpKind::kGet, key("demand"));
  d.submit(*cache);
  EXPECT_EQ(gate->count(BackendOpKind::kGet), before + 1);
  // The three reads sent while completions were held (two prefetches, the demand) come back;
  // the queued prefetches go out after, unheld.
  ASSERT_TRUE(test::eventually([&] { return gate->held_dones() == 3; }));
  gate->hold_done(BackendOpKind::kGet, false);
  gate->release_all_dones();
  ASSERT_TRUE(d.wait());
  EXPECT_EQ(d.value(), "now");
  cache->drain();
  EXPECT_EQ(metric(*cache, "cache_prefetch_issued_total", "source=hint"), 12);
}

// ---- consistency: forced interleavings ----

// A read that started before a Store and finishes after it must not cache the old value.
TEST(CacheConsistency, FillRacingAStoreIsNotCached) {
  Fixture f;
  ASSERT_EQ(test::put(*f.memory, key("k"), "v1"), Status::kSuccess);
  f.gate->hold_done(BackendOpKind::kGet, true);
  SyncOp g1(BackendOpKind::kGet, key("k"));
  g1.submit(*f.cache);  // reads v1 in the backend; completion held
  ASSERT_EQ(f.gate->held_dones(), 1u);
  ASSERT_EQ(test::put(*f.cache, key("k"), "v2"), Status::kSuccess);  // acknowledged
  f.gate->release_all_dones();
  ASSERT_TRUE(g1.wait());
  EXPECT_EQ(g1.value(), "v1");  // it overlapped the Store: either value is right
  f.gate->hold_done(BackendOpKind::kGet, false);
  EXPECT_EQ(f.get(key("k")), "v2");
}

// A read that started while a Store was in flight must not cache what it read, whether or not the
// Store's own value could be cached.
class FillDuringStore : public testing::TestWithParam<bool> {};

TEST_P(FillDuringStore, IsNotCached) {
  const bool store_cacheable = GetParam();
  CacheOptions o;
  o.capacity_bytes = 100;
  Fixture f(o);
  const std::string v1(50, '1');
  const std::string v2(store_cacheable ? 60 : 200, '2');  // 200 bytes don't fit the cache
  ASSERT_EQ(test::put(*f.memory, key("k"), v1), Status::kSuccess);
  f.gate->hold_submit(BackendOpKind::kPut, true);
  SyncOp p(BackendOpKind::kPut, key("k"), test::bytes_of(v2));
  p.submit(*f.cache);  // held before the backend sees it
  f.gate->hold_done(BackendOpKind::kGet, true);
  SyncOp g1(BackendOpKind::kGet, key("k"));
  g1.submit(*f.cache);  // reads v1; completion held
  ASSERT_EQ(f.gate->held_dones(), 1u);
  f.gate->release_submits(BackendOpKind::kPut);
  ASSERT_TRUE(p.wait());
  ASSERT_EQ(p.status, Status::kSuccess);  // the Store is acknowledged
  f.gate->release_all_dones();
  ASSERT_TRUE(g1.wait());
  EXPECT_EQ(g1.value(), v1);
  f.gate->hold_done(BackendOpKind::kGet, false);
  EXPECT_EQ(f.get(key("k")), v2);
  EXPECT_EQ(f.get(key("k")), v2);
}

INSTANTIATE_TEST_SUITE_P(Cache, FillDuringStore, testing::Bool());

// A read that joins after a Store was acknowledged must not join a read that began before.
TEST(CacheConsistency, ReadAfterStoreDoesNotJoinAnOlderRead) {
  CacheOptions o;
  o.capacity_bytes = 100;
  Fixture f(o);
  ASSERT_EQ(test::put(*f.memory, key("k"), "v1"), Status::kSuccess);
  f.gate->hold_done(BackendOpKind::kGet, true);
  SyncOp g1(BackendOpKind::kGet, key("k"));
  g1.submit(*f.cache);
  // v2 is too large to cache, so after its Store the cache has nothing for k.
  const std::string v2(200, 'x');
  ASSERT_EQ(test::put(*f.cache, key("k"), v2), Status::kSuccess);
  SyncOp g2(BackendOpKind::kGet, key("k"));
  g2.submit(*f.cache);
  EXPECT_EQ(f.gate->held_dones(), 2u);  // g2 has its own backend read
  f.gate->release_all_dones();
  ASSERT_TRUE(g1.wait());
  ASSERT_TRUE(g2.wait());
  EXPECT_EQ(g2.value(), v2);
}

TEST(CacheConsistency, DeleteWinsOverARacingFill) {
  Fixture f;
  ASSERT_EQ(test::put(*f.memory, key("k"), "v1"), Status::kSuccess);
  f.gate->hold_done(BackendOpKind::kGet, true);
  SyncOp g1(BackendOpKind::kGet, key("k"));
  g1.submit(*f.cache);
  SyncOp del(BackendOpKind::kDelete, key("k"));
  ASSERT_EQ(del.run(*f.cache), Status::kSuccess);
  f.gate->release_all_dones();
  ASSERT_TRUE(g1.wait());
  f.gate->hold_done(BackendOpKind::kGet, false);
  Status s;
  f.get(key("k"), &s);
  EXPECT_EQ(s, Status::kKeyNotExist);
  // And a cached value goes with its Delete.
  ASSERT_EQ(test::put(*f.cache, key("k"), "v3"), Status::kSuccess);
  EXPECT_EQ(f.get(key("k")), "v3");
  SyncOp del2(BackendOpKind::kDelete, key("k"));
  ASSERT_EQ(del2.run(*f.cache), Status::kSuccess);
  f.get(key("k"), &s);
  EXPECT_EQ(s, Status::kKeyNotExist);
}

// Two overlapping Stores acknowledged in the reverse of the backend's order: the cache must end
// up agreeing with the backend (v2), not with the Store acknowledged last (v1).
TEST(CacheConsistency, OverlappingStoresLeaveTheBackendsValue) {
  Fixture f;
  f.gate->hold_done(BackendOpKind::kPut, true);
  SyncOp p1(BackendOpKind::kPut, key("k"), test::bytes_of("v1"));
  SyncOp p2(BackendOpKind::kPut, key("k"), test::bytes_of("v2"));
  p1.submit(*f.cache);
  p2.submit(*f.cache);  // the memory backend applied v1 then v2
  ASSERT_EQ(f.gate->held_dones(), 2u);
  f.gate->release_done(1);  // p2 acknowledged first
  f.gate->release_done(0);
  ASSERT_TRUE(p1.wait());
  ASSERT_TRUE(p2.wait());
  EXPECT_EQ(f.get(key("k")), "v2");
}

TEST(CacheConsistency, RejectedStoreKeepsTheCachedValue) {
  Fixture f;
  ASSERT_EQ(test::put(*f.cache, key("k"), "v1"), Status::kSuccess);
  EXPECT_EQ(test::put(*f.cache, key("k"), "v2", nvme::kStoreMustNotExist), Status::kKeyExists);
  EXPECT_EQ(f.get(key("k")), "v1");
  EXPECT_EQ(f.gate->count(BackendOpKind::kGet), 0u);  // still cached
}

// ---- consistency: random races ----

// One writer per key stores increasing versions; readers check that a read started after version
// v was acknowledged never returns an older one. A slow backend and a small cache keep fills,
// Stores and evictions overlapping.
TEST(CacheConsistency, RandomRacesNeverReturnStaleValues) {
  MemoryBackendOptions mo;
  mo.delay_us = 30;
  CacheOptions o;
  o.capacity_bytes = 6 * 1024;
  o.prefetch_depth = 2;
  Fixture f(o, mo);
  constexpr int kKeys = 4;
  constexpr int kVersions = 150;
  std::atomic<uint64_t> acked[kKeys] = {};
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> reads{0}, stale{0};
  auto value_of = [](int k, uint64_t version, size_t size) {
    std::string v(size, static_cast<char>('a' + k));
    std::memcpy(v.data(), &version, sizeof(version));
    return v;
  };
  std::vector<std::thread> ts;
  for (int k = 0; k < kKeys; ++k) {
    ts.emplace_back([&, k] {
      std::mt19937 rng(k);
      for (uint64_t v = 1; v <= kVersions; ++v) {
        const size_t size = 16 + rng() % 2048;
        ASSERT_EQ(test::put(*f.cache, block_key(9, k), value_of(k, v, size)), Status::kSuccess);
        acked[k].store(v);
      }
    });
  }
  for (int r = 0; r < 3; ++r) {
    ts.emplace_back([&, r] {
      std::mt19937 rng(100 + r);
      while (!stop.load()) {
        const int k = static_cast<int>(rng() % kKeys);
        const uint64_t floor = acked[k].load();
        SyncOp g(BackendOpKind::kGet, block_key(9, k));
        g.submit(*f.cache);
        ASSERT_TRUE(g.wait());
        reads.fetch_add(1);
        if (g.status == Status::kKeyNotExist && floor == 0) continue;
        ASSERT_EQ(g.status, Status::kSuccess);
        const std::string v = g.value();
        ASSERT_GE(v.size(), 16u);
        uint64_t got;
        std::memcpy(&got, v.data(), sizeof(got));
        if (got < floor) stale.fetch_add(1);
      }
    });
  }
  for (int k = 0; k < kKeys; ++k) ts[k].join();
  stop = true;
  for (size_t i = kKeys; i < ts.size(); ++i) ts[i].join();
  EXPECT_EQ(stale.load(), 0u);
  EXPECT_GT(reads.load(), 100u);
}

// ---- end to end ----

TEST(CacheEndToEnd, CommandsThroughTheController) {
  auto memory = make_memory_backend();
  auto cache = make_cached_backend(memory).value();
  auto client = Client::open(cache).value();
  std::vector<std::byte> buf(4096);
  for (int i = 0; i < 10; ++i) {
    const Key k = block_key(4, i);
    ASSERT_TRUE(client->put(k, test::bytes_of(block_value(k))).ok());
  }
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 10; ++i) {
      const Key k = block_key(4, i);
      CmdResult r = client->get(k, std::span(buf));
      ASSERT_TRUE(r.ok());
      EXPECT_EQ(test::string_of(buf), block_value(k));
    }
  }
  EXPECT_EQ(metric(*cache, "cache_hits_total"), 30);
  // A short buffer gets the first bytes and the full length.
  std::vector<std::byte> small(100);
  CmdResult r = client->get(block_key(4, 0), std::span(small));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.dw0, 4096u);
  EXPECT_EQ(test::string_of(small), block_value(block_key(4, 0)).substr(0, 100));
  EXPECT_TRUE(client->exists(block_key(4, 3)).ok());
  std::vector<Key> keys;
  ASSERT_TRUE(client->list_all(keys).ok());
  EXPECT_EQ(keys.size(), 10u);
  ASSERT_TRUE(client->del(block_key(4, 3)).ok());
  EXPECT_EQ(client->get(block_key(4, 3), std::span(buf)).status, Status::kKeyNotExist);
  EXPECT_EQ(client->exists(block_key(4, 3)).status, Status::kKeyNotExist);
  // Scatter retrieve is served from the cache too.
  std::vector<std::byte> a(1000), b(1000);
  nvme::ScatterEntry pieces[2] = {
      {reinterpret_cast<uint64_t>(a.data()), 0, 1000},
      {reinterpret_cast<uint64_t>(b.data()), 2000, 1000},
  };
  ASSERT_TRUE(client->scatter_get(block_key(4, 5), pieces).ok());
  EXPECT_EQ(test::string_of(b), block_value(block_key(4, 5)).substr(2000, 1000));
}

TEST(CacheOptionsTest, BadOptionsAreRejected) {
  CacheOptions o;
  o.policy = "fifo";
  auto fifo = make_cached_backend(make_memory_backend(), o);  // an Error, not an exception
  ASSERT_FALSE(fifo);
  EXPECT_NE(fifo.error().find("unknown policy 'fifo'"), std::string::npos) << fifo.error();
  o.policy = "lru-k";
  o.k = 0;
  auto k0 = make_cached_backend(make_memory_backend(), o);
  ASSERT_FALSE(k0);
  EXPECT_NE(k0.error().find("k must be 1..8, not 0"), std::string::npos) << k0.error();
  auto none = make_cached_backend(nullptr);
  ASSERT_FALSE(none);
  EXPECT_EQ(none.error(), "cache: no backend to cache");
  EXPECT_THROW(make_cached_backend(nullptr).value(), std::runtime_error);  // value() throws it
  for (const std::string& p : cache_policies()) {
    CacheOptions ok;
    ok.policy = p;
    EXPECT_NE(make_cached_backend(make_memory_backend(), ok).value(), nullptr);
  }
}

TEST(CacheOptionsTest, ZeroCapacityPassesThrough) {
  CacheOptions o;
  o.capacity_bytes = 0;
  Fixture f(o);
  ASSERT_EQ(test::put(*f.cache, key("k"), "v"), Status::kSuccess);
  EXPECT_EQ(f.get(key("k")), "v");
  EXPECT_EQ(f.get(key("k")), "v");
  EXPECT_EQ(f.gate->count(BackendOpKind::kGet), 2u);
  EXPECT_EQ(metric(*f.cache, "cache_bytes"), 0);
}

// Hits, misses, fills, evictions, Stores and Deletes from four queues on two reactors at once,
// over a cache much smaller than the keys (so entries are evicted while other reactors read
// them) and a backend slow enough for misses to overlap: every read returns its key's value or
// 87h, never other bytes. scripts/test runs it under ASan and TSan too.
TEST(CacheConcurrency, ReactorsShareOneCache) {
  MemoryBackendOptions mo;
  mo.delay_us = 50;
  CacheOptions o;
  o.capacity_bytes = 24 * 4096;
  auto cache = make_cached_backend(make_memory_backend(mo), o).value();
  ControllerOptions co;
  co.reactors = 2;
  co.idle_spin_us = 0;
  Controller ctl(cache, co);
  constexpr int kKeys = 96;
  std::vector<Key> keys;
  for (int i = 0; i < kKeys; ++i) keys.push_back(block_key(9, i));
  {
    Client seed(ctl.create_queue().value(), nullptr, &ctl);
    for (const Key& k : keys) ASSERT_TRUE(seed.put(k, test::bytes_of(block_value(k))).ok());
  }
  std::atomic<int> wrong{0}, errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      Client c(ctl.create_queue().value(), nullptr, &ctl);
      std::mt19937_64 rng(100 + t);
      std::vector<std::byte> buf(4096);
      for (int i = 0; i < 1500; ++i) {
        // Popular keys first, so some are hits and the rest misses.
        const Key& k = keys[std::min<uint64_t>(rng() % kKeys, rng() % kKeys)];
        const unsigned what = rng() % 20;
        if (what == 0) {
          // Another thread may have deleted it first (87h).
          const Status d = c.del(k).status;
          if (d != Status::kSuccess && d != Status::kKeyNotExist) ++errors;
          if (!c.put(k, test::bytes_of(block_value(k))).ok()) ++errors;
        } else if (what == 1) {
          if (!c.put(k, test::bytes_of(block_value(k))).ok()) ++errors;
        } else {
          CmdResult r = c.get(k, std::span(buf));
          if (r.status == Status::kKeyNotExist) continue;  // between a Delete and its Store
          if (!r.ok()) {
            ++errors;
          } else if (r.dw0 != 4096 || test::string_of(buf) != block_value(k)) {
            ++wrong;
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(errors.load(), 0);
  EXPECT_GT(metric(*cache, "cache_hits_total"), 100);
  EXPECT_GT(metric(*cache, "cache_evictions_total"), 100);
}

// The copy engine's bytes on reactor 0 (every engine it has).
double dma_bytes(Client& c) {
  MetricList ms;
  c.controller()->collect(ms);
  double n = 0;
  for (const Metric& m : ms) {
    if (m.name == "dma_bytes_total") n += m.value;
  }
  return n;
}

// A value the cache will not keep (a capacity of 0, or larger than the whole cache) is read by
// the local store straight into the requester's buffer: no slab buffer and no copy-engine bytes.
// A value the cache keeps is read into the slab and copied out (one copy), and hits then cost one
// copy each. Concurrent misses of a value too large to keep still share one backend read.
TEST(CacheDirectReads, ValuesTheCacheWillNotKeepAreNotCopied) {
  test::BackendFixture store;
  auto local = store.open("local", 64 << 20, 8 << 20);
  const Key small = key("small"), big = key("big");
  const std::string small_v = block_value(small, 4096), big_v = block_value(big, 256 << 10);
  ASSERT_EQ(test::put(*local, small, small_v), Status::kSuccess);
  ASSERT_EQ(test::put(*local, big, big_v), Status::kSuccess);
  for (uint64_t capacity : {uint64_t{0}, uint64_t{64} << 10}) {
    SCOPED_TRACE(capacity);
    CacheOptions o;
    o.capacity_bytes = capacity;
    auto gate = std::make_shared<GateBackend>(local);
    auto cache = make_cached_backend(gate, o).value();
    auto client = Client::open(cache).value();
    std::vector<std::byte> buf(big_v.size());
    for (int round = 0; round < 2; ++round) {
      CmdResult r = client->get(big, std::span(buf));
      ASSERT_TRUE(r.ok()) << describe(r);
      EXPECT_EQ(test::string_of(buf), big_v);
    }
    EXPECT_EQ(dma_bytes(*client), 0) << "a value larger than the cache was copied";
    EXPECT_EQ(metric(*cache, "cache_direct_reads_total"), 2);
    EXPECT_EQ(gate->count(BackendOpKind::kGet), 2u);
    std::vector<std::byte> sbuf(small_v.size());
    for (int round = 0; round < 3; ++round) {
      CmdResult r = client->get(small, std::span(sbuf));
      ASSERT_TRUE(r.ok()) << describe(r);
      EXPECT_EQ(test::string_of(sbuf), small_v);
    }
    if (capacity == 0) {
      EXPECT_EQ(dma_bytes(*client), 0);
      EXPECT_EQ(metric(*cache, "cache_direct_reads_total"), 5);
      EXPECT_EQ(metric(*cache, "cache_bytes"), 0);
    } else {
      EXPECT_EQ(dma_bytes(*client), 3 * 4096);  // the fill's copy out, then two hits
      EXPECT_EQ(metric(*cache, "cache_hits_total"), 2);
    }
    // A short buffer still gets the first bytes and the full length.
    std::vector<std::byte> head(100);
    CmdResult r = client->get(big, std::span(head));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r.dw0, big_v.size());
    EXPECT_EQ(test::string_of(head), big_v.substr(0, 100));
    EXPECT_EQ(metric(*cache, "cache_direct_reads_total"), capacity == 0 ? 6 : 3);
  }
  // Sixteen concurrent misses of a value too large to keep: one flight with many waiters reads it
  // into a buffer of its own and every reader gets the bytes.
  CacheOptions o;
  o.capacity_bytes = 4096;
  MemoryBackendOptions mo;
  mo.delay_us = 20000;
  auto slow = std::make_shared<GateBackend>(make_memory_backend(mo));
  auto cache = make_cached_backend(slow, o).value();
  ASSERT_EQ(test::put(*cache, big, big_v), Status::kSuccess);
  std::vector<std::thread> readers;
  std::atomic<int> good{0};
  for (int i = 0; i < 16; ++i) {
    readers.emplace_back([&] {
      SyncOp op(BackendOpKind::kGet, big);
      if (op.run(*cache) == Status::kSuccess && op.value() == big_v) ++good;
    });
  }
  for (auto& t : readers) t.join();
  EXPECT_EQ(good.load(), 16);
  EXPECT_LT(slow->count(BackendOpKind::kGet), 16u);
}

// ---- the write path: one copy ----

// Fails every Store with `status` without passing it on (a backend that lost the write); passes
// everything else to the inner backend.
class FailingStores final : public Backend {
 public:
  explicit FailingStores(std::shared_ptr<Backend> inner) : inner_(std::move(inner)) {}
  void submit(BackendOp* op) override {
    if (op->kind == BackendOpKind::kPut && status_ != Status::kSuccess) {
      return op->complete(status_);
    }
    inner_->submit(op);
  }
  BackendInfo info() const override { return inner_->info(); }
  void collect(MetricList& out) const override { inner_->collect(out); }
  void fail_with(Status s) { status_ = s; }

 private:
  std::shared_ptr<Backend> inner_;
  Status status_ = Status::kSuccess;
};

// A Store through the cache is copied once, into the slab, and the memory backend keeps that
// buffer by reference: copying it a second time (the cache after the backend, or the backend
// after the cache) fails the byte counts. Through the controller from one contiguous buffer there
// is no copy-engine copy either. Sizes cover the slab's class edges and values larger than a page
// (a small page size, so a value spans several pages' worth of chunk).
TEST(CacheWrites, AStoreIsCopiedOnce) {
  CacheOptions o;
  o.slab_page_bytes = 4096;
  auto memory = make_memory_backend();
  auto gate = std::make_shared<GateBackend>(memory);
  auto cache = make_cached_backend(gate, o).value();
  auto client = Client::open(cache).value();
  uint64_t total = 0;
  int i = 0;
  for (size_t n : {size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{4095}, size_t{4097},
                   size_t{3 * 4096 + 123}, (size_t{1} << 20) + 1, size_t{2} << 20}) {
    SCOPED_TRACE(n);
    const Key k = block_key(9, i++);
    const std::string v = block_value(k, n);
    const double dma_before = dma_bytes(*client);
    ASSERT_TRUE(client->put(k, test::bytes_of(v)).ok());
    total += n;
    EXPECT_EQ(metric(*cache, "cache_write_copy_bytes_total"), static_cast<double>(total));
    EXPECT_EQ(metric(*cache, "backend_copied_bytes_total"), 0) << "the backend copied again";
    EXPECT_EQ(dma_bytes(*client), dma_before) << "the controller staged a contiguous Store";
    // The backend has the bytes, and the cache serves them without asking it.
    SyncOp direct(BackendOpKind::kGet, k);
    ASSERT_EQ(direct.run(*memory), Status::kSuccess);
    EXPECT_EQ(direct.value(), v);
    std::vector<std::byte> buf(n);
    const uint64_t gets = gate->count(BackendOpKind::kGet);
    CmdResult r = client->get(k, std::span(buf));
    ASSERT_TRUE(r.ok()) << describe(r);
    EXPECT_EQ(r.dw0, n);
    EXPECT_EQ(test::string_of(buf), v);
    EXPECT_EQ(gate->count(BackendOpKind::kGet), gets);
  }
  EXPECT_EQ(metric(*cache, "cache_write_fills_total"), static_cast<double>(i));
  // Without a cache the memory backend copies the Store itself, once.
  auto bare = make_memory_backend();
  ASSERT_EQ(test::put(*bare, key("plain"), "12345"), Status::kSuccess);
  EXPECT_EQ(metric(*bare, "backend_copied_bytes_total"), 5);
}

// A Store over a cached value replaces it in the cache and in the backend; a view of the old
// value taken before (a copy still reading it) keeps reading the old bytes: cached buffers are
// never written again, which is what lets the backend hold them by reference.
TEST(CacheWrites, AStoreReplacingACachedValue) {
  Fixture f;
  const std::string v1 = block_value(key("old"), 8192), v2 = block_value(key("new"), 12000);
  ASSERT_EQ(test::put(*f.cache, key("k"), v1), Status::kSuccess);
  SyncOp held(BackendOpKind::kGet, key("k"));
  ASSERT_EQ(held.run(*f.cache), Status::kSuccess);
  ASSERT_EQ(held.value(), v1);
  ASSERT_EQ(test::put(*f.cache, key("k"), v2), Status::kSuccess);
  EXPECT_EQ(f.get(key("k")), v2);
  EXPECT_EQ(f.gate->count(BackendOpKind::kGet), 0u);  // both reads were hits
  EXPECT_EQ(held.value(), v1);
  SyncOp direct(BackendOpKind::kGet, key("k"));
  ASSERT_EQ(direct.run(*f.memory), Status::kSuccess);
  EXPECT_EQ(direct.value(), v2);
  EXPECT_EQ(metric(*f.cache, "cache_bytes"), 12000);
  EXPECT_EQ(metric(*f.cache, "cache_entries"), 1);
  // A same-size rewrite, many times: the slab does not grow with the rewrites.
  for (int round = 0; round < 50; ++round) {
    const std::string v = block_value(key("k"), 12000) + std::to_string(round);
    ASSERT_EQ(test::put(*f.cache, key("k"), v.substr(0, 12000)), Status::kSuccess);
    ASSERT_EQ(f.get(key("k")), v.substr(0, 12000));
  }
  EXPECT_LE(metric(*f.cache, "cache_slab_reserved_bytes"), 4 * double{1 << 20});
}

// A Store the backend fails leaves the cache as the backend left the key: a rejected one (81h:
// nothing written) keeps the cached value; any other failure drops the key, so the next read asks
// the backend (which still has the old value here). Either way the slab buffer the value was
// copied into is freed, and neither the cache nor the backend serves the failed value.
// (Slab chunk bytes count what the backend holds by reference too.)
TEST(CacheWrites, AStoreFailingInTheBackendLeavesTheCacheUnchanged) {
  auto memory = make_memory_backend();
  auto failing = std::make_shared<FailingStores>(memory);
  auto gate = std::make_shared<GateBackend>(failing);
  auto cache = make_cached_backend(gate).value();
  const std::string v1(5000, 'a'), v2(5000, 'b');
  ASSERT_EQ(test::put(*cache, key("k"), v1), Status::kSuccess);
  const double chunks = metric(*cache, "cache_slab_chunk_bytes");
  auto get = [&](Backend& b) {
    SyncOp op(BackendOpKind::kGet, key("k"));
    EXPECT_EQ(op.run(b), Status::kSuccess);
    return op.value();
  };

  failing->fail_with(Status::kCapacityExceeded);
  EXPECT_EQ(test::put(*cache, key("k"), v2), Status::kCapacityExceeded);
  EXPECT_EQ(get(*cache), v1);
  EXPECT_EQ(gate->count(BackendOpKind::kGet), 0u);  // still cached
  EXPECT_EQ(metric(*cache, "cache_slab_chunk_bytes"), chunks);

  failing->fail_with(Status::kUnrecoveredError);
  EXPECT_EQ(test::put(*cache, key("k"), v2), Status::kUnrecoveredError);
  EXPECT_EQ(metric(*cache, "cache_entries"), 0);
  // v1's chunk stays: the memory backend holds it by reference. v2's went back.
  EXPECT_EQ(metric(*cache, "cache_slab_chunk_bytes"), chunks);
  EXPECT_EQ(get(*cache), v1);  // from the backend, then cached again
  EXPECT_EQ(gate->count(BackendOpKind::kGet), 1u);
  EXPECT_EQ(get(*memory), v1);

  // A failed Store of a key that was never cached caches nothing.
  EXPECT_EQ(test::put(*cache, key("fresh"), v2), Status::kUnrecoveredError);
  EXPECT_EQ(metric(*cache, "cache_entries"), 1);
  SyncOp miss(BackendOpKind::kGet, key("fresh"));
  EXPECT_EQ(miss.run(*cache), Status::kKeyNotExist);

  failing->fail_with(Status::kSuccess);
  ASSERT_EQ(test::put(*cache, key("k"), v2), Status::kSuccess);
  EXPECT_EQ(get(*cache), v2);
  EXPECT_EQ(get(*memory), v2);
}

// ---- quotas and low-priority Stores ----

constexpr uint32_t kA = 1, kB = 2, kC = 3;
constexpr uint64_t kKiB = 1024;
using test::nkey;
using test::nvalue;
double ns_metric(const Backend& b, const char* name, uint32_t nsid) {
  return test::ns_metric(b, name, nsid, "cache");
}
// Whether the cache holds the key: an Exist it answers never reaches the backend.
bool cached(Fixture& f, uint32_t nsid, const Key& k) {
  const uint64_t before = f.gate->count(BackendOpKind::kExists);
  SyncOp op(BackendOpKind::kExists, k);
  op.op.nsid = nsid;
  EXPECT_EQ(op.run(*f.cache), Status::kSuccess);
  return f.gate->count(BackendOpKind::kExists) == before;
}

class CacheQuota : public testing::TestWithParam<std::string> {};
INSTANTIATE_TEST_SUITE_P(Policies, CacheQuota, testing::ValuesIn(cache_policies()));

// Tenant B (quota 16 KiB) caches 12 KiB; tenant A, without a quota, stores ten times the cache's
// capacity through it. Whatever the policy, all of B's values stay cached (the old single policy
// evicted them) and A's entries alone are evicted.
TEST_P(CacheQuota, FloodWithoutQuotaKeepsQuotaNamespace) {
  CacheOptions o;
  o.policy = GetParam();
  o.capacity_bytes = 64 * kKiB;
  o.quotas = {{kB, 16 * kKiB}};
  Fixture f(o);
  for (int i = 0; i < 12; ++i) {
    ASSERT_EQ(test::put_in(*f.cache, kB, nkey('b', i), nvalue('b', i)), Status::kSuccess);
  }
  constexpr int kFlood = 640;
  for (int i = 0; i < kFlood; ++i) {
    ASSERT_EQ(test::put_in(*f.cache, kA, nkey('a', i), nvalue('a', i)), Status::kSuccess);
    // A read now and then, so that frequency-aware policies see more than one reference.
    if (i % 8 == 0) {
      EXPECT_EQ(test::get_in(*f.cache, kA, nkey('a', i)), nvalue('a', i));
    }
  }
  const uint64_t gets = f.gate->count(BackendOpKind::kGet);
  for (int i = 0; i < 12; ++i) {
    EXPECT_EQ(test::get_in(*f.cache, kB, nkey('b', i)), nvalue('b', i)) << i;
  }
  EXPECT_EQ(f.gate->count(BackendOpKind::kGet), gets);  // every one a hit
  EXPECT_EQ(ns_metric(*f.cache, "namespace_held_bytes", kB), 12.0 * kKiB);
  EXPECT_EQ(ns_metric(*f.cache, "namespace_evictions_total", kB), 0);
  const double held_a = ns_metric(*f.cache, "namespace_held_bytes", kA);
  EXPECT_LE(held_a, 52.0 * kKiB);
  EXPECT_GT(held_a, 0);
  EXPECT_EQ(ns_metric(*f.cache, "namespace_evictions_total", kA), kFlood - held_a / kKiB);
  EXPECT_EQ(metric(*f.cache, "cache_evictions_total"), kFlood - held_a / kKiB);
}

// The same flood under LRU: A's own entries go oldest first, exactly.
TEST(CacheQuotaLru, NamespaceWithoutQuotaEvictsItsOwnOldestFirst) {
  CacheOptions o;
  o.policy = "lru";
  o.capacity_bytes = 64 * kKiB;
  o.quotas = {{kB, 16 * kKiB}};
  Fixture f(o);
  for (int i = 0; i < 12; ++i) {
    ASSERT_EQ(test::put_in(*f.cache, kB, nkey('b', i), nvalue('b', i)), Status::kSuccess);
  }
  for (int i = 0; i < 640; ++i) {
    ASSERT_EQ(test::put_in(*f.cache, kA, nkey('a', i), nvalue('a', i)), Status::kSuccess);
  }
  EXPECT_EQ(ns_metric(*f.cache, "namespace_held_bytes", kA), 52.0 * kKiB);
  EXPECT_EQ(ns_metric(*f.cache, "namespace_evictions_total", kA), 640 - 52);
  for (int i = 640 - 52; i < 640; ++i) EXPECT_TRUE(cached(f, kA, nkey('a', i))) << i;
  EXPECT_FALSE(cached(f, kA, nkey('a', 640 - 53)));
  for (int i = 0; i < 12; ++i) EXPECT_TRUE(cached(f, kB, nkey('b', i))) << i;
}

// Tenant A has a quota of its own (8 KiB) and stores ten times it: it never holds more, it evicts
// its own entries oldest first (a read is a use), and B's and a namespace without a quota's stay.
TEST(CacheQuotaLru, QuotaNamespaceEvictsOnlyItsOwnOldestFirst) {
  CacheOptions o;
  o.policy = "lru";
  o.capacity_bytes = 32 * kKiB;
  o.quotas = {{kA, 8 * kKiB}, {kB, 16 * kKiB}};
  Fixture f(o);
  for (int i = 0; i < 16; ++i) {
    ASSERT_EQ(test::put_in(*f.cache, kB, nkey('b', i), nvalue('b', i)), Status::kSuccess);
  }
  for (int i = 0; i < 8; ++i) {
    ASSERT_EQ(test::put_in(*f.cache, kC, nkey('c', i), nvalue('c', i)), Status::kSuccess);
  }
  for (int i = 0; i < 8; ++i) {
    ASSERT_EQ(test::put_in(*f.cache, kA, nkey('a', i), nvalue('a', i)), Status::kSuccess);
  }
  EXPECT_EQ(test::get_in(*f.cache, kA, nkey('a', 0)), nvalue('a', 0));  // a1 is now the oldest
  for (int i = 8; i < 80; ++i) {
    ASSERT_EQ(test::put_in(*f.cache, kA, nkey('a', i), nvalue('a', i)), Status::kSuccess);
    EXPECT_LE(ns_metric(*f.cache, "namespace_held_bytes", kA), 8.0 * kKiB);
    if (i == 14) {  // seven new keys: a1..a7 went, a0 (read after them) stays
      EXPECT_TRUE(cached(f, kA, nkey('a', 0)));
      for (int j = 1; j < 8; ++j) EXPECT_FALSE(cached(f, kA, nkey('a', j))) << j;
    }
  }
  for (int i = 72; i < 80; ++i) EXPECT_TRUE(cached(f, kA, nkey('a', i))) << i;
  EXPECT_FALSE(cached(f, kA, nkey('a', 71)));
  const uint64_t gets = f.gate->count(BackendOpKind::kGet);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(test::get_in(*f.cache, kB, nkey('b', i)), nvalue('b', i));
  for (int i = 0; i < 8; ++i) EXPECT_EQ(test::get_in(*f.cache, kC, nkey('c', i)), nvalue('c', i));
  EXPECT_EQ(f.gate->count(BackendOpKind::kGet), gets);
  EXPECT_EQ(ns_metric(*f.cache, "namespace_evictions_total", kA), 72);
  EXPECT_EQ(ns_metric(*f.cache, "namespace_evictions_total", kB), 0);
  EXPECT_EQ(ns_metric(*f.cache, "namespace_evictions_total", kC), 0);
  EXPECT_EQ(ns_metric(*f.cache, "namespace_held_bytes", kC), 8.0 * kKiB);
}

// Over a memory backend with the same quotas (as open_store sets them up): a value larger than
// its namespace's quota is refused with 81h and nothing cached is evicted. Over a backend without
// quotas the Store succeeds, and the cache does not keep the value.
TEST(CacheQuotaLru, ValueLargerThanTheQuota) {
  CacheOptions o;
  o.policy = "lru";
  o.capacity_bytes = 64 * kKiB;
  o.quotas = {{kB, 8 * kKiB}};
  MemoryBackendOptions mo;
  mo.quotas = o.quotas;
  Fixture f(o, mo);
  for (int i = 0; i < 4; ++i) {
    ASSERT_EQ(test::put_in(*f.cache, kB, nkey('b', i), nvalue('b', i)), Status::kSuccess);
  }
  EXPECT_EQ(test::put_in(*f.cache, kB, nkey('b', 9), nvalue('b', 9, 8 * kKiB)),
            Status::kCapacityExceeded);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(cached(f, kB, nkey('b', i))) << i;
  EXPECT_EQ(ns_metric(*f.cache, "namespace_evictions_total", kB), 0);

  Fixture plain(o);
  ASSERT_EQ(test::put_in(*plain.cache, kB, nkey('b', 0), nvalue('b', 0)), Status::kSuccess);
  ASSERT_EQ(test::put_in(*plain.cache, kB, nkey('b', 9), nvalue('b', 9, 9 * kKiB)),
            Status::kSuccess);
  EXPECT_EQ(test::get_in(*plain.cache, kB, nkey('b', 9)), nvalue('b', 9, 9 * kKiB));
  EXPECT_EQ(ns_metric(*plain.cache, "namespace_held_bytes", kB), 1.0 * kKiB);
  EXPECT_TRUE(cached(plain, kB, nkey('b', 0)));
}

// A low-priority Store is evicted before any ordinary entry of its group, even a less recently
// used one; a read makes it ordinary. Within a quota namespace, the same.
TEST(CacheQuotaLru, LowPriorityGoesFirstAndAReadPromotes) {
  CacheOptions o;
  o.policy = "lru";
  o.capacity_bytes = 10 * kKiB;  // B's quota and 6 KiB for A
  o.quotas = {{kB, 4 * kKiB}};
  Fixture f(o);
  const auto put = [&](uint32_t ns, char tag, int i, uint8_t opt = 0) {
    ASSERT_EQ(test::put_in(*f.cache, ns, nkey(tag, i), nvalue(tag, i), opt), Status::kSuccess);
  };
  put(kA, 'a', 0);
  put(kA, 'a', 1);
  put(kA, 'a', 2, nvme::kStoreLowPriority);
  put(kA, 'a', 3, nvme::kStoreLowPriority);
  EXPECT_EQ(test::get_in(*f.cache, kA, nkey('a', 3)), nvalue('a', 3));  // a hit: now ordinary
  put(kB, 'b', 0, nvme::kStoreLowPriority);
  put(kB, 'b', 1);
  put(kB, 'b', 2);
  put(kB, 'b', 3, nvme::kStoreLowPriority);
  put(kA, 'a', 4);
  put(kA, 'a', 5);
  put(kA, 'a', 6);  // the capacity takes a2 (low) first
  EXPECT_FALSE(cached(f, kA, nkey('a', 2)));
  EXPECT_TRUE(cached(f, kA, nkey('a', 0)));
  put(kA, 'a', 7);  // then a0 (least recently used), not a3 (promoted, read after a1)
  EXPECT_FALSE(cached(f, kA, nkey('a', 0)));
  put(kB, 'b', 4);  // B's quota: b0 (its oldest low-priority entry), not b1
  EXPECT_FALSE(cached(f, kB, nkey('b', 0)));
  EXPECT_TRUE(cached(f, kB, nkey('b', 1)));
  put(kB, 'b', 5);  // then b3
  EXPECT_FALSE(cached(f, kB, nkey('b', 3)));
  put(kB, 'b', 6);  // then b1
  EXPECT_FALSE(cached(f, kB, nkey('b', 1)));
  for (int i : {1, 3, 4, 5, 6, 7}) EXPECT_TRUE(cached(f, kA, nkey('a', i))) << i;
  for (int i : {2, 4, 5, 6}) EXPECT_TRUE(cached(f, kB, nkey('b', i))) << i;
  EXPECT_EQ(ns_metric(*f.cache, "namespace_evictions_total", kA), 2);
  EXPECT_EQ(ns_metric(*f.cache, "namespace_evictions_total", kB), 3);
  // Rewritten as low priority, a cached ordinary entry goes first again.
  put(kA, 'a', 7, nvme::kStoreLowPriority);
  put(kA, 'a', 8);
  EXPECT_FALSE(cached(f, kA, nkey('a', 7)));
  EXPECT_TRUE(cached(f, kA, nkey('a', 1)));
}

// Hints and prefetch inside a quota namespace: a hinted entry survives its namespace's own
// eviction, and prefetched values never take the namespace past its quota.
TEST(CacheQuotaLru, HintsAndPrefetchWorkWithinAQuota) {
  CacheOptions o;
  o.policy = "lru";
  o.capacity_bytes = 64 * kKiB;
  o.quotas = {{kB, 8 * kKiB}};
  Fixture f(o);
  for (int i = 0; i < 8; ++i) {
    ASSERT_EQ(test::put_in(*f.cache, kB, nkey('b', i), nvalue('b', i)), Status::kSuccess);
  }
  const Key hinted = nkey('b', 0);
  f.cache->hint(kB, std::span(&hinted, 1));
  ASSERT_EQ(test::put_in(*f.cache, kB, nkey('b', 8), nvalue('b', 8)), Status::kSuccess);
  EXPECT_TRUE(cached(f, kB, nkey('b', 0)));  // the LRU victim, kept by its hint
  EXPECT_FALSE(cached(f, kB, nkey('b', 1)));
  // Twelve values only the backend has, prefetched into the namespace.
  std::vector<Key> ahead;
  for (int i = 20; i < 32; ++i) {
    ASSERT_EQ(test::put_in(*f.memory, kB, nkey('b', i), nvalue('b', i)), Status::kSuccess);
    ahead.push_back(nkey('b', i));
  }
  const uint64_t gets = f.gate->count(BackendOpKind::kGet);
  f.cache->prefetch(kB, ahead);
  ASSERT_TRUE(test::eventually([&] { return f.gate->count(BackendOpKind::kGet) == gets + 12; }));
  f.cache->drain();
  EXPECT_LE(ns_metric(*f.cache, "namespace_held_bytes", kB), 8.0 * kKiB);
  EXPECT_TRUE(cached(f, kB, nkey('b', 31)));
  EXPECT_EQ(test::get_in(*f.cache, kB, nkey('b', 31)), nvalue('b', 31));
  EXPECT_EQ(f.gate->count(BackendOpKind::kGet), gets + 12);
}

}  // namespace
}  // namespace gdkv
