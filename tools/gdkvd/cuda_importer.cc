// CUDA IPC device memory import (CUDA builds of gdkvd only).
#include "cuda_importer.h"

#include <cuda_runtime.h>

#include <cstring>
#include <string>

namespace gdkvd {

namespace {

// cuMemGetAddressRange, fetched through the runtime so gdkvd need not link libcuda directly.
using GetAddressRange = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);

class CudaImporter final : public gdkv::DeviceMemoryImporter {
 public:
  CudaImporter() {
    cudaGetDevice(&device_);
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                                           cudaEnableDefault, &found);
#else
    const cudaError_t e =
        cudaGetDriverEntryPoint("cuMemGetAddressRange", &fn, cudaEnableDefault, &found);
#endif
    if (e == cudaSuccess && found == cudaDriverEntryPointSuccess) {
      range_ = reinterpret_cast<GetAddressRange>(fn);
    }
  }

  void* open(const uint8_t (&handle)[64], uint64_t size, std::string* why) override {
    static_assert(sizeof(cudaIpcMemHandle_t) == 64, "CUDA IPC handles are 64 bytes");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle, sizeof(h));
    // open() runs on a thread of its own (not the reactor's): make the device gdkvd's copy
    // engines use current there, or the memory would be mapped for the default device.
    if (const cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
      *why = std::string("cudaSetDevice: ") + cudaGetErrorString(e);
      return nullptr;
    }
    void* p = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      *why = std::string("cudaIpcOpenMemHandle: ") + cudaGetErrorString(e);
      return nullptr;
    }
    // The handle names one allocation: the client may not claim more than it holds, or copies
    // would run past it in gdkvd's device address space.
    unsigned long long base = 0;
    size_t bytes = 0;
    if (range_ == nullptr || range_(&base, &bytes, reinterpret_cast<unsigned long long>(p)) != 0 ||
        size > bytes) {
      cudaIpcCloseMemHandle(p);
      *why = "the registered size exceeds the allocation behind the handle";
      return nullptr;
    }
    return p;
  }

  void close(void* p) override { cudaIpcCloseMemHandle(p); }

 private:
  GetAddressRange range_ = nullptr;
  int device_ = 0;  // current when gdkvd made the importer
};

}  // namespace

std::unique_ptr<gdkv::DeviceMemoryImporter> make_cuda_importer() {
  return std::make_unique<CudaImporter>();
}

}  // namespace gdkvd
