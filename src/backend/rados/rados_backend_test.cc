// The rados backend against a real cluster (scripts/ceph-cluster up; $GDKV_CEPH_CONF), on a
// replicated and an erasure-coded pool: every op kind, store options, short sinks, namespaces,
// corruption detection, and interop with the stock `rados` tool.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <xxhash.h>
#include <rados/librados.hpp>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/rados/rados_record.h"
#include "rados_test_util.h"

namespace gdkv::rados_test {
namespace {

// ---- no cluster needed --------------------------------------------------------------------------

TEST(RadosStatus, MapsLibradosErrors) {
  EXPECT_EQ(rados_status(0), Status::kSuccess);
  EXPECT_EQ(rados_status(5), Status::kSuccess);
  EXPECT_EQ(rados_status(-ENOENT), Status::kKeyNotExist);
  EXPECT_EQ(rados_status(-EEXIST), Status::kKeyExists);
  EXPECT_EQ(rados_status(-ENOSPC), Status::kCapacityExceeded);
  EXPECT_EQ(rados_status(-EDQUOT), Status::kCapacityExceeded);
  EXPECT_EQ(rados_status(-ETIMEDOUT), Status::kNamespaceNotReady);
  EXPECT_EQ(rados_status(-ESHUTDOWN), Status::kNamespaceNotReady);
  EXPECT_EQ(rados_status(-EFBIG), Status::kInvalidValueSize);
  EXPECT_EQ(rados_status(-EIO), Status::kUnrecoveredError);
  EXPECT_EQ(rados_status(-EOPNOTSUPP), Status::kInternalError);
  EXPECT_EQ(rados_status(-EPERM), Status::kInternalError);
}

TEST(RadosRecord, RoundTripsAndRejectsDamage) {
  const auto v = make_value(7, 1000);
  const Key k = key_of("abc");
  std::byte buf[rados::kRecordHeaderSize];
  rados::encode_record_header(rados::make_record_header(k, v), buf);
  auto h = rados::decode_record_header(buf);
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(h->key, k);
  EXPECT_EQ(h->value_len, 1000u);
  EXPECT_EQ(h->identity, hash128(v.data(), v.size()));
  for (size_t i = 0; i < sizeof(buf); ++i) {
    std::byte bad[rados::kRecordHeaderSize];
    std::copy(std::begin(buf), std::end(buf), bad);
    bad[i] ^= std::byte{0x10};
    EXPECT_FALSE(rados::decode_record_header(bad).has_value()) << "byte " << i;
  }
  EXPECT_FALSE(rados::decode_record_header(std::span(buf, 63)).has_value());
}

// make_record_header hashes a large value once, taking XXH3-64 from XXH3-128's low half.
TEST(RadosRecord, DigestsMatchSeparateHashesAtEverySize) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{16}, size_t{240}, size_t{241}, size_t{4096},
                   (size_t{2} << 20) + 13}) {
    SCOPED_TRACE(n);
    const auto v = make_value(n, n);
    const rados::RecordHeader h = rados::make_record_header(key_of("k"), v);
    EXPECT_EQ(h.identity, hash128(v.data(), v.size()));
    EXPECT_EQ(h.checksum, XXH3_64bits(v.data(), v.size()));
  }
}

TEST(RadosBackendOpen, WithoutClusterConfigIsAClearError) {
  RadosBackendOptions o;
  o.ceph_conf = "/nonexistent/ceph.conf";
  const auto r = make_rados_backend(o);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().find("/nonexistent/ceph.conf"), std::string::npos) << r.error();
  o.ceph_timeout_ms = 0;
  EXPECT_NE(make_rados_backend(o).error().find("ceph_timeout_ms must be > 0"), std::string::npos);
}

// ---- against the cluster ------------------------------------------------------------------------

// Runs a shell command; its exit status.
int sh(const std::string& cmd) {
  int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

std::vector<std::byte> read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> v(c.size());
  std::memcpy(v.data(), c.data(), c.size());
  return v;
}

void write_file(const std::filesystem::path& p, std::span<const std::byte> v) {
  std::ofstream out(p, std::ios::binary);
  out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size()));
}

class RadosBackendTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    GDKV_REQUIRE_CEPH();
    opts_ = options_for(GetParam());
    backend_ = make_rados_backend(opts_).value();
    kv_ = std::make_unique<Sync>(backend_);
    tmp_ = std::filesystem::temp_directory_path() / ("gdkv-rados-test-" + opts_.namespace_prefix);
    std::filesystem::create_directories(tmp_);
  }
  void TearDown() override {
    if (!tmp_.empty()) std::filesystem::remove_all(tmp_);
  }

  std::string ns(uint32_t nsid = 1) const { return opts_.namespace_prefix + std::to_string(nsid); }
  std::string rados_cli() const {
    return "rados -c '" + std::string(ceph_conf()) + "' -p '" + GetParam() + "' ";
  }
  // A librados handle of the test's own, for writing behind the backend's back.
  librados::IoCtx raw_ioctx(uint32_t nsid = 1) {
    if (!raw_) {
      raw_ = std::make_unique<librados::Rados>();
      EXPECT_EQ(raw_->init2("client.admin", "ceph", 0), 0);
      EXPECT_EQ(raw_->conf_read_file(ceph_conf()), 0);
      EXPECT_EQ(raw_->connect(), 0);
    }
    librados::IoCtx io;
    EXPECT_EQ(raw_->ioctx_create(GetParam().c_str(), io), 0);
    io.set_namespace(ns(nsid));
    return io;
  }

  RadosBackendOptions opts_;
  std::shared_ptr<Backend> backend_;
  std::unique_ptr<Sync> kv_;
  std::filesystem::path tmp_;
  std::unique_ptr<librados::Rados> raw_;
  std::mt19937_64 rng_{std::random_device{}()};
};

TEST_P(RadosBackendTest, PutThenGetReturnsTheBytes) {
  for (size_t size : {size_t{0}, size_t{1}, size_t{4096}, size_t{100000}, (size_t{2} << 20) + 13}) {
    SCOPED_TRACE(size);
    const Key k = random_key(rng_);
    const auto v = make_value(size, size);
    ASSERT_EQ(kv_->put(k, v).status, Status::kSuccess);
    Result sink = kv_->get(k);
    ASSERT_EQ(sink.status, Status::kSuccess) << hexdump_status(sink.status);
    EXPECT_EQ(sink.len, size);
    EXPECT_TRUE(sink.data == v);
    Result view = kv_->get(k, 1, SIZE_MAX, /*use_sink=*/false);
    ASSERT_EQ(view.status, Status::kSuccess);
    EXPECT_EQ(view.len, size);
    EXPECT_TRUE(view.data == v);
  }
}

TEST_P(RadosBackendTest, ShortSinkGetsThePrefixAndTheFullLength) {
  const Key k = random_key(rng_, 5);
  const auto v = make_value(3, 10000);
  ASSERT_EQ(kv_->put(k, v).status, Status::kSuccess);
  Result r = kv_->get(k, 1, 100);
  ASSERT_EQ(r.status, Status::kSuccess);
  EXPECT_EQ(r.len, 10000u);
  ASSERT_EQ(r.data.size(), 100u);
  EXPECT_TRUE(std::equal(r.data.begin(), r.data.end(), v.begin()));
  Result none = kv_->get(k, 1, 0);  // a sink that wants nothing
  EXPECT_EQ(none.status, Status::kSuccess);
  EXPECT_EQ(none.len, 10000u);
  EXPECT_TRUE(none.sink_called);
}

TEST_P(RadosBackendTest, OverwriteReplacesTheWholeValue) {
  const Key k = random_key(rng_);
  ASSERT_EQ(kv_->put(k, make_value(1, 50000)).status, Status::kSuccess);
  const auto shorter = make_value(2, 3000);
  ASSERT_EQ(kv_->put(k, shorter).status, Status::kSuccess);
  Result r = kv_->get(k);
  ASSERT_EQ(r.status, Status::kSuccess);
  EXPECT_EQ(r.len, 3000u);
  EXPECT_TRUE(r.data == shorter);
}

TEST_P(RadosBackendTest, StoreOptions) {
  const Key k = random_key(rng_);
  const auto a = make_value(10, 4096);
  const auto b = make_value(11, 4096);
  EXPECT_EQ(kv_->put(k, a, nvme::kStoreMustExist).status, Status::kKeyNotExist);
  EXPECT_EQ(kv_->exists(k).status, Status::kKeyNotExist) << "must-exist created the key";
  EXPECT_EQ(kv_->put(k, a, nvme::kStoreMustNotExist).status, Status::kSuccess);
  EXPECT_EQ(kv_->put(k, b, nvme::kStoreMustNotExist).status, Status::kKeyExists);
  EXPECT_TRUE(kv_->get(k).data == a) << "a refused store changed the value";
  EXPECT_EQ(kv_->put(k, b, nvme::kStoreMustExist).status, Status::kSuccess);
  EXPECT_TRUE(kv_->get(k).data == b);
  EXPECT_EQ(kv_->put(k, a, nvme::kStoreMustExist | nvme::kStoreMustNotExist).status,
            Status::kInvalidField);
  EXPECT_EQ(kv_->put(k, a, nvme::kStoreCompressHint).status, Status::kSuccess);
}

TEST_P(RadosBackendTest, ExistsAndDelete) {
  const Key k = random_key(rng_, 1);
  EXPECT_EQ(kv_->exists(k).status, Status::kKeyNotExist);
  EXPECT_EQ(kv_->get(k).status, Status::kKeyNotExist);
  EXPECT_EQ(kv_->del(k).status, Status::kKeyNotExist);
  ASSERT_EQ(kv_->put(k, make_value(5, 10)).status, Status::kSuccess);
  EXPECT_EQ(kv_->exists(k).status, Status::kSuccess);
  EXPECT_EQ(kv_->del(k).status, Status::kSuccess);
  EXPECT_EQ(kv_->exists(k).status, Status::kKeyNotExist);
  EXPECT_EQ(kv_->get(k).status, Status::kKeyNotExist);
  EXPECT_EQ(kv_->del(k).status, Status::kKeyNotExist);
}

TEST_P(RadosBackendTest, ListIsOrderedFilteredAndBounded) {
  EXPECT_TRUE(kv_->list(Key{}, 100).keys.empty());
  std::vector<Key> keys;
  for (size_t i = 0; i < 24; ++i) keys.push_back(random_key(rng_, 1 + i % 16));
  keys.push_back(key_of("a"));
  keys.push_back(key_of("ab"));  // a longer key with a common prefix sorts after
  for (const Key& k : keys) ASSERT_EQ(kv_->put(k, make_value(k.len, 16)).status, Status::kSuccess);
  // Objects whose names are not gdkv keys are not listed.
  librados::IoCtx io = raw_ioctx();
  librados::bufferlist bl;
  bl.append("x");
  ASSERT_EQ(io.write_full("not-a-key", bl), 0);
  ASSERT_EQ(io.write_full("ABCD", bl), 0);  // upper-case hex is not a name gdkv writes
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());

  Result all = kv_->list(Key{}, 1000);
  ASSERT_EQ(all.status, Status::kSuccess);
  EXPECT_EQ(all.keys, keys);
  Result few = kv_->list(Key{}, 5);
  ASSERT_EQ(few.status, Status::kSuccess);
  EXPECT_EQ(few.keys, std::vector<Key>(keys.begin(), keys.begin() + 5));
  const Key& mid = keys[keys.size() / 2];
  Result from = kv_->list(mid, 1000);
  ASSERT_EQ(from.status, Status::kSuccess);
  EXPECT_EQ(from.keys, std::vector<Key>(keys.begin() + keys.size() / 2, keys.end()));
  EXPECT_TRUE(kv_->list(Key{}, 0).keys.empty());
}

TEST_P(RadosBackendTest, NamespacesAreKeptApart) {
  const Key k = random_key(rng_);
  const auto v1 = make_value(1, 100);
  const auto v2 = make_value(2, 200);
  ASSERT_EQ(kv_->put(k, v1, 0, 1).status, Status::kSuccess);
  EXPECT_EQ(kv_->get(k, 2).status, Status::kKeyNotExist);
  EXPECT_EQ(kv_->exists(k, 2).status, Status::kKeyNotExist);
  EXPECT_TRUE(kv_->list(Key{}, 10, 2).keys.empty());
  ASSERT_EQ(kv_->put(k, v2, 0, 2).status, Status::kSuccess);
  EXPECT_TRUE(kv_->get(k, 1).data == v1);
  EXPECT_TRUE(kv_->get(k, 2).data == v2);
  EXPECT_EQ(kv_->del(k, 2).status, Status::kSuccess);
  EXPECT_TRUE(kv_->get(k, 1).data == v1);
}

TEST_P(RadosBackendTest, InvalidInputsAndPrefetch) {
  EXPECT_EQ(kv_->get(Key{}).status, Status::kInvalidKeySize);
  EXPECT_EQ(kv_->put(Key{}, make_value(1, 1)).status, Status::kInvalidKeySize);
  EXPECT_EQ(kv_->del(Key{}).status, Status::kInvalidKeySize);
  EXPECT_EQ(kv_->exists(Key{}).status, Status::kInvalidKeySize);
  Key too_long = random_key(rng_);
  too_long.len = 17;
  EXPECT_EQ(kv_->get(too_long).status, Status::kInvalidKeySize);
  const Key hint[] = {random_key(rng_)};
  kv_->backend().prefetch(1, hint);  // no cache here: a hint with nothing to do
  EXPECT_EQ(kv_->simple(static_cast<BackendOpKind>(99), random_key(rng_)).status,
            Status::kInvalidField);
}

TEST_P(RadosBackendTest, CorruptValueIsReportedNeverReturned) {
  const Key k = random_key(rng_);
  const auto v = make_value(42, 8192);
  ASSERT_EQ(kv_->put(k, v).status, Status::kSuccess);
  const double before = metric(*backend_, "backend_checksum_failures_total");
  // Same length, one bit different, written behind the backend's back (xattr kept).
  auto bad = v;
  bad[4000] ^= std::byte{1};
  librados::IoCtx io = raw_ioctx();
  librados::bufferlist bl;
  bl.append(reinterpret_cast<const char*>(bad.data()), bad.size());
  ASSERT_EQ(io.write_full(k.hex(), bl), 0);
  Result r = kv_->get(k);
  EXPECT_EQ(r.status, Status::kUnrecoveredError) << hexdump_status(r.status);
  EXPECT_FALSE(r.sink_called) << "corrupt bytes reached the sink";
  EXPECT_EQ(kv_->get(k, 1, SIZE_MAX, false).status, Status::kUnrecoveredError);
  EXPECT_EQ(metric(*backend_, "backend_checksum_failures_total"), before + 2);
  // A damaged header is caught the same way.
  ASSERT_EQ(kv_->put(k, v).status, Status::kSuccess);
  librados::bufferlist junk;
  junk.append(std::string(rados::kRecordHeaderSize, 'x'));
  ASSERT_EQ(io.setxattr(k.hex(), rados::kHeaderXattr, junk), 0);
  EXPECT_EQ(kv_->get(k).status, Status::kUnrecoveredError);
  // A value copied to another key's object (header and all) is not that key's value.
  ASSERT_EQ(kv_->put(k, v).status, Status::kSuccess);
  const Key other = random_key(rng_);
  librados::bufferlist data, hdr;
  ASSERT_EQ(io.read(k.hex(), data, 0, 0), static_cast<int>(v.size()));
  ASSERT_GT(io.getxattr(k.hex(), rados::kHeaderXattr, hdr), 0);
  ASSERT_EQ(io.write_full(other.hex(), data), 0);
  ASSERT_EQ(io.setxattr(other.hex(), rados::kHeaderXattr, hdr), 0);
  EXPECT_EQ(kv_->get(other).status, Status::kUnrecoveredError);
  EXPECT_EQ(kv_->get(k).status, Status::kSuccess);
  EXPECT_GT(metric(*backend_, "backend_errors_total"), 0);
}

// The documented choice: a value stored by another tool (no gdkv.hdr xattr) reads as it is,
// unverified and counted, unless allow_raw_objects is off.
TEST_P(RadosBackendTest, RawObjectsFromOtherTools) {
  const Key k = random_key(rng_);
  const auto v = make_value(9, 5000);
  write_file(tmp_ / "in", v);
  ASSERT_EQ(
      sh(rados_cli() + "-N '" + ns() + "' put " + k.hex() + " '" + (tmp_ / "in").string() + "'"),
      0);
  Result r = kv_->get(k);
  ASSERT_EQ(r.status, Status::kSuccess);
  EXPECT_TRUE(r.data == v);
  EXPECT_EQ(metric(*backend_, "rados_raw_reads_total"), 1);

  RadosBackendOptions strict = opts_;
  strict.allow_raw_objects = false;
  Sync s(make_rados_backend(strict).value());
  EXPECT_EQ(s.get(k).status, Status::kUnrecoveredError);
  EXPECT_EQ(s.exists(k).status, Status::kSuccess);
}

// A value stored through gdkv is byte-identical when the stock tool reads it, and a value the
// stock tool overwrites no longer matches its gdkv checksum.
TEST_P(RadosBackendTest, InteropWithTheRadosTool) {
  const Key k = random_key(rng_);
  const auto v = make_value(77, (size_t{1} << 20) + 7);
  ASSERT_EQ(kv_->put(k, v).status, Status::kSuccess);
  const auto out = tmp_ / "out";
  ASSERT_EQ(sh(rados_cli() + "-N '" + ns() + "' get " + k.hex() + " '" + out.string() + "'"), 0);
  EXPECT_TRUE(read_file(out) == v) << "rados get returned other bytes";
  ASSERT_EQ(sh(rados_cli() + "-N '" + ns() + "' stat " + k.hex() + " >/dev/null"), 0);

  auto changed = v;
  changed[12345] ^= std::byte{0x80};
  write_file(tmp_ / "changed", changed);
  ASSERT_EQ(sh(rados_cli() + "-N '" + ns() + "' put " + k.hex() + " '" +
               (tmp_ / "changed").string() + "'"),
            0);
  EXPECT_EQ(kv_->get(k).status, Status::kUnrecoveredError);
}

TEST_P(RadosBackendTest, ManyOpsInFlightAndDrain) {
  constexpr size_t kOps = 256;
  std::vector<std::unique_ptr<SyncOp>> ops;
  std::vector<std::vector<std::byte>> values;
  std::vector<Key> keys;
  for (size_t i = 0; i < kOps; ++i) {
    keys.push_back(random_key(rng_));
    values.push_back(make_value(i, 4096 + i));
  }
  std::atomic<size_t> done{0};
  struct Ctx {
    std::atomic<size_t>* done;
    Status status = Status::kInternalError;
  };
  std::vector<Ctx> ctx(kOps, Ctx{&done});
  std::vector<BackendOp> bops(kOps);
  for (size_t i = 0; i < kOps; ++i) {
    bops[i].kind = BackendOpKind::kPut;
    bops[i].key = keys[i];
    bops[i].value = values[i];
    bops[i].user = &ctx[i];
    bops[i].done = [](BackendOp* op, Status s, uint64_t) {
      auto* c = static_cast<Ctx*>(op->user);
      c->status = s;
      c->done->fetch_add(1);
    };
    backend_->submit(&bops[i]);
  }
  backend_->drain();
  ASSERT_EQ(done.load(), kOps);
  for (const auto& c : ctx) EXPECT_EQ(c.status, Status::kSuccess);
  for (size_t i = 0; i < kOps; i += 17) EXPECT_TRUE(kv_->get(keys[i]).data == values[i]);
  backend_->drain();  // done() runs just before an op leaves the in-flight count
  EXPECT_EQ(metric(*backend_, "backend_inflight"), 0);
}

// Stores start on the backend's submit thread, reads on the caller's: ops one caller submits
// back to back, without waiting, must still reach the cluster in that order. A large Store then
// a small one of the same key leaves the small one, and a Get right behind reads it; a Store
// then a Delete leaves nothing, and an Exists right behind says so.
TEST_P(RadosBackendTest, BackToBackOpsOfOneCallerApplyInOrder) {
  constexpr size_t kKeys = 12;
  struct Ctx {
    std::atomic<size_t>* done;
    Status status = Status::kInternalError;
    uint64_t len = 0;
    std::vector<std::byte> buf = std::vector<std::byte>(8192);
  };
  std::atomic<size_t> done{0};
  const auto big = make_value(1, 1 << 20);
  const auto small = make_value(2, 4096);
  std::vector<Key> keys;
  for (size_t i = 0; i < 2 * kKeys; ++i) keys.push_back(random_key(rng_));
  constexpr size_t kPerKey = 6;  // put big, put small, get; put, delete, exists
  std::vector<Ctx> ctx(kKeys * kPerKey, Ctx{&done});
  std::vector<BackendOp> ops(kKeys * kPerKey);
  const double offloaded0 = metric(*backend_, "rados_submit_thread_ops_total");
  for (size_t i = 0; i < kKeys; ++i) {
    const struct {
      BackendOpKind kind;
      const Key& key;
      std::span<const std::byte> value;
    } plan[kPerKey] = {{BackendOpKind::kPut, keys[i], big},
                       {BackendOpKind::kPut, keys[i], small},
                       {BackendOpKind::kGet, keys[i], {}},
                       {BackendOpKind::kPut, keys[kKeys + i], small},
                       {BackendOpKind::kDelete, keys[kKeys + i], {}},
                       {BackendOpKind::kExists, keys[kKeys + i], {}}};
    for (size_t j = 0; j < kPerKey; ++j) {
      BackendOp& op = ops[i * kPerKey + j];
      op.kind = plan[j].kind;
      op.key = plan[j].key;
      op.value = plan[j].value;
      op.user = &ctx[i * kPerKey + j];
      op.sink = [](BackendOp* o, uint64_t) -> std::span<std::byte> {
        return static_cast<Ctx*>(o->user)->buf;
      };
      op.done = [](BackendOp* o, Status st, uint64_t len) {
        auto* c = static_cast<Ctx*>(o->user);
        c->status = st;
        c->len = len;
        c->done->fetch_add(1);
      };
      backend_->submit(&op);
    }
  }
  backend_->drain();
  ASSERT_EQ(done.load(), ops.size());
  for (size_t i = 0; i < kKeys; ++i) {
    SCOPED_TRACE(i);
    const Ctx* c = &ctx[i * kPerKey];
    EXPECT_EQ(c[0].status, Status::kSuccess);
    EXPECT_EQ(c[1].status, Status::kSuccess);
    ASSERT_EQ(c[2].status, Status::kSuccess);
    EXPECT_EQ(c[2].len, small.size()) << "the Get overtook the second Store";
    EXPECT_TRUE(std::equal(small.begin(), small.end(), c[2].buf.begin()));
    EXPECT_TRUE(kv_->get(keys[i]).data == small) << "the large Store landed last";
    EXPECT_EQ(c[3].status, Status::kSuccess);
    EXPECT_EQ(c[4].status, Status::kSuccess) << "the Delete overtook its Store";
    EXPECT_EQ(c[5].status, Status::kKeyNotExist);
    EXPECT_EQ(kv_->exists(keys[kKeys + i]).status, Status::kKeyNotExist);
  }
  // Every Store went through the submit thread (and ops queued behind them may have).
  EXPECT_GE(metric(*backend_, "rados_submit_thread_ops_total") - offloaded0, 3.0 * kKeys);
}

// A 1 ms timeout makes the watchdog and librados' completions race on nearly every op: each op
// must still complete exactly once, with its result or 82h, and the backend must shut down
// cleanly with librados callbacks still on their way.
TEST_P(RadosBackendTest, TimeoutsRacingCompletionsCompleteEachOpOnce) {
  RadosBackendOptions o = opts_;
  o.ceph_timeout_ms = 1;
  auto b = make_rados_backend(o).value();
  constexpr size_t kOps = 600;
  struct Ctx {
    std::atomic<int> calls{0};
    std::atomic<uint8_t> status{0xFF};
    std::vector<std::byte> buf = std::vector<std::byte>(8192);
  };
  std::vector<Ctx> ctx(kOps);
  std::vector<BackendOp> ops(kOps);
  const auto value = make_value(1, 8192);
  const Key k = random_key(rng_);
  ASSERT_EQ(kv_->put(k, value).status, Status::kSuccess);
  for (size_t i = 0; i < kOps; ++i) {
    BackendOp& op = ops[i];
    op.kind = static_cast<BackendOpKind>(i % 5);  // put, get, delete, exists, list
    op.key = (op.kind == BackendOpKind::kGet || op.kind == BackendOpKind::kExists)
                 ? k
                 : key_of("race" + std::to_string(i));
    op.value = value;
    op.list_max = 10;
    op.user = &ctx[i];
    op.sink = [](BackendOp* o, uint64_t) -> std::span<std::byte> {
      return static_cast<Ctx*>(o->user)->buf;
    };
    op.done = [](BackendOp* o, Status s, uint64_t) {
      auto* c = static_cast<Ctx*>(o->user);
      c->status = static_cast<uint8_t>(s);
      c->calls.fetch_add(1);
    };
    b->submit(&op);
  }
  b->drain();
  const double timeouts = metric(*b, "backend_timeouts_total");
  b.reset();  // waits for librados' late callbacks
  size_t timed_out = 0;
  for (size_t i = 0; i < kOps; ++i) {
    ASSERT_EQ(ctx[i].calls.load(), 1) << "op " << i;
    const auto s = static_cast<Status>(ctx[i].status.load());
    EXPECT_TRUE(s == Status::kSuccess || s == Status::kNamespaceNotReady ||
                s == Status::kKeyNotExist)
        << "op " << i << ": " << hexdump_status(s);
    timed_out += s == Status::kNamespaceNotReady;
  }
  EXPECT_EQ(static_cast<double>(timed_out), timeouts);
  std::printf("%zu of %zu ops timed out\n", timed_out, kOps);
  EXPECT_TRUE(kv_->get(k).data == value) << "a timed-out op damaged another key";
}

TEST_P(RadosBackendTest, InfoAndMetrics) {
  ASSERT_EQ(kv_->put(random_key(rng_), make_value(1, 1000)).status, Status::kSuccess);
  EXPECT_EQ(backend_->info().name, "rados");
  EXPECT_GE(metric(*backend_, "backend_ops_total"), 1);
  EXPECT_GE(metric(*backend_, "backend_written_bytes_total"), 1000);
  MetricList m;
  backend_->collect(m);
  for (const auto& x : m) {
    EXPECT_EQ(x.name.rfind("gdkv_", 0), std::string::npos) << x.name;
    EXPECT_EQ(x.labels.at(0), (std::pair<std::string, std::string>("backend", "rados")));
  }
}

TEST_P(RadosBackendTest, UnknownPoolIsAClearError) {
  RadosBackendOptions o = opts_;
  o.pool = "gdkv-no-such-pool";
  const auto r = make_rados_backend(o);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().find("gdkv-no-such-pool"), std::string::npos) << r.error();
}

INSTANTIATE_TEST_SUITE_P(Pools, RadosBackendTest, ::testing::Values("gdkv-rep3", "gdkv-ec21"),
                         [](const auto& info) {
                           return info.param == "gdkv-rep3" ? std::string("Rep3")
                                                            : std::string("Ec21");
                         });

}  // namespace
}  // namespace gdkv::rados_test
