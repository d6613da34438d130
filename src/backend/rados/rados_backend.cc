// The rados backend: one RADOS object per key, through librados' asynchronous C++ API.
//
// Every op is a `Pending` with two owners: librados (its completion callback, or the list worker
// for List) and the in-flight list a watchdog thread scans in deadline order. Whichever first
// claims the op completes it: librados with the op's result, the watchdog with 82h once
// op_timeout_ms has passed. So a caller always hears back in time, even when the cluster is
// frozen and librados would wait, and a late librados answer is dropped. Outputs librados writes
// (read data, xattr, stat) live in the Pending, never in the caller's buffers, so a timed-out op
// that librados finishes later touches nothing the caller owns.
#include "gdkv/rados_backend.h"

#include <unistd.h>
#include <xxhash.h>
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
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/rados/rados_record.h"

namespace gdkv {

nvme::Status rados_status(int rc) noexcept {
  using nvme::Status;
  if (rc >= 0) return Status::kSuccess;
  switch (-rc) {
    case ENOENT:
      return Status::kKeyNotExist;
    case EEXIST:
      return Status::kKeyExists;
    case ENOSPC:
    case EDQUOT:
      return Status::kCapacityExceeded;
    case ETIMEDOUT:
    case ECANCELED:
    case ENOTCONN:
    case ECONNREFUSED:
    case ESHUTDOWN:  // also EBLOCKLISTED
    case EAGAIN:
      return Status::kNamespaceNotReady;
    case EFBIG:
    case E2BIG:
    case EMSGSIZE:
      return Status::kInvalidValueSize;
    case EIO:
    case EBADMSG:
    case ENODATA:
      return Status::kUnrecoveredError;
    default:
      return Status::kInternalError;
  }
}

namespace {

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
std::string ceil_seconds(uint32_t ms) { return std::to_string((ms + 999) / 1000); }

class RadosBackend final : public Backend {
 public:
  explicit RadosBackend(const RadosBackendOptions& o) : options_(o) {
    if (options_.op_timeout_ms == 0) throw std::runtime_error("rados: op_timeout_ms must be > 0");
    if (options_.evict && (options_.evict_high_percent == 0 || options_.evict_high_percent > 100 ||
                           options_.evict_low_percent >= options_.evict_high_percent ||
                           options_.evict_interval_ms == 0)) {
      throw std::runtime_error(
          "rados: eviction needs 0 < evict_low_percent < evict_high_percent <= 100 and "
          "evict_interval_ms > 0");
    }
    std::string conf = options_.ceph_conf;
    if (conf.empty()) {
      const char* env = std::getenv("CEPH_CONF");
      conf = (env != nullptr && *env != '\0') ? env : "/etc/ceph/ceph.conf";
    }
    if (::access(conf.c_str(), R_OK) != 0) {
      throw std::runtime_error("rados: cannot read Ceph config '" + conf +
                               "': " + std::strerror(errno));
    }
    const std::string where = " (config " + conf + ", " + options_.client_name + ")";
    check(rados_.init2(options_.client_name.c_str(), "ceph", 0),
          "cannot create the client" + where);
    check(rados_.conf_read_file(conf.c_str()), "cannot parse " + conf);
    if (!options_.keyring.empty()) {
      check(rados_.conf_set("keyring", options_.keyring.c_str()), "bad keyring option");
    }
    configure_timeouts();
    if (int r = rados_.connect(); r < 0) {
      std::string why = std::strerror(-r);
      if (r == -ETIMEDOUT) {
        why += ": no monitor answered within " + std::to_string(options_.connect_timeout_ms) +
               " ms; is the cluster up?";
      }
      throw std::runtime_error("rados: cannot connect to the Ceph cluster" + where + ": " + why);
    }
    if (int r = rados_.ioctx_create(options_.pool.c_str(), base_); r < 0) {
      throw std::runtime_error(
          "rados: cannot open pool '" + options_.pool + "'" + where + ": " + std::strerror(-r) +
          (r == -ENOENT ? " (scripts/ceph-cluster up creates gdkv-rep3 and gdkv-ec21)" : ""));
    }
    // Once here, where blocking is allowed (bounded by rados_mon_op_timeout): a one-shot caller
    // such as `gdkv stat` sees real numbers. Later refreshes run on the worker.
    refresh_stats();
    if (!options_.events_object.empty()) {
      // Notifications need the object; creating it is idempotent. Failure (a full pool, a
      // read-only identity) only means Deletes cannot notify, which the counters show.
      for (bool events : {true, false}) {
        librados::ObjectWriteOperation create;
        create.create(false);
        base_.operate(watch_oid(events), &create, librados::OPERATION_FULL_TRY);
      }
    }
    watchdog_ = std::thread([this] { run_watchdog(); });
    worker_.start();
    submitter_.start();
    if (options_.evict || !options_.events_object.empty()) {
      maintainer_ = std::thread([this] { run_maintenance(); });
    }
  }

  ~RadosBackend() override {
    {
      std::lock_guard lk(maint_mu_);
      stop_maint_ = true;
    }
    maint_cv_.notify_all();
    if (maintainer_.joinable()) maintainer_.join();
    unwatch_all();
    drain();  // also waits for the Stores still queued on the submit thread
    submitter_.stop();
    worker_.stop();
    {
      std::lock_guard lk(flight_mu_);
      stop_watchdog_ = true;
    }
    flight_cv_.notify_all();
    watchdog_.join();
    // Ops the watchdog completed may still wait for librados' callback (it was cancelled, so it
    // comes soon); the callbacks use this object, so it must outlive them.
    // Polled: a destructor may sleep, and a plain atomic keeps locks off the op path.
    for (int i = 1; live_.load(std::memory_order_acquire) != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (i % 10000 == 0) {
        std::fprintf(stderr, "gdkv rados: waiting for %llu librados callbacks\n",
                     static_cast<unsigned long long>(live_.load()));
      }
    }
  }

  void submit(BackendOp* op) override {
    ops_.fetch_add(1, std::memory_order_relaxed);
    const auto kind_index = static_cast<size_t>(op->kind);
    if (kind_index < kKinds) kind_ops_[kind_index].fetch_add(1, std::memory_order_relaxed);
    if (Status s = validate(*op); s != Status::kSuccess) {
      count_status(s);
      op->complete(s, 0);
      return;
    }

    auto* p = new Pending;
    p->backend = this;
    p->op = op;
    p->kind = op->kind;
    p->key = op->key;
    p->list_max = op->list_max;
    p->nsid = op->nsid;
    p->ioctx = ioctx_for(op->nsid);
    live_.fetch_add(1, std::memory_order_relaxed);
    inflight_.fetch_add(1, std::memory_order_relaxed);

    if (p->kind == BackendOpKind::kList) {
      link(p);  // the watchdog covers the op from here on
      worker_.post([this, p] { run_list(p); });
      return;
    }
    // Stores are started on the submit thread: copying and hashing the value and librados' own
    // encoding cost the caller (a reactor) ~25 us of CPU at 4 KiB and ~0.35 ms at 2 MiB, next to
    // a Store's milliseconds of replication (docs/rados.md, "Where the CPU goes"). Reads stay on
    // the caller's thread, where a hand-off would add a thread wake-up to ~0.2 ms. Every op behind
    // a queued Store queues too, so ops reach librados in the order each caller submitted them
    // (RADOS applies one client's ops on an object in that order); queued_ drops only once the
    // op is in librados' hands.
    if (p->kind == BackendOpKind::kPut || queued_.load() > 0) {
      queued_.fetch_add(1);
      submit_thread_ops_.fetch_add(1, std::memory_order_relaxed);
      submitter_.post([this, p] {
        issue(p);
        queued_.fetch_sub(1);
      });
      return;
    }
    issue(p);
  }

  // Builds the librados op for `p` and starts it. Not yet timed: the watchdog covers an op from
  // link() on, and an op queued on the submit thread waits unlinked (only CPU work is ahead of
  // it there).
  void issue(Pending* p) {
    BackendOp* op = p->op;
    // Everything that reads the caller's op happens before link(): from then on the watchdog
    // may complete it, and the caller may free it.
    p->completion = librados::Rados::aio_create_completion(p, &RadosBackend::on_complete);
    const std::string oid = op->key.hex();
    librados::ObjectWriteOperation write;
    librados::ObjectReadOperation read;
    if (p->kind == BackendOpKind::kPut) {
      prepare_put(*op, write);
      p->bytes = op->value.size();
    } else if (p->kind == BackendOpKind::kGet) {
      read.read(0, 0, &p->data, &p->read_rc);  // length 0: the whole object, one round trip
      read.getxattr(rados::kHeaderXattr, &p->xattr, &p->xattr_rc);
      read.set_op_flags2(librados::OP_FAILOK);  // a value without header still reads
      read.getxattr(rados::kAtimeXattr, &p->atime, &p->atime_rc);
      read.set_op_flags2(librados::OP_FAILOK);
    }
    link(p);

    int r = 0;
    // FULL_TRY on writes and deletes: a full pool (capacity or quota) answers ENOSPC/EDQUOT (81h)
    // at once, and deletes still go through, instead of librados parking the op until space
    // returns.
    switch (p->kind) {
      case BackendOpKind::kPut:
        r = p->ioctx->aio_operate(oid, p->completion, &write, librados::OPERATION_FULL_TRY);
        break;
      case BackendOpKind::kGet:
        r = p->ioctx->aio_operate(oid, p->completion, &read, nullptr);
        break;
      case BackendOpKind::kExists:
        r = p->ioctx->aio_stat(oid, p->completion, &p->size, &p->mtime);
        break;
      case BackendOpKind::kDelete:
        r = p->ioctx->aio_remove(oid, p->completion, librados::OPERATION_FULL_TRY);
        break;
      default:
        r = -EINVAL;
        break;
    }
    // From here on `p` may be gone (librados can call back before aio_* returns), unless librados
    // refused the op: then no callback comes.
    if (r < 0) finish_librados(p, r);
  }

  BackendInfo info() const override {
    std::lock_guard lk(info_mu_);
    if (!stats_queued_ && Clock::now() - stats_at_ > std::chrono::seconds(2)) {
      // Pool statistics are a synchronous monitor round trip: refresh them on the worker so
      // info() never blocks; callers see the previous values until the refresh lands.
      stats_queued_ = true;
      worker_.post([this] { refresh_stats(); });
    }
    return info_;
  }

  void collect(MetricList& out) const override {
    const auto counter = [&](const char* name, const char* help, uint64_t v,
                             std::vector<std::pair<std::string, std::string>> extra = {}) {
      Metric m{name, help, MetricType::kCounter, {{"backend", "rados"}}, static_cast<double>(v)};
      for (auto& l : extra) m.labels.push_back(std::move(l));
      out.push_back(std::move(m));
    };
    const auto load = [](const std::atomic<uint64_t>& a) {
      return a.load(std::memory_order_relaxed);
    };
    counter("backend_ops_total", "ops submitted to the backend", load(ops_));
    for (size_t i = 0; i < kKinds; ++i) {
      counter("rados_ops_total", "rados backend ops by kind", load(kind_ops_[i]),
              {{"op", backend_op_name(static_cast<BackendOpKind>(i))}});
    }
    counter("backend_errors_total",
            "ops that failed (statuses other than success, key not found, key exists)",
            load(errors_));
    counter("backend_timeouts_total", "ops that hit the op timeout (82h)", load(timeouts_));
    counter("backend_checksum_failures_total",
            "values whose record header or checksum did not match (88h)", load(checksum_failures_));
    counter("rados_raw_reads_total", "values read without a gdkv record header (unverified)",
            load(raw_reads_));
    counter("rados_submit_thread_ops_total",
            "ops started on the submit thread (Stores, and ops queued behind one)",
            load(submit_thread_ops_));
    counter("backend_read_bytes_total", "value bytes read", load(read_bytes_));
    counter("backend_written_bytes_total", "value bytes stored", load(written_bytes_));
    counter("rados_atime_updates_total",
            "access times refreshed by reads (at most one per block "
            "per atime interval)",
            load(atime_updates_));
    counter("rados_atime_update_failures_total", "access time refreshes that failed",
            load(touch_failures_));
    counter("rados_delete_notifies_total", "Deletes announced to the other nodes",
            load(notifies_sent_));
    counter("rados_delete_notify_failures_total",
            "delete notifications that failed or were not acknowledged by every node in time",
            load(notify_failures_));
    counter("rados_remote_deletes_total", "Deletes by other nodes this node was told of",
            load(invalidations_received_));
    counter("rados_watch_errors_total", "watches lost (notifications may have been missed)",
            load(watch_errors_));
    counter("rados_evict_passes_total", "eviction passes that found the pool over its high mark",
            load(evict_passes_));
    counter("rados_evictions_total", "blocks this node evicted from the pool", load(evictions_));
    counter("rados_evicted_bytes_total", "value bytes this node evicted", load(evicted_bytes_));
    counter("rados_evict_kept_total",
            "eviction candidates kept because they were read or stored after the scan",
            load(evict_kept_));
    const auto gauge = [&](const char* name, const char* help, double v) {
      out.push_back(Metric{name, help, MetricType::kGauge, {{"backend", "rados"}}, v});
    };
    gauge("rados_pool_fill_ratio",
          "the pool's fill at the last eviction check (of its capacity or quota, else the "
          "cluster's raw fill)",
          static_cast<double>(load(fill_ppm_)) / 1e6);
    gauge("rados_pool_used_bytes", "the pool's bytes at the last eviction check",
          static_cast<double>(load(pool_used_bytes_)));
    gauge("rados_pool_capacity_bytes", "what the pool's fill is measured against",
          static_cast<double>(load(capacity_bytes_)));
    gauge("rados_evict_nodes", "live evicting nodes sharing the last pass",
          static_cast<double>(load(members_)));
    gauge("rados_evictions_per_second",
          "blocks this node evicted per second, between its last two evicting passes",
          static_cast<double>(load(evict_rate_milli_)) / 1e3);
    gauge("rados_evict_last_pass_seconds", "duration of the last eviction pass",
          static_cast<double>(load(last_pass_ms_)) / 1e3);
    out.push_back(Metric{"backend_inflight",
                         "ops submitted and not yet completed",
                         MetricType::kGauge,
                         {{"backend", "rados"}},
                         static_cast<double>(inflight_.load(std::memory_order_relaxed))});
  }

  void drain() override {
    // RADOS acknowledges a write once every replica (or shard) has it: durable when completed.
    draining_.fetch_add(1);  // seq_cst, paired with complete(): see there
    {
      std::unique_lock lk(drain_mu_);
      drain_cv_.wait(lk, [this] { return inflight_.load() == 0; });
    }
    draining_.fetch_sub(1);
  }

 private:
  static constexpr size_t kKinds = kBackendOpKinds;

  static void check(int r, const std::string& what) {
    if (r < 0) throw std::runtime_error("rados: " + what + ": " + std::strerror(-r));
  }

  void configure_timeouts() {
    const std::string op_s = ceil_seconds(options_.op_timeout_ms);
    check(rados_.conf_set("rados_osd_op_timeout", op_s.c_str()), "rados_osd_op_timeout");
    check(rados_.conf_set("rados_mon_op_timeout", op_s.c_str()), "rados_mon_op_timeout");
    const std::string mount_s = ceil_seconds(std::max<uint32_t>(options_.connect_timeout_ms, 1));
    check(rados_.conf_set("client_mount_timeout", mount_s.c_str()), "client_mount_timeout");
    // librados only asks the monitors for a new OSD map when an op has been "laggy" for
    // objecter_timeout (default 10 s, checked every objecter_tick_interval, default 5 s): with
    // the defaults an op routed to a dead OSD outlives any sensible op timeout. Only ever lower
    // them.
    const double laggy = std::max(1.0, options_.op_timeout_ms / 3000.0);
    lower_float_option("objecter_timeout", laggy);
    lower_float_option("objecter_tick_interval", std::max(0.5, laggy / 2));
  }

  void lower_float_option(const char* name, double value) {
    std::string cur;
    if (rados_.conf_get(name, cur) == 0 && !cur.empty() &&
        std::strtod(cur.c_str(), nullptr) <= value) {
      return;
    }
    check(rados_.conf_set(name, std::to_string(value).c_str()), name);
  }

  static Status validate(const BackendOp& op) noexcept {
    switch (op.kind) {
      case BackendOpKind::kList:
        return op.key.len <= nvme::kMaxKeyLength ? Status::kSuccess : Status::kInvalidKeySize;
      case BackendOpKind::kPut:
        if (!op.key.valid()) return Status::kInvalidKeySize;
        if ((op.store_options & nvme::kStoreMustExist) &&
            (op.store_options & nvme::kStoreMustNotExist)) {
          return Status::kInvalidField;
        }
        // bufferlist lengths are 32-bit; the OSD's own limit (osd_max_object_size) is lower
        // still and comes back as EFBIG (85h).
        if (op.value.size() > UINT32_MAX / 2) return Status::kInvalidValueSize;
        return Status::kSuccess;
      case BackendOpKind::kGet:
      case BackendOpKind::kDelete:
      case BackendOpKind::kExists:
        return op.key.valid() ? Status::kSuccess : Status::kInvalidKeySize;
    }
    return Status::kInvalidField;
  }

  static void prepare_put(const BackendOp& op, librados::ObjectWriteOperation& w) {
    if (op.store_options & nvme::kStoreMustNotExist) {
      w.create(true);  // exclusive: EEXIST (89h) if the object is there
    } else if (op.store_options & nvme::kStoreMustExist) {
      w.assert_exists();  // ENOENT (87h) if it is not
    }
    // A copy, not a static buffer over the caller's value: after a timeout the caller reuses its
    // buffer while librados may still hold the message in a connection's queue.
    librados::bufferlist data;
    data.append(reinterpret_cast<const char*>(op.value.data()),
                static_cast<unsigned>(op.value.size()));
    w.write_full(data);  // whole objects: erasure-coded pools take no partial overwrites
    std::byte hdr[rados::kRecordHeaderSize];
    rados::encode_record_header(rados::make_record_header(op.key, op.value), hdr);
    librados::bufferlist hbl;
    hbl.append(reinterpret_cast<const char*>(hdr), sizeof(hdr));
    w.setxattr(rados::kHeaderXattr, hbl);  // same op: data and header land together
    librados::bufferlist abl;
    abl.append(std::to_string(wall_ms()));
    w.setxattr(rados::kAtimeXattr, abl);  // and the access time eviction orders by
  }

  static uint64_t wall_ms() {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count());
  }

  // An access time xattr's value; 0 when absent or unreadable (the coldest there is).
  static uint64_t parse_atime(const librados::bufferlist& bl, int rc) {
    if (rc < 0 || bl.length() == 0 || bl.length() > 20) return 0;
    std::string text;
    bl.begin().copy(bl.length(), text);
    return std::strtoull(text.c_str(), nullptr, 10);
  }

  // ---- background RADOS ops (access times, notifications) ----
  // Nobody waits for them; live_ keeps the backend alive until their callbacks have run.
  struct Background {
    RadosBackend* self;
    librados::AioCompletion* c = nullptr;
    std::atomic<uint64_t>* failures;
    librados::bufferlist payload;
  };
  Background* background(std::atomic<uint64_t>* failures) {
    auto* b = new Background{this, nullptr, failures, {}};
    live_.fetch_add(1, std::memory_order_relaxed);
    b->c = librados::Rados::aio_create_completion(b, [](librados::completion_t, void* arg) {
      auto* bg = static_cast<Background*>(arg);
      if (bg->c->get_return_value() < 0) bg->failures->fetch_add(1, std::memory_order_relaxed);
      bg->self->end_background(bg);
    });
    return b;
  }
  void end_background(Background* b) {
    b->c->release();
    delete b;
    live_.fetch_sub(1, std::memory_order_release);
  }

  // A read found the block's access time older than the interval: refresh it. The object must
  // still exist (assert_exists), so a touch never recreates a block deleted meanwhile.
  void touch(librados::IoCtx* io, const Key& key) {
    Background* b = background(&touch_failures_);
    librados::ObjectWriteOperation w;
    w.assert_exists();
    librados::bufferlist abl;
    abl.append(std::to_string(wall_ms()));
    w.setxattr(rados::kAtimeXattr, abl);
    atime_updates_.fetch_add(1, std::memory_order_relaxed);
    if (io->aio_operate(key.hex(), b->c, &w, librados::OPERATION_FULL_TRY) < 0) {
      touch_failures_.fetch_add(1, std::memory_order_relaxed);
      end_background(b);
    }
  }

  // Tells the other nodes' backends that `key` is gone: {nsid (le32), key length, key bytes,
  // the RADOS namespace}. Receivers with another namespace prefix (another view of the pool)
  // ignore it.
  void notify_delete(uint32_t nsid, const Key& key) {
    if (options_.events_object.empty()) return;
    Background* b = background(&notify_failures_);
    char head[5 + nvme::kMaxKeyLength];
    std::memcpy(head, &nsid, 4);
    head[4] = static_cast<char>(key.len);
    std::memcpy(head + 5, key.bytes, key.len);
    b->payload.append(head, 5 + key.len);
    b->payload.append(options_.namespace_prefix + std::to_string(nsid));
    notifies_sent_.fetch_add(1, std::memory_order_relaxed);
    if (base_.aio_notify(options_.events_object, b->c, b->payload, options_.op_timeout_ms,
                         nullptr) < 0) {
      notify_failures_.fetch_add(1, std::memory_order_relaxed);
      end_background(b);
    }
  }

  static void on_complete(librados::completion_t, void* arg) {
    auto* p = static_cast<Pending*>(arg);
    p->backend->finish_librados(p, p->completion->get_return_value());
  }

  // librados' answer for `p` (or its refusal to take the op).
  void finish_librados(Pending* p, int r) {
    if (p->claim()) {
      if (r == -ETIMEDOUT) timeouts_.fetch_add(1, std::memory_order_relaxed);
      uint64_t len = 0;
      Status s = rados_status(r);
      if (s == Status::kCapacityExceeded && p->kind == BackendOpKind::kPut && options_.evict &&
          !full_seen_.exchange(true, std::memory_order_acq_rel)) {
        maint_cv_.notify_all();  // evict now, not at the next interval
      }
      if (s == Status::kSuccess) {
        switch (p->kind) {
          case BackendOpKind::kGet:
            s = deliver(p, &len);
            break;
          case BackendOpKind::kPut:
            written_bytes_.fetch_add(p->bytes, std::memory_order_relaxed);
            break;
          case BackendOpKind::kDelete:
            notify_delete(p->nsid, p->key);  // on its way before the caller hears back
            removals_(p->nsid, p->key);
            break;
          default:
            break;
        }
      }
      release(p, s, len);
    } else {
      if (unlink(p)) unref(p);
      unref(p);
    }
  }

  // A successful read: checks the record header, then hands the value to the op (sink or view).
  Status deliver(Pending* p, uint64_t* len_out) {
    BackendOp* op = p->op;
    if (p->read_rc < 0) return rados_status(p->read_rc);
    const uint64_t len = p->data.length();
    if (p->xattr_rc == -ENODATA || (p->xattr_rc == 0 && p->xattr.length() == 0)) {
      if (!options_.allow_raw_objects) {
        checksum_failures_.fetch_add(1, std::memory_order_relaxed);
        return Status::kUnrecoveredError;
      }
      raw_reads_.fetch_add(1, std::memory_order_relaxed);
    } else if (p->xattr_rc < 0) {
      return rados_status(p->xattr_rc);
    } else {
      const auto* hb = reinterpret_cast<const std::byte*>(p->xattr.c_str());
      const auto h = rados::decode_record_header({hb, p->xattr.length()});
      // Checked before the value goes anywhere: a corrupt value is never handed out.
      if (!h || !(h->key == p->key) || h->value_len != len || h->checksum != checksum(p->data)) {
        checksum_failures_.fetch_add(1, std::memory_order_relaxed);
        return Status::kUnrecoveredError;
      }
    }
    read_bytes_.fetch_add(len, std::memory_order_relaxed);
    *len_out = len;
    if (wall_ms() >= parse_atime(p->atime, p->atime_rc) + options_.atime_interval_ms) {
      touch(p->ioctx, p->key);
    }
    if (op->sink != nullptr) {
      // One copy, from the messenger's receive buffer: msgr2 reads into buffers of its own, so a
      // bufferlist pre-filled over the caller's memory (create_static) would be replaced, not
      // filled, and the length is only known once the reply is here.
      const std::span<std::byte> dst = op->sink(op, len);
      const uint64_t n = std::min<uint64_t>(len, dst.size());
      if (n > 0)
        p->data.begin().copy(static_cast<unsigned>(n), reinterpret_cast<char*>(dst.data()));
    } else {
      // No copy: the op borrows the receive buffer, kept alive by the view.
      auto keep = std::make_shared<librados::bufferlist>(std::move(p->data));
      const char* bytes = keep->c_str();  // contiguous (rebuilds only if the reply was split)
      op->view = ValueView{{reinterpret_cast<const std::byte*>(bytes), len}, std::move(keep)};
    }
    return Status::kSuccess;
  }

  static uint64_t checksum(librados::bufferlist& bl) {
    if (bl.get_num_buffers() <= 1)
      return XXH3_64bits(bl.length() ? bl.c_str() : nullptr, bl.length());
    XXH3_state_t* st = XXH3_createState();
    XXH3_64bits_reset(st);
    for (const auto& b : bl.buffers()) XXH3_64bits_update(st, b.c_str(), b.length());
    const uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return h;
  }

  // Lists the op's namespace on the worker thread (librados has no asynchronous listing). Object
  // names that are not lower-case hex keys (foreign objects) are skipped.
  void run_list(Pending* p) {
    std::vector<Key> keys;
    int r = 0;
    librados::IoCtx& io = *p->ioctx;
    // Cursors move by pointer: librados' ObjectCursor::operator= leaks the cursor it replaces.
    auto cursor = std::make_unique<librados::ObjectCursor>(io.object_list_begin());
    const librados::ObjectCursor end = io.object_list_end();
    while (!io.object_list_is_end(*cursor)) {
      if (p->claimed.load(std::memory_order_acquire)) break;  // timed out: stop early
      std::vector<librados::ObjectItem> items;
      auto next = std::make_unique<librados::ObjectCursor>();
      r = io.object_list(*cursor, end, 1024, {}, &items, next.get());
      if (r < 0) break;
      for (const auto& item : items) {
        const auto k = Key::from_hex(item.oid);
        if (!k || k->hex() != item.oid) continue;
        if (p->key.len != 0 && compare(*k, p->key) < 0) continue;
        keys.push_back(*k);
      }
      cursor = std::move(next);
    }
    if (p->claim()) {
      Status s = rados_status(r);
      if (s == Status::kSuccess) {
        std::sort(keys.begin(), keys.end());
        if (keys.size() > p->list_max) keys.resize(p->list_max);
        p->op->keys = std::move(keys);
      }
      if (r == -ETIMEDOUT) timeouts_.fetch_add(1, std::memory_order_relaxed);
      release(p, s, 0);
    } else {
      if (unlink(p)) unref(p);
      unref(p);
    }
  }

  void refresh_stats() const {
    std::list<std::string> pools{options_.pool};
    librados::stats_map stats;
    BackendInfo i;
    i.name = "rados";
    if (rados_.get_pool_stats(pools, stats) == 0) {
      if (auto it = stats.find(options_.pool); it != stats.end()) {
        i.keys = it->second.num_objects;  // the whole pool, every namespace
        i.bytes_used = it->second.num_bytes;
      }
    }
    librados::cluster_stat_t cs{};
    if (rados_.cluster_stat(cs) == 0) i.capacity_bytes = cs.kb * 1024;  // raw, before replication
    const Fill f = read_fill();
    if (f.capacity != 0) i.bytes_used = f.used;  // one copy, not every replica
    i.fill_ratio = f.ratio;
    i.fill_capacity_bytes = f.capacity;
    i.evictions = evictions_.load(std::memory_order_relaxed);
    std::lock_guard lk(info_mu_);
    info_ = i;
    stats_at_ = Clock::now();
    stats_queued_ = false;
  }

  // The claimer of `p` from librados' side (callback or list worker) is done with it: the op is
  // taken off the in-flight list *before* the caller hears back, so the caller's next submit()
  // finds the list lock free instead of racing this thread for it.
  void release(Pending* p, Status s, uint64_t len) {
    const bool was_linked = unlink(p);
    complete(p, s, len);
    if (was_linked) unref(p);
    unref(p);
  }

  // Completes the op the caller claimed. Nothing may touch p->op afterwards.
  void complete(Pending* p, Status s, uint64_t len) {
    count_status(s);
    p->op->complete(s, len);
    // Dekker-style with drain(): both sides seq_cst, so either drain() sees inflight_ == 0 or
    // this sees draining_ > 0 and wakes it. No lock per op when nobody drains.
    if (inflight_.fetch_sub(1) == 1 && draining_.load() > 0) {
      std::lock_guard lk(drain_mu_);
      drain_cv_.notify_all();
    }
  }

  void count_status(Status s) noexcept {
    if (s != Status::kSuccess && s != Status::kKeyNotExist && s != Status::kKeyExists) {
      errors_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  void unref(Pending* p) {
    if (p->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    delete p;
    // The last touch of this object on the op path: the destructor waits for live_ == 0.
    live_.fetch_sub(1, std::memory_order_release);
  }

  // ---- in-flight list, ordered by deadline (all ops share one timeout) ----
  // The watchdog wakes at least every tick and fires ops a tick early at most, so an op ends
  // between op_timeout - tick and op_timeout. Ticking instead of waking it for each op that
  // arrives at an empty list saves a thread wake-up per op at low concurrency.
  std::chrono::milliseconds tick() const {
    return std::chrono::milliseconds(std::clamp<uint32_t>(options_.op_timeout_ms / 20, 1, 100));
  }

  void link(Pending* p) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(options_.op_timeout_ms);
    std::lock_guard lk(flight_mu_);
    // Deadlines only grow along the list: an op linked after another never expires before it.
    p->deadline = tail_ != nullptr ? std::max(deadline, tail_->deadline) : deadline;
    p->prev = tail_;
    p->next = nullptr;
    p->linked = true;
    (tail_ != nullptr ? tail_->next : head_) = p;
    tail_ = p;
  }

  // True if this call removed `p` (and so now holds the list's reference).
  bool unlink(Pending* p) {
    std::lock_guard lk(flight_mu_);
    return unlink_locked(p);
  }
  bool unlink_locked(Pending* p) {
    if (!p->linked) return false;
    (p->prev ? p->prev->next : head_) = p->next;
    (p->next ? p->next->prev : tail_) = p->prev;
    p->linked = false;
    return true;
  }

  void run_watchdog() {
    std::unique_lock lk(flight_mu_);
    std::vector<Pending*> expired;
    while (!stop_watchdog_) {
      const auto now = Clock::now();
      const auto early = now + tick();  // what expires within a tick fires now
      if (head_ == nullptr || head_->deadline > early) {
        // A copy: wait_until reads its argument after unlocking, when the op may be gone.
        const Clock::time_point wake =
            head_ == nullptr ? early : std::min(early, head_->deadline - tick());
        flight_cv_.wait_until(lk, wake);  // later than now: the head is not due within a tick
        continue;
      }
      while (head_ != nullptr && head_->deadline <= early) {
        expired.push_back(head_);
        unlink_locked(head_);
      }
      lk.unlock();
      for (Pending* p : expired) {
        if (p->claim()) {
          timeouts_.fetch_add(1, std::memory_order_relaxed);
          complete(p, Status::kNamespaceNotReady, 0);
        }
        // Frees librados' side of it; its callback then comes with ECANCELED and is dropped.
        if (p->completion != nullptr) p->ioctx->aio_cancel(p->completion);
        unref(p);
      }
      expired.clear();
      lk.lock();
    }
  }

  // ---- watches: delete notifications and the set of evicting nodes ----
  class Watcher final : public librados::WatchCtx2 {
   public:
    Watcher(RadosBackend* b, bool events) : b_(b), events_(events) {}
    void handle_notify(uint64_t notify_id, uint64_t cookie, uint64_t notifier,
                       librados::bufferlist& bl) override {
      if (events_) b_->on_notify(notifier, bl);
      librados::bufferlist none;
      b_->base_.notify_ack(b_->watch_oid(events_), notify_id, cookie, none);
    }
    void handle_error(uint64_t, int err) override { b_->on_watch_error(events_, err); }

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

 public:
  // Deletes through this node, deletes other nodes notified (only with an invalidation handler:
  // it is what watches) and this node's evictions; another node's evictions are its own feed's.
  void set_removal_handler(InvalidationHandler h) override { removals_.set(std::move(h)); }

  void set_invalidation_handler(InvalidationHandler h) override {
    const bool want = static_cast<bool>(h);
    handler_.set(std::move(h));
    if (!want || options_.events_object.empty()) return;
    std::lock_guard lk(maint_mu_);
    events_.wanted = true;
    ensure_watch(events_, true);  // now, so notifications flow from the first op on
  }

 private:
  void on_notify(uint64_t notifier, librados::bufferlist& bl) {
    if (notifier == rados_.get_instance_id()) return;  // our own Delete: the caller knows
    std::string m;
    bl.begin().copy(bl.length(), m);
    if (m.size() < 6) return;
    uint32_t nsid = 0;
    std::memcpy(&nsid, m.data(), 4);
    Key key;
    key.len = static_cast<uint8_t>(m[4]);
    if (nsid == 0 || key.len == 0 || key.len > nvme::kMaxKeyLength || m.size() < 5u + key.len) {
      return;
    }
    std::memcpy(key.bytes, m.data() + 5, key.len);
    if (m.compare(5 + key.len, std::string::npos,
                  options_.namespace_prefix + std::to_string(nsid)) != 0) {
      return;  // another view of the pool
    }
    invalidations_received_.fetch_add(1, std::memory_order_relaxed);
    handler_(nsid, key);
    removals_(nsid, key);
  }

  // The watch broke (our session to its OSD was lost for longer than the watch timeout, or
  // notifications may have been missed): notifications may have been lost, so whoever keeps
  // copies drops or rechecks them all, now and again once the watch is back.
  void on_watch_error(bool events, int err) {
    watch_errors_.fetch_add(1, std::memory_order_relaxed);
    std::fprintf(stderr, "gdkv rados: watch on %s lost (%s); re-establishing\n",
                 watch_oid(events).c_str(), std::strerror(-err));
    {
      std::lock_guard lk(maint_mu_);
      Watch& w = events ? events_ : evictors_;
      w.live = false;
      w.lost = true;
    }
    maint_cv_.notify_all();
    if (events) {
      handler_(0, Key{});
      removals_(0, Key{});
    }
  }

  // REQUIRES: maint_mu_ held. Blocks for up to the op timeout.
  void ensure_watch(Watch& w, bool events) {
    if (!w.wanted || w.live) return;
    if (w.ctx) {
      base_.unwatch2(w.handle);  // the broken one; its error is of no interest
      w.ctx.reset();
    }
    w.ctx = std::make_unique<Watcher>(this, events);
    const int r = base_.watch2(watch_oid(events), &w.handle, w.ctx.get());
    if (r < 0) {
      w.ctx.reset();
      return;  // retried by the maintenance thread
    }
    const bool again = w.lost;
    w.live = true;
    w.lost = false;
    // A watch that had broken is back: what was deleted in between was not notified.
    if (events && again) {
      handler_(0, Key{});
      removals_(0, Key{});
    }
  }

  // REQUIRES: the maintenance thread has stopped (nothing re-establishes a watch meanwhile).
  void unwatch_all() {
    {
      std::lock_guard lk(maint_mu_);
      for (Watch* w : {&events_, &evictors_}) {
        if (w->ctx) base_.unwatch2(w->handle);
        w->live = false;
        w->wanted = false;
      }
    }
    // Outside the lock: a callback still running (on_watch_error takes maint_mu_) must finish
    // before the flush returns. No watch callback runs after this.
    rados_.watch_flush();
    std::lock_guard lk(maint_mu_);
    events_.ctx.reset();
    evictors_.ctx.reset();
  }

  // Re-establishes broken watches (every second) and runs eviction passes.
  void run_maintenance() {
    std::unique_lock lk(maint_mu_);
    evictors_.wanted = options_.evict;
    auto next_pass = Clock::now() + std::chrono::milliseconds(options_.evict_interval_ms);
    while (!stop_maint_) {
      ensure_watch(events_, true);
      ensure_watch(evictors_, false);
      const auto wake = std::min(next_pass, Clock::now() + std::chrono::seconds(1));
      maint_cv_.wait_until(lk, wake, [this] { return stop_maint_ || full_seen_.load(); });
      if (stop_maint_ || !options_.evict) continue;
      if (Clock::now() < next_pass && !full_seen_.load()) continue;
      lk.unlock();
      evict_pass();
      lk.lock();
      next_pass = Clock::now() + std::chrono::milliseconds(options_.evict_interval_ms);
    }
  }

  // ---- eviction ----
  struct Fill {
    uint64_t used = 0;      // the pool's bytes
    uint64_t capacity = 0;  // what they are measured against (0: unknown)
    double ratio = 0;       // used / capacity, or the cluster's raw fill
    bool quota = false;     // capacity is a byte budget (configured or the pool's quota)
  };

  // The pool's stored bytes (one copy: what quotas count; librados' pool statistics count every
  // replica) and the bytes it can still take (max_avail: the cluster's free space over the pool's
  // replication or coding, below the full ratio), from the monitor's `df`.
  bool pool_df(uint64_t* stored, uint64_t* max_avail) const {
    librados::bufferlist in, out;
    std::string outs;
    if (rados_.mon_command(R"({"prefix": "df", "format": "json"})", in, &out, &outs) < 0) {
      return false;
    }
    const std::string json(out.c_str(), out.length());
    size_t at = std::string::npos;
    for (const char* form : {"\"name\":\"", "\"name\": \""}) {
      at = json.find(form + options_.pool + "\"");
      if (at != std::string::npos) break;
    }
    if (at == std::string::npos) return false;
    const auto number = [&](const char* field, uint64_t* v) {
      const auto f = json.find(field, at);
      if (f == std::string::npos) return false;
      *v = std::strtoull(json.c_str() + f + std::strlen(field), nullptr, 10);  // skips spaces
      return true;
    };
    return number("\"stored\":", stored) && number("\"max_avail\":", max_avail);
  }

  Fill read_fill() const {
    Fill f;
    uint64_t avail = 0;
    if (!pool_df(&f.used, &avail)) return f;
    f.capacity = options_.pool_capacity_bytes;
    if (f.capacity == 0) f.capacity = pool_quota();
    f.quota = f.capacity != 0;
    if (!f.quota) f.capacity = f.used + avail;  // what the pool holds and can still take
    if (f.capacity != 0) f.ratio = static_cast<double>(f.used) / static_cast<double>(f.capacity);
    return f;
  }

  // The pool's byte quota (0: none or unknown).
  uint64_t pool_quota() const {
    const std::string cmd =
        R"({"prefix": "osd pool get-quota", "pool": ")" + options_.pool + R"(", "format": "json"})";
    librados::bufferlist in, out;
    std::string outs;
    if (rados_.mon_command(cmd, in, &out, &outs) < 0) return 0;
    const std::string json(out.c_str(), out.length());
    const auto at = json.find("\"quota_max_bytes\":");
    if (at == std::string::npos) return 0;
    return std::strtoull(json.c_str() + at + 18, nullptr, 10);
  }

  // The live evicting nodes, sorted, and our place among them; false if we are not among them.
  bool membership(size_t* index, size_t* count) {
    std::list<obj_watch_t> watchers;
    if (base_.list_watchers(watch_oid(false), &watchers) < 0) return false;
    std::vector<uint64_t> ids;
    for (const auto& w : watchers) ids.push_back(static_cast<uint64_t>(w.watcher_id));
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    const auto me = std::find(ids.begin(), ids.end(), rados_.get_instance_id());
    if (me == ids.end()) return false;
    *index = static_cast<size_t>(me - ids.begin());
    *count = ids.size();
    return true;
  }

  struct Candidate {
    std::string nspace;
    std::string oid;
    uint64_t size = 0;
    time_t mtime = 0;
    librados::bufferlist atime;
    int stat_rc = 0;
    int atime_rc = 0;
    uint64_t atime_ms = 0;
  };

  // An evicted object as the key it held (its name is the key's hex; its RADOS namespace
  // namespace_prefix + nsid).
  void report_eviction(const Candidate& c) {
    const std::string& pre = options_.namespace_prefix;
    const auto k = Key::from_hex(c.oid);
    if (!k || c.nspace.size() <= pre.size() || c.nspace.compare(0, pre.size(), pre) != 0) return;
    uint32_t nsid = 0;
    for (size_t i = pre.size(); i < c.nspace.size(); ++i) {
      const char ch = c.nspace[i];
      if (ch < '0' || ch > '9' || nsid > 100000000) return;
      nsid = nsid * 10 + static_cast<uint32_t>(ch - '0');
    }
    if (nsid != 0) removals_(nsid, *k);
  }

  librados::IoCtx& evict_ioctx(const std::string& nspace) {
    auto& io = evict_ns_[nspace];
    if (!io) {
      io = std::make_unique<librados::IoCtx>();
      io->dup(base_);
      io->set_namespace(nspace);
    }
    return *io;
  }

  // Runs `issue` for items [0, n) with at most kWindow RADOS ops in flight; each returns its
  // completion (nullptr: nothing issued). Every completion has been waited for on return.
  template <typename Issue, typename Done>
  static void windowed(size_t n, Issue issue, Done done) {
    constexpr size_t kWindow = 64;
    std::deque<std::pair<size_t, librados::AioCompletion*>> flight;
    auto reap = [&] {
      auto [i, c] = flight.front();
      flight.pop_front();
      c->wait_for_complete();
      done(i, c->get_return_value());
      c->release();
    };
    for (size_t i = 0; i < n; ++i) {
      if (flight.size() == kWindow) reap();
      if (librados::AioCompletion* c = issue(i)) flight.emplace_back(i, c);
    }
    while (!flight.empty()) reap();
  }

  // One pass: if the pool is past the high watermark, this node removes the coldest blocks of
  // its slice of the hash space until its slice is at the low watermark's share. Each removal is
  // conditional on the access time the scan saw (cmpxattr), so a block read or stored since is
  // kept. A node that dies mid-pass leaves its slice to the next membership.
  void evict_pass() {
    const auto t0 = Clock::now();
    const Fill f = read_fill();
    fill_ppm_.store(static_cast<uint64_t>(f.ratio * 1e6), std::memory_order_relaxed);
    capacity_bytes_.store(f.capacity, std::memory_order_relaxed);
    pool_used_bytes_.store(f.used, std::memory_order_relaxed);
    // A Store refused for space (81h) forces the pass: the pool is full in the monitor's view,
    // whatever the statistics, which lag, say.
    const bool forced = full_seen_.exchange(false, std::memory_order_acq_rel);
    if (f.capacity == 0 || (f.ratio * 100 < options_.evict_high_percent && !forced)) return;
    size_t index = 0, count = 1;
    if (!membership(&index, &count)) return;  // our watch is not (yet) in: skip this pass
    members_.store(count, std::memory_order_relaxed);
    evict_passes_.fetch_add(1, std::memory_order_relaxed);

    // Scan our slice: every gdkv object's size and access time.
    librados::IoCtx all;
    all.dup(base_);
    all.set_namespace(librados::all_nspaces);
    librados::ObjectCursor start, finish;
    all.object_list_slice(all.object_list_begin(), all.object_list_end(), index, count, &start,
                          &finish);
    std::vector<Candidate> cands;
    auto cursor = std::make_unique<librados::ObjectCursor>(start);
    while (!all.object_list_is_end(*cursor) && *cursor < finish) {
      std::vector<librados::ObjectItem> items;
      auto next = std::make_unique<librados::ObjectCursor>();
      if (all.object_list(*cursor, finish, 1024, {}, &items, next.get()) < 0) return;
      for (auto& item : items) {
        if (item.nspace.rfind(options_.namespace_prefix, 0) != 0) continue;
        const auto k = Key::from_hex(item.oid);
        if (!k || k->hex() != item.oid) continue;
        cands.push_back(Candidate{item.nspace, item.oid, 0, 0, {}, 0, 0, 0});
      }
      if (items.empty()) break;
      cursor = std::move(next);
    }
    std::vector<std::unique_ptr<librados::ObjectReadOperation>> reads(cands.size());
    windowed(
        cands.size(),
        [&](size_t i) -> librados::AioCompletion* {
          Candidate& c = cands[i];
          reads[i] = std::make_unique<librados::ObjectReadOperation>();
          reads[i]->stat(&c.size, &c.mtime, &c.stat_rc);
          reads[i]->getxattr(rados::kAtimeXattr, &c.atime, &c.atime_rc);
          reads[i]->set_op_flags2(librados::OP_FAILOK);
          auto* comp = librados::Rados::aio_create_completion();
          if (evict_ioctx(c.nspace).aio_operate(c.oid, comp, reads[i].get(), nullptr) < 0) {
            comp->release();
            c.stat_rc = -EIO;
            return nullptr;
          }
          return comp;
        },
        [&](size_t i, int r) {
          if (r < 0) cands[i].stat_rc = r;
          cands[i].atime_ms = parse_atime(cands[i].atime, cands[i].atime_rc);
        });
    reads.clear();
    std::erase_if(cands, [](const Candidate& c) { return c.stat_rc < 0; });
    uint64_t slice_bytes = 0;
    for (const auto& c : cands) slice_bytes += c.size;

    // Our slice's share of the low watermark.
    const double low = options_.evict_low_percent / 100.0;
    uint64_t target = 0;
    if (f.quota) {
      target =
          static_cast<uint64_t>(low * static_cast<double>(f.capacity) / static_cast<double>(count));
    } else {
      const double fill = std::max(f.ratio, options_.evict_high_percent / 100.0);
      target = static_cast<uint64_t>(static_cast<double>(slice_bytes) * low / fill);
    }
    if (slice_bytes <= target) return;  // the statistics were behind: nothing to do
    const uint64_t to_free = slice_bytes - target;

    std::sort(cands.begin(), cands.end(), [](const Candidate& a, const Candidate& b) {
      return a.atime_ms != b.atime_ms ? a.atime_ms < b.atime_ms : a.size > b.size;
    });
    uint64_t freed = 0, planned = 0;
    size_t next = 0;
    while (freed < to_free && next < cands.size()) {
      // Plan as many removals as would free the rest if they all succeed; a block touched
      // since the scan (ECANCELED) or gone (ENOENT) frees nothing, and the next round goes on.
      const size_t first = next;
      planned = freed;
      while (planned < to_free && next < cands.size()) planned += cands[next++].size;
      std::vector<std::unique_ptr<librados::ObjectWriteOperation>> writes(next - first);
      windowed(
          next - first,
          [&](size_t i) -> librados::AioCompletion* {
            const Candidate& c = cands[first + i];
            writes[i] = std::make_unique<librados::ObjectWriteOperation>();
            if (c.atime_rc == 0 && c.atime.length() != 0) {
              writes[i]->cmpxattr(rados::kAtimeXattr, LIBRADOS_CMPXATTR_OP_EQ, c.atime);
            }
            writes[i]->remove();
            auto* comp = librados::Rados::aio_create_completion();
            if (evict_ioctx(c.nspace).aio_operate(c.oid, comp, writes[i].get(),
                                                  librados::OPERATION_FULL_TRY) < 0) {
              comp->release();
              return nullptr;
            }
            return comp;
          },
          [&](size_t i, int r) {
            const Candidate& c = cands[first + i];
            if (r == 0) {
              freed += c.size;
              evictions_.fetch_add(1, std::memory_order_relaxed);
              report_eviction(c);
              evicted_bytes_.fetch_add(c.size, std::memory_order_relaxed);
            } else if (r == -ECANCELED) {
              evict_kept_.fetch_add(1, std::memory_order_relaxed);
            }
          });
    }
    const auto now = Clock::now();
    const double since = std::chrono::duration<double>(now - last_pass_at_).count();
    if (last_pass_at_ != Clock::time_point{} && since > 0) {
      evict_rate_milli_.store(
          static_cast<uint64_t>(static_cast<double>(evictions_.load() - evictions_at_last_pass_) /
                                since * 1e3),
          std::memory_order_relaxed);
    }
    last_pass_at_ = now;
    evictions_at_last_pass_ = evictions_.load();
    last_pass_ms_.store(
        static_cast<uint64_t>(
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count()),
        std::memory_order_relaxed);
  }

  librados::IoCtx* ioctx_for(uint32_t nsid) {
    {
      std::shared_lock lk(ns_mu_);
      if (auto it = ns_.find(nsid); it != ns_.end()) return it->second.get();
    }
    // One IoCtx per namespace: set_namespace changes shared state, so no per-op switching.
    std::unique_lock lk(ns_mu_);
    auto& slot = ns_[nsid];
    if (!slot) {
      slot = std::make_unique<librados::IoCtx>();
      slot->dup(base_);
      slot->set_namespace(options_.namespace_prefix + std::to_string(nsid));
    }
    return slot.get();
  }

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

}  // namespace

Result<std::shared_ptr<Backend>> make_rados_backend(const RadosBackendOptions& options) {
  return catch_error(
      [&]() -> std::shared_ptr<Backend> { return std::make_shared<RadosBackend>(options); });
}

}  // namespace gdkv
