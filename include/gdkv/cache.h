// The host cache: a Backend decorator that keeps values in slab memory in front of any backend
// (memory, the local NVMe store, RADOS), so hot KV-cache blocks are served from host DRAM.
//
// - Hits complete at once with a view of the cached bytes (BackendOp::view); the controller's copy
//   engine moves them. The view keeps its bytes alive, so an eviction never frees a value a copy is
//   still reading.
// - Concurrent misses on one key share one backend read (single flight).
// - Stores are written through: the Store completes once the backend has the value, and from then
//   on this cache serves the new value or nothing, never an older one. Deletes likewise.
// - Prefetch: Backend::prefetch hints (the vendor opcode's key list) and chain prediction (per
//   stream, the key that followed each key last time) warm the cache ahead of demand reads. At most
//   max_prefetch_inflight prefetch reads are outstanding, so they never queue ahead of demand
//   reads in any number; the rest wait in a bounded queue.
// - Eviction: a policy chosen by name ("adaptive", "prefix", "lru-k", "lru", "arc", "s3-fifo");
// docs/cache.md compares them. Stores with nvme::kStoreLowPriority are evicted before the
// policy's entries until a hit makes them ordinary; namespace quotas (CacheOptions::quotas) give
// a namespace room no other namespace can take.
//
// Coherence covers the writes that pass through this cache, and Deletes by other nodes that the
// backend reports (set_invalidation_handler: RADOS notifications). A key the backend removed
// (set_removal_handler: its own eviction, a Delete) leaves the cache too, so the cache never
// serves what the store no longer holds; those removals are passed on to the cache's own removal
// handler. Rewrites by another node to a shared backend are seen once the cached copy is
// evicted; run one cache per backend view.
//
// Thread safety: as every Backend (see backend.h): submit() and collect() from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/result.h"

namespace gdkv {

struct CacheOptions {
  uint64_t capacity_bytes = uint64_t{1} << 30;  // value bytes held, default 1 GiB (0: no caching)
  // "adaptive" (default: follows whichever of prefix, LRU, LRU-2, ARC and S3-FIFO hits most on
  // shadow caches), "prefix" (blocks seen once wait in a small probation segment, blocks seen
  // again or remembered from the history of evicted keys are protected, chains go from their
  // tails), "lru-k" (evicts the entry whose K-th most recent reference is oldest), "lru", "arc"
  // (Megiddo and Modha's ARC, in bytes) or "s3-fifo" (Yang et al.'s S3-FIFO, in bytes).
  std::string policy = "adaptive";
  uint32_t k = 2;  // LRU-K's K, 1..8 (lru-k only)
  // Evicted keys whose reference times LRU-K keeps, so a returning key keeps its count (prefix:
  // evicted keys remembered). Default 0: as many as there are cached entries (prefix: twice).
  uint64_t history_entries = 0;
  // Microseconds, default 0 (off): a reference to a key within this time of its previous reference
  // belongs to the same burst and counts once (lru-k and adaptive).
  uint64_t correlated_window_us = 0;
  uint32_t prefetch_depth = 8;          // chain prediction: keys fetched ahead, default 8 (0: off)
  uint32_t max_prefetch_inflight = 16;  // prefetch reads outstanding at once, default 16 (0: none)
  uint32_t prefetch_queue = 4096;       // prefetch keys waiting for a slot; more are dropped
  uint64_t chain_entries = 1u << 20;    // learned key → next-key transitions kept, default 1 Mi
  // Scheduler hints (Prefetch with the hint option): hinted keys remembered, default 64 Ki (more
  // push out the oldest); how long a hint protects a cached key, microseconds, default 2 s; and
  // the share of the capacity hints may protect, default 0.5. Hinted keys that are not cached are
  // fetched like other prefetches (max_prefetch_inflight, prefetch_queue bound them).
  uint64_t hint_entries = 65536;
  uint64_t hint_ttl_us = 2'000'000;
  double hint_share = 0.5;
  // Slab pages: allocate `bytes` (aligned to 4096) and free them. The GPU runtime passes pinned
  // memory here so cached values can be DMA'd directly. Default: the host heap.
  std::function<void*(size_t bytes)> alloc;
  std::function<void(void* p, size_t bytes)> free;
  size_t slab_page_bytes = size_t{1} << 20;  // bytes per slab page, default 1 MiB
  // Per-namespace limits in value bytes within capacity_bytes (backend.h; open_store passes the
  // backend's). Each namespace with a quota has a policy of its own, sized by its quota; the
  // namespaces without one share a policy sized by capacity_bytes. A namespace's cached values
  // never exceed its quota: at it, the namespace evicts its own entries (its low-priority ones
  // first, then as its policy chooses); a value larger than its quota is not cached. For the
  // capacity, entries of namespaces without a quota go first (their low-priority ones first);
  // while the quotas sum to at most capacity_bytes nothing else is evicted for it, and a value of
  // a namespace without a quota larger than what the quota namespaces leave is not cached. When
  // they sum to more, once the shared policy is empty the quota namespace fullest against its
  // quota gives up an entry (those holding low-priority entries first). Metrics per namespace
  // (each with a quota or that has held a value, nsid up to 1024; labels namespace and
  // tier="cache"): namespace_held_bytes (value bytes) and namespace_evictions_total.
  NamespaceQuotas quotas;
};

// The policies make_cached_backend accepts.
std::vector<std::string> cache_policies();

// Wraps `inner` in a cache. An Error (gdkv/result.h) on bad options (unknown policy, k out of
// range, no inner backend).
Result<std::shared_ptr<Backend>> make_cached_backend(std::shared_ptr<Backend> inner,
                                                     const CacheOptions& options = {});

}  // namespace gdkv
