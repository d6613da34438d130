// Every opcode's semantics and every kind of bad input, through a queue pair and a real controller,
// against each backend (one suite, parameterised).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "backend_params.h"
#include "gdkv/client.h"
#include "gdkv/commands.h"
#include "gdkv/controller.h"

namespace gdkv {
namespace {

using nvme::Status;

std::vector<std::byte> random_bytes(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

Key key(const std::string& s) { return *Key::from_string(s); }

// "prefix-a-b" without string concatenation (GCC 12 warns falsely on operator+ chains).
Key key(const char* prefix, int a, int b = -1) {
  char buf[32];
  if (b < 0) {
    std::snprintf(buf, sizeof(buf), "%s%d", prefix, a);
  } else {
    std::snprintf(buf, sizeof(buf), "%s%d-%d", prefix, a, b);
  }
  return *Key::from_string(buf);
}

class Semantics : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { open_client({}); }

  void open_client(ControllerOptions co, QueueOptions qo = {}) {
    client_.reset();
    backend_.reset();
    fixture_ = std::make_unique<test::BackendFixture>();
    backend_ = fixture_->open(GetParam());
    if (!backend_) GTEST_SKIP() << "no Ceph cluster: set GDKV_CEPH_CONF (scripts/test does)";
    co.namespaces = std::max<uint32_t>(co.namespaces, 2);
    co.max_value_bytes = 4u << 20;
    ClientOptions o;
    o.controller = co;
    o.queue = qo;
    client_ = Client::open(backend_, o).value();
  }

  void TearDown() override {
    client_.reset();
    backend_.reset();
    fixture_.reset();
  }

  std::unique_ptr<test::BackendFixture> fixture_;
  std::shared_ptr<Backend> backend_;
  std::unique_ptr<Client> client_;
};

TEST_P(Semantics, StoreRetrieveRoundTripManySizes) {
  uint32_t seed = 1;
  for (size_t n : {size_t{1}, size_t{7}, size_t{4096}, size_t{4097}, size_t{65536 + 13},
                   size_t{(2u << 20) + 5}}) {
    Key k = key("size-", static_cast<int>(n));
    auto v = random_bytes(n, seed++);
    ASSERT_TRUE(client_->put(k, v).ok()) << n;
    std::vector<std::byte> out;
    CmdResult r = client_->get(k, out);
    ASSERT_TRUE(r.ok()) << describe(r);
    EXPECT_EQ(r.dw0, n);
    EXPECT_TRUE(out == v) << "value of " << n << " bytes differs";
  }
}

TEST_P(Semantics, EmptyValue) {
  ASSERT_TRUE(client_->put(key("empty"), {}).ok());
  std::byte buf[8];
  CmdResult r = client_->get(key("empty"), buf);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.dw0, 0u);
}

TEST_P(Semantics, OverwriteReplacesTheValue) {
  auto a = random_bytes(5000, 1), b = random_bytes(300, 2);
  ASSERT_TRUE(client_->put(key("k"), a).ok());
  ASSERT_TRUE(client_->put(key("k"), b).ok());
  std::vector<std::byte> out;
  ASSERT_TRUE(client_->get(key("k"), out).ok());
  EXPECT_TRUE(out == b);
}

TEST_P(Semantics, StoreOptions) {
  auto v = random_bytes(100, 3);
  EXPECT_EQ(client_->put(key("opt"), v, nvme::kStoreMustExist).status, Status::kKeyNotExist);
  EXPECT_EQ(client_->exists(key("opt")).status, Status::kKeyNotExist);
  EXPECT_TRUE(client_->put(key("opt"), v, nvme::kStoreMustNotExist).ok());
  EXPECT_EQ(client_->put(key("opt"), v, nvme::kStoreMustNotExist).status, Status::kKeyExists);
  auto w = random_bytes(50, 4);
  EXPECT_TRUE(client_->put(key("opt"), w, nvme::kStoreMustExist).ok());
  std::vector<std::byte> out;
  ASSERT_TRUE(client_->get(key("opt"), out).ok());
  EXPECT_TRUE(out == w);
  // Both at once contradict each other; unknown option bits are invalid.
  EXPECT_EQ(client_->put(key("opt"), v, nvme::kStoreMustExist | nvme::kStoreMustNotExist).status,
            Status::kInvalidField);
  EXPECT_EQ(client_->put(key("opt"), v, 0x80).status, Status::kInvalidField);
  // The compression hint is accepted.
  EXPECT_TRUE(client_->put(key("opt"), v, nvme::kStoreCompressHint).ok());
}

TEST_P(Semantics, RetrieveIntoShortBufferGivesFirstBytesAndFullLength) {
  auto v = random_bytes(10000, 5);
  ASSERT_TRUE(client_->put(key("short"), v).ok());
  std::vector<std::byte> buf(1000, std::byte{0xEE});
  buf.resize(1100, std::byte{0xEE});
  CmdResult r = client_->get(key("short"), std::span(buf).first(1000));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.dw0, 10000u);
  EXPECT_EQ(0, std::memcmp(buf.data(), v.data(), 1000));
  for (size_t i = 1000; i < 1100; ++i)
    ASSERT_EQ(buf[i], std::byte{0xEE}) << "wrote past the buffer";
  // A zero-length buffer asks for the length only.
  r = client_->execute(cmd::retrieve(key("short").bytes, 5, nullptr, 0));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.dw0, 10000u);
}

TEST_P(Semantics, MissingKeys) {
  std::byte buf[16];
  EXPECT_EQ(client_->get(key("nope"), buf).status, Status::kKeyNotExist);
  EXPECT_EQ(client_->del(key("nope")).status, Status::kKeyNotExist);
  EXPECT_EQ(client_->exists(key("nope")).status, Status::kKeyNotExist);
}

TEST_P(Semantics, DeleteAndExist) {
  ASSERT_TRUE(client_->put(key("d"), random_bytes(10, 6)).ok());
  EXPECT_TRUE(client_->exists(key("d")).ok());
  EXPECT_TRUE(client_->del(key("d")).ok());
  EXPECT_EQ(client_->exists(key("d")).status, Status::kKeyNotExist);
  std::byte buf[16];
  EXPECT_EQ(client_->get(key("d"), buf).status, Status::kKeyNotExist);
  EXPECT_EQ(client_->del(key("d")).status, Status::kKeyNotExist);
}

TEST_P(Semantics, ListOrderAndContinuation) {
  std::set<Key> expected;
  std::mt19937 rng(7);
  for (int i = 0; i < 120; ++i) {
    uint8_t b[16];
    const uint32_t len = 1 + rng() % 16;
    for (uint32_t j = 0; j < len; ++j) b[j] = static_cast<uint8_t>(rng());
    Key k = Key::from_bytes(b, len);
    expected.insert(k);
    ASSERT_TRUE(client_->put(k, random_bytes(8, i)).ok());
  }
  // Small pages force many continuations.
  std::vector<Key> got;
  Key start = Key::from_bytes("\0", 1);
  bool skip = false;
  for (int pages = 0; pages < 1000; ++pages) {
    std::vector<Key> page;
    CmdResult r = client_->list(start, page, 100);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r.dw0, page.size());
    size_t from = (skip && !page.empty() && page.front() == start) ? 1 : 0;
    if (page.size() <= from) break;
    got.insert(got.end(), page.begin() + static_cast<long>(from), page.end());
    start = page.back();
    skip = true;
  }
  std::vector<Key> want(expected.begin(), expected.end());
  EXPECT_TRUE(got == want) << "got " << got.size() << " keys, want " << want.size();
  EXPECT_TRUE(std::is_sorted(got.begin(), got.end()));
  std::vector<Key> all;
  ASSERT_TRUE(client_->list_all(all).ok());
  EXPECT_TRUE(all == want);
  // Listing starts at the first key >= the one given.
  std::vector<Key> tail;
  ASSERT_TRUE(client_->list(want[60], tail).ok());
  ASSERT_FALSE(tail.empty());
  EXPECT_EQ(tail.front(), want[60]);
  EXPECT_EQ(tail.size(), want.size() - 60);
}

TEST_P(Semantics, NamespacesAreApart) {
  ASSERT_TRUE(client_->put(key("shared-name"), random_bytes(10, 8), 0, 1).ok());
  EXPECT_EQ(client_->exists(key("shared-name"), 2).status, Status::kKeyNotExist);
  std::vector<Key> keys;
  ASSERT_TRUE(client_->list_all(keys, 2).ok());
  EXPECT_TRUE(keys.empty());
  EXPECT_TRUE(client_->exists(key("shared-name"), 1).ok());
}

TEST_P(Semantics, ScatterRetrievePlacesPieces) {
  auto v = random_bytes(4096 * 4, 9);
  ASSERT_TRUE(client_->put(key("layers"), v).ok());
  std::vector<std::byte> slots[4];
  std::vector<nvme::ScatterEntry> pieces;
  for (int i = 0; i < 4; ++i) {
    slots[i].assign(4096, std::byte{0});
    // Layers land in reverse order to prove each offset is honoured.
    pieces.push_back(
        {reinterpret_cast<uint64_t>(slots[i].data()), static_cast<uint32_t>((3 - i) * 4096), 4096});
  }
  CmdResult r = client_->scatter_get(key("layers"), pieces);
  ASSERT_TRUE(r.ok()) << describe(r);
  EXPECT_EQ(r.dw0, v.size());
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(0, std::memcmp(slots[i].data(), v.data() + (3 - i) * 4096, 4096)) << i;
  }
  EXPECT_EQ(client_->scatter_get(key("missing"), pieces).status, Status::kKeyNotExist);
  EXPECT_EQ(client_->scatter_get(key("layers"), {}).status, Status::kInvalidField);
}

TEST_P(Semantics, PrefetchIsAcceptedAndValidated) {
  std::vector<Key> keys{key("a"), key("bb"), key("ccc")};
  EXPECT_TRUE(client_->prefetch(keys).ok());
  // A key list whose count runs past the buffer is invalid.
  uint32_t bogus[2] = {1000, 0};
  EXPECT_EQ(client_->execute(cmd::prefetch(bogus, sizeof(bogus))).status, Status::kInvalidField);
}

TEST_P(Semantics, BadInputGetsTheRightStatus) {
  auto v = random_bytes(64, 10);
  Key k = key("bad");
  nvme::Sqe s = cmd::store(k.bytes, k.len, v.data(), 64);
  // Key length 0 and > 16.
  s.key_length = 0;
  EXPECT_EQ(client_->execute(s).status, Status::kInvalidKeySize);
  s.key_length = 17;
  EXPECT_EQ(client_->execute(s).status, Status::kInvalidKeySize);
  s.key_length = 255;
  EXPECT_EQ(client_->execute(s).status, Status::kInvalidKeySize);
  // Value over the limit (4 MiB here).
  s = cmd::store(k.bytes, k.len, v.data(), (4u << 20) + 1);
  EXPECT_EQ(client_->execute(s).status, Status::kInvalidValueSize);
  // Unknown opcodes, including unused vendor ones.
  for (uint8_t op : {0x00, 0x03, 0x05, 0x11, 0x7F, 0x80, 0x9F, 0xFF}) {
    nvme::Sqe u = cmd::exist(k.bytes, k.len);
    u.opcode = op;
    EXPECT_EQ(client_->execute(u).status, Status::kInvalidOpcode) << int(op);
  }
  // Namespaces 0 and past the last.
  EXPECT_EQ(client_->execute(cmd::exist(k.bytes, k.len, 0)).status, Status::kInvalidNamespace);
  EXPECT_EQ(client_->execute(cmd::exist(k.bytes, k.len, 99)).status, Status::kInvalidNamespace);
  EXPECT_EQ(client_->execute(cmd::exist(k.bytes, k.len, 0xFFFFFFFF)).status,
            Status::kInvalidNamespace);
  // Missing data buffer.
  EXPECT_EQ(client_->execute(cmd::store(k.bytes, k.len, nullptr, 64)).status,
            Status::kInvalidField);
  EXPECT_EQ(client_->execute(cmd::retrieve(k.bytes, k.len, nullptr, 64)).status,
            Status::kInvalidField);
  // List buffer too short for even the count.
  char tiny[3];
  EXPECT_EQ(client_->execute(cmd::list(k.bytes, k.len, tiny, 3)).status, Status::kInvalidField);
  // Reserved PSDT value, fused bits, unknown retrieve option.
  s = cmd::store(k.bytes, k.len, v.data(), 64);
  s.set_psdt(3);
  EXPECT_EQ(client_->execute(s).status, Status::kInvalidField);
  s = cmd::store(k.bytes, k.len, v.data(), 64);
  s.flags |= 1;
  EXPECT_EQ(client_->execute(s).status, Status::kInvalidField);
  nvme::Sqe g = cmd::retrieve(k.bytes, k.len, v.data(), 64);
  g.options = 0x10;
  EXPECT_EQ(client_->execute(g).status, Status::kInvalidField);
  // An SGL whose length is shorter than the transfer.
  s = cmd::store(k.bytes, k.len, nullptr, 64);
  s.set_psdt(nvme::kPsdtSglContiguous);
  s.dptr.sgl.address = reinterpret_cast<uint64_t>(v.data());
  s.dptr.sgl.length = 32;
  EXPECT_EQ(client_->execute(s).status, Status::kDataTransferError);
  s.dptr.sgl.length = 64;
  EXPECT_TRUE(client_->execute(s).ok());
  // None of it broke the controller.
  std::vector<std::byte> out;
  ASSERT_TRUE(client_->get(k, out).ok());
  EXPECT_TRUE(out == v);
}

TEST_P(Semantics, StrictRegionsRejectUnregisteredMemory) {
  QueueOptions qo;
  qo.strict_regions = true;
  open_client({}, qo);
  if (!client_) return;
  auto v = random_bytes(4096, 11);
  Key k = key("strict");
  EXPECT_EQ(client_->put(k, v).status, Status::kDataTransferError);
  Controller* ctl = client_->controller();
  ASSERT_TRUE(ctl->register_memory(v.data(), v.size(), MemKind::kHost));
  EXPECT_FALSE(ctl->register_memory(v.data() + 10, 10, MemKind::kHost)) << "overlap accepted";
  EXPECT_TRUE(client_->put(k, v).ok());
  // A range running one byte past the region is refused.
  EXPECT_EQ(client_->execute(cmd::store(k.bytes, k.len, v.data() + 1, 4096)).status,
            Status::kDataTransferError);
  std::vector<std::byte> out(4096);
  EXPECT_EQ(client_->get(k, std::span(out)).status, Status::kDataTransferError);
  ASSERT_TRUE(ctl->register_memory(out.data(), out.size(), MemKind::kHost));
  ASSERT_TRUE(client_->get(k, std::span(out)).ok());
  EXPECT_TRUE(out == v);
  EXPECT_TRUE(ctl->unregister_memory(out.data()));
  EXPECT_EQ(client_->get(k, std::span(out)).status, Status::kDataTransferError);
}

TEST_P(Semantics, DeviceMemoryWithoutAGpuEngineIsATransferError) {
  auto v = random_bytes(1024, 12);
  std::vector<std::byte> fake_device(1024);
  ASSERT_TRUE(client_->put(key("dev"), v).ok());
  ASSERT_TRUE(client_->controller()->register_memory(fake_device.data(), 1024, MemKind::kDevice));
  EXPECT_EQ(client_->get(key("dev"), std::span(fake_device)).status, Status::kDataTransferError);
  EXPECT_EQ(client_->put(key("dev2"), fake_device).status, Status::kDataTransferError);
  EXPECT_EQ(client_->exists(key("dev2")).status, Status::kKeyNotExist);
}

TEST_P(Semantics, ConcurrentClientsThroughOneQueue) {
  constexpr int kThreads = 4, kOps = 300;
  std::atomic<int> failures{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      for (int i = 0; i < kOps; ++i) {
        Key k = key("c", t, i);
        auto v = random_bytes(100 + i, t * 1000 + i);
        if (!client_->put(k, v).ok()) ++failures;
        std::vector<std::byte> out;
        if (!client_->get(k, out).ok() || out != v) ++failures;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST_P(Semantics, BatchedCommands) {
  constexpr int kN = 500;
  std::vector<std::vector<std::byte>> values;
  std::vector<Key> keys;
  std::vector<nvme::Sqe> sqes;
  for (int i = 0; i < kN; ++i) {
    keys.push_back(key("b", i));
    values.push_back(random_bytes(64 + i % 200, i));
  }
  for (int i = 0; i < kN; ++i) {
    sqes.push_back(cmd::store(keys[i].bytes, keys[i].len, values[i].data(),
                              static_cast<uint32_t>(values[i].size())));
  }
  std::vector<CmdResult> results(kN);
  client_->run_batch(sqes, results);
  for (auto& r : results) ASSERT_TRUE(r.ok()) << describe(r);
  std::vector<std::vector<std::byte>> outs(kN, std::vector<std::byte>(300));
  sqes.clear();
  for (int i = 0; i < kN; ++i) {
    sqes.push_back(cmd::retrieve(keys[i].bytes, keys[i].len, outs[i].data(), 300));
  }
  client_->run_batch(sqes, results);
  for (int i = 0; i < kN; ++i) {
    ASSERT_TRUE(results[i].ok());
    ASSERT_EQ(results[i].dw0, values[i].size());
    ASSERT_EQ(0, std::memcmp(outs[i].data(), values[i].data(), values[i].size()));
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, Semantics, ::testing::ValuesIn(test::backend_kinds()),
                         [](const auto& info) { return info.param; });

// Memory-backend only: a Store larger than the whole capacity gets 81h and changes nothing; a
// Store that fits but would pass capacity evicts the least recently used value (the backend
// evicts like a cache; before, this Store got 81h).
TEST(MemoryBackend, CapacityExceededAndEviction) {
  MemoryBackendOptions mo;
  mo.capacity_bytes = 10000;
  auto client = Client::open(make_memory_backend(mo)).value();
  auto v = random_bytes(6000, 1);
  ASSERT_TRUE(client->put(key("one"), v).ok());
  EXPECT_EQ(client->put(key("big"), random_bytes(10000, 2)).status, Status::kCapacityExceeded);
  EXPECT_EQ(client->exists(key("big")).status, Status::kKeyNotExist);
  EXPECT_TRUE(client->exists(key("one")).ok());
  ASSERT_TRUE(client->put(key("two"), v).ok());
  EXPECT_EQ(client->exists(key("one")).status, Status::kKeyNotExist);  // evicted
  std::vector<std::byte> out(6000);
  auto r = client->get(key("two"), out);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(out, v);
  // Only the two Stores the backend took count as stored bytes.
  MetricList m;
  client->controller()->collect(m);
  double stored = 0;
  for (const Metric& x : m) {
    if (x.name == "value_bytes_in_total") stored += x.value;
  }
  EXPECT_EQ(stored, 12000.0);
}

// Per backend namespace: Retrieves that found their key (hits) and that did not (misses), and
// the value bytes of successful Stores; a namespace nobody used reports nothing.
TEST(Controller, CountsHitsMissesAndBytesWrittenPerNamespace) {
  ClientOptions co;
  co.controller.namespaces = 3;
  auto client = Client::open(make_memory_backend(), co).value();
  ASSERT_TRUE(client->put(key("a"), random_bytes(100, 1), 0, 1).ok());
  ASSERT_TRUE(client->put(key("a"), random_bytes(300, 2), 0, 3).ok());
  ASSERT_TRUE(client->put(key("b"), random_bytes(50, 3), 0, 3).ok());
  EXPECT_EQ(client->put(key("c"), random_bytes(70, 3), nvme::kStoreMustExist, 3).status,
            Status::kKeyNotExist);  // not stored: not counted
  std::vector<std::byte> out(300);
  EXPECT_TRUE(client->get(key("a"), out, 3).ok());
  EXPECT_TRUE(client->get(key("b"), out, 3).ok());
  EXPECT_EQ(client->get(key("b"), out, 1).status, Status::kKeyNotExist);
  EXPECT_EQ(client->get(key("zz"), out, 1).status, Status::kKeyNotExist);
  EXPECT_EQ(client->get(key("zz"), out, 3).status, Status::kKeyNotExist);
  MetricList m;
  client->controller()->collect(m);
  std::map<std::string, double> got;
  for (const Metric& x : m) {
    if (x.name != "namespace_hits_total" && x.name != "namespace_misses_total" &&
        x.name != "namespace_written_bytes_total") {
      continue;
    }
    ASSERT_EQ(x.labels.size(), 1u);
    got[x.name + "/" + x.labels[0].second] = x.value;
  }
  const std::map<std::string, double> want = {{"namespace_hits_total/1", 0},
                                              {"namespace_misses_total/1", 2},
                                              {"namespace_written_bytes_total/1", 100},
                                              {"namespace_hits_total/3", 2},
                                              {"namespace_misses_total/3", 1},
                                              {"namespace_written_bytes_total/3", 350}};
  EXPECT_EQ(got, want);
}

// The largest value is one number: a local store with 1 MiB segments takes values up to 1 MiB
// minus two 4 KiB blocks, and the controller over it enforces (and reports in options(), which
// Identify reads) that limit, not its own default of 64 MiB. A backend without a limit of its own
// leaves the controller's.
TEST(Controller, LargestValueIsTheBackendsWhenSmaller) {
  test::BackendFixture store;
  auto local = store.open("local", 16 << 20, 1 << 20);
  const uint64_t max = local->info().max_value_bytes;
  EXPECT_EQ(max, (1u << 20) - 8192);
  {
    auto client = Client::open(local).value();
    EXPECT_EQ(client->controller()->options().max_value_bytes, max);
    EXPECT_TRUE(client->put(key("fits"), random_bytes(max, 3)).ok());
    EXPECT_EQ(client->put(key("too-big"), random_bytes(max + 1, 4)).status,
              Status::kInvalidValueSize);
    EXPECT_EQ(client->exists(key("too-big")).status, Status::kKeyNotExist);
    // A smaller configured limit stays.
    ClientOptions co;
    co.controller.max_value_bytes = 4096;
    auto small = Client::open(local, co).value();
    EXPECT_EQ(small->controller()->options().max_value_bytes, 4096u);
  }
  auto memory = Client::open(make_memory_backend()).value();
  EXPECT_EQ(memory->controller()->options().max_value_bytes, ControllerOptions{}.max_value_bytes);
}

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
}

// An idle reactor stays asleep: a sleep that timed out, and a look that found nothing, lead
// straight to the next sleep, not to another idle spin. With a 2 ms idle spin, a reactor that
// spun after each 5 ms sleep timeout would use 40% of a core while nothing happens.
TEST(Controller, AnIdleReactorSleepsWithoutSpinning) {
  ClientOptions co;
  co.controller.idle_spin_us = 2000;
  auto client = Client::open(make_memory_backend(), co).value();
  ASSERT_TRUE(client->put(key("wake"), random_bytes(16, 1)).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // past the spin: asleep
  const double cpu0 = process_cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double share = (process_cpu_seconds() - cpu0) / wall;
  EXPECT_LT(share, 0.1) << "reactors used " << share << " of a core while idle";
  // And a call after the quiet still wakes it.
  EXPECT_TRUE(client->exists(key("wake")).ok());
}

// A backend that holds every op until the test releases them.
class GateBackend final : public Backend {
 public:
  void submit(BackendOp* op) override {
    std::lock_guard lk(mu_);
    held_.push_back(op);
  }
  BackendInfo info() const override { return {"gate"}; }
  size_t held() {
    std::lock_guard lk(mu_);
    return held_.size();
  }
  void release_all() {
    std::vector<BackendOp*> ops;
    {
      std::lock_guard lk(mu_);
      ops.swap(held_);
    }
    // Complete from this (foreign) thread, as librados or io_uring threads would.
    for (BackendOp* op : ops) op->complete(Status::kKeyNotExist);
  }

 private:
  std::mutex mu_;
  std::vector<BackendOp*> held_;
};

// A pending backend op never blocks its reactor: every command reaches the backend before any
// completes, completions from a foreign thread come back, and a full queue pushes back.
TEST(Controller, PendingBackendWorkDoesNotBlockTheReactor) {
  auto gate = std::make_shared<GateBackend>();
  ClientOptions co;
  co.queue.depth = 64;
  auto client = Client::open(gate, co).value();
  Key k = key("x");
  std::vector<uint16_t> cids;
  for (int i = 0; i < 63; ++i) cids.push_back(client->start(cmd::exist(k.bytes, k.len)).value());
  // depth - 1 commands in flight: the queue is full.
  EXPECT_FALSE(client->try_start(cmd::exist(k.bytes, k.len)).has_value());
  for (int spins = 0; gate->held() < 63 && spins < 100000; ++spins) std::this_thread::yield();
  ASSERT_EQ(gate->held(), 63u);
  EXPECT_EQ(client->controller()->in_flight(), 63u);
  for (uint16_t c : cids) EXPECT_FALSE(client->poll(c));
  gate->release_all();
  for (uint16_t c : cids) EXPECT_EQ(client->wait(c).status, Status::kKeyNotExist);
  auto again = client->try_start(cmd::exist(k.bytes, k.len));
  ASSERT_TRUE(again.has_value());
  for (int spins = 0; gate->held() < 1 && spins < 100000; ++spins) std::this_thread::yield();
  gate->release_all();
  EXPECT_EQ(client->wait(*again).status, Status::kKeyNotExist);
}

// ---- staged batches: the client's copies overlap the controller's work ----

// Stages into `slots` fixed stand-ins of `slot_bytes` each (no waiting: a full stager returns 0).
// Before handing out the stand-in of the k-th buffer sent to the controller (k >= 1) it waits for
// the backend to have received the Store of buffer k-1: a client that staged a whole batch before
// submitting any of it (two copies one after the other, where a pipeline overlaps them) never
// lets that happen, and the wait times out.
class PipelineStager final : public BufferStager {
 public:
  PipelineStager(size_t slots, size_t slot_bytes, std::function<uint64_t()> stores_seen)
      : slot_bytes_(slot_bytes),
        mem_(slots, std::vector<std::byte>(slot_bytes)),
        used_(slots, false),
        stores_seen_(std::move(stores_seen)) {}
  uint64_t acquire(const void* p, size_t len, bool to_controller, bool wait) override {
    (void)wait;
    if (len > slot_bytes_) return 0;
    size_t s = 0;
    while (s < used_.size() && used_[s]) ++s;
    if (s == used_.size()) return 0;
    if (to_controller) {
      if (sent_ > 0) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (stores_seen_() < sent_) {
          if (std::chrono::steady_clock::now() > until) {
            ++not_overlapped_;
            break;
          }
          std::this_thread::yield();
        }
      }
      ++sent_;
      std::memcpy(mem_[s].data(), p, len);
    }
    used_[s] = true;
    ++in_use_;
    max_in_use_ = std::max(max_in_use_, in_use_);
    return reinterpret_cast<uint64_t>(mem_[s].data());
  }
  void release(uint64_t addr, void* p, size_t copy_back) override {
    for (size_t s = 0; s < mem_.size(); ++s) {
      if (reinterpret_cast<uint64_t>(mem_[s].data()) != addr) continue;
      if (copy_back > 0) std::memcpy(p, mem_[s].data(), copy_back);
      used_[s] = false;
      --in_use_;
      return;
    }
    ADD_FAILURE() << "release of a stand-in never handed out";
  }
  uint64_t not_overlapped() const { return not_overlapped_; }
  size_t in_use() const { return in_use_; }
  size_t max_in_use() const { return max_in_use_; }

 private:
  size_t slot_bytes_;
  std::vector<std::vector<std::byte>> mem_;
  std::vector<bool> used_;
  std::function<uint64_t()> stores_seen_;
  uint64_t sent_ = 0;
  uint64_t not_overlapped_ = 0;
  size_t in_use_ = 0, max_in_use_ = 0;
};

// Counts the Stores that reach the memory backend.
class CountingStores final : public Backend {
 public:
  CountingStores() : inner_(make_memory_backend()) {}
  void submit(BackendOp* op) override {
    if (op->kind == BackendOpKind::kPut) stores_.fetch_add(1);
    inner_->submit(op);
  }
  BackendInfo info() const override { return inner_->info(); }
  uint64_t stores() const { return stores_.load(); }

 private:
  std::shared_ptr<Backend> inner_;
  std::atomic<uint64_t> stores_{0};
};

TEST(StagedBatch, CopiesOverlapTheControllersWork) {
  auto backend = std::make_shared<CountingStores>();
  Controller ctl(backend, {});
  const QueueRef q = ctl.create_queue({}).value();
  constexpr int kN = 12;
  constexpr size_t kValue = 1 << 20;  // above the pipeline's group size: one Store per group
  PipelineStager stager(kN, kValue, [&] { return backend->stores(); });
  {
    Client client(q, nullptr, &ctl, &stager);
    std::vector<Key> keys;
    std::vector<std::vector<std::byte>> values;
    std::vector<BatchItem> items(kN);
    for (int i = 0; i < kN; ++i) {
      keys.push_back(key("staged", i));
      values.push_back(random_bytes(kValue - static_cast<size_t>(i) * 1000, 100 + i));
      items[i] = BatchItem{cmd::store(keys[i].bytes, keys[i].len, values[i].data(),
                                      static_cast<uint32_t>(values[i].size())),
                           values[i].data(),
                           values[i].size(),
                           true,
                           {}};
    }
    client.execute_batch(items);
    for (auto& it : items) ASSERT_TRUE(it.result.ok()) << describe(it.result);
    EXPECT_EQ(stager.not_overlapped(), 0u) << "the batch was staged whole before it was submitted";
    EXPECT_EQ(stager.in_use(), 0u);
    EXPECT_EQ(client.copies().copies, uint64_t{kN});
    // Gets into plain buffers: each value copied back as its completion arrives, all exact.
    std::vector<std::vector<std::byte>> outs(kN, std::vector<std::byte>(kValue));
    for (int i = 0; i < kN; ++i) {
      items[i] = BatchItem{
          cmd::retrieve(keys[i].bytes, keys[i].len, outs[i].data(), static_cast<uint32_t>(kValue)),
          outs[i].data(),
          kValue,
          false,
          {}};
    }
    client.execute_batch(items);
    for (int i = 0; i < kN; ++i) {
      ASSERT_TRUE(items[i].result.ok()) << describe(items[i].result);
      ASSERT_EQ(items[i].result.dw0, values[i].size());
      ASSERT_EQ(0, std::memcmp(outs[i].data(), values[i].data(), values[i].size()));
    }
    EXPECT_EQ(stager.in_use(), 0u);
  }
  ctl.stop();
}

// Fewer stand-ins than items: the batch runs in turns as completions free them, a buffer no
// stand-in can hold fails alone with 81h, and every other value is exact.
TEST(StagedBatch, MoreItemsThanStagingMemory) {
  auto backend = std::make_shared<CountingStores>();
  Controller ctl(backend, {});
  const QueueRef q = ctl.create_queue({}).value();
  PipelineStager stager(3, 64 << 10, [&] { return ~uint64_t{0}; });
  {
    Client client(q, nullptr, &ctl, &stager);
    constexpr int kN = 20;
    std::vector<Key> keys;
    std::vector<std::vector<std::byte>> values;
    std::vector<BatchItem> items(kN);
    for (int i = 0; i < kN; ++i) {
      keys.push_back(key("turns", i));
      values.push_back(random_bytes(i == 7 ? (64 << 10) + 1 : 1000 + i * 3000, 300 + i));
      items[i] = BatchItem{cmd::store(keys[i].bytes, keys[i].len, values[i].data(),
                                      static_cast<uint32_t>(values[i].size())),
                           values[i].data(),
                           values[i].size(),
                           true,
                           {}};
    }
    client.execute_batch(items);
    for (int i = 0; i < kN; ++i) {
      if (i == 7) {
        EXPECT_EQ(items[i].result.status, kStagingExhausted);
      } else {
        ASSERT_TRUE(items[i].result.ok()) << i << ": " << describe(items[i].result);
      }
    }
    EXPECT_LE(stager.max_in_use(), 3u);
    EXPECT_EQ(stager.in_use(), 0u);
    std::vector<std::vector<std::byte>> outs(kN, std::vector<std::byte>(60000));
    for (int i = 0; i < kN; ++i) {
      items[i] = BatchItem{cmd::retrieve(keys[i].bytes, keys[i].len, outs[i].data(), 60000),
                           outs[i].data(),
                           60000,
                           false,
                           {}};
    }
    client.execute_batch(items);
    for (int i = 0; i < kN; ++i) {
      if (i == 7) {
        EXPECT_EQ(items[i].result.status, Status::kKeyNotExist);
        continue;
      }
      ASSERT_TRUE(items[i].result.ok()) << describe(items[i].result);
      ASSERT_EQ(items[i].result.dw0, values[i].size());
      ASSERT_EQ(0, std::memcmp(outs[i].data(), values[i].data(), values[i].size()));
    }
    EXPECT_EQ(stager.in_use(), 0u);
  }
  ctl.stop();
}

// ---- whole values in one command ----

// Retrieve commands the controller completed, over its reactors.
double retrieves(const Controller& ctl) {
  MetricList m;
  ctl.collect(m);
  double n = 0;
  for (const Metric& x : m) {
    for (const auto& [label, value] : x.labels) {
      if (x.name == "commands_total" && label == "op" && value == "retrieve") n += x.value;
    }
  }
  return n;
}

// get(vector) and get_value read a value of any length with one Retrieve (before, a value over
// the 64 KiB hint cost two), byte-exact from 0 bytes to the controller's largest.
TEST(WholeValueGet, OneRetrieveWhateverTheLength) {
  ClientOptions o;
  o.controller.max_value_bytes = 4u << 20;
  auto client = Client::open(make_memory_backend(), o).value();
  EXPECT_EQ(client->max_value_bytes(), 4u << 20);
  uint32_t seed = 7;
  for (size_t n : {size_t{0}, size_t{1}, size_t{4096}, size_t{(64 << 10) + 1}, size_t{2 << 20},
                   size_t{4 << 20}}) {
    const Key k = key("whole-", static_cast<int>(n));
    const auto v = random_bytes(n, seed++);
    ASSERT_TRUE(client->put(k, v).ok()) << n;
    double before = retrieves(*client->controller());
    std::vector<std::byte> out(3, std::byte{1});
    CmdResult r = client->get(k, out);
    ASSERT_TRUE(r.ok()) << describe(r);
    EXPECT_EQ(r.dw0, n);
    EXPECT_TRUE(out == v) << "value of " << n << " bytes differs";
    EXPECT_EQ(retrieves(*client->controller()) - before, 1.0) << n << " bytes";
    before = retrieves(*client->controller());
    ReceivedValue rv;
    r = client->get_value(k, rv);
    ASSERT_TRUE(r.ok()) << describe(r);
    ASSERT_EQ(rv.size(), n);
    EXPECT_TRUE(n == 0 || std::memcmp(rv.data(), v.data(), n) == 0) << n;
    EXPECT_EQ(retrieves(*client->controller()) - before, 1.0) << n << " bytes";
  }
  std::vector<std::byte> out(5);
  EXPECT_EQ(client->get(key("missing"), out).status, Status::kKeyNotExist);
  EXPECT_TRUE(out.empty());
  ReceivedValue rv;
  EXPECT_EQ(client->get_value(key("missing"), rv).status, Status::kKeyNotExist);
  EXPECT_EQ(rv.size(), 0u);
}

// get_values: one Retrieve per key when the values are as long as the last ones seen (uniform
// KV blocks), one more for each key longer than that; missing keys 87h; every value exact.
TEST(WholeValueGet, ManyKeysOneRetrieveEach) {
  ClientOptions o;
  o.controller.max_value_bytes = 4u << 20;
  auto client = Client::open(make_memory_backend(), o).value();
  constexpr int kN = 64;
  std::vector<Key> keys;
  std::vector<std::vector<std::byte>> values;
  for (int i = 0; i < kN; ++i) {
    keys.push_back(key("many-", i));
    values.push_back(random_bytes((2 << 20) - (i == kN - 1 ? 1000 : 0), 100 + i));
    if (i != 5) {
      ASSERT_TRUE(client->put(keys[i], values[i]).ok());
    }
  }
  auto check = [&](std::span<const Key> ks, int first, int missing) {
    std::vector<int> seen(ks.size(), 0);
    client->get_values(ks, 1, [&](size_t i, const CmdResult& r, ReceivedValue& v) {
      ++seen[i];
      const int at = first + static_cast<int>(i);
      if (at == missing) {
        EXPECT_EQ(r.status, Status::kKeyNotExist);
        return;
      }
      ASSERT_TRUE(r.ok()) << at << ": " << describe(r);
      ASSERT_EQ(v.size(), values[at].size());
      EXPECT_EQ(0, std::memcmp(v.data(), values[at].data(), v.size())) << at;
    });
    for (int s : seen) EXPECT_EQ(s, 1);
  };
  // Nothing learned yet: buffers of the largest value.
  double before = retrieves(*client->controller());
  check(keys, 0, 5);
  EXPECT_EQ(retrieves(*client->controller()) - before, kN);
  // Learned: the last batch's largest length fits them all.
  before = retrieves(*client->controller());
  check(keys, 0, 5);
  EXPECT_EQ(retrieves(*client->controller()) - before, kN);
  // Learned a shorter one (the last key alone): the longer values are read once more each.
  check(std::span(keys).subspan(kN - 1), kN - 1, -1);
  before = retrieves(*client->controller());
  check(std::span(keys).first(8), 0, 5);
  EXPECT_EQ(retrieves(*client->controller()) - before, 8 + 7);
}

}  // namespace
}  // namespace gdkv
