// The tiered backend over a real local store (near) and the memory backend (far), each behind a
// gate that counts its ops: fills, near service, write-through, deletes, integrity failures of the
// near copy, far failures, and a fill racing a Store. The generic backend semantics run over
// `tiered` in controller_semantics_test (with RADOS as the far tier when there is a cluster).
#include "gdkv/tiered_backend.h"

#include <gtest/gtest.h>

#include <unistd.h>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <set>

#include "backend_params.h"
#include "cache_test_util.h"
#include "gdkv/local_backend.h"

namespace gdkv {
namespace {

using nvme::Status;
using test::GateBackend;
using test::SyncOp;

Key key(const std::string& s) { return *Key::from_string(s); }

std::string value_of(const std::string& k, size_t n = 5000) {
  std::string v(n, '\0');
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>(k[i % k.size()] + i / 3);
  return v;
}

// Fails the Retrieve of chosen keys with 88h, as the local store does for a copy that fails its
// checksum.
class CorruptingBackend final : public Backend {
 public:
  explicit CorruptingBackend(std::shared_ptr<Backend> inner) : inner_(std::move(inner)) {}
  void submit(BackendOp* op) override {
    bool fail = false;
    {
      std::lock_guard lk(mu_);
      const std::string k(op->key.view());
      if (op->kind == BackendOpKind::kGet) fail = bad_.contains(k);
      if (op->kind == BackendOpKind::kDelete) bad_.erase(k);  // a clean copy from now on
    }
    if (fail) return op->complete(Status::kUnrecoveredError);
    inner_->submit(op);
  }
  BackendInfo info() const override { return inner_->info(); }
  void set_removal_handler(InvalidationHandler h) override {
    inner_->set_removal_handler(std::move(h));
  }
  void corrupt(const Key& k) {
    std::lock_guard lk(mu_);
    bad_.insert(std::string(k.view()));
  }

 private:
  std::shared_ptr<Backend> inner_;
  std::mutex mu_;
  std::set<std::string> bad_;
};

struct Tiers {
  test::BackendFixture store;  // the near tier's local store, in a directory of its own
  std::shared_ptr<GateBackend> near, far;
  std::shared_ptr<CorruptingBackend> corrupting;
  std::shared_ptr<Backend> tiered;
  Tiers() {
    corrupting = std::make_shared<CorruptingBackend>(store.open("local", 64 << 20, 4 << 20));
    near = std::make_shared<GateBackend>(corrupting);
    far = std::make_shared<GateBackend>(make_memory_backend());
    tiered = make_tiered_backend(near, far).value();
  }
  Status get(Backend& b, const Key& k, std::string* v = nullptr) {
    SyncOp op(BackendOpKind::kGet, k);
    const Status s = op.run(b);
    if (v != nullptr) *v = s == Status::kSuccess ? op.value() : "";
    return s;
  }
  Status del(Backend& b, const Key& k) {
    SyncOp op(BackendOpKind::kDelete, k);
    return op.run(b);
  }
};

double metric(const Backend& b, const std::string& name) { return test::metric(b, name); }

TEST(TieredBackend, AMissIsReadFromFarAndFillsNear) {
  Tiers t;
  const Key k = key("block-1");
  ASSERT_EQ(test::put(*t.far, k, value_of("block-1")), Status::kSuccess);  // stored by another node
  std::string v;
  ASSERT_EQ(t.get(*t.tiered, k, &v), Status::kSuccess);
  EXPECT_EQ(v, value_of("block-1"));
  t.tiered->drain();
  EXPECT_EQ(t.far->count(BackendOpKind::kGet), 1u);
  EXPECT_EQ(metric(*t.tiered, "tiered_fills_total"), 1);
  // Now near serves it: far sees no more reads.
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(t.get(*t.tiered, k, &v), Status::kSuccess);
    EXPECT_EQ(v, value_of("block-1"));
  }
  EXPECT_EQ(t.far->count(BackendOpKind::kGet), 1u);
  EXPECT_EQ(metric(*t.tiered, "tiered_near_hits_total"), 3);
  // A key neither tier has is 87h, and nothing is filled.
  EXPECT_EQ(t.get(*t.tiered, key("absent"), nullptr), Status::kKeyNotExist);
  t.tiered->drain();
  EXPECT_EQ(t.get(*t.near, key("absent"), nullptr), Status::kKeyNotExist);
}

TEST(TieredBackend, StoresAreWrittenThroughAndDeletesReachBothTiers) {
  Tiers t;
  const Key k = key("block-2");
  ASSERT_EQ(test::put(*t.tiered, k, value_of("block-2")), Status::kSuccess);
  std::string v;
  ASSERT_EQ(t.get(*t.far, k, &v), Status::kSuccess);
  EXPECT_EQ(v, value_of("block-2"));
  ASSERT_EQ(t.get(*t.near, k, &v), Status::kSuccess);
  EXPECT_EQ(v, value_of("block-2"));
  ASSERT_EQ(t.get(*t.tiered, k, &v), Status::kSuccess);
  EXPECT_EQ(t.far->count(BackendOpKind::kGet), 1u);  // only the test's own read of far
  // Exist is answered by near when near has it.
  SyncOp ex(BackendOpKind::kExists, k);
  EXPECT_EQ(ex.run(*t.tiered), Status::kSuccess);
  EXPECT_EQ(t.far->count(BackendOpKind::kExists), 0u);
  ASSERT_EQ(t.del(*t.tiered, k), Status::kSuccess);
  EXPECT_EQ(t.get(*t.far, k, nullptr), Status::kKeyNotExist);
  EXPECT_EQ(t.get(*t.near, k, nullptr), Status::kKeyNotExist);
  EXPECT_EQ(t.get(*t.tiered, k, nullptr), Status::kKeyNotExist);
  // Deleting what far lacks is far's 87h, and a stray near copy goes too.
  ASSERT_EQ(test::put(*t.near, k, "stray"), Status::kSuccess);
  EXPECT_EQ(t.del(*t.tiered, k), Status::kKeyNotExist);
  EXPECT_EQ(t.get(*t.near, k, nullptr), Status::kKeyNotExist);
  // A conditional Store far rejects leaves both tiers as they were.
  ASSERT_EQ(test::put(*t.tiered, k, value_of("one")), Status::kSuccess);
  EXPECT_EQ(test::put(*t.tiered, k, value_of("two"), nvme::kStoreMustNotExist), Status::kKeyExists);
  ASSERT_EQ(t.get(*t.tiered, k, &v), Status::kSuccess);
  EXPECT_EQ(v, value_of("one"));
}

// A near copy that fails its integrity check is never returned: it is dropped and the value is
// read from far (and written into near again on a later miss).
TEST(TieredBackend, ACorruptNearCopyIsDroppedAndReadFromFar) {
  Tiers t;
  const Key k = key("block-3");
  ASSERT_EQ(test::put(*t.tiered, k, value_of("block-3")), Status::kSuccess);
  t.corrupting->corrupt(k);
  std::string v;
  ASSERT_EQ(t.get(*t.tiered, k, &v), Status::kSuccess);
  EXPECT_EQ(v, value_of("block-3"));
  t.tiered->drain();
  EXPECT_EQ(metric(*t.tiered, "tiered_near_corrupt_total"), 1);
  EXPECT_EQ(t.near->count(BackendOpKind::kDelete), 1u);
  EXPECT_EQ(t.get(*t.near, k, nullptr), Status::kKeyNotExist);
  // The next read refills near from far; then near serves it.
  ASSERT_EQ(t.get(*t.tiered, k, &v), Status::kSuccess);
  t.tiered->drain();
  ASSERT_EQ(t.get(*t.tiered, k, &v), Status::kSuccess);
  EXPECT_EQ(v, value_of("block-3"));
  EXPECT_EQ(t.far->count(BackendOpKind::kGet), 2u);
}

// Far's failures are the request's: a Store far fails is not acknowledged and is not in near; a
// read far fails returns the failure.
TEST(TieredBackend, FarFailuresAreTheRequestsOwn) {
  Tiers t;
  MemoryBackendOptions tiny;
  tiny.capacity_bytes = 1000;
  auto near = t.near;
  auto small_far = std::make_shared<GateBackend>(make_memory_backend(tiny));
  auto tiered = make_tiered_backend(near, small_far).value();
  const Key k = key("block-4");
  EXPECT_EQ(test::put(*tiered, k, value_of("block-4")), Status::kCapacityExceeded);
  EXPECT_EQ(t.get(*near, k, nullptr), Status::kKeyNotExist);
  EXPECT_EQ(t.get(*tiered, k, nullptr), Status::kKeyNotExist);
  // Bad requests get the same status from the first tier.
  SyncOp bad(BackendOpKind::kGet, Key{});
  EXPECT_EQ(bad.run(*tiered), Status::kInvalidKeySize);
}

// A far read whose fill would race a Store: the Store starts while the read is at far, so the
// old value must not be written into near after the new one.
TEST(TieredBackend, AFillRacingAStoreNeverLeavesTheOlderValueInNear) {
  Tiers t;
  const Key k = key("block-5");
  ASSERT_EQ(test::put(*t.far, k, value_of("old")), Status::kSuccess);
  t.far->hold_done(BackendOpKind::kGet, true);
  SyncOp reader(BackendOpKind::kGet, k);
  reader.submit(*t.tiered);
  ASSERT_TRUE(test::eventually([&] { return t.far->held_dones() == 1; }));
  t.far->hold_done(BackendOpKind::kGet, false);
  ASSERT_EQ(test::put(*t.tiered, k, value_of("new")), Status::kSuccess);
  t.far->release_all_dones();  // the read returns the old value (it overlapped the Store)
  ASSERT_TRUE(reader.wait());
  ASSERT_EQ(reader.status, Status::kSuccess);
  t.tiered->drain();
  std::string v;
  ASSERT_EQ(t.get(*t.near, k, &v), Status::kSuccess);
  EXPECT_EQ(v, value_of("new"));
  EXPECT_GE(metric(*t.tiered, "tiered_fills_skipped_total"), 1);
  ASSERT_EQ(t.get(*t.tiered, k, &v), Status::kSuccess);
  EXPECT_EQ(v, value_of("new"));
}

// Another node deleted a key from far (the shared pool): the notification drops the near copy,
// so the next read is far's 87h, and is passed on to the cache above.
TEST(TieredBackend, AnotherNodesDeleteDropsTheNearCopy) {
  Tiers t;
  ASSERT_TRUE(t.far->has_handler());
  std::vector<std::string> up;
  t.tiered->set_invalidation_handler(
      [&](uint32_t, const Key& k) { up.emplace_back(std::string(k.view())); });
  const Key k = key("block-6");
  ASSERT_EQ(test::put(*t.tiered, k, value_of("block-6")), Status::kSuccess);
  ASSERT_EQ(t.del(*t.far, k), Status::kSuccess);  // behind the tier's back
  std::string v;
  ASSERT_EQ(t.get(*t.tiered, k, &v), Status::kSuccess);  // near still has it
  t.far->fire(1, k);
  t.tiered->drain();
  EXPECT_EQ(t.get(*t.near, k, nullptr), Status::kKeyNotExist);
  EXPECT_EQ(t.get(*t.tiered, k, nullptr), Status::kKeyNotExist);
  EXPECT_EQ(metric(*t.tiered, "tiered_remote_deletes_total"), 1);
  EXPECT_EQ(up, std::vector<std::string>{"block-6"});
}

// Removals are far's, the store's: a Delete is reported once (not again for the near copy), and
// near's reclaim, which leaves the values in far, not at all.
TEST(TieredBackend, RemovalsAreFarsOnly) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("gdkv-tiered-removals-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  LocalBackendOptions lo;
  lo.path = dir.string();
  lo.capacity_bytes = 4 << 20;  // 4 segments of 1 MiB
  lo.segment_bytes = 1 << 20;
  auto near = make_local_backend(lo).value();
  auto tiered = make_tiered_backend(near, make_memory_backend()).value();
  std::vector<std::string> removed;
  std::mutex mu;
  tiered->set_removal_handler([&](uint32_t, const Key& k) {
    std::lock_guard lk(mu);
    removed.emplace_back(std::string(k.view()));
  });
  for (int i = 0; i < 40; ++i) {  // 8 MiB: near reclaims its oldest segments
    char name[16];
    std::snprintf(name, sizeof(name), "fill-%d", i);
    ASSERT_EQ(test::put(*tiered, key(name), value_of(name, 200 << 10)), Status::kSuccess);
  }
  SyncOp near_get(BackendOpKind::kGet, key("fill-0"));
  ASSERT_EQ(near_get.run(*near), Status::kKeyNotExist);  // reclaimed from near
  SyncOp get(BackendOpKind::kGet, key("fill-0"));
  EXPECT_EQ(get.run(*tiered), Status::kSuccess);  // still in far
  SyncOp del(BackendOpKind::kDelete, key("fill-39"));
  ASSERT_EQ(del.run(*tiered), Status::kSuccess);
  tiered->drain();
  tiered->set_removal_handler(nullptr);
  {
    std::lock_guard lk(mu);
    EXPECT_EQ(removed, std::vector<std::string>{"fill-39"});
  }
  tiered.reset();
  near.reset();
  std::filesystem::remove_all(dir);
}

// Far lost its notifications for a while: every near key is checked against far, and those far
// no longer has leave near; the others stay.
TEST(TieredBackend, LostNotificationsAreCheckedAgainstFar) {
  Tiers t;
  std::vector<Key> keys;
  for (int i = 0; i < 5; ++i) {
    // snprintf, not operator+: GCC 12 warns falsely (-Wrestrict) on `"check-" + to_string(i)`
    // where it inlines differently.
    char name[16], value[8];
    std::snprintf(name, sizeof(name), "check-%d", i);
    std::snprintf(value, sizeof(value), "v%d", i);
    keys.push_back(key(name));
    ASSERT_EQ(test::put(*t.tiered, keys.back(), value_of(value)), Status::kSuccess);
  }
  ASSERT_EQ(t.del(*t.far, keys[1]), Status::kSuccess);
  ASSERT_EQ(t.del(*t.far, keys[3]), Status::kSuccess);
  t.far->fire(0, Key{});
  ASSERT_TRUE(test::eventually([&] { return metric(*t.tiered, "tiered_near_checks_total") == 5; }));
  t.tiered->drain();
  for (int i = 0; i < 5; ++i) {
    const Status want = (i == 1 || i == 3) ? Status::kKeyNotExist : Status::kSuccess;
    EXPECT_EQ(t.get(*t.near, keys[i], nullptr), want) << i;
  }
  EXPECT_EQ(metric(*t.tiered, "tiered_remote_deletes_total"), 2);
}

}  // namespace
}  // namespace gdkv
