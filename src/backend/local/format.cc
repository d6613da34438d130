#include "backend/local/format.h"

namespace gdkv::local {

namespace {

// The checksum of a struct whose last 8 bytes are the checksum field.
template <class T>
uint64_t struct_checksum(const T& s) noexcept {
  static_assert(offsetof(T, checksum) + sizeof(uint64_t) == sizeof(T));
  return checksum64(&s, offsetof(T, checksum));
}

uint32_t entry_checksum(RecordEntry e) noexcept {
  e.entry_checksum = 0;
  return static_cast<uint32_t>(checksum64(&e, sizeof(e)));
}

uint64_t batch_checksum(const std::byte* area, uint32_t count) noexcept {
  BatchHeader h;
  std::memcpy(&h, area, sizeof(h));
  h.checksum = 0;
  Checksum64 sum;
  sum.update(&h, sizeof(h));
  sum.update(area + sizeof(h), size_t{count} * sizeof(RecordEntry));
  return sum.digest();
}

}  // namespace

void seal(Superblock& s) noexcept { s.checksum = struct_checksum(s); }
void seal(SegmentHeader& s) noexcept { s.checksum = struct_checksum(s); }
void seal(RecordEntry& e) noexcept { e.entry_checksum = entry_checksum(e); }

void seal_batch(std::byte* area) noexcept {
  BatchHeader h;
  std::memcpy(&h, area, sizeof(h));
  h.checksum = batch_checksum(area, h.count);
  std::memcpy(area, &h, sizeof(h));
}

std::optional<Superblock> parse_superblock(const std::byte* block) noexcept {
  Superblock s;
  std::memcpy(&s, block, sizeof(s));
  if (s.magic != kSuperMagic || s.checksum != struct_checksum(s)) return std::nullopt;
  if (s.version != kFormatVersion || s.block_bytes != kBlock) return std::nullopt;
  if (s.segment_bytes < 4 * kBlock || s.segment_bytes % kBlock != 0) return std::nullopt;
  return s;
}

std::optional<SegmentHeader> parse_segment_header(const std::byte* block, uint64_t store_id,
                                                  uint32_t index, uint32_t segment_bytes) noexcept {
  SegmentHeader s;
  std::memcpy(&s, block, sizeof(s));
  if (s.magic != kSegmentMagic || s.checksum != struct_checksum(s)) return std::nullopt;
  if (s.store_id != store_id || s.index != index || s.segment_bytes != segment_bytes ||
      s.seq == 0 || s.prev_end > segment_bytes) {
    return std::nullopt;
  }
  return s;
}

std::optional<BatchHeader> peek_batch_header(const std::byte* area, size_t avail, uint64_t store_id,
                                             uint64_t seq, uint32_t offset,
                                             uint32_t segment_bytes) noexcept {
  if (avail < sizeof(BatchHeader)) return std::nullopt;
  BatchHeader h;
  std::memcpy(&h, area, sizeof(h));
  if (h.magic != kBatchMagic || h.store_id != store_id || h.seq != seq || h.offset != offset) {
    return std::nullopt;
  }
  if (h.count == 0 || h.count > kMaxBatchRecords) return std::nullopt;
  if (h.header_bytes % kBlock != 0 || h.total_bytes % kBlock != 0) return std::nullopt;
  if (h.header_bytes > kMaxHeaderBytes || h.header_bytes > h.total_bytes) return std::nullopt;
  if (sizeof(BatchHeader) + uint64_t{h.count} * sizeof(RecordEntry) > h.header_bytes) {
    return std::nullopt;
  }
  if (uint64_t{offset} + h.total_bytes > segment_bytes) return std::nullopt;
  return h;
}

bool check_batch_entries(const std::byte* area, const BatchHeader& h,
                         uint32_t segment_bytes) noexcept {
  if (batch_checksum(area, h.count) != h.checksum) return false;
  const uint64_t inline_lo = uint64_t{h.offset} + sizeof(BatchHeader) + uint64_t{h.count} * 64;
  const uint64_t header_hi = uint64_t{h.offset} + h.header_bytes;
  const uint64_t batch_hi = uint64_t{h.offset} + h.total_bytes;
  for (uint32_t i = 0; i < h.count; ++i) {
    const RecordEntry e = entry_at(area, i);
    if (e.magic != kRecordMagic || e.entry_checksum != entry_checksum(e)) return false;
    if (e.key_len < 1 || e.key_len > nvme::kMaxKeyLength) return false;
    const uint64_t lo = e.value_off;
    const uint64_t hi = lo + e.value_len;
    if (e.type == static_cast<uint8_t>(RecordType::kTombstone)) {
      if (e.value_len != 0) return false;
    } else if (e.type == static_cast<uint8_t>(RecordType::kPut)) {
      if (e.value_len <= kInlineMax) {
        if (lo < inline_lo || hi > header_hi) return false;
      } else if (lo < header_hi || lo % kBlock != 0 || round_up(hi, kBlock) > batch_hi ||
                 hi > segment_bytes) {
        return false;
      }
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace gdkv::local
