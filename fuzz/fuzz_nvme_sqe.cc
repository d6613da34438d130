// libFuzzer target: SQE validation and data pointer translation.
//
// Input: a 64-byte SQE, one control byte (bit 0: the controller writes; bit 1: flat PRPs; bits
// 2-7: length scale), then a memory image mapped at IOVA 0x100000 (read/write) plus a read-only
// page at 0x900000. The SQE runs as an admin command of a controller whose queues live in that
// memory, and as an I/O data pointer through PRP/SGL translation. Property checked: every segment
// translation returns lies inside mapped memory with the permission asked for.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/controller.h"
#include "vfio_user/dma_space.h"
#include "vfio_user/nvme_ctrl.h"
#include "vfio_user/translate.h"

using namespace gdkv;             // NOLINT
using namespace gdkv::vfio_user;  // NOLINT

namespace {

Controller& controller() {
  static Controller* ctl = [] {
    ControllerOptions o;
    o.reactors = 1;
    o.idle_spin_us = 0;
    return new Controller(make_memory_backend(), o);
  }();
  return *ctl;
}

class NoIrq final : public IrqSink {
 public:
  void signal(uint16_t) override {}
};

bool inside(const DataSegment& s, const std::byte* base, size_t len) {
  return s.addr >= base && s.len <= len && s.addr + s.len <= base + len;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < sizeof(nvme::Sqe) + 1) return 0;
  nvme::Sqe sqe;
  std::memcpy(&sqe, data, sizeof(sqe));
  const uint8_t ctl = data[sizeof(sqe)];
  const bool for_write = ctl & 1, flat = ctl & 2;
  const uint64_t len = uint64_t{sqe.cdw10} >> (ctl >> 2);  // cover small and huge lengths

  std::vector<std::byte> image(64 * 1024);
  const size_t given = std::min(size - sizeof(sqe) - 1, image.size());
  std::memcpy(image.data(), data + sizeof(sqe) + 1, given);
  std::vector<std::byte> ro(4096);

  DmaSpace dma;
  (void)dma.map_memory(0x100000, image.data(), image.size(), true, true, MemKind::kHost);
  (void)dma.map_memory(0x900000, ro.data(), ro.size(), true, false, MemKind::kHost);
  NoIrq irq;
  NvmeControllerConfig cfg;
  cfg.namespaces = {{1, 1, "a"}};
  cfg.max_value_bytes = 1 << 20;
  NvmeController nvme(controller(), dma, irq, cfg);

  // As an admin command (Identify, queue creation in the image, features, log pages...).
  uint32_t dw0 = 0;
  (void)nvme.run_admin(sqe, &dw0);

  // As an I/O data pointer.
  DataSegments segs;
  if (nvme.translate_for_test(sqe, len, for_write, flat, segs) == nvme::Status::kSuccess) {
    uint64_t total = 0;
    for (const DataSegment& s : segs) {
      const bool ok =
          inside(s, image.data(), image.size()) || (!for_write && inside(s, ro.data(), ro.size()));
      if (!ok) __builtin_trap();
      total += s.len;
    }
    if (total != len) __builtin_trap();
  }
  return 0;
}
