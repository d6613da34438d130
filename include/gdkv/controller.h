// The controller: polled reactors that serve NVMe-KV commands from queue pairs.
//
// N reactor threads each poll the queue pairs assigned to them (run to completion, never blocking:
// a command whose backend work is pending is parked until the backend calls back, and the backend's
// completion is routed to the reactor that owns the command). Each command is validated (opcode,
// namespace, key length, value size, data pointer) before any data moves; bad input gets an NVMe
// status, never a crash. Value bytes move through the reactor's CopyEngine.
//
// Transports plug in below the command layer (gdkv/transport.h): an in-process queue pair
// (create_queue) and the vfio-user NVMe queues of gdkvd are both Pollers that turn SQEs into
// Commands and post CQEs.
//
// Thread safety: all public member functions are thread-safe. Poller::poll and the Command
// callbacks run on the owning reactor thread only.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/copy_engine.h"
#include "gdkv/histogram.h"
#include "gdkv/metrics.h"
#include "gdkv/nvme_kv.h"
#include "gdkv/queue.h"
#include "gdkv/result.h"
#include "gdkv/transport.h"

namespace gdkv {

struct ControllerOptions {
  uint32_t reactors = 1;    // reactor threads
  uint32_t namespaces = 1;  // NVMe namespaces 1..N
  // Bytes; larger Stores get 85h. Lowered to the backend's own limit (BackendInfo) if smaller:
  // options() then reports the limit in force.
  uint64_t max_value_bytes = uint64_t{64} << 20;
  uint32_t idle_spin_us = 200;    // µs a reactor spins with no work before it sleeps (0 = never)
  bool never_sleep = false;       // keep spinning (GPU requesters cannot wake a reactor)
  CopyEngineFactory copy_engine;  // default: host memcpy
  // Allocates zeroed queue-pair memory (size, alignment 4096) and frees it; default: host heap.
  // The GPU runtime passes mapped pinned memory here.
  std::function<void*(size_t)> queue_alloc;
  std::function<void(void*)> queue_free;
  // Controller-owned staging buffers (values staged from device memory, List results, key lists,
  // scatter descriptors). Set: each reactor allocates one pool of staging_pool_bytes with it when
  // the controller starts (and frees it at the end), and commands stage in blocks of that pool,
  // so no command allocates. A buffer the pool cannot give (larger than the pool, or the pool
  // is in use) comes from the heap. The GPU runtime passes pinned memory so a copy to or from GPU
  // memory is one DMA. Unset: every staging buffer comes from the heap.
  std::function<void*(size_t bytes)> staging_alloc;
  std::function<void(void* p, size_t bytes)> staging_free;
  size_t staging_pool_bytes = size_t{128} << 20;  // per reactor; rounded up to a power of two
  // Measures a copy engine's peak bandwidth (bytes/s) once at start, for the
  // dma_link_peak_bytes_per_second and dma_link_utilization gauges. Unset: not measured (tests
  // start many controllers). gdkvd passes measure_copy_peak_bps (metrics_server.h).
  std::function<double(CopyEngine&)> measure_dma_peak;
};

class Reactor;

// An in-process queue pair created by Controller::create_queue.
struct QueueOptions {
  uint32_t depth = 256;  // power of two in [2, 4096]
  // Only accept data pointers inside registered memory (register_memory). Off: any host address
  // is taken as valid (same address space) and registered regions still give memory its kind.
  bool strict_regions = false;
};

class Controller {
 public:
  // REQUIRES: backend is not null (a null one throws std::invalid_argument).
  Controller(std::shared_ptr<Backend> backend, ControllerOptions options = {});
  ~Controller();  // finishes in-flight commands, then stops the reactors
  Controller(const Controller&) = delete;
  Controller& operator=(const Controller&) = delete;

  // Creates an in-process queue pair served by one reactor (round robin); an Error on a bad
  // depth or when its memory cannot be allocated.
  Result<QueueRef> create_queue(const QueueOptions& options = {});
  // Stops serving the queue pair and frees its memory. REQUIRES: no command of it is in flight.
  void destroy_queue(const QueueRef& q);

  // Registers memory that data pointers may name (host or device). Returns false on overlap.
  bool register_memory(const void* addr, size_t len, MemKind kind);
  bool unregister_memory(const void* addr);

  // Transport API: runs `p` on reactor (index % reactors) until remove_poller returns.
  void add_poller(uint32_t reactor, Poller* p);
  void remove_poller(Poller* p);
  // Starts executing a command. Call only from the reactor thread running the caller's Poller.
  void execute(Command* cmd);

  Backend& backend() { return *backend_; }
  const ControllerOptions& options() const { return options_; }
  uint32_t reactor_count() const;
  // Commands accepted and not yet completed, over all reactors.
  uint64_t in_flight() const;
  // Appends controller, reactor and backend metrics.
  void collect(MetricList& out) const;
  // Merged latency histogram of all reactors (ns, fetch to completion).
  Histogram latency() const;

  // Stops fetching new commands, waits for in-flight ones and drains the backend.
  void stop();

  struct Impl;

 private:
  std::shared_ptr<Backend> backend_;
  ControllerOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gdkv
