#include "cache/slab.h"

#include <bit>
#include <cstdlib>

namespace gdkv::cache {

namespace {
constexpr size_t kMinChunk = 64;
constexpr uint32_t kMinExp = 6;   // 2^6 = kMinChunk
constexpr uint32_t kMaxExp = 40;  // the largest class is 1.75 TiB: beyond any value
constexpr size_t kAlign = 4096;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
}  // namespace

struct SlabPage {
  std::byte* base = nullptr;
  size_t bytes = 0;
  uint32_t cls = 0;
  uint32_t chunks = 0;
  uint32_t free_n = 0;
  std::vector<uint32_t> free;  // indices of free chunks
  SlabPage* prev = nullptr;    // in its class's list of pages with a free chunk
  SlabPage* next = nullptr;
  bool in_avail = false;
  SlabPage* all_prev = nullptr;  // every page
  SlabPage* all_next = nullptr;
};

Buffer::~Buffer() {
  if (owner) owner->release(page, index);
}

std::shared_ptr<SlabAllocator> SlabAllocator::create(AllocFn alloc, FreeFn free, size_t page_bytes,
                                                     size_t arena_step_bytes) {
  return std::shared_ptr<SlabAllocator>(
      new SlabAllocator(std::move(alloc), std::move(free), page_bytes, arena_step_bytes));
}

namespace {
Arena::Options arena_options(SlabAllocator::AllocFn alloc, SlabAllocator::FreeFn free,
                             size_t step) {
  Arena::Options o;
  o.step_bytes = step;
  o.align = kAlign;
  if (alloc && free) {
    o.alloc = std::move(alloc);
    o.free = std::move(free);
  }
  return o;
}
}  // namespace

SlabAllocator::SlabAllocator(AllocFn alloc, FreeFn free, size_t page_bytes, size_t arena_step_bytes)
    : arena_(arena_options(std::move(alloc), std::move(free), arena_step_bytes)) {
  page_bytes_ = round_up(page_bytes == 0 ? kAlign : page_bytes, kAlign);
  classes_.resize((kMaxExp - kMinExp + 1) * 4);
  for (uint32_t i = 0; i < classes_.size(); ++i) {
    const uint32_t e = kMinExp + i / 4;
    classes_[i].chunk = (size_t{1} << e) + (i % 4) * (size_t{1} << (e - 2));
  }
}

SlabAllocator::~SlabAllocator() {
  // Every buffer holds a reference to us, so no chunk is in use any more; the arena's regions go
  // back to the hook with the arena.
  while (all_ != nullptr) {
    SlabPage* p = all_;
    all_ = p->all_next;
    arena_.release(p->base, p->bytes);
    delete p;
  }
}

uint32_t SlabAllocator::class_index(size_t n) noexcept {
  if (n <= kMinChunk) return 0;
  const uint32_t e = static_cast<uint32_t>(std::bit_width(n - 1)) - 1;  // 2^e < n <= 2^(e+1)
  const size_t quarter = size_t{1} << (e - 2);
  const size_t q = (n - (size_t{1} << e) + quarter - 1) / quarter;  // 1..4
  return q == 4 ? (e + 1 - kMinExp) * 4 : (e - kMinExp) * 4 + static_cast<uint32_t>(q);
}

size_t SlabAllocator::chunk_size(size_t n) noexcept {
  const uint32_t i = class_index(n);
  const uint32_t e = kMinExp + i / 4;
  return (size_t{1} << e) + (i % 4) * (size_t{1} << (e - 2));
}

void SlabAllocator::push_avail(Class& c, SlabPage* p) {
  p->prev = nullptr;
  p->next = c.avail;
  if (c.avail != nullptr) c.avail->prev = p;
  c.avail = p;
  p->in_avail = true;
}

void SlabAllocator::pop_avail(Class& c, SlabPage* p) {
  if (p->prev != nullptr) p->prev->next = p->next;
  if (p->next != nullptr) p->next->prev = p->prev;
  if (c.avail == p) c.avail = p->next;
  p->prev = p->next = nullptr;
  p->in_avail = false;
}

std::shared_ptr<Buffer> SlabAllocator::allocate(size_t n) {
  const uint32_t ci = class_index(n);
  if (ci >= classes_.size()) return nullptr;
  const size_t chunk = classes_[ci].chunk;
  std::unique_lock lk(mu_);
  Class& c = classes_[ci];
  if (c.avail == nullptr) {
    // The arena may grow (the hook may be slow: pinned memory): call it without the lock.
    const size_t bytes = chunk <= page_bytes_ ? page_bytes_ : round_up(chunk, kAlign);
    lk.unlock();
    void* mem = arena_.allocate(bytes);
    if (mem == nullptr) return nullptr;
    auto* p = new SlabPage;
    p->base = static_cast<std::byte*>(mem);
    p->bytes = bytes;
    p->cls = ci;
    p->chunks = static_cast<uint32_t>(bytes / chunk);
    p->free_n = p->chunks;
    p->free.resize(p->chunks);
    for (uint32_t i = 0; i < p->chunks; ++i) p->free[i] = p->chunks - 1 - i;
    lk.lock();
    p->all_next = all_;
    if (all_ != nullptr) all_->all_prev = p;
    all_ = p;
    reserved_ += bytes;
    ++c.empty_pages;
    push_avail(c, p);
  }
  SlabPage* p = c.avail;
  if (p->free_n == p->chunks) --c.empty_pages;
  const uint32_t index = p->free.back();
  p->free.pop_back();
  if (--p->free_n == 0) pop_avail(c, p);
  in_use_ += chunk;
  lk.unlock();

  auto buf = std::make_shared<Buffer>();
  buf->data = p->base + size_t{index} * chunk;
  buf->len = n;
  buf->owner = shared_from_this();
  buf->page = p;
  buf->index = index;
  return buf;
}

std::shared_ptr<Buffer> SlabAllocator::heap_buffer(size_t n) {
  auto buf = std::make_shared<Buffer>();
  buf->heap = std::make_unique_for_overwrite<std::byte[]>(n == 0 ? 1 : n);
  buf->data = buf->heap.get();
  buf->len = n;
  return buf;
}

void SlabAllocator::release(SlabPage* p, uint32_t index) {
  void* give_back = nullptr;
  size_t give_bytes = 0;
  {
    std::lock_guard lk(mu_);
    Class& c = classes_[p->cls];
    p->free.push_back(index);
    in_use_ -= c.chunk;
    if (++p->free_n == 1) push_avail(c, p);
    if (p->free_n == p->chunks) {
      if (c.empty_pages == 0) {
        ++c.empty_pages;  // keep one spare page per class
      } else {
        pop_avail(c, p);
        if (p->all_prev != nullptr) p->all_prev->all_next = p->all_next;
        if (p->all_next != nullptr) p->all_next->all_prev = p->all_prev;
        if (all_ == p) all_ = p->all_next;
        reserved_ -= p->bytes;
        give_back = p->base;
        give_bytes = p->bytes;
        delete p;
      }
    }
  }
  if (give_back != nullptr) arena_.release(give_back, give_bytes);
}

uint64_t SlabAllocator::reserved_bytes() const {
  std::lock_guard lk(mu_);
  return reserved_;
}

uint64_t SlabAllocator::arena_bytes() const { return arena_.reserved_bytes(); }

uint64_t SlabAllocator::arena_growths() const { return arena_.regions_allocated(); }

uint64_t SlabAllocator::chunk_bytes() const {
  std::lock_guard lk(mu_);
  return in_use_;
}

}  // namespace gdkv::cache
