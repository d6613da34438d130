// The `tiered` backend: a node's local store in front of the shared RADOS pool (or any two
// backends: `near` in front of `far`). With the host cache on top, one gdkvd serves from DRAM,
// then local NVMe, then RADOS (docs/deployment.md, "Tiered node").
//
// - Retrieve: from near; a miss, or a near copy that fails its integrity check (88h: the local
//   store's checksum) or any other near failure, is read from far, returned, and written into near
//   (a fill) unless a write to the key overlapped the read. A corrupt near copy is deleted first.
//   Far is the authority: a value far does not have is 87h whatever near holds.
// - Store: write-through. Far first; the Store is acknowledged once far has it and near has been
//   written too (near failures are not the Store's: the near copy is dropped instead, so near never
//   holds a value older than far's). No write-back mode: an acknowledged value is always in far.
// - Delete: from far, then from near (whatever far answered); the status is far's.
// - Exist: near, else far. List and Prefetch: far.
// - Deletes by other nodes that far reports (set_invalidation_handler) drop the near copy; when far
//   lost its notifications, every near key is checked against far in the background.
// Near evicts by its own policy (the local store reclaims its oldest segment when full).
//
// Thread safety: as every Backend (see backend.h).
#pragma once

#include <memory>

#include "gdkv/backend.h"
#include "gdkv/result.h"

namespace gdkv {

// An Error when near or far is null.
Result<std::shared_ptr<Backend>> make_tiered_backend(std::shared_ptr<Backend> near,
                                                     std::shared_ptr<Backend> far);

}  // namespace gdkv
