#include "controller/staging_pool.h"

#include <bit>

namespace gdkv {

StagingPool::StagingPool(void* arena, size_t bytes, uint64_t region)
    : arena_(static_cast<std::byte*>(arena)),
      bytes_(bytes),
      region_(region),
      orders_(static_cast<uint32_t>(std::countr_zero(bytes / kMinBlock)) + 1) {
  const size_t blocks = bytes / kMinBlock;
  free_.resize(orders_);
  // Reserved up front so that alloc() and free() never allocate.
  for (uint32_t o = 0; o < orders_; ++o) free_[o].reserve(blocks >> o);
  free_pos_.assign(blocks, 0);
  free_order_.assign(blocks, 0);
  used_order_.assign(blocks, 0);
  push(0, orders_ - 1);
}

void StagingPool::push(uint32_t block, uint32_t order) {
  free_pos_[block] = static_cast<uint32_t>(free_[order].size());
  free_order_[block] = static_cast<uint8_t>(order + 1);
  free_[order].push_back(block);
}

void StagingPool::remove(uint32_t block, uint32_t order) {
  std::vector<uint32_t>& list = free_[order];
  const uint32_t at = free_pos_[block];
  const uint32_t last = list.back();
  list[at] = last;
  free_pos_[last] = at;
  list.pop_back();
  free_order_[block] = 0;
}

std::byte* StagingPool::alloc(size_t n) {
  const size_t want = n <= kMinBlock ? kMinBlock : std::bit_ceil(n);
  std::lock_guard lk(mu_);
  if (want > bytes_) {
    ++failed_;
    return nullptr;
  }
  const auto order = static_cast<uint32_t>(std::countr_zero(want / kMinBlock));
  uint32_t o = order;
  while (o < orders_ && free_[o].empty()) ++o;
  if (o == orders_) {
    ++failed_;
    return nullptr;
  }
  const uint32_t block = free_[o].back();
  remove(block, o);
  while (o > order) {  // split: keep the lower half, free the upper half
    --o;
    push(block + (uint32_t{1} << o), o);
  }
  used_order_[block] = static_cast<uint8_t>(order + 1);
  in_use_ += want;
  return arena_ + size_t{block} * kMinBlock;
}

void StagingPool::free(std::byte* p) {
  auto block = static_cast<uint32_t>(static_cast<size_t>(p - arena_) / kMinBlock);
  std::lock_guard lk(mu_);
  uint32_t o = used_order_[block] - 1u;
  used_order_[block] = 0;
  in_use_ -= kMinBlock << o;
  while (o + 1 < orders_) {  // merge with the buddy while it is free and whole
    const uint32_t buddy = block ^ (uint32_t{1} << o);
    if (free_order_[buddy] != o + 1) break;
    remove(buddy, o);
    block &= ~(uint32_t{1} << o);
    ++o;
  }
  push(block, o);
}

bool StagingPool::owns(const void* p) const {
  const auto* b = static_cast<const std::byte*>(p);
  return b >= arena_ && b < arena_ + bytes_;
}

size_t StagingPool::bytes_in_use() const {
  std::lock_guard lk(mu_);
  return in_use_;
}

uint64_t StagingPool::failed_allocs() const {
  std::lock_guard lk(mu_);
  return failed_;
}

}  // namespace gdkv
