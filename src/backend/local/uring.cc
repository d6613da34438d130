#include "backend/local/uring.h"

#include <sys/uio.h>

#include <cstring>
#include <stdexcept>
#include <string>

namespace gdkv::local {

namespace {
struct Needed {
  int op;
  const char* name;
};
// What the store issues: reads and writes into arbitrary (caller) memory, the same into the
// registered arena, and fdatasync for group commit. All exist since Linux 5.6.
constexpr Needed kNeeded[] = {
    {IORING_OP_READ, "IORING_OP_READ"},
    {IORING_OP_WRITE, "IORING_OP_WRITE"},
    {IORING_OP_READ_FIXED, "IORING_OP_READ_FIXED"},
    {IORING_OP_WRITE_FIXED, "IORING_OP_WRITE_FIXED"},
    {IORING_OP_FSYNC, "IORING_OP_FSYNC"},
};
}  // namespace

Uring::Uring(unsigned entries) : entries_(entries) {
  // One thread creates the ring, submits to it and waits on it. Completion work can then wait
  // until that thread enters the kernel instead of interrupting it: DEFER_TASKRUN (Linux 6.1,
  // needs SINGLE_ISSUER), else COOP_TASKRUN (5.19); older kernels refuse both and get a plain ring.
  const unsigned tries[] = {
      IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
      IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG,
      0,
  };
  int r = -EINVAL;
  for (unsigned flags : tries) {
    io_uring_params p{};
    p.flags = IORING_SETUP_CQSIZE | flags;
    p.cq_entries = entries * 2;
    r = io_uring_queue_init_params(entries, &ring_, &p);
    if (r != -EINVAL) break;
  }
  if (r < 0) {
    std::string why = std::strerror(-r);
    if (r == -EPERM) why += " (io_uring disabled? see /proc/sys/kernel/io_uring_disabled)";
    if (r == -ENOSYS) why += " (kernel without io_uring; Linux 5.6 or newer is needed)";
    throw std::runtime_error("local store: cannot set up io_uring: " + why);
  }
  io_uring_probe* probe = io_uring_get_probe_ring(&ring_);
  if (probe == nullptr) {
    io_uring_queue_exit(&ring_);
    throw std::runtime_error(
        "local store: io_uring opcode probe failed (kernel too old: Linux 5.6 or newer is needed)");
  }
  std::string missing;
  for (const Needed& n : kNeeded) {
    if (!io_uring_opcode_supported(probe, n.op))
      missing += std::string(missing.empty() ? "" : ", ") + n.name;
  }
  io_uring_free_probe(probe);
  if (!missing.empty()) {
    io_uring_queue_exit(&ring_);
    throw std::runtime_error("local store: this kernel's io_uring lacks " + missing +
                             " (Linux 5.6 or newer is needed)");
  }
}

Uring::~Uring() { io_uring_queue_exit(&ring_); }

bool Uring::register_arena(std::byte* base, size_t bytes) {
  iovec iov{base, bytes};
  registered_ = io_uring_register_buffers(&ring_, &iov, 1) == 0;
  return registered_;
}

void Uring::prep_write(io_uring_sqe* s, int fd, const std::byte* buf, uint32_t n, uint64_t off,
                       bool fixed, void* data) {
  if (hook_ != nullptr) {
    const int64_t r = hook_->write(off, buf, n);
    if (r < 0) return inject(s, data, static_cast<int>(r));
    if (r < n) n = static_cast<uint32_t>(r);
  }
  if (fixed) {
    io_uring_prep_write_fixed(s, fd, buf, n, off, 0);
  } else {
    io_uring_prep_write(s, fd, buf, n, off);
  }
  io_uring_sqe_set_data(s, data);
}

void Uring::prep_fdatasync(io_uring_sqe* s, int fd, void* data) {
  if (hook_ != nullptr) {
    if (const int r = hook_->sync(); r < 0) return inject(s, data, r);
  }
  io_uring_prep_fsync(s, fd, IORING_FSYNC_DATASYNC);
  io_uring_sqe_set_data(s, data);
}

void Uring::inject(io_uring_sqe* s, void* data, int res) {
  injected_.push_back(std::make_unique<Injected>(Injected{data, res}));
  io_uring_prep_nop(s);
  io_uring_sqe_set_data(s, injected_.back().get());
}

int Uring::take_injected(void*& data, int res) {
  for (size_t i = 0; i < injected_.size(); ++i) {
    if (injected_[i].get() == data) {
      data = injected_[i]->data;
      res = injected_[i]->res;
      injected_.erase(injected_.begin() + static_cast<ptrdiff_t>(i));
      break;
    }
  }
  return res;
}

io_uring_sqe* Uring::sqe() {
  for (;;) {
    if (io_uring_sqe* s = io_uring_get_sqe(&ring_)) return s;
    io_uring_submit(&ring_);
  }
}

}  // namespace gdkv::local
