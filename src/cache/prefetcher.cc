// The host cache's prefetcher (see prefetcher.h): chain learning, readahead along learned chains
// and the prefetch queue. Every function here runs under the cache's lock.
#include "cache/prefetcher.h"

#include <algorithm>

namespace gdkv::cache {

Prefetcher::Prefetcher(const CacheOptions& o, bool policy_chains)
    : depth_(o.prefetch_depth),
      max_inflight_(o.capacity_bytes == 0 ? 0 : o.max_prefetch_inflight),
      queue_cap_(o.prefetch_queue),
      learning_(depth_ != 0 || policy_chains),
      chain_(o.chain_entries) {}

bool Prefetcher::learn_store(uint64_t stream, const NsKey& key, NsKey* pred) {
  if (!learning_) return false;
  Readahead& ra = readahead_of(stream);
  const bool followed = learn(ra, key, pred);
  ra.ahead = 0;
  return followed;
}

bool Prefetcher::learn(Readahead& ra, const NsKey& key, NsKey* pred) {
  bool followed = false;
  if (ra.has_last && !(ra.last == key)) {
    const NsKey* next = chain_.next(ra.last);
    followed = next != nullptr && *next == key;
    if (followed) {
      *pred = ra.last;
    } else {
      chain_.record(ra.last, key);
    }
  }
  ra.last = key;
  ra.has_last = true;
  return followed;
}

// Like a file system's readahead: while the reader follows the predicted chain the window of keys
// fetched ahead doubles, up to depth_; when it jumps elsewhere the window closes (to one key if the
// read missed, as a chain may start there), so random hits cost no chain walk and a sequential
// reader one step per block.
void Prefetcher::readahead(uint64_t stream, const NsKey& key, bool followed, bool miss,
                           PrefetchHost& host) {
  Readahead& ra = readahead_of(stream);
  if (followed) {
    ra.window = std::min(depth_, std::max(1u, ra.window * 2));
  } else {
    ra.window = miss ? 1 : 0;
    ra.ahead = 0;
  }
  if (ra.ahead > 0) {
    --ra.ahead;  // the reader moved one step towards the frontier
  } else {
    ra.frontier = key;
  }
  while (ra.ahead < ra.window) {
    const NsKey* next = chain_.next(ra.frontier);
    if (next == nullptr || *next == key) break;
    ra.frontier = *next;
    ++ra.ahead;
    fetch(ra.frontier, kChain, host);
  }
}

void Prefetcher::fetch(const NsKey& key, PrefetchSource source, PrefetchHost& host) {
  if (!(host.holds(key) || queued_.contains(key))) {
    if (pending_.size() >= queue_cap_) {
      ++n_.dropped;
    } else {
      pending_.push_back(Pending{key, source});
      queued_.insert(key);
    }
  }
  pump(host);  // the queue holds only what waits for a slot
}

void Prefetcher::pump(PrefetchHost& host) {
  while (inflight_ < max_inflight_ && !pending_.empty()) {
    const Pending p = pending_.front();
    pending_.pop_front();
    queued_.erase(p.key);
    if (host.holds(p.key)) continue;
    ++n_.issued[p.source];
    ++inflight_;
    host.start_prefetch(p.key);
  }
}

void Prefetcher::finished(bool ok, bool kept) {
  --inflight_;
  if (!ok) {
    ++n_.failed;
  } else if (!kept) {
    ++n_.wasted;
  }
}

void Prefetcher::clear_queue() {
  pending_.clear();
  queued_.clear();
}

void Prefetcher::collect(MetricWriter& w) const {
  auto d = [](uint64_t v) { return static_cast<double>(v); };
  w.counter("cache_prefetch_issued_total", "prefetch reads sent to the backend",
            d(n_.issued[kChain]), {{"source", "chain"}});
  w.counter("cache_prefetch_issued_total", "prefetch reads sent to the backend",
            d(n_.issued[kHint]), {{"source", "hint"}});
  w.counter("cache_prefetch_used_total", "prefetched values a read used (or joined in flight)",
            d(n_.used));
  w.counter("cache_prefetch_wasted_total", "prefetched values evicted or dropped unused",
            d(n_.wasted));
  w.counter("cache_prefetch_failed_total", "prefetch reads that found no value or failed",
            d(n_.failed));
  w.counter("cache_prefetch_dropped_total", "prefetch keys dropped because the queue was full",
            d(n_.dropped));
  w.counter("cache_hint_keys_total", "keys named by scheduler hints", d(n_.hints));
  const uint64_t issued = n_.issued[kChain] + n_.issued[kHint];
  w.gauge("cache_prefetch_accuracy", "prefetch used / issued since start",
          issued ? d(n_.used) / d(issued) : 0.0);
  w.gauge("cache_prefetch_inflight", "prefetch reads outstanding", d(inflight_));
  w.gauge("cache_prefetch_queued", "prefetch keys waiting for a slot", d(pending_.size()));
  w.gauge("cache_chain_entries", "learned key-to-next-key transitions", d(chain_.size()));
}

}  // namespace gdkv::cache
