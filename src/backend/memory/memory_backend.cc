// The memory backend: one ordered map per namespace under a mutex. Gets hand out a view of the
// stored value (no copy here: the controller's copy engine moves the bytes). A Store whose op
// names a value_owner (the host cache's slab buffer) is kept by reference, not copied; otherwise
// its bytes are copied once, outside the lock, into an arena (common/arena.h) whose memory was
// faulted in ahead of use and is reused when values go: a Store of a new key no longer makes the
// kernel fault in and zero fresh pages. At capacity it evicts like a cache, least
// recently used first (Stores and Gets count as uses), rather than failing with 81h. With delay_us
// set, completions are held back by a timer thread, so it can stand in for a slow backend.
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
    for (const auto& [ns, map] : spaces_) i.keys += map.size();
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
  }

  void drain() override {
    std::unique_lock lk(timer_mu_);
    timer_cv_.wait(lk, [this] { return timers_.empty() && running_ == 0; });
  }

 private:
  struct Slot {
    uint32_t nsid;
    Key key;
  };
  using Lru = std::list<Slot>;  // front: most recently used
  struct Entry {
    Value value;
    Lru::iterator lru;
  };
  using Map = std::map<Key, Entry>;

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
      Map& m = spaces_[op->nsid];
      switch (op->kind) {
        case BackendOpKind::kPut:
          break;
        case BackendOpKind::kGet: {
          auto it = m.find(op->key);
          if (it == m.end()) {
            s = Status::kKeyNotExist;
            break;
          }
          lru_.splice(lru_.begin(), lru_, it->second.lru);
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
          erase_locked(m, it, gone);
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
        // A Store its options refuse evicts nothing.
        if (Status s = check_options(spaces_[op.nsid], op); s != Status::kSuccess) return s;
        if (lru_.empty()) break;
        // A rewrite never evicts its own key (a Store that then failed would have changed it);
        // the old value goes when the new one is in.
        if (lru_.back().nsid == op.nsid && lru_.back().key == op.key) {
          if (lru_.size() == 1) break;
          lru_.splice(lru_.begin(), lru_, std::prev(lru_.end()));
        }
        evicted += evict_one_locked(gone);
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

  // REQUIRES: mu_ held.
  static Status check_options(const Map& m, const BackendOp& op) {
    const bool exists = m.contains(op.key);
    if (op.store_options & nvme::kStoreMustExist && !exists) return Status::kKeyNotExist;
    if (op.store_options & nvme::kStoreMustNotExist && exists) return Status::kKeyExists;
    return Status::kSuccess;
  }

  // REQUIRES: mu_ held, and the value fits in the capacity. `v` becomes the key's value; the one it
  // replaces and those evicted to make room go to `gone`.
  Status put(const BackendOp& op, Value v, std::vector<Value>& gone) {
    Map& m = spaces_[op.nsid];
    if (Status s = check_options(m, op); s != Status::kSuccess) return s;
    if (auto it = m.find(op.key); it != m.end()) erase_locked(m, it, gone);
    const uint64_t add = op.key.len + v.bytes.size();
    while (used_ + add > options_.capacity_bytes && !lru_.empty()) evict_one_locked(gone);
    lru_.push_front(Slot{op.nsid, op.key});
    m.emplace(op.key, Entry{std::move(v), lru_.begin()});
    used_ += add;
    return Status::kSuccess;
  }

  // REQUIRES: mu_ held.
  void erase_locked(Map& m, Map::iterator it, std::vector<Value>& gone) {
    used_ -= it->first.len + it->second.value.bytes.size();
    gone.push_back(std::move(it->second.value));
    lru_.erase(it->second.lru);
    m.erase(it);
  }

  // REQUIRES: mu_ held, lru_ not empty. Evicts the least recently used value; returns its bytes.
  uint64_t evict_one_locked(std::vector<Value>& gone) {
    const Slot& s = lru_.back();
    Map& m = spaces_[s.nsid];
    auto it = m.find(s.key);
    const uint64_t bytes = it->second.value.bytes.size();
    const uint32_t nsid = s.nsid;
    const Key key = s.key;  // erase_locked drops the slot `s`
    erase_locked(m, it, gone);
    evictions_.fetch_add(1, std::memory_order_relaxed);
    removed_.push_back(NsKey{nsid, key});
    has_removed_.store(true, std::memory_order_release);
    return bytes;
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
  std::map<uint32_t, Map> spaces_;
  Lru lru_;
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
