// A thin owner of one io_uring instance for the local store: setup with a clear error when the
// kernel lacks io_uring or an opcode the store uses, and one registered buffer arena.
//
// Thread safety: none. The store's I/O thread creates it, uses it and destroys it (the ring may
// be single-issuer, which the kernel enforces).
#pragma once

#include <liburing.h>

#include <cstddef>
#include <cstdint>

namespace gdkv::local {

class Uring {
 public:
  // Throws std::runtime_error when io_uring can't be set up or lacks an opcode the store needs.
  explicit Uring(unsigned entries);
  ~Uring();
  Uring(const Uring&) = delete;
  Uring& operator=(const Uring&) = delete;

  // Registers [base, base+bytes) as fixed buffer 0. Returns false (and the ring keeps working
  // without fixed buffers) when the kernel refuses, e.g. RLIMIT_MEMLOCK too small for a non-root
  // user: correctness never depends on registration, only a little speed.
  bool register_arena(std::byte* base, size_t bytes);
  bool registered() const noexcept { return registered_; }

  // An SQE; submits queued entries to make room if the submission ring is full. Never null: the
  // store bounds its outstanding operations below the ring size.
  io_uring_sqe* sqe();
  io_uring* ring() noexcept { return &ring_; }
  unsigned entries() const noexcept { return entries_; }

 private:
  io_uring ring_{};
  unsigned entries_ = 0;
  bool registered_ = false;
};

}  // namespace gdkv::local
