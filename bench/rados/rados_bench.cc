// Store and Retrieve through the rados backend at a fixed concurrency, the way `rados bench`
// drives librados: a closed loop keeping T ops in flight, one thread reaping completions and
// submitting the next op. Store writes fresh keys for --seconds, Retrieve then reads random keys
// among those stored for --seconds, and the keys are deleted at the end. bench/rados/run.sh
// runs it next to `rados bench` on the same pool and prints the ratios.
//
// With --reference, the same loop then reads the same objects through raw librados (no gdkv):
// "raw-read" (a plain aio_read, what `rados bench rand` does) and "raw-read+hdr" (the read plus
// the gdkv.hdr xattr in one op, what the backend sends). Retrieve / raw-read+hdr is the backend's
// own cost; raw-read+hdr / raw-read is what keeping the header in an xattr costs the cluster.
//
// Output, one line per phase:
//   gdkv <store|retrieve> pool=P size=B t=T ops=N seconds=S iops=X mbps=Y p50_us=.. p99_us=..
//   cpu_us_per_op=.. submit_us_per_op=.. submit_cpu_us_per_op=.. errors=E
// submit_us_per_op is the time spent inside the backend's submit(), what a reactor pays per op;
// submit_cpu_us_per_op the calling thread's CPU time in it.
#include <sys/resource.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <rados/librados.hpp>

#include "gdkv/histogram.h"
#include "gdkv/rados_backend.h"

namespace {

using gdkv::BackendOp;
using gdkv::BackendOpKind;
using gdkv::Key;
using gdkv::nvme::Status;
using Clock = std::chrono::steady_clock;

struct Slot;

// Completions land here from librados' thread; the main thread reaps them.
struct Reaper {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Slot*> done;
};

struct Slot {
  BackendOp op;
  librados::AioCompletion* completion = nullptr;  // --reference phases
  librados::bufferlist data, xattr;
  int read_rc = 0, xattr_rc = 0;
  Reaper* reaper = nullptr;
  std::vector<std::byte> buf;  // Store: the value; Retrieve: the sink
  Clock::time_point started;
  Status status = Status::kSuccess;
  uint64_t len = 0;

  static std::span<std::byte> sink(BackendOp* op, uint64_t) {
    return static_cast<Slot*>(op->user)->buf;
  }
  static void on_done(BackendOp* op, Status s, uint64_t len) {
    auto* slot = static_cast<Slot*>(op->user);
    slot->status = s;
    slot->len = len;
    slot->reap();
  }
  static void on_raw_done(librados::completion_t, void* arg) {
    auto* slot = static_cast<Slot*>(arg);
    const int r = slot->completion->get_return_value();
    slot->status = r < 0 ? Status::kUnrecoveredError : Status::kSuccess;
    slot->reap();
  }
  void reap() {
    std::lock_guard lk(reaper->mu);
    reaper->done.push_back(this);
    reaper->cv.notify_one();
  }
};

Key key_of(uint64_t i) {
  uint8_t b[16] = {'b', 'e', 'n', 'c', 'h'};
  for (int j = 0; j < 8; ++j) b[8 + j] = static_cast<uint8_t>(i >> (56 - 8 * j));
  return Key::from_bytes(b, 16);
}

struct PhaseResult {
  uint64_t ops = 0;
  uint64_t errors = 0;
  double seconds = 0;
  double cpu_seconds = 0;
  // Inside start(), the caller's (a reactor's) share of each op: wall time, and the calling
  // thread's CPU time (the difference is time the thread was descheduled).
  double submit_seconds = 0;
  double submit_cpu_seconds = 0;
  gdkv::Histogram latency_ns;
};

double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  const auto sec = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

double thread_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) / 1e9;
}

// Keeps `slots.size()` ops in flight until `seconds` pass; `start(slot)` issues a slot's next op.
template <typename Start>
PhaseResult closed_loop(std::vector<Slot>& slots, Reaper& reaper, double seconds, Start start) {
  PhaseResult r;
  const double cpu0 = cpu_seconds();
  const auto t0 = Clock::now();
  const auto end =
      t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  size_t in_flight = 0;
  for (Slot& s : slots) {
    s.started = Clock::now();
    ++in_flight;
    start(s);
  }
  while (in_flight > 0) {
    Slot* s = nullptr;
    {
      std::unique_lock lk(reaper.mu);
      reaper.cv.wait(lk, [&] { return !reaper.done.empty(); });
      s = reaper.done.front();
      reaper.done.pop_front();
    }
    --in_flight;
    const auto now = Clock::now();
    r.latency_ns.record(static_cast<uint64_t>((now - s->started) / std::chrono::nanoseconds(1)));
    ++r.ops;
    if (s->status != Status::kSuccess) ++r.errors;
    if (now < end) {
      s->started = Clock::now();
      ++in_flight;
      const double c0 = thread_cpu_seconds();
      start(*s);
      r.submit_seconds += std::chrono::duration<double>(Clock::now() - s->started).count();
      r.submit_cpu_seconds += thread_cpu_seconds() - c0;
    }
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  r.cpu_seconds = cpu_seconds() - cpu0;
  return r;
}

void print(const char* phase, const std::string& pool, size_t size, size_t t,
           const PhaseResult& r) {
  const double iops = r.ops / r.seconds;
  std::printf(
      "gdkv %s pool=%s size=%zu t=%zu ops=%llu seconds=%.2f iops=%.1f mbps=%.2f p50_us=%.1f "
      "p99_us=%.1f cpu_us_per_op=%.1f submit_us_per_op=%.2f submit_cpu_us_per_op=%.2f "
      "errors=%llu\n",
      phase, pool.c_str(), size, t, static_cast<unsigned long long>(r.ops), r.seconds, iops,
      iops * static_cast<double>(size) / 1e6, r.latency_ns.percentile(0.5) / 1e3,
      r.latency_ns.percentile(0.99) / 1e3, r.ops ? r.cpu_seconds * 1e6 / r.ops : 0.0,
      r.ops ? r.submit_seconds * 1e6 / r.ops : 0.0,
      r.ops ? r.submit_cpu_seconds * 1e6 / r.ops : 0.0, static_cast<unsigned long long>(r.errors));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gdkv rados backend benchmark: Store then Retrieve at a fixed concurrency"};
  gdkv::RadosBackendOptions o;
  size_t size = 4096;
  size_t threads = 16;
  double seconds = 5;
  app.add_option("--ceph-conf", o.ceph_conf, "ceph.conf (default $CEPH_CONF, /etc/ceph/ceph.conf)");
  app.add_option("--pool", o.pool, "pool")->capture_default_str();
  app.add_option("--size,-b", size, "value size in bytes")
      ->capture_default_str()
      ->check(CLI::Range(1, 64 << 20));
  app.add_option("--concurrency,-t", threads, "ops in flight")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--seconds", seconds, "seconds per phase")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--ceph-timeout-ms", o.ceph_timeout_ms, "backend op timeout")->capture_default_str();
  bool reference = false;
  app.add_flag("--reference", reference,
               "also read the same objects through raw librados (raw-read, raw-read+hdr)");
  CLI11_PARSE(app, argc, argv);

  // A namespace of its own: the cleanup below deletes exactly what this run stored.
  o.namespace_prefix = "bench-" + std::to_string(::getpid()) + "-ns";
  std::shared_ptr<gdkv::Backend> backend;
  try {
    backend = gdkv::make_rados_backend(o).value();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }

  Reaper reaper;
  std::vector<Slot> slots(threads);
  std::mt19937_64 rng(1);
  for (Slot& s : slots) {
    s.reaper = &reaper;
    s.op.user = &s;
    s.op.done = &Slot::on_done;
    s.buf.resize(size);
    for (auto& x : s.buf) x = static_cast<std::byte>(rng());
  }

  uint64_t stored = 0;
  PhaseResult st = closed_loop(slots, reaper, seconds, [&](Slot& s) {
    s.op.kind = BackendOpKind::kPut;
    s.op.key = key_of(stored++);
    s.op.value = s.buf;
    s.op.sink = nullptr;
    backend->submit(&s.op);
  });
  print("store", o.pool, size, threads, st);
  // Keys whose store failed read as not found and count as errors below, as in rados bench.
  const uint64_t keys = stored;

  PhaseResult rt = closed_loop(slots, reaper, seconds, [&](Slot& s) {
    s.op.kind = BackendOpKind::kGet;
    s.op.key = key_of(rng() % keys);
    s.op.sink = &Slot::sink;
    s.op.view = {};
    backend->submit(&s.op);
  });
  print("retrieve", o.pool, size, threads, rt);

  if (reference) {
    // A client of its own, outside gdkv, on the objects the store phase wrote.
    librados::Rados rados;
    librados::IoCtx io;
    if (rados.init2(o.client_name.c_str(), "ceph", 0) < 0 ||
        rados.conf_read_file(o.ceph_conf.empty() ? nullptr : o.ceph_conf.c_str()) < 0 ||
        rados.connect() < 0 || rados.ioctx_create(o.pool.c_str(), io) < 0) {
      std::fprintf(stderr, "--reference: cannot open the pool through librados\n");
      return 1;
    }
    io.set_namespace(o.namespace_prefix + "1");
    for (const bool with_header : {false, true}) {
      PhaseResult raw = closed_loop(slots, reaper, seconds, [&](Slot& s) {
        if (s.completion != nullptr) s.completion->release();
        s.completion = librados::Rados::aio_create_completion(&s, &Slot::on_raw_done);
        s.data.clear();
        s.xattr.clear();
        const std::string oid = key_of(rng() % keys).hex();
        librados::ObjectReadOperation rd;
        rd.read(0, 0, &s.data, &s.read_rc);
        if (with_header) {
          rd.getxattr("gdkv.hdr", &s.xattr, &s.xattr_rc);
          rd.set_op_flags2(librados::OP_FAILOK);
        }
        io.aio_operate(oid, s.completion, &rd, nullptr);
      });
      print(with_header ? "raw-read+hdr" : "raw-read", o.pool, size, threads, raw);
    }
    for (Slot& s : slots) {
      if (s.completion != nullptr) s.completion->release();
      s.completion = nullptr;
    }
  }

  // Cleanup at concurrency 64 whatever the measured concurrency was.
  std::vector<Slot> cleaners(std::min<size_t>(64, keys));
  for (Slot& s : cleaners) {
    s.reaper = &reaper;
    s.op.user = &s;
    s.op.done = &Slot::on_done;
  }
  uint64_t next_del = 0;
  size_t in_flight = 0;
  for (Slot& s : cleaners) {
    s.op.kind = BackendOpKind::kDelete;
    s.op.key = key_of(next_del++);
    ++in_flight;
    backend->submit(&s.op);
  }
  while (in_flight > 0) {
    Slot* s = nullptr;
    {
      std::unique_lock lk(reaper.mu);
      reaper.cv.wait(lk, [&] { return !reaper.done.empty(); });
      s = reaper.done.front();
      reaper.done.pop_front();
    }
    --in_flight;
    if (next_del < keys) {
      s->op.key = key_of(next_del++);
      ++in_flight;
      backend->submit(&s->op);
    }
  }
  return (st.errors == 0 && rt.errors == 0) ? 0 : 2;
}
