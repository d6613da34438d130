#include "vfio_user/dma_space.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "vfio_user/protocol.h"

namespace gdkv::vfio_user {

namespace {
constexpr uint64_t kPage = 4096;

bool overflows(uint64_t a, uint64_t len) { return a + len < a; }

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

// Fills this mapping's page tables for the pages `fd` already holds in [offset, offset + size)
// (its data extents, SEEK_DATA/SEEK_HOLE), so the first transfers into memory a client shared
// in place (an engine's KV pool, already written) do not take one page fault per 4 KiB: a first
// 70 MiB load into such a pool took 35 ms against 10 ms for the next. Holes stay holes (nothing
// is allocated for memory the client never touched). Best effort: a kernel without
// MADV_POPULATE_* leaves the faults to happen as before.
void populate_present(std::byte* base, int fd, uint64_t offset, uint64_t size, bool writable) {
  const off_t end = static_cast<off_t>(offset + size);
  off_t at = static_cast<off_t>(offset);
  while (at < end) {
    const off_t data = ::lseek(fd, at, SEEK_DATA);
    if (data < 0 || data >= end) return;  // ENXIO: no data past `at`
    off_t hole = ::lseek(fd, data, SEEK_HOLE);
    if (hole < 0 || hole > end) hole = end;
    const off_t from = data & ~static_cast<off_t>(kPage - 1);
    if (::madvise(base + (from - static_cast<off_t>(offset)), static_cast<size_t>(hole - from),
                  writable ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) != 0) {
      return;
    }
    at = hole;
  }
}

// Waits until no command uses `m`. Commands finish on their own (backend ops complete or time
// out), so this terminates; it sleeps so a long wait costs nothing.
void wait_unpinned(const DmaMap& m) {
  while (m.inflight.load(std::memory_order_acquire) != 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}
}  // namespace

DmaMap::~DmaMap() {
  if (mmap_base != nullptr) ::munmap(mmap_base, mmap_len);
  if (release) release();
}

DmaSpace::~DmaSpace() = default;

DmaMap* DmaSpace::find(uint64_t iova) const {
  auto it = maps_.upper_bound(iova);
  if (it == maps_.begin()) return nullptr;
  --it;
  DmaMap* m = it->second.get();
  return iova - m->iova < m->size ? m : nullptr;
}

int DmaSpace::insert(std::unique_ptr<DmaMap> m) {
  std::unique_lock lk(mu_);
  if (maps_.size() >= options_.max_maps) return ENOSPC;
  // Overlap with the neighbour at or after the start, or the one before it.
  auto it = maps_.lower_bound(m->iova);
  if (it != maps_.end() && it->second->iova < m->iova + m->size) return EEXIST;
  if (it != maps_.begin()) {
    const DmaMap& prev = *std::prev(it)->second;
    if (prev.iova + prev.size > m->iova) return EEXIST;
  }
  const uint64_t at = m->iova;
  if (m->host == nullptr) message_maps_.fetch_add(1, std::memory_order_release);
  maps_.emplace(at, std::move(m));
  return 0;
}

int DmaSpace::map(uint64_t iova, uint64_t size, uint64_t offset, uint32_t flags, UniqueFd fd) {
  if (size == 0 || overflows(iova, size) || overflows(offset, size)) return EINVAL;
  if ((iova | size | offset) % kPage != 0) return EINVAL;
  if ((flags & ~(kDmaFlagRead | kDmaFlagWrite)) != 0 || flags == 0) return EINVAL;
  auto m = std::make_unique<DmaMap>();
  m->iova = iova;
  m->size = size;
  m->readable = flags & kDmaFlagRead;
  m->writable = flags & kDmaFlagWrite;
  if (fd.valid()) {
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) return EBADF;
    if (!S_ISREG(st.st_mode)) return EINVAL;  // sockets, pipes, devices: nothing to share
    if (static_cast<uint64_t>(st.st_size) < offset + size) return EINVAL;
    const int seals = ::fcntl(fd.get(), F_GET_SEALS);
    const bool shrink_sealed = seals >= 0 && (seals & F_SEAL_SHRINK);
    if (!shrink_sealed && !options_.allow_unsealed_memory) return EPERM;
    const int prot = (m->readable ? PROT_READ : 0) | (m->writable ? PROT_WRITE : 0);
    void* p = ::mmap(nullptr, size, prot, MAP_SHARED, fd.get(), static_cast<off_t>(offset));
    if (p == MAP_FAILED) return errno == EACCES ? EACCES : EINVAL;
    m->mmap_base = p;
    m->mmap_len = size;
    m->host = static_cast<std::byte*>(p);
    populate_present(m->host, fd.get(), offset, size, m->writable);
    m->fd = std::move(fd);
  }
  return insert(std::move(m));
}

int DmaSpace::map_memory(uint64_t iova, void* p, uint64_t size, bool readable, bool writable,
                         MemKind kind, std::function<void()> release) {
  if (size == 0 || p == nullptr || overflows(iova, size) || (!readable && !writable)) {
    if (release) release();
    return EINVAL;
  }
  auto m = std::make_unique<DmaMap>();
  m->iova = iova;
  m->size = size;
  m->host = static_cast<std::byte*>(p);
  m->readable = readable;
  m->writable = writable;
  m->kind = kind;
  m->release = std::move(release);
  return insert(std::move(m));  // on failure the map's destructor runs `release`
}

std::unique_ptr<DmaMap> DmaSpace::detach(uint64_t iova, uint64_t size, int* err, bool device_only) {
  std::unique_lock lk(mu_);
  auto it = maps_.find(iova);
  if (it == maps_.end() || it->second->size != size ||
      (device_only && it->second->kind != MemKind::kDevice)) {
    *err = ENOENT;
    return nullptr;
  }
  if (it->second->queue_refs.load() != 0) {
    *err = EBUSY;
    return nullptr;
  }
  std::unique_ptr<DmaMap> victim = std::move(it->second);
  maps_.erase(it);
  if (victim->host == nullptr) message_maps_.fetch_sub(1, std::memory_order_release);
  *err = 0;
  return victim;
}

int DmaSpace::unmap(uint64_t iova, uint64_t size) {
  int err = 0;
  std::unique_ptr<DmaMap> victim = detach(iova, size, &err);
  if (!victim) return err;
  wait_unpinned(*victim);
  return 0;
}

std::vector<const DmaMap*> DmaSpace::queue_maps(uint64_t iova, uint64_t size, bool all) const {
  std::shared_lock lk(mu_);
  std::vector<const DmaMap*> out;
  for (const auto& [at, m] : maps_) {
    if (m->queue_refs.load() == 0) continue;
    if (all || (at == iova && m->size == size)) out.push_back(m.get());
  }
  return out;
}

int DmaSpace::detach_all(std::vector<std::unique_ptr<DmaMap>>& out) {
  std::unique_lock lk(mu_);
  for (const auto& [at, m] : maps_) {
    if (m->queue_refs.load() != 0) return EBUSY;
  }
  for (auto& [at, m] : maps_) out.push_back(std::move(m));
  maps_.clear();
  message_maps_.store(0, std::memory_order_release);
  return 0;
}

int DmaSpace::unmap_all() {
  std::vector<std::unique_ptr<DmaMap>> victims;
  if (int err = detach_all(victims); err != 0) return err;
  for (const auto& m : victims) wait_unpinned(*m);
  return 0;
}

nvme::Status DmaSpace::resolve(uint64_t iova, uint64_t len, bool for_write, DataSegments& out,
                               MapRefs& refs, RemoteSink* remote) {
  if (len == 0) return nvme::Status::kSuccess;
  if (overflows(iova, len)) return nvme::Status::kDataTransferError;
  std::shared_lock lk(mu_);
  while (len > 0) {
    DmaMap* m = find(iova);
    if (m == nullptr) return nvme::Status::kDataTransferError;
    if (for_write ? !m->writable : !m->readable) return nvme::Status::kDataTransferError;
    const uint64_t n = std::min<uint64_t>(len, m->iova + m->size - iova);
    std::byte* p;
    if (m->host == nullptr) {
      p = remote == nullptr ? nullptr : remote->bounce(iova, n, for_write);
      if (p == nullptr) return nvme::Status::kDataTransferError;
    } else {
      p = m->host + (iova - m->iova);
      bool pinned = false;
      for (DmaMap* r : refs) pinned |= r == m;
      if (!pinned) {
        m->inflight.fetch_add(1, std::memory_order_relaxed);
        refs.push_back(m);
      }
    }
    if (!out.empty() && out.back().kind == m->kind && out.back().addr + out.back().len == p) {
      out.back().len += n;
    } else {
      out.push_back(DataSegment{p, static_cast<size_t>(n), m->kind});
    }
    iova += n;
    len -= n;
  }
  return nvme::Status::kSuccess;
}

bool DmaSpace::message_only(uint64_t iova, uint64_t len, bool for_write) const {
  if (len == 0 || overflows(iova, len)) return false;
  std::shared_lock lk(mu_);
  while (len > 0) {
    const DmaMap* m = find(iova);
    if (m == nullptr || m->host != nullptr || (for_write ? !m->writable : !m->readable)) {
      return false;
    }
    const uint64_t n = std::min<uint64_t>(len, m->iova + m->size - iova);
    iova += n;
    len -= n;
  }
  return true;
}

bool DmaSpace::read(uint64_t iova, void* dst, size_t len) {
  if (overflows(iova, len)) return false;
  auto* d = static_cast<std::byte*>(dst);
  std::shared_lock lk(mu_);
  while (len > 0) {
    const DmaMap* m = find(iova);
    if (m == nullptr || m->host == nullptr || !m->readable || m->kind != MemKind::kHost) {
      return false;
    }
    const uint64_t n = std::min<uint64_t>(len, m->iova + m->size - iova);
    std::memcpy(d, m->host + (iova - m->iova), n);
    d += n;
    iova += n;
    len -= n;
  }
  return true;
}

bool DmaSpace::write(uint64_t iova, const void* src, size_t len) {
  if (overflows(iova, len)) return false;
  const auto* s = static_cast<const std::byte*>(src);
  std::shared_lock lk(mu_);
  while (len > 0) {
    const DmaMap* m = find(iova);
    if (m == nullptr || m->host == nullptr || !m->writable || m->kind != MemKind::kHost) {
      return false;
    }
    const uint64_t n = std::min<uint64_t>(len, m->iova + m->size - iova);
    std::memcpy(m->host + (iova - m->iova), s, n);
    s += n;
    iova += n;
    len -= n;
  }
  return true;
}

void DmaSpace::unpin(MapRefs& refs) {
  for (DmaMap* m : refs) m->inflight.fetch_sub(1, std::memory_order_release);
  refs.clear();
}

std::byte* DmaSpace::acquire_queue(uint64_t iova, uint64_t len, bool for_write, DmaMap** map) {
  if (len == 0 || overflows(iova, len)) return nullptr;
  std::shared_lock lk(mu_);
  DmaMap* m = find(iova);
  if (m == nullptr || m->host == nullptr || m->kind != MemKind::kHost) return nullptr;
  if (!m->readable || (for_write && !m->writable)) return nullptr;
  if (iova + len > m->iova + m->size) return nullptr;
  m->queue_refs.fetch_add(1);
  *map = m;
  return m->host + (iova - m->iova);
}

void DmaSpace::release_queue(DmaMap* map) {
  if (map != nullptr) map->queue_refs.fetch_sub(1);
}

size_t DmaSpace::count() const {
  std::shared_lock lk(mu_);
  return maps_.size();
}

uint64_t DmaSpace::bytes() const {
  std::shared_lock lk(mu_);
  uint64_t n = 0;
  for (const auto& [at, m] : maps_) n += m->size;
  return n;
}

}  // namespace gdkv::vfio_user
