// The rados backend while the cluster fails under it: an OSD killed during a read/write workload
// (no failed op, no wrong byte), the monitor stopped, the whole cluster frozen (every op fails
// in time with 82h, and the same backend works again once the cluster returns).
//
// These tests change the cluster for everyone: ctest runs this program alone (RUN_SERIAL), and
// each test leaves the cluster active+clean. They drive scripts/ceph-cluster with the state
// directory of $GDKV_CEPH_CONF.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <atomic>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "rados_test_util.h"

namespace gdkv::rados_test {
namespace {

using namespace std::chrono_literals;

// scripts/ceph-cluster ARGS for the cluster of $GDKV_CEPH_CONF; its exit status.
int cluster(const std::string& args) {
  const std::string dir = std::filesystem::path(ceph_conf()).parent_path().string();
  const std::string cmd =
      "GDKV_CEPH_DIR='" + dir + "' '" GDKV_CEPH_CLUSTER_SCRIPT "' " + args + " >&2";
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// Runs `f` when it goes out of scope: the cluster is restored even when an assertion fails.
template <typename F>
struct Finally {
  F f;
  ~Finally() { f(); }
};
template <typename F>
Finally(F) -> Finally<F>;

// Writers and readers on keys of their own, each checking every value it reads against the last
// version it stored. Counts failed ops and wrong bytes.
class Workload {
 public:
  Workload(std::shared_ptr<Backend> b, int threads) : b_(std::move(b)) {
    versions_.assign(threads, std::vector<uint64_t>(kKeysPerThread, 0));
    for (int t = 0; t < threads; ++t) threads_.emplace_back([this, t] { run(t); });
  }
  ~Workload() { stop(); }
  void stop() {
    stop_ = true;
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  uint64_t ops() const { return ops_; }
  uint64_t failed() const { return failed_; }
  uint64_t wrong() const { return wrong_; }
  std::string first_error() {
    std::lock_guard lk(mu_);
    return first_error_;
  }
  std::chrono::milliseconds slowest() const {
    return std::chrono::milliseconds(slowest_ms_.load());
  }

  // After stop(): reads back every key ever stored and compares it with the last version its
  // writer had acknowledged. Returns the keys that differ or fail; `stored` gets the count.
  size_t verify_all(size_t* stored) {
    Sync kv(b_);
    size_t bad = 0;
    *stored = 0;
    for (size_t t = 0; t < versions_.size(); ++t) {
      for (int i = 0; i < kKeysPerThread; ++i) {
        const uint64_t ver = versions_[t][i];
        if (ver == 0) continue;
        ++*stored;
        const Result r = kv.get(key(static_cast<int>(t), i));
        if (r.status != Status::kSuccess || r.data != value(static_cast<int>(t), i, ver)) ++bad;
      }
    }
    return bad;
  }

 private:
  static constexpr int kKeysPerThread = 32;

  static Key key(int t, int i) { return key_of("w" + std::to_string(t) + "-" + std::to_string(i)); }
  static std::vector<std::byte> value(int t, int i, uint64_t ver) {
    return make_value((static_cast<uint64_t>(t) << 40) ^ (static_cast<uint64_t>(i) << 20) ^ ver,
                      4096 + 1024 * static_cast<size_t>(i % 29));
  }

  void run(int t) {
    Sync kv(b_);
    kv.limit = 60s;  // the op timeout is the backend's; this only catches a hang
    std::mt19937_64 rng(static_cast<uint64_t>(t) * 7919 + 1);
    std::vector<uint64_t>& version = versions_[t];  // 0: never stored; this thread's row only
    const auto key = [t](int i) { return Workload::key(t, i); };
    const auto value = [t](int i, uint64_t ver) { return Workload::value(t, i, ver); };
    while (!stop_) {
      const int i = static_cast<int>(rng() % kKeysPerThread);
      const bool write = version[i] == 0 || rng() % 2 == 0;
      Result r;
      if (write) {
        const auto v = value(i, version[i] + 1);
        r = kv.put(key(i), v);
        if (r.status == Status::kSuccess) ++version[i];
      } else {
        r = kv.get(key(i));
        if (r.status == Status::kSuccess && r.data != value(i, version[i])) {
          ++wrong_;
          note("wrong bytes for " + key(i).hex());
        }
      }
      ++ops_;
      slowest_ms_ = std::max<int64_t>(slowest_ms_, r.elapsed.count());
      if (r.elapsed > 1s) {  // rare: worth seeing in a CI log
        std::printf("slow %s %s: %lld ms, started t=%lld ms\n", write ? "put" : "get",
                    key(i).hex().c_str(), static_cast<long long>(r.elapsed.count()),
                    static_cast<long long>((Clock::now() - r.elapsed - start_) / 1ms));
      }
      if (r.status != Status::kSuccess) {
        ++failed_;
        note(std::string(write ? "put " : "get ") + key(i).hex() + ": " + hexdump_status(r.status) +
             " after " + std::to_string(r.elapsed.count()) +
             " ms, at t=" + std::to_string((Clock::now() - start_) / 1ms) + " ms");
      }
    }
  }
  void note(const std::string& s) {
    std::lock_guard lk(mu_);
    if (first_error_.empty()) first_error_ = s;
  }

  const Clock::time_point start_ = Clock::now();  // workload's t=0 (first member initialised)
  std::shared_ptr<Backend> b_;
  std::vector<std::vector<uint64_t>> versions_;  // [thread][key]: last acknowledged version
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> ops_{0}, failed_{0}, wrong_{0};
  std::atomic<int64_t> slowest_ms_{0};
  std::mutex mu_;
  std::string first_error_;
};

class RadosOsdFailureTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { GDKV_REQUIRE_CEPH(); }
};

TEST_P(RadosOsdFailureTest, KillOneOsdUnderLoadLosesNothing) {
  ASSERT_EQ(cluster("wait-clean 60"), 0);
  auto backend = make_rados_backend(options_for(GetParam())).value();  // default op timeout
  Finally restore{[] {
    cluster("start-osd 1");
    cluster("wait-clean 120");
  }};
  const auto t0 = Clock::now();
  Workload w(backend, 8);
  std::this_thread::sleep_for(1500ms);
  const uint64_t before = w.ops();
  ASSERT_EQ(cluster("kill-osd 1"), 0);
  std::printf("osd.1 killed at t=%lld ms\n", static_cast<long long>((Clock::now() - t0) / 1ms));
  std::this_thread::sleep_for(8s);  // degraded: the pool keeps serving from two OSDs
  const uint64_t degraded = w.ops() - before;
  ASSERT_EQ(cluster("start-osd 1"), 0);
  std::printf("osd.1 started at t=%lld ms\n", static_cast<long long>((Clock::now() - t0) / 1ms));
  std::this_thread::sleep_for(3s);  // recovery runs under the load
  w.stop();
  EXPECT_EQ(w.failed(), 0u) << w.first_error();
  EXPECT_EQ(w.wrong(), 0u) << w.first_error();
  EXPECT_GT(degraded, 100u) << "hardly any ops ran while the OSD was down";
  std::printf("ops %llu (%llu while degraded), slowest %lld ms\n",
              static_cast<unsigned long long>(w.ops()), static_cast<unsigned long long>(degraded),
              static_cast<long long>(w.slowest().count()));
  EXPECT_EQ(cluster("wait-clean 120"), 0);
  size_t stored = 0;
  EXPECT_EQ(w.verify_all(&stored), 0u) << "acknowledged values lost or changed";
  EXPECT_GT(stored, 200u);
}

INSTANTIATE_TEST_SUITE_P(Pools, RadosOsdFailureTest, ::testing::Values("gdkv-rep3", "gdkv-ec21"),
                         [](const auto& info) {
                           return info.param == "gdkv-rep3" ? std::string("Rep3")
                                                            : std::string("Ec21");
                         });

class RadosClusterGoneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    GDKV_REQUIRE_CEPH();
    opts_ = options_for("gdkv-rep3");
    opts_.ceph_timeout_ms = kTimeoutMs;
    backend_ = make_rados_backend(opts_).value();
    kv_ = std::make_unique<Sync>(backend_);
    kv_->limit = std::chrono::milliseconds(kTimeoutMs + 10000);
    ASSERT_EQ(kv_->put(key_, value_).status, Status::kSuccess);
  }

  // Every kind of op, once each and all at once: each must end with success (if allowed) or 82h
  // within the timeout (+ slack for a loaded 2-core machine); returns how many succeeded.
  int every_op_bounded(bool success_allowed) {
    int ok = 0;
    const Key fresh = key_of("fresh-" + std::to_string(counter_++));
    std::vector<Result> rs(5);
    {
      std::vector<std::jthread> ops;
      ops.emplace_back([&] { rs[0] = kv_->get(key_); });
      ops.emplace_back([&] { rs[1] = kv_->put(fresh, value_); });
      ops.emplace_back([&] { rs[2] = kv_->exists(key_); });
      ops.emplace_back([&] { rs[3] = kv_->list(Key{}, 10); });
      ops.emplace_back([&] { rs[4] = kv_->del(fresh); });
    }
    for (size_t i = 0; i < rs.size(); ++i) {
      const Result& r = rs[i];
      SCOPED_TRACE("op " + std::to_string(i));
      EXPECT_TRUE(r.completed);
      EXPECT_LE(r.elapsed.count(), kTimeoutMs + kSlackMs);
      if (r.status == Status::kSuccess && success_allowed) {
        ++ok;
        if (i == 0) {
          EXPECT_TRUE(r.data == value_);
        }
        continue;
      }
      if (i == 4 && r.status == Status::kKeyNotExist) continue;  // ran before its put
      EXPECT_EQ(r.status, Status::kNamespaceNotReady) << hexdump_status(r.status);
    }
    return ok;
  }

  // After the cluster returns, the same backend works again: retried until it does (bounded),
  // then every op must succeed.
  void works_again() {
    const auto t0 = Clock::now();
    int tries = 1;
    while (kv_->get(key_).status != Status::kSuccess && Clock::now() < t0 + 60s) {
      std::this_thread::sleep_for(500ms);
      ++tries;
    }
    EXPECT_EQ(kv_->get(key_).status, Status::kSuccess);
    std::printf("serving again after %lld ms (%d tries)\n",
                static_cast<long long>((Clock::now() - t0) / 1ms), tries);
    const Key k = key_of("after-" + std::to_string(counter_++));
    EXPECT_EQ(kv_->put(k, value_).status, Status::kSuccess);
    EXPECT_TRUE(kv_->get(k).data == value_);
    EXPECT_EQ(kv_->exists(k).status, Status::kSuccess);
    EXPECT_EQ(kv_->list(Key{}, 100).status, Status::kSuccess);
    EXPECT_EQ(kv_->del(k).status, Status::kSuccess);
  }

  static constexpr uint32_t kTimeoutMs = 2000;
  static constexpr int64_t kSlackMs = 1500;
  RadosBackendOptions opts_;
  std::shared_ptr<Backend> backend_;
  std::unique_ptr<Sync> kv_;
  const Key key_ = key_of("cluster-gone");
  const std::vector<std::byte> value_ = make_value(5, 20000);
  int counter_ = 0;
};

// With the monitor gone, OSDs may still serve a client that has its maps: ops either succeed or
// fail in time with 82h; a new client cannot connect and says so within its connect timeout.
TEST_F(RadosClusterGoneTest, MonitorStopped) {
  Finally restore{[] {
    cluster("start-mon");
    cluster("wait-clean 120");
  }};
  ASSERT_EQ(cluster("stop-mon"), 0);
  for (int round = 0; round < 3; ++round) every_op_bounded(/*success_allowed=*/true);

  RadosBackendOptions o = opts_;
  o.connect_timeout_ms = 2000;
  const auto t0 = Clock::now();
  EXPECT_THROW(make_rados_backend(o).value(), std::runtime_error);
  EXPECT_LT(Clock::now() - t0, 10s);

  ASSERT_EQ(cluster("start-mon"), 0);
  works_again();
}

// Every daemon stopped with SIGSTOP: connections stay open and nothing answers, the case only a
// timeout can end. Every op fails with 82h within the timeout; after SIGCONT the same backend
// object serves again.
TEST_F(RadosClusterGoneTest, ClusterFrozen) {
  const double timeouts_before = metric(*backend_, "backend_timeouts_total");
  Finally restore{[] {
    cluster("thaw");
    cluster("wait-clean 120");
  }};
  ASSERT_EQ(cluster("freeze"), 0);
  EXPECT_EQ(every_op_bounded(/*success_allowed=*/false), 0);
  ASSERT_EQ(cluster("thaw"), 0);
  EXPECT_GE(metric(*backend_, "backend_timeouts_total"), timeouts_before + 4);
  works_again();
}

}  // namespace
}  // namespace gdkv::rados_test
