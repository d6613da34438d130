// One client's device: what a vfio-user connection talks to, independent of the socket.
//
// handle() takes one decoded message and returns the reply to send (or none for NO_REPLY
// messages): every payload is length-checked before it is read, unexpected descriptors are
// closed, and any malformed request gets an error reply with an errno, never a crash. The
// session owns the client's DMA space, PCI config space, MSI-X eventfds and NVMe controller (a
// Poller on one reactor of the shared Controller).
//
// Message-only DMA memory: the controller asks for DMA_READ/DMA_WRITE transfers (submit(), on the
// reactor); the connection's thread sends them (dma_pump()) as messages of at most
// max_data_xfer_size bytes and hands each reply to its transfer (handle()). Several requests may
// be outstanding (replies matched by id, in any order) while they and their replies together stay
// within kDmaWindowBytes, far below a socket buffer, so neither side can block writing while the
// other does; a larger message goes out alone. A transfer fails (the command completes with 04h) on
// an error reply, a malformed or late reply, a range unmapped before it was sent, or a disconnect.
// While the connection's thread waits for commands (DMA_UNMAP of memory in use, DEVICE_RESET,
// teardown) it cannot read replies, so transfers are failed for that time instead of waited for.
//
// Thread safety: handle() and dma_pump() are called by one thread (the connection's). signal()
// and submit() are called by the reactor. The destructor stops the controller, waits for the
// client's in-flight commands, then unmaps its memory.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "gdkv/controller.h"
#include "vfio_user/dma_space.h"
#include "vfio_user/nvme_ctrl.h"
#include "vfio_user/pci_config.h"
#include "vfio_user/protocol.h"
#include "vfio_user/socket_io.h"

namespace gdkv::vfio_user {

// Outstanding DMA_READ/DMA_WRITE requests and their replies, in bytes (headers included), and in
// number; one request larger than that may be outstanding alone.
inline constexpr uint64_t kDmaWindowBytes = 64 << 10;
inline constexpr size_t kDmaWindowRequests = 16;

struct SessionConfig {
  NvmeControllerConfig nvme;
  DmaSpaceOptions dma;
  uint32_t reset_timeout_ms = 30000;      // DEVICE_RESET waits this long for the controller
  uint32_t dma_reply_timeout_ms = 10000;  // a DMA_READ/DMA_WRITE reply later than this fails
};

struct Reply {
  bool send = false;  // false: NO_REPLY request
  Header hdr{};
  std::vector<std::byte> payload;
  std::vector<int> fds;      // borrowed: sent, not closed
  bool close_after = false;  // the connection cannot continue (version mismatch)
  std::string why;           // for an error reply: what was wrong, for the operator's log
};

// Counters of one session (relaxed).
struct SessionStats {
  std::atomic<uint64_t> messages{0};
  std::atomic<uint64_t> errors{0};        // error replies
  std::atomic<uint64_t> dma_messages{0};  // DMA_READ/DMA_WRITE requests sent
  std::atomic<uint64_t> dma_bytes{0};     // bytes they moved
  std::atomic<uint64_t> dma_failures{0};  // transfers failed
};

class DeviceSession final : public IrqSink, public DmaChannel {
 public:
  // Creates the device and registers its controller's poller on reactor config.nvme.reactor.
  DeviceSession(Controller& ctl, SessionConfig config);
  ~DeviceSession() override;
  DeviceSession(const DeviceSession&) = delete;
  DeviceSession& operator=(const DeviceSession&) = delete;

  Reply handle(Message& m);

  // IrqSink (reactor thread).
  void signal(uint16_t vector) override;
  // DmaChannel (reactor thread).
  void submit(DmaXfer* x) override;

  // Readable when transfers wait to be sent; the connection's thread then calls dma_pump(), and
  // also every few milliseconds (reply timeouts).
  int dma_wake_fd() const { return dma_wake_.get(); }
  // Sends the next request if none is outstanding; fails an overdue one. `send` writes a message
  // to the client (false: the socket failed).
  void dma_pump(const std::function<bool(const Header&, std::span<const std::byte>)>& send);

  // Stops fetching, removes the poller and waits for in-flight commands (idempotent).
  void quiesce();

  NvmeController& nvme() { return *nvme_; }
  DmaSpace& dma() { return dma_; }
  const SessionStats& stats() const { return stats_; }
  bool negotiated() const { return negotiated_; }

 private:
  int on_version(const Message& m, Reply& r);
  int on_dma_map(Message& m);
  int on_dma_unmap(Message& m, Reply& r);
  int on_device_info(const Message& m, Reply& r);
  int on_region_info(const Message& m, Reply& r);
  int on_region_io_fds(const Message& m, Reply& r);
  int on_irq_info(const Message& m, Reply& r);
  int on_set_irqs(Message& m);
  uint32_t irq_count(uint32_t index) const;
  UniqueFd& irq_fd(uint32_t index, uint32_t i);  // REQUIRES: irq_mu_ held, i < irq_count(index)
  int on_region_read(const Message& m, Reply& r);
  int on_region_write(const Message& m, Reply& r);
  int on_write_multi(const Message& m, Reply& r);
  int on_reset();
  void dma_reply(const Message& m);
  // Reports a started or queued transfer done; a failed one's outstanding requests are dropped
  // (their replies, if they come, are ignored).
  void dma_finish(DmaXfer* x, bool ok);
  // Hands a transfer's outcome to the controller (any thread: no session-thread state).
  void dma_report(DmaXfer* x, bool ok);
  // Fails every queued and outstanding transfer; while `refuse`, new ones fail at once.
  void dma_refuse(bool refuse);
  // Destroys a detached map once no command uses it, failing transfers meanwhile.
  void release_map(std::unique_ptr<DmaMap> m);
  int region_access(uint32_t region, uint64_t offset, std::span<std::byte> read,
                    std::span<const std::byte> write);

  Controller& ctl_;
  SessionConfig config_;
  SessionStats stats_;
  DmaSpace dma_;
  PciConfig pci_;
  std::vector<uint8_t> msix_table_;  // BAR4 [0, 0x1000): the host's MSI-X table entries
  std::mutex irq_mu_;
  std::vector<UniqueFd> msix_;  // eventfd per vector
  UniqueFd err_irq_;            // the ERR interrupt's eventfd (kept, never signalled)
  std::string refusal_;         // why the message being handled is refused (Reply::why)
  std::unique_ptr<NvmeController> nvme_;
  bool registered_ = false;
  bool negotiated_ = false;

  // Transfers of message-only memory.
  std::mutex dma_mu_;
  std::deque<DmaXfer*> dma_queue_;  // submitted, not started (guarded by dma_mu_)
  bool dma_refusing_ = false;       // guarded by dma_mu_
  UniqueFd dma_wake_;               // eventfd
  // The connection's thread only:
  struct DmaActive {  // a transfer being sent
    DmaXfer* x;
    uint64_t sent = 0;   // bytes requested so far
    uint64_t acked = 0;  // bytes whose reply came
  };
  struct DmaRequest {  // a request awaiting its reply
    DmaXfer* x;
    uint64_t offset;
    uint32_t len;
    std::chrono::steady_clock::time_point deadline;
  };
  std::deque<DmaActive> dma_active_;
  std::map<uint16_t, DmaRequest> dma_out_;  // by message id
  uint64_t dma_out_bytes_ = 0;              // of dma_out_ and their replies
  uint16_t next_msg_id_ = 0;
  uint32_t dma_chunk_ = kMaxDataXfer;  // max_data_xfer_size agreed at VERSION
};

}  // namespace gdkv::vfio_user
