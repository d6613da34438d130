// The client API: NVMe-KV commands through a queue pair, synchronous or asynchronous.
//
// A Client owns one queue pair of a controller: either an in-process controller it created
// (Client::open) or a queue it was handed (a vfio-user connection to gdkvd). Every call goes
// through the queue: the client never touches the backend directly.
//
// Thread safety: a Client may be used from many threads at once (the queue protocol is lock-free);
// an async command id is used by the thread that started it until it finishes it.
//
// Failure: a Client on a remote controller (gdkvd) checks while it waits that the controller is
// still there, and gives up after a timeout. Either way it fails for good: the call, and every
// later one, returns 07h (aborted) at once, and failure() says why; the transport hears of it
// (set_on_failure: gdkv's vfio-user driver then closes the connection and hands out no more of
// its shared memory). The caller opens a new connection. A command may still be in flight then:
// its id and staged memory are never reused, and a buffer it named may still be read or written
// until the controller notices the connection is gone, so the caller must not reuse that buffer.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
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
  // the bytes are copied in now. Returns 0 when nothing can be had, at once or (`wait`) after a
  // bounded wait for memory other calls hold; the call then fails with 81h.
  virtual uint64_t acquire(const void* p, size_t len, bool to_controller, bool wait) = 0;
  // After the command: copies the first `copy_back` bytes of the stand-in back to `p` (0 for data
  // sent to the controller, and for commands that failed), and frees the stand-in.
  virtual void release(uint64_t addr, void* p, size_t copy_back) = 0;
  // Memory for a value whose length is not known yet, which the controller writes in place and
  // this process reads at the same address (gdkv's vfio-user driver: a chunk of the shared
  // memory): `len` bytes, or the largest piece the memory has free when that is less (*got says
  // how many). Null when there is none, at once or (`wait`) after a bounded wait. Given back
  // with release(ptr, nullptr, 0). The default has none: Client::get_value then receives into
  // the heap and stages that buffer as any other.
  // A piece shorter than `min_len` is never given. Only called when has_receive_memory().
  virtual bool has_receive_memory() const { return false; }
  virtual std::byte* acquire_receive(size_t len, size_t min_len, bool wait, size_t* got) {
    (void)len;
    (void)min_len;
    (void)wait;
    *got = 0;
    return nullptr;
  }
  // Gives back all but the first `keep` bytes of a buffer from acquire_receive.
  virtual void shrink_receive(std::byte* p, size_t keep) {
    (void)p;
    (void)keep;
  }
  // What keeps this stager and its memory alive for a ReceivedValue that outlives the Client
  // (gdkv's vfio-user driver: the connection); null: the Client's owner does.
  virtual std::shared_ptr<void> keep_alive() { return nullptr; }
};

// A value Client::get_value read, in the memory it was received in: through gdkvd a chunk of the
// shared memory, read where gdkvd wrote it; in-process (or with a stager without receive memory)
// the heap. Move-only; the memory is given back when it is destroyed or reset(), which may be
// after the Client is gone (it keeps the connection's memory alive). Not thread-safe.
struct ReceiveSpare;  // client.cc: a Client's kept heap receive buffer

class ReceivedValue {
 public:
  ReceivedValue() = default;
  ~ReceivedValue() { reset(); }
  ReceivedValue(ReceivedValue&& o) noexcept { *this = std::move(o); }
  ReceivedValue& operator=(ReceivedValue&& o) noexcept;
  ReceivedValue(const ReceivedValue&) = delete;
  ReceivedValue& operator=(const ReceivedValue&) = delete;

  const std::byte* data() const { return p_; }
  size_t size() const { return size_; }
  std::span<const std::byte> bytes() const { return {p_, size_}; }
  // Gives the memory back now; size() becomes 0.
  void reset();

 private:
  friend class Client;
  std::byte* p_ = nullptr;
  size_t size_ = 0;
  BufferStager* stager_ = nullptr;       // its memory (acquire_receive); null: the heap
  std::shared_ptr<void> keep_;           // keeps the stager alive (BufferStager::keep_alive)
  std::shared_ptr<ReceiveSpare> spare_;  // heap memory that goes back there (if it is empty)
};

// For transports whose controller can signal completions (gdkvd's completion interrupts): how a
// waiting Client leaves the core to others instead of yielding in a loop, which on a shared core
// keeps the controller from running.
class CompletionWaiter {
 public:
  virtual ~CompletionWaiter() = default;
  // How long this wait spins on the queue before it blocks (the calling thread's wait).
  virtual std::chrono::nanoseconds spin() = 0;
  // Whether a spin (a nonzero spin()) saw the completion (lets the waiter stop spinning where it
  // never helps, e.g. a controller on the waiter's own core).
  virtual void spun(bool completed) = 0;
  // Blocks until the controller signals a completion (asked for, then `q`'s command `cid` looked
  // at once more, so none is missed), or a bounded time passed. Returns at once if it completed.
  virtual void block(const QueueRef& q, uint16_t cid) = 0;
};

// Why a Client stopped working.
enum class ClientFailure : uint8_t {
  kNone = 0,
  kTimeout,   // a command did not complete within the timeout
  kPeerGone,  // the controller's process closed the connection (gdkvd died or stopped)
};

// One command of a batch with its data buffer: staged through the Client's stager like the
// synchronous calls' buffers.
struct BatchItem {
  nvme::Sqe sqe{};
  const void* data = nullptr;  // the command's data buffer (its PRP1), or null
  size_t len = 0;
  bool to_controller = false;  // Store: the controller reads the buffer
  CmdResult result{};
  bool metadata = false;  // a descriptor or key list, not value bytes: not counted in copies()
};

// Value buffers the calls had to copy through a stager (not counted: buffers used in place, and
// command metadata such as List results, key lists and scatter descriptors). Zero-copy callers
// assert both stay 0.
struct CopyCounters {
  uint64_t copies = 0;
  uint64_t bytes = 0;
};

// What a call returns when its buffer could not be staged (81h, "capacity exceeded"): the memory
// shared with the controller is exhausted.
inline constexpr nvme::Status kStagingExhausted = nvme::Status::kCapacityExceeded;

struct ClientOptions {
  ControllerOptions controller;  // for Client::open
  QueueOptions queue;            // depth of the client's queue pair
};

class Client {
 public:
  // An in-process controller over `backend` and one queue pair to it; an Error (nothing thrown)
  // when the queue pair cannot be made.
  static Result<std::unique_ptr<Client>> open(std::shared_ptr<Backend> backend,
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
  // The whole value, however long: get_value, then one copy into `out`. `hint` is not needed
  // any more and is ignored (kept so that callers passing one still compile).
  CmdResult get(const Key& key, std::vector<std::byte>& out, uint32_t nsid = 1,
                size_t hint = 64 * 1024);
  // The whole value in one Retrieve whatever its length: received into a buffer of the
  // controller's max value size (max_value_bytes()) in memory the controller writes in place and
  // this process reads (through gdkvd a chunk of the shared memory, so there is no staging copy;
  // in-process the heap), then cut to the value's length (completion DW0). A second Retrieve
  // happens only when the memory could not give a max-size buffer and the value is longer than
  // the piece it gave; if it cannot give the value's length either, 81h (kStagingExhausted).
  // On an error `out` is empty.
  CmdResult get_value(const Key& key, ReceivedValue& out, uint32_t nsid = 1);
  // get_value for many keys in rounds: each round receives as many keys as the memory gives
  // buffers for at once, into buffers of the largest length of the previous round (KV blocks
  // are uniform; the first round, knowing none, of max_value_bytes()), and runs as one batch.
  // The first round uses the largest length this Client saw last (get_value, get_values), or
  // max_value_bytes() when it saw none. done(i, result, value) is called once for every key, on
  // the calling thread, as its command completes (later commands of the round still running;
  // not in key order); it may move the value out. A key costs one Retrieve unless its value is
  // longer than its buffer (longer than the last ones seen): then it is read again, at its
  // length, in a later round. A key no memory can be had for, even after waiting, gets 81h, and
  // the keys after it wait no more (81h unless memory is free at once).
  void get_values(std::span<const Key> keys, uint32_t nsid,
                  const std::function<void(size_t, const CmdResult&, ReceivedValue&)>& done);
  // The controller's largest value (Identify, or the in-process controller's options): the size
  // of get_value's receive buffer. Set by the transport before the Client is shared.
  uint64_t max_value_bytes() const { return max_value_bytes_; }
  void set_max_value_bytes(uint64_t n);
  CmdResult del(const Key& key, uint32_t nsid = 1);
  CmdResult exists(const Key& key, uint32_t nsid = 1);
  // Keys >= start in ascending order, one List command of `buf_bytes`; appends to out.
  CmdResult list(const Key& start, std::vector<Key>& out, uint32_t buf_bytes = 64 * 1024,
                 uint32_t nsid = 1);
  // Every key (List commands continued until the end).
  CmdResult list_all(std::vector<Key>& out, uint32_t nsid = 1);
  CmdResult prefetch(std::span<const Key> keys, uint32_t nsid = 1);
  // Scheduler hint: `keys` will be read soon, in this order (Prefetch 81h with the hint option).
  // The cache keeps the cached ones from eviction until read or until the hint ages out, and
  // fetches the others from its lower tier ahead of the read. Keys stored nowhere cost nothing.
  // An empty list or one over 64 KiB of KeyList is 02h (invalid field), a key that is not
  // 1..16 bytes 86h (invalid key size); neither is sent.
  CmdResult hint(std::span<const Key> keys, uint32_t nsid = 1);
  // One value into several places (e.g. one slot per layer).
  CmdResult scatter_get(const Key& key, std::span<const nvme::ScatterEntry> pieces,
                        uint32_t nsid = 1);
  // Runs any prepared command (cid is filled in).
  CmdResult execute(nvme::Sqe sqe);
  // Runs commands with data buffers as one batch; each item's result is filled in. Buffers used
  // in place go in one submission round where the queue allows; staged ones in rounds of about
  // 512 KiB of staging copies, each completion unstaged as it arrives, so the copies overlap the
  // controller's work.
  // `completed(i)`, when given, runs as item i's result is filled in (in item order).
  void execute_batch(std::span<BatchItem> items,
                     const std::function<void(size_t)>& completed = nullptr);

  // ---- batches: one result per key, as RocksDB's MultiGet returns a status per key ----
  // Each runs its commands as one execute_batch (one submission round where the queue allows)
  // and returns every key's result in key order: a failed key fails only itself. On a failed
  // Client every result is 07h (failure() says why).
  std::vector<CmdResult> exists_many(std::span<const Key> keys, uint32_t nsid = 1);
  std::vector<CmdResult> del_many(std::span<const Key> keys, uint32_t nsid = 1);
  // values[i] is stored under keys[i] (the spans must be as many as the keys: else every result
  // is 02h, invalid field, and nothing is sent).
  std::vector<CmdResult> put_many(std::span<const Key> keys,
                                  std::span<const std::span<const std::byte>> values,
                                  uint8_t options = 0, uint32_t nsid = 1);
  // Each key's value into its pieces, laid out in order: one piece is a Retrieve into it, more a
  // Scatter Retrieve. dw0 of a result is the value's full length; min(length, the pieces' total)
  // bytes land. outs must be as many as the keys (else every result is 02h).
  std::vector<CmdResult> get_many_into(std::span<const Key> keys,
                                       std::span<const std::span<const nvme::ScatterEntry>> outs,
                                       uint32_t nsid = 1);
  // How many leading keys exist: Exists in rounds of 16, 32, 64... keys, stopping after the
  // round that found one missing, so a short run costs one small round and a long one a few
  // large ones. *stop (when given) gets the result of the key that ended the run (87h for a
  // missing key, or its error); ok when every key exists.
  size_t lookup_prefix(std::span<const Key> keys, uint32_t nsid = 1, CmdResult* stop = nullptr);

  // ---- asynchronous ----
  // Submits; nullopt when the queue is full (back-pressure).
  std::optional<uint16_t> try_start(nvme::Sqe sqe);
  // Submits, spinning (and reaping) while the queue is full. nullopt once the Client failed.
  std::optional<uint16_t> start(nvme::Sqe sqe);
  // True once command `cid` completed.
  bool poll(uint16_t cid) { return queue::poll(queue_, cid); }
  // The result of a completed command; frees its id. REQUIRES: poll(cid) returned true.
  CmdResult finish(uint16_t cid);
  // Waits for command `cid`, then frees its id. On a failed Client: 07h (see failure()).
  CmdResult wait(uint16_t cid);
  // Runs a batch: submits as many as fit at once (one doorbell per group), waits for all.
  void run_batch(std::span<nvme::Sqe> sqes, std::span<CmdResult> results);

  // How long wait() waits for one command (0: for ever, the default of in-process clients, whose
  // backends time out on their own), and how it learns that the controller is gone (null: it
  // never is). Set before the Client is shared between threads.
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }
  void set_liveness(std::function<bool()> alive) { alive_ = std::move(alive); }
  // How wait() blocks once spinning found nothing (null, the default: it yields). Not owned: the
  // owner (see the constructor) keeps it alive. Set before the Client is shared between threads.
  void set_waiter(CompletionWaiter* w) { waiter_ = w; }
  // Called once, on the thread that found the failure, when the Client fails.
  void set_on_failure(std::function<void(ClientFailure)> f) { on_failure_ = std::move(f); }
  ClientFailure failure() const { return failure_.load(std::memory_order_acquire); }
  CopyCounters copies() const {
    return {copies_.load(std::memory_order_relaxed), copy_bytes_.load(std::memory_order_relaxed)};
  }

  const QueueRef& queue() const { return queue_; }
  // The in-process controller (null for remote connections).
  Controller* controller() const { return controller_; }

 private:
  // Prefetch 81h over a KeyList of `keys`, with the hint option when `hint` (prefetch, hint).
  CmdResult send_key_list(std::span<const Key> keys, uint32_t nsid, bool hint);
  // A command whose data buffer is [p, p+len): staged through stager_ when there is one.
  CmdResult execute_data(nvme::Sqe sqe, const void* p, size_t len, bool to_controller,
                         bool metadata = false);
  // Staging of one buffer: false when no stand-in could be had (now, or after waiting if `wait`).
  bool stage(nvme::Sqe& sqe, const void* p, size_t len, bool to_controller, bool metadata,
             bool wait = true);
  // After the command: the bytes it delivered go back to the caller's buffer. A command that is
  // still in flight (the Client failed) keeps its stand-in.
  void unstage(const nvme::Sqe& sqe, const void* p, size_t len, bool to_controller,
               const CmdResult& r);
  // A receive buffer of up to `want` bytes (*got of them) for get_value; null when none.
  std::byte* acquire_receive(size_t want, size_t min_len, bool wait, size_t* got, bool* heap);
  // The end of a Retrieve into a receive buffer: `v` holds the value or is reset (r failed).
  void finish_receive(ReceivedValue& v, std::byte* p, size_t len, bool heap, const CmdResult& r);
  CmdResult wait_slow(uint16_t cid);
  // wait() with a CompletionWaiter: spins for its spin(), then blocks.
  CmdResult wait_blocking(uint16_t cid);
  // A wait that makes no progress (a command not completing, a full queue) checks here every so
  // often: fails the Client once the controller is gone (looked at every 10 ms) or the wait
  // began a timeout ago. True once the Client failed. Reset with `w = {}` when progress is made.
  struct Waiting {
    std::chrono::steady_clock::time_point since{}, next_look{};
  };
  bool stuck(Waiting& w);
  // Marks the Client failed (the first reason stays) and returns what every call then gets: 07h.
  CmdResult fail(ClientFailure why);
  bool broken() const { return failure_.load(std::memory_order_relaxed) != ClientFailure::kNone; }

  QueueRef queue_;
  std::shared_ptr<void> owner_;
  BufferStager* stager_ = nullptr;
  Controller* controller_ = nullptr;
  std::unique_ptr<Controller> owned_controller_;
  std::chrono::milliseconds timeout_{0};
  std::function<bool()> alive_;
  CompletionWaiter* waiter_ = nullptr;
  std::function<void(ClientFailure)> on_failure_;
  std::atomic<ClientFailure> failure_{ClientFailure::kNone};
  std::atomic<uint64_t> copies_{0}, copy_bytes_{0};
  uint64_t max_value_bytes_ = uint64_t{64} << 20;  // ControllerOptions' default until told
  std::atomic<uint64_t> learned_len_{0};  // the largest value length of the last get; 0: none
  // One heap receive buffer of max_value_bytes_ kept for the next get_value (in-process): a
  // fresh one costs an mmap, page faults and an munmap each time (a 4 KiB get took 4x as long).
  // Its committed pages stay at the longest value read into it.
  std::shared_ptr<ReceiveSpare> spare_;
};

// The data buffer of a Scatter Retrieve (82h): its header and `pieces`.
std::vector<std::byte> scatter_descriptor(std::span<const nvme::ScatterEntry> pieces);

// "timed out", "controller gone" or "" for kNone.
const char* failure_name(ClientFailure f);

// "key does not exist (87h)"
std::string describe(const CmdResult& r);

}  // namespace gdkv
