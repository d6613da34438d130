// Chain prediction for prefetch: which key followed which within a stream (a queue), learned from
// the order of reads and stores (the cache tracks each stream's last key and records changes).
// KV-cache blocks of one prompt are read in chain order, so the key that followed block i last time
// is the best guess for what is read after it next time.
//
// Bounded by two generations: when the current table is full it becomes the old one and the old
// one is dropped, so transitions not seen for a while are forgotten without per-entry LRU
// bookkeeping. Not thread-safe (the cache calls it under its lock).
#pragma once

#include <cstdint>
#include <unordered_map>

#include "cache/policy.h"

namespace gdkv::cache {

class ChainTable {
 public:
  explicit ChainTable(uint64_t max_entries) : half_(max_entries / 2 > 0 ? max_entries / 2 : 1) {}

  // The key that followed `key` last time, or null. `current`: whether the transition is in the
  // newer generation (one in the older is forgotten at the next turnover unless recorded again).
  const CacheKey* next(const CacheKey& key, bool* current = nullptr) const {
    if (auto it = cur_.find(key); it != cur_.end()) {
      if (current != nullptr) *current = true;
      return &it->second;
    }
    if (current != nullptr) *current = false;
    if (auto it = old_.find(key); it != old_.end()) return &it->second;
    return nullptr;
  }

  // `to` was requested right after `from` on one stream.
  void record(const CacheKey& from, const CacheKey& to) {
    if (auto it = cur_.find(from); it != cur_.end()) {
      it->second = to;
      return;
    }
    if (cur_.size() >= half_) {
      old_ = std::move(cur_);
      cur_.clear();
    }
    cur_.emplace(from, to);
  }

  uint64_t size() const { return cur_.size() + old_.size(); }

 private:
  uint64_t half_;
  std::unordered_map<CacheKey, CacheKey, CacheKeyHash> cur_, old_;
};

}  // namespace gdkv::cache
