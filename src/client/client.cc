#include "gdkv/client.h"

#include <cstdio>
#include <cstring>
#include <thread>

#include "gdkv/commands.h"

namespace gdkv {

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
    : queue_(queue), owner_(std::move(owner)), stager_(stager), controller_(controller) {}

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
void Client::execute_batch(std::span<BatchItem> items) {
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
  };
  while (i < items.size() || head < flights.size()) {
    if (broken()) {
      // Commands in flight keep their stand-ins (unstage of an abort); the rest never start.
      for (; head < flights.size(); ++head) complete(head, aborted());
      for (; i < items.size(); ++i) items[i].result = aborted();
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
        it.result = staging_exhausted();
        ++i;
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

CmdResult Client::get(const Key& key, std::vector<std::byte>& out, uint32_t nsid, size_t hint) {
  out.resize(hint);
  for (;;) {
    CmdResult r = get(key, std::span<std::byte>(out), nsid);
    if (!r.ok()) {
      out.clear();
      return r;
    }
    if (r.dw0 <= out.size()) {
      out.resize(r.dw0);
      return r;
    }
    out.resize(r.dw0);  // the value grew past the buffer: read it whole
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
