// Keys: 1–16 bytes, as in the NVMe KV command set.
//
// gdkv derives the key of a KV-cache block from the block's place in a prompt: key(i) is the
// 128-bit XXH3 hash of (key(i-1), the block's token ids, a salt naming the model/adapter), like
// vLLM's chained block hash, so two prompts that share a prefix share the keys of its full
// blocks. Key is a plain value type (safe to copy between threads and into kernels); the helpers
// below are pure functions.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gdkv/nvme_kv.h"

namespace gdkv {

struct Key {
  uint8_t len = 0;  // 0 means "no key"; valid keys have 1..16 bytes
  uint8_t bytes[nvme::kMaxKeyLength] = {};

  // REQUIRES: n <= 16.
  static Key from_bytes(const void* data, size_t n) noexcept {
    Key k;
    k.len = static_cast<uint8_t>(n);
    std::memcpy(k.bytes, data, n);
    return k;
  }
  // nullopt unless the string has 1..16 bytes.
  static std::optional<Key> from_string(std::string_view s) noexcept {
    if (s.empty() || s.size() > nvme::kMaxKeyLength) return std::nullopt;
    return from_bytes(s.data(), s.size());
  }
  // nullopt unless the text is 2..32 hex digits (an even count), upper or lower case.
  static std::optional<Key> from_hex(std::string_view hex) noexcept;

  bool valid() const noexcept { return len >= 1 && len <= nvme::kMaxKeyLength; }
  std::string_view view() const noexcept { return {reinterpret_cast<const char*>(bytes), len}; }
  // Lower-case hex of the key's bytes (the RADOS object name, the CLI's printed form).
  std::string hex() const;

  void to_sqe(nvme::Sqe& sqe) const noexcept { nvme::pack_key(sqe, bytes, len); }
  // The key of an SQE; invalid (len 0 or > 16 clamped to 0) if the length field is out of range.
  static Key from_sqe(const nvme::Sqe& sqe) noexcept {
    Key k;
    uint32_t n = nvme::unpack_key(sqe, k.bytes);
    k.len = (n >= 1 && n <= nvme::kMaxKeyLength) ? static_cast<uint8_t>(n) : 0;
    if (k.len < nvme::kMaxKeyLength) std::memset(k.bytes + k.len, 0, nvme::kMaxKeyLength - k.len);
    return k;
  }

  // Byte order, shorter first on a common prefix: the order List returns keys in.
  friend int compare(const Key& a, const Key& b) noexcept {
    int c = std::memcmp(a.bytes, b.bytes, a.len < b.len ? a.len : b.len);
    if (c != 0) return c;
    return a.len < b.len ? -1 : (a.len > b.len ? 1 : 0);
  }
  friend bool operator==(const Key& a, const Key& b) noexcept {
    return a.len == b.len && std::memcmp(a.bytes, b.bytes, a.len) == 0;
  }
  friend bool operator<(const Key& a, const Key& b) noexcept { return compare(a, b) < 0; }
};

struct KeyHash {
  size_t operator()(const Key& k) const noexcept;
};

// A key in one NVMe namespace: what the cache, the local store's index and the tiered backend's
// write stripes look keys up by.
static_assert(std::endian::native == std::endian::little, "NsKey's compare assumes it");
struct NsKey {
  uint32_t nsid = 0;
  Key key;
  // Only the key's `len` bytes count, as in Key's operator==; done with two masked 8-byte
  // compares instead of a call to memcmp (the cache compares keys several times per request).
  friend bool operator==(const NsKey& a, const NsKey& b) noexcept {
    if (a.nsid != b.nsid || a.key.len != b.key.len) return false;
    static_assert(sizeof(a.key.bytes) == 16);
    uint64_t a0, a1, b0, b1;
    std::memcpy(&a0, a.key.bytes, 8);
    std::memcpy(&a1, a.key.bytes + 8, 8);
    std::memcpy(&b0, b.key.bytes, 8);
    std::memcpy(&b1, b.key.bytes + 8, 8);
    const unsigned n = a.key.len < 16 ? a.key.len : 16;
    // Little-endian byte i is bits 8i..8i+7: keep the first n bytes.
    const uint64_t m0 = n >= 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * n)) - 1;
    const uint64_t m1 = n >= 16 ? ~uint64_t{0} : n <= 8 ? 0 : (uint64_t{1} << (8 * (n - 8))) - 1;
    return (((a0 ^ b0) & m0) | ((a1 ^ b1) & m1)) == 0;
  }
};

// Inline and cheap (the cache hashes a key several times per request); only the key's `len`
// bytes count, as in Key's operator==.
struct NsKeyHash {
  size_t operator()(const NsKey& k) const noexcept {
    uint8_t b[16] = {};
    std::memcpy(b, k.key.bytes, k.key.len < 16 ? k.key.len : 16);
    uint64_t lo, hi;
    std::memcpy(&lo, b, 8);
    std::memcpy(&hi, b + 8, 8);
    uint64_t h = lo * 0x9E3779B97F4A7C15ull;
    h ^= (hi ^ (uint64_t{k.nsid} << 8 | k.key.len)) * 0xC2B2AE3D27D4EB4Full;
    h ^= h >> 33;  // murmur3's finalizer: every input bit reaches the low (bucket) bits
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ull;
    return h ^ (h >> 33);
  }
};

// Keys of every full block of `tokens` (a trailing partial block gets none): block i covers tokens
// [i*block_tokens, (i+1)*block_tokens). `parent` continues a chain (the key of the block before
// tokens[0]); without it the chain starts from the all-zero key. The salt names the model and
// adapter so different models never share keys. REQUIRES: block_tokens > 0.
std::vector<Key> chain_keys(std::span<const uint32_t> tokens, size_t block_tokens,
                            std::string_view salt, const Key* parent = nullptr);

// 128-bit XXH3 of arbitrary bytes, as a 16-byte key (used for value identity digests too).
Key hash128(const void* data, size_t n) noexcept;

// Above this many bytes the low 64 bits of XXH3-128 are XXH3-64 of the same bytes (both run the
// same accumulator loop and final merge; the algorithm is frozen since xxHash 0.8), so one pass
// over a value yields both its checksum and its identity digest. rados_backend_test and the local
// store's hash_test pin it.
inline constexpr size_t kXxh3SharedAbove = 240;

}  // namespace gdkv
