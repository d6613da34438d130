// Memory a client already has, shared with gdkvd where it lies (VfioUserDevice::share).
//
// gdkvd reaches a client's memory only through the memory fds the client DMA_MAPs, so memory an
// engine allocated itself (malloc, a torch or numpy array: private anonymous pages) is first made
// memfd-backed at the same addresses: a sealed memfd of the range's pages gets their contents
// (only the pages the kernel holds: untouched ones are zero on both sides), is mapped over a
// spare address, and mremap(MREMAP_FIXED) moves that mapping onto the range, replacing the old
// pages in one step. The process then sees the same bytes at the same addresses, and gdkvd maps
// the same memfd. What it costs the caller:
//   - writes to the range by other threads while it is being shared are lost (share memory
//     before it is in use: an engine's KV pool at registration). Its first and last page may
//     also hold other allocations (a buffer on the heap): they are copied last, right before
//     the move, and the sharing thread allocates nothing in between, so only another thread
//     writing there within that window (two page copies and one mremap) would lose its write;
//   - a child forked later shares these pages with the parent instead of getting a copy;
//   - the memory must stay allocated while it is shared (unshare before freeing it).
//
// A process-wide table keeps the memfd of each range while its pages stay mapped, so a second
// connection sharing the same memory, or a new connection after the last one let go (a gdkvd
// restarted under an engine), maps the same memfd: copying the pages again would leave an
// earlier connection's gdkvd with pages the process no longer sees, and would lose what other
// threads write meanwhile. Only the first share of private memory copies. A memfd whose pages
// were unmapped (the memory freed) and that no connection shares is closed at the next share.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "vfio_user/socket_io.h"

namespace gdkv::vfio_user {

struct InPlaceRange {
  uint64_t addr = 0;    // page-aligned start of a piece
  uint64_t size = 0;    // page-aligned length
  uint64_t offset = 0;  // of addr in the memfd
  UniqueFd fd;          // a duplicate of the memfd, for DMA_MAP
  uint64_t ino = 0;     // the memfd's inode: what release() takes
};

// Makes the pages covering [p, p + len) memfd-backed and takes a reference on each memfd they
// lie on: the pieces, in address order, each a run of pages on one memfd. Pages on a memfd of an
// earlier share (a neighbouring buffer's boundary page, another connection's share, a share made
// before) stay there; every other run is moved onto a new memfd. Throws std::runtime_error
// naming the problem: memory that is not mapped, or not private anonymous read-write memory (a
// file, a shared mapping another process maps too, read-only pages, the stack). REQUIRES: len > 0.
std::vector<InPlaceRange> share_in_place(const void* p, size_t len);

// Drops the reference share_in_place took (`ino` of its range). The memfd stays for a later share
// while the pages are mapped.
void release_in_place(uint64_t ino);

// Makes the pages covering [p, p + len) memfd-backed now, with no connection: a later share of
// them (by any connection, at any time) copies nothing. Throws as share_in_place.
void prepare_in_place(const void* p, size_t len);

// The memfd name that marks gdkv's own in-place mappings in /proc/self/maps.
inline constexpr const char* kInPlaceName = "gdkv-in-place";

}  // namespace gdkv::vfio_user
