// The local store's in-memory index: (namespace, key) → where the value lives.
//
// An open-addressing hash table with linear probing and backward-shift deletion (no tombstones,
// so probe lengths stay short under churn). One slot is 44 bytes and holds everything a Get needs,
// the value's checksum included, so a Get reads only the value's own blocks. The table never
// shrinks; it doubles at 70% load.
//
// Thread safety: none. The store's I/O thread owns the index.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "gdkv/key.h"

namespace gdkv::local {

struct Location {
  uint32_t segment = 0;
  uint32_t offset = 0;  // of the value's first byte, within the segment
  uint32_t length = 0;
  uint32_t checksum_lo = 0;  // XXH3-64 of the value, split so a slot packs to 4-byte alignment
  uint32_t checksum_hi = 0;

  uint64_t checksum() const noexcept { return uint64_t{checksum_hi} << 32 | checksum_lo; }
  void set_checksum(uint64_t c) noexcept {
    checksum_lo = static_cast<uint32_t>(c);
    checksum_hi = static_cast<uint32_t>(c >> 32);
  }
};

class Index {
 public:
  struct Slot {
    uint32_t nsid;
    uint8_t key_len;  // 0: empty slot
    uint8_t key[nvme::kMaxKeyLength];
    uint8_t pad[3];
    Location loc;
  };
  static_assert(sizeof(Slot) == 44);

  Index();

  // nullptr when absent. The pointer is valid until the next insert or erase.
  const Location* find(uint32_t nsid, const Key& key) const noexcept;
  // Inserts or replaces; returns the location it replaced, if any.
  bool upsert(uint32_t nsid, const Key& key, const Location& loc, Location* old);
  // Removes; returns whether the key was present (and its location in *old).
  bool erase(uint32_t nsid, const Key& key, Location* old) noexcept;

  // Calls f(nsid, key, loc) for every entry, in table order. f must not modify the index.
  template <class F>
  void for_each(F&& f) const {
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      if (s.key_len != 0) f(s.nsid, Key::from_bytes(s.key, s.key_len), s.loc);
    }
  }

  size_t size() const noexcept { return size_; }
  // Bytes the table itself occupies (what the index costs per key, reported by the store).
  size_t memory_bytes() const noexcept { return slots_.size() * sizeof(Slot); }

 private:
  size_t probe_start(uint32_t nsid, const Key& key) const noexcept;
  size_t find_slot(uint32_t nsid, const Key& key) const noexcept;  // slot index or npos
  void grow();

  static constexpr size_t npos = ~size_t{0};
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

}  // namespace gdkv::local
