// The NVMe controller: message-only DMA memory (commands staged through bounce buffers) (see
// nvme_ctrl.h, nvme_ctrl_impl.h).
#include "vfio_user/nvme_ctrl_impl.h"

namespace gdkv::vfio_user {

// ---- Message-only DMA memory
// ----------------------------------------------------------------------

void NvmeController::dma_done(DmaXfer* x) {
  {
    std::lock_guard lk(dma_mu_);
    dma_done_.push_back(x);
    dma_pending_.store(true, std::memory_order_release);
  }
  // The reactor may sleep: its wake fd ends that at once (else its sleep timeout would).
  const uint64_t one = 1;
  (void)!::write(wake_fd_.get(), &one, sizeof(one));
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

}  // namespace gdkv::vfio_user
