// Helpers the local store's tests and its test helper program share: blocking wrappers around the
// asynchronous Backend API, and values whose bytes are a pure function of (key, version), so a
// reader can tell exactly which write it is looking at and whether every byte is right.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <span>
#include <vector>

#include "gdkv/backend.h"

namespace gdkv::local::test {

inline uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Value of (id, version): 16 bytes naming it, then a pseudo-random stream. REQUIRES: len >= 16.
inline std::vector<std::byte> make_value(uint64_t id, uint64_t version, size_t len) {
  std::vector<std::byte> v(len);
  std::memcpy(v.data(), &id, 8);
  std::memcpy(v.data() + 8, &version, 8);
  uint64_t s = id * 0x100000001b3ull ^ version;
  for (size_t i = 16; i < len; i += 8) {
    const uint64_t r = splitmix(s);
    std::memcpy(v.data() + i, &r, std::min<size_t>(8, len - i));
  }
  return v;
}

// A length between 16 and ~24 KiB, a third of them inline (<= 1 KiB), and one in 40 of 1–3 MiB
// (so a batch spans several staging chunks and a crash can cut it between them).
// Odd versions in "big" runs are all 1–3 MiB (see the crash test).
inline size_t value_len(uint64_t id, uint64_t version) {
  uint64_t s = id * 31 + version * 7919;
  const uint64_t r = splitmix(s);
  if (r % 40 == 7 || version % 1000 == 999) return (1u << 20) + r % (2u << 20);
  return r % 3 == 0 ? 16 + r % 1000 : 16 + r % 24000;
}

enum class SinkMode {
  kAligned,    // a 4 KiB-aligned buffer of exactly the value's length
  kUnaligned,  // a buffer one byte off alignment
  kShort,      // half the value's length
  kView,       // no sink: the backend hands out a view
};

struct Call {
  BackendOp op;
  std::promise<void> done;
  nvme::Status status = nvme::Status::kInternalError;
  uint64_t len = 0;
  SinkMode mode = SinkMode::kAligned;
  std::byte* raw = nullptr;
  std::span<std::byte> buf;

  ~Call() { std::free(raw); }

  static std::span<std::byte> sink(BackendOp* op, uint64_t len) {
    auto* c = static_cast<Call*>(op->user);
    const size_t n = c->mode == SinkMode::kShort ? len / 2 : len;
    const size_t off = c->mode == SinkMode::kUnaligned ? 1 : 0;
    c->raw =
        static_cast<std::byte*>(std::aligned_alloc(4096, (n + off + 4095) / 4096 * 4096 + 4096));
    c->buf = {c->raw + off, n};
    return c->buf;
  }
  static void on_done(BackendOp* op, nvme::Status s, uint64_t len) {
    auto* c = static_cast<Call*>(op->user);
    c->status = s;
    c->len = len;
    c->done.set_value();
  }
};

inline nvme::Status run(Backend& b, Call& c) {
  c.op.user = &c;
  c.op.done = &Call::on_done;
  auto f = c.done.get_future();
  b.submit(&c.op);
  f.wait();
  return c.status;
}

inline nvme::Status put(Backend& b, const Key& k, std::span<const std::byte> v, uint8_t opts = 0,
                        uint32_t nsid = 1) {
  Call c;
  c.op.kind = BackendOpKind::kPut;
  c.op.key = k;
  c.op.nsid = nsid;
  c.op.value = v;
  c.op.store_options = opts;
  return run(b, c);
}

inline nvme::Status simple(Backend& b, BackendOpKind kind, const Key& k, uint32_t nsid = 1) {
  Call c;
  c.op.kind = kind;
  c.op.key = k;
  c.op.nsid = nsid;
  return run(b, c);
}

struct GetResult {
  nvme::Status status;
  uint64_t len;                 // the value's full length
  std::vector<std::byte> data;  // the bytes delivered
};

inline GetResult get(Backend& b, const Key& k, SinkMode mode = SinkMode::kAligned,
                     uint32_t nsid = 1) {
  Call c;
  c.op.kind = BackendOpKind::kGet;
  c.op.key = k;
  c.op.nsid = nsid;
  c.mode = mode;
  if (mode != SinkMode::kView) c.op.sink = &Call::sink;
  run(b, c);
  GetResult r{c.status, c.len, {}};
  if (c.status == nvme::Status::kSuccess) {
    if (mode == SinkMode::kView) {
      r.data.assign(c.op.view.bytes.begin(), c.op.view.bytes.end());
    } else {
      r.data.assign(c.buf.begin(), c.buf.begin() + std::min<size_t>(c.buf.size(), c.len));
    }
  }
  return r;
}

inline std::vector<Key> list(Backend& b, const Key& from, uint32_t max, uint32_t nsid = 1) {
  Call c;
  c.op.kind = BackendOpKind::kList;
  c.op.key = from;
  c.op.nsid = nsid;
  c.op.list_max = max;
  run(b, c);
  return c.op.keys;
}

inline Key int_key(uint32_t i) {
  uint8_t b[8] = {'k', 'e', 'y', ':'};
  std::memcpy(b + 4, &i, 4);
  return Key::from_bytes(b, 8);
}

inline double metric(Backend& b, const std::string& name,
                     const std::pair<std::string, std::string>* label = nullptr) {
  MetricList m;
  b.collect(m);
  for (const Metric& x : m) {
    if (x.name != name) continue;
    if (label != nullptr) {
      bool hit = false;
      for (const auto& l : x.labels) hit |= l == *label;
      if (!hit) continue;
    }
    return x.value;
  }
  return -1;
}

}  // namespace gdkv::local::test
