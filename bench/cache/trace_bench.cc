// cache_trace_bench: the eviction policies on KV-cache traces, side by side in one run, at cache
// sizes from 1% to 20% of the trace's unique blocks, with Belady's optimal (OPT/MIN, which knows
// the future) as the ceiling. The traces are synthetic (kv_trace.h, the default) or real ones in
// the Mooncake format (--trace FILE.jsonl, bench/cache/trace_file.h); --json prints the prefix-hit
// ratios as one JSON object per trace.
//
// Prefix-hit ratio: a request reuses only its leading run of cached blocks (the first miss ends
// the reusable prefix: the rest is recomputed and stored again); it is the sum over requests of
// that run's length over the sum of their lengths. Block-hit ratio: every cached block counts.
// A request's blocks are looked up and then referenced in chain order (a hit is an access, a miss
// an insert). Throughput: trace references per second through the policy (lookups included).
// Chains: like the cache, the replay learns which key followed which (cache/chain.h) and tells
// the policy (record_chain) when a key follows the key that followed its predecessor last time;
// the trace is one stream, so a request's first block is never taken for a chain successor
// unless the same two requests came in that order before.
// Every block is one unit of size; OPT is exact for unit sizes.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "bench/cache/kv_trace.h"
#include "bench/cache/trace_file.h"
#include "cache/chain.h"
#include "cache/policy.h"
#include "gdkv/cache.h"
#include "tests/numbered_key.h"

namespace {

using gdkv::NsKey;
using gdkv::bench::Trace;
using gdkv::bench::TraceOptions;
using gdkv::cache::AddKind;

struct Result {
  double prefix_hit = 0;
  double block_hit = 0;
  double refs_per_s = 0;
};

uint64_t id_of(const NsKey& k) {
  uint64_t id;
  std::memcpy(&id, k.key.bytes, sizeof(id));
  return id;
}

// Scheduler hints (--lookahead W): before request r is served, the blocks of requests
// r+1..r+W are hinted in order (HintedPolicy, policy.h), as an engine would for the requests
// waiting in its queue. Hints protect cached blocks. With `prefetch` the cache sits on a lower
// tier (a tiered node's local store) that holds every block stored before, as gdkv's does: the
// hinted blocks that were seen before and are not cached are then fetched into the cache ahead
// of their read (nearest request first), as CachedBackend::hint does, while blocks fetched and
// not yet read stay within the hint share of the capacity (the prefetch budget). The replay
// assumes a fetch lands before its request runs, i.e. a request waits in the queue longer than a
// read from the lower tier takes. Without `prefetch` a block cached nowhere is still a miss.
struct Hints {
  uint32_t lookahead = 0;  // W; 0: no hints
  double share = 0.5;      // HintOptions::max_share, and the prefetch budget
  bool prefetch = false;
};

// `admit` (optional, one flag per reference): a missed block is cached only where it is set.
Result simulate(const std::string& policy_name, const Trace& t, uint64_t capacity,
                uint64_t history_entries = 0, const std::vector<uint8_t>* admit = nullptr,
                Hints hints = {}) {
  gdkv::cache::PolicyOptions po;
  po.capacity_bytes = capacity;
  po.expected_entries = capacity;
  po.history_entries = history_entries;
  std::unique_ptr<gdkv::cache::EvictionPolicy> policy = gdkv::cache::make_policy(policy_name, po);
  gdkv::cache::HintedPolicy* hinted = nullptr;
  if (hints.lookahead > 0) {
    gdkv::cache::HintOptions ho;
    ho.capacity_bytes = capacity;
    ho.max_hints = uint64_t{1} << 22;
    ho.max_share = hints.share;
    auto h = gdkv::cache::make_hinted_policy(std::move(policy), ho);
    hinted = h.get();
    policy = std::move(h);
  }
  std::vector<uint8_t> resident(t.unique_blocks, 0);
  std::vector<uint8_t> seen;  // with prefetch: stored before (so the lower tier has it)
  if (hints.prefetch) seen.assign(t.unique_blocks, 0);
  std::vector<uint8_t> fetched(t.unique_blocks, 0);  // fetched ahead and not yet read
  const uint64_t budget = static_cast<uint64_t>(hints.share * static_cast<double>(capacity));
  uint64_t unread = 0;  // blocks fetched ahead and not yet read
  gdkv::cache::ChainTable chain(gdkv::CacheOptions{}.chain_entries);
  NsKey last;
  bool has_last = false;
  uint64_t count = 0, prefix_hits = 0, block_hits = 0, now = 0;
  // Evicts until one more block fits; false when the policy has nothing left to evict.
  auto make_room = [&] {
    while (count >= capacity) {
      NsKey victim;
      if (!policy->evict(&victim)) return false;
      const uint64_t v = id_of(victim);
      resident[v] = 0;
      unread -= fetched[v];
      fetched[v] = 0;
      --count;
    }
    return true;
  };
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t r = 0; r + 1 < t.starts.size(); ++r) {
    if (hinted != nullptr) {
      const uint64_t end = std::min<uint64_t>(t.starts.size() - 1, r + 1 + hints.lookahead);
      ++now;
      const uint64_t first = t.starts[r + 1 < end ? r + 1 : end];
      for (uint64_t i = first; i < t.starts[end]; ++i) {
        hinted->hint(gdkv::cache::numbered_key(t.refs[i]), resident[t.refs[i]] ? 1 : 0, now);
      }
      for (uint64_t i = first; hints.prefetch && i < t.starts[end] && unread < budget; ++i) {
        const uint64_t b = t.refs[i];
        if (resident[b] || !seen[b]) continue;
        const NsKey key = gdkv::cache::numbered_key(b);
        ++now;
        policy->prepare_insert(key, 1, AddKind::kPrefetch);
        if (!make_room()) break;
        policy->add(key, 1, now, AddKind::kPrefetch);
        resident[b] = 1;
        fetched[b] = 1;
        ++unread;
        ++count;
      }
    }
    bool in_prefix = true;
    for (uint64_t i = t.starts[r]; i < t.starts[r + 1]; ++i) {
      const uint64_t b = t.refs[i];
      const NsKey key = gdkv::cache::numbered_key(b);
      ++now;
      // What the cache's learn() does: was this transition seen before?
      bool followed = false;
      if (has_last && !(last == key)) {
        const NsKey* next = chain.next(last);
        followed = next != nullptr && *next == key;
        if (!followed) chain.record(last, key);
      }
      const NsKey pred = last;
      last = key;
      has_last = true;
      if (hints.prefetch) seen[b] = 1;
      unread -= fetched[b];
      fetched[b] = 0;
      if (resident[b]) {
        ++block_hits;
        if (in_prefix) ++prefix_hits;
        policy->record_access(key, 1, now);
        if (followed) policy->record_chain(key, pred);
        continue;
      }
      in_prefix = false;
      if (admit != nullptr && !(*admit)[i]) continue;
      policy->prepare_insert(key, 1, AddKind::kDemand);
      make_room();
      policy->add(key, 1, now, AddKind::kDemand);
      if (followed) policy->record_chain(key, pred);
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

// Two clairvoyant references between the online policies and OPT, which show how much of OPT's
// lead needs knowledge of the future. Each knows one thing about it:
// - "static": the trace's final reference counts; it caches exactly the `capacity` most referenced
//   blocks (a block is a hit from its second reference on), which no policy that learns counts as
//   it goes can beat on a trace whose popularity does not change;
// - "admit": LRU that caches a missed block only if the block is referenced again later (never
//   fills the cache with blocks seen once).
Result simulate_static(const Trace& t, uint64_t capacity) {
  std::vector<uint64_t> refs(t.unique_blocks, 0);
  for (uint64_t b : t.refs) ++refs[b];
  std::vector<uint64_t> order(t.unique_blocks);
  for (uint64_t b = 0; b < t.unique_blocks; ++b) order[b] = b;
  std::stable_sort(order.begin(), order.end(),
                   [&](uint64_t a, uint64_t b) { return refs[a] > refs[b]; });
  std::vector<uint8_t> kept(t.unique_blocks, 0), seen(t.unique_blocks, 0);
  for (uint64_t i = 0; i < std::min<uint64_t>(capacity, order.size()); ++i) kept[order[i]] = 1;
  uint64_t prefix_hits = 0, block_hits = 0;
  for (uint64_t r = 0; r + 1 < t.starts.size(); ++r) {
    bool in_prefix = true;
    for (uint64_t i = t.starts[r]; i < t.starts[r + 1]; ++i) {
      const uint64_t b = t.refs[i];
      if (kept[b] && seen[b]) {
        ++block_hits;
        if (in_prefix) ++prefix_hits;
      } else {
        in_prefix = false;
      }
      seen[b] = 1;
    }
  }
  const double n = static_cast<double>(t.refs.size());
  return Result{static_cast<double>(prefix_hits) / n, static_cast<double>(block_hits) / n, 0};
}

Result simulate_admit_oracle(const Trace& t, uint64_t capacity) {
  std::vector<uint8_t> again(t.refs.size(), 0);  // is refs[i] referenced again later?
  std::vector<uint8_t> later(t.unique_blocks, 0);
  for (uint64_t i = t.refs.size(); i-- > 0;) {
    again[i] = later[t.refs[i]];
    later[t.refs[i]] = 1;
  }
  return simulate("lru", t, capacity, 0, &again);
}

struct Named {
  std::string name;
  Trace trace;
  bool file = false;
};

Trace from_file(const std::string& path) {
  gdkv::cache::BlockTrace b = gdkv::cache::read_mooncake_trace(path);
  Trace t;
  t.refs = std::move(b.refs);
  t.starts = std::move(b.starts);
  t.unique_blocks = b.unique_blocks;
  return t;
}

uint64_t capacity_of(double pct, const Trace& t) {
  return std::max<uint64_t>(
      1, static_cast<uint64_t>(pct / 100.0 * static_cast<double>(t.unique_blocks)));
}

void print_list(const char* key, const std::vector<double>& v, const char* fmt) {
  std::printf("\"%s\":[", key);
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) std::printf(",");
    std::printf(fmt, v[i]);
  }
  std::printf("]");
}

// {"sizes":[...], "opt":[...], "default":[...], then every policy under its name}: prefix-hit
// ratios at each size (a share of 1).
// With --lookahead W also "static-oracle", "admit-oracle", "lookahead" (W) and every policy with
// hints as "<policy>+hints", and with hints and prefetch from a lower tier as
// "<policy>+hints+prefetch".
void json(const Trace& t, const std::vector<double>& sizes,
          const std::vector<std::string>& policies, const std::string& default_policy,
          Hints hints) {
  std::vector<double> opt, stat, admit;
  std::vector<std::vector<double>> by(policies.size()), with(policies.size()),
      fetch(policies.size());
  Hints prefetching = hints;
  prefetching.prefetch = true;
  for (double pct : sizes) {
    const uint64_t cap = capacity_of(pct, t);
    opt.push_back(simulate_opt(t, cap).prefix_hit);
    for (size_t p = 0; p < policies.size(); ++p) {
      by[p].push_back(simulate(policies[p], t, cap).prefix_hit);
      if (hints.lookahead > 0) {
        with[p].push_back(simulate(policies[p], t, cap, 0, nullptr, hints).prefix_hit);
        fetch[p].push_back(simulate(policies[p], t, cap, 0, nullptr, prefetching).prefix_hit);
      }
    }
    if (hints.lookahead > 0) {
      stat.push_back(simulate_static(t, cap).prefix_hit);
      admit.push_back(simulate_admit_oracle(t, cap).prefix_hit);
    }
  }
  std::printf("{");
  print_list("sizes", sizes, "%g");
  std::printf(", ");
  print_list("opt", opt, "%.6f");
  for (size_t p = 0; p < policies.size(); ++p) {
    if (policies[p] == default_policy) {
      std::printf(", ");
      print_list("default", by[p], "%.6f");
    }
  }
  for (size_t p = 0; p < policies.size(); ++p) {
    std::printf(", ");
    print_list(policies[p].c_str(), by[p], "%.6f");
  }
  if (hints.lookahead > 0) {
    std::printf(", \"lookahead\":%u, ", hints.lookahead);
    print_list("static-oracle", stat, "%.6f");
    std::printf(", ");
    print_list("admit-oracle", admit, "%.6f");
    for (size_t p = 0; p < policies.size(); ++p) {
      std::printf(", ");
      print_list((policies[p] + "+hints").c_str(), with[p], "%.6f");
      std::printf(", ");
      print_list((policies[p] + "+hints+prefetch").c_str(), fetch[p], "%.6f");
    }
  }
  std::printf("}\n");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cache_trace_bench: eviction policies on KV-cache traces (synthetic or Mooncake)"};
  uint64_t requests = 40000, seed = 1;
  std::vector<std::string> mixes{"default", "chat", "scan", "shared", "gaps"};
  std::vector<std::string> files;
  std::vector<double> sizes;
  bool as_json = false;
  app.add_option("--trace", files,
                 "replay these Mooncake-format traces (JSON Lines with hash_ids) instead of "
                 "synthetic ones");
  app.add_option("--requests", requests, "synthetic: requests per trace (40000)");
  app.add_option("--seed", seed, "synthetic: trace seed (1)");
  app.add_option("--mix", mixes, "synthetic: trace mixes: default chat scan shared gaps (all)");
  app.add_option("--sizes", sizes,
                 "cache sizes in % of the unique blocks (synthetic: 1 2 5 10 15 20; --trace: "
                 "1 2 5 10 20)");
  uint32_t repeat = 1;
  app.add_option("--repeat", repeat, "runs per policy and size; the fastest counts (1)");
  app.add_flag("--json", as_json,
               "print only the prefix-hit ratios, one JSON object per trace: {\"sizes\", \"opt\", "
               "\"default\", and each policy}");
  Hints hints;
  app.add_option("--lookahead", hints.lookahead,
                 "hint the blocks of the next W requests before serving each one (0: off)");
  app.add_option("--hint-share", hints.share,
                 "with --lookahead: the share of the cache hints may protect (0.5)");
  CLI11_PARSE(app, argc, argv);
  if (!(hints.share >= 0 && hints.share <= 1)) {
    std::fprintf(stderr, "cache_trace_bench: --hint-share must be in [0, 1]\n");
    return 2;
  }
  if (sizes.empty()) {
    sizes = files.empty() ? std::vector<double>{1, 2, 5, 10, 15, 20}
                          : std::vector<double>{1, 2, 5, 10, 20};
  }
  for (double pct : sizes) {
    if (!(pct > 0 && pct <= 100)) {
      std::fprintf(stderr, "cache_trace_bench: --sizes must be in (0, 100], not %g\n", pct);
      return 2;
    }
  }

  std::vector<Named> traces;
  try {
    if (files.empty()) {
      for (const std::string& m : mixes)
        traces.push_back({m, make_trace(gdkv::bench::mix(m, requests, seed))});
    } else {
      for (const std::string& f : files) traces.push_back({f, from_file(f), true});
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cache_trace_bench: %s\n", e.what());
    return 1;
  }

  // Every policy the cache offers, the default first (the summary compares it with the best of
  // the classic ones).
  const std::string default_policy = gdkv::CacheOptions{}.policy;
  std::vector<std::string> policies{default_policy};
  for (const std::string& p : gdkv::cache_policies()) {
    if (p != default_policy) policies.push_back(p);
  }
  if (as_json) {
    for (const Named& n : traces) json(n.trace, sizes, policies, default_policy, hints);
    return 0;
  }
  // The classic policies the default must not lose to (by more than 0.5 points).
  std::vector<size_t> classic;
  for (const char* name : {"lru", "lru-k", "arc", "s3-fifo"}) {
    const auto at = std::find(policies.begin(), policies.end(), name);
    if (at != policies.end() && *at != default_policy) classic.push_back(at - policies.begin());
  }

  std::string names;
  for (const std::string& p : policies) names += " " + p;
  double worst_gap = -1;
  std::string worst_at;
  int points = 0, better_than_all = 0;
  for (const Named& n : traces) {
    const Trace& t = n.trace;
    std::printf("\ntrace '%s': %llu requests, %zu block references, %llu unique blocks\n",
                n.name.c_str(), static_cast<unsigned long long>(t.requests()), t.refs.size(),
                static_cast<unsigned long long>(t.unique_blocks));
    std::printf("%6s %8s | prefix-hit %%: opt%s%s | block-hit %%: opt%s | M refs/s:%s\n", "size",
                "blocks", names.c_str(),
                n.file ? " lru-2/unbounded-history static-oracle admit-oracle" : "", names.c_str(),
                names.c_str());
    for (double pct : sizes) {
      const uint64_t cap = capacity_of(pct, t);
      const Result opt = simulate_opt(t, cap);
      std::vector<Result> rs;
      for (const auto& p : policies) {
        Result best = simulate(p, t, cap);
        for (uint32_t i = 1; i < repeat; ++i) {
          best.refs_per_s = std::max(best.refs_per_s, simulate(p, t, cap).refs_per_s);
        }
        rs.push_back(best);
      }
      std::printf("%5.1f%% %8llu | %6.2f", pct, static_cast<unsigned long long>(cap),
                  100 * opt.prefix_hit);
      for (const Result& r : rs) std::printf(" %6.2f", 100 * r.prefix_hit);
      // The trace README's LRU-2 keeps every evicted key's history.
      if (n.file) {
        std::printf(" %6.2f", 100 * simulate("lru-k", t, cap, t.unique_blocks).prefix_hit);
        std::printf(" %6.2f", 100 * simulate_static(t, cap).prefix_hit);
        std::printf(" %6.2f", 100 * simulate_admit_oracle(t, cap).prefix_hit);
      }
      if (hints.lookahead > 0) {
        std::printf(" | +hints W=%u:", hints.lookahead);
        for (const auto& p : policies) {
          std::printf(" %6.2f", 100 * simulate(p, t, cap, 0, nullptr, hints).prefix_hit);
        }
        Hints prefetching = hints;
        prefetching.prefetch = true;
        std::printf(" | +prefetch:");
        for (const auto& p : policies) {
          std::printf(" %6.2f", 100 * simulate(p, t, cap, 0, nullptr, prefetching).prefix_hit);
        }
      }
      std::printf(" | %6.2f", 100 * opt.block_hit);
      for (const Result& r : rs) std::printf(" %6.2f", 100 * r.block_hit);
      std::printf(" |");
      for (const Result& r : rs) std::printf(" %5.2f", r.refs_per_s / 1e6);
      std::printf("\n");
      if (classic.empty()) continue;
      double best = 0;
      for (size_t i : classic) best = std::max(best, rs[i].prefix_hit);
      const double gap = best - rs[0].prefix_hit;
      ++points;
      if (gap < 0) ++better_than_all;
      if (gap > worst_gap) {
        worst_gap = gap;
        char at[256];
        std::snprintf(at, sizeof(at), "'%s' at %.1f%%", n.name.c_str(), pct);
        worst_at = at;
      }
    }
  }
  if (points == 0) return 0;
  std::printf(
      "\n%s vs the best of lru, lru-2, arc and s3-fifo (prefix-hit %%): better than all at %d "
      "of %d points; ",
      default_policy.c_str(), better_than_all, points);
  if (worst_gap <= 0) {
    std::printf("never worse\n");
  } else {
    std::printf("largest shortfall %.2f points (%s)\n", 100 * worst_gap, worst_at.c_str());
  }
  // The rule for the default: never more than 0.5 points below the best classic policy.
  std::printf("within 0.50 points of the best at every point: %s\n",
              worst_gap <= 0.005 ? "yes" : "NO");
  return 0;
}
