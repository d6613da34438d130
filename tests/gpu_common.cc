#include "gpu_common.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "gpu/cuda_check.h"

namespace gdkv::gpu {
namespace {

using nvme::Status;

class PinnedBackend final : public Backend {
 public:
  explicit PinnedBackend(size_t bytes) : capacity_(bytes) {
    check(cudaHostAlloc(&arena_, capacity_, cudaHostAllocPortable), "cudaHostAlloc (backend)");
  }
  ~PinnedBackend() override { cudaFreeHost(arena_); }

  bool preload(const Key& key, std::span<const std::byte> value, uint32_t nsid) {
    std::lock_guard lk(mu_);
    std::byte* p = take(value.size());
    if (p == nullptr) return false;
    if (!value.empty()) std::memcpy(p, value.data(), value.size());
    index_[{nsid, key}] = {p, value.size()};
    return true;
  }

  void submit(BackendOp* op) override {
    Status s = Status::kSuccess;
    uint64_t len = 0;
    {
      std::lock_guard lk(mu_);
      auto it = index_.find({op->nsid, op->key});
      const bool found = it != index_.end();
      switch (op->kind) {
        case BackendOpKind::kPut: {
          if ((op->store_options & nvme::kStoreMustExist) && !found) {
            s = Status::kKeyNotExist;
          } else if ((op->store_options & nvme::kStoreMustNotExist) && found) {
            s = Status::kKeyExists;
          } else if (std::byte* p = take(op->value.size()); p == nullptr) {
            s = Status::kCapacityExceeded;
          } else {
            if (!op->value.empty()) std::memcpy(p, op->value.data(), op->value.size());
            index_[{op->nsid, op->key}] = {p, op->value.size()};
          }
          break;
        }
        case BackendOpKind::kGet:
          if (!found) {
            s = Status::kKeyNotExist;
          } else {
            op->view.bytes = {it->second.first, it->second.second};
            len = it->second.second;
          }
          break;
        case BackendOpKind::kDelete:
          if (found) {
            index_.erase(it);
          } else {
            s = Status::kKeyNotExist;
          }
          break;
        case BackendOpKind::kExists:
          if (!found) s = Status::kKeyNotExist;
          break;
        case BackendOpKind::kList:
          op->keys.clear();
          break;
      }
    }
    op->complete(s, len);
  }

  BackendInfo info() const override {
    std::lock_guard lk(mu_);
    BackendInfo i;
    i.name = "pinned-memory";
    i.keys = index_.size();
    i.bytes_used = used_;
    i.capacity_bytes = capacity_;
    return i;
  }

 private:
  std::byte* take(size_t n) {
    n = (n + 255) & ~size_t{255};
    if (n > capacity_ - used_) return nullptr;
    std::byte* p = static_cast<std::byte*>(arena_) + used_;
    used_ += n;
    return p;
  }

  mutable std::mutex mu_;
  void* arena_ = nullptr;
  size_t capacity_;
  size_t used_ = 0;  // bump pointer: deleted values are not reused (views stay valid)
  std::map<std::pair<uint32_t, Key>, std::pair<const std::byte*, size_t>> index_;
};

}  // namespace

std::shared_ptr<Backend> make_pinned_backend(size_t arena_bytes) {
  return std::make_shared<PinnedBackend>(arena_bytes);
}

bool pinned_backend_preload(Backend& b, const Key& key, std::span<const std::byte> value,
                            uint32_t nsid) {
  return static_cast<PinnedBackend&>(b).preload(key, value, nsid);
}

void wait_stream(cudaStream_t stream, double timeout_s, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6));
  for (;;) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) check(e, what);
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "FAIL: %s timed out after %.0f s (kernel hung?)\n", what, timeout_s);
      std::fflush(stderr);
      std::_Exit(2);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void fill_random(std::byte* p, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
  for (; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = static_cast<std::byte>(x);
  }
}

double percentile(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())));
  return v[i];
}

Key item_key(const char* tag, uint32_t i) {
  char buf[32];
  const int n = std::snprintf(buf, sizeof(buf), "%.6s-%u", tag, i);
  return Key::from_bytes(buf, static_cast<size_t>(std::min(n, 16)));
}

}  // namespace gdkv::gpu
