// The local store's implementation, shared by its source files: store.cc (open, submission, the
// I/O thread's loop), rebuild.cc (the index at open), write_path.cc (group commit, segments,
// reclaim) and read_path.cc (Gets). The public face is include/gdkv/local_backend.h; the format
// is format.h; docs/local-store.md explains the design.
//
// Threads: submit() runs on callers' threads (a reactor's) and only validates and queues the op:
// no per-byte work there. One I/O thread owns the ring, the index, the segment table and every
// buffer; it alone decides, so no lock guards the index. It hashes a Store's value when the
// value's batch forms (checksum and digest in one pass) and verifies every Get's. Completions
// (op->done) run on the I/O thread.
//
// Writes: Stores and Deletes wait in `pending_` while a batch is being written; when it is
// durable the next batch takes everything pending (group commit: one write stream, one
// fdatasync). Only one batch is in flight, which is what makes recovery simple: only the last
// batch of the newest segment can be torn, and the index is always current when a batch forms,
// so conditional Stores are decided against durable state.
//
// Quotas (write_path.cc, docs/local-store.md "Quotas"): a namespace over its quota evicts its own
// oldest values when a batch commits (tombstones in the next batch). With any quota set, one
// segment is kept free: taking the last free one reclaims the oldest at once, after its values of
// namespaces with a quota are copied into the fresh head (alone, durable) and its header is zeroed.
#pragma once

#include <liburing.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "backend/local/format.h"
#include "backend/local/hash.h"
#include "backend/local/index.h"
#include "backend/local/uring.h"
#include "common/arena.h"
#include "gdkv/local_backend.h"

namespace gdkv::local {

using nvme::Status;

// Buffer arena: write staging (a batch streams through these) and read bounce buffers.
constexpr uint32_t kStageBytes = 2u << 20;
constexpr uint32_t kStageChunks = 4;
constexpr uint32_t kBounceBytes = 256u << 10;
constexpr uint32_t kBounceCount = 32;
constexpr uint32_t kChunksPerJob = 4;  // bounce reads one Get keeps in flight
constexpr uint32_t kDirectPieces = 4;  // a large direct read is split in up to this many pieces
constexpr uint32_t kMinDirectPiece = 256u << 10;
// A batch stops growing at kMaxBatchBytes (a single record may exceed it).
constexpr uint64_t kMaxBatchBytes = 32u << 20;
constexpr uint32_t kScanWindow = 128u << 10;  // rebuild reads the log in windows this big
// Values at least this large, in memory aligned for O_DIRECT, are written straight from the
// caller's buffer (up to kDirectWrites at once) instead of being copied into staging.
constexpr uint64_t kDirectWriteMin = 256u << 10;
constexpr uint32_t kDirectWrites = 16;
// Ring entries the write path and the wake-up may use (staging, direct writes, fsync,
// invalidation, wake); reads use the rest.
constexpr unsigned kReservedSqes = kStageChunks + kDirectWrites + 4;
constexpr uint32_t kNone = ~uint32_t{0};

[[noreturn]] inline void fail(const std::string& what, int err) {
  throw std::runtime_error("local store: " + what + ": " + std::strerror(err));
}

inline bool is_disk_full(int err) { return err == ENOSPC || err == EDQUOT || err == EFBIG; }

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};
using AlignedBuf = std::unique_ptr<std::byte[], FreeDeleter>;
inline AlignedBuf alloc_aligned(size_t n, size_t align) {
  void* p = nullptr;
  if (posix_memalign(&p, std::max<size_t>(align, sizeof(void*)), std::max<size_t>(n, 1)) != 0) {
    throw std::bad_alloc();
  }
  return AlignedBuf(static_cast<std::byte*>(p));
}

// user_data of every SQE.
struct IoTag {
  enum Kind : uint8_t {
    kWake,
    kStage,
    kDirectWrite,
    kFsync,
    kInvalidate,
    kClearHeader,
    kCleanClear,
    kDirect,
    kChunk,
    kScan
  } kind;
  uint32_t slot = 0;
  void* owner = nullptr;
};

struct SegState {
  uint64_t seq = 0;       // 0: free (no live log)
  uint32_t end = 0;       // bytes of log written (0: nothing, not even the header)
  uint32_t readers = 0;   // Gets in flight against this segment: reclaim waits for them
  uint64_t live = 0;      // index entries pointing here (reclaim skips the scan when 0)
  bool reserved = false;  // disk space known to exist (fallocated, or a block device)
  // Its first block may hold a valid header of a previous life (it was reclaimed): zeroed and
  // flushed before the new life's first batch, so a power loss in that batch cannot leave the
  // old header over a half-overwritten old log (whose records would point at new bytes).
  bool stale_header = false;
};

// What a value holds of its namespace's quota: its record entry (64 bytes, the key included) and
// its bytes as the log lays them out (inline up to kInlineMax, else whole blocks).
inline uint64_t held_charge(uint64_t len) {
  return sizeof(RecordEntry) + (len <= kInlineMax ? len : round_up(len, kBlock));
}

// A live value's place in the log: segment sequence number, then offset (oldest first). A
// zero-length value shares its offset with the next inline value, hence the key.
struct LogPos {
  uint64_t seq;
  uint32_t off;
  Key key;
  friend bool operator<(const LogPos& a, const LogPos& b) noexcept {
    if (a.seq != b.seq) return a.seq < b.seq;
    if (a.off != b.off) return a.off < b.off;
    return a.key < b.key;
  }
};

// Per backend namespace (docs/local-store.md, "Quotas"). held and evictions are read by collect().
struct NsState {
  bool limited = false;  // has a quota
  uint64_t quota = 0;
  std::atomic<uint64_t> held{0};  // held_charge of its live values
  std::atomic<uint64_t> evictions{0};
  std::set<LogPos> order;  // limited only: its live values, oldest first
};

// A write the store makes on its own behalf: a value copied forward out of the segment being
// reclaimed, or the tombstone of a value its namespace's quota evicted. Never counted by drain().
struct InternalOp {
  BackendOp op;
  bool copy = false;     // else an eviction tombstone
  uint32_t src_seg = 0;  // copy: where the value was
  uint32_t src_off = 0;
  AlignedBuf buf;  // copy: the value, read back from the log
};

// One Get in progress. The value's bytes arrive in two parts: a prefix read with O_DIRECT straight
// into the caller's buffer (in up to kDirectPieces pieces, so hashing the first pieces overlaps
// reading the last), then the rest through bounce buffers. The checksum is a stream, fed in value
// order as the parts land.
struct ReadJob {
  struct Piece {       // of the direct prefix
    uint64_t off = 0;  // in the value
    uint32_t len = 0;
    uint32_t got = 0;
    bool done = false;
    IoTag tag{IoTag::kDirect};
  };
  struct Chunk {  // a bounce read
    uint32_t buf;
    uint64_t file_off;
    uint32_t len;
    uint32_t got;
    bool done;
    IoTag tag{IoTag::kChunk};
  };
  BackendOp* op = nullptr;
  uint32_t seg = 0;
  uint64_t vfile = 0;  // file offset of the value's first byte
  uint32_t len = 0;
  uint64_t checksum = 0;
  std::byte* dst = nullptr;  // the caller's buffer (sink) or ours (view)
  uint64_t want = 0;         // bytes of the value the caller wants
  uint64_t direct = 0;       // bytes read straight into dst (a multiple of the I/O alignment)
  Piece pieces[kDirectPieces];
  uint32_t npieces = 0;
  uint32_t pieces_hashed = 0;
  bool direct_issued = false;
  bool fallback = false;             // O_DIRECT into dst was refused: redo through bounce buffers
  std::shared_ptr<std::byte> owned;  // the view's buffer when the op has no sink
  uint64_t next_file = 0;            // the part of the value read through bounce buffers
  uint64_t end_file = 0;
  uint64_t hashed = 0;  // value bytes fed to the checksum, in order
  bool failed = false;
  bool waiting = false;
  uint32_t outstanding = 0;
  Chunk chunks[kChunksPerJob];
  uint32_t first = 0;
  uint32_t count = 0;
  Checksum64 sum;
};

class LocalStore final : public Backend {
 public:
  // `hook` (tests only; may be null): sees, and may fail, every write, flush and size change.
  explicit LocalStore(const LocalBackendOptions& o, IoHook* hook = nullptr);
  ~LocalStore() override;

  void submit(BackendOp* op) override;
  BackendInfo info() const override;
  void collect(MetricList& out) const override;
  void drain() override;
  void set_removal_handler(InvalidationHandler h) override { removals_.set(std::move(h)); }

 private:
  // ---- open ----
  void open_file(const LocalBackendOptions& o);
  void load_or_create_superblock(const LocalBackendOptions& o);
  void size_segments(const LocalBackendOptions& o);
  // The synchronous writes and flushes of open (the superblock), through the hook.
  ssize_t io_write_sync(const std::byte* buf, uint32_t n, uint64_t off);
  int io_datasync_sync();
  void rebuild();
  uint64_t seg_base(uint32_t s) const { return kBlock + uint64_t{s} * seg_bytes_; }

  // ---- I/O thread ----
  void run(unsigned entries, std::promise<void>& ready);
  void arm_wake();
  void dispatch(BackendOp* op);
  void on_cqe(IoTag* t, int res);
  void finish(BackendOp* op, Status s, uint64_t len = 0);
  static void internal_done(BackendOp*, Status, uint64_t) {}
  static bool is_internal(const BackendOp* op) { return op->done == &internal_done; }
  static InternalOp* internal(BackendOp* op) { return static_cast<InternalOp*>(op->user); }
  void do_list(BackendOp* op);

  // writes
  void form_batch();
  bool head_fits(uint64_t need) const;
  Status switch_segment();
  void seal_head();
  void start_head(uint32_t s, bool wait_readers);
  int reserve(uint32_t s);
  void cap_segments();
  void reclaim(uint32_t s);
  // quotas
  NsState& ns(uint32_t nsid);
  void held_add(uint32_t nsid, const Key& k, const Location& loc);
  void held_sub(uint32_t nsid, const Key& k, const Location& loc);
  void account_index();  // at open, from the rebuilt index
  void enforce_quota(uint32_t nsid, NsState& n);
  void queue_tombstone(uint32_t nsid, const Key& k);
  bool cleaning_wanted() const;
  void start_cleaning();
  void form_copy_batch();
  void finish_cleaning();
  void on_clean_clear(int res);
  void check_quotas(const LocalBackendOptions& o) const;
  void start_batch(uint64_t inline_bytes, uint64_t data_bytes);
  uint32_t fill_stage(std::byte* dst, uint32_t max);
  void pump_writes();
  void issue_stage_write(uint32_t slot);
  void on_stage(uint32_t slot, int res);
  void issue_direct_write(uint32_t slot);
  void on_direct_write(uint32_t slot, int res);
  void on_fsync(int res);
  void on_invalidate(int res);
  void on_clear_header(int res);
  void commit_batch();
  void fail_batch();

  // reads
  void start_get(BackendOp* op);
  void advance(ReadJob* j);
  void step(ReadJob* j);  // advance() without submitting
  void on_read(IoTag* t, int res);
  void direct_mode(ReadJob* j);
  void issue_piece(ReadJob* j, uint32_t idx);
  void issue_chunk(ReadJob* j, uint32_t idx);
  void finish_read(ReadJob* j, Status s);
  void pump_waiting();
  bool read_credit() const { return sqe_inflight_ < read_sqe_limit_; }

  std::byte* stage(uint32_t i) const { return arena_ + size_t{i} * kStageBytes; }
  std::byte* bounce(uint32_t i) const {
    return arena_ + size_t{kStageChunks} * kStageBytes + size_t{i} * kBounceBytes;
  }
  std::byte* zero_block() const {
    return arena_ + size_t{kStageChunks} * kStageBytes + size_t{kBounceCount} * kBounceBytes;
  }
  void prep_read(io_uring_sqe* s, std::byte* buf, uint32_t n, uint64_t off, bool arena);
  void prep_write(io_uring_sqe* s, const std::byte* buf, uint32_t n, uint64_t off, void* data);

  // ---- configuration ----
  std::string file_;
  int fd_ = -1;
  bool blockdev_ = false;
  bool direct_io_ = true;
  bool preallocate_ = true;
  uint32_t io_align_ = kBlock;   // offsets and lengths of O_DIRECT I/O
  uint32_t mem_align_ = kBlock;  // buffer addresses of O_DIRECT I/O
  uint32_t seg_bytes_ = 0;
  uint32_t nseg_ = 0;
  uint64_t store_id_ = 0;
  uint64_t file_size_ = 0;
  uint64_t max_value_ = 0;
  uint64_t configured_bytes_ = 0;  // capacity_bytes asked for, in whole segments
  NamespaceQuotas quotas_;         // read by submit() too: never changed after open
  IoHook* hook_ = nullptr;

  std::unique_ptr<Uring> ring_;  // created, used and destroyed by the I/O thread only
  bool registered_ = false;
  std::byte* arena_ = nullptr;
  size_t arena_bytes_ = 0;
  int wake_fd_ = -1;
  uint64_t wake_buf_ = 0;
  IoTag wake_tag_{IoTag::kWake};
  IoTag fsync_tag_{IoTag::kFsync};
  IoTag inval_tag_{IoTag::kInvalidate};
  IoTag clear_tag_{IoTag::kClearHeader};
  unsigned sqe_inflight_ = 0;
  unsigned read_sqe_limit_ = 0;

  // ---- state owned by the I/O thread ----
  Index index_;
  std::vector<SegState> segments_;
  std::deque<uint32_t> fifo_;   // segments holding log, oldest first; the head is at the back
  std::vector<uint32_t> free_;  // free segments, highest index first (we take from the back)
  uint32_t head_ = kNone;
  bool head_wait_readers_ = false;
  uint64_t next_seq_ = 1;
  uint64_t next_batch_ = 1;
  uint64_t last_sealed_seq_ = 0;
  uint32_t last_sealed_end_ = 0;
  bool degraded_ = false;  // a failed batch could not be invalidated: refuse writes until reopen

  // Quotas: per namespace, and the reclaim in progress of the oldest segment whose values of
  // limited namespaces are being copied forward (kNone: none). ns_ changes shape under ns_mu_,
  // on the I/O thread only; collect() reads it under ns_mu_.
  std::map<uint32_t, NsState> ns_;
  mutable std::mutex ns_mu_;
  uint32_t clean_seg_ = kNone;
  bool clean_clearing_ = false;  // its header is being zeroed and flushed
  int clean_clear_left_ = 0;
  bool clean_clear_failed_ = false;
  IoTag clean_tag_{IoTag::kCleanClear};
  std::deque<BackendOp*> copies_;  // copy-forward writes not yet in a batch
  uint32_t cleanings_ = 0;         // started since a batch last took a caller's op

  std::deque<BackendOp*> pending_;                      // Stores and Deletes waiting for a batch
  std::unordered_map<NsKey, bool, NsKeyHash> overlay_;  // per forming batch: key present after it
  std::unordered_set<NsKey, NsKeyHash> blocked_;        // keys with an op deferred to next batch

  struct Piece {
    const std::byte* src;  // nullptr: zeros (padding)
    uint64_t len;
    bool direct = false;  // written straight from src, not through staging
  };
  struct Batch {
    bool active = false;
    enum Phase { kClearing, kWriting, kSyncing, kInvalidating } phase = kWriting;
    uint32_t seg = 0;
    uint32_t stream_start = 0;  // segment offset of the stream (0 when it carries the seg header)
    uint32_t batch_off = 0;
    uint64_t stream_len = 0;
    uint64_t header_end = 0;  // stream bytes up to the end of the batch header's block
    uint64_t batch_no = 0;
    uint64_t data_bytes = 0;
    std::vector<BackendOp*> recs;
    std::vector<uint32_t> value_off;
    std::vector<uint64_t> checksum;     // of each record's value
    std::vector<std::byte> head_bytes;  // [segment header] + header area
    std::vector<Piece> pieces;
    size_t piece = 0;
    uint64_t piece_off = 0;
    uint64_t produced = 0;
    uint64_t landed = 0;  // bytes of the stream prefix known written (for invalidation)
    uint32_t inflight = 0;
    int error = 0;
    bool restage = false;  // the kernel refused a direct write's memory: rewrite all staged
    int inval_left = 0;
    bool inval_failed = false;
  } batch_;
  struct Stage {
    bool busy = false;
    uint64_t stream_off = 0;
    uint32_t len = 0;
    uint32_t got = 0;
    IoTag tag{IoTag::kStage};
  } stages_[kStageChunks];
  struct DirectWrite {
    bool busy = false;
    const std::byte* src = nullptr;
    uint64_t stream_off = 0;
    uint64_t len = 0;
    uint64_t got = 0;
    IoTag tag{IoTag::kDirectWrite};
  } direct_writes_[kDirectWrites];

  std::vector<uint32_t> bounce_free_;
  std::vector<std::unique_ptr<ReadJob>> job_pool_;
  // The buffers of Gets that hand out a view (no sink): prepared memory reused from Get to Get.
  // A buffer per Get from the heap churned memory through glibc's per-thread arenas, which held
  // up to 264 MiB in a soak whose live buffers were a few MiB. Shared: a view can outlive us.
  std::shared_ptr<Arena> read_arena_ = std::make_shared<Arena>(read_arena_options());
  static Arena::Options read_arena_options() {
    Arena::Options o;
    o.step_bytes = size_t{16} << 20;
    o.align = 4096;  // O_DIRECT reads land in it
    return o;
  }
  std::deque<ReadJob*> waiting_;
  uint64_t jobs_active_ = 0;

  // ---- shared with callers ----
  std::mutex in_mu_;
  std::vector<BackendOp*> incoming_;
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> submitted_{0};
  std::atomic<uint64_t> completed_{0};
  std::mutex drain_mu_;
  std::condition_variable drain_cv_;
  std::atomic<int> drain_waiters_{0};
  std::thread thread_;

  // ---- statistics (relaxed; read by info() and collect()) ----
  std::atomic<uint64_t> ops_[kBackendOpKinds] = {};
  std::atomic<uint64_t> read_bytes_{0}, written_bytes_{0}, log_bytes_{0}, direct_written_{0};
  std::atomic<uint64_t> checksum_failures_{0}, read_errors_{0}, write_errors_{0};
  InvalidationHook removals_;  // set_removal_handler: deletes and reclaimed keys
  std::atomic<uint64_t> disk_full_{0}, reclaimed_{0}, flushes_{0}, batch_records_{0};
  std::atomic<uint64_t> batch_max_{0};
  std::atomic<uint64_t> keys_{0}, bytes_used_{0}, capacity_{0}, segments_used_{0};
  std::atomic<uint64_t> index_bytes_{0};
  std::atomic<uint64_t> copied_bytes_{0}, copy_dropped_{0};
  uint64_t rebuild_ns_ = 0, rebuild_records_ = 0;
  uint64_t torn_dropped_ = 0, invalid_headers_ = 0, truncated_segments_ = 0;
};

}  // namespace gdkv::local
