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

// Lanes of this thread's warp that exist: a block whose size is not a multiple of the warp size
// has a last warp with fewer lanes.
__device__ inline uint64_t existing_lanes() noexcept {
  const uint32_t in_block = blockDim.x * blockDim.y * blockDim.z;
  const uint32_t me = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const uint32_t size = static_cast<uint32_t>(warpSize);
  const uint32_t n = in_block - (me / size) * size;
  const uint32_t lanes = n < size ? n : size;
  return lanes >= 64 ? ~uint64_t{0} : (uint64_t{1} << lanes) - 1;
}

// The lanes of a warp (CUDA: 32) or wavefront (HIP: 32 or 64) named by a mask, formed explicitly:
// the lanes of the mask construct it together, and the constructor converges them. Lanes that are
// merely active at the same moment (__activemask) are not guaranteed to stay together, so the
// group never derives its members from the hardware's current state.
// REQUIRES: every lane of `lanes` (clipped to the lanes the warp has) constructs it with the same
// mask, and the calling lane is one of them.
class Warp {
 public:
#if defined(__CUDA_ARCH__) || !defined(__HIP_PLATFORM_AMD__)
  __device__ explicit Warp(uint64_t lanes) noexcept
      : mask_(static_cast<uint32_t>(lanes & existing_lanes())) {
    __syncwarp(mask_);
  }
  __device__ uint64_t mask() const noexcept { return mask_; }
  __device__ uint32_t lane() const noexcept {
    uint32_t id;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(id));
    return id;
  }
  __device__ uint64_t ballot(bool p) const noexcept { return __ballot_sync(mask_, p); }
  __device__ uint32_t shfl(uint32_t v, uint32_t src_lane) const noexcept {
    return __shfl_sync(mask_, v, static_cast<int>(src_lane));
  }
  __device__ void sync() const noexcept { __syncwarp(mask_); }

 private:
  uint32_t mask_;
#else
  // AMD wavefronts run their active lanes in lockstep, so the lanes of the mask that call together
  // are converged; a ballot is limited to the mask, and lanes of a wavefront see each other's
  // stores after a wavefront-scope fence.
  __device__ explicit Warp(uint64_t lanes) noexcept : mask_(lanes & existing_lanes()) { sync(); }
  __device__ uint64_t mask() const noexcept { return mask_; }
  __device__ uint32_t lane() const noexcept { return __lane_id(); }
  __device__ uint64_t ballot(bool p) const noexcept { return __ballot(p) & mask_; }
  __device__ uint32_t shfl(uint32_t v, uint32_t src_lane) const noexcept {
    return static_cast<uint32_t>(__shfl(static_cast<int>(v), static_cast<int>(src_lane)));
  }
  __device__ void sync() const noexcept {
    __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "wavefront");
    __builtin_amdgcn_wave_barrier();
  }

 private:
  uint64_t mask_;
#endif
};

}  // namespace detail

__device__ inline CmdResult warp_execute(const QueueRef& q, const nvme::Sqe& sqe, bool active,
                                         uint64_t lanes) noexcept {
  return group_execute(detail::Warp(lanes), q, sqe, active);
}

__device__ inline CmdResult warp_get(const QueueRef& q, const Key& key, void* dst, uint32_t len,
                                     bool active, uint32_t nsid, uint64_t lanes) noexcept {
  return warp_execute(q, make_retrieve(key, dst, len, nsid), active, lanes);
}

__device__ inline CmdResult warp_put(const QueueRef& q, const Key& key, const void* src,
                                     uint32_t len, bool active, uint8_t options, uint32_t nsid,
                                     uint64_t lanes) noexcept {
  return warp_execute(q, make_store(key, src, len, options, nsid), active, lanes);
}

__device__ inline CmdResult warp_exists(const QueueRef& q, const Key& key, bool active,
                                        uint32_t nsid, uint64_t lanes) noexcept {
  return warp_execute(q, make_exist(key, nsid), active, lanes);
}

__device__ inline CmdResult warp_del(const QueueRef& q, const Key& key, bool active, uint32_t nsid,
                                     uint64_t lanes) noexcept {
  return warp_execute(q, make_delete(key, nsid), active, lanes);
}

}  // namespace gdkv::device
