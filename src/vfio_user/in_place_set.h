// The memory a client driver connection shares with gdkvd in place (VfioUserDevice::share).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <utility>
#include <vector>

namespace gdkv::vfio_user {

// This connection's DMA maps of memory shared in place (VfioUserDevice::share): disjoint
// segments by address, each counting the shares that cover it. Shares may overlap (a buffer
// inside another, two buffers with a page in common): each page is mapped once.
class InPlaceSet {
 public:
  struct Segment {
    uint64_t size = 0;
    uint32_t refs = 0;  // shares covering it
  };
  // On every staged buffer's way (ShmStager::acquire): nothing shared, no lock. True when
  // [p, p + len) lies in one run of touching segments.
  bool contains(const void* p, size_t len) const {
    if (count_.load(std::memory_order_acquire) == 0) return false;
    const auto a = reinterpret_cast<uint64_t>(p);
    const uint64_t b = a + len;
    std::shared_lock lk(mu_);
    auto it = segs_.upper_bound(a);
    if (it == segs_.begin()) return false;
    --it;
    uint64_t end = it->first + it->second.size;
    if (a >= end) return false;
    for (++it; end < b && it != segs_.end() && it->first == end; ++it) end += it->second.size;
    return b <= end;
  }
  // The parts of [a, b) no segment covers.
  std::vector<std::pair<uint64_t, uint64_t>> gaps(uint64_t a, uint64_t b) const {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    std::shared_lock lk(mu_);
    auto it = segs_.upper_bound(a);
    if (it != segs_.begin() && std::prev(it)->first + std::prev(it)->second.size > a) {
      a = std::prev(it)->first + std::prev(it)->second.size;
    }
    for (; a < b && it != segs_.end() && it->first < b; ++it) {
      if (it->first > a) out.emplace_back(a, it->first);
      a = std::max(a, it->first + it->second.size);
    }
    if (a < b) out.emplace_back(a, b);
    return out;
  }
  // Writers: the device's share mutex held.
  void insert(uint64_t addr, uint64_t size) {
    std::unique_lock lk(mu_);
    segs_[addr] = Segment{size, 0};
    count_.store(segs_.size(), std::memory_order_release);
  }
  // Adds `delta` to the count of every segment overlapping [a, b); returns the segments whose
  // count fell to 0, removed.
  std::vector<std::pair<uint64_t, uint64_t>> count(uint64_t a, uint64_t b, int delta) {
    std::vector<std::pair<uint64_t, uint64_t>> gone;
    std::unique_lock lk(mu_);
    auto it = segs_.upper_bound(a);
    if (it != segs_.begin() && std::prev(it)->first + std::prev(it)->second.size > a) --it;
    while (it != segs_.end() && it->first < b) {
      it->second.refs += delta;
      if (it->second.refs == 0) {
        gone.emplace_back(it->first, it->second.size);
        it = segs_.erase(it);
      } else {
        ++it;
      }
    }
    count_.store(segs_.size(), std::memory_order_release);
    return gone;
  }

 private:
  mutable std::shared_mutex mu_;
  std::map<uint64_t, Segment> segs_;
  std::atomic<size_t> count_{0};  // segs_.size()
};

}  // namespace gdkv::vfio_user
