// gdkvd: the gdkv controller as a vfio-user NVMe-KV device, one per node.
//
// Opens the backend (memory, the local store, or RADOS shared by every node), puts the host cache
// in front of it, runs the controller's reactors, serves vfio-user on <socket_dir>/cntrl and
// Prometheus text on /metrics. SIGTERM or SIGINT: stop accepting clients, finish every command in
// flight (completions are posted), flush the backend, remove the socket, exit 0.
//
// Exit codes: 0 clean shutdown, 2 configuration error, 3 startup failure (message on stderr).
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "config.h"
#include "gdkv/backend_factory.h"
#include "gdkv/cache.h"
#include "gdkv/controller.h"
#include "gdkv/metrics_server.h"
#include "gdkv/vfio_user.h"

#ifdef GDKVD_WITH_CUDA
#include "cuda_importer.h"
#include "gdkv/gpu_runtime.h"
#endif

namespace {

void log(const std::string& line) { std::fprintf(stderr, "gdkvd: %s\n", line.c_str()); }

// TEST HOOK, for the soak's leak test only (python/tests/test_soak.py): with
// GDKVD_TEST_LEAK_BYTES_PER_S=N in its environment gdkvd allocates and writes N bytes a second on
// a thread of its own and never frees them, a leak of known size for the soak's verdict to catch.
// Not a setting (no flag, no TOML key): unset, nothing starts. False when N is not a number.
bool start_test_leak() {
  const char* e = std::getenv("GDKVD_TEST_LEAK_BYTES_PER_S");
  if (e == nullptr || *e == '\0') return true;
  unsigned long long rate = 0;
  const char* end = e + std::strlen(e);
  const auto [last, ec] = std::from_chars(e, end, rate);
  if (ec != std::errc{} || last != end) return false;
  log("TEST HOOK: leaking " + std::to_string(rate) +
      " bytes a second (GDKVD_TEST_LEAK_BYTES_PER_S)");
  std::thread([rate] {
    std::vector<std::unique_ptr<char[]>> leaked;
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const size_t n = rate / 10;
      leaked.emplace_back(new char[n]);
      std::memset(leaked.back().get(), 0xa5, n);  // written, so resident
    }
  }).detach();
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  gdkvd::Config cfg;
  std::string error;
  const int rc = gdkvd::load(argc, argv, cfg, &error);
  if (rc == 1) return 0;
  if (rc == 2) {
    std::fprintf(stderr, "gdkvd: %s\n", error.c_str());
    return 2;
  }
  if (cfg.check_only) {
    std::fputs(gdkvd::to_toml(cfg).c_str(), stdout);
    return 0;
  }

  // Termination signals are taken by the main thread only (sigwait below): block them before
  // any thread starts, so every thread inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a client that vanishes mid-reply is handled by the send's error
  // Each client holds descriptors (socket, memory fds, eventfds): take the hard limit.
  rlimit nofile{};
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    setrlimit(RLIMIT_NOFILE, &nofile);
  }
  if (!start_test_leak()) {  // after the signal mask: its thread must not take SIGTERM
    std::fprintf(stderr, "gdkvd: GDKVD_TEST_LEAK_BYTES_PER_S: not a number of bytes\n");
    return 2;
  }

  try {
    gdkv::RemovalLog removals;  // outlives the backend, which reports to it
    // Failures to open are reported by main's handler (exit 3): value() throws them there.
    std::shared_ptr<gdkv::Backend> backend = gdkv::open_store(cfg.store).value();
    // The keys the store stops holding, for /removed (subscribers: the connectors' KV events).
    // On the outermost backend: the host cache registers on the store and passes them on.
    backend->set_removal_handler(
        [&removals](uint32_t nsid, const gdkv::Key& key) { removals.add(nsid, key); });
    gdkv::ControllerOptions co = cfg.store.controller;
    co.measure_dma_peak = [](gdkv::CopyEngine& e) { return gdkv::measure_copy_peak_bps(e); };
    co.namespaces = 1;
    for (const auto& ns : cfg.daemon.server.namespaces)
      co.namespaces = std::max(co.namespaces, ns.backend_namespace);

    gdkv::VfioUserServerOptions so = cfg.daemon.server;
    so.log = log;
    // Log page C0h: each tenant reads its own namespaces' removals over its connection.
    so.removals = [&removals](uint32_t nsid, std::optional<uint64_t> after, size_t max) {
      gdkv::RemovalLog::Slice s = removals.slice(after, max, nsid);
      gdkv::RemovedKeys out{s.boot, s.last, s.first, s.next, s.lost, s.more, {}};
      out.records.reserve(s.records.size());
      for (const auto& r : s.records) out.records.push_back({r.seq, r.key});
      return out;
    };
#ifdef GDKVD_WITH_CUDA
    std::unique_ptr<gdkv::DeviceMemoryImporter> importer;
    if (cfg.daemon.gpu && gdkv::gpu::device_count() > 0) {
      co = gdkv::gpu::controller_options(co);
      importer = gdkvd::make_cuda_importer();
      so.device_memory = importer.get();
      log("GPU: " + gdkv::gpu::device_description(0) + " (CUDA copy engines, device memory)");
    }
#endif

    gdkv::Controller ctl(backend, co);
    gdkv::VfioUserServer server(ctl, so);
    server.start().value();
    std::unique_ptr<gdkv::MetricsServer> metrics;
    if (cfg.daemon.metrics_port >= 0) {
      metrics = gdkv::MetricsServer::start(
                    static_cast<uint16_t>(cfg.daemon.metrics_port),
                    [&ctl, &server] {
                      gdkv::MetricList m;
                      ctl.collect(m);
                      server.collect(m);
                      return m;
                    },
                    cfg.daemon.metrics_bind, &removals)
                    .value();
      log("metrics on http://" + cfg.daemon.metrics_bind + ":" + std::to_string(metrics->port()) +
          "/metrics, every namespace's removed keys at /removed");
    }
    log("ready: backend " + cfg.store.backend.kind + ", " + std::to_string(co.reactors) +
        " reactors, cache " + std::to_string(cfg.store.cache.capacity_bytes) + " bytes, socket " +
        server.socket_path());

    int sig = 0;
    sigwait(&stop_signals, &sig);
    log(std::string("received ") + (sig == SIGINT ? "SIGINT" : "SIGTERM") +
        ": finishing in-flight commands");
    metrics.reset();
    server.stop();  // every client's commands complete; sockets close; the socket file goes
    ctl.stop();     // reactors stop; the backend drains (acknowledged writes are durable)
    backend->set_removal_handler(nullptr);
    log("stopped cleanly");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gdkvd: %s\n", e.what());
    return 3;
  }
}
