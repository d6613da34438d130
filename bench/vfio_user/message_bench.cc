// Data in memory a vfio-user host mapped without an fd (moved by DMA_READ/DMA_WRITE messages)
// against the same commands with their data in the shared memfd.
//
// One standard NVMe host on a bare vfio-user connection (RawHost: ring doorbells, one I/O queue
// pair, waiting for completions on its MSI-X eventfd unless --spin), a VfioUserServer on the memory
// backend (gdkvd's code). Each round keeps
// --qd Retrieves (or Stores, --store) of --size bytes in flight for --duration seconds, once with
// the buffers in the shared memfd and once in message-only memory, alternating; the ratio printed
// is the median of the per-round ratios message / memfd, so drifting load on a shared machine
// cancels out.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/commands.h"
#include "gdkv/vfio_user.h"
#include "raw_host.h"

namespace {

using Clock = std::chrono::steady_clock;
using gdkv::vfio_user::test::RawHost;

constexpr uint64_t kMsgIova = 0x100000000;

struct Options {
  std::vector<uint32_t> sizes = {4096, 1u << 20};
  uint32_t qd = 8;
  double duration = 1;
  uint32_t rounds = 3;
  bool store = false;
  bool spin = false;
};

// Ops per second of one run; 0 if a command failed.
double run(const Options& o, uint32_t size, bool message_only) {
  gdkv::ControllerOptions co;
  co.never_sleep = true;
  gdkv::Controller ctl(gdkv::make_memory_backend(), co);
  gdkv::vfio_user::test::TempDir dir("msgbench");
  gdkv::VfioUserServerOptions so;
  so.socket_dir = dir.path();
  so.log = [](const std::string&) {};
  gdkv::VfioUserServer server(ctl, so);
  server.start().value();
  double result = 0;
  {
    const uint64_t area = uint64_t{o.qd} * size;
    RawHost h(dir.path(), 0x4000 + area);
    bool failed = false;
    h.on_failure = [&failed](const std::string& what) {
      std::fprintf(stderr, "message_bench: %s\n", what.c_str());
      failed = true;
    };
    if (!h.start()) {
      std::fprintf(stderr, "message_bench: the raw host did not come up\n");
      return 0;
    }
    h.set_spin(o.spin);
    std::vector<std::byte> local(area);
    if (message_only && h.map_message_memory(kMsgIova, local.data(), local.size()) != 0) return 0;
    const uint64_t base = message_only ? kMsgIova : RawHost::kIova + 0x4000;
    std::vector<gdkv::Key> keys;
    for (uint32_t i = 0; i < o.qd; ++i) {
      keys.push_back(*gdkv::Key::from_string("mb" + std::to_string(i)));
    }
    auto command = [&](uint32_t i, bool store) {
      const gdkv::Key& k = keys[i];
      gdkv::nvme::Sqe s = store ? gdkv::cmd::store(k.bytes, k.len, nullptr, size)
                                : gdkv::cmd::retrieve(k.bytes, k.len, nullptr, size);
      s.flags = 0x40;  // SGL data block
      s.dptr.sgl = {base + uint64_t{i} * size, size, {}, 0};
      return s;
    };
    auto batch = [&](bool store) {
      std::vector<gdkv::nvme::Sqe> cmds;
      for (uint32_t i = 0; i < o.qd; ++i) cmds.push_back(command(i, store));
      const auto done = h.io_batch(cmds, 10000);
      bool ok = done.size() == cmds.size();
      for (const auto& c : done)
        ok &= gdkv::nvme::status_code(c.status) == gdkv::nvme::Status::kSuccess;
      return ok;
    };
    if (!batch(true)) return 0;  // the keys exist for Retrieves
    uint64_t ops = 0;
    const auto start = Clock::now();
    const auto end = start + std::chrono::duration<double>(o.duration);
    while (Clock::now() < end) {
      if (!batch(o.store)) return 0;
      ops += o.qd;
    }
    const double secs = std::chrono::duration<double>(Clock::now() - start).count();
    result = failed ? 0 : static_cast<double>(ops) / secs;
  }
  server.stop();
  ctl.stop();
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"DMA_READ/DMA_WRITE (memory without an fd) against shared memory, over vfio-user"};
  app.add_option("--sizes", o.sizes, "value sizes in bytes");
  app.add_option("--qd", o.qd, "commands in flight (1..15)")->check(CLI::Range(1, 15));
  app.add_option("--duration", o.duration, "seconds per run");
  app.add_option("--rounds", o.rounds, "rounds (each runs both)")->check(CLI::Range(1, 100));
  app.add_flag("--store", o.store, "Stores instead of Retrieves");
  app.add_flag("--spin", o.spin, "poll the CQ instead of waiting for its interrupt");
  CLI11_PARSE(app, argc, argv);
  const char* op = o.store ? "Store" : "Retrieve";
  for (uint32_t size : o.sizes) {
    std::vector<double> ratios;
    double fd_sum = 0, msg_sum = 0;
    for (uint32_t r = 0; r < o.rounds; ++r) {
      const double fd = run(o, size, false);
      const double msg = run(o, size, true);
      if (fd <= 0 || msg <= 0) {
        std::fprintf(stderr, "message_bench: a command failed (size %u)\n", size);
        return 1;
      }
      std::printf(
          "%-8s %8u B qd %2u  memfd %10.0f ops/s %8.3f GB/s  no-fd %10.0f ops/s %8.3f GB/s\n", op,
          size, o.qd, fd, fd * size / 1e9, msg, msg * size / 1e9);
      ratios.push_back(msg / fd);
      fd_sum += fd;
      msg_sum += msg;
    }
    std::sort(ratios.begin(), ratios.end());
    std::printf(
        "%s %u B: mean %.0f ops/s memfd, %.0f ops/s no-fd; median ratio no-fd / memfd %.3f (min "
        "%.3f, max %.3f)\n\n",
        op, size, fd_sum / o.rounds, msg_sum / o.rounds, ratios[ratios.size() / 2], ratios.front(),
        ratios.back());
  }
  return 0;
}
