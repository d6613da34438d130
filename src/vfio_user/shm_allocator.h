// The client driver's allocator over the memory it shares with gdkvd (client_driver.cc).
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <map>
#include <mutex>
#include <unordered_map>

namespace gdkv::vfio_user {

// First-fit allocator over the memory a connection shares with gdkvd (the client driver's
// staging and receive buffers); blocks callers while it is full (bounded wait). Blocks are
// 64-byte aligned multiples of 64 bytes; free() coalesces with the free neighbours.
class ShmAllocator {
 public:
  void init(std::byte* base, size_t size) {
    base_ = base;
    size_ = size;
    free_[0] = size;
  }
  bool contains(const void* p, size_t len) const {
    const auto* b = static_cast<const std::byte*>(p);
    return b >= base_ && b < base_ + size_ && len <= static_cast<size_t>(base_ + size_ - b);
  }
  void* alloc(size_t bytes, size_t align) {
    std::lock_guard lk(mu_);
    return poisoned_ ? nullptr : alloc_locked(bytes, align);
  }
  void* alloc_wait(size_t bytes, size_t align, std::chrono::milliseconds timeout) {
    std::unique_lock lk(mu_);
    if (bytes > size_) return nullptr;
    void* p = nullptr;
    cv_.wait_for(lk, timeout,
                 [&] { return poisoned_ || (p = alloc_locked(bytes, align)) != nullptr; });
    return p;
  }
  // Up to `bytes` (at least `min_bytes`): `bytes` where a free extent holds them, else the
  // largest free extent. With `wait`, waits up to `timeout` for other callers to free some.
  void* alloc_up_to(size_t bytes, size_t min_bytes, bool wait, std::chrono::milliseconds timeout,
                    size_t* got) {
    std::unique_lock lk(mu_);
    void* p = nullptr;
    auto take = [&] {
      if (poisoned_) return true;
      if ((p = alloc_locked(bytes, 64)) != nullptr) {
        *got = bytes;
        return true;
      }
      size_t best = 0;
      for (const auto& [off, len] : free_) {
        const size_t at = align_up(off, 64);
        if (at < off + len) best = std::max(best, (off + len - at) & ~size_t{63});
      }
      if (best == 0 || best < min_bytes) return false;
      p = alloc_locked(best, 64);
      *got = best;
      return true;
    };
    if (min_bytes > size_) return nullptr;
    if (wait) {
      cv_.wait_for(lk, timeout, take);
    } else {
      (void)take();
    }
    if (p == nullptr) *got = 0;
    return p;
  }
  // Gives back all but the first `keep` bytes of what alloc handed out at p.
  void shrink(void* p, size_t keep) {
    {
      std::lock_guard lk(mu_);
      if (poisoned_) return;
      const size_t off = static_cast<size_t>(static_cast<std::byte*>(p) - base_);
      auto u = used_.find(off);
      keep = align_up(std::max<size_t>(keep, 1), 64);
      if (u == used_.end() || keep >= u->second) return;
      size_t start = off + keep, len = u->second - keep;
      u->second = keep;
      auto next = free_.lower_bound(start);
      if (next != free_.end() && next->first == start + len) {
        len += next->second;
        free_.erase(next);
      }
      free_[start] = len;
    }
    cv_.notify_all();
  }
  // The connection failed: commands may still write into memory handed out, so none of it is
  // handed out again (free is a no-op, alloc fails).
  void poison() {
    {
      std::lock_guard lk(mu_);
      poisoned_ = true;
    }
    cv_.notify_all();
  }
  void free(void* p) {
    if (p == nullptr) return;
    {
      std::lock_guard lk(mu_);
      if (poisoned_) return;
      const size_t off = static_cast<size_t>(static_cast<std::byte*>(p) - base_);
      auto u = used_.find(off);
      if (u == used_.end()) return;
      size_t start = off, len = u->second;
      used_.erase(u);
      // Coalesce with the free neighbours.
      auto next = free_.lower_bound(start);
      if (next != free_.end() && next->first == start + len) {
        len += next->second;
        next = free_.erase(next);
      }
      if (next != free_.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == start) {
          start = prev->first;
          len += prev->second;
          free_.erase(prev);
        }
      }
      free_[start] = len;
    }
    cv_.notify_all();
  }

 private:
  static size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

  void* alloc_locked(size_t bytes, size_t align) {
    bytes = align_up(std::max<size_t>(bytes, 1), 64);
    align = std::max<size_t>(align, 64);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      const size_t off = it->first, len = it->second;
      const size_t at = align_up(off, align);
      if (at + bytes > off + len) continue;
      free_.erase(it);
      if (at > off) free_[off] = at - off;
      if (at + bytes < off + len) free_[at + bytes] = off + len - at - bytes;
      used_[at] = bytes;
      return base_ + at;
    }
    return nullptr;
  }

  std::byte* base_ = nullptr;
  size_t size_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool poisoned_ = false;
  std::map<size_t, size_t> free_;            // offset -> length
  std::unordered_map<size_t, size_t> used_;  // offset -> length
};

}  // namespace gdkv::vfio_user
