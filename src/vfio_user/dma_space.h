// One client's DMA address space: the regions it shared by DMA_MAP (its memory fds, mmapped here)
// and the device memory it registered, and every lookup from a DMA address to memory gdkvd can
// touch. Nothing outside a map is ever reachable; writes need a writable map, reads a readable one.
//
// Lifetime: a map in use cannot vanish under a user. Commands pin the maps their data lives in
// (MapRefs) until they complete; queues pin the map they live in until deleted. unmap() removes
// the map from lookups at once, refuses (EBUSY) while a queue lives there, and otherwise waits for
// pinned commands to finish before it munmaps: the spec's "release all references before replying".
//
// Message-only maps (DMA_MAP without an fd) hold no memory here: their bytes move by DMA_READ and
// DMA_WRITE messages to the client. resolve() hands such ranges to a RemoteSink, which supplies a
// bounce buffer in their place; they are never pinned (there is nothing to unmap), so the sender
// checks message_only() before each request instead: nothing is sent for a range unmapped since.
//
// Memory safety against the client: a client that shrinks a shared file under our mapping would
// make our accesses fault (SIGBUS). memfds must therefore be sealed against shrinking
// (F_SEAL_SHRINK) unless the server was configured to trust unsealed memory (SPDK's hugetlbfs
// files, QEMU seal=off).
//
// Thread safety: all member functions are thread-safe (a shared mutex guards the table).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <shared_mutex>
#include <vector>

#include "gdkv/controller.h"
#include "gdkv/nvme_kv.h"
#include "vfio_user/socket_io.h"

namespace gdkv::vfio_user {

struct DmaMap {
  uint64_t iova = 0;
  uint64_t size = 0;
  std::byte* host = nullptr;  // null: no fd was given (message-only map, not reachable directly)
  bool readable = false;
  bool writable = false;
  MemKind kind = MemKind::kHost;
  void* mmap_base = nullptr;  // what to munmap (page-aligned), if we mmapped
  size_t mmap_len = 0;
  UniqueFd fd;
  std::function<void()> release;        // device memory: closes the imported handle
  std::atomic<uint32_t> inflight{0};    // commands using it
  std::atomic<uint32_t> queue_refs{0};  // queues living in it
  ~DmaMap();
};

// The maps one command pinned.
using MapRefs = std::vector<DmaMap*>;

// Takes the pieces of a transfer that lie in message-only maps.
class RemoteSink {
 public:
  virtual ~RemoteSink() = default;
  // Bounce memory standing in for client memory [iova, iova+len) (the map allows the access), or
  // null to refuse the transfer (04h).
  virtual std::byte* bounce(uint64_t iova, uint64_t len, bool for_write) = 0;
};

struct DmaSpaceOptions {
  uint32_t max_maps = 1024;            // DMA_MAP regions at once
  bool allow_unsealed_memory = false;  // accept memfds without F_SEAL_SHRINK and non-memfd files
};

class DmaSpace {
 public:
  explicit DmaSpace(DmaSpaceOptions options = {}) : options_(options) {}
  ~DmaSpace();  // unmaps everything. REQUIRES: nothing pinned

  // DMA_MAP. Takes the fd (may be invalid: a message-only map). Returns 0 or an errno.
  int map(uint64_t iova, uint64_t size, uint64_t offset, uint32_t flags, UniqueFd fd);
  // Memory already in this process (device memory, tests). `release` runs when it is unmapped.
  int map_memory(uint64_t iova, void* p, uint64_t size, bool readable, bool writable, MemKind kind,
                 std::function<void()> release = {});
  // DMA_UNMAP: the map must match exactly. EBUSY if a queue lives there; waits for commands.
  int unmap(uint64_t iova, uint64_t size);
  // Removes the map from lookups without waiting: the caller destroys it once its inflight count
  // is 0 (a reactor must not wait for its own commands). Null with *err set on failure.
  // With `device_only`, host maps are not found (ENOENT).
  std::unique_ptr<DmaMap> detach(uint64_t iova, uint64_t size, int* err, bool device_only = false);
  // Removes every map (DMA_UNMAP with the ALL flag, disconnect). EBUSY if a queue lives in one.
  int unmap_all();
  // unmap_all() without the wait: the caller waits for each map's commands, then destroys it.
  // The maps a DMA_UNMAP of [iova, iova + size) (all: every map) would remove that queues live in.
  // The pointers stay valid until the caller (the thread that unmaps) detaches them.
  std::vector<const DmaMap*> queue_maps(uint64_t iova, uint64_t size, bool all) const;
  int detach_all(std::vector<std::unique_ptr<DmaMap>>& out);

  // Resolves [iova, iova+len) into segments (spanning adjacent maps), pinning each map in `refs`.
  // Pieces in message-only maps go to `remote` (refused without one). 04h if any byte is
  // unmapped, not reachable, or lacks the needed permission.
  nvme::Status resolve(uint64_t iova, uint64_t len, bool for_write, DataSegments& out,
                       MapRefs& refs, RemoteSink* remote = nullptr);
  // Whether [iova, iova+len) lies in message-only maps that allow the access: checked before each
  // DMA_READ (for_write false) or DMA_WRITE (true) request.
  bool message_only(uint64_t iova, uint64_t len, bool for_write) const;
  // Message-only maps present (cheap: read on every I/O command).
  uint32_t message_maps() const { return message_maps_.load(std::memory_order_acquire); }
  // Copies client memory (PRP lists, SGL segments, admin data) into `dst`. False if unreachable.
  bool read(uint64_t iova, void* dst, size_t len);
  // Copies `src` into client memory. False if unreachable or not writable.
  bool write(uint64_t iova, const void* src, size_t len);
  // Unpins what resolve() pinned, and clears `refs`.
  static void unpin(MapRefs& refs);

  // Queue memory: a host pointer to [iova, iova+len) inside one host map, pinned until
  // release_queue(). Null if not entirely inside one reachable map with the permission.
  std::byte* acquire_queue(uint64_t iova, uint64_t len, bool for_write, DmaMap** map);
  static void release_queue(DmaMap* map);

  size_t count() const;
  uint64_t bytes() const;

 private:
  // The map holding `iova`, or null. REQUIRES: mu_ held.
  DmaMap* find(uint64_t iova) const;
  int insert(std::unique_ptr<DmaMap> m);

  DmaSpaceOptions options_;
  mutable std::shared_mutex mu_;
  std::map<uint64_t, std::unique_ptr<DmaMap>> maps_;  // by iova
  std::atomic<uint32_t> message_maps_{0};
};

}  // namespace gdkv::vfio_user
