// The local store's on-disk format (see docs/local-store.md for the picture).
//
//   file:    [superblock: 4 KiB][segment 0][segment 1]...[segment N-1]
//   segment: [segment header: 4 KiB][batch][batch]...          (batches are block aligned)
//   batch:   [batch header | record entries | inline values]   header area, rounded to a block
//            [value][pad][value][pad]...                       data area, each value block aligned
//
// A batch is what one group commit writes: one contiguous range, one flush. Every structure is
// checksummed (XXH3-64) and carries the store id and the segment's sequence number, so a stale
// batch left over from a segment's previous life, or a block from another store, never parses as
// ours. Values of up to kInlineMax bytes live inside the header area (a small value then costs
// bytes, not a block); larger values start on a block boundary, so a Get can read them with
// O_DIRECT straight into the caller's buffer.
//
// All integers are little-endian (the hosts gdkv supports are; nvme_kv.h asserts it). The structs
// are read and written with memcpy, never by casting a buffer pointer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>

#include "backend/local/hash.h"
#include "gdkv/key.h"

namespace gdkv::local {

inline constexpr uint32_t kBlock = 4096;      // layout unit: headers and values start here
inline constexpr uint32_t kInlineMax = 1024;  // values up to this size live in the header area
inline constexpr uint32_t kMaxBatchRecords = 4096;  // bounds the header area
inline constexpr uint32_t kMaxInlineBytesPerBatch = 512u << 10;
inline constexpr uint32_t kMaxHeaderBytes = 1u << 20;  // header area of one batch, at most
inline constexpr uint32_t kFormatVersion = 1;
inline constexpr const char* kStoreFileName = "store.gdkv";

constexpr uint64_t magic64(const char (&s)[9]) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(s[i]);
  return v;
}
inline constexpr uint64_t kSuperMagic = magic64("GDKVSTOR");
inline constexpr uint64_t kSegmentMagic = magic64("GDKVSEG1");
inline constexpr uint64_t kBatchMagic = magic64("GDKVBAT1");
inline constexpr uint32_t kRecordMagic = 0x524b4447;  // "GDKR"

constexpr uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
constexpr uint64_t round_down(uint64_t v, uint64_t a) { return v / a * a; }

// At file offset 0. Written once, when the store is created.
struct Superblock {
  uint64_t magic;
  uint32_t version;
  uint32_t block_bytes;
  uint32_t segment_bytes;
  uint32_t reserved0;
  uint64_t store_id;    // random, chosen at creation; every segment and batch repeats it
  uint64_t created_ns;  // wall clock at creation, for humans
  uint8_t reserved[16];
  uint64_t checksum;  // of the bytes before this field
};
static_assert(sizeof(Superblock) == 64);

// The first block of each segment. seq orders segments: higher is newer; reclaim takes the lowest.
struct SegmentHeader {
  uint64_t magic;
  uint64_t store_id;
  uint64_t seq;
  uint32_t index;  // the segment's place in the file (self-check)
  uint32_t segment_bytes;
  uint64_t prev_seq;  // the segment that was sealed when this one opened (0: none)
  uint32_t prev_end;  // where that segment's log ended: a shorter scan means corruption
  uint32_t reserved;
  uint64_t first_batch;  // number of this segment's first batch
  uint64_t checksum;
};
static_assert(sizeof(SegmentHeader) == 64);

// Starts every batch; record entries follow it directly.
struct BatchHeader {
  uint64_t magic;
  uint64_t store_id;
  uint64_t seq;           // the segment's seq
  uint64_t batch;         // global batch number; consecutive within a segment
  uint32_t offset;        // this batch's offset in its segment (self-check)
  uint32_t count;         // record entries
  uint32_t header_bytes;  // header area (header, entries, inline values), a multiple of kBlock
  uint32_t total_bytes;   // header area + data area; the next batch starts at offset + total
  uint64_t reserved;
  uint64_t checksum;  // of this header (checksum field zero) and the entries, not inline values
};
static_assert(sizeof(BatchHeader) == 64);

enum class RecordType : uint8_t { kPut = 1, kTombstone = 2 };

struct RecordEntry {
  uint32_t magic;
  uint8_t type;  // RecordType
  uint8_t key_len;
  uint8_t reserved0[2];
  uint32_t nsid;
  uint32_t value_len;
  uint32_t value_off;       // offset in the segment of the value's first byte
  uint32_t entry_checksum;  // low 32 bits of XXH3-64 of this entry with this field zero
  uint8_t key[16];
  uint64_t checksum;   // XXH3-64 of the value: verified on every read
  uint8_t digest[16];  // gdkv::hash128 of the value: its identity, for tiers above
};
static_assert(sizeof(RecordEntry) == 64);
static_assert(offsetof(RecordEntry, checksum) == 40);

// Seals a structure: computes its checksum field.
void seal(Superblock& s) noexcept;
void seal(SegmentHeader& s) noexcept;
void seal(RecordEntry& e) noexcept;
// Seals a batch header over the header and the `count` entries that follow it in `area`.
// REQUIRES: area holds the header at offset 0 and count entries after it.
void seal_batch(std::byte* area) noexcept;

// Parsing: nullopt unless magic, checksum and the self-checks hold. Inputs come from disk and are
// untrusted: every length is checked against the buffer it claims to describe.
std::optional<Superblock> parse_superblock(const std::byte* block) noexcept;
std::optional<SegmentHeader> parse_segment_header(const std::byte* block, uint64_t store_id,
                                                  uint32_t index, uint32_t segment_bytes) noexcept;
// The batch header at the start of `area` (at least sizeof(BatchHeader) bytes), checking only
// the header's own fields; the entries are checked by parse_batch_entries once the whole header
// area has been read.
std::optional<BatchHeader> peek_batch_header(const std::byte* area, size_t avail, uint64_t store_id,
                                             uint64_t seq, uint32_t offset,
                                             uint32_t segment_bytes) noexcept;
// Checks the batch checksum and every entry. REQUIRES: area holds h.header_bytes bytes.
bool check_batch_entries(const std::byte* area, const BatchHeader& h,
                         uint32_t segment_bytes) noexcept;
inline RecordEntry entry_at(const std::byte* area, uint32_t i) noexcept {
  RecordEntry e;
  std::memcpy(&e, area + sizeof(BatchHeader) + size_t{i} * sizeof(RecordEntry), sizeof(e));
  return e;
}

}  // namespace gdkv::local
