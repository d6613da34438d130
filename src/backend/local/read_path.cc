// The local store's read path: Gets, zero-copy when the buffer allows (see store.h).
#include <algorithm>

#include "backend/local/store.h"

namespace gdkv::local {

// ---- reads ------------------------------------------------------------------------------------

void LocalStore::start_get(BackendOp* op) {
  const Location* l = index_.find(op->nsid, op->key);
  if (l == nullptr) return finish(op, Status::kKeyNotExist);
  const Location loc = *l;
  std::span<std::byte> dst;
  std::shared_ptr<std::byte> owned;
  if (op->sink != nullptr) {
    dst = op->sink(op, loc.length);
    // Nothing wanted (a length query): the value's length is all the caller asked for.
    if (dst.empty() || loc.length == 0) return finish(op, Status::kSuccess, loc.length);
  } else {
    if (loc.length == 0) {
      op->view = ValueView{};
      return finish(op, Status::kSuccess, 0);
    }
    const size_t n = round_up(loc.length, kBlock);
    auto* mem = static_cast<std::byte*>(read_arena_->allocate(n));
    if (mem == nullptr) return finish(op, Status::kInternalError);
    owned = std::shared_ptr<std::byte>(
        mem, [arena = read_arena_, n](std::byte* p) { arena->release(p, n); });
    dst = {owned.get(), n};
  }
  std::unique_ptr<ReadJob> jp;
  if (job_pool_.empty()) {
    jp = std::make_unique<ReadJob>();
  } else {
    jp = std::move(job_pool_.back());
    job_pool_.pop_back();
  }
  ReadJob* j = jp.release();
  j->op = op;
  j->seg = loc.segment;
  j->vfile = seg_base(loc.segment) + loc.offset;
  j->len = loc.length;
  j->checksum = loc.checksum();
  j->dst = dst.data();
  j->want = owned ? loc.length : std::min<uint64_t>(loc.length, dst.size());
  j->owned = std::move(owned);
  j->fallback = false;
  direct_mode(j);
  j->failed = false;
  j->waiting = false;
  j->outstanding = 0;
  j->first = j->count = 0;
  j->sum.reset();
  ++segments_[loc.segment].readers;
  ++jobs_active_;
  advance(j);
}

// Plans the read: zero copy when the value starts on an aligned offset and the buffer is
// aligned (the aligned part of what is wanted goes straight into it); the rest, or everything
// when that is impossible, goes through bounce buffers.
void LocalStore::direct_mode(ReadJob* j) {
  const bool aligned = !j->fallback && j->vfile % io_align_ == 0 &&
                       reinterpret_cast<uintptr_t>(j->dst) % mem_align_ == 0;
  if (!aligned) {
    j->direct = 0;
  } else if (j->owned) {
    j->direct = round_up(j->len, io_align_);  // our own buffer: padding may land in it
  } else {
    j->direct = round_down(j->want, io_align_);
  }
  j->npieces = 0;
  if (j->direct > 0) {
    j->npieces =
        static_cast<uint32_t>(std::clamp<uint64_t>(j->direct / kMinDirectPiece, 1, kDirectPieces));
    const uint64_t step = round_up(j->direct / j->npieces, io_align_);
    for (uint32_t i = 0; i < j->npieces; ++i) {
      ReadJob::Piece& p = j->pieces[i];
      p.off = i * step;
      p.len = static_cast<uint32_t>(i + 1 == j->npieces ? j->direct - p.off : step);
      p.got = 0;
      p.done = false;
    }
  }
  j->pieces_hashed = 0;
  j->direct_issued = false;
  const uint64_t direct_value = std::min<uint64_t>(j->direct, j->len);
  j->next_file = round_down(j->vfile + direct_value, io_align_);
  j->end_file = direct_value == j->len ? j->next_file : round_up(j->vfile + j->len, io_align_);
  j->hashed = 0;
  j->sum.reset();
}

void LocalStore::issue_piece(ReadJob* j, uint32_t idx) {
  ReadJob::Piece& p = j->pieces[idx];
  p.tag.slot = idx;
  p.tag.owner = j;
  io_uring_sqe* s = ring_->sqe();
  prep_read(s, j->dst + p.off + p.got, p.len - p.got, j->vfile + p.off + p.got, false);
  io_uring_sqe_set_data(s, &p.tag);
  ++j->outstanding;
}

void LocalStore::on_read(IoTag* t, int res) {
  auto* j = static_cast<ReadJob*>(t->owner);
  --j->outstanding;
  if (t->kind == IoTag::kDirect) {
    ReadJob::Piece& p = j->pieces[t->slot];
    if ((res == -EFAULT || res == -EINVAL) && direct_io_) {
      // The caller's memory can't take O_DIRECT (device memory, or an alignment the file system
      // didn't report): once the other pieces are back, read it all through bounce buffers.
      j->fallback = true;
    } else if (res <= 0) {
      j->failed = true;  // an I/O error, or end of file inside a value: the log is damaged
      ++read_errors_;
    } else {
      p.got += static_cast<uint32_t>(res);
      if (p.got < p.len) return issue_piece(j, t->slot);  // short read: continue
      p.done = true;
    }
  } else {
    ReadJob::Chunk& c = j->chunks[t->slot];
    if (res <= 0) {
      j->failed = true;
      ++read_errors_;
      c.done = true;
    } else {
      c.got += static_cast<uint32_t>(res);
      if (c.got < c.len) return issue_chunk(j, t->slot);
      c.done = true;
    }
  }
  advance(j);
}

void LocalStore::issue_chunk(ReadJob* j, uint32_t idx) {
  ReadJob::Chunk& c = j->chunks[idx];
  c.tag.slot = idx;
  c.tag.owner = j;
  io_uring_sqe* s = ring_->sqe();
  prep_read(s, bounce(c.buf) + c.got, c.len - c.got, c.file_off + c.got, true);
  io_uring_sqe_set_data(s, &c.tag);
  ++j->outstanding;
}

// Moves a Get forward as far as it can: issue the direct read, hash what has landed in value
// order (the checksum is a stream), copy bounce data to the caller, issue more bounce reads, and
// finish once every byte of the value has been checked.
//
// Reads it issues go to the kernel at once, not with the next batch of the loop: a read queued
// behind the handling of other completions starts late, and reads submitted in bursts come back
// in bursts, which idles the device between them. On this machine's virtio disk that is 4 KiB
// QD 32 at 0.73-0.81 of fio batched and 0.90-1.07 submitted at once, with CPU per read about the
// same (docs/benchmarks.md).
void LocalStore::advance(ReadJob* j) {
  const unsigned before = sqe_inflight_;
  step(j);
  if (sqe_inflight_ > before) io_uring_submit(ring_->ring());
}

void LocalStore::step(ReadJob* j) {
  if (j->fallback && j->npieces > 0) {
    if (j->outstanding > 0) return;  // the other pieces are still out
    direct_mode(j);                  // with `fallback` set: bounce reads only
  }
  if (!j->failed && j->npieces > 0 && !j->direct_issued) {
    if (sqe_inflight_ + j->npieces > read_sqe_limit_) {
      if (!j->waiting) {
        j->waiting = true;
        waiting_.push_back(j);
      }
      return;
    }
    j->direct_issued = true;
    for (uint32_t i = 0; i < j->npieces; ++i) issue_piece(j, i);
  }
  // Hash the direct prefix piece by piece, in order, as the pieces land.
  while (!j->failed && j->pieces_hashed < j->npieces && j->pieces[j->pieces_hashed].done) {
    const ReadJob::Piece& p = j->pieces[j->pieces_hashed++];
    const uint64_t n = p.off >= j->len ? 0 : std::min<uint64_t>(p.len, j->len - p.off);
    if (j->npieces == 1 && n == j->len) {
      // The whole value in one piece (a small value in the caller's buffer): one shot is faster.
      const bool good = checksum64(j->dst, n) == j->checksum;
      if (!good) ++checksum_failures_;
      return finish_read(j, good ? Status::kSuccess : Status::kUnrecoveredError);
    }
    j->sum.update(j->dst + p.off, n);
    j->hashed = p.off + n;
  }
  const bool direct_ready = j->pieces_hashed == j->npieces;
  while (j->count > 0 && j->chunks[j->first].done && (direct_ready || j->failed)) {
    ReadJob::Chunk& c = j->chunks[j->first];
    if (!j->failed) {
      const uint64_t vb = std::max<uint64_t>(std::max(c.file_off, j->vfile) - j->vfile, j->hashed);
      const uint64_t ve = std::min<uint64_t>(c.file_off + c.len, j->vfile + j->len) - j->vfile;
      if (ve > vb) {
        const std::byte* src = bounce(c.buf) + (j->vfile + vb - c.file_off);
        j->sum.update(src, ve - vb);
        if (vb < j->want) std::memcpy(j->dst + vb, src, std::min(ve, j->want) - vb);
        j->hashed = ve;
      }
    }
    bounce_free_.push_back(c.buf);
    j->first = (j->first + 1) % kChunksPerJob;
    --j->count;
  }
  while (!j->failed && j->count < kChunksPerJob && j->next_file < j->end_file &&
         !bounce_free_.empty() && read_credit()) {
    const uint32_t idx = (j->first + j->count) % kChunksPerJob;
    ReadJob::Chunk& c = j->chunks[idx];
    c.buf = bounce_free_.back();
    bounce_free_.pop_back();
    c.file_off = j->next_file;
    c.len = static_cast<uint32_t>(std::min<uint64_t>(kBounceBytes, j->end_file - j->next_file));
    c.got = 0;
    c.done = false;
    ++j->count;
    j->next_file += c.len;
    issue_chunk(j, idx);
  }
  if (j->outstanding > 0) return;
  if (j->failed) {
    // Release whatever finished chunks remain (their data is not wanted any more).
    while (j->count > 0) {
      bounce_free_.push_back(j->chunks[j->first].buf);
      j->first = (j->first + 1) % kChunksPerJob;
      --j->count;
    }
    return finish_read(j, Status::kUnrecoveredError);
  }
  if (j->hashed == j->len && j->count == 0) {
    if (j->sum.digest() != j->checksum) {
      ++checksum_failures_;
      return finish_read(j, Status::kUnrecoveredError);
    }
    return finish_read(j, Status::kSuccess);
  }
  // Out of bounce buffers or SQE credit with nothing in flight: wait for another read to end.
  if (!j->waiting) {
    j->waiting = true;
    waiting_.push_back(j);
  }
}

void LocalStore::finish_read(ReadJob* j, Status s) {
  BackendOp* op = j->op;
  const uint64_t len = j->len;
  --segments_[j->seg].readers;
  if (s == Status::kSuccess) {
    read_bytes_.fetch_add(j->want);
    if (j->owned) {
      op->view = ValueView{{j->owned.get(), len}, std::move(j->owned)};
    }
  }
  j->owned.reset();
  j->op = nullptr;
  if (j->waiting) {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), j));
    j->waiting = false;
  }
  job_pool_.emplace_back(j);
  --jobs_active_;
  finish(op, s, len);
}

void LocalStore::pump_waiting() {
  // Each waiting job gets one try per round; one that still can't move stays in line.
  size_t n = waiting_.size();
  while (n-- > 0 && !waiting_.empty()) {
    if (!read_credit()) return;
    ReadJob* j = waiting_.front();
    waiting_.pop_front();
    j->waiting = false;
    advance(j);
  }
}

}  // namespace gdkv::local
