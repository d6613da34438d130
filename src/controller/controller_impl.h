// Controller internals shared by its source files.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <vector>

#include "common/clock.h"
#include "controller/reactor.h"
#include "controller/staging_pool.h"
#include "gdkv/controller.h"

namespace gdkv {

// Which stage a command is in when its copy or backend op completes.
enum class CmdPhase : uint8_t {
  kIdle,
  kStoreStaging,     // copying the value from the requester into a staging buffer
  kBackend,          // backend op outstanding
  kDeliver,          // copying the result to the requester
  kPrefetchStaging,  // copying the key list in
  kScatterStaging,   // copying the scatter descriptors in
};

// Controller-owned bytes of one command (device data staged in or out, List results, key lists,
// scatter descriptors). Taken from the reactor's StagingPool when it has one (pinned memory on
// GPU builds, so a copy to or from GPU memory is one DMA), else from the heap. Contents are not
// kept on resize.
class StagingBuffer {
 public:
  StagingBuffer() = default;
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;
  ~StagingBuffer() { release(); }

  // Where later resizes take memory from (null: the heap).
  void set_pool(StagingPool* pool) { pool_ = pool; }
  // Makes room for n bytes. Returns false if no memory could be had.
  bool resize(size_t n) {
    if (n > capacity_) {
      release();
      const size_t cap = n < 4096 ? 4096 : n;
      if (pool_ != nullptr && (data_ = pool_->alloc(cap)) != nullptr) {
        from_ = pool_;
      } else {
        data_ = static_cast<std::byte*>(::operator new(cap, std::nothrow));
        if (data_ == nullptr) return false;
      }
      capacity_ = cap;
    }
    size_ = n;
    return true;
  }
  void clear() { size_ = 0; }
  // The command is done: pool memory goes back to the pool; heap memory is kept for the next
  // command unless it is larger than `keep` bytes (or a pool is there to use next time).
  void done(size_t keep) {
    if (from_ != nullptr || pool_ != nullptr || capacity_ > keep) release();
  }
  std::byte* data() { return data_; }
  size_t size() const { return size_; }
  // The region id of the memory (its pool's), 0 for heap memory.
  uint64_t region() const { return from_ != nullptr ? from_->region() : 0; }

 private:
  void release() {
    if (from_ != nullptr) {
      from_->free(data_);
    } else if (data_ != nullptr) {
      ::operator delete(data_);
    }
    from_ = nullptr;
    data_ = nullptr;
    capacity_ = size_ = 0;
  }
  StagingPool* pool_ = nullptr;
  StagingPool* from_ = nullptr;  // the pool data_ came from; null: the heap
  std::byte* data_ = nullptr;
  size_t capacity_ = 0;
  size_t size_ = 0;
};

struct CommandState {
  Controller::Impl* ctl = nullptr;
  Reactor* owner = nullptr;
  CmdPhase phase = CmdPhase::kIdle;
  uint8_t op_index = 0;  // ReactorStats slot
  uint64_t start_ns = 0;
  uint64_t copy_start_ns = 0;
  BackendOp op;
  CopyJob copy;
  std::vector<CopySegment> copy_segs;  // when a job has more than CopyJob::kInlineSegments
  DataSegments segs;                   // the requester's data buffer
  StagingBuffer staging;               // controller-owned bytes (device data, lists, scatter)
  bool direct = false;                 // the backend wrote straight into segs[0]
  bool sink_failed = false;            // no staging memory could be had for the backend
  uint64_t deliver_cap = 0;            // bytes of the value the requester wants
  nvme::Status status = nvme::Status::kSuccess;
  uint64_t value_len = 0;
  // Scatter retrieve: where each piece goes.
  std::vector<nvme::ScatterEntry> scatter;
  std::vector<DataSegments> scatter_segs;
};

struct MemoryRegion {
  uintptr_t begin;
  uintptr_t end;
  MemKind kind;
  uint64_t id;  // unique for the controller's lifetime (CopySegment::dst_region)
};

struct Controller::Impl {
  Controller* self = nullptr;
  Backend* backend = nullptr;
  ControllerOptions options;
  std::vector<std::unique_ptr<Reactor>> reactors;
  std::atomic<bool> stopping{false};
  std::atomic<uint32_t> next_queue{0};

  mutable std::shared_mutex regions_mu;
  std::map<uintptr_t, MemoryRegion> regions;  // by begin
  std::atomic<uint32_t> region_count{0};
  std::atomic<uint64_t> next_region_id{1};  // registered regions and staging pools

  double dma_peak_bps = 0;  // measured at start, 0 if not
  mutable std::mutex util_mu;
  mutable std::vector<std::pair<uint64_t, uint64_t>> util_last;  // per reactor: copy bytes, ns

  std::mutex queues_mu;
  std::vector<std::unique_ptr<Poller>> queues;  // in-process queue pollers

  // Per backend namespace (index nsid - 1), summed over reactors (relaxed fetch_add): Retrieves
  // that found their key and that did not, and value bytes stored.
  struct NamespaceStats {
    std::atomic<uint64_t> hits{0};
    std::atomic<uint64_t> misses{0};
    std::atomic<uint64_t> bytes_written{0};
  };
  std::unique_ptr<NamespaceStats[]> ns_stats;

  // Looks up [addr, addr+len): the region holding all of it, or none.
  bool find_region(uintptr_t addr, size_t len, MemoryRegion* out) const;

  // Command execution (controller.cc).
  void execute(Command* cmd);
  void on_backend_done(Command* cmd);  // on the owning reactor
  void finish(Command* cmd, nvme::Status status, uint32_t dw0 = 0);
};

}  // namespace gdkv
