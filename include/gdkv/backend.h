// Backends: where values live behind the controller (memory, local NVMe store, RADOS).
//
// One asynchronous interface: the controller fills a BackendOp and calls submit(); the backend
// completes it by calling op->done exactly once, from any thread (its own I/O thread, a librados
// callback, or inline inside submit()). The controller routes the completion back to the reactor
// that owns the command, so a backend never needs to know about reactors. submit() must not block
// on I/O: a backend that needs to wait queues the work to its own thread or to the kernel.
//
// Buffers named by an op (value, the sink's buffer) stay valid until done() is called. After
// done() the backend must not touch the op again.
//
// Thread safety: submit() and collect() may be called from many threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <vector>

#include "gdkv/key.h"
#include "gdkv/metrics.h"
#include "gdkv/nvme_kv.h"

namespace gdkv {

enum class BackendOpKind : uint8_t {
  kPut,     // store op.value under op.key, honouring op.store_options (nvme::kStoreMust*)
  kGet,     // read op.key's value (see sink/view)
  kDelete,  // remove op.key; kKeyNotExist if absent
  kExists,  // kSuccess if present, else kKeyNotExist
  kList,    // keys >= op.key (all keys when op.key.len == 0), ascending, at most list_max
};
inline constexpr size_t kBackendOpKinds = 5;

// The kind's name in metrics labels ("put", "get", "delete", "exists", "list").
constexpr const char* backend_op_name(BackendOpKind k) noexcept {
  constexpr const char* kNames[kBackendOpKinds] = {"put", "get", "delete", "exists", "list"};
  return static_cast<size_t>(k) < kBackendOpKinds ? kNames[static_cast<size_t>(k)] : "?";
}

// Bytes a backend can hand out without copying them (memory backend, cache slabs), with what keeps
// them alive until the controller has copied them to their destination.
struct ValueView {
  std::span<const std::byte> bytes;
  std::shared_ptr<const void> keepalive;
};

struct BackendOp {
  BackendOpKind kind = BackendOpKind::kGet;
  uint32_t nsid = 1;    // NVMe namespace: backends keep namespaces apart
  uint32_t stream = 0;  // the queue the request came from (lets a cache learn per-queue order)
  Key key;
  uint8_t store_options = 0;

  // kPut: the value.
  std::span<const std::byte> value;
  // kPut, optional: when set, it keeps `value`'s bytes alive and unchanged for as long as anyone
  // holds a copy of it, so a backend that keeps values in memory may hold this reference instead
  // of copying the bytes (the host cache passes the slab buffer it has just filled: a Store's
  // bytes are then copied once on their way in). Null: the bytes are valid until done() only.
  std::shared_ptr<const void> value_owner;

  // kGet: once the backend knows the value's full length it either
  //   - calls sink(op, length) and writes the first min(length, returned size) bytes there, or
  //   - sets `view` to the whole value, kept alive by view.keepalive.
  // Either way done() reports the full length. sink may return an empty span (nothing wanted).
  std::span<std::byte> (*sink)(BackendOp* op, uint64_t value_len) = nullptr;
  ValueView view;

  // kList: results.
  uint32_t list_max = 0;
  std::vector<Key> keys;

  // Completion: status, and for kGet the value's full length.
  void (*done)(BackendOp* op, nvme::Status status, uint64_t value_len) = nullptr;
  void* user = nullptr;

  void complete(nvme::Status s, uint64_t len = 0) { done(this, s, len); }
};

// Byte limits per namespace: backend namespace → the key and value bytes it may hold (a namespace
// not listed has no limit of its own). A namespace at its limit makes room by evicting its own
// least recently used values, never another namespace's; a value larger than its namespace's limit
// is refused with kCapacityExceeded (81h). gdkvd fills it from its [[namespace]] entries'
// capacity_bytes; every backend and the host cache hold it.
using NamespaceQuotas = std::map<uint32_t, uint64_t>;

// The samples every tier (host cache, memory, local, rados) reports per backend namespace, with
// labels namespace and tier: declared once, so names and help texts agree. A tier reports
// namespaces up to kMaxMetricNamespace (bounded label sets).
inline constexpr uint32_t kMaxMetricNamespace = 1024;
inline void add_namespace_metrics(MetricList& out, const char* tier, uint32_t nsid,
                                  double held_bytes, double evictions) {
  MetricWriter w(out, {{"namespace", std::to_string(nsid)}, {"tier", tier}});
  w.gauge("namespace_held_bytes",
          "bytes of the backend namespace the tier holds, counted as its quota counts them",
          held_bytes);
  w.counter("namespace_evictions_total", "values of the backend namespace the tier evicted",
            evictions);
}

// Sizes a backend reports for `gdkv stat` (0 where unknown).
struct BackendInfo {
  std::string name;
  uint64_t keys = 0;
  uint64_t bytes_used = 0;
  uint64_t capacity_bytes = 0;
  uint64_t segments = 0;  // local store: log segments in use
  // The largest value it can store (0: no limit of its own). The controller takes the smaller of
  // this and ControllerOptions::max_value_bytes as the one limit it enforces and Identify reports.
  uint64_t max_value_bytes = 0;
  // A shared pool that evicts (rados): its fill against what it is measured by (its capacity or
  // quota, else stored + free space), and the blocks this node has evicted.
  double fill_ratio = 0;
  uint64_t fill_capacity_bytes = 0;
  uint64_t evictions = 0;
};

// Told of keys removed behind a backend's back: another node deleted them from a shared backend
// (RADOS), so copies held above it (host cache, local tier) must go. nsid 0 (with an empty key):
// anything may have changed, because the backend missed notifications for a while.
using InvalidationHandler = std::function<void(uint32_t nsid, const Key& key)>;

// Holds one InvalidationHandler: set() and call() from any thread; set() waits for calls in
// progress, so once set(nullptr) returns the old handler is never called again.
class InvalidationHook {
 public:
  void set(InvalidationHandler h) {
    std::unique_lock lk(mu_);
    fn_ = std::move(h);
  }
  bool empty() const {
    std::shared_lock lk(mu_);
    return !fn_;
  }
  void operator()(uint32_t nsid, const Key& key) const {
    std::shared_lock lk(mu_);
    if (fn_) fn_(nsid, key);
  }

 private:
  mutable std::shared_mutex mu_;
  InvalidationHandler fn_;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual void submit(BackendOp* op) = 0;
  virtual BackendInfo info() const = 0;
  // Appends the backend's metrics (names without the gdkv_ prefix).
  virtual void collect(MetricList& out) const { (void)out; }
  // Blocks until every acknowledged write is durable and every op submitted so far has completed.
  virtual void drain() {}
  // Whoever keeps copies of this backend's values (a cache, a tier) registers here to hear of
  // keys deleted by other nodes; nullptr unregisters (and waits for a call in progress). Only a
  // shared backend calls it; the others ignore it. One handler per backend.
  virtual void set_invalidation_handler(InvalidationHandler h) { (void)h; }
  // Whoever reports what the store no longer holds (gdkvd's /removed feed, docs/integrations.md
  // "KV events") registers here: called once for each key this backend stops holding, deleted
  // (by a Delete through it or, on a shared backend, notified from another node) or evicted by
  // its own policy (the local store's reclaim, the memory backend's LRU, the RADOS pool's
  // eviction by this node); nsid 0 with an empty key: removals may have been missed. Copies that
  // go while the value stays in the store (the host cache's, a near tier's) are not removals:
  // decorators forward this to the backend that is the store. Called from the backend's own
  // threads, sometimes under its locks: it must be quick and must not call back into it.
  // nullptr unregisters (and waits for a call in progress). One handler per backend.
  virtual void set_removal_handler(InvalidationHandler h) { (void)h; }
  // A hint (the Prefetch command): the keys of namespace `nsid` will be read soon. The host cache
  // warms them; a backend without a cache has nothing to do (the default), and a decorator
  // passes it on. Never blocks; `keys` is only read during the call.
  virtual void prefetch(uint32_t nsid, std::span<const Key> keys) {
    (void)nsid;
    (void)keys;
  }
  // A scheduler hint (Prefetch with the hint option): the keys will be read soon, in this order.
  // The host cache also protects the resident ones from eviction until read or until the hint
  // ages out. Default: the same as prefetch, so a decorator that forwards prefetch stays correct.
  virtual void hint(uint32_t nsid, std::span<const Key> keys) { prefetch(nsid, keys); }
};

// The routing of a backend in front of another (the host cache, the tiered pair): Get, the writes
// (Put, Delete) and Exist go to its own handlers, List to `next` unchanged.
template <class Get, class Write, class Exists>
void route_op(BackendOp* op, Backend& next, Get get, Write write, Exists exists) {
  switch (op->kind) {
    case BackendOpKind::kGet:
      return get(op);
    case BackendOpKind::kPut:
    case BackendOpKind::kDelete:
      return write(op);
    case BackendOpKind::kExists:
      return exists(op);
    case BackendOpKind::kList:
      break;
  }
  next.submit(op);
}

// The `memory` backend: a map per namespace, for tests and benchmarks. capacity_bytes counts key
// and value bytes. At capacity it evicts like a cache, least recently used first (a Store or a Get
// is a use); only a Store larger than the whole capacity fails, with kCapacityExceeded (81h), and
// with capacity 0 every Store does. Values it copies live in an arena of prepared memory (faulted
// in a region at a time, 2 MiB doubling to 64 MiB, at most capacity_bytes in all) that evicted
// and deleted values return to; it is never handed back while the backend lives.
//
// Quotas and priorities. Values are evicted from pools: one shared by all namespaces without a
// quota, one per namespace with a quota. A pool's next victim is its oldest value stored with
// nvme::kStoreLowPriority and not read since (a Get makes such a value ordinary), else its least
// recently used value. A Store:
//   1. fails with 81h, evicting nothing, if its key and value are larger than its namespace's
//      quota; or, for a namespace without a quota while the quotas sum to at most capacity_bytes,
//      larger than capacity_bytes less the bytes the quota namespaces hold;
//   2. in a namespace with a quota, evicts that namespace's own victims until the namespace's key
//      and value bytes, with the new value, fit its quota;
//   3. while the whole store would exceed capacity_bytes, evicts the shared pool's victims; only
//      when the quotas sum to more than capacity_bytes and the shared pool is empty, the quota
//      pools' (their oldest low-priority value, else the least recently used value among them).
// So while the quotas sum to at most capacity_bytes a namespace with a quota keeps what it stored
// until it needs the room itself, whatever the others store. Every eviction is reported to the
// removal handler. Metrics per namespace (each with a quota or that has held a value, nsid up to
// 1024; labels namespace and tier="memory"): namespace_held_bytes (key and value bytes) and
// namespace_evictions_total.
struct MemoryBackendOptions {
  uint64_t capacity_bytes = uint64_t{1} << 30;  // bytes, default 1 GiB (gdkvd --memory-capacity)
  uint32_t delay_us = 0;  // injected latency per op (tests of prefetch and slow backends)
  // Per-namespace limits in key and value bytes within capacity_bytes (default: none); eviction
  // rules above.
  NamespaceQuotas quotas;
};
std::shared_ptr<Backend> make_memory_backend(const MemoryBackendOptions& options = {});

}  // namespace gdkv
