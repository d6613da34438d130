// The host cache's prefetcher: per-stream chain learning (which key follows which, for readahead
// and for policies that order by chains), the bounded queue of keys to fetch ahead, its metrics.
#pragma once

#include <cstdint>
#include <deque>
#include <unordered_map>
#include <unordered_set>

#include "cache/chain.h"
#include "gdkv/cache.h"
#include "gdkv/key.h"
#include "gdkv/metrics.h"

namespace gdkv::cache {

// Why a key is fetched ahead (the `source` label of cache_prefetch_issued_total).
enum PrefetchSource : uint8_t { kChain, kHint };

// What the prefetcher asks of the cache it fills. Called with the cache's lock held (the one that
// guards the Prefetcher), so the answers stay true until the caller unlocks.
class PrefetchHost {
 public:
  // Whether `key` is cached or being read already (then there is nothing to fetch).
  virtual bool holds(const NsKey& key) const = 0;
  // Starts a prefetch read of `key`; the cache submits it to the backend after it unlocks.
  virtual void start_prefetch(const NsKey& key) = 0;

 protected:
  ~PrefetchHost() = default;
};

// Chain learning and prefetch for one cache. The cache tells it of every read (learn_read, then
// predict) and Store (learn_store) and of each prefetch read's end (finished); it decides what to
// fetch ahead and starts those reads through a PrefetchHost while at most max_prefetch_inflight
// are outstanding, the rest waiting in a queue of prefetch_queue keys.
//
// Not thread-safe, and has no lock of its own: every member function REQUIRES the cache's lock
// (CachedBackend::mu_, which also guards the entries and flights that PrefetchHost answers for),
// except fetches(), which reads a constant.
class Prefetcher {
 public:
  // `policy_chains`: the eviction policy orders by chains (record_chain), so chains are learned
  // even with readahead off.
  Prefetcher(const CacheOptions& o, bool policy_chains);

  // Whether prefetch reads are made at all (max_prefetch_inflight > 0 and a capacity).
  bool fetches() const { return max_inflight_ != 0; }

  // `key` was read on `stream`: learns that it followed the stream's previous key. Returns whether
  // that is what the chain predicted; then *pred = that previous key (key's chain predecessor, as
  // far as the cache can tell).
  bool learn_read(uint64_t stream, const NsKey& key, NsKey* pred) {
    return learning_ && learn(readahead_of(stream), key, pred);
  }
  // `key` was stored on `stream` (a prefill's Stores teach the order its blocks will be read in).
  // Returns as learn_read; the stream's readahead starts again from `key`.
  bool learn_store(uint64_t stream, const NsKey& key, NsKey* pred);

  // After learn_read said whether the read of `key` `followed` the chain: queues the keys the chain
  // predicts after it and starts what fits. `miss`: the key was not cached.
  void predict(uint64_t stream, const NsKey& key, bool followed, bool miss, PrefetchHost& host) {
    if (depth_ != 0 && max_inflight_ != 0) readahead(stream, key, followed, miss, host);
  }

  // Queues `key` to be fetched ahead, unless it is held, queued already or the queue is full (then
  // it is dropped and counted), and starts queued keys while slots are free.
  // REQUIRES: fetches().
  void fetch(const NsKey& key, PrefetchSource source, PrefetchHost& host);

  // Starts queued keys while slots are free (a queued key held meanwhile is skipped).
  void pump(PrefetchHost& host);

  // A prefetch read finished, which frees its slot. `ok`: it found a value; `kept`: the cache kept
  // that value or a demand read joined the read (if neither, the prefetch was wasted).
  void finished(bool ok, bool kept);

  // A read used a prefetched value (a hit on it, or a read that joined its read in flight).
  void count_used() { ++n_.used; }
  // A prefetched value left the cache (evicted, replaced or dropped) before any read used it.
  void count_wasted() { ++n_.wasted; }
  // A key named by a scheduler hint.
  void count_hint() { ++n_.hints; }

  // Forgets the queued keys (reads in flight run to their end).
  void clear_queue();

  // The prefetch and chain metrics (cache_prefetch_*, cache_hint_keys_total, cache_chain_entries).
  void collect(MetricWriter& w) const;

 private:
  struct Pending {
    NsKey key;
    PrefetchSource source;
  };
  // Per stream: the chain learning and readahead state.
  struct Readahead {
    NsKey last;  // the key the stream read or stored last
    bool has_last = false;
    NsKey frontier;       // the furthest key predicted for it
    uint32_t ahead = 0;   // chain steps from last to frontier
    uint32_t window = 0;  // how far ahead to keep the frontier
  };
  struct Counters {
    uint64_t issued[2] = {}, used = 0, wasted = 0, failed = 0, dropped = 0, hints = 0;
  };

  // A stream's state; the last one asked for is remembered (a queue's commands come in runs), and
  // unordered_map's elements never move.
  Readahead& readahead_of(uint64_t stream) {
    if (last_ra_ == nullptr || last_stream_ != stream) {
      last_ra_ = &readahead_[stream];
      last_stream_ = stream;
    }
    return *last_ra_;
  }
  bool learn(Readahead& ra, const NsKey& key, NsKey* pred);
  void readahead(uint64_t stream, const NsKey& key, bool followed, bool miss, PrefetchHost& host);

  const uint32_t depth_;
  const uint32_t max_inflight_;
  const uint32_t queue_cap_;
  const bool learning_;  // learn chains: for readahead or a policy that orders by them
  ChainTable chain_;
  std::unordered_map<uint64_t, Readahead> readahead_;  // per stream
  Readahead* last_ra_ = nullptr;                       // readahead_of's memory
  uint64_t last_stream_ = 0;
  std::deque<Pending> pending_;
  std::unordered_set<NsKey, NsKeyHash> queued_;  // keys in pending_
  uint32_t inflight_ = 0;                        // prefetch reads started and not finished
  Counters n_;
};

}  // namespace gdkv::cache
