// Test helpers for the cache: a backend wrapper that counts ops and can hold them back (to force
// an interleaving), a synchronous op, and metric lookup.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gdkv/backend.h"

namespace gdkv::test {

inline std::vector<std::byte> bytes_of(const std::string& s) {
  std::vector<std::byte> v(s.size());
  if (!s.empty()) std::memcpy(v.data(), s.data(), s.size());  // an empty vector's data() is null
  return v;
}

inline std::string string_of(std::span<const std::byte> b) {
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

// One backend op, submitted and waited for.
struct SyncOp {
  BackendOp op;
  std::vector<std::byte> sink_buf;
  std::vector<std::byte> value_buf;
  std::atomic<bool> done{false};
  nvme::Status status = nvme::Status::kSuccess;
  uint64_t len = 0;

  SyncOp(BackendOpKind kind, const Key& key, std::span<const std::byte> value = {}) {
    op.kind = kind;
    op.key = key;
    value_buf.assign(value.begin(), value.end());
    op.value = value_buf;
    op.sink = &sink;
    op.done = &on_done;
    op.user = this;
  }
  void submit(Backend& b) { b.submit(&op); }
  bool wait(std::chrono::milliseconds limit = std::chrono::milliseconds(10000)) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (!done.load(std::memory_order_acquire)) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::yield();
    }
    return true;
  }
  nvme::Status run(Backend& b) {
    submit(b);
    EXPECT_TRUE(wait());
    return status;
  }
  // The value a get returned.
  std::string value() const {
    if (op.view.bytes.data() != nullptr || op.view.keepalive) {
      return string_of(op.view.bytes.subspan(0, std::min<size_t>(len, op.view.bytes.size())));
    }
    return string_of(std::span(sink_buf).subspan(0, std::min<size_t>(len, sink_buf.size())));
  }

  static std::span<std::byte> sink(BackendOp* op, uint64_t len) {
    auto* self = static_cast<SyncOp*>(op->user);
    self->sink_buf.resize(len);
    return self->sink_buf;
  }
  static void on_done(BackendOp* op, nvme::Status s, uint64_t len) {
    auto* self = static_cast<SyncOp*>(op->user);
    self->status = s;
    self->len = len;
    self->done.store(true, std::memory_order_release);
  }
};

inline nvme::Status put(Backend& b, const Key& k, const std::string& v, uint8_t options = 0) {
  SyncOp op(BackendOpKind::kPut, k, bytes_of(v));
  op.op.store_options = options;
  return op.run(b);
}

// A Store and a Retrieve in backend namespace `nsid`; get_in returns "" unless it succeeded.
inline nvme::Status put_in(Backend& b, uint32_t nsid, const Key& k, const std::string& v,
                           uint8_t options = 0) {
  SyncOp op(BackendOpKind::kPut, k, bytes_of(v));
  op.op.nsid = nsid;
  op.op.store_options = options;
  return op.run(b);
}
inline std::string get_in(Backend& b, uint32_t nsid, const Key& k, nvme::Status* s = nullptr) {
  SyncOp op(BackendOpKind::kGet, k);
  op.op.nsid = nsid;
  const nvme::Status st = op.run(b);
  if (s != nullptr) *s = st;
  return st == nvme::Status::kSuccess ? op.value() : std::string();
}

// Counts the ops that reach the inner backend; can hold ops of a kind before they reach it
// (hold_submit) or hold their completions (hold_done) until released.
class GateBackend final : public Backend {
 public:
  explicit GateBackend(std::shared_ptr<Backend> inner) : inner_(std::move(inner)) {}

  void submit(BackendOp* op) override {
    const auto k = static_cast<size_t>(op->kind);
    counts_[k].fetch_add(1);
    {
      std::lock_guard lk(mu_);
      if (hold_submit_[k]) {
        held_submits_.push_back(op);
        return;
      }
    }
    forward(op);
  }
  BackendInfo info() const override { return inner_->info(); }
  void collect(MetricList& out) const override { inner_->collect(out); }
  void drain() override { inner_->drain(); }

  // Plays a shared backend: keeps the handler a cache or tier registers; fire() calls it as a
  // delete notification from another node would.
  void set_invalidation_handler(InvalidationHandler h) override { hook_.set(std::move(h)); }
  void fire(uint32_t nsid, const Key& k) { hook_(nsid, k); }
  bool has_handler() const { return !hook_.empty(); }
  // A decorator: removals are the inner backend's. forward_removals(false) before a cache is
  // put on top hides them, so deletes behind the cache's back reach it only through fire().
  void set_removal_handler(InvalidationHandler h) override {
    if (forward_removals_) inner_->set_removal_handler(std::move(h));
  }
  void forward_removals(bool on) { forward_removals_ = on; }

  uint64_t count(BackendOpKind k) const { return counts_[static_cast<size_t>(k)].load(); }
  void hold_submit(BackendOpKind k, bool on) {
    std::lock_guard lk(mu_);
    hold_submit_[static_cast<size_t>(k)] = on;
  }
  void hold_done(BackendOpKind k, bool on) {
    std::lock_guard lk(mu_);
    hold_done_[static_cast<size_t>(k)] = on;
  }
  size_t held_dones() {
    std::lock_guard lk(mu_);
    return parked_.size();
  }
  // Passes held submissions of kind k on to the inner backend, oldest first.
  void release_submits(BackendOpKind k) {
    std::vector<BackendOp*> go;
    {
      std::lock_guard lk(mu_);
      for (auto it = held_submits_.begin(); it != held_submits_.end();) {
        if ((*it)->kind == k) {
          go.push_back(*it);
          it = held_submits_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (BackendOp* op : go) forward(op);
  }
  // Completes the held completion number `i` (in the order they were held).
  void release_done(size_t i) {
    Parked p;
    {
      std::lock_guard lk(mu_);
      ASSERT_LT(i, parked_.size());
      p = parked_[i];
      parked_.erase(parked_.begin() + static_cast<std::ptrdiff_t>(i));
    }
    p.op->done = p.done;
    p.op->user = p.user;
    p.op->complete(p.status, p.len);
  }
  void release_all_dones() {
    while (held_dones() > 0) release_done(0);
  }

 private:
  bool forward_removals_ = true;
  struct Parked {
    BackendOp* op = nullptr;
    void (*done)(BackendOp*, nvme::Status, uint64_t) = nullptr;
    void* user = nullptr;
    nvme::Status status = nvme::Status::kSuccess;
    uint64_t len = 0;
  };
  struct Ctx {
    GateBackend* self;
    void (*done)(BackendOp*, nvme::Status, uint64_t);
    void* user;
    std::span<std::byte> (*sink)(BackendOp*, uint64_t);
  };

  InvalidationHook hook_;

  void forward(BackendOp* op) {
    bool hold;
    {
      std::lock_guard lk(mu_);
      hold = hold_done_[static_cast<size_t>(op->kind)];
    }
    if (hold) {
      auto* ctx = new Ctx{this, op->done, op->user, op->sink};
      op->done = &park;
      op->user = ctx;
      if (op->sink != nullptr) op->sink = &sink_through;
    }
    inner_->submit(op);
  }
  // The op's own sink, called with the op's own user.
  static std::span<std::byte> sink_through(BackendOp* op, uint64_t len) {
    auto* ctx = static_cast<Ctx*>(op->user);
    op->user = ctx->user;
    std::span<std::byte> out = ctx->sink(op, len);
    op->user = ctx;
    return out;
  }
  static void park(BackendOp* op, nvme::Status s, uint64_t len) {
    auto* ctx = static_cast<Ctx*>(op->user);
    GateBackend* self = ctx->self;
    Parked p{op, ctx->done, ctx->user, s, len};
    op->sink = ctx->sink;
    op->user = ctx->user;
    delete ctx;
    std::lock_guard lk(self->mu_);
    self->parked_.push_back(p);
  }

  std::shared_ptr<Backend> inner_;
  std::atomic<uint64_t> counts_[8] = {};
  std::mutex mu_;
  bool hold_submit_[8] = {};
  bool hold_done_[8] = {};
  std::vector<BackendOp*> held_submits_;
  std::vector<Parked> parked_;
};

// The value of the sample `name` whose labels include `label` (k=v), or -1.
inline double metric(const MetricList& ms, const std::string& name, const std::string& label = "") {
  for (const Metric& m : ms) {
    if (m.name != name) continue;
    if (label.empty()) return m.value;
    for (const auto& [k, v] : m.labels) {
      if (k + "=" + v == label) return m.value;
    }
  }
  return -1;
}

inline double metric(const Backend& b, const std::string& name, const std::string& label = "") {
  MetricList ms;
  b.collect(ms);
  return metric(ms, name, label);
}

// The quota tests' keys and values: "<tag><i, 4 digits>" (5 bytes), and `n` bytes that differ for
// every (tag, i), so byte-exact checks mean something.
inline Key nkey(char tag, int i) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%c%04d", tag, i % 10000);
  return *Key::from_string(buf);
}
inline std::string nvalue(char tag, int i, size_t n = 1024) {
  std::string v(n, '\0');
  uint32_t x = static_cast<uint32_t>(tag) * 2654435761u ^ static_cast<uint32_t>(i) * 40503u;
  for (char& c : v) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<char>(x >> 24);
  }
  return v;
}

// The per-namespace sample `name` (namespace_held_bytes, namespace_evictions_total) of backend
// namespace `nsid` in `tier` ("memory", "cache"), or -1.
inline double ns_metric(const Backend& b, const std::string& name, uint32_t nsid,
                        const std::string& tier) {
  MetricList ms;
  b.collect(ms);
  for (const Metric& m : ms) {
    if (m.name != name) continue;
    bool ns = false, t = false;
    for (const auto& [k, v] : m.labels) {
      ns = ns || (k == "namespace" && v == std::to_string(nsid));
      t = t || (k == "tier" && v == tier);
    }
    if (ns && t) return m.value;
  }
  return -1;
}

// Polls `pred` for up to `limit`.
template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = std::chrono::milliseconds(10000)) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

}  // namespace gdkv::test
