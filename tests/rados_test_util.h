// Helpers for the rados backend tests: synchronous wrappers over the asynchronous Backend API, the
// cluster's config from $GDKV_CEPH_CONF, test values, and a namespace prefix nobody else uses.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/rados_backend.h"

namespace gdkv::rados_test {

using nvme::Status;
using Clock = std::chrono::steady_clock;

inline const char* ceph_conf() {
  const char* c = std::getenv("GDKV_CEPH_CONF");
  return (c != nullptr && *c != '\0') ? c : nullptr;
}

#define GDKV_REQUIRE_CEPH()                                                      \
  do {                                                                           \
    if (::gdkv::rados_test::ceph_conf() == nullptr) {                            \
      GTEST_SKIP() << "no Ceph cluster: set GDKV_CEPH_CONF (scripts/test does)"; \
    }                                                                            \
  } while (0)

// "t<pid>-<random>-": each backend a test opens gets namespaces of its own, so runs and parallel
// tests never see each other's objects.
inline std::string unique_prefix() {
  static std::mt19937_64 rng{std::random_device{}()};
  static std::mutex mu;
  std::lock_guard lk(mu);
  return "t" + std::to_string(::getpid()) + "-" + std::to_string(rng() % 1000000000) + "-ns";
}

inline RadosBackendOptions options_for(const std::string& pool) {
  RadosBackendOptions o;
  o.ceph_conf = ceph_conf();
  o.pool = pool;
  o.namespace_prefix = unique_prefix();
  return o;
}

// Deterministic bytes for (seed, size): a wrong or stale value never compares equal.
inline std::vector<std::byte> make_value(uint64_t seed, size_t size) {
  std::vector<std::byte> v(size);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + size + 1;
  for (size_t i = 0; i < size; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v[i] = static_cast<std::byte>(x);
  }
  return v;
}

inline Key key_of(const std::string& s) { return *Key::from_string(s); }

// A key of `len` random bytes.
inline Key random_key(std::mt19937_64& rng, size_t len = 16) {
  uint8_t b[16];
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return Key::from_bytes(b, len);
}

struct Result {
  Status status = Status::kInternalError;
  uint64_t len = 0;
  std::vector<std::byte> data;  // what the sink received (or the view held)
  std::vector<Key> keys;
  bool sink_called = false;
  bool completed = false;
  std::chrono::milliseconds elapsed{0};
};

// One op and what it needs until done() is called.
struct SyncOp {
  BackendOp op;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Result r;
  size_t sink_limit = SIZE_MAX;  // sink returns at most this many bytes
  std::vector<std::byte> buf;

  static std::span<std::byte> sink(BackendOp* op, uint64_t len) {
    auto* s = static_cast<SyncOp*>(op->user);
    s->r.sink_called = true;
    s->buf.assign(std::min<uint64_t>(len, s->sink_limit), std::byte{0});
    return s->buf;
  }
  static void on_done(BackendOp* op, Status st, uint64_t len) {
    auto* s = static_cast<SyncOp*>(op->user);
    std::lock_guard lk(s->mu);
    s->r.status = st;
    s->r.len = len;
    s->done = true;
    s->cv.notify_all();
  }
};

// Runs `op` to completion (waits at most `limit`); fills the result.
inline Result run(Backend& b, SyncOp& s,
                  std::chrono::milliseconds limit = std::chrono::seconds(30)) {
  s.op.user = &s;
  s.op.done = &SyncOp::on_done;
  const auto t0 = Clock::now();
  b.submit(&s.op);
  std::unique_lock lk(s.mu);
  s.r.completed = s.cv.wait_for(lk, limit, [&] { return s.done; });
  s.r.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  if (!s.r.completed) {
    ADD_FAILURE() << "op did not complete within " << limit.count() << " ms";
    return s.r;  // the op still belongs to the backend: the caller must not free it
  }
  if (s.op.sink == nullptr && s.op.view.bytes.data() != nullptr) {
    s.buf.assign(s.op.view.bytes.begin(), s.op.view.bytes.end());
  }
  s.r.data = s.buf;
  s.r.keys = s.op.keys;
  return s.r;
}

// Synchronous calls on a backend, namespace `nsid`.
class Sync {
 public:
  explicit Sync(std::shared_ptr<Backend> b) : b_(std::move(b)) {}
  Backend& backend() { return *b_; }

  Result put(const Key& k, std::span<const std::byte> v, uint8_t opts = 0, uint32_t nsid = 1) {
    auto s = std::make_unique<SyncOp>();
    s->op.kind = BackendOpKind::kPut;
    s->op.key = k;
    s->op.value = v;
    s->op.store_options = opts;
    s->op.nsid = nsid;
    return finish(std::move(s));
  }
  // With `use_sink` false the backend must hand out a view.
  Result get(const Key& k, uint32_t nsid = 1, size_t sink_limit = SIZE_MAX, bool use_sink = true) {
    auto s = std::make_unique<SyncOp>();
    s->op.kind = BackendOpKind::kGet;
    s->op.key = k;
    s->op.nsid = nsid;
    s->sink_limit = sink_limit;
    if (use_sink) s->op.sink = &SyncOp::sink;
    return finish(std::move(s));
  }
  Result del(const Key& k, uint32_t nsid = 1) { return simple(BackendOpKind::kDelete, k, nsid); }
  Result exists(const Key& k, uint32_t nsid = 1) { return simple(BackendOpKind::kExists, k, nsid); }
  Result list(const Key& from, uint32_t max, uint32_t nsid = 1) {
    auto s = std::make_unique<SyncOp>();
    s->op.kind = BackendOpKind::kList;
    s->op.key = from;
    s->op.list_max = max;
    s->op.nsid = nsid;
    return finish(std::move(s));
  }
  Result simple(BackendOpKind kind, const Key& k, uint32_t nsid = 1) {
    auto s = std::make_unique<SyncOp>();
    s->op.kind = kind;
    s->op.key = k;
    s->op.nsid = nsid;
    return finish(std::move(s));
  }

  std::chrono::milliseconds limit{30000};

 private:
  Result finish(std::unique_ptr<SyncOp> s) {
    Result r = run(*b_, *s, limit);
    if (!r.completed) (void)s.release();  // still the backend's: leak it, never free it under it
    return r;
  }
  std::shared_ptr<Backend> b_;
};

inline double metric(const Backend& b, const std::string& name) {
  MetricList m;
  b.collect(m);
  double v = 0;
  for (const auto& x : m) {
    if (x.name == name) v += x.value;
  }
  return v;
}

inline std::string hexdump_status(Status s) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%s (%02xh)", nvme::status_name(s), static_cast<unsigned>(s));
  return buf;
}

}  // namespace gdkv::rados_test
