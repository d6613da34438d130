// Slab memory for cached values: pages from an allocation hook (host heap, or pinned memory the
// GPU can DMA from) carved into chunks of one size class each. Size classes are 2^e * {1, 1.25,
// 1.5, 1.75} from 64 bytes up, so powers of two (typical KV block sizes) fit exactly and no value
// wastes more than a fifth of its chunk. A page whose chunks are all free goes back to the hook,
// except one spare per class, so memory follows the cached bytes and a pinned-memory hook (slow)
// is not called on every fill.
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

  // Null hooks: the host heap (4096-aligned). page_bytes is rounded up to a multiple of 4096.
  static std::shared_ptr<SlabAllocator> create(AllocFn alloc, FreeFn free, size_t page_bytes);
  ~SlabAllocator();

  // A buffer of `n` bytes from the smallest class that fits, or null when the hook failed.
  std::shared_ptr<Buffer> allocate(size_t n);
  // A buffer of `n` bytes on the heap (values the slab can't or shouldn't hold).
  static std::shared_ptr<Buffer> heap_buffer(size_t n);

  // The chunk size serving `n` bytes.
  static size_t chunk_size(size_t n) noexcept;

  uint64_t reserved_bytes() const;  // pages held
  uint64_t chunk_bytes() const;     // chunks handed out

 private:
  friend struct Buffer;
  struct Class {
    size_t chunk = 0;
    SlabPage* avail = nullptr;  // pages with a free chunk (doubly linked)
    uint32_t empty_pages = 0;
  };
  SlabAllocator(AllocFn alloc, FreeFn free, size_t page_bytes);
  static uint32_t class_index(size_t n) noexcept;
  void release(SlabPage* page, uint32_t index);
  void push_avail(Class& c, SlabPage* p);
  void pop_avail(Class& c, SlabPage* p);
  void free_page(SlabPage* p);

  AllocFn alloc_;
  FreeFn free_;
  size_t page_bytes_;
  mutable std::mutex mu_;
  std::vector<Class> classes_;
  SlabPage* all_ = nullptr;  // every page (singly linked through all_next)
  uint64_t reserved_ = 0;
  uint64_t in_use_ = 0;
};

}  // namespace gdkv::cache
