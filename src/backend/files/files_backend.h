// The `files` backend: a directory on any file system, one file per value. On a mount every node
// shares (NFS, CephFS) it is a tier every node reads and writes.
//
// - Layout: <dir>/ns<N>/<key as hex>. A file is a 48-byte header (magic, key, value length,
//   XXH3-64 of the value) and the value.
// - Store: written to a temporary file in the same folder, fdatasync'ed, then renamed over the
//   key's file (link(), which fails if the name exists, for "only if it does not exist"), and the
//   folder fsync'ed before the Store is acknowledged. A reader sees the old value or the new one,
//   never part of one; an acknowledged value survives a crash of the machine.
// - Retrieve: the header and the value are checked (magic, key, length, checksum); a file that
//   fails is 88h (unrecovered error) and counted, never returned as data.
// - Capacity (capacity_bytes > 0): a Store that would pass it first removes the oldest values
//   this node knows of (those found at open, by modification time, then those it wrote), as
//   removals. Values other nodes write to a shared folder are not counted until the next open.
// - Work runs on `threads` threads of its own; submit() never blocks.
// - At open, temporary files this machine left behind (a crash mid-Store) are removed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "gdkv/backend.h"
#include "gdkv/result.h"

namespace gdkv {

struct FilesBackendOptions {
  std::string path;             // the directory (created if missing); required
  uint64_t capacity_bytes = 0;  // bytes of headers and values; 0: no limit of its own
  uint32_t threads = 4;         // threads doing the file system calls
};

// An Error when the directory cannot be created or read.
Result<std::shared_ptr<Backend>> make_files_backend(const FilesBackendOptions& options);

}  // namespace gdkv
