// gdkv: the command-line client. Runs a controller in-process over the chosen backend (the local
// store by default) and talks to it through a queue pair, like any other requester; with
// --connect DIR it is a client of the gdkvd serving DIR instead (vfio-user).
//
// Exit codes: 0 success, 1 key does not exist, 2 usage error, 3 any other failure; each failure
// prints one line on stderr naming the key and the NVMe status.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <random>
#include <thread>

#include "gdkv/backend_factory.h"
#include "gdkv/cache.h"
#include "gdkv/client.h"
#include "gdkv/commands.h"
#include "gdkv/histogram.h"
#include "gdkv/metrics_server.h"
#include "gdkv/vfio_user.h"
#include "settings_flags.h"

namespace {

using gdkv::CmdResult;
using gdkv::Key;
using gdkv::nvme::Status;

constexpr int kExitOk = 0;
constexpr int kExitNotFound = 1;
constexpr int kExitUsage = 2;
constexpr int kExitFailure = 3;

struct Options {
  // The backend, the host cache (off unless asked: one CLI command rarely rereads a block),
  // reactors and the largest value: the settings table's flags (gdkv/settings.h).
  gdkv::StoreSettings store;
  // With --connect: the connection's settings (shared memory, queue depth, timeouts).
  gdkv::VfioUserClientOptions client;
  uint32_t nsid = 1;
  bool hex = false;
  std::string connect;    // a running gdkvd's socket directory
  int metrics_port = -1;  // serve /metrics while the command runs (0: any free port)
};

// With --connect: the gdkvd connection. Asynchronous commands (bench) name their buffers
// directly, so those must live in the memory it shares with gdkvd.
std::shared_ptr<gdkv::VfioUserDevice> g_device;

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

Key parse_key(const std::string& text, bool hex) {
  std::optional<Key> k = hex ? Key::from_hex(text) : Key::from_string(text);
  if (!k) {
    throw UsageError(hex ? "KEY must be 1-16 bytes as hex (2-32 hex digits): '" + text + "'"
                         : "KEY must be 1-16 bytes: '" + text + "' has " +
                               std::to_string(text.size()));
  }
  return *k;
}

// The key as the user typed it: raw text, or hex with --hex.
std::string show_key(const Key& k, bool hex) {
  if (hex) return k.hex();
  std::string s;
  for (uint8_t b : std::span(k.bytes, k.len)) {
    if (b >= 0x20 && b < 0x7F && b != '\\') {
      s.push_back(static_cast<char>(b));
    } else {
      char buf[5];
      std::snprintf(buf, sizeof(buf), "\\x%02x", b);
      s += buf;
    }
  }
  return s;
}

int fail(const std::string& what, const Key& k, bool hex, const CmdResult& r) {
  std::fprintf(stderr, "gdkv: %s '%s': %s\n", what.c_str(), show_key(k, hex).c_str(),
               gdkv::describe(r).c_str());
  return r.status == Status::kKeyNotExist ? kExitNotFound : kExitFailure;
}

std::vector<std::byte> read_all(std::istream& in) {
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(chars.size());
  if (!chars.empty()) std::memcpy(out.data(), chars.data(), chars.size());
  return out;
}

std::unique_ptr<gdkv::Client> open_client(const Options& o) {
  if (!o.connect.empty()) {
    // A failure to open is this program's error: value() throws it to main's handler.
    g_device = gdkv::VfioUserDevice::open(o.connect, o.client).value();
    return g_device->make_client().value();
  }
  gdkv::ClientOptions co;
  co.controller = o.store.controller;
  co.controller.namespaces = std::max<uint32_t>(o.nsid, 1);
  co.queue.depth = 1024;
  return gdkv::Client::open(gdkv::open_store(o.store).value(), co).value();
}

// ---- bench --------------------------------------------------------------------------------------

struct BenchOptions {
  uint32_t value_size = 4096;
  uint32_t qd = 32;
  uint32_t threads = 1;
  uint32_t keys = 1000;
  double duration = 5;
  std::string op = "get";  // get | put | mixed
  bool json = false;
};

// memcpy of the same bytes, the same way (one value at a time from a rotating set of sources).
double measure_memcpy_bps(uint32_t value_size, uint32_t keys, double seconds) {
  const uint32_t n = std::min<uint32_t>(keys, std::max<uint32_t>(1, (256u << 20) / value_size));
  std::vector<std::vector<std::byte>> src(n, std::vector<std::byte>(value_size, std::byte{1}));
  std::vector<std::byte> dst(value_size);
  uint64_t bytes = 0;
  auto t0 = std::chrono::steady_clock::now();
  double el = 0;
  for (uint64_t i = 0;; ++i) {
    std::memcpy(dst.data(), src[i % n].data(), value_size);
    bytes += value_size;
    if ((i & 255) == 0) {
      el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (el >= seconds) break;
    }
  }
  asm volatile("" : : "r"(dst.data()) : "memory");
  return static_cast<double>(bytes) / el;
}

// A buffer for asynchronous commands: gdkvd-shared memory with --connect, else the heap.
std::byte* bench_buffer(size_t n, std::vector<std::unique_ptr<std::byte[]>>& owned) {
  if (g_device) {
    auto* p = static_cast<std::byte*>(g_device->alloc(n, 4096));
    if (p == nullptr) {
      throw std::runtime_error("bench: shared memory exhausted (lower --qd or --threads)");
    }
    return p;
  }
  owned.push_back(std::make_unique<std::byte[]>(n));
  return owned.back().get();
}

int run_bench(gdkv::Client& client, const BenchOptions& b, uint32_t nsid) {
  if (b.value_size == 0 || b.qd == 0 || b.threads == 0 || b.keys == 0 || b.duration <= 0) {
    throw UsageError("bench: sizes, depth, threads, keys and duration must be positive");
  }
  if (b.op != "get" && b.op != "put" && b.op != "mixed") {
    throw UsageError("bench: --op is get, put or mixed");
  }
  // Populate the keys once (also what a put benchmark overwrites).
  std::vector<Key> keys(b.keys);
  std::vector<std::unique_ptr<std::byte[]>> owned;
  const std::span<std::byte> value(bench_buffer(b.value_size, owned), b.value_size);
  std::mt19937_64 rng(42);
  for (auto& x : value) x = static_cast<std::byte>(rng());
  for (uint32_t i = 0; i < b.keys; ++i) {
    char name[16];
    std::snprintf(name, sizeof(name), "bench%010u", i);
    keys[i] = *Key::from_string(name);
  }
  {
    std::vector<gdkv::nvme::Sqe> sqes;
    for (const Key& k : keys) {
      sqes.push_back(gdkv::cmd::store(k.bytes, k.len, value.data(), b.value_size, 0, nsid));
    }
    std::vector<CmdResult> rs(sqes.size());
    client.run_batch(sqes, rs);
    for (auto& r : rs) {
      if (!r.ok()) {
        std::fprintf(stderr, "gdkv: bench: populating keys failed: %s\n",
                     gdkv::describe(r).c_str());
        return kExitFailure;
      }
    }
  }

  std::atomic<bool> stop{false};
  std::atomic<uint64_t> total_ops{0}, errors{0};
  std::vector<gdkv::Histogram> hists(b.threads);
  const bool tty = isatty(STDERR_FILENO);
  auto worker = [&](uint32_t t) {
    std::mt19937_64 r(t + 1);
    std::vector<std::unique_ptr<std::byte[]>> mine;
    std::vector<std::byte*> bufs(b.qd);
    for (auto& p : bufs) p = bench_buffer(b.value_size, mine);
    std::vector<uint16_t> cids(b.qd);
    std::vector<uint64_t> starts(b.qd);
    auto issue = [&](uint32_t slot) {
      const Key& k = keys[r() % keys.size()];
      const bool put = b.op == "put" || (b.op == "mixed" && (r() & 1));
      gdkv::nvme::Sqe s =
          put ? gdkv::cmd::store(k.bytes, k.len, value.data(), b.value_size, 0, nsid)
              : gdkv::cmd::retrieve(k.bytes, k.len, bufs[slot], b.value_size, nsid);
      starts[slot] =
          static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
      // A Client that failed (gdkvd gone) takes no more commands: count it and stop the run.
      if (auto cid = client.start(s)) {
        cids[slot] = *cid;
      } else {
        errors.fetch_add(1, std::memory_order_relaxed);
        stop = true;
        cids[slot] = UINT16_MAX;
      }
    };
    for (uint32_t s = 0; s < b.qd; ++s) issue(s);
    uint64_t local_ops = 0;
    while (true) {
      for (uint32_t s = 0; s < b.qd; ++s) {
        if (cids[s] == UINT16_MAX || !client.poll(cids[s])) continue;
        CmdResult res = client.finish(cids[s]);
        const uint64_t now =
            static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
        hists[t].record(now - starts[s]);
        if (!res.ok()) errors.fetch_add(1, std::memory_order_relaxed);
        if (++local_ops % 64 == 0) total_ops.fetch_add(64, std::memory_order_relaxed);
        if (stop.load(std::memory_order_relaxed)) {
          cids[s] = UINT16_MAX;
          continue;
        }
        issue(s);
      }
      if (stop.load(std::memory_order_relaxed)) {
        bool any = false;
        for (uint32_t s = 0; s < b.qd; ++s) {
          if (cids[s] == UINT16_MAX) continue;
          (void)client.wait(cids[s]);
          any = true;
          cids[s] = UINT16_MAX;
        }
        (void)any;
        break;
      }
    }
  };
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (uint32_t t = 0; t < b.threads; ++t) ts.emplace_back(worker, t);
  double elapsed = 0;
  while (elapsed < b.duration) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (tty) {
      std::fprintf(stderr, "\r%5.1f s  %.0f ops/s   ", elapsed,
                   static_cast<double>(total_ops.load()) / elapsed);
    }
  }
  stop = true;
  for (auto& t : ts) t.join();
  elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (tty) std::fprintf(stderr, "\r%40s\r", "");
  gdkv::Histogram h;
  for (auto& x : hists) h.merge(x);
  const double ops = static_cast<double>(h.count()) / elapsed;
  const double bps = ops * b.value_size;
  const double memcpy_bps = measure_memcpy_bps(b.value_size, b.keys, 1.0);
  const double ratio = bps / memcpy_bps;
  if (b.json) {
    std::printf(
        "{\"op\":\"%s\",\"value_size\":%u,\"qd\":%u,\"threads\":%u,\"ops_per_s\":%.0f,"
        "\"gb_per_s\":%.4f,\"p50_us\":%.2f,\"p99_us\":%.2f,\"p999_us\":%.2f,\"errors\":%llu,"
        "\"memcpy_gb_per_s\":%.4f,\"ratio_to_memcpy\":%.4f,\"ns_per_op_beyond_memcpy\":%.1f}\n",
        b.op.c_str(), b.value_size, b.qd, b.threads, ops, bps / 1e9, h.percentile(0.5) / 1e3,
        h.percentile(0.99) / 1e3, h.percentile(0.999) / 1e3,
        static_cast<unsigned long long>(errors.load()), memcpy_bps / 1e9, ratio,
        1e9 / ops - 1e9 * b.value_size / memcpy_bps);
  } else {
    std::printf("op %s  value %u B  qd %u  threads %u  %.1f s\n", b.op.c_str(), b.value_size, b.qd,
                b.threads, elapsed);
    std::printf("  %.0f ops/s  %.3f GB/s  latency p50 %.2f us  p99 %.2f us  p999 %.2f us\n", ops,
                bps / 1e9, h.percentile(0.5) / 1e3, h.percentile(0.99) / 1e3,
                h.percentile(0.999) / 1e3);
    std::printf(
        "  memcpy of the same bytes: %.3f GB/s  ratio %.3f  (%.1f ns per op beyond memcpy)\n",
        memcpy_bps / 1e9, ratio, 1e9 / ops - 1e9 * b.value_size / memcpy_bps);
    if (errors.load() != 0)
      std::printf("  errors: %llu\n", static_cast<unsigned long long>(errors.load()));
  }
  return errors.load() == 0 ? kExitOk : kExitFailure;
}

// Two synthetic prompts that share a system prompt: store the first prompt's KV blocks, then find
// the second prompt's shared prefix blocks by their chain keys and load them.
int run_demo(gdkv::Client& client, uint32_t nsid) {
  constexpr uint32_t kBlockTokens = 16;
  constexpr uint32_t kLayers = 4, kKvHeads = 8, kHeadDim = 128, kBytesPerElem = 2;
  constexpr uint32_t kBlockBytes = kBlockTokens * kLayers * 2 * kKvHeads * kHeadDim * kBytesPerElem;
  const std::string salt = "demo-model-4L-8kv-128d/fp16";
  std::mt19937 rng(2024);
  std::vector<uint32_t> system_prompt(256), question_a(120), question_b(90);
  for (auto& t : system_prompt) t = rng() % 128256;
  for (auto& t : question_a) t = rng() % 128256;
  for (auto& t : question_b) t = rng() % 128256;
  std::vector<uint32_t> prompt_a = system_prompt, prompt_b = system_prompt;
  prompt_a.insert(prompt_a.end(), question_a.begin(), question_a.end());
  prompt_b.insert(prompt_b.end(), question_b.begin(), question_b.end());
  const auto keys_a = gdkv::chain_keys(prompt_a, kBlockTokens, salt);
  const auto keys_b = gdkv::chain_keys(prompt_b, kBlockTokens, salt);
  // A block's "KV tensor": bytes derived from its key, so what comes back can be checked.
  auto block_value = [&](const Key& k) {
    std::vector<std::byte> v(kBlockBytes);
    uint64_t seed;
    std::memcpy(&seed, k.bytes, sizeof(seed));
    std::mt19937_64 g(seed);
    for (size_t i = 0; i < v.size(); i += 8) {
      const uint64_t x = g();
      std::memcpy(v.data() + i, &x, 8);
    }
    return v;
  };
  std::printf(
      "model shape: %u layers x K,V x %u heads x %u dims, fp16; %u tokens per block = %u KiB\n",
      kLayers, kKvHeads, kHeadDim, kBlockTokens, kBlockBytes / 1024);
  std::printf("prompt A: %zu tokens -> %zu full blocks; prompt B: %zu tokens -> %zu full blocks\n",
              prompt_a.size(), keys_a.size(), prompt_b.size(), keys_b.size());
  std::printf("(both start with the same %zu-token system prompt)\n\n", system_prompt.size());

  // Prefill of A: store every block (Store with must-not-exist: a block already there is reused).
  uint32_t stored = 0, reused = 0;
  for (const Key& k : keys_a) {
    CmdResult r = client.put(k, block_value(k), gdkv::nvme::kStoreMustNotExist, nsid);
    if (r.status == Status::kKeyExists) {
      ++reused;
    } else if (!r.ok()) {
      return fail("demo put", k, true, r);
    } else {
      ++stored;
    }
  }
  std::printf("prompt A: stored %u blocks, %u were already in the store\n\n", stored, reused);

  // Prompt B: its leading run of blocks that exist is the reusable prefix.
  std::printf("prompt B  block  key                               found\n");
  size_t hits = 0;
  bool in_prefix = true;
  for (size_t i = 0; i < keys_b.size(); ++i) {
    const bool found = client.exists(keys_b[i], nsid).ok();
    if (!found) in_prefix = false;
    if (in_prefix) ++hits;
    std::printf("          %5zu  %s  %s\n", i, keys_b[i].hex().c_str(), found ? "yes" : "no");
  }
  // Load the shared blocks and check every byte.
  std::vector<std::byte> buf(kBlockBytes);
  for (size_t i = 0; i < hits; ++i) {
    CmdResult r = client.get(keys_b[i], std::span(buf), nsid);
    if (!r.ok()) return fail("demo get", keys_b[i], true, r);
    if (r.dw0 != kBlockBytes || buf != block_value(keys_b[i])) {
      std::fprintf(stderr, "gdkv: demo: block %zu came back different\n", i);
      return kExitFailure;
    }
  }
  std::printf("\nprompt B reuses %zu of %zu blocks (%zu tokens, %zu KiB loaded and verified);\n",
              hits, keys_b.size(), hits * kBlockTokens, hits * kBlockBytes / 1024);
  std::printf("only its last %zu tokens need a prefill.\n", prompt_b.size() - hits * kBlockTokens);
  return hits == system_prompt.size() / kBlockTokens ? kExitOk : kExitFailure;
}

int run_stat(gdkv::Client& client) {
  gdkv::Controller* ctl = client.controller();
  if (ctl == nullptr) {
    std::fprintf(
        stderr, "gdkv: stat: not available with --connect: gdkvd serves its metrics on /metrics\n");
    return kExitFailure;
  }
  const gdkv::BackendInfo info = ctl->backend().info();
  std::printf("backend   %s\n", info.name.c_str());
  std::printf("keys      %llu\n", static_cast<unsigned long long>(info.keys));
  std::printf("used      %llu bytes\n", static_cast<unsigned long long>(info.bytes_used));
  std::printf("capacity  %llu bytes\n", static_cast<unsigned long long>(info.capacity_bytes));
  std::printf("segments  %llu\n", static_cast<unsigned long long>(info.segments));
  if (info.fill_capacity_bytes != 0) {
    std::printf("pool fill %.1f%% of %llu bytes\n", info.fill_ratio * 100,
                static_cast<unsigned long long>(info.fill_capacity_bytes));
  }
  gdkv::MetricList metrics;
  ctl->collect(metrics);
  std::printf("\n%s", gdkv::metrics_table(metrics).c_str());
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gdkv: a GPU-direct NVMe-KV store for KV-cache blocks"};
  app.require_subcommand(1);
  // Global flags are accepted after the verb too (`gdkv put --hex KEY FILE`), as people type them.
  app.fallthrough();
  // A flag given twice (a default in an alias, then the user's own) takes the last value.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  Options o;
  gdkv_tools::add_setting_flags(app, gdkv::store_settings(), o.store);
  gdkv_tools::add_setting_flags(app, gdkv::client_settings(), o.client);
  app.add_option("--metrics-port", o.metrics_port,
                 "serve Prometheus text on /metrics while the command runs (0: any free port)");
  app.add_option("--nsid", o.nsid, "NVMe namespace (default 1)")->check(CLI::Range(1u, 1024u));
  app.add_flag("--hex", o.hex, "KEY arguments are hex (1-16 bytes as 2-32 hex digits)");
  app.add_option("--connect", o.connect,
                 "use the gdkvd serving DIR (socket DIR/cntrl) instead of an in-process controller")
      ->envname("GDKV_CONNECT");

  std::string key_text, file = "-", out_file;
  bool must_exist = false, must_not_exist = false;
  auto* put = app.add_subcommand("put", "store a value: put KEY [FILE|-] (stdin by default)");
  put->add_option("KEY", key_text, "the key")->required();
  put->add_option("FILE", file, "file to read the value from, - for stdin");
  put->add_flag("--must-exist", must_exist, "only replace an existing key (else exit 1)");
  put->add_flag("--must-not-exist", must_not_exist, "only create a new key (else exit 3)");
  auto* get = app.add_subcommand("get", "print a value: get KEY [-o FILE]");
  get->add_option("KEY", key_text, "the key")->required();
  get->add_option("-o,--output", out_file, "write the value to FILE instead of stdout");
  auto* del = app.add_subcommand("del", "delete a key");
  del->add_option("KEY", key_text, "the key")->required();
  auto* exists = app.add_subcommand("exists", "exit 0 if the key exists, 1 if not");
  exists->add_option("KEY", key_text, "the key")->required();
  std::string prefix;
  auto* ls = app.add_subcommand("ls", "list keys in order");
  ls->add_option("--prefix", prefix, "only keys starting with these bytes (hex with --hex)");
  auto* stat = app.add_subcommand("stat", "backend sizes and metrics");
  auto* demo =
      app.add_subcommand("demo", "store one prompt's KV blocks, find another's shared prefix");
  BenchOptions bo;
  auto* bench =
      app.add_subcommand("bench", "put/get workload; compares with memcpy in the same run");
  bench->add_option("--value-size", bo.value_size, "bytes per value (4096)");
  bench->add_option("--qd", bo.qd, "commands in flight per thread (32)");
  bench->add_option("--threads", bo.threads, "submitting threads (1)");
  bench->add_option("--keys", bo.keys, "distinct keys (1000)");
  bench->add_option("--duration", bo.duration, "seconds (5)");
  bench->add_option("--op", bo.op, "get, put or mixed (get)");
  bench->add_flag("--json", bo.json, "print one JSON line");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "gdkv: %s\n", e.what());
    std::fprintf(stderr, "Run with --help for more information.\n");
    return kExitUsage;
  }

  try {
    if (must_exist && must_not_exist)
      throw UsageError("--must-exist and --must-not-exist conflict");
    Key key;
    if (put->parsed() || get->parsed() || del->parsed() || exists->parsed()) {
      key = parse_key(key_text, o.hex);
    }
    std::optional<Key> prefix_key;
    if (ls->parsed() && !prefix.empty()) prefix_key = parse_key(prefix, o.hex);

    // Read the value before starting anything, so a bad FILE is a clean usage error.
    std::vector<std::byte> value;
    if (put->parsed()) {
      if (file == "-") {
        value = read_all(std::cin);
      } else {
        std::ifstream in(file, std::ios::binary);
        if (!in) throw UsageError("cannot read '" + file + "': " + std::strerror(errno));
        value = read_all(in);
      }
      if (value.size() > o.store.controller.max_value_bytes) {
        std::fprintf(stderr, "gdkv: put '%s': value of %zu bytes is over the %llu-byte limit\n",
                     show_key(key, o.hex).c_str(), value.size(),
                     static_cast<unsigned long long>(o.store.controller.max_value_bytes));
        return kExitFailure;
      }
    }

    auto client = open_client(o);
    std::unique_ptr<gdkv::MetricsServer> metrics;
    if (o.metrics_port >= 0 && client->controller() != nullptr) {
      gdkv::Controller* ctl = client->controller();
      metrics = gdkv::MetricsServer::start(static_cast<uint16_t>(o.metrics_port), [ctl] {
                  gdkv::MetricList m;
                  ctl->collect(m);
                  return m;
                }).value();
      std::fprintf(stderr, "gdkv: metrics on http://127.0.0.1:%u/metrics\n", metrics->port());
    }
    if (put->parsed()) {
      uint8_t opts = must_exist ? gdkv::nvme::kStoreMustExist
                                : (must_not_exist ? gdkv::nvme::kStoreMustNotExist : 0);
      CmdResult r = client->put(key, value, opts, o.nsid);
      return r.ok() ? kExitOk : fail("put", key, o.hex, r);
    }
    if (get->parsed()) {
      std::vector<std::byte> out;
      CmdResult r = client->get(key, out, o.nsid);
      if (!r.ok()) return fail("get", key, o.hex, r);
      if (out_file.empty()) {
        if (!out.empty() && std::fwrite(out.data(), 1, out.size(), stdout) != out.size()) {
          std::fprintf(stderr, "gdkv: get '%s': writing stdout failed\n",
                       show_key(key, o.hex).c_str());
          return kExitFailure;
        }
        std::fflush(stdout);
      } else {
        std::ofstream f(out_file, std::ios::binary | std::ios::trunc);
        f.write(reinterpret_cast<const char*>(out.data()),
                static_cast<std::streamsize>(out.size()));
        if (!f) {
          std::fprintf(stderr, "gdkv: get '%s': cannot write '%s': %s\n",
                       show_key(key, o.hex).c_str(), out_file.c_str(), std::strerror(errno));
          return kExitFailure;
        }
      }
      return kExitOk;
    }
    if (del->parsed()) {
      CmdResult r = client->del(key, o.nsid);
      return r.ok() ? kExitOk : fail("del", key, o.hex, r);
    }
    if (exists->parsed()) {
      CmdResult r = client->exists(key, o.nsid);
      if (r.status == Status::kKeyNotExist) return kExitNotFound;
      return r.ok() ? kExitOk : fail("exists", key, o.hex, r);
    }
    if (ls->parsed()) {
      std::vector<Key> keys;
      CmdResult r = client->list_all(keys, o.nsid);
      if (!r.ok()) {
        std::fprintf(stderr, "gdkv: ls: %s\n", gdkv::describe(r).c_str());
        return kExitFailure;
      }
      for (const Key& k : keys) {
        if (prefix_key && (k.len < prefix_key->len ||
                           std::memcmp(k.bytes, prefix_key->bytes, prefix_key->len) != 0)) {
          continue;
        }
        std::printf("%s\n", show_key(k, o.hex).c_str());
      }
      return kExitOk;
    }
    if (stat->parsed()) return run_stat(*client);
    if (bench->parsed()) return run_bench(*client, bo, o.nsid);
    if (demo->parsed()) return run_demo(*client, o.nsid);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "gdkv: %s\n", e.what());
    return kExitUsage;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gdkv: %s\n", e.what());
    return kExitFailure;
  }
  return kExitUsage;
}
