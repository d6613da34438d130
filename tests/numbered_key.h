// A test and benchmark helper: key number `id` in namespace 1 (the cache tests and the trace
// benchmark name keys by number).
#pragma once

#include <cstdint>

#include "gdkv/key.h"

namespace gdkv::cache {

inline NsKey numbered_key(uint64_t id) noexcept {
  NsKey k;
  k.nsid = 1;
  k.key = Key::from_bytes(&id, sizeof(id));
  return k;
}

}  // namespace gdkv::cache
