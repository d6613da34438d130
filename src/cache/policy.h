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
// Policies: "prefix" (the cache's default, prefix_policy.cc: probation and protected segments, a
// history of evicted keys, chains evicted from their tails, a hill-climbed probation share);
// "lru"; "lru-k" (O'Neil's LRU-K with history and a correlated-reference window); "arc" (Megiddo
// and Modha's ARC, in bytes); "adaptive" (runs LRU, LRU-2 and ARC side by side on shadow copies of
// the key stream and evicts as the one that has been hitting most lately does).
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

#include "gdkv/key.h"
#include "gdkv/metrics.h"

namespace gdkv::cache {

// A key in one namespace.
static_assert(std::endian::native == std::endian::little, "CacheKey's compare assumes it");
struct CacheKey {
  uint32_t nsid = 0;
  Key key;
  // Only the key's `len` bytes count, as in Key's operator==; done with two masked 8-byte
  // compares instead of a call to memcmp (the cache compares keys several times per request).
  friend bool operator==(const CacheKey& a, const CacheKey& b) noexcept {
    if (a.nsid != b.nsid || a.key.len != b.key.len) return false;
    static_assert(sizeof(a.key.bytes) == 16);
    uint64_t a0, a1, b0, b1;
    std::memcpy(&a0, a.key.bytes, 8);
    std::memcpy(&a1, a.key.bytes + 8, 8);
    std::memcpy(&b0, b.key.bytes, 8);
    std::memcpy(&b1, b.key.bytes + 8, 8);
    const unsigned n = a.key.len < 16 ? a.key.len : 16;
    // Little-endian byte i is bits 8i..8i+7: keep the first n bytes.
    const uint64_t m0 = n >= 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * n)) - 1;
    const uint64_t m1 = n >= 16 ? ~uint64_t{0} : n <= 8 ? 0 : (uint64_t{1} << (8 * (n - 8))) - 1;
    return (((a0 ^ b0) & m0) | ((a1 ^ b1) & m1)) == 0;
  }
};

// Inline and cheap (the cache hashes a key several times per request); only the key's `len`
// bytes count, as in Key's operator==.
struct CacheKeyHash {
  size_t operator()(const CacheKey& k) const noexcept {
    uint8_t b[16] = {};
    std::memcpy(b, k.key.bytes, k.key.len < 16 ? k.key.len : 16);
    uint64_t lo, hi;
    std::memcpy(&lo, b, 8);
    std::memcpy(&hi, b + 8, 8);
    uint64_t h = lo * 0x9E3779B97F4A7C15ull;
    h ^= (hi ^ (uint64_t{k.nsid} << 8 | k.key.len)) * 0xC2B2AE3D27D4EB4Full;
    h ^= h >> 33;  // murmur3's finalizer: every input bit reaches the low (bucket) bits
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ull;
    return h ^ (h >> 33);
  }
};

// A test and benchmark helper: key number `id` in namespace 1.
inline CacheKey numbered_key(uint64_t id) noexcept {
  CacheKey k;
  k.nsid = 1;
  k.key = Key::from_bytes(&id, sizeof(id));
  return k;
}

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
  virtual void prepare_insert(const CacheKey& key, uint64_t size, AddKind kind) {
    (void)key, (void)size, (void)kind;
  }
  // REQUIRES: key not resident.
  virtual void add(const CacheKey& key, uint64_t size, uint64_t now, AddKind kind) = 0;
  // A hit (or an overwrite) of a resident key, now `size` bytes. REQUIRES: key resident.
  virtual void record_access(const CacheKey& key, uint64_t size, uint64_t now) = 0;
  // Forgets a resident key (deleted or invalidated); no-op if not resident.
  virtual void remove(const CacheKey& key) = 0;
  // Removes the entry that should go next and remembers it in the history of evicted keys.
  // False when nothing is resident.
  virtual bool evict(CacheKey* victim) = 0;
  // `key` (resident, just added or accessed) was read right after `pred`, its predecessor in a
  // chain (a prefix hit on key needs pred cached). Policies that know chains order by it; no-op
  // for the others, and when either key is not resident.
  virtual void record_chain(const CacheKey& key, const CacheKey& pred) { (void)key, (void)pred; }
  // Whether record_chain does anything (the cache learns chains only for a policy that uses them
  // or for prefetch).
  virtual bool uses_chains() const { return false; }
  // Evicts `key` as if this policy had chosen it (it enters the history): lets a policy follow
  // another's choices. No-op if not resident.
  virtual void evict_key(const CacheKey& key) = 0;

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
  // Adaptive, for tests and experiments: always follow this expert ("arc", "lru-k" or "lru").
  std::string pin_expert;
  // Prefix, for tests and experiments: a fixed probation share of the capacity in (0, 1] instead
  // of the hill-climbed one (0). Its history_entries: evicted keys remembered (0 = twice the
  // resident entries).
  double probation_share = 0;
};

inline constexpr uint32_t kMaxK = 8;

// "prefix", "lru", "lru-k", "arc" or "adaptive"; null for an unknown name or k outside 1..kMaxK.
std::unique_ptr<EvictionPolicy> make_policy(std::string_view name, const PolicyOptions& options);
std::unique_ptr<EvictionPolicy> make_prefix_policy(const PolicyOptions& options);

}  // namespace gdkv::cache
