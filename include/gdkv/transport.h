// The transport interfaces: what a transport (an in-process queue pair, gdkvd's vfio-user NVMe
// queues) hands the controller and what the controller calls back. A transport turns SQEs into
// Commands with an AddressSpace for their data pointers, is polled by a reactor as a Poller, and
// posts the CQE when the Command completes (Controller::execute and add_poller, controller.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "gdkv/copy_engine.h"
#include "gdkv/nvme_kv.h"

namespace gdkv {

// A contiguous piece of a command's data buffer, resolved to memory the controller can reach.
struct DataSegment {
  std::byte* addr = nullptr;
  size_t len = 0;
  MemKind kind = MemKind::kHost;
  uint64_t region = 0;  // the registered region it lies in (CopySegment::dst_region); 0: none
};
using DataSegments = std::vector<DataSegment>;

// Resolves data pointers of one requester into memory, checking that every byte lies inside
// memory that requester may use. `for_write` = the controller writes there (Retrieve, List).
class AddressSpace {
 public:
  virtual ~AddressSpace() = default;
  // The data pointer of `sqe` (PRP or SGL), `len` bytes.
  virtual nvme::Status map_data(const nvme::Sqe& sqe, size_t len, bool for_write,
                                DataSegments& out) = 0;
  // A plain address range (scatter entries).
  virtual nvme::Status map_range(uint64_t addr, size_t len, bool for_write, DataSegments& out) = 0;
};

// Per-command controller state (opaque to transports).
struct CommandState;

// One command as a transport hands it to the controller.
struct Command {
  nvme::Sqe sqe{};
  AddressSpace* space = nullptr;
  uint32_t stream = 0;  // the queue it came from
  // Called on the owning reactor when the command is finished; the transport posts the CQE.
  void (*complete)(Command* cmd, nvme::Status status, uint32_t dw0) = nullptr;
  void* transport = nullptr;
  std::unique_ptr<CommandState> state;  // created by the controller on first use
  Command();
  ~Command();
};

// Something a reactor polls: returns true if it did work.
class Poller {
 public:
  virtual ~Poller() = default;
  virtual bool poll() = 0;
  // Sleeping reactors. A poller whose requesters can wake a sleeping reactor from another process
  // gives a non-blocking eventfd they signal (the reactor waits on it and reads it; -1: none, the
  // reactor then notices its work within its sleep timeout). Fixed while the poller is on a
  // reactor.
  virtual int wake_fd() const { return -1; }
  // Called on the reactor thread: true just before the reactor's last look before it sleeps (the
  // poller tells its requesters to signal wake_fd() from now on), false once it woke.
  virtual void announce_sleep(bool sleeping) { (void)sleeping; }
  // Called on the reactor thread when wake_fd() woke it (for counters).
  virtual void woken_by_fd() {}
};

// Called by a Poller on its reactor's thread when it just woke a requester blocked waiting for a
// completion: if the reactor then finds no work it sleeps at once instead of spinning, so that
// requester gets a core it may share with the reactor. No effect on other threads.
void hint_requester_woken() noexcept;

}  // namespace gdkv
