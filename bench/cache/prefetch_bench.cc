// cache_prefetch_bench: prompt chains read block by block from a slow backend, with prefetch off,
// with chain prediction at several depths, and with explicit hints (the prefetch vendor opcode),
// all in one run against the same stored data. The speed-up is the time of the "off" run over
// each other's.
//
// Each configuration gets a fresh cache, much smaller than the data: one pass over the chains
// (which teaches chain prediction the block order), then the timed pass in the same order, by
// which time the first chains are long evicted. Readers run on their own queues (streams).
//
//   cache_prefetch_bench                                   memory backend, 500 us per op
//   cache_prefetch_bench --backend rados --ceph-conf /tmp/gdkv-ceph/ceph.conf
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gdkv/backend_factory.h"
#include "gdkv/cache.h"
#include "gdkv/client.h"

namespace {

using gdkv::Key;

struct Mode {
  std::string name;
  uint32_t depth = 0;
  bool hint = false;
};

struct Result {
  double seconds = 0;
  double hits = 0, issued = 0, used = 0, wasted = 0, errors = 0;
};

double metric(const gdkv::Backend& b, const std::string& name) {
  gdkv::MetricList ms;
  b.collect(ms);
  double v = 0;
  for (const auto& m : ms) {
    if (m.name == name) v += m.value;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cache_prefetch_bench: chain reads from a slow backend, prefetch on and off"};
  std::string backend = "memory", ceph_conf = "/tmp/gdkv-ceph/ceph.conf", pool = "gdkv-rep3";
  uint32_t delay_us = 500, chains = 24, blocks = 32, value_size = 16384, readers = 1;
  std::vector<uint32_t> depths{2, 4, 8};
  app.add_option("--backend", backend, "memory (with --delay-us) or rados")
      ->check(CLI::IsMember({"memory", "rados"}));
  app.add_option("--delay-us", delay_us, "memory backend: microseconds per op (500)");
  app.add_option("--ceph-conf", ceph_conf, "rados: ceph.conf (/tmp/gdkv-ceph/ceph.conf)");
  app.add_option("--pool", pool, "rados: pool (gdkv-rep3)");
  app.add_option("--chains", chains, "prompt chains (24)");
  app.add_option("--blocks", blocks, "blocks per chain (32)");
  app.add_option("--value-size", value_size, "bytes per block (16384)");
  app.add_option("--readers", readers, "concurrent readers, one queue each (1)");
  app.add_option("--depths", depths, "chain prediction depths to run (2 4 8)");
  CLI11_PARSE(app, argc, argv);
  if (readers == 0 || chains < readers || blocks == 0) {
    std::fprintf(stderr,
                 "cache_prefetch_bench: need readers >= 1, chains >= readers, blocks >= 1\n");
    return 2;
  }

  gdkv::BackendConfig bc;
  bc.kind = backend;
  bc.memory.delay_us = delay_us;
  bc.rados.ceph_conf = ceph_conf;
  bc.rados.pool = pool;
  bc.rados.namespace_prefix = "cache-bench-" + std::to_string(::getpid()) + "-";
  std::shared_ptr<gdkv::Backend> inner;
  try {
    inner = gdkv::open_backend(bc).value();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cache_prefetch_bench: %s\n", e.what());
    return 1;
  }

  // The chains' keys (as an inference engine derives them) and values.
  std::vector<std::vector<Key>> keys(chains);
  std::vector<uint32_t> tokens(16);
  std::mt19937 rng(42);
  for (uint32_t c = 0; c < chains; ++c) {
    std::vector<uint32_t> prompt(size_t{blocks} * 16);
    for (auto& t : prompt) t = rng() % 128000;
    keys[c] = gdkv::chain_keys(prompt, 16, "prefetch-bench");
  }
  std::vector<std::byte> value(value_size);
  for (auto& b : value) b = static_cast<std::byte>(rng());
  {
    auto writer = gdkv::Client::open(inner).value();
    for (const auto& chain : keys) {
      for (const Key& k : chain) {
        if (auto r = writer->put(k, value); !r.ok()) {
          std::fprintf(stderr, "cache_prefetch_bench: storing failed: %s\n",
                       gdkv::describe(r).c_str());
          return 1;
        }
      }
    }
  }
  const uint64_t data_bytes = uint64_t{chains} * blocks * value_size;

  std::vector<Mode> modes{{"off", 0, false}};
  for (uint32_t d : depths) modes.push_back({"chain depth " + std::to_string(d), d, false});
  modes.push_back({"hint (81h)", 0, true});

  std::printf("backend %s", backend.c_str());
  if (backend == "memory") std::printf(" (%u us per op)", delay_us);
  std::printf("; %u chains x %u blocks x %u B = %.1f MiB; cache %.1f MiB; %u reader(s)\n", chains,
              blocks, value_size, data_bytes / 1048576.0, data_bytes / 8 / 1048576.0, readers);
  std::printf("%-15s %10s %10s %9s %8s %8s %8s %8s\n", "mode", "blocks/s", "us/block", "speed-up",
              "hits", "issued", "used", "wasted");
  double base = 0;
  for (const Mode& m : modes) {
    gdkv::CacheOptions co;
    co.capacity_bytes = data_bytes / 8;
    co.prefetch_depth = m.depth;
    auto cache = gdkv::make_cached_backend(inner, co).value();
    gdkv::Controller ctl(cache);
    std::vector<std::unique_ptr<gdkv::Client>> clients;
    for (uint32_t r = 0; r < readers; ++r) {
      clients.push_back(std::make_unique<gdkv::Client>(ctl.create_queue().value(), nullptr, &ctl));
    }
    std::atomic<uint64_t> errors{0};
    auto pass = [&](bool timed) {
      std::vector<std::thread> ts;
      for (uint32_t r = 0; r < readers; ++r) {
        ts.emplace_back([&, r] {
          std::vector<std::byte> buf(value_size);
          for (uint32_t c = r; c < chains; c += readers) {
            if (timed && m.hint) {
              if (!clients[r]->prefetch(keys[c]).ok()) errors.fetch_add(1);
            }
            for (const Key& k : keys[c]) {
              auto res = clients[r]->get(k, std::span(buf));
              if (!res.ok() || res.dw0 != value_size) errors.fetch_add(1);
            }
          }
        });
      }
      for (auto& t : ts) t.join();
    };
    pass(false);
    cache->drain();
    const double hits0 = metric(*cache, "cache_hits_total");
    const double issued0 = metric(*cache, "cache_prefetch_issued_total");
    const double used0 = metric(*cache, "cache_prefetch_used_total");
    const double wasted0 = metric(*cache, "cache_prefetch_wasted_total");
    const auto t0 = std::chrono::steady_clock::now();
    pass(true);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    cache->drain();
    const double n = static_cast<double>(chains) * blocks;
    if (m.name == "off") base = secs;
    std::printf("%-15s %10.0f %10.1f %8.2fx %8.0f %8.0f %8.0f %8.0f%s\n", m.name.c_str(), n / secs,
                secs / n * 1e6, base / secs, metric(*cache, "cache_hits_total") - hits0,
                metric(*cache, "cache_prefetch_issued_total") - issued0,
                metric(*cache, "cache_prefetch_used_total") - used0,
                metric(*cache, "cache_prefetch_wasted_total") - wasted0,
                errors.load() ? "  ERRORS" : "");
    clients.clear();
  }

  // Leave nothing behind in a shared cluster.
  auto cleaner = gdkv::Client::open(inner).value();
  for (const auto& chain : keys) {
    for (const Key& k : chain) (void)cleaner->del(k);
  }
  return 0;
}
