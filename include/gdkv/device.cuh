// The device API: GPU threads issue NVMe-KV commands to a gdkv controller.
//
// A kernel gets a QueueRef (queue.h) by value, made by the GPU runtime (gdkv/gpu_runtime.h) so that
// every pointer in it is a device-side pointer, and calls the functions below. They build one SQE
// per request and run it through queue.h's requester protocol, the same code CPU threads run:
// credits and command ids, SQ tickets, publish + doorbell, reaping completions by polling. Nothing
// here sleeps or calls the host; a request that finds the queue full spins until a credit is free.
//
// Data pointers are plain virtual addresses in the controller's process: device memory registered
// with Controller::register_memory(ptr, len, MemKind::kDevice), or host memory (pinned, mapped; on
// UVA systems its device pointer equals its host pointer). The controller checks every data
// pointer against registered memory before it moves a byte and fails the command otherwise.
//
// Results are CmdResult values: status (nvme::Status), status type and DW0 (Retrieve: the value's
// full length; a short buffer receives the first bytes and success). All functions are noexcept.
//
// Three levels, all usable from host code too (GDKV_HD), except the warp forms:
//   - per thread, blocking: get/put/exists/del/execute: one request, returns its result.
//   - per thread, split: try_submit/submit, then poll/wait: many requests in flight per thread.
//   - per warp: warp_get/warp_put/warp_exists/warp_del/warp_execute: the lanes of a mask (default:
//     the whole warp) call together and share one SQ ticket grab (reserve_slots(n)) and one
//     doorbell per batch, then each lane waits for its own completion. A lane with nothing to do
//     passes active = false.
//     group_execute is the same algorithm over any lane group (the CPU tests use a thread group).
//
// REQUIRES (all forms): a thread must not block for a credit (submit, execute, get, ...) while it
// holds command ids it has not waited for, if those could use up the queue's depth - 1 credits.
#pragma once

#include <cstdint>

#include "gdkv/key.h"
#include "gdkv/nvme_kv.h"
#include "gdkv/platform.h"
#include "gdkv/queue.h"

namespace gdkv::device {

// ---- Commands -----------------------------------------------------------------------------------
// SQEs for each opcode (cid is filled in on submission). `nsid` is the NVMe namespace (1-based).

// Retrieve: up to `len` bytes of the value into `dst`; DW0 of the result = the value's full length.
GDKV_HD inline nvme::Sqe make_retrieve(const Key& key, void* dst, uint32_t len,
                                       uint32_t nsid = 1) noexcept;
// Store: `len` bytes from `src`; options: nvme::kStoreMustExist / kStoreMustNotExist.
GDKV_HD inline nvme::Sqe make_store(const Key& key, const void* src, uint32_t len,
                                    uint8_t options = 0, uint32_t nsid = 1) noexcept;
GDKV_HD inline nvme::Sqe make_exist(const Key& key, uint32_t nsid = 1) noexcept;
GDKV_HD inline nvme::Sqe make_delete(const Key& key, uint32_t nsid = 1) noexcept;
// List: the keys equal to or after `start` (a 1-byte key 00h lists from the first key), into
// `dst` as a KeyListHeader and its entries; DW0 of the result = the number of keys returned.
GDKV_HD inline nvme::Sqe make_list(const Key& start, void* dst, uint32_t len,
                                   uint32_t nsid = 1) noexcept;
// Scatter Retrieve (vendor 82h): `list` holds an nvme::ScatterHeader and its ScatterEntry items
// (`list_bytes` in all), in memory the controller can read (registered host memory).
GDKV_HD inline nvme::Sqe make_scatter_retrieve(const Key& key, const void* list,
                                               uint32_t list_bytes, uint32_t nsid = 1) noexcept;
// Prefetch (vendor 81h): `list` holds a key list (List's layout), in registered host memory.
GDKV_HD inline nvme::Sqe make_prefetch(const void* list, uint32_t list_bytes,
                                       uint32_t nsid = 1) noexcept;

// ---- Per thread, split --------------------------------------------------------------------------
// Submits `sqe` if a credit is free: sets *cid and returns true; false when the queue is full.
GDKV_HD inline bool try_submit(const QueueRef& q, nvme::Sqe sqe, uint16_t* cid) noexcept;
// Submits `sqe`, spinning until a credit is free; returns its command id.
GDKV_HD inline uint16_t submit(const QueueRef& q, nvme::Sqe sqe) noexcept;
// True once command `cid` completed (then call wait() to take the result and free the id).
GDKV_HD inline bool poll(const QueueRef& q, uint16_t cid) noexcept;
// Spins until command `cid` completes, frees its id and returns its result.
GDKV_HD inline CmdResult wait(const QueueRef& q, uint16_t cid) noexcept;

// ---- Per thread, blocking -----------------------------------------------------------------------
GDKV_HD inline CmdResult execute(const QueueRef& q, const nvme::Sqe& sqe) noexcept;
GDKV_HD inline CmdResult get(const QueueRef& q, const Key& key, void* dst, uint32_t len,
                             uint32_t nsid = 1) noexcept;
GDKV_HD inline CmdResult put(const QueueRef& q, const Key& key, const void* src, uint32_t len,
                             uint8_t options = 0, uint32_t nsid = 1) noexcept;
// Success if the key exists, nvme::Status::kKeyNotExist if not.
GDKV_HD inline CmdResult exists(const QueueRef& q, const Key& key, uint32_t nsid = 1) noexcept;
GDKV_HD inline CmdResult del(const QueueRef& q, const Key& key, uint32_t nsid = 1) noexcept;

// ---- Per lane group -----------------------------------------------------------------------------
// A Group is a set of lanes that call group functions together (see detail/device_group.cuh):
//   uint64_t mask() const;              the participating lanes, one bit per lane
//   uint32_t lane() const;              this lane's index (its bit in mask())
//   uint64_t ballot(bool p) const;      lanes of mask() whose p is true
//   uint32_t shfl(uint32_t v, uint32_t src_lane) const;  v of lane src_lane
//   void sync() const;                  all lanes arrive; their memory writes are visible
// Every lane of the group runs `sqe` (active lanes only) as one batch per round: a round takes
// what credits it can get, one reserve_slots(n), each lane's write_slot, one publish. Lanes that
// got no credit retry in the next round. Returns this lane's result ({} for inactive lanes).
template <class Group>
GDKV_HD inline CmdResult group_execute(const Group& g, const QueueRef& q, const nvme::Sqe& sqe,
                                       bool active) noexcept;

}  // namespace gdkv::device

#include "gdkv/detail/device_commands.cuh"
#include "gdkv/detail/device_group.cuh"

#if defined(__CUDACC__) || defined(__HIPCC__)
namespace gdkv::device {

// ---- Per warp (device code only) ----------------------------------------------------------------
// Called together by the lanes named in `lanes` (one bit per lane of the warp; default: every lane
// the warp has). The group is formed from that mask, not from the lanes that happen to be active:
// the lanes are converged with __syncwarp(lanes) first, and the batch leader is the lowest lane of
// the mask that got a credit. Code in a divergent branch passes the branch's mask, e.g.
//   if (lane & 1) r = warp_get(q, k, dst, len, true, 1, 0xAAAAAAAA);  // the odd lanes only
// A lane of the mask with nothing to do passes active = false. One reserve_slots and one doorbell
// per round.
// REQUIRES: every lane of `lanes` calls, with the same mask; lanes outside it do not.
inline constexpr uint64_t kFullWarp = ~uint64_t{0};

__device__ inline CmdResult warp_execute(const QueueRef& q, const nvme::Sqe& sqe,
                                         bool active = true, uint64_t lanes = kFullWarp) noexcept;
__device__ inline CmdResult warp_get(const QueueRef& q, const Key& key, void* dst, uint32_t len,
                                     bool active = true, uint32_t nsid = 1,
                                     uint64_t lanes = kFullWarp) noexcept;
__device__ inline CmdResult warp_put(const QueueRef& q, const Key& key, const void* src,
                                     uint32_t len, bool active = true, uint8_t options = 0,
                                     uint32_t nsid = 1, uint64_t lanes = kFullWarp) noexcept;
__device__ inline CmdResult warp_exists(const QueueRef& q, const Key& key, bool active = true,
                                        uint32_t nsid = 1, uint64_t lanes = kFullWarp) noexcept;
__device__ inline CmdResult warp_del(const QueueRef& q, const Key& key, bool active = true,
                                     uint32_t nsid = 1, uint64_t lanes = kFullWarp) noexcept;

}  // namespace gdkv::device

#include "gdkv/detail/device_warp.cuh"
#endif
