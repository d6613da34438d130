// NVMe controller definitions the vfio-user device emulates: BAR0 registers, admin opcodes,
// status codes of the command-specific type, and the Identify and log page data structures, each
// with its size pinned. The I/O side (SQE, CQE, KV opcodes) is gdkv/nvme_kv.h.
//
// Also the gdkv extensions of the device (all optional for standard hosts):
//   - Create I/O SQ / Create I/O CQ CDW12 bit 31: "counter doorbells". The queue's doorbell holds a
//     32-bit counter of entries (SQ: published, CQ: consumed) instead of a ring index, compared by
//     signed difference, so a late smaller write from another requester thread is harmless
//     (gdkv/queue.h). The queue size must be a power of two. On such an SQ, a command whose PRP2
//     is 0 names a contiguous IOVA range of any length in PRP1 (GPU threads cannot build PRP
//     lists).
//   - Admin opcode C0h: register or unregister device (GPU) memory by CUDA IPC handle.
//   - Identify Controller vendor area (bytes 3072+): GdkvVendorInfo.
//   - Log page C0h: the keys gdkvd's store removed from one namespace (RemovalLogHeader below).
//   - Wake-ups (vendor flag kVendorWakeups, docs/vfio-user.md "Wake-ups"): once the host fetched
//     BAR0's ioeventfd (DEVICE_GET_REGION_IO_FDS), gdkvd keeps the word at doorbell page offset
//     kWakeSleepingOffset at 1 while the reactor serving the connection sleeps; a host that finds
//     it set after ringing a doorbell signals the ioeventfd. Create I/O CQ CDW12 bit 30 ("armed
//     interrupts", with IEN): the CQ's vector is signalled only while the host has armed it by a
//     nonzero word kWakeArmOffset bytes into the CQ's head doorbell stride (2 + the CPU the
//     waiter blocks on, or 1); gdkvd clears the word when it signals. A host may store the same
//     (2 + the CPU it runs on) in the word at kWakeWakerCpuOffset before signalling the ioeventfd:
//     a reactor woken on that CPU sleeps at once after posting the completions that follow, instead
//     of spinning idle while the host waits queued behind it.
//   - Revoke: a host that gives up on the connection (a command timed out) stores a nonzero word
//     at doorbell page offset kRevokedOffset before it closes the socket; from then on gdkvd
//     fetches no command of that controller, so a command left in a queue never reads or writes
//     the host's memory after the host stopped waiting for it (a command fetched before still
//     completes).
#pragma once

#include <cstddef>
#include <cstdint>

namespace gdkv::vfio_user {

// ---- BAR0 ---------------------------------------------------------------------------------------
namespace reg {
inline constexpr uint32_t kCap = 0x00;  // 64-bit
inline constexpr uint32_t kVs = 0x08;
inline constexpr uint32_t kIntms = 0x0C;
inline constexpr uint32_t kIntmc = 0x10;
inline constexpr uint32_t kCc = 0x14;
inline constexpr uint32_t kCsts = 0x1C;
inline constexpr uint32_t kNssr = 0x20;
inline constexpr uint32_t kAqa = 0x24;
inline constexpr uint32_t kAsq = 0x28;  // 64-bit
inline constexpr uint32_t kAcq = 0x30;  // 64-bit
inline constexpr uint32_t kCmbloc = 0x38;
inline constexpr uint32_t kCmbsz = 0x3C;
inline constexpr uint32_t kDoorbells = 0x1000;
}  // namespace reg

inline constexpr uint64_t kBar0Size = 0x4000;      // a power of two >= 16 KiB
inline constexpr uint32_t kDoorbellPage = 0x1000;  // [0x1000, 0x2000): the mmappable page
inline constexpr uint32_t kDstrd = 4;              // doorbell stride 4 << 4 = 64 bytes
inline constexpr uint32_t kDoorbellStride = 4u << kDstrd;
// One doorbell page holds 4096 / (2 * 64) = 32 queue pairs: the admin queue and 31 I/O queues.
inline constexpr uint16_t kMaxQueues = 32;
inline constexpr uint16_t kMaxIoQueues = kMaxQueues - 1;
inline constexpr uint32_t kPageSize = 4096;  // CAP.MPSMIN = CAP.MPSMAX = 0

// CAP fields.
inline constexpr uint64_t kCapCqr = 1ull << 16;           // contiguous queues required
inline constexpr uint64_t kCapCssIoSets = 1ull << 43;     // CSS bit 6: one or more I/O command sets
inline constexpr uint64_t kCapCssAdminOnly = 1ull << 44;  // CSS bit 7
inline constexpr uint32_t kCapTimeout500ms = 30;          // CAP.TO: 15 s to become ready

// CC fields.
inline constexpr uint32_t kCcEn = 1u << 0;
inline constexpr uint32_t cc_css(uint32_t cc) { return (cc >> 4) & 0x7; }
inline constexpr uint32_t cc_mps(uint32_t cc) { return (cc >> 7) & 0xF; }
inline constexpr uint32_t cc_shn(uint32_t cc) { return (cc >> 14) & 0x3; }
inline constexpr uint32_t cc_iosqes(uint32_t cc) { return (cc >> 16) & 0xF; }
inline constexpr uint32_t cc_iocqes(uint32_t cc) { return (cc >> 20) & 0xF; }
inline constexpr uint32_t kCcCssIoSets = 0x6;  // 110b: all supported I/O command sets
inline constexpr uint32_t kCcCssAdminOnly = 0x7;

// CSTS fields.
inline constexpr uint32_t kCstsRdy = 1u << 0;
inline constexpr uint32_t kCstsCfs = 1u << 1;
inline constexpr uint32_t kCstsShstComplete = 2u << 2;
inline constexpr uint32_t kCstsShstMask = 3u << 2;

// ---- Admin commands -----------------------------------------------------------------------------
enum class AdminOp : uint8_t {
  kDeleteIoSq = 0x00,
  kCreateIoSq = 0x01,
  kGetLogPage = 0x02,
  kDeleteIoCq = 0x04,
  kCreateIoCq = 0x05,
  kIdentify = 0x06,
  kAbort = 0x08,
  kSetFeatures = 0x09,
  kGetFeatures = 0x0A,
  kAsyncEventRequest = 0x0C,
  kKeepAlive = 0x18,
  kGdkvDeviceMemory = 0xC0,  // vendor: register/unregister GPU memory (CUDA IPC handle)
};

// Create I/O SQ/CQ CDW12 bit 31 (gdkv): counter doorbells, see the top of this file.
inline constexpr uint32_t kCounterDoorbells = 1u << 31;
// Create I/O CQ CDW12 bit 30 (gdkv): armed interrupts, see the top of this file.
inline constexpr uint32_t kArmedInterrupts = 1u << 30;
// Byte offsets of the wake-up words: in the doorbell page (the admin SQ tail's stride, unused by
// the doorbell itself), and in a CQ head doorbell's stride.
inline constexpr uint32_t kWakeSleepingOffset = 0x20;
inline constexpr uint32_t kWakeWakerCpuOffset = 0x24;
inline constexpr uint32_t kWakeArmOffset = 0x20;
// The revoke word (doorbell page, the admin SQ tail's stride): see the top of this file.
inline constexpr uint32_t kRevokedOffset = 0x28;

// The wake-up words that name a CPU (a CQ's arm word, the waker word) hold 2 + the CPU, or 1 for
// a host thread that does not know its CPU (sched_getcpu failed).
inline constexpr uint32_t cpu_word(int cpu) {
  return cpu >= 0 ? 2u + static_cast<uint32_t>(cpu) : 1u;
}
// Whether such a word puts its host thread on `cpu` (the reactor's; an unknown CPU counts as
// this one, the cautious guess: the reactor then gives up its core instead of spinning).
inline constexpr bool names_cpu(uint32_t word, int cpu) {
  return word == 1 || (cpu >= 0 && word == cpu_word(cpu));
}

// Identify CNS values.
inline constexpr uint8_t kCnsNamespace = 0x00;
inline constexpr uint8_t kCnsController = 0x01;
inline constexpr uint8_t kCnsActiveNsList = 0x02;
inline constexpr uint8_t kCnsNsDescriptors = 0x03;
inline constexpr uint8_t kCnsCsiNamespace = 0x05;
inline constexpr uint8_t kCnsCsiController = 0x06;
inline constexpr uint8_t kCnsCsiActiveNsList = 0x07;
inline constexpr uint8_t kCnsCsIndepNamespace = 0x08;
inline constexpr uint8_t kCnsIoCommandSets = 0x1C;
inline constexpr uint8_t kCsiNvm = 0x00;
inline constexpr uint8_t kCsiKv = 0x01;

// Feature identifiers gdkvd keeps.
inline constexpr uint8_t kFeatArbitration = 0x01;
inline constexpr uint8_t kFeatPowerManagement = 0x02;
inline constexpr uint8_t kFeatTemperatureThreshold = 0x04;
inline constexpr uint8_t kFeatErrorRecovery = 0x05;
inline constexpr uint8_t kFeatVolatileWriteCache = 0x06;
inline constexpr uint8_t kFeatNumberOfQueues = 0x07;
inline constexpr uint8_t kFeatInterruptCoalescing = 0x08;
inline constexpr uint8_t kFeatInterruptVectorConfig = 0x09;
inline constexpr uint8_t kFeatWriteAtomicity = 0x0A;
inline constexpr uint8_t kFeatAsyncEventConfig = 0x0B;
inline constexpr uint8_t kFeatKeepAliveTimer = 0x0F;
inline constexpr uint8_t kFeatIoCommandSetProfile = 0x19;

// Log pages.
inline constexpr uint8_t kLogErrorInfo = 0x01;
inline constexpr uint8_t kLogSmart = 0x02;
inline constexpr uint8_t kLogFirmwareSlot = 0x03;
inline constexpr uint8_t kLogCommandEffects = 0x05;  // CSI in CDW14 bits 31:24
inline constexpr uint8_t kLogRemovals = 0xC0;        // gdkv: removed keys, see below
// Identify Controller LPA bit 1: the Commands Supported and Effects log is supported.
inline constexpr uint8_t kLpaCommandEffects = 1u << 1;
// Commands Supported and Effects log (05h): 256 admin then 256 I/O command entries (dwords).
struct CommandEffectsLog {
  uint32_t admin[256];
  uint32_t io[256];
  uint8_t reserved[2048];
};
static_assert(sizeof(CommandEffectsLog) == 4096);
inline constexpr uint32_t kEffectsCsupp = 1u << 0;  // the command is supported

// Status codes of the command-specific type (SCT 1) that admin commands return.
namespace sc {
inline constexpr uint8_t kCqInvalid = 0x00;
inline constexpr uint8_t kInvalidQueueId = 0x01;
inline constexpr uint8_t kInvalidQueueSize = 0x02;
inline constexpr uint8_t kAerLimitExceeded = 0x05;
inline constexpr uint8_t kInvalidInterruptVector = 0x08;
inline constexpr uint8_t kInvalidLogPage = 0x09;
inline constexpr uint8_t kInvalidQueueDeletion = 0x0C;
inline constexpr uint8_t kFeatureNotChangeable = 0x0E;
}  // namespace sc

// A CQE status field (phase bit clear): SC, SCT and DNR on errors.
constexpr uint16_t status_field(uint8_t code, uint8_t type = 0) {
  uint16_t f = static_cast<uint16_t>((code << 1) | ((type & 0x7) << 9));
  if (code != 0 || type != 0) f |= 0x8000;
  return f;
}

// ---- Identify data structures (4096 bytes each)
// --------------------------------------------------
struct IdentifyController {
  uint16_t vid;
  uint16_t ssvid;
  char sn[20];
  char mn[40];
  char fr[8];
  uint8_t rab;
  uint8_t ieee[3];
  uint8_t cmic;
  uint8_t mdts;  // max data transfer: 2^mdts pages of CAP.MPSMIN
  uint16_t cntlid;
  uint32_t ver;
  uint32_t rtd3r;
  uint32_t rtd3e;
  uint32_t oaes;
  uint32_t ctratt;
  uint16_t rrls;
  uint8_t rsvd102[9];
  uint8_t cntrltype;  // 1 = I/O controller
  uint8_t fguid[16];
  uint16_t crdt[3];
  uint8_t rsvd134[122];
  uint16_t oacs;
  uint8_t acl;   // abort command limit, 0's based
  uint8_t aerl;  // async event request limit, 0's based
  uint8_t frmw;
  uint8_t lpa;
  uint8_t elpe;  // error log entries, 0's based
  uint8_t npss;
  uint8_t avscc;
  uint8_t apsta;
  uint16_t wctemp;
  uint16_t cctemp;
  uint8_t rsvd270[242];
  uint8_t sqes;  // 3:0 required, 7:4 maximum, log2 bytes
  uint8_t cqes;
  uint16_t maxcmd;
  uint32_t nn;  // highest namespace ID
  uint16_t oncs;
  uint16_t fuses;
  uint8_t fna;
  uint8_t vwc;
  uint16_t awun;
  uint16_t awupf;
  uint8_t icsvscc;
  uint8_t nwpc;
  uint16_t acwu;
  uint16_t rsvd534;
  uint32_t sgls;
  uint32_t mnan;
  uint8_t rsvd544[224];
  char subnqn[256];
  uint8_t rsvd1024[1024];
  uint8_t psd[32][32];
  uint8_t vs[1024];  // vendor specific: GdkvVendorInfo
};
static_assert(sizeof(IdentifyController) == 4096);
static_assert(offsetof(IdentifyController, mdts) == 77);
static_assert(offsetof(IdentifyController, ver) == 80);
static_assert(offsetof(IdentifyController, cntrltype) == 111);
static_assert(offsetof(IdentifyController, oacs) == 256);
static_assert(offsetof(IdentifyController, sqes) == 512);
static_assert(offsetof(IdentifyController, nn) == 516);
static_assert(offsetof(IdentifyController, sgls) == 536);
static_assert(offsetof(IdentifyController, subnqn) == 768);
static_assert(offsetof(IdentifyController, psd) == 2048);
static_assert(offsetof(IdentifyController, vs) == 3072);

// In IdentifyController::vs: what a gdkv client checks before it uses the extensions.
struct GdkvVendorInfo {
  char magic[4];  // "GDKV"
  uint16_t version;
  uint16_t flags;  // kVendor* bits
  uint64_t max_value_bytes;
  uint32_t msix_vectors;
  uint32_t max_queue_entries;
};
static_assert(sizeof(GdkvVendorInfo) == 24);
inline constexpr uint16_t kVendorCounterDoorbells = 1u << 0;
inline constexpr uint16_t kVendorDeviceMemory = 1u << 1;
inline constexpr uint16_t kVendorWakeups = 1u << 2;
inline constexpr uint16_t kVendorRemovalLog = 1u << 3;  // log page C0h is served

struct LbaFormat {
  uint16_t ms;
  uint8_t lbads;
  uint8_t rp;
};
// CNS 00h (the NVM layout; for a KV namespace only the capacity fields and NGUID carry meaning).
struct IdentifyNamespace {
  uint64_t nsze;
  uint64_t ncap;
  uint64_t nuse;
  uint8_t nsfeat;
  uint8_t nlbaf;
  uint8_t flbas;
  uint8_t rsvd27[77];
  uint8_t nguid[16];
  uint8_t eui64[8];
  LbaFormat lbaf[64];
  uint8_t rsvd384[3712];
};
static_assert(sizeof(IdentifyNamespace) == 4096);
static_assert(offsetof(IdentifyNamespace, nguid) == 104);
static_assert(offsetof(IdentifyNamespace, lbaf) == 128);

// CNS 05h with CSI 01h: the KV Identify Namespace data structure.
struct KvFormat {
  uint16_t kml;  // maximum key length, bytes
  uint8_t rsvd2;
  uint8_t afo;   // additional format options
  uint32_t vml;  // maximum value length, bytes
  uint32_t mnk;  // maximum number of keys (0 = not reported)
  uint8_t rsvd12[4];
};
static_assert(sizeof(KvFormat) == 16);
struct KvIdentifyNamespace {
  uint64_t nsze;  // bytes
  uint8_t rsvd8[8];
  uint64_t nuse;  // bytes
  uint8_t nsfeat;
  uint8_t nkvf;  // number of KV formats, 0's based
  uint8_t nmic;
  uint8_t rescap;
  uint8_t fpi;
  uint8_t rsvd29[3];
  uint32_t novg;
  uint32_t anagrpid;
  uint8_t rsvd40[3];
  uint8_t nsattr;
  uint16_t nvmsetid;
  uint16_t endgid;
  uint8_t nguid[16];
  uint8_t eui64[8];
  KvFormat kvf[16];
  uint8_t rsvd328[3768];
};
static_assert(sizeof(KvIdentifyNamespace) == 4096);
static_assert(offsetof(KvIdentifyNamespace, nuse) == 16);
static_assert(offsetof(KvIdentifyNamespace, novg) == 32);
static_assert(offsetof(KvIdentifyNamespace, nguid) == 48);
static_assert(offsetof(KvIdentifyNamespace, kvf) == 72);

// CNS 08h: the I/O Command Set Independent Identify Namespace data structure.
struct CsIndepIdentifyNamespace {
  uint8_t nsfeat;
  uint8_t nmic;
  uint8_t rescap;
  uint8_t fpi;
  uint32_t anagrpid;
  uint8_t nsattr;
  uint8_t rsvd9;
  uint16_t nvmsetid;
  uint16_t endgid;
  uint8_t nstat;  // bit 0: namespace ready
  uint8_t rsvd15[4081];
};
static_assert(sizeof(CsIndepIdentifyNamespace) == 4096);
static_assert(offsetof(CsIndepIdentifyNamespace, nstat) == 14);

// CNS 03h entries: type, length, then the identifier.
inline constexpr uint8_t kNidtNguid = 0x02;
inline constexpr uint8_t kNidtCsi = 0x04;

// Log page 02h.
struct SmartLog {
  uint8_t critical_warning;
  uint16_t temperature;  // kelvin (unaligned on the wire)
  uint8_t avail_spare;
  uint8_t spare_thresh;
  uint8_t percent_used;
  uint8_t rsvd6[26];
  uint8_t data_units_read[16];  // 128-bit little-endian counters
  uint8_t data_units_written[16];
  uint8_t host_reads[16];
  uint8_t host_writes[16];
  uint8_t ctrl_busy_time[16];
  uint8_t power_cycles[16];
  uint8_t power_on_hours[16];
  uint8_t unsafe_shutdowns[16];
  uint8_t media_errors[16];
  uint8_t num_err_log_entries[16];
  uint8_t rsvd192[320];
} __attribute__((packed));
static_assert(sizeof(SmartLog) == 512);
static_assert(offsetof(SmartLog, data_units_read) == 32);
static_assert(offsetof(SmartLog, host_reads) == 64);

// Log page C0h (gdkv): the keys the store removed (deleted, evicted) from ONE namespace, for a
// subscriber that reports them (the vLLM connector's BlockRemoved). Command fields:
//   NSID        a namespace this connection may use (else Invalid Namespace); records of other
//               namespaces, and of other tenants, are never returned
//   CDW10 7:0   C0h; bits 31:16 with CDW11 15:0 NUMD (0's based dwords): the page holds the
//               header and as many records as fit, at most kRemovalMaxRecords; the buffer must
//               hold at least the header (else Invalid Field)
//   CDW10 8     (LSP bit 0) no cursor: no records, the header only (a new subscriber's start)
//   CDW12, CDW13 (LPO) the cursor `after`: records with a greater sequence number are returned
//   CDW14 23    (OT) must be 1: LPO is an index (a sequence number), not a byte offset
// A subscriber keeps (boot, next): a different boot means gdkvd restarted and its cursor is void.
inline constexpr uint32_t kRemovalNoCursor = 1u << 8;       // CDW10: LSP bit 0
inline constexpr uint32_t kLogOffsetIsIndex = 1u << 23;     // CDW14: OT
inline constexpr uint32_t kLogRetainAsyncEvent = 1u << 15;  // CDW10: RAE (no events: ignored)
inline constexpr uint32_t kRemovalMaxRecords = 4096;
struct RemovalLogHeader {
  uint64_t boot;          // this removal log's life (a new one after a gdkvd restart)
  uint64_t last;          // the newest sequence number given, all namespaces (0: none yet)
  uint64_t first;         // the oldest kept (last + 1 when none)
  uint64_t next;          // the cursor to pass next: the newest sequence number this answer covered
  uint32_t count;         // records that follow the header
  uint32_t flags;         // kRemovals* bits
  uint16_t record_bytes;  // sizeof(RemovalRecord)
  uint8_t reserved[22];
};
static_assert(sizeof(RemovalLogHeader) == 64);
static_assert(offsetof(RemovalLogHeader, next) == 24);
static_assert(offsetof(RemovalLogHeader, count) == 32);
static_assert(offsetof(RemovalLogHeader, flags) == 36);
static_assert(offsetof(RemovalLogHeader, record_bytes) == 40);
// Records were missed: dropped before they were read, a cursor from another boot or from the
// future, or a backend that lost track (a broken RADOS watch). Treat every key as possibly gone.
inline constexpr uint32_t kRemovalsLost = 1u << 0;
inline constexpr uint32_t kRemovalsMore = 1u << 1;  // records after `next` remain: read again
struct RemovalRecord {
  uint64_t seq;
  uint8_t key_length;  // 1..16
  uint8_t reserved[7];
  uint8_t key[16];
};
static_assert(sizeof(RemovalRecord) == 32);
static_assert(offsetof(RemovalRecord, key) == 16);

// Admin C0h (gdkv): the data buffer (CDW10 = its length) holds this; CDW11 = kDevMem* operation.
inline constexpr uint32_t kDevMemRegister = 0;
inline constexpr uint32_t kDevMemUnregister = 1;
struct DeviceMemoryRequest {
  uint8_t ipc_handle[64];  // cudaIpcMemHandle_t of the allocation (register)
  uint64_t iova;           // where it appears in the client's DMA space (its device pointer)
  uint64_t size;           // bytes (register)
  uint32_t flags;          // reserved, must be 0
  uint32_t reserved;
};
static_assert(sizeof(DeviceMemoryRequest) == 88);
// Completion DW0 of a failed C0h names why (status 02h invalid field).
inline constexpr uint32_t kDevMemErrNotSupported = 1;  // this gdkvd has no device memory importer
inline constexpr uint32_t kDevMemErrBadRequest = 2;    // length, alignment, flags or size
inline constexpr uint32_t kDevMemErrOverlap = 3;       // overlaps an existing map
inline constexpr uint32_t kDevMemErrImport = 4;        // the importer refused the handle
inline constexpr uint32_t kDevMemErrNotFound = 5;      // unregister: no such region
inline constexpr uint32_t kDevMemErrBusy = 6;          // unregister: a queue lives there

}  // namespace gdkv::vfio_user
