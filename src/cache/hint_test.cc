// Scheduler hints: the HintedPolicy decorator against a reference model (an LRU that
// spares hinted keys), aging, bounds under a hint flood, hints for keys stored nowhere, the cache
// fetching hinted blocks from a lower tier, and the wire form's statuses through the controller.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <list>
#include <map>
#include <random>

#include "cache/policy.h"
#include "cache_test_util.h"
#include "gdkv/cache.h"
#include "gdkv/client.h"
#include "gdkv/commands.h"
#include "gdkv/tiered_backend.h"
#include "numbered_key.h"

namespace gdkv {
namespace {

using cache::AddKind;
using cache::numbered_key;
using nvme::Status;
using test::metric;

std::unique_ptr<cache::HintedPolicy> hinted_lru(uint64_t capacity, uint64_t max_hints = 1 << 20,
                                                uint64_t ttl = 0, double share = 1.0) {
  cache::PolicyOptions po;
  po.capacity_bytes = capacity;
  cache::HintOptions ho;
  ho.capacity_bytes = capacity;
  ho.max_hints = max_hints;
  ho.ttl = ttl;
  ho.max_share = share;
  return cache::make_hinted_policy(cache::make_policy("lru", po), ho);
}

// The reference: unit-size entries, LRU order; a hint (until the key is read or removed) spares
// the key; when only hinted keys are left, the one hinted last goes.
struct Reference {
  std::list<uint64_t> lru;  // front = least recent
  std::map<uint64_t, uint64_t> hint_seq;
  uint64_t seq = 0;
  bool resident(uint64_t k) const { return std::find(lru.begin(), lru.end(), k) != lru.end(); }
  void touch(uint64_t k) {
    lru.remove(k);
    lru.push_back(k);
    hint_seq.erase(k);
  }
  uint64_t evict() {
    for (auto it = lru.begin(); it != lru.end(); ++it) {
      if (!hint_seq.contains(*it)) {
        const uint64_t v = *it;
        lru.erase(it);
        return v;
      }
    }
    uint64_t best = 0, best_seq = 0;
    for (uint64_t k : lru) {
      if (hint_seq[k] >= best_seq) best = k, best_seq = hint_seq[k];
    }
    lru.remove(best);
    hint_seq.erase(best);
    return best;
  }
};

TEST(HintPolicy, MatchesTheReferenceModel) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    std::mt19937_64 rng(seed);
    const uint64_t cap = 8 + seed % 8;
    auto p = hinted_lru(cap);
    Reference ref;
    uint64_t now = 0;
    for (int step = 0; step < 3000; ++step) {
      const uint64_t k = rng() % 40;
      const NsKey key = numbered_key(k);
      const int what = static_cast<int>(rng() % 10);
      ++now;
      if (what < 3) {
        p->hint(key, ref.resident(k) ? 1 : 0, now);
        ref.hint_seq[k] = ++ref.seq;
      } else if (what == 3) {
        p->remove(key);
        ref.lru.remove(k);
        ref.hint_seq.erase(k);
      } else if (ref.resident(k)) {
        p->record_access(key, 1, now);
        ref.touch(k);
      } else {
        p->prepare_insert(key, 1, AddKind::kDemand);
        while (ref.lru.size() + 1 > cap) {
          NsKey v;
          ASSERT_TRUE(p->evict(&v));
          const uint64_t want = ref.evict();
          ASSERT_EQ(v, numbered_key(want)) << "seed " << seed << " step " << step;
        }
        p->add(key, 1, now, AddKind::kDemand);
        ref.lru.push_back(k);
        ref.hint_seq.erase(k);  // a miss read it: the hint was used
      }
      ASSERT_EQ(p->entries(), ref.lru.size());
    }
  }
}

TEST(HintPolicy, HintsAgeOut) {
  auto p = hinted_lru(4, 1 << 20, /*ttl=*/10);
  for (uint64_t k = 0; k < 4; ++k) p->add(numbered_key(k), 1, k + 1, AddKind::kDemand);
  p->hint(numbered_key(0), 1, 5);
  NsKey v;
  // Fresh hint: key 0 (least recent) is spared.
  p->prepare_insert(numbered_key(10), 1, AddKind::kDemand);
  ASSERT_TRUE(p->evict(&v));
  EXPECT_EQ(v, numbered_key(1));
  p->add(numbered_key(10), 1, 6, AddKind::kDemand);
  EXPECT_TRUE(p->hinted(numbered_key(0)));
  EXPECT_EQ(p->protected_bytes(), 1u);
  // Past its ttl the hint is gone and its block, never read, goes first.
  p->add(numbered_key(11), 1, 30, AddKind::kDemand);
  ASSERT_TRUE(p->evict(&v));
  EXPECT_EQ(v, numbered_key(0));
  EXPECT_FALSE(p->hinted(numbered_key(0)));
  EXPECT_EQ(p->protected_bytes(), 0u);
  EXPECT_EQ(p->hints(), 0u);
}

TEST(HintPolicy, AFloodOfHintsIsBounded) {
  const uint64_t cap = 100;
  auto p = hinted_lru(cap, /*max_hints=*/64, 0, /*share=*/0.5);
  uint64_t now = 0;
  for (uint64_t k = 0; k < cap; ++k) p->add(numbered_key(k), 1, ++now, AddKind::kDemand);
  auto size = [&](uint64_t k) -> uint64_t { return k < cap ? 1 : 0; };  // keys 0..cap-1 resident
  for (uint64_t k = 0; k < 100000; ++k) p->hint(numbered_key(k % 5000), size(k % 5000), ++now);
  EXPECT_LE(p->hints(), 64u);
  // Everything resident is hinted now, yet new blocks still find room and at most half the
  // capacity stays protected.
  for (uint64_t k = 0; k < 1000; ++k) p->hint(numbered_key(k), size(k), ++now);
  for (uint64_t k = 10000; k < 10000 + 2 * cap; ++k) {
    p->prepare_insert(numbered_key(k), 1, AddKind::kDemand);
    NsKey v;
    ASSERT_TRUE(p->evict(&v));
    p->add(numbered_key(k), 1, ++now, AddKind::kDemand);
    ASSERT_LE(p->protected_bytes(), cap / 2);
  }
  EXPECT_EQ(p->entries(), cap);
  EXPECT_LE(p->hints(), 64u);
  // Everything can still be evicted.
  NsKey v;
  uint64_t n = 0;
  while (p->evict(&v)) ++n;
  EXPECT_EQ(n, cap);
  EXPECT_EQ(p->protected_bytes(), 0u);
}

TEST(HintPolicy, HintsForKeysStoredNowhereChangeNothing) {
  for (const char* name : {"lru", "lru-k", "arc", "prefix"}) {
    cache::PolicyOptions po;
    po.capacity_bytes = 50;
    auto plain = cache::make_policy(name, po);
    cache::HintOptions ho;
    ho.capacity_bytes = 50;
    auto hinted = cache::make_hinted_policy(cache::make_policy(name, po), ho);
    std::mt19937_64 rng(7);
    std::vector<uint64_t> res;
    uint64_t now = 0;
    std::map<uint64_t, bool> in;
    for (int i = 0; i < 5000; ++i) {
      const uint64_t k = rng() % 200;
      ++now;
      hinted->hint(numbered_key(1'000'000 + rng() % 1000), 0, now);  // never stored
      const NsKey key = numbered_key(k);
      if (in[k]) {
        plain->record_access(key, 1, now);
        hinted->record_access(key, 1, now);
        continue;
      }
      plain->prepare_insert(key, 1, AddKind::kDemand);
      hinted->prepare_insert(key, 1, AddKind::kDemand);
      while (plain->entries() + 1 > 50) {
        NsKey a, b;
        ASSERT_TRUE(plain->evict(&a));
        ASSERT_TRUE(hinted->evict(&b));
        ASSERT_EQ(a, b) << name << " step " << i;
        uint64_t id = 0;
        std::memcpy(&id, a.key.bytes, sizeof(id));
        in[id] = false;
      }
      plain->add(key, 1, now, AddKind::kDemand);
      hinted->add(key, 1, now, AddKind::kDemand);
      in[k] = true;
    }
    EXPECT_EQ(hinted->protected_bytes(), 0u) << name;
  }
}

// A near tier (memory) over a slow far tier (memory with latency), the DRAM cache on top.
TEST(HintCache, HintedBlocksFromTheLowerTierAreInDramBeforeTheRead) {
  MemoryBackendOptions slow;
  slow.delay_us = 2000;
  auto far = make_memory_backend(slow);
  auto tiered = make_tiered_backend(make_memory_backend(), far).value();
  CacheOptions o;
  o.prefetch_depth = 0;  // hints only
  auto cache = make_cached_backend(tiered, o).value();
  std::vector<Key> keys;
  for (int i = 0; i < 24; ++i) {
    uint64_t id = 500 + i;
    keys.push_back(Key::from_bytes(&id, sizeof(id)));
    ASSERT_EQ(test::put(*far, keys.back(), std::string(4096, static_cast<char>('a' + i))),
              Status::kSuccess);
  }
  ASSERT_EQ(metric(*cache, "cache_entries"), 0);
  cache->hint(1, keys);
  ASSERT_TRUE(test::eventually([&] {
    return metric(*cache, "cache_prefetch_inflight") == 0 &&
           metric(*cache, "cache_prefetch_queued") == 0 && metric(*cache, "cache_entries") == 24;
  }));
  EXPECT_EQ(metric(*cache, "cache_prefetch_issued_total", "source=hint"), 24);
  EXPECT_EQ(metric(*cache, "cache_hint_keys_total"), 24);
  for (int i = 0; i < 24; ++i) {
    test::SyncOp op(BackendOpKind::kGet, keys[i]);
    ASSERT_EQ(op.run(*cache), Status::kSuccess);
    EXPECT_EQ(op.value(), std::string(4096, static_cast<char>('a' + i)));
  }
  EXPECT_EQ(metric(*cache, "cache_hits_total"), 24);
  EXPECT_EQ(metric(*cache, "cache_misses_total"), 0);
  EXPECT_EQ(metric(*cache, "cache_prefetch_used_total"), 24);
}

TEST(HintCache, HintedBlocksSurviveAScan) {
  CacheOptions o;
  o.capacity_bytes = 64 * 4096;
  o.prefetch_depth = 0;
  o.policy = "lru";
  auto memory = make_memory_backend();
  auto cache = make_cached_backend(memory, o).value();
  auto k = [](uint64_t id) { return Key::from_bytes(&id, sizeof(id)); };
  for (uint64_t i = 0; i < 400; ++i) {
    ASSERT_EQ(test::put(*memory, k(i), std::string(4096, 'x')), Status::kSuccess);
  }
  for (uint64_t i = 0; i < 16; ++i) {
    test::SyncOp op(BackendOpKind::kGet, k(i));
    ASSERT_EQ(op.run(*cache), Status::kSuccess);
  }
  std::vector<Key> hinted;
  for (uint64_t i = 0; i < 16; ++i) hinted.push_back(k(i));
  cache->hint(1, hinted);
  for (uint64_t i = 100; i < 400; ++i) {  // a scan that would flush an LRU
    test::SyncOp op(BackendOpKind::kGet, k(i));
    ASSERT_EQ(op.run(*cache), Status::kSuccess);
  }
  const double hits = metric(*cache, "cache_hits_total");
  for (uint64_t i = 0; i < 16; ++i) {
    test::SyncOp op(BackendOpKind::kGet, k(i));
    ASSERT_EQ(op.run(*cache), Status::kSuccess);
  }
  EXPECT_EQ(metric(*cache, "cache_hits_total") - hits, 16);
  EXPECT_LE(metric(*cache, "cache_bytes"), 64 * 4096);
}

TEST(HintCache, AHintForKeysStoredNowhereCostsNothing) {
  CacheOptions o;
  o.prefetch_depth = 0;
  auto memory = make_memory_backend();
  auto cache = make_cached_backend(memory, o).value();
  std::vector<Key> ghosts;
  for (uint64_t i = 0; i < 32; ++i) {
    uint64_t id = 9000 + i;
    ghosts.push_back(Key::from_bytes(&id, sizeof(id)));
  }
  cache->hint(1, ghosts);
  ASSERT_TRUE(test::eventually([&] {
    return metric(*cache, "cache_prefetch_failed_total") == 32 &&
           metric(*cache, "cache_prefetch_inflight") == 0;
  }));
  EXPECT_EQ(metric(*cache, "cache_entries"), 0);
  EXPECT_EQ(metric(*cache, "cache_bytes"), 0);
  EXPECT_EQ(metric(*cache, "cache_hint_protected_bytes"), 0);
}

// The wire form through the controller: good hints succeed, bad ones get their status.
TEST(HintWire, StatusesThroughTheController) {
  auto memory = make_memory_backend();
  auto cache = make_cached_backend(memory, CacheOptions{}).value();
  auto client = Client::open(cache).value();
  const Key a = *Key::from_string("a");
  const std::vector<std::byte> v = test::bytes_of("v");
  ASSERT_EQ(client->put(a, std::span(v)).status, Status::kSuccess);
  EXPECT_TRUE(client->hint(std::span(&a, 1)).ok());
  // The client refuses what it cannot send.
  EXPECT_EQ(client->hint({}).status, Status::kInvalidField);
  Key bad;
  bad.len = 0;
  EXPECT_EQ(client->hint(std::span(&bad, 1)).status, Status::kInvalidKeySize);
  std::vector<Key> huge(5000, a);  // 5000 * 4 + 4 bytes < 64 KiB: fine
  EXPECT_TRUE(client->hint(huge).ok());
  huge.assign(20000, a);  // over 64 KiB of KeyList
  EXPECT_EQ(client->hint(huge).status, Status::kInvalidField);

  // Raw SQEs, as a hostile or stock host would send them.
  auto raw = [&](std::vector<std::byte> list, uint8_t options) {
    nvme::Sqe s = cmd::hint(list.data(), static_cast<uint32_t>(list.size()));
    s.options = options;
    return client->execute(s).status;
  };
  std::vector<std::byte> empty(4, std::byte{0});  // count 0
  EXPECT_EQ(raw(empty, nvme::kPrefetchHint), Status::kInvalidField);
  EXPECT_EQ(raw(empty, 0), Status::kSuccess);  // a stock empty Prefetch stays a no-op
  std::vector<std::byte> badlen(8, std::byte{0});
  badlen[0] = std::byte{1};   // one key
  badlen[4] = std::byte{17};  // of 17 bytes
  EXPECT_EQ(raw(badlen, nvme::kPrefetchHint), Status::kInvalidKeySize);
  std::vector<std::byte> good(8, std::byte{0});
  nvme::KeyListWriter w(good.data(), good.size());
  ASSERT_TRUE(w.add(a.bytes, a.len));
  w.finish();
  EXPECT_EQ(raw(good, 0x80), Status::kInvalidField);  // reserved option bit
  EXPECT_EQ(raw(good, nvme::kPrefetchHint), Status::kSuccess);
  std::vector<std::byte> over(64 * 1024 + 4, std::byte{0});
  EXPECT_EQ(raw(over, nvme::kPrefetchHint), Status::kInvalidField);
}

}  // namespace
}  // namespace gdkv
