// The vfio-user wire format (QEMU docs/interop/vfio-user.rst): the 16-byte message header, the
// payload of every command gdkvd serves or sends, and validation of what arrives on the socket.
//
// Everything here is plain data and pure functions: decoding never trusts a length it has not
// checked against the bytes actually received, so the server, the client driver and the fuzz
// targets share one set of checks. Host byte order (the protocol's rule for AF_UNIX peers).
//
// Thread safety: no state; safe from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace gdkv::vfio_user {

// ---- Header ------------------------------------------------------------------------------------
enum class Cmd : uint16_t {
  kVersion = 1,
  kDmaMap = 2,
  kDmaUnmap = 3,
  kDeviceGetInfo = 4,
  kDeviceGetRegionInfo = 5,
  kDeviceGetRegionIoFds = 6,
  kDeviceGetIrqInfo = 7,
  kDeviceSetIrqs = 8,
  kRegionRead = 9,
  kRegionWrite = 10,
  kDmaRead = 11,   // server -> client
  kDmaWrite = 12,  // server -> client
  kDeviceReset = 13,
  kRegionWriteMulti = 15,
  kDeviceFeature = 16,
  kMigDataRead = 17,
  kMigDataWrite = 18,
};
const char* cmd_name(uint16_t cmd) noexcept;

struct Header {
  uint16_t id;       // chosen by the sender, echoed in the reply
  uint16_t command;  // Cmd
  uint32_t size;     // whole message, header included
  uint32_t flags;    // kType*, kNoReply, kError
  uint32_t error;    // errno in error replies; reserved in commands
};
static_assert(sizeof(Header) == 16);

inline constexpr uint32_t kTypeMask = 0xF;
inline constexpr uint32_t kTypeCommand = 0x0;
inline constexpr uint32_t kTypeReply = 0x1;
inline constexpr uint32_t kNoReply = 1u << 4;
inline constexpr uint32_t kErrorFlag = 1u << 5;

// Protocol versions this implementation speaks: major 0, minors up to kMaxMinor.
inline constexpr uint16_t kMajor = 0;
inline constexpr uint16_t kMaxMinor = 2;

// Limits. kMaxDataXfer is the largest REGION/DMA read or write payload we send or accept (the
// spec's default max_data_xfer_size); a message can be no larger than that plus its fixed part.
inline constexpr uint32_t kMaxDataXfer = 1u << 20;
inline constexpr uint32_t kMaxMessage = kMaxDataXfer + 64;
inline constexpr uint32_t kMaxMsgFds = 16;         // fds we accept in one message
inline constexpr uint32_t kMaxVersionJson = 4096;  // bytes of capabilities JSON we parse

// ---- Payloads ----------------------------------------------------------------------------------
struct VersionMsg {
  uint16_t major;
  uint16_t minor;
  // then optional NUL-terminated JSON
};
static_assert(sizeof(VersionMsg) == 4);

inline constexpr uint32_t kDmaFlagRead = 1u << 0;
inline constexpr uint32_t kDmaFlagWrite = 1u << 1;
struct DmaMapMsg {
  uint32_t argsz;
  uint32_t flags;   // kDmaFlagRead | kDmaFlagWrite
  uint64_t offset;  // file offset of the region in the fd
  uint64_t addr;    // DMA (IO virtual) address
  uint64_t size;
};
static_assert(sizeof(DmaMapMsg) == 32);

inline constexpr uint32_t kDmaUnmapFlagGetDirtyBitmap = 1u << 0;
inline constexpr uint32_t kDmaUnmapFlagAll = 1u << 1;
struct DmaUnmapMsg {
  uint32_t argsz;
  uint32_t flags;
  uint64_t addr;
  uint64_t size;
};
static_assert(sizeof(DmaUnmapMsg) == 24);

inline constexpr uint32_t kDeviceFlagReset = 1u << 0;
inline constexpr uint32_t kDeviceFlagPci = 1u << 1;
struct DeviceInfoMsg {
  uint32_t argsz;
  uint32_t flags;
  uint32_t num_regions;
  uint32_t num_irqs;
};
static_assert(sizeof(DeviceInfoMsg) == 16);

// PCI region indexes (linux/vfio.h VFIO_PCI_*_REGION_INDEX).
inline constexpr uint32_t kRegionBar0 = 0;
inline constexpr uint32_t kRegionBar4 = 4;
inline constexpr uint32_t kRegionRom = 6;
inline constexpr uint32_t kRegionConfig = 7;
inline constexpr uint32_t kRegionVga = 8;
inline constexpr uint32_t kNumPciRegions = 9;

inline constexpr uint32_t kRegionFlagRead = 1u << 0;
inline constexpr uint32_t kRegionFlagWrite = 1u << 1;
inline constexpr uint32_t kRegionFlagMmap = 1u << 2;
inline constexpr uint32_t kRegionFlagCaps = 1u << 3;
struct RegionInfoMsg {
  uint32_t argsz;
  uint32_t flags;
  uint32_t index;
  uint32_t cap_offset;  // from the start of this struct
  uint64_t size;
  uint64_t offset;  // mmap offset base for the region and its sparse areas
};
static_assert(sizeof(RegionInfoMsg) == 32);

struct CapHeader {
  uint16_t id;
  uint16_t version;
  uint32_t next;  // offset of the next capability from the start of RegionInfoMsg; 0 = last
};
static_assert(sizeof(CapHeader) == 8);
inline constexpr uint16_t kCapSparseMmap = 1;
struct SparseMmapCap {
  CapHeader header;
  uint32_t nr_areas;
  uint32_t reserved;
};
struct SparseArea {
  uint64_t offset;
  uint64_t size;
};
static_assert(sizeof(SparseMmapCap) == 16);
static_assert(sizeof(SparseArea) == 16);

// IRQ indexes (VFIO_PCI_*_IRQ_INDEX).
inline constexpr uint32_t kIrqIntx = 0;
inline constexpr uint32_t kIrqMsi = 1;
inline constexpr uint32_t kIrqMsix = 2;
inline constexpr uint32_t kIrqErr = 3;
inline constexpr uint32_t kIrqReq = 4;
inline constexpr uint32_t kNumIrqTypes = 5;

inline constexpr uint32_t kIrqInfoEventfd = 1u << 0;
inline constexpr uint32_t kIrqInfoMaskable = 1u << 1;
inline constexpr uint32_t kIrqInfoAutomasked = 1u << 2;
inline constexpr uint32_t kIrqInfoNoresize = 1u << 3;
struct IrqInfoMsg {
  uint32_t argsz;
  uint32_t flags;
  uint32_t index;
  uint32_t count;
};
static_assert(sizeof(IrqInfoMsg) == 16);

inline constexpr uint32_t kIrqSetDataNone = 1u << 0;
inline constexpr uint32_t kIrqSetDataBool = 1u << 1;
inline constexpr uint32_t kIrqSetDataEventfd = 1u << 2;
inline constexpr uint32_t kIrqSetActionMask = 1u << 3;
inline constexpr uint32_t kIrqSetActionUnmask = 1u << 4;
inline constexpr uint32_t kIrqSetActionTrigger = 1u << 5;
inline constexpr uint32_t kIrqSetDataMask = kIrqSetDataNone | kIrqSetDataBool | kIrqSetDataEventfd;
inline constexpr uint32_t kIrqSetActionMaskAll =
    kIrqSetActionMask | kIrqSetActionUnmask | kIrqSetActionTrigger;
struct IrqSetMsg {
  uint32_t argsz;
  uint32_t flags;
  uint32_t index;
  uint32_t start;
  uint32_t count;
  // then `count` bool bytes with kIrqSetDataBool
};
static_assert(sizeof(IrqSetMsg) == 20);

// DEVICE_GET_REGION_IO_FDS: request and reply header, then `count` sub-regions (the reply's fds
// come as SCM_RIGHTS, each sub-region naming one by index).
struct RegionIoFdsMsg {
  uint32_t argsz;  // request: the reply payload the client can take; reply: what it needs
  uint32_t flags;  // 0
  uint32_t index;  // region
  uint32_t count;  // reply: sub-regions
};
static_assert(sizeof(RegionIoFdsMsg) == 16);
inline constexpr uint32_t kIoFdTypeIoeventfd = 0;
inline constexpr uint32_t kIoFdTypeIoregionfd = 1;
struct IoFdSubRegion {
  uint64_t offset;  // in the region
  uint64_t size;
  uint32_t fd_index;
  uint32_t type;  // kIoFdType*
  uint32_t flags;
  uint32_t padding;
  uint64_t datamatch;  // ioeventfd: with KVM_IOEVENTFD_FLAG_DATAMATCH (not used here)
};
static_assert(sizeof(IoFdSubRegion) == 40);

struct RegionAccessMsg {
  uint64_t offset;
  uint32_t region;
  uint32_t count;
  // then data (write request, read reply)
};
static_assert(sizeof(RegionAccessMsg) == 16);

struct DmaAccessMsg {
  uint64_t addr;
  uint64_t count;
  // then data (DMA_WRITE request, DMA_READ reply)
};
static_assert(sizeof(DmaAccessMsg) == 16);

struct WriteMultiEntry {
  uint64_t offset;
  uint32_t region;
  uint32_t count;  // 1..8
  uint8_t data[8];
};
static_assert(sizeof(WriteMultiEntry) == 24);
inline constexpr uint64_t kMaxWriteMulti = 256;  // entries in one REGION_WRITE_MULTI

// ---- Validation --------------------------------------------------------------------------------
enum class HeaderError : uint8_t {
  kOk,
  kTooShort,  // size < 16: framing is lost
  kTooLarge,  // size > limit: we will not buffer it
  kBadType,   // neither command nor reply
};
// Checks a header before its payload is read. `max_size` bounds the whole message.
HeaderError check_header(const Header& h, uint32_t max_size = kMaxMessage) noexcept;

// A payload view with bounds-checked reads: every get() fails cleanly past the end.
class PayloadReader {
 public:
  explicit PayloadReader(std::span<const std::byte> p) : p_(p) {}
  size_t size() const { return p_.size(); }
  // Copies a T from byte offset `off`; nullopt if it does not fit.
  template <class T>
  std::optional<T> get(size_t off = 0) const;
  std::span<const std::byte> tail(size_t off) const {
    return off <= p_.size() ? p_.subspan(off) : std::span<const std::byte>{};
  }

 private:
  std::span<const std::byte> p_;
};

template <class T>
std::optional<T> PayloadReader::get(size_t off) const {
  static_assert(std::is_trivially_copyable_v<T>);
  if (off > p_.size() || p_.size() - off < sizeof(T)) return std::nullopt;
  T v;
  std::memcpy(&v, p_.data() + off, sizeof(T));
  return v;
}

// ---- VERSION capabilities ----------------------------------------------------------------------
// What a VERSION payload proposes. Keys absent from the JSON stay nullopt.
struct Capabilities {
  bool has_json = false;  // the message carried a JSON document
  std::optional<uint64_t> max_msg_fds;
  std::optional<uint64_t> max_data_xfer_size;
  std::optional<uint64_t> max_dma_maps;
  std::optional<uint64_t> pgsizes;
  std::optional<bool> write_multiple;
  bool twin_socket = false;  // twin_socket.supported
  bool migration = false;    // a migration object was present
};

struct VersionRequest {
  uint16_t major = 0;
  uint16_t minor = 0;
  Capabilities caps;
};

// Decodes a VERSION payload. Returns an errno (EINVAL) for a short payload, JSON that is not
// NUL-terminated, malformed, deeper than 16 levels or not an object, or a capability of the wrong
// type; 0 on success.
int decode_version(std::span<const std::byte> payload, VersionRequest* out);

// The JSON capabilities of our VERSION reply: a subset of what the client proposed (the spec's
// rule), with our limits. Kept short because QEMU sizes its reply buffer by its own request.
std::string version_reply_json(const Capabilities& proposed, uint32_t max_dma_maps);

// ---- Minimal JSON ------------------------------------------------------------------------------
// A JSON value, enough for capability documents. Parsing is bounded (depth, length) and never
// throws.
struct JsonValue {
  enum class Type : uint8_t { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool b = false;
  double num = 0;
  bool is_uint = false;  // the number was a non-negative integer that fits in uint64
  uint64_t u = 0;
  std::string str;
  std::vector<JsonValue> items;   // array elements, or object member values
  std::vector<std::string> keys;  // object member names, parallel to items

  const JsonValue* find(std::string_view key) const;
};
// Parses exactly one JSON value spanning `text` (surrounding whitespace allowed).
std::optional<JsonValue> parse_json(std::string_view text, int max_depth = 16);

}  // namespace gdkv::vfio_user
