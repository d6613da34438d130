// Eviction policies of the host cache, behind one small interface so LRU, LRU-K and the adaptive
// default can be swapped and compared (the cache, the property tests and bench/cache use them).
//
// Time is whatever the caller says it is: a strictly increasing tick per call that carries `now`
// (the cache uses nanoseconds, the trace benchmark the reference index). Sizes are value bytes.
// A policy only orders keys; the cache owns the values and calls back in this order:
//   hit:   record_access
//   miss:  prepare_insert, evict (until the value fits), add
//   gone:  remove (deleted or invalidated: forgotten, no history)
//   chain: record_chain, after the hit or add of a key read right after its chain predecessor
// Policies: "adaptive" (the cache's default: runs prefix, LRU, LRU-2, ARC and S3-FIFO side by side
// on shadow copies of the key stream and evicts as the one that has been hitting most lately
// does); "prefix" (prefix_policy.cc: probation and protected segments, a history of evicted keys,
// chains evicted from their tails, a hill-climbed probation share); "lru"; "lru-k" (O'Neil's LRU-K
// with history and a correlated-reference window); "arc" (Megiddo and Modha's ARC, in bytes);
// "s3-fifo" (Yang et al.'s S3-FIFO, in bytes).
//
// Not thread-safe: the cache calls it under its lock.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gdkv/key.h"
#include "gdkv/metrics.h"

namespace gdkv::cache {

enum class AddKind : uint8_t {
  kDemand,    // a miss that a request waits for (or a Store): counts as a reference
  kPrefetch,  // fetched ahead: not a reference yet; its first record_access is its first one
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual const char* name() const = 0;

  // `key` (not resident) will be added with `size` bytes once room is made: called before the
  // evictions for it, so a policy can consult its history of evicted keys first (the adaptive
  // policy moves its recency/frequency split here, as ARC does on a ghost hit).
  virtual void prepare_insert(const NsKey& key, uint64_t size, AddKind kind) {
    (void)key, (void)size, (void)kind;
  }
  // REQUIRES: key not resident.
  virtual void add(const NsKey& key, uint64_t size, uint64_t now, AddKind kind) = 0;
  // A hit (or an overwrite) of a resident key, now `size` bytes. REQUIRES: key resident.
  virtual void record_access(const NsKey& key, uint64_t size, uint64_t now) = 0;
  // Forgets a resident key (deleted or invalidated); no-op if not resident.
  virtual void remove(const NsKey& key) = 0;
  // Removes the entry that should go next and remembers it in the history of evicted keys.
  // False when nothing is resident.
  virtual bool evict(NsKey* victim) = 0;
  // `key` (resident, just added or accessed) was read right after `pred`, its predecessor in a
  // chain (a prefix hit on key needs pred cached). Policies that know chains order by it; no-op
  // for the others, and when either key is not resident.
  virtual void record_chain(const NsKey& key, const NsKey& pred) { (void)key, (void)pred; }
  // Whether record_chain does anything (the cache learns chains only for a policy that uses them
  // or for prefetch).
  virtual bool uses_chains() const { return false; }
  // Evicts `key` as if this policy had chosen it (it enters the history): lets a policy follow
  // another's choices. No-op if not resident.
  virtual void evict_key(const NsKey& key) = 0;

  virtual size_t entries() const = 0;
  // Policy-specific gauges (e.g. the adaptive split), names without the gdkv_ prefix.
  virtual void collect(MetricList& out) const { (void)out; }
};

struct PolicyOptions {
  uint64_t capacity_bytes = 0;   // the cache's capacity (the adaptive policy sizes its parts by it)
  uint32_t k = 2;                // LRU-K's K, 1..kMaxK
  uint64_t history_entries = 0;  // LRU-K: evicted keys remembered; 0 = as many as resident
  uint64_t correlated_window = 0;  // ticks: a reference this close to the previous one is the same
                                   // burst
  // Adaptive: about how many entries the cache will hold (0: unknown). Its shadow caches then
  // follow only a sample of the keys (one in 2^n, with capacity scaled alike) of at least ~8192
  // entries, which estimates each expert's hit ratio well at a fraction of the cost.
  uint64_t expected_entries = 0;
  // Adaptive, for tests and experiments: always follow this expert ("arc", "lru-k", "lru" or
  // "s3-fifo").
  std::string pin_expert;
  // Prefix, for tests and experiments: a fixed probation share of the capacity in (0, 1] instead
  // of the hill-climbed one (0). Its history_entries: evicted keys remembered (0 = twice the
  // resident entries).
  double probation_share = 0;
};

inline constexpr uint32_t kMaxK = 8;

// Scheduler hints (docs/cache.md, "Scheduler hints"): a decorator over any policy. A hinted key
// the inner policy chooses to evict is kept in a protected set instead, until it is read (then it
// returns to the inner policy as a reference to a remembered key), until its hint ages out, or
// until the protected set would exceed its share of the capacity. Aged-out protected keys go
// first. Memory is bounded: at most max_hints hints (resident or not) are remembered, the oldest
// dropped first. A hint for a key that is not resident changes no eviction.
struct HintOptions {
  uint64_t capacity_bytes = 0;  // the cache's capacity in bytes
  uint64_t max_hints = 65536;   // hinted keys remembered, default 64 Ki; more push out the oldest
  uint64_t ttl = 0;             // ticks a hint lasts (the cache: ns); 0 = until read or pushed out
  double max_share = 0.5;       // protected bytes at most this share of the capacity, default 0.5
};

class HintedPolicy : public EvictionPolicy {
 public:
  // `key` will be read soon: hints given later are read later. `size`: its bytes if it is
  // resident, else 0 (a later add tells).
  virtual void hint(const NsKey& key, uint64_t size, uint64_t now) = 0;
  virtual bool hinted(const NsKey& key) const = 0;
  virtual uint64_t hints() const = 0;            // hints remembered (<= max_hints)
  virtual uint64_t protected_bytes() const = 0;  // resident bytes kept only by hints
};

std::unique_ptr<HintedPolicy> make_hinted_policy(std::unique_ptr<EvictionPolicy> inner,
                                                 const HintOptions& options);

// The policy called `name` (one of policy_names()); null for an unknown name or k outside
// 1..kMaxK.
std::unique_ptr<EvictionPolicy> make_policy(std::string_view name, const PolicyOptions& options);
// Every policy's name, in the order the docs list them (the one list: cache_policies() too).
std::vector<std::string> policy_names();
std::unique_ptr<EvictionPolicy> make_prefix_policy(const PolicyOptions& options);

}  // namespace gdkv::cache
