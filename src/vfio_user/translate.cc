#include "vfio_user/translate.h"

#include <algorithm>

namespace gdkv::vfio_user {

namespace {

using nvme::Status;

// Coalesces adjacent pages into one resolve() call: a buffer that is contiguous in DMA space (the
// common case) costs one map lookup however many PRP entries describe it.
class RunBuilder {
 public:
  RunBuilder(DmaResolver& r, bool for_write, DataSegments& out)
      : r_(r), for_write_(for_write), out_(out) {}
  Status add(uint64_t addr, uint64_t len) {
    if (len_ != 0 && start_ + len_ == addr) {
      len_ += len;
      return Status::kSuccess;
    }
    if (Status s = flush(); s != Status::kSuccess) return s;
    start_ = addr;
    len_ = len;
    return Status::kSuccess;
  }
  Status flush() {
    if (len_ == 0) return Status::kSuccess;
    const uint64_t n = len_;
    len_ = 0;
    return r_.resolve(start_, n, for_write_, out_);
  }

 private:
  DmaResolver& r_;
  bool for_write_;
  DataSegments& out_;
  uint64_t start_ = 0;
  uint64_t len_ = 0;
};

Status translate_prp(const nvme::Sqe& sqe, uint64_t len, bool for_write, const TranslateOptions& o,
                     DmaResolver& r, DataSegments& out) {
  const uint64_t page = o.page_size;
  const uint64_t prp1 = sqe.dptr.prp.prp1;
  const uint64_t prp2 = sqe.dptr.prp.prp2;
  if (o.flat && prp2 == 0) return r.resolve(prp1, len, for_write, out);

  RunBuilder run(r, for_write, out);
  const uint64_t first = std::min(len, page - (prp1 & (page - 1)));
  if (Status s = run.add(prp1, first); s != Status::kSuccess) return s;
  uint64_t remaining = len - first;
  if (remaining == 0) return run.flush();
  if (remaining <= page) {
    // PRP2 is the second (and last) page.
    if ((prp2 & (page - 1)) != 0) return Status::kInvalidField;
    if (Status s = run.add(prp2, remaining); s != Status::kSuccess) return s;
    return run.flush();
  }
  // PRP2 points into a PRP list; the entry in a list page's last slot chains to the next page
  // while more than one page of data remains. Each list page is read with one copy.
  if ((prp2 & 7) != 0) return Status::kInvalidField;
  const uint64_t entries_per_page = page / 8;
  constexpr uint64_t kChunk = 512;
  uint64_t entries[kChunk];
  uint64_t cur = prp2;
  // Every list page visited consumes data or moves on; a page whose only remaining slot is its
  // chain slot consumes none, so bound the visits to stop a list that chains to itself.
  uint64_t budget = 2 * (remaining / page + 2);
  while (remaining > 0) {
    if (budget-- == 0) return Status::kInvalidField;
    const uint64_t slot = (cur & (page - 1)) / 8;
    const uint64_t pages_left = (remaining + page - 1) / page;
    const uint64_t n = std::min({entries_per_page - slot, pages_left, kChunk});
    if (!r.read(cur, entries, n * sizeof(uint64_t))) return Status::kDataTransferError;
    bool chained = false;
    for (uint64_t i = 0; i < n; ++i) {
      if (slot + i == entries_per_page - 1 && remaining > page) {
        if ((entries[i] & 7) != 0) return Status::kInvalidField;
        cur = entries[i];
        chained = true;
        break;
      }
      if ((entries[i] & (page - 1)) != 0) return Status::kInvalidField;
      const uint64_t take = std::min(remaining, page);
      if (Status s = run.add(entries[i], take); s != Status::kSuccess) return s;
      remaining -= take;
    }
    if (!chained) cur += n * sizeof(uint64_t);
  }
  return run.flush();
}

constexpr uint8_t kSglDataBlock = 0x0;
constexpr uint8_t kSglSegment = 0x2;
constexpr uint8_t kSglLastSegment = 0x3;

Status translate_sgl(const nvme::Sqe& sqe, uint64_t len, bool for_write, const TranslateOptions& o,
                     DmaResolver& r, DataSegments& out) {
  nvme::SglDescriptor d = sqe.dptr.sgl;
  uint64_t remaining = len;
  uint32_t budget = o.max_sgl_descriptors;
  bool in_last_segment = false;
  // The descriptor in the SQE, then the lists it leads to.
  for (;;) {
    const uint8_t type = d.type >> 4;
    const uint8_t subtype = d.type & 0xF;
    if (subtype != 0) return Status::kInvalidField;  // only plain addresses over PCIe
    if (type == kSglDataBlock) {
      const uint64_t n = std::min<uint64_t>(d.length, remaining);
      if (n > 0) {
        if (Status s = r.resolve(d.address, n, for_write, out); s != Status::kSuccess) return s;
        remaining -= n;
      }
      return remaining == 0 ? Status::kSuccess : Status::kDataTransferError;
    }
    if (type != kSglSegment && type != kSglLastSegment) return Status::kInvalidField;
    if (in_last_segment) return Status::kInvalidField;  // a last segment may not chain
    if (d.length == 0 || d.length % sizeof(nvme::SglDescriptor) != 0) return Status::kInvalidField;
    in_last_segment = type == kSglLastSegment;
    const uint32_t count = d.length / sizeof(nvme::SglDescriptor);
    const uint64_t base = d.address;
    nvme::SglDescriptor next{};
    bool chained = false;
    for (uint32_t i = 0; i < count; ++i) {
      if (budget-- == 0) return Status::kInvalidField;
      nvme::SglDescriptor e;
      if (!r.read(base + uint64_t{i} * sizeof(e), &e, sizeof(e))) {
        return Status::kDataTransferError;
      }
      const uint8_t et = e.type >> 4;
      if ((e.type & 0xF) != 0) return Status::kInvalidField;
      if (et == kSglDataBlock) {
        const uint64_t n = std::min<uint64_t>(e.length, remaining);
        if (n > 0) {
          if (Status s = r.resolve(e.address, n, for_write, out); s != Status::kSuccess) return s;
          remaining -= n;
        }
        continue;
      }
      // A segment descriptor may only be the last one of a (non-last) segment.
      if ((et == kSglSegment || et == kSglLastSegment) && i == count - 1 && !in_last_segment) {
        next = e;
        chained = true;
        continue;
      }
      return Status::kInvalidField;
    }
    if (!chained) return remaining == 0 ? Status::kSuccess : Status::kDataTransferError;
    d = next;
  }
}

}  // namespace

nvme::Status translate_data(const nvme::Sqe& sqe, uint64_t len, bool for_write,
                            const TranslateOptions& options, DmaResolver& resolver,
                            DataSegments& out) {
  if (len == 0) return Status::kSuccess;
  const uint32_t page = options.page_size;
  if (page < 512 || (page & (page - 1)) != 0) return Status::kInternalError;
  if (options.max_transfer != 0 && len > options.max_transfer) return Status::kInvalidField;
  switch (sqe.psdt()) {
    case nvme::kPsdtPrp:
      return translate_prp(sqe, len, for_write, options, resolver, out);
    case nvme::kPsdtSglContiguous:
    case nvme::kPsdtSglSegment:
      return translate_sgl(sqe, len, for_write, options, resolver, out);
    default:
      return Status::kInvalidField;
  }
}

}  // namespace gdkv::vfio_user
