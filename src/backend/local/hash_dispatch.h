// The table each XXH3 build of hash_impl.inc fills in, and the builds that exist. Private to
// hash*.cc.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gdkv::local {

struct HashImpl {
  uint64_t (*oneshot64)(const void*, size_t) noexcept;
  // XXH3-128 in canonical byte order; returns its low 64 bits.
  uint64_t (*digest128)(const void*, size_t, uint8_t*) noexcept;
  void (*reset)(void*) noexcept;
  void (*update)(void*, const void*, size_t) noexcept;
  uint64_t (*digest)(const void*) noexcept;
  size_t state_size;
  size_t state_align;
};

namespace generic {
extern const HashImpl kImpl;
}
#if defined(GDKV_HASH_AVX2)
namespace avx2 {
extern const HashImpl kImpl;
}
#endif

}  // namespace gdkv::local
