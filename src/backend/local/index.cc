#include "backend/local/index.h"

#include <xxhash.h>

#include <cstring>

namespace gdkv::local {

namespace {
constexpr size_t kInitialSlots = 1024;

bool same(const Index::Slot& s, uint32_t nsid, const Key& key) noexcept {
  return s.key_len == key.len && s.nsid == nsid && std::memcmp(s.key, key.bytes, key.len) == 0;
}
}  // namespace

Index::Index() : slots_(kInitialSlots), mask_(kInitialSlots - 1) {}

size_t Index::probe_start(uint32_t nsid, const Key& key) const noexcept {
  return static_cast<size_t>(XXH3_64bits_withSeed(key.bytes, key.len, nsid)) & mask_;
}

size_t Index::find_slot(uint32_t nsid, const Key& key) const noexcept {
  for (size_t i = probe_start(nsid, key);; i = (i + 1) & mask_) {
    const Slot& s = slots_[i];
    if (s.key_len == 0) return npos;
    if (same(s, nsid, key)) return i;
  }
}

const Location* Index::find(uint32_t nsid, const Key& key) const noexcept {
  const size_t i = find_slot(nsid, key);
  return i == npos ? nullptr : &slots_[i].loc;
}

bool Index::upsert(uint32_t nsid, const Key& key, const Location& loc, Location* old) {
  // Grow before probing so the slot found stays valid; 70% keeps linear probes short.
  if ((size_ + 1) * 10 > slots_.size() * 7) grow();
  for (size_t i = probe_start(nsid, key);; i = (i + 1) & mask_) {
    Slot& s = slots_[i];
    if (s.key_len == 0) {
      s.nsid = nsid;
      s.key_len = key.len;
      std::memcpy(s.key, key.bytes, sizeof(s.key));
      s.loc = loc;
      ++size_;
      return false;
    }
    if (same(s, nsid, key)) {
      if (old != nullptr) *old = s.loc;
      s.loc = loc;
      return true;
    }
  }
}

bool Index::erase(uint32_t nsid, const Key& key, Location* old) noexcept {
  size_t hole = find_slot(nsid, key);
  if (hole == npos) return false;
  if (old != nullptr) *old = slots_[hole].loc;
  // Backward-shift: pull later members of the probe run into the hole so lookups never need
  // tombstones. An entry may move into the hole only if the hole lies on its probe path.
  for (size_t j = (hole + 1) & mask_;; j = (j + 1) & mask_) {
    Slot& s = slots_[j];
    if (s.key_len == 0) break;
    const size_t home =
        probe_start(s.nsid, Key::from_bytes(s.key, s.key_len));  // where s's probe began
    const bool hole_on_path = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
    if (hole_on_path) {
      slots_[hole] = s;
      hole = j;
    }
  }
  slots_[hole].key_len = 0;
  --size_;
  return true;
}

void Index::grow() {
  std::vector<Slot> old(slots_.size() * 2);
  old.swap(slots_);
  mask_ = slots_.size() - 1;
  size_ = 0;
  for (const Slot& s : old) {
    if (s.key_len != 0) upsert(s.nsid, Key::from_bytes(s.key, s.key_len), s.loc, nullptr);
  }
}

}  // namespace gdkv::local
