// Definitions for device.cuh: SQE builders and the per-thread requests. Included by device.cuh
// only.
#pragma once

#include <cstdint>

#include "gdkv/key.h"
#include "gdkv/nvme_kv.h"
#include "gdkv/platform.h"
#include "gdkv/queue.h"

namespace gdkv::device {
namespace detail {

GDKV_HD inline nvme::Sqe command(nvme::Opcode op, uint32_t nsid) noexcept {
  nvme::Sqe s{};
  s.opcode = static_cast<uint8_t>(op);
  s.nsid = nsid;
  return s;
}

// Key bytes are read as plain fields: Key's member functions are host-only.
GDKV_HD inline nvme::Sqe keyed(nvme::Opcode op, const Key& key, uint32_t nsid) noexcept {
  nvme::Sqe s = command(op, nsid);
  // An out-of-range length is sent as is: the controller answers 86h, never a crash.
  const uint32_t len = key.len;
  nvme::pack_key(s, key.bytes, len <= nvme::kMaxKeyLength ? len : 0);
  s.key_length = key.len;
  return s;
}

GDKV_HD inline void set_data(nvme::Sqe& s, const void* addr, uint32_t len) noexcept {
  s.dptr.prp.prp1 = reinterpret_cast<uint64_t>(addr);
  s.cdw10 = len;
}

}  // namespace detail

GDKV_HD inline nvme::Sqe make_retrieve(const Key& key, void* dst, uint32_t len,
                                       uint32_t nsid) noexcept {
  nvme::Sqe s = detail::keyed(nvme::Opcode::kRetrieve, key, nsid);
  detail::set_data(s, dst, len);
  return s;
}

GDKV_HD inline nvme::Sqe make_store(const Key& key, const void* src, uint32_t len, uint8_t options,
                                    uint32_t nsid) noexcept {
  nvme::Sqe s = detail::keyed(nvme::Opcode::kStore, key, nsid);
  detail::set_data(s, src, len);
  s.options = options;
  return s;
}

GDKV_HD inline nvme::Sqe make_exist(const Key& key, uint32_t nsid) noexcept {
  return detail::keyed(nvme::Opcode::kExist, key, nsid);
}

GDKV_HD inline nvme::Sqe make_delete(const Key& key, uint32_t nsid) noexcept {
  return detail::keyed(nvme::Opcode::kDelete, key, nsid);
}

GDKV_HD inline nvme::Sqe make_list(const Key& start, void* dst, uint32_t len,
                                   uint32_t nsid) noexcept {
  nvme::Sqe s = detail::keyed(nvme::Opcode::kList, start, nsid);
  detail::set_data(s, dst, len);
  return s;
}

GDKV_HD inline nvme::Sqe make_scatter_retrieve(const Key& key, const void* list,
                                               uint32_t list_bytes, uint32_t nsid) noexcept {
  nvme::Sqe s = detail::keyed(nvme::Opcode::kScatterRetrieve, key, nsid);
  detail::set_data(s, list, list_bytes);
  return s;
}

GDKV_HD inline nvme::Sqe make_prefetch(const void* list, uint32_t list_bytes,
                                       uint32_t nsid) noexcept {
  nvme::Sqe s = detail::command(nvme::Opcode::kPrefetch, nsid);
  detail::set_data(s, list, list_bytes);
  return s;
}

GDKV_HD inline bool try_submit(const QueueRef& q, nvme::Sqe sqe, uint16_t* cid) noexcept {
  if (!queue::try_acquire(q, cid)) return false;
  sqe.cid = *cid;
  queue::submit(q, &sqe, 1);
  return true;
}

GDKV_HD inline uint16_t submit(const QueueRef& q, nvme::Sqe sqe) noexcept {
  uint16_t cid = 0;
  while (!try_submit(q, sqe, &cid)) atomic::pause();
  return cid;
}

GDKV_HD inline bool poll(const QueueRef& q, uint16_t cid) noexcept { return queue::poll(q, cid); }

GDKV_HD inline CmdResult wait(const QueueRef& q, uint16_t cid) noexcept {
  return queue::wait(q, cid);
}

GDKV_HD inline CmdResult execute(const QueueRef& q, const nvme::Sqe& sqe) noexcept {
  return wait(q, submit(q, sqe));
}

GDKV_HD inline CmdResult get(const QueueRef& q, const Key& key, void* dst, uint32_t len,
                             uint32_t nsid) noexcept {
  return execute(q, make_retrieve(key, dst, len, nsid));
}

GDKV_HD inline CmdResult put(const QueueRef& q, const Key& key, const void* src, uint32_t len,
                             uint8_t options, uint32_t nsid) noexcept {
  return execute(q, make_store(key, src, len, options, nsid));
}

GDKV_HD inline CmdResult exists(const QueueRef& q, const Key& key, uint32_t nsid) noexcept {
  return execute(q, make_exist(key, nsid));
}

GDKV_HD inline CmdResult del(const QueueRef& q, const Key& key, uint32_t nsid) noexcept {
  return execute(q, make_delete(key, nsid));
}

}  // namespace gdkv::device
