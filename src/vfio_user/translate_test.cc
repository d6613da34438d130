// DMA maps and data pointer translation: PRP, PRP lists, SGL, the gdkv flat extension, and every
// way a pointer can leave the client's maps.
#include "vfio_user/translate.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <thread>
#include <vector>

#include "vfio_user/dma_space.h"
#include "vfio_user/protocol.h"

namespace gdkv::vfio_user {
namespace {

using nvme::Status;
constexpr uint64_t kPage = 4096;

class Resolver final : public DmaResolver {
 public:
  explicit Resolver(DmaSpace& d) : d_(d) {}
  ~Resolver() override { DmaSpace::unpin(refs); }
  Status resolve(uint64_t iova, uint64_t len, bool w, DataSegments& out) override {
    return d_.resolve(iova, len, w, out, refs);
  }
  bool read(uint64_t iova, void* dst, size_t len) override { return d_.read(iova, dst, len); }
  MapRefs refs;

 private:
  DmaSpace& d_;
};

// 64 pages of client memory at IOVA 0x100000 (readable and writable), and a read-only page.
class TranslateTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kBase = 0x100000;
  static constexpr uint64_t kRoBase = 0x900000;
  void SetUp() override {
    mem_.resize(64 * kPage);
    ro_.resize(kPage);
    ASSERT_EQ(dma_.map_memory(kBase, mem_.data(), mem_.size(), true, true, MemKind::kHost), 0);
    ASSERT_EQ(dma_.map_memory(kRoBase, ro_.data(), ro_.size(), true, false, MemKind::kHost), 0);
  }
  std::byte* at(uint64_t iova) { return mem_.data() + (iova - kBase); }
  void put_u64(uint64_t iova, uint64_t v) { std::memcpy(at(iova), &v, 8); }
  Status run(const nvme::Sqe& sqe, uint64_t len, bool write, DataSegments& out, bool flat = false) {
    Resolver r(dma_);
    TranslateOptions o;
    o.flat = flat;
    return translate_data(sqe, len, write, o, r, out);
  }
  uint64_t total(const DataSegments& s) {
    uint64_t n = 0;
    for (auto& x : s) n += x.len;
    return n;
  }

  std::vector<std::byte> mem_, ro_;
  DmaSpace dma_;
};

TEST_F(TranslateTest, PrpSinglePageAndTwoPages) {
  nvme::Sqe s{};
  s.dptr.prp.prp1 = kBase + 100;
  DataSegments out;
  ASSERT_EQ(run(s, 200, true, out), Status::kSuccess);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].addr, at(kBase + 100));
  // Crossing into a second page needs PRP2; adjacent pages merge into one segment.
  out.clear();
  s.dptr.prp.prp2 = kBase + kPage;
  ASSERT_EQ(run(s, kPage, true, out), Status::kSuccess);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].len, kPage);
  // Non-adjacent second page: two segments.
  out.clear();
  s.dptr.prp.prp2 = kBase + 10 * kPage;
  ASSERT_EQ(run(s, kPage, true, out), Status::kSuccess);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[1].addr, at(kBase + 10 * kPage));
  // A misaligned PRP2 is malformed.
  out.clear();
  s.dptr.prp.prp2 = kBase + 10 * kPage + 8;
  EXPECT_EQ(run(s, kPage, true, out), Status::kInvalidField);
}

TEST_F(TranslateTest, PrpListAndChaining) {
  // 600 pages would need a chained list; keep to the map: 40 pages of data through a list whose
  // first page holds entries from offset 4096-16 so the second entry chains to another list page.
  const uint64_t list1 = kBase + 50 * kPage - 16;  // two slots: entry, then chain
  const uint64_t list2 = kBase + 51 * kPage;
  nvme::Sqe s{};
  s.dptr.prp.prp1 = kBase;  // page 0 (whole)
  s.dptr.prp.prp2 = list1;
  put_u64(list1, kBase + 1 * kPage);
  put_u64(list1 + 8, list2);  // last slot of the page: chain
  for (uint64_t i = 0; i < 8; ++i) put_u64(list2 + 8 * i, kBase + (2 + i) * kPage);
  DataSegments out;
  ASSERT_EQ(run(s, 10 * kPage, false, out), Status::kSuccess);
  EXPECT_EQ(total(out), 10 * kPage);
  ASSERT_EQ(out.size(), 1u);  // pages 0..9 are contiguous
  // An entry outside the maps is a transfer error; a misaligned one malformed.
  put_u64(list2 + 8 * 3, 0xdead0000);
  out.clear();
  EXPECT_EQ(run(s, 10 * kPage, false, out), Status::kDataTransferError);
  put_u64(list2 + 8 * 3, kBase + 5 * kPage + 1);
  out.clear();
  EXPECT_EQ(run(s, 10 * kPage, false, out), Status::kInvalidField);
  // A list pointer outside the maps.
  s.dptr.prp.prp2 = 0x7000000;
  out.clear();
  EXPECT_EQ(run(s, 10 * kPage, false, out), Status::kDataTransferError);
  // A misaligned list pointer.
  s.dptr.prp.prp2 = list1 + 3;
  out.clear();
  EXPECT_EQ(run(s, 10 * kPage, false, out), Status::kInvalidField);
}

TEST_F(TranslateTest, PrpListLoopTerminates) {
  // A chain slot that points at itself consumes no data: it must fail, not spin.
  const uint64_t list = kBase + 60 * kPage;
  put_u64(list + 511 * 8, list + 511 * 8);
  nvme::Sqe s{};
  s.dptr.prp.prp1 = kBase;
  s.dptr.prp.prp2 = list + 511 * 8;
  DataSegments out;
  EXPECT_EQ(run(s, 64 * kPage, false, out), Status::kInvalidField);
  // A list that chains back to its own start reuses pages but ends when the data does.
  for (uint64_t i = 0; i < 511; ++i) put_u64(list + 8 * i, kBase + (i % 40) * kPage);
  put_u64(list + 511 * 8, list);
  s.dptr.prp.prp2 = list;
  out.clear();
  EXPECT_EQ(run(s, 4096 * kPage, false, out), Status::kSuccess);
  EXPECT_EQ(total(out), 4096 * kPage);
  // Beyond the transfer limit: refused before anything is read.
  Resolver r(dma_);
  TranslateOptions o;
  o.max_transfer = 64 * kPage;
  out.clear();
  EXPECT_EQ(translate_data(s, 65 * kPage, false, o, r, out), Status::kInvalidField);
}

TEST_F(TranslateTest, FlatOnlyOnGdkvQueues) {
  nvme::Sqe s{};
  s.dptr.prp.prp1 = kBase + 5;
  DataSegments out;
  ASSERT_EQ(run(s, 3 * kPage, false, out, /*flat=*/true), Status::kSuccess);
  EXPECT_EQ(total(out), 3 * kPage);
  out.clear();
  // A standard queue: PRP2 = 0 for a multi-page transfer is not a valid page.
  EXPECT_EQ(run(s, 3 * kPage, false, out, /*flat=*/false), Status::kDataTransferError);
}

TEST_F(TranslateTest, Permissions) {
  nvme::Sqe s{};
  s.dptr.prp.prp1 = kRoBase;
  DataSegments out;
  EXPECT_EQ(run(s, 100, false, out), Status::kSuccess);
  out.clear();
  EXPECT_EQ(run(s, 100, true, out), Status::kDataTransferError);  // the controller would write
  // Past the end of a map, and an address that wraps.
  s.dptr.prp.prp1 = kBase + 64 * kPage - 10;
  out.clear();
  EXPECT_EQ(run(s, 100, false, out, true), Status::kDataTransferError);
  s.dptr.prp.prp1 = UINT64_MAX - 10;
  out.clear();
  EXPECT_EQ(run(s, 100, false, out, true), Status::kDataTransferError);
}

TEST_F(TranslateTest, Sgl) {
  nvme::Sqe s{};
  s.set_psdt(nvme::kPsdtSglContiguous);
  s.dptr.sgl = {kBase + 7, 5000, {}, 0x00};
  DataSegments out;
  ASSERT_EQ(run(s, 5000, true, out), Status::kSuccess);
  EXPECT_EQ(total(out), 5000u);
  out.clear();
  EXPECT_EQ(run(s, 6000, true, out), Status::kDataTransferError);  // describes too little
  // A last segment of three data blocks.
  const uint64_t seg = kBase + 40 * kPage;
  nvme::SglDescriptor d[3] = {
      {kBase, 100, {}, 0}, {kBase + kPage, 200, {}, 0}, {kBase + 3 * kPage, 300, {}, 0}};
  std::memcpy(at(seg), d, sizeof(d));
  s.dptr.sgl = {seg, sizeof(d), {}, 0x30};
  out.clear();
  ASSERT_EQ(run(s, 600, false, out), Status::kSuccess);
  EXPECT_EQ(out.size(), 3u);
  // A segment chaining to a last segment.
  const uint64_t seg0 = kBase + 41 * kPage;
  nvme::SglDescriptor head[2] = {{kBase + 5 * kPage, 50, {}, 0}, {seg, sizeof(d), {}, 0x30}};
  std::memcpy(at(seg0), head, sizeof(head));
  s.dptr.sgl = {seg0, sizeof(head), {}, 0x20};
  out.clear();
  ASSERT_EQ(run(s, 650, false, out), Status::kSuccess);
  EXPECT_EQ(total(out), 650u);
  // Bad: keyed/bit bucket types, a subtype, a length that is not whole descriptors, a segment
  // that chains to itself forever.
  s.dptr.sgl = {kBase, 100, {}, 0x10};
  out.clear();
  EXPECT_EQ(run(s, 100, false, out), Status::kInvalidField);
  s.dptr.sgl = {kBase, 100, {}, 0x01};
  out.clear();
  EXPECT_EQ(run(s, 100, false, out), Status::kInvalidField);
  s.dptr.sgl = {seg, 20, {}, 0x30};
  out.clear();
  EXPECT_EQ(run(s, 100, false, out), Status::kInvalidField);
  nvme::SglDescriptor self[2] = {{kBase, 1, {}, 0}, {seg0, 32, {}, 0x20}};
  std::memcpy(at(seg0), self, sizeof(self));
  s.dptr.sgl = {seg0, 32, {}, 0x20};
  out.clear();
  EXPECT_EQ(run(s, 1 << 20, false, out), Status::kInvalidField);
  // PSDT 11b is reserved.
  s.set_psdt(3);
  out.clear();
  EXPECT_EQ(run(s, 100, false, out), Status::kInvalidField);
}

// ---- DmaSpace with real memory fds -------------------------------------------------------------

UniqueFd make_memfd(size_t size, bool seal) {
  UniqueFd fd(::memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  EXPECT_TRUE(fd.valid());
  EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(size)), 0);
  if (seal) {
    EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  }
  return fd;
}

TEST(DmaSpace, MapRules) {
  DmaSpace d;
  EXPECT_EQ(d.map(0x10000, 0x4000, 0, kDmaFlagRead | kDmaFlagWrite, make_memfd(0x4000, true)), 0);
  // Overlap, bad alignment, zero size, wrap, unknown flags, no permission.
  EXPECT_EQ(d.map(0x12000, 0x4000, 0, 3, make_memfd(0x4000, true)), EEXIST);
  EXPECT_EQ(d.map(0xF000, 0x2000, 0, 3, make_memfd(0x4000, true)), EEXIST);
  EXPECT_EQ(d.map(0x20001, 0x1000, 0, 3, make_memfd(0x4000, true)), EINVAL);
  EXPECT_EQ(d.map(0x20000, 0, 0, 3, make_memfd(0x4000, true)), EINVAL);
  EXPECT_EQ(d.map(UINT64_MAX - 0xFFF, 0x2000, 0, 3, make_memfd(0x4000, true)), EINVAL);
  EXPECT_EQ(d.map(0x20000, 0x1000, 0, 0x4, make_memfd(0x4000, true)), EINVAL);
  EXPECT_EQ(d.map(0x20000, 0x1000, 0, 0, make_memfd(0x4000, true)), EINVAL);
  // A file shorter than offset + size, and an unsealed memfd (could be shrunk under us).
  EXPECT_EQ(d.map(0x20000, 0x4000, 0x2000, 3, make_memfd(0x4000, true)), EINVAL);
  EXPECT_EQ(d.map(0x20000, 0x1000, 0, 3, make_memfd(0x4000, false)), EPERM);
  // Not a file at all.
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  ::close(p[1]);
  EXPECT_EQ(d.map(0x20000, 0x1000, 0, 3, UniqueFd(p[0])), EINVAL);
  // A read-only fd cannot be mapped writable.
  {
    UniqueFd m = make_memfd(0x1000, true);
    const std::string path = "/proc/self/fd/" + std::to_string(m.get());
    UniqueFd ro(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    EXPECT_EQ(d.map(0x30000, 0x1000, 0, 3, std::move(ro)), EACCES);
  }
  EXPECT_EQ(d.count(), 1u);
  EXPECT_EQ(d.unmap(0x10000, 0x1000), ENOENT);  // must match exactly
  EXPECT_EQ(d.unmap(0x10000, 0x4000), 0);
  EXPECT_EQ(d.count(), 0u);
}

// Whether this process's page tables map the page at `p` (/proc/self/pagemap bit 63).
bool page_mapped(const void* p) {
  UniqueFd pm(::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC));
  uint64_t e = 0;
  const off_t at = static_cast<off_t>(reinterpret_cast<uintptr_t>(p) / 4096 * sizeof(e));
  EXPECT_EQ(::pread(pm.get(), &e, sizeof(e), at), static_cast<ssize_t>(sizeof(e)));
  return (e >> 63) & 1;
}

// The pages a client's memfd already holds (an engine pool shared in place) are in gdkvd's page
// tables once mapped, so the first transfers take no fault per page; its holes stay unallocated.
TEST(DmaSpace, MapFillsPageTablesForPresentPagesOnly) {
  constexpr size_t kPages = 16;
  UniqueFd fd = make_memfd(kPages * 4096, true);
  const char one = 1;
  for (const size_t pg : {0u, 1u, 2u, 3u, 8u, 9u, 15u}) {
    ASSERT_EQ(::pwrite(fd.get(), &one, 1, static_cast<off_t>(pg * 4096)), 1);
  }
  const int raw = fd.get();
  DmaSpace d;
  ASSERT_EQ(d.map(0x100000, kPages * 4096, 0, kDmaFlagRead | kDmaFlagWrite, std::move(fd)), 0);
  DataSegments out;
  MapRefs refs;
  ASSERT_EQ(d.resolve(0x100000, kPages * 4096, false, out, refs), Status::kSuccess);
  ASSERT_EQ(out.size(), 1u);
  const std::byte* host = out[0].addr;
  for (size_t pg = 0; pg < kPages; ++pg) {
    const bool present = pg <= 3 || pg == 8 || pg == 9 || pg == 15;
    EXPECT_EQ(page_mapped(host + pg * 4096), present) << "page " << pg;
  }
  // Nothing was allocated for the holes.
  EXPECT_EQ(::lseek(raw, 4 * 4096, SEEK_DATA), 8 * 4096);
  EXPECT_EQ(::lseek(raw, 10 * 4096, SEEK_DATA), 15 * 4096);
  DmaSpace::unpin(refs);
  EXPECT_EQ(d.unmap(0x100000, kPages * 4096), 0);
}

TEST(DmaSpace, MessageOnlyMapIsNotReachable) {
  DmaSpace d;
  ASSERT_EQ(d.map(0x10000, 0x1000, 0, 3, UniqueFd()), 0);
  DataSegments out;
  MapRefs refs;
  EXPECT_EQ(d.resolve(0x10000, 16, false, out, refs), Status::kDataTransferError);
  DmaSpace::unpin(refs);
  char b[8];
  EXPECT_FALSE(d.read(0x10000, b, 8));
}

TEST(DmaSpace, UnmapWaitsForCommandsAndRefusesQueues) {
  DmaSpace d;
  ASSERT_EQ(d.map(0x10000, 0x2000, 0, 3, make_memfd(0x2000, true)), 0);
  // A queue lives there: unmapping is refused.
  DmaMap* qm = nullptr;
  ASSERT_NE(d.acquire_queue(0x10000, 1024, true, &qm), nullptr);
  EXPECT_EQ(d.unmap(0x10000, 0x2000), EBUSY);
  EXPECT_EQ(d.unmap_all(), EBUSY);
  DmaSpace::release_queue(qm);
  // A command pins it: unmap waits for it.
  DataSegments out;
  MapRefs refs;
  ASSERT_EQ(d.resolve(0x10000, 64, true, out, refs), Status::kSuccess);
  std::atomic<bool> done{false};
  std::thread t([&] {
    EXPECT_EQ(d.unmap(0x10000, 0x2000), 0);
    done = true;
  });
  // unmap detaches the map first (lookups no longer find it), then waits for the pin.
  for (int i = 0; i < 100000 && d.count() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  EXPECT_EQ(d.count(), 0u);
  EXPECT_FALSE(done.load());
  // Still writable while pinned, even though lookups no longer find it.
  std::memset(out[0].addr, 1, 64);
  MapRefs other;
  DataSegments out2;
  EXPECT_EQ(d.resolve(0x10000, 64, true, out2, other), Status::kDataTransferError);
  DmaSpace::unpin(refs);
  DmaSpace::unpin(other);  // (nothing, unless the check above failed: then unmap waits for it)
  t.join();
  EXPECT_TRUE(done.load());
}

TEST(DmaSpace, ResolveAcrossAdjacentMaps) {
  DmaSpace d;
  std::vector<std::byte> a(8192), b(8192);
  ASSERT_EQ(d.map_memory(0x10000, a.data(), a.size(), true, true, MemKind::kHost), 0);
  ASSERT_EQ(d.map_memory(0x12000, b.data(), b.size(), true, true, MemKind::kHost), 0);
  DataSegments out;
  MapRefs refs;
  ASSERT_EQ(d.resolve(0x11000, 0x2000, true, out, refs), Status::kSuccess);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(refs.size(), 2u);
  DmaSpace::unpin(refs);
  std::vector<std::byte> buf(0x4000);
  EXPECT_TRUE(d.read(0x10800, buf.data(), 0x3000));
  EXPECT_FALSE(d.read(0x10800, buf.data(), 0x4000));  // runs past the second map
}

}  // namespace
}  // namespace gdkv::vfio_user
