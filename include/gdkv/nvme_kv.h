// NVMe Key Value command set: the wire format gdkv speaks.
//
// The 64-byte submission queue entry (SQE) and 16-byte completion queue entry (CQE), named dword
// by dword, with the KV opcodes, status codes and option bits of the NVMe KV Command Set (NVMe 2.0
// family). Plain data and constexpr helpers only: this header compiles under g++, nvcc and hipcc,
// and holds no state, so it is safe from any thread.
//
// Byte order: NVMe is little-endian and so are all hosts and GPUs gdkv targets (static_assert
// below). Key bytes are kept as byte arrays, so key packing has no endianness question at all.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gdkv/platform.h"

namespace gdkv::nvme {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "NVMe structures are little-endian");

// ---- Opcodes ------------------------------------------------------------------------------------
// Bits 1:0 of an I/O opcode give the data direction: 00 none, 01 host→controller, 10
// controller→host. The vendor opcodes below follow that rule too.
enum class Opcode : uint8_t {
  kStore = 0x01,
  kRetrieve = 0x02,
  kList = 0x06,
  kDelete = 0x10,
  kExist = 0x14,
  // gdkv vendor-specific I/O commands (80h–FFh).
  kPrefetch = 0x81,         // data: a KeyList (host→controller); warm these keys into the cache
  kScatterRetrieve = 0x82,  // data: a ScatterList (host→controller); one value into many places
};
inline constexpr uint8_t kVendorOpcodeFirst = 0x80;
inline constexpr uint8_t kVendorOpcodeLast = 0xFF;

// ---- Status ------------------------------------------------------------------------------------
// Status code types (SCT).
inline constexpr uint8_t kSctGeneric = 0x0;
inline constexpr uint8_t kSctCommandSpecific = 0x1;

// Status codes of the generic type (SCT 0), including the KV command set's 8xh range.
enum class Status : uint8_t {
  kSuccess = 0x00,
  kInvalidOpcode = 0x01,
  kInvalidField = 0x02,
  kDataTransferError = 0x04,
  kInternalError = 0x06,
  kAbortRequested = 0x07,
  kInvalidNamespace = 0x0B,
  kCapacityExceeded = 0x81,
  kNamespaceNotReady = 0x82,
  kReservationConflict = 0x83,
  kFormatInProgress = 0x84,
  kInvalidValueSize = 0x85,
  kInvalidKeySize = 0x86,
  kKeyNotExist = 0x87,
  kUnrecoveredError = 0x88,
  kKeyExists = 0x89,
};

// A short, stable name for logs and CLI messages ("key does not exist (87h)").
GDKV_HD constexpr const char* status_name(Status s) noexcept {
  switch (s) {
    case Status::kSuccess:
      return "success";
    case Status::kInvalidOpcode:
      return "invalid opcode";
    case Status::kInvalidField:
      return "invalid field";
    case Status::kDataTransferError:
      return "data transfer error";
    case Status::kInternalError:
      return "internal error";
    case Status::kAbortRequested:
      return "aborted";
    case Status::kInvalidNamespace:
      return "invalid namespace";
    case Status::kCapacityExceeded:
      return "capacity exceeded";
    case Status::kNamespaceNotReady:
      return "namespace not ready";
    case Status::kReservationConflict:
      return "reservation conflict";
    case Status::kFormatInProgress:
      return "format in progress";
    case Status::kInvalidValueSize:
      return "invalid value size";
    case Status::kInvalidKeySize:
      return "invalid key size";
    case Status::kKeyNotExist:
      return "key does not exist";
    case Status::kUnrecoveredError:
      return "unrecovered error";
    case Status::kKeyExists:
      return "key exists";
  }
  return "unknown status";
}

// ---- Option bits (CDW11 bits 15:8) ------------------------------------------------------------
inline constexpr uint8_t kStoreMustExist = 0x01;     // don't store if the key does not exist (87h)
inline constexpr uint8_t kStoreMustNotExist = 0x02;  // don't store if the key exists (89h)
inline constexpr uint8_t kStoreCompressHint = 0x04;  // accepted and ignored
// Evict this value first: the host cache and the memory backend put it at the cold end; a later
// read makes it an ordinary value.
inline constexpr uint8_t kStoreLowPriority = 0x08;
inline constexpr uint8_t kStoreOptionsValid =
    kStoreMustExist | kStoreMustNotExist | kStoreCompressHint | kStoreLowPriority;
inline constexpr uint8_t kRetrieveRaw = 0x01;  // no decompression: gdkv never compresses
inline constexpr uint8_t kRetrieveOptionsValid = kRetrieveRaw;
// Prefetch (81h): bit 0 = scheduler hint. The keys will be read soon, in the list's order: the
// cache also keeps the resident ones from eviction until read or until the hint ages out. Clear
// (a stock host): a plain warm-up. Other bits are reserved (02h invalid field).
inline constexpr uint8_t kPrefetchHint = 0x01;
inline constexpr uint8_t kPrefetchOptionsValid = kPrefetchHint;

// PSDT (CDW0 bits 15:14): how the data pointer is to be read.
inline constexpr uint8_t kPsdtPrp = 0;
inline constexpr uint8_t kPsdtSglContiguous = 1;  // SGL, metadata a byte-aligned buffer
inline constexpr uint8_t kPsdtSglSegment = 2;     // SGL, metadata an SGL segment

inline constexpr uint32_t kMaxKeyLength = 16;

// ---- Submission queue entry --------------------------------------------------------------------
// An SGL descriptor of the data block type (16 bytes) overlays PRP1/PRP2 when PSDT != 0.
struct SglDescriptor {
  uint64_t address;
  uint32_t length;
  uint8_t reserved[3];
  uint8_t type;  // bits 7:4 descriptor type (0 = data block), bits 3:0 subtype
};
static_assert(sizeof(SglDescriptor) == 16);

struct Sqe {
  // CDW0
  uint8_t opcode;
  uint8_t flags;  // bits 1:0 fused operation, bits 7:6 PSDT
  uint16_t cid;   // command identifier, echoed in the completion
  // CDW1
  uint32_t nsid;
  // CDW2–3: key bytes 0–7
  uint8_t key_lo[8];
  // CDW4–5
  uint64_t mptr;
  // CDW6–9: data pointer
  union {
    struct {
      uint64_t prp1;
      uint64_t prp2;
    } prp;
    SglDescriptor sgl;
  } dptr;
  // CDW10: value size (Store), host buffer size (Retrieve, List, vendor commands)
  uint32_t cdw10;
  // CDW11: bits 7:0 key length, bits 15:8 options
  uint8_t key_length;
  uint8_t options;
  uint16_t cdw11_reserved;
  // CDW12–13
  uint32_t cdw12;
  uint32_t cdw13;
  // CDW14–15: key bytes 8–15
  uint8_t key_hi[8];

  GDKV_HD constexpr uint8_t psdt() const noexcept { return static_cast<uint8_t>(flags >> 6); }
  GDKV_HD constexpr void set_psdt(uint8_t v) noexcept {
    flags = static_cast<uint8_t>((flags & 0x3F) | (v << 6));
  }
};
static_assert(sizeof(Sqe) == 64);
static_assert(offsetof(Sqe, opcode) == 0);
static_assert(offsetof(Sqe, flags) == 1);
static_assert(offsetof(Sqe, cid) == 2);
static_assert(offsetof(Sqe, nsid) == 4);         // CDW1
static_assert(offsetof(Sqe, key_lo) == 8);       // CDW2
static_assert(offsetof(Sqe, mptr) == 16);        // CDW4
static_assert(offsetof(Sqe, dptr) == 24);        // CDW6
static_assert(offsetof(Sqe, cdw10) == 40);       // CDW10
static_assert(offsetof(Sqe, key_length) == 44);  // CDW11 bits 7:0
static_assert(offsetof(Sqe, options) == 45);     // CDW11 bits 15:8
static_assert(offsetof(Sqe, cdw12) == 48);       // CDW12
static_assert(offsetof(Sqe, cdw13) == 52);       // CDW13
static_assert(offsetof(Sqe, key_hi) == 56);      // CDW14

// Writes key bytes into CDW2–3 and CDW14–15 and the length into CDW11 bits 7:0. Bytes past
// `len` are zeroed. REQUIRES: len <= 16.
GDKV_HD inline void pack_key(Sqe& sqe, const uint8_t* key, uint32_t len) noexcept {
  for (uint32_t i = 0; i < 8; ++i) sqe.key_lo[i] = i < len ? key[i] : 0;
  for (uint32_t i = 0; i < 8; ++i) sqe.key_hi[i] = i + 8 < len ? key[i + 8] : 0;
  sqe.key_length = static_cast<uint8_t>(len);
}

// Reads the key bytes back: writes min(key_length, 16) bytes to `out` (16 bytes of room) and
// returns the key length field as sent (which may be invalid; the caller checks it).
GDKV_HD inline uint32_t unpack_key(const Sqe& sqe, uint8_t* out) noexcept {
  for (uint32_t i = 0; i < 8; ++i) out[i] = sqe.key_lo[i];
  for (uint32_t i = 0; i < 8; ++i) out[i + 8] = sqe.key_hi[i];
  return sqe.key_length;
}

// ---- Completion queue entry --------------------------------------------------------------------
struct Cqe {
  uint32_t dw0;      // command specific: Retrieve = the value's full length
  uint32_t dw1;      // reserved
  uint16_t sq_head;  // DW2 15:0
  uint16_t sq_id;    // DW2 31:16
  uint16_t cid;      // DW3 15:0
  uint16_t status;   // DW3 31:16: bit 0 phase, 8:1 SC, 11:9 SCT, 13:12 CRD, 14 M, 15 DNR
};
static_assert(sizeof(Cqe) == 16);
static_assert(offsetof(Cqe, dw0) == 0);
static_assert(offsetof(Cqe, dw1) == 4);
static_assert(offsetof(Cqe, sq_head) == 8);
static_assert(offsetof(Cqe, sq_id) == 10);
static_assert(offsetof(Cqe, cid) == 12);
static_assert(offsetof(Cqe, status) == 14);

inline constexpr uint16_t kCqePhase = 0x0001;
inline constexpr uint16_t kCqeDnr = 0x8000;  // do not retry

// The status field without the phase bit: SC in bits 8:1 and SCT in 11:9; DNR set on errors.
GDKV_HD constexpr uint16_t make_status_field(Status sc, uint8_t sct = kSctGeneric) noexcept {
  uint16_t f = static_cast<uint16_t>((static_cast<uint16_t>(sc) << 1) | ((sct & 0x7) << 9));
  if (sc != Status::kSuccess) f |= kCqeDnr;
  return f;
}
GDKV_HD constexpr Status status_code(uint16_t field) noexcept {
  return static_cast<Status>((field >> 1) & 0xFF);
}
GDKV_HD constexpr uint8_t status_type(uint16_t field) noexcept { return (field >> 9) & 0x7; }

// ---- Data structures carried in data buffers ---------------------------------------------------
// List (06h) returns, in the host buffer: a 32-bit count of keys returned, then for each key a
// 16-bit length and the key bytes, each entry padded to a multiple of 4 bytes. Keys come back in
// ascending byte order (shorter first on a common prefix), starting with the first key equal to
// or after the key in the command. The same layout carries the key list of Prefetch (81h).
struct KeyListHeader {
  uint32_t count;
};
static_assert(sizeof(KeyListHeader) == 4);
GDKV_HD constexpr uint32_t key_list_entry_size(uint32_t key_len) noexcept {
  return (2 + key_len + 3) & ~3u;
}

// The one KeyList codec (List results, Prefetch key lists, and their readers).
// Writes a KeyList into `buf` (`cap` bytes, zeroed by the caller so padding is 0): add() appends
// an entry if it fits, finish() writes the count. bytes(): the list's length so far.
class KeyListWriter {
 public:
  GDKV_HD KeyListWriter(void* buf, size_t cap) noexcept
      : buf_(static_cast<unsigned char*>(buf)), cap_(cap) {}
  GDKV_HD bool add(const uint8_t* key, uint16_t len) noexcept {
    const size_t entry = key_list_entry_size(len);
    if (off_ + entry > cap_) return false;
    buf_[off_] = static_cast<unsigned char>(len & 0xFF);
    buf_[off_ + 1] = static_cast<unsigned char>(len >> 8);
    for (uint16_t i = 0; i < len; ++i) buf_[off_ + 2 + i] = key[i];
    off_ += entry;
    ++count_;
    return true;
  }
  GDKV_HD void finish() noexcept {
    for (int i = 0; i < 4; ++i) buf_[i] = static_cast<unsigned char>(count_ >> (8 * i));
  }
  GDKV_HD size_t bytes() const noexcept { return off_; }
  GDKV_HD uint32_t count() const noexcept { return count_; }

 private:
  unsigned char* buf_;
  size_t cap_;
  size_t off_ = sizeof(KeyListHeader);
  uint32_t count_ = 0;
};

// Reads the KeyList in `buf` (`len` bytes): calls f(key, key_len) for each entry in order.
// kInvalidField when the list is malformed (shorter than its header or its count, a count larger
// than the bytes could hold), kInvalidKeySize for a key of 0 or more than 16 bytes; the entries
// before the damage were passed.
template <class F>
GDKV_HD Status read_key_list_status(const void* buf, size_t len, F&& f) {
  const auto* b = static_cast<const unsigned char*>(buf);
  if (len < sizeof(KeyListHeader)) return Status::kInvalidField;
  const uint32_t count =
      uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
  if (count > len / 4) return Status::kInvalidField;
  size_t off = sizeof(KeyListHeader);
  for (uint32_t i = 0; i < count; ++i) {
    if (off + 2 > len) return Status::kInvalidField;
    const uint16_t klen = static_cast<uint16_t>(b[off] | b[off + 1] << 8);
    if (klen < 1 || klen > kMaxKeyLength) return Status::kInvalidKeySize;
    const size_t entry = key_list_entry_size(klen);
    if (off + entry > len) return Status::kInvalidField;
    f(b + off + 2, klen);
    off += entry;
  }
  return Status::kSuccess;
}

// read_key_list_status, as true when the whole list was read.
template <class F>
GDKV_HD bool read_key_list(const void* buf, size_t len, F&& f) {
  return read_key_list_status(buf, len, static_cast<F&&>(f)) == Status::kSuccess;
}

// The bytes a KeyList of `count` entries occupies at the start of a buffer of `cap` bytes (at most
// cap), for a reader that sees the buffer only piecewise (the vfio-user server copying a List's
// result back out of bounce memory): read_len(offset, &len) fetches an entry's 16-bit length and
// returns false if it cannot.
template <class ReadLen>
GDKV_HD uint64_t key_list_extent(ReadLen&& read_len, uint64_t cap, uint32_t count) {
  uint64_t off = sizeof(KeyListHeader);
  for (uint32_t i = 0; i < count && off + 2 <= cap; ++i) {
    uint16_t len = 0;
    if (!read_len(off, &len)) break;
    off += key_list_entry_size(len);
  }
  return off < cap ? off : cap;
}

// Scatter Retrieve (82h): the data buffer holds a ScatterHeader then `count` ScatterEntry items.
// The value is cut at the given value offsets and each piece lands at its own address, e.g. one
// slot per layer of a paged KV layout. CDW10 = the size of this descriptor buffer in bytes.
struct ScatterHeader {
  uint32_t count;
  uint32_t reserved;
};
struct ScatterEntry {
  uint64_t address;       // destination (host or registered device memory)
  uint32_t value_offset;  // where in the value this piece starts
  uint32_t length;        // bytes to place
};
static_assert(sizeof(ScatterHeader) == 8);
static_assert(sizeof(ScatterEntry) == 16);
inline constexpr uint32_t kMaxScatterEntries = 1024;

}  // namespace gdkv::nvme
