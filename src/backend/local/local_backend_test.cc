// The local store at the Backend API: semantics, persistence, group commit, integrity on read,
// capacity and reclaim, a full file system, restart with many keys, and kill -9 at random moments.
// (The controller-level suite in tests/ runs the same semantics through queues on `local` too.)
#include <fcntl.h>
#include <linux/magic.h>
#include <signal.h>
#include <spawn.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "gdkv/local_backend.h"
#include "local_test_util.h"

extern char** environ;

namespace gdkv::local::test {
namespace {

namespace fs = std::filesystem;
using nvme::Status;

std::vector<std::byte> bytes_of(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()),
          reinterpret_cast<const std::byte*>(s.data()) + s.size()};
}
Key skey(const std::string& s) { return *Key::from_string(s); }

class LocalStore : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("gdkv-local-" + std::to_string(::getpid()) + "-" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    store_.reset();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  LocalBackendOptions options(uint32_t segment = 4u << 20, uint64_t capacity = 256u << 20) const {
    LocalBackendOptions o;
    o.path = dir_.string();
    o.segment_bytes = segment;
    o.capacity_bytes = capacity;
    return o;
  }
  Backend& open(const LocalBackendOptions& o) {
    store_.reset();
    store_ = make_local_backend(o).value();
    return *store_;
  }
  Backend& reopen(const LocalBackendOptions& o) { return open(o); }
  fs::path file() const { return dir_ / "store.gdkv"; }

  fs::path dir_;
  std::shared_ptr<Backend> store_;
};

// ---- semantics ----------------------------------------------------------------------------------

TEST_F(LocalStore, RoundTripsEverySizeThroughEveryKindOfBuffer) {
  Backend& b = open(options());
  const size_t sizes[] = {0, 1, 16, 100, 1024, 1025, 4095, 4096, 4097, 65536, 1000003, 3u << 20};
  for (size_t i = 0; i < std::size(sizes); ++i) {
    std::vector<std::byte> v(sizes[i]);
    if (v.size() >= 16) v = make_value(i, 1, sizes[i]);
    ASSERT_EQ(put(b, int_key(static_cast<uint32_t>(i)), v), Status::kSuccess) << sizes[i];
  }
  for (SinkMode mode :
       {SinkMode::kAligned, SinkMode::kUnaligned, SinkMode::kShort, SinkMode::kView}) {
    for (size_t i = 0; i < std::size(sizes); ++i) {
      std::vector<std::byte> v(sizes[i]);
      if (v.size() >= 16) v = make_value(i, 1, sizes[i]);
      const GetResult r = get(b, int_key(static_cast<uint32_t>(i)), mode);
      ASSERT_EQ(r.status, Status::kSuccess) << sizes[i];
      EXPECT_EQ(r.len, sizes[i]);
      if (mode == SinkMode::kShort) v.resize(sizes[i] / 2);
      EXPECT_TRUE(r.data == v) << "size " << sizes[i] << " mode " << static_cast<int>(mode);
    }
  }
  EXPECT_EQ(metric(b, "local_checksum_failures_total"), 0);
  // O_DIRECT works on every disk file system; only a tmpfs before Linux 6.6 refuses it (the store
  // then runs buffered, with the same guarantees).
  struct statfs sf {};
  ASSERT_EQ(::statfs(dir_.c_str(), &sf), 0);
  if (sf.f_type != TMPFS_MAGIC) {
    EXPECT_EQ(metric(b, "local_direct_io"), 1) << dir_;
  }
}

TEST_F(LocalStore, LargeAlignedValuesAreWrittenWithoutACopy) {
  // Values of 256 KiB and more in memory aligned for O_DIRECT go from the caller's buffer to the
  // file; an unaligned tail and the padding still go through staging.
  Backend& b = open(options(8u << 20));
  const size_t sizes[] = {256u << 10, (1u << 20) + 100, 2u << 20, (3u << 20) + 4095};
  std::vector<std::unique_ptr<std::byte, decltype(&std::free)>> bufs;
  std::vector<std::vector<std::byte>> want;
  for (size_t i = 0; i < std::size(sizes); ++i) {
    want.push_back(make_value(i, 9, sizes[i]));
    bufs.emplace_back(
        static_cast<std::byte*>(std::aligned_alloc(4096, (sizes[i] + 4095) / 4096 * 4096)),
        &std::free);
    std::memcpy(bufs.back().get(), want.back().data(), sizes[i]);
    ASSERT_EQ(put(b, int_key(i), std::span<const std::byte>(bufs.back().get(), sizes[i])),
              Status::kSuccess);
  }
  EXPECT_GE(metric(b, "local_direct_write_bytes_total"), (6u << 20) + (256u << 10));
  Backend& r = reopen(options(8u << 20));
  for (size_t i = 0; i < std::size(sizes); ++i) {
    for (SinkMode mode : {SinkMode::kAligned, SinkMode::kUnaligned}) {
      EXPECT_TRUE(get(r, int_key(i), mode).data == want[i]) << sizes[i];
    }
  }
}

TEST_F(LocalStore, BasicSemantics) {
  Backend& b = open(options());
  const auto v1 = bytes_of("value one");
  const auto v2 = bytes_of("the second value");
  EXPECT_EQ(get(b, skey("a")).status, Status::kKeyNotExist);
  EXPECT_EQ(simple(b, BackendOpKind::kExists, skey("a")), Status::kKeyNotExist);
  EXPECT_EQ(simple(b, BackendOpKind::kDelete, skey("a")), Status::kKeyNotExist);
  EXPECT_EQ(put(b, skey("a"), v1, nvme::kStoreMustExist), Status::kKeyNotExist);
  EXPECT_EQ(put(b, skey("a"), v1, nvme::kStoreMustNotExist), Status::kSuccess);
  EXPECT_EQ(put(b, skey("a"), v2, nvme::kStoreMustNotExist), Status::kKeyExists);
  EXPECT_EQ(get(b, skey("a")).data, v1);
  EXPECT_EQ(put(b, skey("a"), v2, nvme::kStoreMustExist), Status::kSuccess);
  EXPECT_EQ(get(b, skey("a")).data, v2);
  EXPECT_EQ(simple(b, BackendOpKind::kExists, skey("a")), Status::kSuccess);
  // Namespaces are apart.
  EXPECT_EQ(get(b, skey("a"), SinkMode::kAligned, 2).status, Status::kKeyNotExist);
  EXPECT_EQ(put(b, skey("a"), v1, 0, 2), Status::kSuccess);
  EXPECT_EQ(get(b, skey("a"), SinkMode::kAligned, 2).data, v1);
  EXPECT_EQ(get(b, skey("a")).data, v2);
  EXPECT_EQ(simple(b, BackendOpKind::kDelete, skey("a")), Status::kSuccess);
  EXPECT_EQ(get(b, skey("a")).status, Status::kKeyNotExist);
  EXPECT_EQ(simple(b, BackendOpKind::kDelete, skey("a")), Status::kKeyNotExist);
  EXPECT_EQ(get(b, skey("a"), SinkMode::kAligned, 2).data, v1);
  // Bad input.
  Key bad;
  EXPECT_EQ(put(b, bad, v1), Status::kInvalidKeySize);
  EXPECT_EQ(get(b, bad).status, Status::kInvalidKeySize);
  std::vector<std::byte> huge((4u << 20) - 8192 + 1);
  EXPECT_EQ(put(b, skey("big"), huge), Status::kInvalidValueSize);
  huge.resize((4u << 20) - 8192);
  EXPECT_EQ(put(b, skey("big"), huge), Status::kSuccess) << "a segment minus 8 KiB fits";
  const Key hint[] = {skey("a")};
  b.prefetch(1, hint);  // a hint the local store has nothing to do with: harmless
  const BackendInfo i = b.info();
  EXPECT_EQ(i.name, "local");
  EXPECT_EQ(i.keys, 2u);
  EXPECT_EQ(i.capacity_bytes, 256u << 20);
  EXPECT_GE(i.segments, 1u);
  EXPECT_GT(i.bytes_used, 4u << 20 >> 1);
}

TEST_F(LocalStore, ListIsOrderedPerNamespaceAndBounded) {
  Backend& b = open(options());
  std::set<Key> model;
  for (const char* k : {"b", "a", "ab", "abc", "c", "ba", "a\x01", "zz"}) {
    ASSERT_EQ(put(b, skey(k), bytes_of(k)), Status::kSuccess);
    model.insert(skey(k));
  }
  ASSERT_EQ(put(b, skey("other-ns"), bytes_of("x"), 0, 7), Status::kSuccess);
  const std::vector<Key> all(model.begin(), model.end());
  EXPECT_EQ(list(b, Key{}, 100), all);
  EXPECT_EQ(list(b, Key{}, 3), std::vector<Key>(all.begin(), all.begin() + 3));
  EXPECT_EQ(list(b, skey("ab"), 100), std::vector<Key>(model.lower_bound(skey("ab")), model.end()));
  EXPECT_EQ(list(b, skey("b"), 2), (std::vector<Key>{skey("b"), skey("ba")}));
  EXPECT_TRUE(list(b, Key{}, 0).empty());
  EXPECT_EQ(list(b, Key{}, 100, 7), std::vector<Key>{skey("other-ns")});
  EXPECT_TRUE(list(b, Key{}, 100, 8).empty());
}

TEST_F(LocalStore, StateSurvivesReopen) {
  Backend& b = open(options(1u << 20));
  std::map<uint32_t, std::optional<uint64_t>> model;  // key → version, nullopt: deleted
  std::mt19937 rng(3);
  auto small_len = [](uint32_t k, uint64_t ver) {
    return std::min<size_t>(value_len(k, ver), 30000);
  };
  for (uint64_t ver = 1; ver <= 600; ++ver) {
    const uint32_t k = rng() % 80;
    if (rng() % 5 == 0) {
      const Status s = simple(b, BackendOpKind::kDelete, int_key(k));
      const bool present = model.count(k) && model[k].has_value();
      ASSERT_EQ(s, present ? Status::kSuccess : Status::kKeyNotExist);
      model[k] = std::nullopt;
    } else {
      ASSERT_EQ(put(b, int_key(k), make_value(k, ver, small_len(k, ver))), Status::kSuccess);
      model[k] = ver;
    }
  }
  for (int round = 0; round < 2; ++round) {
    Backend& r = reopen(options(1u << 20));
    size_t present = 0;
    for (const auto& [k, ver] : model) {
      const GetResult g = get(r, int_key(k));
      if (!ver) {
        EXPECT_EQ(g.status, Status::kKeyNotExist) << "deleted key " << k << " came back";
        continue;
      }
      ++present;
      ASSERT_EQ(g.status, Status::kSuccess);
      EXPECT_TRUE(g.data == make_value(k, *ver, small_len(k, *ver))) << k;
    }
    EXPECT_EQ(r.info().keys, present);
    EXPECT_GT(metric(r, "local_rebuild_records"), 0);
  }
}

TEST_F(LocalStore, AnExistingStoreKeepsItsSegmentSize) {
  {
    Backend& b = open(options(1u << 20, 16u << 20));
    ASSERT_EQ(put(b, skey("k"), make_value(1, 1, 5000)), Status::kSuccess);
    store_.reset();
  }
  Backend& b = open(options(4u << 20, 16u << 20));
  EXPECT_EQ(get(b, skey("k")).data, make_value(1, 1, 5000));
  EXPECT_EQ(b.info().capacity_bytes, 16u << 20);
  // The limit on a value follows the stored segment size, not the option.
  EXPECT_EQ(put(b, skey("big"), std::vector<std::byte>(2u << 20)), Status::kInvalidValueSize);
}

TEST_F(LocalStore, SecondOpenOfTheSameStoreFailsClearly) {
  open(options());
  auto o = options();
  o.lock_wait_ms = 50;
  const auto second = make_local_backend(o);  // an Error, never an exception
  ASSERT_FALSE(second) << "a second open succeeded";
  EXPECT_NE(second.error().find("in use by another process"), std::string::npos) << second.error();
}

TEST_F(LocalStore, RefusesAFileThatIsNotAStore) {
  {
    std::ofstream f(file());
    f << std::string(10000, 'x');
  }
  EXPECT_THROW(make_local_backend(options()).value(), std::runtime_error);
}

// ---- concurrency and group commit ---------------------------------------------------------------

TEST_F(LocalStore, ConcurrentStoresAreGroupCommitted) {
  Backend& b = open(options());
  constexpr int kOps = 512;
  std::vector<std::unique_ptr<Call>> calls;
  std::vector<std::vector<std::byte>> values;
  for (int i = 0; i < kOps; ++i) values.push_back(make_value(i, 1, 4096));
  const double flushes0 = metric(b, "local_flushes_total");
  for (int i = 0; i < kOps; ++i) {
    auto c = std::make_unique<Call>();
    c->op.kind = BackendOpKind::kPut;
    c->op.key = int_key(i);
    c->op.value = values[i];
    c->op.user = c.get();
    c->op.done = &Call::on_done;
    calls.push_back(std::move(c));
  }
  for (auto& c : calls) b.submit(&c->op);
  b.drain();
  for (auto& c : calls) ASSERT_EQ(c->status, Status::kSuccess);
  const double flushes = metric(b, "local_flushes_total") - flushes0;
  std::printf("512 concurrent 4 KiB stores: %.0f flushes, largest batch %.0f records\n", flushes,
              metric(b, "local_group_commit_max_records"));
  EXPECT_LE(flushes, kOps / 8) << "stores were not batched";
  for (int i = 0; i < kOps; i += 37) EXPECT_EQ(get(b, int_key(i)).data, values[i]);
}

TEST_F(LocalStore, ConditionalStoresAreAtomicAcrossThreads) {
  Backend& b = open(options());
  constexpr int kThreads = 6;
  constexpr int kKeys = 40;
  std::atomic<int> wins[kKeys] = {};
  std::atomic<int> exists[kKeys] = {};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      for (int k = 0; k < kKeys; ++k) {
        const auto v = make_value(k, t + 1, 100 + t);
        const Status s = put(b, int_key(k), v, nvme::kStoreMustNotExist);
        if (s == Status::kSuccess) ++wins[k];
        if (s == Status::kKeyExists) ++exists[k];
      }
    });
  }
  for (auto& t : ts) t.join();
  for (int k = 0; k < kKeys; ++k) {
    EXPECT_EQ(wins[k].load(), 1) << "key " << k;
    EXPECT_EQ(exists[k].load(), kThreads - 1) << "key " << k;
  }
  // And "only if it exists" from many threads: every one succeeds once the key is there.
  ts.clear();
  std::atomic<int> ok{0};
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      for (int k = 0; k < kKeys; ++k) {
        if (put(b, int_key(k), make_value(k, 100 + t, 64), nvme::kStoreMustExist) ==
            Status::kSuccess) {
          ++ok;
        }
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(ok.load(), kThreads * kKeys);
}

// ---- integrity on read --------------------------------------------------------------------------

// Finds `needle` in the store file (read through the page cache, not O_DIRECT) and XORs one byte
// at `delta` from its start. Returns the file offset of the flipped byte.
std::optional<uint64_t> flip(const fs::path& file, std::span<const std::byte> needle,
                             size_t delta) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  std::string data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::string n(reinterpret_cast<const char*>(needle.data()), needle.size());
  const size_t at = data.find(n);
  if (at == std::string::npos || data.find(n, at + 1) != std::string::npos) return std::nullopt;
  f.seekp(static_cast<std::streamoff>(at + delta));
  f.put(static_cast<char>(data[at + delta] ^ 0x5a));
  f.flush();
  return at + delta;
}

TEST_F(LocalStore, FlippedBytesAreReportedNeverReturned) {
  const auto o = options(1u << 20);
  const auto big = make_value(1, 1, 10000);    // block-aligned, read straight into the buffer
  const auto small = make_value(2, 1, 300);    // inline in the batch header area
  const auto other = make_value(3, 1, 20000);  // untouched
  {
    Backend& b = open(o);
    ASSERT_EQ(put(b, int_key(1), big), Status::kSuccess);
    ASSERT_EQ(put(b, int_key(2), small), Status::kSuccess);
    ASSERT_EQ(put(b, int_key(3), other), Status::kSuccess);
    ASSERT_EQ(put(b, int_key(4), make_value(4, 1, 5000)), Status::kSuccess);  // the last batch
    store_.reset();
  }
  ASSERT_TRUE(flip(file(), big, 9000));
  ASSERT_TRUE(flip(file(), small, 200));
  Backend& b = open(o);
  for (SinkMode mode :
       {SinkMode::kAligned, SinkMode::kUnaligned, SinkMode::kShort, SinkMode::kView}) {
    EXPECT_EQ(get(b, int_key(1), mode).status, Status::kUnrecoveredError);
    EXPECT_EQ(get(b, int_key(2), mode).status, Status::kUnrecoveredError);
    std::vector<std::byte> want = other;
    if (mode == SinkMode::kShort) want.resize(other.size() / 2);
    EXPECT_TRUE(get(b, int_key(3), mode).data == want);
  }
  EXPECT_EQ(metric(b, "local_checksum_failures_total"), 8);
  // Rewriting a damaged key heals it.
  ASSERT_EQ(put(b, int_key(1), big), Status::kSuccess);
  EXPECT_EQ(get(b, int_key(1)).data, big);
}

TEST_F(LocalStore, DamagedRecordHeaderLosesItsBatchNotOtherData) {
  const auto o = options(1u << 20);
  const auto a = make_value(1, 1, 5000);
  const auto c = make_value(3, 1, 5000);
  {
    Backend& b = open(o);
    ASSERT_EQ(put(b, int_key(1), a), Status::kSuccess);
    ASSERT_EQ(put(b, int_key(2), make_value(2, 1, 5000)), Status::kSuccess);
    store_.reset();
  }
  // The key bytes sit in the record entry, which the batch checksum covers.
  const Key k2 = int_key(2);
  ASSERT_TRUE(flip(file(), std::span(reinterpret_cast<const std::byte*>(k2.bytes), k2.len), 5));
  Backend& b = open(o);
  EXPECT_EQ(get(b, int_key(1)).data, a);
  EXPECT_EQ(get(b, int_key(2)).status, Status::kKeyNotExist);
  EXPECT_GE(metric(b, "local_invalid_headers"), 1);
  // Writing resumes where the log is valid.
  ASSERT_EQ(put(b, int_key(3), c), Status::kSuccess);
  Backend& r = reopen(o);
  EXPECT_EQ(get(r, int_key(3)).data, c);
  EXPECT_EQ(get(r, int_key(1)).data, a);
}

TEST_F(LocalStore, TornLastBatchIsDroppedAtOpen) {
  // A crash can leave the last batch's header on disk with its data only partly written; that
  // batch was never acknowledged, so open drops it instead of serving 88h forever.
  const auto o = options(1u << 20);
  const auto a = make_value(1, 1, 9000);
  const auto last = make_value(2, 1, 9000);
  {
    Backend& b = open(o);
    ASSERT_EQ(put(b, int_key(1), a), Status::kSuccess);
    ASSERT_EQ(put(b, int_key(2), last), Status::kSuccess);
    store_.reset();
  }
  ASSERT_TRUE(flip(file(), last, 8000));
  Backend& b = open(o);
  EXPECT_EQ(get(b, int_key(2)).status, Status::kKeyNotExist);
  EXPECT_EQ(metric(b, "local_torn_batches_dropped"), 1);
  EXPECT_EQ(get(b, int_key(1)).data, a);
  ASSERT_EQ(put(b, int_key(3), a), Status::kSuccess);
  Backend& r = reopen(o);
  EXPECT_EQ(get(r, int_key(3)).data, a);
  EXPECT_EQ(metric(r, "local_torn_batches_dropped"), 0);
}

// ---- capacity -----------------------------------------------------------------------------------

TEST_F(LocalStore, FillingPastCapacityReclaimsOldestAndKeepsServing) {
  const auto o = options(1u << 20, 8u << 20);  // 8 segments of 1 MiB
  Backend& b = open(o);
  constexpr size_t kLen = 60000;
  constexpr uint32_t kKeys = 600;  // ~36 MiB: the log wraps four times
  for (uint32_t k = 0; k < kKeys; ++k) {
    ASSERT_EQ(put(b, int_key(k), make_value(k, 1, kLen)), Status::kSuccess) << k;
  }
  const BackendInfo i = b.info();
  EXPECT_LE(i.segments, 8u);
  EXPECT_LE(i.bytes_used, i.capacity_bytes);
  EXPECT_GE(metric(b, "local_segments_reclaimed_total"), 20);
  EXPECT_EQ(get(b, int_key(0)).status, Status::kKeyNotExist);
  EXPECT_EQ(get(b, int_key(kKeys - 1)).data, make_value(kKeys - 1, 1, kLen));
  // What survives is a suffix of what was written (oldest first), byte-exact.
  const auto keys = list(b, Key{}, kKeys);
  ASSERT_GE(keys.size(), 80u);
  std::set<uint32_t> present;
  for (const Key& k : keys) {
    uint32_t n;
    std::memcpy(&n, k.bytes + 4, 4);
    present.insert(n);
  }
  EXPECT_EQ(*present.rbegin(), kKeys - 1);
  EXPECT_EQ(present.size(), kKeys - *present.begin()) << "reclaim was not oldest-first";
  for (uint32_t k : present) ASSERT_EQ(get(b, int_key(k)).data, make_value(k, 1, kLen));
  // The same after a restart.
  Backend& r = reopen(o);
  EXPECT_EQ(list(r, Key{}, kKeys), keys);
  EXPECT_EQ(get(r, int_key(kKeys - 1)).data, make_value(kKeys - 1, 1, kLen));
}

// The removal handler hears of exactly the keys the store stopped holding, once each: those its
// reclaim dropped and those deleted; not a rewrite, not a Delete of an absent key.
TEST_F(LocalStore, RemovalsAreTheDeletedAndReclaimedKeysOnce) {
  Backend& b = open(options(1u << 20, 8u << 20));
  std::mutex mu;
  std::vector<Key> removed;
  b.set_removal_handler([&](uint32_t nsid, const Key& k) {
    EXPECT_EQ(nsid, 1u);
    std::lock_guard lk(mu);
    removed.push_back(k);
  });
  constexpr uint32_t kKeys = 300;  // ~18 MiB of 60 KB values: the log wraps twice
  for (uint32_t k = 0; k < kKeys; ++k) {
    ASSERT_EQ(put(b, int_key(k), make_value(k, 1, 60000)), Status::kSuccess) << k;
    if (k == kKeys - 2) {  // a rewrite: no removal
      ASSERT_EQ(put(b, int_key(k), make_value(k, 2, 60000)), Status::kSuccess);
    }
  }
  ASSERT_EQ(simple(b, BackendOpKind::kDelete, int_key(kKeys - 1)), Status::kSuccess);
  ASSERT_EQ(simple(b, BackendOpKind::kDelete, skey("absent")), Status::kKeyNotExist);
  b.set_removal_handler(nullptr);
  std::set<Key> held;
  for (const Key& k : list(b, Key{}, kKeys)) held.insert(k);
  std::set<Key> expected;
  for (uint32_t k = 0; k < kKeys; ++k) {
    if (!held.contains(int_key(k))) expected.insert(int_key(k));
  }
  ASSERT_GT(expected.size(), 100u);  // reclaim dropped many
  EXPECT_TRUE(expected.contains(int_key(kKeys - 1)));
  std::lock_guard lk(mu);
  EXPECT_EQ(removed.size(), expected.size()) << "a removal reported twice, or a rewrite";
  EXPECT_EQ(std::set<Key>(removed.begin(), removed.end()), expected);
  EXPECT_EQ(removed.back(), int_key(kKeys - 1));  // the Delete, once its tombstone is durable
}

TEST_F(LocalStore, ReclaimNeverResurrectsADeletedKey) {
  const auto o = options(1u << 20, 4u << 20);
  Backend& b = open(o);
  const auto v = make_value(999, 1, 5000);
  ASSERT_EQ(put(b, skey("victim"), v), Status::kSuccess);
  uint32_t n = 0;
  auto fill = [&](Backend& s, int count) {
    for (int i = 0; i < count; ++i, ++n) {
      ASSERT_EQ(put(s, int_key(n), make_value(n, 1, 50000)), Status::kSuccess);
    }
  };
  fill(b, 10);  // the victim's put is in the first segment, the tombstone in a later one
  ASSERT_EQ(simple(b, BackendOpKind::kDelete, skey("victim")), Status::kSuccess);
  for (int round = 0; round < 6; ++round) {
    fill(*store_, 15);  // reclaim the put's segment, later the tombstone's
    Backend& r = reopen(o);
    EXPECT_EQ(get(r, skey("victim")).status, Status::kKeyNotExist) << "round " << round;
  }
  EXPECT_GE(metric(*store_, "local_segments_reclaimed_total"), 0);
}

TEST_F(LocalStore, ReadsRacingReclaimNeverSeeWrongBytes) {
  // Readers hammer keys while a writer wraps the log: every Get is either exact or 87h; a
  // segment being reclaimed waits for its in-flight reads before it is overwritten.
  const auto o = options(1u << 20, 4u << 20);
  Backend& b = open(o);
  std::atomic<uint32_t> written{0};
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0}, hits{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 3; ++t) {
    readers.emplace_back([&, t] {
      std::mt19937 rng(t);
      while (!stop.load()) {
        const uint32_t w = written.load();
        if (w == 0) continue;
        const uint32_t k = w - 1 - rng() % std::min<uint32_t>(w, 120);
        const GetResult r = get(b, int_key(k), t == 0 ? SinkMode::kUnaligned : SinkMode::kAligned);
        if (r.status == Status::kSuccess) {
          ++hits;
          if (r.data != make_value(k, 7, 30000)) ++bad;
        } else if (r.status != Status::kKeyNotExist) {
          ++bad;
        }
      }
    });
  }
  for (uint32_t k = 0; k < 600; ++k) {
    ASSERT_EQ(put(b, int_key(k), make_value(k, 7, 30000)), Status::kSuccess);
    written.store(k + 1);
  }
  stop.store(true);
  for (auto& t : readers) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(hits.load(), 100);
  EXPECT_EQ(metric(b, "local_checksum_failures_total"), 0);
}

TEST_F(LocalStore, FullFileSystemKeepsServingAndStaysConsistent) {
  // The helper mounts small file systems in a private mount namespace (tmpfs; ext4 on a loop
  // device when run as root), fills a store there and checks the outcome; see its header.
  const std::string cmd = std::string(GDKV_LOCAL_HELPER) + " diskfull " + dir_.string();
  const int rc = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(rc)) << cmd;
  if (WEXITSTATUS(rc) == 77) GTEST_SKIP() << "no way to mount a small file system here";
  if (WEXITSTATUS(rc) == 78) {
    GTEST_SKIP() << "the tmpfs scenarios passed; the ext4-on-a-loop-device ones need root";
  }
  EXPECT_EQ(WEXITSTATUS(rc), 0) << cmd;
}

// ---- quotas -------------------------------------------------------------------------------------

// What a value holds of its namespace's quota: its bytes as the log lays them out (inline up to
// 1 KiB, else whole 4 KiB blocks) and its 64-byte record.
uint64_t charge(uint64_t len) { return 64 + (len <= 1024 ? len : (len + 4095) / 4096 * 4096); }

double ns_metric(Backend& b, const std::string& name, uint32_t nsid) {
  const std::pair<std::string, std::string> l{"namespace", std::to_string(nsid)};
  return metric(b, name, &l);
}

// A tenant (namespace 1) writes 10x the store's capacity in 500 KB values; tenant B (namespace 2,
// with a quota) stored values of every size class first and rewrites one in the middle of the
// flood. Every B value stays readable byte-exact, also after a reopen: reclaim copies them forward
// instead of dropping them. With `a_quota`, A has a quota too and makes room by evicting its own
// oldest values: what it keeps is the newest that fit, everything else reported as removed once,
// and a reopen keeps exactly that (the evictions' tombstones are durable).
class LocalQuota : public LocalStore {
 public:
  void flood(std::optional<uint64_t> a_quota) {
    constexpr uint64_t kQuotaB = 4u << 20;
    auto o = options(1u << 20, 16u << 20);  // 16 segments of 1 MiB
    o.quotas[2] = kQuotaB;
    if (a_quota) o.quotas[1] = *a_quota;
    Backend& b = open(o);
    std::mutex mu;
    std::map<uint32_t, std::vector<Key>> removed;  // per namespace, in order
    b.set_removal_handler([&](uint32_t nsid, const Key& k) {
      std::lock_guard lk(mu);
      removed[nsid].push_back(k);
    });
    const size_t sizes[] = {0, 100, 1024, 4096, 60000, 250000, 300000};
    constexpr uint32_t kB = 21;
    std::map<uint32_t, std::pair<uint64_t, size_t>> bvals;  // key -> (version, length)
    uint64_t b_held = 0;
    for (uint32_t k = 0; k < kB; ++k) {
      const size_t len = sizes[k % 7];
      const auto v = len >= 16 ? make_value(k, 1, len) : std::vector<std::byte>(len, std::byte{7});
      ASSERT_EQ(put(b, int_key(k), v, 0, 2), Status::kSuccess) << k;
      bvals[k] = {1, len};
      b_held += charge(len);
    }
    ASSERT_LE(b_held, kQuotaB);
    constexpr size_t kLenA = 500000;
    const uint32_t kA = 10 * (16u << 20) / kLenA;  // 10x the capacity
    for (uint32_t k = 0; k < kA; ++k) {
      ASSERT_EQ(put(b, int_key(k), make_value(k, 1, kLenA)), Status::kSuccess) << k;
      if (k == kA / 2) {  // B rewrites a value mid-flood: the new one is copied forward later
        ASSERT_EQ(put(b, int_key(5), make_value(5, 2, 250000), 0, 2), Status::kSuccess);
        b_held += charge(250000) - charge(bvals[5].second);
        bvals[5] = {2, 250000};
      }
    }
    auto check_b = [&](Backend& s, const char* when) {
      for (const auto& [k, vl] : bvals) {
        const GetResult r = get(s, int_key(k), SinkMode::kAligned, 2);
        ASSERT_EQ(r.status, Status::kSuccess) << when << ": B's key " << k << " was lost";
        const auto want = vl.second >= 16 ? make_value(k, vl.first, vl.second)
                                          : std::vector<std::byte>(vl.second, std::byte{7});
        ASSERT_EQ(r.data, want) << when << ": B's key " << k;
      }
      EXPECT_EQ(list(s, Key{}, 1000, 2).size(), bvals.size()) << when;
      EXPECT_EQ(ns_metric(s, "namespace_held_bytes", 2), static_cast<double>(b_held)) << when;
      EXPECT_EQ(ns_metric(s, "namespace_evictions_total", 2), 0) << when;
      EXPECT_EQ(metric(s, "local_checksum_failures_total"), 0) << when;
    };
    check_b(b, "after the flood");
    EXPECT_GE(metric(b, "local_segments_reclaimed_total"), 100);
    EXPECT_GE(metric(b, "local_copied_forward_bytes_total"), static_cast<double>(b_held) * 5)
        << "B's values were copied forward on (nearly) every lap of the log";
    EXPECT_EQ(metric(b, "local_copy_forward_dropped_total"), 0);
    // A: what is left is the newest of what it wrote, byte-exact, and the rest was reported.
    std::set<uint32_t> kept;
    for (const Key& k : list(b, Key{}, 100000, 1)) {
      uint32_t n;
      std::memcpy(&n, k.bytes + 4, 4);
      kept.insert(n);
    }
    ASSERT_FALSE(kept.empty());
    EXPECT_EQ(*kept.rbegin(), kA - 1);
    EXPECT_EQ(kept.size(), kA - *kept.begin()) << "A lost values other than its oldest";
    for (uint32_t k : kept) ASSERT_EQ(get(b, int_key(k)).data, make_value(k, 1, kLenA)) << k;
    const double a_held = ns_metric(b, "namespace_held_bytes", 1);
    EXPECT_EQ(a_held, static_cast<double>(kept.size() * charge(kLenA)));
    b.set_removal_handler(nullptr);
    {
      std::lock_guard lk(mu);
      EXPECT_EQ(removed.count(2), 0u) << "B lost values";
      ASSERT_EQ(removed[1].size(), kA - kept.size()) << "a removal missing or reported twice";
      std::set<Key> once(removed[1].begin(), removed[1].end());
      EXPECT_EQ(once.size(), removed[1].size());
      for (uint32_t k = 0; k < *kept.begin(); ++k) EXPECT_TRUE(once.contains(int_key(k))) << k;
    }
    if (a_quota) {
      // A's own quota, not reclaim, decided: it keeps as much as fits, and evicted the rest.
      EXPECT_LE(a_held, static_cast<double>(*a_quota));
      EXPECT_GT(a_held + static_cast<double>(charge(kLenA)), static_cast<double>(*a_quota));
      EXPECT_EQ(ns_metric(b, "namespace_evictions_total", 1),
                static_cast<double>(kA - kept.size()));
    } else {
      EXPECT_EQ(ns_metric(b, "namespace_evictions_total", 1), 0);
    }
    // A reopen finds the same: B whole, A's survivors (evicted values stay evicted).
    Backend& r = reopen(o);
    check_b(r, "after reopen");
    std::set<uint32_t> kept2;
    for (const Key& k : list(r, Key{}, 100000, 1)) {
      uint32_t n;
      std::memcpy(&n, k.bytes + 4, 4);
      kept2.insert(n);
    }
    EXPECT_EQ(kept2, kept);
    EXPECT_EQ(ns_metric(r, "namespace_held_bytes", 1), a_held);
  }
};

TEST_F(LocalQuota, AFloodWithoutAQuotaLeavesEveryValueOfANamespaceWithAQuota) {
  flood(std::nullopt);
}

TEST_F(LocalQuota, ANamespaceOverItsQuotaEvictsItsOwnOldestOnly) { flood(uint64_t{3} << 20); }

TEST_F(LocalQuota, AValueLargerThanItsQuotaIsRefused) {
  auto o = options(1u << 20, 16u << 20);
  o.quotas[2] = 100000;
  Backend& b = open(o);
  ASSERT_EQ(put(b, skey("small"), make_value(1, 1, 50000), 0, 2), Status::kSuccess);
  // 99,000 bytes take 25 blocks and a record in the log: 102,464 bytes, over 100,000.
  EXPECT_EQ(put(b, skey("big"), make_value(2, 1, 99000), 0, 2), Status::kCapacityExceeded);
  EXPECT_EQ(put(b, skey("bigger"), make_value(3, 1, 200000), 0, 2), Status::kCapacityExceeded);
  EXPECT_EQ(put(b, skey("big"), make_value(2, 1, 99000), 0, 1), Status::kSuccess);  // no quota
  // Refused, nothing evicted for it.
  EXPECT_EQ(get(b, skey("small"), SinkMode::kAligned, 2).data, make_value(1, 1, 50000));
  EXPECT_EQ(ns_metric(b, "namespace_evictions_total", 2), 0);
  EXPECT_EQ(ns_metric(b, "namespace_held_bytes", 2), static_cast<double>(charge(50000)));
  // The largest that fits: 95,000 bytes (24 blocks, 98,368 with its record) replaces "small".
  ASSERT_EQ(put(b, skey("fits"), make_value(4, 1, 95000), 0, 2), Status::kSuccess);
  EXPECT_EQ(get(b, skey("small"), SinkMode::kAligned, 2).status, Status::kKeyNotExist);
  EXPECT_EQ(get(b, skey("fits"), SinkMode::kAligned, 2).data, make_value(4, 1, 95000));
  EXPECT_EQ(ns_metric(b, "namespace_evictions_total", 2), 1);
  EXPECT_EQ(ns_metric(b, "namespace_held_bytes", 2), static_cast<double>(charge(95000)));
  EXPECT_EQ(ns_metric(b, "namespace_held_bytes", 1), static_cast<double>(charge(99000)));
}

TEST_F(LocalQuota, OpenRefusesQuotasTheLogCannotKeep) {
  // 16 segments of 1 MiB: quotas may sum to 14 x 15/16 MiB = 13,762,560 bytes.
  auto o = options(1u << 20, 16u << 20);
  o.quotas[1] = 8u << 20;
  o.quotas[2] = 13762560 - (8u << 20) + 1;
  auto r = make_local_backend(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().find("quotas sum to 13762561 bytes"), std::string::npos) << r.error();
  o.quotas[2] -= 1;
  EXPECT_TRUE(make_local_backend(o).ok());
  auto two = options(1u << 20, 2u << 20);  // two segments leave no room for any quota
  two.quotas[3] = 1;
  EXPECT_FALSE(make_local_backend(two).ok());
}

// Evictions are durable: the evicted values do not come back at the next open (their tombstones
// went out in the batch after the eviction), and the namespace is within its quota from the start.
TEST_F(LocalQuota, EvictedValuesStayGoneAfterReopen) {
  auto o = options(1u << 20, 16u << 20);
  o.quotas[1] = 10 * charge(20000);
  Backend& b = open(o);
  for (uint32_t k = 0; k < 25; ++k) {
    ASSERT_EQ(put(b, int_key(k), make_value(k, 1, 20000)), Status::kSuccess);
  }
  EXPECT_EQ(ns_metric(b, "namespace_evictions_total", 1), 15);
  EXPECT_EQ(list(b, Key{}, 100).size(), 10u);
  b.drain();
  Backend& r = reopen(o);
  const auto keys = list(r, Key{}, 100);
  ASSERT_EQ(keys.size(), 10u);
  for (uint32_t k = 15; k < 25; ++k) EXPECT_EQ(get(r, int_key(k)).data, make_value(k, 1, 20000));
  EXPECT_EQ(ns_metric(r, "namespace_held_bytes", 1), static_cast<double>(10 * charge(20000)));
}

// Copy-forward copies live values only: a deleted key of a namespace with a quota stays deleted
// while its put's segment and then its tombstone's are reclaimed, and a live one is kept.
TEST_F(LocalQuota, CopyForwardNeverResurrectsADeletedKey) {
  auto o = options(1u << 20, 8u << 20);
  o.quotas[2] = 1u << 20;
  Backend& b = open(o);
  ASSERT_EQ(put(b, skey("victim"), make_value(998, 1, 5000), 0, 2), Status::kSuccess);
  ASSERT_EQ(put(b, skey("keeper"), make_value(999, 1, 70000), 0, 2), Status::kSuccess);
  uint32_t n = 0;
  auto fill = [&](Backend& s, int count) {
    for (int i = 0; i < count; ++i, ++n) {
      ASSERT_EQ(put(s, int_key(n), make_value(n, 1, 50000)), Status::kSuccess);
    }
  };
  fill(b, 10);
  ASSERT_EQ(simple(b, BackendOpKind::kDelete, skey("victim"), 2), Status::kSuccess);
  double reclaimed = 0;
  for (int round = 0; round < 8; ++round) {
    fill(*store_, 40);  // 2 MB: a quarter of the log, so every segment is reclaimed in 4 rounds
    reclaimed += metric(*store_, "local_segments_reclaimed_total");
    Backend& r = reopen(o);
    EXPECT_EQ(get(r, skey("victim"), SinkMode::kAligned, 2).status, Status::kKeyNotExist)
        << "round " << round;
    EXPECT_EQ(get(r, skey("keeper"), SinkMode::kAligned, 2).data, make_value(999, 1, 70000))
        << "round " << round;
  }
  EXPECT_GE(reclaimed, 8);
  EXPECT_EQ(metric(*store_, "local_copy_forward_dropped_total"), 0);
}

// ---- restart ------------------------------------------------------------------------------------

TEST_F(LocalStore, ReopenWith100000KeysRebuildsTheIndex) {
  const auto o = options(16u << 20, 1u << 30);
  constexpr uint32_t kKeys = 100000;
  {
    Backend& b = open(o);
    // 100 bytes each, in flights of 2048: group commits of up to 2048 records.
    std::vector<std::vector<std::byte>> values(2048);
    std::vector<Call> calls(2048);
    for (uint32_t base = 0; base < kKeys; base += 2048) {
      const uint32_t n = std::min<uint32_t>(2048, kKeys - base);
      for (uint32_t i = 0; i < n; ++i) {
        values[i] = make_value(base + i, 1, 100);
        Call& c = calls[i];
        c.op = BackendOp{};
        c.op.kind = BackendOpKind::kPut;
        c.op.key = int_key(base + i);
        c.op.value = values[i];
        c.op.user = &c;
        c.op.done = [](BackendOp* op, Status s, uint64_t) {
          static_cast<Call*>(op->user)->status = s;
        };
      }
      for (uint32_t i = 0; i < n; ++i) b.submit(&calls[i].op);
      b.drain();
      for (uint32_t i = 0; i < n; ++i) ASSERT_EQ(calls[i].status, Status::kSuccess);
    }
    ASSERT_EQ(b.info().keys, kKeys);
    store_.reset();
  }
  const auto t0 = std::chrono::steady_clock::now();
  Backend& b = open(o);
  const double open_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double rebuild_s = metric(b, "local_rebuild_seconds");
  std::printf(
      "reopen with %u keys: index rebuilt in %.1f ms (open %.1f ms), index %.1f bytes/key\n", kKeys,
      rebuild_s * 1e3, open_s * 1e3, metric(b, "local_index_bytes") / kKeys);
  RecordProperty("rebuild_ms_100k_keys", std::to_string(rebuild_s * 1e3));
  ASSERT_EQ(b.info().keys, kKeys);
  // Every key, exactly: one List of the namespace against the set that was stored.
  std::vector<Key> want;
  for (uint32_t k = 0; k < kKeys; ++k) want.push_back(int_key(k));
  std::sort(want.begin(), want.end());
  EXPECT_TRUE(list(b, Key{}, 2 * kKeys) == want);
  for (uint32_t k = 0; k < kKeys; k += 997)
    ASSERT_EQ(get(b, int_key(k)).data, make_value(k, 1, 100));
}

// ---- crash --------------------------------------------------------------------------------------

// What the writer logged in one run: per key, its ops in order and whether each was acknowledged.
struct LoggedOp {
  uint64_t version;
  bool del;
  bool acked = false;
  bool noop = false;  // a delete of an absent key
};

std::map<uint32_t, std::vector<LoggedOp>> parse_log(const fs::path& log) {
  std::map<uint32_t, std::vector<LoggedOp>> ops;
  std::map<uint64_t, LoggedOp*> by_version;
  std::ifstream in(log);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ss(line);
    std::string tag;
    uint32_t k;
    uint64_t ver;
    if (!(ss >> tag >> k >> ver)) continue;  // "ready", or a line cut by the kill
    if (tag == "S") {
      std::string kind;
      if (!(ss >> kind)) continue;
      ops[k].push_back(LoggedOp{ver, kind == "D"});
    } else if (tag == "A" || tag == "N") {
      for (LoggedOp& o : ops[k]) {
        if (o.version == ver) (tag == "A" ? o.acked : o.noop) = true;
      }
    } else if (tag == "F") {
      ADD_FAILURE() << "the writer saw a failed op: " << line;
    }
  }
  return ops;
}

TEST_F(LocalStore, AcknowledgedValuesSurviveKill9) {
  const fs::path store_dir = dir_ / "store";
  const fs::path log = dir_ / "writer.log";
  LocalBackendOptions o;
  o.path = store_dir.string();
  o.segment_bytes = 32u << 20;  // as the writer opens it
  o.capacity_bytes = uint64_t{8} << 30;
  // Current state per key: the version stored, or nullopt when absent.
  std::map<uint32_t, std::optional<uint64_t>> model;
  std::mt19937 rng(std::random_device{}());
  constexpr int kRuns = 24;
  size_t acked_total = 0, ambiguous = 0, torn = 0;
  for (int run = 0; run < kRuns; ++run) {
    fs::remove(log);
    pid_t pid;
    const std::string helper = GDKV_LOCAL_HELPER;
    const std::string sdir = store_dir.string(), slog = log.string();
    // Every fourth run stores only large values, so kills often cut a multi-chunk batch.
    char* argv[] = {const_cast<char*>(helper.c_str()),
                    const_cast<char*>("writer"),
                    const_cast<char*>(sdir.c_str()),
                    const_cast<char*>(slog.c_str()),
                    run % 4 == 1 ? const_cast<char*>("big") : nullptr,
                    nullptr};
    ASSERT_EQ(posix_spawn(&pid, helper.c_str(), nullptr, nullptr, argv, environ), 0);
    if (run % 6 == 5) {
      // Sometimes while it is still opening (rebuilding its index).
      std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 15));
    } else {
      for (int i = 0; i < 2000; ++i) {
        std::ifstream f(log);
        std::string first;
        if (std::getline(f, first) && first == "ready") break;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20 + rng() % 200));
    }
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the writer exited by itself: status " << status;

    // Every key must be in a state some prefix of its ops explains: everything acknowledged
    // applied, plus possibly the one op that was in flight.
    const auto ops = parse_log(log);
    Backend& b = open(o);
    for (auto& [k, list] : ops) {
      std::optional<uint64_t> before = model.count(k) ? model[k] : std::nullopt;
      size_t last_acked = 0;  // ops[0, last_acked) are certainly applied
      for (size_t i = 0; i < list.size(); ++i) {
        if (list[i].acked || list[i].noop) last_acked = i + 1;
      }
      ASSERT_LE(list.size(), last_acked + 1) << "two ops in flight on one key";
      auto state_after = [&](size_t n) {
        std::optional<uint64_t> s = before;
        for (size_t i = 0; i < n; ++i) {
          if (list[i].noop) continue;
          s = list[i].del ? std::nullopt : std::optional<uint64_t>(list[i].version);
        }
        return s;
      };
      const std::optional<uint64_t> sure = state_after(last_acked);
      const std::optional<uint64_t> maybe = state_after(list.size());
      const GetResult r = get(b, int_key(k), k % 2 ? SinkMode::kAligned : SinkMode::kUnaligned);
      std::optional<uint64_t> actual;
      if (r.status == Status::kSuccess) {
        ASSERT_GE(r.data.size(), 16u);
        uint64_t id, ver;
        std::memcpy(&id, r.data.data(), 8);
        std::memcpy(&ver, r.data.data() + 8, 8);
        ASSERT_EQ(id, k);
        ASSERT_TRUE(r.data == make_value(k, ver, value_len(k, ver)))
            << "key " << k << " version " << ver << ": torn or wrong bytes";
        actual = ver;
      } else {
        ASSERT_EQ(r.status, Status::kKeyNotExist) << "key " << k;
      }
      ASSERT_TRUE(actual == sure || actual == maybe)
          << "run " << run << " key " << k << ": found "
          << (actual ? std::to_string(*actual) : "nothing") << ", acknowledged state "
          << (sure ? std::to_string(*sure) : "absent");
      if (sure != maybe) ++ambiguous;
      model[k] = actual;
      for (const auto& op : list) acked_total += op.acked;
    }
    // Keys untouched in this run keep their state, and nothing else exists.
    size_t present = 0;
    for (const auto& [k, ver] : model) {
      present += ver.has_value();
      if (ops.count(k) == 0 && ver) {
        ASSERT_EQ(get(b, int_key(k)).data, make_value(k, *ver, value_len(k, *ver)));
      }
    }
    ASSERT_EQ(list(b, Key{}, 100000).size(), present) << "run " << run;
    ASSERT_EQ(metric(b, "local_checksum_failures_total"), 0);
    torn += static_cast<size_t>(metric(b, "local_torn_batches_dropped"));
    store_.reset();
  }
  std::printf(
      "%d kill -9 runs: %zu acknowledged ops checked, %zu in flight at a kill, %zu torn "
      "batches dropped at open\n",
      kRuns, acked_total, ambiguous, torn);
  EXPECT_GT(acked_total, 1000u);
}

}  // namespace
}  // namespace gdkv::local::test
