// One client's device: what a vfio-user connection talks to, independent of the socket.
//
// handle() takes one decoded message and returns the reply to send (or none for NO_REPLY
// messages): every payload is length-checked before it is read, unexpected descriptors are
// closed, and any malformed request gets an error reply with an errno, never a crash. The
// session owns the client's DMA space, PCI config space, MSI-X eventfds and NVMe controller (a
// Poller on one reactor of the shared Controller).
//
// Thread safety: handle() is called by one thread (the connection's). signal() is called by the
// reactor. The destructor stops the controller, waits for the client's in-flight commands, then
// unmaps its memory.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gdkv/controller.h"
#include "vfio_user/dma_space.h"
#include "vfio_user/nvme_ctrl.h"
#include "vfio_user/pci_config.h"
#include "vfio_user/protocol.h"
#include "vfio_user/socket_io.h"

namespace gdkv::vfio_user {

struct SessionConfig {
  NvmeControllerConfig nvme;
  DmaSpaceOptions dma;
  uint32_t reset_timeout_ms = 30000;  // DEVICE_RESET waits this long for the controller
};

struct Reply {
  bool send = false;  // false: NO_REPLY request
  Header hdr{};
  std::vector<std::byte> payload;
  std::vector<int> fds;      // borrowed: sent, not closed
  bool close_after = false;  // the connection cannot continue (version mismatch)
};

// Counters of one session (relaxed).
struct SessionStats {
  std::atomic<uint64_t> messages{0};
  std::atomic<uint64_t> errors{0};  // error replies
};

class DeviceSession final : public IrqSink {
 public:
  // Creates the device and registers its controller's poller on reactor config.nvme.reactor.
  DeviceSession(Controller& ctl, SessionConfig config);
  ~DeviceSession() override;
  DeviceSession(const DeviceSession&) = delete;
  DeviceSession& operator=(const DeviceSession&) = delete;

  Reply handle(Message& m);

  // IrqSink (reactor thread).
  void signal(uint16_t vector) override;

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
  int on_irq_info(const Message& m, Reply& r);
  int on_set_irqs(Message& m);
  int on_region_read(const Message& m, Reply& r);
  int on_region_write(const Message& m, Reply& r);
  int on_write_multi(const Message& m, Reply& r);
  int on_reset();
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
  std::unique_ptr<NvmeController> nvme_;
  bool registered_ = false;
  bool negotiated_ = false;
};

}  // namespace gdkv::vfio_user
