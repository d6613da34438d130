// A synthetic KV-cache request trace: what an inference server's prefix cache sees.
//
// Each request is the chain of block ids of one prompt, in order. Three kinds mix:
//   - one-shot requests: a shared prefix (system prompt or document) picked by a Zipf popularity,
//     then a few blocks of a question seen once;
//   - multi-turn chats: turn n's prompt is turn n-1's prompt plus the answer and the next question
//     (new blocks), so each turn reuses the whole previous prompt; many chats are active at once,
//     so a chat's next turn comes after many other requests;
//   - long scans: documents read once (batch summarisation, ingestion), never reused.
// Block ids are dense (0..unique-1), so a simulator can index arrays by them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string_view>
#include <vector>

namespace gdkv::bench {

struct TraceOptions {
  uint64_t requests = 40000;
  uint32_t prefixes = 500;                   // shared system prompts and documents
  double zipf = 0.9;                         // popularity skew of the prefixes
  uint32_t prefix_min = 2, prefix_max = 40;  // blocks per prefix
  double p_chat = 0.5;                       // share of chat turns
  double p_scan = 0.04;                      // share of scans; the rest are one-shot requests
  uint32_t active_chats = 600;               // conversations open at once
  uint32_t turns_max = 10;                   // turns per conversation, uniform 1..max
  uint32_t turn_min = 1, turn_max = 6;       // new blocks per turn (answer + question)
  uint32_t question_max = 4;                 // new blocks of a one-shot request
  uint32_t scan_min = 32, scan_max = 256;    // blocks per scan
  uint64_t seed = 1;
};

struct Trace {
  std::vector<uint64_t> refs;    // block ids, request after request
  std::vector<uint64_t> starts;  // where each request begins in refs (plus refs.size() at end)
  uint64_t unique_blocks = 0;
  uint64_t requests() const { return starts.size() - 1; }
};

inline Trace make_trace(const TraceOptions& o) {
  std::mt19937_64 rng(o.seed);
  Trace t;
  uint64_t next_id = 0;
  auto fresh = [&](std::vector<uint64_t>& out, uint32_t n) {
    for (uint32_t i = 0; i < n; ++i) out.push_back(next_id++);
  };
  auto uniform = [&](uint32_t lo, uint32_t hi) {
    return lo + static_cast<uint32_t>(rng() % (hi - lo + 1));
  };
  std::vector<std::vector<uint64_t>> prefixes(o.prefixes);
  for (auto& p : prefixes) fresh(p, uniform(o.prefix_min, o.prefix_max));
  std::vector<double> weights(o.prefixes);
  for (uint32_t i = 0; i < o.prefixes; ++i) weights[i] = 1.0 / std::pow(i + 1.0, o.zipf);
  std::discrete_distribution<uint32_t> popular(weights.begin(), weights.end());

  struct Chat {
    std::vector<uint64_t> context;
    uint32_t turns_left = 0;
  };
  auto new_chat = [&] {
    Chat c;
    c.context = prefixes[popular(rng)];
    c.turns_left = uniform(1, o.turns_max);
    return c;
  };
  std::vector<Chat> chats(o.active_chats);
  for (auto& c : chats) c = new_chat();

  std::uniform_real_distribution<double> u01(0, 1);
  for (uint64_t r = 0; r < o.requests; ++r) {
    t.starts.push_back(t.refs.size());
    const double x = u01(rng);
    if (x < o.p_scan) {
      std::vector<uint64_t> doc;
      fresh(doc, uniform(o.scan_min, o.scan_max));
      t.refs.insert(t.refs.end(), doc.begin(), doc.end());
    } else if (x < o.p_scan + o.p_chat) {
      Chat& c = chats[rng() % chats.size()];
      fresh(c.context, uniform(o.turn_min, o.turn_max));
      t.refs.insert(t.refs.end(), c.context.begin(), c.context.end());
      if (--c.turns_left == 0) c = new_chat();
    } else {
      const auto& p = prefixes[popular(rng)];
      t.refs.insert(t.refs.end(), p.begin(), p.end());
      fresh(t.refs, uniform(1, o.question_max));
    }
  }
  t.starts.push_back(t.refs.size());
  t.unique_blocks = next_id;
  return t;
}

// The named mixes of cache_trace_bench --mix: "default", "chat" (mostly long conversations),
// "scan" (heavy batch traffic between interactive requests), "shared" (one-shot requests on
// popular system prompts), "gaps" (conversations whose next turn comes long after: 8,000 open).
inline TraceOptions mix(std::string_view name, uint64_t requests, uint64_t seed) {
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
  } else if (name == "gaps") {  // conversations whose next turn comes long after (many open)
    o.p_chat = 0.6;
    o.p_scan = 0.02;
    o.active_chats = 8000;
    o.turns_max = 12;
  }
  return o;
}

}  // namespace gdkv::bench
