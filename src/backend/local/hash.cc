#include "backend/local/hash.h"

#include <cstdlib>
#include <new>

#include "backend/local/hash_dispatch.h"

namespace gdkv::local {

namespace {
const HashImpl& impl() noexcept {
#if defined(GDKV_HASH_AVX2)
  static const HashImpl& chosen = __builtin_cpu_supports("avx2") ? avx2::kImpl : generic::kImpl;
  return chosen;
#else
  return generic::kImpl;
#endif
}
}  // namespace

uint64_t checksum64(const void* data, size_t n) noexcept { return impl().oneshot64(data, n); }

Key digest128(const void* data, size_t n) noexcept {
  Key k;
  k.len = nvme::kMaxKeyLength;
  impl().digest128(data, n, k.bytes);
  return k;
}

ValueHashes value_hashes(const void* data, size_t n) noexcept {
  ValueHashes h;
  h.digest.len = nvme::kMaxKeyLength;
  const uint64_t low = impl().digest128(data, n, h.digest.bytes);
  h.checksum = n > kXxh3SharedAbove ? low : impl().oneshot64(data, n);
  return h;
}

Checksum64::Checksum64() {
  const HashImpl& h = impl();
  const size_t size = (h.state_size + h.state_align - 1) / h.state_align * h.state_align;
  state_ = std::aligned_alloc(h.state_align, size);
  if (state_ == nullptr) throw std::bad_alloc();
  h.reset(state_);
}
Checksum64::~Checksum64() { std::free(state_); }
void Checksum64::reset() noexcept { impl().reset(state_); }
void Checksum64::update(const void* data, size_t n) noexcept { impl().update(state_, data, n); }
uint64_t Checksum64::digest() const noexcept { return impl().digest(state_); }

const char* hash_implementation() noexcept {
#if defined(GDKV_HASH_AVX2)
  if (&impl() == &avx2::kImpl) return "avx2";
#endif
  return "generic";
}

}  // namespace gdkv::local
