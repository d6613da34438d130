#include "common/arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cstring>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older headers lack the name
#endif

namespace gdkv {

namespace {
constexpr size_t kPage = 4096;
constexpr size_t kHugePage = size_t{2} << 20;
// Tries to place a request before giving up: another thread may take a region just grown.
constexpr int kGrowTries = 4;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
}  // namespace

void* Arena::map_prepared(size_t bytes) {
  bytes = round_up(bytes, kPage);
  // Huge-page aligned, so the whole region can be backed by 2 MiB pages.
  const size_t slack = bytes >= kHugePage ? kHugePage : 0;
  void* m =
      ::mmap(nullptr, bytes + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  auto* base = static_cast<std::byte*>(m);
  if (slack != 0) {
    auto* aligned =
        reinterpret_cast<std::byte*>(round_up(reinterpret_cast<uintptr_t>(base), kHugePage));
    if (aligned != base) ::munmap(base, static_cast<size_t>(aligned - base));
    const size_t tail = static_cast<size_t>(base + bytes + slack - (aligned + bytes));
    if (tail != 0) ::munmap(aligned + bytes, tail);
    base = aligned;
    // Advice only: a kernel with THP off (or "never") keeps 4 KiB pages.
    (void)::madvise(base, bytes, MADV_HUGEPAGE);
  }
  if (::madvise(base, bytes, MADV_POPULATE_WRITE) != 0) {
    // Kernels before 5.14: fault every page in by writing it.
    for (size_t off = 0; off < bytes; off += kPage) {
      *reinterpret_cast<volatile std::byte*>(base + off) = std::byte{0};
    }
  }
  return base;
}

void Arena::unmap(void* p, size_t bytes) { ::munmap(p, round_up(bytes, kPage)); }

Arena::Arena(Options o)
    : step_(round_up(std::max<size_t>(o.step_bytes, kPage), kPage)),
      first_step_(std::min(step_, round_up(std::max<size_t>(o.first_step_bytes, kPage), kPage))),
      limit_(round_up(o.limit_bytes, kPage)),
      align_(std::clamp<size_t>(std::bit_ceil(std::max<size_t>(o.align, 1)), 1, kPage)),
      alloc_(std::move(o.alloc)),
      free_(std::move(o.free)) {
  if (!alloc_ || !free_) {
    alloc_ = &Arena::map_prepared;
    free_ = &Arena::unmap;
  }
}

Arena::~Arena() {
  // Every extent should be back by now; the regions go regardless (the owner outlives its users).
  for (const Region& r : regions_) {
    if (r.bytes != 0) free_(r.base, r.bytes);
  }
}

void Arena::remove_free_locked(std::map<std::byte*, Extent>::iterator it) {
  free_by_size_.erase({it->second.bytes, it->first});
  free_by_addr_.erase(it);
}

void Arena::add_free_locked(std::byte* p, size_t bytes, uint32_t region) {
  auto next = free_by_addr_.find(p + bytes);
  if (next != free_by_addr_.end() && next->second.region == region) {
    bytes += next->second.bytes;
    remove_free_locked(next);
  }
  auto prev = free_by_addr_.lower_bound(p);
  if (prev != free_by_addr_.begin()) {
    --prev;
    if (prev->first + prev->second.bytes == p && prev->second.region == region) {
      p = prev->first;
      bytes += prev->second.bytes;
      remove_free_locked(prev);
    }
  }
  free_by_addr_.emplace(p, Extent{bytes, region});
  free_by_size_.emplace(bytes, p);
}

void* Arena::take_locked(size_t n) {
  auto fit = free_by_size_.lower_bound({n, nullptr});
  if (fit == free_by_size_.end()) return nullptr;
  auto it = free_by_addr_.find(fit->second);
  std::byte* p = it->first;
  const Extent e = it->second;
  remove_free_locked(it);
  if (e.bytes > n) add_free_locked(p + n, e.bytes - n, e.region);
  used_ += n;
  return p;
}

void* Arena::allocate(size_t n) {
  const size_t need = round(n);
  // n near SIZE_MAX: its rounding, or a region's rounding up to the step, would wrap.
  if (need < n || need > SIZE_MAX - step_) return nullptr;
  std::unique_lock lk(mu_);
  for (int attempt = 0; attempt < kGrowTries; ++attempt) {
    if (void* p = take_locked(need)) return p;
    const size_t grow =
        std::clamp<size_t>(round_up(reserved_ + growing_, kPage), first_step_, step_);
    size_t bytes = std::max(grow, round_up(need, need > step_ ? step_ : grow));
    std::vector<Region> drop;
    if (limit_ != 0) {
      uint64_t room = limit_ - std::min<uint64_t>(limit_, reserved_ + growing_);
      // The sizes asked for changed (a value larger than any free extent): whole free regions
      // go back so a region that fits can be made. Rare, and never page by page.
      for (auto r = regions_.begin(); r != regions_.end() && room < need; ++r) {
        if (r->bytes == 0) continue;
        auto it = free_by_addr_.find(r->base);
        if (it == free_by_addr_.end() || it->second.bytes != r->bytes) continue;
        remove_free_locked(it);
        region_by_base_.erase(r->base);
        reserved_ -= r->bytes;
        room += r->bytes;
        drop.push_back(*r);
        *r = Region{};
      }
      if (room < need) {
        lk.unlock();
        for (const Region& r : drop) free_(r.base, r.bytes);
        return nullptr;
      }
      bytes = static_cast<size_t>(std::min<uint64_t>(bytes, room));
    }
    growing_ += bytes;
    lk.unlock();
    for (const Region& r : drop) free_(r.base, r.bytes);
    void* mem = alloc_(bytes);
    lk.lock();
    growing_ -= bytes;
    if (mem == nullptr) return nullptr;
    auto slot = std::find_if(regions_.begin(), regions_.end(),
                             [](const Region& r) { return r.bytes == 0; });
    if (slot == regions_.end()) slot = regions_.insert(slot, Region{});
    *slot = Region{static_cast<std::byte*>(mem), bytes};
    const auto index = static_cast<uint32_t>(slot - regions_.begin());
    region_by_base_.emplace(slot->base, index);
    reserved_ += bytes;
    ++grown_;
    add_free_locked(slot->base, bytes, index);
  }
  return take_locked(need);
}

void Arena::release(void* p, size_t n) {
  if (p == nullptr) return;
  const size_t need = round(n);
  auto* b = static_cast<std::byte*>(p);
  std::lock_guard lk(mu_);
  auto r = region_by_base_.upper_bound(b);
  --r;  // the region holding b (REQUIRES: b came from this arena)
  used_ -= need;
  add_free_locked(b, need, r->second);
}

uint64_t Arena::reserved_bytes() const {
  std::lock_guard lk(mu_);
  return reserved_;
}

uint64_t Arena::used_bytes() const {
  std::lock_guard lk(mu_);
  return used_;
}

uint64_t Arena::regions_allocated() const {
  std::lock_guard lk(mu_);
  return grown_;
}

}  // namespace gdkv
