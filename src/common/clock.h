// The one clock of the library: monotonic nanoseconds (CLOCK_MONOTONIC, as steady_clock).
#pragma once

#include <time.h>

#include <cstdint>

namespace gdkv {

inline uint64_t now_ns() noexcept {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

}  // namespace gdkv
