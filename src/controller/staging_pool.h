// A reactor's staging memory: one arena, allocated once when the reactor is made (through
// ControllerOptions::staging_alloc; the GPU runtime passes pinned memory, so a staged copy to or
// from GPU memory is one DMA), handed out to commands in power-of-two blocks by buddy allocation.
// Nothing is allocated per command: a block goes back to the pool when its command finishes.
//
// Thread safety: alloc() and free() may be called from any thread (a mutex; in practice only the
// owning reactor calls them, so it is never contended).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace gdkv {

class StagingPool {
 public:
  static constexpr size_t kMinBlock = 4096;

  // Serves blocks out of [arena, arena + bytes). The arena is not owned.
  // REQUIRES: bytes is a power of two, at least kMinBlock, at most 2^31 * kMinBlock.
  // `region` is the id copies name the arena by (CopySegment::src_region).
  StagingPool(void* arena, size_t bytes, uint64_t region = 0);
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // A block of at least `n` bytes (n rounded up to a power of two, at least kMinBlock), or null
  // when no free block is that large.
  std::byte* alloc(size_t n);
  // REQUIRES: `p` came from alloc() of this pool and was not freed since.
  void free(std::byte* p);

  bool owns(const void* p) const;
  uint64_t region() const { return region_; }
  size_t capacity() const { return bytes_; }
  size_t bytes_in_use() const;
  uint64_t failed_allocs() const;  // alloc() calls that returned null

 private:
  static constexpr uint32_t kNotFree = 0xFFFFFFFF;

  void push(uint32_t block, uint32_t order);
  void remove(uint32_t block, uint32_t order);

  std::byte* arena_;
  size_t bytes_;
  uint64_t region_;
  uint32_t orders_;  // block sizes kMinBlock << 0 .. kMinBlock << (orders_ - 1)
  mutable std::mutex mu_;
  std::vector<std::vector<uint32_t>> free_;  // per order: first min-block index of free blocks
  std::vector<uint32_t> free_pos_;           // per min-block index: its place in free_[order]
  std::vector<uint8_t> free_order_;          // per min-block index: order + 1 of a free block
  std::vector<uint8_t> used_order_;          // per min-block index: order + 1 of an allocated block
  size_t in_use_ = 0;
  uint64_t failed_ = 0;
};

}  // namespace gdkv
