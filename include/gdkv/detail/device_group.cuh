// Definitions for device.cuh: the lane-group batch algorithm (group_execute). Included by
// device.cuh only. Group is a GPU warp (device_warp.cuh) or, in the CPU tests, a set of threads
// with the same five operations, so this exact code runs on both.
#pragma once

#include <cstdint>

#include "gdkv/nvme_kv.h"
#include "gdkv/platform.h"
#include "gdkv/queue.h"

namespace gdkv::device {
namespace detail {

GDKV_HD inline uint32_t popcount64(uint64_t v) noexcept {
#if defined(__CUDA_ARCH__)
  return static_cast<uint32_t>(__popcll(v));
#else
  return static_cast<uint32_t>(__builtin_popcountll(v));
#endif
}

// REQUIRES: v != 0.
GDKV_HD inline uint32_t lowest_bit(uint64_t v) noexcept {
#if defined(__CUDA_ARCH__)
  return static_cast<uint32_t>(__ffsll(static_cast<long long>(v)) - 1);
#else
  return static_cast<uint32_t>(__builtin_ctzll(v));
#endif
}

// Bits of `mask` below `lane`.
GDKV_HD inline uint64_t below(uint64_t mask, uint32_t lane) noexcept {
  return mask & ((uint64_t{1} << lane) - 1);
}

}  // namespace detail

template <class Group>
GDKV_HD inline CmdResult group_execute(const Group& g, const QueueRef& q, const nvme::Sqe& sqe,
                                       bool active) noexcept {
  CmdResult result{};
  bool pending = active;
  // Every lane runs the same number of rounds: the loop ends on a group-wide ballot.
  while (g.ballot(pending) != 0) {
    uint16_t cid = 0;
    const bool got = pending && queue::try_acquire(q, &cid);
    const uint64_t batch = g.ballot(got);
    if (batch != 0) {
      const uint32_t leader = detail::lowest_bit(batch);
      uint32_t first = 0;
      if (g.lane() == leader) first = queue::reserve_slots(q, detail::popcount64(batch));
      first = g.shfl(first, leader);
      if (got) {
        nvme::Sqe s = sqe;
        s.cid = cid;
        queue::write_slot(q, first + detail::popcount64(detail::below(batch, g.lane())), s);
      }
      // Every entry of the batch is written before the leader rings once for all of them.
      g.sync();
      if (g.lane() == leader) queue::publish(q);
    }
    if (got) {
      result = queue::wait(q, cid);
      pending = false;
    } else if (pending) {
      atomic::pause();  // queue full: the lanes that got credits free them as they complete
    }
  }
  return result;
}

}  // namespace gdkv::device
