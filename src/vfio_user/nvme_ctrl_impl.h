// Private to the NVMe controller of a vfio-user connection (nvme_ctrl*.cc): shared helpers and
// the I/O command slot. The controller is split along its concerns: nvme_ctrl.cc registers,
// enable, reset and completion posting; nvme_io.cc the I/O path; nvme_dma.cc message-only DMA
// memory (bounce buffers); nvme_admin.cc the admin command set.
#pragma once

#include "vfio_user/nvme_ctrl.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>

#include "gdkv/key.h"

namespace gdkv::vfio_user {

using nvme::Status;

constexpr uint32_t kMaxBatch = 64;    // SQEs fetched per queue per poll: fairness between queues
constexpr uint32_t kAdminBatch = 16;  // admin commands per poll
constexpr uint32_t kAerLimit = 4;     // AERL + 1
constexpr uint32_t kMaxLogBytes = 1u << 20;
constexpr uint32_t kNsidBroadcast = 0xFFFFFFFF;

inline uint16_t sf(uint8_t code, uint8_t type = 0) { return status_field(code, type); }
inline uint16_t sf(Status s) { return status_field(static_cast<uint8_t>(s)); }

inline uint32_t load_db(const volatile uint32_t* p) {
  return __atomic_load_n(const_cast<const uint32_t*>(p), __ATOMIC_ACQUIRE);
}
inline void store_db(volatile uint32_t* p, uint32_t v) {
  __atomic_store_n(const_cast<uint32_t*>(p), v, __ATOMIC_RELEASE);
}

// The 32-bit CDW11 of an SQE (the KV layout of nvme::Sqe names its bytes).
inline uint32_t cdw11(const nvme::Sqe& s) {
  return static_cast<uint32_t>(s.key_length) | (static_cast<uint32_t>(s.options) << 8) |
         (static_cast<uint32_t>(s.cdw11_reserved) << 16);
}

// CDW14 as a number (the KV layout of nvme::Sqe names its bytes as key bytes 8–11).
inline uint32_t bytes_of_cdw14(const nvme::Sqe& s) {
  uint32_t v;
  std::memcpy(&v, s.key_hi, sizeof(v));
  return v;
}

inline void pad_copy(char* dst, size_t n, const std::string& s) {
  std::memset(dst, ' ', n);
  std::memcpy(dst, s.data(), std::min(n, s.size()));
}

// Resolves through a DmaSpace, pinning maps into a command's refs; message-only pieces go to
// `remote` when there is one.
class PinningResolver final : public DmaResolver {
 public:
  PinningResolver(DmaSpace& dma, MapRefs& refs, RemoteSink* remote = nullptr)
      : dma_(dma), refs_(refs), remote_(remote) {}
  Status resolve(uint64_t iova, uint64_t len, bool for_write, DataSegments& out) override {
    return dma_.resolve(iova, len, for_write, out, refs_, remote_);
  }
  bool read(uint64_t iova, void* dst, size_t len) override { return dma_.read(iova, dst, len); }

 private:
  DmaSpace& dma_;
  MapRefs& refs_;
  RemoteSink* remote_;
};

// Copies transfer bytes [off, off+len) out of the segments they were resolved to.
inline bool read_segments(const DataSegments& segs, uint64_t off, void* dst, size_t len) {
  auto* d = static_cast<std::byte*>(dst);
  for (const DataSegment& s : segs) {
    if (len == 0) break;
    if (off >= s.len) {
      off -= s.len;
      continue;
    }
    if (s.kind != MemKind::kHost) return false;
    const size_t n = std::min<uint64_t>(len, s.len - off);
    std::memcpy(d, s.addr + off, n);
    d += n;
    len -= n;
    off = 0;
  }
  return len == 0;
}

// Bytes a successful List (dw0 keys) wrote at the start of its buffer of `cap` bytes.
inline uint64_t list_bytes(const DataSegments& segs, uint32_t cap, uint32_t count) {
  return nvme::key_list_extent(
      [&](uint64_t off, uint16_t* len) { return read_segments(segs, off, len, 2); }, cap, count);
}

// The data pointer length and direction of opcodes that have one (cdw10 bytes), for staging.
inline bool data_transfer(const nvme::Sqe& sqe, bool* for_write) {
  switch (static_cast<nvme::Opcode>(sqe.opcode)) {
    case nvme::Opcode::kStore:
    case nvme::Opcode::kPrefetch:
    case nvme::Opcode::kScatterRetrieve:
      *for_write = false;
      return sqe.cdw10 != 0;
    case nvme::Opcode::kRetrieve:
    case nvme::Opcode::kList:
      *for_write = true;
      return sqe.cdw10 != 0;
    default:
      return false;
  }
}

// NGUID of a namespace: the same configuration gives the same identifier on every node, which is
// what a namespace shared through RADOS is.
inline void namespace_nguid(const NamespaceView& ns, uint8_t out[16]) {
  const std::string id = "gdkv-ns/" + std::to_string(ns.backend_nsid) + "/" + ns.name;
  const Key k = hash128(id.data(), id.size());
  std::memcpy(out, k.bytes, 16);
}

// One I/O command slot of an SQ; its own AddressSpace so translation pins maps into its refs.
//
// Message-only memory: `staged` commands had their data pointer translated when fetched (transfer
// 0, `pre`); each piece in message-only memory is a Bounce. Scatter Retrieve destinations
// resolved later (map_range, transfers 1..n) may bounce too. The descriptor list of a staged
// Scatter Retrieve is copied (`scatter_copy`) so the entries seen at completion are the ones the
// controller used.
struct NvmeController::IoCmd final : AddressSpace, RemoteSink {
  struct Bounce {
    uint64_t iova;
    uint64_t len;
    std::unique_ptr<std::byte[]> buf;
    uint32_t transfer;  // which map_data/map_range call
    uint64_t offset;    // where in that transfer
    bool to_client;
  };
  enum class Stage : uint8_t { kNone, kFetching, kWriting };

  Command cmd;
  NvmeController* owner = nullptr;
  Sq* sq = nullptr;
  MapRefs refs;

  bool staged = false;
  bool pre_write = false;
  uint64_t pre_len = 0;
  DataSegments pre;
  std::vector<std::byte> scatter_copy;
  std::vector<Bounce> bounces;
  std::vector<DmaXfer> xfers;
  uint64_t bounce_bytes = 0;
  uint64_t charged = 0;    // bounce bytes counted against the connection's budget
  uint32_t transfers = 0;  // map_range calls after the staged transfer
  Stage stage = Stage::kNone;
  uint32_t pending = 0;  // transfers submitted, not done
  bool dma_failed = false;
  uint16_t status = 0;  // held while the write-back runs
  uint32_t dw0 = 0;
  bool staging = false;  // in stage_io's translation: the only time reads may bounce (fetched next)
  // Set while resolving: where the next bounce starts in its transfer.
  const DataSegments* resolving = nullptr;
  size_t resolving_from = 0;

  std::byte* bounce(uint64_t iova, uint64_t len, bool for_write) override {
    if (!for_write && !staging) return nullptr;                     // nothing would fetch it
    if (bounce_bytes + len > owner->max_transfer_) return nullptr;  // a command's worth at most
    uint64_t off = 0;
    for (size_t i = resolving_from; i < resolving->size(); ++i) off += (*resolving)[i].len;
    bounces.push_back(
        Bounce{iova, len, std::make_unique<std::byte[]>(len), transfers, off, for_write});
    bounce_bytes += len;
    return bounces.back().buf.get();
  }

  // Runs fn(resolver) to append to `out`, with bounces for message-only pieces (staged commands
  // only).
  template <class Fn>
  Status resolve_into(DataSegments& out, Fn fn) {
    PinningResolver r(owner->dma_, refs, staged ? this : nullptr);
    resolving = &out;
    resolving_from = out.size();
    const Status s = fn(r);
    resolving = nullptr;
    return s;
  }

  Status translate(const nvme::Sqe& sqe, uint64_t len, bool for_write, DataSegments& out) {
    TranslateOptions o;
    o.flat = sq->counter;
    o.max_transfer = owner->max_transfer_;
    return resolve_into(
        out, [&](DmaResolver& r) { return translate_data(sqe, len, for_write, o, r, out); });
  }

  Status map_data(const nvme::Sqe& sqe, size_t len, bool for_write, DataSegments& out) override {
    if (staged && len == pre_len && for_write == pre_write) {
      if (!scatter_copy.empty()) {
        out.push_back(DataSegment{scatter_copy.data(), scatter_copy.size(), MemKind::kHost});
      } else {
        out.insert(out.end(), pre.begin(), pre.end());
      }
      return Status::kSuccess;
    }
    return translate(sqe, len, for_write, out);
  }
  Status map_range(uint64_t addr, size_t len, bool for_write, DataSegments& out) override {
    ++transfers;
    return resolve_into(out, [&](DmaResolver& r) { return r.resolve(addr, len, for_write, out); });
  }

  // Bytes of transfer `t` the command wrote (from the start), after it succeeded with `dw0`.
  uint64_t written(uint32_t t, uint32_t result) const {
    const auto op = static_cast<nvme::Opcode>(cmd.sqe.opcode);
    if (t == 0 && op == nvme::Opcode::kRetrieve) return std::min(cmd.sqe.cdw10, result);
    if (t == 0 && op == nvme::Opcode::kList) return list_bytes(pre, cmd.sqe.cdw10, result);
    if (t == 0 || op != nvme::Opcode::kScatterRetrieve) return 0;
    // The t-th entry with a length (the controller maps only those, in order).
    nvme::ScatterHeader h{};
    if (scatter_copy.size() < sizeof(h)) return 0;
    std::memcpy(&h, scatter_copy.data(), sizeof(h));
    uint32_t seen = 0;
    for (uint32_t i = 0; i < h.count; ++i) {
      const size_t at = sizeof(h) + size_t{i} * sizeof(nvme::ScatterEntry);
      if (at + sizeof(nvme::ScatterEntry) > scatter_copy.size()) break;
      nvme::ScatterEntry e;
      std::memcpy(&e, scatter_copy.data() + at, sizeof(e));
      if (e.length == 0 || ++seen != t) continue;
      return e.value_offset >= result ? 0 : std::min<uint64_t>(e.length, result - e.value_offset);
    }
    return 0;
  }
};

}  // namespace gdkv::vfio_user
