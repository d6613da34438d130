// The local store's write path: group commit, segments and reclaim (see store.h).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>

#include "backend/local/store.h"

namespace gdkv::local {

// ---- group commit -----------------------------------------------------------------------------

bool LocalStore::head_fits(uint64_t need) const {
  if (head_ == kNone) return false;
  const SegState& g = segments_[head_];
  const uint64_t start = g.end == 0 ? kBlock : g.end;
  return start + need <= seg_bytes_;
}

void LocalStore::form_batch() {
  if (batch_.active || clean_clearing_) return;
  if (degraded_) {
    while (!pending_.empty()) {
      BackendOp* op = pending_.front();
      pending_.pop_front();
      finish(op, Status::kInternalError);
    }
    while (!copies_.empty()) {
      finish(copies_.front(), Status::kInternalError);
      copies_.pop_front();
    }
    clean_seg_ = kNone;
    return;
  }
  if (head_ != kNone && head_wait_readers_) {
    if (segments_[head_].readers > 0) return;
    head_wait_readers_ = false;
  }
  // Copy-forward goes first, alone: while it runs, the head takes nothing else, so the copies of
  // the oldest segment fit in the fresh head (they pack at least as tightly as the original).
  if (clean_seg_ != kNone && copies_.empty()) finish_cleaning();
  if (clean_seg_ == kNone && cleaning_wanted()) start_cleaning();
  if (clean_seg_ != kNone) return form_copy_batch();
  if (pending_.empty()) return;
  auto header_area = [](uint64_t n, uint64_t inl) {
    return round_up(sizeof(BatchHeader) + n * sizeof(RecordEntry) + inl, kBlock);
  };
  batch_.recs.clear();
  overlay_.clear();
  blocked_.clear();
  std::deque<BackendOp*> keep;  // deferred to the next batch, in order
  uint64_t entries = 0, inline_bytes = 0, data_bytes = 0;
  while (!pending_.empty()) {
    BackendOp* op = pending_.front();
    const NsKey k{op->nsid, op->key};
    const bool put = op->kind == BackendOpKind::kPut;
    const bool conditional =
        !put || (op->store_options & (nvme::kStoreMustExist | nvme::kStoreMustNotExist)) != 0;
    // A decision that depends on an earlier op of this same batch waits for that op to be
    // durable: if the batch failed, the decision would have been taken on state that never was.
    // Later ops on the key wait with it, so per-key order holds.
    if (blocked_.count(k) != 0 || (conditional && overlay_.count(k) != 0)) {
      blocked_.insert(k);
      keep.push_back(op);
      pending_.pop_front();
      continue;
    }
    const uint64_t len = put ? op->value.size() : 0;
    const bool inl = put && len <= kInlineMax;
    const uint64_t n_entries = entries + 1;
    const uint64_t n_inline = inline_bytes + (inl ? len : 0);
    const uint64_t n_data = data_bytes + (put && !inl ? round_up(len, kBlock) : 0);
    const uint64_t need = header_area(n_entries, n_inline) + n_data;
    if (entries > 0 && (n_entries > kMaxBatchRecords || n_inline > kMaxInlineBytesPerBatch ||
                        need > kMaxBatchBytes || !head_fits(need))) {
      break;
    }
    if (entries == 0 && !head_fits(need)) {
      const Status s = switch_segment();
      if (s != Status::kSuccess) {
        // No segment to write to (the file system is full and nothing can be reclaimed yet):
        // everything waiting fails with the reason; the store stays as it was.
        while (!pending_.empty()) {
          BackendOp* p = pending_.front();
          pending_.pop_front();
          finish(p, s);
        }
        return;
      }
      if (head_wait_readers_) return;  // the reclaimed segment is still being read
      // The free segment just taken was the last: the oldest is reclaimed now, its values of
      // limited namespaces copied into the fresh head before anything else goes there.
      if (cleaning_wanted()) return form_batch();
    }
    bool present;
    if (auto it = overlay_.find(k); it != overlay_.end()) {
      present = it->second;
    } else {
      present = index_.find(k.nsid, k.key) != nullptr;
    }
    pending_.pop_front();
    if (put) {
      if ((op->store_options & nvme::kStoreMustExist) && !present) {
        finish(op, Status::kKeyNotExist);
        continue;
      }
      if ((op->store_options & nvme::kStoreMustNotExist) && present) {
        finish(op, Status::kKeyExists);
        continue;
      }
      overlay_[k] = true;
    } else {
      if (!present &&
          !is_internal(op)) {  // an eviction's tombstone: its key left the index already
        finish(op, Status::kKeyNotExist);
        continue;
      }
      overlay_[k] = false;
    }
    batch_.recs.push_back(op);
    entries = n_entries;
    inline_bytes = n_inline;
    data_bytes = n_data;
  }
  for (auto it = keep.rbegin(); it != keep.rend(); ++it) pending_.push_front(*it);
  if (batch_.recs.empty()) return;
  start_batch(inline_bytes, data_bytes);
}

void LocalStore::start_batch(uint64_t inline_bytes, uint64_t data_bytes) {
  Batch& b = batch_;
  SegState& g = segments_[head_];
  const bool fresh = g.end == 0;
  const uint32_t count = static_cast<uint32_t>(b.recs.size());
  const uint64_t H =
      round_up(sizeof(BatchHeader) + uint64_t{count} * sizeof(RecordEntry) + inline_bytes, kBlock);
  b.seg = head_;
  b.batch_off = fresh ? kBlock : g.end;
  b.stream_start = fresh ? 0 : g.end;
  b.batch_no = next_batch_++;
  b.data_bytes = data_bytes;
  b.head_bytes.assign((fresh ? kBlock : 0) + H, std::byte{0});
  b.header_end = (fresh ? kBlock : 0) + kBlock;
  std::byte* area = b.head_bytes.data() + (fresh ? kBlock : 0);
  if (fresh) {
    SegmentHeader sh{};
    sh.magic = kSegmentMagic;
    sh.store_id = store_id_;
    sh.seq = g.seq;
    sh.index = head_;
    sh.segment_bytes = seg_bytes_;
    sh.prev_seq = last_sealed_seq_;
    sh.prev_end = last_sealed_end_;
    sh.first_batch = b.batch_no;
    seal(sh);
    std::memcpy(b.head_bytes.data(), &sh, sizeof(sh));
  }
  b.pieces.clear();
  b.pieces.push_back({b.head_bytes.data(), b.head_bytes.size()});
  b.value_off.resize(count);
  b.checksum.resize(count);
  uint64_t inline_cur = b.batch_off + sizeof(BatchHeader) + uint64_t{count} * 64;
  uint64_t data_cur = b.batch_off + H;
  for (uint32_t i = 0; i < count; ++i) {
    const BackendOp* op = b.recs[i];
    RecordEntry e{};
    e.magic = kRecordMagic;
    e.key_len = op->key.len;
    std::memcpy(e.key, op->key.bytes, op->key.len);
    e.nsid = op->nsid;
    if (op->kind == BackendOpKind::kPut) {
      const uint64_t len = op->value.size();
      e.type = static_cast<uint8_t>(RecordType::kPut);
      e.value_len = static_cast<uint32_t>(len);
      if (len <= kInlineMax) {
        e.value_off = static_cast<uint32_t>(inline_cur);
        if (len > 0) std::memcpy(area + (inline_cur - b.batch_off), op->value.data(), len);
        inline_cur += len;
      } else {
        e.value_off = static_cast<uint32_t>(data_cur);
        // A large value in suitably aligned memory goes to the file without a copy; its unaligned
        // tail (if any) and the padding go through staging.
        const uint64_t direct =
            len >= kDirectWriteMin &&
                    reinterpret_cast<uintptr_t>(op->value.data()) % mem_align_ == 0
                ? round_down(len, io_align_)
                : 0;
        if (direct > 0) b.pieces.push_back({op->value.data(), direct, true});
        if (len > direct) b.pieces.push_back({op->value.data() + direct, len - direct});
        if (round_up(len, kBlock) > len) b.pieces.push_back({nullptr, round_up(len, kBlock) - len});
        data_cur += round_up(len, kBlock);
      }
      // Hashed here, on the I/O thread, once the Store is sure to be written: one pass yields the
      // checksum every read verifies and the identity digest.
      const ValueHashes h = value_hashes(op->value.data(), len);
      e.checksum = b.checksum[i] = h.checksum;
      std::memcpy(e.digest, h.digest.bytes, sizeof(e.digest));
    } else {
      e.type = static_cast<uint8_t>(RecordType::kTombstone);
    }
    b.value_off[i] = e.value_off;
    seal(e);
    std::memcpy(area + sizeof(BatchHeader) + size_t{i} * sizeof(e), &e, sizeof(e));
  }
  BatchHeader h{};
  h.magic = kBatchMagic;
  h.store_id = store_id_;
  h.seq = g.seq;
  h.batch = b.batch_no;
  h.offset = b.batch_off;
  h.count = count;
  h.header_bytes = static_cast<uint32_t>(H);
  h.total_bytes = static_cast<uint32_t>(H + data_bytes);
  std::memcpy(area, &h, sizeof(h));
  seal_batch(area);

  b.stream_len = b.head_bytes.size() + data_bytes;
  b.piece = 0;
  b.piece_off = 0;
  b.produced = 0;
  b.landed = 0;
  b.inflight = 0;
  b.error = 0;
  b.restage = false;
  b.active = true;
  b.phase = Batch::kWriting;
  if (fresh && g.stale_header) {
    // A reused segment: its old header goes first (zeroed and flushed), then the batch.
    b.phase = Batch::kClearing;
    b.inval_left = 2;
    b.inval_failed = false;
    io_uring_sqe* s = ring_->sqe();
    prep_write(s, zero_block(), kBlock, seg_base(b.seg), &clear_tag_);
    s->flags |= IOSQE_IO_LINK;
    s = ring_->sqe();
    ring_->prep_fdatasync(s, fd_, &clear_tag_);
    ++sqe_inflight_;
    return;
  }
  pump_writes();
}

void LocalStore::on_clear_header(int res) {
  Batch& b = batch_;
  if (res < 0 && !b.inval_failed) {
    b.inval_failed = true;
    b.error = -res;
  }
  if (--b.inval_left > 0) return;
  if (b.inval_failed) return fail_batch();  // nothing of the batch was written
  segments_[b.seg].stale_header = false;
  b.phase = Batch::kWriting;
  pump_writes();
}

// Copies the stream from the cursor into a staging buffer: up to `max` bytes, stopping before a
// piece that is written directly. Returns the bytes copied.
uint32_t LocalStore::fill_stage(std::byte* dst, uint32_t max) {
  Batch& b = batch_;
  uint64_t done = 0;
  while (done < max && b.piece < b.pieces.size() && !b.pieces[b.piece].direct) {
    const Piece& p = b.pieces[b.piece];
    const uint64_t take = std::min<uint64_t>(max - done, p.len - b.piece_off);
    if (p.src != nullptr) {
      std::memcpy(dst + done, p.src + b.piece_off, take);
    } else {
      std::memset(dst + done, 0, take);
    }
    done += take;
    b.piece_off += take;
    if (b.piece_off == p.len) {
      ++b.piece;
      b.piece_off = 0;
    }
  }
  return static_cast<uint32_t>(done);
}

void LocalStore::prep_write(io_uring_sqe* s, const std::byte* buf, uint32_t n, uint64_t off,
                            void* data) {
  ring_->prep_write(s, fd_, buf, n, off, ring_->registered(), data);
  ++sqe_inflight_;
}

void LocalStore::prep_read(io_uring_sqe* s, std::byte* buf, uint32_t n, uint64_t off, bool arena) {
  if (arena && ring_->registered()) {
    io_uring_prep_read_fixed(s, fd_, buf, n, off, 0);
  } else {
    io_uring_prep_read(s, fd_, buf, n, off);
  }
  ++sqe_inflight_;
}

void LocalStore::issue_stage_write(uint32_t slot) {
  Stage& st = stages_[slot];
  st.tag.slot = slot;
  io_uring_sqe* s = ring_->sqe();
  const uint64_t off = seg_base(batch_.seg) + batch_.stream_start + st.stream_off + st.got;
  prep_write(s, stage(slot) + st.got, st.len - st.got, off, &st.tag);
}

void LocalStore::issue_direct_write(uint32_t slot) {
  DirectWrite& d = direct_writes_[slot];
  d.tag.slot = slot;
  io_uring_sqe* s = ring_->sqe();
  const uint64_t off = seg_base(batch_.seg) + batch_.stream_start + d.stream_off + d.got;
  ring_->prep_write(s, fd_, d.src + d.got, static_cast<uint32_t>(d.len - d.got), off, false,
                    &d.tag);
  ++sqe_inflight_;
}

void LocalStore::pump_writes() {
  Batch& b = batch_;
  if (b.phase != Batch::kWriting) return;
  while (b.error == 0 && !b.restage && b.produced < b.stream_len) {
    const Piece& p = b.pieces[b.piece];
    if (p.direct) {
      uint32_t slot = kDirectWrites;
      for (uint32_t i = 0; i < kDirectWrites; ++i) {
        if (!direct_writes_[i].busy) {
          slot = i;
          break;
        }
      }
      if (slot == kDirectWrites) break;
      DirectWrite& d = direct_writes_[slot];
      d.busy = true;
      d.src = p.src;
      d.stream_off = b.produced;
      d.len = p.len;
      d.got = 0;
      issue_direct_write(slot);
      b.produced += p.len;
      ++b.piece;
      ++b.inflight;
      continue;
    }
    uint32_t slot = kStageChunks;
    for (uint32_t i = 0; i < kStageChunks; ++i) {
      if (!stages_[i].busy) {
        slot = i;
        break;
      }
    }
    if (slot == kStageChunks) break;
    Stage& st = stages_[slot];
    const uint64_t start = b.produced;
    const uint32_t n = fill_stage(
        stage(slot), static_cast<uint32_t>(std::min<uint64_t>(kStageBytes, b.stream_len - start)));
    st.busy = true;
    st.stream_off = start;
    st.len = n;
    st.got = 0;
    issue_stage_write(slot);
    b.produced += n;
    ++b.inflight;
  }
  if (b.inflight > 0) return;
  if (b.restage && b.error == 0) {
    // Write the whole batch again, all of it through staging (nothing of it was acknowledged).
    for (Piece& p : b.pieces) p.direct = false;
    b.restage = false;
    b.piece = 0;
    b.piece_off = 0;
    b.produced = 0;
    b.landed = 0;
    return pump_writes();
  }
  if (b.error != 0) {
    // Make sure the failed batch can never be parsed at the next open: zero its header block,
    // unless its header never reached the file.
    if (b.landed < b.header_end) return fail_batch();
    b.phase = Batch::kInvalidating;
    b.inval_left = 2;
    b.inval_failed = false;
    io_uring_sqe* s = ring_->sqe();
    prep_write(s, zero_block(), kBlock, seg_base(b.seg) + b.batch_off, &inval_tag_);
    s->flags |= IOSQE_IO_LINK;
    s = ring_->sqe();
    ring_->prep_fdatasync(s, fd_, &inval_tag_);
    ++sqe_inflight_;
    return;
  }
  if (b.produced == b.stream_len) {
    b.phase = Batch::kSyncing;
    io_uring_sqe* s = ring_->sqe();
    ring_->prep_fdatasync(s, fd_, &fsync_tag_);
    ++sqe_inflight_;
  }
}

void LocalStore::on_stage(uint32_t slot, int res) {
  Stage& st = stages_[slot];
  Batch& b = batch_;
  if (res > 0) {
    st.got += static_cast<uint32_t>(res);
    if (st.got < st.len && b.error == 0) {
      issue_stage_write(slot);  // short write: the retry reports the real error, if any
      return;
    }
  } else if (b.error == 0) {
    b.error = res < 0 ? -res : EIO;
  }
  if (st.stream_off == 0) b.landed = st.got;
  st.busy = false;
  --b.inflight;
  pump_writes();
}

void LocalStore::on_direct_write(uint32_t slot, int res) {
  DirectWrite& d = direct_writes_[slot];
  Batch& b = batch_;
  if (res > 0) {
    d.got += static_cast<uint64_t>(res);
    direct_written_.fetch_add(static_cast<uint64_t>(res), std::memory_order_relaxed);
    if (d.got < d.len && b.error == 0 && !b.restage) return issue_direct_write(slot);
  } else if ((res == -EFAULT || res == -EINVAL) && direct_io_) {
    b.restage = true;  // memory O_DIRECT can't use (device memory, an unreported alignment)
  } else if (b.error == 0) {
    b.error = res < 0 ? -res : EIO;
  }
  d.busy = false;
  --b.inflight;
  pump_writes();
}

void LocalStore::on_fsync(int res) {
  if (res < 0) {
    batch_.error = -res;
    batch_.landed = batch_.stream_len;  // every write completed: the header is in the file
    batch_.phase = Batch::kWriting;
    return pump_writes();  // goes on to invalidate the batch
  }
  commit_batch();
}

void LocalStore::on_invalidate(int res) {
  Batch& b = batch_;
  if (res < 0) b.inval_failed = true;
  if (--b.inval_left > 0) return;
  if (b.inval_failed) degraded_ = true;
  fail_batch();
}

void LocalStore::fail_batch() {
  Batch& b = batch_;
  const bool full = is_disk_full(b.error);
  const Status s = full ? Status::kCapacityExceeded : Status::kInternalError;
  ++write_errors_;
  next_batch_ = b.batch_no;  // the batch never happened: its number is reused
  if (full) {
    ++disk_full_;
    // The head's unwritten part has no disk behind it: stop using it, and stop growing.
    cap_segments();
    seal_head();
  }
  b.active = false;
  std::vector<BackendOp*> recs;
  recs.swap(b.recs);
  for (BackendOp* op : recs) finish(op, s);
}

void LocalStore::commit_batch() {
  Batch& b = batch_;
  SegState& g = segments_[b.seg];
  uint64_t value_bytes = 0;
  bool callers = false;         // the batch carried a caller's op
  std::vector<uint32_t> grown;  // limited namespaces a Store added to
  for (size_t i = 0; i < b.recs.size(); ++i) {
    BackendOp* op = b.recs[i];
    const InternalOp* in = is_internal(op) ? internal(op) : nullptr;
    callers |= in == nullptr;
    Location old;
    if (op->kind == BackendOpKind::kPut) {
      if (in != nullptr) {
        // A copy replaces the value it copied, and nothing newer (copies go alone, so nothing
        // newer can have come; checked all the same).
        const Location* cur = index_.find(op->nsid, op->key);
        if (cur == nullptr || cur->segment != in->src_seg || cur->offset != in->src_off) continue;
      }
      Location loc;
      loc.segment = b.seg;
      loc.offset = b.value_off[i];
      loc.length = static_cast<uint32_t>(op->value.size());
      loc.set_checksum(b.checksum[i]);
      if (index_.upsert(op->nsid, op->key, loc, &old)) {
        --segments_[old.segment].live;
        held_sub(op->nsid, op->key, old);
      }
      ++g.live;
      held_add(op->nsid, op->key, loc);
      if (in != nullptr) {
        copied_bytes_.fetch_add(op->value.size());
      } else {
        value_bytes += op->value.size();
        if (ns(op->nsid).limited) grown.push_back(op->nsid);
      }
    } else if (index_.erase(op->nsid, op->key, &old)) {
      --segments_[old.segment].live;
      held_sub(op->nsid, op->key, old);
      if (in == nullptr) removals_(op->nsid, op->key);  // an eviction was reported when it happened
    }
  }
  if (callers) cleanings_ = 0;
  // A namespace over its quota now gives up its own oldest values (the Stores just made durable
  // are its newest): they leave the index at once, their tombstones go in the next batch.
  std::sort(grown.begin(), grown.end());
  grown.erase(std::unique(grown.begin(), grown.end()), grown.end());
  for (uint32_t nsid : grown) enforce_quota(nsid, ns(nsid));
  const uint64_t new_end = uint64_t{b.stream_start} + b.stream_len;
  bytes_used_.fetch_add(new_end - g.end);
  g.end = static_cast<uint32_t>(new_end);
  keys_.store(index_.size());
  index_bytes_.store(index_.memory_bytes());
  written_bytes_.fetch_add(value_bytes);
  log_bytes_.fetch_add(b.stream_len);
  flushes_.fetch_add(1);
  batch_records_.fetch_add(b.recs.size());
  if (b.recs.size() > batch_max_.load()) batch_max_.store(b.recs.size());
  b.active = false;
  std::vector<BackendOp*> recs;
  recs.swap(b.recs);
  for (BackendOp* op : recs) finish(op, Status::kSuccess);
  b.recs.swap(recs);  // keep the capacity
  b.recs.clear();
}

// ---- segments ---------------------------------------------------------------------------------

int LocalStore::reserve(uint32_t s) {
  SegState& g = segments_[s];
  if (g.reserved) return 0;
  const uint64_t base = seg_base(s);
  if (hook_ != nullptr) {
    if (const int r = hook_->resize(base + seg_bytes_); r < 0) return -r;
  }
  if (preallocate_) {
    if (::fallocate(fd_, 0, static_cast<off_t>(base), seg_bytes_) == 0) {
      g.reserved = true;
      file_size_ = std::max(file_size_, base + seg_bytes_);
      return 0;
    }
    if (errno != EOPNOTSUPP) return errno;
    preallocate_ = false;  // the file system can't: fall back to a sparse file
  }
  if (file_size_ < base + seg_bytes_) {
    if (::ftruncate(fd_, static_cast<off_t>(base + seg_bytes_)) != 0) return errno;
    file_size_ = base + seg_bytes_;
  }
  return 0;
}

// After a full file system: the log stops growing at the segments that have space behind them;
// from now on the oldest is reclaimed instead. Capacity reports what is really there.
void LocalStore::cap_segments() {
  std::vector<uint32_t> keep;
  for (uint32_t s : free_) {
    if (segments_[s].reserved) keep.push_back(s);
  }
  free_.swap(keep);
  capacity_.store(uint64_t{fifo_.size() + free_.size()} * seg_bytes_);
}

void LocalStore::seal_head() {
  if (head_ == kNone) return;
  SegState& g = segments_[head_];
  if (g.end == 0) {
    // Never written: it holds nothing; give it back (its old log, if any, was reclaimed already
    // in memory and is older than everything else, so it can't shadow anything on disk).
    fifo_.pop_back();
    g.seq = 0;
    if (g.reserved) {
      free_.push_back(head_);
      std::sort(free_.begin(), free_.end(), std::greater<>());
    }
  } else {
    last_sealed_seq_ = g.seq;
    last_sealed_end_ = g.end;
  }
  head_ = kNone;
  head_wait_readers_ = false;
  segments_used_.store(fifo_.size());
}

void LocalStore::start_head(uint32_t s, bool wait_readers) {
  SegState& g = segments_[s];
  g.seq = next_seq_++;
  g.end = 0;
  g.live = 0;
  head_ = s;
  head_wait_readers_ = wait_readers;
  fifo_.push_back(s);
  segments_used_.store(fifo_.size());
}

void LocalStore::reclaim(uint32_t s) {
  SegState& g = segments_[s];
  if (g.live > 0) {
    std::vector<NsKey> victims;
    victims.reserve(g.live);
    index_.for_each([&](uint32_t nsid, const Key& k, const Location& loc) {
      if (loc.segment == s) victims.push_back(NsKey{nsid, k});
    });
    for (const NsKey& k : victims) {
      Location old;
      index_.erase(k.nsid, k.key, &old);
      held_sub(k.nsid, k.key, old);
      if (ns(k.nsid).limited) copy_dropped_.fetch_add(1);
      removals_(k.nsid, k.key);
    }
    keys_.store(index_.size());
  }
  bytes_used_.fetch_sub(g.end);
  g.seq = 0;
  g.end = 0;
  g.live = 0;
  g.stale_header = true;
  reclaimed_.fetch_add(1);
}

Status LocalStore::switch_segment() {
  seal_head();
  while (!free_.empty()) {
    const uint32_t s = free_.back();
    const int e = reserve(s);
    if (e == 0) {
      free_.pop_back();
      start_head(s, segments_[s].readers > 0);  // reclaimed by copy-forward: may still be read
      return Status::kSuccess;
    }
    ++write_errors_;
    if (!is_disk_full(e)) return Status::kInternalError;
    ++disk_full_;
    cap_segments();  // drops s and every other segment without space
    break;           // and reclaims the oldest instead, as a store capped at open does
  }
  if (fifo_.empty()) return Status::kCapacityExceeded;
  // Always the oldest: a tombstone then outlives every older record of its key (they sit in
  // older segments or earlier in its own), so reclaim can never resurrect a deleted key.
  const uint32_t v = fifo_.front();
  fifo_.pop_front();
  reclaim(v);
  if (int e = reserve(v); e != 0) {
    ++write_errors_;
    free_.push_back(v);  // empty now; cap_segments drops it if it has no space behind it
    std::sort(free_.begin(), free_.end(), std::greater<>());
    segments_used_.store(fifo_.size());
    if (!is_disk_full(e)) return Status::kInternalError;
    ++disk_full_;
    cap_segments();
    return Status::kCapacityExceeded;
  }
  start_head(v, segments_[v].readers > 0);
  return Status::kSuccess;
}

// ---- quotas ----------------------------------------------------------------------------------

NsState& LocalStore::ns(uint32_t nsid) {
  if (auto it = ns_.find(nsid); it != ns_.end()) return it->second;  // only this thread inserts
  std::lock_guard lk(ns_mu_);
  return ns_[nsid];
}

void LocalStore::held_add(uint32_t nsid, const Key& k, const Location& loc) {
  NsState& n = ns(nsid);
  n.held.fetch_add(held_charge(loc.length), std::memory_order_relaxed);
  if (n.limited) n.order.insert(LogPos{segments_[loc.segment].seq, loc.offset, k});
}

void LocalStore::held_sub(uint32_t nsid, const Key& k, const Location& loc) {
  NsState& n = ns(nsid);
  n.held.fetch_sub(held_charge(loc.length), std::memory_order_relaxed);
  if (n.limited) n.order.erase(LogPos{segments_[loc.segment].seq, loc.offset, k});
}

// At open: what each namespace holds, and the quotas enforced (a crash may have brought back
// values evicted before their tombstones were durable).
void LocalStore::account_index() {
  index_.for_each(
      [&](uint32_t nsid, const Key& k, const Location& loc) { held_add(nsid, k, loc); });
  for (auto& [nsid, n] : ns_) {
    if (n.limited) enforce_quota(nsid, n);
  }
}

void LocalStore::enforce_quota(uint32_t nsid, NsState& n) {
  while (n.held.load(std::memory_order_relaxed) > n.quota && !n.order.empty()) {
    const Key k = n.order.begin()->key;
    Location old;
    if (!index_.erase(nsid, k, &old)) {
      n.order.erase(n.order.begin());  // not reached: the order mirrors the index
      continue;
    }
    --segments_[old.segment].live;
    held_sub(nsid, k, old);
    n.evictions.fetch_add(1, std::memory_order_relaxed);
    removals_(nsid, k);
    queue_tombstone(nsid, k);
  }
  keys_.store(index_.size());
}

// The tombstone goes ahead of every op still pending (all of them came after the eviction), so a
// later Store of the key is never undone by it. Until it is durable, a crash may bring the
// evicted value back: its last value, as after a reclaim.
void LocalStore::queue_tombstone(uint32_t nsid, const Key& k) {
  auto* t = new InternalOp;
  t->op.kind = BackendOpKind::kDelete;
  t->op.nsid = nsid;
  t->op.key = k;
  t->op.done = &internal_done;
  t->op.user = t;
  pending_.push_front(&t->op);
}

// When the last free segment has become the head, the oldest is reclaimed at once (so a free
// segment is always there for the next switch), and its live values of limited namespaces are
// first copied into the head. Only when a write waits: a store opened with no free segment
// reclaims nothing until something is written.
bool LocalStore::cleaning_wanted() const {
  return !quotas_.empty() && free_.empty() && !pending_.empty() && head_ != kNone &&
         fifo_.size() >= 2 &&
         cleanings_ <= nseg_;  // a caller's batch that finds no room after a lap: plain reclaim
}

void LocalStore::start_cleaning() {
  const uint32_t o = fifo_.front();
  const uint64_t seq = segments_[o].seq;
  ++cleanings_;
  clean_seg_ = o;
  for (auto& [nsid, n] : ns_) {
    if (!n.limited) continue;
    // The oldest segment's values come first in every namespace's order.
    for (auto it = n.order.begin(); it != n.order.end() && it->seq == seq; ++it) {
      const Location* loc = index_.find(nsid, it->key);
      if (loc == nullptr || loc->segment != o) continue;
      auto c = std::make_unique<InternalOp>();
      const uint64_t start = round_down(loc->offset, io_align_);
      const uint64_t end = round_up(uint64_t{loc->offset} + loc->length, io_align_);
      c->buf = alloc_aligned(std::max<uint64_t>(end - start, 1), std::max(mem_align_, kBlock));
      bool good = true;
      for (uint64_t got = 0; good && got < end - start;) {
        const ssize_t r = ::pread(fd_, c->buf.get() + got, end - start - got,
                                  static_cast<off_t>(seg_base(o) + start + got));
        if (r <= 0) {
          ++read_errors_;
          good = false;
        } else {
          got += static_cast<uint64_t>(r);
        }
      }
      const std::byte* v = c->buf.get() + (loc->offset - start);
      if (good && checksum64(v, loc->length) != loc->checksum()) {
        ++checksum_failures_;
        good = false;
      }
      if (!good) continue;  // left in the segment: reclaim drops it (counted)
      c->copy = true;
      c->src_seg = o;
      c->src_off = loc->offset;
      c->op.kind = BackendOpKind::kPut;
      c->op.nsid = nsid;
      c->op.key = it->key;
      c->op.value = {v, loc->length};
      c->op.done = &internal_done;
      c->op.user = c.get();
      copies_.push_back(&c.release()->op);
    }
  }
  if (copies_.empty()) finish_cleaning();
}

void LocalStore::form_copy_batch() {
  auto header_area = [](uint64_t n, uint64_t inl) {
    return round_up(sizeof(BatchHeader) + n * sizeof(RecordEntry) + inl, kBlock);
  };
  batch_.recs.clear();
  uint64_t entries = 0, inline_bytes = 0, data_bytes = 0;
  while (!copies_.empty()) {
    BackendOp* op = copies_.front();
    const uint64_t len = op->value.size();
    const bool inl = len <= kInlineMax;
    const uint64_t n_entries = entries + 1;
    const uint64_t n_inline = inline_bytes + (inl ? len : 0);
    const uint64_t n_data = data_bytes + (inl ? 0 : round_up(len, kBlock));
    const uint64_t need = header_area(n_entries, n_inline) + n_data;
    if (entries > 0 && (n_entries > kMaxBatchRecords || n_inline > kMaxInlineBytesPerBatch ||
                        need > kMaxBatchBytes || !head_fits(need))) {
      break;
    }
    if (entries == 0 && !head_fits(need)) {
      // The head is full and no segment is free (a store that got its quotas with a full log,
      // or a full file system): the copies left are given up, and the reclaim drops their values.
      if (free_.empty() || switch_segment() != Status::kSuccess) {
        while (!copies_.empty()) {
          finish(copies_.front(), Status::kCapacityExceeded);
          copies_.pop_front();
        }
        finish_cleaning();
        return form_batch();
      }
      if (head_wait_readers_) return;
    }
    copies_.pop_front();
    batch_.recs.push_back(op);
    entries = n_entries;
    inline_bytes = n_inline;
    data_bytes = n_data;
  }
  if (!batch_.recs.empty()) start_batch(inline_bytes, data_bytes);
}

// The copies are durable (or given up): the segment's header is zeroed and flushed, then it is
// reclaimed (what is left in it, of namespaces without a quota, is dropped) and becomes the free
// segment the next switch takes. Zeroed first, so a reopen cannot find the dropped keys again
// (its reuse then has no old header to clear: the same one write and flush, done earlier).
void LocalStore::finish_cleaning() {
  clean_clearing_ = true;
  clean_clear_left_ = 2;
  clean_clear_failed_ = false;
  io_uring_sqe* s = ring_->sqe();
  prep_write(s, zero_block(), kBlock, seg_base(clean_seg_), &clean_tag_);
  s->flags |= IOSQE_IO_LINK;
  s = ring_->sqe();
  ring_->prep_fdatasync(s, fd_, &clean_tag_);
  ++sqe_inflight_;
}

void LocalStore::on_clean_clear(int res) {
  if (res < 0) clean_clear_failed_ = true;
  if (--clean_clear_left_ > 0) return;
  clean_clearing_ = false;
  if (clean_clear_failed_) ++write_errors_;
  const uint32_t o = clean_seg_;
  clean_seg_ = kNone;
  if (o == kNone || fifo_.empty() || fifo_.front() != o || o == head_) return;  // not reached
  fifo_.pop_front();
  reclaim(o);
  // Not cleared: its reuse zeroes the old header first, as after a plain reclaim.
  segments_[o].stale_header = clean_clear_failed_;
  free_.push_back(o);
  std::sort(free_.begin(), free_.end(), std::greater<>());
  segments_used_.store(fifo_.size());
}

}  // namespace gdkv::local
