// Chain prediction for prefetch and the prefix policy: which key followed which within a stream
// (a queue), learned from the order of reads and stores (the cache tracks each stream's last key
// and records changes). KV-cache blocks of one prompt are read in chain order, so the key that
// followed block i last time is the best guess for what is read after it next time, and a key
// that follows the key it followed last time is taken for its chain successor.
//
// A fixed table of slots, like a CPU's branch target buffer: a hash of the earlier key picks a set
// of two slots; a new transition takes the set's first slot and moves the one there to the second,
// so of three transitions landing on one set the oldest is forgotten. No allocation after
// construction, one hash and at most two key comparisons per lookup: the cache consults it on
// every read. The slots are zeroed memory from
// calloc, so a table's pages cost nothing until used. Not thread-safe (the cache calls it under
// its lock).
#pragma once

#include <bit>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <type_traits>

#include "cache/policy.h"

namespace gdkv::cache {

class ChainTable {
 public:
  // About `max_entries` slots (rounded up to a power of two, at least 2).
  explicit ChainTable(uint64_t max_entries)
      : sets_(std::bit_ceil(max_entries < 2 ? uint64_t{2} : max_entries) / 2),
        slots_(static_cast<Slot*>(std::calloc(2 * sets_, sizeof(Slot)))) {
    if (!slots_) throw std::bad_alloc();
  }

  // The key that followed `key` last time, or null.
  const NsKey* next(const NsKey& key) const {
    const Slot* set = set_of(key);
    for (int i = 0; i < 2; ++i) {
      if (set[i].used && set[i].from == key) return &set[i].to;
    }
    return nullptr;
  }

  // `to` was requested right after `from` on one stream.
  void record(const NsKey& from, const NsKey& to) {
    Slot* set = set_of(from);
    for (int i = 0; i < 2; ++i) {
      if (set[i].used && set[i].from == from) {
        set[i].to = to;
        return;
      }
    }
    used_ += set[1].used ? 0 : 1;
    set[1] = set[0];
    set[0] = Slot{from, to, true};
  }

  // Slots holding a transition.
  uint64_t size() const { return used_; }

 private:
  struct Slot {
    NsKey from;
    NsKey to;
    bool used;
  };
  // All-zero bytes are an unused slot.
  static_assert(std::is_trivially_copyable_v<Slot> && std::is_trivially_destructible_v<Slot>);
  struct Free {
    void operator()(Slot* p) const { std::free(p); }
  };

  Slot* set_of(const NsKey& k) const { return &slots_[2 * (NsKeyHash{}(k) & (sets_ - 1))]; }

  uint64_t sets_;
  std::unique_ptr<Slot[], Free> slots_;
  uint64_t used_ = 0;
};

}  // namespace gdkv::cache
