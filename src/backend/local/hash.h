// XXH3 for the local store's checksums and digests, dispatched at run time to the widest vector
// unit the CPU has. Debian's libxxhash is built for baseline x86-64 (SSE2); XXH3 built for AVX2
// verifies a 2 MiB value fresh from the device about twice as fast, and a Get verifies every byte.
// Results are bit-identical whichever implementation runs (hash_test checks it against libxxhash
// and gdkv::hash128).
//
// Thread safety: the functions are pure; a Checksum64 object belongs to one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gdkv/key.h"

namespace gdkv::local {

// XXH3-64 of a byte range: the payload checksum of the format.
uint64_t checksum64(const void* data, size_t n) noexcept;
// XXH3-128 as gdkv::hash128 returns it (canonical byte order): the value's identity digest.
Key digest128(const void* data, size_t n) noexcept;

// A Store's two hashes: checksum64 and digest128 of the value, in one pass over values above
// kXxh3SharedAbove bytes (the checksum is then the digest's low half).
struct ValueHashes {
  uint64_t checksum;
  Key digest;
};
ValueHashes value_hashes(const void* data, size_t n) noexcept;

// Streaming XXH3-64, for a value that arrives in pieces; equals checksum64 of the concatenation.
class Checksum64 {
 public:
  Checksum64();
  ~Checksum64();
  Checksum64(const Checksum64&) = delete;
  Checksum64& operator=(const Checksum64&) = delete;
  void reset() noexcept;
  void update(const void* data, size_t n) noexcept;
  uint64_t digest() const noexcept;

 private:
  void* state_;
};

// Which implementation runs ("avx2" or "generic"), for logs and benchmarks.
const char* hash_implementation() noexcept;

}  // namespace gdkv::local
