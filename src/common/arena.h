// Value memory prepared ahead of use: regions (growing from 2 MiB to `step_bytes`, 64 MiB by
// default) are allocated and faulted in once (anonymous memory with transparent huge pages where
// the kernel gives them, and MADV_POPULATE_WRITE, or a touch of every page on kernels without it),
// then carved into extents. A released extent goes back to the arena's free list, merged with its
// free neighbours; nothing is returned to the kernel on the hot path. A region goes back (to the
// free hook) only when a request could otherwise not be placed within limit_bytes and that whole
// region is free, or when the arena is destroyed.
//
// Why: a store that allocates every value anew makes the kernel fault in and zero fresh pages for
// each one (512 faults per 2 MiB value with 4 KiB pages), which held gdkvd's put to a third of a
// store that writes into a segment faulted in once.
//
// Thread-safe. The hooks run without the arena's lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

namespace gdkv {

class Arena {
 public:
  using AllocFn = std::function<void*(size_t bytes)>;
  using FreeFn = std::function<void(void* p, size_t bytes)>;
  struct Options {
    // Bytes per region: the first is first_step_bytes (default 2 MiB), each next one as large as
    // all before it, up to step_bytes (default 64 MiB); a larger request gets a region of its
    // own. So an arena that holds little prepares little (the first Store into an empty store
    // faults in 2 MiB, not 64), and one that holds much grows in 64 MiB steps.
    size_t step_bytes = size_t{64} << 20;
    size_t first_step_bytes = size_t{2} << 20;
    uint64_t limit_bytes = 0;  // region bytes held at most (0: no limit)
    size_t align = 64;         // extent alignment, a power of two, at most 4096
    // Regions: allocate `bytes` (4096-aligned) and free them; both or neither. Null: anonymous
    // memory, huge pages advised, faulted in before use (prepare_region).
    AllocFn alloc;
    FreeFn free;
  };

  explicit Arena(Options o);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // An extent of at least `n` bytes (n == 0 counts as 1), aligned to `align`; null when it fits in
  // no free extent and a new region would pass limit_bytes (or the hook failed).
  void* allocate(size_t n);
  // REQUIRES: `p` came from allocate(n) with this `n` and is not yet released.
  void release(void* p, size_t n);

  uint64_t reserved_bytes() const;     // region bytes held
  uint64_t used_bytes() const;         // extent bytes handed out (rounded up to `align`)
  uint64_t regions_allocated() const;  // hook calls that succeeded, ever (growth steps)

  // The default region hook: anonymous memory, MADV_HUGEPAGE, faulted in. Null on failure.
  static void* map_prepared(size_t bytes);
  static void unmap(void* p, size_t bytes);

 private:
  struct Extent {
    size_t bytes;
    uint32_t region;
  };
  struct Region {
    std::byte* base = nullptr;
    size_t bytes = 0;  // 0: slot unused (the region went back)
  };
  size_t round(size_t n) const { return ((n == 0 ? 1 : n) + align_ - 1) & ~(align_ - 1); }
  // REQUIRES: mu_ held. Carves `n` from the best-fitting free extent; null if none fits.
  void* take_locked(size_t n);
  void add_free_locked(std::byte* p, size_t bytes, uint32_t region);
  void remove_free_locked(std::map<std::byte*, Extent>::iterator it);

  const size_t step_;
  const size_t first_step_;
  const uint64_t limit_;
  const size_t align_;
  AllocFn alloc_;
  FreeFn free_;

  mutable std::mutex mu_;
  std::vector<Region> regions_;
  std::map<std::byte*, uint32_t> region_by_base_;
  std::map<std::byte*, Extent> free_by_addr_;
  std::set<std::pair<size_t, std::byte*>> free_by_size_;  // best fit: smallest that holds n
  uint64_t reserved_ = 0;
  uint64_t used_ = 0;
  uint64_t grown_ = 0;
  uint64_t growing_ = 0;  // bytes of regions being allocated outside the lock
};

}  // namespace gdkv
