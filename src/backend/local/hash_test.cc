// The dispatched XXH3 (hash.h) must equal libxxhash and gdkv::hash128 bit for bit: records
// written on one machine are verified on another, perhaps with a different vector unit.
#include "backend/local/hash.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <random>
#include <vector>

namespace gdkv::local {
namespace {

TEST(LocalHash, MatchesLibxxhashAndHash128) {
  std::printf("XXH3 implementation: %s\n", hash_implementation());
  std::vector<uint8_t> buf((3u << 20) + 77);
  std::mt19937 rng(11);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  std::vector<size_t> sizes = {0,   1,    3,    16,   17,    128,        129,       240,
                               241, 1024, 4095, 4096, 65537, (2u << 20), buf.size()};
  for (int i = 0; i < 40; ++i) sizes.push_back(rng() % buf.size());
  Checksum64 stream;
  for (size_t n : sizes) {
    for (size_t off : {size_t{0}, size_t{1}, size_t{7}}) {
      if (off + n > buf.size()) continue;
      const uint8_t* p = buf.data() + off;
      ASSERT_EQ(checksum64(p, n), XXH3_64bits(p, n)) << n;
      ASSERT_EQ(digest128(p, n), hash128(p, n)) << n;
      const ValueHashes both = value_hashes(p, n);  // one pass above kXxh3SharedAbove bytes
      ASSERT_EQ(both.checksum, XXH3_64bits(p, n)) << n;
      ASSERT_EQ(both.digest, hash128(p, n)) << n;
      // In uneven pieces, as bounce reads deliver them.
      stream.reset();
      for (size_t at = 0; at < n;) {
        const size_t step = std::min<size_t>(n - at, 1 + rng() % 300000);
        stream.update(p + at, step);
        at += step;
      }
      ASSERT_EQ(stream.digest(), XXH3_64bits(p, n)) << n;
    }
  }
}

}  // namespace
}  // namespace gdkv::local
