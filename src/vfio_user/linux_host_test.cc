// What real hosts do to gdkvd, step by step with the project's own host driver (RawHost):
// - the scan a Linux 6.x guest's nvme driver runs on a namespace whose command set is not NVM
//   (nvme_scan_ns: Identify CNS 08h, the descriptor list with its CSI, then the Commands Supported
//   and Effects log for that CSI, which it must get or it abandons the namespace), each answer
//   checked against the NVMe 2.0 base and KV command set layouts;
// - SPDK's detach: CC.SHN, wait for CSTS.SHST, then DMA_UNMAP of every region, the one holding
//   its queues included: every reply succeeds, nothing is logged as refused;
// - an unmap while commands run on a queue in that memory: they complete first, and the
//   controller, still enabled, reports fatal status (CSTS.CFS) instead of touching freed memory.
#include <gtest/gtest.h>

#include <cstring>
#include <mutex>
#include <thread>

#include "gdkv/commands.h"
#include "gdkv/controller.h"
#include "gdkv/vfio_user.h"
#include "raw_host.h"
#include "vfio_user/nvme_defs.h"
#include "vfio_user_test_util.h"

namespace gdkv {
namespace {

using nvme::Status;
using namespace vfio_user;  // NOLINT
using vfio_user::test::RawHost;
using vfio_user::test::TempDir;

constexpr uint64_t kData = RawHost::kIova + 0x4000;  // RawHost's data area
void* const kDataPtr = reinterpret_cast<void*>(kData);

// Exist of a key named by text, in namespace 1.
nvme::Sqe exist(const char* name) {
  const Key k = *Key::from_string(name);
  return cmd::exist(k.bytes, k.len);
}

class LinuxHost : public ::testing::Test {
 protected:
  void start(uint32_t delay_us = 0) {
    ControllerOptions co;
    co.idle_spin_us = 1000;
    MemoryBackendOptions mo;
    mo.delay_us = delay_us;
    ctl_ = std::make_unique<Controller>(make_memory_backend(mo), co);
    VfioUserServerOptions so;
    so.socket_dir = dir_.path();
    so.log = [this](const std::string& line) {
      std::lock_guard lk(log_mu_);
      log_ += line + "\n";
    };
    server_ = std::make_unique<VfioUserServer>(*ctl_, so);
    server_->start().value();
  }
  void TearDown() override {
    if (server_) server_->stop();
    if (ctl_) ctl_->stop();
  }
  std::string log() {
    std::lock_guard lk(log_mu_);
    return log_;
  }

  // An admin command whose data (len bytes) lands at kData; returns the status code and SCT.
  static std::pair<uint8_t, uint8_t> admin(RawHost& h, nvme::Sqe s) {
    s.dptr.prp.prp1 = kData;
    const nvme::Cqe c = h.admin(s, false);
    return {static_cast<uint8_t>(nvme::status_code(c.status)), nvme::status_type(c.status)};
  }
  static nvme::Sqe identify(uint8_t cns, uint32_t nsid, uint8_t csi = 0) {
    nvme::Sqe s{};
    s.opcode = static_cast<uint8_t>(AdminOp::kIdentify);
    s.nsid = nsid;
    s.cdw10 = cns;
    s.cdw11_reserved = static_cast<uint16_t>(csi << 8);  // CDW11 bits 31:24
    return s;
  }
  // Get Log Page of `bytes` at `offset`, CSI in CDW14 bits 31:24.
  static nvme::Sqe log_page(uint8_t lid, uint32_t bytes, uint64_t offset = 0, uint8_t csi = 0) {
    nvme::Sqe s{};
    s.opcode = static_cast<uint8_t>(AdminOp::kGetLogPage);
    s.nsid = 0xFFFFFFFF;
    const uint32_t numd = bytes / 4 - 1;
    s.cdw10 = lid | ((numd & 0xFFFF) << 16);
    s.key_length = static_cast<uint8_t>(numd >> 16);  // CDW11 bits 15:0: NUMDU
    s.cdw12 = static_cast<uint32_t>(offset);
    s.cdw13 = static_cast<uint32_t>(offset >> 32);
    s.key_hi[3] = csi;
    return s;
  }
  static constexpr std::pair<uint8_t, uint8_t> kOk{0, 0};

  TempDir dir_{"linux"};
  std::unique_ptr<Controller> ctl_;
  std::unique_ptr<VfioUserServer> server_;
  std::mutex log_mu_;
  std::string log_;
};

TEST_F(LinuxHost, ScanSequenceOfAKvNamespace) {
  start();
  RawHost h(dir_.path());
  ASSERT_TRUE(h.start());
  std::byte* data = h.mem() + 0x4000;

  // nvme_init_identify: Identify Controller. NVMe 2.0, and LPA bit 1 (the effects log exists):
  // with it set, Linux reads the CSI 00h effects log at start and fails the controller if it can't.
  ASSERT_EQ(admin(h, identify(kCnsController, 0)), kOk);
  IdentifyController idc;
  std::memcpy(&idc, data, sizeof(idc));
  EXPECT_GE(idc.ver, 0x00020000u);
  EXPECT_TRUE(idc.lpa & kLpaCommandEffects);
  EXPECT_EQ(idc.wctemp, 0);  // no sensor, no made-up thresholds
  EXPECT_EQ(idc.cctemp, 0);
  ASSERT_EQ(admin(h, log_page(kLogCommandEffects, 4096, 0, kCsiNvm)), kOk);
  CommandEffectsLog nvm;
  std::memcpy(&nvm, data, sizeof(nvm));
  EXPECT_EQ(nvm.admin[static_cast<uint8_t>(AdminOp::kIdentify)], kEffectsCsupp);
  for (uint32_t op = 0; op < 256; ++op) EXPECT_EQ(nvm.io[op], 0u) << op;  // no NVM I/O commands

  // nvme_scan_ns_list: the active namespace list.
  ASSERT_EQ(admin(h, identify(kCnsActiveNsList, 0)), kOk);
  uint32_t first;
  std::memcpy(&first, data, 4);
  EXPECT_EQ(first, 1u);

  // nvme_scan_ns: the I/O command set independent namespace (ready), its descriptors (CSI 01h).
  ASSERT_EQ(admin(h, identify(kCnsCsIndepNamespace, 1)), kOk);
  CsIndepIdentifyNamespace indep;
  std::memcpy(&indep, data, sizeof(indep));
  EXPECT_EQ(indep.nstat & 1, 1);
  ASSERT_EQ(admin(h, identify(kCnsNsDescriptors, 1)), kOk);
  bool csi_kv = false;
  for (size_t off = 0; off + 4 <= 4096;) {
    const auto nidt = static_cast<uint8_t>(data[off]);
    const auto nidl = static_cast<uint8_t>(data[off + 1]);
    if (nidt == 0) break;
    if (nidt == kNidtCsi) csi_kv = nidl == 1 && static_cast<uint8_t>(data[off + 4]) == kCsiKv;
    off += 4 + nidl;
  }
  EXPECT_TRUE(csi_kv);

  // Not NVM: the effects log of its command set, or Linux drops the namespace. The KV opcodes and
  // gdkv's vendor ones are supported, with no command-submission effects; nothing else is.
  ASSERT_EQ(admin(h, log_page(kLogCommandEffects, 4096, 0, kCsiKv)), kOk);
  CommandEffectsLog kv;
  std::memcpy(&kv, data, sizeof(kv));
  for (uint32_t op = 0; op < 256; ++op) {
    const bool supported = op == 0x01 || op == 0x02 || op == 0x06 || op == 0x10 || op == 0x14 ||
                           op == 0x81 || op == 0x82;
    EXPECT_EQ(kv.io[op], supported ? kEffectsCsupp : 0u) << "I/O opcode " << op;
  }
  for (uint32_t op = 0; op < 256; ++op) {
    const bool supported = op == 0x00 || op == 0x01 || op == 0x02 || op == 0x04 || op == 0x05 ||
                           op == 0x06 || op == 0x08 || op == 0x09 || op == 0x0A || op == 0x0C ||
                           op == 0x18 || op == 0xC0;
    EXPECT_EQ(kv.admin[op], supported ? kEffectsCsupp : 0u) << "admin opcode " << op;
  }
  for (uint8_t b : kv.reserved) EXPECT_EQ(b, 0);

  // The KV command set's own identify (what a passthrough user reads next).
  ASSERT_EQ(admin(h, identify(kCnsCsiNamespace, 1, kCsiKv)), kOk);
  KvIdentifyNamespace kvid;
  std::memcpy(&kvid, data, sizeof(kvid));
  EXPECT_EQ(kvid.kvf[0].kml, 16);
  EXPECT_GT(kvid.kvf[0].vml, 0u);

  // The ERR interrupt exists (QEMU enables error recovery with it).
  IrqInfoMsg ii{sizeof(IrqInfoMsg), 0, kIrqErr, 0};
  Message rep;
  ASSERT_EQ(h.call(Cmd::kDeviceGetIrqInfo, test::RawClient::bytes_of(ii), &rep), 0);
  ASSERT_GE(rep.payload.size(), sizeof(IrqInfoMsg));
  std::memcpy(&ii, rep.payload.data(), sizeof(ii));
  EXPECT_EQ(ii.count, 1u);
  EXPECT_EQ(log().find("refused"), std::string::npos) << log();
}

TEST_F(LinuxHost, EffectsLogBadFieldsAndSmartFigures) {
  start();
  RawHost h(dir_.path());
  ASSERT_TRUE(h.start());
  std::byte* data = h.mem() + 0x4000;
  const std::pair<uint8_t, uint8_t> invalid_field{static_cast<uint8_t>(Status::kInvalidField), 0};
  EXPECT_EQ(admin(h, log_page(kLogCommandEffects, 4096, 0, 0x02)), invalid_field);     // ZNS: no
  EXPECT_EQ(admin(h, log_page(kLogCommandEffects, 16, 4100, kCsiKv)), invalid_field);  // past it
  EXPECT_EQ(admin(h, log_page(kLogCommandEffects, 16, 2, kCsiKv)), invalid_field);     // unaligned
  // A window: 16 bytes at 1024 + 4 * 0x14 (I/O entry of Exist), then zeros past the end.
  std::memset(data, 0xAA, 64);
  ASSERT_EQ(admin(h, log_page(kLogCommandEffects, 16, 1024 + 4 * 0x14, kCsiKv)), kOk);
  uint32_t w[4];
  std::memcpy(w, data, sizeof(w));
  EXPECT_EQ(w[0], kEffectsCsupp);
  EXPECT_EQ(w[1], 0u);
  ASSERT_EQ(admin(h, log_page(kLogCommandEffects, 16, 4088, kCsiKv)), kOk);
  std::memcpy(w, data, sizeof(w));
  EXPECT_EQ(w[2], 0u);
  EXPECT_EQ(w[3], 0u);

  // SMART: only what was measured. 3 Stores of 1000 bytes, 2 Retrieves (one short buffer).
  const Key k = *Key::from_string("smart");
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(nvme::status_code(h.io(cmd::store(k.bytes, k.len, kDataPtr, 1000)).status),
              Status::kSuccess);
  }
  for (uint32_t len : {1000u, 10u}) {
    ASSERT_EQ(nvme::status_code(h.io(cmd::retrieve(k.bytes, k.len, kDataPtr, len)).status),
              Status::kSuccess);
  }
  ASSERT_EQ(admin(h, log_page(kLogSmart, 512)), kOk);
  SmartLog s;
  std::memcpy(&s, data, sizeof(s));
  uint64_t reads, writes, units_read, units_written;
  std::memcpy(&reads, s.host_reads, 8);
  std::memcpy(&writes, s.host_writes, 8);
  std::memcpy(&units_read, s.data_units_read, 8);
  std::memcpy(&units_written, s.data_units_written, 8);
  EXPECT_EQ(s.temperature, 0);  // no sensor
  EXPECT_EQ(reads, 2u);
  EXPECT_EQ(writes, 3u);
  EXPECT_EQ(units_read, 1u);  // 1010 bytes, in thousands of 512-byte units rounded up
  EXPECT_EQ(units_written, 1u);
}

TEST_F(LinuxHost, ShutdownUnmapEverythingAndAttachAgain) {
  start();
  {
    RawHost h(dir_.path());
    ASSERT_TRUE(h.start());
    // SPDK's detach: shutdown notification, wait for shutdown complete, unmap its memory (the
    // admin and I/O queues live in it), close.
    const uint32_t cc = h.reg_read(reg::kCc);
    ASSERT_EQ(h.reg_write(reg::kCc, cc | (1u << 14), 4), 0);  // CC.SHN = 01b
    uint32_t csts = 0;
    for (int i = 0; i < 2000 && (csts & kCstsShstMask) != kCstsShstComplete; ++i) {
      csts = h.reg_read(reg::kCsts);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_EQ(csts & kCstsShstMask, kCstsShstComplete);
    const DmaUnmapMsg u{24, 0, RawHost::kIova, RawHost::kDefaultSize};
    EXPECT_EQ(h.call(Cmd::kDmaUnmap, test::RawClient::bytes_of(u)), 0);
    EXPECT_FALSE(h.reg_read(reg::kCsts) & kCstsCfs);  // shut down: no queue was live
  }
  EXPECT_EQ(log().find("refused"), std::string::npos) << log();
  // A new host attaches right after and works.
  RawHost h2(dir_.path());
  ASSERT_TRUE(h2.start());
  EXPECT_EQ(nvme::status_code(h2.io(exist("none")).status), Status::kKeyNotExist);
}

TEST_F(LinuxHost, UnmapWhileCommandsRunOnAQueueInThatMemory) {
  start(/*delay_us=*/300000);  // each backend op takes 300 ms
  RawHost h(dir_.path());
  ASSERT_TRUE(h.start());
  const Key slow = *Key::from_string("slow");
  const nvme::Sqe st = cmd::store(slow.bytes, slow.len, kDataPtr, 4096);
  uint16_t status = 0xFFFF;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread io([&] { status = nvme::status_code(h.io(st).status) == Status::kSuccess ? 0 : 1; });
  // The Store is in the backend.
  for (int i = 0; i < 10000 && ctl_->in_flight() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(ctl_->in_flight(), 1u);
  const DmaUnmapMsg u{24, 0, RawHost::kIova, RawHost::kDefaultSize};
  EXPECT_EQ(h.call(Cmd::kDmaUnmap, test::RawClient::bytes_of(u)), 0);
  // The reply came once the Store had completed (its CQE posted while the memory was mapped):
  // not before the backend's 300 ms.
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(300));
  io.join();
  EXPECT_EQ(status, 0);
  EXPECT_TRUE(h.reg_read(reg::kCsts) & kCstsCfs);  // enabled, and its queues lost their memory
  // Doorbells of the dropped queues reach nothing; the server keeps serving others.
  RawHost h2(dir_.path());
  ASSERT_TRUE(h2.start());
  EXPECT_EQ(nvme::status_code(h2.io(exist("slow")).status), Status::kSuccess);
}

TEST_F(LinuxHost, RefusedMessagesAreLoggedWithTheirReason) {
  start();
  test::RawClient r(dir_.path());
  ASSERT_EQ(r.version(), 0);
  UniqueFd m(::memfd_create("unsealed", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(m.get(), 0x10000), 0);
  const DmaMapMsg dm{32, kDmaFlagRead | kDmaFlagWrite, 0, 0x40000000, 0x10000};
  EXPECT_EQ(r.call(static_cast<uint16_t>(Cmd::kDmaMap), test::RawClient::bytes_of(dm), nullptr,
                   std::vector<int>{m.get()}),
            EPERM);
  const std::string l = log();
  EXPECT_NE(l.find("refused DMA_MAP"), std::string::npos) << l;
  EXPECT_NE(l.find("allow_unsealed_memory"), std::string::npos) << l;
}

}  // namespace
}  // namespace gdkv
