// A thin owner of one io_uring instance for the local store: setup with a clear error when the
// kernel lacks io_uring or an opcode the store uses, and one registered buffer arena.
//
// Thread safety: none. The store's I/O thread creates it, uses it and destroys it (the ring may
// be single-issuer, which the kernel enforces).
#pragma once

#include <liburing.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace gdkv::local {

// A test's view of, and hand in, every write, flush and size change the store makes to its file:
// the power-loss harness records them to build crash states (crash_test.cc), the error tests fail
// chosen ones. Called on the thread that issues the I/O, before it is issued. Unset (the default)
// it costs one null-pointer test per write or flush and one empty-vector test per completion.
class IoHook {
 public:
  virtual ~IoHook() = default;
  // A write of [buf, buf + n) at file offset `off` is about to be issued. Returns n to issue it, a
  // smaller positive count to issue only that prefix (a short write, as the kernel may return),
  // or -errno to fail it without issuing it (its completion carries the error).
  virtual int64_t write(uint64_t off, const std::byte* buf, uint64_t n) = 0;
  // An fdatasync is about to be issued: 0 to issue it, -errno to fail it unissued.
  virtual int sync() = 0;
  // The file is about to be extended to `size` bytes (fallocate or ftruncate): 0 or -errno.
  virtual int resize(uint64_t size) = 0;
};

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

  // Every write and flush the store puts in the ring goes through these, so an IoHook sees them.
  // `data` becomes the SQE's user_data. `fixed`: buf lies in the registered arena.
  void set_hook(IoHook* hook) noexcept { hook_ = hook; }
  void prep_write(io_uring_sqe* s, int fd, const std::byte* buf, uint32_t n, uint64_t off,
                  bool fixed, void* data);
  void prep_fdatasync(io_uring_sqe* s, int fd, void* data);
  // A completion's user_data and result: the kernel's, or, for a NOP standing for an I/O the
  // hook failed, that I/O's user_data and the injected error. REQUIRES: once per completion.
  int result(void*& data, int res) { return injected_.empty() ? res : take_injected(data, res); }
  unsigned entries() const noexcept { return entries_; }

 private:
  io_uring ring_{};
  unsigned entries_ = 0;
  bool registered_ = false;
  IoHook* hook_ = nullptr;
  struct Injected {
    void* data;
    int res;
  };
  // NOPs standing for failed I/O; a NOP's user_data is its entry here (stable addresses).
  std::vector<std::unique_ptr<Injected>> injected_;
  void inject(io_uring_sqe* s, void* data, int res);
  int take_injected(void*& data, int res);
};

}  // namespace gdkv::local
