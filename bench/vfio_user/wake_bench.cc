// Wake-ups and contention over vfio-user: the same calls with gdkvd's wake-ups
// (doorbell ioeventfd, completion interrupts) and without them (the behaviour before: the reactor
// notices a remote doorbell within its 5 ms sleep timeout, a waiting client yields in a loop).
//
//   idle:       one exists() after --idle-ms of quiet, --samples times: p50 and p99.
//   one core:   the whole process (reactor, server threads and client) pinned to one CPU,
//               back-to-back exists() for --duration seconds: p50 and p99.
//   contention: 4 KiB gets (batch 1) for --duration seconds quiet, then with one CPU hog per
//               online CPU (separate processes in their own sessions, as unrelated programs),
//               --rounds times: each round's ratio hogged / quiet.
//
// Each setup is a VfioUserServer on an in-process Controller over the memory backend (the code
// gdkvd runs, reactors allowed to sleep as gdkvd's default) reached through gdkv's client driver;
// the two modes alternate per measurement. Goals (printed with each figure): idle p50 <= 30 us and
// p99 <= 100 us, one-core p50 <= 20 us, contention ratio >= 0.3 in every round.
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/client.h"
#include "gdkv/vfio_user.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  uint32_t samples = 100;
  uint32_t idle_ms = 50;
  double duration = 1.0;
  uint32_t rounds = 5;
  int cpu = 0;
  uint32_t spin_us = 10;     // VfioUserClientOptions::wait_spin_us
  int hog_nice = 0;          // the hogs' nice value (contention)
  bool never_sleep = false;  // reactors spin (gdkvd --never-sleep): isolates the client's wake-up
  std::string only;          // "idle", "onecore", "contention" or empty for all
};

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())));
  return v[i];
}

// A server and one connected Client; `wakeups` selects the mode.
struct Setup {
  std::unique_ptr<gdkv::Controller> ctl;
  std::unique_ptr<gdkv::VfioUserServer> server;
  std::shared_ptr<gdkv::VfioUserDevice> dev;
  std::unique_ptr<gdkv::Client> client;
  std::string dir;
  std::byte* buf = nullptr;
  gdkv::Key key{};

  Setup(bool wakeups, const Options& o) {
    static int n = 0;
    dir = (std::filesystem::temp_directory_path() /
           ("gdkv-wake-" + std::to_string(::getpid()) + "-" + std::to_string(n++)))
              .string();
    gdkv::ControllerOptions co;
    co.reactors = 1;
    co.never_sleep = o.never_sleep;
    gdkv::MemoryBackendOptions mo;
    mo.capacity_bytes = uint64_t{256} << 20;
    ctl = std::make_unique<gdkv::Controller>(gdkv::make_memory_backend(mo), co);
    gdkv::VfioUserServerOptions so;
    so.socket_dir = dir;
    so.log = [](const std::string&) {};
    server = std::make_unique<gdkv::VfioUserServer>(*ctl, so);
    server->start().value();
    gdkv::VfioUserClientOptions vo;
    vo.wakeups = wakeups;
    vo.wait_spin_us = o.spin_us;
    vo.shared_memory_bytes = size_t{16} << 20;
    dev = gdkv::VfioUserDevice::open(dir, vo).value();
    client = dev->make_client().value();
    if (wakeups && !(dev->doorbell_wakeups() && dev->completion_wakeups())) {
      throw std::runtime_error("wake-ups were asked for but not set up");
    }
    buf = static_cast<std::byte*>(dev->alloc(4096, 4096));
    std::memset(buf, 7, 4096);
    const char k[] = "wake-bench";
    key = gdkv::Key::from_bytes(k, sizeof(k) - 1);
    if (!client->put(key, std::span<const std::byte>(buf, 4096)).ok()) {
      throw std::runtime_error("put failed");
    }
  }
  ~Setup() {
    dev->free(buf);
    client.reset();
    dev.reset();
    server->stop();
    ctl->stop();
    std::filesystem::remove_all(dir);
  }
  double exists_us() {
    const auto t0 = Clock::now();
    if (!client->exists(key).ok()) throw std::runtime_error("exists failed");
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  }
  bool get() { return client->get(key, std::span<std::byte>(buf, 4096)).ok(); }
};

const char* mode_name(bool w) { return w ? "wake-ups" : "before  "; }

// The floor the machine sets: two threads' eventfd round trip (two wake-ups, as a call that finds
// the reactor asleep and then blocks for its completion needs) after the same quiet.
std::vector<double> eventfd_round_trips(const Options& o) {
  const int a = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK), b = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  std::thread t([&] {
    for (;;) {
      pollfd p{a, POLLIN, 0};
      (void)::poll(&p, 1, -1);
      uint64_t v;
      if (::read(a, &v, 8) != 8) continue;
      if (v > 1) return;
      v = 1;
      (void)!::write(b, &v, 8);
    }
  });
  std::vector<double> lat;
  for (uint32_t i = 0; i < o.samples; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(o.idle_ms));
    const auto t0 = Clock::now();
    uint64_t v = 1;
    (void)!::write(a, &v, 8);
    pollfd p{b, POLLIN, 0};
    (void)::poll(&p, 1, -1);
    (void)!::read(b, &v, 8);
    lat.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  uint64_t stop = 2;
  (void)!::write(a, &stop, 8);
  t.join();
  ::close(a);
  ::close(b);
  return lat;
}

// The other floor: one wake-up of a thread pinned to another CPU that has been idle as long
// (the waker spins for its answer). An idle call whose reactor the scheduler wakes on another
// core pays this before any work; on a VM whose idle vCPUs halt it is a hypervisor round trip.
std::vector<double> cross_core_wakes(const Options& o) {
  if (std::thread::hardware_concurrency() < 2) return {};
  const int a = eventfd(0, EFD_CLOEXEC);
  std::atomic<int> answered{0};
  auto pin = [](int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    return pthread_setaffinity_np(pthread_self(), sizeof(s), &s) == 0;
  };
  std::thread t([&] {
    (void)pin(1);
    for (;;) {
      uint64_t v;
      if (::read(a, &v, 8) != 8) continue;
      if (v > 1) return;
      answered.store(1, std::memory_order_release);
    }
  });
  cpu_set_t old;
  CPU_ZERO(&old);
  sched_getaffinity(0, sizeof(old), &old);
  std::vector<double> lat;
  if (pin(0)) {
    for (uint32_t i = 0; i < o.samples; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(o.idle_ms));
      const auto t0 = Clock::now();
      uint64_t v = 1;
      (void)!::write(a, &v, 8);
      while (answered.load(std::memory_order_acquire) == 0) {
      }
      answered.store(0, std::memory_order_relaxed);
      lat.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  }
  sched_setaffinity(0, sizeof(old), &old);
  uint64_t stop = 2;
  (void)!::write(a, &stop, 8);
  t.join();
  ::close(a);
  return lat;
}

void idle(const Options& o) {
  std::printf("== idle: exists() after %u ms quiet, %u samples\n", o.idle_ms, o.samples);
  const std::vector<double> floor = eventfd_round_trips(o);
  const std::vector<double> cross = cross_core_wakes(o);
  std::vector<double> lat[2];
  for (int m = 0; m < 2; ++m) {
    Setup s(m == 1, o);
    for (uint32_t i = 0; i < o.samples; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(o.idle_ms));
      lat[m].push_back(s.exists_us());
    }
  }
  for (int m = 0; m < 2; ++m) {
    std::printf("  %s p50 %8.1f us  p99 %8.1f us\n", mode_name(m == 1), pct(lat[m], 0.5),
                pct(lat[m], 0.99));
  }
  std::printf("  eventfd round trip (the machine's floor) p50 %8.1f us  p99 %8.1f us\n",
              pct(floor, 0.5), pct(floor, 0.99));
  if (!cross.empty()) {
    std::printf("  one wake-up of an idle other core       p50 %8.1f us  p99 %8.1f us\n",
                pct(cross, 0.5), pct(cross, 0.99));
  }
  const double p50 = pct(lat[1], 0.5), p99 = pct(lat[1], 0.99);
  std::printf("  goal p50 <= 30 us: %s, p99 <= 100 us: %s; p50 before/after %.0fx\n",
              p50 <= 30 ? "met" : "NOT met", p99 <= 100 ? "met" : "NOT met",
              pct(lat[0], 0.5) / p50);
}

void one_core(const Options& o) {
  std::printf("== one core: process pinned to CPU %d, back-to-back exists() for %.1f s\n", o.cpu,
              o.duration);
  cpu_set_t old;
  CPU_ZERO(&old);
  sched_getaffinity(0, sizeof(old), &old);
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(o.cpu, &one);
  // Threads inherit the affinity of the thread that creates them: pin before the setup exists.
  if (sched_setaffinity(0, sizeof(one), &one) != 0) throw std::runtime_error("sched_setaffinity");
  double p50[2], p99[2];
  size_t n[2];
  for (int m = 0; m < 2; ++m) {
    Setup s(m == 1, o);
    std::vector<double> lat;
    const auto end = Clock::now() + std::chrono::duration<double>(o.duration);
    while (Clock::now() < end) lat.push_back(s.exists_us());
    p50[m] = pct(lat, 0.5);
    p99[m] = pct(lat, 0.99);
    n[m] = lat.size();
  }
  sched_setaffinity(0, sizeof(old), &old);
  for (int m = 0; m < 2; ++m) {
    std::printf("  %s p50 %8.1f us  p99 %8.1f us  (%zu calls)\n", mode_name(m == 1), p50[m], p99[m],
                n[m]);
  }
  std::printf("  goal p50 <= 20 us: %s; p50 before/after %.0fx\n", p50[1] <= 20 ? "met" : "NOT met",
              p50[0] / p50[1]);
}

// One busy-looping process per online CPU, each in its own session, at nice `nice` (a positive
// value gives the bench's threads the larger share, as a higher CPUWeight for gdkvd would).
struct Hogs {
  std::vector<pid_t> pids;
  explicit Hogs(int nice) {
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    for (long i = 0; i < cpus; ++i) {
      const pid_t p = fork();
      if (p == 0) {
        setsid();
        if (nice != 0) {
          // With autogroups (each session its own group) the group's nice is what competes
          // with the bench's group; the process's own nice counts only within the group.
          (void)!setpriority(PRIO_PROCESS, 0, nice);
          if (FILE* f = std::fopen("/proc/self/autogroup", "w")) {
            std::fprintf(f, "%d", nice);
            std::fclose(f);
          }
        }
        volatile uint64_t x = 0;
        for (;;) x = x + 1;
      }
      if (p > 0) pids.push_back(p);
    }
  }
  ~Hogs() {
    for (pid_t p : pids) kill(p, SIGKILL);
    for (pid_t p : pids) waitpid(p, nullptr, 0);
  }
};

double gets_per_s(Setup& s, double seconds) {
  uint64_t n = 0;
  const auto t0 = Clock::now();
  const auto end = t0 + std::chrono::duration<double>(seconds);
  while (Clock::now() < end) {
    if (!s.get()) throw std::runtime_error("get failed");
    ++n;
  }
  return static_cast<double>(n) / std::chrono::duration<double>(Clock::now() - t0).count();
}

void contention(const Options& o) {
  std::printf("== contention: 4 KiB gets, quiet vs one CPU hog per CPU (%ld), %.1f s each\n",
              sysconf(_SC_NPROCESSORS_ONLN), o.duration);
  Setup s[2] = {Setup(false, o), Setup(true, o)};
  double worst[2] = {1e9, 1e9};
  for (uint32_t r = 0; r < o.rounds; ++r) {
    for (int m = 0; m < 2; ++m) {
      const double quiet = gets_per_s(s[m], o.duration);
      double hogged;
      {
        Hogs h(o.hog_nice);
        hogged = gets_per_s(s[m], o.duration);
      }
      const double ratio = hogged / quiet;
      worst[m] = std::min(worst[m], ratio);
      std::printf("  round %u %s quiet %9.0f/s  hogged %9.0f/s  ratio %.2f\n", r + 1,
                  mode_name(m == 1), quiet, hogged, ratio);
    }
  }
  for (int m = 0; m < 2; ++m) {
    std::printf("  %s worst ratio %.2f\n", mode_name(m == 1), worst[m]);
  }
  std::printf("  goal >= 0.3 in every round: %s\n", worst[1] >= 0.3 ? "met" : "NOT met");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"vfio-user wake-ups: idle latency, one shared core, CPU contention"};
  Options o;
  app.add_option("--samples", o.samples, "idle samples (100)");
  app.add_option("--idle-ms", o.idle_ms, "quiet before each idle sample, ms (50)");
  app.add_option("--duration", o.duration, "seconds per one-core / contention run (1)");
  app.add_option("--rounds", o.rounds, "contention rounds (5)");
  app.add_option("--cpu", o.cpu, "the CPU of the one-core run (0)");
  app.add_option("--spin-us", o.spin_us, "a waiting client spins this long, then blocks (10)");
  app.add_flag("--never-sleep", o.never_sleep, "reactors never sleep (as gdkvd --never-sleep)");
  app.add_option("--hog-nice", o.hog_nice, "nice value of the contention hogs (0)");
  app.add_option("--only", o.only, "idle | onecore | contention");
  CLI11_PARSE(app, argc, argv);
  try {
    if (o.only.empty() || o.only == "idle") idle(o);
    if (o.only.empty() || o.only == "onecore") one_core(o);
    if (o.only.empty() || o.only == "contention") contention(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "wake_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
