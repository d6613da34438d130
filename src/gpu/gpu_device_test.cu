// GPU test of the device API against an in-process controller with the CUDA copy engine:
// thousands of concurrent thread- and warp-level puts and gets of random values, poisoned
// destinations with every byte compared on the host, exists/delete, short buffers, the split
// submit/wait API, pinned host destinations, and out-of-range pointers refused with a status.
// Runs against the memory backend (pageable values: the engine's staging path) and a pinned
// backend (direct DMA path). Every CUDA call is checked.
//
// Exit status: 0 all passed, 1 a check failed, 2 a kernel hung, 77 no GPU ("skipped: no GPU").
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "gdkv/controller.h"
#include "gdkv/device.cuh"
#include "gdkv/gpu_runtime.h"
#include "gpu/cuda_check.h"
#include "gpu_common.h"

#define CK(call) ::gdkv::gpu::check((call), #call)

namespace gdkv::gpu {
namespace {

using nvme::Status;

constexpr uint32_t kItems = 8192;       // concurrent requests per kernel
constexpr uint32_t kMaxValue = 8192;    // bytes
constexpr uint32_t kSlack = 128;        // poisoned bytes after each destination slot
constexpr uint32_t kBlock = 128;        // threads per block (whole warps)
constexpr double kKernelTimeout = 120;  // seconds
constexpr unsigned char kPoison = 0xA5;

struct Item {
  Key key;
  uint64_t off;  // offset of the value in the source arena and of its slot in the destination
  uint32_t len;
};

struct Queues {
  QueueRef q[4];
  uint32_t n;
};

// kWarpBranches: a divergent if, each side a warp group of its own lanes (odd / even masks).
// kWarpOdd: only the odd lanes call; the even lanes leave the kernel first.
enum class Mode : int { kThread, kWarp, kWarpBranches, kWarpOdd };
constexpr uint64_t kOddLanes = 0xAAAAAAAAu;
constexpr uint64_t kEvenLanes = 0x55555555u;
enum class Op : int { kPut, kGet, kShortGet, kExists, kDelete, kPutMustNotExist };

__device__ nvme::Sqe make(Op op, const Item& it, const std::byte* src, std::byte* dst) {
  switch (op) {
    case Op::kPut:
      return device::make_store(it.key, src + it.off, it.len);
    case Op::kPutMustNotExist:
      return device::make_store(it.key, src + it.off, it.len, nvme::kStoreMustNotExist);
    case Op::kGet:
      return device::make_retrieve(it.key, dst + it.off, it.len + kSlack / 2);
    case Op::kShortGet:
      return device::make_retrieve(it.key, dst + it.off, it.len / 2);
    case Op::kExists:
      return device::make_exist(it.key);
    case Op::kDelete:
      break;
  }
  return device::make_delete(it.key);
}

// One request per thread; `filter` = 2 runs only even items (the rest stay inactive lanes).
__global__ void run_kernel(Queues qs, Mode mode, Op op, const Item* items, uint32_t n,
                           const std::byte* src, std::byte* dst, uint32_t filter, CmdResult* out) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  const QueueRef& q = qs.q[blockIdx.x % qs.n];
  const bool active = i < n && (filter != 2 || i % 2 == 0);
  const Item it = i < n ? items[i] : Item{};
  const nvme::Sqe sqe = make(op, it, src, dst);
  const bool odd = (threadIdx.x % 32) & 1;
  CmdResult r{};
  switch (mode) {
    case Mode::kThread:
      if (active) out[i] = device::execute(q, sqe);
      return;
    case Mode::kWarp:
      r = device::warp_execute(q, sqe, active, device::kFullWarp);
      break;
    case Mode::kWarpBranches:
      if (odd) {
        r = device::warp_execute(q, sqe, active, kOddLanes);
      } else {
        r = device::warp_execute(q, sqe, active, kEvenLanes);
      }
      break;
    case Mode::kWarpOdd:
      if (!odd) return;  // the even lanes submit nothing
      r = device::warp_execute(q, sqe, active, kOddLanes);
      break;
  }
  if (active) out[i] = r;
}

// The split API: each thread keeps up to 4 gets in flight, waiting for its oldest when the queue
// pushes back (never blocking for a credit while holding ids).
__global__ void split_kernel(QueueRef q, const Item* items, uint32_t n, std::byte* dst,
                             CmdResult* out) {
  constexpr uint32_t kPer = 4;
  const uint32_t first = (blockIdx.x * blockDim.x + threadIdx.x) * kPer;
  uint16_t cids[kPer];
  uint32_t idx[kPer];
  uint32_t head = 0, tail = 0;  // in flight: [head, tail)
  for (uint32_t j = 0; j < kPer && first + j < n; ++j) {
    const Item it = items[first + j];
    const nvme::Sqe sqe = device::make_retrieve(it.key, dst + it.off, it.len + kSlack / 2);
    while (!device::try_submit(q, sqe, &cids[tail % kPer])) {
      if (head == tail) continue;
      out[idx[head % kPer]] = device::wait(q, cids[head % kPer]);
      ++head;
    }
    idx[tail % kPer] = first + j;
    ++tail;
  }
  for (; head != tail; ++head) out[idx[head % kPer]] = device::wait(q, cids[head % kPer]);
}

int g_failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok && ++g_failures <= 20) std::fprintf(stderr, "FAIL: %s\n", what.c_str());
}

class Fixture {
 public:
  Fixture(std::shared_ptr<Backend> backend, const char* name) : name_(name) {
    ControllerOptions o;
    o.reactors = 2;
    ctl_ = std::make_unique<Controller>(std::move(backend), controller_options(o));
    for (int i = 0; i < 2; ++i) {
      DeviceQueueOptions qo;
      qo.queue.depth = 1024;
      queues_.push_back(std::make_unique<DeviceQueue>(*ctl_, qo));
    }
    qs_.n = 2;
    for (uint32_t i = 0; i < qs_.n; ++i) qs_.q[i] = queues_[i]->ref();
    arena_ = size_t{kItems} * (kMaxValue + kSlack);
    CK(cudaMalloc(&src_, arena_));
    CK(cudaMalloc(&dst_, arena_));
    CK(cudaMalloc(&items_d_, sizeof(Item) * kItems));
    CK(cudaMalloc(&out_d_, sizeof(CmdResult) * kItems));
    CK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    regs_.push_back(std::make_unique<Registration>(*ctl_, src_, arena_, MemKind::kDevice));
    regs_.push_back(std::make_unique<Registration>(*ctl_, dst_, arena_, MemKind::kDevice));
  }
  ~Fixture() {
    regs_.clear();
    queues_.clear();
    ctl_.reset();
    cudaStreamDestroy(stream_);
    cudaFree(src_);
    cudaFree(dst_);
    cudaFree(items_d_);
    cudaFree(out_d_);
  }

  // Random values with random lengths under keys "<tag>-<i>", uploaded to the source arena.
  void make_items(const char* tag, uint64_t seed) {
    items_.resize(kItems);
    host_src_.assign(arena_, std::byte{0});
    for (uint32_t i = 0; i < kItems; ++i) {
      Item& it = items_[i];
      it.key = item_key(tag, i);
      it.off = uint64_t{i} * (kMaxValue + kSlack);
      it.len = 1 + static_cast<uint32_t>((seed * 2654435761u + i * 40503u) % kMaxValue);
      fill_random(host_src_.data() + it.off, it.len, seed * 100003 + i);
    }
    CK(cudaMemcpy(src_, host_src_.data(), arena_, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(items_d_, items_.data(), sizeof(Item) * kItems, cudaMemcpyHostToDevice));
  }

  std::vector<CmdResult> run(Mode mode, Op op, uint32_t filter = 1) {
    CK(cudaMemsetAsync(out_d_, 0xFF, sizeof(CmdResult) * kItems, stream_));
    run_kernel<<<kItems / kBlock, kBlock, 0, stream_>>>(qs_, mode, op, items_d_, kItems, src_, dst_,
                                                        filter, out_d_);
    CK(cudaGetLastError());
    wait_stream(stream_, kKernelTimeout, "request kernel");
    return results();
  }

  std::vector<CmdResult> run_split() {
    CK(cudaMemsetAsync(out_d_, 0xFF, sizeof(CmdResult) * kItems, stream_));
    split_kernel<<<kItems / 4 / kBlock, kBlock, 0, stream_>>>(qs_.q[0], items_d_, kItems, dst_,
                                                              out_d_);
    CK(cudaGetLastError());
    wait_stream(stream_, kKernelTimeout, "split kernel");
    return results();
  }

  std::vector<CmdResult> results() {
    std::vector<CmdResult> r(kItems);
    CK(cudaMemcpy(r.data(), out_d_, sizeof(CmdResult) * kItems, cudaMemcpyDeviceToHost));
    return r;
  }

  void poison_dst() { CK(cudaMemset(dst_, kPoison, arena_)); }

  std::vector<std::byte> download_dst() {
    std::vector<std::byte> h(arena_);
    CK(cudaMemcpy(h.data(), dst_, arena_, cudaMemcpyDeviceToHost));
    return h;
  }

  // Every byte of every slot: the value's first `want(i)` bytes, then poison to the slot's end.
  template <class Want>
  void compare(const std::vector<std::byte>& h, Want want, const std::string& what) {
    uint32_t bad = 0;
    for (uint32_t i = 0; i < kItems; ++i) {
      const Item& it = items_[i];
      const uint32_t w = want(i);
      const std::byte* got = h.data() + it.off;
      bool ok = std::memcmp(got, host_src_.data() + it.off, w) == 0;
      for (uint32_t b = w; ok && b < kMaxValue + kSlack; ++b) {
        ok = got[b] == std::byte{kPoison};
      }
      if (!ok && ++bad <= 3) expect(false, what + ": bytes of item " + std::to_string(i));
    }
    expect(bad == 0, what + ": " + std::to_string(bad) + " items with wrong bytes");
  }

  void check_all(const std::vector<CmdResult>& r, const std::string& what, Status want,
                 uint32_t filter = 1, bool check_len = false) {
    uint32_t bad = 0;
    for (uint32_t i = 0; i < kItems; ++i) {
      if (filter == 2 && i % 2 != 0) continue;
      const bool ok = r[i].status == want && (!check_len || r[i].dw0 == items_[i].len);
      if (!ok && ++bad <= 3) {
        expect(false, what + ": item " + std::to_string(i) + " status " +
                          nvme::status_name(r[i].status) + " dw0 " + std::to_string(r[i].dw0));
      }
    }
    expect(bad == 0, what + ": " + std::to_string(bad) + " wrong results");
  }

  // The whole sequence for one mode.
  void exercise(Mode mode) {
    const char* level = mode == Mode::kThread ? " thread"
                        : mode == Mode::kWarp ? " warp"
                                              : " warp branches";
    const std::string m = std::string(name_) + level;
    const int seed = mode == Mode::kThread ? 11 : mode == Mode::kWarp ? 12 : 15;
    make_items(mode == Mode::kThread ? "t" : mode == Mode::kWarp ? "w" : "b", seed);
    const int before = g_failures;

    check_all(run(mode, Op::kPut), m + " put", Status::kSuccess);
    check_all(run(mode, Op::kPutMustNotExist), m + " put must-not-exist", Status::kKeyExists);

    poison_dst();
    check_all(run(mode, Op::kGet), m + " get", Status::kSuccess, 1, true);
    compare(
        download_dst(), [&](uint32_t i) { return items_[i].len; }, m + " get");

    poison_dst();
    check_all(run(mode, Op::kShortGet), m + " short get", Status::kSuccess, 1, true);
    compare(
        download_dst(), [&](uint32_t i) { return items_[i].len / 2; }, m + " short get");

    check_all(run(mode, Op::kExists), m + " exists", Status::kSuccess);
    check_all(run(mode, Op::kDelete, 2), m + " delete evens", Status::kSuccess, 2);
    std::vector<CmdResult> ex = run(mode, Op::kExists);
    uint32_t bad = 0;
    for (uint32_t i = 0; i < kItems; ++i) {
      bad += ex[i].status != (i % 2 ? Status::kSuccess : Status::kKeyNotExist);
    }
    expect(bad == 0, m + " exists after delete: " + std::to_string(bad) + " wrong");
    poison_dst();
    check_all(run(mode, Op::kGet, 2), m + " get deleted", Status::kKeyNotExist, 2);
    compare(
        download_dst(), [&](uint32_t) { return 0u; }, m + " get deleted leaves poison");

    if (mode == Mode::kWarpBranches) {
      // Only the odd lanes of each warp call (leader: lane 1); the even lanes' results stay unset.
      std::vector<CmdResult> odd = run(Mode::kWarpOdd, Op::kExists);
      uint32_t wrong = 0;
      for (uint32_t i = 0; i < kItems; ++i) {
        if (i % 2) {
          wrong += odd[i].status != Status::kSuccess;
        } else {
          wrong += static_cast<uint8_t>(odd[i].status) != 0xFF || odd[i].dw0 != 0xFFFFFFFFu;
        }
      }
      expect(wrong == 0, m + " odd lanes only: " + std::to_string(wrong) + " wrong");
    }

    std::printf("%s %s: %u requests per kernel\n", g_failures == before ? "PASS" : "FAIL",
                m.c_str(), kItems);
  }

  void exercise_split() {
    make_items("s", 13);
    const int before = g_failures;
    check_all(run(Mode::kThread, Op::kPut), std::string(name_) + " split setup", Status::kSuccess);
    poison_dst();
    check_all(run_split(), std::string(name_) + " split get", Status::kSuccess, 1, true);
    compare(
        download_dst(), [&](uint32_t i) { return items_[i].len; },
        std::string(name_) + " split get");
    std::printf("%s %s split API: 4 gets in flight per thread\n",
                g_failures == before ? "PASS" : "FAIL", name_);
  }

  // Per command, no pinned allocation and no pointer query for memory in a known region: Stores
  // from registered device memory stage in the reactor's pinned pool (both ends known), Retrieves
  // ask only about the backend's memory (in no region). 2 MiB Stores from device memory too.
  void exercise_per_command_costs() {
    make_items("c", 16);
    const int before = g_failures;
    const std::string n = name_;
    check_all(run(Mode::kThread, Op::kPut), n + " counters setup", Status::kSuccess);
    const uint64_t allocs = staging_allocations();
    uint64_t q0 = pointer_attribute_queries();
    check_all(run(Mode::kWarp, Op::kPut), n + " counted put", Status::kSuccess);
    const uint64_t put_queries = pointer_attribute_queries() - q0;
    expect(put_queries == 0, n + " put from registered device memory: " +
                                 std::to_string(put_queries) + " pointer queries (want 0)");
    poison_dst();
    q0 = pointer_attribute_queries();
    check_all(run(Mode::kWarp, Op::kGet), n + " counted get", Status::kSuccess, 1, true);
    const uint64_t get_queries = pointer_attribute_queries() - q0;
    expect(get_queries <= kItems, n + " get: " + std::to_string(get_queries) +
                                      " pointer queries for " + std::to_string(kItems) +
                                      " commands (want at most one each: the backend's end)");
    compare(
        download_dst(), [&](uint32_t i) { return items_[i].len; }, n + " counted get");

    // 2 MiB values stored from device memory and read back, three times over.
    constexpr uint32_t kBig = 32;
    constexpr uint32_t kBigLen = 2u << 20;
    fill_random(host_src_.data(), size_t{kBig} * kBigLen, 99);
    CK(cudaMemcpy(src_, host_src_.data(), size_t{kBig} * kBigLen, cudaMemcpyHostToDevice));
    std::vector<Item> big(kBig);
    for (uint32_t i = 0; i < kBig; ++i)
      big[i] = Item{item_key("big", i), uint64_t{i} * kBigLen, kBigLen};
    Item* big_d = nullptr;
    CK(cudaMalloc(&big_d, sizeof(Item) * kBig));
    CK(cudaMemcpy(big_d, big.data(), sizeof(Item) * kBig, cudaMemcpyHostToDevice));
    for (int round = 0; round < 3; ++round) {
      for (Op op : {Op::kPut, Op::kGet}) {
        if (op == Op::kGet) poison_dst();
        CK(cudaMemsetAsync(out_d_, 0xFF, sizeof(CmdResult) * kBig, stream_));
        run_kernel<<<1, kBig, 0, stream_>>>(qs_, Mode::kThread, op, big_d, kBig, src_, dst_, 1,
                                            out_d_);
        CK(cudaGetLastError());
        wait_stream(stream_, kKernelTimeout, "2 MiB kernel");
        std::vector<CmdResult> r(kBig);
        CK(cudaMemcpy(r.data(), out_d_, sizeof(CmdResult) * kBig, cudaMemcpyDeviceToHost));
        uint32_t bad = 0;
        for (const CmdResult& x : r) bad += !x.ok() || (op == Op::kGet && x.dw0 != kBigLen);
        expect(bad == 0, n + " 2 MiB " + (op == Op::kPut ? "put" : "get") + ": " +
                             std::to_string(bad) + " failed");
      }
      const std::vector<std::byte> h = download_dst();
      expect(std::memcmp(h.data(), host_src_.data(), size_t{kBig} * kBigLen) == 0,
             n + " 2 MiB get bytes");
    }
    CK(cudaFree(big_d));
    expect(staging_allocations() == allocs,
           n + " pinned staging allocations grew from " + std::to_string(allocs) + " to " +
               std::to_string(staging_allocations()) + " (want none per command)");
    std::printf(
        "%s %s per-command costs: %lu pointer queries for %u puts, %lu for %u gets, "
        "%lu pinned staging allocations in all\n",
        g_failures == before ? "PASS" : "FAIL", name_, static_cast<unsigned long>(put_queries),
        kItems, static_cast<unsigned long>(get_queries), kItems,
        static_cast<unsigned long>(staging_allocations()));
  }

  // Destinations outside registered memory get 04h and stay untouched; a registered pinned host
  // buffer receives values straight from the GPU-issued command.
  void exercise_regions() {
    make_items("r", 14);
    const int before = g_failures;
    check_all(run(Mode::kThread, Op::kPut), std::string(name_) + " regions setup",
              Status::kSuccess);
    std::byte* unregistered = nullptr;
    CK(cudaMalloc(&unregistered, 1 << 20));
    CK(cudaMemset(unregistered, kPoison, 1 << 20));
    void* pinned = alloc_mapped(1 << 20);
    if (pinned == nullptr) throw std::runtime_error("alloc_mapped failed");
    std::memset(pinned, kPoison, 1 << 20);
    auto pinned_reg = std::make_unique<Registration>(*ctl_, pinned, 1 << 20, MemKind::kHost);

    // Item 0..2: into unregistered device memory; across the end of dst; into pinned memory.
    std::vector<Item> probe = {items_[0], items_[1], items_[2]};
    probe[0].off = 0;
    probe[1].off = arena_ - probe[1].len / 2;
    probe[2].off = 0;
    Item* probe_d = nullptr;
    CK(cudaMalloc(&probe_d, sizeof(Item) * 3));
    CK(cudaMemcpy(probe_d, probe.data(), sizeof(Item) * 3, cudaMemcpyHostToDevice));
    auto get_one = [&](const Item* it, std::byte* base) {
      run_kernel<<<1, 32, 0, stream_>>>(qs_, Mode::kThread, Op::kGet, it, 1, src_, base, 1, out_d_);
      CK(cudaGetLastError());
      wait_stream(stream_, kKernelTimeout, "region kernel");
      CmdResult r{};
      CK(cudaMemcpy(&r, out_d_, sizeof(r), cudaMemcpyDeviceToHost));
      return r;
    };
    CmdResult r = get_one(probe_d, unregistered);
    expect(r.status == Status::kDataTransferError,
           std::string(name_) +
               " get into unregistered device memory: " + nvme::status_name(r.status));
    r = get_one(probe_d + 1, dst_);
    expect(r.status == Status::kDataTransferError,
           std::string(name_) + " get across the end of a region: " + nvme::status_name(r.status));
    std::vector<std::byte> h(1 << 20);
    CK(cudaMemcpy(h.data(), unregistered, 1 << 20, cudaMemcpyDeviceToHost));
    bool untouched = true;
    for (std::byte b : h) untouched &= b == std::byte{kPoison};
    expect(untouched, std::string(name_) + " unregistered memory untouched");

    auto* pinned_dev = static_cast<std::byte*>(device_pointer(pinned));
    r = get_one(probe_d + 2, pinned_dev);
    const auto* p = static_cast<const std::byte*>(pinned);
    expect(r.ok() && r.dw0 == probe[2].len &&
               std::memcmp(p, host_src_.data() + items_[2].off, probe[2].len) == 0 &&
               p[probe[2].len] == std::byte{kPoison},
           std::string(name_) + " get into registered pinned host memory");
    CK(cudaFree(probe_d));
    CK(cudaFree(unregistered));
    pinned_reg.reset();
    free_mapped(pinned);
    std::printf("%s %s registered regions: out-of-range refused, pinned host destination\n",
                g_failures == before ? "PASS" : "FAIL", name_);
  }

 private:
  const char* name_;
  std::unique_ptr<Controller> ctl_;
  std::vector<std::unique_ptr<DeviceQueue>> queues_;
  std::vector<std::unique_ptr<Registration>> regs_;
  Queues qs_{};
  size_t arena_ = 0;
  std::byte* src_ = nullptr;
  std::byte* dst_ = nullptr;
  Item* items_d_ = nullptr;
  CmdResult* out_d_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::vector<Item> items_;
  std::vector<std::byte> host_src_;
};

int run_all() {
  std::printf("device: %s\n", device_description(0).c_str());
  {
    Fixture f(make_memory_backend(), "memory backend");
    f.exercise(Mode::kThread);
    f.exercise(Mode::kWarp);
    f.exercise(Mode::kWarpBranches);
    f.exercise_split();
    f.exercise_regions();
    f.exercise_per_command_costs();
  }
  {
    Fixture f(make_pinned_backend(size_t{1} << 30), "pinned backend");
    f.exercise(Mode::kThread);
    f.exercise(Mode::kWarp);
    f.exercise(Mode::kWarpBranches);
    f.exercise_split();
    f.exercise_regions();
    f.exercise_per_command_costs();
  }
  std::printf("%s: %d failure(s)\n", g_failures == 0 ? "PASS" : "FAIL", g_failures);
  return g_failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace gdkv::gpu

int main() {
  if (gdkv::gpu::device_count() == 0) {
    std::printf("skipped: no GPU\n");
    return gdkv::gpu::kSkipped;
  }
  try {
    return gdkv::gpu::run_all();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: %s\n", e.what());
    return 1;
  }
}
