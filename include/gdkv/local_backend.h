// The `local` backend: a persistent, log-structured KV store on one file or block device, the
// embedded default. Values are records (header with magic, key, lengths, identity digest and
// payload checksum) appended to fixed-size segments with O_DIRECT writes through io_uring; an
// in-memory index key → (segment, offset, length) is rebuilt at open by scanning the segments.
// A Store is acknowledged once its record is durable; concurrent Stores share one write and one
// flush (group commit). When full, the oldest segment is reclaimed (this is a cache); the live
// values in it of a namespace with a quota are first copied forward, so only that namespace's own
// Stores can push them out (it evicts its oldest values to stay within its quota).
//
// Thread safety: as every Backend (see backend.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "gdkv/backend.h"
#include "gdkv/result.h"

namespace gdkv {

struct LocalBackendOptions {
  std::string path;  // a directory (the store file is created inside it) or a block device
  // Bytes of log space, default 8 GiB; at most what the file system holds at open (open warns
  // on stderr when it holds less, and fails when it cannot hold one segment).
  uint64_t capacity_bytes = uint64_t{8} << 30;
  uint32_t segment_bytes = 64u << 20;  // bytes per segment, default 64 MiB
  uint32_t queue_depth = 128;          // io_uring entries, 64..4096, default 128
  // Reserve each segment's space with fallocate when the log first uses it, so a full file system
  // shows up (81h) before data is written. Off: a sparse file; ENOSPC then surfaces on write.
  bool preallocate = true;
  // How long open waits for the store's lock. A process killed while it had I/O in flight keeps
  // the lock until the kernel has torn down its io_uring (usually milliseconds), so a restart
  // right after a crash waits briefly instead of failing. 0: fail at once if the store is in use.
  uint32_t lock_wait_ms = 2000;
  // Per-namespace limits within capacity_bytes (backend.h; default none). A namespace's values
  // count their bytes as the log holds them plus a 64-byte record each. Open fails when the quotas
  // sum to more than (segments - 2) x 15/16 of segment_bytes (docs/local-store.md, "Quotas").
  NamespaceQuotas quotas;
};

// Opens (creating if needed) the store and rebuilds its index. An Error (gdkv/result.h) with a
// clear message when the path cannot be used, another process has the store open (flock),
// io_uring lacks what the store needs, or a new store's file system has no room for one segment. An
// existing store keeps the segment size it was created with, and never shrinks below the segments
// its file holds. Values up to segment_bytes − 8 KiB are accepted (larger: 85h). Format, durability
// and reclaim: docs/local-store.md.
Result<std::shared_ptr<Backend>> make_local_backend(const LocalBackendOptions& options);

}  // namespace gdkv
