// A queue pair whose requester bookkeeping lives apart from its rings: the controller's block keeps
// the SQ, CQ and doorbells (all the controller touches), and a second block of control_bytes()
// holds sq_seq, the command-id bits, the result slots and QueueControl. The GPU runtime puts that
// second block in device memory (GPU atomics don't reach host memory over PCIe); the CPU tests put
// it in host memory to check that the controller never reads the requester part.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gdkv/queue.h"

namespace gdkv::gpu {

// Bytes of the bookkeeping block for `depth` (the [sq_seq, doorbells) span of QueueLayout).
// REQUIRES: valid_queue_depth(depth).
inline size_t control_bytes(uint32_t depth) noexcept {
  const QueueLayout l = QueueLayout::for_depth(depth);
  return l.doorbells - l.sq_seq;
}

// `q` with its bookkeeping pointers moved into `control` (zero-filled, control_bytes(q.depth)
// bytes, 64-byte aligned). The ring and doorbell pointers are kept as they are.
inline QueueRef with_control(QueueRef q, void* control) noexcept {
  const QueueLayout l = QueueLayout::for_depth(q.depth);
  auto* base = static_cast<unsigned char*>(control);
  q.sq_seq = reinterpret_cast<uint32_t*>(base);
  q.cid_bits = reinterpret_cast<uint32_t*>(base + (l.cid_bits - l.sq_seq));
  q.slots = reinterpret_cast<CmdSlot*>(base + (l.slots - l.sq_seq));
  q.ctl = reinterpret_cast<QueueControl*>(base + (l.control - l.sq_seq));
  return q;
}

}  // namespace gdkv::gpu
