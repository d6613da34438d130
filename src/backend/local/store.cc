// The local store: opening, submission, metrics and the I/O thread's loop (see store.h).
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <future>
#include <random>

#include "backend/local/store.h"

namespace gdkv::local {

// ================================================================================================
// Open
// ================================================================================================

LocalStore::LocalStore(const LocalBackendOptions& o, IoHook* hook)
    : preallocate_(o.preallocate), quotas_(o.quotas), hook_(hook) {
  if (o.segment_bytes < 16 * kBlock || o.segment_bytes % kBlock != 0 ||
      o.segment_bytes > (1u << 31)) {
    throw std::runtime_error(
        "local store: segment_bytes must be a multiple of 4096 between 64 KiB and 2 GiB");
  }
  auto cleanup = [this] {
    if (arena_ != nullptr) ::munmap(arena_, arena_bytes_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
    if (fd_ >= 0) ::close(fd_);
  };
  try {
    open_file(o);
    load_or_create_superblock(o);
    check_quotas(o);
    for (const auto& [nsid, quota] : quotas_) {
      NsState& n = ns_[nsid];
      n.limited = true;
      n.quota = quota;
    }
    arena_bytes_ =
        size_t{kStageChunks} * kStageBytes + size_t{kBounceCount} * kBounceBytes + kBlock;
    void* a = ::mmap(nullptr, arena_bytes_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (a == MAP_FAILED) fail("cannot map the I/O buffer arena", errno);
    arena_ = static_cast<std::byte*>(a);
    for (uint32_t i = kBounceCount; i-- > 0;) bounce_free_.push_back(i);
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC);
    if (wake_fd_ < 0) fail("eventfd", errno);
  } catch (...) {
    cleanup();
    throw;
  }
  // The I/O thread creates the ring, so the ring can be single-issuer (see Uring), and rebuilds
  // the index with it; open returns once the store is ready, or rethrows why it is not.
  std::promise<void> ready;
  std::future<void> started = ready.get_future();
  const unsigned entries = std::clamp<unsigned>(o.queue_depth, 64, 4096);
  thread_ = std::thread([this, entries, &ready] { run(entries, ready); });
  try {
    started.get();
  } catch (...) {
    thread_.join();
    cleanup();
    throw;
  }
}

LocalStore::~LocalStore() {
  stopping_.store(true);
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t r = ::write(wake_fd_, &one, sizeof(one));
  thread_.join();
  ::munmap(arena_, arena_bytes_);
  ::close(wake_fd_);
  ::close(fd_);  // also drops the flock
}

void LocalStore::open_file(const LocalBackendOptions& o) {
  namespace fs = std::filesystem;
  if (o.path.empty()) throw std::runtime_error("local store: no path given");
  struct stat st {};
  if (::stat(o.path.c_str(), &st) == 0 && S_ISBLK(st.st_mode)) {
    blockdev_ = true;
    file_ = o.path;
  } else if (::stat(o.path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
    file_ = o.path;
  } else {
    std::error_code ec;
    fs::create_directories(o.path, ec);
    if (ec) throw std::runtime_error("local store: cannot create " + o.path + ": " + ec.message());
    file_ = (fs::path(o.path) / kStoreFileName).string();
  }
  const int flags = O_RDWR | O_CLOEXEC | (blockdev_ ? 0 : O_CREAT);
  fd_ = ::open(file_.c_str(), flags | O_DIRECT, 0644);
  if (fd_ < 0 && errno == EINVAL) {
    // The file system refuses O_DIRECT (e.g. tmpfs before Linux 6.6). Buffered I/O with
    // fdatasync keeps every guarantee but the zero-copy read; local_direct_io reports it.
    direct_io_ = false;
    fd_ = ::open(file_.c_str(), flags, 0644);
  }
  if (fd_ < 0) fail("cannot open " + file_, errno);
  int locked = ::flock(fd_, LOCK_EX | LOCK_NB);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(o.lock_wait_ms);
  while (locked != 0 && errno == EWOULDBLOCK && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    locked = ::flock(fd_, LOCK_EX | LOCK_NB);
  }
  if (locked != 0) {
    const int e = errno;
    ::close(fd_);
    fd_ = -1;
    if (e == EWOULDBLOCK) {
      throw std::runtime_error(
          "local store: " + file_ +
          " is in use by another process (or already open in this one): it holds the "
          "store's lock, and a store can be open once at a time");
    }
    fail("cannot lock " + file_, e);
  }
  if (blockdev_) {
    int ssz = 0;
    if (::ioctl(fd_, BLKSSZGET, &ssz) == 0 && ssz > 0) io_align_ = mem_align_ = ssz;
    if (::ioctl(fd_, BLKGETSIZE64, &file_size_) != 0) fail("cannot size " + file_, errno);
  } else {
    struct statx sx {};
    if (::statx(fd_, "", AT_EMPTY_PATH, STATX_DIOALIGN | STATX_SIZE, &sx) != 0) {
      fail("cannot stat " + file_, errno);
    }
    file_size_ = sx.stx_size;
    if ((sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_offset_align != 0) {
      io_align_ = sx.stx_dio_offset_align;
      mem_align_ = sx.stx_dio_mem_align;
    }
  }
  if (!direct_io_) io_align_ = mem_align_ = 1;
  if (io_align_ > kBlock || kBlock % io_align_ != 0) {
    throw std::runtime_error("local store: " + file_ + " needs " + std::to_string(io_align_) +
                             "-byte aligned direct I/O; the store supports at most 4096");
  }
  mem_align_ = std::max<uint32_t>(mem_align_, 1);
}

ssize_t LocalStore::io_write_sync(const std::byte* buf, uint32_t n, uint64_t off) {
  if (hook_ != nullptr) {
    const int64_t r = hook_->write(off, buf, n);
    if (r < 0) {
      errno = static_cast<int>(-r);
      return -1;
    }
    n = static_cast<uint32_t>(std::min<int64_t>(r, n));
  }
  return ::pwrite(fd_, buf, n, static_cast<off_t>(off));
}

int LocalStore::io_datasync_sync() {
  if (hook_ != nullptr) {
    if (const int r = hook_->sync(); r < 0) {
      errno = -r;
      return -1;
    }
  }
  return ::fdatasync(fd_);
}

void LocalStore::load_or_create_superblock(const LocalBackendOptions& o) {
  AlignedBuf blk = alloc_aligned(kBlock, kBlock);
  ssize_t r = 0;
  if (file_size_ >= kBlock) r = ::pread(fd_, blk.get(), kBlock, 0);
  if (r < 0) fail("cannot read " + file_, errno);
  std::optional<Superblock> sb;
  if (r == kBlock) sb = parse_superblock(blk.get());
  if (!sb) {
    const bool zero = r == kBlock && std::all_of(blk.get(), blk.get() + kBlock,
                                                 [](std::byte b) { return b == std::byte{0}; });
    // Blank: a new file, one whose creation was cut short, or a zeroed device.
    const bool blank = file_size_ == 0 || zero || (!blockdev_ && file_size_ < kBlock);
    if (!blank) {
      throw std::runtime_error(
          "local store: " + file_ +
          " is not a gdkv store (no valid superblock); refusing to overwrite "
          "it" +
          (blockdev_ ? " (zero its first 4 KiB to let gdkv use the device)" : ""));
    }
  }
  // An existing store keeps the segment size it was created with.
  seg_bytes_ = sb ? sb->segment_bytes : o.segment_bytes;
  max_value_ = seg_bytes_ - 2 * kBlock;
  // Before a new store writes anything: a file system without room for one segment is refused
  // with the sizes, instead of a store that fails every Store.
  size_segments(o);
  if (!sb) {
    Superblock s{};
    s.magic = kSuperMagic;
    s.version = kFormatVersion;
    s.block_bytes = kBlock;
    s.segment_bytes = o.segment_bytes;
    std::random_device rd;
    s.store_id = (uint64_t{rd()} << 32 | rd()) | 1;
    s.created_ns = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch() /
                                         std::chrono::nanoseconds(1));
    seal(s);
    std::memset(blk.get(), 0, kBlock);
    std::memcpy(blk.get(), &s, sizeof(s));
    if (io_write_sync(blk.get(), kBlock, 0) != kBlock) fail("cannot write " + file_, errno);
    if (io_datasync_sync() != 0) fail("cannot sync " + file_, errno);
    if (!blockdev_) {
      // The new file's directory entry must be durable too, or a crash could lose the store.
      const std::string dir = std::filesystem::path(file_).parent_path().string();
      const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (dfd >= 0) {
        ::fsync(dfd);
        ::close(dfd);
      }
      file_size_ = std::max<uint64_t>(file_size_, kBlock);
    }
    sb = s;
  }
  store_id_ = sb->store_id;
  segments_.resize(nseg_);
  for (uint32_t i = 0; i < nseg_; ++i) {
    // Space within the file is reserved when the store preallocates (it only ever extends the
    // file by fallocate then); a sparse store learns about holes from ENOSPC on write.
    segments_[i].reserved = blockdev_ || (preallocate_ && seg_base(i) + seg_bytes_ <= file_size_);
  }
  capacity_.store(uint64_t{nseg_} * seg_bytes_);
}

// Copy-forward (write_path.cc) must always end: the values of limited namespaces, packed by the
// copies into full batches, must leave room in the log beside the head and the segment being
// reclaimed. Rule: the quotas sum to at most (segments - 2) x (segment_bytes - segment_bytes/16),
// the 1/16 for segment and batch headers and the header blocks of batches.
void LocalStore::check_quotas(const LocalBackendOptions& o) const {
  if (quotas_.empty()) return;
  uint64_t sum = 0;
  for (const auto& [nsid, q] : quotas_) sum += q;
  const uint64_t room = nseg_ > 2 ? uint64_t{nseg_ - 2} * (seg_bytes_ - seg_bytes_ / 16) : 0;
  if (sum > room) {
    throw std::runtime_error(
        "local store: " + file_ + ": the namespace quotas sum to " + std::to_string(sum) +
        " bytes, more than the " + std::to_string(room) + " bytes the log can keep for them (" +
        std::to_string(nseg_) + " segments of " + std::to_string(seg_bytes_) +
        " bytes: quotas may sum to at most (segments - 2) x 15/16 of a segment, so that the "
        "values of namespaces with a quota can always be copied forward out of the segment being "
        "reclaimed); lower the quotas or raise capacity_bytes (configured " +
        std::to_string(o.capacity_bytes) + ")");
  }
}

// The number of segments: what capacity_bytes asks for, but no more than the file system can hold
// (the file's own blocks plus its free space, at this open: every process that opens the store
// learns it, so none tries to grow into space that is not there), and never fewer than the file
// holds (dropping newer segments could resurrect what their tombstones deleted; shrinking a store
// means deleting it).
void LocalStore::size_segments(const LocalBackendOptions& o) {
  const uint64_t want = std::max<uint64_t>(1, o.capacity_bytes / seg_bytes_);
  configured_bytes_ = want * seg_bytes_;
  const uint64_t present =
      file_size_ > kBlock ? (file_size_ - kBlock + seg_bytes_ - 1) / seg_bytes_ : 0;
  uint64_t n = std::max(want, present);
  if (blockdev_) {
    n = std::min<uint64_t>(n, file_size_ > kBlock ? (file_size_ - kBlock) / seg_bytes_ : 0);
    if (n == 0) throw std::runtime_error("local store: " + file_ + " is smaller than one segment");
  } else {
    struct statvfs vfs {};
    struct stat st {};
    // A file system that reports no size at all (f_blocks 0, as some FUSE ones do) is trusted.
    if (::fstatvfs(fd_, &vfs) == 0 && vfs.f_blocks != 0 && ::fstat(fd_, &st) == 0) {
      const uint64_t free_bytes = uint64_t{vfs.f_bavail} * vfs.f_frsize;
      const uint64_t room = static_cast<uint64_t>(st.st_blocks) * 512 + free_bytes;
      const uint64_t fits = room > kBlock ? (room - kBlock) / seg_bytes_ : 0;
      if (present == 0 && fits == 0) {
        const uint64_t best = room > kBlock ? round_down(room - kBlock, kBlock) : 0;
        throw std::runtime_error(
            "local store: the file system of " + file_ + " has " + std::to_string(free_bytes) +
            " bytes free, not enough for one segment of " + std::to_string(seg_bytes_) +
            " bytes (plus the 4096-byte superblock); " +
            (best >= 16 * kBlock
                 ? "choose segment_bytes (gdkv --segment-bytes) of at most " +
                       std::to_string(best) + " or free space"
                 : std::string("free space (the smallest segment is 65536 bytes)")));
      }
      if (fits < want) {
        n = std::max(present, fits);
        std::fprintf(stderr,
                     "gdkv: local store %s: the file system has room for %llu bytes of log "
                     "(%llu segments of %u bytes), less than the %llu bytes configured; the "
                     "store's capacity is %llu bytes, and when full it reclaims its oldest "
                     "segment\n",
                     file_.c_str(), static_cast<unsigned long long>(fits * seg_bytes_),
                     static_cast<unsigned long long>(fits), seg_bytes_,
                     static_cast<unsigned long long>(configured_bytes_),
                     static_cast<unsigned long long>(n * seg_bytes_));
      }
    }
  }
  nseg_ = static_cast<uint32_t>(std::min<uint64_t>(n, 1u << 24));
}

// ================================================================================================
// Submission
// ================================================================================================

void LocalStore::submit(BackendOp* op) {
  ops_[static_cast<size_t>(op->kind) % kBackendOpKinds].fetch_add(1, std::memory_order_relaxed);
  switch (op->kind) {
    case BackendOpKind::kList:
      if (op->key.len > nvme::kMaxKeyLength) return op->complete(Status::kInvalidKeySize);
      break;
    case BackendOpKind::kPut:
      if (!op->key.valid()) return op->complete(Status::kInvalidKeySize);
      if (op->value.size() > max_value_) return op->complete(Status::kInvalidValueSize);
      if (op->store_options & ~nvme::kStoreOptionsValid) return op->complete(Status::kInvalidField);
      if (!quotas_.empty()) {
        const auto q = quotas_.find(op->nsid);
        if (q != quotas_.end() && held_charge(op->value.size()) > q->second) {
          return op->complete(Status::kCapacityExceeded);  // never fits its namespace's quota
        }
      }
      break;
    default:
      if (!op->key.valid()) return op->complete(Status::kInvalidKeySize);
      break;
  }
  submitted_.fetch_add(1);
  {
    std::lock_guard lk(in_mu_);
    incoming_.push_back(op);
  }
  // Wake the I/O thread only when it sleeps: one syscall per idle period, not per op.
  if (sleeping_.exchange(false)) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t r = ::write(wake_fd_, &one, sizeof(one));
  }
}

void LocalStore::drain() {
  const uint64_t target = submitted_.load();
  std::unique_lock lk(drain_mu_);
  drain_waiters_.fetch_add(1);
  drain_cv_.wait(lk, [&] { return completed_.load() >= target; });
  drain_waiters_.fetch_sub(1);
}

void LocalStore::finish(BackendOp* op, Status s, uint64_t len) {
  if (is_internal(op)) {
    delete internal(op);  // its effect, if it had one, was applied by commit_batch
    return;
  }
  op->complete(s, len);
  completed_.fetch_add(1);
  if (drain_waiters_.load() > 0) {
    std::lock_guard lk(drain_mu_);
    drain_cv_.notify_all();
  }
}

BackendInfo LocalStore::info() const {
  BackendInfo i;
  i.name = "local";
  i.keys = keys_.load(std::memory_order_relaxed);
  i.bytes_used = bytes_used_.load(std::memory_order_relaxed);
  i.capacity_bytes = capacity_.load(std::memory_order_relaxed);
  i.segments = segments_used_.load(std::memory_order_relaxed);
  i.max_value_bytes = max_value_;
  return i;
}

void LocalStore::collect(MetricList& out) const {
  MetricWriter w(out);
  auto ld = [](const std::atomic<uint64_t>& a) {
    return static_cast<double>(a.load(std::memory_order_relaxed));
  };
  constexpr MetricType C = MetricType::kCounter;
  constexpr MetricType G = MetricType::kGauge;
  auto add = [&](const char* name, const char* help, MetricType t, double v,
                 MetricLabels labels = {}) { w.add(name, help, t, v, std::move(labels)); };
  double total = 0;
  for (size_t k = 0; k < kBackendOpKinds; ++k) {
    const double n = ld(ops_[k]);  // one read: the total is the sum of the counters written
    w.counter("local_ops_total", "ops submitted to the local store", n,
              {{"op", backend_op_name(static_cast<BackendOpKind>(k))}});
    total += n;
  }
  const BackendInfo i = info();
  MetricWriter backend(out, {{"backend", "local"}});
  backend.counter("backend_ops_total", "ops submitted to the backend", total);
  backend.gauge("backend_keys", "keys stored", static_cast<double>(i.keys));
  backend.gauge("backend_bytes_used", "bytes stored", static_cast<double>(i.bytes_used));
  add("local_capacity_bytes",
      "log capacity in bytes (what the file system can hold, at most what was configured)", G,
      static_cast<double>(i.capacity_bytes));
  add("local_configured_capacity_bytes", "log capacity configured (capacity_bytes)", G,
      static_cast<double>(configured_bytes_));
  add("local_segments", "log segments holding data", G, static_cast<double>(i.segments));
  add("local_read_bytes_total", "value bytes returned by Gets", C, ld(read_bytes_));
  add("local_written_bytes_total", "value bytes of acknowledged Stores", C, ld(written_bytes_));
  add("local_log_bytes_written_total", "bytes written to the log (headers and padding included)", C,
      ld(log_bytes_));
  add("local_direct_write_bytes_total",
      "value bytes written straight from the caller's buffer (no staging copy)", C,
      ld(direct_written_));
  add("local_checksum_failures_total", "values whose checksum failed on read (reported as 88h)", C,
      ld(checksum_failures_));
  add("local_io_errors_total", "I/O errors", C, ld(read_errors_), {{"dir", "read"}});
  add("local_io_errors_total", "I/O errors", C, ld(write_errors_), {{"dir", "write"}});
  add("local_disk_full_total", "batches that met a full file system (reported as 81h)", C,
      ld(disk_full_));
  add("local_segments_reclaimed_total", "oldest segments reclaimed to make room", C,
      ld(reclaimed_));
  add("local_flushes_total", "group commits (one write stream and one fdatasync each)", C,
      ld(flushes_));
  add("local_group_commit_records_total", "records made durable by group commits", C,
      ld(batch_records_));
  add("local_group_commit_max_records", "largest group commit so far", G, ld(batch_max_));
  add("local_index_bytes", "memory of the in-memory index", G, ld(index_bytes_));
  add("local_rebuild_seconds", "time to rebuild the index at open", G,
      static_cast<double>(rebuild_ns_) / 1e9);
  add("local_rebuild_records", "log records scanned at open", G,
      static_cast<double>(rebuild_records_));
  add("local_torn_batches_dropped", "unacknowledged torn batches dropped at open", G,
      static_cast<double>(torn_dropped_));
  add("local_invalid_headers",
      "headers with a bad checksum found at open (corruption or a torn "
      "last write)",
      G, static_cast<double>(invalid_headers_));
  add("local_truncated_segments", "segments whose log ended early at open (corruption)", G,
      static_cast<double>(truncated_segments_));
  add("local_copied_forward_bytes_total",
      "value bytes of namespaces with a quota copied forward out of a reclaimed segment", C,
      ld(copied_bytes_));
  add("local_copy_forward_dropped_total",
      "values of namespaces with a quota that reclaim dropped instead of copying forward", C,
      ld(copy_dropped_));
  {
    std::lock_guard lk(ns_mu_);
    for (const auto& [nsid, n] : ns_) {
      if (nsid > kMaxMetricNamespace) break;
      add_namespace_metrics(out, "local", nsid, static_cast<double>(n.held.load()),
                            static_cast<double>(n.evictions.load()));
    }
  }
  add("local_direct_io", "1 when the store uses O_DIRECT", G, direct_io_ ? 1 : 0);
  add("local_registered_buffers", "1 when the I/O buffers are registered with io_uring", G,
      registered_ ? 1 : 0);
}

// ================================================================================================
// The I/O thread
// ================================================================================================

void LocalStore::arm_wake() {
  io_uring_sqe* s = ring_->sqe();
  io_uring_prep_read(s, wake_fd_, &wake_buf_, sizeof(wake_buf_), 0);
  io_uring_sqe_set_data(s, &wake_tag_);
  ++sqe_inflight_;
}

void LocalStore::run(unsigned entries, std::promise<void>& ready) {
  try {
    ring_ = std::make_unique<Uring>(entries);
    ring_->set_hook(hook_);
    read_sqe_limit_ = ring_->entries() - kReservedSqes;
    registered_ = ring_->register_arena(arena_, arena_bytes_);
    const auto t0 = std::chrono::steady_clock::now();
    rebuild();
    rebuild_ns_ = static_cast<uint64_t>((std::chrono::steady_clock::now() - t0) /
                                        std::chrono::nanoseconds(1));
  } catch (...) {
    ring_.reset();
    ready.set_exception(std::current_exception());
    return;
  }
  ready.set_value();  // `ready` lives on the opener's stack: not touched after this

  arm_wake();
  std::vector<BackendOp*> batch;
  std::vector<std::pair<IoTag*, int>> done;
  io_uring* ring = ring_->ring();
  for (;;) {
    {
      std::lock_guard lk(in_mu_);
      batch.swap(incoming_);
    }
    for (BackendOp* op : batch) dispatch(op);
    batch.clear();
    form_batch();
    pump_waiting();
    const bool idle = pending_.empty() && !batch_.active && jobs_active_ == 0 && waiting_.empty() &&
                      copies_.empty() && clean_seg_ == kNone;
    bool more;
    sleeping_.store(true);
    {
      std::lock_guard lk(in_mu_);
      more = !incoming_.empty();
    }
    if (stopping_.load() && idle && !more) break;
    if (more) {
      // Work is waiting: submit, collect whatever completed, and come straight back.
      sleeping_.store(false);
      io_uring_submit_and_get_events(ring);
    } else {
      // Sleep until a completion or a submitter's wake-up (the eventfd read in the ring).
      io_uring_submit_and_wait(ring, 1);
      sleeping_.store(false);
    }
    // Reap first, then handle: handlers queue new SQEs and complete ops (user callbacks).
    done.clear();
    io_uring_cqe* cqe;
    unsigned head;
    unsigned seen = 0;
    io_uring_for_each_cqe(ring, head, cqe) {
      ++seen;
      void* data = io_uring_cqe_get_data(cqe);
      const int res = ring_->result(data, cqe->res);
      done.emplace_back(static_cast<IoTag*>(data), res);
    }
    io_uring_cq_advance(ring, seen);
    for (auto [t, res] : done) on_cqe(t, res);
  }
  ring_.reset();  // on this thread: a single-issuer ring belongs to it
}

void LocalStore::on_cqe(IoTag* t, int res) {
  --sqe_inflight_;
  switch (t->kind) {
    case IoTag::kWake:
      arm_wake();
      break;
    case IoTag::kStage:
      on_stage(t->slot, res);
      break;
    case IoTag::kDirectWrite:
      on_direct_write(t->slot, res);
      break;
    case IoTag::kFsync:
      on_fsync(res);
      break;
    case IoTag::kInvalidate:
      on_invalidate(res);
      break;
    case IoTag::kClearHeader:
      on_clear_header(res);
      break;
    case IoTag::kCleanClear:
      on_clean_clear(res);
      break;
    case IoTag::kDirect:
    case IoTag::kChunk:
      on_read(t, res);
      break;
    case IoTag::kScan:
      break;
  }
}

void LocalStore::dispatch(BackendOp* op) {
  switch (op->kind) {
    case BackendOpKind::kPut:
    case BackendOpKind::kDelete:
      if (degraded_) return finish(op, Status::kInternalError);
      pending_.push_back(op);
      return;
    case BackendOpKind::kGet:
      return start_get(op);
    case BackendOpKind::kExists:
      return finish(op, index_.find(op->nsid, op->key) ? Status::kSuccess : Status::kKeyNotExist);
    case BackendOpKind::kList:
      return do_list(op);
  }
}

// List scans the whole table: it is an administrative call (gdkv ls), and a hash index keeps every
// Get at one probe. O(keys) on the I/O thread.
void LocalStore::do_list(BackendOp* op) {
  op->keys.clear();
  if (op->list_max > 0) {
    std::vector<Key> keys;
    const Key& from = op->key;
    index_.for_each([&](uint32_t nsid, const Key& k, const Location&) {
      if (nsid == op->nsid && (from.len == 0 || compare(k, from) >= 0)) keys.push_back(k);
    });
    const size_t n = std::min<size_t>(keys.size(), op->list_max);
    std::partial_sort(keys.begin(), keys.begin() + static_cast<ptrdiff_t>(n), keys.end());
    keys.resize(n);
    op->keys = std::move(keys);
  }
  finish(op, Status::kSuccess);
}

}  // namespace gdkv::local

namespace gdkv {

Result<std::shared_ptr<Backend>> make_local_backend(const LocalBackendOptions& options) {
  return catch_error(
      [&]() -> std::shared_ptr<Backend> { return std::make_shared<local::LocalStore>(options); });
}

}  // namespace gdkv
