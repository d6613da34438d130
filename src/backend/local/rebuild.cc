// The local store's index rebuild at open (see store.h and docs/local-store.md).
#include <unistd.h>

#include <algorithm>

#include "backend/local/store.h"

namespace gdkv::local {

// Rebuild: read every segment header, then walk each segment's chain of batches, all segments in
// parallel through the ring (reads of kScanWindow bytes; a window usually holds several batch
// headers). Records are applied in (segment seq, offset) order: the newest record of a key wins,
// a tombstone removes it.
void LocalStore::rebuild() {
  struct Rec {
    uint32_t nsid;
    Key key;
    RecordType type;
    Location loc;
  };
  struct Walker {
    uint32_t seg = 0;
    SegmentHeader hdr{};
    uint32_t off = kBlock;  // next batch
    uint64_t expect = 0;    // next batch number (0: the first batch may carry any)
    AlignedBuf buf;
    size_t cap = 0;
    uint32_t buf_off = 0, buf_len = 0;
    bool reading = false, done = false;
    std::vector<Rec> recs;
    uint32_t last_off = 0;  // offset of the last good batch
    uint32_t last_total = 0;
    size_t last_first_rec = 0;  // its first record in recs
    uint64_t last_batch = 0;
    IoTag tag{IoTag::kScan};
  };
  io_uring* ring = ring_->ring();
  std::vector<std::unique_ptr<Walker>> walkers;

  // 1. Segment headers (synchronously; one block each, within the file only).
  AlignedBuf blk = alloc_aligned(kBlock, kBlock);
  for (uint32_t i = 0; i < nseg_; ++i) {
    if (seg_base(i) + kBlock > file_size_) continue;
    const ssize_t r = ::pread(fd_, blk.get(), kBlock, static_cast<off_t>(seg_base(i)));
    if (r != kBlock) continue;
    auto h = parse_segment_header(blk.get(), store_id_, i, seg_bytes_);
    if (!h) {
      SegmentHeader raw;
      std::memcpy(&raw, blk.get(), sizeof(raw));
      if (raw.magic == kSegmentMagic && raw.store_id == store_id_) ++invalid_headers_;
      continue;
    }
    auto w = std::make_unique<Walker>();
    w->seg = i;
    w->hdr = *h;
    walkers.push_back(std::move(w));
  }

  // 2. Walk the chains.
  auto step = [&](Walker& w) {
    // Parse what the window holds; ask for a new window when the next header lies outside it.
    while (!w.done) {
      if (w.off + kBlock > seg_bytes_) {
        w.done = true;
        return false;
      }
      const bool in_window = w.buf_len > 0 && w.off >= w.buf_off &&
                             w.off + sizeof(BatchHeader) <= uint64_t{w.buf_off} + w.buf_len;
      if (!in_window) return true;
      const std::byte* p = w.buf.get() + (w.off - w.buf_off);
      const size_t avail = w.buf_off + w.buf_len - w.off;
      auto h = peek_batch_header(p, avail, store_id_, w.hdr.seq, w.off, seg_bytes_);
      if (!h || (w.expect != 0 && h->batch != w.expect)) {
        BatchHeader raw;
        std::memcpy(&raw, p, sizeof(raw));
        if (raw.magic == kBatchMagic && raw.store_id == store_id_ && raw.seq == w.hdr.seq &&
            raw.offset == w.off && !h) {
          ++invalid_headers_;
        }
        w.done = true;
        return false;
      }
      if (h->header_bytes > avail) return true;  // header area continues past the window
      if (!check_batch_entries(p, *h, seg_bytes_)) {
        ++invalid_headers_;
        w.done = true;
        return false;
      }
      w.last_off = w.off;
      w.last_total = h->total_bytes;
      w.last_first_rec = w.recs.size();
      w.last_batch = h->batch;
      for (uint32_t i = 0; i < h->count; ++i) {
        const RecordEntry e = entry_at(p, i);
        Rec r;
        r.nsid = e.nsid;
        r.key = Key::from_bytes(e.key, e.key_len);
        r.type = static_cast<RecordType>(e.type);
        r.loc.segment = w.seg;
        r.loc.offset = e.value_off;
        r.loc.length = e.value_len;
        r.loc.set_checksum(e.checksum);
        w.recs.push_back(r);
      }
      w.expect = h->batch + 1;
      w.off += h->total_bytes;
    }
    return false;
  };
  auto issue = [&](Walker& w) {
    uint32_t want = kScanWindow;
    if (w.buf_len > 0 && w.off >= w.buf_off && w.off < w.buf_off + w.buf_len) {
      // The header area straddles the window: read at least all of it.
      BatchHeader raw;
      std::memcpy(&raw, w.buf.get() + (w.off - w.buf_off), sizeof(raw));
      want = std::max<uint32_t>(want, std::min<uint32_t>(raw.header_bytes, kMaxHeaderBytes));
    }
    want = static_cast<uint32_t>(std::min<uint64_t>(want, seg_bytes_ - w.off));
    if (seg_base(w.seg) + w.off >= file_size_) {
      w.done = true;
      return;
    }
    want = static_cast<uint32_t>(std::min<uint64_t>(want, file_size_ - seg_base(w.seg) - w.off));
    want = static_cast<uint32_t>(round_down(want, kBlock));
    if (want == 0 || (w.buf_len > 0 && w.buf_off == w.off && want <= w.buf_len)) {
      w.done = true;  // end of file, or a read here already came back short: no progress
      return;
    }
    if (w.cap < want) {
      w.buf = alloc_aligned(want, kBlock);
      w.cap = want;
    }
    w.buf_off = w.off;
    w.buf_len = 0;
    w.reading = true;
    w.tag.owner = &w;
    io_uring_sqe* s = ring_->sqe();
    io_uring_prep_read(s, fd_, w.buf.get(), want, seg_base(w.seg) + w.off);
    io_uring_sqe_set_data(s, &w.tag);
    ++sqe_inflight_;
  };
  size_t next = 0;
  unsigned active = 0;
  const unsigned limit = ring_->entries();
  while (next < walkers.size() || active > 0) {
    while (next < walkers.size() && active < limit) {
      Walker& w = *walkers[next++];
      if (step(w)) {
        issue(w);
        if (w.reading) ++active;
      }
    }
    if (active == 0) continue;
    io_uring_submit_and_wait(ring, 1);
    io_uring_cqe* cqe;
    unsigned head;
    unsigned seen = 0;
    std::vector<Walker*> ready;
    io_uring_for_each_cqe(ring, head, cqe) {
      ++seen;
      auto* w = static_cast<Walker*>(static_cast<IoTag*>(io_uring_cqe_get_data(cqe))->owner);
      w->reading = false;
      --active;
      --sqe_inflight_;
      if (cqe->res <= 0) {
        w->done = true;  // a read error ends the segment's scan where it is
        if (cqe->res < 0) ++read_errors_;
      } else {
        w->buf_len = static_cast<uint32_t>(round_down(static_cast<uint32_t>(cqe->res), kBlock));
        ready.push_back(w);
      }
    }
    io_uring_cq_advance(ring, seen);
    for (Walker* w : ready) {
      if (step(*w)) {
        issue(*w);
        if (w->reading) ++active;
      }
    }
  }

  // 3. Order segments oldest first and verify the newest segment's last batch: the only one a
  //    crash can have left half-written (one batch is in flight at a time). It is dropped whole
  //    if any value in it fails its checksum; it was never acknowledged.
  std::sort(walkers.begin(), walkers.end(),
            [](const auto& a, const auto& b) { return a->hdr.seq < b->hdr.seq; });
  if (!walkers.empty()) {
    Walker& w = *walkers.back();
    if (w.last_total > 0) {
      const uint64_t n = w.last_total;
      AlignedBuf b = alloc_aligned(n, kBlock);
      const ssize_t r = ::pread(fd_, b.get(), n, static_cast<off_t>(seg_base(w.seg) + w.last_off));
      bool good = r == static_cast<ssize_t>(n);
      for (size_t i = w.last_first_rec; good && i < w.recs.size(); ++i) {
        const Rec& rec = w.recs[i];
        if (rec.type != RecordType::kPut) continue;
        const std::byte* v = b.get() + (rec.loc.offset - w.last_off);
        good = checksum64(v, rec.loc.length) == rec.loc.checksum();
      }
      if (!good) {
        ++torn_dropped_;
        w.recs.resize(w.last_first_rec);
        w.off = w.last_off;
        w.expect = w.last_batch;  // the next batch written here takes the dropped one's number
        w.last_batch = w.last_batch - 1;
      }
    }
  }

  // 4. Detect segments whose scan ended before their successor says their log did (a corrupt
  //    batch header in the middle of a segment): reported, since what followed it is lost.
  for (size_t i = 0; i + 1 < walkers.size(); ++i) {
    const Walker& a = *walkers[i];
    const Walker& b = *walkers[i + 1];
    if (b.hdr.prev_seq == a.hdr.seq && a.off < b.hdr.prev_end) ++truncated_segments_;
  }

  // 5. Apply, oldest segment first.
  uint64_t max_batch = 0;
  for (const auto& wp : walkers) {
    Walker& w = *wp;
    for (const Rec& r : w.recs) {
      Location old;
      if (r.type == RecordType::kPut) {
        if (index_.upsert(r.nsid, r.key, r.loc, &old)) {
          --segments_[old.segment].live;
        }
        ++segments_[w.seg].live;
      } else if (index_.erase(r.nsid, r.key, &old)) {
        --segments_[old.segment].live;
      }
    }
    rebuild_records_ += w.recs.size();
    max_batch = std::max({max_batch, w.last_batch, w.expect > 0 ? w.expect - 1 : 0});
    next_seq_ = std::max(next_seq_, w.hdr.seq + 1);
  }
  next_batch_ = max_batch + 1;

  // 6. Segment table: segments with log join the FIFO (oldest first); the newest stays the head
  //    and keeps appending; empty ones are free.
  std::vector<bool> used(nseg_, false);
  uint64_t bytes = 0;
  for (size_t i = 0; i < walkers.size(); ++i) {
    Walker& w = *walkers[i];
    const bool newest = i + 1 == walkers.size();
    if (w.off <= kBlock && !newest) continue;  // a header and nothing after it
    SegState& g = segments_[w.seg];
    g.seq = w.hdr.seq;
    g.end = w.off;
    used[w.seg] = true;
    fifo_.push_back(w.seg);
    bytes += g.end;
    if (newest) head_ = w.seg;
  }
  for (uint32_t i = nseg_; i-- > 0;) {
    if (!used[i]) free_.push_back(i);
  }
  account_index();
  keys_.store(index_.size());
  index_bytes_.store(index_.memory_bytes());
  bytes_used_.store(bytes);
  segments_used_.store(fifo_.size());
}

}  // namespace gdkv::local
