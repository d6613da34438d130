// The NVMe controller one vfio-user client sees: BAR0 registers, the admin queue (Identify,
// queue management, features, log pages, the gdkv vendor command), and I/O queues whose commands
// run on the shared gdkv Controller.
//
// Threads. The connection's socket thread reads and writes registers (bar0_read/bar0_write): a
// register write only records the value and flags it. Everything else runs on one reactor: this
// object is a Poller, so the queues, the admin command set, enabling and resetting the controller
// and posting completions all happen on that reactor's thread, with no lock on the I/O path. CSTS
// changes there and the host sees it by polling CSTS, as with a real controller.
//
// Doorbells live in a 2-page memfd shared with the client (the sparse-mmap area of BAR0 is its
// second page). The poller reads them every poll; standard hosts write ring indexes (checked as
// the spec says: an invalid doorbell write is ignored and counted), gdkv clients may ask for
// counter doorbells per queue (nvme_defs.h).
//
// Message-only DMA memory (DMA_MAP without an fd): a command whose data pointer lies there gets
// bounce buffers instead. While any such map exists, an I/O command with a data pointer is
// translated when fetched; the pieces it reads are fetched first (DMA_READ through the
// DmaChannel), the command then runs on the bounce buffers, and the bytes it wrote are sent back
// (DMA_WRITE) before its completion is posted. Bounce memory per connection is bounded; commands
// over the budget wait in order. Queues, PRP lists and SGL segments must be in fd-backed memory.
//
// Teardown: stop() makes the poller fetch nothing more; after the owner removed it from its
// reactor and inflight() reached 0, the object may be destroyed. In-flight commands still post
// their completions meanwhile.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "gdkv/controller.h"
#include "gdkv/metrics.h"
#include "gdkv/nvme_kv.h"
#include "gdkv/vfio_user.h"
#include "vfio_user/dma_space.h"
#include "vfio_user/nvme_defs.h"
#include "vfio_user/pci_config.h"
#include "vfio_user/socket_io.h"
#include "vfio_user/translate.h"

namespace gdkv::vfio_user {

// One namespace a connection may use.
struct NamespaceView {
  uint32_t nsid = 1;          // what the client sees
  uint32_t backend_nsid = 1;  // the backend namespace its commands go to
  std::string name;           // for logs and the NGUID
};

// Signals MSI-X vectors (the connection's eventfds).
class IrqSink {
 public:
  virtual ~IrqSink() = default;
  virtual void signal(uint16_t vector) = 0;
};

// One DMA_READ (client memory -> buf) or DMA_WRITE (buf -> client memory) of a message-only range.
struct DmaXfer {
  uint64_t iova = 0;
  uint64_t len = 0;
  std::byte* buf = nullptr;
  bool to_client = false;  // DMA_WRITE
  bool ok = false;         // set by the channel before it reports the transfer done
  void* owner = nullptr;   // the command
};

// Carries DmaXfers to the client (the connection). submit() is called on the reactor; every
// transfer is reported exactly once through NvmeController::dma_done, from any thread.
class DmaChannel {
 public:
  virtual ~DmaChannel() = default;
  virtual void submit(DmaXfer* x) = 0;
};

struct NvmeControllerConfig {
  uint16_t cntlid = 1;
  PciIds ids;
  std::string serial = "gdkv";
  std::string model = "gdkv NVMe-KV controller";
  std::string firmware = "0.1";
  std::string subnqn = "nqn.2024-01.io.gdkv:gdkvd";
  uint32_t max_queue_entries = 4096;  // CAP.MQES + 1
  uint16_t msix_vectors = 32;
  uint64_t max_value_bytes = uint64_t{64} << 20;
  std::vector<NamespaceView> namespaces;  // visible to this client
  DeviceMemoryImporter* importer = nullptr;
  RemovalSource removals;  // log page C0h; null: not served
  uint32_t reactor = 0;    // where the poller runs (for the owner)
  // Bounce memory for message-only DMA maps, per connection. A command larger than this still
  // runs, alone.
  uint64_t message_bounce_bytes = uint64_t{256} << 20;
};

// Counters of one controller (relaxed atomics, read by collect()).
struct NvmeStats {
  std::atomic<uint64_t> io_commands{0};
  std::atomic<uint64_t> io_errors{0};
  std::atomic<uint64_t> admin_commands{0};
  std::atomic<uint64_t> admin_errors{0};
  std::atomic<uint64_t> bad_doorbells{0};
  std::atomic<uint64_t> bytes_read{0};      // value bytes delivered to the host
  std::atomic<uint64_t> bytes_written{0};   // value bytes stored
  std::atomic<uint64_t> read_commands{0};   // Retrieves that succeeded (SMART host reads)
  std::atomic<uint64_t> write_commands{0};  // Stores that succeeded (SMART host writes)
  std::atomic<uint64_t> interrupts{0};
  std::atomic<uint64_t> doorbell_wakeups{0};  // the reactor woken through wake_fd()
  std::atomic<uint64_t> bounced_commands{0};  // commands that used message-only DMA memory
};

class NvmeController final : public Poller {
 public:
  // Throws std::runtime_error if the doorbell memfd cannot be made.
  // `channel` (may be null: message-only maps are then unreachable) moves message-only data.
  NvmeController(Controller& ctl, DmaSpace& dma, IrqSink& irq, NvmeControllerConfig config,
                 DmaChannel* channel = nullptr);
  ~NvmeController() override;

  // ---- socket thread ----
  int doorbell_fd() const { return db_fd_.get(); }
  // The doorbell page's ioeventfd (DEVICE_GET_REGION_IO_FDS): the host signals it after a
  // doorbell write that found the reactor asleep; handing it out turns the sleeping word on.
  int doorbell_event_fd() {
    doorbell_wake_.store(true, std::memory_order_release);
    return wake_fd_.get();
  }
  bool doorbell_wake() const { return doorbell_wake_.load(std::memory_order_acquire); }
  // BAR0 access, any size inside the BAR. False when out of range.
  bool bar0_read(uint64_t offset, std::span<std::byte> out) const;
  bool bar0_write(uint64_t offset, std::span<const std::byte> in);
  uint32_t csts() const { return csts_.load(std::memory_order_acquire); }
  // Fetch nothing more (teardown); in-flight commands still complete.
  void stop() { stopping_.store(true, std::memory_order_release); }
  // The host stored the revoke word (nvme_defs.h, kRevokedOffset): it gave up on the connection.
  bool revoked() const;
  uint64_t inflight() const { return inflight_.load(std::memory_order_acquire); }
  // Before `map` is unmapped: the queues living in it (ring or completion queue there) stop
  // fetching, their commands complete, then the reactor drops them; CSTS.CFS is set if the
  // controller was enabled and not shut down (a live queue lost its memory). False if the reactor
  // did not finish within `timeout` (commands stuck in a backend).
  bool drop_queues_in(const DmaMap* map, std::chrono::milliseconds timeout);

  // ---- any thread ----
  // A transfer submitted to the channel has finished (x->ok says how).
  void dma_done(DmaXfer* x);
  const NvmeStats& stats() const { return stats_; }
  const NvmeControllerConfig& config() const { return config_; }

  // ---- reactor thread ----
  bool poll() override;
  int wake_fd() const override { return wake_fd_.get(); }
  void announce_sleep(bool sleeping) override;
  void woken_by_fd() override;

  // The admin command set, exposed for tests and the fuzz target: executes one admin command as
  // if fetched from the admin queue (REQUIRES: the reactor thread, or no reactor running this
  // controller). Returns the CQE status field and sets *dw0; deferred commands return nullopt.
  std::optional<uint16_t> run_admin(const nvme::Sqe& sqe, uint32_t* dw0);
  // The I/O-side translation of one SQE, as a command of an I/O queue would see it.
  nvme::Status translate_for_test(const nvme::Sqe& sqe, uint64_t len, bool for_write, bool flat,
                                  DataSegments& out);

 private:
  struct Sq;
  struct IoCmd;
  struct PendingCqe {
    uint16_t cid;
    uint16_t sqid;
    uint16_t sq_head;
    uint16_t status;  // without the phase bit
    uint32_t dw0;
  };
  struct Cq {
    bool active = false;
    bool counter = false;
    uint16_t id = 0;
    uint32_t size = 0;
    nvme::Cqe* ring = nullptr;
    DmaMap* map = nullptr;
    uint32_t tail = 0;  // index mode: next slot; counter mode: entries posted
    uint32_t head = 0;  // last valid head doorbell value
    uint16_t phase = 1;
    bool ien = false;
    bool armed = false;  // kArmedInterrupts: signal only while the host armed it
    uint16_t iv = 0;
    uint32_t sqs = 0;  // SQs completing here
    bool irq_due = false;
    std::deque<PendingCqe> overflow;
  };
  struct Sq {
    bool active = false;
    bool counter = false;
    uint16_t id = 0;
    uint32_t size = 0;
    uint16_t cqid = 0;
    const nvme::Sqe* ring = nullptr;
    DmaMap* map = nullptr;
    uint32_t head = 0;  // index mode: next slot to fetch; counter mode: entries fetched
    uint32_t inflight = 0;
    bool deleting = false;
    std::unique_ptr<IoCmd[]> cmds;
    std::vector<IoCmd*> free;
  };
  enum class Deferred : uint8_t { kNone, kDeleteSq, kUnregisterMemory, kImportMemory, kShutdown };
  // A C0h register whose import (cudaIpcOpenMemHandle, which can take milliseconds) runs on a
  // worker thread, so the reactor keeps serving the I/O queues; the reactor maps the memory and
  // completes the command once `done` is set.
  struct Import {
    DeviceMemoryRequest req{};
    void* ptr = nullptr;  // the worker's result (null: refused), written before `done`
    std::string why;
    std::atomic<bool> done{false};
    std::thread worker;
  };

  // Registers (guarded by regs_mu_; CSTS is atomic).
  uint32_t read_reg32(uint32_t off) const;
  void write_reg32(uint32_t off, uint32_t value);

  // Reactor side.
  void handle_cc();
  bool enable(uint32_t cc, uint32_t aqa, uint64_t asq, uint64_t acq);
  void begin_reset();
  bool continue_reset();
  bool continue_drop();
  void teardown_queues();
  bool process_admin();
  bool process_deferred();
  bool fetch_io(Sq& sq);
  void dispatch_io(Sq& sq, IoCmd* c);
  // Message-only memory: translate a command's data pointer up front; false = run it as usual.
  bool stage_io(IoCmd* c);
  void start_staged(IoCmd* c);
  bool process_dma();
  void dma_step(IoCmd* c);
  bool write_back(IoCmd* c, uint16_t status, uint32_t dw0);
  void release_bounce(IoCmd* c);
  void complete_io(IoCmd* c, uint16_t status, uint32_t dw0);
  static void on_io_complete(Command* cmd, nvme::Status status, uint32_t dw0);
  bool post(Cq& cq, const PendingCqe& e);
  void post_or_queue(Cq& cq, const PendingCqe& e);
  bool flush(Cq& cq);
  void refresh_cq_head(Cq& cq);
  uint32_t sq_head_index(const Sq& sq) const;
  void signal_irqs();
  volatile uint32_t* sq_doorbell(uint16_t qid) const;
  volatile uint32_t* cq_doorbell(uint16_t qid) const;
  uint32_t* cq_arm_word(uint16_t qid) const;

  // Admin commands; each returns the status field and sets dw0.
  uint16_t admin(const nvme::Sqe& sqe, uint32_t* dw0, bool* deferred);
  uint16_t identify(const nvme::Sqe& sqe);
  uint16_t get_log_page(const nvme::Sqe& sqe);
  // Log page C0h (nvme_defs.h): fills `page` with the header and records.
  uint16_t removal_log_page(const nvme::Sqe& sqe, uint64_t bytes, std::vector<uint8_t>& page);
  uint16_t set_features(const nvme::Sqe& sqe, uint32_t* dw0);
  uint16_t get_features(const nvme::Sqe& sqe, uint32_t* dw0);
  uint16_t create_cq(const nvme::Sqe& sqe);
  uint16_t create_sq(const nvme::Sqe& sqe);
  uint16_t delete_sq(const nvme::Sqe& sqe, bool* deferred);
  uint16_t delete_cq(const nvme::Sqe& sqe);
  uint16_t device_memory(const nvme::Sqe& sqe, uint32_t* dw0, bool* deferred);
  // Maps a finished import; returns the status field of the C0h command and sets *dw0.
  uint16_t finish_import(uint32_t* dw0);
  // Waits for an import still running and closes what it opened (reset, teardown).
  void abandon_import();
  // Moves admin data to or from the command's PRPs.
  uint16_t admin_write(const nvme::Sqe& sqe, const void* data, size_t len);
  uint16_t admin_read(const nvme::Sqe& sqe, void* data, size_t len);
  const NamespaceView* find_ns(uint32_t nsid) const;
  uint32_t max_nsid() const;
  void destroy_sq(Sq& sq);
  void destroy_cq(Cq& cq);

  Controller& ctl_;
  DmaSpace& dma_;
  IrqSink& irq_;
  NvmeControllerConfig config_;
  NvmeStats stats_;

  // Doorbell page.
  UniqueFd db_fd_;
  void* db_map_ = nullptr;
  uint32_t* db_ = nullptr;                  // the doorbell page (BAR0 + 0x1000)
  UniqueFd wake_fd_;                        // eventfd: the doorbell page's ioeventfd
  std::atomic<bool> doorbell_wake_{false};  // handed out: keep the sleeping word
  bool waker_here_ = false;  // the last wake-up came from a host thread on this reactor's CPU

  // Registers.
  mutable std::mutex regs_mu_;
  uint32_t cc_ = 0;
  uint32_t aqa_ = 0;
  uint64_t asq_ = 0;
  uint64_t acq_ = 0;
  std::atomic<uint32_t> csts_{0};
  std::atomic<bool> cc_dirty_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> inflight_{0};
  // drop_queues_in's request to the reactor.
  std::mutex drop_mu_;
  std::condition_variable drop_cv_;
  const DmaMap* drop_map_ = nullptr;  // guarded by drop_mu_; null once done
  std::atomic<bool> drop_pending_{false};

  // Reactor-owned state.
  bool enabled_ = false;
  bool resetting_ = false;
  bool shutting_down_ = false;
  uint32_t css_ = 0;
  Sq sqs_[kMaxQueues];
  Cq cqs_[kMaxQueues];
  uint32_t admin_sq_size_ = 0;
  uint16_t nsqa_ = kMaxIoQueues;  // queues allocated (Set Features 07h), 1's based
  uint16_t ncqa_ = kMaxIoQueues;
  std::vector<uint16_t> aers_;  // outstanding Async Event Request command ids
  uint32_t features_[256] = {};
  Deferred deferred_ = Deferred::kNone;
  uint16_t deferred_cid_ = 0;
  uint16_t deferred_qid_ = 0;
  std::unique_ptr<DmaMap> dying_map_;  // device memory being unregistered
  std::unique_ptr<Import> import_;     // a device memory import in progress
  MapRefs admin_refs_;
  // Message-only memory.
  DmaChannel* channel_ = nullptr;
  std::mutex dma_mu_;
  std::vector<DmaXfer*> dma_done_;  // guarded by dma_mu_
  std::atomic<bool> dma_pending_{false};
  std::deque<IoCmd*> bounce_wait_;  // over the bounce budget, in fetch order
  uint64_t bounce_in_use_ = 0;
  uint8_t mdts_ = 1;
  uint64_t max_transfer_ = 0;  // bytes: 2^MDTS pages
};

}  // namespace gdkv::vfio_user
