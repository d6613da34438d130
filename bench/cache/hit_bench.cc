// cache_hit_bench: the cost of the cache's hit path. 4 KiB Retrieves of values that are all
// cached, through Client and the controller, against the same Retrieves from the memory backend
// alone (the foundation's reference path: a map lookup and a view). Both runs in one process,
// alternating, so the ratio compares like with like.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gdkv/cache.h"
#include "gdkv/client.h"
#include "gdkv/commands.h"
#include "gdkv/histogram.h"

namespace {

struct Run {
  double ops_per_s = 0;
  double p50_us = 0, p99_us = 0;
};

std::vector<gdkv::Key> make_keys(uint32_t n) {
  std::vector<gdkv::Key> keys(n);
  for (uint32_t i = 0; i < n; ++i) {
    char name[17];
    std::snprintf(name, sizeof(name), "hit%012u", i);
    keys[i] = *gdkv::Key::from_string(name);
  }
  return keys;
}

// Queue depth `qd` from one thread for `seconds`; uniform random keys.
Run measure(gdkv::Client& c, const std::vector<gdkv::Key>& keys, uint32_t size, uint32_t qd,
            double seconds) {
  std::vector<std::vector<std::byte>> bufs(qd, std::vector<std::byte>(size));
  std::vector<uint16_t> cids(qd);
  std::vector<uint64_t> starts(qd);
  std::mt19937_64 rng(9);
  gdkv::Histogram h;
  using Clock = std::chrono::steady_clock;
  auto ns = [] {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
            .count());
  };
  auto issue = [&](uint32_t s) {
    const gdkv::Key& k = keys[rng() % keys.size()];
    starts[s] = ns();
    cids[s] = c.start(gdkv::cmd::retrieve(k.bytes, k.len, bufs[s].data(), size)).value();
  };
  for (uint32_t s = 0; s < qd; ++s) issue(s);
  const auto t0 = Clock::now();
  uint64_t done = 0, errors = 0;
  for (;;) {
    for (uint32_t s = 0; s < qd; ++s) {
      if (!c.poll(cids[s])) continue;
      if (!c.finish(cids[s]).ok()) ++errors;
      h.record(ns() - starts[s]);
      ++done;
      issue(s);
    }
    if ((done & 1023) == 0 && std::chrono::duration<double>(Clock::now() - t0).count() >= seconds) {
      break;
    }
  }
  const double el = std::chrono::duration<double>(Clock::now() - t0).count();
  for (uint32_t s = 0; s < qd; ++s) (void)c.wait(cids[s]);
  if (errors != 0)
    std::fprintf(stderr, "cache_hit_bench: %llu errors\n", (unsigned long long)errors);
  return Run{static_cast<double>(done) / el, h.percentile(0.5) / 1e3, h.percentile(0.99) / 1e3};
}

// The backend alone, no controller: ns per kGet, submitted and completed inline on this thread
// (both backends hand out a view, so this is the lookup and bookkeeping cost of a hit).
double backend_ns_per_get(gdkv::Backend& b, const std::vector<gdkv::Key>& keys, double seconds) {
  struct Op {
    gdkv::BackendOp op;
    bool done = false;
  } o;
  o.op.kind = gdkv::BackendOpKind::kGet;
  o.op.user = &o;
  o.op.done = [](gdkv::BackendOp* op, gdkv::nvme::Status, uint64_t) {
    static_cast<Op*>(op->user)->done = true;
  };
  std::mt19937_64 rng(5);
  uint64_t n = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double el = 0;
  for (;;) {
    for (int i = 0; i < 1024; ++i, ++n) {
      o.op.key = keys[rng() % keys.size()];
      o.op.view = {};
      o.done = false;
      b.submit(&o.op);
      if (!o.done) return -1;  // not inline: not comparable
    }
    el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (el >= seconds) break;
  }
  return el * 1e9 / static_cast<double>(n);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cache_hit_bench: 4 KiB Retrieve hits through the cache vs the memory backend"};
  uint32_t size = 4096, keys_n = 16384, rounds = 3;
  std::vector<uint32_t> qds{1, 32};
  double seconds = 1.0;
  std::string policy = gdkv::CacheOptions{}.policy;
  app.add_option("--value-size", size, "bytes per value (4096)");
  app.add_option("--keys", keys_n, "distinct keys, all cached (16384)");
  app.add_option("--qd", qds, "queue depths (1 32)");
  app.add_option("--seconds", seconds, "seconds per measurement (1)");
  app.add_option("--rounds", rounds, "alternating rounds per configuration; the best counts (3)");
  app.add_option("--policy", policy, "cache policy (the default, " + policy + ")");
  uint32_t depth = gdkv::CacheOptions{}.prefetch_depth;
  app.add_option("--prefetch-depth", depth, "chain prefetch depth (the default, 8)");
  uint64_t gets = 0;
  std::string only = "cache";
  app.add_option("--gets", gets,
                 "only run this many backend-level gets on --only, untimed (for callgrind: "
                 "instructions per get = difference of two runs / difference of --gets)");
  app.add_option("--only", only, "with --gets: memory or cache (cache)")
      ->check(CLI::IsMember({"memory", "cache"}));
  CLI11_PARSE(app, argc, argv);

  const auto keys = make_keys(keys_n);
  std::vector<std::byte> value(size, std::byte{0x42});
  if (gets != 0) {
    gdkv::CacheOptions co;
    co.policy = policy;
    co.prefetch_depth = depth;
    co.capacity_bytes = uint64_t{keys_n} * size * 2;
    std::shared_ptr<gdkv::Backend> b = gdkv::make_memory_backend();
    if (only == "cache") b = gdkv::make_cached_backend(b, co).value();
    struct Op {
      gdkv::BackendOp op;
      bool done = false;
    } o;
    o.op.user = &o;
    o.op.done = [](gdkv::BackendOp* op, gdkv::nvme::Status, uint64_t) {
      static_cast<Op*>(op->user)->done = true;
    };
    o.op.kind = gdkv::BackendOpKind::kPut;
    o.op.value = value;
    for (const auto& k : keys) {
      o.op.key = k;
      b->submit(&o.op);
    }
    o.op.kind = gdkv::BackendOpKind::kGet;
    o.op.value = {};
    std::mt19937_64 rng(5);
    for (uint64_t i = 0; i < gets; ++i) {
      o.op.key = keys[rng() % keys.size()];
      o.op.view = {};
      b->submit(&o.op);
    }
    return 0;
  }
  auto plain = gdkv::Client::open(gdkv::make_memory_backend()).value();
  gdkv::CacheOptions co;
  co.policy = policy;
  co.prefetch_depth = depth;
  co.capacity_bytes = uint64_t{keys_n} * size * 2;
  auto cache = gdkv::make_cached_backend(gdkv::make_memory_backend(), co).value();
  auto cached = gdkv::Client::open(cache).value();
  for (const auto& k : keys) {
    if (!plain->put(k, value).ok() || !cached->put(k, value).ok()) {
      std::fprintf(stderr, "cache_hit_bench: populating failed\n");
      return 1;
    }
  }
  std::printf(
      "%u-byte Retrieves of %u keys, all cached (policy %s, prefetch depth %u); best of %u "
      "x %.1f s\n",
      size, keys_n, policy.c_str(), depth, rounds, seconds);
  {
    auto mem = gdkv::make_memory_backend();
    auto c2 = gdkv::make_cached_backend(mem, co).value();
    for (const auto& k : keys) {
      struct W {
        gdkv::BackendOp op;
        bool done = false;
      } w;
      w.op.kind = gdkv::BackendOpKind::kPut;
      w.op.key = k;
      w.op.value = value;
      w.op.user = &w;
      w.op.done = [](gdkv::BackendOp* op, gdkv::nvme::Status, uint64_t) {
        static_cast<W*>(op->user)->done = true;
      };
      c2->submit(&w.op);
    }
    double best_mem = 1e18, best_cache = 1e18;
    for (uint32_t r = 0; r < rounds; ++r) {
      best_mem = std::min(best_mem, backend_ns_per_get(*mem, keys, seconds / 2));
      best_cache = std::min(best_cache, backend_ns_per_get(*c2, keys, seconds / 2));
    }
    std::printf("backend alone (no controller), ns per get: memory %.0f, cache hit %.0f (%.2fx)\n",
                best_mem, best_cache, best_cache / best_mem);
  }
  std::printf("%4s | %-30s | %-30s | %s\n", "qd", "memory backend: ops/s p50 p99",
              "cache hit: ops/s p50 p99", "cache/memory ops/s");
  for (uint32_t qd : qds) {
    Run best_plain, best_cached;
    for (uint32_t r = 0; r < rounds; ++r) {
      const Run a = measure(*plain, keys, size, qd, seconds);
      const Run b = measure(*cached, keys, size, qd, seconds);
      if (a.ops_per_s > best_plain.ops_per_s) best_plain = a;
      if (b.ops_per_s > best_cached.ops_per_s) best_cached = b;
    }
    std::printf("%4u | %10.0f %7.2fus %7.2fus | %10.0f %7.2fus %7.2fus | %.3f\n", qd,
                best_plain.ops_per_s, best_plain.p50_us, best_plain.p99_us, best_cached.ops_per_s,
                best_cached.p50_us, best_cached.p99_us,
                best_cached.ops_per_s / best_plain.ops_per_s);
  }
  gdkv::MetricList ms;
  cache->collect(ms);
  for (const auto& m : ms) {
    if (m.name == "cache_hit_ratio") std::printf("cache hit ratio %.4f\n", m.value);
  }
  return 0;
}
