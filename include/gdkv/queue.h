// Queue pairs with NVMe semantics, shared by a controller and many requesters.
//
// A queue pair is one block of memory (see QueueLayout) holding a ring of 64-byte SQEs, a ring of
// 16-byte CQEs with phase tags, two doorbells and the requesters' bookkeeping. QueueRef is a
// small, trivially-copyable view of that block: CPU threads hold it, and kernels get it by value.
// The requester side below is GDKV_HD code: CPU threads and GPU threads run the same functions.
//
// Protocol (requester side; any number of threads at once, no lock on the submit path):
//   1. try_acquire(): take a credit and a free command id. At most depth-1 commands are in flight,
//      so the completion ring can never overflow and an SQ slot is never reused before the
//      controller has fetched it. Fails (back-pressure) when the queue is full.
//   2. submit(): take SQ tickets with one fetch_add, write the entries, mark each slot filled,
//      then publish: any thread advances the published tail over every consecutive filled slot
//      (so a slow writer never blocks others for longer than its own write) and rings the doorbell.
//   3. wait()/poll(): whoever holds the reaper flag drains new CQEs (phase tag tells new from old)
//      into per-command-id result slots; each requester watches only its own slot, then release()s
//      the id and the credit.
// Doorbells are 32-bit counters, not ring indexes (depth is a power of two so counter % depth is
// the index across wrap-around): the controller compares a doorbell with its own counter, so a
// late, smaller doorbell write from another thread is harmless. Every counter is compared by
// unsigned difference, so wrap-around at 2^32 is fine.
//
// Thread safety: all functions may be called concurrently on one QueueRef, except that a command id
// is used only by the thread that acquired it, until it releases it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gdkv/nvme_kv.h"
#include "gdkv/platform.h"

namespace gdkv {

// The result of one command as the requester sees it.
struct CmdResult {
  nvme::Status status;
  uint8_t status_type;  // SCT
  uint32_t dw0;         // Retrieve: the value's full length
  GDKV_HD constexpr bool ok() const noexcept { return status == nvme::Status::kSuccess; }
};

// Per command id: where the reaper leaves a completion for its requester. Each slot has its own
// 64-byte line: a waiting requester spins on its `done`, and slots sharing a line would make every
// completion invalidate the lines other waiters are polling.
struct alignas(64) CmdSlot {
  uint32_t done;  // 1 once the completion arrived; 0 again after release()
  uint32_t dw0;
  uint16_t status;  // CQE status field, phase bit cleared
  uint16_t reserved0;
  uint32_t reserved1;
};
static_assert(sizeof(CmdSlot) == 64 && alignof(CmdSlot) == 64);

// Requester bookkeeping; each counter on its own cache line.
struct QueueControl {
  alignas(64) uint32_t credits_taken;
  alignas(64) uint32_t credits_returned;
  alignas(64) uint32_t sq_ticket;     // SQ slots handed out
  alignas(64) uint32_t sq_published;  // consecutive filled slots (the value rung on the doorbell)
  alignas(64) uint32_t cq_head;       // CQEs consumed (the value rung on the CQ head doorbell)
  uint32_t reaper;                    // 1 while a thread drains the CQ
};

// The doorbells, 64 bytes apart (an NVMe doorbell stride of 4 << 4), so a pair maps onto NVMe's
// SQ y tail / CQ y head registers.
struct QueueDoorbells {
  alignas(64) uint32_t sq_tail;  // requesters → controller: SQEs published (counter)
  alignas(64) uint32_t cq_head;  // requesters → controller: CQEs consumed (counter)
};

// Where each part of a queue pair lives inside its memory block.
struct QueueLayout {
  size_t sq, cq, sq_seq, cid_bits, slots, control, doorbells, total;

  // REQUIRES: depth is a power of two in [2, 4096].
  static constexpr QueueLayout for_depth(uint32_t depth) noexcept {
    QueueLayout l{};
    size_t off = 0;
    auto take = [&off](size_t bytes) {
      size_t at = off;
      off = (off + bytes + 63) & ~size_t{63};
      return at;
    };
    l.sq = take(sizeof(nvme::Sqe) * depth);
    l.cq = take(sizeof(nvme::Cqe) * depth);
    l.sq_seq = take(sizeof(uint32_t) * depth);
    l.cid_bits = take(sizeof(uint32_t) * ((depth + 31) / 32));
    l.slots = take(sizeof(CmdSlot) * depth);
    l.control = take(sizeof(QueueControl));
    l.doorbells = take(sizeof(QueueDoorbells));
    l.total = off;
    return l;
  }
};

inline constexpr uint32_t kMinQueueDepth = 2;
inline constexpr uint32_t kMaxQueueDepth = 4096;
GDKV_HD constexpr bool valid_queue_depth(uint32_t d) noexcept {
  return d >= kMinQueueDepth && d <= kMaxQueueDepth && (d & (d - 1)) == 0;
}

// A view of one queue pair. Trivially copyable: pass it to kernels by value.
struct QueueRef {
  nvme::Sqe* sq = nullptr;
  nvme::Cqe* cq = nullptr;
  uint32_t* sq_seq = nullptr;    // per SQ slot: ticket + 1 once the entry is written
  uint32_t* cid_bits = nullptr;  // one bit per command id, set while in use
  CmdSlot* slots = nullptr;      // per command id
  QueueControl* ctl = nullptr;
  QueueDoorbells* db = nullptr;
  // Host only, may be null: the serving reactor's sleep word. Nonzero while the reactor sleeps;
  // a requester that rings the doorbell then sees it set calls wake_fn(wake) (like io_uring's
  // SQPOLL NEED_WAKEUP). Whoever serves the queue sets both; the queue knows nothing of its
  // server. GPU requesters leave them null and the reactor keeps polling.
  uint32_t* wake = nullptr;
  void (*wake_fn)(uint32_t* word) = nullptr;
  uint32_t depth = 0;
  uint16_t qid = 0;

  // A view over a zero-filled block laid out by QueueLayout::for_depth(depth).
  static QueueRef over(void* block, uint32_t depth, uint16_t qid) noexcept {
    auto* base = static_cast<unsigned char*>(block);
    QueueLayout l = QueueLayout::for_depth(depth);
    QueueRef q;
    q.sq = reinterpret_cast<nvme::Sqe*>(base + l.sq);
    q.cq = reinterpret_cast<nvme::Cqe*>(base + l.cq);
    q.sq_seq = reinterpret_cast<uint32_t*>(base + l.sq_seq);
    q.cid_bits = reinterpret_cast<uint32_t*>(base + l.cid_bits);
    q.slots = reinterpret_cast<CmdSlot*>(base + l.slots);
    q.ctl = reinterpret_cast<QueueControl*>(base + l.control);
    q.db = reinterpret_cast<QueueDoorbells*>(base + l.doorbells);
    q.depth = depth;
    q.qid = qid;
    return q;
  }
};

namespace queue {

// Takes one credit and a free command id. Returns false when depth-1 commands are in flight.
GDKV_HD inline bool try_acquire(const QueueRef& q, uint16_t* cid) noexcept {
  uint32_t taken = atomic::load(&q.ctl->credits_taken);
  for (;;) {
    uint32_t returned = atomic::load(&q.ctl->credits_returned);
    if (taken - returned >= q.depth - 1) return false;
    if (atomic::cas(&q.ctl->credits_taken, taken, taken + 1)) break;
  }
  // A credit guarantees a free id exists (fewer than depth ids are in use); find and claim one.
  const uint32_t words = (q.depth + 31) / 32;
  for (uint32_t start = taken % words;; start = (start + 1) % words) {
    uint32_t bits = atomic::load(&q.cid_bits[start]);
    while (bits != 0xFFFFFFFFu) {
      uint32_t free_bit = 0;
      while (bits & (1u << free_bit)) ++free_bit;
      uint32_t id = start * 32 + free_bit;
      if (id >= q.depth) break;
      uint32_t old = atomic::fetch_or(&q.cid_bits[start], 1u << free_bit);
      if (!(old & (1u << free_bit))) {
        *cid = static_cast<uint16_t>(id);
        return true;
      }
      bits = old | (1u << free_bit);
    }
  }
}

// Returns the command id and the credit taken by try_acquire.
// REQUIRES: the command's completion was consumed (or it was never submitted).
GDKV_HD inline void release(const QueueRef& q, uint16_t cid) noexcept {
  atomic::store(&q.slots[cid].done, 0u);
  atomic::fetch_and(&q.cid_bits[cid / 32], ~(1u << (cid % 32)));
  atomic::fetch_add(&q.ctl->credits_returned, 1u);
}

// Reserves `n` consecutive SQ slots; returns the first ticket. Slot of ticket t is t % depth.
// REQUIRES: the caller holds n credits.
GDKV_HD inline uint32_t reserve_slots(const QueueRef& q, uint32_t n) noexcept {
  return atomic::fetch_add(&q.ctl->sq_ticket, n);
}

// Writes an entry into the slot of `ticket` and marks it filled.
GDKV_HD inline void write_slot(const QueueRef& q, uint32_t ticket, const nvme::Sqe& sqe) noexcept {
  const uint32_t slot = ticket & (q.depth - 1);
  q.sq[slot] = sqe;
  atomic::fence();
  atomic::store(&q.sq_seq[slot], ticket + 1);
}

// Advances the published tail over every consecutive filled slot and rings the doorbell. Any
// thread may do this for the others; it never waits for a slot that is still being written.
GDKV_HD inline void publish(const QueueRef& q) noexcept {
  for (;;) {
    uint32_t p = atomic::load(&q.ctl->sq_published);
    while (atomic::load(&q.sq_seq[p & (q.depth - 1)]) == p + 1) {
      uint32_t expected = p;
      if (atomic::cas(&q.ctl->sq_published, expected, p + 1)) {
        ++p;
      } else {
        p = expected;
      }
    }
    atomic::store(&q.db->sq_tail, p);
    atomic::fence();
    // Another thread may have advanced the tail after our load but rung before our store; ring
    // again until the doorbell we left matches the published tail we see afterwards.
    if (atomic::load(&q.ctl->sq_published) == p) break;
  }
#if !defined(__CUDA_ARCH__) && !defined(__HIP_DEVICE_COMPILE__)
  if (q.wake != nullptr && q.wake_fn != nullptr && atomic::load(q.wake) != 0) q.wake_fn(q.wake);
#endif
}

// Submits `n` entries (their cid fields set from try_acquire) with one ticket grab and one ring.
GDKV_HD inline void submit(const QueueRef& q, const nvme::Sqe* sqes, uint32_t n) noexcept {
  uint32_t t = reserve_slots(q, n);
  for (uint32_t i = 0; i < n; ++i) write_slot(q, t + i, sqes[i]);
  publish(q);
}

// Drains new completions into the command slots, if no other thread is doing it. Returns how many
// it moved.
GDKV_HD inline uint32_t reap(const QueueRef& q) noexcept {
  uint32_t unlocked = 0;
  if (!atomic::cas(&q.ctl->reaper, unlocked, 1u)) return 0;
  uint32_t head = atomic::load(&q.ctl->cq_head);
  uint32_t n = 0;
  for (;;) {
    const nvme::Cqe* e = &q.cq[head & (q.depth - 1)];
    const uint16_t expected_phase = ((head / q.depth) & 1) ? 0 : 1;
    const uint16_t st = atomic::load(&e->status);
    if ((st & nvme::kCqePhase) != expected_phase) break;
    const uint16_t cid = e->cid;
    if (cid < q.depth) {
      CmdSlot& s = q.slots[cid];
      s.dw0 = e->dw0;
      s.status = static_cast<uint16_t>(st & ~nvme::kCqePhase);
      atomic::store(&s.done, 1u);
    }
    ++head;
    ++n;
  }
  if (n) {
    atomic::store(&q.ctl->cq_head, head);
    atomic::store(&q.db->cq_head, head);
  }
  atomic::store(&q.ctl->reaper, 0u);
  return n;
}

// True once the command's completion has been reaped (reaps if needed).
GDKV_HD inline bool poll(const QueueRef& q, uint16_t cid) noexcept {
  if (atomic::load(&q.slots[cid].done)) return true;
  reap(q);
  return atomic::load(&q.slots[cid].done) != 0;
}

// The completed command's result. REQUIRES: poll(q, cid) returned true.
GDKV_HD inline CmdResult result(const QueueRef& q, uint16_t cid) noexcept {
  const CmdSlot& s = q.slots[cid];
  return CmdResult{nvme::status_code(s.status), nvme::status_type(s.status), s.dw0};
}

// Spins until the command completes, then releases its id and credit and returns the result.
GDKV_HD inline CmdResult wait(const QueueRef& q, uint16_t cid) noexcept {
  while (!poll(q, cid)) atomic::pause();
  CmdResult r = result(q, cid);
  release(q, cid);
  return r;
}

}  // namespace queue
}  // namespace gdkv
