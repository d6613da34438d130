// The memory backend's capacity, eviction and value memory: it evicts least recently
// used values instead of failing with 81h once full, and values it copies live in an arena that
// evicted and deleted values return to. Namespace quotas and low-priority Stores.
#include <gtest/gtest.h>

#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "cache_test_util.h"
#include "gdkv/backend.h"

namespace gdkv {
namespace {

using nvme::Status;
using test::SyncOp;

constexpr size_t kMiB = size_t{1} << 20;

Key key(const std::string& s) { return *Key::from_string(s); }

double metric_of(const Backend& b, const std::string& name) {
  MetricList m;
  b.collect(m);
  for (const Metric& x : m) {
    if (x.name == name) return x.value;
  }
  return -1;
}

std::string get(Backend& b, const Key& k, Status* s = nullptr) {
  SyncOp op(BackendOpKind::kGet, k);
  const Status st = op.run(b);
  if (s != nullptr) *s = st;
  return st == Status::kSuccess ? op.value() : std::string();
}

TEST(MemoryBackend, DefaultCapacityIsOneGiB) {
  EXPECT_EQ(MemoryBackendOptions{}.capacity_bytes, uint64_t{1} << 30);
  EXPECT_EQ(make_memory_backend()->info().capacity_bytes, uint64_t{1} << 30);
}

TEST(MemoryBackend, FullStoreEvictsLeastRecentlyUsedFirst) {
  MemoryBackendOptions mo;
  mo.capacity_bytes = 4 * (1022 + 2);  // four 1022-byte values under 2-byte keys
  auto b = make_memory_backend(mo);
  const auto value = [](const char* k) { return std::string(1022, k[1]); };
  for (const char* k : {"k0", "k1", "k2", "k3"}) {
    ASSERT_EQ(test::put(*b, key(k), value(k)), Status::kSuccess);
  }
  EXPECT_EQ(get(*b, key("k0")), value("k0"));  // k0 used again: k1 is now the oldest
  ASSERT_EQ(test::put(*b, key("k4"), value("k4")), Status::kSuccess);
  Status s;
  get(*b, key("k1"), &s);
  EXPECT_EQ(s, Status::kKeyNotExist);
  for (const char* k : {"k2", "k0", "k3", "k4"}) EXPECT_EQ(get(*b, key(k)), value(k));
  EXPECT_EQ(b->info().keys, 4u);
  EXPECT_EQ(b->info().bytes_used, mo.capacity_bytes);
  EXPECT_EQ(metric_of(*b, "backend_evictions_total"), 1);
  // Equal sizes: each new key evicts exactly the least recently used one (k2, then k0).
  ASSERT_EQ(test::put(*b, key("k5"), value("k5")), Status::kSuccess);
  get(*b, key("k2"), &s);
  EXPECT_EQ(s, Status::kKeyNotExist);
  ASSERT_EQ(test::put(*b, key("k6"), value("k6")), Status::kSuccess);
  get(*b, key("k0"), &s);
  EXPECT_EQ(s, Status::kKeyNotExist);
  for (const char* k : {"k3", "k4", "k5", "k6"}) EXPECT_EQ(get(*b, key(k)), value(k));
  EXPECT_EQ(metric_of(*b, "backend_evictions_total"), 3);
  // A larger value evicts the oldest until it fits in bytes and in contiguous memory.
  ASSERT_EQ(test::put(*b, key("k7"), std::string(2500, '7')), Status::kSuccess);
  EXPECT_LE(b->info().keys, 2u);
  EXPECT_LE(b->info().bytes_used, mo.capacity_bytes);
  EXPECT_EQ(get(*b, key("k7")), std::string(2500, '7'));
}

TEST(MemoryBackend, BadSizes) {
  MemoryBackendOptions mo;
  mo.capacity_bytes = 10000;
  auto b = make_memory_backend(mo);
  ASSERT_EQ(test::put(*b, key("keep"), "x"), Status::kSuccess);
  // Larger than the whole capacity: 81h, nothing evicted.
  EXPECT_EQ(test::put(*b, key("big"), std::string(10000, 'b')), Status::kCapacityExceeded);
  EXPECT_EQ(get(*b, key("keep")), "x");
  EXPECT_EQ(metric_of(*b, "backend_evictions_total"), 0);
  // Zero bytes: stored and read back empty.
  ASSERT_EQ(test::put(*b, key("empty"), ""), Status::kSuccess);
  Status s;
  EXPECT_EQ(get(*b, key("empty"), &s), "");
  EXPECT_EQ(s, Status::kSuccess);
  // Exactly the capacity (key and value): fits, after evicting everything else.
  ASSERT_EQ(test::put(*b, key("all"), std::string(10000 - 3, 'a')), Status::kSuccess);
  EXPECT_EQ(b->info().keys, 1u);
  EXPECT_EQ(get(*b, key("all")), std::string(10000 - 3, 'a'));

  // Capacity 0: every Store gets 81h, the backend still answers the rest.
  mo.capacity_bytes = 0;
  auto none = make_memory_backend(mo);
  EXPECT_EQ(test::put(*none, key("a"), "v"), Status::kCapacityExceeded);
  EXPECT_EQ(test::put(*none, key("a"), ""), Status::kCapacityExceeded);
  get(*none, key("a"), &s);
  EXPECT_EQ(s, Status::kKeyNotExist);
  EXPECT_EQ(metric_of(*none, "backend_arena_bytes"), 0);
}

TEST(MemoryBackend, StoreOptionsRefusedEvictNothing) {
  MemoryBackendOptions mo;
  mo.capacity_bytes = 3000;  // room for two values
  auto b = make_memory_backend(mo);
  ASSERT_EQ(test::put(*b, key("a"), std::string(1400, 'a')), Status::kSuccess);
  ASSERT_EQ(test::put(*b, key("b"), std::string(1400, 'b')), Status::kSuccess);
  EXPECT_EQ(test::put(*b, key("c"), std::string(1400, 'c'), nvme::kStoreMustExist),
            Status::kKeyNotExist);
  EXPECT_EQ(test::put(*b, key("a"), std::string(1400, 'x'), nvme::kStoreMustNotExist),
            Status::kKeyExists);
  EXPECT_EQ(b->info().keys, 2u);
  EXPECT_EQ(metric_of(*b, "backend_evictions_total"), 0);
  EXPECT_EQ(get(*b, key("a")), std::string(1400, 'a'));
  EXPECT_EQ(get(*b, key("b")), std::string(1400, 'b'));
}

// A rewrite when the store is full never evicts the key it rewrites: with no other key to evict,
// the new copy goes to the heap for the moment both exist.
TEST(MemoryBackend, RewriteOfAFullStoreKeepsTheKey) {
  MemoryBackendOptions mo;
  mo.capacity_bytes = 4096;
  auto b = make_memory_backend(mo);
  ASSERT_EQ(test::put(*b, key("a"), std::string(2500, 'a')), Status::kSuccess);
  ASSERT_EQ(test::put(*b, key("a"), std::string(2500, 'b'), nvme::kStoreMustExist),
            Status::kSuccess);
  EXPECT_EQ(get(*b, key("a")), std::string(2500, 'b'));
  EXPECT_EQ(metric_of(*b, "backend_evictions_total"), 0);
  EXPECT_EQ(metric_of(*b, "backend_heap_values_total"), 1);
  ASSERT_EQ(test::put(*b, key("a"), std::string(2500, 'c')), Status::kSuccess);  // arena again
  EXPECT_EQ(get(*b, key("a")), std::string(2500, 'c'));
  EXPECT_EQ(metric_of(*b, "backend_heap_values_total"), 1);
}

// New keys far past the capacity: the arena reaches the capacity and stays there; evicted and
// deleted values' memory is reused, not allocated again.
TEST(MemoryBackend, ArenaIsRecycledOnEvictionAndDelete) {
  MemoryBackendOptions mo;
  mo.capacity_bytes = 64 * kMiB;
  auto b = make_memory_backend(mo);
  const std::string v(2 * kMiB, 'v');
  for (int i = 0; i < 31; ++i) {
    ASSERT_EQ(test::put(*b, key("warm" + std::to_string(i)), v), Status::kSuccess);
  }
  const double arena = metric_of(*b, "backend_arena_bytes");
  const double growths = metric_of(*b, "backend_arena_growths_total");
  EXPECT_EQ(arena, 64.0 * kMiB);  // in regions of 2, 2, 4, 8, 16 and 32 MiB
  EXPECT_EQ(growths, 6);
  for (int i = 0; i < 200; ++i) {  // 400 MiB of new keys through a 64 MiB store
    ASSERT_EQ(test::put(*b, key("new" + std::to_string(i)), v), Status::kSuccess);
  }
  EXPECT_GT(metric_of(*b, "backend_evictions_total"), 150);
  EXPECT_EQ(metric_of(*b, "backend_arena_bytes"), arena);
  EXPECT_EQ(metric_of(*b, "backend_arena_growths_total"), growths);
  EXPECT_EQ(metric_of(*b, "backend_heap_values_total"), 0);
  EXPECT_EQ(get(*b, key("new199")), v);
  // Delete everything, store again: the same memory.
  std::vector<Key> keys;
  SyncOp list(BackendOpKind::kList, Key{});
  list.op.list_max = 1000;
  ASSERT_EQ(list.run(*b), Status::kSuccess);
  for (const Key& k : list.op.keys) {
    SyncOp del(BackendOpKind::kDelete, k);
    ASSERT_EQ(del.run(*b), Status::kSuccess);
  }
  EXPECT_EQ(b->info().keys, 0u);
  const double evictions = metric_of(*b, "backend_evictions_total");
  for (int i = 0; i < 31; ++i) {
    ASSERT_EQ(test::put(*b, key("again" + std::to_string(i)), v), Status::kSuccess);
  }
  EXPECT_EQ(metric_of(*b, "backend_evictions_total"), evictions);  // the deletes made the room
  EXPECT_EQ(metric_of(*b, "backend_arena_growths_total"), growths);
  EXPECT_EQ(metric_of(*b, "backend_arena_bytes"), arena);
}

// A Get's view keeps an evicted value's bytes alive and unchanged (its extent goes back to the
// arena only when the view goes), and Stores go on meanwhile.
TEST(MemoryBackend, ViewOfAnEvictedValueStaysValid) {
  MemoryBackendOptions mo;
  mo.capacity_bytes = 2 * kMiB;
  auto b = make_memory_backend(mo);
  ASSERT_EQ(test::put(*b, key("a"), std::string(kMiB, 'a')), Status::kSuccess);
  SyncOp held(BackendOpKind::kGet, key("a"));
  ASSERT_EQ(held.run(*b), Status::kSuccess);
  ASSERT_EQ(test::put(*b, key("b"), std::string(kMiB, 'b')), Status::kSuccess);
  ASSERT_EQ(test::put(*b, key("c"), std::string(kMiB, 'c')), Status::kSuccess);  // evicts a
  Status s;
  get(*b, key("a"), &s);
  EXPECT_EQ(s, Status::kKeyNotExist);
  EXPECT_EQ(held.value(), std::string(kMiB, 'a'));
  EXPECT_EQ(get(*b, key("c")), std::string(kMiB, 'c'));
  EXPECT_LE(metric_of(*b, "backend_arena_bytes"), 2.0 * kMiB);
}

// ---- quotas and low-priority Stores ----

constexpr uint32_t kA = 1, kB = 2, kC = 3;
constexpr uint64_t kKiB = 1024;
using test::nkey;
using test::nvalue;
// Key and value: exactly 1 KiB as the backend counts it.
std::string kib_value(char tag, int i) { return nvalue(tag, i, kKiB - 5); }

double ns_metric(const Backend& b, const char* name, uint32_t nsid) {
  return test::ns_metric(b, name, nsid, "memory");
}

// Records the removal handler's calls.
struct Removals {
  std::mutex mu;
  std::vector<NsKey> keys;
  void attach(Backend& b) {
    b.set_removal_handler([this](uint32_t nsid, const Key& k) {
      std::lock_guard lk(mu);
      keys.push_back(NsKey{nsid, k});
    });
  }
};

// Tenant B (quota) stores 12 KiB; tenant A, with no quota, writes ten times the capacity. The old
// single LRU evicted all of B's values; now A evicts only its own, oldest first.
TEST(MemoryBackendQuota, FloodWithoutQuotaKeepsQuotaNamespace) {
  MemoryBackendOptions mo;
  mo.capacity_bytes = 64 * kKiB;
  mo.quotas = {{kB, 16 * kKiB}};
  auto b = make_memory_backend(mo);
  Removals removed;
  removed.attach(*b);
  for (int i = 0; i < 12; ++i) {
    ASSERT_EQ(test::put_in(*b, kB, nkey('b', i), kib_value('b', i)), Status::kSuccess);
  }
  constexpr int kFlood = 640;  // 10 x capacity
  for (int i = 0; i < kFlood; ++i) {
    ASSERT_EQ(test::put_in(*b, kA, nkey('a', i), kib_value('a', i)), Status::kSuccess) << i;
  }
  for (int i = 0; i < 12; ++i) EXPECT_EQ(test::get_in(*b, kB, nkey('b', i)), kib_value('b', i));
  // A keeps what the capacity leaves it (64 - 12 KiB): its newest 52 values.
  constexpr int kKept = 52;
  for (int i = 0; i < kFlood; ++i) {
    Status s;
    const std::string v = test::get_in(*b, kA, nkey('a', i), &s);
    if (i < kFlood - kKept) {
      EXPECT_EQ(s, Status::kKeyNotExist) << i;
    } else {
      EXPECT_EQ(v, kib_value('a', i)) << i;
    }
  }
  EXPECT_EQ(ns_metric(*b, "namespace_held_bytes", kB), 12.0 * kKiB);
  EXPECT_EQ(ns_metric(*b, "namespace_evictions_total", kB), 0);
  EXPECT_EQ(ns_metric(*b, "namespace_held_bytes", kA), double{kKept} * kKiB);
  EXPECT_EQ(ns_metric(*b, "namespace_evictions_total", kA), kFlood - kKept);
  EXPECT_EQ(metric_of(*b, "backend_evictions_total"), kFlood - kKept);
  // Every eviction reached the removal handler, oldest first, and none of them was B's.
  std::lock_guard lk(removed.mu);
  ASSERT_EQ(removed.keys.size(), size_t{kFlood - kKept});
  for (int i = 0; i < kFlood - kKept; ++i) EXPECT_EQ(removed.keys[i], (NsKey{kA, nkey('a', i)}));
}

// Tenant A has a quota of its own and writes ten times it: it evicts its own values, oldest
// first (a read is a use), and reports them; B's values and a namespace without a quota stay.
TEST(MemoryBackendQuota, QuotaNamespaceEvictsOnlyItsOwnOldestFirst) {
  MemoryBackendOptions mo;
  mo.capacity_bytes = 32 * kKiB;
  mo.quotas = {{kA, 8 * kKiB}, {kB, 16 * kKiB}};
  auto b = make_memory_backend(mo);
  Removals removed;
  removed.attach(*b);
  for (int i = 0; i < 16; ++i) {
    ASSERT_EQ(test::put_in(*b, kB, nkey('b', i), kib_value('b', i)), Status::kSuccess);
  }
  for (int i = 0; i < 8; ++i) {
    ASSERT_EQ(test::put_in(*b, kC, nkey('c', i), kib_value('c', i)), Status::kSuccess);
  }
  for (int i = 0; i < 8; ++i) {
    ASSERT_EQ(test::put_in(*b, kA, nkey('a', i), kib_value('a', i)), Status::kSuccess);
  }
  EXPECT_EQ(test::get_in(*b, kA, nkey('a', 0)), kib_value('a', 0));  // a0 used: a1 is oldest
  // 80 KiB in all: ten times its quota.
  for (int i = 8; i < 80; ++i) {
    ASSERT_EQ(test::put_in(*b, kA, nkey('a', i), kib_value('a', i)), Status::kSuccess);
    EXPECT_LE(ns_metric(*b, "namespace_held_bytes", kA), 8.0 * kKiB);
  }
  for (int i = 0; i < 16; ++i) EXPECT_EQ(test::get_in(*b, kB, nkey('b', i)), kib_value('b', i));
  for (int i = 0; i < 8; ++i) EXPECT_EQ(test::get_in(*b, kC, nkey('c', i)), kib_value('c', i));
  for (int i = 72; i < 80; ++i) EXPECT_EQ(test::get_in(*b, kA, nkey('a', i)), kib_value('a', i));
  // Evicted in the order used: a1..a7, then a0 (read after them), then a8..a71.
  std::vector<NsKey> want;
  for (int i = 1; i < 8; ++i) want.push_back(NsKey{kA, nkey('a', i)});
  want.push_back(NsKey{kA, nkey('a', 0)});
  for (int i = 8; i < 72; ++i) want.push_back(NsKey{kA, nkey('a', i)});
  {
    std::lock_guard lk(removed.mu);
    EXPECT_EQ(removed.keys, want);
  }
  EXPECT_EQ(ns_metric(*b, "namespace_held_bytes", kA), 8.0 * kKiB);
  EXPECT_EQ(ns_metric(*b, "namespace_evictions_total", kA), 72);
  EXPECT_EQ(ns_metric(*b, "namespace_evictions_total", kB), 0);
  EXPECT_EQ(ns_metric(*b, "namespace_evictions_total", kC), 0);
  EXPECT_EQ(ns_metric(*b, "namespace_held_bytes", kC), 8.0 * kKiB);
  // Namespaces that never held a value and have no quota are not reported.
  EXPECT_EQ(ns_metric(*b, "namespace_held_bytes", 7), -1);
}

TEST(MemoryBackendQuota, ValueLargerThanItsRoomIs81h) {
  MemoryBackendOptions mo;
  mo.capacity_bytes = 64 * kKiB;
  mo.quotas = {{kB, 40 * kKiB}};
  auto b = make_memory_backend(mo);
  ASSERT_EQ(test::put_in(*b, kB, nkey('b', 0), kib_value('b', 0)), Status::kSuccess);
  // Key and value one byte over the quota: 81h, nothing evicted.
  EXPECT_EQ(test::put_in(*b, kB, nkey('b', 1), nvalue('b', 1, 40 * kKiB - 4)),
            Status::kCapacityExceeded);
  EXPECT_EQ(test::get_in(*b, kB, nkey('b', 0)), kib_value('b', 0));
  // Exactly the quota: fits, after evicting B's own value.
  ASSERT_EQ(test::put_in(*b, kB, nkey('b', 2), nvalue('b', 2, 40 * kKiB - 5)), Status::kSuccess);
  Status s;
  test::get_in(*b, kB, nkey('b', 0), &s);
  EXPECT_EQ(s, Status::kKeyNotExist);
  EXPECT_EQ(ns_metric(*b, "namespace_evictions_total", kB), 1);
  // Without a quota, while the quotas fit in the capacity, a namespace has what the quota
  // namespaces do not hold (24 KiB): more is 81h and evicts nothing of B's.
  ASSERT_EQ(test::put_in(*b, kA, nkey('a', 0), kib_value('a', 0)), Status::kSuccess);
  EXPECT_EQ(test::put_in(*b, kA, nkey('a', 1), nvalue('a', 1, 24 * kKiB)),
            Status::kCapacityExceeded);
  EXPECT_EQ(test::get_in(*b, kB, nkey('b', 2)), nvalue('b', 2, 40 * kKiB - 5));
  EXPECT_EQ(test::get_in(*b, kA, nkey('a', 0)), kib_value('a', 0));
  ASSERT_EQ(test::put_in(*b, kA, nkey('a', 2), nvalue('a', 2, 24 * kKiB - 5)), Status::kSuccess);
  EXPECT_EQ(test::get_in(*b, kB, nkey('b', 2)), nvalue('b', 2, 40 * kKiB - 5));
  // A quota of 0: every Store of the namespace is 81h.
  mo.quotas = {{kB, 0}};
  auto zero = make_memory_backend(mo);
  EXPECT_EQ(test::put_in(*zero, kB, nkey('b', 0), ""), Status::kCapacityExceeded);
  EXPECT_EQ(test::put_in(*zero, kA, nkey('a', 0), "x"), Status::kSuccess);
}

// Quotas that sum to more than the capacity cannot all be held: once the namespaces without a
// quota hold nothing, the capacity takes the least recently used value of the quota namespaces.
TEST(MemoryBackendQuota, OvercommittedQuotasShareTheCapacityByRecency) {
  MemoryBackendOptions mo;
  mo.capacity_bytes = 8 * kKiB;
  mo.quotas = {{kA, 6 * kKiB}, {kB, 6 * kKiB}};
  auto b = make_memory_backend(mo);
  for (int i = 0; i < 4; ++i) {
    ASSERT_EQ(test::put_in(*b, kC, nkey('c', i), kib_value('c', i)), Status::kSuccess);
    ASSERT_EQ(test::put_in(*b, kA, nkey('a', i), kib_value('a', i)), Status::kSuccess);
  }
  // B's first four take C's four values, then A's oldest two (a0, a1).
  for (int i = 0; i < 6; ++i) {
    ASSERT_EQ(test::put_in(*b, kB, nkey('b', i), kib_value('b', i)), Status::kSuccess);
  }
  EXPECT_EQ(ns_metric(*b, "namespace_evictions_total", kC), 4);
  EXPECT_EQ(ns_metric(*b, "namespace_evictions_total", kA), 2);
  EXPECT_EQ(ns_metric(*b, "namespace_held_bytes", kB), 6.0 * kKiB);
  for (int i = 2; i < 4; ++i) EXPECT_EQ(test::get_in(*b, kA, nkey('a', i)), kib_value('a', i));
  EXPECT_EQ(b->info().bytes_used, 8 * kKiB);
}

// A low-priority value goes before any ordinary one of its pool, even a less recently used one;
// a read makes it ordinary. In a namespace with a quota, the same within the namespace.
TEST(MemoryBackendQuota, LowPriorityGoesFirstAndAReadPromotes) {
  MemoryBackendOptions mo;
  mo.capacity_bytes = 10 * kKiB;  // B's quota, and 6 KiB for A
  mo.quotas = {{kB, 4 * kKiB}};
  auto b = make_memory_backend(mo);
  Removals removed;
  removed.attach(*b);
  const auto put = [&](uint32_t ns, char tag, int i, uint8_t opt = 0) {
    ASSERT_EQ(test::put_in(*b, ns, nkey(tag, i), kib_value(tag, i), opt), Status::kSuccess);
  };
  put(kA, 'a', 0);
  put(kA, 'a', 1);
  put(kA, 'a', 2, nvme::kStoreLowPriority);
  put(kA, 'a', 3, nvme::kStoreLowPriority);
  EXPECT_EQ(test::get_in(*b, kA, nkey('a', 3)), kib_value('a', 3));  // now ordinary, newest
  put(kB, 'b', 0, nvme::kStoreLowPriority);
  put(kB, 'b', 1);
  put(kB, 'b', 2);
  put(kB, 'b', 3, nvme::kStoreLowPriority);
  put(kA, 'a', 4);
  put(kA, 'a', 5);
  put(kA, 'a', 6);  // capacity: A's a2 (low) goes first,
  put(kA, 'a', 7);  // then a0 (least recently used)
  put(kB, 'b', 4);  // quota: b0 (B's oldest low-priority), not b1
  put(kB, 'b', 5);  // then b3
  put(kB, 'b', 6);  // then b1
  const std::vector<NsKey> want = {{kA, nkey('a', 2)},
                                   {kA, nkey('a', 0)},
                                   {kB, nkey('b', 0)},
                                   {kB, nkey('b', 3)},
                                   {kB, nkey('b', 1)}};
  {
    std::lock_guard lk(removed.mu);
    EXPECT_EQ(removed.keys, want);
  }
  for (int i : {1, 3, 4, 5, 6, 7}) EXPECT_EQ(test::get_in(*b, kA, nkey('a', i)), kib_value('a', i));
  for (int i : {2, 4, 5, 6}) EXPECT_EQ(test::get_in(*b, kB, nkey('b', i)), kib_value('b', i));
  // Rewritten as low priority, an ordinary value goes first again.
  put(kA, 'a', 7, nvme::kStoreLowPriority);
  put(kA, 'a', 8);
  Status s;
  test::get_in(*b, kA, nkey('a', 7), &s);
  EXPECT_EQ(s, Status::kKeyNotExist);
  EXPECT_EQ(test::get_in(*b, kA, nkey('a', 1)), kib_value('a', 1));
}

}  // namespace
}  // namespace gdkv
