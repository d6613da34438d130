#include "gdkv/gpu_runtime.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include "gpu/cuda_check.h"
#include "gpu/split_queue.h"

namespace gdkv::gpu {

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for the caller
    return 0;
  }
  return n;
}

std::string device_description(int device) {
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties");
  char tail[96];
  std::snprintf(tail, sizeof(tail), " (sm_%d%d, %d SMs, %.1f GiB)", p.major, p.minor,
                p.multiProcessorCount, static_cast<double>(p.totalGlobalMem) / (1u << 30));
  return std::string(p.name) + tail;
}

void* alloc_mapped(size_t bytes) noexcept {
  void* p = nullptr;
  if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  std::memset(p, 0, bytes);
  return p;
}

void free_mapped(void* p) noexcept {
  if (p != nullptr) cudaFreeHost(p);
}

void* device_pointer(void* host) {
  void* d = nullptr;
  check(cudaHostGetDevicePointer(&d, host, 0), "cudaHostGetDevicePointer");
  return d;
}

namespace {
std::atomic<uint64_t> g_staging_allocations{0};
}  // namespace

uint64_t staging_allocations() noexcept {
  return g_staging_allocations.load(std::memory_order_relaxed);
}

ControllerOptions controller_options(ControllerOptions base, const GpuOptions& gpu) {
  base.never_sleep = true;
  base.queue_alloc = [](size_t bytes) { return alloc_mapped(bytes); };
  base.queue_free = [](void* p) { free_mapped(p); };
  // Pinned staging: a value staged from or to GPU memory moves in one DMA. Called once per
  // reactor, for its staging pool; never per command.
  base.staging_alloc = [](size_t bytes) {
    g_staging_allocations.fetch_add(1, std::memory_order_relaxed);
    return alloc_mapped(bytes);
  };
  base.staging_free = [](void* p, size_t) { free_mapped(p); };
  base.copy_engine = [gpu](uint32_t) { return make_cuda_copy_engine(gpu); };
  return base;
}

CacheOptions cache_options(CacheOptions base) {
  base.alloc = [](size_t bytes) { return alloc_mapped(bytes); };
  base.free = [](void* p, size_t) { free_mapped(p); };
  return base;
}

namespace {

int device_attribute(cudaDeviceAttr attr, int device) {
  int v = 0;
  check(cudaDeviceGetAttribute(&v, attr, device), "cudaDeviceGetAttribute");
  return v;
}

template <class T>
T* on_device(T* host) {
  return static_cast<T*>(device_pointer(host));
}

}  // namespace

DeviceQueue::DeviceQueue(Controller& controller, const DeviceQueueOptions& options)
    : controller_(controller) {
  const int dev = options.device;
  // Data pointers in SQEs are plain virtual addresses in this process: that needs UVA.
  if (device_attribute(cudaDevAttrUnifiedAddressing, dev) == 0) {
    throw std::runtime_error("gdkv GPU queues need unified virtual addressing");
  }
  if (device_attribute(cudaDevAttrCanMapHostMemory, dev) == 0) {
    throw std::runtime_error("gdkv GPU queues need a device that can map host memory");
  }
  if (options.control == ControlPlacement::kHostMapped &&
      device_attribute(cudaDevAttrHostNativeAtomicSupported, dev) == 0) {
    throw std::runtime_error(
        "queue bookkeeping in host memory needs native host atomics (e.g. NVLink-C2C); this "
        "link has none: use ControlPlacement::kDevice");
  }
  const uint32_t depth = options.queue.depth;
  if (!valid_queue_depth(depth)) {
    throw std::invalid_argument("queue depth must be a power of two in [2, 4096]");
  }
  if (options.control == ControlPlacement::kDevice) {
    const size_t bytes = control_bytes(depth);
    check(cudaSetDevice(dev), "cudaSetDevice");
    check(cudaMalloc(&control_, bytes), "cudaMalloc (queue bookkeeping)");
    if (cudaError_t e = cudaMemset(control_, 0, bytes); e != cudaSuccess) {
      cudaFree(control_);
      check(e, "cudaMemset (queue bookkeeping)");
    }
  }
  try {
    host_ref_ = controller_.create_queue(options.queue).value();
    QueueRef d = host_ref_;
    d.sq = on_device(host_ref_.sq);
    d.cq = on_device(host_ref_.cq);
    d.db = on_device(host_ref_.db);
    d.wake = nullptr;
    if (control_ != nullptr) {
      d = with_control(d, control_);
    } else {
      d.sq_seq = on_device(host_ref_.sq_seq);
      d.cid_bits = on_device(host_ref_.cid_bits);
      d.slots = on_device(host_ref_.slots);
      d.ctl = on_device(host_ref_.ctl);
    }
    device_ref_ = d;
  } catch (...) {
    controller_.destroy_queue(host_ref_);  // a no-op if create_queue threw
    if (control_ != nullptr) cudaFree(control_);
    throw;
  }
}

DeviceQueue::~DeviceQueue() {
  controller_.destroy_queue(host_ref_);
  if (control_ != nullptr) cudaFree(control_);
}

Registration::Registration(Controller& controller, const void* addr, size_t len, MemKind kind)
    : controller_(controller), addr_(addr) {
  if (kind == MemKind::kDevice) {
    cudaPointerAttributes a{};
    check(cudaPointerGetAttributes(&a, addr), "cudaPointerGetAttributes");
    if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) {
      throw std::runtime_error("registering device memory: the address is not device memory");
    }
  }
  if (!controller_.register_memory(addr, len, kind)) {
    throw std::runtime_error("registering memory: the range is empty or overlaps a registered one");
  }
}

Registration::~Registration() { controller_.unregister_memory(addr_); }

}  // namespace gdkv::gpu
