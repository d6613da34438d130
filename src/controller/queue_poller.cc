// In-process queue pairs: a Poller that fetches SQEs from a QueueRef's ring and posts CQEs, and
// the address space of a requester in the controller's own process.
#include "controller/queue_poller.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "controller/reactor.h"

namespace gdkv {

nvme::Status InProcessSpace::map_range(uint64_t addr, size_t len, bool for_write,
                                       DataSegments& out) {
  (void)for_write;
  if (len == 0) return nvme::Status::kSuccess;
  if (addr == 0) return nvme::Status::kInvalidField;
  if (addr + len < addr) return nvme::Status::kDataTransferError;
  MemoryRegion r{};
  MemKind kind = MemKind::kHost;
  uint64_t region = 0;
  if (ctl_->find_region(static_cast<uintptr_t>(addr), len, &r)) {
    kind = r.kind;
    region = r.id;
  } else if (strict_) {
    return nvme::Status::kDataTransferError;
  }
  out.push_back(
      DataSegment{reinterpret_cast<std::byte*>(static_cast<uintptr_t>(addr)), len, kind, region});
  return nvme::Status::kSuccess;
}

nvme::Status InProcessSpace::map_data(const nvme::Sqe& sqe, size_t len, bool for_write,
                                      DataSegments& out) {
  // In-process data pointers name one contiguous virtual range: PRP1 (PSDT 0), or a single SGL
  // data block descriptor (PSDT 1) whose length must cover the transfer.
  switch (sqe.psdt()) {
    case nvme::kPsdtPrp:
      return map_range(sqe.dptr.prp.prp1, len, for_write, out);
    case nvme::kPsdtSglContiguous:
      if ((sqe.dptr.sgl.type >> 4) != 0) return nvme::Status::kInvalidField;
      if (sqe.dptr.sgl.length < len) return nvme::Status::kDataTransferError;
      return map_range(sqe.dptr.sgl.address, len, for_write, out);
    default:
      return nvme::Status::kInvalidField;
  }
}

QueuePoller::QueuePoller(Controller::Impl* ctl, const QueueOptions& options, uint16_t qid,
                         uint32_t* wake)
    : ctl_(ctl), space_(ctl, options.strict_regions) {
  if (!valid_queue_depth(options.depth)) {
    throw std::invalid_argument("queue depth must be a power of two in [2, 4096]");
  }
  const size_t bytes = QueueLayout::for_depth(options.depth).total;
  if (ctl_->options.queue_alloc) {
    block_ = ctl_->options.queue_alloc(bytes);
    if (block_ == nullptr) throw std::runtime_error("queue memory allocation failed");
  } else {
    block_ = std::aligned_alloc(4096, (bytes + 4095) & ~size_t{4095});
    if (block_ == nullptr) throw std::bad_alloc();
    std::memset(block_, 0, bytes);
  }
  ref_ = QueueRef::over(block_, options.depth, qid);
  ref_.wake = wake;
  ref_.wake_fn = wake != nullptr ? &Reactor::wake_word_fn : nullptr;
  commands_ = std::make_unique<Command[]>(options.depth);
  command_count_ = options.depth;
  free_.reserve(options.depth);
  for (uint32_t i = 0; i < command_count_; ++i) {
    Command& c = commands_[i];
    c.space = &space_;
    c.stream = qid;
    c.transport = this;
    c.complete = &QueuePoller::on_complete;
    free_.push_back(&c);
  }
}

QueuePoller::~QueuePoller() {
  if (ctl_->options.queue_free) {
    ctl_->options.queue_free(block_);
  } else {
    std::free(block_);
  }
}

bool QueuePoller::poll() {
  bool busy = flush_overflow();
  if (ctl_->stopping.load(std::memory_order_relaxed)) return busy;
  const uint32_t tail = atomic::load(&ref_.db->sq_tail);
  int32_t pending = static_cast<int32_t>(tail - fetched_);
  // A doorbell behind us is a late write from another requester thread; one more than a whole
  // ring ahead is garbage. Neither is work.
  if (pending <= 0 || pending > static_cast<int32_t>(ref_.depth)) return busy;
  uint32_t n = static_cast<uint32_t>(pending);
  if (n > kMaxBatch) n = kMaxBatch;
  for (uint32_t i = 0; i < n && !free_.empty(); ++i) {
    Command* cmd = free_.back();
    free_.pop_back();
    cmd->sqe = ref_.sq[fetched_ & (ref_.depth - 1)];
    ++fetched_;
    ctl_->execute(cmd);
    busy = true;
  }
  return busy;
}

void QueuePoller::on_complete(Command* cmd, nvme::Status status, uint32_t dw0) {
  auto* self = static_cast<QueuePoller*>(cmd->transport);
  const uint16_t cid = cmd->sqe.cid;
  self->free_.push_back(cmd);
  if (!self->overflow_.empty() || !self->post(cid, status, dw0)) {
    self->overflow_.push_back(Pending{cid, status, dw0});
  }
}

bool QueuePoller::post(uint16_t cid, nvme::Status status, uint32_t dw0) {
  const uint32_t head = atomic::load(&ref_.db->cq_head);
  if (posted_ - head >= ref_.depth) return false;  // ring full: the requesters are behind
  nvme::Cqe* e = &ref_.cq[posted_ & (ref_.depth - 1)];
  const uint16_t phase = ((posted_ / ref_.depth) & 1) ? 0 : 1;
  e->dw0 = dw0;
  e->dw1 = 0;
  e->sq_head = static_cast<uint16_t>(fetched_ & (ref_.depth - 1));
  e->sq_id = ref_.qid;
  e->cid = cid;
  atomic::store(&e->status, static_cast<uint16_t>(nvme::make_status_field(status) | phase));
  ++posted_;
  return true;
}

bool QueuePoller::flush_overflow() {
  bool busy = false;
  while (!overflow_.empty()) {
    const Pending& p = overflow_.front();
    if (!post(p.cid, p.status, p.dw0)) break;
    overflow_.pop_front();
    busy = true;
  }
  return busy;
}

}  // namespace gdkv
