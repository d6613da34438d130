// The client API: NVMe-KV commands through a queue pair, synchronous or asynchronous.
//
// A Client owns one queue pair of a controller: either an in-process controller it created
// (Client::open) or a queue it was handed (a vfio-user connection to gdkvd). Every call goes
// through the queue: the client never touches the backend directly.
//
// Thread safety: a Client may be used from many threads at once (the queue protocol is lock-free);
// an async command id is used by the thread that started it until it finishes it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/controller.h"
#include "gdkv/key.h"
#include "gdkv/nvme_kv.h"
#include "gdkv/queue.h"

namespace gdkv {

// For transports whose controller cannot reach arbitrary client memory (vfio-user: only the
// client's DMA-mapped shared memory): the synchronous calls stage each data buffer through it.
class BufferStager {
 public:
  virtual ~BufferStager() = default;
  // An address the controller can reach for `len` bytes standing in for `p`; when `to_controller`
  // the bytes are copied in now. Returns 0 when nothing can be had (the call then fails with 04h).
  virtual uint64_t acquire(const void* p, size_t len, bool to_controller) = 0;
  // After the command: copies `len` bytes back to `p` when !to_controller, and frees the stand-in.
  virtual void release(uint64_t addr, void* p, size_t len, bool to_controller) = 0;
};

struct ClientOptions {
  ControllerOptions controller;  // for Client::open
  QueueOptions queue;            // depth of the client's queue pair
};

class Client {
 public:
  // An in-process controller over `backend` and one queue pair to it.
  static std::unique_ptr<Client> open(std::shared_ptr<Backend> backend,
                                      const ClientOptions& options = {});
  // A queue pair kept alive by `owner` (e.g. a vfio-user connection).
  Client(QueueRef queue, std::shared_ptr<void> owner, Controller* controller = nullptr,
         BufferStager* stager = nullptr);
  ~Client();

  // ---- synchronous ----
  CmdResult put(const Key& key, std::span<const std::byte> value, uint8_t options = 0,
                uint32_t nsid = 1);
  // dw0 of the result = the value's full length; min(length, buf.size()) bytes land in buf.
  CmdResult get(const Key& key, std::span<std::byte> buf, uint32_t nsid = 1);
  // The whole value, however long (a second round trip when it outgrows `hint` bytes).
  CmdResult get(const Key& key, std::vector<std::byte>& out, uint32_t nsid = 1,
                size_t hint = 64 * 1024);
  CmdResult del(const Key& key, uint32_t nsid = 1);
  CmdResult exists(const Key& key, uint32_t nsid = 1);
  // Keys >= start in ascending order, one List command of `buf_bytes`; appends to out.
  CmdResult list(const Key& start, std::vector<Key>& out, uint32_t buf_bytes = 64 * 1024,
                 uint32_t nsid = 1);
  // Every key (List commands continued until the end).
  CmdResult list_all(std::vector<Key>& out, uint32_t nsid = 1);
  CmdResult prefetch(std::span<const Key> keys, uint32_t nsid = 1);
  // One value into several places (e.g. one slot per layer).
  CmdResult scatter_get(const Key& key, std::span<const nvme::ScatterEntry> pieces,
                        uint32_t nsid = 1);
  // Runs any prepared command (cid is filled in).
  CmdResult execute(nvme::Sqe sqe);

  // ---- asynchronous ----
  // Submits; nullopt when the queue is full (back-pressure).
  std::optional<uint16_t> try_start(nvme::Sqe sqe);
  // Submits, spinning (and reaping) while the queue is full.
  uint16_t start(nvme::Sqe sqe);
  // True once command `cid` completed.
  bool poll(uint16_t cid) { return queue::poll(queue_, cid); }
  // The result of a completed command; frees its id. REQUIRES: poll(cid) returned true.
  CmdResult finish(uint16_t cid);
  CmdResult wait(uint16_t cid) { return queue::wait(queue_, cid); }
  // Runs a batch: submits as many as fit at once (one doorbell per group), waits for all.
  void run_batch(std::span<nvme::Sqe> sqes, std::span<CmdResult> results);

  const QueueRef& queue() const { return queue_; }
  // The in-process controller (null for remote connections).
  Controller* controller() const { return controller_; }

 private:
  // A command whose data buffer is [p, p+len): staged through stager_ when there is one.
  CmdResult execute_data(nvme::Sqe sqe, const void* p, size_t len, bool to_controller);

  QueueRef queue_;
  std::shared_ptr<void> owner_;
  BufferStager* stager_ = nullptr;
  Controller* controller_ = nullptr;
  std::unique_ptr<Controller> owned_controller_;
};

// "key does not exist (87h)"
std::string describe(const CmdResult& r);

}  // namespace gdkv
