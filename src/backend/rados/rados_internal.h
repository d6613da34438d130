// The rados backend's implementation, shared by its source files: rados_backend.cc (the data
// path: ops, the in-flight list and its watchdog), rados_watch.cc (background ops, watches and
// delete notifications, the maintenance thread), rados_evict.cc (eviction) and rados_metrics.cc
// (metrics and pool statistics). The public face is include/gdkv/rados_backend.h.
#pragma once

#include <rados/librados.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/rados/rados_record.h"
#include "gdkv/rados_backend.h"

namespace gdkv::rados_detail {

using nvme::Status;
using Clock = std::chrono::steady_clock;

class RadosBackend;

struct Pending {
  RadosBackend* backend = nullptr;
  BackendOp* op = nullptr;  // only touched by whoever claimed the op, until it completes it
  BackendOpKind kind = BackendOpKind::kGet;
  Key key;                // copies: the list worker reads them after a timeout may have
  uint32_t list_max = 0;  // completed (and released) the op
  uint32_t nsid = 0;
  Clock::time_point deadline;
  std::atomic<int> refs{2};  // librados (or the list worker) + the in-flight list
  std::atomic<bool> claimed{false};
  Pending* prev = nullptr;  // in-flight list, guarded by RadosBackend::flight_mu_
  Pending* next = nullptr;
  bool linked = false;
  librados::IoCtx* ioctx = nullptr;
  librados::AioCompletion* completion = nullptr;
  // librados' outputs.
  librados::bufferlist data;
  librados::bufferlist xattr;
  librados::bufferlist atime;
  int read_rc = 0;
  int xattr_rc = 0;
  int atime_rc = 0;
  uint64_t size = 0;
  time_t mtime = 0;
  uint64_t bytes = 0;  // Store: value bytes (metrics)

  bool claim() noexcept { return !claimed.exchange(true, std::memory_order_acq_rel); }
  ~Pending() {
    if (completion != nullptr) completion->release();
  }
};

// A thread that runs posted jobs one at a time, in the order they were posted. stop() runs what
// is still queued, then joins.
class JobThread {
 public:
  JobThread() = default;
  JobThread(const JobThread&) = delete;
  JobThread& operator=(const JobThread&) = delete;
  ~JobThread() { stop(); }
  void start() {
    thread_ = std::thread([this] { run(); });
  }
  void post(std::function<void()> job) {
    {
      std::lock_guard lk(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();  // no system call unless the thread waits
  }
  void stop() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    std::deque<std::function<void()>> batch;
    std::unique_lock lk(mu_);
    while (true) {
      cv_.wait(lk, [this] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, and nothing left to run
      batch.swap(jobs_);
      lk.unlock();
      for (auto& job : batch) job();
      batch.clear();
      lk.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::thread thread_;
};

// Seconds for librados' integer-second timeouts, rounded up so they never fire before ours.
inline std::string ceil_seconds(uint32_t ms) { return std::to_string((ms + 999) / 1000); }

class RadosBackend final : public Backend {
 public:
  // The data path (rados_backend.cc).
  explicit RadosBackend(const RadosBackendOptions& o);
  ~RadosBackend() override;
  void submit(BackendOp* op) override;
  void issue(Pending* p);
  BackendInfo info() const override;
  void drain() override;

  // Metrics (rados_metrics.cc).
  void collect(MetricList& out) const override;

  // Watches and delete notifications (rados_watch.cc).
  void set_removal_handler(InvalidationHandler h) override;
  void set_invalidation_handler(InvalidationHandler h) override;

 private:
  static constexpr size_t kKinds = kBackendOpKinds;

  // ---- the data path (rados_backend.cc) ----
  static void check(int r, const std::string& what);
  void configure_timeouts();
  void lower_float_option(const char* name, double value);
  static Status validate(const BackendOp& op) noexcept;
  static void prepare_put(const BackendOp& op, librados::ObjectWriteOperation& w);
  static uint64_t wall_ms();
  static uint64_t parse_atime(const librados::bufferlist& bl, int rc);
  static void on_complete(librados::completion_t, void* arg);
  void finish_librados(Pending* p, int r);
  Status deliver(Pending* p, uint64_t* len_out);
  static uint64_t checksum(librados::bufferlist& bl);
  void run_list(Pending* p);
  void release(Pending* p, Status s, uint64_t len);
  void complete(Pending* p, Status s, uint64_t len);
  void unref(Pending* p);
  std::chrono::milliseconds tick() const;
  void link(Pending* p);
  bool unlink(Pending* p);
  bool unlink_locked(Pending* p);
  void run_watchdog();
  librados::IoCtx* ioctx_for(uint32_t nsid);

  // ---- background RADOS ops (access times, notifications) ----
  // Nobody waits for them; live_ keeps the backend alive until their callbacks have run.
  // (rados_watch.cc)
  struct Background {
    RadosBackend* self;
    librados::AioCompletion* c = nullptr;
    std::atomic<uint64_t>* failures;
    librados::bufferlist payload;
  };
  Background* background(std::atomic<uint64_t>* failures);
  void end_background(Background* b);
  void touch(librados::IoCtx* io, const Key& key);
  void notify_delete(uint32_t nsid, const Key& key);

  // ---- watches: delete notifications and the set of evicting nodes ----
  // (rados_watch.cc)
  class Watcher final : public librados::WatchCtx2 {
   public:
    Watcher(RadosBackend* b, bool events) : b_(b), events_(events) {}
    void handle_notify(uint64_t notify_id, uint64_t cookie, uint64_t notifier,
                       librados::bufferlist& bl) override;
    void handle_error(uint64_t, int err) override;

   private:
    RadosBackend* b_;
    bool events_;
  };
  struct Watch {
    std::unique_ptr<Watcher> ctx;
    uint64_t handle = 0;
    bool wanted = false;
    bool live = false;
    bool lost = false;  // it broke since it was last established
  };

  std::string watch_oid(bool events) const {
    return events ? options_.events_object : options_.events_object + ".evictors";
  }

  void on_notify(uint64_t notifier, librados::bufferlist& bl);
  void on_watch_error(bool events, int err);
  void ensure_watch(Watch& w, bool events);
  void unwatch_all();
  void run_maintenance();

  // ---- eviction ----
  // (rados_evict.cc)
  struct Fill {
    uint64_t used = 0;      // the pool's bytes
    uint64_t capacity = 0;  // what they are measured against (0: unknown)
    double ratio = 0;       // used / capacity, or the cluster's raw fill
    bool quota = false;     // capacity is a byte budget (configured or the pool's quota)
  };

  bool pool_df(uint64_t* stored, uint64_t* max_avail) const;
  Fill read_fill() const;
  uint64_t pool_quota() const;
  bool membership(size_t* index, size_t* count, std::vector<uint64_t>* ids);

  // A namespace with a quota (options_.quotas). The vector holding them is sized once at
  // construction and never changes, so collect() reads the atomics without a lock.
  struct NsQuota {
    uint32_t nsid = 0;
    std::string nspace;                  // its RADOS namespace
    uint64_t limit = 0;                  // bytes
    std::atomic<uint64_t> held{0};       // the namespace's bytes on all nodes, as last measured
    std::atomic<uint64_t> evictions{0};  // its blocks this node evicted (quota or pool-wide)
  };

  struct Candidate {
    std::string nspace;
    std::string oid;
    uint64_t size = 0;
    time_t mtime = 0;
    librados::bufferlist atime;
    int stat_rc = 0;
    int atime_rc = 0;
    uint64_t atime_ms = 0;
    NsQuota* quota = nullptr;  // its namespace's quota, if it has one
    bool removed = false;
  };

  NsQuota* quota_of(const std::string& nspace);
  bool list_slice(const std::string& nspace, size_t index, size_t count,
                  std::vector<Candidate>* out);
  static constexpr std::string_view kHeldXattr = "gdkv.held.";  // + client id, on the evictors
  void add_others_held(const std::vector<uint64_t>& members, std::vector<uint64_t>* held,
                       std::vector<std::string>* stale);
  void publish_held(const std::vector<uint64_t>& mine, const std::vector<std::string>& stale);
  uint64_t remove_coldest(const std::vector<Candidate*>& order, uint64_t to_free);
  void report_eviction(const Candidate& c);
  librados::IoCtx& evict_ioctx(const std::string& nspace);
  // Defined in rados_evict.cc, its only user.
  template <typename Issue, typename Done>
  static void windowed(size_t n, Issue issue, Done done);
  void evict_pass();

  // ---- metrics (rados_metrics.cc) ----
  void refresh_stats() const;
  void count_status(Status s) noexcept;

  const RadosBackendOptions options_;
  // Declared before every IoCtx and thread: shut down last. Mutable: info() refreshes pool
  // statistics through it, and librados' stat calls are not const.
  mutable librados::Rados rados_;
  librados::IoCtx base_;
  std::shared_mutex ns_mu_;
  std::unordered_map<uint32_t, std::unique_ptr<librados::IoCtx>> ns_;

  std::mutex flight_mu_;
  std::condition_variable flight_cv_;
  Pending* head_ = nullptr;
  Pending* tail_ = nullptr;
  bool stop_watchdog_ = false;
  std::thread watchdog_;

  mutable JobThread worker_;         // lists and pool statistics: synchronous librados calls
  JobThread submitter_;              // starts Stores, and the ops queued behind them
  std::atomic<uint64_t> queued_{0};  // ops posted to submitter_ and not yet issued
  std::atomic<uint64_t> submit_thread_ops_{0};

  std::mutex drain_mu_;
  std::condition_variable drain_cv_;
  std::atomic<uint64_t> inflight_{0};  // ops not yet completed to their caller
  std::atomic<uint64_t> draining_{0};  // drain() calls waiting
  std::atomic<uint64_t> live_{0};      // Pendings not yet freed (librados may still call back)

  mutable std::mutex info_mu_;
  mutable BackendInfo info_{.name = "rados"};
  mutable Clock::time_point stats_at_{};
  mutable bool stats_queued_ = false;

  // Watches, eviction (the maintenance thread).
  InvalidationHook handler_;
  InvalidationHook removals_;  // set_removal_handler
  std::mutex maint_mu_;
  std::condition_variable maint_cv_;
  bool stop_maint_ = false;
  Watch events_;
  Watch evictors_;
  std::thread maintainer_;
  std::unordered_map<std::string, std::unique_ptr<librados::IoCtx>> evict_ns_;  // its thread's

  std::vector<NsQuota> quotas_;         // one per options_.quotas entry, in nsid order
  std::atomic<bool> full_seen_{false};  // a Store got 81h since the last pass
  std::atomic<uint64_t> fill_ppm_{0};
  std::atomic<uint64_t> capacity_bytes_{0};
  std::atomic<uint64_t> pool_used_bytes_{0};
  std::atomic<uint64_t> members_{0};
  std::atomic<uint64_t> evict_passes_{0};
  std::atomic<uint64_t> evictions_{0};
  std::atomic<uint64_t> evicted_bytes_{0};
  std::atomic<uint64_t> evict_kept_{0};
  std::atomic<uint64_t> last_pass_ms_{0};
  std::atomic<uint64_t> evict_rate_milli_{0};
  Clock::time_point last_pass_at_{};  // the maintenance thread's
  uint64_t evictions_at_last_pass_ = 0;
  std::atomic<uint64_t> atime_updates_{0};
  std::atomic<uint64_t> touch_failures_{0};
  std::atomic<uint64_t> notifies_sent_{0};
  std::atomic<uint64_t> notify_failures_{0};
  std::atomic<uint64_t> invalidations_received_{0};
  std::atomic<uint64_t> watch_errors_{0};

  std::atomic<uint64_t> ops_{0};
  std::atomic<uint64_t> kind_ops_[kKinds] = {};
  std::atomic<uint64_t> errors_{0};
  std::atomic<uint64_t> timeouts_{0};
  std::atomic<uint64_t> checksum_failures_{0};
  std::atomic<uint64_t> raw_reads_{0};
  std::atomic<uint64_t> read_bytes_{0};
  std::atomic<uint64_t> written_bytes_{0};
};

}  // namespace gdkv::rados_detail
