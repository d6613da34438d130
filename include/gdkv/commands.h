// Builders of NVMe-KV submission entries, shared by the host client and the device API.
//
// Data pointers are plain addresses in PRP1 (PSDT 0): the in-process controller and the GPU
// runtime read them as virtual addresses; the vfio-user client driver rewrites them into PRPs of
// its shared memory. cid is left 0: the queue's try_acquire() hands out command ids.
#pragma once

#include <cstdint>

#include "gdkv/nvme_kv.h"
#include "gdkv/platform.h"

namespace gdkv::cmd {

GDKV_HD inline nvme::Sqe base(nvme::Opcode op, const uint8_t* key, uint32_t key_len,
                              uint32_t nsid) noexcept {
  nvme::Sqe s{};
  s.opcode = static_cast<uint8_t>(op);
  s.nsid = nsid;
  nvme::pack_key(s, key, key_len);
  return s;
}

GDKV_HD inline nvme::Sqe store(const uint8_t* key, uint32_t key_len, const void* value,
                               uint32_t value_len, uint8_t options = 0,
                               uint32_t nsid = 1) noexcept {
  nvme::Sqe s = base(nvme::Opcode::kStore, key, key_len, nsid);
  s.dptr.prp.prp1 = reinterpret_cast<uint64_t>(value);
  s.cdw10 = value_len;
  s.options = options;
  return s;
}

GDKV_HD inline nvme::Sqe retrieve(const uint8_t* key, uint32_t key_len, void* buf, uint32_t buf_len,
                                  uint32_t nsid = 1) noexcept {
  nvme::Sqe s = base(nvme::Opcode::kRetrieve, key, key_len, nsid);
  s.dptr.prp.prp1 = reinterpret_cast<uint64_t>(buf);
  s.cdw10 = buf_len;
  return s;
}

GDKV_HD inline nvme::Sqe remove(const uint8_t* key, uint32_t key_len, uint32_t nsid = 1) noexcept {
  return base(nvme::Opcode::kDelete, key, key_len, nsid);
}

GDKV_HD inline nvme::Sqe exist(const uint8_t* key, uint32_t key_len, uint32_t nsid = 1) noexcept {
  return base(nvme::Opcode::kExist, key, key_len, nsid);
}

// List keys >= key into buf (KeyList layout, see nvme_kv.h).
GDKV_HD inline nvme::Sqe list(const uint8_t* key, uint32_t key_len, void* buf, uint32_t buf_len,
                              uint32_t nsid = 1) noexcept {
  nvme::Sqe s = base(nvme::Opcode::kList, key, key_len, nsid);
  s.dptr.prp.prp1 = reinterpret_cast<uint64_t>(buf);
  s.cdw10 = buf_len;
  return s;
}

// Prefetch hint: buf holds a KeyList of buf_len bytes.
GDKV_HD inline nvme::Sqe prefetch(const void* key_list, uint32_t buf_len,
                                  uint32_t nsid = 1) noexcept {
  nvme::Sqe s{};
  s.opcode = static_cast<uint8_t>(nvme::Opcode::kPrefetch);
  s.nsid = nsid;
  s.dptr.prp.prp1 = reinterpret_cast<uint64_t>(key_list);
  s.cdw10 = buf_len;
  return s;
}

// Scheduler hint: a Prefetch with the hint option (nvme_kv.h kPrefetchHint); the keys in the
// KeyList will be read soon, in this order.
GDKV_HD inline nvme::Sqe hint(const void* key_list, uint32_t buf_len, uint32_t nsid = 1) noexcept {
  nvme::Sqe s = prefetch(key_list, buf_len, nsid);
  s.options = nvme::kPrefetchHint;
  return s;
}

// Scatter retrieve: desc holds a ScatterHeader and its entries, desc_len bytes in all.
GDKV_HD inline nvme::Sqe scatter_retrieve(const uint8_t* key, uint32_t key_len, const void* desc,
                                          uint32_t desc_len, uint32_t nsid = 1) noexcept {
  nvme::Sqe s = base(nvme::Opcode::kScatterRetrieve, key, key_len, nsid);
  s.dptr.prp.prp1 = reinterpret_cast<uint64_t>(desc);
  s.cdw10 = desc_len;
  return s;
}

}  // namespace gdkv::cmd
