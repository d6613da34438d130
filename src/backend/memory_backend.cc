// The memory backend: one ordered map per namespace under a mutex. Gets hand out a view of the
// stored value (no copy here: the controller's copy engine moves the bytes). A Store whose op
// names a value_owner (the host cache's slab buffer) is kept by reference, not copied; otherwise
// its bytes are copied once, outside the lock. With delay_us set, completions are held back by a
// timer thread, so it can stand in for a slow backend.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <queue>
#include <thread>
#include <vector>

#include "gdkv/backend.h"

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
  explicit MemoryBackend(const MemoryBackendOptions& o) : options_(o) {
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

  void collect(MetricList& out) const override {
    out.push_back(Metric{"backend_ops_total",
                         "ops submitted to the backend",
                         MetricType::kCounter,
                         {{"backend", "memory"}},
                         static_cast<double>(ops_.load())});
    const BackendInfo i = info();
    out.push_back(Metric{"backend_keys",
                         "keys stored",
                         MetricType::kGauge,
                         {{"backend", "memory"}},
                         static_cast<double>(i.keys)});
    out.push_back(Metric{"backend_copied_bytes_total",
                         "Store bytes the backend copied (values kept by reference are not)",
                         MetricType::kCounter,
                         {{"backend", "memory"}},
                         static_cast<double>(copied_.load())});
    out.push_back(Metric{"backend_bytes_used",
                         "bytes stored",
                         MetricType::kGauge,
                         {{"backend", "memory"}},
                         static_cast<double>(i.bytes_used)});
  }

  void drain() override {
    std::unique_lock lk(timer_mu_);
    timer_cv_.wait(lk, [this] { return timers_.empty() && running_ == 0; });
  }

 private:
  using Map = std::map<Key, Value>;

  void run(BackendOp* op) {
    Status s = Status::kSuccess;
    uint64_t len = 0;
    Value incoming;  // a Store's value, made before the lock
    if (op->kind == BackendOpKind::kPut) incoming = take(*op);
    Value replaced;  // freed after the lock
    {
      std::lock_guard lk(mu_);
      Map& m = spaces_[op->nsid];
      switch (op->kind) {
        case BackendOpKind::kPut:
          s = put(m, *op, incoming, replaced);
          break;
        case BackendOpKind::kGet: {
          auto it = m.find(op->key);
          if (it == m.end()) {
            s = Status::kKeyNotExist;
            break;
          }
          len = it->second.bytes.size();
          op->view = ValueView{it->second.bytes, it->second.keep};
          break;
        }
        case BackendOpKind::kDelete: {
          auto it = m.find(op->key);
          if (it == m.end()) {
            s = Status::kKeyNotExist;
            break;
          }
          used_ -= it->first.len + it->second.bytes.size();
          replaced = std::move(it->second);
          m.erase(it);
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
    op->complete(s, len);
  }

  // The Store's value as kept: by reference when the op has an owner, else a copy of its own.
  // Made before the lock, so the lock covers map operations only (a 2 MiB copy under it stalled
  // every other reactor's ops); a Store then rejected (81h, 87h, 89h) paid for a copy it did not
  // need.
  Value take(const BackendOp& op) {
    if (op.value_owner) return Value{op.value, op.value_owner};
    const size_t n = op.value.size();
    std::shared_ptr<std::byte[]> copy = std::make_shared_for_overwrite<std::byte[]>(n == 0 ? 1 : n);
    if (n != 0) std::memcpy(copy.get(), op.value.data(), n);
    copied_.fetch_add(n, std::memory_order_relaxed);
    return Value{{copy.get(), n}, std::move(copy)};
  }

  // REQUIRES: mu_ held. `v` becomes the key's value; the one it replaces goes to `replaced`.
  Status put(Map& m, const BackendOp& op, Value& v, Value& replaced) {
    auto it = m.find(op.key);
    const bool exists = it != m.end();
    if (op.store_options & nvme::kStoreMustExist && !exists) return Status::kKeyNotExist;
    if (op.store_options & nvme::kStoreMustNotExist && exists) return Status::kKeyExists;
    const uint64_t old = exists ? op.key.len + it->second.bytes.size() : 0;
    const uint64_t add = op.key.len + v.bytes.size();
    if (used_ - old + add > options_.capacity_bytes) return Status::kCapacityExceeded;
    used_ = used_ - old + add;
    if (exists) {
      replaced = std::move(it->second);
      it->second = std::move(v);
    } else {
      m.emplace(op.key, std::move(v));
    }
    return Status::kSuccess;
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
  mutable std::mutex mu_;
  std::map<uint32_t, Map> spaces_;
  uint64_t used_ = 0;
  std::atomic<uint64_t> ops_{0};
  std::atomic<uint64_t> copied_{0};

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
