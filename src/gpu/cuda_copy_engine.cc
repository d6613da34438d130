// The CUDA copy engine: moves value bytes between the controller's buffers and GPU memory with
// cudaMemcpyAsync on a per-reactor stream, and completes each job once an event recorded after its
// copies has fired. The reactor thread never blocks on the GPU: poll() only queries events.
//
// Where each end of a segment really lives decides the path (cudaPointerGetAttributes, so a
// mis-registered kind can't send memcpy at device memory; asked once per region the controller
// names in the segment, RegionCache, and per segment only for memory in no known region):
//   host ↔ host (pinned or pageable)      memcpy on the reactor thread
//   device or pinned ↔ device or pinned   one cudaMemcpyAsync (DMA, no CPU copy)
//   device ↔ pageable host                through a pinned staging ring in chunks: a pageable
//                                         source is memcpy'd in first; a pageable destination
//                                         gets the bytes by memcpy once the chunk's event fired.
//                                         cudaMemcpyAsync on pageable memory would block.
// Jobs are issued in submission order on one stream, so events fire in order, flights retire in
// order and the staging ring is freed in order.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <memory>
#include <stdexcept>
#include <vector>

#include "gdkv/gpu_runtime.h"
#include "gpu/cuda_check.h"
#include "gpu/region_cache.h"

namespace gdkv::gpu {
namespace {

enum class Where : uint8_t { kPageable, kPinned, kDevice };

std::atomic<uint64_t> g_attribute_queries{0};

Where classify(const void* p) {
  g_attribute_queries.fetch_add(1, std::memory_order_relaxed);
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return Where::kPageable;
  }
  switch (a.type) {
    case cudaMemoryTypeDevice:
    case cudaMemoryTypeManaged:
      return Where::kDevice;
    case cudaMemoryTypeHost:
      return Where::kPinned;
    default:
      return Where::kPageable;
  }
}

// A ring of pinned host memory handed out in FIFO order. Positions are 64-bit counters; the bytes
// of position x are at base + x % capacity. A piece never wraps: the gap at the end is skipped.
class StagingRing {
 public:
  explicit StagingRing(size_t capacity) : capacity_(capacity) {
    check(cudaHostAlloc(&base_, capacity_, cudaHostAllocPortable), "cudaHostAlloc (staging)");
  }
  ~StagingRing() { cudaFreeHost(base_); }
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  size_t capacity() const { return capacity_; }
  // Null if `n` bytes don't fit until earlier pieces are released.
  std::byte* alloc(size_t n) {
    n = (n + 255) & ~size_t{255};
    const size_t pos = head_ % capacity_;
    const size_t skip = pos + n > capacity_ ? capacity_ - pos : 0;
    if (head_ == tail_) {
      head_ += skip;  // empty: start the piece at the ring's beginning
      tail_ = head_;
    } else if ((head_ - tail_) + skip + n > capacity_) {
      return nullptr;
    } else {
      head_ += skip;
    }
    if (n > capacity_) return nullptr;
    std::byte* p = static_cast<std::byte*>(base_) + head_ % capacity_;
    head_ += n;
    return p;
  }
  // Everything allocated up to now (a flight's release mark).
  uint64_t mark() const { return head_; }
  void release_to(uint64_t mark) { tail_ = std::max(tail_, mark); }

 private:
  void* base_ = nullptr;
  size_t capacity_;
  uint64_t head_ = 0;
  uint64_t tail_ = 0;
};

class CudaCopyEngine final : public CopyEngine {
 public:
  explicit CudaCopyEngine(const GpuOptions& o)
      : device_(o.device),
        staging_(std::max<size_t>(o.bounce_bytes, size_t{1} << 20)),
        chunk_(staging_.capacity() / 4) {
    // Set up on the constructing thread without changing its current device for good.
    int prev = 0;
    check(cudaGetDevice(&prev), "cudaGetDevice");
    check(cudaSetDevice(device_), "cudaSetDevice");
    cudaError_t e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    cudaSetDevice(prev);
    check(e, "cudaStreamCreateWithFlags");
  }

  ~CudaCopyEngine() override {
    use_device();
    cudaStreamSynchronize(stream_);  // staging memory must outlive copies still in flight
    for (Flight& f : flights_) {
      if (f.event != nullptr) cudaEventDestroy(f.event);
    }
    for (cudaEvent_t ev : free_events_) cudaEventDestroy(ev);
    cudaStreamDestroy(stream_);
  }

  void submit(CopyJob* job) override {
    use_device();
    Job* j = new_job();
    j->job = job;
    waiting_.push_back(j);
    pump();
  }

  bool poll() override {
    if (flights_.empty() && waiting_.empty()) return false;
    use_device();
    bool work = false;
    while (!flights_.empty()) {
      Flight& f = flights_.front();
      const cudaError_t e = f.event != nullptr ? cudaEventQuery(f.event) : cudaErrorUnknown;
      if (e == cudaErrorNotReady) break;
      Job* j = f.job;
      if (e == cudaSuccess) {
        for (const Finish& x : f.finish) std::memcpy(x.dst, x.src, x.len);
      } else {
        cudaGetLastError();
        j->status = nvme::Status::kDataTransferError;
      }
      staging_.release_to(f.mark);
      if (f.event != nullptr) free_events_.push_back(f.event);
      f.finish.clear();
      spare_finish_.swap(f.finish);  // keep one vector's capacity for the next flight
      flights_.pop_front();
      work = true;
      if (--j->flights == 0 && j->issued) complete(j);
    }
    work |= pump();
    return work;
  }

  const char* name() const override { return "cuda"; }

 private:
  struct Job {
    CopyJob* job = nullptr;
    uint32_t seg = 0;         // next segment to issue
    size_t off = 0;           // bytes of it issued
    bool classified = false;  // dst/src below are for segment `seg`
    Where dst = Where::kPageable;
    Where src = Where::kPageable;
    bool issued = false;   // every segment issued (or the job failed)
    uint32_t flights = 0;  // flights not yet retired
    nvme::Status status = nvme::Status::kSuccess;
  };
  // A pageable destination's bytes, copied out of staging once the flight's event fired.
  struct Finish {
    void* dst;
    const void* src;
    size_t len;
  };
  // Copies issued for one job in one go, closed by one event.
  struct Flight {
    cudaEvent_t event;  // null: recording failed; the flight fails when it reaches the front
    Job* job;
    uint64_t mark;  // staging_.mark() after its pieces
    std::vector<Finish> finish;
  };

  void use_device() {
    thread_local int current = -1;
    if (current != device_ && cudaSetDevice(device_) == cudaSuccess) current = device_;
  }

  Job* new_job() {
    if (free_jobs_.empty()) {
      jobs_.push_back(std::make_unique<Job>());
      return jobs_.back().get();
    }
    Job* j = free_jobs_.back();
    free_jobs_.pop_back();
    *j = Job{};
    return j;
  }

  void complete(Job* j) {
    CopyJob* job = j->job;
    const nvme::Status s = j->status;
    free_jobs_.push_back(j);
    job->done(job, s);  // may call submit() again
  }

  // Issues jobs in order until one waits for staging space. Returns true if it did anything.
  bool pump() {
    if (pumping_) return false;  // a done() callback inside pump submitted: the loop picks it up
    pumping_ = true;
    bool work = false;
    while (!waiting_.empty()) {
      Job* j = waiting_.front();
      work |= issue(*j);
      if (!j->issued) break;
      waiting_.pop_front();
      if (j->flights == 0) complete(j);
    }
    pumping_ = false;
    return work;
  }

  // A CUDA call failed: the job fails with 04h (the error is cleared if it is not sticky).
  static void fail(Job& j) {
    cudaGetLastError();
    j.status = nvme::Status::kDataTransferError;
  }

  // Issues what it can of `j`: sets j.issued once every segment is issued or the job failed.
  // Returns true if it issued anything.
  bool issue(Job& j) {
    CopyJob& job = *j.job;
    std::vector<Finish> finish;
    finish.swap(spare_finish_);
    bool async = false;
    bool progress = false;
    while (j.seg < job.count && j.status == nvme::Status::kSuccess) {
      const CopySegment& s = job.segs[j.seg];
      if (s.len == 0) {
        next_segment(j);
        continue;
      }
      if (!j.classified) {
        j.dst = where_.lookup(s.dst_region, s.dst, classify);
        j.src = where_.lookup(s.src_region, s.src, classify);
        j.classified = true;
      }
      auto* dst = static_cast<std::byte*>(s.dst);
      const auto* src = static_cast<const std::byte*>(s.src);
      if (j.dst != Where::kDevice && j.src != Where::kDevice) {
        std::memcpy(dst, src, s.len);
        next_segment(j);
        progress = true;
        continue;
      }
      if (j.dst != Where::kPageable && j.src != Where::kPageable) {
        cudaError_t e = cudaMemcpyAsync(dst, src, s.len, cudaMemcpyDefault, stream_);
        if (e != cudaSuccess) {
          fail(j);
          break;
        }
        async = progress = true;
        next_segment(j);
        continue;
      }
      // Device ↔ pageable host: one chunk through the staging ring.
      const size_t n = std::min(s.len - j.off, chunk_);
      std::byte* b = staging_.alloc(n);
      if (b == nullptr) break;  // wait for earlier flights to free space
      cudaError_t e;
      if (j.src == Where::kPageable) {
        std::memcpy(b, src + j.off, n);
        e = cudaMemcpyAsync(dst + j.off, b, n, cudaMemcpyHostToDevice, stream_);
      } else {
        e = cudaMemcpyAsync(b, src + j.off, n, cudaMemcpyDeviceToHost, stream_);
        finish.push_back(Finish{dst + j.off, b, n});
      }
      if (e != cudaSuccess) {
        if (j.src != Where::kPageable) finish.pop_back();  // this chunk was not queued
        fail(j);
        break;
      }
      async = progress = true;
      j.off += n;
      if (j.off == s.len) next_segment(j);
    }
    if (j.seg == job.count || j.status != nvme::Status::kSuccess) j.issued = true;
    if (async) {
      cudaEvent_t ev = event();
      if (ev != nullptr && cudaEventRecord(ev, stream_) != cudaSuccess) {
        cudaGetLastError();
        free_events_.push_back(ev);
        ev = nullptr;
      }
      flights_.push_back(Flight{ev, &j, staging_.mark(), std::move(finish)});
      ++j.flights;
    } else {
      finish.clear();
      spare_finish_.swap(finish);
    }
    return progress;
  }

  void next_segment(Job& j) {
    ++j.seg;
    j.off = 0;
    j.classified = false;
  }

  cudaEvent_t event() {
    if (!free_events_.empty()) {
      cudaEvent_t ev = free_events_.back();
      free_events_.pop_back();
      return ev;
    }
    cudaEvent_t ev = nullptr;
    if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return ev;
  }

  const int device_;
  cudaStream_t stream_ = nullptr;
  StagingRing staging_;
  const size_t chunk_;          // largest staged piece: a quarter of the ring, so pieces pipeline
  std::deque<Job*> waiting_;    // jobs not fully issued, in submission order
  std::deque<Flight> flights_;  // in stream order
  std::vector<cudaEvent_t> free_events_;
  std::vector<std::unique_ptr<Job>> jobs_;  // every Job ever made (reused through free_jobs_)
  std::vector<Job*> free_jobs_;
  std::vector<Finish> spare_finish_;
  RegionCache<Where> where_;
  bool pumping_ = false;
};

}  // namespace

uint64_t pointer_attribute_queries() noexcept {
  return g_attribute_queries.load(std::memory_order_relaxed);
}

std::unique_ptr<CopyEngine> make_cuda_copy_engine(const GpuOptions& gpu) {
  return std::make_unique<CudaCopyEngine>(gpu);
}

}  // namespace gdkv::gpu
