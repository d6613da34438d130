// Copy engines: how the controller moves value bytes between its buffers and a requester's memory.
//
// The controller never copies a value itself; it hands a CopyJob to its reactor's engine. The host
// engine is memcpy (CPU-only machines); the CUDA engine (GPU builds) queues cudaMemcpyAsync on the
// reactor's stream and completes the job once an event says the bytes landed. One engine instance
// belongs to one reactor: submit() and poll() are called only from that reactor's thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "gdkv/metrics.h"
#include "gdkv/nvme_kv.h"

namespace gdkv {

enum class MemKind : uint8_t { kHost, kDevice };

struct CopySegment {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t len = 0;
  MemKind dst_kind = MemKind::kHost;
  MemKind src_kind = MemKind::kHost;
  // The memory region each end lies in (a registered region, a reactor's staging pool), 0: not
  // known. An id names one region for the controller's lifetime and is never reused, so an
  // engine may cache what it learns about a region's memory under it.
  uint64_t dst_region = 0;
  uint64_t src_region = 0;
};

struct CopyJob {
  static constexpr uint32_t kInlineSegments = 4;
  CopySegment inline_segs[kInlineSegments];
  CopySegment* segs = inline_segs;  // points at inline_segs or at caller-owned storage
  uint32_t count = 0;
  // Called exactly once, on the reactor thread, when every segment has landed (or failed).
  void (*done)(CopyJob* job, nvme::Status status) = nullptr;
  void* user = nullptr;

  uint64_t bytes() const noexcept {
    uint64_t n = 0;
    for (uint32_t i = 0; i < count; ++i) n += segs[i].len;
    return n;
  }
};

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  // Starts the copies; may complete the job before returning.
  virtual void submit(CopyJob* job) = 0;
  // Completes finished jobs; returns true if it did any work.
  virtual bool poll() = 0;
  virtual const char* name() const = 0;
};

// memcpy on the calling thread; completes inline.
std::unique_ptr<CopyEngine> make_host_copy_engine();

// Makes the engine for reactor `index`.
using CopyEngineFactory = std::function<std::unique_ptr<CopyEngine>(uint32_t reactor_index)>;

}  // namespace gdkv
