// gdkv's user-space NVMe driver for a gdkvd over vfio-user (see gdkv/vfio_user.h).
//
// Bring-up, as a host driver does it: VERSION, device and region info (the doorbell page comes as
// a sparse-mmap area and is mapped here), PCI config checks, DMA_MAP of one sealed memfd (the DMA
// address of every byte is its address in this process, so pointers into it need no
// translation), CC.EN = 0 and wait, the admin queue in shared memory, CC.EN = 1 with CSS = 110b
// and wait for CSTS.RDY, Identify Controller (the gdkv vendor area says counter doorbells are
// offered), Set Features Number of Queues. I/O queue pairs are created on demand with counter
// doorbells; the requester bookkeeping of gdkv::QueueRef stays in private memory.
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <atomic>
#include <bitset>
#include <cerrno>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <utility>

#include "gdkv/vfio_user.h"
#include "vfio_user/in_place.h"
#include "vfio_user/in_place_set.h"
#include "vfio_user/nvme_defs.h"
#include "vfio_user/pci_config.h"
#include "vfio_user/protocol.h"
#include "vfio_user/shm_allocator.h"
#include "vfio_user/socket_io.h"
#include "vfio_user/wakeups.h"

namespace gdkv {

namespace {

using namespace vfio_user;  // NOLINT: the driver speaks this protocol throughout
using Clock = std::chrono::steady_clock;

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// An owned mmap.
class Mapping {
 public:
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (p_ != nullptr) ::munmap(p_, n_);
  }
  void reset(void* p, size_t n) {
    if (p_ != nullptr) ::munmap(p_, n_);
    p_ = p;
    n_ = n;
  }
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// Stages a synchronous call's buffer through shared memory (or uses it in place when it already
// is shared memory, or memory shared in place).
class ShmStager final : public BufferStager {
 public:
  // `device`: the connection that owns the stager, kept alive by values received in its memory.
  ShmStager(ShmAllocator& a, const InPlaceSet& in_place, VfioUserDevice& device)
      : a_(a), in_place_(in_place), device_(device) {}
  uint64_t acquire(const void* p, size_t len, bool to_controller, bool wait) override {
    if (a_.contains(p, len) || in_place_.contains(p, len)) return reinterpret_cast<uint64_t>(p);
    void* s = wait ? a_.alloc_wait(len, 64, std::chrono::seconds(10)) : a_.alloc(len, 64);
    if (s == nullptr) return 0;
    if (to_controller) std::memcpy(s, p, len);
    return reinterpret_cast<uint64_t>(s);
  }
  void release(uint64_t addr, void* p, size_t copy_back) override {
    void* s = reinterpret_cast<void*>(addr);
    if (s == p) return;
    if (copy_back > 0) std::memcpy(p, s, copy_back);
    a_.free(s);
  }
  // Values of unknown length land in the shared memory itself (DMA address = pointer), read
  // there by the caller: no stand-in, no copy back.
  bool has_receive_memory() const override { return true; }
  std::byte* acquire_receive(size_t len, size_t min_len, bool wait, size_t* got) override {
    return static_cast<std::byte*>(
        a_.alloc_up_to(len, min_len, wait, std::chrono::seconds(10), got));
  }
  void shrink_receive(std::byte* p, size_t keep) override { a_.shrink(p, keep); }
  // The connection (its shared memory), not the Client's queue: a value held after the Client
  // is closed keeps the mapping, as VfioUserDevice::alloc memory does, and no I/O queue.
  std::shared_ptr<void> keep_alive() override { return device_.shared_from_this(); }

 private:
  ShmAllocator& a_;
  const InPlaceSet& in_place_;
  VfioUserDevice& device_;
};

class Driver;

// An I/O queue pair; destroying it deletes the queues on the controller.
struct IoQueue {
  std::shared_ptr<Driver> driver;
  uint16_t qid = 0;
  void* sq = nullptr;
  void* cq = nullptr;
  void* block = nullptr;              // private requester bookkeeping
  std::unique_ptr<IrqWaiter> waiter;  // with completion wake-ups
  ~IoQueue();
};

class Driver final : public VfioUserDevice {
 public:
  Driver(const std::string& dir, const VfioUserClientOptions& o)
      : options_(o), stager_(alloc_, in_place_, *this) {
    connect(dir);
    negotiate();
    map_doorbells();
    check_config();
    share_memory();
    enable();
    identify();
    if (options_.wakeups && wakeups_offered_) fetch_doorbell_fd();
  }

  ~Driver() override {
    for (const auto& [p, sh] : shares_) {
      for (uint64_t ino : sh.inos) vfio_user::release_in_place(ino);
    }
    if (doorbell_efd_.valid()) {
      unregister_doorbell(sleeping_word());
    }
    // Disable the controller so its admin queue stops; the server tears the rest down when the
    // socket closes.
    if (failed_.load()) return;
    try {
      write_reg32(reg::kCc, 0);
    } catch (const std::exception&) {
    }
  }

  // A Client of this connection failed (gdkvd gone or not answering in time): the connection is
  // closed, so gdkvd finishes its commands and lets go of the memory, and nothing of the shared
  // memory is handed out again (a command gdkvd had fetched may still write into it).
  // The revoke word goes first: a command still in a queue (gdkvd frozen, or slow to notice the
  // closed socket) is then never fetched, so it cannot write into memory handed back to the
  // caller. A command gdkvd fetched before still completes into it.
  void poison() {
    if (failed_.exchange(true)) return;
    if (db_ != nullptr) __atomic_store_n(db_ + kRevokedOffset / 4, 1u, __ATOMIC_SEQ_CST);
    alloc_.poison();
    ::shutdown(sock_.get(), SHUT_RDWR);
  }

  Result<std::unique_ptr<Client>> make_client(uint32_t depth) override {
    return catch_error([&] { return open_client(depth); });
  }
  std::unique_ptr<Client> open_client(uint32_t depth);
  void* alloc(size_t bytes, size_t align) override { return alloc_.alloc(bytes, align); }
  void free(void* p) override { alloc_.free(p); }
  bool contains(const void* p, size_t len) const override {
    return alloc_.contains(p, len) || in_place_.contains(p, len);
  }
  Result<void> share(const void* p, size_t len) override;
  Result<void> unshare(const void* p) override;
  void unmap_in_place(const std::vector<std::pair<uint64_t, uint64_t>>& segs);
  std::vector<uint32_t> namespaces() override;
  CmdResult admin(nvme::Sqe sqe, void* data, size_t len) override;
  CmdResult register_device_memory(const void* handle, uint64_t iova, uint64_t size) override;
  CmdResult unregister_device_memory(uint64_t iova, uint64_t size) override;
  CmdResult removed(uint32_t nsid, std::optional<uint64_t> after, RemovedKeys* out,
                    uint32_t max_records) override;
  bool device_memory_supported() const override { return devmem_; }
  bool doorbell_wakeups() const override { return doorbell_efd_.valid(); }
  bool completion_wakeups() const override { return options_.wakeups && wakeups_offered_; }

  void release_queue(uint16_t qid, void* sq, void* cq, bool irq) {
    if (failed_.load()) return;  // the connection is gone: so are its queues on gdkvd's side
    nvme::Sqe s{};
    s.opcode = static_cast<uint8_t>(AdminOp::kDeleteIoSq);
    s.cdw10 = qid;
    (void)admin(s, nullptr, 0);
    s.opcode = static_cast<uint8_t>(AdminOp::kDeleteIoCq);
    (void)admin(s, nullptr, 0);
    if (irq) (void)set_irq(qid, -1);  // gdkvd lets go of the eventfd
    alloc_.free(sq);
    alloc_.free(cq);
    std::lock_guard lk(qid_mu_);
    qids_.reset(qid);
  }

 private:
  // ---- messages ----
  // Sends a request and waits for its reply. Returns the reply's errno (0 = success); throws if
  // the connection fails.
  int request(Cmd cmd, std::span<const std::byte> payload, std::vector<std::byte>* reply,
              std::span<const int> fds = {}, std::vector<UniqueFd>* reply_fds = nullptr) {
    std::lock_guard lk(sock_mu_);
    Header h{};
    h.id = next_id_++;
    h.command = static_cast<uint16_t>(cmd);
    h.size = static_cast<uint32_t>(sizeof(Header) + payload.size());
    h.flags = kTypeCommand;
    if (!write_message(sock_.get(), h, payload, fds)) fail(where_ + ": connection lost");
    for (;;) {
      // A gdkvd that stopped answering must not hang the caller (a destructor, say).
      pollfd pf{sock_.get(), POLLIN, 0};
      const int ready = ::poll(&pf, 1, static_cast<int>(options_.admin_timeout_ms));
      if (ready == 0)
        fail(where_ + ": no reply within " + std::to_string(options_.admin_timeout_ms) + " ms");
      if (ready < 0 && errno != EINTR) fail(where_ + ": connection lost");
      if (ready < 0) continue;
      Message m;
      if (read_message(sock_.get(), m) != ReadStatus::kOk) fail(where_ + ": connection lost");
      if ((m.hdr.flags & kTypeMask) == kTypeCommand) {
        // gdkvd sends no requests; answer anything unexpected with an error.
        if (!(m.hdr.flags & kNoReply)) {
          write_message(sock_.get(), reply_header(m.hdr, 0, ENOTSUP), {});
        }
        continue;
      }
      if (m.hdr.id != h.id) continue;
      if (m.hdr.flags & kErrorFlag) return m.hdr.error != 0 ? static_cast<int>(m.hdr.error) : EIO;
      if (reply != nullptr) *reply = std::move(m.payload);
      if (reply_fds != nullptr) *reply_fds = std::move(m.fds);
      return 0;
    }
  }

  template <class T>
  static std::span<const std::byte> as_bytes_of(const T& v) {
    return {reinterpret_cast<const std::byte*>(&v), sizeof(T)};
  }

  void region_rw(uint32_t region, uint64_t offset, void* data, uint32_t count, bool write) {
    std::vector<std::byte> msg(sizeof(RegionAccessMsg) + (write ? count : 0));
    const RegionAccessMsg a{offset, region, count};
    std::memcpy(msg.data(), &a, sizeof(a));
    if (write) std::memcpy(msg.data() + sizeof(a), data, count);
    std::vector<std::byte> reply;
    const int e = request(write ? Cmd::kRegionWrite : Cmd::kRegionRead, msg, &reply);
    if (e != 0) fail(where_ + ": region access failed: " + std::strerror(e));
    if (!write) {
      if (reply.size() < sizeof(a) + count) fail(where_ + ": short region read");
      std::memcpy(data, reply.data() + sizeof(a), count);
    }
  }
  uint32_t read_reg32(uint32_t off) {
    uint32_t v;
    region_rw(kRegionBar0, off, &v, 4, false);
    return v;
  }
  uint64_t read_reg64(uint32_t off) {
    uint64_t v;
    region_rw(kRegionBar0, off, &v, 8, false);
    return v;
  }
  void write_reg32(uint32_t off, uint32_t v) { region_rw(kRegionBar0, off, &v, 4, true); }
  void write_reg64(uint32_t off, uint64_t v) { region_rw(kRegionBar0, off, &v, 8, true); }

  // True once gdkvd closed the connection (then no command will ever complete). Thread-safe.
  bool peer_gone() {
    pollfd p{sock_.get(), POLLRDHUP, 0};
    return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
  }

  // The connection's sleeping word (doorbell page, kWakeSleepingOffset).
  uint32_t* sleeping_word() const { return db_ + kWakeSleepingOffset / 4; }

  // After ringing a doorbell outside a QueueRef (the admin queue): wake a sleeping reactor.
  void wake_after_doorbell() {
    if (!doorbell_efd_.valid()) return;
    atomic::fence();  // the doorbell store before the look at the word (as queue::publish)
    if (__atomic_load_n(sleeping_word(), __ATOMIC_SEQ_CST) != 0) wake_reactor(sleeping_word());
  }

  // The doorbell page's ioeventfd. Anything unexpected leaves wake-ups off: gdkvd then notices
  // the doorbells within its reactor's sleep timeout, as before.
  void fetch_doorbell_fd() {
    const RegionIoFdsMsg req{sizeof(RegionIoFdsMsg) + 4 * sizeof(IoFdSubRegion), 0, kRegionBar0, 0};
    std::vector<std::byte> reply;
    std::vector<UniqueFd> fds;
    if (request(Cmd::kDeviceGetRegionIoFds, as_bytes_of(req), &reply, {}, &fds) != 0) return;
    PayloadReader r(reply);
    auto head = r.get<RegionIoFdsMsg>();
    if (!head || head->index != kRegionBar0) return;
    for (uint32_t i = 0; i < head->count && i < 4; ++i) {
      auto sub = r.get<IoFdSubRegion>(sizeof(RegionIoFdsMsg) + i * sizeof(IoFdSubRegion));
      if (!sub || sub->type != kIoFdTypeIoeventfd || sub->fd_index >= fds.size() ||
          sub->offset > kDoorbellPage || sub->offset + sub->size < 2 * kDoorbellPage) {
        continue;
      }
      doorbell_efd_ = std::move(fds[sub->fd_index]);
      register_doorbell(sleeping_word(), doorbell_efd_.get());
      return;
    }
  }

  // Assigns `fd` to MSI-X vector `vector` (-1: de-assigns it). Returns the errno (EPIPE once
  // the connection is lost: it runs in destructors too, so it never throws).
  int set_irq(uint16_t vector, int fd) noexcept {
    const IrqSetMsg m{sizeof(IrqSetMsg), kIrqSetDataEventfd | kIrqSetActionTrigger, kIrqMsix,
                      vector, 1};
    const int fds[1] = {fd};
    try {
      return request(Cmd::kDeviceSetIrqs, as_bytes_of(m), nullptr,
                     fd >= 0 ? std::span<const int>(fds) : std::span<const int>());
    } catch (const std::exception&) {
      return EPIPE;
    }
  }

  // ---- bring-up ----
  void connect(const std::string& dir) {
    const std::string path = dir + "/cntrl";
    where_ = "gdkvd at " + dir;
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.size() >= sizeof(addr.sun_path)) fail("socket path too long: " + path);
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    sock_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!sock_.valid()) fail(std::string("socket: ") + std::strerror(errno));
    if (::connect(sock_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      const int e = errno;
      fail("cannot connect to " + path + ": " + std::strerror(e) +
           (e == ENOENT || e == ECONNREFUSED ? " (is gdkvd running?)" : ""));
    }
  }

  void negotiate() {
    const std::string caps = "{\"capabilities\":{\"max_msg_fds\":8,\"max_data_xfer_size\":" +
                             std::to_string(kMaxDataXfer) + "}}";
    std::vector<std::byte> msg(sizeof(VersionMsg) + caps.size() + 1);
    const VersionMsg v{kMajor, kMaxMinor};
    std::memcpy(msg.data(), &v, sizeof(v));
    std::memcpy(msg.data() + sizeof(v), caps.c_str(), caps.size() + 1);
    std::vector<std::byte> reply;
    const int e = request(Cmd::kVersion, msg, &reply);
    if (e != 0) fail(where_ + ": VERSION refused: " + std::strerror(e));
    VersionRequest r;
    if (decode_version(reply, &r) != 0 || r.major != kMajor || r.minor > kMaxMinor) {
      fail(where_ + ": incompatible VERSION reply");
    }
    DeviceInfoMsg info{sizeof(DeviceInfoMsg), 0, 0, 0};
    if (request(Cmd::kDeviceGetInfo, as_bytes_of(info), &reply) != 0 ||
        reply.size() < sizeof(info)) {
      fail(where_ + ": DEVICE_GET_INFO failed");
    }
    std::memcpy(&info, reply.data(), sizeof(info));
    if (!(info.flags & kDeviceFlagPci) || info.num_regions < kNumPciRegions) {
      fail(where_ + ": not a PCI device");
    }
  }

  void map_doorbells() {
    std::vector<std::byte> msg(256);
    RegionInfoMsg req{static_cast<uint32_t>(msg.size()), 0, kRegionBar0, 0, 0, 0};
    std::memcpy(msg.data(), &req, sizeof(req));
    std::vector<std::byte> reply;
    std::vector<UniqueFd> fds;
    if (request(Cmd::kDeviceGetRegionInfo, msg, &reply, {}, &fds) != 0) {
      fail(where_ + ": DEVICE_GET_REGION_INFO failed");
    }
    PayloadReader r(reply);
    auto info = r.get<RegionInfoMsg>();
    if (!info || !(info->flags & kRegionFlagMmap) || !(info->flags & kRegionFlagCaps) ||
        fds.empty()) {
      fail(where_ + ": BAR0 has no mappable doorbell page");
    }
    // Walk the capability chain for the sparse-mmap area that holds [0x1000, 0x2000).
    uint32_t at = info->cap_offset;
    for (int hops = 0; at != 0 && hops < 16; ++hops) {
      auto cap = r.get<CapHeader>(at);
      if (!cap) break;
      if (cap->id == kCapSparseMmap) {
        auto sm = r.get<SparseMmapCap>(at);
        for (uint32_t i = 0; sm && i < sm->nr_areas && i < 64; ++i) {
          auto area = r.get<SparseArea>(at + sizeof(SparseMmapCap) + i * sizeof(SparseArea));
          if (!area || area->offset > kDoorbellPage ||
              area->offset + area->size < kDoorbellPage * 2) {
            continue;
          }
          const uint64_t file_off = info->offset + kDoorbellPage;
          void* p = ::mmap(nullptr, kDoorbellPage, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0].get(),
                           static_cast<off_t>(file_off));
          if (p == MAP_FAILED) fail(where_ + ": cannot map the doorbell page");
          db_map_.reset(p, kDoorbellPage);
          db_ = static_cast<uint32_t*>(p);
          return;
        }
      }
      at = cap->next;
    }
    fail(where_ + ": BAR0 offers no sparse-mmap area over the doorbells");
  }

  void check_config() {
    uint8_t cfg[64];
    region_rw(kRegionConfig, 0, cfg, sizeof(cfg), false);
    if (cfg[0x0B] != 0x01 || cfg[0x0A] != 0x08 || cfg[0x09] != 0x02) {
      fail(where_ + ": the device is not an NVMe controller (class code)");
    }
    uint16_t cmd;
    std::memcpy(&cmd, cfg + 4, 2);
    cmd |= 0x0006;  // memory space, bus master
    region_rw(kRegionConfig, 4, &cmd, 2, true);
    cap_ = read_reg64(reg::kCap);
    if (!(cap_ & kCapCssIoSets)) fail(where_ + ": the controller offers no I/O command sets");
    if (((cap_ >> 32) & 0xF) != kDstrd) fail(where_ + ": unexpected doorbell stride");
  }

  void share_memory() {
    shm_size_ = align_up(std::max<size_t>(options_.shared_memory_bytes, size_t{1} << 20), 4096);
    UniqueFd fd(::memfd_create("gdkv-dma", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!fd.valid() || ::ftruncate(fd.get(), static_cast<off_t>(shm_size_)) != 0 ||
        ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      fail(std::string("shared memory: ") + std::strerror(errno));
    }
    void* p = ::mmap(nullptr, shm_size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (p == MAP_FAILED) fail(std::string("shared memory mmap: ") + std::strerror(errno));
    shm_map_.reset(p, shm_size_);
    shm_ = static_cast<std::byte*>(p);
    alloc_.init(shm_, shm_size_);
    const DmaMapMsg m{sizeof(DmaMapMsg), kDmaFlagRead | kDmaFlagWrite, 0,
                      reinterpret_cast<uint64_t>(shm_), shm_size_};
    const int fds[1] = {fd.get()};
    const int e = request(Cmd::kDmaMap, as_bytes_of(m), nullptr, fds);
    if (e != 0) fail(where_ + ": DMA_MAP refused: " + std::strerror(e));
  }

  void wait_csts(uint32_t mask, uint32_t want) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(options_.admin_timeout_ms);
    for (;;) {
      const uint32_t csts = read_reg32(reg::kCsts);
      if (csts & kCstsCfs) fail(where_ + ": controller fatal status (CSTS.CFS)");
      if ((csts & mask) == want) return;
      if (Clock::now() > deadline) fail(where_ + ": controller did not become ready");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  void enable() {
    if (read_reg32(reg::kCc) & kCcEn) {
      write_reg32(reg::kCc, 0);
      wait_csts(kCstsRdy, 0);
    }
    adepth_ = std::clamp<uint32_t>(options_.admin_queue_depth, 2, 4096);
    asq_ = static_cast<nvme::Sqe*>(alloc_.alloc(adepth_ * sizeof(nvme::Sqe), 4096));
    acq_ = static_cast<nvme::Cqe*>(alloc_.alloc(adepth_ * sizeof(nvme::Cqe), 4096));
    if (asq_ == nullptr || acq_ == nullptr) fail("shared memory too small for the admin queue");
    std::memset(asq_, 0, adepth_ * sizeof(nvme::Sqe));
    std::memset(acq_, 0, adepth_ * sizeof(nvme::Cqe));
    write_reg32(reg::kAqa, ((adepth_ - 1) << 16) | (adepth_ - 1));
    write_reg64(reg::kAsq, reinterpret_cast<uint64_t>(asq_));
    write_reg64(reg::kAcq, reinterpret_cast<uint64_t>(acq_));
    write_reg32(reg::kCc, kCcEn | (kCcCssIoSets << 4) | (6u << 16) | (4u << 20));
    wait_csts(kCstsRdy, kCstsRdy);
  }

  void identify() {
    IdentifyController id;
    nvme::Sqe s{};
    s.opcode = static_cast<uint8_t>(AdminOp::kIdentify);
    s.cdw10 = kCnsController;
    CmdResult r = admin(s, &id, sizeof(id));
    if (!r.ok()) fail(where_ + ": Identify Controller failed: " + describe(r));
    GdkvVendorInfo vi;
    std::memcpy(&vi, id.vs, sizeof(vi));
    if (std::memcmp(vi.magic, "GDKV", 4) != 0 || !(vi.flags & kVendorCounterDoorbells)) {
      fail(where_ + ": the controller is not a gdkvd (no counter doorbells)");
    }
    devmem_ = vi.flags & kVendorDeviceMemory;
    wakeups_offered_ = vi.flags & kVendorWakeups;
    msix_vectors_ = vi.msix_vectors;
    max_value_bytes_ = vi.max_value_bytes;
    max_entries_ = vi.max_queue_entries;
    nvme::Sqe f{};
    f.opcode = static_cast<uint8_t>(AdminOp::kSetFeatures);
    f.cdw10 = kFeatNumberOfQueues;
    const uint32_t want = kMaxIoQueues - 1;  // 0's based
    f.key_length = static_cast<uint8_t>(want);
    f.cdw11_reserved = static_cast<uint16_t>(want);
    r = admin(f, nullptr, 0);
    if (!r.ok()) fail(where_ + ": Set Features (number of queues) failed: " + describe(r));
    max_qid_ = static_cast<uint16_t>(std::min(r.dw0 & 0xFFFF, r.dw0 >> 16) + 1);
  }

  // PRP1/PRP2 for a page-aligned buffer in shared memory (a PRP list when it spans > 2 pages).
  bool build_prps(void* buf, size_t len, nvme::Sqe& s, void** list) {
    const auto base = reinterpret_cast<uint64_t>(buf);
    s.dptr.prp.prp1 = base;
    const size_t pages = (len + kPageSize - 1) / kPageSize;
    if (pages <= 1) return true;
    if (pages == 2) {
      s.dptr.prp.prp2 = base + kPageSize;
      return true;
    }
    if (pages - 1 > kPageSize / 8) return false;  // one list page is all admin data needs
    auto* l = static_cast<uint64_t*>(alloc_.alloc(kPageSize, kPageSize));
    if (l == nullptr) return false;
    for (size_t i = 1; i < pages; ++i) l[i - 1] = base + i * kPageSize;
    s.dptr.prp.prp2 = reinterpret_cast<uint64_t>(l);
    *list = l;
    return true;
  }

  VfioUserClientOptions options_;
  std::string where_;
  // Declared before the socket: unmapped after it closes.
  Mapping db_map_;
  Mapping shm_map_;
  std::mutex sock_mu_;
  UniqueFd sock_;
  uint16_t next_id_ = 1;
  uint64_t cap_ = 0;
  uint32_t* db_ = nullptr;
  std::byte* shm_ = nullptr;
  size_t shm_size_ = 0;
  ShmAllocator alloc_;
  InPlaceSet in_place_;
  std::mutex share_mu_;  // share() and unshare(), one at a time
  struct Share {
    uint64_t a = 0, b = 0;       // its pages
    std::vector<uint64_t> inos;  // the memfds it holds a reference on (release_in_place)
  };
  std::multimap<const void*, Share> shares_;  // by share()'s pointer; share_mu_
  ShmStager stager_;
  // Admin queue.
  std::mutex admin_mu_;
  nvme::Sqe* asq_ = nullptr;
  nvme::Cqe* acq_ = nullptr;
  uint32_t adepth_ = 0, atail_ = 0, ahead_ = 0;
  uint16_t aphase_ = 1, next_cid_ = 0;
  // I/O queues.
  std::mutex qid_mu_;
  std::bitset<kMaxQueues> qids_;
  uint16_t max_qid_ = 0;
  uint32_t max_entries_ = 0;
  bool devmem_ = false;
  bool wakeups_offered_ = false;  // Identify vendor flag kVendorWakeups
  uint64_t max_value_bytes_ = 0;  // Identify vendor area: the controller's largest value
  uint32_t msix_vectors_ = 0;
  UniqueFd doorbell_efd_;            // gdkvd's doorbell ioeventfd (wake-ups on)
  std::atomic<bool> failed_{false};  // poison() was called
};

IoQueue::~IoQueue() {
  if (driver) driver->release_queue(qid, sq, cq, waiter != nullptr);
  std::free(block);
}

CmdResult Driver::admin(nvme::Sqe sqe, void* data, size_t len) {
  if (failed_.load()) return CmdResult{nvme::Status::kAbortRequested, nvme::kSctGeneric, 0};
  void* buf = nullptr;
  void* list = nullptr;
  if (len > 0) {
    buf = alloc_.alloc_wait(len, kPageSize, std::chrono::milliseconds(options_.admin_timeout_ms));
    if (buf == nullptr || !build_prps(buf, len, sqe, &list)) {
      alloc_.free(buf);
      return CmdResult{nvme::Status::kDataTransferError, nvme::kSctGeneric, 0};
    }
    std::memcpy(buf, data, len);
  }
  CmdResult result{nvme::Status::kInternalError, nvme::kSctGeneric, 0};
  bool timed_out = false;
  {
    std::lock_guard lk(admin_mu_);
    sqe.cid = next_cid_++;
    asq_[atail_] = sqe;
    atail_ = (atail_ + 1) % adepth_;
    atomic::fence();
    __atomic_store_n(db_, atail_, __ATOMIC_RELEASE);  // SQ 0 tail
    wake_after_doorbell();
    const auto deadline = Clock::now() + std::chrono::milliseconds(options_.admin_timeout_ms);
    uint32_t spins = 0;
    for (;;) {
      nvme::Cqe* e = &acq_[ahead_];
      const uint16_t st = __atomic_load_n(&e->status, __ATOMIC_ACQUIRE);
      if ((st & nvme::kCqePhase) == aphase_) {
        const bool mine = e->cid == sqe.cid;
        if (mine) {
          result = CmdResult{nvme::status_code(st), nvme::status_type(st), e->dw0};
        }
        if (++ahead_ == adepth_) {
          ahead_ = 0;
          aphase_ ^= 1;
        }
        __atomic_store_n(db_ + kDoorbellStride / 4, ahead_, __ATOMIC_RELEASE);  // CQ 0 head
        if (mine) break;
        continue;
      }
      if (Clock::now() > deadline || ((++spins & 1023) == 0 && peer_gone())) {
        result = CmdResult{nvme::Status::kAbortRequested, nvme::kSctGeneric, 0};
        timed_out = true;
        break;
      }
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  if (timed_out) {
    // gdkvd is gone or not answering: the command may still run, so its memory stays out of the
    // allocator, and nothing more is sent (a teardown then does not wait once per command).
    poison();
    return result;
  }
  if (buf != nullptr) {
    std::memcpy(data, buf, len);
    alloc_.free(buf);
  }
  alloc_.free(list);
  return result;
}

std::vector<uint32_t> Driver::namespaces() {
  std::vector<uint32_t> ids(1024);
  nvme::Sqe s{};
  s.opcode = static_cast<uint8_t>(AdminOp::kIdentify);
  s.cdw10 = kCnsActiveNsList;
  if (!admin(s, ids.data(), 4096).ok()) return {};
  std::vector<uint32_t> out;
  for (uint32_t id : ids) {
    if (id == 0) break;
    out.push_back(id);
  }
  return out;
}

std::unique_ptr<Client> Driver::open_client(uint32_t depth) {
  if (depth == 0) depth = options_.queue_depth;
  if (!valid_queue_depth(depth) || depth > max_entries_) {
    throw std::invalid_argument("queue depth must be a power of two in [2, " +
                                std::to_string(std::min<uint32_t>(max_entries_, 4096)) + "]");
  }
  uint16_t qid = 0;
  {
    std::lock_guard lk(qid_mu_);
    for (uint16_t q = 1; q <= max_qid_ && q < kMaxQueues; ++q) {
      if (!qids_.test(q)) {
        qids_.set(q);
        qid = q;
        break;
      }
    }
  }
  if (qid == 0) throw std::runtime_error(where_ + ": no free I/O queue on this connection");
  auto q = std::make_shared<IoQueue>();
  q->qid = qid;
  q->sq = alloc_.alloc(depth * sizeof(nvme::Sqe), kPageSize);
  q->cq = alloc_.alloc(depth * sizeof(nvme::Cqe), kPageSize);
  const QueueLayout layout = QueueLayout::for_depth(depth);
  q->block = std::aligned_alloc(4096, align_up(layout.total, 4096));
  if (q->sq == nullptr || q->cq == nullptr || q->block == nullptr) {
    alloc_.free(q->sq);
    alloc_.free(q->cq);
    std::lock_guard lk(qid_mu_);
    qids_.reset(qid);
    throw std::runtime_error(where_ + ": shared memory exhausted creating a queue");
  }
  std::memset(q->sq, 0, depth * sizeof(nvme::Sqe));
  std::memset(q->cq, 0, depth * sizeof(nvme::Cqe));
  std::memset(q->block, 0, layout.total);

  // Completion wake-ups: vector qid carries an eventfd, and the CQ interrupts only when armed.
  // If gdkvd refuses, the Client polls and yields as without them.
  if (completion_wakeups() && qid < msix_vectors_) {
    UniqueFd efd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (efd.valid() && set_irq(qid, efd.get()) == 0) {
      auto* arm = db_ + (2u * qid + 1) * (kDoorbellStride / 4) + kWakeArmOffset / 4;
      q->waiter = std::make_unique<IrqWaiter>(std::move(efd), arm,
                                              std::chrono::microseconds(options_.wait_spin_us));
    }
  }
  nvme::Sqe c{};
  c.opcode = static_cast<uint8_t>(AdminOp::kCreateIoCq);
  c.cdw10 = qid | ((depth - 1) << 16);
  c.key_length = 1;  // CDW11: physically contiguous, no interrupts (the Client polls)
  c.cdw12 = kCounterDoorbells;
  if (q->waiter) {
    c.key_length |= 2;            // CDW11 bit 1: interrupts enabled
    c.cdw11_reserved = qid;       // CDW11 31:16: the vector
    c.cdw12 |= kArmedInterrupts;  // only when armed by a waiting thread
  }
  c.dptr.prp.prp1 = reinterpret_cast<uint64_t>(q->cq);
  CmdResult r = admin(c, nullptr, 0);
  if (r.ok()) {
    nvme::Sqe s{};
    s.opcode = static_cast<uint8_t>(AdminOp::kCreateIoSq);
    s.cdw10 = qid | ((depth - 1) << 16);
    s.key_length = 1;        // CDW11 bit 0: physically contiguous
    s.cdw11_reserved = qid;  // CDW11 31:16: the CQ
    s.cdw12 = kCounterDoorbells;
    s.dptr.prp.prp1 = reinterpret_cast<uint64_t>(q->sq);
    r = admin(s, nullptr, 0);
    if (!r.ok()) {
      c.opcode = static_cast<uint8_t>(AdminOp::kDeleteIoCq);
      c.cdw10 = qid;
      (void)admin(c, nullptr, 0);
    }
  }
  if (!r.ok()) {
    alloc_.free(q->sq);
    alloc_.free(q->cq);
    if (q->waiter) (void)set_irq(qid, -1);
    {
      std::lock_guard lk(qid_mu_);
      qids_.reset(qid);
    }
    throw std::runtime_error(where_ + ": creating I/O queue " + std::to_string(qid) +
                             " failed: " + describe(r));
  }
  q->driver = std::static_pointer_cast<Driver>(shared_from_this());
  QueueRef ref = QueueRef::over(q->block, depth, qid);
  ref.sq = static_cast<nvme::Sqe*>(q->sq);
  ref.cq = static_cast<nvme::Cqe*>(q->cq);
  ref.db =
      reinterpret_cast<QueueDoorbells*>(reinterpret_cast<char*>(db_) + 2u * qid * kDoorbellStride);
  if (doorbell_efd_.valid()) {
    ref.wake = sleeping_word();  // set while the reactor sleeps: then signal its ioeventfd
    ref.wake_fn = &wake_reactor;
  }
  auto client = std::make_unique<Client>(ref, q, nullptr, &stager_);
  if (max_value_bytes_ > 0) client->set_max_value_bytes(max_value_bytes_);
  if (q->waiter) client->set_waiter(q->waiter.get());
  client->set_timeout(std::chrono::milliseconds(options_.timeout_ms));
  // The client's queue (its owner) keeps the driver alive, so the check may name it.
  Driver* self = this;
  client->set_liveness([self] { return !self->peer_gone(); });
  client->set_on_failure([self](ClientFailure) { self->poison(); });
  return client;
}

Result<void> Driver::share(const void* p, size_t len) {
  return catch_error([&] {
    if (len == 0) fail("share: an empty range");
    if (alloc_.contains(p, len)) return;  // the connection's own shared memory
    std::lock_guard lk(share_mu_);
    std::vector<vfio_user::InPlaceRange> pieces = vfio_user::share_in_place(p, len);
    Share sh{pieces.front().addr, pieces.back().addr + pieces.back().size, {}};
    for (const auto& r : pieces) sh.inos.push_back(r.ino);
    // Maps the pages no earlier share of this connection mapped; on a failure, undoes this call.
    std::vector<std::pair<uint64_t, uint64_t>> mapped;
    try {
      for (const auto& r : pieces) {
        for (const auto& [a, b] : in_place_.gaps(r.addr, r.addr + r.size)) {
          const DmaMapMsg m{sizeof(DmaMapMsg), kDmaFlagRead | kDmaFlagWrite,
                            r.offset + (a - r.addr), a, b - a};
          const int fds[1] = {r.fd.get()};
          if (const int e = request(Cmd::kDmaMap, as_bytes_of(m), nullptr, fds); e != 0) {
            fail(where_ + ": gdkvd refused to map the memory shared in place: " + std::strerror(e));
          }
          in_place_.insert(a, b - a);
          mapped.emplace_back(a, b);
        }
      }
    } catch (const std::exception&) {
      for (const auto& [a, b] : mapped) unmap_in_place(in_place_.count(a, b, 0));
      for (uint64_t ino : sh.inos) vfio_user::release_in_place(ino);
      throw;
    }
    in_place_.count(sh.a, sh.b, 1);
    shares_.emplace(p, std::move(sh));
  });
}

Result<void> Driver::unshare(const void* p) {
  return catch_error([&] {
    std::lock_guard lk(share_mu_);
    auto by = shares_.find(p);
    if (by == shares_.end()) {
      if (alloc_.contains(p, 1)) return;  // share() of the connection's own memory: a no-op
      fail("unshare: this memory was not shared");
    }
    const Share sh = std::move(by->second);
    shares_.erase(by);
    // Pages no share covers any more are staged from now on, and unmapped.
    auto gone = in_place_.count(sh.a, sh.b, -1);
    for (uint64_t ino : sh.inos) vfio_user::release_in_place(ino);
    unmap_in_place(gone);
  });
}

// DMA_UNMAPs segments of memory shared in place (gone from in_place_ already).
void Driver::unmap_in_place(const std::vector<std::pair<uint64_t, uint64_t>>& segs) {
  for (const auto& [addr, size] : segs) {
    if (failed_.load()) return;  // the connection is gone, and its maps with it
    const DmaUnmapMsg m{sizeof(DmaUnmapMsg), 0, addr, size};
    if (const int e = request(Cmd::kDmaUnmap, as_bytes_of(m), nullptr); e != 0) {
      fail(where_ + ": gdkvd refused to unmap memory shared in place: " + std::strerror(e));
    }
  }
}

CmdResult Driver::register_device_memory(const void* handle, uint64_t iova, uint64_t size) {
  DeviceMemoryRequest req{};
  std::memcpy(req.ipc_handle, handle, sizeof(req.ipc_handle));
  req.iova = iova;
  req.size = size;
  nvme::Sqe s{};
  s.opcode = static_cast<uint8_t>(AdminOp::kGdkvDeviceMemory);
  s.cdw10 = sizeof(req);
  s.key_length = static_cast<uint8_t>(kDevMemRegister);
  return admin(s, &req, sizeof(req));
}

CmdResult Driver::removed(uint32_t nsid, std::optional<uint64_t> after, RemovedKeys* out,
                          uint32_t max_records) {
  *out = RemovedKeys{};
  if (max_records == 0 || max_records > kRemovalMaxRecords) {
    return CmdResult{nvme::Status::kInvalidField, nvme::kSctGeneric, 0};
  }
  const size_t len = sizeof(RemovalLogHeader) + size_t{max_records} * sizeof(RemovalRecord);
  std::vector<uint8_t> page(len);
  const uint32_t numd = static_cast<uint32_t>(len / 4 - 1);
  nvme::Sqe s{};
  s.opcode = static_cast<uint8_t>(AdminOp::kGetLogPage);
  s.nsid = nsid;
  s.cdw10 = kLogRemovals | ((numd & 0xFFFF) << 16) | (after ? 0 : kRemovalNoCursor);
  s.key_length = static_cast<uint8_t>(numd >> 16);  // CDW11 15:0: NUMDU
  s.options = static_cast<uint8_t>(numd >> 24);
  s.cdw12 = static_cast<uint32_t>(after.value_or(0));
  s.cdw13 = static_cast<uint32_t>(after.value_or(0) >> 32);
  const uint32_t cdw14 = kLogOffsetIsIndex;
  std::memcpy(s.key_hi, &cdw14, sizeof(cdw14));
  const CmdResult r = admin(s, page.data(), len);
  if (!r.ok()) return r;
  RemovalLogHeader h;
  std::memcpy(&h, page.data(), sizeof(h));
  if (h.record_bytes != sizeof(RemovalRecord) || h.count > max_records) {
    return CmdResult{nvme::Status::kInternalError, nvme::kSctGeneric, 0};  // not this format
  }
  out->boot = h.boot;
  out->last = h.last;
  out->first = h.first;
  out->next = h.next;
  out->lost = h.flags & kRemovalsLost;
  out->more = h.flags & kRemovalsMore;
  out->records.reserve(h.count);
  for (uint32_t i = 0; i < h.count; ++i) {
    RemovalRecord rec;
    std::memcpy(&rec, page.data() + sizeof(h) + size_t{i} * sizeof(rec), sizeof(rec));
    if (rec.key_length < 1 || rec.key_length > sizeof(rec.key)) {
      return CmdResult{nvme::Status::kInternalError, nvme::kSctGeneric, 0};
    }
    out->records.push_back({rec.seq, Key::from_bytes(rec.key, rec.key_length)});
  }
  return r;
}

CmdResult Driver::unregister_device_memory(uint64_t iova, uint64_t size) {
  DeviceMemoryRequest req{};
  req.iova = iova;
  req.size = size;
  nvme::Sqe s{};
  s.opcode = static_cast<uint8_t>(AdminOp::kGdkvDeviceMemory);
  s.cdw10 = sizeof(req);
  s.key_length = static_cast<uint8_t>(kDevMemUnregister);
  return admin(s, &req, sizeof(req));
}

}  // namespace

Result<std::shared_ptr<VfioUserDevice>> VfioUserDevice::open(const std::string& socket_dir,
                                                             const VfioUserClientOptions& options) {
  if (!valid_queue_depth(options.queue_depth)) {
    return Error{"queue depth must be a power of two in [2, 4096]"};
  }
  return catch_error([&]() -> std::shared_ptr<VfioUserDevice> {
    return std::make_shared<Driver>(socket_dir, options);
  });
}

Result<void> prepare_shared_memory(const void* p, size_t len) {
  if (len == 0) return Error{"share: an empty range"};
  return catch_error([&] { vfio_user::prepare_in_place(p, len); });
}

Result<std::unique_ptr<Client>> connect_vfio_user(const std::string& socket_dir,
                                                  const VfioUserClientOptions& options) {
  auto dev = VfioUserDevice::open(socket_dir, options);
  if (!dev) return Error{dev.error()};
  return (*dev)->make_client();
}

}  // namespace gdkv
