// cache_trace_bench: the eviction policies on synthetic KV-cache traces (kv_trace.h), side by side
// in one run, at cache sizes from 1% to 20% of the trace's unique blocks, with Belady's optimal
// (OPT/MIN, which knows the future) as the ceiling.
//
// Prefix-hit ratio: a request reuses only its leading run of cached blocks (the first miss ends
// the reusable prefix: the rest is recomputed and stored again). Block-hit ratio: every cached
// block counts. Throughput: trace references per second through the policy (lookups included).
// Every block is one unit of size; OPT is exact for unit sizes.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "bench/cache/kv_trace.h"
#include "cache/policy.h"

namespace {

using gdkv::bench::Trace;
using gdkv::bench::TraceOptions;
using gdkv::cache::AddKind;
using gdkv::cache::CacheKey;

struct Result {
  double prefix_hit = 0;
  double block_hit = 0;
  double refs_per_s = 0;
};

uint64_t id_of(const CacheKey& k) {
  uint64_t id;
  std::memcpy(&id, k.key.bytes, sizeof(id));
  return id;
}

Result simulate(const std::string& policy_name, const Trace& t, uint64_t capacity) {
  gdkv::cache::PolicyOptions po;
  po.capacity_bytes = capacity;
  po.expected_entries = capacity;
  auto policy = gdkv::cache::make_policy(policy_name, po);
  std::vector<uint8_t> resident(t.unique_blocks, 0);
  uint64_t count = 0, prefix_hits = 0, block_hits = 0, now = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t r = 0; r + 1 < t.starts.size(); ++r) {
    bool in_prefix = true;
    for (uint64_t i = t.starts[r]; i < t.starts[r + 1]; ++i) {
      const uint64_t b = t.refs[i];
      const CacheKey key = gdkv::cache::numbered_key(b);
      ++now;
      if (resident[b]) {
        ++block_hits;
        if (in_prefix) ++prefix_hits;
        policy->record_access(key, 1, now);
        continue;
      }
      in_prefix = false;
      policy->prepare_insert(key, 1, AddKind::kDemand);
      while (count >= capacity) {
        CacheKey victim;
        if (!policy->evict(&victim)) break;
        resident[id_of(victim)] = 0;
        --count;
      }
      policy->add(key, 1, now, AddKind::kDemand);
      resident[b] = 1;
      ++count;
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double n = static_cast<double>(t.refs.size());
  return Result{static_cast<double>(prefix_hits) / n, static_cast<double>(block_hits) / n,
                n / secs};
}

// Belady's MIN: on a miss with the cache full, drop whichever of the cached blocks and the new
// one is next used furthest in the future (the new one is then simply not cached).
Result simulate_opt(const Trace& t, uint64_t capacity) {
  constexpr uint64_t kNever = UINT64_MAX;
  std::vector<uint64_t> next(t.refs.size());
  {
    std::vector<uint64_t> seen(t.unique_blocks, kNever);
    for (uint64_t i = t.refs.size(); i-- > 0;) {
      next[i] = seen[t.refs[i]];
      seen[t.refs[i]] = i;
    }
  }
  std::vector<uint64_t> cur(t.unique_blocks, kNever);
  std::vector<uint8_t> resident(t.unique_blocks, 0);
  std::set<std::pair<uint64_t, uint64_t>> by_next;  // (next use, block)
  uint64_t prefix_hits = 0, block_hits = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t r = 0; r + 1 < t.starts.size(); ++r) {
    bool in_prefix = true;
    for (uint64_t i = t.starts[r]; i < t.starts[r + 1]; ++i) {
      const uint64_t b = t.refs[i];
      if (resident[b]) {
        ++block_hits;
        if (in_prefix) ++prefix_hits;
        by_next.erase({cur[b], b});
      } else {
        in_prefix = false;
        if (by_next.size() >= capacity) {
          auto far = std::prev(by_next.end());
          if (far->first <= next[i]) continue;  // the new block is needed last: don't cache it
          resident[far->second] = 0;
          by_next.erase(far);
        }
        resident[b] = 1;
      }
      cur[b] = next[i];
      by_next.insert({cur[b], b});
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double n = static_cast<double>(t.refs.size());
  return Result{static_cast<double>(prefix_hits) / n, static_cast<double>(block_hits) / n,
                n / secs};
}

TraceOptions mix(const std::string& name, uint64_t requests, uint64_t seed) {
  TraceOptions o;
  o.requests = requests;
  o.seed = seed;
  if (name == "chat") {  // mostly long conversations
    o.p_chat = 0.8;
    o.p_scan = 0.02;
    o.active_chats = 400;
  } else if (name == "scan") {  // heavy batch traffic between interactive requests
    o.p_chat = 0.35;
    o.p_scan = 0.12;
  } else if (name == "shared") {  // one-shot requests on popular system prompts
    o.p_chat = 0.15;
    o.p_scan = 0.03;
    o.zipf = 1.1;
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cache_trace_bench: eviction policies on synthetic KV-cache traces"};
  uint64_t requests = 40000, seed = 1;
  std::vector<std::string> mixes{"default", "chat", "scan", "shared"};
  std::vector<double> sizes{1, 2, 5, 10, 15, 20};
  app.add_option("--requests", requests, "requests per trace (40000)");
  app.add_option("--seed", seed, "trace seed (1)");
  app.add_option("--mix", mixes, "trace mixes: default chat scan shared (all)");
  app.add_option("--sizes", sizes, "cache sizes in % of the unique blocks (1 2 5 10 15 20)");
  uint32_t repeat = 1;
  app.add_option("--repeat", repeat, "runs per policy and size; the fastest counts (1)");
  CLI11_PARSE(app, argc, argv);

  const std::vector<std::string> policies{"adaptive", "lru-k", "lru", "arc"};
  double worst_gap = -1;
  std::string worst_at;
  int points = 0, better_than_both = 0;
  for (const std::string& m : mixes) {
    const Trace t = make_trace(mix(m, requests, seed));
    std::printf("\ntrace '%s': %llu requests, %zu block references, %llu unique blocks\n",
                m.c_str(), static_cast<unsigned long long>(t.requests()), t.refs.size(),
                static_cast<unsigned long long>(t.unique_blocks));
    std::printf("%6s %8s | %-39s | %-39s | %s\n", "size", "blocks",
                "prefix-hit %: OPT adapt. lru-2 lru arc", "block-hit %: OPT adapt. lru-2 lru arc",
                "M refs/s: adapt. lru-2 lru arc");
    for (double pct : sizes) {
      const uint64_t cap = std::max<uint64_t>(
          1, static_cast<uint64_t>(pct / 100.0 * static_cast<double>(t.unique_blocks)));
      const Result opt = simulate_opt(t, cap);
      std::vector<Result> rs;
      for (const auto& p : policies) {
        Result best = simulate(p, t, cap);
        for (uint32_t i = 1; i < repeat; ++i) {
          best.refs_per_s = std::max(best.refs_per_s, simulate(p, t, cap).refs_per_s);
        }
        rs.push_back(best);
      }
      std::printf(
          "%5.1f%% %8llu | %6.2f %6.2f %6.2f %6.2f %6.2f | %6.2f %6.2f %6.2f %6.2f %6.2f |"
          " %5.2f %5.2f %5.2f %5.2f\n",
          pct, static_cast<unsigned long long>(cap), 100 * opt.prefix_hit, 100 * rs[0].prefix_hit,
          100 * rs[1].prefix_hit, 100 * rs[2].prefix_hit, 100 * rs[3].prefix_hit,
          100 * opt.block_hit, 100 * rs[0].block_hit, 100 * rs[1].block_hit, 100 * rs[2].block_hit,
          100 * rs[3].block_hit, rs[0].refs_per_s / 1e6, rs[1].refs_per_s / 1e6,
          rs[2].refs_per_s / 1e6, rs[3].refs_per_s / 1e6);
      const double best = std::max(rs[1].prefix_hit, rs[2].prefix_hit);
      const double gap = best - rs[0].prefix_hit;
      ++points;
      if (gap < 0) ++better_than_both;
      if (gap > worst_gap) {
        worst_gap = gap;
        char at[64];
        std::snprintf(at, sizeof(at), "'%s' at %.1f%%", m.c_str(), pct);
        worst_at = at;
      }
    }
  }
  std::printf(
      "\nadaptive vs the better of lru-2 and lru (prefix-hit %%): better than both at %d of "
      "%d points; ",
      better_than_both, points);
  if (worst_gap <= 0) {
    std::printf("never worse\n");
  } else {
    std::printf("largest shortfall %.2f points (%s)\n", 100 * worst_gap, worst_at.c_str());
  }
  return 0;
}
