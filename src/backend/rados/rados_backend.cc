// The rados backend: one RADOS object per key, through librados' asynchronous C++ API.
// This file holds the data path: construction, ops from submit() to their completion, the
// in-flight list and its watchdog. rados_internal.h declares the class; watches, eviction and
// metrics are in rados_watch.cc, rados_evict.cc and rados_metrics.cc.
//
// Every op is a `Pending` with two owners: librados (its completion callback, or the list worker
// for List) and the in-flight list a watchdog thread scans in deadline order. Whichever first
// claims the op completes it: librados with the op's result, the watchdog with 82h once
// ceph_timeout_ms has passed. So a caller always hears back in time, even when the cluster is
// frozen and librados would wait, and a late librados answer is dropped. Outputs librados writes
// (read data, xattr, stat) live in the Pending, never in the caller's buffers, so a timed-out op
// that librados finishes later touches nothing the caller owns.
#include "gdkv/rados_backend.h"

#include <unistd.h>
#include <xxhash.h>

#include "backend/rados/rados_internal.h"

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

namespace rados_detail {

RadosBackend::RadosBackend(const RadosBackendOptions& o) : options_(o), quotas_(o.quotas.size()) {
  if (options_.ceph_timeout_ms == 0) throw std::runtime_error("rados: ceph_timeout_ms must be > 0");
  size_t qi = 0;
  for (const auto& [nsid, limit] : options_.quotas) {
    quotas_[qi].nsid = nsid;
    quotas_[qi].nspace = options_.namespace_prefix + std::to_string(nsid);
    quotas_[qi].limit = limit;
    ++qi;
  }
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
  check(rados_.init2(options_.client_name.c_str(), "ceph", 0), "cannot create the client" + where);
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

RadosBackend::~RadosBackend() {
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

void RadosBackend::submit(BackendOp* op) {
  ops_.fetch_add(1, std::memory_order_relaxed);
  const auto kind_index = static_cast<size_t>(op->kind);
  if (kind_index < kKinds) kind_ops_[kind_index].fetch_add(1, std::memory_order_relaxed);
  Status s = validate(*op);
  // A value larger than its namespace's quota could never be held: refused now, not evicted
  // by the next pass (eviction counts an object's size, the value's bytes).
  if (s == Status::kSuccess && op->kind == BackendOpKind::kPut) {
    const auto q = options_.quotas.find(op->nsid);
    if (q != options_.quotas.end() && op->value.size() > q->second) {
      s = Status::kCapacityExceeded;
    }
  }
  if (s != Status::kSuccess) {
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
void RadosBackend::issue(Pending* p) {
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

BackendInfo RadosBackend::info() const {
  std::lock_guard lk(info_mu_);
  if (!stats_queued_ && Clock::now() - stats_at_ > std::chrono::seconds(2)) {
    // Pool statistics are a synchronous monitor round trip: refresh them on the worker so
    // info() never blocks; callers see the previous values until the refresh lands.
    stats_queued_ = true;
    worker_.post([this] { refresh_stats(); });
  }
  return info_;
}

void RadosBackend::drain() {
  // RADOS acknowledges a write once every replica (or shard) has it: durable when completed.
  draining_.fetch_add(1);  // seq_cst, paired with complete(): see there
  {
    std::unique_lock lk(drain_mu_);
    drain_cv_.wait(lk, [this] { return inflight_.load() == 0; });
  }
  draining_.fetch_sub(1);
}

void RadosBackend::check(int r, const std::string& what) {
  if (r < 0) throw std::runtime_error("rados: " + what + ": " + std::strerror(-r));
}

void RadosBackend::configure_timeouts() {
  const std::string op_s = ceil_seconds(options_.ceph_timeout_ms);
  check(rados_.conf_set("rados_osd_op_timeout", op_s.c_str()), "rados_osd_op_timeout");
  check(rados_.conf_set("rados_mon_op_timeout", op_s.c_str()), "rados_mon_op_timeout");
  const std::string mount_s = ceil_seconds(std::max<uint32_t>(options_.connect_timeout_ms, 1));
  check(rados_.conf_set("client_mount_timeout", mount_s.c_str()), "client_mount_timeout");
  // librados only asks the monitors for a new OSD map when an op has been "laggy" for
  // objecter_timeout (default 10 s, checked every objecter_tick_interval, default 5 s): with
  // the defaults an op routed to a dead OSD outlives any sensible op timeout. Only ever lower
  // them.
  const double laggy = std::max(1.0, options_.ceph_timeout_ms / 3000.0);
  lower_float_option("objecter_timeout", laggy);
  lower_float_option("objecter_tick_interval", std::max(0.5, laggy / 2));
}

void RadosBackend::lower_float_option(const char* name, double value) {
  std::string cur;
  if (rados_.conf_get(name, cur) == 0 && !cur.empty() &&
      std::strtod(cur.c_str(), nullptr) <= value) {
    return;
  }
  check(rados_.conf_set(name, std::to_string(value).c_str()), name);
}

Status RadosBackend::validate(const BackendOp& op) noexcept {
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

void RadosBackend::prepare_put(const BackendOp& op, librados::ObjectWriteOperation& w) {
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

uint64_t RadosBackend::wall_ms() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

// An access time xattr's value; 0 when absent or unreadable (the coldest there is).
uint64_t RadosBackend::parse_atime(const librados::bufferlist& bl, int rc) {
  if (rc < 0 || bl.length() == 0 || bl.length() > 20) return 0;
  std::string text;
  bl.begin().copy(bl.length(), text);
  return std::strtoull(text.c_str(), nullptr, 10);
}

void RadosBackend::on_complete(librados::completion_t, void* arg) {
  auto* p = static_cast<Pending*>(arg);
  p->backend->finish_librados(p, p->completion->get_return_value());
}

// librados' answer for `p` (or its refusal to take the op).
void RadosBackend::finish_librados(Pending* p, int r) {
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
Status RadosBackend::deliver(Pending* p, uint64_t* len_out) {
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
    if (n > 0) p->data.begin().copy(static_cast<unsigned>(n), reinterpret_cast<char*>(dst.data()));
  } else {
    // No copy: the op borrows the receive buffer, kept alive by the view.
    auto keep = std::make_shared<librados::bufferlist>(std::move(p->data));
    const char* bytes = keep->c_str();  // contiguous (rebuilds only if the reply was split)
    op->view = ValueView{{reinterpret_cast<const std::byte*>(bytes), len}, std::move(keep)};
  }
  return Status::kSuccess;
}

uint64_t RadosBackend::checksum(librados::bufferlist& bl) {
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
void RadosBackend::run_list(Pending* p) {
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

// The claimer of `p` from librados' side (callback or list worker) is done with it: the op is
// taken off the in-flight list *before* the caller hears back, so the caller's next submit()
// finds the list lock free instead of racing this thread for it.
void RadosBackend::release(Pending* p, Status s, uint64_t len) {
  const bool was_linked = unlink(p);
  complete(p, s, len);
  if (was_linked) unref(p);
  unref(p);
}

// Completes the op the caller claimed. Nothing may touch p->op afterwards.
void RadosBackend::complete(Pending* p, Status s, uint64_t len) {
  count_status(s);
  p->op->complete(s, len);
  // Dekker-style with drain(): both sides seq_cst, so either drain() sees inflight_ == 0 or
  // this sees draining_ > 0 and wakes it. No lock per op when nobody drains.
  if (inflight_.fetch_sub(1) == 1 && draining_.load() > 0) {
    std::lock_guard lk(drain_mu_);
    drain_cv_.notify_all();
  }
}

void RadosBackend::unref(Pending* p) {
  if (p->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  delete p;
  // The last touch of this object on the op path: the destructor waits for live_ == 0.
  live_.fetch_sub(1, std::memory_order_release);
}

// ---- in-flight list, ordered by deadline (all ops share one timeout) ----
// The watchdog wakes at least every tick and fires ops a tick early at most, so an op ends
// between op_timeout - tick and op_timeout. Ticking instead of waking it for each op that
// arrives at an empty list saves a thread wake-up per op at low concurrency.
std::chrono::milliseconds RadosBackend::tick() const {
  return std::chrono::milliseconds(std::clamp<uint32_t>(options_.ceph_timeout_ms / 20, 1, 100));
}

void RadosBackend::link(Pending* p) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(options_.ceph_timeout_ms);
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
bool RadosBackend::unlink(Pending* p) {
  std::lock_guard lk(flight_mu_);
  return unlink_locked(p);
}

bool RadosBackend::unlink_locked(Pending* p) {
  if (!p->linked) return false;
  (p->prev ? p->prev->next : head_) = p->next;
  (p->next ? p->next->prev : tail_) = p->prev;
  p->linked = false;
  return true;
}

void RadosBackend::run_watchdog() {
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

librados::IoCtx* RadosBackend::ioctx_for(uint32_t nsid) {
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

}  // namespace rados_detail

Result<std::shared_ptr<Backend>> make_rados_backend(const RadosBackendOptions& options) {
  return catch_error([&]() -> std::shared_ptr<Backend> {
    return std::make_shared<rados_detail::RadosBackend>(options);
  });
}

}  // namespace gdkv
