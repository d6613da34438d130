// Definitions for device.cuh: the warp as a lane group, and the warp-cooperative requests.
// Included by device.cuh under nvcc or hipcc only.
#pragma once

#include <cstdint>

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
#endif

#include "gdkv/key.h"
#include "gdkv/nvme_kv.h"
#include "gdkv/queue.h"

namespace gdkv::device {
namespace detail {

// The lanes of a warp (CUDA: 32) or wavefront (HIP: 32 or 64) active where it is constructed.
class Warp {
 public:
#if defined(__CUDA_ARCH__) || !defined(__HIP_PLATFORM_AMD__)
  __device__ Warp() noexcept : mask_(__activemask()) {}
  __device__ uint64_t mask() const noexcept { return mask_; }
  __device__ uint32_t lane() const noexcept {
    uint32_t id;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(id));
    return id;
  }
  __device__ uint64_t ballot(bool p) const noexcept {
    return __ballot_sync(static_cast<uint32_t>(mask_), p);
  }
  __device__ uint32_t shfl(uint32_t v, uint32_t src_lane) const noexcept {
    return __shfl_sync(static_cast<uint32_t>(mask_), v, static_cast<int>(src_lane));
  }
  __device__ void sync() const noexcept { __syncwarp(static_cast<uint32_t>(mask_)); }
#else
  // AMD wavefronts run in lockstep: a ballot of the active lanes is the mask, and lanes of a
  // wavefront see each other's stores after a wavefront-scope fence.
  __device__ Warp() noexcept : mask_(__ballot(1)) {}
  __device__ uint64_t mask() const noexcept { return mask_; }
  __device__ uint32_t lane() const noexcept { return __lane_id(); }
  __device__ uint64_t ballot(bool p) const noexcept { return __ballot(p); }
  __device__ uint32_t shfl(uint32_t v, uint32_t src_lane) const noexcept {
    return static_cast<uint32_t>(__shfl(static_cast<int>(v), static_cast<int>(src_lane)));
  }
  __device__ void sync() const noexcept {
    __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "wavefront");
    __builtin_amdgcn_wave_barrier();
  }
#endif

 private:
  uint64_t mask_;
};

}  // namespace detail

__device__ inline CmdResult warp_execute(const QueueRef& q, const nvme::Sqe& sqe,
                                         bool active) noexcept {
  return group_execute(detail::Warp(), q, sqe, active);
}

__device__ inline CmdResult warp_get(const QueueRef& q, const Key& key, void* dst, uint32_t len,
                                     bool active, uint32_t nsid) noexcept {
  return warp_execute(q, make_retrieve(key, dst, len, nsid), active);
}

__device__ inline CmdResult warp_put(const QueueRef& q, const Key& key, const void* src,
                                     uint32_t len, bool active, uint8_t options,
                                     uint32_t nsid) noexcept {
  return warp_execute(q, make_store(key, src, len, options, nsid), active);
}

__device__ inline CmdResult warp_exists(const QueueRef& q, const Key& key, bool active,
                                        uint32_t nsid) noexcept {
  return warp_execute(q, make_exist(key, nsid), active);
}

__device__ inline CmdResult warp_del(const QueueRef& q, const Key& key, bool active,
                                     uint32_t nsid) noexcept {
  return warp_execute(q, make_delete(key, nsid), active);
}

}  // namespace gdkv::device
