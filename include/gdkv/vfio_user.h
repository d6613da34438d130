// gdkv over vfio-user: the controller as an emulated PCI NVMe-KV device other processes and VMs
// attach to, and gdkv's own user-space NVMe driver for it.
//
// Server (gdkvd): VfioUserServer listens on <socket_dir>/cntrl. Every connection is its own NVMe
// controller (registers, admin queue, up to 31 I/O queue pairs) whose I/O commands run on the
// shared gdkv Controller, so many processes share one cache and one backend connection. Real
// clients attach too: SPDK's NVMe driver (trtype:VFIOUSER traddr:<socket_dir>) and QEMU's
// vfio-user-pci (docs/vfio-user.md). Each connection's peer is identified by SO_PEERCRED and sees
// only the namespaces its uid/gid is allowed; a namespace maps to a backend namespace of its own.
//
// Client: connect_vfio_user() is a user-space NVMe driver: it shares a memfd with the daemon as
// DMA memory, brings the controller up through its registers, creates an I/O queue pair in that
// memory with gdkv's counter doorbells (so many threads, or GPU threads, submit lock-free as with
// an in-process queue), and returns an ordinary gdkv::Client. Buffers passed to the synchronous
// Client calls are staged through the shared memory, and values of unknown length
// (Client::get_value, get_values) are received in it and read there; asynchronous callers put
// their buffers in memory from VfioUserDevice::alloc() and pass those pointers directly (DMA
// address = pointer).
//
// Thread safety: VfioUserServer's member functions are thread-safe. A VfioUserDevice may be used
// from many threads; its Clients are thread-safe as every Client.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gdkv/client.h"
#include "gdkv/controller.h"
#include "gdkv/metrics.h"
#include "gdkv/queue.h"
#include "gdkv/result.h"

namespace gdkv {

// ---- Server ------------------------------------------------------------------------------------

// The largest NVMe namespace ID gdkvd serves (and backend namespace it maps one to).
inline constexpr uint32_t kMaxNsid = 1024;

// One NVMe namespace of the device and who may use it.
struct VfioUserNamespace {
  uint32_t nsid = 1;               // the NVMe namespace ID clients see (1..kMaxNsid)
  uint32_t backend_namespace = 1;  // where its keys live: RADOS namespace "ns<N>", local index N
  std::string name;                // for logs and the namespace's NGUID
  // Peers allowed to see and use it: a matching uid, or a matching primary or supplementary gid.
  // Both empty: everyone who can open the socket.
  std::vector<uint32_t> uids;
  std::vector<uint32_t> gids;
  // Bytes its backend namespace may hold (0: no limit of its own): NamespaceQuotas (backend.h).
  uint64_t capacity_bytes = 0;
};

// Imports device (GPU) memory named by an IPC handle, for the vendor admin command C0h. gdkvd's
// CUDA builds provide one (cudaIpcOpenMemHandle); without it that command fails with 02h and
// completion DW0 = 1 ("not supported").
class DeviceMemoryImporter {
 public:
  virtual ~DeviceMemoryImporter() = default;
  // A device pointer the controller's copy engine can use for `size` bytes, or null. Runs on a
  // worker thread, not on a reactor (an open can take milliseconds): at most one open at a time
  // per connection, while that connection's I/O queues keep being served.
  virtual void* open(const uint8_t (&handle)[64], uint64_t size, std::string* why) = 0;
  virtual void close(void* ptr) = 0;
};

// The keys the store removed from one namespace after a subscriber's cursor: what the vendor log
// page C0h carries (docs/vfio-user.md), read by VfioUserDevice::removed and given to the server by
// VfioUserServerOptions::removals.
struct RemovedKeys {
  struct Entry {
    uint64_t seq;  // the removal's sequence number
    Key key;
  };
  uint64_t boot = 0;   // the removal log's life: a new one after a gdkvd restart voids a cursor
  uint64_t last = 0;   // the newest sequence number given, all namespaces (0: none yet)
  uint64_t first = 0;  // the oldest kept (last + 1 when none)
  uint64_t next = 0;   // the cursor to pass next (past the other namespaces' records too)
  bool lost = false;   // removals were missed: treat every key followed as possibly gone
  bool more = false;   // records after `next` remain: read again at once
  std::vector<Entry> records;  // oldest first
};

// The records of backend namespace `backend_nsid` after `after` (nullopt: none, the position
// only), at most `max`: RemovedKeys. Called on a reactor thread, so it must copy and return.
using RemovalSource =
    std::function<RemovedKeys(uint32_t backend_nsid, std::optional<uint64_t> after, size_t max)>;

struct VfioUserServerOptions {
  std::string socket_dir;       // required; the socket is <socket_dir>/cntrl (created if missing)
  uint32_t socket_mode = 0660;  // permissions of the socket file
  // Namespaces and tenants. Empty: nsid 1 = backend namespace 1, open to everyone. The same nsid
  // may appear in several entries (one per tenant): a peer sees the first entry it is allowed.
  std::vector<VfioUserNamespace> namespaces;
  uint32_t max_clients = 64;     // connections at once; more are closed at accept
  uint32_t max_dma_maps = 1024;  // DMA_MAP regions per connection
  // Accept DMA memory a client could shrink under gdkvd (memfds without F_SEAL_SHRINK, files on
  // hugetlbfs/tmpfs such as SPDK's): a hostile client could then crash gdkvd with SIGBUS. Off:
  // only shrink-sealed memfds (gdkv's client, QEMU memory-backend-memfd with seal=on).
  bool allow_unsealed_memory = false;
  uint16_t msix_vectors = 32;         // MSI-X vectors of the device
  uint32_t max_queue_entries = 4096;  // per queue (CAP.MQES + 1)
  uint16_t pci_vendor_id = 0x4e58;    // PCI IDs (see docs/vfio-user.md)
  uint16_t pci_device_id = 0x0001;
  std::string serial;  // Identify serial number; default: "gdkv-" + hostname
  DeviceMemoryImporter* device_memory = nullptr;  // not owned; null: no GPU memory registration
  // Memory a client maps without an fd is reached by DMA_READ/DMA_WRITE messages to the client
  // (slow: for hosts that cannot share some of their memory). A reply later than this fails the
  // command (04h); data in such memory is bounced through at most this many bytes per client.
  uint32_t dma_reply_timeout_ms = 10000;
  uint64_t message_bounce_bytes = uint64_t{256} << 20;
  // One line per connection event (accept, reject, disconnect, errors); default: stderr.
  std::function<void(const std::string&)> log;
  // Removed keys for the log page C0h, per namespace (gdkvd: its RemovalLog). Null: the page is
  // not served (Invalid Log Page) and the Identify vendor flag kVendorRemovalLog is clear.
  RemovalSource removals;
};

class VfioUserServer {
 public:
  // REQUIRES: `controller` outlives the server, and the server is stopped before the controller.
  VfioUserServer(Controller& controller, VfioUserServerOptions options);
  ~VfioUserServer();  // stop()
  VfioUserServer(const VfioUserServer&) = delete;
  VfioUserServer& operator=(const VfioUserServer&) = delete;

  // Checks the options, creates the socket and starts accepting. An Error (gdkv/result.h) with a
  // clear message on bad options (a namespace beyond the controller's), an unusable directory, or
  // another gdkvd serving it. The constructor only stores the options.
  Result<void> start();
  // Stops accepting, lets every client's in-flight commands finish (their completions are
  // posted), then closes every connection and removes the socket. Idempotent.
  void stop();

  std::string socket_path() const;
  size_t clients() const;
  // Appends server metrics (connections, messages, per-device NVMe counters).
  void collect(MetricList& out) const;

  struct Impl;

 private:
  void start_listening();  // start(), throwing
  std::unique_ptr<Impl> impl_;
};

// ---- Client driver -----------------------------------------------------------------------------

// A client's connection to gdkvd. Each field is a row of gdkv::client_settings() (gdkv/settings.h),
// so gdkv.connect, the CLI's --connect and the connectors take it by the same name and default.
struct VfioUserClientOptions {
  uint32_t queue_depth = 1024;  // I/O queue entries, a power of two in [2, 4096]
  // Bytes of memory shared with gdkvd (a sealed memfd): queues and staged buffers. Pages are only
  // committed when touched. Values larger than this cannot be staged.
  size_t shared_memory_bytes = size_t{1} << 30;
  uint32_t admin_queue_depth = 32;
  uint32_t admin_timeout_ms = 10000;  // controller enable/disable and admin commands
  // One I/O command, after which the Client fails for good (ClientFailure::kTimeout); 0 = no limit.
  // A gdkvd that exits or dies is noticed within ~10 ms whatever this is.
  uint32_t timeout_ms = 5000;
  // Wake-ups, used when gdkvd offers them (docs/vfio-user.md "Wake-ups"): a doorbell that finds
  // the reactor asleep signals its ioeventfd, and a waiting Client spins for wait_spin_us (not
  // when it just woke the reactor), then blocks on its queue's completion interrupt (an
  // eventfd). Off: the reactor notices work within its sleep timeout (5 ms) and a waiting Client
  // yields in a loop.
  bool wakeups = true;
  uint32_t wait_spin_us = 10;
};

// An open connection to a gdkvd: its controller, shared memory and admin queue.
class VfioUserDevice : public std::enable_shared_from_this<VfioUserDevice> {
 public:
  // Connects to <socket_dir>/cntrl and brings the controller up. An Error (gdkv/result.h) with a
  // clear message: no daemon, a refused connection, a controller that does not become ready.
  static Result<std::shared_ptr<VfioUserDevice>> open(const std::string& socket_dir,
                                                      const VfioUserClientOptions& options = {});
  virtual ~VfioUserDevice() = default;

  // A Client on a new I/O queue pair (depth 0: the options' depth). An Error when the controller
  // refuses the queue (31 pairs per connection at most) or the connection has failed.
  virtual Result<std::unique_ptr<Client>> make_client(uint32_t depth = 0) = 0;

  // Memory in the shared region: usable directly as data buffers of asynchronous commands.
  // Null when exhausted. free() takes what alloc() returned.
  virtual void* alloc(size_t bytes, size_t align = 64) = 0;
  virtual void free(void* p) = 0;
  // True when [p, p + len) lies inside the shared region or inside memory shared in place with
  // share() (a buffer gdkvd reaches in place).
  virtual bool contains(const void* p, size_t len) const = 0;
  // Memory this process already has (an engine's KV pool: malloc, numpy, torch), shared with
  // gdkvd where it lies, so commands read and write it in place instead of staging it: the pages
  // covering [p, p + len) are moved onto a sealed memfd at the same addresses, contents kept,
  // and DMA_MAPped (docs/vfio-user.md "Memory shared in place"). Only private anonymous
  // read-write memory (or shared anonymous memory no other process maps) can be; memory already
  // reachable is a success that changes nothing. Each share() is undone by one unshare() of the
  // same pointer; shares may overlap (a buffer inside another, two buffers with a page in
  // common), and pages already shared stay where they are. Writes to the range by other threads
  // during share() are lost, and the memory must stay allocated until unshare() (or this
  // device's end). An Error: not mapped, not anonymous memory, gdkvd refusing the map (too many
  // maps).
  virtual Result<void> share(const void* p, size_t len) = 0;
  // Undoes one share(p, ...): after the last, gdkvd unmaps it (once commands using it have
  // completed) and buffers there are staged again; the memory stays valid for the process.
  // An Error if p was not shared.
  virtual Result<void> unshare(const void* p) = 0;

  // Active namespace IDs (Identify CNS 02h): the namespaces this peer may use.
  virtual std::vector<uint32_t> namespaces() = 0;
  // Runs one admin command; `data` (len bytes) is staged through shared memory both ways.
  virtual CmdResult admin(nvme::Sqe sqe, void* data = nullptr, size_t len = 0) = 0;
  // Device memory (GPU) joins this connection's DMA space at `iova` (use the allocation's device
  // pointer): `ipc_handle` is the 64-byte cudaIpcMemHandle_t of the allocation.
  virtual CmdResult register_device_memory(const void* ipc_handle, uint64_t iova,
                                           uint64_t size) = 0;
  virtual CmdResult unregister_device_memory(uint64_t iova, uint64_t size) = 0;
  // The keys gdkvd's store removed from namespace `nsid` after the cursor `after` (nullopt: no
  // records, the position to start from), at most `max_records` (1..4096): log page C0h.
  // 0Bh (invalid namespace) for a namespace this peer may not use; 02h for a bad `max_records`;
  // 09h (command specific) from a gdkvd that keeps no removal log.
  virtual CmdResult removed(uint32_t nsid, std::optional<uint64_t> after, RemovedKeys* out,
                            uint32_t max_records = 4096) = 0;
  // Whether the daemon offers device memory registration (Identify vendor flags).
  virtual bool device_memory_supported() const = 0;
  // Whether this connection signals gdkvd's doorbell ioeventfd, and whether its Clients block on
  // completion interrupts (both need VfioUserClientOptions::wakeups and a gdkvd that offers them).
  virtual bool doorbell_wakeups() const = 0;
  virtual bool completion_wakeups() const = 0;
};

// Moves the pages covering [p, p + len) onto memory gdkvd can map (a sealed memfd, at the same
// addresses, contents kept), with no connection needed: every later VfioUserDevice::share of
// that memory, by any connection (one opened after a gdkvd restart too), then copies nothing and
// loses nothing other threads write. Call it once, before the memory is in use (an engine's KV
// pool at registration): writes by other threads during this call are lost. The same rules and
// Errors as share(); the memfd is kept while the pages stay mapped.
Result<void> prepare_shared_memory(const void* p, size_t len);

// A Client on a running gdkvd: VfioUserDevice::open(socket_dir, options), then make_client().
Result<std::unique_ptr<Client>> connect_vfio_user(const std::string& socket_dir,
                                                  const VfioUserClientOptions& options = {});

}  // namespace gdkv
