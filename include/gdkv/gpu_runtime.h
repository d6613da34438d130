// The GPU runtime: what a process needs so that its kernels can send NVMe-KV commands to an
// in-process gdkv controller (device API: gdkv/device.cuh).
//
//   auto ctl = gdkv::Controller(backend, gdkv::gpu::controller_options());  // pinned queues,
//                                                                           // CUDA copy engines
//   gdkv::gpu::DeviceQueue q(ctl);               // a queue pair kernels can use
//   gdkv::gpu::Registration r(ctl, buf, bytes, gdkv::MemKind::kDevice);  // cudaMalloc'd buffer
//   kernel<<<...>>>(q.ref(), ...);                // QueueRef by value, device pointers only
//
// Memory placement (see docs/gpu.md): the SQ, CQ and doorbells live in mapped pinned host memory,
// because the controller (a CPU thread) polls the doorbells and writes the CQ. The requesters'
// bookkeeping (credits, command ids, SQ tickets, per-command result slots) lives in device memory
// by default: GPU threads update it with atomics, which PCIe does not carry to host memory on most
// x86 machines (cudaDevAttrHostNativeAtomicSupported = 0). The controller never touches that part.
//
// Errors: functions throw std::runtime_error naming the failing CUDA call; nothing here is on a
// request path. Thread safety: free functions are thread-safe; objects are not shared.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "gdkv/cache.h"
#include "gdkv/controller.h"
#include "gdkv/copy_engine.h"
#include "gdkv/queue.h"

namespace gdkv::gpu {

struct GpuOptions {
  int device = 0;  // CUDA device ordinal the copy engines and queues use
  // Per copy engine: a pinned bounce buffer (bytes, default 32 MiB) for copies between device
  // memory and pageable host memory (a Store into a pageable staging vector, a value served from
  // the heap). Copies to or from pinned memory go straight through without it.
  size_t bounce_bytes = size_t{32} << 20;
};

// CUDA devices usable by this process: 0 without a driver or a GPU. Never throws.
int device_count() noexcept;
// "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)".
std::string device_description(int device);

// Options for a controller serving GPU requesters: queue memory in mapped pinned host memory, a
// CUDA copy engine per reactor, and reactors that never sleep (a GPU thread cannot wake one).
ControllerOptions controller_options(ControllerOptions base = {}, const GpuOptions& gpu = {});

// Pinned staging allocations made by controllers of controller_options(), all of them together:
// one per reactor (its staging pool), never one per command. For tests.
uint64_t staging_allocations() noexcept;

// Cache options whose slab pages are pinned host memory (mapped, portable), so the copy engine
// DMAs cached values straight to GPU memory.
CacheOptions cache_options(CacheOptions base = {});

// The CUDA copy engine: cudaMemcpyAsync on its own stream, completion by polling an event.
std::unique_ptr<CopyEngine> make_cuda_copy_engine(const GpuOptions& gpu = {});
// cudaPointerGetAttributes calls made by CUDA copy engines, all of them together: once per region
// a segment names (registered memory, staging pools), once per segment end in no region. For
// tests.
uint64_t pointer_attribute_queries() noexcept;

// Zeroed, mapped, pinned host memory (cudaHostAlloc, mapped and portable), aligned to 4096.
// Returns null on failure.
void* alloc_mapped(size_t bytes) noexcept;
void free_mapped(void* p) noexcept;
// The device-side address of mapped host memory (cudaHostGetDevicePointer); throws if unmapped.
void* device_pointer(void* host);

// Where the requesters' bookkeeping of a DeviceQueue lives.
enum class ControlPlacement : uint8_t {
  kDevice,      // device memory: only GPU threads may use the queue (the default)
  kHostMapped,  // the controller's block: CPU and GPU threads may share the queue; needs a link
                // with native host atomics (NVLink-C2C); refused otherwise
};

struct DeviceQueueOptions {
  QueueOptions queue = {256, true};  // depth 256, strict regions: only registered memory
  ControlPlacement control = ControlPlacement::kDevice;
  int device = 0;
};

// A queue pair of `controller` for kernels. REQUIRES: the controller's options came from
// controller_options() (queue memory must be mapped pinned host memory).
class DeviceQueue {
 public:
  explicit DeviceQueue(Controller& controller, const DeviceQueueOptions& options = {});
  ~DeviceQueue();  // REQUIRES: no command of this queue in flight (kernels finished)
  DeviceQueue(const DeviceQueue&) = delete;
  DeviceQueue& operator=(const DeviceQueue&) = delete;

  // For kernels: device pointers only, wake = null.
  const QueueRef& ref() const noexcept { return device_ref_; }
  // As the controller sees it (host pointers).
  const QueueRef& host_ref() const noexcept { return host_ref_; }

 private:
  Controller& controller_;
  QueueRef host_ref_;
  QueueRef device_ref_;
  void* control_ = nullptr;  // device memory holding the bookkeeping (ControlPlacement::kDevice)
};

// Registers [addr, addr + len) with the controller for as long as it lives. Throws
// std::runtime_error on overlap, or if kind = kDevice and the pointer is not device memory.
class Registration {
 public:
  Registration(Controller& controller, const void* addr, size_t len, MemKind kind);
  ~Registration();
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

 private:
  Controller& controller_;
  const void* addr_;
};

}  // namespace gdkv::gpu
