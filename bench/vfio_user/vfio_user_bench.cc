// The same Retrieve workloads in-process and over vfio-user, and their ratio.
//
//   in-process: Client::open over the memory backend (one queue pair in this process).
//   vfio-user:  a VfioUserServer on the same kind of controller and backend (the code gdkvd runs),
//               reached through gdkv's client driver: doorbells in the shared page, SQ/CQ and
//               buffers in the shared memfd, PRPs translated against the DMA map. With --connect
//               DIR the client talks to a running gdkvd instead (its backend is what it was
//               started with).
//
// Each run populates the keys, then --threads threads keep --qd Retrieves in flight each for
// --duration seconds. The two setups alternate for --rounds rounds (each round builds its setup
// afresh, so only one controller's reactors run at a time), and the ratio reported is the median
// of the per-round ratios: robust to load that drifts during the benchmark on a shared machine.
// Output: per round and a summary per value size (target >= 0.8); --json: one JSON line per size.
// --concurrent runs both setups at the same time instead, so both see the same CPU share.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/client.h"
#include "gdkv/commands.h"
#include "gdkv/histogram.h"
#include "gdkv/vfio_user.h"
#include "vfio_user/dma_space.h"
#include "vfio_user/translate.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<uint32_t> sizes = {4096, 2u << 20};
  uint32_t qd = 32;
  uint32_t threads = 1;
  uint32_t reactors = 1;
  double duration = 2;
  uint32_t rounds = 5;
  uint32_t keys_4k = 4096;
  uint32_t keys_large = 32;
  std::string connect;  // a running gdkvd's socket dir
  bool never_sleep = true;
  bool json = false;
  bool concurrent = false;
  bool micro = false;
};

struct Result {
  double ops_per_s = 0;
  double bytes_per_s = 0;
  gdkv::Histogram latency;
  uint64_t errors = 0;
};

// Buffers for one thread's in-flight commands: heap, or the device's shared memory.
struct Buffers {
  std::vector<std::byte*> slots;
  std::vector<std::vector<std::byte>> owned;
};

Result run(gdkv::Client& c, const Options& o, uint32_t size,
           const std::function<std::byte*(size_t)>& alloc) {
  const uint32_t nkeys = size <= 65536 ? o.keys_4k : o.keys_large;
  std::vector<gdkv::Key> keys(nkeys);
  {
    std::byte* v = alloc(size);
    std::mt19937_64 g(7);
    for (uint32_t i = 0; i < size; i += 8) {
      const uint64_t x = g();
      std::memcpy(v + i, &x, std::min<uint32_t>(8, size - i));
    }
    std::vector<gdkv::nvme::Sqe> sqes;
    for (uint32_t i = 0; i < nkeys; ++i) {
      char name[17];
      std::snprintf(name, sizeof(name), "%08x%08x", size, i);
      keys[i] = *gdkv::Key::from_string(name);
      sqes.push_back(gdkv::cmd::store(keys[i].bytes, keys[i].len, v, size));
    }
    std::vector<gdkv::CmdResult> rs(sqes.size());
    c.run_batch(sqes, rs);
    for (auto& r : rs) {
      if (!r.ok()) throw std::runtime_error("populate failed: " + gdkv::describe(r));
    }
  }
  std::atomic<bool> stop{false};
  std::vector<gdkv::Histogram> hists(o.threads);
  std::vector<uint64_t> errors(o.threads, 0);
  std::vector<std::vector<std::byte*>> bufs(o.threads);
  for (auto& b : bufs) {
    for (uint32_t s = 0; s < o.qd; ++s) b.push_back(alloc(size));
  }
  auto worker = [&](uint32_t t) {
    std::mt19937_64 r(t + 1);
    std::vector<uint16_t> cids(o.qd);
    std::vector<Clock::time_point> starts(o.qd);
    auto issue = [&](uint32_t s) {
      const gdkv::Key& k = keys[r() % keys.size()];
      starts[s] = Clock::now();
      cids[s] = c.start(gdkv::cmd::retrieve(k.bytes, k.len, bufs[t][s], size)).value();
    };
    for (uint32_t s = 0; s < o.qd; ++s) issue(s);
    while (!stop.load(std::memory_order_relaxed)) {
      for (uint32_t s = 0; s < o.qd; ++s) {
        if (!c.poll(cids[s])) continue;
        const gdkv::CmdResult res = c.finish(cids[s]);
        hists[t].record(static_cast<uint64_t>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - starts[s])
                .count()));
        if (!res.ok() || res.dw0 != size) ++errors[t];
        issue(s);
      }
    }
    for (uint32_t s = 0; s < o.qd; ++s) (void)c.wait(cids[s]);
  };
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (uint32_t t = 0; t < o.threads; ++t) ts.emplace_back(worker, t);
  std::this_thread::sleep_for(std::chrono::duration<double>(o.duration));
  stop = true;
  for (auto& t : ts) t.join();
  const double el = std::chrono::duration<double>(Clock::now() - t0).count();
  Result res;
  for (uint32_t t = 0; t < o.threads; ++t) {
    res.latency.merge(hists[t]);
    res.errors += errors[t];
  }
  res.ops_per_s = static_cast<double>(res.latency.count()) / el;
  res.bytes_per_s = res.ops_per_s * size;
  return res;
}

void print(const char* mode, uint32_t size, const Options& o, const Result& r) {
  std::printf(
      "%-11s value %8u B  qd %3u x %u thr  %10.0f ops/s  %8.3f GB/s  p50 %8.2f us  "
      "p99 %8.2f us%s\n",
      mode, size, o.qd, o.threads, r.ops_per_s, r.bytes_per_s / 1e9,
      r.latency.percentile(0.5) / 1e3, r.latency.percentile(0.99) / 1e3,
      r.errors ? "  ERRORS" : "");
}

// What the vfio-user transport adds per command on the reactor: resolving the data pointer
// against the client's DMA maps (and unpinning at completion). Timed in a tight loop; the minimum
// over batches is insensitive to other load on the machine. Returns ns per command.
double translation_ns(uint32_t size, bool flat) {
  gdkv::vfio_user::DmaSpace dma;
  std::vector<std::byte> mem(size + (size_t{1} << 20));
  for (int i = 0; i < 8; ++i) {  // a few other maps, as a client with several regions has
    (void)dma.map_memory(0x10000000 + uint64_t(i) * 0x100000, mem.data(), 4096, true, true,
                         gdkv::MemKind::kHost);
  }
  const uint64_t base = 0x40000000;
  (void)dma.map_memory(base, mem.data(), mem.size(), true, true, gdkv::MemKind::kHost);
  // PRP form: a list page after the data for the non-flat case.
  auto* list = reinterpret_cast<uint64_t*>(mem.data() + size);
  for (uint32_t i = 1; i < size / 4096; ++i) list[i - 1] = base + uint64_t{i} * 4096;
  gdkv::nvme::Sqe s{};
  s.dptr.prp.prp1 = base;
  s.dptr.prp.prp2 = flat ? 0 : (size > 8192 ? base + size : base + 4096);
  class Resolver final : public gdkv::vfio_user::DmaResolver {
   public:
    explicit Resolver(gdkv::vfio_user::DmaSpace& d) : d_(d) {}
    gdkv::nvme::Status resolve(uint64_t iova, uint64_t len, bool w,
                               gdkv::DataSegments& out) override {
      return d_.resolve(iova, len, w, out, refs);
    }
    bool read(uint64_t iova, void* dst, size_t len) override { return d_.read(iova, dst, len); }
    gdkv::vfio_user::MapRefs refs;

   private:
    gdkv::vfio_user::DmaSpace& d_;
  } r(dma);
  r.refs.reserve(4);
  gdkv::vfio_user::TranslateOptions to;
  to.flat = flat;
  gdkv::DataSegments out;
  out.reserve(size / 4096 + 1);
  double best = 1e18;
  for (int batch = 0; batch < 20; ++batch) {
    const auto t0 = Clock::now();
    constexpr int kIters = 2000;
    for (int i = 0; i < kIters; ++i) {
      out.clear();
      if (gdkv::vfio_user::translate_data(s, size, true, to, r, out) !=
          gdkv::nvme::Status::kSuccess) {
        return -1;
      }
      gdkv::vfio_user::DmaSpace::unpin(r.refs);
    }
    best = std::min(best,
                    std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / kIters);
  }
  return best;
}

// The in-process setup: Client::open over a memory backend; buffers on the heap.
struct InProcess {
  std::unique_ptr<gdkv::Client> client;
  std::vector<std::unique_ptr<std::vector<std::byte>>> heap;
  InProcess(const Options&, const gdkv::ControllerOptions& co,
            const gdkv::MemoryBackendOptions& mo) {
    gdkv::ClientOptions opts;
    opts.controller = co;
    opts.queue.depth = 256;
    client = gdkv::Client::open(gdkv::make_memory_backend(mo), opts).value();
  }
  std::function<std::byte*(size_t)> allocator() {
    return [this](size_t n) {
      heap.push_back(std::make_unique<std::vector<std::byte>>(n));
      return heap.back()->data();
    };
  }
};

// The vfio-user setup: a VfioUserServer (or a running gdkvd) and gdkv's client driver; buffers
// in the shared memory.
struct Remote {
  std::unique_ptr<gdkv::Controller> ctl;
  std::unique_ptr<gdkv::VfioUserServer> server;
  std::shared_ptr<gdkv::VfioUserDevice> dev;
  std::unique_ptr<gdkv::Client> client;
  std::vector<void*> shm;
  std::string dir;
  Remote(const Options& o, const gdkv::ControllerOptions& co, const gdkv::MemoryBackendOptions& mo,
         uint32_t size) {
    dir = o.connect;
    if (dir.empty()) {
      dir = (std::filesystem::temp_directory_path() / ("gdkv-bench-" + std::to_string(::getpid())))
                .string();
      ctl = std::make_unique<gdkv::Controller>(gdkv::make_memory_backend(mo), co);
      gdkv::VfioUserServerOptions so;
      so.socket_dir = dir;
      so.log = [](const std::string&) {};
      server = std::make_unique<gdkv::VfioUserServer>(*ctl, so);
      server->start().value();
    }
    gdkv::VfioUserClientOptions vo;
    vo.queue_depth = 256;
    const size_t need = (size_t{o.qd} * o.threads + 2) * size + (size_t{64} << 20);
    vo.shared_memory_bytes = std::max<size_t>(vo.shared_memory_bytes, need);
    dev = gdkv::VfioUserDevice::open(dir, vo).value();
    client = dev->make_client().value();
  }
  ~Remote() {
    for (void* p : shm) dev->free(p);
    client.reset();
    dev.reset();
    if (server) {
      server->stop();
      ctl->stop();
      std::filesystem::remove_all(dir);
    }
  }
  std::function<std::byte*(size_t)> allocator() {
    return [this](size_t n) {
      void* p = dev->alloc(n, 4096);
      if (p == nullptr) throw std::runtime_error("shared memory exhausted");
      std::memset(p, 0, n);  // commit the pages, as the heap buffers are
      shm.push_back(p);
      return static_cast<std::byte*>(p);
    };
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Retrieve throughput in-process vs over vfio-user (gdkvd), same workload"};
  Options o;
  app.add_option("--sizes", o.sizes, "value sizes in bytes (default 4096 2097152)");
  app.add_option("--qd", o.qd, "commands in flight per thread (32)");
  app.add_option("--threads", o.threads, "submitting threads (1)");
  app.add_option("--reactors", o.reactors, "controller reactors (1)");
  app.add_option("--duration", o.duration, "seconds per run (2)");
  app.add_option("--rounds", o.rounds, "alternating rounds per value size (5)");
  app.add_option("--keys-small", o.keys_4k, "keys for values <= 64 KiB (4096)");
  app.add_option("--keys-large", o.keys_large, "keys for larger values (32)");
  app.add_option("--connect", o.connect, "use a running gdkvd at DIR for the vfio-user runs");
  app.add_flag("!--may-sleep", o.never_sleep, "let reactors sleep when idle");
  app.add_flag("--json", o.json, "one JSON line per value size");
  app.add_flag("--micro", o.micro, "also time the per-command data pointer translation");
  app.add_flag("--concurrent", o.concurrent,
               "run both setups at the same time (a fair ratio on a machine with other load)");
  CLI11_PARSE(app, argc, argv);

  try {
    gdkv::ControllerOptions co;
    co.reactors = o.reactors;
    co.never_sleep = o.never_sleep;
    co.max_value_bytes = uint64_t{64} << 20;
    gdkv::MemoryBackendOptions mo;
    mo.capacity_bytes = uint64_t{4} << 30;
    if (o.micro) {
      for (uint32_t size : o.sizes) {
        std::printf(
            "translation of a %u-byte Retrieve pointer: %.0f ns flat (gdkv queues), %.0f ns "
            "PRP%s (standard hosts)\n",
            size, translation_ns(size, true), translation_ns(size, false),
            size > 8192 ? " list" : "1/PRP2");
      }
    }
    for (uint32_t size : o.sizes) {
      std::vector<double> ratios;
      Result local_total, remote_total;
      double local_ops = 0, remote_ops = 0;
      for (uint32_t round = 0; round < std::max<uint32_t>(o.rounds, 1); ++round) {
        Result local, remote;
        if (o.concurrent) {
          // Both at once: they share whatever CPU the machine gives, so the ratio compares the
          // work per command even when other load comes and goes.
          InProcess a(o, co, mo);
          Remote b(o, co, mo, size);
          std::thread ta([&] { local = run(*a.client, o, size, a.allocator()); });
          std::thread tb([&] { remote = run(*b.client, o, size, b.allocator()); });
          ta.join();
          tb.join();
        } else {
          {
            InProcess a(o, co, mo);
            local = run(*a.client, o, size, a.allocator());
          }
          Remote b(o, co, mo, size);
          remote = run(*b.client, o, size, b.allocator());
        }
        if (!o.json) {
          print("in-process", size, o, local);
          print("vfio-user", size, o, remote);
        }
        ratios.push_back(remote.ops_per_s / local.ops_per_s);
        local_ops += local.ops_per_s;
        remote_ops += remote.ops_per_s;
        local_total.latency.merge(local.latency);
        remote_total.latency.merge(remote.latency);
        local_total.errors += local.errors;
        remote_total.errors += remote.errors;
      }
      std::sort(ratios.begin(), ratios.end());
      const double ratio = ratios[ratios.size() / 2];
      const double n = static_cast<double>(ratios.size());
      if (o.json) {
        std::printf(
            "{\"mode\":\"%s\",\"value_size\":%u,\"qd\":%u,\"threads\":%u,\"reactors\":%u,"
            "\"rounds\":%zu,"
            "\"in_process_ops_per_s\":%.0f,\"vfio_user_ops_per_s\":%.0f,"
            "\"in_process_gb_per_s\":%.4f,\"vfio_user_gb_per_s\":%.4f,"
            "\"in_process_p50_us\":%.2f,\"vfio_user_p50_us\":%.2f,\"median_ratio\":%.3f,"
            "\"min_ratio\":%.3f,\"max_ratio\":%.3f,\"errors\":%llu}\n",
            o.concurrent ? "concurrent" : "alternating", size, o.qd, o.threads, o.reactors,
            ratios.size(), local_ops / n, remote_ops / n, local_ops / n * size / 1e9,
            remote_ops / n * size / 1e9, local_total.latency.percentile(0.5) / 1e3,
            remote_total.latency.percentile(0.5) / 1e3, ratio, ratios.front(), ratios.back(),
            static_cast<unsigned long long>(local_total.errors + remote_total.errors));
      } else {
        std::printf(
            "value %u B: mean %.0f ops/s in-process, %.0f ops/s vfio-user; "
            "median ratio vfio-user / in-process %.3f (min %.3f, max %.3f; target >= "
            "0.8)\n\n",
            size, local_ops / n, remote_ops / n, ratio, ratios.front(), ratios.back());
      }
      if (local_total.errors || remote_total.errors) return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vfio_user_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
