// The NVMe controller of one vfio-user connection: construction, registers, enable, reset and
// completion posting (see nvme_ctrl.h, nvme_ctrl_impl.h).
#include "vfio_user/nvme_ctrl_impl.h"

#include <sched.h>
#include <sys/eventfd.h>

namespace gdkv::vfio_user {

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
  wake_fd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_.valid()) throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
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
uint32_t* NvmeController::cq_arm_word(uint16_t qid) const {
  return db_ + (2u * qid + 1) * (kDoorbellStride / 4) + kWakeArmOffset / 4;
}

bool NvmeController::revoked() const {
  return __atomic_load_n(db_ + kRevokedOffset / 4, __ATOMIC_ACQUIRE) != 0;
}

void NvmeController::announce_sleep(bool sleeping) {
  // Only for a host that took the ioeventfd: others never see the word change. The reactor
  // fences after announcing and before its last look at the doorbells (tests/handshake_model_test).
  if (!doorbell_wake_.load(std::memory_order_relaxed)) return;
  __atomic_store_n(db_ + kWakeSleepingOffset / 4, sleeping ? 1u : 0u, __ATOMIC_SEQ_CST);
}

void NvmeController::woken_by_fd() {
  stats_.doorbell_wakeups.fetch_add(1, std::memory_order_relaxed);
  if (!doorbell_wake_.load(std::memory_order_relaxed)) return;
  // The host's word (cpu_word of where it runs, or 0 if it does not say); another CPU's or
  // any other value is ignored.
  const uint32_t w = __atomic_exchange_n(db_ + kWakeWakerCpuOffset / 4, 0u, __ATOMIC_RELAXED);
  waker_here_ = names_cpu(w, ::sched_getcpu());
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
      // A doorbell written by message instead of through the mapping: the same memory. It comes
      // by message, so the reactor may be asleep: wake it (a full counter is still a wake-up).
      store_db(db_ + (dword_at - reg::kDoorbells) / 4, v);
      const uint64_t one = 1;
      (void)!::write(wake_fd_.get(), &one, sizeof(one));
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
  } else if (revoked()) {
    stop();  // the host gave up on this connection: nothing of it starts any more
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
  bool woke_waiter = false;
  for (Cq& cq : cqs_) {
    if (!cq.irq_due) continue;
    cq.irq_due = false;
    // The host thread that woke this reactor runs on its core and waits for what was posted.
    woke_waiter |= std::exchange(waker_here_, false);
    if (cq.active && cq.ien) {
      if (cq.armed) {
        // Store-buffering with the host's arm-then-look (its CQEs were stored above, it stored
        // the arm word): a full fence before the load, else both could miss the other.
        atomic::fence();
        uint32_t* w = cq_arm_word(cq.id);
        uint32_t armed = 0;
        if (__atomic_load_n(w, __ATOMIC_SEQ_CST) == 0 ||
            (armed = __atomic_exchange_n(w, 0u, __ATOMIC_SEQ_CST)) == 0) {
          continue;
        }
        // The arm word names the CPU the waiter blocked on: a waiter on this reactor's own
        // core needs the core back.
        woke_waiter |= names_cpu(armed, ::sched_getcpu());
      }
      irq_.signal(cq.iv);
      stats_.interrupts.fetch_add(1, std::memory_order_relaxed);
    }
  }
  // A client thread blocked on this core for its completion was just woken, and the scheduler
  // tends to leave it queued behind the reactor, which would spin idle for idle_spin_us before
  // letting it run: the reactor sleeps at once if nothing else comes (a yield instead would queue
  // the reactor behind every other program on a loaded core). A waiter elsewhere has its core.
  if (woke_waiter) hint_requester_woken();
}

uint32_t NvmeController::sq_head_index(const Sq& sq) const {
  return sq.counter ? (sq.head & (sq.size - 1)) : sq.head;
}

}  // namespace gdkv::vfio_user
