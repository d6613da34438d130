// Slab memory for cached values: pages carved from an arena (common/arena.h) into chunks of one
// size class each. Size classes are 2^e * {1, 1.25, 1.5, 1.75} from 64 bytes up, so powers of two
// (typical KV block sizes) fit exactly and no value wastes more than a fifth of its chunk.
//
// The arena's regions come from the allocation hook (pinned memory the GPU can DMA from), or by
// default from anonymous memory with huge pages advised, faulted in once, in steps of
// `arena_step_bytes`. A page whose chunks are all free goes back to the arena, except one spare
// per class, so a class that stops being used frees its pages for the others; neither a page nor
// a region goes back to the hook (or the kernel) until the allocator is destroyed. So a filling
// cache pays for fresh memory once per step, not once per value, and a steady cache (evicting as
// it fills) reuses pages it already faulted in. The arena keeps the high-water mark of the
// slab's pages.
//
// Buffers are reference counted: the last holder (the cache entry, or a view a copy is still
// reading) returns the chunk, on whatever thread it drops it. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "common/arena.h"

namespace gdkv::cache {

class SlabAllocator;
struct SlabPage;

// A value's bytes. `len` is the value's length (the chunk may be larger).
struct Buffer {
  std::byte* data = nullptr;
  size_t len = 0;
  // Where the bytes came from: a slab chunk, or the heap when the slab could not supply one.
  std::shared_ptr<SlabAllocator> owner;
  SlabPage* page = nullptr;
  uint32_t index = 0;
  std::unique_ptr<std::byte[]> heap;

  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();
  bool from_slab() const noexcept { return owner != nullptr; }
};

class SlabAllocator : public std::enable_shared_from_this<SlabAllocator> {
 public:
  using AllocFn = std::function<void*(size_t)>;
  using FreeFn = std::function<void(void*, size_t)>;

  // Null hooks: anonymous memory, prepared (Arena::map_prepared). The hooks are called for arena
  // regions of arena_step_bytes (or a multiple, for a chunk larger than a step). page_bytes is
  // rounded up to a multiple of 4096.
  static std::shared_ptr<SlabAllocator> create(AllocFn alloc, FreeFn free, size_t page_bytes,
                                               size_t arena_step_bytes = kDefaultArenaStep);
  static constexpr size_t kDefaultArenaStep = size_t{64} << 20;
  ~SlabAllocator();

  // A buffer of `n` bytes from the smallest class that fits, or null when the hook failed.
  std::shared_ptr<Buffer> allocate(size_t n);
  // A buffer of `n` bytes on the heap (values the slab can't or shouldn't hold).
  static std::shared_ptr<Buffer> heap_buffer(size_t n);

  // The chunk size serving `n` bytes.
  static size_t chunk_size(size_t n) noexcept;

  uint64_t reserved_bytes() const;  // pages held
  uint64_t chunk_bytes() const;     // chunks handed out
  uint64_t arena_bytes() const;     // arena regions held (faulted in): pages held and free space
  uint64_t arena_growths() const;   // arena regions allocated, ever

 private:
  friend struct Buffer;
  struct Class {
    size_t chunk = 0;
    SlabPage* avail = nullptr;  // pages with a free chunk (doubly linked)
    uint32_t empty_pages = 0;
  };
  SlabAllocator(AllocFn alloc, FreeFn free, size_t page_bytes, size_t arena_step_bytes);
  static uint32_t class_index(size_t n) noexcept;
  void release(SlabPage* page, uint32_t index);
  void push_avail(Class& c, SlabPage* p);
  void pop_avail(Class& c, SlabPage* p);
  void free_page(SlabPage* p);

  Arena arena_;
  size_t page_bytes_;
  mutable std::mutex mu_;
  std::vector<Class> classes_;
  SlabPage* all_ = nullptr;  // every page (singly linked through all_next)
  uint64_t reserved_ = 0;
  uint64_t in_use_ = 0;
};

}  // namespace gdkv::cache
