// The NVMe controller: the admin command set (see nvme_ctrl.h, nvme_ctrl_impl.h).
#include "vfio_user/nvme_ctrl_impl.h"

namespace gdkv::vfio_user {

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
      vi.flags = kVendorCounterDoorbells | kVendorWakeups |
                 (config_.importer ? kVendorDeviceMemory : 0) |
                 (config_.removals ? kVendorRemovalLog : 0);
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
  std::vector<uint8_t> page;
  if (lid == kLogRemovals && config_.removals) {
    // LPO is the subscriber's cursor, not a byte offset: the page is built for it, whole.
    const uint16_t st = removal_log_page(sqe, dwords * 4, page);
    if (st != 0) return st;
    return admin_write(sqe, page.data(), page.size());
  }
  if (dwords * 4 > kMaxLogBytes) return sf(Status::kInvalidField);
  const uint64_t offset = (uint64_t{sqe.cdw13} << 32) | sqe.cdw12;
  if (offset & 3) return sf(Status::kInvalidField);
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

uint16_t NvmeController::removal_log_page(const nvme::Sqe& sqe, uint64_t bytes,
                                          std::vector<uint8_t>& page) {
  // Only a namespace this connection may use: another tenant's removals are never read.
  const NamespaceView* ns = find_ns(sqe.nsid);
  if (ns == nullptr) return sf(Status::kInvalidNamespace);
  if (!(bytes_of_cdw14(sqe) & kLogOffsetIsIndex) || bytes < sizeof(RemovalLogHeader) ||
      bytes > kMaxLogBytes ||
      (sqe.cdw10 & ~(0xFFFF00FFu | kRemovalNoCursor | kLogRetainAsyncEvent)) != 0) {
    return sf(Status::kInvalidField);  // LPO must be a cursor; room for the header; LSP bit 0 only
  }
  const uint64_t room = (bytes - sizeof(RemovalLogHeader)) / sizeof(RemovalRecord);
  const size_t max = static_cast<size_t>(std::min<uint64_t>(room, kRemovalMaxRecords));
  std::optional<uint64_t> after;
  if (!(sqe.cdw10 & kRemovalNoCursor)) after = (uint64_t{sqe.cdw13} << 32) | sqe.cdw12;
  RemovedKeys got;
  try {
    got = config_.removals(ns->backend_nsid, after, max);
  } catch (const std::exception&) {
    return sf(Status::kInternalError);
  }
  const size_t count = std::min(got.records.size(), max);
  RemovalLogHeader h{};
  h.boot = got.boot;
  h.last = got.last;
  h.first = got.first;
  h.next = got.next;
  h.count = static_cast<uint32_t>(count);
  h.flags = (got.lost ? kRemovalsLost : 0) | (got.more ? kRemovalsMore : 0);
  h.record_bytes = sizeof(RemovalRecord);
  page.assign(static_cast<size_t>(bytes), 0);
  std::memcpy(page.data(), &h, sizeof(h));
  for (size_t i = 0; i < count; ++i) {
    const RemovedKeys::Entry& e = got.records[i];
    RemovalRecord r{};
    r.seq = e.seq;
    r.key_length = e.key.len;
    std::memcpy(r.key, e.key.bytes, sizeof(r.key));
    std::memcpy(page.data() + sizeof(h) + i * sizeof(r), &r, sizeof(r));
  }
  return sf(0);
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
  __atomic_store_n(cq_arm_word(static_cast<uint16_t>(qid)), 0u, __ATOMIC_RELEASE);
  Cq& cq = cqs_[qid];
  cq = Cq{};
  cq.active = true;
  cq.counter = counter;
  cq.id = static_cast<uint16_t>(qid);
  cq.size = size;
  cq.ring = reinterpret_cast<nvme::Cqe*>(ring);
  cq.map = map;
  cq.ien = ien;
  cq.armed = ien && (sqe.cdw12 & kArmedInterrupts);
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
