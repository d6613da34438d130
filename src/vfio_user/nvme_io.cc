// The NVMe controller: the I/O path (fetch, dispatch, completion) (see nvme_ctrl.h,
// nvme_ctrl_impl.h).
#include "vfio_user/nvme_ctrl_impl.h"

namespace gdkv::vfio_user {

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
  // The revoke word is read before each command: a host that stores it during this loop gets
  // nothing more fetched from its queues.
  for (uint32_t i = 0; i < n && !sq.free.empty() && !revoked(); ++i) {
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

}  // namespace gdkv::vfio_user
