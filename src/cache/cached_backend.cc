// The cache decorator (see gdkv/cache.h).
//
// One mutex guards the entries, the policy, the in-flight reads ("flights"), the in-flight writes
// and the prefetcher (prefetcher.h: chain learning and the prefetch queue). Critical sections are
// hash and tree operations only: no I/O, no value copies, and never a call into the inner backend
// or an op's completion, because the inner backend may complete inline inside submit() (the memory
// backend does) and a completion may submit again.
//
// Consistency rules (why an older value is never served after a newer Store was acknowledged):
//   1. A write (Store or Delete) detaches the key's flight when it starts and when it completes:
//      later misses start a new backend read instead of joining one that may return the old value.
//      Requests that joined before the write started may return the old value; they overlapped it.
//   2. A flight inserts its value only if it is still attached when it completes and no write to
//      the key was in flight when it started: a read racing a write may return either value.
//   3. A completed Store caches its value only if no other write to the key overlapped it (the
//      backend's order of overlapping writes is not known here); otherwise the key is dropped and
//      the next read asks the backend. A failed write drops the key too, unless the status says the
//      backend rejected it unchanged (e.g. 89h key exists). A Delete always drops it.
// A Store's completion is passed on only after rule 3 has updated the cache.
//
// Eviction groups (quotas, gdkv/cache.h): the namespaces without a quota share one group, each
// namespace with a quota has its own. A group is a policy instance (sized by the capacity, or by
// the quota) for its ordinary entries and a list of its low-priority ones (Stores with
// nvme::kStoreLowPriority not read since), which go first, oldest first; a hit moves such an
// entry into the policy as a demand add.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cache/policy.h"
#include "cache/prefetcher.h"
#include "cache/slab.h"
#include "common/clock.h"
#include "gdkv/cache.h"

namespace gdkv {
namespace {

using cache::AddKind;
using cache::Buffer;
using cache::SlabAllocator;
using nvme::Status;

// The eviction policy of a group of `capacity_bytes` (the cache's, or a namespace's quota).
using PolicyFactory = std::function<std::unique_ptr<cache::HintedPolicy>(uint64_t capacity_bytes)>;

// A Store that failed with one of these left the backend's value as it was.
bool rejected_unchanged(Status s) {
  switch (s) {
    case Status::kKeyExists:
    case Status::kKeyNotExist:
    case Status::kCapacityExceeded:
    case Status::kInvalidValueSize:
    case Status::kInvalidKeySize:
    case Status::kInvalidField:
    case Status::kInvalidNamespace:
    case Status::kInvalidOpcode:
      return true;
    default:
      return false;
  }
}

class CachedBackend final : public Backend {
 public:
  CachedBackend(std::shared_ptr<Backend> inner, const CacheOptions& o,
                const PolicyFactory& make_policy)
      : inner_(std::move(inner)),
        capacity_(o.capacity_bytes),
        policy_name_(o.policy),
        slab_(SlabAllocator::create(o.alloc, o.free, o.slab_page_bytes, arena_step(o))),
        shared_(make_policy(o.capacity_bytes)),
        prefetch_(o, shared_.policy->uses_chains()) {
    uint64_t sum = 0;
    for (const auto& [nsid, quota] : o.quotas) {
      Group& g = groups_.try_emplace(nsid, make_policy(std::min(quota, capacity_))).first->second;
      g.limited = true;
      g.quota = quota;
      sum = quota > UINT64_MAX - sum ? UINT64_MAX : sum + quota;
      if (NsStat* st = stat(nsid)) st->limited = true;
    }
    quotas_fit_ = sum <= capacity_;
    inner_->set_invalidation_handler(
        [this](uint32_t nsid, const Key& key) { invalidate(nsid, key); });
    inner_->set_removal_handler([this](uint32_t nsid, const Key& key) { removed(nsid, key); });
  }

  ~CachedBackend() override {
    inner_->set_invalidation_handler(nullptr);  // waits for a call in progress
    inner_->set_removal_handler(nullptr);
    {
      std::lock_guard lk(mu_);
      prefetch_.clear_queue();
    }
    drain();
  }

  void submit(BackendOp* op) override {
    if (!op->key.valid()) return inner_->submit(op);
    route_op(
        op, *inner_, [this](BackendOp* o) { get(o); }, [this](BackendOp* o) { write(o); },
        [this](BackendOp* o) { exists(o); });
  }

  BackendInfo info() const override { return inner_->info(); }

  void set_invalidation_handler(InvalidationHandler h) override { upstream_.set(std::move(h)); }
  // The store is below: a cached copy that goes is not a removal; a key the store removed
  // leaves the cache too (removed()) and is passed on.
  void set_removal_handler(InvalidationHandler h) override { removals_.set(std::move(h)); }

  void collect(MetricList& out) const override {
    MetricWriter w(out);
    auto add = [&](const char* name, const char* help, MetricType type, double v,
                   MetricLabels labels = {}) { w.add(name, help, type, v, std::move(labels)); };
    constexpr auto kC = MetricType::kCounter;
    constexpr auto kG = MetricType::kGauge;
    {
      std::lock_guard lk(mu_);
      const Counters& c = n_;
      auto d = [](uint64_t v) { return static_cast<double>(v); };
      add("cache_info", "host cache configuration", kG, 1, {{"policy", policy_name_}});
      add("cache_hits_total", "reads served from the host cache", kC, d(c.hits));
      add("cache_misses_total", "reads that needed the backend (joined reads included)", kC,
          d(c.misses));
      add("cache_hit_ratio", "hits / (hits + misses) since start", kG,
          c.hits + c.misses ? d(c.hits) / d(c.hits + c.misses) : 0.0);
      add("cache_single_flight_merges_total", "misses that joined a backend read already running",
          kC, d(c.merges));
      add("cache_fills_total", "values read from the backend and cached", kC, d(c.fills));
      add("cache_direct_reads_total",
          "misses too large to cache, read straight into the requester's memory", kC, d(c.direct));
      add("cache_write_fills_total", "stored values cached on their way to the backend", kC,
          d(c.write_fills));
      add("cache_write_copy_bytes_total",
          "Store bytes copied into the slab (once, before the backend gets them)", kC,
          d(write_copy_bytes_.load(std::memory_order_relaxed)));
      add("cache_evictions_total", "entries evicted to make room", kC, d(c.evictions));
      add("cache_invalidations_total", "entries dropped by a write or delete", kC,
          d(c.invalidations));
      add("cache_remote_invalidations_total",
          "deletes by other nodes seen (each drops the key; a lost watch drops everything)", kC,
          d(c.remote_invalidations));
      add("cache_exists_hits_total", "Exist commands answered from the cache", kC,
          d(c.exists_hits));
      add("cache_bytes", "value bytes cached", kG, d(bytes_));
      add("cache_capacity_bytes", "value bytes the cache may hold", kG, d(capacity_));
      add("cache_entries", "values cached", kG, d(entries_.size()));
      add("cache_slab_reserved_bytes", "slab memory held (pages)", kG, d(slab_->reserved_bytes()));
      add("cache_slab_chunk_bytes", "slab memory in chunks handed out", kG,
          d(slab_->chunk_bytes()));
      add("cache_slab_arena_bytes", "slab memory prepared (arena regions, faulted in)", kG,
          d(slab_->arena_bytes()));
      add("cache_slab_arena_growths_total", "arena regions allocated for the slab", kC,
          d(slab_->arena_growths()));
      prefetch_.collect(w);
      shared_.policy->collect(out);  // the quota groups' policies report nothing of their own
      for (uint32_t nsid = 0; nsid < ns_.size(); ++nsid) {
        const NsStat& st = ns_[nsid];
        if (!st.used && !st.limited) continue;
        add_namespace_metrics(out, "cache", nsid, d(st.held), d(st.evictions));
      }
    }
    inner_->collect(out);
  }

  void drain() override {
    for (;;) {
      inner_->drain();
      if (outstanding_.load(std::memory_order_acquire) == 0) break;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  struct Entry {
    std::shared_ptr<Buffer> buf;
    bool prefetched = false;  // added by a prefetch and not read yet
    bool low = false;         // in its group's low list, not its policy
    std::list<NsKey>::iterator low_at;
  };
  // Entries evicted together (see the top of the file).
  struct Group {
    explicit Group(std::unique_ptr<cache::HintedPolicy> p) : policy(std::move(p)) {}
    std::unique_ptr<cache::HintedPolicy> policy;  // the ordinary entries
    std::list<NsKey> low;                         // low-priority entries, newest first
    uint64_t bytes = 0;
    bool limited = false;
    uint64_t quota = 0;  // limited: the most `bytes` may be
  };
  struct NsStat {
    uint64_t held = 0;
    uint64_t evictions = 0;
    bool used = false;     // has held a value
    bool limited = false;  // has a quota
  };
  struct Flight {
    CachedBackend* self = nullptr;
    NsKey key;
    BackendOp op;
    std::vector<BackendOp*> waiters;
    std::shared_ptr<Buffer> buf;  // filled through the sink
    bool attached = true;         // flights_ points here: misses on the key join it
    bool insertable = true;       // no write was in flight when it started
    bool prefetch = false;
    bool used = false;     // a demand read joined this prefetch
    bool chained = false;  // the read followed its chain predecessor `pred` on its stream
    NsKey pred;
    // A value the cache will not keep (larger than the cache) read by one request: the backend
    // writes it through that request's own sink, with no slab buffer and no copy.
    BackendOp* direct = nullptr;
  };
  struct WriteState {
    uint32_t count = 0;       // writes in flight
    bool overlapped = false;  // two were in flight at once since count was last 0
  };
  struct WriteCtx {
    CachedBackend* self;
    NsKey key;
    void (*done)(BackendOp*, Status, uint64_t);
    void* user;
    bool chained = false;  // a Store that followed its chain predecessor `pred` on its stream
    NsKey pred;
    bool low = false;  // stored with nvme::kStoreLowPriority
    // A Store's value copied into the slab before it went to the backend (the backend was handed
    // these bytes and may keep them by reference), and the caller's bytes it replaced in the op.
    std::shared_ptr<Buffer> buf;
    std::span<const std::byte> caller_value;
    std::shared_ptr<const void> caller_owner;
  };
  struct Counters {
    uint64_t hits = 0, misses = 0, merges = 0, fills = 0, write_fills = 0, evictions = 0,
             invalidations = 0, exists_hits = 0, direct = 0, remote_invalidations = 0;
  };
  // Prefetch reads started under mu_, submitted by start() once it is released; the prefetcher
  // sees the cache through it (REQUIRES: mu_ held for holds() and start_prefetch()).
  class Launch final : public cache::PrefetchHost {
   public:
    explicit Launch(CachedBackend& cache) : cache_(cache) {}
    bool holds(const NsKey& key) const override {
      return cache_.entries_.contains(key) || cache_.flights_.contains(key);
    }
    void start_prefetch(const NsKey& key) override {
      flights.push_back(cache_.start_flight(key, true, 0));
    }
    std::vector<Flight*> flights;

   private:
    CachedBackend& cache_;
  };

  static uint64_t stream_id(const BackendOp* op) { return uint64_t{op->nsid} << 32 | op->stream; }

  // ---- reads ----

  void get(BackendOp* op) {
    const NsKey key{op->nsid, op->key};
    std::shared_ptr<Buffer> hit;
    Flight* miss = nullptr;
    Launch launch(*this);
    {
      std::lock_guard lk(mu_);
      NsKey pred;
      const bool chained = prefetch_.learn_read(stream_id(op), key, &pred);
      if (auto it = entries_.find(key); it != entries_.end()) {
        hit = it->second.buf;
        if (it->second.prefetched) {
          it->second.prefetched = false;
          prefetch_.count_used();
        }
        Group& g = group_of(key.nsid);
        if (it->second.low) {
          promote(g, key, it->second);
        } else {
          g.policy->record_access(key, hit->len, tick());
        }
        if (chained) g.policy->record_chain(key, pred);
        ++n_.hits;
      } else if (auto f = flights_.find(key); f != flights_.end()) {
        Flight* fl = f->second;
        fl->waiters.push_back(op);
        ++n_.misses;
        ++n_.merges;
        if (fl->prefetch && !fl->used) {
          fl->used = true;
          prefetch_.count_used();
        }
      } else {
        ++n_.misses;
        miss = start_flight(key, false, op->stream);
        miss->waiters.push_back(op);
        miss->chained = chained;
        miss->pred = pred;
      }
      prefetch_.predict(stream_id(op), key, chained, !hit, launch);
    }
    if (hit) {
      op->view = ValueView{{hit->data, hit->len}, hit};
      op->complete(Status::kSuccess, hit->len);
    } else if (miss != nullptr) {
      inner_->submit(&miss->op);  // demand first, then prefetches
    }
    start(launch);
  }

  static std::span<std::byte> fill_sink(BackendOp* op, uint64_t len) {
    auto* f = static_cast<Flight*>(op->user);
    if (len > f->self->capacity_ && f->self->go_direct(f)) return f->direct->sink(f->direct, len);
    f->buf = f->self->alloc_value(len);
    return {f->buf->data, static_cast<size_t>(len)};
  }

  // A value larger than the cache is never kept: when one demand read with a sink of its own
  // waits for it, the flight hands that sink to the backend and leaves flights_, so a later miss
  // starts a read of its own rather than joining one whose bytes went elsewhere.
  bool go_direct(Flight* f) {
    std::lock_guard lk(mu_);
    if (f->prefetch || f->waiters.size() != 1 || f->waiters[0]->sink == nullptr) return false;
    f->direct = f->waiters[0];
    if (f->attached) {
      flights_.erase(f->key);
      f->attached = false;
    }
    ++n_.direct;
    return true;
  }

  static void fill_done(BackendOp* op, Status s, uint64_t len) {
    auto* f = static_cast<Flight*>(op->user);
    f->self->finish_fill(f, s, len);
  }

  void finish_fill(Flight* f, Status s, uint64_t len) {
    std::shared_ptr<Buffer> buf;
    if (f->direct != nullptr) {
      // The value is in the requester's memory already (or it failed): nothing to keep.
      {
        std::lock_guard lk(mu_);
        if (f->attached) flights_.erase(f->key);
      }
      f->direct->complete(s, s == Status::kSuccess ? len : 0);
      delete f;
      outstanding_.fetch_sub(1, std::memory_order_release);  // last: drain() may return now
      return;
    }
    if (s == Status::kSuccess) {
      const ValueView& v = f->op.view;
      if (f->buf && f->buf->len == len) {
        buf = std::move(f->buf);
      } else if (v.bytes.data() != nullptr || v.keepalive) {
        // The backend handed out its own bytes: copy them into the slab so cached values all
        // live in (possibly pinned) slab memory and the backend's buffer can go.
        if (v.bytes.size() >= len) {
          buf = alloc_value(len);
          if (len != 0) std::memcpy(buf->data, v.bytes.data(), len);
        } else {
          s = Status::kUnrecoveredError;
        }
      } else if (len == 0) {
        buf = alloc_value(0);
      } else {
        s = Status::kUnrecoveredError;  // neither the sink nor a view got the value
      }
      f->op.view = ValueView{};
    }
    std::vector<BackendOp*> waiters;
    Launch launch(*this);
    {
      std::lock_guard lk(mu_);
      if (f->attached) flights_.erase(f->key);
      const bool cache_it =
          s == Status::kSuccess && f->attached && f->insertable && buf->from_slab();
      if (cache_it) {
        insert(f->key, buf, f->prefetch && !f->used ? AddKind::kPrefetch : AddKind::kDemand,
               f->chained ? &f->pred : nullptr);
        ++n_.fills;
      }
      if (f->prefetch) prefetch_.finished(s == Status::kSuccess, cache_it || f->used);
      waiters.swap(f->waiters);
      prefetch_.pump(launch);
    }
    for (BackendOp* w : waiters) {
      if (s == Status::kSuccess) {
        w->view = ValueView{{buf->data, buf->len}, buf};
        w->complete(s, len);
      } else {
        w->complete(s, 0);
      }
    }
    start(launch);
    delete f;
    outstanding_.fetch_sub(1, std::memory_order_release);  // last: drain() may return now
  }

  void exists(BackendOp* op) {
    bool hit;
    {
      std::lock_guard lk(mu_);
      hit = entries_.contains(NsKey{op->nsid, op->key});
      if (hit) ++n_.exists_hits;
    }
    if (hit) return op->complete(Status::kSuccess);
    inner_->submit(op);
  }

  // ---- writes ----

  // A Store that may be cached (the only write to its key in flight, not larger than the cache) is
  // copied into a slab buffer first, and the backend gets the slab's bytes with the buffer as
  // their owner: a backend that keeps values in memory holds the buffer instead of copying, and
  // one that writes elsewhere (local store, RADOS) reads the slab as it would the caller's memory.
  // Either way the value is copied once here and the cache keeps that buffer on success, where it
  // used to copy the caller's bytes again after the backend had them. The copy runs on the
  // caller's thread, outside the lock.
  void write(BackendOp* op) {
    auto* ctx = new WriteCtx{};
    ctx->self = this;
    ctx->key = NsKey{op->nsid, op->key};
    ctx->done = op->done;
    ctx->user = op->user;
    const bool put = op->kind == BackendOpKind::kPut;
    bool sole = false;
    {
      std::lock_guard lk(mu_);
      WriteState& w = writes_[ctx->key];
      if (++w.count > 1) w.overlapped = true;
      sole = !w.overlapped;
      detach(ctx->key);
      if (op->kind == BackendOpKind::kPut) {
        ctx->chained = prefetch_.learn_store(stream_id(op), ctx->key, &ctx->pred);
        ctx->low = (op->store_options & nvme::kStoreLowPriority) != 0;
      }
      outstanding_.fetch_add(1, std::memory_order_relaxed);
      sole = sole && put && cacheable(op->nsid, op->value.size());
    }
    if (sole && (ctx->buf = slab_->allocate(op->value.size())) != nullptr) {
      if (!op->value.empty()) std::memcpy(ctx->buf->data, op->value.data(), op->value.size());
      write_copy_bytes_.fetch_add(op->value.size(), std::memory_order_relaxed);
      ctx->caller_value = op->value;
      ctx->caller_owner = std::move(op->value_owner);
      op->value = {ctx->buf->data, ctx->buf->len};
      op->value_owner = ctx->buf;
    }
    op->done = &write_done;
    op->user = ctx;
    inner_->submit(op);
  }

  static void write_done(BackendOp* op, Status s, uint64_t len) {
    auto* ctx = static_cast<WriteCtx*>(op->user);
    op->done = ctx->done;
    op->user = ctx->user;
    std::shared_ptr<Buffer> buf = std::move(ctx->buf);
    if (buf) {
      // The op goes back as the caller filled it (the backend may still hold its reference).
      op->value = ctx->caller_value;
      op->value_owner = std::move(ctx->caller_owner);
    }
    const NsKey key = ctx->key;
    const bool chained = ctx->chained;
    const NsKey pred = ctx->pred;
    const bool low = ctx->low;
    CachedBackend* self = ctx->self;
    delete ctx;
    if (s != Status::kSuccess) buf.reset();  // the cache is left as the backend left the key
    self->finish_write(op, key, s, len, chained ? &pred : nullptr, std::move(buf), low);
  }

  // `buf`: the Store's value in the slab, when it was copied there and the backend took it.
  // `low`: stored with nvme::kStoreLowPriority.
  void finish_write(BackendOp* op, const NsKey& key, Status s, uint64_t len, const NsKey* pred,
                    std::shared_ptr<Buffer> buf, bool low) {
    const bool put = op->kind == BackendOpKind::kPut;
    {
      std::lock_guard lk(mu_);
      auto w = writes_.find(key);
      detach(key);
      if (buf && !w->second.overlapped) {
        insert(key, std::move(buf), AddKind::kDemand, pred, low);
        ++n_.write_fills;
      } else if (!(put && s != Status::kSuccess && rejected_unchanged(s))) {
        erase(key);
      }
      if (--w->second.count == 0) writes_.erase(w);
    }
    op->complete(s, len);
    outstanding_.fetch_sub(1, std::memory_order_release);
  }

  // ---- prefetch ----

  void prefetch(uint32_t nsid, std::span<const Key> keys) override { warm(nsid, keys, false); }

  // Scheduler hint: the keys will be read soon, in this order. Each is remembered by the policy
  // (which keeps it from eviction while the hint lasts), and fetched ahead like a prefetch. A key
  // stored nowhere costs one failed backend read and changes nothing.
  void hint(uint32_t nsid, std::span<const Key> keys) override { warm(nsid, keys, true); }

  // Those of `keys` not cached are fetched ahead, in order, through the prefetch queue (its
  // slots and length bound the work); `hinted`: the policy is told of each first.
  void warm(uint32_t nsid, std::span<const Key> keys, bool hinted) {
    hinted = hinted && capacity_ != 0;
    if (!hinted && !prefetch_.fetches()) return;
    Launch launch(*this);
    {
      std::lock_guard lk(mu_);
      const uint64_t now = tick();
      for (const Key& k : keys) {
        if (!k.valid()) continue;
        const NsKey key{nsid, k};
        if (hinted) {
          auto e = entries_.find(key);
          // A low-priority entry is not in the policy: it learns the size once a read adds it.
          const bool known = e != entries_.end() && !e->second.low;
          group_of(nsid).policy->hint(key, known ? e->second.buf->len : 0, now);
          prefetch_.count_hint();
        }
        if (prefetch_.fetches()) prefetch_.fetch(key, cache::kHint, launch);
      }
    }
    start(launch);
  }

  void start(const Launch& launch) {
    for (Flight* f : launch.flights) inner_->submit(&f->op);
  }

  // ---- state (REQUIRES: mu_ held) ----

  // A strictly increasing clock for the policy: nanoseconds, bumped when two reads share one.
  uint64_t tick() {
    uint64_t t = now_ns();
    if (t <= last_tick_) t = last_tick_ + 1;
    return last_tick_ = t;
  }

  Flight* start_flight(const NsKey& key, bool prefetch, uint32_t stream) {
    auto* f = new Flight;
    f->self = this;
    f->key = key;
    f->prefetch = prefetch;
    f->insertable = !writes_.contains(key);
    f->op.kind = BackendOpKind::kGet;
    f->op.nsid = key.nsid;
    f->op.key = key.key;
    f->op.stream = stream;
    f->op.sink = &fill_sink;
    f->op.done = &fill_done;
    f->op.user = f;
    flights_.emplace(key, f);  // a prefetch's slot is the prefetcher's to count
    outstanding_.fetch_add(1, std::memory_order_relaxed);
    return f;
  }

  // Another node deleted `key` (nsid 0: anything): drop the copy, and keep a read in flight
  // from caching what it fetched before the delete. Then tell whoever sits above.
  void invalidate(uint32_t nsid, const Key& key) {
    {
      std::lock_guard lk(mu_);
      if (nsid != 0) {
        const NsKey k{nsid, key};
        detach(k);
        erase(k);
      } else {
        for (auto& [k, f] : flights_) f->attached = false;
        flights_.clear();
        std::vector<NsKey> all;
        all.reserve(entries_.size());
        for (const auto& [k, e] : entries_) all.push_back(k);
        for (const NsKey& k : all) erase(k);
      }
      ++n_.remote_invalidations;
    }
    upstream_(nsid, key);
  }

  // The store no longer holds `key` (deleted, or evicted by its own policy): neither does the
  // cache, so what gdkvd serves is what the store holds and a removal reported upstream (gdkvd's
  // /removed) is true. nsid 0 (removals missed) comes with an invalidation that dropped all.
  void removed(uint32_t nsid, const Key& key) {
    if (nsid != 0) {
      std::lock_guard lk(mu_);
      const NsKey k{nsid, key};
      detach(k);
      erase(k);
    }
    removals_(nsid, key);
  }

  void detach(const NsKey& key) {
    auto it = flights_.find(key);
    if (it == flights_.end()) return;
    it->second->attached = false;
    flights_.erase(it);
  }

  Group& group_of(uint32_t nsid) {
    if (groups_.empty()) return shared_;
    auto it = groups_.find(nsid);
    return it != groups_.end() ? it->second : shared_;
  }

  // The namespace's metrics, or null past kMaxMetricNamespace.
  NsStat* stat(uint32_t nsid) {
    if (nsid > kMaxMetricNamespace) return nullptr;
    if (nsid >= ns_.size()) ns_.resize(nsid + 1);
    return &ns_[nsid];
  }

  // Whether a value of `size` bytes of namespace `nsid` may be cached: it fits the capacity and
  // its namespace's quota; and while the quotas sum to at most the capacity, a namespace without a
  // quota has only what the quota namespaces do not hold.
  bool cacheable(uint32_t nsid, uint64_t size) {
    if (size > capacity_) return false;
    const Group& g = group_of(nsid);
    if (g.limited) return size <= g.quota;
    return !quotas_fit_ || size <= capacity_ - limited_bytes_;
  }

  void charge(const NsKey& key, Group& g, uint64_t n) {
    bytes_ += n;
    g.bytes += n;
    if (g.limited) limited_bytes_ += n;
    if (NsStat* st = stat(key.nsid)) {
      st->held += n;
      st->used = true;
    }
  }
  void credit(const NsKey& key, Group& g, uint64_t n) {
    bytes_ -= n;
    g.bytes -= n;
    if (g.limited) limited_bytes_ -= n;
    if (NsStat* st = stat(key.nsid)) st->held -= n;
  }

  // A low-priority entry read: it becomes an ordinary one, added to its group's policy.
  void promote(Group& g, const NsKey& key, Entry& e) {
    g.low.erase(e.low_at);
    e.low = false;
    g.policy->prepare_insert(key, e.buf->len, AddKind::kDemand);
    g.policy->add(key, e.buf->len, tick(), AddKind::kDemand);
  }

  // Room for `size` more bytes in `g`: its own victims while it is over its quota, then victims
  // for the capacity (evict_for_capacity).
  void make_room(Group& g, uint64_t size) {
    while (g.limited && g.bytes + size > g.quota && evict_from(g)) {
    }
    while (bytes_ + size > capacity_ && evict_for_capacity()) {
    }
  }

  // `pred`: the key's chain predecessor when it was read or stored right after it. `low`: a Store
  // with nvme::kStoreLowPriority (its entry goes to the low list).
  void insert(const NsKey& key, std::shared_ptr<Buffer> buf, AddKind kind,
              const NsKey* pred = nullptr, bool low = false) {
    const uint64_t size = buf->len;
    auto it = entries_.find(key);
    Group& g = group_of(key.nsid);
    if (!cacheable(key.nsid, size)) {
      if (it != entries_.end()) erase(key);
      return;
    }
    const uint64_t now = tick();
    if (it != entries_.end()) {
      // A Store over a cached value: the same entry, a new reference.
      Entry& e = it->second;
      if (e.prefetched) prefetch_.count_wasted();
      credit(key, g, e.buf->len);
      charge(key, g, size);
      e.buf = std::move(buf);
      e.prefetched = false;
      if (low) {
        if (e.low) {
          g.low.splice(g.low.begin(), g.low, e.low_at);
        } else {
          g.policy->remove(key);
          g.low.push_front(key);
          e.low_at = g.low.begin();
          e.low = true;
        }
      } else if (e.low) {
        promote(g, key, e);
      } else {
        g.policy->record_access(key, size, now);
      }
      if (pred != nullptr) g.policy->record_chain(key, *pred);
      make_room(g, 0);
      return;
    }
    if (!low) g.policy->prepare_insert(key, size, kind);
    make_room(g, size);
    Entry& e = entries_.emplace(key, Entry{std::move(buf), kind == AddKind::kPrefetch, low, {}})
                   .first->second;
    charge(key, g, size);
    if (low) {
      g.low.push_front(key);
      e.low_at = g.low.begin();
      return;
    }
    g.policy->add(key, size, now, kind);
    if (pred != nullptr) g.policy->record_chain(key, *pred);
  }

  // Evicts `g`'s next victim: its oldest low-priority entry, else its policy's choice. False when
  // it holds nothing.
  bool evict_from(Group& g) {
    NsKey victim;
    if (!g.low.empty()) {
      victim = g.low.back();
      g.low.pop_back();
    } else if (!g.policy->evict(&victim)) {
      return false;
    }
    auto it = entries_.find(victim);
    if (it == entries_.end()) return true;  // cannot happen: groups hold resident keys only
    if (it->second.prefetched) prefetch_.count_wasted();
    credit(victim, g, it->second.buf->len);
    entries_.erase(it);
    ++n_.evictions;
    if (NsStat* st = stat(victim.nsid)) ++st->evictions;
    return true;
  }

  // Evicts for the capacity: from the shared group; from the quota groups only when the quotas
  // sum to more than the capacity and the shared group is empty: then from the group fullest
  // against its quota among those with low-priority entries, else among all.
  bool evict_for_capacity() {
    if (evict_from(shared_)) return true;
    if (quotas_fit_) return false;
    for (const bool low_only : {true, false}) {
      Group* best = nullptr;
      double best_fill = -1;
      for (auto& [nsid, g] : groups_) {
        if (g.bytes == 0 || (low_only && g.low.empty())) continue;
        const double fill =
            static_cast<double>(g.bytes) / static_cast<double>(std::max<uint64_t>(g.quota, 1));
        if (fill > best_fill) {
          best = &g;
          best_fill = fill;
        }
      }
      if (best != nullptr) return evict_from(*best);
    }
    return false;
  }

  void erase(const NsKey& key) {
    auto it = entries_.find(key);
    if (it == entries_.end()) return;
    Group& g = group_of(key.nsid);
    if (it->second.low) {
      g.low.erase(it->second.low_at);
    } else {
      g.policy->remove(key);
    }
    if (it->second.prefetched) prefetch_.count_wasted();
    credit(key, g, it->second.buf->len);
    entries_.erase(it);
    ++n_.invalidations;
  }

  // The slab's arena grows in steps of 64 MiB, or of the capacity (2 MiB granules) when that is
  // smaller, so a small cache does not fault in more than it can hold.
  static size_t arena_step(const CacheOptions& o) {
    constexpr uint64_t kGranule = uint64_t{2} << 20;
    const uint64_t cap =
        (std::max<uint64_t>(o.capacity_bytes, 1) + kGranule - 1) / kGranule * kGranule;
    return static_cast<size_t>(std::max<uint64_t>(
        o.slab_page_bytes, std::min<uint64_t>(SlabAllocator::kDefaultArenaStep, cap)));
  }

  std::shared_ptr<Buffer> alloc_value(size_t n) {
    if (n <= capacity_) {
      if (auto b = slab_->allocate(n)) return b;
    }
    return SlabAllocator::heap_buffer(n);  // still delivered, just not cached
  }

  const std::shared_ptr<Backend> inner_;
  const uint64_t capacity_;
  const std::string policy_name_;
  const std::shared_ptr<SlabAllocator> slab_;

  mutable std::mutex mu_;
  Group shared_;                      // the namespaces without a quota
  std::map<uint32_t, Group> groups_;  // the namespaces with a quota; fixed at construction
  bool quotas_fit_ = true;            // the quotas sum to at most the capacity
  uint64_t limited_bytes_ = 0;        // cached for the namespaces with a quota
  std::vector<NsStat> ns_;            // by namespace, up to kMaxMetricNamespace
  std::unordered_map<NsKey, Entry, NsKeyHash> entries_;
  uint64_t bytes_ = 0;
  std::unordered_map<NsKey, Flight*, NsKeyHash> flights_;  // attached flights
  std::unordered_map<NsKey, WriteState, NsKeyHash> writes_;
  // Chain learning and the prefetch queue; after shared_ (it asks whether the policy orders by
  // chains). Guarded by mu_ like the rest: every call into it holds the lock.
  cache::Prefetcher prefetch_;
  uint64_t last_tick_ = 0;
  Counters n_;

  std::atomic<uint64_t> outstanding_{0};       // flights and writes not finished yet
  std::atomic<uint64_t> write_copy_bytes_{0};  // Store bytes copied into the slab
  InvalidationHook upstream_;
  InvalidationHook removals_;  // set_removal_handler: the store's removals, passed on
};

}  // namespace

std::vector<std::string> cache_policies() { return cache::policy_names(); }

Result<std::shared_ptr<Backend>> make_cached_backend(std::shared_ptr<Backend> inner,
                                                     const CacheOptions& options) {
  if (!inner) return Error{"cache: no backend to cache"};
  // One policy per eviction group: the shared one sized by the capacity, one per quota by it.
  auto policy_options = [&](uint64_t capacity) {
    cache::PolicyOptions po;
    po.capacity_bytes = capacity;
    po.k = options.k;
    po.history_entries = options.history_entries;
    po.correlated_window = options.correlated_window_us * 1000;  // the cache's clock is in ns
    // A first guess (64 KiB values); the adaptive policy corrects it once the cache has filled.
    po.expected_entries = capacity / (64 * 1024);
    return po;
  };
  if (!cache::make_policy(options.policy, policy_options(options.capacity_bytes))) {
    if (options.policy == "lru-k") {
      return Error{"cache: k must be 1.." + std::to_string(cache::kMaxK) + ", not " +
                   std::to_string(options.k)};
    }
    std::string all;
    for (const std::string& n : cache::policy_names()) all += (all.empty() ? "" : ", ") + n;
    return Error{"cache: unknown policy '" + options.policy + "' (" + all + ")"};
  }
  const PolicyFactory make_policy = [&](uint64_t capacity) {
    cache::HintOptions ho;
    ho.capacity_bytes = capacity;
    ho.max_hints = std::max<uint64_t>(1, options.hint_entries);
    ho.ttl = options.hint_ttl_us * 1000;
    ho.max_share = std::clamp(options.hint_share, 0.0, 1.0);
    return cache::make_hinted_policy(cache::make_policy(options.policy, policy_options(capacity)),
                                     ho);
  };
  return catch_error([&]() -> std::shared_ptr<Backend> {
    return std::make_shared<CachedBackend>(std::move(inner), options, make_policy);
  });
}

}  // namespace gdkv
