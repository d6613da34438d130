// Portability layer for code shared by CPU threads and GPU threads.
//
// GDKV_HD marks a function callable from host and device code under nvcc or hipcc and expands to
// nothing under a plain C++ compiler, so the same header is unit-tested on the CPU. The atomic
// helpers act on plain integers in memory that several agents share (CPU threads, GPU threads,
// the controller); on the GPU they use system scope because queue memory may sit in mapped host
// memory. All are sequentially consistent unless the name says otherwise.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define GDKV_HD __host__ __device__
#else
#define GDKV_HD
#endif

#if defined(__CUDA_ARCH__)
#include <cuda/atomic>
#endif

namespace gdkv::atomic {

#if defined(__CUDA_ARCH__)
template <class T>
using Ref = cuda::atomic_ref<T, cuda::thread_scope_system>;

template <class T>
__device__ inline T load(const T* p) noexcept {
  return Ref<T>(*const_cast<T*>(p)).load(cuda::memory_order_acquire);
}
template <class T>
__device__ inline void store(T* p, T v) noexcept {
  Ref<T>(*p).store(v, cuda::memory_order_release);
}
template <class T>
__device__ inline T fetch_add(T* p, T v) noexcept {
  return Ref<T>(*p).fetch_add(v);
}
template <class T>
__device__ inline T fetch_or(T* p, T v) noexcept {
  return Ref<T>(*p).fetch_or(v);
}
template <class T>
__device__ inline T fetch_and(T* p, T v) noexcept {
  return Ref<T>(*p).fetch_and(v);
}
template <class T>
__device__ inline bool cas(T* p, T& expected, T desired) noexcept {
  return Ref<T>(*p).compare_exchange_strong(expected, desired);
}
__device__ inline void pause() noexcept { __nanosleep(32); }
#else
// GCC/Clang builtins: host code, and HIP device code (clang supports them on AMDGPU).
template <class T>
GDKV_HD inline T load(const T* p) noexcept {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
template <class T>
GDKV_HD inline void store(T* p, T v) noexcept {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
template <class T>
GDKV_HD inline T fetch_add(T* p, T v) noexcept {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
template <class T>
GDKV_HD inline T fetch_or(T* p, T v) noexcept {
  return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);
}
template <class T>
GDKV_HD inline T fetch_and(T* p, T v) noexcept {
  return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST);
}
template <class T>
GDKV_HD inline bool cas(T* p, T& expected, T desired) noexcept {
  return __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST,
                                     __ATOMIC_SEQ_CST);
}
GDKV_HD inline void pause() noexcept {
#if defined(__x86_64__) && !defined(__HIP_DEVICE_COMPILE__)
  __builtin_ia32_pause();
#endif
}
#endif

// Full fence between the stores to queue memory and the doorbell.
GDKV_HD inline void fence() noexcept {
#if defined(__CUDA_ARCH__)
  __threadfence_system();
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

}  // namespace gdkv::atomic
