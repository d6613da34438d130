// Power loss and I/O errors, through the store's own I/O layer (IoHook, uring.h).
//
// Power loss. A workload runs against a real store whose hook records every write (offset and
// bytes, as issued), every fdatasync (a barrier) and every extension of the file. From that trace
// the harness builds crash states: the file as of a barrier, plus any subset of the writes issued
// after it and before the next barrier, applied in any order, each possibly torn at 512-byte
// sectors (a power loss keeps an arbitrary subset of unflushed sectors; killing a process, as
// AcknowledgedValuesSurviveKill9 does, keeps them all, because the page cache survives). Each
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
// Run length: `local_crash_test --states=N --seed=S` (defaults 1000 and 1; the same program with a
// larger N is the long run documented in docs/local-store.md). GDKV_CRASH_STATES / GDKV_CRASH_SEED
// in the environment do the same, for runs through ctest.
//
// I/O errors. The same hook fails the n-th write or flush of a batch (EIO, ENOSPC) or shortens a
// write, for every n the batch issues; each time the ops must get a clear status, nothing
// acknowledged may change, reads keep working, and writes are accepted again (after a reopen when
// the failed batch could not even be invalidated).
#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

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
    std::lock_guard lk(mu_);
    if (failing() && fail_err_ != 0) return -fail_err_;
    if (recording_) events_.push_back({Event::kSync, 0, {}});
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
  std::vector<Event> take() {
    std::lock_guard lk(mu_);
    return std::move(events_);
  }
  bool recording_ = true;

 private:
  std::mutex mu_;
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
};

// Every size class the store treats differently: empty, inline (<= 1 KiB), one block, a few
// blocks, tens of KiB, and (when the segment allows) >= 256 KiB written straight from the
// page-aligned buffer, also with an unaligned tail.
uint32_t pick_len(std::mt19937_64& rng, uint32_t max_value) {
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
      if (max_value >= (256u << 10) && rng() % 6 == 0) {
        return static_cast<uint32_t>((256u << 10) + rng() % (max_value - (256u << 10) + 1));
      }
      return static_cast<uint32_t>(std::min<uint64_t>(max_value, 4096 * (1 + rng() % 16)));
  }
}

Trace record(const WorkloadSpec& w, const fs::path& dir, uint64_t seed) {
  Trace t;
  t.keys = w.keys;
  t.options.segment_bytes = w.segment_bytes;
  t.options.capacity_bytes = w.capacity_bytes;
  t.options.path = dir.string();
  Recorder rec;
  std::mt19937_64 rng(seed);
  auto open = [&] { return std::make_shared<LocalStore>(t.options, &rec); };
  std::shared_ptr<Backend> store = open();
  uint64_t version = 0;
  for (int step = 0; step < w.steps; ++step) {
    if (step > 0 && step % w.reopen_every == 0) {
      store.reset();  // a clean close and an open that rebuilds the index, mid-trace
      store = open();
    }
    if (w.fault_every > 0 && step % w.fault_every == w.fault_every - 1) rec.arm(rng() % 4, EIO);
    // 1-8 concurrent ops; a key may appear twice (the second waits for the first's batch).
    const int n = 1 + static_cast<int>(rng() % 8);
    std::vector<Call> calls(static_cast<size_t>(n));
    std::vector<std::unique_ptr<AlignedValue>> values;
    std::vector<size_t> idx;
    for (int i = 0; i < n; ++i) {
      Op op;
      op.key = static_cast<uint32_t>(rng() % w.keys);
      op.put = rng() % 5 != 0;
      op.version = ++version;
      if (op.put) op.len = pick_len(rng, w.max_value);
      Call& c = calls[static_cast<size_t>(i)];
      c.op.kind = op.put ? BackendOpKind::kPut : BackendOpKind::kDelete;
      c.op.key = int_key(op.key);
      if (op.put) {
        values.push_back(std::make_unique<AlignedValue>(value_of(op.key, op.version, op.len)));
        c.op.value = std::span<const std::byte>(values.back()->p, values.back()->n);
      }
      op.submitted = rec.now();
      idx.push_back(t.ops.size());
      t.ops.push_back(op);
    }
    // Each op notes the trace's length when it completes: what was issued before its ack.
    struct Ctx {
      Recorder* rec;
      Call* call;
      uint64_t at;
    };
    std::vector<Ctx> ctx(static_cast<size_t>(n));
    std::vector<std::future<void>> fut;
    for (size_t i = 0; i < calls.size(); ++i) {
      ctx[i] = {&rec, &calls[i], 0};
      fut.push_back(calls[i].done.get_future());
      calls[i].op.user = &ctx[i];
      calls[i].op.done = [](BackendOp* op, Status s, uint64_t len) {
        auto* x = static_cast<Ctx*>(op->user);
        x->at = x->rec->now();
        x->call->status = s;
        x->call->len = len;
        x->call->done.set_value();
      };
    }
    for (Call& c : calls) store->submit(&c.op);
    for (auto& f : fut) f.wait();
    for (size_t i = 0; i < calls.size(); ++i) {
      Op& op = t.ops[idx[i]];
      op.status = calls[i].status;
      op.acked = ctx[i].at;
    }
    rec.fired();  // disarms an injection the step did not reach
    if (simple(*store, BackendOpKind::kExists, int_key(0)) == Status::kInternalError) {
      store.reset();  // a failure the store could not recover from in place: reopen
      store = open();
    }
  }
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
  uint64_t states = 0, violations = 0, torn_writes = 0, keys_checked = 0;
  std::set<uint64_t> epochs;
};

class CrashChecker {
 public:
  CrashChecker(const Trace& t, fs::path dir) : t_(t), dir_(std::move(dir)) {
    for (size_t i = 0; i < t_.events.size(); ++i) {
      if (t_.events[i].kind == Event::kSync) syncs_.push_back(i);
    }
    syncs_.push_back(t_.events.size());  // the end of the trace closes the last epoch
    per_key_.resize(t_.keys);
    for (size_t i = 0; i < t_.ops.size(); ++i) per_key_[t_.ops[i].key].push_back(i);
    find_reclaims();
  }
  size_t epochs() const { return syncs_.size(); }
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
      const size_t begin = e == 0 ? 0 : syncs_[e - 1] + 1;
      for (size_t i = begin; i < syncs_[e]; ++i) {
        if (t_.events[i].kind == Event::kWrite) {
          out.push_back(e);
          break;
        }
      }
    }
    return out;
  }

  // State `variant` of epoch e (the writes after barrier e-1 and before barrier e; epoch 0 is
  // before the first barrier): variant 0 applies none of them (the file as of the barrier),
  // 1 all of them in order, others a random subset in random order, some torn.
  void check(size_t e, uint64_t variant, std::mt19937_64& rng, CrashStats& st, Watchdog& wd) {
    const size_t begin = e == 0 ? 0 : syncs_[e - 1] + 1;
    const size_t end = syncs_[e];
    advance_base(begin);
    std::vector<std::byte> img = base_;
    uint64_t size = base_size_;
    std::vector<size_t> chosen;
    for (size_t i = begin; i < end; ++i) {
      if (variant == 1 || (variant > 1 && rng() % 2 == 0)) chosen.push_back(i);
    }
    if (variant > 1) std::shuffle(chosen.begin(), chosen.end(), rng);
    std::string desc = "epoch " + std::to_string(e) + " variant " + std::to_string(variant) +
                       " of " + std::to_string(end - begin) + " events; applied:";
    for (size_t i : chosen) {
      const Event& ev = t_.events[i];
      if (ev.kind == Event::kResize) {
        size = std::max(size, ev.off);
        desc += " resize#" + std::to_string(i);
        continue;
      }
      const bool tear = variant > 1 && rng() % 3 == 0;
      if (tear) ++st.torn_writes;
      desc += " w#" + std::to_string(i) + (tear ? "(torn)" : "");
      apply(img, size, ev, tear ? &rng : nullptr);
    }
    if (img.size() < size) img.resize(size);
    ++st.states;
    st.epochs.insert(e);
    wd.arm(desc);
    applied_.assign(t_.events.size(), false);
    for (size_t i = 0; i < begin; ++i) applied_[i] = true;
    for (size_t i : chosen) applied_[i] = true;
    const std::string bad = verify(img, size, end);
    wd.arm("");
    if (!bad.empty()) {
      ++st.violations;
      if (st.violations <= 5) ADD_FAILURE() << desc << ": " << bad;
    }
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

  // Writes one recorded write into the image; torn: only a random subset of its 512-byte sectors.
  static void apply(std::vector<std::byte>& img, uint64_t& size, const Event& ev,
                    std::mt19937_64* tear) {
    const uint64_t end = ev.off + ev.data.size();
    if (img.size() < end) img.resize(end);
    size = std::max(size, end);
    for (uint64_t s = 0; s < ev.data.size(); s += 512) {
      if (tear != nullptr && (*tear)() % 2 == 0) continue;
      const uint64_t n = std::min<uint64_t>(512, ev.data.size() - s);
      std::memcpy(img.data() + ev.off + s, ev.data.data() + s, n);
    }
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

  // Opens the state with the real recovery and checks it; "" when it holds. `cut`: the index of
  // the barrier that ends the epoch (ops acknowledged before it was issued count as acknowledged).
  std::string verify(const std::vector<std::byte>& img, uint64_t size, size_t cut) {
    std::error_code ec;
    fs::remove_all(dir_, ec);
    fs::create_directories(dir_);
    const fs::path file = dir_ / kStoreFileName;
    {
      const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0) return "cannot write the state file";
      const size_t n = std::min<size_t>(img.size(), size);
      if (n > 0 && ::pwrite(fd, img.data(), n, 0) != static_cast<ssize_t>(n)) {
        ::close(fd);
        return "cannot write the state file";
      }
      if (::ftruncate(fd, static_cast<off_t>(size)) != 0) return "cannot size the state file";
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
    size_t present = 0;
    for (uint32_t k = 0; k < t_.keys; ++k) {
      const GetResult r = get(*store, int_key(k));
      if (r.status != Status::kSuccess && r.status != Status::kKeyNotExist) {
        return "key " + std::to_string(k) + ": Get status " +
               std::to_string(static_cast<int>(r.status));
      }
      if (r.status == Status::kSuccess) ++present;
      if (std::string why = allowed(k, cut, r); !why.empty()) return why;
    }
    if (list(*store, Key{}, 1u << 20).size() != present) return "List disagrees with the Gets";
    if (metric(*store, "local_checksum_failures_total") != 0) return "checksum failures";
    // Writing resumes where recovery left off.
    const uint32_t probe = t_.keys + 1;
    const auto v = value_of(probe, 1, 5000);
    if (Status s = put(*store, int_key(probe), v); s != Status::kSuccess) {
      return "a Store after recovery failed: " + std::to_string(static_cast<int>(s));
    }
    const GetResult r = get(*store, int_key(probe));
    if (r.status != Status::kSuccess || r.data != v) return "a Store after recovery reads wrong";
    keys_checked_ += t_.keys;
    return "";
  }

  std::string allowed(uint32_t k, size_t cut, const GetResult& r) {
    const std::vector<size_t>& ops = per_key_[k];
    // The last op on k acknowledged (success) before the barrier `cut` was issued.
    std::optional<size_t> last;
    for (size_t i : ops) {
      const Op& op = t_.ops[i];
      if (op.status == Status::kSuccess && op.acked <= cut) last = i;
    }
    auto matches = [&](const Op& op) {
      if (!op.put) return r.status == Status::kKeyNotExist;
      return r.status == Status::kSuccess && r.len == op.len &&
             r.data == value_of(op.key, op.version, op.len);
    };
    if (!last) {
      if (r.status == Status::kKeyNotExist) return "";
    } else {
      const Op& l = t_.ops[*last];
      if (matches(l)) return "";
      // Reclaimed: the segment holding it has a new header in this state (whole or torn).
      if (l.put && gone_[*last] < cut && applied_[gone_[*last]] &&
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
      if ((in_flight || failed) && matches(op)) return "";
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
      got = std::to_string(r.len) + " bytes" +
            (r.data.size() >= 16 ? " naming version " + std::to_string(ver) : "");
    }
    std::string hist;
    for (size_t i : ops) {
      const Op& op = t_.ops[i];
      hist += " [v" + std::to_string(op.version) + (op.put ? " put " : " del ") +
              std::to_string(op.len) + " sub " + std::to_string(op.submitted) + " ack " +
              std::to_string(op.acked) + " st " + std::to_string(static_cast<int>(op.status)) +
              (gone_[i] != ~uint64_t{0} ? " reused " + std::to_string(gone_[i]) : "") + "]";
    }
    return "key " + std::to_string(k) + ": expected " + want + ", got " + got + " (cut at event " +
           std::to_string(cut) + "; ops:" + hist + ")";
  }

  const Trace& t_;
  fs::path dir_;
  std::vector<size_t> syncs_;
  std::vector<std::vector<size_t>> per_key_;
  std::vector<uint64_t> gone_;  // per op: the event reusing its value's segment
  std::vector<bool> applied_;   // per event: part of the state being checked
  std::vector<std::byte> base_;
  uint64_t base_size_ = 0;
  size_t base_upto_ = 0;

 public:
  uint64_t keys_checked_ = 0;
};

fs::path scratch(const std::string& name) {
  // tmpfs when there is one: states are written and read back thousands of times.
  const fs::path root = fs::exists("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
  return root / ("gdkv-crash-" + std::to_string(::getpid()) + "-" + name);
}

// `reuse_only`: every state is a random subset (some torn) of an epoch that reuses a segment.
void run_workload(const WorkloadSpec& w, uint64_t states, bool reuse_only = false) {
  const fs::path dir = scratch(w.name);
  std::error_code ec;
  fs::remove_all(dir, ec);
  const auto t0 = std::chrono::steady_clock::now();
  const Trace t = record(w, dir / "live", g_seed);
  uint64_t acked = 0, failed = 0, syncs = 0, writes = 0, bytes = 0;
  for (const Op& op : t.ops) {
    acked += op.status == Status::kSuccess;
    failed += op.status == Status::kInternalError;
  }
  for (const Event& ev : t.events) {
    syncs += ev.kind == Event::kSync;
    writes += ev.kind == Event::kWrite;
    bytes += ev.data.size();
  }
  CrashChecker checker(t, dir / "state");
  std::mt19937_64 rng(g_seed * 7919 + 17);
  CrashStats st;
  Watchdog wd;
  // Every barrier's own state first; then, alternately, an epoch with all its writes landed (in
  // turn) and a random subset (random order, some torn) of a random epoch, until `states` states
  // have been checked.
  const size_t E = checker.epochs();
  const std::vector<size_t> busy =
      reuse_only ? checker.epochs_reusing_segments() : checker.epochs_with_writes();
  if (reuse_only) {
    ASSERT_GE(busy.size(), 5u) << "the workload reused too few segments";
    for (uint64_t i = 0; i < states && st.violations <= 20; ++i) {
      checker.check(busy[i % busy.size()], 2 + i, rng, st, wd);
    }
  }
  // With fewer states than twice the barriers, barrier states take half, evenly spread.
  const uint64_t P = std::min<uint64_t>(E, std::max<uint64_t>(1, states / 2));
  for (uint64_t i = 0; !reuse_only && i < states && st.violations <= 20; ++i) {
    if (i < P) {
      checker.check(i * E / P, 0, rng, st, wd);
    } else if ((i - P) % 2 == 0 || busy.empty()) {
      checker.check((i - P) / 2 % E, 1, rng, st, wd);
    } else {
      checker.check(busy[rng() % busy.size()], 2 + i, rng, st, wd);
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf(
      "[%s] trace: %zu ops (%llu acknowledged, %llu failed), %llu writes (%.1f MiB), %llu "
      "barriers; checked "
      "%llu "
      "crash states over %zu epochs (%llu torn writes, %llu key reads): %llu violations, %.1f s\n",
      w.name, t.ops.size(), static_cast<unsigned long long>(acked),
      static_cast<unsigned long long>(failed), static_cast<unsigned long long>(writes),
      static_cast<double>(bytes) / (1 << 20), static_cast<unsigned long long>(syncs),
      static_cast<unsigned long long>(st.states), st.epochs.size(),
      static_cast<unsigned long long>(st.torn_writes),
      static_cast<unsigned long long>(checker.keys_checked_),
      static_cast<unsigned long long>(st.violations), secs);
  EXPECT_EQ(st.violations, 0u);
  fs::remove_all(dir, ec);
}

// Segments roll over (1 MiB segments, ~8 MiB written, nothing reclaimed); every size class up to
// 600 KiB (direct writes from the caller's buffer included), overwrites, deletes, and a clean
// reopen (index rebuild) every 40 steps.
TEST(LocalCrash, StatesAcrossRolloverEverySizeAndRebuild) {
  run_workload({"rollover", 1u << 20, 32u << 20, 48, 120, 40, 600u << 10}, g_states * 45 / 100);
}

// A 4-segment log written several times over: the oldest segment is reclaimed again and again
// (reclaim is the store's garbage collection), with tombstones, overwrites and reopens.
TEST(LocalCrash, StatesAcrossReclaim) {
  run_workload({"reclaim", 256u << 10, 1u << 20, 32, 110, 30, 96u << 10}, g_states * 35 / 100);
}

// A power loss while the first batch of a reclaimed segment's new life was being written: the old
// header may survive while some of the new batch's sectors land over the old life's values. The
// old records must then not come back pointing at overwritten bytes (found by the long run: Gets
// failed with 88h). 150 torn or partial states of such epochs (at least 5 in the trace).
TEST(LocalCrash, PowerLossWhileReusingASegment) {
  run_workload({"reuse", 256u << 10, 1u << 20, 32, 60, 1000, 96u << 10}, 150, true);
}

// Failed batches in the trace: every third step one of its first writes or flushes fails with
// EIO (its ops get 06h, the store zeroes the failed batch's header and reuses its place), then a
// power loss anywhere around it.
TEST(LocalCrash, StatesAroundFailedBatches) {
  run_workload({"faults", 1u << 20, 32u << 20, 32, 60, 25, 600u << 10, 3},
               g_states - g_states * 45 / 100 - g_states * 35 / 100);
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

}  // namespace
}  // namespace gdkv::local::test

int main(int argc, char** argv) {
  using namespace gdkv::local::test;
  if (const char* s = std::getenv("GDKV_CRASH_STATES")) g_states = std::strtoull(s, nullptr, 10);
  if (const char* s = std::getenv("GDKV_CRASH_SEED")) g_seed = std::strtoull(s, nullptr, 10);
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--states=", 0) == 0) g_states = std::strtoull(a.c_str() + 9, nullptr, 10);
    if (a.rfind("--seed=", 0) == 0) g_seed = std::strtoull(a.c_str() + 7, nullptr, 10);
  }
  return RUN_ALL_TESTS();
}
