// GPU-initiated request benchmarks (run by scripts/gpu-check):
//   - cudaMemcpy pinned host→device peak, measured first, the reference for what follows;
//   - cached 4 KiB Retrieve issued by GPU threads: latency p50/p99 (one thread, globaltimer) and
//     throughput (many warps, thread- and warp-level);
//   - 2 MiB Retrieve GB/s against that peak;
//   - loading the KV cache of 8K and 32K tokens of a Llama-3-8B-shaped model (32 layers, 8 KV heads
//     of 128, bf16: 128 KiB per token) from gdkv into GPU memory, as contiguous 2 MiB blocks of 16
//     tokens and scattered into per-layer slots (Scatter Retrieve);
//   - with --prefill-approx: a CUDA-only approximation of the prefill time (cuBLAS GEMMs), for
//     machines without PyTorch.
// "Cached" = served from pinned host memory (a pinned backend standing in for the host cache's
// pinned slabs), so the copy engine DMAs straight from it.
//
// Writes "name value unit" lines to --out. Exit 0, 1 on a failed check, 77 without a GPU.
#include <cuda_bf16.h>
#if defined(GDKV_HAVE_CUBLAS)
#include <cublas_v2.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
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

constexpr uint32_t kSmall = 4096;
constexpr uint32_t kSmallKeys = 4096;
constexpr uint32_t kBig = 2u << 20;  // 2 MiB: one block of 16 tokens × 128 KiB
constexpr uint32_t kLayers = 32;
constexpr uint32_t kLayerBytes = kBig / kLayers;  // K and V of 16 tokens of one layer: 64 KiB
constexpr uint32_t kTokensPerBlock = 16;
constexpr uint32_t kQueues = 4;
constexpr double kTimeout = 300;

struct Queues {
  QueueRef q[kQueues];
  uint32_t n;
};

struct Result {
  std::string name;
  double value;
  std::string unit;
};

__device__ inline uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One thread, `iters` dependent gets: the latency of each.
__global__ void latency_kernel(QueueRef q, const Key* keys, uint32_t nkeys, std::byte* dst,
                               uint32_t len, uint32_t iters, uint64_t* ns,
                               unsigned long long* errors) {
  for (uint32_t i = 0; i < iters; ++i) {
    const Key& k = keys[(i * 2654435761u) % nkeys];
    const uint64_t t0 = globaltimer();
    const CmdResult r = device::get(q, k, dst, len);
    const uint64_t t1 = globaltimer();
    ns[i] = t1 - t0;
    if (!r.ok() || r.dw0 != len) atomicAdd(errors, 1ull);
  }
}

// Every thread: `per_thread` gets of `len` bytes into its own slot.
__global__ void throughput_kernel(Queues qs, bool warp, const Key* keys, uint32_t nkeys,
                                  std::byte* dst, uint32_t len, uint32_t per_thread,
                                  unsigned long long* errors) {
  const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
  const QueueRef& q = qs.q[blockIdx.x % qs.n];
  std::byte* mine = dst + size_t{tid} * len;
  for (uint32_t j = 0; j < per_thread; ++j) {
    const Key& k = keys[(tid * 7919u + j * 104729u) % nkeys];
    // Every lane of the warp runs this loop the same number of times: the whole warp is the group.
    const CmdResult r = warp ? device::warp_get(q, k, mine, len, true, 1, device::kFullWarp)
                             : device::get(q, k, mine, len);
    if (!r.ok() || r.dw0 != len) atomicAdd(errors, 1ull);
  }
}

// One thread per block of the KV cache: contiguous (into dst + i * len), or scattered by the
// descriptor list i (in registered pinned host memory).
__global__ void load_kernel(Queues qs, const Key* keys, uint32_t n, std::byte* dst, uint32_t len,
                            const std::byte* lists, uint32_t list_bytes,
                            unsigned long long* errors) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const QueueRef& q = qs.q[i % qs.n];
  const CmdResult r =
      lists == nullptr
          ? device::get(q, keys[i], dst + size_t{i} * len, len)
          : device::execute(q, device::make_scatter_retrieve(
                                   keys[i], lists + size_t{i} * list_bytes, list_bytes));
  if (!r.ok() || r.dw0 != len) atomicAdd(errors, 1ull);
}

class Bench {
 public:
  explicit Bench(bool quick) : quick_(quick) {
    kv_blocks_ = (quick_ ? 8192 : 32768) / kTokensPerBlock;
    CK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CK(cudaEventCreate(&ev0_));
    CK(cudaEventCreate(&ev1_));
    CK(cudaMalloc(&errors_, sizeof(unsigned long long)));
  }
  ~Bench() {
    cudaFree(errors_);
    cudaEventDestroy(ev0_);
    cudaEventDestroy(ev1_);
    cudaStreamDestroy(stream_);
  }

  std::vector<Result> results;

  void add(const std::string& name, double v, const std::string& unit) {
    results.push_back({name, v, unit});
    std::printf("  %-28s %12.3f %s\n", name.c_str(), v, unit.c_str());
    std::fflush(stdout);
  }

  // cudaMemcpyAsync from pinned host memory: one 256 MiB copy, and 2 MiB copies back to back.
  void h2d_peak() {
    const size_t bytes = size_t{256} << 20;
    void* h = nullptr;
    void* d = nullptr;
    CK(cudaHostAlloc(&h, bytes, cudaHostAllocPortable));
    CK(cudaMalloc(&d, bytes));
    std::memset(h, 1, bytes);
    auto time = [&](size_t chunk) {
      double best = 0;
      for (int rep = 0; rep < 4; ++rep) {
        CK(cudaEventRecord(ev0_, stream_));
        for (size_t off = 0; off < bytes; off += chunk) {
          CK(cudaMemcpyAsync(static_cast<char*>(d) + off, static_cast<char*>(h) + off, chunk,
                             cudaMemcpyHostToDevice, stream_));
        }
        CK(cudaEventRecord(ev1_, stream_));
        CK(cudaEventSynchronize(ev1_));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, ev0_, ev1_));
        if (rep > 0) best = std::max(best, static_cast<double>(bytes) / (ms * 1e6));
      }
      return best;
    };
    const double one = time(bytes);
    const double chunked = time(kBig);
    add("h2d_pinned_peak_gbps", std::max(one, chunked), "GB/s");
    add("h2d_pinned_2m_chunks_gbps", chunked, "GB/s");
    peak_gbps_ = std::max(one, chunked);
    CK(cudaFree(d));
    CK(cudaFreeHost(h));
  }

  void setup() {
    const size_t arena = size_t{kv_blocks_} * kBig + size_t{kSmallKeys} * kSmall + (64u << 20);
    backend_ = make_pinned_backend(arena);
    ControllerOptions o;
    o.reactors = kQueues;
    ctl_ = std::make_unique<Controller>(backend_, controller_options(o));
    for (uint32_t i = 0; i < kQueues; ++i) {
      DeviceQueueOptions qo;
      qo.queue.depth = 4096;
      queues_.push_back(std::make_unique<DeviceQueue>(*ctl_, qo));
      qs_.q[i] = queues_.back()->ref();
    }
    qs_.n = kQueues;

    // Small values.
    std::vector<std::byte> v(kBig);
    std::vector<Key> small(kSmallKeys);
    for (uint32_t i = 0; i < kSmallKeys; ++i) {
      small[i] = item_key("s", i);
      fill_random(v.data(), kSmall, i);
      if (!pinned_backend_preload(*backend_, small[i], {v.data(), kSmall})) {
        throw std::runtime_error("backend arena full");
      }
    }
    CK(cudaMalloc(&small_keys_, sizeof(Key) * kSmallKeys));
    CK(cudaMemcpy(small_keys_, small.data(), sizeof(Key) * kSmallKeys, cudaMemcpyHostToDevice));

    // KV blocks: the value of block i is laid out [layer][K,V][16 tokens][8 heads][128] bf16.
    std::vector<Key> kv(kv_blocks_);
    for (uint32_t i = 0; i < kv_blocks_; ++i) {
      kv[i] = item_key("kv", i);
      fill_random(v.data(), kBig, 1000 + i);
      if (!pinned_backend_preload(*backend_, kv[i], {v.data(), kBig})) {
        throw std::runtime_error("backend arena full");
      }
    }
    CK(cudaMalloc(&kv_keys_, sizeof(Key) * kv_blocks_));
    CK(cudaMemcpy(kv_keys_, kv.data(), sizeof(Key) * kv_blocks_, cudaMemcpyHostToDevice));
    kv_bytes_ = size_t{kv_blocks_} * kBig;
    CK(cudaMalloc(&kv_dst_, kv_bytes_));
    regs_.push_back(std::make_unique<Registration>(*ctl_, kv_dst_, kv_bytes_, MemKind::kDevice));
  }

  void teardown() {
    regs_.clear();
    queues_.clear();
    ctl_.reset();
    backend_.reset();
    cudaFree(small_keys_);
    cudaFree(kv_keys_);
    cudaFree(kv_dst_);
  }

  void small_latency() {
    const uint32_t iters = 3000;
    const uint32_t warm = 300;
    uint64_t* ns = nullptr;
    CK(cudaMalloc(&ns, sizeof(uint64_t) * iters));
    CK(cudaMemsetAsync(errors_, 0, sizeof(unsigned long long), stream_));
    latency_kernel<<<1, 1, 0, stream_>>>(qs_.q[0], small_keys_, kSmallKeys, kv_dst_, kSmall, iters,
                                         ns, errors_);
    CK(cudaGetLastError());
    wait_stream(stream_, kTimeout, "latency kernel");
    std::vector<uint64_t> h(iters);
    CK(cudaMemcpy(h.data(), ns, sizeof(uint64_t) * iters, cudaMemcpyDeviceToHost));
    CK(cudaFree(ns));
    expect_no_errors("4 KiB latency");
    std::vector<double> us;
    for (uint32_t i = warm; i < iters; ++i) us.push_back(static_cast<double>(h[i]) / 1000.0);
    double sum = 0;
    for (double x : us) sum += x;
    const double mean = sum / static_cast<double>(us.size());
    add("get4k_latency_p50_us", percentile(us, 0.50), "us");
    add("get4k_latency_p99_us", percentile(us, 0.99), "us");
    add("get4k_latency_mean_us", mean, "us");
  }

  void small_throughput() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const uint32_t threads = 256;
    const uint32_t blocks = static_cast<uint32_t>(sms) * 2;
    const uint32_t per_thread = quick_ ? 2 : 8;
    const uint64_t ops = uint64_t{blocks} * threads * per_thread;
    if (uint64_t{blocks} * threads * kSmall > kv_bytes_) throw std::runtime_error("dst too small");
    for (bool warp : {false, true}) {
      CK(cudaMemsetAsync(errors_, 0, sizeof(unsigned long long), stream_));
      CK(cudaEventRecord(ev0_, stream_));
      throughput_kernel<<<blocks, threads, 0, stream_>>>(qs_, warp, small_keys_, kSmallKeys,
                                                         kv_dst_, kSmall, per_thread, errors_);
      CK(cudaGetLastError());
      CK(cudaEventRecord(ev1_, stream_));
      wait_stream(stream_, kTimeout, "throughput kernel");
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, ev0_, ev1_));
      expect_no_errors("4 KiB throughput");
      const double iops = static_cast<double>(ops) / (ms / 1e3);
      const std::string level = warp ? "warp" : "thread";
      add("get4k_" + level + "_kiops", iops / 1e3, "kIOPS");
      add("get4k_" + level + "_gbps", iops * kSmall / 1e9, "GB/s");
    }
  }

  // Loads `blocks` KV blocks: contiguous, or scattered one 64 KiB piece per layer into 32 layer
  // regions of kv_dst_ (layer l's slots at kv_dst_ + l * (blocks * 64 KiB)).
  double load(uint32_t blocks, bool scatter) {
    std::byte* lists = nullptr;
    std::unique_ptr<Registration> lists_reg;
    void* lists_host = nullptr;
    const uint32_t list_bytes = sizeof(nvme::ScatterHeader) + kLayers * sizeof(nvme::ScatterEntry);
    if (scatter) {
      lists_host = alloc_mapped(size_t{blocks} * list_bytes);
      if (lists_host == nullptr) throw std::runtime_error("alloc_mapped (scatter lists)");
      for (uint32_t b = 0; b < blocks; ++b) {
        auto* p = static_cast<std::byte*>(lists_host) + size_t{b} * list_bytes;
        nvme::ScatterHeader h{kLayers, 0};
        std::memcpy(p, &h, sizeof(h));
        for (uint32_t l = 0; l < kLayers; ++l) {
          const nvme::ScatterEntry e{
              reinterpret_cast<uint64_t>(kv_dst_ + (size_t{l} * blocks + b) * kLayerBytes),
              l * kLayerBytes, kLayerBytes};
          std::memcpy(p + sizeof(h) + l * sizeof(e), &e, sizeof(e));
        }
      }
      lists_reg = std::make_unique<Registration>(*ctl_, lists_host, size_t{blocks} * list_bytes,
                                                 MemKind::kHost);
      lists = static_cast<std::byte*>(device_pointer(lists_host));
    }
    CK(cudaMemsetAsync(kv_dst_, 0, size_t{blocks} * kBig, stream_));
    CK(cudaMemsetAsync(errors_, 0, sizeof(unsigned long long), stream_));
    CK(cudaEventRecord(ev0_, stream_));
    load_kernel<<<(blocks + 63) / 64, 64, 0, stream_>>>(qs_, kv_keys_, blocks, kv_dst_, kBig, lists,
                                                        list_bytes, errors_);
    CK(cudaGetLastError());
    CK(cudaEventRecord(ev1_, stream_));
    wait_stream(stream_, kTimeout, "KV load kernel");
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, ev0_, ev1_));
    expect_no_errors(scatter ? "scatter load" : "contiguous load");
    verify_blocks(blocks, scatter);
    lists_reg.reset();
    free_mapped(lists_host);
    return ms;
  }

  // Every byte of the first, a middle and the last block.
  void verify_blocks(uint32_t blocks, bool scatter) {
    std::vector<std::byte> want(kBig), got(kBig);
    for (uint32_t b : {0u, blocks / 2, blocks - 1}) {
      fill_random(want.data(), kBig, 1000 + b);
      if (scatter) {
        for (uint32_t l = 0; l < kLayers; ++l) {
          CK(cudaMemcpy(got.data() + size_t{l} * kLayerBytes,
                        kv_dst_ + (size_t{l} * blocks + b) * kLayerBytes, kLayerBytes,
                        cudaMemcpyDeviceToHost));
        }
      } else {
        CK(cudaMemcpy(got.data(), kv_dst_ + size_t{b} * kBig, kBig, cudaMemcpyDeviceToHost));
      }
      if (std::memcmp(want.data(), got.data(), kBig) != 0) {
        throw std::runtime_error(std::string("KV block ") + std::to_string(b) +
                                 (scatter ? " (scatter)" : "") + ": wrong bytes");
      }
    }
  }

  void big_and_kv() {
    // 2 MiB Retrieve: 512 blocks (1 GiB) into GPU memory; the first run warms up.
    const uint32_t n = std::min<uint32_t>(512, kv_blocks_);
    load(n, false);
    const double ms = load(n, false);
    const double gbps = static_cast<double>(n) * kBig / (ms * 1e6);
    add("get2m_gbps", gbps, "GB/s");
    add("get2m_vs_h2d_peak", gbps / peak_gbps_, "x");
    for (uint32_t tokens : {8192u, 32768u}) {
      const uint32_t blocks = tokens / kTokensPerBlock;
      if (blocks > kv_blocks_) continue;
      const std::string t = std::to_string(tokens / 1024) + "k";
      add("kv_load_" + t + "_ms", load(blocks, false), "ms");
      add("kv_load_scatter_" + t + "_ms", load(blocks, true), "ms");
    }
  }

  void expect_no_errors(const char* what) {
    unsigned long long e = 0;
    CK(cudaMemcpy(&e, errors_, sizeof(e), cudaMemcpyDeviceToHost));
    if (e != 0) {
      throw std::runtime_error(std::string(what) + ": " + std::to_string(e) + " failed requests");
    }
  }

#if defined(GDKV_HAVE_CUBLAS)
  void prefill_approx();
#endif

 private:
  bool quick_;
  uint32_t kv_blocks_ = 0;
  double peak_gbps_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ev0_ = nullptr;
  cudaEvent_t ev1_ = nullptr;
  unsigned long long* errors_ = nullptr;
  std::shared_ptr<Backend> backend_;
  std::unique_ptr<Controller> ctl_;
  std::vector<std::unique_ptr<DeviceQueue>> queues_;
  std::vector<std::unique_ptr<Registration>> regs_;
  Queues qs_{};
  Key* small_keys_ = nullptr;
  Key* kv_keys_ = nullptr;
  std::byte* kv_dst_ = nullptr;
  size_t kv_bytes_ = 0;
};

#if defined(GDKV_HAVE_CUBLAS)
__global__ void fill_bf16(__nv_bfloat16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = __float2bfloat16((static_cast<float>(x & 0xFFFF) / 65535.0f - 0.5f) * 0.04f);
  }
}

void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string(what) + ": cuBLAS status " + std::to_string(s));
  }
}

// The GEMMs of one transformer layer at T tokens, timed on the GPU; the prefill is 32 of them.
// Attention's QK^T and PV products are timed in full and counted at half (the causal mask halves
// the work a flash kernel does); softmax, norms, RoPE and the LM head are left out.
void Bench::prefill_approx() {
  constexpr int d = 4096, heads = 32, kv_heads = 8, hd = 128, ffn = 14336;
  cublasHandle_t h = nullptr;
  cublas_check(cublasCreate(&h), "cublasCreate");
  cublas_check(cublasSetStream(h, stream_), "cublasSetStream");
  for (uint32_t tokens : {8192u, 32768u}) {
    if (quick_ && tokens > 8192) continue;
    const int T = static_cast<int>(tokens);
    const int head_batch =
        std::max(1, std::min(heads, static_cast<int>((size_t{4} << 30) / (size_t{2} * T * T))));
    const size_t t = tokens, qkv = size_t{heads + 2 * kv_heads} * hd;
    const size_t sizes[] = {
        t * d,                                    // 0 x
        d * qkv,                                  // 1 w_qkv
        t * qkv,                                  // 2 qkv
        size_t{d} * d,                            // 3 w_o
        t * d,                                    // 4 out
        d * 2 * size_t{ffn},                      // 5 w_gate_up
        t * 2 * ffn,                              // 6 gate_up
        size_t{ffn} * d,                          // 7 w_down
        static_cast<size_t>(head_batch) * t * t,  // 8 scores
        t * heads * hd,                           // 9 q (k and v reuse it)
        t * heads * hd,                           // 10 attention out
    };
    std::vector<__nv_bfloat16*> buf;
    for (size_t i = 0; i < std::size(sizes); ++i) {
      __nv_bfloat16* p = nullptr;
      CK(cudaMalloc(&p, sizes[i] * sizeof(__nv_bfloat16)));
      fill_bf16<<<1024, 256, 0, stream_>>>(p, sizes[i], static_cast<uint32_t>(i));
      CK(cudaGetLastError());
      buf.push_back(p);
    }
    const float one = 1.0f, zero = 0.0f;
    // Row-major C[m×n] = A[m×k] · B[k×n].
    auto gemm = [&](int m, int n, int k, const __nv_bfloat16* A, const __nv_bfloat16* B,
                    __nv_bfloat16* C) {
      cublas_check(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &one, B, CUDA_R_16BF, n, A,
                                CUDA_R_16BF, k, &zero, C, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx");
    };
    auto batched = [&](int m, int n, int k, const __nv_bfloat16* A, long long sa,
                       const __nv_bfloat16* B, long long sb, __nv_bfloat16* C, long long sc,
                       int count) {
      cublas_check(
          cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &one, B, CUDA_R_16BF, n,
                                     sb, A, CUDA_R_16BF, k, sa, &zero, C, CUDA_R_16BF, n, sc, count,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmStridedBatchedEx");
    };
    auto dense = [&] {
      gemm(T, (heads + 2 * kv_heads) * hd, d, buf[0], buf[1], buf[2]);
      gemm(T, d, d, buf[10], buf[3], buf[4]);
      gemm(T, 2 * ffn, d, buf[4], buf[5], buf[6]);
      gemm(T, d, ffn, buf[6], buf[7], buf[0]);
    };
    auto attention = [&] {
      const long long qs = static_cast<long long>(T) * hd;
      for (int h0 = 0; h0 < heads; h0 += head_batch) {
        const int c = std::min(head_batch, heads - h0);
        batched(T, T, hd, buf[9] + h0 * qs, qs, buf[9] + h0 * qs, qs, buf[8],
                static_cast<long long>(T) * T, c);  // scores = Q Kᵀ (shapes only)
        batched(T, hd, T, buf[8], static_cast<long long>(T) * T, buf[9] + h0 * qs, qs,
                buf[10] + h0 * qs, qs, c);  // out = P V
      }
    };
    auto time_ms = [&](auto&& f) {
      f();  // warm-up
      CK(cudaEventRecord(ev0_, stream_));
      f();
      CK(cudaEventRecord(ev1_, stream_));
      wait_stream(stream_, kTimeout, "prefill GEMMs");
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, ev0_, ev1_));
      return static_cast<double>(ms);
    };
    const double layer = time_ms(dense) + 0.5 * time_ms(attention);
    add("prefill_approx_" + std::to_string(tokens / 1024) + "k_ms", layer * kLayers, "ms");
    for (auto* p : buf) CK(cudaFree(p));
  }
  cublasDestroy(h);
}
#endif

int run(const std::string& out, bool quick, bool prefill) {
  std::printf("device: %s\n", device_description(0).c_str());
  Bench b(quick);
  b.h2d_peak();
  b.setup();
  b.small_latency();
  b.small_throughput();
  b.big_and_kv();
  b.teardown();
  if (prefill) {
#if defined(GDKV_HAVE_CUBLAS)
    b.prefill_approx();
#else
    std::printf("  prefill approximation: not built (no cuBLAS)\n");
#endif
  }
  std::ofstream f(out);
  f << "# gdkv gpu_bench on " << device_description(0) << "\n";
  for (const Result& r : b.results) f << r.name << " " << r.value << " " << r.unit << "\n";
  if (!f) throw std::runtime_error("writing " + out);
  return 0;
}

}  // namespace
}  // namespace gdkv::gpu

int main(int argc, char** argv) {
  std::string out = "gpu_bench_results.txt";
  bool quick = false;
  bool prefill = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) {
      out = argv[++i];
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--prefill-approx") {
      prefill = true;
    } else {
      std::fprintf(stderr, "usage: gpu_bench [--out FILE] [--quick] [--prefill-approx]\n");
      return 2;
    }
  }
  if (gdkv::gpu::device_count() == 0) {
    std::printf("skipped: no GPU\n");
    return gdkv::gpu::kSkipped;
  }
  try {
    return gdkv::gpu::run(out, quick, prefill);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: %s\n", e.what());
    return 1;
  }
}
