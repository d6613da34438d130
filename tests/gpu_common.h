// Shared by the GPU programs (src/gpu's gpu_device_test, bench/gpu's gpu_bench): a backend serving
// values from pinned host memory, a kernel watchdog, and small helpers. Host code only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/key.h"

namespace gdkv::gpu {

// Exit status for "skipped: no GPU" (ctest SKIP_RETURN_CODE).
inline constexpr int kSkipped = 77;

// A backend whose values live in one pinned host arena (bump allocation, never reused): it stands
// in for the host cache's pinned slabs, so Retrieve measures the copy engine's direct DMA path.
// Supports put (with the store options), get, exists, delete; list/prefetch answer success/empty.
std::shared_ptr<Backend> make_pinned_backend(size_t arena_bytes);
// Stores a value directly (setup without the controller). Returns false when the arena is full.
bool pinned_backend_preload(Backend& b, const Key& key, std::span<const std::byte> value,
                            uint32_t nsid = 1);

// Waits for `stream` with a deadline; on timeout prints "FAIL: <what> timed out" and exits 2 (a
// hung kernel can't be cancelled; exiting tears the context down). Throws on a CUDA error.
void wait_stream(cudaStream_t stream, double timeout_s, const char* what);

// Deterministic pseudo-random bytes.
void fill_random(std::byte* p, size_t n, uint64_t seed);

// Percentile of `v` (sorted in place), q in [0, 1].
double percentile(std::vector<double>& v, double q);

// The key of item `i` of a benchmark or test set: "<tag>-<i>", at most 16 bytes.
Key item_key(const char* tag, uint32_t i);

}  // namespace gdkv::gpu
