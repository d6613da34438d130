// One client's device: vfio-user request handling (see session.h).
#include "vfio_user/session.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

namespace gdkv::vfio_user {

namespace {

// An interrupt descriptor gdkvd may signal from a reactor: an eventfd (anything else, a pipe
// say, could block the reactor), made non-blocking so that a client that lets its counter reach
// the maximum cannot block it either. The flag is the open file's, shared with the client;
// interrupt eventfds are read by event loops (QEMU) or consumed by KVM, so it is harmless there.
bool usable_irq_fd(int fd) {
  char link[64];
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = ::readlink(path.c_str(), link, sizeof(link) - 1);
  if (n <= 0) return false;
  link[n] = 0;
  if (std::strcmp(link, "anon_inode:[eventfd]") != 0) return false;
  const int fl = ::fcntl(fd, F_GETFL);
  return fl >= 0 && ((fl & O_NONBLOCK) || ::fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0);
}

template <class T>
void append(std::vector<std::byte>& out, const T& v) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &v, sizeof(T));
}

}  // namespace

DeviceSession::DeviceSession(Controller& ctl, SessionConfig config)
    : ctl_(ctl),
      config_(std::move(config)),
      dma_(config_.dma),
      pci_(config_.nvme.ids, config_.nvme.msix_vectors),
      msix_table_(kMsixPbaOffset, 0) {
  msix_.resize(config_.nvme.msix_vectors);
  // Vectors start masked (vector control bit 0), as after a PCI reset.
  for (uint32_t v = 0; v < config_.nvme.msix_vectors && (v + 1) * 16 <= msix_table_.size(); ++v) {
    msix_table_[v * 16 + 12] = 1;
  }
  dma_wake_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!dma_wake_.valid()) throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
  nvme_ = std::make_unique<NvmeController>(ctl_, dma_, *this, config_.nvme, this);
  ctl_.add_poller(config_.nvme.reactor, nvme_.get());
  registered_ = true;
}

DeviceSession::~DeviceSession() {
  quiesce();
  nvme_.reset();  // releases the queues' maps
  (void)dma_.unmap_all();
}

void DeviceSession::quiesce() {
  if (!nvme_) return;
  nvme_->stop();
  // Commands in flight still write into this client's memory and post completions: wait for
  // them before anything is unmapped. Those waiting on the client's DMA replies fail instead
  // (nobody reads replies any more); the poller keeps running until all are done.
  dma_refuse(true);
  while (nvme_->inflight() != 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
  if (registered_) {
    ctl_.remove_poller(nvme_.get());
    registered_ = false;
  }
}

// ---- Message-only memory
// ---------------------------------------------------------------------------

void DeviceSession::submit(DmaXfer* x) {
  {
    std::lock_guard lk(dma_mu_);
    if (!dma_refusing_) {
      dma_queue_.push_back(x);
      const uint64_t one = 1;
      (void)!::write(dma_wake_.get(), &one, sizeof(one));
      return;
    }
  }
  dma_report(x, false);
}

void DeviceSession::dma_report(DmaXfer* x, bool ok) {
  x->ok = ok;
  if (!ok) stats_.dma_failures.fetch_add(1, std::memory_order_relaxed);
  nvme_->dma_done(x);
}

namespace {
// Bytes a request and its reply occupy on the socket.
uint64_t dma_cost(uint32_t len) { return 2 * (sizeof(Header) + sizeof(DmaAccessMsg)) + len; }
}  // namespace

void DeviceSession::dma_finish(DmaXfer* x, bool ok) {
  for (auto it = dma_out_.begin(); it != dma_out_.end();) {
    if (it->second.x == x) {
      dma_out_bytes_ -= dma_cost(it->second.len);
      it = dma_out_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = dma_active_.begin(); it != dma_active_.end(); ++it) {
    if (it->x == x) {
      dma_active_.erase(it);
      break;
    }
  }
  dma_report(x, ok);
}

void DeviceSession::dma_refuse(bool refuse) {
  std::deque<DmaXfer*> failed;
  {
    std::lock_guard lk(dma_mu_);
    dma_refusing_ = refuse;
    failed.swap(dma_queue_);
  }
  if (refuse) {
    while (!dma_active_.empty()) dma_finish(dma_active_.front().x, false);
  }
  for (DmaXfer* x : failed) dma_report(x, false);  // never started: nothing to drop
}

void DeviceSession::dma_pump(
    const std::function<bool(const Header&, std::span<const std::byte>)>& send) {
  uint64_t drained;
  (void)!::read(dma_wake_.get(), &drained, sizeof(drained));
  const auto now = std::chrono::steady_clock::now();
  for (;;) {  // overdue replies fail their transfers
    auto late = std::find_if(dma_out_.begin(), dma_out_.end(),
                             [&](const auto& r) { return now > r.second.deadline; });
    if (late == dma_out_.end()) break;
    dma_finish(late->second.x, false);
  }
  for (;;) {
    // The next bytes to request: the oldest started transfer with some left, else a new one.
    DmaActive* a = nullptr;
    for (DmaActive& d : dma_active_) {
      if (d.sent < d.x->len) {
        a = &d;
        break;
      }
    }
    if (a == nullptr) {
      DmaXfer* x;
      {
        std::lock_guard lk(dma_mu_);
        if (dma_queue_.empty()) return;
        x = dma_queue_.front();
        dma_queue_.pop_front();
      }
      dma_active_.push_back(DmaActive{x});
      a = &dma_active_.back();
    }
    const DmaXfer& x = *a->x;
    const auto len = static_cast<uint32_t>(std::min<uint64_t>(x.len - a->sent, dma_chunk_));
    if (!dma_out_.empty() && (dma_out_.size() >= kDmaWindowRequests ||
                              dma_out_bytes_ + dma_cost(len) > kDmaWindowBytes)) {
      return;  // a reply makes room
    }
    // Nothing is sent for memory unmapped (or remapped with an fd) since the command started,
    // not even the rest of a transfer already under way.
    if (!dma_.message_only(x.iova + a->sent, len, x.to_client)) {
      dma_finish(a->x, false);
      continue;
    }
    std::vector<std::byte> payload(sizeof(DmaAccessMsg) + (x.to_client ? len : 0));
    const DmaAccessMsg req{x.iova + a->sent, len};
    std::memcpy(payload.data(), &req, sizeof(req));
    if (x.to_client) std::memcpy(payload.data() + sizeof(req), x.buf + a->sent, len);
    Header h{};
    do {
      h.id = ++next_msg_id_;  // ids wrap; one still awaiting its reply is skipped
    } while (dma_out_.count(h.id) != 0);
    h.command = static_cast<uint16_t>(x.to_client ? Cmd::kDmaWrite : Cmd::kDmaRead);
    h.size = static_cast<uint32_t>(sizeof(Header) + payload.size());
    h.flags = kTypeCommand;
    dma_out_[h.id] = DmaRequest{a->x, a->sent, len,
                                now + std::chrono::milliseconds(config_.dma_reply_timeout_ms)};
    dma_out_bytes_ += dma_cost(len);
    a->sent += len;
    stats_.dma_messages.fetch_add(1, std::memory_order_relaxed);
    if (!send(h, payload)) return dma_finish(a->x, false);
  }
}

void DeviceSession::dma_reply(const Message& m) {
  auto it = dma_out_.find(m.hdr.id);
  if (it == dma_out_.end()) return;  // stray, or for a transfer that already failed
  const DmaRequest r = it->second;
  const bool read = !r.x->to_client;
  const uint64_t at = r.x->iova + r.offset;
  PayloadReader p(m.payload);
  const auto a = p.get<DmaAccessMsg>();
  bool ok = !(m.hdr.flags & kErrorFlag) &&
            m.hdr.command == static_cast<uint16_t>(read ? Cmd::kDmaRead : Cmd::kDmaWrite);
  if (ok && read) {
    // The data, exactly: the address and count asked for, then count bytes.
    ok =
        a && a->addr == at && a->count == r.len && m.payload.size() == sizeof(DmaAccessMsg) + r.len;
    if (ok) std::memcpy(r.x->buf + r.offset, m.payload.data() + sizeof(DmaAccessMsg), r.len);
  } else if (ok) {
    // DMA_WRITE replies echo the address and count (some clients send nothing).
    ok = m.payload.empty() || (a && a->addr == at && a->count == r.len);
  }
  if (!ok) return dma_finish(r.x, false);
  dma_out_.erase(it);
  dma_out_bytes_ -= dma_cost(r.len);
  stats_.dma_bytes.fetch_add(r.len, std::memory_order_relaxed);
  for (DmaActive& d : dma_active_) {
    if (d.x != r.x) continue;
    d.acked += r.len;
    if (d.acked == d.x->len) dma_finish(d.x, true);
    break;
  }
}

void DeviceSession::release_map(std::unique_ptr<DmaMap> m) {
  if (m->inflight.load(std::memory_order_acquire) != 0) {
    // Commands still use it; those waiting on DMA replies (which this thread would read) fail.
    dma_refuse(true);
    while (m->inflight.load(std::memory_order_acquire) != 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    dma_refuse(false);
  }
  m.reset();
}

void DeviceSession::signal(uint16_t vector) {
  std::lock_guard lk(irq_mu_);
  if (vector >= msix_.size() || !msix_[vector].valid()) return;
  const uint64_t one = 1;
  // A full eventfd counter (EAGAIN) still means "pending": nothing is lost.
  (void)!::write(msix_[vector].get(), &one, sizeof(one));
}

Reply DeviceSession::handle(Message& m) {
  stats_.messages.fetch_add(1, std::memory_order_relaxed);
  Reply r;
  r.send = !(m.hdr.flags & kNoReply);
  int err = 0;
  if ((m.hdr.flags & kTypeMask) != kTypeCommand) {
    // A reply to our DMA_READ/DMA_WRITE, or a stray one (dropped; its fds close with it).
    r.send = false;
    dma_reply(m);
    return r;
  }
  if (m.fds_truncated) {
    err = EINVAL;
  } else if (!negotiated_ && m.hdr.command != static_cast<uint16_t>(Cmd::kVersion)) {
    err = EINVAL;  // VERSION comes first
  } else {
    switch (static_cast<Cmd>(m.hdr.command)) {
      case Cmd::kVersion:
        err = on_version(m, r);
        break;
      case Cmd::kDmaMap:
        err = on_dma_map(m);
        break;
      case Cmd::kDmaUnmap:
        err = on_dma_unmap(m, r);
        break;
      case Cmd::kDeviceGetInfo:
        err = on_device_info(m, r);
        break;
      case Cmd::kDeviceGetRegionInfo:
        err = on_region_info(m, r);
        break;
      case Cmd::kDeviceGetIrqInfo:
        err = on_irq_info(m, r);
        break;
      case Cmd::kDeviceSetIrqs:
        err = on_set_irqs(m);
        break;
      case Cmd::kRegionRead:
        err = on_region_read(m, r);
        break;
      case Cmd::kRegionWrite:
        err = on_region_write(m, r);
        break;
      case Cmd::kRegionWriteMulti:
        err = on_write_multi(m, r);
        break;
      case Cmd::kDeviceReset:
        err = on_reset();
        break;
      case Cmd::kDeviceFeature:
        err = ENOTTY;
        break;  // no migration or dirty tracking
      case Cmd::kDeviceGetRegionIoFds:
        err = on_region_io_fds(m, r);
        break;
      case Cmd::kMigDataRead:
      case Cmd::kMigDataWrite:
        err = ENOTSUP;
        break;
      case Cmd::kDmaRead:
      case Cmd::kDmaWrite:
        err = EINVAL;
        break;  // server-to-client only
      default:
        err = ENOSYS;
        break;
    }
  }
  if (err != 0) {
    stats_.errors.fetch_add(1, std::memory_order_relaxed);
    r.payload.clear();
    r.fds.clear();
    r.why = std::move(refusal_);
  }
  refusal_.clear();
  r.hdr = reply_header(m.hdr, static_cast<uint32_t>(r.payload.size()), err);
  return r;
}

int DeviceSession::on_version(const Message& m, Reply& r) {
  if (negotiated_) return EINVAL;
  VersionRequest v;
  if (int e = decode_version(m.payload, &v); e != 0) return e;
  if (v.major != kMajor) {
    r.close_after = true;
    return ENOTSUP;
  }
  VersionMsg out{kMajor, std::min(v.minor, kMaxMinor)};
  append(r.payload, out);
  // Our DMA_READ/DMA_WRITE messages stay within the client's max_data_xfer_size (at least a
  // page: smaller would only multiply messages) and ours.
  if (v.caps.max_data_xfer_size) {
    dma_chunk_ =
        static_cast<uint32_t>(std::clamp<uint64_t>(*v.caps.max_data_xfer_size, 4096, kMaxDataXfer));
  }
  const std::string json = version_reply_json(v.caps, config_.dma.max_maps);
  for (char c : json) r.payload.push_back(static_cast<std::byte>(c));
  r.payload.push_back(std::byte{0});  // QEMU refuses a reply whose JSON is not NUL-terminated
  negotiated_ = true;
  return 0;
}

int DeviceSession::on_dma_map(Message& m) {
  PayloadReader p(m.payload);
  auto req = p.get<DmaMapMsg>();
  if (!req || req->argsz < sizeof(DmaMapMsg) || m.fds.size() > 1) return EINVAL;
  UniqueFd fd = m.fds.empty() ? UniqueFd() : std::move(m.fds[0]);
  if (!fd.valid() && req->offset != 0) return EINVAL;
  const int err = dma_.map(req->addr, req->size, req->offset, req->flags, std::move(fd));
  if (err == EPERM) {
    refusal_ =
        "its memory fd is not sealed against shrinking (F_SEAL_SHRINK), so the client could "
        "make gdkvd fault; allow_unsealed_memory = true accepts such memory (SPDK's "
        "hugetlbfs files, QEMU memory-backend-memfd without seal=on)";
  }
  return err;
}

// How long a DMA_UNMAP waits for the commands of queues in the memory (longer than a backend's
// own op timeout, so only a stuck backend hits it).
constexpr std::chrono::seconds kUnmapTimeout{30};

int DeviceSession::on_dma_unmap(Message& m, Reply& r) {
  // SPDK sends the region's fd along with DMA_UNMAP; it is closed with the message.
  PayloadReader p(m.payload);
  auto req = p.get<DmaUnmapMsg>();
  if (!req || req->argsz < sizeof(DmaUnmapMsg)) return EINVAL;
  if (req->flags & kDmaUnmapFlagGetDirtyBitmap) return ENOTSUP;
  if (req->flags & ~(kDmaUnmapFlagAll)) return EINVAL;
  const bool all = req->flags & kDmaUnmapFlagAll;
  if (all && (req->addr != 0 || req->size != 0)) return EINVAL;
  // The spec leaves a server no way to refuse: queues living in the memory go first (SPDK unmaps
  // the region of its admin queue after shutting the controller down). Their commands finish
  // meanwhile; those waiting on DMA replies, which this thread would read, fail.
  const std::vector<const DmaMap*> with_queues = dma_.queue_maps(req->addr, req->size, all);
  if (!with_queues.empty()) {
    dma_refuse(true);
    for (const DmaMap* q : with_queues) {
      if (!nvme_->drop_queues_in(q, kUnmapTimeout)) {
        refusal_ = "commands on queues in this memory did not finish in time";
      }
    }
    dma_refuse(false);
  }
  int err = 0;
  std::vector<std::unique_ptr<DmaMap>> victims;
  if (all) {
    err = dma_.detach_all(victims);
  } else {
    victims.push_back(dma_.detach(req->addr, req->size, &err));
  }
  if (err == EBUSY && refusal_.empty()) refusal_ = "a queue was created in this memory meanwhile";
  if (err != 0) return err;
  for (auto& m : victims) release_map(std::move(m));  // no reference is left when we reply
  append(r.payload, *req);                            // the reply echoes the unmapped entry
  return 0;
}

int DeviceSession::on_device_info(const Message& m, Reply& r) {
  PayloadReader p(m.payload);
  auto req = p.get<DeviceInfoMsg>();
  if (!req || req->argsz < sizeof(DeviceInfoMsg)) return EINVAL;
  DeviceInfoMsg out{sizeof(DeviceInfoMsg), kDeviceFlagReset | kDeviceFlagPci, kNumPciRegions,
                    kNumIrqTypes};
  append(r.payload, out);
  return 0;
}

int DeviceSession::on_region_info(const Message& m, Reply& r) {
  PayloadReader p(m.payload);
  auto req = p.get<RegionInfoMsg>();
  if (!req || req->argsz < sizeof(RegionInfoMsg) || req->index >= kNumPciRegions) return EINVAL;
  RegionInfoMsg out{};
  out.argsz = sizeof(RegionInfoMsg);
  out.index = req->index;
  switch (req->index) {
    case kRegionBar0: {
      // Registers [0, 0x1000) are trapped; the doorbell page is mappable from our memfd.
      SparseMmapCap cap{};
      cap.header = {kCapSparseMmap, 1, 0};
      cap.nr_areas = 1;
      const SparseArea area{kDoorbellPage, kDoorbellPage};
      const uint32_t full = sizeof(RegionInfoMsg) + sizeof(cap) + sizeof(area);
      out.flags = kRegionFlagRead | kRegionFlagWrite | kRegionFlagMmap | kRegionFlagCaps;
      out.size = kBar0Size;
      out.offset = 0;
      out.argsz = full;
      if (req->argsz < full) {
        // Too small for the capability: say how much is needed and leave the capability (and its
        // CAPS flag, which QEMU checks against cap_offset) out; the client asks again.
        out.flags &= ~kRegionFlagCaps;
        out.cap_offset = 0;
        append(r.payload, out);
        return 0;
      }
      out.cap_offset = sizeof(RegionInfoMsg);
      append(r.payload, out);
      append(r.payload, cap);
      append(r.payload, area);
      r.fds.push_back(nvme_->doorbell_fd());
      return 0;
    }
    case kRegionBar4:
      out.flags = kRegionFlagRead | kRegionFlagWrite;
      out.size = kBar4Size;
      break;
    case kRegionConfig:
      out.flags = kRegionFlagRead | kRegionFlagWrite;
      out.size = kConfigSize;
      break;
    default:
      break;  // BAR1 (upper half of BAR0), BAR2/3/5, ROM, VGA: not present
  }
  append(r.payload, out);
  return 0;
}

int DeviceSession::on_region_io_fds(const Message& m, Reply& r) {
  PayloadReader p(m.payload);
  auto req = p.get<RegionIoFdsMsg>();
  if (!req || req->argsz < sizeof(RegionIoFdsMsg) || req->flags != 0 ||
      req->index >= kNumPciRegions) {
    return EINVAL;
  }
  RegionIoFdsMsg out{sizeof(RegionIoFdsMsg), 0, req->index, 0};
  if (req->index != kRegionBar0) {
    append(r.payload, out);  // no other region has io fds
    return 0;
  }
  // One ioeventfd over the doorbell page: a write there (by a host that traps it, or gdkv's
  // client after a doorbell that found the reactor asleep) wakes the reactor serving this
  // connection. No datamatch: any write.
  const IoFdSubRegion sub{kDoorbellPage, kDoorbellPage, 0, kIoFdTypeIoeventfd, 0, 0, 0};
  out.count = 1;
  out.argsz = sizeof(RegionIoFdsMsg) + sizeof(sub);
  append(r.payload, out);
  if (req->argsz < out.argsz) return 0;  // says what it needs; the client asks again
  append(r.payload, sub);
  r.fds.push_back(nvme_->doorbell_event_fd());
  return 0;
}

int DeviceSession::on_irq_info(const Message& m, Reply& r) {
  PayloadReader p(m.payload);
  auto req = p.get<IrqInfoMsg>();
  if (!req || req->argsz < sizeof(IrqInfoMsg) || req->index >= kNumIrqTypes) return EINVAL;
  IrqInfoMsg out{sizeof(IrqInfoMsg), kIrqInfoEventfd, req->index, irq_count(req->index)};
  if (req->index == kIrqMsix) out.flags |= kIrqInfoNoresize;
  append(r.payload, out);
  return 0;
}

int DeviceSession::on_set_irqs(Message& m) {
  PayloadReader p(m.payload);
  auto req = p.get<IrqSetMsg>();
  if (!req || req->argsz < sizeof(IrqSetMsg) || req->index >= kNumIrqTypes) return EINVAL;
  const uint32_t data = req->flags & kIrqSetDataMask;
  const uint32_t action = req->flags & kIrqSetActionMaskAll;
  if ((req->flags & ~(kIrqSetDataMask | kIrqSetActionMaskAll)) != 0) return EINVAL;
  if (std::popcount(data) != 1 || std::popcount(action) != 1) return EINVAL;
  const uint32_t count = irq_count(req->index);
  // DATA_NONE with start = count = 0 disables every interrupt of the index.
  if (data == kIrqSetDataNone && req->start == 0 && req->count == 0) {
    if (!m.fds.empty()) return EINVAL;
    if (action == kIrqSetActionTrigger) {
      std::lock_guard lk(irq_mu_);
      for (uint32_t v = 0; v < count; ++v) irq_fd(req->index, v).reset();
    }
    return 0;
  }
  if (req->start > count || req->count > count - req->start) return EINVAL;
  if (data == kIrqSetDataEventfd) {
    if (!m.fds.empty() && m.fds.size() != req->count) return EINVAL;
    if (action != kIrqSetActionTrigger) return 0;  // mask/unmask notifications: not generated
    for (const UniqueFd& fd : m.fds) {
      if (!usable_irq_fd(fd.get())) {
        refusal_ = "an interrupt descriptor is not an eventfd";
        return EINVAL;
      }
    }
    std::lock_guard lk(irq_mu_);
    for (uint32_t i = 0; i < req->count; ++i) {
      // No descriptors: de-assign these vectors.
      irq_fd(req->index, req->start + i) = m.fds.empty() ? UniqueFd() : std::move(m.fds[i]);
    }
    return 0;
  }
  if (!m.fds.empty()) return EINVAL;
  if (data == kIrqSetDataBool && p.size() < sizeof(IrqSetMsg) + req->count) return EINVAL;
  // The client triggers vectors itself (DATA_NONE / DATA_BOOL with TRIGGER); masking is the
  // client's business (QEMU emulates the MSI-X table), so MASK/UNMASK are accepted as no-ops.
  if (action == kIrqSetActionTrigger && req->index == kIrqMsix) {
    const std::span<const std::byte> bools = p.tail(sizeof(IrqSetMsg));
    for (uint32_t i = 0; i < req->count; ++i) {
      if (data == kIrqSetDataBool && bools[i] == std::byte{0}) continue;
      signal(static_cast<uint16_t>(req->start + i));
    }
  }
  return 0;
}

uint32_t DeviceSession::irq_count(uint32_t index) const {
  // MSI-X vectors, and one ERR interrupt so QEMU enables error recovery. (gdkvd reports its
  // errors through CSTS.CFS and completion statuses; it never signals ERR.)
  if (index == kIrqMsix) return config_.nvme.msix_vectors;
  return index == kIrqErr ? 1 : 0;
}

UniqueFd& DeviceSession::irq_fd(uint32_t index, uint32_t i) {
  return index == kIrqErr ? err_irq_ : msix_[i];
}

int DeviceSession::region_access(uint32_t region, uint64_t offset, std::span<std::byte> read,
                                 std::span<const std::byte> write) {
  const size_t n = read.empty() ? write.size() : read.size();
  switch (region) {
    case kRegionConfig:
      if (offset > kConfigSize) return EINVAL;
      return (read.empty() ? pci_.write(static_cast<uint32_t>(offset), write)
                           : pci_.read(static_cast<uint32_t>(offset), read))
                 ? 0
                 : EINVAL;
    case kRegionBar0:
      return (read.empty() ? nvme_->bar0_write(offset, write) : nvme_->bar0_read(offset, read))
                 ? 0
                 : EINVAL;
    case kRegionBar4: {
      if (offset > kBar4Size || n > kBar4Size - offset) return EINVAL;
      // [0, 0x1000): the MSI-X table as the host wrote it; [0x1000, 0x2000): the PBA, nothing
      // pending (gdkvd signals eventfds, it never holds an interrupt back).
      for (size_t i = 0; i < n; ++i) {
        const uint64_t at = offset + i;
        if (read.empty()) {
          if (at < msix_table_.size()) msix_table_[at] = static_cast<uint8_t>(write[i]);
        } else {
          read[i] =
              at < msix_table_.size() ? static_cast<std::byte>(msix_table_[at]) : std::byte{0};
        }
      }
      return 0;
    }
    default:
      return EINVAL;
  }
}

int DeviceSession::on_region_read(const Message& m, Reply& r) {
  PayloadReader p(m.payload);
  auto req = p.get<RegionAccessMsg>();
  if (!req || req->count > kMaxDataXfer) return EINVAL;
  append(r.payload, *req);
  r.payload.resize(sizeof(RegionAccessMsg) + req->count);
  std::span<std::byte> data(r.payload.data() + sizeof(RegionAccessMsg), req->count);
  if (req->count == 0) return 0;
  return region_access(req->region, req->offset, data, {});
}

int DeviceSession::on_region_write(const Message& m, Reply& r) {
  PayloadReader p(m.payload);
  auto req = p.get<RegionAccessMsg>();
  if (!req || req->count > kMaxDataXfer) return EINVAL;
  const std::span<const std::byte> data = p.tail(sizeof(RegionAccessMsg));
  if (data.size() < req->count) return EINVAL;
  if (int e = region_access(req->region, req->offset, {}, data.first(req->count)); e != 0) {
    return e;
  }
  append(r.payload, *req);
  return 0;
}

int DeviceSession::on_write_multi(const Message& m, Reply& r) {
  PayloadReader p(m.payload);
  auto count = p.get<uint64_t>();
  if (!count || *count > kMaxWriteMulti ||
      p.size() < sizeof(uint64_t) + *count * sizeof(WriteMultiEntry)) {
    return EINVAL;
  }
  for (uint64_t i = 0; i < *count; ++i) {
    const auto e = *p.get<WriteMultiEntry>(sizeof(uint64_t) + i * sizeof(WriteMultiEntry));
    if (e.count == 0 || e.count > sizeof(e.data)) return EINVAL;
    const auto* d = reinterpret_cast<const std::byte*>(e.data);
    if (int err = region_access(e.region, e.offset, {}, std::span(d, e.count)); err != 0) {
      return err;
    }
  }
  append(r.payload, *count);
  return 0;
}

int DeviceSession::on_reset() {
  // As the host would: clear CC.EN and wait for the controller to finish its commands and drop
  // RDY. Interrupt and DMA setup stay, as the spec keeps device state across resets.
  const std::byte zero[4] = {};
  nvme_->bar0_write(reg::kCc, zero);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(config_.reset_timeout_ms);
  dma_refuse(true);  // commands waiting on DMA replies fail: this thread reads no replies now
  int err = 0;
  while (nvme_->csts() & (kCstsRdy | kCstsShstMask)) {
    if (std::chrono::steady_clock::now() > deadline) {
      err = ETIMEDOUT;
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  dma_refuse(false);
  return err;
}

}  // namespace gdkv::vfio_user
