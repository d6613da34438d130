// Power loss and I/O errors, through the store's own I/O layer (IoHook, uring.h).
//
// Power loss. A workload runs against a real store whose hook records every write (offset and
// bytes, as issued), every fdatasync (a barrier) and every extension of the file. From that trace
// the harness builds crash states: the file as of a barrier, plus any subset of the writes issued
// after it and before the next barrier, applied in any order, each possibly torn at 512-byte
// sectors (a power loss keeps an arbitrary subset of unflushed sectors; killing a process, as
// AcknowledgedValuesSurviveKill9 does, keeps them all, because the page cache survives). The
// workloads store several large values per batch, each written straight from its buffer by a
// write of its own, so an epoch (the writes between two barriers) holds several writes and its
// subsets differ. A state whose file has the same bytes as one already checked (a hash of the
// whole file) is skipped: only distinct disk images count toward the states asked for. Each new
// state is written to a file and opened with the real recovery (LocalStore's open and rebuild),
// then checked:
//   - open succeeds (a watchdog aborts the run, naming the state, if one takes over a minute);
//   - every key reads back as its last Store or Delete acknowledged before the crash, or as one
//     that was in flight (submitted, not yet acknowledged, or failed) after it; missing only when
//     its last value was reclaimed (the live store no longer had it) or deleted; byte-exact;
//   - no read fails its checksum, List agrees with the Gets, and a new Store succeeds and reads
//     back (writing resumes).
// An op counts as acknowledged in the states after barrier j when its acknowledgement came before
// barrier j+1 was issued: acknowledgements follow their batch's fdatasync, so its batch was flushed
// at barrier j or earlier, and a crash just before barrier j+1 completes follows the ack.
//
// A run that checks less than it claims fails: no op acknowledged, no key read back as an
// acknowledged value, no write torn, no state keeping part of an epoch's writes, or fewer
// distinct states than asked (new states are drawn until there are enough, at most 4 per state
// asked plus 64).
//
// Run length: `local_crash_test --states=N --seed=S` (defaults 1000 and 1; the same program with a
// larger N is the long run documented in docs/local-store.md). GDKV_CRASH_STATES / GDKV_CRASH_SEED
// in the environment do the same, for runs through ctest; a count that is not a whole number of at
// least 1 ends the program with status 2.
//
// I/O errors. The same hook fails the n-th write or flush of a batch (EIO, ENOSPC) or shortens a
// write, for every n the batch issues; each time the ops must get a clear status, nothing
// acknowledged may change, reads keep working, and writes are accepted again (after a reopen when
// the failed batch could not even be invalidated).
#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backend/local/hash.h"
#include "backend/local/store.h"
#include "local_test_util.h"

namespace gdkv::local::test {
namespace {

namespace fs = std::filesystem;
using nvme::Status;

uint64_t g_states = 1000;
uint64_t g_seed = 1;

// ---- the recording (and failing) hook ----------------------------------------------------------

struct Event {
  enum Kind { kWrite, kSync, kResize } kind;
  uint64_t off = 0;  // write: file offset; resize: the new size
  std::vector<std::byte> data;
};

class Recorder final : public IoHook {
 public:
  int64_t write(uint64_t off, const std::byte* buf, uint64_t n) override {
    std::lock_guard lk(mu_);
    int64_t r = static_cast<int64_t>(n);
    if (failing()) {
      if (fail_err_ != 0) return -fail_err_;
      // A short write, as a device splitting the request would leave: whole 4 KiB blocks, so the
      // store's retry of the rest stays aligned for O_DIRECT.
      if (n > 4096) r = static_cast<int64_t>((n / 2 + 4095) / 4096 * 4096);
    }
    if (recording_) events_.push_back({Event::kWrite, off, {buf, buf + r}});
    return r;
  }
  int sync() override {
    std::unique_lock lk(mu_);
    if (failing() && fail_err_ != 0) return -fail_err_;
    if (recording_) events_.push_back({Event::kSync, 0, {}});
    if (hold_) {
      // Held (the store's I/O thread waits here) until pass().
      const uint64_t gen = gen_;
      held_ = true;
      cv_.notify_all();
      cv_.wait(lk, [&] { return gen_ != gen; });
    }
    return 0;
  }
  int resize(uint64_t size) override {
    std::lock_guard lk(mu_);
    if (recording_) events_.push_back({Event::kResize, size, {}});
    return 0;
  }
  uint64_t now() {
    std::lock_guard lk(mu_);
    return events_.size();
  }
  // Fails the `count` writes or flushes from the n-th from now on: with -err, or (err 0) by
  // shortening the write.
  void arm(uint64_t n, int err, uint64_t count = 1) {
    std::lock_guard lk(mu_);
    fail_at_ = calls_ + n;
    fail_end_ = fail_at_ + count;
    fail_err_ = err;
  }
  // Whether an armed failure was reached since arm(); disarms.
  bool fired() {
    std::lock_guard lk(mu_);
    const bool f = calls_ > fail_at_;
    fail_at_ = fail_end_ = ~uint64_t{0};
    return f;
  }
  // The next flush, once recorded, is held until pass().
  void hold_next() {
    std::lock_guard lk(mu_);
    hold_ = true;
    held_ = false;
  }
  // Whether a flush is held, waiting up to `d` for one.
  bool wait_held(std::chrono::milliseconds d) {
    std::unique_lock lk(mu_);
    return cv_.wait_for(lk, d, [&] { return held_; });
  }
  // Lets a held flush go on; `hold`: hold the next one too.
  void pass(bool hold) {
    std::lock_guard lk(mu_);
    ++gen_;
    held_ = false;
    hold_ = hold;
    cv_.notify_all();
  }
  std::vector<Event> take() {
    std::lock_guard lk(mu_);
    return std::move(events_);
  }
  bool recording_ = true;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool hold_ = false;  // hold the next flush
  bool held_ = false;  // a flush is held
  uint64_t gen_ = 0;   // pass() count: a held flush waits for it to change
  std::vector<Event> events_;
  uint64_t calls_ = 0;
  uint64_t fail_at_ = ~uint64_t{0};
  uint64_t fail_end_ = ~uint64_t{0};
  int fail_err_ = 0;
  bool failing() {
    const uint64_t c = calls_++;
    return c >= fail_at_ && c < fail_end_;
  }
};

// Bytes of (key, version, len): distinct per version, also for values shorter than make_value's
// 16-byte name.
std::vector<std::byte> value_of(uint32_t key, uint64_t version, size_t len) {
  if (len >= 16) return make_value(key, version, len);
  std::vector<std::byte> v(len);
  uint64_t s = (uint64_t{key} << 32) ^ version ^ 0x5eedull;
  for (size_t i = 0; i < len; ++i) v[i] = static_cast<std::byte>(splitmix(s));
  return v;
}

struct AlignedValue {
  std::byte* p = nullptr;
  size_t n = 0;
  explicit AlignedValue(const std::vector<std::byte>& v) : n(v.size()) {
    p = static_cast<std::byte*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096 + 4096));
    if (n > 0) std::memcpy(p, v.data(), n);
  }
  ~AlignedValue() { std::free(p); }
  AlignedValue(const AlignedValue&) = delete;
  AlignedValue& operator=(const AlignedValue&) = delete;
};

// One Store or Delete of the workload, as the checker sees it.
struct Op {
  uint32_t key = 0;
  bool put = true;
  uint64_t version = 0;
  uint32_t len = 0;
  uint64_t submitted = 0;         // events recorded when it was submitted
  uint64_t acked = ~uint64_t{0};  // events recorded when it completed
  Status status = Status::kInternalError;
};

struct Trace {
  std::vector<Event> events;
  std::vector<Op> ops;
  uint32_t keys = 0;
  uint32_t quota_keys = 0;  // keys below this live in kQuotaNs
  double copied = 0;  // bytes the live store copied forward (local_copied_forward_bytes_total)
  LocalBackendOptions options;  // path is replaced per state
};

// ---- workloads --------------------------------------------------------------------------------

struct WorkloadSpec {
  const char* name;
  uint32_t segment_bytes;
  uint64_t capacity_bytes;
  uint32_t keys;
  int steps;
  int reopen_every;
  uint32_t max_value;   // largest value
  int fault_every = 0;  // > 0: every so many steps, one write or flush of the step fails (EIO)
  // Of every 10 Stores, how many are large: 256 KiB (kDirectWriteMin) up to max_value, in
  // page-aligned buffers, so each is written straight from its buffer by a write of its own.
  int large_in_10 = 0;
  int max_ops = 8;  // concurrent ops per step: 1 to this many
  // Keys below this live in namespace kQuotaNs, which has a quota far above what they can hold
  // (values of at most 16 KiB): reclaim must copy them forward, never drop them, so in every
  // state they read back exactly as the rest of the keys do, but never as missing by reclaim.
  uint32_t quota_keys = 0;
};

constexpr uint32_t kQuotaNs = 2;
constexpr uint64_t kQuotaBytes = 1u << 20;
uint32_t nsid_of(uint32_t key, uint32_t quota_keys) { return key < quota_keys ? kQuotaNs : 1; }

// A value of a key in kQuotaNs: empty, inline, one block or a few.
uint32_t pick_small_len(std::mt19937_64& rng) {
  switch (rng() % 4) {
    case 0:
      return static_cast<uint32_t>(rng() % 16);
    case 1:
      return static_cast<uint32_t>(16 + rng() % 1009);
    case 2:
      return 4096;
    default:
      return static_cast<uint32_t>(1025 + rng() % 15360);
  }
}

// Every size class the store treats differently: empty, inline (<= 1 KiB), one block, a few
// blocks, tens of KiB, and (when the segment allows) >= 256 KiB written straight from the
// page-aligned buffer, also with an unaligned tail.
uint32_t pick_len(std::mt19937_64& rng, const WorkloadSpec& w) {
  const uint32_t max_value = w.max_value;
  constexpr uint32_t kLarge = static_cast<uint32_t>(kDirectWriteMin);
  if (max_value > kLarge && static_cast<int>(rng() % 10) < w.large_in_10) {
    return kLarge + static_cast<uint32_t>(rng() % (max_value - kLarge + 1));
  }
  switch (rng() % 10) {
    case 0:
      return static_cast<uint32_t>(rng() % 2 == 0 ? 0 : 1 + rng() % 15);
    case 1:
    case 2:
      return static_cast<uint32_t>(16 + rng() % 1009);  // inline
    case 3:
      return 4096;
    case 4:
    case 5:
      return static_cast<uint32_t>(1025 + rng() % 12000);
    case 6:
    case 7:
      return static_cast<uint32_t>(std::min<uint64_t>(max_value, 16384 + rng() % 65536));
    default:
      if (max_value >= kLarge && rng() % 6 == 0) {
        return kLarge + static_cast<uint32_t>(rng() % (max_value - kLarge + 1));
      }
      return static_cast<uint32_t>(std::min<uint64_t>(max_value, 4096 * (1 + rng() % 16)));
  }
}

// One step's ops in flight: each notes the trace's length when it completes (what was issued
// before its ack).
struct Step {
  struct Ctx {
    Recorder* rec;
    Call* call;
    uint64_t at;
  };
  std::vector<Call> calls;
  std::vector<std::unique_ptr<AlignedValue>> values;
  std::vector<size_t> idx;  // the ops' places in Trace::ops
  std::vector<Ctx> ctx;
  std::vector<std::future<void>> fut;
  bool faulty = false;  // an injected failure was armed for it

  explicit Step(size_t n) : calls(n), ctx(n) {}
  bool done() const {
    return std::all_of(fut.begin(), fut.end(), [](const std::future<void>& f) {
      return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    });
  }
  // Waits for every op and writes its outcome into the trace.
  void finish(Trace& t) {
    for (auto& f : fut) f.wait();
    for (size_t i = 0; i < calls.size(); ++i) {
      Op& op = t.ops[idx[i]];
      op.status = calls[i].status;
      op.acked = ctx[i].at;
    }
  }
};

// Steps overlap: while the previous step's flush is held in the hook, the next step's ops are
// submitted, so they queue up and go out together as one batch (several large values, several
// writes) instead of the first op leaving alone.
Trace record(const WorkloadSpec& w, const fs::path& dir, uint64_t seed) {
  Trace t;
  t.keys = w.keys;
  t.quota_keys = w.quota_keys;
  if (w.quota_keys > 0) t.options.quotas[kQuotaNs] = kQuotaBytes;
  t.options.segment_bytes = w.segment_bytes;
  t.options.capacity_bytes = w.capacity_bytes;
  t.options.path = dir.string();
  Recorder rec;
  std::mt19937_64 rng(seed);
  auto open = [&] { return std::make_shared<LocalStore>(t.options, &rec); };
  std::shared_ptr<Backend> store = open();
  std::unique_ptr<Step> prev;
  // A clean close and an open that rebuilds the index, with nothing in flight.
  auto reopen = [&] {
    rec.pass(false);
    if (prev) prev->finish(t);
    prev.reset();
    t.copied += metric(*store, "local_copied_forward_bytes_total");
    store.reset();
    store = open();
  };
  uint64_t version = 0;
  for (int step = 0; step < w.steps; ++step) {
    if (step > 0 && step % w.reopen_every == 0) reopen();
    // Concurrent ops; a key may appear twice (the second waits for the first's batch).
    const size_t n = 1 + static_cast<size_t>(rng() % static_cast<uint64_t>(w.max_ops));
    auto cur = std::make_unique<Step>(n);
    for (size_t i = 0; i < n; ++i) {
      Op op;
      if (w.quota_keys == 0) {
        op.key = static_cast<uint32_t>(rng() % w.keys);
      } else {
        // Keys with a quota are written one op in 6, so their values live long enough to be
        // copied forward, often more than once.
        op.key = rng() % 6 == 0
                     ? static_cast<uint32_t>(rng() % w.quota_keys)
                     : w.quota_keys + static_cast<uint32_t>(rng() % (w.keys - w.quota_keys));
      }
      op.put = rng() % 5 != 0;
      op.version = ++version;
      if (op.put) op.len = op.key < w.quota_keys ? pick_small_len(rng) : pick_len(rng, w);
      Call& c = cur->calls[i];
      c.op.kind = op.put ? BackendOpKind::kPut : BackendOpKind::kDelete;
      c.op.key = int_key(op.key);
      c.op.nsid = nsid_of(op.key, w.quota_keys);
      if (op.put) {
        cur->values.push_back(std::make_unique<AlignedValue>(value_of(op.key, op.version, op.len)));
        c.op.value = std::span<const std::byte>(cur->values.back()->p, cur->values.back()->n);
      }
      cur->idx.push_back(t.ops.size());
      t.ops.push_back(op);
      cur->ctx[i] = {&rec, &c, 0};
      cur->fut.push_back(c.done.get_future());
      c.op.user = &cur->ctx[i];
      c.op.done = [](BackendOp* op, Status s, uint64_t len) {
        auto* x = static_cast<Step::Ctx*>(op->user);
        x->at = x->rec->now();
        x->call->status = s;
        x->call->len = len;
        x->call->done.set_value();
      };
    }
    // The previous step's flush is held (or it needed none, or is over).
    while (prev && !rec.wait_held(std::chrono::milliseconds(1)) && !prev->done()) {
    }
    if (w.fault_every > 0 && step % w.fault_every == w.fault_every - 1) {
      rec.arm(rng() % 4, EIO);
      cur->faulty = true;
    }
    for (size_t i = 0; i < n; ++i) {
      t.ops[cur->idx[i]].submitted = rec.now();
      store->submit(&cur->calls[i].op);
    }
    rec.pass(false);
    if (prev) {
      prev->finish(t);
      if (prev->faulty && !cur->faulty) rec.fired();  // disarms an injection it did not reach
      prev.reset();
      if (simple(*store, BackendOpKind::kExists, int_key(0)) == Status::kInternalError) {
        prev = std::move(cur);
        reopen();  // a failure the store could not recover from in place
        continue;
      }
    }
    rec.hold_next();
    prev = std::move(cur);
  }
  rec.pass(false);
  if (prev) prev->finish(t);
  t.copied += metric(*store, "local_copied_forward_bytes_total");
  store.reset();
  t.events = rec.take();
  return t;
}

// ---- crash states -----------------------------------------------------------------------------

class Watchdog {
 public:
  Watchdog() : th_([this] { loop(); }) {}
  ~Watchdog() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    th_.join();
  }
  void arm(std::string what) {
    std::lock_guard lk(mu_);
    what_ = std::move(what);
    deadline_ = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  }

 private:
  void loop() {
    std::unique_lock lk(mu_);
    while (!stop_) {
      cv_.wait_for(lk, std::chrono::seconds(1));
      if (!what_.empty() && std::chrono::steady_clock::now() > deadline_) {
        std::fprintf(stderr, "crash state hangs (over 60 s): %s\n", what_.c_str());
        std::abort();
      }
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::string what_;
  std::chrono::steady_clock::time_point deadline_;
  std::thread th_;
};

struct CrashStats {
  uint64_t states = 0;       // distinct disk images checked
  uint64_t attempts = 0;     // states built, repeats included
  uint64_t barrier = 0;      // states as of a barrier: none of the epoch's writes
  uint64_t partial = 0;      // states with some of their epoch's writes, whole, and not the others
  uint64_t torn_states = 0;  // states with a torn write
  uint64_t torn_writes = 0;  // writes of which some but not all sectors landed
  uint64_t violations = 0;
  std::set<size_t> epochs;
};

enum class StateKind {
  kBarrier,  // the file as of the epoch's opening barrier
  kSubset,   // a random subset of the epoch's writes, in random order, each whole
  kTorn,     // as kSubset, and at least one of them torn
};

// What verify checked, over all states.
struct CheckCounts {
  uint64_t keys = 0;         // keys read back
  uint64_t acked_reads = 0;  // of them, read back as the value an acknowledged Store wrote
};

// All keys' Gets at once (each into a page-aligned buffer of the value's length): one round trip
// to the store's I/O thread instead of one per key. REQUIRES: calls.size() == keys.
void get_all(Backend& b, std::vector<Call>& calls, uint32_t keys, uint32_t quota_keys) {
  std::vector<std::future<void>> fut;
  for (uint32_t k = 0; k < keys; ++k) {
    Call& c = calls[k];
    c.op.kind = BackendOpKind::kGet;
    c.op.key = int_key(k);
    c.op.nsid = nsid_of(k, quota_keys);
    c.op.sink = &Call::sink;
    c.op.user = &c;
    c.op.done = &Call::on_done;
    fut.push_back(c.done.get_future());
  }
  for (Call& c : calls) b.submit(&c.op);
  for (auto& f : fut) f.wait();
}

// A Get's answer, the bytes still in the Get's own buffer.
struct Read {
  Status status;
  uint64_t len;                     // the value's full length
  std::span<const std::byte> data;  // the bytes delivered
};

class CrashChecker {
 public:
  // `tear`: whether kTorn states may tear writes (off only in the guards' own test).
  CrashChecker(const Trace& t, fs::path dir, bool tear) : t_(t), dir_(std::move(dir)), tear_(tear) {
    for (size_t i = 0; i < t_.events.size(); ++i) {
      if (t_.events[i].kind == Event::kSync) syncs_.push_back(i);
    }
    syncs_.push_back(t_.events.size());  // the end of the trace closes the last epoch
    per_key_.resize(t_.keys);
    for (size_t i = 0; i < t_.ops.size(); ++i) per_key_[t_.ops[i].key].push_back(i);
    expected_.resize(t_.ops.size());
    find_reclaims();
    std::error_code ec;
    fs::remove_all(dir_, ec);
    fs::create_directories(dir_);
  }
  size_t epochs() const { return syncs_.size(); }
  size_t begin_of(size_t e) const { return e == 0 ? 0 : syncs_[e - 1] + 1; }
  // Writes in epoch e.
  size_t writes_in(size_t e) const {
    size_t n = 0;
    for (size_t i = begin_of(e); i < syncs_[e]; ++i) n += t_.events[i].kind == Event::kWrite;
    return n;
  }
  // Epochs whose writes reuse a segment that held log before (the first write of a new life
  // lands on the segment's first block, over an old header).
  std::vector<size_t> epochs_reusing_segments() const {
    const uint64_t seg = t_.options.segment_bytes;
    std::set<uint64_t> used;
    std::vector<size_t> out;
    size_t e = 0;
    for (size_t i = 0; i < t_.events.size(); ++i) {
      const Event& ev = t_.events[i];
      if (ev.kind == Event::kSync) {
        ++e;
        continue;
      }
      if (ev.kind != Event::kWrite || ev.off < kBlock) continue;
      const uint64_t s = (ev.off - kBlock) / seg;
      if (ev.off == kBlock + s * seg && used.count(s) != 0 && (out.empty() || out.back() != e)) {
        out.push_back(e);
      }
      used.insert(s);
    }
    return out;
  }
  // Epochs with at least one write after their barrier: where subsets and tears differ.
  std::vector<size_t> epochs_with_writes() const {
    std::vector<size_t> out;
    for (size_t e = 0; e < syncs_.size(); ++e) {
      if (writes_in(e) > 0) out.push_back(e);
    }
    return out;
  }

  // Builds a state of epoch e (the writes after barrier e-1 and before barrier e; epoch 0 is
  // before the first barrier) and checks it, unless its file has the same bytes as a state checked
  // before. Returns whether it was new (and so checked).
  bool check(size_t e, StateKind kind, std::mt19937_64& rng, CrashStats& st, Watchdog& wd) {
    const size_t begin = begin_of(e);
    const size_t end = syncs_[e];
    advance_base(begin);
    ++st.attempts;
    // The state is built in base_ itself and undone afterwards: it differs from the barrier's file
    // only where its writes land.
    const size_t base_bytes = base_.size();
    uint64_t size = base_size_;
    undo_.clear();
    std::vector<size_t> chosen;
    size_t chosen_writes = 0;
    if (kind == StateKind::kSubset && end - begin <= kTrackedEvents) {
      const std::optional<uint64_t> mask = new_subset(e, end - begin, rng);
      if (!mask) kind = StateKind::kTorn;  // every proper subset of the epoch was checked
      for (size_t i = begin; mask && i < end; ++i) {
        if ((*mask >> (i - begin)) & 1) chosen.push_back(i);
      }
    } else if (kind != StateKind::kBarrier) {
      for (size_t i = begin; i < end; ++i) {
        if (rng() % 2 == 0) chosen.push_back(i);
      }
    }
    std::shuffle(chosen.begin(), chosen.end(), rng);
    // A torn state tears at least one write: one it applies, or else one it adds.
    std::optional<size_t> must_tear;
    if (kind == StateKind::kTorn && tear_) {
      std::vector<size_t> tearable;
      for (size_t i : chosen) {
        if (can_tear(t_.events[i])) tearable.push_back(i);
      }
      if (tearable.empty()) {
        for (size_t i = begin; i < end; ++i) {
          if (t_.events[i].kind == Event::kWrite && can_tear(t_.events[i])) tearable.push_back(i);
        }
        if (!tearable.empty()) {
          must_tear = tearable[rng() % tearable.size()];
          chosen.insert(chosen.begin() + static_cast<std::ptrdiff_t>(rng() % (chosen.size() + 1)),
                        *must_tear);
        }
      } else {
        must_tear = tearable[rng() % tearable.size()];
      }
    }
    std::string desc = "epoch " + std::to_string(e) + " (" + std::to_string(end - begin) +
                       " events after its barrier); applied:";
    uint64_t torn = 0;
    for (size_t i : chosen) {
      const Event& ev = t_.events[i];
      if (ev.kind == Event::kResize) {
        size = std::max(size, ev.off);
        desc += " resize#" + std::to_string(i);
        continue;
      }
      ++chosen_writes;
      const bool tear = must_tear && ev.data.size() > 512 && (i == *must_tear || rng() % 3 == 0);
      desc += " w#" + std::to_string(i);
      if (ev.off < base_bytes) {
        const uint64_t n = std::min<uint64_t>(ev.data.size(), base_bytes - ev.off);
        undo_.push_back({ev.off,
                         {base_.begin() + static_cast<std::ptrdiff_t>(ev.off),
                          base_.begin() + static_cast<std::ptrdiff_t>(ev.off + n)}});
      }
      if (apply(base_, size, ev, tear ? &rng : nullptr)) {
        ++torn;
        desc += "(torn)";
      }
    }
    if (base_.size() < size) base_.resize(size);
    struct Restore {
      CrashChecker* c;
      size_t bytes;
      ~Restore() {
        for (auto it = c->undo_.rbegin(); it != c->undo_.rend(); ++it) {
          std::memcpy(c->base_.data() + it->off, it->old.data(), it->old.size());
        }
        c->base_.resize(bytes);
      }
    } restore{this, base_bytes};
    // Repeats a disk image already checked: the same file, byte for byte.
    const Key h = digest128(base_.data(), size);
    std::array<uint64_t, 3> id{size, 0, 0};
    std::memcpy(id.data() + 1, h.bytes, 16);
    if (!seen_.insert(id).second) {
      ++repeats_[e];
      return false;
    }
    repeats_[e] = 0;
    ++st.states;
    st.epochs.insert(e);
    const size_t writes = writes_in(e);
    if (kind == StateKind::kBarrier) {
      ++st.barrier;
    } else if (torn > 0) {
      ++st.torn_states;
      st.torn_writes += torn;
    } else if (chosen_writes > 0 && chosen_writes < writes) {
      ++st.partial;
    }
    wd.arm(desc);
    applied_.assign(t_.events.size(), false);
    for (size_t i = 0; i < begin; ++i) applied_[i] = true;
    for (size_t i : chosen) applied_[i] = true;
    const std::string bad = verify(base_, size, end);
    wd.arm("");
    if (!bad.empty()) {
      ++st.violations;
      if (st.violations <= 5) ADD_FAILURE() << desc << ": " << bad;
    }
    return true;
  }

  CheckCounts counts() const { return counts_; }
  // Whether epoch e's last states drawn all repeated states already checked (its variety is used
  // up).
  bool spent(size_t e) const {
    auto it = repeats_.find(e);
    return it != repeats_.end() && it->second >= 4;
  }

 private:
  // Where each acknowledged put's value lies, and when that segment is next reused. One batch is
  // in flight at a time, so the writes between two barriers are one batch's: the batch of an op
  // is the epoch closed by the last barrier before its acknowledgement, and its segment is where
  // that epoch's first write lands. A reused segment's first write is its new header, at the
  // segment's first byte.
  void find_reclaims() {
    const uint64_t seg = t_.options.segment_bytes;
    gone_.assign(t_.ops.size(), ~uint64_t{0});
    for (size_t i = 0; i < t_.ops.size(); ++i) {
      const Op& op = t_.ops[i];
      if (!op.put || op.status != Status::kSuccess) continue;
      auto it = std::lower_bound(syncs_.begin(), syncs_.end(), op.acked);
      if (it == syncs_.begin()) continue;
      const size_t sync = *(it - 1);
      const size_t from = it - 1 == syncs_.begin() ? 0 : *(it - 2) + 1;
      std::optional<uint64_t> s;
      for (size_t e = from; e < sync && !s; ++e) {
        if (t_.events[e].kind == Event::kWrite && t_.events[e].off >= kBlock) {
          s = (t_.events[e].off - kBlock) / seg;
        }
      }
      if (!s) continue;
      const uint64_t head = kBlock + *s * seg;
      for (size_t e = sync + 1; e < t_.events.size(); ++e) {
        if (t_.events[e].kind == Event::kWrite && t_.events[e].off == head) {
          gone_[i] = e;
          break;
        }
      }
    }
  }

  // Epochs of up to this many events have their whole subsets drawn without repeats.
  static constexpr size_t kTrackedEvents = 20;

  // A subset of epoch e's n events (a bit mask) that no state drew before, neither none nor all
  // of them (those are barrier states); nullopt when none is left. REQUIRES: n <= kTrackedEvents.
  std::optional<uint64_t> new_subset(size_t e, size_t n, std::mt19937_64& rng) {
    if (n < 2) return std::nullopt;
    const uint64_t all = (uint64_t{1} << n) - 1;
    std::set<uint64_t>& used = masks_[e];
    if (used.size() >= all - 1) return std::nullopt;
    uint64_t m = 1 + rng() % (all - 1);
    for (int i = 0; i < 64 && used.count(m) != 0; ++i) m = 1 + rng() % (all - 1);
    while (used.count(m) != 0) m = m % (all - 1) + 1;
    used.insert(m);
    return m;
  }

  // Whether a write changes two or more 512-byte sectors of the file as of the barrier (zeros past
  // its end), so that it can land in part.
  bool can_tear(const Event& ev) const {
    if (ev.kind != Event::kWrite) return false;
    int changed = 0;
    for (uint64_t s = 0; s < ev.data.size() && changed < 2; s += 512) {
      const std::byte* src = ev.data.data() + s;
      const uint64_t n = std::min<uint64_t>(512, ev.data.size() - s);
      const uint64_t at = ev.off + s;
      const uint64_t old = at < base_.size() ? std::min<uint64_t>(n, base_.size() - at) : 0;
      const bool differs =
          (old > 0 && std::memcmp(base_.data() + at, src, old) != 0) ||
          std::any_of(src + old, src + n, [](std::byte b) { return b != std::byte{0}; });
      changed += differs;
    }
    return changed >= 2;
  }

  // Writes one recorded write into the image. Torn (`tear` given): of the 512-byte sectors it
  // changes, some land and the others do not; a write that changes fewer than two sectors cannot
  // tear and lands whole. Returns whether it tore.
  static bool apply(std::vector<std::byte>& img, uint64_t& size, const Event& ev,
                    std::mt19937_64* tear) {
    const uint64_t end = ev.off + ev.data.size();
    if (img.size() < end) img.resize(end);
    size = std::max(size, end);
    std::byte* dst = img.data() + ev.off;
    std::vector<uint64_t> changed;
    if (tear != nullptr) {
      for (uint64_t s = 0; s < ev.data.size(); s += 512) {
        const uint64_t n = std::min<uint64_t>(512, ev.data.size() - s);
        if (std::memcmp(dst + s, ev.data.data() + s, n) != 0) changed.push_back(s);
      }
    }
    if (changed.size() < 2) {
      std::memcpy(dst, ev.data.data(), ev.data.size());
      return false;
    }
    std::vector<bool> keep(changed.size());
    size_t kept = 0;
    for (size_t i = 0; i < changed.size(); ++i) kept += keep[i] = (*tear)() % 2 == 0;
    if (kept == 0) keep[(*tear)() % changed.size()] = true;
    if (kept == changed.size()) keep[(*tear)() % changed.size()] = false;
    for (size_t i = 0; i < changed.size(); ++i) {
      if (!keep[i]) continue;
      const uint64_t n = std::min<uint64_t>(512, ev.data.size() - changed[i]);
      std::memcpy(dst + changed[i], ev.data.data() + changed[i], n);
    }
    return true;
  }

  // The file as of event index `upto` (exclusive), all of it applied: the state at a barrier.
  void advance_base(size_t upto) {
    if (upto < base_upto_) {
      base_.clear();
      base_size_ = 0;
      base_upto_ = 0;
    }
    for (; base_upto_ < upto; ++base_upto_) {
      const Event& ev = t_.events[base_upto_];
      if (ev.kind == Event::kWrite) apply(base_, base_size_, ev, nullptr);
      if (ev.kind == Event::kResize) base_size_ = std::max(base_size_, ev.off);
    }
  }

  const std::vector<std::byte>& expected(size_t op) {
    if (expected_[op].size() != t_.ops[op].len) {
      const Op& o = t_.ops[op];
      expected_[op] = value_of(o.key, o.version, o.len);
    }
    return expected_[op];
  }

  // Opens the state with the real recovery and checks it; "" when it holds. `cut`: the index of
  // the barrier that ends the epoch (ops acknowledged before it was issued count as acknowledged).
  std::string verify(const std::vector<std::byte>& img, uint64_t size, size_t cut) {
    // The previous state's file is overwritten in place: every byte up to `size`, then cut to it.
    const fs::path file = dir_ / kStoreFileName;
    {
      const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
      if (fd < 0) return "cannot write the state file";
      const size_t n = std::min<size_t>(img.size(), size);
      if (n > 0 && ::pwrite(fd, img.data(), n, 0) != static_cast<ssize_t>(n)) {
        ::close(fd);
        return "cannot write the state file";
      }
      if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
        ::close(fd);
        return "cannot size the state file";
      }
      ::close(fd);
    }
    LocalBackendOptions o = t_.options;
    o.path = dir_.string();
    o.lock_wait_ms = 0;
    std::shared_ptr<Backend> store;
    try {
      store = std::make_shared<LocalStore>(o);
    } catch (const std::exception& e) {
      return std::string("open failed: ") + e.what();
    }
    std::vector<Call> calls(t_.keys);
    get_all(*store, calls, t_.keys, t_.quota_keys);
    size_t present = 0;
    for (uint32_t k = 0; k < t_.keys; ++k) {
      const Call& c = calls[k];
      Read r{c.status, c.len, {}};
      if (c.status == Status::kSuccess) r.data = c.buf.first(std::min<size_t>(c.buf.size(), c.len));
      if (r.status != Status::kSuccess && r.status != Status::kKeyNotExist) {
        return "key " + std::to_string(k) + ": Get status " +
               std::to_string(static_cast<int>(r.status));
      }
      if (r.status == Status::kSuccess) ++present;
      if (std::string why = allowed(k, cut, r); !why.empty()) return why;
    }
    size_t listed = list(*store, Key{}, 1u << 20).size();
    if (t_.quota_keys > 0) listed += list(*store, Key{}, 1u << 20, kQuotaNs).size();
    if (listed != present) return "List disagrees with the Gets";
    if (metric(*store, "local_checksum_failures_total") != 0) return "checksum failures";
    // Writing resumes where recovery left off.
    const uint32_t probe = t_.keys + 1;
    const auto v = value_of(probe, 1, 5000);
    if (Status s = put(*store, int_key(probe), v); s != Status::kSuccess) {
      return "a Store after recovery failed: " + std::to_string(static_cast<int>(s));
    }
    const GetResult r = get(*store, int_key(probe));
    if (r.status != Status::kSuccess || r.data != v) return "a Store after recovery reads wrong";
    counts_.keys += t_.keys;
    return "";
  }

  std::string allowed(uint32_t k, size_t cut, const Read& r) {
    const std::vector<size_t>& ops = per_key_[k];
    // The last op on k acknowledged (success) before the barrier `cut` was issued.
    std::optional<size_t> last;
    for (size_t i : ops) {
      const Op& op = t_.ops[i];
      if (op.status == Status::kSuccess && op.acked <= cut) last = i;
    }
    auto matches = [&](size_t i) {
      const Op& op = t_.ops[i];
      if (!op.put) return r.status == Status::kKeyNotExist;
      const std::vector<std::byte>& want = expected(i);
      return r.status == Status::kSuccess && r.len == op.len && r.data.size() == want.size() &&
             (want.empty() || std::memcmp(r.data.data(), want.data(), want.size()) == 0);
    };
    if (!last) {
      if (r.status == Status::kKeyNotExist) return "";
    } else {
      const Op& l = t_.ops[*last];
      if (matches(*last)) {
        counts_.acked_reads += l.put;
        return "";
      }
      // Reclaimed: the segment holding it has a new header in this state (whole or torn). Not a
      // key of the namespace with a quota: reclaim copies those forward first.
      if (l.put && k >= t_.quota_keys && gone_[*last] < cut && applied_[gone_[*last]] &&
          r.status == Status::kKeyNotExist) {
        return "";
      }
    }
    // Or an op after it that was in flight at the crash (submitted before the barrier, not yet
    // acknowledged) or that failed (its state is unknown to the client).
    bool after = !last;
    for (size_t i : ops) {
      if (last && i == *last) {
        after = true;
        continue;
      }
      const Op& op = t_.ops[i];
      if (!after || op.submitted > cut) continue;
      const bool in_flight = op.status == Status::kSuccess && op.acked > cut;
      const bool failed =
          op.status == Status::kInternalError || op.status == Status::kCapacityExceeded;
      if ((in_flight || failed) && matches(i)) return "";
    }
    std::string want = "absent";
    if (last) {
      const Op& l = t_.ops[*last];
      want = l.put
                 ? "version " + std::to_string(l.version) + " (" + std::to_string(l.len) + " bytes)"
                 : "deleted (version " + std::to_string(l.version) + ")";
    }
    std::string got = "absent";
    if (r.status == Status::kSuccess) {
      uint64_t ver = 0;
      if (r.data.size() >= 16) std::memcpy(&ver, r.data.data() + 8, 8);
      got = std::to_string(r.len) + " bytes";
      if (r.data.size() >= 16) got += " naming version " + std::to_string(ver);
    }
    std::string hist;
    for (size_t i : ops) {
      const Op& op = t_.ops[i];
      hist += " [v" + std::to_string(op.version) + (op.put ? " put " : " del ") +
              std::to_string(op.len) + " sub " + std::to_string(op.submitted) + " ack " +
              std::to_string(op.acked) + " st " + std::to_string(static_cast<int>(op.status));
      if (gone_[i] != ~uint64_t{0}) hist += " reused " + std::to_string(gone_[i]);
      hist += "]";
    }
    return "key " + std::to_string(k) + ": expected " + want + ", got " + got + " (cut at event " +
           std::to_string(cut) + "; ops:" + hist + ")";
  }

  const Trace& t_;
  fs::path dir_;
  bool tear_;
  std::vector<size_t> syncs_;
  std::vector<std::vector<size_t>> per_key_;
  std::vector<uint64_t> gone_;                    // per op: the event reusing its value's segment
  std::vector<std::vector<std::byte>> expected_;  // per op: its value's bytes, once needed
  std::vector<bool> applied_;                     // per event: part of the state being checked
  std::vector<std::byte> base_;
  uint64_t base_size_ = 0;
  size_t base_upto_ = 0;
  struct Saved {
    uint64_t off;
    std::vector<std::byte> old;
  };
  std::vector<Saved> undo_;                     // what the state being checked overwrote in base_
  std::map<size_t, std::set<uint64_t>> masks_;  // per epoch: the whole subsets drawn
  std::map<size_t, uint64_t> repeats_;          // per epoch: repeats since its last new state
  std::set<std::array<uint64_t, 3>> seen_;      // (size, XXH3-128) of every state checked
  CheckCounts counts_;
};

fs::path scratch(const std::string& name) {
  // tmpfs when there is one: states are written and read back thousands of times.
  const fs::path root = fs::exists("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
  return root / ("gdkv-crash-" + std::to_string(::getpid()) + "-" + name);
}

struct RunOptions {
  uint64_t states = 0;      // distinct crash states to check
  bool reuse_only = false;  // every state a subset (some torn) of an epoch that reuses a segment
  bool tear = true;         // false: no write is ever torn (only the guards' own test)
};

struct RunResult {
  uint64_t acked = 0;  // ops acknowledged in the trace
  CrashStats st;
  CheckCounts counts;
};

// Records the workload and checks `o.states` distinct crash states of its trace; fails the test on
// a violation, and when the run checked less than it claims.
RunResult run_workload(const WorkloadSpec& w, const RunOptions& o) {
  const fs::path dir = scratch(w.name);
  std::error_code ec;
  fs::remove_all(dir, ec);
  const auto t0 = std::chrono::steady_clock::now();
  const Trace t = record(w, dir / "live", g_seed);
  RunResult res;
  uint64_t failed = 0, syncs = 0, writes = 0, bytes = 0;
  for (const Op& op : t.ops) {
    res.acked += op.status == Status::kSuccess;
    failed += op.status == Status::kInternalError;
  }
  for (const Event& ev : t.events) {
    syncs += ev.kind == Event::kSync;
    writes += ev.kind == Event::kWrite;
    bytes += ev.data.size();
  }
  CrashChecker checker(t, dir / "state", o.tear);
  std::mt19937_64 rng(g_seed * 7919 + 17);
  CrashStats& st = res.st;
  Watchdog wd;
  const size_t E = checker.epochs();
  size_t max_writes = 0;
  for (size_t e = 0; e < E; ++e) max_writes = std::max(max_writes, checker.writes_in(e));
  // Where random states are drawn from; subsets that keep some writes whole need two or more.
  const std::vector<size_t> pool =
      o.reuse_only ? checker.epochs_reusing_segments() : checker.epochs_with_writes();
  std::vector<size_t> multi;
  for (size_t e : pool) {
    if (checker.writes_in(e) >= 2) multi.push_back(e);
  }
  if (o.reuse_only) {
    EXPECT_GE(pool.size(), 5u) << w.name << ": the workload reused too few segments";
  }
  const uint64_t want = o.states;
  const uint64_t max_attempts = 4 * want + 64;
  auto more = [&] { return st.states < want && st.attempts < max_attempts && st.violations <= 20; };
  // Every barrier's own state first (with fewer states asked than twice the barriers, half of them,
  // evenly spread). The barrier state of epoch e is also epoch e-1 with all its writes landed;
  // checked first, as epoch e's, it must hold every op acknowledged before epoch e's own barrier
  // was issued (the stricter of the two checks of that file).
  if (!o.reuse_only) {
    const uint64_t P = std::min<uint64_t>(E, std::max<uint64_t>(1, want / 2));
    for (uint64_t i = 0; i < P && more(); ++i) {
      checker.check(i * E / P, StateKind::kBarrier, rng, st, wd);
    }
  }
  // Then random states, alternately whole subsets (of an epoch with two or more writes) and torn
  // ones, in epoch order so the file as of each barrier is built once per round. A state that
  // repeats one already checked is drawn again, up to 4 times, torn from the second (the epoch's
  // whole subsets may all have been checked).
  for (uint64_t before = ~uint64_t{0}; more() && !pool.empty() && st.attempts != before;) {
    before = st.attempts;
    struct Slot {
      size_t epoch;
      StateKind kind;
    };
    std::vector<Slot> slots;
    for (uint64_t i = 0; i < want - st.states; ++i) {
      const bool whole = i % 2 == 0 && !multi.empty();
      const std::vector<size_t>& from = whole ? multi : pool;
      slots.push_back({from[rng() % from.size()], whole ? StateKind::kSubset : StateKind::kTorn});
    }
    std::stable_sort(slots.begin(), slots.end(),
                     [](const Slot& a, const Slot& b) { return a.epoch < b.epoch; });
    for (const Slot& s : slots) {
      if (checker.spent(s.epoch)) continue;
      StateKind kind = s.kind;
      for (int n = 0; n < 4 && more(); ++n) {
        if (n == 1) kind = StateKind::kTorn;
        if (checker.check(s.epoch, kind, rng, st, wd)) break;
      }
    }
  }
  res.counts = checker.counts();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto u = [](uint64_t v) { return static_cast<unsigned long long>(v); };
  std::printf(
      "[%s] trace: %zu ops (%llu acknowledged, %llu failed), %llu writes (%.1f MiB), %llu "
      "barriers, %.1f writes per epoch with writes (at most %zu)\n"
      "[%s] %llu distinct crash states over %zu epochs: %llu at a barrier, %llu with some of an "
      "epoch's writes whole and the others missing, %llu with torn writes (%llu writes torn), "
      "%llu others; %llu repeats skipped; %llu key reads (%llu an acknowledged value): %llu "
      "violations, %.1f s\n",
      w.name, t.ops.size(), u(res.acked), u(failed), u(writes),
      static_cast<double>(bytes) / (1 << 20), u(syncs),
      static_cast<double>(writes) /
          static_cast<double>(std::max<size_t>(1, checker.epochs_with_writes().size())),
      max_writes, w.name, u(st.states), st.epochs.size(), u(st.barrier), u(st.partial),
      u(st.torn_states), u(st.torn_writes), u(st.states - st.barrier - st.partial - st.torn_states),
      u(st.attempts - st.states), u(res.counts.keys), u(res.counts.acked_reads), u(st.violations),
      secs);
  std::fflush(stdout);
  if (w.quota_keys > 0) {
    std::printf("[%s] keys 0-%u in a namespace with a quota: %.1f KiB copied forward\n", w.name,
                w.quota_keys - 1, t.copied / 1024);
    if (t.copied <= 0) ADD_FAILURE() << w.name << ": nothing was copied forward";
  }
  EXPECT_EQ(st.violations, 0u);
  // The run checked what it claims.
  if (res.acked == 0) ADD_FAILURE() << w.name << ": no op was acknowledged";
  if (res.counts.acked_reads == 0) {
    ADD_FAILURE() << w.name << ": no key read back as the value an acknowledged Store wrote";
  }
  if (st.torn_writes == 0) ADD_FAILURE() << w.name << ": no state had a torn write";
  if (st.partial == 0) {
    ADD_FAILURE() << w.name
                  << ": no state kept part of an epoch's writes (at most one write per epoch?)";
  }
  if (st.states < want) {
    ADD_FAILURE() << w.name << ": " << st.states << " distinct crash states of the " << want
                  << " asked (" << st.attempts - st.states
                  << " more states built repeated a disk image already checked)";
  }
  if (w.fault_every > 0 && failed == 0) ADD_FAILURE() << w.name << ": no op failed";
  fs::remove_all(dir, ec);
  return res;
}

// The share of --states a test checks, in percent; at least 20, so that the checks above can hold.
uint64_t share(uint64_t percent) { return std::max<uint64_t>(20, g_states * percent / 100); }

// Segments roll over (2 MiB segments, nothing reclaimed); every size class up to 600 KiB (large
// values written straight from the caller's buffer, several per batch), overwrites, deletes, and a
// clean reopen (index rebuild) every 5 steps.
TEST(LocalCrash, StatesAcrossRolloverEverySizeAndRebuild) {
  run_workload({"rollover", 2u << 20, 64u << 20, 24, 12, 5, 600u << 10, 0, 5, 10, 0}, {share(35)});
}

// A 4-segment log (2 MiB segments) written several times over: the oldest segment is reclaimed
// again and again (reclaim is the store's garbage collection), with tombstones, overwrites and
// reopens; batches of up to ~7 values of 256-288 KiB. Keys 0-7 are in a namespace with a quota:
// each reclaim first copies them forward, and no state may lose them.
TEST(LocalCrash, StatesAcrossReclaim) {
  run_workload({"reclaim", 2u << 20, 8u << 20, 24, 50, 20, 288u << 10, 0, 7, 10, 8}, {share(30)});
}

// A power loss while the first batch of a reclaimed segment's new life was being written: the old
// header may survive while some of the new batch's sectors land over the old life's values. The
// old records must then not come back pointing at overwritten bytes (found by the long run: Gets
// failed with 88h). Every state is a subset (whole writes, or some torn) of such an epoch (at least
// 5 in the trace). Keys 0-7 are in a namespace with a quota, so the first batch of a new life is
// often the copy-forward of those keys out of the segment being reclaimed.
TEST(LocalCrash, PowerLossWhileReusingASegment) {
  run_workload({"reuse", 2u << 20, 8u << 20, 24, 40, 1000, 288u << 10, 0, 7, 10, 8},
               {share(15), true});
}

// Failed batches in the trace: every third step one of its first writes or flushes fails with
// EIO (its ops get 06h, the store zeroes the failed batch's header and reuses its place), then a
// power loss anywhere around it.
TEST(LocalCrash, StatesAroundFailedBatches) {
  run_workload({"faults", 2u << 20, 8u << 20, 24, 24, 8, 600u << 10, 3, 5, 10, 0}, {share(20)});
}

// ---- injected I/O errors ------------------------------------------------------------------------

struct Acked {
  uint64_t version = 0;  // 0: absent
  uint32_t len = 0;
  bool reclaimed = false;  // may be missing (its segment was reclaimed), else exactly this
};

// Every key reads back as the model says: byte-exact, or missing. `reclaimed`: an acknowledged
// value may also be missing (the store reclaimed its segment); from then on it may be missing or
// (a reopen before the reclaimed segment was rewritten finds it again) exactly that value.
void expect_model(Backend& b, std::map<uint32_t, Acked>& model, const std::string& when,
                  bool reclaimed = false) {
  for (auto& [k, a] : model) {
    const GetResult r = get(b, int_key(k));
    if (reclaimed && a.version != 0 && r.status == Status::kKeyNotExist) a.reclaimed = true;
    if (a.reclaimed && r.status == Status::kKeyNotExist) continue;
    if (a.version == 0) {
      EXPECT_EQ(r.status, Status::kKeyNotExist) << when << ": key " << k;
    } else {
      ASSERT_EQ(r.status, Status::kSuccess) << when << ": key " << k;
      EXPECT_TRUE(r.len == a.len && r.data == value_of(k, a.version, a.len))
          << when << ": key " << k << " is not version " << a.version;
    }
  }
}

// For each kind of failure and each n, the n-th write or flush of a batch fails (or is short):
// the batch's ops get a clear status (06h for EIO, 81h for ENOSPC; a short write is retried and
// succeeds), nothing acknowledged changes, reads keep working, and the next Store succeeds. With
// the failure repeated on the following calls too, the zero block that invalidates the failed
// batch fails as well: the store then refuses writes (06h) until reopened, keeps serving reads,
// and after a reopen accepts writes again with everything acknowledged intact. ENOSPC comes last:
// the store takes it for a full disk, caps its log at the segments it has and reclaims the
// oldest from then on, so there acknowledged values may go (reclaimed, as in a full cache), but
// none may come back wrong or old.
TEST(LocalFaults, ErrorsAtEveryIoOfABatchGiveAStatusAndLoseNothing) {
  const fs::path dir = scratch("faults");
  std::error_code ec;
  fs::remove_all(dir, ec);
  LocalBackendOptions o;
  o.path = dir.string();
  o.segment_bytes = 8u << 20;
  o.capacity_bytes = 256u << 20;
  Recorder rec;
  rec.recording_ = false;
  auto store = std::make_shared<LocalStore>(o, &rec);
  std::map<uint32_t, Acked> model;
  uint64_t version = 0;
  constexpr uint32_t kKeys = 24;
  for (uint32_t k = 0; k < kKeys; ++k) {
    const uint32_t len = 100 + k * 997;
    ASSERT_EQ(put(*store, int_key(k), value_of(k, ++version, len)), Status::kSuccess);
    model[k] = {version, len};
  }
  struct Mode {
    const char* name;
    int err;
    uint64_t count;
  };
  const Mode modes[] = {{"EIO", EIO, 1},
                        {"short write", 0, 1},
                        {"EIO, then the invalidation too", EIO, 3},
                        {"ENOSPC", ENOSPC, 1}};
  std::mt19937_64 rng(g_seed);
  int rounds = 0, failed_rounds = 0, reopens = 0;
  for (const Mode& m : modes) {
    for (uint64_t n = 0;; ++n) {
      // One batch (usually): inline, one block, a direct write from an aligned 300 KiB buffer, a
      // staged 3 MiB value spanning two staging buffers, 20 KiB, and a Delete.
      const uint32_t lens[] = {100, 4096, 300u << 10, (3u << 20) + 1, 20000};
      std::vector<uint32_t> keys(kKeys);
      for (uint32_t k = 0; k < kKeys; ++k) keys[k] = k;
      std::shuffle(keys.begin(), keys.end(), rng);
      std::vector<Call> calls(6);
      std::vector<std::unique_ptr<AlignedValue>> vals;
      std::vector<std::vector<std::byte>> unaligned(1);
      std::vector<Acked> next(6);
      for (size_t i = 0; i < calls.size(); ++i) {
        Call& c = calls[i];
        c.op.key = int_key(keys[i]);
        c.op.user = &c;
        c.op.done = &Call::on_done;
        if (i == 5) {
          c.op.kind = BackendOpKind::kDelete;
          next[i] = {0, 0};
          continue;
        }
        c.op.kind = BackendOpKind::kPut;
        next[i] = {++version, lens[i]};
        auto v = value_of(keys[i], version, lens[i]);
        if (i == 3) {
          unaligned[0] = std::move(v);  // heap memory: staged, not direct
          c.op.value = unaligned[0];
        } else {
          vals.push_back(std::make_unique<AlignedValue>(v));
          c.op.value = std::span<const std::byte>(vals.back()->p, vals.back()->n);
        }
      }
      rec.arm(n, m.err, m.count);
      std::vector<std::future<void>> fut;
      for (Call& c : calls) fut.push_back(c.done.get_future());
      for (Call& c : calls) store->submit(&c.op);
      for (auto& f : fut) f.wait();
      const bool fired = rec.fired();
      ++rounds;
      const std::string when = std::string(m.name) + " at I/O " + std::to_string(n);
      int failed = 0;
      for (size_t i = 0; i < calls.size(); ++i) {
        const Status s = calls[i].status;
        const uint32_t k = keys[i];
        if (s == Status::kSuccess) {
          model[k] = next[i];
        } else if (i == 5 && s == Status::kKeyNotExist) {
          // Absent already, or (full disk) its segment was reclaimed.
          EXPECT_TRUE(model[k].version == 0 || m.err == ENOSPC) << when << ": key " << k;
          model[k] = {};
        } else {
          ++failed;
          const Status want = m.err == ENOSPC ? Status::kCapacityExceeded : Status::kInternalError;
          EXPECT_TRUE(fired && m.err != 0 && s == want)
              << when << ": op " << i << " got status " << static_cast<int>(s);
        }
      }
      if (fired && m.err != 0) {
        EXPECT_GT(failed, 0) << when << ": an I/O failed and every op succeeded";
      }
      failed_rounds += failed > 0;
      // Nothing acknowledged changed; the failed ops left the keys as they were.
      const bool full = m.err == ENOSPC;
      expect_model(*store, model, when, full);
      // The store takes writes again, or (the failed batch could not be invalidated) refuses
      // them until reopened.
      const uint32_t pk = static_cast<uint32_t>(rng() % kKeys);
      ++version;
      Status s = put(*store, int_key(pk), value_of(pk, version, 5000));
      if (s == Status::kInternalError && m.count > 1) {
        store.reset();
        store = std::make_shared<LocalStore>(o, &rec);
        ++reopens;
        // A batch that failed only in its flush may be whole in the file: after the reopen its
        // ops may show (their status said the outcome was unknown); anything else must not.
        for (size_t i = 0; i < calls.size(); ++i) {
          if (calls[i].status == Status::kSuccess || calls[i].status == Status::kKeyNotExist) {
            continue;
          }
          const uint32_t k = keys[i];
          const GetResult r = get(*store, int_key(k));
          const Acked& n2 = next[i];
          const bool is_next = n2.version == 0 ? r.status == Status::kKeyNotExist
                                               : r.status == Status::kSuccess && r.len == n2.len &&
                                                     r.data == value_of(k, n2.version, n2.len);
          if (is_next) model[k] = n2;
        }
        expect_model(*store, model, when + ", reopened", full);
        s = put(*store, int_key(pk), value_of(pk, version, 5000));
      }
      ASSERT_EQ(s, Status::kSuccess) << when << ": a Store after the failure";
      model[pk] = {version, 5000};
      if (!fired) break;  // n is past the batch's last I/O
    }
  }
  // Everything acknowledged survives a reopen.
  store.reset();
  store = std::make_shared<LocalStore>(o);
  expect_model(*store, model, "final reopen");
  EXPECT_EQ(metric(*store, "local_checksum_failures_total"), 0);
  std::printf(
      "%d rounds (one per I/O of a batch and failure kind), %d with failed ops, %d reopens\n",
      rounds, failed_rounds, reopens);
  store.reset();
  fs::remove_all(dir, ec);
}

// ---- the checks on the run itself -----------------------------------------------------------

// The failures `f` reports, caught instead of failing the test.
std::vector<std::string> failures_of(const std::function<void()>& f) {
  testing::TestPartResultArray results;
  {
    testing::ScopedFakeTestPartResultReporter catcher(
        testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    f();
  }
  std::vector<std::string> out;
  for (int i = 0; i < results.size(); ++i) out.emplace_back(results.GetTestPartResult(i).message());
  return out;
}

bool any_has(const std::vector<std::string>& failures, const std::string& text) {
  return std::any_of(failures.begin(), failures.end(),
                     [&](const std::string& f) { return f.find(text) != std::string::npos; });
}

// A trace without a single op, and no tearing: nothing acknowledged, nothing read back, nothing
// torn, no epoch with two writes, and fewer distinct states than asked. Each check fails the run.
TEST(LocalCrashChecks, ARunThatChecksNothingFails) {
  const auto f = failures_of([] {
    run_workload({"nothing", 1u << 20, 4u << 20, 4, 0, 1000, 4096}, {20, false, false});
  });
  EXPECT_TRUE(any_has(f, "no op was acknowledged"));
  EXPECT_TRUE(any_has(f, "no key read back as the value an acknowledged Store wrote"));
  EXPECT_TRUE(any_has(f, "no state had a torn write"));
  EXPECT_TRUE(any_has(f, "no state kept part of an epoch's writes"));
  EXPECT_TRUE(any_has(f, "distinct crash states of the 20 asked"));
}

// One small Store per step, so each epoch is a single write; without tearing, a subset of it is
// the file as of one of its two barriers again. Such repeats count once: asked for more distinct
// states than the trace has, the run draws up to its limit and fails.
TEST(LocalCrashChecks, RepeatedStatesDoNotCount) {
  RunResult r;
  const auto f = failures_of([&r] {
    r = run_workload({"repeats", 1u << 20, 4u << 20, 4, 8, 1000, 1000, 0, 0, 1},
                     {60, false, false});
  });
  EXPECT_GT(r.acked, 0u);
  EXPECT_GT(r.counts.acked_reads, 0u);
  EXPECT_LT(r.st.states, 60u);
  EXPECT_GT(r.st.attempts, r.st.states);  // the states drawn beyond these repeated them
  EXPECT_TRUE(any_has(f, "distinct crash states of the 60 asked"));
  EXPECT_TRUE(any_has(f, "no state kept part of an epoch's writes"));
  EXPECT_TRUE(any_has(f, "no state had a torn write"));
  EXPECT_FALSE(any_has(f, "no op was acknowledged"));
}

// Decimal digits only (no sign, no space), from `min` to `max`.
std::optional<uint64_t> whole_number(const char* s, uint64_t min, uint64_t max) {
  if (*s == '\0') return std::nullopt;
  uint64_t v = 0;
  for (const char* p = s; *p != '\0'; ++p) {
    if (*p < '0' || *p > '9') return std::nullopt;
    const uint64_t d = static_cast<uint64_t>(*p - '0');
    if (v > (max - d) / 10) return std::nullopt;
    v = v * 10 + d;
  }
  if (v < min) return std::nullopt;
  return v;
}

// The run length and seed from the environment, then the command line (which wins; gtest's own
// flags are gone by then). A count of 0, a negative one or anything but a number ends the program
// with status 2 and says so: a run asked to check nothing must not pass.
void read_run_length(int argc, char** argv) {
  constexpr uint64_t kMaxStates = 1000000000;
  auto take = [](const char* name, const char* text, uint64_t min, uint64_t max, uint64_t& out) {
    const std::optional<uint64_t> v = whole_number(text, min, max);
    if (!v) {
      std::fprintf(
          stderr, "local_crash_test: %s must be a whole number from %llu to %llu, not '%s'\n", name,
          static_cast<unsigned long long>(min), static_cast<unsigned long long>(max), text);
      std::exit(2);
    }
    out = *v;
  };
  if (const char* s = std::getenv("GDKV_CRASH_STATES")) {
    take("GDKV_CRASH_STATES", s, 1, kMaxStates, g_states);
  }
  if (const char* s = std::getenv("GDKV_CRASH_SEED")) {
    take("GDKV_CRASH_SEED", s, 0, ~uint64_t{0}, g_seed);
  }
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--states=", 0) == 0) take("--states", argv[i] + 9, 1, kMaxStates, g_states);
    if (a.rfind("--seed=", 0) == 0) take("--seed", argv[i] + 7, 0, ~uint64_t{0}, g_seed);
  }
}

// read_run_length as `local_crash_test ARG`, and with GDKV_CRASH_STATES set to `states` (when not
// null); returns the count taken.
uint64_t states_read(const std::string& arg, const char* states = nullptr) {
  if (states != nullptr) ::setenv("GDKV_CRASH_STATES", states, 1);
  std::string prog = "local_crash_test", a = arg;
  char* argv[] = {prog.data(), a.data(), nullptr};
  read_run_length(2, argv);
  return g_states;
}

TEST(LocalCrashChecks, AStateCountThatIsNotAPositiveNumberIsAnError) {
  for (const char* bad : {"0", "-5", "abc", "12x", "", " 7", "99999999999999999999999"}) {
    EXPECT_EXIT(states_read(std::string("--states=") + bad), testing::ExitedWithCode(2),
                "--states must be a whole number from 1 to")
        << "--states=" << bad;
  }
  for (const char* bad : {"0", "-1", "abc"}) {
    EXPECT_EXIT(states_read("", bad), testing::ExitedWithCode(2),
                "GDKV_CRASH_STATES must be a whole number from 1 to")
        << "GDKV_CRASH_STATES=" << bad;
  }
  EXPECT_EXIT(states_read("--seed=x"), testing::ExitedWithCode(2), "--seed must be a whole number");
  // A good count is taken; the command line wins over the environment. (In a child, so this run's
  // own count stays.)
  EXPECT_EXIT(std::exit(states_read("--states=12000", "7") == 12000 ? 0 : 1),
              testing::ExitedWithCode(0), "");
  EXPECT_EXIT(std::exit(states_read("", "7") == 7 ? 0 : 1), testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace gdkv::local::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  gdkv::local::test::read_run_length(argc, argv);
  return RUN_ALL_TESTS();
}
