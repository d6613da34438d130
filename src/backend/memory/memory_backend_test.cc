// The memory backend's capacity, eviction and value memory: it evicts least recently
// used values instead of failing with 81h once full, and values it copies live in an arena that
// evicted and deleted values return to.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace gdkv
