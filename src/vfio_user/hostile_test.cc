// Hostile input: malformed vfio-user messages, bad descriptors, overlapping and in-use maps,
// queue commands and SQEs that point outside the client's memory, garbage doorbells. Every case
// gets an error reply or an NVMe status; the server keeps serving a well-behaved client throughout
// and leaks no descriptors.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/client.h"
#include "gdkv/commands.h"
#include "gdkv/vfio_user.h"
#include "raw_host.h"
#include "vfio_user/nvme_defs.h"
#include "vfio_user/pci_config.h"
#include "vfio_user/protocol.h"
#include "vfio_user_test_util.h"

namespace gdkv {
namespace {

using nvme::Status;
using namespace vfio_user;  // NOLINT
using vfio_user::test::RawClient;
using vfio_user::test::TempDir;

size_t open_fds() {
  size_t n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
  ::closedir(d);
  return n;
}

UniqueFd memfd(size_t size, bool seal = true) {
  UniqueFd fd(::memfd_create("hostile", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) std::abort();
  if (seal) ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
  return fd;
}

class Hostile : public ::testing::Test {
 protected:
  void SetUp() override {
    ControllerOptions co;
    co.reactors = 1;
    co.idle_spin_us = 1000;
    ctl_ = std::make_unique<Controller>(make_memory_backend(), co);
    VfioUserServerOptions so;
    so.socket_dir = dir_.path();
    so.log = [](const std::string&) {};
    so.max_dma_maps = 8;
    so.dma_reply_timeout_ms = 300;
    so.message_bounce_bytes = 64 << 10;
    server_ = std::make_unique<VfioUserServer>(*ctl_, so);
    server_->start().value();
    // A well-behaved client that must keep working whatever the others do.
    good_ = connect_vfio_user(dir_.path()).value();
    ASSERT_TRUE(good_->put(*Key::from_string("good"), std::vector<std::byte>(100)).ok());
  }
  void TearDown() override {
    good_.reset();
    server_->stop();
    ctl_->stop();
  }
  void expect_good_client_works() {
    std::vector<std::byte> out;
    EXPECT_TRUE(good_->get(*Key::from_string("good"), out).ok());
    EXPECT_EQ(out.size(), 100u);
  }
  void wait_clients(size_t n) {
    for (int i = 0; i < 500 && server_->clients() != n; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_EQ(server_->clients(), n);
  }

  TempDir dir_{"hostile"};
  std::unique_ptr<Controller> ctl_;
  std::unique_ptr<VfioUserServer> server_;
  std::unique_ptr<Client> good_;
};

constexpr uint16_t c(Cmd x) { return static_cast<uint16_t>(x); }

TEST_F(Hostile, FramingErrorsCloseTheConnection) {
  {
    RawClient r(dir_.path());
    ASSERT_TRUE(r.ok());
    // A size smaller than the header: an error reply, then the connection closes.
    ASSERT_TRUE(r.send(c(Cmd::kVersion), {}, {}, kTypeCommand, 8));
    Message m;
    ASSERT_TRUE(r.recv(m));
    EXPECT_TRUE(m.hdr.flags & kErrorFlag);
    EXPECT_EQ(m.hdr.error, static_cast<uint32_t>(EINVAL));
    EXPECT_FALSE(r.recv(m));
  }
  {
    RawClient r(dir_.path());
    ASSERT_TRUE(r.send(c(Cmd::kRegionWrite), {}, {}, kTypeCommand, 64 << 20));
    Message m;
    ASSERT_TRUE(r.recv(m));
    EXPECT_EQ(m.hdr.error, static_cast<uint32_t>(E2BIG));
    EXPECT_FALSE(r.recv(m));
  }
  {
    RawClient r(dir_.path());
    ASSERT_TRUE(r.send(c(Cmd::kVersion), {}, {}, 0x7));  // neither command nor reply
    Message m;
    ASSERT_TRUE(r.recv(m));
    EXPECT_TRUE(m.hdr.flags & kErrorFlag);
    EXPECT_FALSE(r.recv(m));
  }
  {
    // A message cut short by the peer closing: nothing to answer, nothing leaked.
    RawClient r(dir_.path());
    Header h{1, c(Cmd::kVersion), 1000, kTypeCommand, 0};
    ASSERT_EQ(::write(r.fd(), &h, sizeof(h)), static_cast<ssize_t>(sizeof(h)));
  }
  expect_good_client_works();
}

TEST_F(Hostile, VersionRules) {
  RawClient r(dir_.path());
  // Anything before VERSION is refused; the connection stays usable.
  EXPECT_EQ(r.call(c(Cmd::kDeviceGetInfo), RawClient::bytes_of(DeviceInfoMsg{16, 0, 0, 0})),
            EINVAL);
  std::vector<std::byte> p(4 + 3);
  VersionMsg v{0, 0};
  std::memcpy(p.data(), &v, 4);
  std::memcpy(p.data() + 4, "{\"a", 3);  // no NUL, not JSON
  EXPECT_EQ(r.call(c(Cmd::kVersion), p), EINVAL);
  EXPECT_EQ(r.call(c(Cmd::kVersion), std::vector<std::byte>(2)), EINVAL);  // short
  Message m;
  ASSERT_EQ(r.version(), 0);
  EXPECT_EQ(r.call(c(Cmd::kVersion), RawClient::bytes_of(v)), EINVAL);  // only once
  // Major version 1: refused, then closed.
  RawClient r2(dir_.path());
  v.major = 1;
  EXPECT_EQ(r2.call(c(Cmd::kVersion), RawClient::bytes_of(v)), ENOTSUP);
  EXPECT_FALSE(r2.recv(m));
  expect_good_client_works();
}

TEST_F(Hostile, VersionReplyIsNulTerminatedJson) {
  RawClient r(dir_.path());
  VersionMsg v{0, 1};  // SPDK: no JSON at all
  Message m;
  ASSERT_EQ(r.call(c(Cmd::kVersion), RawClient::bytes_of(v), &m), 0);
  ASSERT_GT(m.payload.size(), 5u);
  EXPECT_EQ(m.payload.back(), std::byte{0});
  VersionRequest back;
  ASSERT_EQ(decode_version(m.payload, &back), 0);
  EXPECT_EQ(back.minor, 1);
  EXPECT_TRUE(back.caps.has_json);
}

TEST_F(Hostile, WrongSizesAndUnknownCommands) {
  const size_t fds_before = open_fds();
  {
    RawClient r(dir_.path());
    ASSERT_EQ(r.version(), 0);
    const std::vector<std::byte> tiny(3);
    for (Cmd x : {Cmd::kDmaMap, Cmd::kDmaUnmap, Cmd::kDeviceGetInfo, Cmd::kDeviceGetRegionInfo,
                  Cmd::kDeviceGetIrqInfo, Cmd::kDeviceSetIrqs, Cmd::kRegionRead, Cmd::kRegionWrite,
                  Cmd::kRegionWriteMulti}) {
      EXPECT_EQ(r.call(c(x), tiny), EINVAL) << cmd_name(c(x));
    }
    EXPECT_EQ(r.call(999, tiny), ENOSYS);
    EXPECT_EQ(r.call(c(Cmd::kDmaRead), tiny), EINVAL);
    EXPECT_EQ(r.call(c(Cmd::kDeviceFeature), tiny), ENOTTY);
    // argsz smaller than the structure.
    EXPECT_EQ(r.call(c(Cmd::kDeviceGetInfo), RawClient::bytes_of(DeviceInfoMsg{4, 0, 0, 0})),
              EINVAL);
    // Region accesses out of range, to a missing region, claiming more data than sent.
    RegionAccessMsg a{0, kRegionConfig, 8};
    a.offset = kConfigSize - 4;
    EXPECT_EQ(r.call(c(Cmd::kRegionRead), RawClient::bytes_of(a)), EINVAL);
    a = {0, 99, 4};
    EXPECT_EQ(r.call(c(Cmd::kRegionRead), RawClient::bytes_of(a)), EINVAL);
    a = {0, kRegionBar0, kMaxDataXfer + 1};
    EXPECT_EQ(r.call(c(Cmd::kRegionRead), RawClient::bytes_of(a)), EINVAL);
    a = {UINT64_MAX - 2, kRegionBar0, 4};
    EXPECT_EQ(r.call(c(Cmd::kRegionRead), RawClient::bytes_of(a)), EINVAL);
    a = {0x14, kRegionBar0, 100};  // write claiming 100 bytes, carrying none
    EXPECT_EQ(r.call(c(Cmd::kRegionWrite), RawClient::bytes_of(a)), EINVAL);
    RegionInfoMsg ri{32, 0, 42, 0, 0, 0};
    EXPECT_EQ(r.call(c(Cmd::kDeviceGetRegionInfo), RawClient::bytes_of(ri)), EINVAL);
    IrqSetMsg s{20, kIrqSetDataEventfd | kIrqSetActionTrigger, kIrqMsix, 30, 10};
    EXPECT_EQ(r.call(c(Cmd::kDeviceSetIrqs), RawClient::bytes_of(s)), EINVAL);  // past the end
    s = {20, kIrqSetDataBool | kIrqSetDataNone | kIrqSetActionTrigger, kIrqMsix, 0, 1};
    EXPECT_EQ(r.call(c(Cmd::kDeviceSetIrqs), RawClient::bytes_of(s)), EINVAL);  // two data kinds
    s = {20, kIrqSetDataBool | kIrqSetActionTrigger, kIrqMsix, 0, 8};
    EXPECT_EQ(r.call(c(Cmd::kDeviceSetIrqs), RawClient::bytes_of(s)), EINVAL);  // bools missing
    uint64_t multi[1] = {1000};
    EXPECT_EQ(r.call(c(Cmd::kRegionWriteMulti), RawClient::bytes_of(multi)), EINVAL);
    // NO_REPLY: an erroneous request gets no reply; the next one is answered normally.
    ASSERT_TRUE(r.send(999, tiny, {}, kTypeCommand | kNoReply));
    Message m;
    ASSERT_EQ(r.call(c(Cmd::kDeviceGetInfo), RawClient::bytes_of(DeviceInfoMsg{16, 0, 0, 0}), &m),
              0);
    EXPECT_EQ(m.hdr.command, c(Cmd::kDeviceGetInfo));
    // A region info buffer too small for the capability: the needed size comes back, no fd.
    RegionInfoMsg small{32, 0, kRegionBar0, 0, 0, 0};
    ASSERT_EQ(r.call(c(Cmd::kDeviceGetRegionInfo), RawClient::bytes_of(small), &m), 0);
    EXPECT_TRUE(m.fds.empty());
    RegionInfoMsg got;
    std::memcpy(&got, m.payload.data(), sizeof(got));
    EXPECT_GT(got.argsz, 32u);
    EXPECT_FALSE(got.flags & kRegionFlagCaps);  // QEMU rejects CAPS with cap_offset 0
  }
  wait_clients(1);
  EXPECT_EQ(open_fds(), fds_before);
  expect_good_client_works();
}

TEST_F(Hostile, BadDescriptorsAndMaps) {
  const size_t fds_before = open_fds();
  {
    RawClient r(dir_.path());
    ASSERT_EQ(r.version(), 0);
    auto map = [&](uint64_t addr, uint64_t size, std::vector<int> fds, uint64_t offset = 0) {
      const DmaMapMsg m{32, kDmaFlagRead | kDmaFlagWrite, offset, addr, size};
      return r.call(c(Cmd::kDmaMap), RawClient::bytes_of(m), nullptr, fds);
    };
    UniqueFd a = memfd(0x10000), b = memfd(0x10000), unsealed = memfd(0x10000, false);
    int p[2];
    ASSERT_EQ(::pipe(p), 0);
    UniqueFd pr(p[0]), pw(p[1]);
    EXPECT_EQ(map(0x100000, 0x10000, {a.get(), b.get()}), EINVAL);  // two fds
    EXPECT_EQ(map(0x100000, 0x10000, {pr.get()}), EINVAL);          // not a file
    EXPECT_EQ(map(0x100000, 0x10000, {unsealed.get()}), EPERM);     // could shrink under us
    EXPECT_EQ(map(0x100000, 0x20000, {a.get()}), EINVAL);           // longer than the file
    EXPECT_EQ(map(0x100000, 0x10000, {}, 0x1000), EINVAL);          // offset without an fd
    EXPECT_EQ(map(0x100000, 0x10000, {a.get()}), 0);
    EXPECT_EQ(map(0x108000, 0x10000, {b.get()}), EEXIST);  // overlapping
    EXPECT_EQ(map(0x0F8000, 0x10000, {b.get()}), EEXIST);
    EXPECT_EQ(map(0x200000, 0x1000, {}), 0);  // message-only (no fd)
    // The map limit (8).
    int placed = 0;
    for (int i = 0; i < 10; ++i) placed += map(0x1000000 + i * 0x10000, 0x1000, {}) == 0;
    EXPECT_EQ(placed, 6);
    // Unmap must match a map exactly; flags it does not know are refused.
    DmaUnmapMsg u{24, 0, 0x100000, 0x1000};
    EXPECT_EQ(r.call(c(Cmd::kDmaUnmap), RawClient::bytes_of(u)), ENOENT);
    u = {24, 0x8, 0x100000, 0x10000};
    EXPECT_EQ(r.call(c(Cmd::kDmaUnmap), RawClient::bytes_of(u)), EINVAL);
    u = {24, kDmaUnmapFlagGetDirtyBitmap, 0x100000, 0x10000};
    EXPECT_EQ(r.call(c(Cmd::kDmaUnmap), RawClient::bytes_of(u)), ENOTSUP);
    // Descriptors on a message that takes none are closed (SPDK sends one with DMA_UNMAP).
    u = {24, 0, 0x100000, 0x10000};
    Message m;
    EXPECT_EQ(r.call(c(Cmd::kDmaUnmap), RawClient::bytes_of(u), &m, std::vector<int>{b.get()}), 0);
    EXPECT_EQ(m.payload.size(), sizeof(u));  // echoes the entry
    EXPECT_EQ(r.call(c(Cmd::kDeviceGetInfo), RawClient::bytes_of(DeviceInfoMsg{16, 0, 0, 0}),
                     nullptr, std::vector<int>{a.get(), b.get()}),
              0);
    // MSI-X eventfds: assign, replace, de-assign; a count/fd mismatch is refused.
    IrqSetMsg s{20, kIrqSetDataEventfd | kIrqSetActionTrigger, kIrqMsix, 0, 2};
    UniqueFd e1(::eventfd(0, EFD_CLOEXEC)), e2(::eventfd(0, EFD_CLOEXEC));
    EXPECT_EQ(
        r.call(c(Cmd::kDeviceSetIrqs), RawClient::bytes_of(s), nullptr, std::vector<int>{e1.get()}),
        EINVAL);
    EXPECT_EQ(r.call(c(Cmd::kDeviceSetIrqs), RawClient::bytes_of(s), nullptr,
                     std::vector<int>{e1.get(), e2.get()}),
              0);
    // The client triggers vector 1 itself: its eventfd fires.
    IrqSetMsg t{20, kIrqSetDataNone | kIrqSetActionTrigger, kIrqMsix, 1, 1};
    EXPECT_EQ(r.call(c(Cmd::kDeviceSetIrqs), RawClient::bytes_of(t)), 0);
    uint64_t n = 0;
    EXPECT_EQ(::read(e2.get(), &n, 8), 8);
    EXPECT_EQ(n, 1u);
    s = {20, kIrqSetDataNone | kIrqSetActionTrigger, kIrqMsix, 0, 0};  // disable all
    EXPECT_EQ(r.call(c(Cmd::kDeviceSetIrqs), RawClient::bytes_of(s)), 0);
  }
  wait_clients(1);
  EXPECT_EQ(open_fds(), fds_before);  // every descriptor the server got was closed
  expect_good_client_works();
}

TEST_F(Hostile, QueuesAndSqesOutsideTheMaps) {
  auto dev = VfioUserDevice::open(dir_.path()).value();
  // Create I/O CQ/SQ with hostile parameters.
  nvme::Sqe q{};
  q.opcode = static_cast<uint8_t>(AdminOp::kCreateIoCq);
  q.key_length = 1;  // PC
  q.cdw10 = 5 | (63u << 16);
  q.dptr.prp.prp1 = 0x10000;  // not mapped
  EXPECT_EQ(dev->admin(q).status, Status::kDataTransferError);
  q.cdw10 = 40 | (63u << 16);  // qid beyond the doorbell page
  EXPECT_EQ(dev->admin(q).status_type, nvme::kSctCommandSpecific);
  void* ring = dev->alloc(64 * 64, 4096);
  q.dptr.prp.prp1 = reinterpret_cast<uint64_t>(ring);
  q.cdw10 = 5 | (0u << 16);  // one entry
  EXPECT_EQ(dev->admin(q).status_type, nvme::kSctCommandSpecific);
  q.cdw10 = 5 | (62u << 16);  // 63 entries with counter doorbells: not a power of two
  q.cdw12 = kCounterDoorbells;
  EXPECT_EQ(dev->admin(q).status_type, nvme::kSctCommandSpecific);
  q.cdw12 = 0;
  q.key_length = 0;  // not physically contiguous
  EXPECT_EQ(dev->admin(q).status, Status::kInvalidField);
  q.key_length = 1 | 2;  // interrupts on vector 900
  q.cdw11_reserved = 900;
  EXPECT_EQ(dev->admin(q).status_type, nvme::kSctCommandSpecific);
  nvme::Sqe sq{};
  sq.opcode = static_cast<uint8_t>(AdminOp::kCreateIoSq);
  sq.key_length = 1;
  sq.cdw10 = 5 | (63u << 16);
  sq.cdw11_reserved = 7;  // no such CQ
  sq.dptr.prp.prp1 = reinterpret_cast<uint64_t>(ring);
  EXPECT_EQ(dev->admin(sq).status_type, nvme::kSctCommandSpecific);
  nvme::Sqe del{};
  del.opcode = static_cast<uint8_t>(AdminOp::kDeleteIoCq);
  del.cdw10 = 9;
  EXPECT_EQ(dev->admin(del).status_type, nvme::kSctCommandSpecific);
  dev->free(ring);

  // I/O: data pointers outside the maps, PRP lists outside, malformed PRPs, SGL oddities.
  auto cl = dev->make_client(16).value();
  const Key k = *Key::from_string("victim");
  ASSERT_TRUE(cl->put(k, std::vector<std::byte>(20000, std::byte{7})).ok());
  auto* buf = static_cast<std::byte*>(dev->alloc(5 * 4096, 4096));
  nvme::Sqe s = cmd::retrieve(k.bytes, k.len, reinterpret_cast<void*>(0x1000), 4096);
  EXPECT_EQ(cl->execute(s).status, Status::kDataTransferError);
  s = cmd::retrieve(k.bytes, k.len, buf, 20000);
  s.dptr.prp.prp2 = 0x5000;  // a PRP list pointer outside the maps
  EXPECT_EQ(cl->execute(s).status, Status::kDataTransferError);
  s.dptr.prp.prp2 = reinterpret_cast<uint64_t>(buf) + 3;  // misaligned list pointer
  EXPECT_EQ(cl->execute(s).status, Status::kInvalidField);
  auto* list = reinterpret_cast<uint64_t*>(buf + 4 * 4096);
  list[0] = reinterpret_cast<uint64_t>(buf) + 4096;
  list[1] = 0xdeadbeef000;  // an entry outside the maps
  list[2] = reinterpret_cast<uint64_t>(buf) + 3 * 4096;
  list[3] = reinterpret_cast<uint64_t>(buf) + 3 * 4096;
  s.dptr.prp.prp2 = reinterpret_cast<uint64_t>(list);
  EXPECT_EQ(cl->execute(s).status, Status::kDataTransferError);
  list[1] = reinterpret_cast<uint64_t>(buf) + 2 * 4096;
  EXPECT_TRUE(cl->execute(s).ok());
  s.set_psdt(nvme::kPsdtSglContiguous);
  s.dptr.sgl = {0x4000, 20000, {}, 0x00};
  EXPECT_EQ(cl->execute(s).status, Status::kDataTransferError);
  s.dptr.sgl = {reinterpret_cast<uint64_t>(buf), 20000, {}, 0x50};  // transport data block
  EXPECT_EQ(cl->execute(s).status, Status::kInvalidField);
  // Store reading from outside, bad key sizes, unknown opcodes, fused commands.
  s = cmd::store(k.bytes, k.len, reinterpret_cast<void*>(0x7000), 100);
  EXPECT_EQ(cl->execute(s).status, Status::kDataTransferError);
  s = cmd::exist(k.bytes, k.len);
  s.key_length = 200;
  EXPECT_EQ(cl->execute(s).status, Status::kInvalidKeySize);
  s.key_length = k.len;
  s.opcode = 0xEE;
  EXPECT_EQ(cl->execute(s).status, Status::kInvalidOpcode);
  s.opcode = static_cast<uint8_t>(nvme::Opcode::kExist);
  s.flags = 1;
  EXPECT_EQ(cl->execute(s).status, Status::kInvalidField);
  s.flags = 0;
  s.nsid = 77;
  EXPECT_EQ(cl->execute(s).status, Status::kInvalidNamespace);
  dev->free(buf);
  expect_good_client_works();
}

TEST_F(Hostile, GarbageDoorbells) {
  auto dev = VfioUserDevice::open(dir_.path()).value();
  auto cl = dev->make_client(16).value();
  const Key k = *Key::from_string("db");
  ASSERT_TRUE(cl->put(k, std::vector<std::byte>(10)).ok());
  // Far ahead and behind: both ignored (counter doorbells compare by signed difference).
  const uint32_t sane = __atomic_load_n(&cl->queue().db->sq_tail, __ATOMIC_ACQUIRE);
  __atomic_store_n(&cl->queue().db->sq_tail, sane + 0x80000000u, __ATOMIC_RELEASE);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  __atomic_store_n(&cl->queue().db->sq_tail, sane - 5, __ATOMIC_RELEASE);
  __atomic_store_n(&cl->queue().db->cq_head, 0xFFFF0000u, __ATOMIC_RELEASE);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(cl->exists(k).ok());
  expect_good_client_works();
}

TEST_F(Hostile, UnmapInUseAndReset) {
  RawClient r(dir_.path());
  ASSERT_EQ(r.version(), 0);
  // Map memory, put an admin queue in it, enable the controller through registers.
  UniqueFd m = memfd(0x10000);
  const uint64_t iova = 0x40000000;
  const DmaMapMsg dm{32, kDmaFlagRead | kDmaFlagWrite, 0, iova, 0x10000};
  ASSERT_EQ(r.call(c(Cmd::kDmaMap), RawClient::bytes_of(dm), nullptr, std::vector<int>{m.get()}),
            0);
  auto wr = [&](uint32_t off, uint64_t v, uint32_t n) {
    std::vector<std::byte> p(16 + n);
    const RegionAccessMsg a{off, kRegionBar0, n};
    std::memcpy(p.data(), &a, 16);
    std::memcpy(p.data() + 16, &v, n);
    return r.call(c(Cmd::kRegionWrite), p);
  };
  auto rd = [&](uint32_t off) {
    Message rep;
    const RegionAccessMsg a{off, kRegionBar0, 4};
    EXPECT_EQ(r.call(c(Cmd::kRegionRead), RawClient::bytes_of(a), &rep), 0);
    uint32_t v = 0;
    if (rep.payload.size() >= 20) std::memcpy(&v, rep.payload.data() + 16, 4);
    return v;
  };
  ASSERT_EQ(wr(reg::kAqa, (3u << 16) | 3u, 4), 0);
  ASSERT_EQ(wr(reg::kAsq, iova, 8), 0);
  ASSERT_EQ(wr(reg::kAcq, iova + 0x1000, 8), 0);
  ASSERT_EQ(wr(reg::kCc, kCcEn | (6u << 4) | (6u << 16) | (4u << 20), 4), 0);
  for (int i = 0; i < 1000 && !(rd(reg::kCsts) & kCstsRdy); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(rd(reg::kCsts) & kCstsRdy);
  // The admin queue lives in the map: the unmap succeeds (the spec gives a server no way to
  // refuse), the queue goes with it, and the controller, enabled and not shut down, reports
  // fatal status. A reset brings it back to a clean state.
  const DmaUnmapMsg u{24, 0, iova, 0x10000};
  EXPECT_EQ(r.call(c(Cmd::kDmaUnmap), RawClient::bytes_of(u)), 0);
  EXPECT_TRUE(rd(reg::kCsts) & kCstsCfs);
  EXPECT_EQ(r.call(c(Cmd::kDmaUnmap), RawClient::bytes_of(u)), ENOENT);
  EXPECT_EQ(r.call(c(Cmd::kDeviceReset), {}), 0);
  EXPECT_FALSE(rd(reg::kCsts) & kCstsRdy);
  // Enabling with the admin queue outside any map: controller fatal status, not a crash.
  ASSERT_EQ(wr(reg::kCc, kCcEn | (6u << 4), 4), 0);
  uint32_t csts = 0;
  for (int i = 0; i < 1000 && !(csts & kCstsCfs); ++i) {
    csts = rd(reg::kCsts);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(csts & kCstsCfs);
  ASSERT_EQ(wr(reg::kCc, 0, 4), 0);
  for (int i = 0; i < 1000 && rd(reg::kCsts) != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(rd(reg::kCsts), 0u);
  // Registers: CAP has the I/O command set bit and DSTRD 4; writes to read-only ones are ignored.
  const uint32_t cap_hi = rd(reg::kCap + 4);
  EXPECT_TRUE(cap_hi & (1u << (43 - 32)));
  EXPECT_EQ(cap_hi & 0xF, 4u);
  ASSERT_EQ(wr(reg::kVs, 0x12345678, 4), 0);
  EXPECT_EQ(rd(reg::kVs), 0x00020000u);
  expect_good_client_works();
}

TEST_F(Hostile, ConfigSpace) {
  RawClient r(dir_.path());
  ASSERT_EQ(r.version(), 0);
  auto cfg = [&](uint32_t off, uint32_t n) {
    Message rep;
    const RegionAccessMsg a{off, kRegionConfig, n};
    EXPECT_EQ(r.call(c(Cmd::kRegionRead), RawClient::bytes_of(a), &rep), 0);
    uint32_t v = 0;
    std::memcpy(&v, rep.payload.data() + 16, std::min<uint32_t>(n, 4));
    return v;
  };
  auto wcfg = [&](uint32_t off, uint32_t v) {
    std::vector<std::byte> p(20);
    const RegionAccessMsg a{off, kRegionConfig, 4};
    std::memcpy(p.data(), &a, 16);
    std::memcpy(p.data() + 16, &v, 4);
    return r.call(c(Cmd::kRegionWrite), p);
  };
  EXPECT_EQ(cfg(0x08, 4) >> 8, 0x010802u);  // class code
  // BAR sizing: write all ones, read back the size mask.
  ASSERT_EQ(wcfg(0x10, 0xFFFFFFFF), 0);
  EXPECT_EQ(cfg(0x10, 4), static_cast<uint32_t>(~(kBar0Size - 1)) | 0x4);
  ASSERT_EQ(wcfg(0x00, 0xFFFFFFFF), 0);  // IDs are read-only
  EXPECT_EQ(cfg(0x00, 2), 0x4e58u);
  // The capability list: PM -> MSI-X -> PCIe.
  EXPECT_EQ(cfg(0x34, 1), 0x40u);
  EXPECT_EQ(cfg(0x40, 2), 0x5001u);
  EXPECT_EQ(cfg(0x50, 2), 0x6011u);
  EXPECT_EQ(cfg(0x60, 2), 0x0010u);
}

}  // namespace
}  // namespace gdkv

namespace gdkv {
namespace {

// Data in memory mapped without an fd, with a client that answers DMA_READ/DMA_WRITE badly, late,
// never, or hangs up; unmaps while transfers wait; more bounce memory asked than the budget.
TEST_F(Hostile, MessageOnlyMemory) {
  test::RawHost h(dir_.path());
  h.on_failure = [](const std::string& what) { ADD_FAILURE() << what; };
  ASSERT_TRUE(h.start());
  constexpr uint64_t kMsg = 0x100000000, kReadOnly = 0x200000000, kData = 0x90000000;
  std::vector<std::byte> local(1 << 20), ro(1 << 16);
  ASSERT_EQ(h.map_message_memory(kMsg, local.data(), local.size()), 0);
  auto sgl = [](nvme::Sqe s, uint64_t iova, uint32_t len) {
    s.flags = 0x40;  // SGL data block
    s.dptr.sgl = {iova, len, {}, 0};
    return s;
  };
  auto store = [&](const char* key, uint64_t iova, uint32_t len) {
    const Key k = *Key::from_string(key);
    return sgl(cmd::store(k.bytes, k.len, nullptr, len), iova, len);
  };
  auto status = [](const nvme::Cqe& c) { return nvme::status_code(c.status); };
  using M = test::RawHost::DmaMode;
  for (size_t i = 0; i < local.size(); ++i) local[i] = static_cast<std::byte>(i * 5);
  EXPECT_EQ(status(h.io(store("m0", kMsg, 40000))), Status::kSuccess);
  // An error reply, a reply with the wrong count, no reply at all (300 ms): 04h each time.
  h.set_dma_mode(M::kErrorReply);
  EXPECT_EQ(status(h.io(store("m1", kMsg, 40000))), Status::kDataTransferError);
  const Key m0 = *Key::from_string("m0");
  EXPECT_EQ(status(h.io(sgl(cmd::retrieve(m0.bytes, m0.len, nullptr, 40000), kMsg, 40000))),
            Status::kDataTransferError);
  h.set_dma_mode(M::kWrongCount);
  EXPECT_EQ(status(h.io(store("m1", kMsg, 40000))), Status::kDataTransferError);
  h.set_dma_mode(M::kNoReply);
  EXPECT_EQ(status(h.io(store("m1", kMsg, 40000))), Status::kDataTransferError);
  h.set_dma_mode(M::kServe);
  // A stray reply (an id we never sent) is dropped; the next command works.
  const DmaAccessMsg bogus{kMsg, 8};
  ASSERT_TRUE(h.raw().send(c(Cmd::kDmaRead), RawClient::bytes_of(bogus), {}, kTypeReply));
  EXPECT_EQ(status(h.io(store("m2", kMsg, 40000))), Status::kSuccess);
  // A failed Store stored nothing; the good ones hold their bytes.
  std::vector<std::byte> out;
  EXPECT_EQ(good_->get(*Key::from_string("m1"), out).status, Status::kKeyNotExist);
  ASSERT_TRUE(good_->get(*Key::from_string("m2"), out).ok());
  EXPECT_TRUE(std::equal(out.begin(), out.end(), local.begin()) && out.size() == 40000);
  // Four 48 KiB Stores at once over a 64 KiB bounce budget: they run one after another.
  std::vector<nvme::Sqe> batch;
  const char* names[] = {"b0", "b1", "b2", "b3"};
  for (int i = 0; i < 4; ++i) batch.push_back(store(names[i], kMsg + i * 0x10000, 48 << 10));
  const auto done = h.io_batch(batch);
  ASSERT_EQ(done.size(), 4u);
  for (const auto& e : done) EXPECT_EQ(status(e), Status::kSuccess);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(good_->get(*Key::from_string(names[i]), out).ok());
    EXPECT_EQ(std::memcmp(out.data(), local.data() + i * 0x10000, 48 << 10), 0);
  }
  // Eight 4 KiB Retrieves at once, replies out of order: several requests are outstanding
  // together and each reply lands in its own command.
  h.set_dma_mode(M::kReverse);
  batch.clear();
  for (int i = 0; i < 8; ++i) {
    const Key k = *Key::from_string(names[i % 4]);
    batch.push_back(
        sgl(cmd::retrieve(k.bytes, k.len, nullptr, 4096), kMsg + 0x80000 + i * 4096, 4096));
  }
  std::memset(local.data() + 0x80000, 0, 8 * 4096);
  const auto got = h.io_batch(batch);
  ASSERT_EQ(got.size(), 8u);
  for (const auto& e : got) EXPECT_EQ(status(e), Status::kSuccess);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(
        std::memcmp(local.data() + 0x80000 + i * 4096, local.data() + (i % 4) * 0x10000, 4096), 0)
        << i;
  }
  EXPECT_EQ(h.dma_max_outstanding(), 2u);
  h.set_dma_mode(M::kServe);
  // A read-only message map: nothing is written there, and no DMA_WRITE is sent.
  const DmaMapMsg rom{32, kDmaFlagRead, 0, kReadOnly, ro.size()};
  ASSERT_EQ(h.call(Cmd::kDmaMap, RawClient::bytes_of(rom)), 0);
  const uint64_t writes = h.dma_writes();
  EXPECT_EQ(status(h.io(sgl(cmd::retrieve(m0.bytes, m0.len, nullptr, 4096), kReadOnly, 4096))),
            Status::kDataTransferError);
  EXPECT_EQ(h.dma_writes(), writes);
  // Unmapping fd-backed memory that a command waiting on a DMA reply uses: the unmap is answered
  // (the waiting transfer fails, 04h) instead of hanging the connection.
  UniqueFd data = memfd(0x10000);
  const DmaMapMsg dm{32, kDmaFlagRead | kDmaFlagWrite, 0, kData, 0x10000};
  ASSERT_EQ(h.call(Cmd::kDmaMap, RawClient::bytes_of(dm), nullptr, std::vector<int>{data.get()}),
            0);
  h.set_dma_mode(M::kNoReply);
  const Key mx = *Key::from_string("mixed");
  nvme::Sqe st = cmd::store(mx.bytes, mx.len, nullptr, 8192);
  st.dptr.prp.prp1 = kData;
  st.dptr.prp.prp2 = kMsg;
  nvme::Cqe cqe{};
  std::thread io([&] { cqe = h.io(st); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the DMA_READ is out
  const DmaUnmapMsg um{24, 0, kData, 0x10000};
  EXPECT_EQ(h.call(Cmd::kDmaUnmap, RawClient::bytes_of(um)), 0);
  io.join();
  EXPECT_EQ(status(cqe), Status::kDataTransferError);
  EXPECT_EQ(h.dma_bad(), 0u);
  // A client that hangs up in the middle of a transfer is torn down (its waiting command fails
  // before its memory goes); the others keep working.
  h.set_dma_mode(M::kHangUp);
  EXPECT_EQ(status(h.io(store("m3", kMsg, 40000), 2000)), Status::kDataTransferError);
  h.stop_dma();
  wait_clients(1);
  expect_good_client_works();
}

// ---- Wake-ups: DEVICE_GET_REGION_IO_FDS and interrupt descriptors ----

bool is_eventfd(int fd) {
  char link[64];
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = ::readlink(path.c_str(), link, sizeof(link) - 1);
  return n > 0 && std::string(link, static_cast<size_t>(n)) == "anon_inode:[eventfd]";
}

TEST_F(Hostile, RegionIoFdsRequests) {
  RawClient r(dir_.path());
  ASSERT_EQ(r.version(), 0);
  const std::byte tiny[4] = {};
  EXPECT_EQ(r.call(c(Cmd::kDeviceGetRegionIoFds), tiny), EINVAL);  // short
  RegionIoFdsMsg q{16, 1, kRegionBar0, 0};
  EXPECT_EQ(r.call(c(Cmd::kDeviceGetRegionIoFds), RawClient::bytes_of(q)), EINVAL);  // flags
  q = {16, 0, 42, 0};
  EXPECT_EQ(r.call(c(Cmd::kDeviceGetRegionIoFds), RawClient::bytes_of(q)), EINVAL);  // region
  q = {8, 0, kRegionBar0, 0};
  EXPECT_EQ(r.call(c(Cmd::kDeviceGetRegionIoFds), RawClient::bytes_of(q)), EINVAL);  // argsz
  // Too small a reply buffer: the size needed, no sub-region, no descriptor.
  Message m;
  q = {16, 0, kRegionBar0, 0};
  ASSERT_EQ(r.call(c(Cmd::kDeviceGetRegionIoFds), RawClient::bytes_of(q), &m), 0);
  ASSERT_EQ(m.payload.size(), sizeof(RegionIoFdsMsg));
  RegionIoFdsMsg head;
  std::memcpy(&head, m.payload.data(), sizeof(head));
  EXPECT_EQ(head.argsz, sizeof(RegionIoFdsMsg) + sizeof(IoFdSubRegion));
  EXPECT_EQ(head.count, 1u);
  EXPECT_TRUE(m.fds.empty());
  // Other regions have none.
  q = {256, 0, kRegionConfig, 0};
  ASSERT_EQ(r.call(c(Cmd::kDeviceGetRegionIoFds), RawClient::bytes_of(q), &m), 0);
  std::memcpy(&head, m.payload.data(), sizeof(head));
  EXPECT_EQ(head.count, 0u);
  EXPECT_TRUE(m.fds.empty());
  // BAR0: one ioeventfd over the doorbell page.
  q = {256, 0, kRegionBar0, 0};
  ASSERT_EQ(r.call(c(Cmd::kDeviceGetRegionIoFds), RawClient::bytes_of(q), &m), 0);
  ASSERT_EQ(m.payload.size(), sizeof(RegionIoFdsMsg) + sizeof(IoFdSubRegion));
  IoFdSubRegion sub;
  std::memcpy(&sub, m.payload.data() + sizeof(RegionIoFdsMsg), sizeof(sub));
  EXPECT_EQ(sub.offset, kDoorbellPage);
  EXPECT_EQ(sub.size, kDoorbellPage);
  EXPECT_EQ(sub.type, kIoFdTypeIoeventfd);
  EXPECT_EQ(sub.fd_index, 0u);
  ASSERT_EQ(m.fds.size(), 1u);
  EXPECT_TRUE(is_eventfd(m.fds[0].get()));
  // Garbage written into it (the largest count an eventfd takes) only wakes the reactor.
  const uint64_t big = UINT64_MAX - 1;
  EXPECT_EQ(::write(m.fds[0].get(), &big, sizeof(big)), 8);
  expect_good_client_works();
}

TEST_F(Hostile, InterruptDescriptorsMustBeEventfds) {
  RawClient r(dir_.path());
  ASSERT_EQ(r.version(), 0);
  IrqSetMsg s{20, kIrqSetDataEventfd | kIrqSetActionTrigger, kIrqMsix, 0, 1};
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  UniqueFd rd(p[0]), wr(p[1]);
  // A pipe would block the reactor once full; a memfd is no interrupt at all.
  EXPECT_EQ(
      r.call(c(Cmd::kDeviceSetIrqs), RawClient::bytes_of(s), nullptr, std::vector<int>{wr.get()}),
      EINVAL);
  UniqueFd mf = memfd(4096);
  EXPECT_EQ(
      r.call(c(Cmd::kDeviceSetIrqs), RawClient::bytes_of(s), nullptr, std::vector<int>{mf.get()}),
      EINVAL);
  // An eventfd is taken, and made non-blocking: a client that fills its counter cannot block
  // the reactor that signals it.
  UniqueFd e(::eventfd(0, EFD_CLOEXEC));
  ASSERT_EQ(
      r.call(c(Cmd::kDeviceSetIrqs), RawClient::bytes_of(s), nullptr, std::vector<int>{e.get()}),
      0);
  EXPECT_NE(::fcntl(e.get(), F_GETFL) & O_NONBLOCK, 0);
  const uint64_t full = UINT64_MAX - 1;
  ASSERT_EQ(::write(e.get(), &full, sizeof(full)), 8);
  IrqSetMsg t{20, kIrqSetDataNone | kIrqSetActionTrigger, kIrqMsix, 0, 1};
  EXPECT_EQ(r.call(c(Cmd::kDeviceSetIrqs), RawClient::bytes_of(t)), 0);  // returns, EAGAIN inside
  expect_good_client_works();
}

TEST_F(Hostile, RevokedConnectionFetchesNothing) {
  // A host that gave up on the connection (a client's command timed out) stores the revoke word
  // (nvme_defs.h): a command it left in a queue is never fetched, so it neither reads nor writes
  // the host's memory after the host stopped waiting. Other connections are served on.
  vfio_user::test::RawHost h(dir_.path());
  h.on_failure = [](const std::string& what) { ADD_FAILURE() << what; };
  ASSERT_TRUE(h.start());
  const auto* good = reinterpret_cast<const uint8_t*>("good");
  EXPECT_EQ(nvme::status_code(h.io(cmd::exist(good, 4)).status), Status::kSuccess);
  __atomic_store_n(h.doorbell_page() + kRevokedOffset / 4, 1u, __ATOMIC_SEQ_CST);
  EXPECT_EQ(h.io(cmd::exist(good, 4), 300).status, 0xFFFF);  // no completion: never fetched
  expect_good_client_works();
}

// The memory backend, except that an op on the key "revoke" first stores the revoke word into
// `word` (a host that gives up while the reactor is fetching its queue).
class RevokingBackend final : public Backend {
 public:
  void submit(BackendOp* op) override {
    if (op->key.view() == "revoke" && word != nullptr) __atomic_store_n(word, 1u, __ATOMIC_SEQ_CST);
    inner_->submit(op);
  }
  BackendInfo info() const override { return inner_->info(); }
  uint32_t* word = nullptr;

 private:
  std::shared_ptr<Backend> inner_ = make_memory_backend();
};

TEST(HostileRevoke, RevokeStoredDuringAPollStopsTheFetch) {
  // Ten commands rung at once; the first one's op stores the revoke word, as a host that gives up
  // while the reactor fetches: none of the nine behind it is fetched (no completion comes).
  TempDir dir("hostile-revoke");
  auto backend = std::make_shared<RevokingBackend>();
  ControllerOptions co;
  co.reactors = 1;
  Controller ctl(backend, co);
  VfioUserServerOptions so;
  so.socket_dir = dir.path();
  so.log = [](const std::string&) {};
  VfioUserServer server(ctl, so);
  server.start().value();
  {
    vfio_user::test::RawHost h(dir.path());
    h.on_failure = [](const std::string& what) { ADD_FAILURE() << what; };
    ASSERT_TRUE(h.start());
    const auto* name = reinterpret_cast<const uint8_t*>("revoke");
    EXPECT_EQ(nvme::status_code(h.io(cmd::exist(reinterpret_cast<const uint8_t*>("x"), 1)).status),
              Status::kKeyNotExist);
    backend->word = h.doorbell_page() + kRevokedOffset / 4;
    std::vector<nvme::Sqe> cmds(10, cmd::exist(reinterpret_cast<const uint8_t*>("x"), 1));
    cmds[0] = cmd::exist(name, 6);
    EXPECT_LE(h.io_batch(cmds, 300).size(), 1u);
    backend->word = nullptr;
  }
  server.stop();
  ctl.stop();
}

TEST_F(Hostile, WakeUpsMisusedByTheHost) {
  // A host that takes the ioeventfd and never signals it, then closes it: its commands still
  // complete (the reactor's sleep timeout), and a full interrupt counter on its I/O vector does
  // not stop the reactor that serves everyone.
  vfio_user::test::RawHost h(dir_.path());
  h.on_failure = [](const std::string& what) { ADD_FAILURE() << what; };
  ASSERT_TRUE(h.start());
  Message m;
  RegionIoFdsMsg q{256, 0, kRegionBar0, 0};
  ASSERT_EQ(h.call(Cmd::kDeviceGetRegionIoFds, RawClient::bytes_of(q), &m), 0);
  ASSERT_EQ(m.fds.size(), 1u);
  for (int i = 0; i < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // the reactor sleeps
    const nvme::Cqe e = h.io(cmd::exist(reinterpret_cast<const uint8_t*>("good"), 4));
    EXPECT_EQ(nvme::status_code(e.status), Status::kSuccess);
  }
  // Garbage in the waker word (docs/vfio-user.md "Wake-ups"), then the ioeventfd signalled: at
  // most the reactor sleeps right after a completion; every command still completes.
  const uint32_t here = 2u + static_cast<uint32_t>(std::max(0, ::sched_getcpu()));
  for (const uint32_t w : {0xFFFFFFFFu, 1u, here, here + 4096u, 0u}) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    __atomic_store_n(h.doorbell_page() + kWakeWakerCpuOffset / 4, w, __ATOMIC_RELAXED);
    const uint64_t one = 1;
    ASSERT_EQ(::write(m.fds[0].get(), &one, sizeof(one)), 8);
    const nvme::Cqe e = h.io(cmd::exist(reinterpret_cast<const uint8_t*>("good"), 4));
    EXPECT_EQ(nvme::status_code(e.status), Status::kSuccess);
  }
  m.fds.clear();  // closed by the host
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(nvme::status_code(h.io(cmd::exist(reinterpret_cast<const uint8_t*>("good"), 4)).status),
            Status::kSuccess);
  UniqueFd e(::eventfd(UINT32_MAX, EFD_CLOEXEC));
  const uint64_t fill = UINT64_MAX - 1 - UINT32_MAX;
  ASSERT_EQ(::write(e.get(), &fill, sizeof(fill)), 8);
  IrqSetMsg s{20, kIrqSetDataEventfd | kIrqSetActionTrigger, kIrqMsix, 3, 1};
  ASSERT_EQ(h.call(Cmd::kDeviceSetIrqs, RawClient::bytes_of(s), nullptr, std::vector<int>{e.get()}),
            0);
  // The host now waits on an eventfd that is no longer its vector's: no interrupt comes, but the
  // completion is posted and the reactor carries on.
  (void)h.io(cmd::exist(reinterpret_cast<const uint8_t*>("good"), 4), 50);
  expect_good_client_works();
}

}  // namespace
}  // namespace gdkv
