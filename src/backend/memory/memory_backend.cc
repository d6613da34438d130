// The memory backend: one ordered map per namespace under a mutex. Gets hand out a view of the
// stored value (no copy here: the controller's copy engine moves the bytes). A Store whose op
// names a value_owner (the host cache's slab buffer) is kept by reference, not copied; otherwise
// its bytes are copied once, outside the lock, into an arena (common/arena.h) whose memory was
// faulted in ahead of use and is reused when values go: a Store of a new key no longer makes the
// kernel fault in and zero fresh pages. At capacity it evicts like a cache, least
// recently used first (Stores and Gets count as uses), rather than failing with 81h. With delay_us
// set, completions are held back by a timer thread, so it can stand in for a slow backend.
//
// Eviction order (gdkv/backend.h states the rule): values live in pools, one shared by every
// namespace without a quota and one per namespace with a quota. A pool keeps two lists, its
// low-priority values (newest first) and the rest (most recently used first); its victim is the
// oldest low-priority value, else the least recently used one. Each value carries the sequence
// number of its last use, so the least recently used value of all the quota pools is the oldest
// of their list tails: that scan (one step per quota) runs only when the quotas sum to more than
// the capacity and the shared pool is empty.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <iterator>
#include <list>
#include <map>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <vector>

#include "common/arena.h"
#include "gdkv/backend.h"
#include "gdkv/backend_factory.h"

namespace gdkv {
namespace {

using nvme::Status;
// A stored value: its bytes and what keeps them alive (our own copy, or the Store's owner).
struct Value {
  std::span<const std::byte> bytes;
  std::shared_ptr<const void> keep;
};
using Clock = std::chrono::steady_clock;

class MemoryBackend final : public Backend {
 public:
  explicit MemoryBackend(const MemoryBackendOptions& o)
      : options_(o), arena_(std::make_shared<Arena>(arena_options(o))) {
    uint64_t sum = 0;
    for (const auto& [nsid, quota] : options_.quotas) {
      Pool& p = quota_pools_[nsid];
      p.limited = true;
      p.quota = quota;
      sum = quota > UINT64_MAX - sum ? UINT64_MAX : sum + quota;
      space(nsid);  // reported from the start
    }
    quotas_fit_ = sum <= options_.capacity_bytes;
    if (options_.delay_us > 0) timer_ = std::thread([this] { run_timer(); });
  }
  ~MemoryBackend() override {
    {
      std::lock_guard lk(timer_mu_);
      stop_ = true;
    }
    timer_cv_.notify_all();
    if (timer_.joinable()) timer_.join();
  }

  void submit(BackendOp* op) override {
    ops_.fetch_add(1, std::memory_order_relaxed);
    if (options_.delay_us == 0) return run(op);
    std::lock_guard lk(timer_mu_);
    timers_.push(Timer{Clock::now() + std::chrono::microseconds(options_.delay_us), seq_++, op});
    timer_cv_.notify_one();
  }

  BackendInfo info() const override {
    std::lock_guard lk(mu_);
    BackendInfo i;
    i.name = "memory";
    for (const auto& [ns, sp] : spaces_) i.keys += sp.map.size();
    i.bytes_used = used_;
    i.capacity_bytes = options_.capacity_bytes;
    return i;
  }

  void set_removal_handler(InvalidationHandler h) override { removals_.set(std::move(h)); }

  void collect(MetricList& out) const override {
    MetricWriter w(out, {{"backend", "memory"}});
    const BackendInfo i = info();
    w.counter("backend_ops_total", "ops submitted to the backend", ops_);
    w.gauge("backend_keys", "keys stored", static_cast<double>(i.keys));
    w.counter("backend_copied_bytes_total",
              "Store bytes the backend copied (values kept by reference are not)", copied_);
    w.counter("backend_evictions_total", "values evicted to make room (least recently used first)",
              evictions_);
    w.gauge("backend_arena_bytes", "value memory prepared (arena regions, faulted in)",
            static_cast<double>(arena_->reserved_bytes()));
    w.counter("backend_arena_growths_total", "arena regions allocated",
              static_cast<double>(arena_->regions_allocated()));
    w.counter("backend_heap_values_total",
              "values copied to the heap because the arena had no room (views of evicted values "
              "still held, or fragmentation)",
              heap_values_);
    w.gauge("backend_bytes_used", "bytes stored", static_cast<double>(i.bytes_used));
    collect_namespaces(out);
  }

  void drain() override {
    std::unique_lock lk(timer_mu_);
    timer_cv_.wait(lk, [this] { return timers_.empty() && running_ == 0; });
  }

 private:
  struct Slot {
    NsKey key;
    uint64_t seq;  // use_seq_ at its last use (a Store or a Get)
  };
  using Lru = std::list<Slot>;  // front: most recently used (or stored)
  struct Entry {
    Value value;
    Lru::iterator lru;
    bool low;  // in its pool's low list (stored with kStoreLowPriority, not read since)
  };
  using Map = std::map<Key, Entry>;
  // Values evicted together: all namespaces without a quota share one pool, each namespace with
  // a quota has its own.
  struct Pool {
    Lru ordinary;
    Lru low;
    uint64_t bytes = 0;  // key and value bytes
    bool limited = false;
    uint64_t quota = 0;  // limited: the most `bytes` may be
  };
  struct Space {
    Map map;
    Pool* pool = nullptr;
    uint64_t held = 0;       // key and value bytes
    uint64_t evictions = 0;  // values evicted, for its quota or for the capacity
    bool used = false;       // has held a value
  };

  // Regions of 64 MiB (or the capacity, when smaller), at most the capacity in all.
  static Arena::Options arena_options(const MemoryBackendOptions& o) {
    constexpr uint64_t kStep = uint64_t{64} << 20;
    Arena::Options a;
    a.step_bytes = static_cast<size_t>(std::clamp<uint64_t>(o.capacity_bytes, 1, kStep));
    a.limit_bytes = std::max<uint64_t>(o.capacity_bytes, 1);
    return a;
  }

  void run(BackendOp* op) {
    Status s = Status::kSuccess;
    uint64_t len = 0;
    std::vector<Value> gone;  // replaced, deleted or evicted values: freed after the lock
    if (op->kind == BackendOpKind::kPut) {
      s = store(*op, gone);
      gone.clear();
      report_removed();
      return op->complete(s, len);
    }
    {
      std::lock_guard lk(mu_);
      Space& sp = space(op->nsid);
      Map& m = sp.map;
      switch (op->kind) {
        case BackendOpKind::kPut:
          break;
        case BackendOpKind::kGet: {
          auto it = m.find(op->key);
          if (it == m.end()) {
            s = Status::kKeyNotExist;
            break;
          }
          touch(sp, it->second);
          len = it->second.value.bytes.size();
          op->view = ValueView{it->second.value.bytes, it->second.value.keep};
          break;
        }
        case BackendOpKind::kDelete: {
          auto it = m.find(op->key);
          if (it == m.end()) {
            s = Status::kKeyNotExist;
            break;
          }
          erase_locked(sp, it, gone);
          removed_.push_back(NsKey{op->nsid, op->key});
          has_removed_.store(true, std::memory_order_release);
          break;
        }
        case BackendOpKind::kExists:
          s = m.count(op->key) ? Status::kSuccess : Status::kKeyNotExist;
          break;
        case BackendOpKind::kList: {
          op->keys.clear();
          auto it = op->key.len == 0 ? m.begin() : m.lower_bound(op->key);
          for (; it != m.end() && op->keys.size() < op->list_max; ++it)
            op->keys.push_back(it->first);
          break;
        }
      }
    }
    gone.clear();
    report_removed();
    op->complete(s, len);
  }

  // Outside mu_: the handler may take the locks of whoever keeps copies (the host cache).
  void report_removed() {
    if (!has_removed_.load(std::memory_order_acquire)) return;  // no second lock per op
    std::vector<NsKey> keys;
    {
      std::lock_guard lk(mu_);
      has_removed_.store(false, std::memory_order_relaxed);
      keys.swap(removed_);
    }
    for (const NsKey& k : keys) removals_(k.nsid, k.key);
  }

  Status store(const BackendOp& op, std::vector<Value>& gone) {
    // Larger than the whole store: no eviction can make room.
    if (op.key.len + op.value.size() > options_.capacity_bytes) return Status::kCapacityExceeded;
    if (!options_.quotas.empty()) {  // refused before the copy, and before evicting for it
      std::lock_guard lk(mu_);
      if (Status s = admit(op); s != Status::kSuccess) return s;
    }
    Value v;
    if (Status s = take(op, v, gone); s != Status::kSuccess) return s;
    std::lock_guard lk(mu_);
    return put(op, std::move(v), gone);
  }

  // The Store's value as kept: by reference when the op has an owner, else a copy of its own in
  // the arena. Made before the lock, so the lock covers map operations only (a 2 MiB copy under it
  // stalled every other reactor's ops), and a rewrite holds both copies for that moment. When the
  // arena is full, the least recently used values go until the copy fits; if it still does not
  // (evicted values a Get's view still holds, fragmentation, or a rewrite of the only key) after
  // evicting four times its size, it goes to the heap rather than emptying the store
  // (backend_heap_values_total counts those).
  Status take(const BackendOp& op, Value& v, std::vector<Value>& gone) {
    if (op.value_owner) {
      v = Value{op.value, op.value_owner};
      return Status::kSuccess;
    }
    const size_t n = op.value.size();
    if (n == 0) {
      v = Value{{}, empty_keep()};
      return Status::kSuccess;
    }
    void* p = arena_->allocate(n);
    uint64_t evicted = 0;
    const uint64_t max_evicted = uint64_t{4} * n + (uint64_t{64} << 10);
    while (p == nullptr && evicted < max_evicted) {
      {
        std::lock_guard lk(mu_);
        // A Store its options or quota refuse evicts nothing.
        if (Status s = admit(op); s != Status::kSuccess) return s;
        // A rewrite never evicts its own key (a Store that then failed would have changed it);
        // the old value goes when the new one is in. Room its namespace's quota needs anyway
        // comes from that namespace.
        const NsKey self{op.nsid, op.key};
        Space& sp = space(op.nsid);
        const Slot* victim = nullptr;
        if (sp.pool->limited && held_after(sp, op) > sp.pool->quota) {
          victim = victim_of(*sp.pool, &self);
        }
        if (victim == nullptr) victim = capacity_victim(&self);
        if (victim == nullptr) break;
        evicted += evict_locked(*victim, gone);
      }
      gone.clear();  // the evicted extents go back to the arena (unless a view holds one)
      p = arena_->allocate(n);
    }
    copied_.fetch_add(n, std::memory_order_relaxed);
    if (p == nullptr) {
      heap_values_.fetch_add(1, std::memory_order_relaxed);
      std::shared_ptr<std::byte[]> copy = std::make_shared_for_overwrite<std::byte[]>(n);
      std::memcpy(copy.get(), op.value.data(), n);
      v = Value{{copy.get(), n}, std::move(copy)};
      return Status::kSuccess;
    }
    std::memcpy(p, op.value.data(), n);
    // The last holder (this backend, or a Get's view of an evicted value) returns the extent;
    // the arena outlives the backend while a view holds one.
    std::shared_ptr<const void> keep(
        p, [arena = arena_, n](const void* q) { arena->release(const_cast<void*>(q), n); });
    v = Value{{static_cast<const std::byte*>(p), n}, std::move(keep)};
    return Status::kSuccess;
  }

  static std::shared_ptr<const void> empty_keep() {
    static const std::shared_ptr<const void> nothing = std::make_shared<char>(0);
    return nothing;
  }

  // REQUIRES: mu_ held. The namespace's Space (created empty, in its pool, on first use).
  Space& space(uint32_t nsid) {
    auto [it, fresh] = spaces_.try_emplace(nsid);
    if (fresh) {
      auto q = quota_pools_.find(nsid);
      it->second.pool = q != quota_pools_.end() ? &q->second : &shared_;
    }
    return it->second;
  }

  // REQUIRES: mu_ held. Whether the Store may go ahead: its options (MustExist, MustNotExist), and
  // room: a value larger than its namespace's quota never fits; while the quotas sum to at most
  // the capacity, a namespace without a quota has only what the quota namespaces do not hold.
  Status admit(const BackendOp& op) {
    Space& sp = space(op.nsid);
    const bool exists = sp.map.contains(op.key);
    if (op.store_options & nvme::kStoreMustExist && !exists) return Status::kKeyNotExist;
    if (op.store_options & nvme::kStoreMustNotExist && exists) return Status::kKeyExists;
    const uint64_t add = op.key.len + op.value.size();
    if (sp.pool->limited) {
      if (add > sp.pool->quota) return Status::kCapacityExceeded;
    } else if (quotas_fit_ && add > options_.capacity_bytes - limited_bytes_) {
      return Status::kCapacityExceeded;
    }
    return Status::kSuccess;
  }

  // REQUIRES: mu_ held. The bytes op's namespace holds once the Store replaces its old value.
  static uint64_t held_after(const Space& sp, const BackendOp& op) {
    uint64_t held = sp.pool->bytes + op.key.len + op.value.size();
    if (auto it = sp.map.find(op.key); it != sp.map.end()) {
      held -= it->first.len + it->second.value.bytes.size();
    }
    return held;
  }

  // REQUIRES: mu_ held, and the value fits in the capacity. `v` becomes the key's value; the one it
  // replaces and those evicted to make room go to `gone`.
  Status put(const BackendOp& op, Value v, std::vector<Value>& gone) {
    if (Status s = admit(op); s != Status::kSuccess) return s;
    Space& sp = space(op.nsid);
    Pool& pool = *sp.pool;
    if (auto it = sp.map.find(op.key); it != sp.map.end()) erase_locked(sp, it, gone);
    const uint64_t add = op.key.len + v.bytes.size();
    // First the namespace's quota, from its own values; then the capacity (capacity_victim).
    while (pool.limited && pool.bytes + add > pool.quota) {
      const Slot* victim = victim_of(pool, nullptr);
      if (victim == nullptr) break;
      evict_locked(*victim, gone);
    }
    while (used_ + add > options_.capacity_bytes) {
      const Slot* victim = capacity_victim(nullptr);
      if (victim == nullptr) break;
      evict_locked(*victim, gone);
    }
    const bool low = (op.store_options & nvme::kStoreLowPriority) != 0;
    Lru& list = low ? pool.low : pool.ordinary;
    list.push_front(Slot{NsKey{op.nsid, op.key}, ++use_seq_});
    sp.map.emplace(op.key, Entry{std::move(v), list.begin(), low});
    used_ += add;
    pool.bytes += add;
    if (pool.limited) limited_bytes_ += add;
    sp.held += add;
    sp.used = true;
    return Status::kSuccess;
  }

  // REQUIRES: mu_ held. A Get of the value: it becomes its pool's most recently used, and an
  // ordinary value if it was a low-priority one.
  void touch(Space& sp, Entry& e) {
    Pool& pool = *sp.pool;
    pool.ordinary.splice(pool.ordinary.begin(), e.low ? pool.low : pool.ordinary, e.lru);
    e.low = false;
    e.lru->seq = ++use_seq_;
  }

  // REQUIRES: mu_ held.
  void erase_locked(Space& sp, Map::iterator it, std::vector<Value>& gone) {
    const uint64_t bytes = it->first.len + it->second.value.bytes.size();
    used_ -= bytes;
    sp.held -= bytes;
    sp.pool->bytes -= bytes;
    if (sp.pool->limited) limited_bytes_ -= bytes;
    gone.push_back(std::move(it->second.value));
    (it->second.low ? sp.pool->low : sp.pool->ordinary).erase(it->second.lru);
    sp.map.erase(it);
  }

  // The oldest slot of `list` that is not `keep`; null if none. A key is in a list at most once,
  // so the last two slots are all there is to look at.
  static const Slot* oldest(const Lru& list, const NsKey* keep) {
    auto it = list.rbegin();
    if (it == list.rend()) return nullptr;
    if (keep == nullptr || !(it->key == *keep)) return &*it;
    return ++it == list.rend() ? nullptr : &*it;
  }

  // The value `pool` gives up next: its oldest low-priority value, else its least recently used.
  static const Slot* victim_of(const Pool& pool, const NsKey* keep) {
    if (const Slot* s = oldest(pool.low, keep)) return s;
    return oldest(pool.ordinary, keep);
  }

  // REQUIRES: mu_ held. The value to evict for the capacity: the shared pool's victim; a quota
  // pool's only when the shared pool has none to give and the quotas sum to more than the
  // capacity (else the quota namespaces hold at most their quotas and admit() kept the others
  // within the rest): then the oldest low-priority value of all quota pools, else their least
  // recently used value.
  const Slot* capacity_victim(const NsKey* keep) const {
    if (const Slot* s = victim_of(shared_, keep)) return s;
    if (quotas_fit_) return nullptr;
    for (const Lru Pool::*list : {&Pool::low, &Pool::ordinary}) {
      const Slot* best = nullptr;
      for (const auto& [nsid, pool] : quota_pools_) {
        const Slot* s = oldest(pool.*list, keep);
        if (s != nullptr && (best == nullptr || s->seq < best->seq)) best = s;
      }
      if (best != nullptr) return best;
    }
    return nullptr;
  }

  // REQUIRES: mu_ held. Evicts `victim`'s value and reports it removed; returns its value bytes.
  uint64_t evict_locked(const Slot& victim, std::vector<Value>& gone) {
    const NsKey key = victim.key;  // erase_locked drops the slot
    Space& sp = space(key.nsid);
    auto it = sp.map.find(key.key);
    const uint64_t bytes = it->second.value.bytes.size();
    erase_locked(sp, it, gone);
    ++sp.evictions;
    evictions_.fetch_add(1, std::memory_order_relaxed);
    removed_.push_back(key);
    has_removed_.store(true, std::memory_order_release);
    return bytes;
  }

  // Each namespace with a quota, and each that has held a value (up to kMaxMetricNamespace).
  void collect_namespaces(MetricList& out) const {
    std::lock_guard lk(mu_);
    for (const auto& [nsid, sp] : spaces_) {
      if (nsid > kMaxMetricNamespace) break;
      if (!sp.used && !sp.pool->limited) continue;
      add_namespace_metrics(out, "memory", nsid, static_cast<double>(sp.held),
                            static_cast<double>(sp.evictions));
    }
  }

  struct Timer {
    Clock::time_point due;
    uint64_t seq;
    BackendOp* op;
    bool operator>(const Timer& o) const { return due != o.due ? due > o.due : seq > o.seq; }
  };

  void run_timer() {
    std::unique_lock lk(timer_mu_);
    while (!stop_) {
      if (timers_.empty()) {
        timer_cv_.wait(lk);
        continue;
      }
      const Timer t = timers_.top();
      if (Clock::now() < t.due) {
        timer_cv_.wait_until(lk, t.due);
        continue;
      }
      timers_.pop();
      ++running_;
      lk.unlock();
      run(t.op);
      lk.lock();
      --running_;
      timer_cv_.notify_all();
    }
  }

  MemoryBackendOptions options_;
  const std::shared_ptr<Arena> arena_;
  mutable std::mutex mu_;
  std::map<uint32_t, Space> spaces_;
  Pool shared_;                           // the namespaces without a quota
  std::map<uint32_t, Pool> quota_pools_;  // by namespace; fixed at construction
  bool quotas_fit_ = true;                // the quotas sum to at most the capacity
  uint64_t limited_bytes_ = 0;            // held by the quota namespaces
  uint64_t use_seq_ = 0;
  uint64_t used_ = 0;
  std::atomic<uint64_t> ops_{0};
  std::atomic<uint64_t> copied_{0};
  std::atomic<uint64_t> evictions_{0};
  InvalidationHook removals_;   // set_removal_handler
  std::vector<NsKey> removed_;  // under mu_: deleted and evicted keys, reported after the lock
  std::atomic<bool> has_removed_{false};  // removed_ is not empty (set under mu_)
  std::atomic<uint64_t> heap_values_{0};

  std::mutex timer_mu_;
  std::condition_variable timer_cv_;
  std::priority_queue<Timer, std::vector<Timer>, std::greater<Timer>> timers_;
  uint64_t seq_ = 0;
  int running_ = 0;
  bool stop_ = false;
  std::thread timer_;
};

}  // namespace

std::shared_ptr<Backend> make_memory_backend(const MemoryBackendOptions& options) {
  return std::make_shared<MemoryBackend>(options);
}

}  // namespace gdkv

// ---- registration (gdkv/backend_registry.h) ----

void gdkv_register_backend_memory(std::vector<gdkv::BackendRegistration>& registry) {
  using gdkv::kSettingAny;
  using gdkv::setting_row;
  using C = gdkv::BackendConfig;
  gdkv::BackendRegistration b;
  b.name = "memory";
  b.help = "values in gdkvd's memory, least recently used evicted";
  b.traits.can_be_far_tier = true;
  b.settings.push_back(setting_row<C>(
      "memory_capacity", "backend.memory_capacity_bytes", "--memory-capacity", "bytes", 1,
      kSettingAny, {}, "memory backend capacity (full, it evicts least recently used)",
      [](C & c) -> auto& { return c.memory.capacity_bytes; }));
  b.open = [](const C& c) -> gdkv::Result<std::shared_ptr<gdkv::Backend>> {
    gdkv::MemoryBackendOptions o = c.memory;
    o.quotas = c.quotas;
    return gdkv::make_memory_backend(o);
  };
  registry.push_back(std::move(b));
}
