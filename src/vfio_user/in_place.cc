// See in_place.h.
#include "vfio_user/in_place.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <vector>

namespace gdkv::vfio_user {

namespace {

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

std::string hex(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof(b), "0x%" PRIx64, v);
  return b;
}

// One line of /proc/self/maps.
struct Vma {
  uint64_t start = 0, end = 0, offset = 0, ino = 0;
  std::string perms, path;
};

// The mappings overlapping [a, b), in address order.
std::vector<Vma> vmas_over(uint64_t a, uint64_t b) {
  std::ifstream in("/proc/self/maps");
  if (!in) fail("cannot read /proc/self/maps");
  std::vector<Vma> out;
  std::string line;
  while (std::getline(in, line)) {
    Vma v;
    char range[64], perms[8], dev[16];
    unsigned long long off = 0, ino = 0;
    int used = 0;
    if (std::sscanf(line.c_str(), "%63s %7s %llx %15s %llu %n", range, perms, &off, dev, &ino,
                    &used) < 5) {
      continue;
    }
    unsigned long long s = 0, e = 0;
    if (std::sscanf(range, "%llx-%llx", &s, &e) != 2) continue;
    if (e <= a || s >= b) continue;
    v.start = s;
    v.end = e;
    v.offset = off;
    v.ino = ino;
    v.perms = perms;
    v.path = used > 0 && static_cast<size_t>(used) <= line.size() ? line.substr(used) : "";
    out.push_back(std::move(v));
  }
  return out;
}

bool private_anonymous(const Vma& v) {
  return v.perms.size() >= 4 && v.perms[0] == 'r' && v.perms[1] == 'w' && v.perms[3] == 'p' &&
         v.ino == 0 && (v.path.empty() || v.path == "[heap]" || v.path.rfind("[anon:", 0) == 0);
}

// Shared anonymous memory (mmap MAP_SHARED | MAP_ANONYMOUS: SGLang's host pool, so that
// cudaHostRegister pins populated pages) is shmem the kernel names "/dev/zero (deleted)".
bool shared_anonymous(const Vma& v) {
  return v.perms.size() >= 4 && v.perms[0] == 'r' && v.perms[1] == 'w' && v.perms[3] == 's' &&
         v.path.rfind("/dev/zero", 0) == 0;
}

// Whether another process maps any of v's pages (a child forked after the mmap): replacing
// them here would split this process's view from the other's. From /proc/self/smaps, whose
// Shared_* counts pages that other processes map too.
bool mapped_elsewhere(const Vma& v) {
  std::ifstream in("/proc/self/smaps");
  if (!in) return true;
  std::string line;
  bool in_v = false;
  while (std::getline(in, line)) {
    unsigned long long s = 0, e = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx ", &s, &e) == 2 && line.find(':') > line.find(' ')) {
      in_v = s == v.start;
      continue;
    }
    if (!in_v) continue;
    unsigned long long kb = 0;
    if ((std::sscanf(line.c_str(), "Shared_Clean: %llu", &kb) == 1 ||
         std::sscanf(line.c_str(), "Shared_Dirty: %llu", &kb) == 1) &&
        kb > 0) {
      return true;
    }
  }
  return false;
}

bool ours(const Vma& v) {
  return v.perms.size() >= 4 && v.perms[0] == 'r' && v.perms[1] == 'w' && v.perms[3] == 's' &&
         v.path.rfind(std::string("/memfd:") + kInPlaceName, 0) == 0;
}

std::string describe(const Vma& v) {
  return hex(v.start) + "-" + hex(v.end) + " " + v.perms + (v.path.empty() ? "" : " " + v.path);
}

// Whole pages, so also bytes around the caller's buffer that belong to other allocations: the
// kernel copies them (process_vm_readv on this process), which a sanitizer does not see as
// reading outside an object (AddressSanitizer's redzones lie in those pages); memcpy where the
// call is refused (a seccomp filter).
void copy_pages(std::byte* dst, const std::byte* src, size_t n) {
  while (n > 0) {
    iovec local{dst, n}, remote{const_cast<std::byte*>(src), n};
    const ssize_t got = ::process_vm_readv(::getpid(), &local, 1, &remote, 1, 0);
    if (got <= 0) break;
    dst += got;
    src += got;
    n -= static_cast<size_t>(got);
  }
  if (n > 0) std::memcpy(dst, src, n);
}

// Which of the `pages` pages at src the kernel holds (present or swapped out, per
// /proc/self/pagemap): untouched pages read as zero on both sides and need no copy, so a fresh
// allocation costs no copy and commits no memory. Empty when unknown (no pagemap, or `all`):
// every page is copied.
std::vector<bool> held_pages(const std::byte* src, size_t pages, size_t page, bool all) {
  std::vector<uint64_t> flags(pages);
  const int fd = all ? -1 : ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  bool known = false;
  if (fd >= 0) {
    const auto at = static_cast<off_t>(reinterpret_cast<uintptr_t>(src) / page * 8);
    const ssize_t want = static_cast<ssize_t>(pages * 8);
    known = ::pread(fd, flags.data(), static_cast<size_t>(want), at) == want;
    ::close(fd);
  }
  if (!known) return {};
  constexpr uint64_t kPresent = 1ull << 63, kSwapped = 1ull << 62;
  std::vector<bool> held(pages);
  for (size_t i = 0; i < pages; ++i) held[i] = (flags[i] & (kPresent | kSwapped)) != 0;
  return held;
}

// Copies pages [first, last) of src to dst, those `held` names (all of them if it is empty), in
// runs. Allocates nothing.
void copy_held_pages(std::byte* dst, const std::byte* src, const std::vector<bool>& held,
                     size_t first, size_t last, size_t page) {
  size_t i = first;
  while (i < last) {
    if (!held.empty() && !held[i]) {
      ++i;
      continue;
    }
    size_t j = i + 1;
    while (j < last && (held.empty() || held[j])) ++j;
    copy_pages(dst + i * page, src + i * page, (j - i) * page);
    i = j;
  }
}

// A memfd this process's memory lies on. Kept while the pages are mapped, even with no share
// left, so sharing them again reuses it instead of copying the pages (a copy would lose what
// other threads write meanwhile: an engine's KV pool is in use by then).
struct Shared {
  UniqueFd fd;
  uint32_t refs = 0;  // connections sharing it
};
std::mutex g_mu;
std::map<uint64_t, Shared> g_shared;  // memfd inode -> fd; guarded by g_mu

// Closes the memfds no connection shares whose pages are no longer mapped (the memory was freed),
// so their pages go back to the system. REQUIRES: g_mu held.
void drop_unmapped() {
  bool idle = false;
  for (const auto& [ino, s] : g_shared) idle |= s.refs == 0;
  if (!idle) return;
  std::set<uint64_t> mapped;
  for (const Vma& v : vmas_over(0, UINT64_MAX)) {
    if (ours(v)) mapped.insert(v.ino);
  }
  std::erase_if(g_shared,
                [&](const auto& e) { return e.second.refs == 0 && mapped.count(e.first) == 0; });
}

}  // namespace

namespace {

// Moves the pages [a, a + n) onto a new sealed memfd, which then takes their place, and enters it
// in g_shared. `all`: copy every page (see copy_held_pages). REQUIRES: g_mu held.
uint64_t move_to_memfd(uint64_t a, uint64_t n, bool all) {
  UniqueFd fd(::memfd_create(kInPlaceName, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid() || ::ftruncate(fd.get(), static_cast<off_t>(n)) != 0 ||
      ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    fail(std::string("share: memfd: ") + std::strerror(errno));
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) fail(std::string("share: fstat: ") + std::strerror(errno));
  void* tmp = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (tmp == MAP_FAILED) fail(std::string("share: mmap: ") + std::strerror(errno));
  // The first and last page may hold other allocations and malloc's own headers (a buffer on
  // the heap), which this thread or another may change until the mremap: whatever is written to
  // the old pages after their copy is lost. So nothing is allocated or freed from here to the
  // mremap (a free next to the buffer would be undone: heap corruption), and those two pages
  // are copied last, leaving a window of two page copies and one system call.
  const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t pages = n / page;
  auto* dst = static_cast<std::byte*>(tmp);
  const auto* src = reinterpret_cast<const std::byte*>(a);
  const std::vector<bool> held = held_pages(src, pages, page, all);
  if (pages > 2) copy_held_pages(dst, src, held, 1, pages - 1, page);
  copy_held_pages(dst, src, held, 0, 1, page);
  if (pages > 1) copy_held_pages(dst, src, held, pages - 1, pages, page);
  void* moved = ::mremap(tmp, n, n, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(a));
  if (moved == MAP_FAILED) {
    const int e = errno;
    ::munmap(tmp, n);
    fail(std::string("share: mremap: ") + std::strerror(e));
  }
  g_shared[st.st_ino].fd = std::move(fd);
  return st.st_ino;
}

}  // namespace

std::vector<InPlaceRange> share_in_place(const void* p, size_t len) {
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const auto u = reinterpret_cast<uintptr_t>(p);
  if (len == 0 || u + len < u || u + len > UINTPTR_MAX - page) fail("share: an empty or bad range");
  const uint64_t a = u / page * page;
  const uint64_t b = (u + len + page - 1) / page * page;
  std::lock_guard lk(g_mu);
  drop_unmapped();
  const std::vector<Vma> vmas = vmas_over(a, b);
  uint64_t at = a;
  for (const Vma& v : vmas) {
    if (v.start > at) break;
    at = v.end;
  }
  if (at < b) {
    fail("share: memory at " + hex(std::max(at, a)) + " is not mapped in this process");
  }
  // The range as pieces, each on one memfd: a run of pages already on one of ours (shared
  // before: another buffer's pages next to this one, another connection's share, an earlier
  // one) stays there; each run of other pages is moved onto a new memfd. Everything is checked
  // before anything moves.
  struct Run {
    uint64_t start, end, ino, offset;  // ino 0: pages to move
    bool copy_all;
  };
  std::vector<Run> runs;
  for (const Vma& v : vmas) {
    const uint64_t s = std::max(v.start, a), e = std::min(v.end, b);
    const bool kept = ours(v) && g_shared.count(v.ino) != 0;
    bool all = false;
    if (shared_anonymous(v)) {
      if (mapped_elsewhere(v)) {
        fail("share: memory at " + describe(v) +
             " is shared memory that another process maps too (a child forked after it was "
             "allocated); it cannot be moved onto memory gdkvd maps");
      }
      all = true;
    } else if (!kept && !private_anonymous(v) && !ours(v)) {
      fail("share: memory at " + describe(v) +
           " is not private anonymous read-write memory (malloc, numpy or torch arrays); a "
           "file, a shared mapping, read-only pages or a stack cannot be shared in place");
    }
    const uint64_t ino = kept ? v.ino : 0, offset = kept ? v.offset + (s - v.start) : 0;
    if (!runs.empty() && runs.back().end == s && runs.back().ino == ino &&
        (ino == 0 || runs.back().offset + (s - runs.back().start) == offset)) {
      runs.back().end = e;
      runs.back().copy_all |= all;
    } else {
      runs.push_back(Run{s, e, ino, offset, all});
    }
  }
  for (Run& r : runs) {
    if (r.ino == 0) r.ino = move_to_memfd(r.start, r.end - r.start, r.copy_all);
  }
  std::vector<InPlaceRange> out;
  for (const Run& r : runs) {
    UniqueFd dup(::fcntl(g_shared[r.ino].fd.get(), F_DUPFD_CLOEXEC, 0));
    if (!dup.valid()) fail(std::string("share: dup: ") + std::strerror(errno));
    out.push_back(InPlaceRange{r.start, r.end - r.start, r.offset, std::move(dup), r.ino});
  }
  for (const Run& r : runs) ++g_shared[r.ino].refs;  // nothing can fail from here
  return out;
}

void release_in_place(uint64_t ino) {
  std::lock_guard lk(g_mu);
  auto it = g_shared.find(ino);
  if (it != g_shared.end() && it->second.refs > 0) --it->second.refs;
}

void prepare_in_place(const void* p, size_t len) {
  for (const InPlaceRange& r : share_in_place(p, len)) release_in_place(r.ino);
}

}  // namespace gdkv::vfio_user
