#include "gdkv/client.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>

#include "gdkv/commands.h"

namespace gdkv {

struct ReceiveSpare {
  explicit ReceiveSpare(size_t n) : size(n) {}
  ~ReceiveSpare() { std::free(p.load()); }
  ReceiveSpare(const ReceiveSpare&) = delete;
  ReceiveSpare& operator=(const ReceiveSpare&) = delete;
  // The kept buffer, or null.
  std::byte* take() { return p.exchange(nullptr, std::memory_order_acquire); }
  // Keeps `b` (of `size` bytes) if nothing is kept, else frees it.
  void give(std::byte* b) {
    std::byte* none = nullptr;
    if (!p.compare_exchange_strong(none, b, std::memory_order_release)) std::free(b);
  }
  const size_t size;
  std::atomic<std::byte*> p{nullptr};
};

Result<std::unique_ptr<Client>> Client::open(std::shared_ptr<Backend> backend,
                                             const ClientOptions& options) {
  if (!backend) return Error{"Client::open: no backend"};
  auto ctl = std::make_unique<Controller>(std::move(backend), options.controller);
  Result<QueueRef> q = ctl->create_queue(options.queue);
  if (!q) return Error{q.error()};
  auto c = std::make_unique<Client>(*q, nullptr, ctl.get());
  c->owned_controller_ = std::move(ctl);
  return c;
}

Client::Client(QueueRef queue, std::shared_ptr<void> owner, Controller* controller,
               BufferStager* stager)
    : queue_(queue), owner_(std::move(owner)), stager_(stager), controller_(controller) {
  set_max_value_bytes(controller_ != nullptr ? controller_->options().max_value_bytes
                                             : max_value_bytes_);
}

void Client::set_max_value_bytes(uint64_t n) {
  max_value_bytes_ = n;
  spare_ = std::make_shared<ReceiveSpare>(std::clamp<uint64_t>(n, 1, UINT32_MAX));
}

Client::~Client() {
  if (owned_controller_) {
    owned_controller_->stop();
    owned_controller_.reset();
  }
}

std::optional<uint16_t> Client::try_start(nvme::Sqe sqe) {
  uint16_t cid;
  if (!queue::try_acquire(queue_, &cid)) return std::nullopt;
  sqe.cid = cid;
  queue::submit(queue_, &sqe, 1);
  return cid;
}

std::optional<uint16_t> Client::start(nvme::Sqe sqe) {
  Waiting full;
  for (uint32_t spins = 0;; ++spins) {
    if (broken()) return std::nullopt;
    if (auto cid = try_start(sqe)) return cid;
    // Full: completions we reap may free credits held by finished commands of other threads.
    queue::reap(queue_);
    atomic::pause();
    // A full queue on a controller that died or froze never drains: look every so often.
    if ((spins & 0xffff) == 0xffff && stuck(full)) return std::nullopt;
  }
}

bool Client::stuck(Waiting& w) {
  constexpr auto kLivenessPeriod = std::chrono::milliseconds(10);
  const auto now = std::chrono::steady_clock::now();
  if (w.since == std::chrono::steady_clock::time_point{}) w.since = w.next_look = now;
  if (alive_ && now >= w.next_look) {
    if (!alive_()) (void)fail(ClientFailure::kPeerGone);
    w.next_look = now + kLivenessPeriod;
  }
  if (timeout_.count() > 0 && now - w.since > timeout_) (void)fail(ClientFailure::kTimeout);
  return broken();
}

CmdResult Client::finish(uint16_t cid) {
  CmdResult r = queue::result(queue_, cid);
  queue::release(queue_, cid);
  return r;
}

namespace {
// What every call of a failed Client returns.
CmdResult aborted() { return CmdResult{nvme::Status::kAbortRequested, nvme::kSctGeneric, 0}; }
// A buffer that could not be staged.
CmdResult staging_exhausted() { return CmdResult{kStagingExhausted, nvme::kSctGeneric, 0}; }
}  // namespace

CmdResult Client::fail(ClientFailure why) {
  ClientFailure none = ClientFailure::kNone;
  if (failure_.compare_exchange_strong(none, why, std::memory_order_acq_rel) && on_failure_) {
    on_failure_(why);
  }
  return aborted();
}

CmdResult Client::wait(uint16_t cid) {
  if (waiter_ != nullptr) return wait_blocking(cid);
  // Most commands complete within a few microseconds: spin on the CQ before looking at clocks.
  for (uint32_t i = 0; i < 1024; ++i) {
    if (queue::poll(queue_, cid)) return finish(cid);
    atomic::pause();
  }
  return wait_slow(cid);
}

CmdResult Client::wait_slow(uint16_t cid) {
  Waiting w;
  (void)stuck(w);  // the timeout counts from here
  for (uint32_t n = 0;; ++n) {
    if (queue::poll(queue_, cid)) return finish(cid);
    // Failed, here or on another thread: nothing completes any more. (The id stays taken.)
    if (broken() || ((n & 63) == 63 && stuck(w))) return aborted();
    // Leave the core to the controller (on a small machine it may need this one).
    std::this_thread::yield();
  }
}

CmdResult Client::wait_blocking(uint16_t cid) {
  // Spin for as long as a completion usually takes, reading the clock every 16 polls. No spin:
  // straight to block(), which looks once more before it sleeps.
  if (const auto spin = waiter_->spin(); spin.count() > 0) {
    const auto until = std::chrono::steady_clock::now() + spin;
    for (uint32_t i = 1;; ++i) {
      if (queue::poll(queue_, cid)) {
        waiter_->spun(true);
        return finish(cid);
      }
      atomic::pause();
      if ((i & 15) == 0 && std::chrono::steady_clock::now() >= until) break;
    }
    waiter_->spun(false);
  }
  Waiting w;
  (void)stuck(w);  // the timeout counts from here
  for (uint32_t n = 0;; ++n) {
    if (queue::poll(queue_, cid)) return finish(cid);
    if (broken() || ((n & 7) == 7 && stuck(w))) return aborted();
    waiter_->block(queue_, cid);  // returns within a bounded time, so liveness is still checked
  }
}

CmdResult Client::execute(nvme::Sqe sqe) {
  auto cid = start(sqe);
  if (!cid) return aborted();
  return wait(*cid);
}

bool Client::stage(nvme::Sqe& sqe, const void* p, size_t len, bool to_controller, bool metadata,
                   bool wait) {
  if (stager_ == nullptr || len == 0) return true;
  const uint64_t addr = stager_->acquire(p, len, to_controller, wait);
  if (addr == 0) return false;
  if (!metadata && addr != reinterpret_cast<uint64_t>(p)) {
    copies_.fetch_add(1, std::memory_order_relaxed);
    copy_bytes_.fetch_add(len, std::memory_order_relaxed);
  }
  sqe.dptr.prp.prp1 = addr;
  return true;
}

void Client::unstage(const nvme::Sqe& sqe, const void* p, size_t len, bool to_controller,
                     const CmdResult& r) {
  if (stager_ == nullptr || len == 0) return;
  // Aborted because the Client failed: the command may still be in flight, so its stand-in is
  // never handed out again.
  if (r.status == nvme::Status::kAbortRequested && broken()) return;
  size_t copy_back = 0;
  if (!to_controller && r.ok()) {
    // A Retrieve delivered min(value, buffer) bytes; the rest of the stand-in is not the caller's.
    copy_back = sqe.opcode == static_cast<uint8_t>(nvme::Opcode::kRetrieve)
                    ? std::min<size_t>(len, r.dw0)
                    : len;
  }
  stager_->release(sqe.dptr.prp.prp1, const_cast<void*>(p), copy_back);
}

CmdResult Client::execute_data(nvme::Sqe sqe, const void* p, size_t len, bool to_controller,
                               bool metadata) {
  if (broken()) return aborted();
  if (!stage(sqe, p, len, to_controller, metadata)) return staging_exhausted();
  CmdResult r = execute(sqe);
  unstage(sqe, p, len, to_controller, r);
  return r;
}

// Pipelined: items are staged and submitted in groups of about kPipelineBytes of staging copies,
// and each completion is unstaged (its bytes copied back) as soon as it arrives, in order. So the
// copies this thread makes into and out of staging memory overlap the controller's work on the
// commands before and after them, where staging everything first and unstaging everything last
// ran them one after the other. Buffers used in place cost no copy: they go in one group.
void Client::execute_batch(std::span<BatchItem> items,
                           const std::function<void(size_t)>& completed) {
  constexpr size_t kPipelineBytes = 512 << 10;
  std::vector<nvme::Sqe> sqes;
  std::vector<std::pair<size_t, uint16_t>> flights;  // (item, cid), in submission order
  flights.reserve(items.size());
  size_t head = 0;  // flights before it are done
  size_t i = 0;
  Waiting full;  // while other threads hold every credit
  uint32_t spins = 0;
  auto complete = [&](size_t f, const CmdResult& r) {
    BatchItem& it = items[flights[f].first];
    it.result = r;
    unstage(it.sqe, it.data, it.len, it.to_controller, r);
    if (completed) completed(flights[f].first);
  };
  auto never_sent = [&](size_t k, const CmdResult& r) {
    items[k].result = r;
    if (completed) completed(k);
  };
  while (i < items.size() || head < flights.size()) {
    if (broken()) {
      // Commands in flight keep their stand-ins (unstage of an abort); the rest never start.
      for (; head < flights.size(); ++head) complete(head, aborted());
      for (; i < items.size(); ++i) never_sent(i, aborted());
      return;
    }
    // Stage and submit one group. Only an item with nothing of ours ahead of it may wait for
    // staging memory (other calls hold it); otherwise our own completions will free some.
    sqes.clear();
    size_t copied = 0;
    bool blocked = false;  // no id, or no staging memory until a completion of ours
    while (i < items.size() && copied < kPipelineBytes) {
      BatchItem& it = items[i];
      uint16_t cid;
      if (!queue::try_acquire(queue_, &cid)) {
        blocked = true;
        break;
      }
      const bool alone = head == flights.size() && sqes.empty();
      if (!stage(it.sqe, it.data, it.len, it.to_controller, it.metadata, alone)) {
        queue::release(queue_, cid);  // never submitted
        if (!alone) {
          blocked = true;
          break;
        }
        never_sent(i++, staging_exhausted());
        continue;
      }
      if (it.to_controller && it.sqe.dptr.prp.prp1 != reinterpret_cast<uint64_t>(it.data)) {
        copied += it.len;
      }
      it.sqe.cid = cid;
      sqes.push_back(it.sqe);
      flights.emplace_back(i++, cid);
    }
    if (!sqes.empty()) {
      queue::submit(queue_, sqes.data(), static_cast<uint32_t>(sqes.size()));
      full = {};
    }
    // Reap what has completed, in order; when nothing more can be submitted now, wait for the
    // oldest (its completion may free room for the next group).
    while (head < flights.size() && queue::poll(queue_, flights[head].second)) {
      complete(head, finish(flights[head].second));
      ++head;
    }
    if ((i == items.size() || blocked) && head < flights.size()) {
      complete(head, wait(flights[head].second));
      ++head;
    }
    if (blocked && head == flights.size() && i < items.size()) {
      // Other threads hold every credit: a controller that died or froze never returns them.
      queue::reap(queue_);
      atomic::pause();
      if ((++spins & 0xffff) == 0xffff) (void)stuck(full);
    }
  }
}

void Client::run_batch(std::span<nvme::Sqe> sqes, std::span<CmdResult> results) {
  std::vector<uint16_t> cids(sqes.size());
  Waiting full;  // while other threads hold every credit
  uint32_t spins = 0;
  size_t next = 0;
  size_t done = 0;
  while (done < sqes.size()) {
    if (broken()) {
      // Nothing more is submitted; what was submitted is waited for no longer.
      for (; done < sqes.size(); ++done) results[done] = aborted();
      return;
    }
    // Acquire as many ids as the queue allows, submit them with one doorbell.
    size_t group = 0;
    while (next + group < sqes.size()) {
      uint16_t cid;
      if (!queue::try_acquire(queue_, &cid)) break;
      sqes[next + group].cid = cid;
      cids[next + group] = cid;
      ++group;
    }
    if (group > 0) {
      queue::submit(queue_, sqes.data() + next, static_cast<uint32_t>(group));
      next += group;
    }
    // Wait for the oldest outstanding one; it frees room for the next group.
    if (done < next) {
      results[done] = wait(cids[done]);
      ++done;
      full = {};
    } else {
      // Other threads hold every credit: a controller that died or froze never returns them.
      queue::reap(queue_);
      atomic::pause();
      if ((++spins & 0xffff) == 0xffff) (void)stuck(full);
    }
  }
}

CmdResult Client::put(const Key& key, std::span<const std::byte> value, uint8_t options,
                      uint32_t nsid) {
  if (value.size() > UINT32_MAX) {  // CDW10 holds the size
    return CmdResult{nvme::Status::kInvalidValueSize, nvme::kSctGeneric, 0};
  }
  return execute_data(cmd::store(key.bytes, key.len, value.data(),
                                 static_cast<uint32_t>(value.size()), options, nsid),
                      value.data(), value.size(), true);
}

CmdResult Client::get(const Key& key, std::span<std::byte> buf, uint32_t nsid) {
  if (buf.size() > UINT32_MAX) buf = buf.first(UINT32_MAX);  // CDW10 holds the buffer size
  return execute_data(
      cmd::retrieve(key.bytes, key.len, buf.data(), static_cast<uint32_t>(buf.size()), nsid),
      buf.data(), buf.size(), false);
}

CmdResult Client::get(const Key& key, std::vector<std::byte>& out, uint32_t nsid, size_t /*hint*/) {
  ReceivedValue v;
  CmdResult r = get_value(key, v, nsid);
  if (!r.ok()) {
    out.clear();
    return r;
  }
  out.assign(v.data(), v.data() + v.size());
  return r;
}

ReceivedValue& ReceivedValue::operator=(ReceivedValue&& o) noexcept {
  if (this != &o) {
    reset();
    p_ = std::exchange(o.p_, nullptr);
    size_ = std::exchange(o.size_, 0);
    stager_ = std::exchange(o.stager_, nullptr);
    keep_ = std::move(o.keep_);
    spare_ = std::move(o.spare_);
  }
  return *this;
}

void ReceivedValue::reset() {
  if (p_ != nullptr) {
    if (stager_ != nullptr) {
      stager_->release(reinterpret_cast<uint64_t>(p_), nullptr, 0);
    } else if (spare_) {
      spare_->give(p_);
    } else {
      std::free(p_);
    }
  }
  p_ = nullptr;
  size_ = 0;
  stager_ = nullptr;
  keep_.reset();
  spare_.reset();
}

std::byte* Client::acquire_receive(size_t want, size_t min_len, bool wait, size_t* got,
                                   bool* heap) {
  want = std::clamp<size_t>(want, 1, UINT32_MAX);  // CDW10 holds the buffer size
  if (stager_ != nullptr && stager_->has_receive_memory()) {
    *heap = false;
    return stager_->acquire_receive(want, std::min(min_len, want), wait, got);
  }
  // The heap: in-process the controller writes it in place; a stager without receive memory
  // stages it as any other buffer. Untouched pages of it are never committed.
  *heap = true;
  *got = want;
  if (want == spare_->size) {
    if (std::byte* p = spare_->take()) return p;
  }
  return static_cast<std::byte*>(std::malloc(want));
}

void Client::finish_receive(ReceivedValue& v, std::byte* p, size_t len, bool heap,
                            const CmdResult& r) {
  v.reset();
  v.p_ = p;
  if (heap) {
    if (len == spare_->size) v.spare_ = spare_;
  } else {
    v.stager_ = stager_;
  }
  if (!r.ok()) {
    // Aborted because the Client failed: the command may still write it, so it is never given
    // back (the shared memory is poisoned then anyway).
    if (r.status == nvme::Status::kAbortRequested && broken()) {
      v.p_ = nullptr;
      v.stager_ = nullptr;
      v.spare_.reset();
      return;
    }
    v.reset();
    return;
  }
  v.size_ = r.dw0;
  if (!heap) {
    v.stager_ = stager_;
    v.keep_ = stager_->keep_alive();
    if (!v.keep_) v.keep_ = owner_;
    stager_->shrink_receive(p, r.dw0);
  }
}

CmdResult Client::get_value(const Key& key, ReceivedValue& out, uint32_t nsid) {
  out.reset();
  size_t want = max_value_bytes_, min_len = 1;
  for (;;) {
    if (broken()) return aborted();
    size_t got = 0;
    bool heap = false;
    std::byte* p = acquire_receive(want, min_len, true, &got, &heap);
    if (p == nullptr) return staging_exhausted();
    CmdResult r = execute_data(
        cmd::retrieve(key.bytes, key.len, p, static_cast<uint32_t>(got), nsid), p, got, false);
    if (r.ok() && r.dw0 > got) {
      // The memory gave less than the value (or it grew since): once more, at its length.
      finish_receive(out, p, got, heap,
                     CmdResult{nvme::Status::kInvalidField, nvme::kSctGeneric, 0});
      want = min_len = r.dw0;
      continue;
    }
    finish_receive(out, p, got, heap, r);
    if (r.ok()) learned_len_.store(std::max<uint64_t>(r.dw0, 1), std::memory_order_relaxed);
    return r;
  }
}

void Client::get_values(std::span<const Key> keys, uint32_t nsid,
                        const std::function<void(size_t, const CmdResult&, ReceivedValue&)>& done) {
  struct Pending {
    size_t key;
    size_t len;  // 0: the round's guess; else the value's length, from a first read too short
  };
  std::deque<Pending> todo;
  for (size_t i = 0; i < keys.size(); ++i) todo.push_back({i, 0});
  size_t guess = learned_len_.load(std::memory_order_relaxed);
  std::vector<BatchItem> items;
  std::vector<Pending> round;
  std::vector<std::pair<std::byte*, bool>> bufs;  // (buffer, heap)
  // Once a wait for memory failed, later keys do not wait again: the memory is likely held by
  // the values this call already handed to `done` (kept by the caller), and each wait is 10 s.
  bool starved = false;
  while (!todo.empty()) {
    items.clear();
    round.clear();
    bufs.clear();
    // Buffers for as many keys as the memory gives at once; only the first key waits for memory
    // other calls hold, and takes whatever piece it can get.
    while (!todo.empty()) {
      const Pending pd = todo.front();
      const size_t want = pd.len > 0 ? pd.len : guess > 0 ? guess : max_value_bytes_;
      const bool first = items.empty();
      size_t got = 0;
      bool heap = false;
      std::byte* p =
          acquire_receive(want, first && pd.len == 0 ? 1 : want, first && !starved, &got, &heap);
      if (p == nullptr) {
        starved = starved || first;
        break;
      }
      todo.pop_front();
      const Key& k = keys[pd.key];
      BatchItem it;
      it.sqe = cmd::retrieve(k.bytes, k.len, p, static_cast<uint32_t>(got), nsid);
      it.data = p;
      it.len = got;
      items.push_back(it);
      round.push_back(pd);
      bufs.emplace_back(p, heap);
    }
    if (items.empty()) {
      const Pending pd = todo.front();
      todo.pop_front();
      ReceivedValue none;
      done(pd.key, broken() ? aborted() : staging_exhausted(), none);
      continue;
    }
    size_t largest = 0;
    execute_batch(items, [&](size_t k) {
      const CmdResult& r = items[k].result;
      ReceivedValue v;
      if (r.ok() && r.dw0 > items[k].len) {
        finish_receive(v, bufs[k].first, items[k].len, bufs[k].second,
                       CmdResult{nvme::Status::kInvalidField, nvme::kSctGeneric, 0});
        todo.push_back({round[k].key, r.dw0});
        return;
      }
      if (r.ok()) largest = std::max<size_t>(largest, std::max<uint32_t>(r.dw0, 1));
      finish_receive(v, bufs[k].first, items[k].len, bufs[k].second, r);
      done(round[k].key, r, v);
    });
    if (largest > 0) {
      guess = largest;
      learned_len_.store(largest, std::memory_order_relaxed);
    }
  }
}

CmdResult Client::del(const Key& key, uint32_t nsid) {
  return execute(cmd::remove(key.bytes, key.len, nsid));
}

CmdResult Client::exists(const Key& key, uint32_t nsid) {
  return execute(cmd::exist(key.bytes, key.len, nsid));
}

CmdResult Client::list(const Key& start, std::vector<Key>& out, uint32_t buf_bytes, uint32_t nsid) {
  std::vector<std::byte> buf(buf_bytes);
  CmdResult r = execute_data(cmd::list(start.bytes, start.len, buf.data(), buf_bytes, nsid),
                             buf.data(), buf.size(), false, true);
  if (!r.ok()) return r;
  // The controller wrote only entries that fit; a damaged list yields the keys before the damage.
  nvme::read_key_list(buf.data(), buf.size(), [&](const unsigned char* k, uint16_t len) {
    out.push_back(Key::from_bytes(k, len));
  });
  return r;
}

CmdResult Client::list_all(std::vector<Key>& out, uint32_t nsid) {
  // The smallest key is one zero byte; continuation restarts at the last key and skips it.
  Key start = Key::from_bytes("\0", 1);
  bool skip_first = false;
  for (;;) {
    std::vector<Key> page;
    CmdResult r = list(start, page, 64 * 1024, nsid);
    if (!r.ok()) return r;
    size_t from = (skip_first && !page.empty() && page.front() == start) ? 1 : 0;
    if (page.size() <= from) return r;
    out.insert(out.end(), page.begin() + static_cast<std::ptrdiff_t>(from), page.end());
    start = page.back();
    skip_first = true;
  }
}

CmdResult Client::prefetch(std::span<const Key> keys, uint32_t nsid) {
  return send_key_list(keys, nsid, false);
}

CmdResult Client::hint(std::span<const Key> keys, uint32_t nsid) {
  if (keys.empty()) return CmdResult{nvme::Status::kInvalidField, nvme::kSctGeneric, 0};
  return send_key_list(keys, nsid, true);
}

// What the controller would refuse is refused here, unsent, with its status: a key that is not
// 1..16 bytes (86h for a hint; a stock Prefetch answers 02h) or a list over its 64 KiB.
CmdResult Client::send_key_list(std::span<const Key> keys, uint32_t nsid, bool hint) {
  constexpr size_t kMaxKeyListBytes = 64 * 1024;  // the controller's limit for a Prefetch
  const auto refuse = [](nvme::Status s) { return CmdResult{s, nvme::kSctGeneric, 0}; };
  size_t bytes = sizeof(nvme::KeyListHeader);
  for (const Key& k : keys) {
    if (!k.valid())
      return refuse(hint ? nvme::Status::kInvalidKeySize : nvme::Status::kInvalidField);
    bytes += nvme::key_list_entry_size(k.len);
  }
  if (bytes > kMaxKeyListBytes) return refuse(nvme::Status::kInvalidField);
  std::vector<std::byte> buf(bytes);
  nvme::KeyListWriter w(buf.data(), buf.size());
  for (const Key& k : keys) w.add(k.bytes, k.len);  // sized for all of them
  w.finish();
  const auto len = static_cast<uint32_t>(bytes);
  const nvme::Sqe sqe =
      hint ? cmd::hint(buf.data(), len, nsid) : cmd::prefetch(buf.data(), len, nsid);
  return execute_data(sqe, buf.data(), buf.size(), true, true);
}

CmdResult Client::scatter_get(const Key& key, std::span<const nvme::ScatterEntry> pieces,
                              uint32_t nsid) {
  std::vector<std::byte> desc = scatter_descriptor(pieces);
  // The descriptor is staged; the destinations it names must be reachable by the controller.
  return execute_data(cmd::scatter_retrieve(key.bytes, key.len, desc.data(),
                                            static_cast<uint32_t>(desc.size()), nsid),
                      desc.data(), desc.size(), true, true);
}

std::vector<std::byte> scatter_descriptor(std::span<const nvme::ScatterEntry> pieces) {
  std::vector<std::byte> desc(sizeof(nvme::ScatterHeader) + pieces.size_bytes());
  const nvme::ScatterHeader hdr{static_cast<uint32_t>(pieces.size()), 0};
  std::memcpy(desc.data(), &hdr, sizeof(hdr));
  if (!pieces.empty()) std::memcpy(desc.data() + sizeof(hdr), pieces.data(), pieces.size_bytes());
  return desc;
}

const char* failure_name(ClientFailure f) {
  switch (f) {
    case ClientFailure::kTimeout:
      return "timed out";
    case ClientFailure::kPeerGone:
      return "controller gone";
    case ClientFailure::kNone:
      break;
  }
  return "";
}

std::string describe(const CmdResult& r) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%s (%02Xh)", nvme::status_name(r.status),
                static_cast<unsigned>(r.status));
  return buf;
}

}  // namespace gdkv
