// Loud errors for host-side CUDA calls (never used on a request path).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace gdkv::gpu {

// Throws std::runtime_error("<what>: <error name>: <error text>") unless e is cudaSuccess.
inline void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(e) + ": " +
                           cudaGetErrorString(e));
}

}  // namespace gdkv::gpu
