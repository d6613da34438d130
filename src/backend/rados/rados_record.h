// The record header of a value stored in RADOS: kept in the object's xattr "gdkv.hdr" while the
// object's data is the value itself, so stock tools (`rados get`) read values byte for byte and
// erasure-coded pools (no omap) can hold it. docs/rados.md describes the layout for other tools.
//
// Layout, version 1, 64 bytes, integers little-endian:
//   0  u32  magic "GDKV" (0x564b4447 read as little-endian)
//   4  u16  version (1)
//   6  u8   key length (1..16)
//   7  u8   reserved (0)
//   8  u64  value length in bytes
//   16 u8[16] key, zero-padded: a copy renamed to another key's object is caught
//   32 u8[16] identity digest: XXH3-128 of the value (canonical, big-endian), as gdkv::hash128
//   48 u64  checksum: XXH3-64 of the value
//   56 u64  XXH3-64 of bytes 0..55, so a damaged header is told apart from a damaged value
#pragma once

#include <xxhash.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>

#include "gdkv/key.h"

namespace gdkv::rados {

inline constexpr char kHeaderXattr[] = "gdkv.hdr";
// The block's access time for eviction: milliseconds since the Unix epoch, in decimal.
inline constexpr char kAtimeXattr[] = "gdkv.atime";
inline constexpr uint32_t kRecordMagic = 0x564b4447;  // "GDKV" in memory order
inline constexpr uint16_t kRecordVersion = 1;
inline constexpr size_t kRecordHeaderSize = 64;

// The byte layout above is the in-memory layout of these integers on a little-endian host.
static_assert(std::endian::native == std::endian::little,
              "rados record header assumes little-endian");

struct RecordHeader {
  Key key;
  uint64_t value_len = 0;
  Key identity;  // 16 bytes
  uint64_t checksum = 0;
};

// Header of `value` stored under `key`. One pass over a large value yields both digests.
inline RecordHeader make_record_header(const Key& key, std::span<const std::byte> value) noexcept {
  RecordHeader h;
  h.key = key;
  h.value_len = value.size();
  const XXH128_hash_t d = XXH3_128bits(value.data(), value.size());
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, d);  // big-endian, exactly as gdkv::hash128
  h.identity = Key::from_bytes(c.digest, sizeof(c.digest));
  h.checksum = value.size() > kXxh3SharedAbove ? d.low64 : XXH3_64bits(value.data(), value.size());
  return h;
}

inline void encode_record_header(const RecordHeader& h, std::byte out[kRecordHeaderSize]) noexcept {
  std::memset(out, 0, kRecordHeaderSize);
  const uint16_t version = kRecordVersion;
  std::memcpy(out + 0, &kRecordMagic, 4);
  std::memcpy(out + 4, &version, 2);
  out[6] = static_cast<std::byte>(h.key.len);
  std::memcpy(out + 8, &h.value_len, 8);
  std::memcpy(out + 16, h.key.bytes, h.key.len);
  std::memcpy(out + 32, h.identity.bytes, 16);
  std::memcpy(out + 48, &h.checksum, 8);
  const uint64_t self = XXH3_64bits(out, 56);
  std::memcpy(out + 56, &self, 8);
}

// nullopt if `in` is not a version-1 header (wrong size, magic, version, key length or self
// checksum).
inline std::optional<RecordHeader> decode_record_header(std::span<const std::byte> in) noexcept {
  if (in.size() != kRecordHeaderSize) return std::nullopt;
  uint32_t magic = 0;
  uint16_t version = 0;
  uint64_t self = 0;
  std::memcpy(&magic, in.data(), 4);
  std::memcpy(&version, in.data() + 4, 2);
  std::memcpy(&self, in.data() + 56, 8);
  const uint8_t key_len = static_cast<uint8_t>(in[6]);
  if (magic != kRecordMagic || version != kRecordVersion || key_len < 1 ||
      key_len > nvme::kMaxKeyLength || self != XXH3_64bits(in.data(), 56)) {
    return std::nullopt;
  }
  RecordHeader h;
  h.key = Key::from_bytes(in.data() + 16, key_len);
  std::memcpy(&h.value_len, in.data() + 8, 8);
  h.identity = Key::from_bytes(in.data() + 32, 16);
  std::memcpy(&h.checksum, in.data() + 48, 8);
  return h;
}

}  // namespace gdkv::rados
