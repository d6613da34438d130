// Eviction policies: LRU-K against a direct reference model on random traces, scan resistance,
// and the adaptive policy's balance between recency and frequency.
#include "cache/policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace gdkv::cache {
namespace {

// LRU-K as the documentation states it, with vectors and linear scans.
class LruKModel {
 public:
  LruKModel(uint32_t k, uint64_t history, uint64_t window)
      : k_(k), history_cap_(history), window_(window) {}

  bool resident(uint64_t id) const { return find(resident_, id) != resident_.end(); }
  size_t size() const { return resident_.size(); }

  void add(uint64_t id, uint64_t now, AddKind kind) {
    E e;
    e.id = id;
    if (auto h = find(history_, id); h != history_.end()) {
      e = *h;
      history_.erase(h);
    }
    if (kind == AddKind::kDemand) {
      reference(e, now);
    } else if (e.bursts.empty()) {
      e.added = now;
    }
    e.seq = seq_++;
    resident_.push_back(e);
  }
  void access(uint64_t id, uint64_t now) { reference(*find(resident_, id), now); }
  void remove(uint64_t id) {
    if (auto it = find(resident_, id); it != resident_.end()) resident_.erase(it);
  }
  uint64_t evict() {
    auto victim = std::min_element(resident_.begin(), resident_.end(),
                                   [&](const E& a, const E& b) { return goes_first(a, b); });
    E e = *victim;
    resident_.erase(victim);
    history_.push_back(e);
    const size_t cap = history_cap_ ? history_cap_ : std::max<size_t>(resident_.size(), 1);
    while (history_.size() > cap) history_.erase(history_.begin());
    return e.id;
  }

 private:
  struct E {
    uint64_t id = 0;
    std::vector<uint64_t> bursts;  // most recent first, at most K
    uint64_t last = 0;
    bool has_last = false;
    uint64_t added = 0;
    uint64_t seq = 0;
  };
  static std::vector<E>::const_iterator find(const std::vector<E>& v, uint64_t id) {
    return std::find_if(v.begin(), v.end(), [&](const E& e) { return e.id == id; });
  }
  static std::vector<E>::iterator find(std::vector<E>& v, uint64_t id) {
    return std::find_if(v.begin(), v.end(), [&](const E& e) { return e.id == id; });
  }
  void reference(E& e, uint64_t now) {
    if (e.has_last && !e.bursts.empty() && now - e.last <= window_) {
      e.bursts[0] = now;  // same burst
    } else {
      e.bursts.insert(e.bursts.begin(), now);
      if (e.bursts.size() > k_) e.bursts.pop_back();
    }
    e.last = now;
    e.has_last = true;
  }
  // Fewer than K bursts first (oldest retained burst, or the time a prefetch added it); then the
  // oldest K-th burst; equal times: the older insertion.
  bool goes_first(const E& a, const E& b) const {
    const bool fa = a.bursts.size() >= k_, fb = b.bursts.size() >= k_;
    if (fa != fb) return !fa;
    const uint64_t ta = fa ? a.bursts[k_ - 1] : (a.bursts.empty() ? a.added : a.bursts.back());
    const uint64_t tb = fb ? b.bursts[k_ - 1] : (b.bursts.empty() ? b.added : b.bursts.back());
    if (ta != tb) return ta < tb;
    return a.seq < b.seq;
  }

  uint32_t k_;
  uint64_t history_cap_;
  uint64_t window_;
  uint64_t seq_ = 0;
  std::vector<E> resident_;
  std::vector<E> history_;  // oldest evicted first
};

uint64_t id_of(const CacheKey& k) {
  uint64_t id;
  std::memcpy(&id, k.key.bytes, sizeof(id));
  return id;
}

TEST(LruKPolicy, MatchesReferenceModelOnRandomTraces) {
  std::mt19937_64 rng(7);
  int traces = 0;
  for (uint32_t k : {1u, 2u, 3u, 4u}) {
    for (uint64_t window : {0u, 2u, 6u}) {
      for (uint64_t history : {0u, 3u, 1000u}) {
        for (int rep = 0; rep < 6; ++rep, ++traces) {
          PolicyOptions po;
          po.k = k;
          po.history_entries = history;
          po.correlated_window = window;
          auto policy = make_policy("lru-k", po);
          ASSERT_NE(policy, nullptr);
          LruKModel model(k, history, window);
          const size_t capacity = 1 + rng() % 12;
          const uint64_t universe = 8 + rng() % 40;
          // Skewed popularity, so counts differ between keys.
          std::vector<double> weights(universe);
          for (uint64_t i = 0; i < universe; ++i) weights[i] = 1.0 / (1 + i);
          std::discrete_distribution<uint64_t> pick(weights.begin(), weights.end());
          uint64_t now = 0;
          for (int step = 0; step < 1500; ++step) {
            now += 1 + rng() % 3;
            const uint64_t id = pick(rng);
            const CacheKey key = numbered_key(id);
            const unsigned what = rng() % 20;
            auto make_room = [&] {
              while (model.size() >= capacity) {
                CacheKey victim;
                ASSERT_TRUE(policy->evict(&victim));
                ASSERT_EQ(id_of(victim), model.evict())
                    << "k=" << k << " window=" << window << " history=" << history
                    << " step=" << step;
              }
            };
            if (what < 2) {  // invalidation
              policy->remove(key);
              model.remove(id);
            } else if (model.resident(id)) {
              policy->record_access(key, 1, now);
              model.access(id, now);
            } else {
              const AddKind kind = what < 4 ? AddKind::kPrefetch : AddKind::kDemand;
              policy->prepare_insert(key, 1, kind);
              make_room();
              if (testing::Test::HasFatalFailure()) return;
              policy->add(key, 1, now, kind);
              model.add(id, now, kind);
            }
            ASSERT_EQ(policy->entries(), model.size());
          }
        }
      }
    }
  }
  EXPECT_EQ(traces, 4 * 3 * 3 * 6);
}

// Hits of `policy` on a trace of demand references, with room for `capacity` unit-size entries.
double hit_ratio(const std::string& name, const std::vector<uint64_t>& trace, uint64_t capacity) {
  PolicyOptions po;
  po.capacity_bytes = capacity;
  auto policy = make_policy(name, po);
  std::unordered_set<uint64_t> resident;
  uint64_t hits = 0, now = 0;
  for (uint64_t id : trace) {
    const CacheKey key = numbered_key(id);
    ++now;
    if (resident.contains(id)) {
      ++hits;
      policy->record_access(key, 1, now);
      continue;
    }
    policy->prepare_insert(key, 1, AddKind::kDemand);
    while (resident.size() >= capacity) {
      CacheKey victim;
      EXPECT_TRUE(policy->evict(&victim));
      resident.erase(id_of(victim));
    }
    policy->add(key, 1, now, AddKind::kDemand);
    resident.insert(id);
  }
  return static_cast<double>(hits) / static_cast<double>(trace.size());
}

// A hot loop of 100 keys, each pass followed by a scan of 300 keys never seen again.
std::vector<uint64_t> hot_loop_with_scans() {
  std::vector<uint64_t> trace;
  uint64_t next_scan = 1'000'000;
  for (int round = 0; round < 60; ++round) {
    for (int pass = 0; pass < 2; ++pass) {
      for (uint64_t i = 0; i < 100; ++i) trace.push_back(i);
    }
    for (int i = 0; i < 300; ++i) trace.push_back(next_scan++);
  }
  return trace;
}

TEST(LruKPolicy, ResistsScansThatFlushLru) {
  const auto trace = hot_loop_with_scans();
  const double lru = hit_ratio("lru", trace, 150);
  const double lru2 = hit_ratio("lru-k", trace, 150);
  // LRU loses the hot loop to every scan; LRU-2 keeps it (only scan keys have one reference).
  EXPECT_GT(lru2, lru + 0.15) << "lru " << lru << " lru-2 " << lru2;
  EXPECT_GT(lru2, 0.38);  // the ceiling is 0.4: every hot reference after the first round
}

TEST(AdaptivePolicy, FollowsFrequencyUnderScans) {
  const auto trace = hot_loop_with_scans();
  const double lru = hit_ratio("lru", trace, 150);
  const double lru2 = hit_ratio("lru-k", trace, 150);
  const double adaptive = hit_ratio("adaptive", trace, 150);
  std::printf("scan trace: lru %.3f lru-2 %.3f adaptive %.3f\n", lru, lru2, adaptive);
  EXPECT_GT(adaptive, lru + 0.1) << "adaptive " << adaptive << " lru " << lru;
  EXPECT_GT(adaptive, lru2 - 0.05) << "adaptive " << adaptive << " lru-2 " << lru2;
}

// Every key is used twice, the second time shortly after the first: pure recency. LRU-2 evicts a
// once-used key before any twice-used one, so it loses the short reuse that LRU catches.
TEST(AdaptivePolicy, FollowsRecencyWhenReuseIsShort) {
  std::vector<uint64_t> trace;
  std::mt19937_64 rng(3);
  // A background of keys used twice far apart (they look "frequent" to LRU-2) ...
  std::vector<uint64_t> window;
  uint64_t next = 0;
  for (int i = 0; i < 40000; ++i) {
    const uint64_t id = next++;
    trace.push_back(id);
    window.push_back(id);
    // ... reused after 20..60 other references.
    if (window.size() > 60) {
      const size_t j = rng() % 40;
      trace.push_back(window[j]);
      window.erase(window.begin() + static_cast<std::ptrdiff_t>(j));
    }
  }
  const double lru = hit_ratio("lru", trace, 120);
  const double lru2 = hit_ratio("lru-k", trace, 120);
  const double adaptive = hit_ratio("adaptive", trace, 120);
  std::printf("short-reuse trace: lru %.3f lru-2 %.3f adaptive %.3f\n", lru, lru2, adaptive);
  EXPECT_GE(adaptive, lru2 - 0.01) << "adaptive " << adaptive << " lru-2 " << lru2;
  EXPECT_GE(adaptive, lru - 0.03) << "adaptive " << adaptive << " lru " << lru;
}

TEST(LruPolicy, EqualsLruKWithKOne) {
  std::mt19937_64 rng(11);
  PolicyOptions po;
  po.k = 1;
  auto lru = make_policy("lru", po);
  auto lru1 = make_policy("lru-k", po);
  std::unordered_set<uint64_t> resident;
  for (uint64_t now = 1; now < 20000; ++now) {
    const uint64_t id = rng() % 64;
    const CacheKey key = numbered_key(id);
    if (resident.contains(id)) {
      lru->record_access(key, 1, now);
      lru1->record_access(key, 1, now);
      continue;
    }
    while (resident.size() >= 16) {
      CacheKey a, b;
      ASSERT_TRUE(lru->evict(&a));
      ASSERT_TRUE(lru1->evict(&b));
      ASSERT_EQ(id_of(a), id_of(b));
      resident.erase(id_of(a));
    }
    lru->add(key, 1, now, AddKind::kDemand);
    lru1->add(key, 1, now, AddKind::kDemand);
    resident.insert(id);
  }
}

// The adaptive policy keeps every expert's state in step with the cache: pinned to one expert,
// it must evict exactly as that policy alone does (random traces with prefetches, removals and
// size changes).
TEST(AdaptivePolicy, PinnedToAnExpertBehavesAsThatPolicy) {
  std::mt19937_64 rng(21);
  for (const char* expert : {"arc", "lru-k", "lru"}) {
    for (int rep = 0; rep < 20; ++rep) {
      PolicyOptions po;
      po.capacity_bytes = 200 + rng() % 2000;
      po.correlated_window = rng() % 3;
      po.history_entries = rng() % 2 ? 0 : 1 + rng() % 20;
      PolicyOptions pinned = po;
      pinned.pin_expert = expert;
      auto alone = make_policy(expert, po);
      auto adaptive = make_policy("adaptive", pinned);
      ASSERT_NE(adaptive, nullptr);
      std::unordered_map<uint64_t, uint64_t> sizes;  // resident keys
      uint64_t bytes = 0;
      for (uint64_t now = 1; now < 4000; ++now) {
        const uint64_t id = rng() % 60;
        const CacheKey key = numbered_key(id);
        const uint64_t size = 10 + rng() % 90;
        const unsigned what = rng() % 10;
        if (what == 0) {
          alone->remove(key);
          adaptive->remove(key);
          if (auto it = sizes.find(id); it != sizes.end()) {
            bytes -= it->second;
            sizes.erase(it);
          }
          continue;
        }
        if (auto it = sizes.find(id); it != sizes.end()) {
          alone->record_access(key, size, now);
          adaptive->record_access(key, size, now);
          bytes = bytes - it->second + size;
          it->second = size;
        } else {
          const AddKind kind = what == 1 ? AddKind::kPrefetch : AddKind::kDemand;
          alone->prepare_insert(key, size, kind);
          adaptive->prepare_insert(key, size, kind);
          while (bytes + size > po.capacity_bytes) {
            CacheKey a, b;
            ASSERT_TRUE(alone->evict(&a));
            ASSERT_TRUE(adaptive->evict(&b));
            ASSERT_EQ(id_of(a), id_of(b)) << expert << " rep " << rep << " at " << now;
            bytes -= sizes[id_of(a)];
            sizes.erase(id_of(a));
          }
          alone->add(key, size, now, kind);
          adaptive->add(key, size, now, kind);
          sizes[id] = size;
          bytes += size;
        }
        ASSERT_EQ(alone->entries(), adaptive->entries());
      }
    }
  }
}

TEST(Policies, FactoryRejectsBadNames) {
  PolicyOptions po;
  EXPECT_EQ(make_policy("mru", po), nullptr);
  po.k = 0;
  EXPECT_EQ(make_policy("lru-k", po), nullptr);
  po.k = kMaxK + 1;
  EXPECT_EQ(make_policy("lru-k", po), nullptr);
  po.k = kMaxK;
  EXPECT_NE(make_policy("lru-k", po), nullptr);
}

// A prefetched entry is not a reference: it goes before entries that were used, and its first
// use is its first reference (not its second).
TEST(LruKPolicy, PrefetchIsNotAReference) {
  PolicyOptions po;
  auto p = make_policy("lru-k", po);
  p->add(numbered_key(1), 1, 1, AddKind::kDemand);
  p->record_access(numbered_key(1), 1, 2);  // key 1: two references
  p->add(numbered_key(2), 1, 3, AddKind::kPrefetch);
  p->record_access(numbered_key(2), 1, 4);  // key 2: one reference
  p->add(numbered_key(3), 1, 5, AddKind::kDemand);
  CacheKey v;
  ASSERT_TRUE(p->evict(&v));
  EXPECT_EQ(id_of(v), 2u);  // one reference, older than key 3's
  ASSERT_TRUE(p->evict(&v));
  EXPECT_EQ(id_of(v), 3u);
  ASSERT_TRUE(p->evict(&v));
  EXPECT_EQ(id_of(v), 1u);
  EXPECT_FALSE(p->evict(&v));
}

// Zero-length values through ARC (and the adaptive policy, which runs ARC): a ghost hit divides
// one ghost list's bytes by the other's, which are 0 when only zero-length keys were evicted into
// it (0/0, and x/0 = inf converted to an integer: undefined; -fsanitize=float-divide-by-zero and
// float-cast-overflow abort here without the fix). Every case: a ghost hit in B1 with both ghost
// lists empty of bytes, in B1 with B2 holding bytes, in B2 with B1 holding bytes; then the policy
// still evicts every entry exactly once.
TEST(ArcPolicy, ZeroLengthValuesAndGhostHits) {
  for (const char* name : {"arc", "adaptive"}) {
    SCOPED_TRACE(name);
    PolicyOptions po;
    po.capacity_bytes = 100;
    po.expected_entries = 8;
    auto p = make_policy(name, po);
    ASSERT_NE(p, nullptr);
    uint64_t now = 0;
    auto add = [&](uint64_t id, uint64_t size) {
      p->prepare_insert(numbered_key(id), size, AddKind::kDemand);
      p->add(numbered_key(id), size, ++now, AddKind::kDemand);
    };
    // B1 hit, ghosts hold 0 bytes: 0 / 0.
    add(1, 0);
    add(2, 0);
    p->evict_key(numbered_key(1));  // T1 -> B1 (0 bytes)
    add(1, 0);                      // ghost hit in B1
    // B1 hit, B2 holds bytes and B1 none: x / 0.
    add(3, 10);
    p->record_access(numbered_key(3), 10, ++now);  // T2
    p->evict_key(numbered_key(3));                 // -> B2 (10 bytes)
    add(4, 0);
    p->evict_key(numbered_key(4));  // -> B1 (0 bytes)
    add(4, 0);
    // B2 hit, B1 holds bytes and B2 none: x / 0 the other way.
    add(5, 0);
    p->record_access(numbered_key(5), 0, ++now);  // T2, 0 bytes
    add(6, 10);
    p->evict_key(numbered_key(6));                 // T1 -> B1 (10 bytes)
    add(3, 10);                                    // B2's 10 bytes leave with key 3
    p->evict_key(numbered_key(5));                 // -> B2 (0 bytes)
    add(5, 0);                                     // ghost hit in B2
    p->record_access(numbered_key(5), 50, ++now);  // a zero-length entry that grows
    auto drain = [&](size_t expect) {
      std::unordered_set<uint64_t> evicted;
      CacheKey v;
      while (p->evict(&v)) EXPECT_TRUE(evicted.insert(id_of(v)).second);
      EXPECT_EQ(evicted.size(), expect);
    };
    drain(5);  // 1 to 5
    // A full cache of mostly zero-length entries, with re-references and ghost hits.
    std::unordered_map<uint64_t, uint64_t> sizes;
    uint64_t bytes = 0;
    std::mt19937_64 rng(13);
    for (int i = 0; i < 20000; ++i) {
      const uint64_t id = rng() % 200, size = rng() % 4 == 0 ? rng() % 30 : 0;
      if (auto it = sizes.find(id); it != sizes.end()) {
        bytes = bytes - it->second + size;
        it->second = size;
        p->record_access(numbered_key(id), size, ++now);
        continue;
      }
      p->prepare_insert(numbered_key(id), size, AddKind::kDemand);
      while (bytes + size > po.capacity_bytes || sizes.size() >= 50) {
        CacheKey v;
        ASSERT_TRUE(p->evict(&v));
        auto it = sizes.find(id_of(v));
        ASSERT_NE(it, sizes.end());
        bytes -= it->second;
        sizes.erase(it);
      }
      p->add(numbered_key(id), size, ++now, AddKind::kDemand);
      sizes[id] = size;
      bytes += size;
      ASSERT_EQ(p->entries(), sizes.size());
    }
    drain(sizes.size());
    EXPECT_EQ(p->entries(), 0u);
  }
}

}  // namespace
}  // namespace gdkv::cache
