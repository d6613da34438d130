// The NVMe controller of one vfio-user connection (see nvme_ctrl.h).
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

namespace {

using nvme::Status;

constexpr uint32_t kMaxBatch = 64;    // SQEs fetched per queue per poll: fairness between queues
constexpr uint32_t kAdminBatch = 16;  // admin commands per poll
constexpr uint32_t kAerLimit = 4;     // AERL + 1
constexpr uint32_t kMaxLogBytes = 1u << 20;
constexpr uint32_t kNsidBroadcast = 0xFFFFFFFF;

uint16_t sf(uint8_t code, uint8_t type = 0) { return status_field(code, type); }
uint16_t sf(Status s) { return status_field(static_cast<uint8_t>(s)); }

uint32_t load_db(const volatile uint32_t* p) {
  return __atomic_load_n(const_cast<const uint32_t*>(p), __ATOMIC_ACQUIRE);
}
void store_db(volatile uint32_t* p, uint32_t v) {
  __atomic_store_n(const_cast<uint32_t*>(p), v, __ATOMIC_RELEASE);
}

// The 32-bit CDW11 of an SQE (the KV layout of nvme::Sqe names its bytes).
uint32_t cdw11(const nvme::Sqe& s) {
  return static_cast<uint32_t>(s.key_length) | (static_cast<uint32_t>(s.options) << 8) |
         (static_cast<uint32_t>(s.cdw11_reserved) << 16);
}

// CDW14 as a number (the KV layout of nvme::Sqe names its bytes as key bytes 8–11).
uint32_t bytes_of_cdw14(const nvme::Sqe& s) {
  uint32_t v;
  std::memcpy(&v, s.key_hi, sizeof(v));
  return v;
}

void pad_copy(char* dst, size_t n, const std::string& s) {
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
bool read_segments(const DataSegments& segs, uint64_t off, void* dst, size_t len) {
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
uint64_t list_bytes(const DataSegments& segs, uint32_t cap, uint32_t count) {
  uint64_t off = sizeof(nvme::KeyListHeader);
  for (uint32_t i = 0; i < count && off + 2 <= cap; ++i) {
    uint16_t len = 0;
    if (!read_segments(segs, off, &len, 2)) break;
    off += nvme::key_list_entry_size(len);
  }
  return std::min<uint64_t>(off, cap);
}

// The data pointer length and direction of opcodes that have one (cdw10 bytes), for staging.
bool data_transfer(const nvme::Sqe& sqe, bool* for_write) {
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
void namespace_nguid(const NamespaceView& ns, uint8_t out[16]) {
  const std::string id = "gdkv-ns/" + std::to_string(ns.backend_nsid) + "/" + ns.name;
  const Key k = hash128(id.data(), id.size());
  std::memcpy(out, k.bytes, 16);
}

}  // namespace

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

NvmeController::NvmeController(Controller& ctl, DmaSpace& dma, IrqSink& irq,
                               NvmeControllerConfig config, DmaChannel* channel)
    : ctl_(ctl), dma_(dma), irq_(irq), config_(std::move(config)), channel_(channel) {
  if (config_.max_queue_entries < 2 || config_.max_queue_entries > 65536) {
    config_.max_queue_entries = 4096;
  }
  if (config_.msix_vectors == 0 || config_.msix_vectors > 2048) config_.msix_vectors = 32;
  std::sort(config_.namespaces.begin(), config_.namespaces.end(),
            [](const NamespaceView& a, const NamespaceView& b) { return a.nsid < b.nsid; });
  // The doorbell page is shared with the client through a sealed memfd: sealed so the client,
  // which gets the fd, cannot shrink it under our mapping.
  db_fd_.reset(::memfd_create("gdkvd-doorbells", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!db_fd_.valid() || ::ftruncate(db_fd_.get(), 2 * kDoorbellPage) != 0 ||
      ::fcntl(db_fd_.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    throw std::runtime_error(std::string("doorbell memfd: ") + std::strerror(errno));
  }
  db_map_ = ::mmap(nullptr, 2 * kDoorbellPage, PROT_READ | PROT_WRITE, MAP_SHARED, db_fd_.get(), 0);
  if (db_map_ == MAP_FAILED) {
    db_map_ = nullptr;
    throw std::runtime_error(std::string("doorbell mmap: ") + std::strerror(errno));
  }
  db_ = reinterpret_cast<uint32_t*>(static_cast<char*>(db_map_) + kDoorbellPage);
  features_[kFeatTemperatureThreshold] = 0x0157;  // 343 K
  // MDTS: the smallest power-of-two number of pages that holds the largest value (and at least
  // 1 MiB, for List buffers).
  const uint64_t want = std::max<uint64_t>(config_.max_value_bytes, uint64_t{1} << 20);
  mdts_ = 1;
  while (mdts_ < 30 && (uint64_t{kPageSize} << mdts_) < want) ++mdts_;
  max_transfer_ = uint64_t{kPageSize} << mdts_;
}

NvmeController::~NvmeController() {
  abandon_import();
  teardown_queues();
  if (dying_map_) dying_map_.reset();
  DmaSpace::unpin(admin_refs_);
  if (db_map_ != nullptr) ::munmap(db_map_, 2 * kDoorbellPage);
}

volatile uint32_t* NvmeController::sq_doorbell(uint16_t qid) const {
  return db_ + (2u * qid) * (kDoorbellStride / 4);
}
volatile uint32_t* NvmeController::cq_doorbell(uint16_t qid) const {
  return db_ + (2u * qid + 1) * (kDoorbellStride / 4);
}

// ---- Registers (socket thread)
// -------------------------------------------------------------------

uint32_t NvmeController::read_reg32(uint32_t off) const {
  const uint64_t cap = uint64_t{config_.max_queue_entries - 1} | kCapCqr |
                       (uint64_t{kCapTimeout500ms} << 24) | (uint64_t{kDstrd} << 32) |
                       kCapCssIoSets;
  std::lock_guard lk(regs_mu_);
  switch (off) {
    case reg::kCap:
      return static_cast<uint32_t>(cap);
    case reg::kCap + 4:
      return static_cast<uint32_t>(cap >> 32);
    case reg::kVs:
      return 0x00020000;  // NVMe 2.0
    case reg::kCc:
      return cc_;
    case reg::kCsts:
      return csts_.load(std::memory_order_acquire);
    case reg::kAqa:
      return aqa_;
    case reg::kAsq:
      return static_cast<uint32_t>(asq_);
    case reg::kAsq + 4:
      return static_cast<uint32_t>(asq_ >> 32);
    case reg::kAcq:
      return static_cast<uint32_t>(acq_);
    case reg::kAcq + 4:
      return static_cast<uint32_t>(acq_ >> 32);
    default:
      return 0;  // INTMS/INTMC (MSI-X only), NSSR, CMB, PMR: not implemented
  }
}

void NvmeController::write_reg32(uint32_t off, uint32_t value) {
  std::lock_guard lk(regs_mu_);
  const bool enabled = cc_ & kCcEn;
  switch (off) {
    case reg::kCc:
      cc_ = value;
      cc_dirty_.store(true, std::memory_order_release);
      break;
    // The admin queue registers take effect when the controller is enabled; writes while it is
    // enabled are ignored, as the spec leaves them undefined.
    case reg::kAqa:
      if (!enabled) aqa_ = value & 0x0FFF0FFF;
      break;
    case reg::kAsq:
      if (!enabled) asq_ = (asq_ & ~uint64_t{0xFFFFFFFF}) | value;
      break;
    case reg::kAsq + 4:
      if (!enabled) asq_ = (asq_ & 0xFFFFFFFF) | (uint64_t{value} << 32);
      break;
    case reg::kAcq:
      if (!enabled) acq_ = (acq_ & ~uint64_t{0xFFFFFFFF}) | value;
      break;
    case reg::kAcq + 4:
      if (!enabled) acq_ = (acq_ & 0xFFFFFFFF) | (uint64_t{value} << 32);
      break;
    default:
      break;  // read-only or not implemented
  }
}

bool NvmeController::bar0_read(uint64_t offset, std::span<std::byte> out) const {
  if (offset > kBar0Size || out.size() > kBar0Size - offset) return false;
  for (size_t i = 0; i < out.size();) {
    const uint64_t at = offset + i;
    const uint32_t dword_at = static_cast<uint32_t>(at & ~uint64_t{3});
    uint32_t v = 0;
    if (dword_at < reg::kDoorbells) {
      v = read_reg32(dword_at);
    } else if (dword_at < reg::kDoorbells + kDoorbellPage) {
      v = load_db(db_ + (dword_at - reg::kDoorbells) / 4);
    }
    for (uint32_t b = static_cast<uint32_t>(at & 3); b < 4 && i < out.size(); ++b, ++i) {
      out[i] = static_cast<std::byte>(v >> (8 * b));
    }
  }
  return true;
}

bool NvmeController::bar0_write(uint64_t offset, std::span<const std::byte> in) {
  if (offset > kBar0Size || in.size() > kBar0Size - offset) return false;
  for (size_t i = 0; i < in.size();) {
    const uint64_t at = offset + i;
    const uint32_t dword_at = static_cast<uint32_t>(at & ~uint64_t{3});
    const bool doorbell = dword_at >= reg::kDoorbells && dword_at < reg::kDoorbells + kDoorbellPage;
    uint32_t v = 0;
    if (dword_at < reg::kDoorbells) {
      v = read_reg32(dword_at);
    } else if (doorbell) {
      v = load_db(db_ + (dword_at - reg::kDoorbells) / 4);
    }
    for (uint32_t b = static_cast<uint32_t>(at & 3); b < 4 && i < in.size(); ++b, ++i) {
      v = (v & ~(0xFFu << (8 * b))) | (static_cast<uint32_t>(in[i]) << (8 * b));
    }
    if (dword_at < reg::kDoorbells) {
      write_reg32(dword_at, v);
    } else if (doorbell) {
      // A doorbell written by message instead of through the mapping: the same memory.
      store_db(db_ + (dword_at - reg::kDoorbells) / 4, v);
    }
  }
  return true;
}

// ---- Reactor: enable, reset, polling
// -------------------------------------------------------------

bool NvmeController::poll() {
  bool busy = process_dma();
  if (drop_pending_.load(std::memory_order_acquire)) busy |= continue_drop();
  if (cc_dirty_.load(std::memory_order_relaxed) &&
      cc_dirty_.exchange(false, std::memory_order_acq_rel)) {
    handle_cc();
    busy = true;
  }
  if (resetting_) busy |= continue_reset();
  if (!enabled_) return busy;
  for (Cq& cq : cqs_) {
    if (!cq.active) continue;
    refresh_cq_head(cq);
    if (!cq.overflow.empty()) busy |= flush(cq);
  }
  if (shutting_down_) {
    if (inflight_.load(std::memory_order_acquire) == 0) {
      csts_.store((csts_.load() & ~kCstsShstMask) | kCstsShstComplete);
      shutting_down_ = false;
      busy = true;
    }
  } else if (!stopping_.load(std::memory_order_acquire) &&
             !(csts_.load(std::memory_order_relaxed) & kCstsShstMask)) {
    busy |= process_deferred();
    if (deferred_ == Deferred::kNone) busy |= process_admin();
    for (uint16_t q = 1; q < kMaxQueues; ++q) {
      Sq& sq = sqs_[q];
      if (sq.active && !sq.deleting) busy |= fetch_io(sq);
    }
  }
  signal_irqs();
  return busy;
}

void NvmeController::handle_cc() {
  uint32_t cc, aqa;
  uint64_t asq, acq;
  {
    std::lock_guard lk(regs_mu_);
    cc = cc_;
    aqa = aqa_;
    asq = asq_;
    acq = acq_;
  }
  if (!(cc & kCcEn)) {
    if (enabled_ || (csts_.load() & (kCstsRdy | kCstsCfs | kCstsShstMask)) != 0) begin_reset();
    return;
  }
  if (resetting_) return;  // continue_reset() looks at CC again when it is done
  if (!enabled_) {
    if (!(csts_.load() & kCstsCfs) && !enable(cc, aqa, asq, acq)) {
      csts_.store(kCstsCfs, std::memory_order_release);
    }
    return;
  }
  // Enabled: a shutdown notification, or the I/O entry sizes the host sets before creating queues.
  if (cc_shn(cc) != 0 && !(csts_.load() & kCstsShstMask)) shutting_down_ = true;
}

bool NvmeController::enable(uint32_t cc, uint32_t aqa, uint64_t asq, uint64_t acq) {
  const uint32_t css = cc_css(cc);
  // 110b: the I/O command sets (KV). 111b: admin only. 000b (NVM only, which CAP does not offer)
  // is tolerated for hosts that fall back to it: the controller runs with no active namespaces.
  if (css != kCcCssIoSets && css != kCcCssAdminOnly && css != 0) return false;
  if (cc_mps(cc) != 0) return false;  // 4 KiB pages only (CAP.MPSMIN = MPSMAX = 0)
  const uint32_t asqs = (aqa & 0xFFF) + 1;
  const uint32_t acqs = ((aqa >> 16) & 0xFFF) + 1;
  if (asqs < 2 || acqs < 2) return false;
  if (((asq | acq) & (kPageSize - 1)) != 0) return false;
  Sq& s = sqs_[0];
  Cq& c = cqs_[0];
  DmaMap* sm = nullptr;
  DmaMap* cm = nullptr;
  auto* sring = dma_.acquire_queue(asq, uint64_t{asqs} * sizeof(nvme::Sqe), false, &sm);
  auto* cring = dma_.acquire_queue(acq, uint64_t{acqs} * sizeof(nvme::Cqe), true, &cm);
  if (sring == nullptr || cring == nullptr) {
    DmaSpace::release_queue(sm);
    DmaSpace::release_queue(cm);
    return false;
  }
  c = Cq{};
  c.active = true;
  c.id = 0;
  c.size = acqs;
  c.ring = reinterpret_cast<nvme::Cqe*>(cring);
  c.map = cm;
  c.ien = true;  // the admin CQ always interrupts on vector 0
  c.sqs = 1;
  s.active = true;
  s.id = 0;
  s.size = asqs;
  s.cqid = 0;
  s.ring = reinterpret_cast<const nvme::Sqe*>(sring);
  s.map = sm;
  s.head = 0;
  admin_sq_size_ = asqs;
  css_ = css;
  enabled_ = true;
  csts_.store(kCstsRdy, std::memory_order_release);
  return true;
}

void NvmeController::begin_reset() {
  resetting_ = true;
  enabled_ = false;
  shutting_down_ = false;
}

bool NvmeController::continue_reset() {
  // Commands in flight write into client memory until they complete; the host may reuse that
  // memory once RDY is clear, so RDY clears only after the last one.
  if (inflight_.load(std::memory_order_acquire) != 0) return false;
  if (import_ && !import_->done.load(std::memory_order_acquire)) return false;  // let it finish
  teardown_queues();
  aers_.clear();
  std::fill(std::begin(features_), std::end(features_), 0u);
  features_[kFeatTemperatureThreshold] = 0x0157;
  nsqa_ = ncqa_ = kMaxIoQueues;
  abandon_import();
  deferred_ = Deferred::kNone;
  dying_map_.reset();
  resetting_ = false;
  csts_.store(0, std::memory_order_release);
  {
    std::lock_guard lk(regs_mu_);
    if (cc_ & kCcEn) cc_dirty_.store(true, std::memory_order_release);  // enabled again meanwhile
  }
  return true;
}

bool NvmeController::drop_queues_in(const DmaMap* map, std::chrono::milliseconds timeout) {
  std::unique_lock lk(drop_mu_);
  drop_map_ = map;
  drop_pending_.store(true, std::memory_order_release);
  if (drop_cv_.wait_for(lk, timeout, [&] { return drop_map_ == nullptr; })) return true;
  drop_map_ = nullptr;  // given up: the reactor forgets the request
  drop_pending_.store(false, std::memory_order_release);
  return false;
}

bool NvmeController::continue_drop() {
  std::lock_guard lk(drop_mu_);
  const DmaMap* m = drop_map_;
  if (m == nullptr) return false;
  const auto doomed = [&](const Sq& sq) {
    return sq.active && (sq.map == m || cqs_[sq.cqid].map == m);
  };
  // Fetch nothing more from them; commands in flight still post their completions, into memory
  // that stays mapped until this returns.
  bool waiting = false;
  for (Sq& sq : sqs_) {
    if (!doomed(sq)) continue;
    sq.deleting = true;
    if (sq.inflight != 0) waiting = true;
  }
  if (waiting) return false;
  signal_irqs();  // completions posted since the last poll still get their interrupt
  const bool live = enabled_ && (csts_.load() & kCstsShstMask) != kCstsShstComplete;
  bool lost = false;
  for (Sq& sq : sqs_) {
    if (!doomed(sq)) continue;
    lost = true;
    destroy_sq(sq);
  }
  for (Cq& cq : cqs_) {
    if (!cq.active || cq.map != m) continue;
    lost = true;
    destroy_cq(cq);
  }
  if (live && lost) csts_.fetch_or(kCstsCfs, std::memory_order_acq_rel);
  drop_map_ = nullptr;
  drop_pending_.store(false, std::memory_order_release);
  drop_cv_.notify_all();
  return true;
}

void NvmeController::teardown_queues() {
  for (uint16_t q = kMaxQueues; q-- > 0;) {
    if (sqs_[q].active) destroy_sq(sqs_[q]);
  }
  for (uint16_t q = kMaxQueues; q-- > 0;) {
    if (cqs_[q].active) destroy_cq(cqs_[q]);
  }
  for (uint32_t i = 0; i < kDoorbellPage / 4; ++i) store_db(db_ + i, 0);
  enabled_ = false;
}

void NvmeController::destroy_sq(Sq& sq) {
  DmaSpace::release_queue(sq.map);
  if (sq.id != 0 && cqs_[sq.cqid].sqs > 0) --cqs_[sq.cqid].sqs;
  sq = Sq{};
}

void NvmeController::destroy_cq(Cq& cq) {
  DmaSpace::release_queue(cq.map);
  cq = Cq{};
}

void NvmeController::refresh_cq_head(Cq& cq) {
  const uint32_t v = load_db(cq_doorbell(cq.id));
  if (v == cq.head) return;
  if (cq.counter) {
    // A head behind ours is a late write from another requester thread: harmless, ignored.
    if (v - cq.head <= cq.tail - cq.head) cq.head = v;
    return;
  }
  const uint32_t outstanding = (cq.tail + cq.size - cq.head) % cq.size;
  if (v < cq.size && (v + cq.size - cq.head) % cq.size <= outstanding) {
    cq.head = v;
  } else {
    stats_.bad_doorbells.fetch_add(1, std::memory_order_relaxed);
  }
}

bool NvmeController::post(Cq& cq, const PendingCqe& e) {
  uint32_t slot;
  uint16_t phase;
  if (cq.counter) {
    if (cq.tail - cq.head >= cq.size) return false;
    slot = cq.tail & (cq.size - 1);
    phase = ((cq.tail / cq.size) & 1) ? 0 : 1;
  } else {
    if ((cq.tail + 1) % cq.size == cq.head) return false;
    slot = cq.tail;
    phase = cq.phase;
  }
  nvme::Cqe* p = &cq.ring[slot];
  p->dw0 = e.dw0;
  p->dw1 = 0;
  p->sq_head = e.sq_head;
  p->sq_id = e.sqid;
  p->cid = e.cid;
  __atomic_store_n(&p->status, static_cast<uint16_t>(e.status | phase), __ATOMIC_RELEASE);
  if (cq.counter) {
    ++cq.tail;
  } else if (++cq.tail == cq.size) {
    cq.tail = 0;
    cq.phase ^= 1;
  }
  cq.irq_due = true;
  return true;
}

void NvmeController::post_or_queue(Cq& cq, const PendingCqe& e) {
  if (!cq.active) return;  // dropped with its memory (drop_queues_in): nowhere to post
  if (!cq.overflow.empty() || !post(cq, e)) cq.overflow.push_back(e);
}

bool NvmeController::flush(Cq& cq) {
  bool busy = false;
  while (!cq.overflow.empty() && post(cq, cq.overflow.front())) {
    cq.overflow.pop_front();
    busy = true;
  }
  return busy;
}

void NvmeController::signal_irqs() {
  for (Cq& cq : cqs_) {
    if (!cq.irq_due) continue;
    cq.irq_due = false;
    if (cq.active && cq.ien) {
      irq_.signal(cq.iv);
      stats_.interrupts.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

uint32_t NvmeController::sq_head_index(const Sq& sq) const {
  return sq.counter ? (sq.head & (sq.size - 1)) : sq.head;
}

// ---- I/O queues
// ----------------------------------------------------------------------------------

bool NvmeController::fetch_io(Sq& sq) {
  const uint32_t v = load_db(sq_doorbell(sq.id));
  uint32_t pending;
  if (sq.counter) {
    const auto d = static_cast<int32_t>(v - sq.head);
    if (d <= 0 || d > static_cast<int32_t>(sq.size)) return false;  // late write, or garbage
    pending = static_cast<uint32_t>(d);
  } else {
    if (v >= sq.size) {
      if (v != sq.head) stats_.bad_doorbells.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    pending = (v + sq.size - sq.head) % sq.size;
  }
  if (pending == 0) return false;
  const uint32_t n = std::min(pending, kMaxBatch);
  bool busy = false;
  for (uint32_t i = 0; i < n && !sq.free.empty(); ++i) {
    IoCmd* c = sq.free.back();
    sq.free.pop_back();
    const uint32_t slot = sq.counter ? (sq.head & (sq.size - 1)) : sq.head;
    std::memcpy(&c->cmd.sqe, const_cast<const nvme::Sqe*>(&sq.ring[slot]), sizeof(nvme::Sqe));
    if (sq.counter) {
      ++sq.head;
    } else if (++sq.head == sq.size) {
      sq.head = 0;
    }
    dispatch_io(sq, c);
    busy = true;
  }
  return busy;
}

void NvmeController::dispatch_io(Sq& sq, IoCmd* c) {
  ++sq.inflight;
  inflight_.fetch_add(1, std::memory_order_relaxed);
  stats_.io_commands.fetch_add(1, std::memory_order_relaxed);
  const NamespaceView* ns = css_ == kCcCssIoSets ? find_ns(c->cmd.sqe.nsid) : nullptr;
  if (ns == nullptr) return complete_io(c, sf(Status::kInvalidNamespace), 0);
  c->cmd.sqe.nsid = ns->backend_nsid;
  c->transfers = 0;
  if (channel_ != nullptr && dma_.message_maps() != 0) {
    if (!bounce_wait_.empty() || !stage_io(c)) bounce_wait_.push_back(c);
    return;
  }
  ctl_.execute(&c->cmd);
}

// ---- Message-only DMA memory
// ----------------------------------------------------------------------

void NvmeController::dma_done(DmaXfer* x) {
  std::lock_guard lk(dma_mu_);
  dma_done_.push_back(x);
  dma_pending_.store(true, std::memory_order_release);
}

bool NvmeController::process_dma() {
  bool busy = false;
  if (dma_pending_.load(std::memory_order_acquire)) {
    std::vector<DmaXfer*> done;
    {
      std::lock_guard lk(dma_mu_);
      done.swap(dma_done_);
      dma_pending_.store(false, std::memory_order_relaxed);
    }
    for (DmaXfer* x : done) {
      auto* c = static_cast<IoCmd*>(x->owner);
      if (!x->ok) c->dma_failed = true;
      if (--c->pending == 0) dma_step(c);
    }
    busy = !done.empty();
  }
  while (!bounce_wait_.empty() && stage_io(bounce_wait_.front())) {
    bounce_wait_.pop_front();
    busy = true;
  }
  return busy;
}

bool NvmeController::stage_io(IoCmd* c) {
  const nvme::Sqe& sqe = c->cmd.sqe;
  bool for_write = false;
  if (!data_transfer(sqe, &for_write)) {
    ctl_.execute(&c->cmd);
    return true;
  }
  const bool scatter = sqe.opcode == static_cast<uint8_t>(nvme::Opcode::kScatterRetrieve);
  c->staged = true;
  c->pre_write = for_write;
  c->pre_len = sqe.cdw10;
  c->staging = true;
  const bool ok = c->translate(sqe, sqe.cdw10, for_write, c->pre) == Status::kSuccess;
  c->staging = false;
  bool device = false;
  for (const DataSegment& seg : c->pre) device |= seg.kind != MemKind::kHost;
  // Nothing in message-only memory, or a pointer the controller will refuse itself: run as
  // usual. A Scatter Retrieve list is kept (copied) so its destinations may bounce.
  if (!ok || (scatter && device) || (c->bounces.empty() && !scatter)) {
    release_bounce(c);
    ctl_.execute(&c->cmd);
    return true;
  }
  if (bounce_in_use_ != 0 && bounce_in_use_ + c->bounce_bytes > config_.message_bounce_bytes) {
    release_bounce(c);  // waits for bounce memory; translated again then
    return false;
  }
  c->charged = c->bounce_bytes;
  bounce_in_use_ += c->charged;
  stats_.bounced_commands.fetch_add(1, std::memory_order_relaxed);
  // Fetch what the command reads, then run it.
  c->xfers.clear();
  c->xfers.reserve(c->bounces.size());
  for (const IoCmd::Bounce& b : c->bounces) {
    if (!b.to_client) c->xfers.push_back(DmaXfer{b.iova, b.len, b.buf.get(), false, false, c});
  }
  if (c->xfers.empty()) {
    start_staged(c);
    return true;
  }
  c->stage = IoCmd::Stage::kFetching;
  c->pending = static_cast<uint32_t>(c->xfers.size());
  c->dma_failed = false;
  for (DmaXfer& x : c->xfers) channel_->submit(&x);
  return true;
}

void NvmeController::start_staged(IoCmd* c) {
  c->stage = IoCmd::Stage::kNone;
  if (c->cmd.sqe.opcode == static_cast<uint8_t>(nvme::Opcode::kScatterRetrieve)) {
    c->scatter_copy.resize(c->pre_len);
    if (!read_segments(c->pre, 0, c->scatter_copy.data(), c->pre_len)) {
      return complete_io(c, sf(Status::kDataTransferError), 0);
    }
  }
  ctl_.execute(&c->cmd);
}

void NvmeController::dma_step(IoCmd* c) {
  if (c->stage == IoCmd::Stage::kFetching) {
    if (c->dma_failed) return complete_io(c, sf(Status::kDataTransferError), 0);
    return start_staged(c);
  }
  complete_io(c, c->dma_failed ? sf(Status::kDataTransferError) : c->status, c->dw0);
}

bool NvmeController::write_back(IoCmd* c, uint16_t status, uint32_t dw0) {
  c->xfers.clear();
  for (const IoCmd::Bounce& b : c->bounces) {
    if (!b.to_client) continue;
    const uint64_t w = c->written(b.transfer, dw0);
    if (w <= b.offset) continue;
    const uint64_t n = std::min(b.len, w - b.offset);
    c->xfers.push_back(DmaXfer{b.iova, n, b.buf.get(), true, false, c});
  }
  if (c->xfers.empty()) return false;
  c->stage = IoCmd::Stage::kWriting;
  c->status = status;
  c->dw0 = dw0;
  c->pending = static_cast<uint32_t>(c->xfers.size());
  c->dma_failed = false;
  for (DmaXfer& x : c->xfers) channel_->submit(&x);
  return true;
}

void NvmeController::release_bounce(IoCmd* c) {
  DmaSpace::unpin(c->refs);
  bounce_in_use_ -= c->charged;
  c->charged = 0;
  c->staged = false;
  c->pre.clear();
  c->scatter_copy.clear();
  c->bounces.clear();
  c->xfers.clear();
  c->bounce_bytes = 0;
  c->stage = IoCmd::Stage::kNone;
  c->pending = 0;
  c->dma_failed = false;
}

void NvmeController::on_io_complete(Command* cmd, Status status, uint32_t dw0) {
  auto* c = static_cast<IoCmd*>(cmd->transport);
  // Bytes the command wrote into bounce buffers go back to the client before its completion.
  if (c->staged && status == Status::kSuccess && c->owner->write_back(c, sf(status), dw0)) return;
  c->owner->complete_io(c, sf(status), dw0);
}

void NvmeController::complete_io(IoCmd* c, uint16_t status, uint32_t dw0) {
  if (c->staged) release_bounce(c);
  DmaSpace::unpin(c->refs);
  Sq& sq = *c->sq;
  const nvme::Sqe& sqe = c->cmd.sqe;
  if (status != 0) {
    stats_.io_errors.fetch_add(1, std::memory_order_relaxed);
  } else if (sqe.opcode == static_cast<uint8_t>(nvme::Opcode::kStore)) {
    stats_.write_commands.fetch_add(1, std::memory_order_relaxed);
    stats_.bytes_written.fetch_add(sqe.cdw10, std::memory_order_relaxed);
  } else if (sqe.opcode == static_cast<uint8_t>(nvme::Opcode::kRetrieve)) {
    stats_.read_commands.fetch_add(1, std::memory_order_relaxed);
    stats_.bytes_read.fetch_add(std::min(sqe.cdw10, dw0), std::memory_order_relaxed);
  }
  const PendingCqe e{sqe.cid, sq.id, 0, status, dw0};
  sq.free.push_back(c);
  --sq.inflight;
  PendingCqe out = e;
  out.sq_head = static_cast<uint16_t>(sq_head_index(sq));
  post_or_queue(cqs_[sq.cqid], out);
  // Last: once this reaches 0 the owner may destroy us.
  inflight_.fetch_sub(1, std::memory_order_release);
}

// ---- Admin queue
// ---------------------------------------------------------------------------------

bool NvmeController::process_admin() {
  Sq& s = sqs_[0];
  Cq& c = cqs_[0];
  if (!s.active || s.deleting || !c.active) return false;  // its memory was unmapped
  const uint32_t tail = load_db(sq_doorbell(0));
  if (tail >= s.size) {
    if (tail != s.head) stats_.bad_doorbells.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  bool busy = false;
  for (uint32_t n = 0; n < kAdminBatch && s.head != tail && deferred_ == Deferred::kNone; ++n) {
    if (!c.overflow.empty()) break;  // completions are backed up: fetch nothing more
    nvme::Sqe sqe;
    std::memcpy(&sqe, const_cast<const nvme::Sqe*>(&s.ring[s.head]), sizeof(sqe));
    if (++s.head == s.size) s.head = 0;
    uint32_t dw0 = 0;
    bool deferred = false;
    const uint16_t st = admin(sqe, &dw0, &deferred);
    busy = true;
    if (deferred) {
      if (deferred_ != Deferred::kNone) deferred_cid_ = sqe.cid;
      continue;
    }
    post_or_queue(c, PendingCqe{sqe.cid, 0, static_cast<uint16_t>(s.head), st, dw0});
  }
  return busy;
}

bool NvmeController::process_deferred() {
  uint16_t st = sf(0);
  uint32_t dw0 = 0;
  switch (deferred_) {
    case Deferred::kNone:
    case Deferred::kShutdown:
      return false;
    case Deferred::kDeleteSq: {
      Sq& sq = sqs_[deferred_qid_];
      if (sq.inflight != 0) return false;
      destroy_sq(sq);
      break;
    }
    case Deferred::kUnregisterMemory:
      if (dying_map_ && dying_map_->inflight.load(std::memory_order_acquire) != 0) return false;
      dying_map_.reset();
      break;
    case Deferred::kImportMemory:
      if (!import_->done.load(std::memory_order_acquire)) return false;
      st = finish_import(&dw0);
      break;
  }
  deferred_ = Deferred::kNone;
  post_or_queue(cqs_[0],
                PendingCqe{deferred_cid_, 0, static_cast<uint16_t>(sqs_[0].head), st, dw0});
  return true;
}

std::optional<uint16_t> NvmeController::run_admin(const nvme::Sqe& sqe, uint32_t* dw0) {
  bool deferred = false;
  const uint16_t st = admin(sqe, dw0, &deferred);
  if (deferred) return std::nullopt;
  return st;
}

nvme::Status NvmeController::translate_for_test(const nvme::Sqe& sqe, uint64_t len, bool for_write,
                                                bool flat, DataSegments& out) {
  MapRefs refs;
  TranslateOptions o;
  o.flat = flat;
  o.max_transfer = max_transfer_;
  PinningResolver r(dma_, refs);
  const Status s = translate_data(sqe, len, for_write, o, r, out);
  DmaSpace::unpin(refs);
  return s;
}

uint16_t NvmeController::admin(const nvme::Sqe& sqe, uint32_t* dw0, bool* deferred) {
  stats_.admin_commands.fetch_add(1, std::memory_order_relaxed);
  *dw0 = 0;
  uint16_t st;
  if ((sqe.flags & 0x3) != 0 || sqe.psdt() != nvme::kPsdtPrp) {
    st = sf(Status::kInvalidField);  // no fused admin commands; admin data pointers are PRPs
  } else {
    switch (static_cast<AdminOp>(sqe.opcode)) {
      case AdminOp::kIdentify:
        st = identify(sqe);
        break;
      case AdminOp::kGetLogPage:
        st = get_log_page(sqe);
        break;
      case AdminOp::kSetFeatures:
        st = set_features(sqe, dw0);
        break;
      case AdminOp::kGetFeatures:
        st = get_features(sqe, dw0);
        break;
      case AdminOp::kCreateIoCq:
        st = create_cq(sqe);
        break;
      case AdminOp::kCreateIoSq:
        st = create_sq(sqe);
        break;
      case AdminOp::kDeleteIoSq:
        st = delete_sq(sqe, deferred);
        break;
      case AdminOp::kDeleteIoCq:
        st = delete_cq(sqe);
        break;
      case AdminOp::kAbort:
        *dw0 = 1;  // not aborted: commands run to completion
        st = sf(0);
        break;
      case AdminOp::kAsyncEventRequest:
        // gdkvd raises no asynchronous events; the request stays outstanding until reset.
        if (aers_.size() >= kAerLimit) {
          st = sf(sc::kAerLimitExceeded, nvme::kSctCommandSpecific);
        } else {
          aers_.push_back(sqe.cid);
          *deferred = true;
          st = sf(0);
        }
        break;
      case AdminOp::kKeepAlive:
        st = sf(0);
        break;
      case AdminOp::kGdkvDeviceMemory:
        st = device_memory(sqe, dw0, deferred);
        break;
      default:
        st = sf(Status::kInvalidOpcode);
        break;
    }
  }
  if (st != 0) stats_.admin_errors.fetch_add(1, std::memory_order_relaxed);
  return st;
}

uint16_t NvmeController::admin_write(const nvme::Sqe& sqe, const void* data, size_t len) {
  DataSegments segs;
  PinningResolver r(dma_, admin_refs_);
  const Status s = translate_data(sqe, len, true, TranslateOptions{}, r, segs);
  uint16_t st = sf(s);
  if (s == Status::kSuccess) {
    const auto* p = static_cast<const std::byte*>(data);
    for (const DataSegment& seg : segs) {
      if (seg.kind != MemKind::kHost) {
        st = sf(Status::kDataTransferError);
        break;
      }
      std::memcpy(seg.addr, p, seg.len);
      p += seg.len;
    }
  }
  DmaSpace::unpin(admin_refs_);
  return st;
}

uint16_t NvmeController::admin_read(const nvme::Sqe& sqe, void* data, size_t len) {
  DataSegments segs;
  PinningResolver r(dma_, admin_refs_);
  const Status s = translate_data(sqe, len, false, TranslateOptions{}, r, segs);
  uint16_t st = sf(s);
  if (s == Status::kSuccess) {
    auto* p = static_cast<std::byte*>(data);
    for (const DataSegment& seg : segs) {
      if (seg.kind != MemKind::kHost) {
        st = sf(Status::kDataTransferError);
        break;
      }
      std::memcpy(p, seg.addr, seg.len);
      p += seg.len;
    }
  }
  DmaSpace::unpin(admin_refs_);
  return st;
}

const NamespaceView* NvmeController::find_ns(uint32_t nsid) const {
  for (const NamespaceView& ns : config_.namespaces) {
    if (ns.nsid == nsid) return &ns;
  }
  return nullptr;
}

uint32_t NvmeController::max_nsid() const {
  return config_.namespaces.empty() ? 0 : config_.namespaces.back().nsid;
}

uint16_t NvmeController::identify(const nvme::Sqe& sqe) {
  const uint8_t cns = sqe.cdw10 & 0xFF;
  const uint8_t csi = static_cast<uint8_t>(cdw11(sqe) >> 24);
  const uint32_t nsid = sqe.nsid;
  alignas(8) std::array<uint8_t, 4096> buf{};
  // Namespaces hidden from this tenant (or all of them with CC.CSS = admin only) are inactive.
  const NamespaceView* ns = css_ == kCcCssIoSets ? find_ns(nsid) : nullptr;
  const bool in_range = nsid >= 1 && nsid <= max_nsid();
  auto list_active = [&](uint32_t after) {
    uint32_t n = 0;
    if (css_ != kCcCssIoSets) return;
    for (const NamespaceView& v : config_.namespaces) {
      if (v.nsid <= after || n >= 1024) continue;
      std::memcpy(&buf[n * 4], &v.nsid, 4);
      ++n;
    }
  };
  switch (cns) {
    case kCnsController: {
      auto* id = reinterpret_cast<IdentifyController*>(buf.data());
      id->vid = config_.ids.vendor;
      id->ssvid = config_.ids.subsystem_vendor;
      pad_copy(id->sn, sizeof(id->sn), config_.serial);
      pad_copy(id->mn, sizeof(id->mn), config_.model);
      pad_copy(id->fr, sizeof(id->fr), config_.firmware);
      id->rab = 6;
      id->mdts = mdts_;
      id->cntlid = config_.cntlid;
      id->ver = 0x00020000;
      id->cntrltype = 1;
      id->acl = 3;
      id->aerl = kAerLimit - 1;
      id->frmw = 0x03;  // slot 1 read-only, one slot
      // No temperature sensor: the thresholds are 0 ("not reported") and so is the SMART
      // temperature; a fixed figure would be made up.
      id->lpa = kLpaCommandEffects;
      id->sqes = 0x66;
      id->cqes = 0x44;
      id->nn = max_nsid();
      id->sgls = 0x1;            // SGLs supported, no alignment requirement
      const uint16_t mp = 2500;  // 25 W, in centiwatts
      std::memcpy(id->psd[0], &mp, sizeof(mp));
      std::snprintf(id->subnqn, sizeof(id->subnqn), "%s", config_.subnqn.c_str());
      GdkvVendorInfo vi{};
      std::memcpy(vi.magic, "GDKV", 4);
      vi.version = 1;
      vi.flags = kVendorCounterDoorbells | (config_.importer ? kVendorDeviceMemory : 0);
      vi.max_value_bytes = config_.max_value_bytes;
      vi.msix_vectors = config_.msix_vectors;
      vi.max_queue_entries = config_.max_queue_entries;
      std::memcpy(id->vs, &vi, sizeof(vi));
      break;
    }
    case kCnsNamespace: {
      if (nsid == kNsidBroadcast) break;  // capabilities common to all namespaces: none
      if (!in_range) return sf(Status::kInvalidNamespace);
      if (ns == nullptr) break;  // inactive: zeroes
      auto* id = reinterpret_cast<IdentifyNamespace*>(buf.data());
      const BackendInfo info = ctl_.backend().info();
      // In 4 KiB "blocks": enough for tools that only look at the capacity.
      id->nsze = id->ncap = std::max<uint64_t>(info.capacity_bytes / kPageSize, 1);
      id->nuse = info.bytes_used / kPageSize;
      id->lbaf[0].lbads = 12;
      namespace_nguid(*ns, id->nguid);
      break;
    }
    case kCnsActiveNsList:
      if (nsid >= 0xFFFFFFFE) return sf(Status::kInvalidNamespace);
      list_active(nsid);
      break;
    case kCnsNsDescriptors: {
      if (ns == nullptr) return sf(Status::kInvalidNamespace);
      buf[0] = kNidtNguid;
      buf[1] = 16;
      namespace_nguid(*ns, &buf[4]);
      buf[20] = kNidtCsi;
      buf[21] = 1;
      buf[24] = kCsiKv;
      break;
    }
    case kCnsCsiNamespace: {
      if (csi != kCsiKv) return sf(Status::kInvalidField);
      if (!in_range) return sf(Status::kInvalidNamespace);
      if (ns == nullptr) break;
      auto* id = reinterpret_cast<KvIdentifyNamespace*>(buf.data());
      const BackendInfo info = ctl_.backend().info();
      id->nsze = info.capacity_bytes;
      id->nuse = info.bytes_used;
      id->nkvf = 0;  // one format
      namespace_nguid(*ns, id->nguid);
      id->kvf[0].kml = nvme::kMaxKeyLength;
      id->kvf[0].vml =
          static_cast<uint32_t>(std::min<uint64_t>(config_.max_value_bytes, UINT32_MAX));
      id->kvf[0].mnk = 0;
      break;
    }
    case kCnsCsiController:
      if (csi != kCsiKv && csi != kCsiNvm) return sf(Status::kInvalidField);
      break;  // no command-set-specific limits beyond Identify Controller
    case kCnsCsiActiveNsList:
      if (nsid >= 0xFFFFFFFE) return sf(Status::kInvalidNamespace);
      if (csi == kCsiKv) {
        list_active(nsid);
      } else if (csi != kCsiNvm) {
        return sf(Status::kInvalidField);
      }
      break;
    case kCnsCsIndepNamespace: {
      if (!in_range) return sf(Status::kInvalidNamespace);
      if (ns == nullptr) break;
      auto* id = reinterpret_cast<CsIndepIdentifyNamespace*>(buf.data());
      id->nstat = 1;  // ready
      break;
    }
    case kCnsIoCommandSets: {
      const uint64_t kv_only = uint64_t{1} << kCsiKv;
      std::memcpy(buf.data(), &kv_only, sizeof(kv_only));
      break;
    }
    default:
      return sf(Status::kInvalidField);
  }
  return admin_write(sqe, buf.data(), buf.size());
}

uint16_t NvmeController::get_log_page(const nvme::Sqe& sqe) {
  const uint8_t lid = sqe.cdw10 & 0xFF;
  const uint32_t numdu = cdw11(sqe) & 0xFFFF;
  const uint64_t dwords = ((uint64_t{numdu} << 16) | (sqe.cdw10 >> 16)) + 1;
  if (dwords * 4 > kMaxLogBytes) return sf(Status::kInvalidField);
  const uint64_t offset = (uint64_t{sqe.cdw13} << 32) | sqe.cdw12;
  if (offset & 3) return sf(Status::kInvalidField);
  std::vector<uint8_t> page;
  switch (lid) {
    case kLogErrorInfo:
      page.assign(64, 0);
      break;  // ELPE = 0: one entry, no errors logged
    case kLogSmart: {
      // Only what this controller measured: value bytes moved and commands per direction.
      SmartLog s{};
      s.avail_spare = 100;
      s.spare_thresh = 10;
      // 128-bit counters: data units are thousands of 512-byte units, rounded up.
      const uint64_t units_read = (stats_.bytes_read.load() + 511999) / 512000;
      const uint64_t units_written = (stats_.bytes_written.load() + 511999) / 512000;
      const uint64_t reads = stats_.read_commands.load();
      const uint64_t writes = stats_.write_commands.load();
      std::memcpy(s.data_units_read, &units_read, 8);
      std::memcpy(s.data_units_written, &units_written, 8);
      std::memcpy(s.host_reads, &reads, 8);
      std::memcpy(s.host_writes, &writes, 8);
      const uint64_t one = 1;
      std::memcpy(s.power_cycles, &one, 8);
      page.resize(sizeof(s));
      std::memcpy(page.data(), &s, sizeof(s));
      break;
    }
    case kLogFirmwareSlot: {
      page.assign(512, 0);
      page[0] = 1;  // active slot 1
      pad_copy(reinterpret_cast<char*>(&page[8]), 8, config_.firmware);
      break;
    }
    case kLogCommandEffects: {
      const uint8_t csi = static_cast<uint8_t>(bytes_of_cdw14(sqe) >> 24);
      if (csi != kCsiNvm && csi != kCsiKv) return sf(Status::kInvalidField);
      CommandEffectsLog e{};
      // Every admin command gdkvd implements; no command-submission effects are claimed.
      for (AdminOp op :
           {AdminOp::kDeleteIoSq, AdminOp::kCreateIoSq, AdminOp::kGetLogPage, AdminOp::kDeleteIoCq,
            AdminOp::kCreateIoCq, AdminOp::kIdentify, AdminOp::kAbort, AdminOp::kSetFeatures,
            AdminOp::kGetFeatures, AdminOp::kAsyncEventRequest, AdminOp::kKeepAlive,
            AdminOp::kGdkvDeviceMemory}) {
        e.admin[static_cast<uint8_t>(op)] = kEffectsCsupp;
      }
      // I/O commands: the KV command set's and gdkv's vendor ones; none of the NVM set.
      if (csi == kCsiKv) {
        for (nvme::Opcode op : {nvme::Opcode::kStore, nvme::Opcode::kRetrieve, nvme::Opcode::kList,
                                nvme::Opcode::kDelete, nvme::Opcode::kExist,
                                nvme::Opcode::kPrefetch, nvme::Opcode::kScatterRetrieve}) {
          e.io[static_cast<uint8_t>(op)] = kEffectsCsupp;
        }
      }
      page.resize(sizeof(e));
      std::memcpy(page.data(), &e, sizeof(e));
      break;
    }
    default:
      return sf(sc::kInvalidLogPage, nvme::kSctCommandSpecific);
  }
  if (offset > page.size()) return sf(Status::kInvalidField);
  std::vector<uint8_t> out(static_cast<size_t>(dwords * 4), 0);
  const size_t n = std::min<size_t>(out.size(), page.size() - static_cast<size_t>(offset));
  std::memcpy(out.data(), page.data() + offset, n);
  return admin_write(sqe, out.data(), out.size());
}

namespace {
bool stored_feature(uint8_t fid) {
  switch (fid) {
    case kFeatArbitration:
    case kFeatPowerManagement:
    case kFeatTemperatureThreshold:
    case kFeatErrorRecovery:
    case kFeatInterruptCoalescing:
    case kFeatInterruptVectorConfig:
    case kFeatWriteAtomicity:
    case kFeatAsyncEventConfig:
    case kFeatKeepAliveTimer:
      return true;
    default:
      return false;
  }
}
}  // namespace

uint16_t NvmeController::set_features(const nvme::Sqe& sqe, uint32_t* dw0) {
  const uint8_t fid = sqe.cdw10 & 0xFF;
  if (sqe.cdw10 & (1u << 31)) return sf(0x0D, nvme::kSctCommandSpecific);  // not saveable
  const uint32_t v = cdw11(sqe);
  switch (fid) {
    case kFeatNumberOfQueues: {
      const uint32_t nsqr = v & 0xFFFF, ncqr = v >> 16;
      if (nsqr == 0xFFFF || ncqr == 0xFFFF) return sf(Status::kInvalidField);
      bool any = false;
      for (uint16_t q = 1; q < kMaxQueues; ++q) any |= sqs_[q].active || cqs_[q].active;
      if (!any) {  // once queues exist the allocation stays (the spec's sequence rule)
        nsqa_ = static_cast<uint16_t>(std::min<uint32_t>(nsqr + 1, kMaxIoQueues));
        ncqa_ = static_cast<uint16_t>(std::min<uint32_t>(ncqr + 1, kMaxIoQueues));
      }
      *dw0 = (uint32_t{ncqa_ - 1u} << 16) | (nsqa_ - 1u);
      return sf(0);
    }
    case kFeatIoCommandSetProfile:
      if ((v & 0x1FF) != 0) return sf(Status::kInvalidField);  // vector 0 (KV) only
      features_[fid] = 0;
      return sf(0);
    default:
      if (!stored_feature(fid)) return sf(Status::kInvalidField);
      features_[fid] = v;
      return sf(0);
  }
}

uint16_t NvmeController::get_features(const nvme::Sqe& sqe, uint32_t* dw0) {
  const uint8_t fid = sqe.cdw10 & 0xFF;
  const uint8_t sel = (sqe.cdw10 >> 8) & 0x7;
  const bool known =
      fid == kFeatNumberOfQueues || fid == kFeatIoCommandSetProfile || stored_feature(fid);
  if (!known || sel > 3) return sf(Status::kInvalidField);
  if (sel == 3) {
    *dw0 = 0x4;  // changeable, not saveable, not namespace specific
    return sf(0);
  }
  if (fid == kFeatNumberOfQueues) {
    *dw0 = (uint32_t{ncqa_ - 1u} << 16) | (nsqa_ - 1u);
  } else {
    *dw0 = features_[fid];
  }
  return sf(0);
}

uint16_t NvmeController::create_cq(const nvme::Sqe& sqe) {
  const uint32_t qid = sqe.cdw10 & 0xFFFF;
  const uint32_t size = (sqe.cdw10 >> 16) + 1;
  const uint32_t w11 = cdw11(sqe);
  const bool pc = w11 & 1, ien = w11 & 2;
  const uint32_t iv = w11 >> 16;
  const bool counter = sqe.cdw12 & kCounterDoorbells;
  if (qid == 0 || qid > ncqa_ || cqs_[qid].active) {
    return sf(sc::kInvalidQueueId, nvme::kSctCommandSpecific);
  }
  if (size < 2 || size > config_.max_queue_entries || (counter && (size & (size - 1)) != 0)) {
    return sf(sc::kInvalidQueueSize, nvme::kSctCommandSpecific);
  }
  if (ien && iv >= config_.msix_vectors) {
    return sf(sc::kInvalidInterruptVector, nvme::kSctCommandSpecific);
  }
  uint32_t cc;
  {
    std::lock_guard lk(regs_mu_);
    cc = cc_;
  }
  if (!pc || cc_iocqes(cc) != 4 || (sqe.dptr.prp.prp1 & (kPageSize - 1)) != 0) {
    return sf(Status::kInvalidField);
  }
  DmaMap* map = nullptr;
  auto* ring =
      dma_.acquire_queue(sqe.dptr.prp.prp1, uint64_t{size} * sizeof(nvme::Cqe), true, &map);
  if (ring == nullptr) return sf(Status::kDataTransferError);
  store_db(cq_doorbell(static_cast<uint16_t>(qid)), 0);
  Cq& cq = cqs_[qid];
  cq = Cq{};
  cq.active = true;
  cq.counter = counter;
  cq.id = static_cast<uint16_t>(qid);
  cq.size = size;
  cq.ring = reinterpret_cast<nvme::Cqe*>(ring);
  cq.map = map;
  cq.ien = ien;
  cq.iv = static_cast<uint16_t>(iv);
  return sf(0);
}

uint16_t NvmeController::create_sq(const nvme::Sqe& sqe) {
  const uint32_t qid = sqe.cdw10 & 0xFFFF;
  const uint32_t size = (sqe.cdw10 >> 16) + 1;
  const uint32_t w11 = cdw11(sqe);
  const bool pc = w11 & 1;
  const uint32_t cqid = w11 >> 16;
  const bool counter = sqe.cdw12 & kCounterDoorbells;
  if (qid == 0 || qid > nsqa_ || sqs_[qid].active) {
    return sf(sc::kInvalidQueueId, nvme::kSctCommandSpecific);
  }
  if (cqid == 0 || cqid >= kMaxQueues || !cqs_[cqid].active) {
    return sf(sc::kCqInvalid, nvme::kSctCommandSpecific);
  }
  if (size < 2 || size > config_.max_queue_entries || (counter && (size & (size - 1)) != 0)) {
    return sf(sc::kInvalidQueueSize, nvme::kSctCommandSpecific);
  }
  uint32_t cc;
  {
    std::lock_guard lk(regs_mu_);
    cc = cc_;
  }
  if (!pc || cc_iosqes(cc) != 6 || (sqe.dptr.prp.prp1 & (kPageSize - 1)) != 0) {
    return sf(Status::kInvalidField);
  }
  DmaMap* map = nullptr;
  auto* ring =
      dma_.acquire_queue(sqe.dptr.prp.prp1, uint64_t{size} * sizeof(nvme::Sqe), false, &map);
  if (ring == nullptr) return sf(Status::kDataTransferError);
  store_db(sq_doorbell(static_cast<uint16_t>(qid)), 0);
  Sq& sq = sqs_[qid];
  sq = Sq{};
  sq.active = true;
  sq.counter = counter;
  sq.id = static_cast<uint16_t>(qid);
  sq.size = size;
  sq.cqid = static_cast<uint16_t>(cqid);
  sq.ring = reinterpret_cast<const nvme::Sqe*>(ring);
  sq.map = map;
  sq.cmds = std::make_unique<IoCmd[]>(size);
  sq.free.reserve(size);
  for (uint32_t i = size; i-- > 0;) {
    IoCmd& c = sq.cmds[i];
    c.owner = this;
    c.sq = &sq;
    c.refs.reserve(4);
    c.cmd.space = &c;
    c.cmd.stream = qid;
    c.cmd.transport = &c;
    c.cmd.complete = &NvmeController::on_io_complete;
    sq.free.push_back(&c);
  }
  ++cqs_[cqid].sqs;
  return sf(0);
}

uint16_t NvmeController::delete_sq(const nvme::Sqe& sqe, bool* deferred) {
  const uint32_t qid = sqe.cdw10 & 0xFFFF;
  if (qid == 0 || qid >= kMaxQueues || !sqs_[qid].active) {
    return sf(sc::kInvalidQueueId, nvme::kSctCommandSpecific);
  }
  Sq& sq = sqs_[qid];
  sq.deleting = true;
  if (sq.inflight == 0) {
    destroy_sq(sq);
    return sf(0);
  }
  // Its commands are still running; the deletion completes when the last one has.
  deferred_ = Deferred::kDeleteSq;
  deferred_qid_ = static_cast<uint16_t>(qid);
  *deferred = true;
  return sf(0);
}

uint16_t NvmeController::delete_cq(const nvme::Sqe& sqe) {
  const uint32_t qid = sqe.cdw10 & 0xFFFF;
  if (qid == 0 || qid >= kMaxQueues || !cqs_[qid].active) {
    return sf(sc::kInvalidQueueId, nvme::kSctCommandSpecific);
  }
  if (cqs_[qid].sqs != 0) return sf(sc::kInvalidQueueDeletion, nvme::kSctCommandSpecific);
  destroy_cq(cqs_[qid]);
  return sf(0);
}

uint16_t NvmeController::device_memory(const nvme::Sqe& sqe, uint32_t* dw0, bool* deferred) {
  const uint32_t op = cdw11(sqe);
  if (sqe.cdw10 != sizeof(DeviceMemoryRequest) ||
      (op != kDevMemRegister && op != kDevMemUnregister)) {
    *dw0 = kDevMemErrBadRequest;
    return sf(Status::kInvalidField);
  }
  DeviceMemoryRequest req;
  if (uint16_t st = admin_read(sqe, &req, sizeof(req)); st != 0) return st;
  if (req.flags != 0 || req.reserved != 0) {
    *dw0 = kDevMemErrBadRequest;
    return sf(Status::kInvalidField);
  }
  if (op == kDevMemUnregister) {
    int err = 0;
    // Only device memory: DMA_MAP regions go away by DMA_UNMAP.
    std::unique_ptr<DmaMap> m = dma_.detach(req.iova, req.size, &err, /*device_only=*/true);
    if (!m) {
      *dw0 = err == EBUSY ? kDevMemErrBusy : kDevMemErrNotFound;
      return sf(Status::kInvalidField);
    }
    if (m->inflight.load(std::memory_order_acquire) == 0) return sf(0);  // destroyed on return
    dying_map_ = std::move(m);
    deferred_ = Deferred::kUnregisterMemory;
    *deferred = true;
    return sf(0);
  }
  if (config_.importer == nullptr) {
    *dw0 = kDevMemErrNotSupported;
    return sf(Status::kInvalidField);
  }
  if (req.size == 0 || req.iova + req.size < req.iova || req.size > (uint64_t{1} << 40)) {
    *dw0 = kDevMemErrBadRequest;
    return sf(Status::kInvalidField);
  }
  // The open runs on a worker; the command completes in process_deferred once it is done. Admin
  // commands after it wait (deferred_), I/O commands do not.
  import_ = std::make_unique<Import>();
  import_->req = req;
  Import* im = import_.get();
  DeviceMemoryImporter* imp = config_.importer;
  try {
    import_->worker = std::thread([im, imp] {
      im->ptr = imp->open(im->req.ipc_handle, im->req.size, &im->why);
      im->done.store(true, std::memory_order_release);
    });
  } catch (const std::system_error&) {
    import_.reset();
    *dw0 = kDevMemErrImport;
    return sf(Status::kInvalidField);
  }
  deferred_ = Deferred::kImportMemory;
  *deferred = true;
  return sf(0);
}

uint16_t NvmeController::finish_import(uint32_t* dw0) {
  import_->worker.join();
  std::unique_ptr<Import> im = std::move(import_);
  void* p = im->ptr;
  if (p == nullptr) {
    *dw0 = kDevMemErrImport;
    return sf(Status::kInvalidField);
  }
  DeviceMemoryImporter* imp = config_.importer;
  const int err = dma_.map_memory(im->req.iova, p, im->req.size, true, true, MemKind::kDevice,
                                  [imp, p] { imp->close(p); });
  if (err != 0) {
    *dw0 = err == EEXIST ? kDevMemErrOverlap : kDevMemErrBadRequest;
    return sf(Status::kInvalidField);
  }
  return sf(0);
}

void NvmeController::abandon_import() {
  if (!import_) return;
  import_->worker.join();
  if (import_->ptr != nullptr) config_.importer->close(import_->ptr);
  import_.reset();
}

}  // namespace gdkv::vfio_user
