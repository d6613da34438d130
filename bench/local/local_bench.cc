// Benchmark of the local store through the Backend API (no controller), for bench/local/run.sh,
// which runs fio on the same file system in the same script and prints the ratios. Each command
// prints one JSON object.
//
//   local_bench write   --dir D --size BYTES --count N --qd Q
//       A fresh store; stores N values (keys 0..N-1) keeping Q in flight. Reports throughput
//       and the group-commit batch size (records per fdatasync), which run.sh hands to fio.
//   local_bench read    --dir D --size BYTES --count N --qd Q --seconds T
//       Reopens that store; random Gets over keys 0..N-1 with Q in flight for T seconds, into
//       4 KiB-aligned buffers (the zero-copy path). O_DIRECT: every Get goes to the device.
//   local_bench rebuild --dir D --count N
//       A fresh store with N small values, then a timed reopen: rebuild time and index memory.
//
// QD is the number of outstanding ops (a closed loop, like fio's iodepth). With --submit callback
// (the default) each completion submits the next op right from the store's I/O thread, one thread
// doing everything as fio does. With --submit thread completions hand their slot to the bench's
// own thread, which submits the next op, as gdkvd's reactors do: a Store's checksum and digest
// are then computed on that thread, in submit(), instead of on the I/O thread.
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "gdkv/histogram.h"
#include "gdkv/local_backend.h"

namespace gdkv {
namespace {

using Clock = std::chrono::steady_clock;
using nvme::Status;

struct Args {
  std::string cmd, dir;
  uint64_t size = 4096, count = 1024, qd = 1;
  double seconds = 5;
  bool thread = false;  // --submit thread
};

Args parse(int argc, char** argv) {
  Args a;
  if (argc < 2) throw std::runtime_error("missing command");
  a.cmd = argv[1];
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--dir") {
      a.dir = v;
    } else if (k == "--size") {
      a.size = std::stoull(v);
    } else if (k == "--count") {
      a.count = std::stoull(v);
    } else if (k == "--qd") {
      a.qd = std::stoull(v);
    } else if (k == "--seconds") {
      a.seconds = std::stod(v);
    } else if (k == "--submit" && (v == "thread" || v == "callback")) {
      a.thread = v == "thread";
    } else {
      throw std::runtime_error("unknown option " + k + " " + v);
    }
  }
  if (a.dir.empty()) throw std::runtime_error("--dir is required");
  if (a.qd == 0 || a.count == 0) throw std::runtime_error("--qd and --count must be positive");
  return a;
}

// A fresh store in --dir: removes only the store file there, never anything else.
void fresh_store(const std::string& dir) {
  namespace fs = std::filesystem;
  if (fs::exists(dir) && !fs::is_directory(dir)) {
    throw std::runtime_error("--dir must be a directory: " + dir);
  }
  fs::create_directories(dir);
  fs::remove(fs::path(dir) / "store.gdkv");
}

Key key_of(uint64_t i) {
  uint8_t b[8];
  std::memcpy(b, &i, 8);
  return Key::from_bytes(b, 8);
}

double metric(const Backend& b, const char* name) {
  MetricList m;
  b.collect(m);
  for (const Metric& x : m) {
    if (x.name == name) return x.value;
  }
  return 0;
}

LocalBackendOptions store_options(const Args& a) {
  LocalBackendOptions o;
  o.path = a.dir;
  o.capacity_bytes = uint64_t{64} << 30;  // no reclaim during a run
  o.queue_depth = 256;
  return o;
}

// One in-flight slot of the closed loop.
struct Slot {
  BackendOp op;
  struct Loop* loop = nullptr;
  std::byte* buf = nullptr;
  Clock::time_point t0;
  uint64_t rng = 0;
};

struct Loop {
  Backend* store = nullptr;
  bool write = false;
  bool thread = false;
  uint64_t size = 0, count = 0;
  std::atomic<uint64_t> next{0};  // write: next key to store
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> done{0}, errors{0}, live{0};
  std::atomic<uint64_t> submit_ns{0};  // time inside submit(): what a reactor would spend
  HistogramRecorder lat;       // single writer: completions all run on the store's I/O thread
  std::byte* value = nullptr;  // page-aligned, as the cache's slabs are
  std::mutex mu;  // write runs: completed slots waiting for the bench thread to resubmit them
  std::condition_variable cv;
  std::vector<Slot*> ready;

  static std::span<std::byte> sink(BackendOp* op, uint64_t len) {
    auto* s = static_cast<Slot*>(op->user);
    return {s->buf, std::min<uint64_t>(len, s->loop->size)};
  }
  static void on_done(BackendOp* op, Status st, uint64_t) {
    auto* s = static_cast<Slot*>(op->user);
    Loop* l = s->loop;
    l->lat.record(static_cast<uint64_t>((Clock::now() - s->t0) / std::chrono::nanoseconds(1)));
    if (st != Status::kSuccess) l->errors.fetch_add(1);
    l->done.fetch_add(1);
    if (l->thread) {
      std::lock_guard lk(l->mu);
      l->ready.push_back(s);
      l->cv.notify_one();
    } else if (!l->issue(s)) {
      l->live.fetch_sub(1);
    }
  }
  bool issue(Slot* s) {
    if (stop.load(std::memory_order_relaxed)) return false;
    if (write) {
      const uint64_t k = next.fetch_add(1);
      if (k >= count) return false;
      s->op.key = key_of(k);
    } else {
      s->rng ^= s->rng << 13;
      s->rng ^= s->rng >> 7;
      s->rng ^= s->rng << 17;
      s->op.key = key_of(s->rng % count);
    }
    s->t0 = Clock::now();
    store->submit(&s->op);
    submit_ns.fetch_add(static_cast<uint64_t>((Clock::now() - s->t0) / std::chrono::nanoseconds(1)),
                        std::memory_order_relaxed);
    return true;
  }
};

void print_latency(const Histogram& h) {
  std::printf(", \"p50_us\": %.1f, \"p99_us\": %.1f, \"mean_us\": %.1f",
              static_cast<double>(h.percentile(0.5)) / 1e3,
              static_cast<double>(h.percentile(0.99)) / 1e3, h.mean() / 1e3);
}

int run_loop(const Args& a, bool write) {
  if (write) fresh_store(a.dir);
  auto store = make_local_backend(store_options(a)).value();
  Loop l;
  l.store = store.get();
  l.write = write;
  l.thread = a.thread;
  l.size = a.size;
  l.count = a.count;
  if (write) {
    l.value = static_cast<std::byte*>(std::aligned_alloc(4096, (a.size + 4095) / 4096 * 4096));
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < a.size; i += 8) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      std::memcpy(l.value + i, &s, std::min<size_t>(8, a.size - i));
    }
  } else if (store->info().keys < a.count) {
    throw std::runtime_error("the store holds fewer than --count keys: run write first");
  }
  std::vector<Slot> slots(a.qd);
  std::vector<std::byte*> bufs;
  for (uint64_t i = 0; i < a.qd; ++i) {
    Slot& s = slots[i];
    s.loop = &l;
    s.rng = 0x2545F4914F6CDD1Dull * (i + 1);
    s.op.user = &s;
    s.op.done = &Loop::on_done;
    if (write) {
      s.op.kind = BackendOpKind::kPut;
      s.op.value = std::span<const std::byte>(l.value, a.size);
    } else {
      s.op.kind = BackendOpKind::kGet;
      s.op.sink = &Loop::sink;
      s.buf = static_cast<std::byte*>(std::aligned_alloc(4096, (a.size + 4095) / 4096 * 4096));
      bufs.push_back(s.buf);
    }
  }
  const double flushes0 = metric(*store, "local_flushes_total");
  const double recs0 = metric(*store, "local_group_commit_records_total");
  rusage ru0{}, ru1{};
  getrusage(RUSAGE_SELF, &ru0);
  const auto t0 = Clock::now();
  l.live.store(a.qd);
  for (Slot& s : slots) {
    if (!l.issue(&s)) l.live.fetch_sub(1);
  }
  if (a.thread) {
    std::thread stopper;
    if (!write) {
      stopper = std::thread([&] {
        std::this_thread::sleep_for(std::chrono::duration<double>(a.seconds));
        l.stop.store(true);
      });
    }
    std::vector<Slot*> batch;
    while (l.live.load() > 0) {
      {
        std::unique_lock lk(l.mu);
        l.cv.wait(lk, [&] { return !l.ready.empty(); });
        batch.swap(l.ready);
      }
      for (Slot* s : batch) {
        if (!l.issue(s)) l.live.fetch_sub(1);
      }
      batch.clear();
    }
    if (stopper.joinable()) stopper.join();
  } else if (write) {
    while (l.live.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  } else {
    std::this_thread::sleep_for(std::chrono::duration<double>(a.seconds));
    l.stop.store(true);
  }
  store->drain();
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  getrusage(RUSAGE_SELF, &ru1);
  const auto cpu = [](const rusage& r) {
    return static_cast<double>(r.ru_utime.tv_sec + r.ru_stime.tv_sec) +
           static_cast<double>(r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1e6;
  };
  const double ops = static_cast<double>(l.done.load());
  const double flushes = metric(*store, "local_flushes_total") - flushes0;
  const double recs = metric(*store, "local_group_commit_records_total") - recs0;
  std::printf(
      "{\"op\": \"%s\", \"submit\": \"%s\", \"size\": %llu, \"qd\": %llu, \"ops\": %.0f, "
      "\"seconds\": %.3f, \"ops_per_s\": %.1f, \"mb_per_s\": %.1f, \"errors\": %llu, "
      "\"cpu_per_op_us\": %.2f, \"submit_us\": %.2f",
      write ? "put" : "get", a.thread ? "thread" : "callback",
      static_cast<unsigned long long>(a.size), static_cast<unsigned long long>(a.qd), ops, secs,
      ops / secs, ops * static_cast<double>(a.size) / secs / 1e6,
      static_cast<unsigned long long>(l.errors.load()),
      (cpu(ru1) - cpu(ru0)) / std::max(ops, 1.0) * 1e6,
      static_cast<double>(l.submit_ns.load()) / std::max(ops, 1.0) / 1e3);
  print_latency(l.lat.snapshot());
  if (write) {
    std::printf(
        ", \"flushes\": %.0f, \"records_per_flush\": %.1f, \"log_bytes_per_value_byte\": %.3f",
        flushes, recs / std::max(flushes, 1.0),
        metric(*store, "local_log_bytes_written_total") /
            std::max(metric(*store, "local_written_bytes_total"), 1.0));
  } else {
    // log_end: the file offset the log is written up to (segments fill from the file's start),
    // so a reference reader can cover the written part of the store's own file and no more.
    std::printf(
        ", \"checksum_failures\": %.0f, \"direct_io\": %.0f, \"rebuild_ms\": %.1f, "
        "\"log_end\": %llu",
        metric(*store, "local_checksum_failures_total"), metric(*store, "local_direct_io"),
        metric(*store, "local_rebuild_seconds") * 1e3,
        static_cast<unsigned long long>(4096 + store->info().bytes_used));
  }
  std::printf("}\n");
  for (std::byte* b : bufs) std::free(b);
  std::free(l.value);
  return l.errors.load() == 0 ? 0 : 1;
}

int run_rebuild(const Args& a) {
  fresh_store(a.dir);
  auto o = store_options(a);
  {
    auto store = make_local_backend(o).value();
    std::vector<BackendOp> ops(4096);
    std::vector<uint64_t> vals(4096);
    std::atomic<uint64_t> errors{0};
    for (uint64_t base = 0; base < a.count; base += ops.size()) {
      const uint64_t n = std::min<uint64_t>(ops.size(), a.count - base);
      for (uint64_t i = 0; i < n; ++i) {
        vals[i] = base + i;
        ops[i] = BackendOp{};
        ops[i].kind = BackendOpKind::kPut;
        ops[i].key = key_of(base + i);
        ops[i].value = std::as_bytes(std::span(&vals[i], 1));
        ops[i].user = &errors;
        ops[i].done = [](BackendOp* op, Status s, uint64_t) {
          if (s != Status::kSuccess) static_cast<std::atomic<uint64_t>*>(op->user)->fetch_add(1);
        };
      }
      for (uint64_t i = 0; i < n; ++i) store->submit(&ops[i]);
      store->drain();
    }
    if (errors.load() != 0) throw std::runtime_error("stores failed while filling");
  }
  const auto t0 = Clock::now();
  auto store = make_local_backend(o).value();
  const double open_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const double keys = static_cast<double>(store->info().keys);
  const double rebuild_s = metric(*store, "local_rebuild_seconds");
  std::printf(
      "{\"op\": \"rebuild\", \"keys\": %.0f, \"rebuild_ms\": %.1f, \"open_ms\": %.1f, "
      "\"rebuild_s_per_million_keys\": %.3f, \"index_bytes_per_key\": %.1f, "
      "\"log_bytes\": %llu}\n",
      keys, rebuild_s * 1e3, open_s * 1e3, rebuild_s / keys * 1e6,
      metric(*store, "local_index_bytes") / keys,
      static_cast<unsigned long long>(store->info().bytes_used));
  return keys == static_cast<double>(a.count) ? 0 : 1;
}

}  // namespace
}  // namespace gdkv

int main(int argc, char** argv) {
  try {
    const gdkv::Args a = gdkv::parse(argc, argv);
    if (a.cmd == "write") return gdkv::run_loop(a, true);
    if (a.cmd == "read") return gdkv::run_loop(a, false);
    if (a.cmd == "rebuild") return gdkv::run_rebuild(a);
    throw std::runtime_error("unknown command " + a.cmd);
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "local_bench: %s\nusage: local_bench write|read|rebuild --dir D "
                 "[--size BYTES] [--count N] [--qd Q] [--seconds T] [--submit callback|thread]\n",
                 e.what());
    return 2;
  }
}
