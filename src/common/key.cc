#include "gdkv/key.h"

#include <xxhash.h>

namespace gdkv {

namespace {
int hex_digit(char c) noexcept {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

Key from_xxh128(XXH128_hash_t h) noexcept {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, h);  // big-endian bytes: stable across hosts
  return Key::from_bytes(c.digest, sizeof(c.digest));
}
}  // namespace

std::optional<Key> Key::from_hex(std::string_view hex) noexcept {
  if (hex.size() < 2 || hex.size() > 2 * nvme::kMaxKeyLength || hex.size() % 2 != 0) {
    return std::nullopt;
  }
  Key k;
  k.len = static_cast<uint8_t>(hex.size() / 2);
  for (size_t i = 0; i < k.len; ++i) {
    int hi = hex_digit(hex[2 * i]);
    int lo = hex_digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    k.bytes[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return k;
}

std::string Key::hex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(2 * static_cast<size_t>(len), '\0');
  for (size_t i = 0; i < len; ++i) {
    s[2 * i] = kDigits[bytes[i] >> 4];
    s[2 * i + 1] = kDigits[bytes[i] & 0xF];
  }
  return s;
}

size_t KeyHash::operator()(const Key& k) const noexcept {
  return static_cast<size_t>(XXH3_64bits(k.bytes, k.len));
}

Key hash128(const void* data, size_t n) noexcept { return from_xxh128(XXH3_128bits(data, n)); }

std::vector<Key> chain_keys(std::span<const uint32_t> tokens, size_t block_tokens,
                            std::string_view salt, const Key* parent) {
  std::vector<Key> keys;
  if (block_tokens == 0) return keys;
  const size_t blocks = tokens.size() / block_tokens;
  keys.reserve(blocks);
  Key prev;
  prev.len = nvme::kMaxKeyLength;  // all-zero root
  if (parent != nullptr) prev = *parent;
  XXH3_state_t* st = XXH3_createState();
  for (size_t b = 0; b < blocks; ++b) {
    XXH3_128bits_reset(st);
    XXH3_128bits_update(st, &prev.len, 1);
    XXH3_128bits_update(st, prev.bytes, prev.len);
    XXH3_128bits_update(st, tokens.data() + b * block_tokens, block_tokens * sizeof(uint32_t));
    const uint64_t salt_len = salt.size();
    XXH3_128bits_update(st, &salt_len, sizeof(salt_len));
    XXH3_128bits_update(st, salt.data(), salt.size());
    prev = from_xxh128(XXH3_128bits_digest(st));
    keys.push_back(prev);
  }
  XXH3_freeState(st);
  return keys;
}

}  // namespace gdkv
