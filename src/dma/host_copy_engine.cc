#include <cstring>

#include "gdkv/copy_engine.h"

namespace gdkv {
namespace {

class HostCopyEngine final : public CopyEngine {
 public:
  void submit(CopyJob* job) override {
    for (uint32_t i = 0; i < job->count; ++i) {
      const CopySegment& s = job->segs[i];
      if (s.dst_kind != MemKind::kHost || s.src_kind != MemKind::kHost) {
        job->done(job, nvme::Status::kDataTransferError);  // device memory needs a GPU engine
        return;
      }
      if (s.len != 0) std::memcpy(s.dst, s.src, s.len);
    }
    job->done(job, nvme::Status::kSuccess);
  }
  bool poll() override { return false; }
  const char* name() const override { return "host-memcpy"; }
};

}  // namespace

std::unique_ptr<CopyEngine> make_host_copy_engine() { return std::make_unique<HostCopyEngine>(); }

}  // namespace gdkv
