// Data pointer translation: the PRP entries or SGL descriptors of an SQE, resolved against a
// client's DMA space into DataSegments the controller can copy to or from.
//
// PRP (PSDT 00b): PRP1 may carry an offset into its page; the rest of the transfer is whole pages
// named by PRP2, or by the PRP list PRP2 points to (the last entry of a full list page chains to
// the next list page). Entries after the first must be page aligned. On gdkv counter-doorbell
// queues (`flat`), PRP2 = 0 means PRP1 is one contiguous range of the whole length.
// SGL (PSDT 01b/10b): data block descriptors, segment and last segment descriptors (lists read from
// client memory), bounded in count. Bit buckets and keyed descriptors are refused.
//
// Errors: a pointer outside the maps (or without the needed permission) is 04h data transfer
// error; a malformed pointer (misaligned entry, bad descriptor type, a list that never ends) is
// 02h invalid field. Never reads or writes outside what the resolver grants.
//
// Thread safety: pure functions over the resolver.
#pragma once

#include <cstdint>

#include "gdkv/controller.h"
#include "gdkv/nvme_kv.h"

namespace gdkv::vfio_user {

// Where translation looks things up.
class DmaResolver {
 public:
  virtual ~DmaResolver() = default;
  // Appends segments for [iova, iova+len) (pinning what it uses); 04h if unreachable.
  virtual nvme::Status resolve(uint64_t iova, uint64_t len, bool for_write, DataSegments& out) = 0;
  // Copies client memory (PRP lists, SGL segments). False if unreachable.
  virtual bool read(uint64_t iova, void* dst, size_t len) = 0;
};

struct TranslateOptions {
  uint32_t page_size = 4096;           // CC.MPS
  bool flat = false;                   // gdkv counter-doorbell queue: PRP2 = 0 means contiguous
  uint32_t max_sgl_descriptors = 256;  // descriptors read from lists, over the whole command
  uint64_t max_transfer = 0;           // bytes (MDTS); longer transfers are 02h. 0 = no limit
};

// Translates the data pointer of `sqe` for a transfer of `len` bytes.
nvme::Status translate_data(const nvme::Sqe& sqe, uint64_t len, bool for_write,
                            const TranslateOptions& options, DmaResolver& resolver,
                            DataSegments& out);

}  // namespace gdkv::vfio_user
