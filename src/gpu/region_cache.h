// What a copy engine learned about memory, cached per region (CopySegment::dst_region /
// src_region: a registered region or a reactor's staging pool), so a segment in a known region
// costs no driver query. The answer for the first pointer asked stands for the whole region: a
// region is one allocation (gpu::Registration checks device memory). Plain C++ (no CUDA), so the
// CPU tests cover it. Not thread-safe: one per copy engine, used by its reactor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gdkv::gpu {

template <class Info>
class RegionCache {
 public:
  static constexpr size_t kMaxRegions = 64;  // oldest forgotten first beyond this

  // The Info of `p` in `region`: cached, or ask(p) once (region 0, not a region: ask every time).
  template <class Ask>
  Info lookup(uint64_t region, const void* p, Ask&& ask) {
    if (region == 0) return ask(p);
    for (const Entry& e : entries_) {
      if (e.region == region) return e.info;
    }
    const Info info = ask(p);
    if (entries_.size() == kMaxRegions) entries_.erase(entries_.begin());
    entries_.push_back(Entry{region, info});
    return info;
  }
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    uint64_t region;
    Info info;
  };
  std::vector<Entry> entries_;
};

}  // namespace gdkv::gpu
