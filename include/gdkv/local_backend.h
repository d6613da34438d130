// The `local` backend: a persistent, log-structured KV store on one file or block device, the
// embedded default. Values are records (header with magic, key, lengths, identity digest and
// payload checksum) appended to fixed-size segments with O_DIRECT writes through io_uring; an
// in-memory index key → (segment, offset, length) is rebuilt at open by scanning the segments.
// A Store is acknowledged once its record is durable; concurrent Stores share one write and one
// flush (group commit). When full, the oldest segment is reclaimed (this is a cache).
//
// Thread safety: as every Backend (see backend.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "gdkv/backend.h"

namespace gdkv {

struct LocalBackendOptions {
  std::string path;  // a directory (the store file is created inside it) or a block device
  uint64_t capacity_bytes = uint64_t{8} << 30;  // bytes of log space, default 8 GiB
  uint32_t segment_bytes = 64u << 20;           // bytes per segment, default 64 MiB
  uint32_t queue_depth = 128;                   // io_uring submission queue entries
};

// Opens (creating if needed) the store and rebuilds its index. Throws std::runtime_error with a
// clear message when the path cannot be used or io_uring lacks what the store needs.
std::shared_ptr<Backend> make_local_backend(const LocalBackendOptions& options);

}  // namespace gdkv
