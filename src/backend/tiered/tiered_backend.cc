// The tiered backend (see gdkv/tiered_backend.h).
//
// Fills and overlapping writes: a Retrieve that goes to far records its key's write stripe (a
// count of writes in flight and a version bumped by each write) when it starts. Its fill is
// written into near only if no write was in flight then and none started since; and if one
// started while the fill was being written, the fill may have landed after that write's near copy,
// so the key is dropped from near again. A value missing from near is always correct (far has
// it), so every doubt drops the near copy.
#include "gdkv/tiered_backend.h"

#include "gdkv/backend_factory.h"

#include <array>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace gdkv {
namespace {

using nvme::Status;

// Statuses that say the request itself is bad: every tier would answer the same.
bool bad_request(Status s) {
  return s == Status::kInvalidField || s == Status::kInvalidKeySize ||
         s == Status::kInvalidNamespace || s == Status::kInvalidOpcode ||
         s == Status::kInvalidValueSize;
}

// A failed Store that left the backend's value as it was.
bool rejected_unchanged(Status s) {
  return bad_request(s) || s == Status::kKeyExists || s == Status::kKeyNotExist ||
         s == Status::kCapacityExceeded;
}

class TieredBackend final : public Backend {
 public:
  TieredBackend(std::shared_ptr<Backend> near, std::shared_ptr<Backend> far)
      : near_(std::move(near)), far_(std::move(far)) {
    far_->set_invalidation_handler(
        [this](uint32_t nsid, const Key& key) { invalidate(nsid, key); });
  }

  ~TieredBackend() override {
    far_->set_invalidation_handler(nullptr);  // waits for a call in progress
    {
      std::lock_guard lk(check_mu_);
      stop_check_ = true;
    }
    check_cv_.notify_all();
    if (checker_.joinable()) checker_.join();
    drain_own();
  }

  void set_invalidation_handler(InvalidationHandler h) override { upstream_.set(std::move(h)); }
  // Far is the authority: near's reclaim leaves the value in the store.
  void set_removal_handler(InvalidationHandler h) override {
    far_->set_removal_handler(std::move(h));
  }
  void prefetch(uint32_t nsid, std::span<const Key> keys) override { far_->prefetch(nsid, keys); }

  void submit(BackendOp* op) override {
    if (op->nsid < kNsBits) {  // the namespaces a lost-watch check has to look through
      auto& word = seen_ns_[op->nsid / 64];
      const uint64_t bit = uint64_t{1} << (op->nsid % 64);
      if ((word.load(std::memory_order_relaxed) & bit) == 0)
        word.fetch_or(bit, std::memory_order_relaxed);
    }
    route_op(
        op, *far_, [this](BackendOp* o) { get(o); }, [this](BackendOp* o) { write(o); },
        [this](BackendOp* o) { exists(o); });
  }

  BackendInfo info() const override {
    BackendInfo i = far_->info();
    const BackendInfo n = near_->info();
    i.name = "tiered(" + n.name + "+" + i.name + ")";
    i.segments = n.segments;
    return i;
  }

  void collect(MetricList& out) const override {
    near_->collect(out);
    far_->collect(out);
    MetricWriter w(out);
    auto c = [&](const char* name, const char* help, const std::atomic<uint64_t>& v) {
      w.counter(name, help, v);
    };
    c("tiered_near_hits_total", "Retrieves served by the near tier", n_.near_hits);
    c("tiered_far_reads_total", "Retrieves that went to the far tier", n_.far_reads);
    c("tiered_fills_total", "values the far tier returned that were written into the near tier",
      n_.fills);
    c("tiered_fills_skipped_total",
      "far reads not written into the near tier (a write overlapped, or the near write failed)",
      n_.fills_skipped);
    c("tiered_near_corrupt_total",
      "near copies that failed their integrity check (dropped and read from the far tier)",
      n_.corrupt);
    c("tiered_near_drops_total", "near copies deleted to keep the near tier no newer than far",
      n_.drops);
    c("tiered_remote_deletes_total", "near copies dropped because another node deleted the key",
      n_.remote_deletes);
    c("tiered_near_checks_total",
      "near keys checked against the far tier after its delete notifications were lost",
      n_.checked);
  }

  void drain() override {
    drain_own();
    near_->drain();
    far_->drain();
  }

 private:
  // ---- write stripes ----
  struct Stripe {
    std::atomic<uint32_t> writing{0};
    std::atomic<uint64_t> version{0};
  };
  static constexpr size_t kStripes = 4096;
  Stripe& stripe(const BackendOp* op) {
    return stripes_[NsKeyHash{}(NsKey{op->nsid, op->key}) % kStripes];
  }

  // An op of our own, kept until its backend is done with it.
  struct Own {
    TieredBackend* self;
    BackendOp op;
  };
  BackendOp* own(BackendOpKind kind, const BackendOp* like,
                 void (*done)(BackendOp*, Status, uint64_t)) {
    auto* o = new Own{this, {}};
    o->op.kind = kind;
    o->op.nsid = like->nsid;
    o->op.stream = like->stream;
    o->op.key = like->key;
    o->op.done = done;
    o->op.user = o;
    outstanding_.fetch_add(1, std::memory_order_relaxed);
    return &o->op;
  }
  static TieredBackend* release(BackendOp* op) {
    auto* o = static_cast<Own*>(op->user);
    TieredBackend* self = o->self;
    delete o;
    self->outstanding_.fetch_sub(1, std::memory_order_release);
    return self;
  }
  // Deletes the key from near, in the background.
  void drop_near(const BackendOp* like) {
    n_.drops.fetch_add(1, std::memory_order_relaxed);
    near_->submit(
        own(BackendOpKind::kDelete, like, [](BackendOp* op, Status, uint64_t) { release(op); }));
  }

  void drain_own() {
    while (outstanding_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
  }

  // ---- deletes by other nodes ----
  // A key another node deleted leaves near before the tiers above hear of it: the near Delete is
  // waited for (on far's notification thread), so a read the cache above makes after its own
  // invalidation cannot find the old copy in near and cache it again. A fill in flight for the
  // key is stopped by the stripe's version. nsid 0 (far lost its notifications for a while):
  // every near key of every namespace used is checked against far on a thread of ours, and those
  // far lacks are dropped.
  void invalidate(uint32_t nsid, const Key& key) {
    if (nsid != 0) {
      BackendOp d;
      d.kind = BackendOpKind::kDelete;
      d.nsid = nsid;
      d.key = key;
      stripe(&d).version.fetch_add(1, std::memory_order_acq_rel);
      n_.remote_deletes.fetch_add(1, std::memory_order_relaxed);
      n_.drops.fetch_add(1, std::memory_order_relaxed);
      call(*near_, d);
    } else {
      std::lock_guard lk(check_mu_);
      check_wanted_ = true;
      if (!checker_.joinable()) checker_ = std::thread([this] { run_checks(); });
      check_cv_.notify_all();
    }
    upstream_(nsid, key);
  }

  // One op on `b`, waited for: the checker's thread may block.
  static Status call(Backend& b, BackendOp& op) {
    struct Wait {
      std::mutex mu;
      std::condition_variable cv;
      bool done = false;
      Status s = Status::kSuccess;
    } w;
    op.user = &w;
    op.done = [](BackendOp* o, Status s, uint64_t) {
      auto* wt = static_cast<Wait*>(o->user);
      std::lock_guard lk(wt->mu);
      wt->s = s;
      wt->done = true;
      wt->cv.notify_all();
    };
    b.submit(&op);
    std::unique_lock lk(w.mu);
    w.cv.wait(lk, [&] { return w.done; });
    return w.s;
  }

  void run_checks() {
    std::unique_lock lk(check_mu_);
    while (true) {
      check_cv_.wait(lk, [this] { return stop_check_ || check_wanted_; });
      if (stop_check_) return;
      check_wanted_ = false;
      lk.unlock();
      for (uint32_t ns = 1; ns < kNsBits; ++ns) {
        if ((seen_ns_[ns / 64].load(std::memory_order_relaxed) >> (ns % 64) & 1) != 0) check(ns);
      }
      lk.lock();
    }
  }

  // Drops from near the keys of namespace `ns` far no longer has.
  void check(uint32_t ns) {
    Key from;  // empty: the first key
    while (true) {
      BackendOp list;
      list.kind = BackendOpKind::kList;
      list.nsid = ns;
      list.key = from;
      list.list_max = 1024;
      if (call(*near_, list) != Status::kSuccess || list.keys.empty()) return;
      for (const Key& k : list.keys) {
        {
          std::lock_guard lk(check_mu_);
          if (stop_check_) return;
        }
        BackendOp e;
        e.kind = BackendOpKind::kExists;
        e.nsid = ns;
        e.key = k;
        n_.checked.fetch_add(1, std::memory_order_relaxed);
        if (call(*far_, e) == Status::kKeyNotExist) {
          n_.remote_deletes.fetch_add(1, std::memory_order_relaxed);
          drop_near(&e);
        }
      }
      if (list.keys.size() < list.list_max) return;
      from = list.keys.back();  // List is inclusive: the next round starts after it
      if (!next_key(from)) return;
    }
  }

  // The smallest key greater than `k` in List order; false if there is none.
  static bool next_key(Key& k) {
    if (k.len < nvme::kMaxKeyLength) {
      k.bytes[k.len++] = 0;
      return true;
    }
    for (int i = k.len - 1; i >= 0; --i) {  // a full-length key: the next prefix up
      if (k.bytes[i] != 0xff) {
        ++k.bytes[i];
        k.len = static_cast<uint8_t>(i + 1);
        for (size_t j = static_cast<size_t>(i) + 1; j < nvme::kMaxKeyLength; ++j) k.bytes[j] = 0;
        return true;
      }
    }
    return false;
  }

  // ---- Retrieve ----
  struct Get {
    TieredBackend* self;
    BackendOp* req;
    BackendOp near;
    BackendOp far;
    BackendOp fill;
    std::shared_ptr<std::vector<std::byte>> buf;  // far's value when it used our sink
    ValueView value;                              // far's value, whichever way it came
    Stripe* stripe = nullptr;
    uint64_t version = 0;
    bool may_fill = false;
  };

  void get(BackendOp* op) {
    auto* g = new Get{this, op, {}, {}, {}, nullptr, {}, &stripe(op), 0, false};
    outstanding_.fetch_add(1, std::memory_order_relaxed);
    g->version = g->stripe->version.load(std::memory_order_acquire);
    g->may_fill = g->stripe->writing.load(std::memory_order_acquire) == 0;
    BackendOp& n = g->near;
    n.kind = BackendOpKind::kGet;
    n.nsid = op->nsid;
    n.stream = op->stream;
    n.key = op->key;
    // The requester's own sink: a near hit goes straight into its memory.
    n.sink = op->sink != nullptr ? &near_sink : nullptr;
    n.done = &near_done;
    n.user = g;
    near_->submit(&n);
  }
  static std::span<std::byte> near_sink(BackendOp* op, uint64_t len) {
    BackendOp* req = static_cast<Get*>(op->user)->req;
    return req->sink(req, len);
  }
  static void near_done(BackendOp* op, Status s, uint64_t len) {
    auto* g = static_cast<Get*>(op->user);
    TieredBackend* self = g->self;
    if (s == Status::kSuccess || bad_request(s)) {
      if (s == Status::kSuccess) self->n_.near_hits.fetch_add(1, std::memory_order_relaxed);
      g->req->view = std::move(op->view);
      BackendOp* req = g->req;
      self->finish(g);
      return req->complete(s, s == Status::kSuccess ? len : 0);
    }
    if (s == Status::kUnrecoveredError) {
      // A near copy that failed its check: never returned, dropped, read from far.
      self->n_.corrupt.fetch_add(1, std::memory_order_relaxed);
      self->drop_near(g->req);
      g->may_fill = false;  // the drop and a fill could land in either order
    }
    self->n_.far_reads.fetch_add(1, std::memory_order_relaxed);
    BackendOp& f = g->far;
    f.kind = BackendOpKind::kGet;
    f.nsid = g->req->nsid;
    f.stream = g->req->stream;
    f.key = g->req->key;
    f.sink = &far_sink;
    f.done = &far_done;
    f.user = g;
    self->far_->submit(&f);
  }
  static std::span<std::byte> far_sink(BackendOp* op, uint64_t len) {
    auto* g = static_cast<Get*>(op->user);
    g->buf = std::make_shared<std::vector<std::byte>>(len);
    return {g->buf->data(), g->buf->size()};
  }
  static void far_done(BackendOp* op, Status s, uint64_t len) {
    auto* g = static_cast<Get*>(op->user);
    TieredBackend* self = g->self;
    BackendOp* req = g->req;
    if (s != Status::kSuccess) {
      self->finish(g);
      return req->complete(s, 0);
    }
    if (op->view.bytes.data() != nullptr || op->view.keepalive) {
      g->value = std::move(op->view);
    } else if (g->buf) {
      g->value = ValueView{{g->buf->data(), g->buf->size()}, g->buf};
    } else if (len != 0) {
      self->finish(g);
      return req->complete(Status::kUnrecoveredError, 0);  // the value came neither way
    }
    req->view = g->value;  // the requester copies out of our buffer, which it keeps alive
    const bool fill = g->may_fill && g->stripe->writing.load(std::memory_order_acquire) == 0 &&
                      g->stripe->version.load(std::memory_order_acquire) == g->version;
    if (!fill) self->n_.fills_skipped.fetch_add(1, std::memory_order_relaxed);
    if (fill) {
      BackendOp& w = g->fill;
      w.kind = BackendOpKind::kPut;
      w.nsid = req->nsid;
      w.stream = req->stream;
      w.key = req->key;
      w.value = g->value.bytes;
      w.done = &fill_done;
      w.user = g;
      req->complete(Status::kSuccess, len);  // the fill is ours; the requester need not wait
      return self->near_->submit(&w);
    }
    self->finish(g);
    req->complete(Status::kSuccess, len);
  }
  static void fill_done(BackendOp* op, Status s, uint64_t) {
    auto* g = static_cast<Get*>(op->user);
    TieredBackend* self = g->self;
    if (s == Status::kSuccess) {
      self->n_.fills.fetch_add(1, std::memory_order_relaxed);
      // A write that started meanwhile may have put its value into near before this landed.
      if (g->stripe->version.load(std::memory_order_acquire) != g->version)
        self->drop_near(&g->fill);
    } else {
      self->n_.fills_skipped.fetch_add(1, std::memory_order_relaxed);
    }
    self->finish(g);
  }
  void finish(Get* g) {
    delete g;
    outstanding_.fetch_sub(1, std::memory_order_release);
  }

  // ---- Store and Delete ----
  struct Write {
    TieredBackend* self;
    BackendOp* req;
    BackendOp far;
    BackendOp near;
    Stripe* stripe;
    Status far_status = Status::kSuccess;
  };

  void write(BackendOp* op) {
    auto* w = new Write{this, op, {}, {}, &stripe(op)};
    outstanding_.fetch_add(1, std::memory_order_relaxed);
    w->stripe->writing.fetch_add(1, std::memory_order_acq_rel);
    w->stripe->version.fetch_add(1, std::memory_order_acq_rel);
    BackendOp& f = w->far;
    f.kind = op->kind;
    f.nsid = op->nsid;
    f.stream = op->stream;
    f.key = op->key;
    f.store_options = op->store_options;
    f.value = op->value;
    f.done = &write_far_done;
    f.user = w;
    far_->submit(&f);
  }
  static void write_far_done(BackendOp* op, Status s, uint64_t) {
    auto* w = static_cast<Write*>(op->user);
    w->far_status = s;
    const bool put = w->req->kind == BackendOpKind::kPut;
    if (put && s != Status::kSuccess && rejected_unchanged(s)) return w->self->end_write(w);
    // A Store far took goes to near too; a Delete (whatever far said), and a Store far failed
    // in a way that may have changed its value, remove the near copy.
    BackendOp& n = w->near;
    n.kind = put && s == Status::kSuccess ? BackendOpKind::kPut : BackendOpKind::kDelete;
    n.nsid = w->req->nsid;
    n.stream = w->req->stream;
    n.key = w->req->key;
    n.value = n.kind == BackendOpKind::kPut ? w->req->value : std::span<const std::byte>{};
    n.done = &write_near_done;
    n.user = w;
    w->self->near_->submit(&n);
  }
  static void write_near_done(BackendOp* op, Status s, uint64_t) {
    auto* w = static_cast<Write*>(op->user);
    // A near copy that could not be written must not stay older than far's.
    if (op->kind == BackendOpKind::kPut && s != Status::kSuccess) w->self->drop_near(w->req);
    w->self->end_write(w);
  }
  void end_write(Write* w) {
    w->stripe->version.fetch_add(1, std::memory_order_acq_rel);
    w->stripe->writing.fetch_sub(1, std::memory_order_acq_rel);
    BackendOp* req = w->req;
    const Status s = w->far_status;
    delete w;
    outstanding_.fetch_sub(1, std::memory_order_release);
    req->complete(s);
  }

  // ---- Exist ----
  struct Exist {
    TieredBackend* self;
    BackendOp* req;
    BackendOp near;
  };
  void exists(BackendOp* op) {
    auto* e = new Exist{this, op, {}};
    outstanding_.fetch_add(1, std::memory_order_relaxed);
    e->near.kind = BackendOpKind::kExists;
    e->near.nsid = op->nsid;
    e->near.stream = op->stream;
    e->near.key = op->key;
    e->near.done = [](BackendOp* o, Status s, uint64_t) {
      auto* ex = static_cast<Exist*>(o->user);
      TieredBackend* self = ex->self;
      BackendOp* req = ex->req;
      delete ex;
      self->outstanding_.fetch_sub(1, std::memory_order_release);
      if (s == Status::kSuccess || bad_request(s)) return req->complete(s);
      self->far_->submit(req);
    };
    e->near.user = e;
    near_->submit(&e->near);
  }

  struct Counters {
    std::atomic<uint64_t> near_hits{0}, far_reads{0}, fills{0}, fills_skipped{0}, corrupt{0},
        drops{0}, remote_deletes{0}, checked{0};
  };

  std::shared_ptr<Backend> near_, far_;
  InvalidationHook upstream_;
  static constexpr uint32_t kNsBits = 1024;
  std::array<std::atomic<uint64_t>, kNsBits / 64> seen_ns_{};
  std::mutex check_mu_;
  std::condition_variable check_cv_;
  bool check_wanted_ = false;
  bool stop_check_ = false;
  std::thread checker_;
  std::array<Stripe, kStripes> stripes_;
  Counters n_;
  std::atomic<uint64_t> outstanding_{0};  // our own ops and requests not finished
};

}  // namespace

Result<std::shared_ptr<Backend>> make_tiered_backend(std::shared_ptr<Backend> near,
                                                     std::shared_ptr<Backend> far) {
  if (!near || !far) return Error{"tiered backend needs a near and a far backend"};
  return std::shared_ptr<Backend>(std::make_shared<TieredBackend>(std::move(near), std::move(far)));
}

}  // namespace gdkv

// ---- registration (gdkv/backend_registry.h) ----

void gdkv_register_backend_tiered(std::vector<gdkv::BackendRegistration>& registry) {
  using C = gdkv::BackendConfig;
  gdkv::BackendRegistration b;
  b.name = "tiered";
  b.help = "the local store in front of a far tier (rados)";
  b.traits.can_time_out = true;
  b.traits.needs_directory = true;
  b.traits.has_far_tier = true;
  b.directory_setting = "store";
  b.open = [](const C& c) -> gdkv::Result<std::shared_ptr<gdkv::Backend>> {
    const gdkv::BackendRegistration* far = gdkv::find_backend(c.tiered_far);
    if (far == nullptr || !far->traits.can_be_far_tier) {
      return gdkv::Error{"tiered: '" + c.tiered_far + "' cannot be a far tier"};
    }
    C near_config = c;
    near_config.kind = "local";
    auto near = gdkv::open_backend(near_config);
    if (!near) return gdkv::Error{near.error()};
    auto f = far->open(c);
    if (!f) return gdkv::Error{f.error()};
    return gdkv::make_tiered_backend(std::move(*near), std::move(*f));
  };
  registry.push_back(std::move(b));
}
