// A standard NVMe host on a bare vfio-user connection, as a VM's driver behind QEMU's
// vfio-user-pci would be: its memory is a sealed memfd shared by DMA_MAP at kIova, it maps the
// doorbell page, sets up MSI-X eventfds, enables the controller through BAR0 messages and creates
// one I/O queue pair with ring-index doorbells and interrupts. Memory it maps without an fd is
// served by a thread that answers the server's DMA_READ/DMA_WRITE from a local buffer, with
// selectable misbehaviour. For tests and benchmarks: protocol surprises (a wrong phase, cid or
// SQ id in a completion, a doorbell write refused) go to on_failure (tests: ADD_FAILURE).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "gdkv/nvme_kv.h"
#include "vfio_user/nvme_defs.h"
#include "vfio_user/protocol.h"
#include "vfio_user_test_util.h"

namespace gdkv::vfio_user::test {

class RawHost {
 public:
  static constexpr uint64_t kIova = 0x80000000, kDefaultSize = 0x20000;
  // Layout in the shared memory: admin SQ (8 entries) at +0, admin CQ at +0x1000, I/O SQ (16) at
  // +0x2000, I/O CQ at +0x3000, data from +0x4000 to the end (`size` bytes in all).
  static constexpr uint32_t kAdminDepth = 8, kIoDepth = 16;

  // How the DMA thread answers the server's requests.
  // kReverse answers correctly but out of order (each request after the one that follows it).
  // kUnmapMidway sends DMA_UNMAP of the message-only map before answering the next request, then
  // serves normally.
  enum class DmaMode {
    kServe,
    kErrorReply,
    kNoReply,
    kWrongCount,
    kHangUp,
    kReverse,
    kUnmapMidway
  };

  explicit RawHost(const std::string& dir, uint64_t size = kDefaultSize) : raw_(dir), size_(size) {}
  ~RawHost() {
    stop_dma();
    if (db_ != nullptr) ::munmap(db_, 4096);
    if (mem_ != nullptr) ::munmap(mem_, size_);
  }

  std::byte* mem() { return mem_; }
  RawClient& raw() { return raw_; }
  // Where protocol surprises go; default: stderr.
  std::function<void(const std::string&)> on_failure = [](const std::string& what) {
    std::fprintf(stderr, "raw host: %s\n", what.c_str());
  };
  // Busy-wait for completions instead of waiting for the interrupt (eventfd).
  void set_spin(bool spin) { spin_ = spin; }

  // Everything up to a ready I/O queue pair; false (with test failures) if a step failed.
  bool start() {
    if (!raw_.ok() || raw_.version() != 0) return false;
    UniqueFd mfd(::memfd_create("host", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (::ftruncate(mfd.get(), static_cast<off_t>(size_)) != 0 ||
        ::fcntl(mfd.get(), F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
      return false;
    }
    void* m = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, mfd.get(), 0);
    if (m == MAP_FAILED) return false;
    mem_ = static_cast<std::byte*>(m);
    const DmaMapMsg dm{32, kDmaFlagRead | kDmaFlagWrite, 0, kIova, size_};
    if (call(Cmd::kDmaMap, RawClient::bytes_of(dm), nullptr, std::vector<int>{mfd.get()}) != 0) {
      return false;
    }
    Message info;
    const RegionInfoMsg ri{256, 0, kRegionBar0, 0, 0, 0};
    if (call(Cmd::kDeviceGetRegionInfo, RawClient::bytes_of(ri), &info) != 0 ||
        info.fds.size() != 1) {
      return false;
    }
    void* d =
        ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, info.fds[0].get(), kDoorbellPage);
    if (d == MAP_FAILED) return false;
    db_ = static_cast<uint32_t*>(d);
    // MSI-X vectors 0 (admin) and 3 (I/O).
    ev0_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    ev3_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    IrqSetMsg is{20, kIrqSetDataEventfd | kIrqSetActionTrigger, kIrqMsix, 0, 1};
    if (call(Cmd::kDeviceSetIrqs, RawClient::bytes_of(is), nullptr, std::vector<int>{ev0_.get()}) !=
        0) {
      return false;
    }
    is.start = 3;
    if (call(Cmd::kDeviceSetIrqs, RawClient::bytes_of(is), nullptr, std::vector<int>{ev3_.get()}) !=
        0) {
      return false;
    }
    if (reg_write(reg::kAqa, ((kAdminDepth - 1) << 16) | (kAdminDepth - 1), 4) != 0 ||
        reg_write(reg::kAsq, kIova, 8) != 0 || reg_write(reg::kAcq, kIova + 0x1000, 8) != 0 ||
        reg_write(reg::kCc, kCcEn | (6u << 4) | (6u << 16) | (4u << 20), 4) != 0) {
      return false;
    }
    for (int i = 0; i < 2000 && !(reg_read(reg::kCsts) & kCstsRdy); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!(reg_read(reg::kCsts) & kCstsRdy)) return false;
    // The I/O queue pair: CQ 1 interrupting on vector 3, SQ 1 completing there.
    nvme::Sqe cq{};
    cq.opcode = static_cast<uint8_t>(AdminOp::kCreateIoCq);
    cq.cdw10 = 1 | ((kIoDepth - 1) << 16);
    cq.key_length = 1 | 2;  // PC, IEN
    cq.cdw11_reserved = 3;  // IV
    cq.dptr.prp.prp1 = kIova + 0x3000;
    if (nvme::status_code(admin(cq, false).status) != nvme::Status::kSuccess) return false;
    nvme::Sqe sq{};
    sq.opcode = static_cast<uint8_t>(AdminOp::kCreateIoSq);
    sq.cdw10 = 1 | ((kIoDepth - 1) << 16);
    sq.key_length = 1;
    sq.cdw11_reserved = 1;  // CQ 1
    sq.dptr.prp.prp1 = kIova + 0x2000;
    return nvme::status_code(admin(sq, false).status) == nvme::Status::kSuccess;
  }

  // A request and its reply's errno (-1: the socket failed). Safe while the DMA thread runs.
  int call(Cmd cmd, std::span<const std::byte> payload, Message* reply = nullptr,
           std::span<const int> fds = {}) {
    if (!dma_thread_.joinable()) return raw_.call(static_cast<uint16_t>(cmd), payload, reply, fds);
    const int id = send_command(cmd, payload, fds);
    if (id < 0) return -1;
    std::unique_lock lk(reply_mu_);
    if (!reply_cv_.wait_for(lk, std::chrono::seconds(10), [&] { return replies_.count(id); })) {
      return -1;
    }
    Message m = std::move(replies_[id]);
    replies_.erase(id);
    const int err = (m.hdr.flags & kErrorFlag) ? static_cast<int>(m.hdr.error) : 0;
    if (reply != nullptr) *reply = std::move(m);
    return err;
  }

  // The mapped doorbell page (BAR0 + 0x1000), for tests that write its words themselves.
  uint32_t* doorbell_page() const { return db_; }

  int reg_write(uint32_t off, uint64_t v, uint32_t n) {
    std::vector<std::byte> p(16 + n);
    const RegionAccessMsg a{off, kRegionBar0, n};
    std::memcpy(p.data(), &a, 16);
    std::memcpy(p.data() + 16, &v, n);
    return call(Cmd::kRegionWrite, p);
  }
  uint32_t reg_read(uint32_t off) {
    Message rep;
    const RegionAccessMsg a{off, kRegionBar0, 4};
    uint32_t v = 0;
    if (call(Cmd::kRegionRead, RawClient::bytes_of(a), &rep) == 0 && rep.payload.size() >= 20) {
      std::memcpy(&v, rep.payload.data() + 16, 4);
    }
    return v;
  }

  // One admin command; the tail doorbell by REGION_WRITE or through the mapped page.
  nvme::Cqe admin(nvme::Sqe s, bool ring_by_message) {
    auto* asq = reinterpret_cast<nvme::Sqe*>(mem_);
    auto* acq = reinterpret_cast<nvme::Cqe*>(mem_ + 0x1000);
    s.cid = static_cast<uint16_t>(100 + atail_);
    asq[atail_] = s;
    atail_ = (atail_ + 1) % kAdminDepth;
    if (ring_by_message) {
      check(reg_write(reg::kDoorbells, atail_, 4) == 0, "SQ 0 doorbell by REGION_WRITE refused");
    } else {
      __atomic_store_n(&db_[0], atail_, __ATOMIC_RELEASE);
    }
    check(wait_event(ev0_.get(), 2000), "no admin interrupt");
    nvme::Cqe e;
    std::memcpy(&e, &acq[ahead_], sizeof(e));
    check((e.status & 1) == aphase_, "admin CQE with the wrong phase");
    check(e.cid == s.cid, "admin CQE for another command");
    if (++ahead_ == kAdminDepth) {
      ahead_ = 0;
      aphase_ ^= 1;
    }
    __atomic_store_n(&db_[16], ahead_, __ATOMIC_RELEASE);  // CQ 0 head
    return e;
  }

  // One I/O command on SQ 1; waits up to `wait_ms` for its completion (status 0xFFFF if none).
  nvme::Cqe io(nvme::Sqe s, int wait_ms = 5000) {
    auto* isq = reinterpret_cast<nvme::Sqe*>(mem_ + 0x2000);
    auto* icq = reinterpret_cast<nvme::Cqe*>(mem_ + 0x3000);
    s.cid = static_cast<uint16_t>(itail_);
    isq[itail_] = s;
    itail_ = (itail_ + 1) % kIoDepth;
    __atomic_store_n(&db_[2 * 16], itail_, __ATOMIC_RELEASE);  // SQ 1 tail
    nvme::Cqe c{};
    c.status = 0xFFFF;
    if (!wait_event(ev3_.get(), wait_ms)) return c;
    std::memcpy(&c, &icq[ihead_], sizeof(c));
    check((c.status & 1) == iphase_, "I/O CQE with the wrong phase");
    check(c.sq_id == 1 && c.cid == s.cid, "I/O CQE for another command");
    consume_io_cqe();
    return c;
  }

  // Several I/O commands rung at once; their completions in completion order (fewer on timeout).
  std::vector<nvme::Cqe> io_batch(std::vector<nvme::Sqe> cmds, int wait_ms = 5000) {
    auto* isq = reinterpret_cast<nvme::Sqe*>(mem_ + 0x2000);
    auto* icq = reinterpret_cast<nvme::Cqe*>(mem_ + 0x3000);
    for (nvme::Sqe& s : cmds) {
      s.cid = static_cast<uint16_t>(itail_);
      isq[itail_] = s;
      itail_ = (itail_ + 1) % kIoDepth;
    }
    __atomic_store_n(&db_[2 * 16], itail_, __ATOMIC_RELEASE);
    std::vector<nvme::Cqe> out;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
    while (out.size() < cmds.size() && std::chrono::steady_clock::now() < deadline) {
      nvme::Cqe c;
      std::memcpy(&c, const_cast<const nvme::Cqe*>(&icq[ihead_]), sizeof(c));
      if ((c.status & 1) != iphase_) {
        uint64_t n;
        if (::read(ev3_.get(), &n, 8) != 8 && !spin_) {
          pollfd p{ev3_.get(), POLLIN, 0};  // the interrupt, or a 1 ms recheck
          (void)::poll(&p, 1, 1);
        }
        continue;
      }
      out.push_back(c);
      consume_io_cqe();
    }
    uint64_t n;
    (void)!::read(ev3_.get(), &n, 8);
    return out;
  }

  // Maps [iova, iova+size) without an fd and starts answering DMA_READ/DMA_WRITE from `local`.
  int map_message_memory(uint64_t iova, std::byte* local, uint64_t size,
                         uint32_t flags = kDmaFlagRead | kDmaFlagWrite) {
    local_ = local;
    local_iova_ = iova;
    local_size_ = size;
    if (!dma_thread_.joinable()) dma_thread_ = std::thread([this] { serve_dma(); });
    const DmaMapMsg dm{32, flags, 0, iova, size};
    return call(Cmd::kDmaMap, RawClient::bytes_of(dm));
  }
  void set_dma_mode(DmaMode m) { mode_.store(m); }
  uint64_t dma_reads() const { return reads_.load(); }
  uint64_t dma_writes() const { return writes_.load(); }
  uint64_t dma_bad() const { return bad_.load(); }
  // Whether a DMA request arrived while another was held unanswered (2) or not (1; kReverse).
  uint64_t dma_max_outstanding() const { return max_outstanding_.load(); }
  // Closes the connection (the server sees the client vanish).
  void hang_up() { ::shutdown(raw_.fd(), SHUT_RDWR); }
  void stop_dma() {
    if (!dma_thread_.joinable()) return;
    ::shutdown(raw_.fd(), SHUT_RDWR);
    dma_thread_.join();
  }

 private:
  // Moves past the CQE at the head of CQ 1 and tells the controller (head doorbell).
  void consume_io_cqe() {
    if (++ihead_ == kIoDepth) {
      ihead_ = 0;
      iphase_ ^= 1;
    }
    __atomic_store_n(&db_[3 * 16], ihead_, __ATOMIC_RELEASE);
  }
  bool wait_event(int fd, int ms) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    for (;;) {
      uint64_t n;
      if (::read(fd, &n, 8) == 8) return true;
      if (std::chrono::steady_clock::now() > deadline) return false;
      pollfd p{fd, POLLIN, 0};
      if (!spin_) (void)::poll(&p, 1, 1);
    }
  }
  void check(bool ok, const char* what) {
    if (!ok) on_failure(what);
  }

  // The socket reader: replies to our commands go to call(); DMA requests are answered.
  void serve_dma() {
    Message m, held;  // kReverse: a request held back until the next one was answered
    bool holding = false;
    for (;;) {
      if (holding) {
        pollfd p{raw_.fd(), POLLIN, 0};
        if (::poll(&p, 1, 5) == 0) {  // nothing more came: answer the held one
          answer(held);
          holding = false;
          continue;
        }
      }
      if (read_message(raw_.fd(), m) != ReadStatus::kOk) return;
      if ((m.hdr.flags & kTypeMask) == kTypeReply) {
        std::lock_guard lk(reply_mu_);
        replies_[m.hdr.id] = std::move(m);
        reply_cv_.notify_all();
        m = Message{};
        continue;
      }
      const uint64_t outstanding = holding ? 2 : 1;  // this one, and the held one
      if (outstanding > max_outstanding_.load()) max_outstanding_.store(outstanding);
      if (mode_.load() == DmaMode::kReverse && !holding) {
        held = std::move(m);
        holding = true;
        continue;
      }
      answer(m);
      if (holding) {
        answer(held);
        holding = false;
      }
    }
  }
  // Answers one DMA request as the mode says.
  void answer(const Message& m) {
    PayloadReader p(m.payload);
    const auto a = p.get<DmaAccessMsg>();
    const bool read = m.hdr.command == static_cast<uint16_t>(Cmd::kDmaRead);
    const bool write = m.hdr.command == static_cast<uint16_t>(Cmd::kDmaWrite);
    // Every request must stay inside what we mapped and carry exactly its data.
    const bool inside = a && a->addr >= local_iova_ && a->count <= local_size_ &&
                        a->addr - local_iova_ <= local_size_ - a->count;
    const bool sized = a && (read ? m.payload.size() == sizeof(DmaAccessMsg)
                                  : m.payload.size() == sizeof(DmaAccessMsg) + a->count);
    if (!(read || write) || !inside || !sized) {
      bad_.fetch_add(1);
      send_reply(m.hdr, {}, EINVAL);
      return;
    }
    const DmaMode mode = mode_.load();
    if (mode == DmaMode::kUnmapMidway) {
      const DmaUnmapMsg u{sizeof(DmaUnmapMsg), 0, local_iova_, local_size_};
      send_command(Cmd::kDmaUnmap, RawClient::bytes_of(u));  // its reply goes to replies_
      mode_.store(DmaMode::kServe);
    }
    if (mode == DmaMode::kNoReply) return;
    if (mode == DmaMode::kHangUp) {
      ::shutdown(raw_.fd(), SHUT_RDWR);
      return;
    }
    if (mode == DmaMode::kErrorReply) {
      send_reply(m.hdr, {}, EFAULT);
      return;
    }
    std::byte* at = local_ + (a->addr - local_iova_);
    std::vector<std::byte> out(sizeof(DmaAccessMsg));
    DmaAccessMsg echo = *a;
    if (mode == DmaMode::kWrongCount) echo.count = a->count / 2;
    std::memcpy(out.data(), &echo, sizeof(echo));
    if (read) {
      reads_.fetch_add(1);
      out.insert(out.end(), at, at + echo.count);
    } else {
      writes_.fetch_add(1);
      std::memcpy(at, m.payload.data() + sizeof(DmaAccessMsg), a->count);
    }
    send_reply(m.hdr, out, 0);
  }
  // Sends one of our commands while the DMA thread runs; its id, or -1 if the socket failed.
  int send_command(Cmd cmd, std::span<const std::byte> payload, std::span<const int> fds = {}) {
    std::lock_guard lk(write_mu_);
    Header h{};
    h.id = ++own_id_;
    h.command = static_cast<uint16_t>(cmd);
    h.size = static_cast<uint32_t>(sizeof(Header) + payload.size());
    return write_message(raw_.fd(), h, payload, fds) ? h.id : -1;
  }
  void send_reply(const Header& req, std::span<const std::byte> payload, int err) {
    std::lock_guard lk(write_mu_);
    write_message(raw_.fd(), reply_header(req, static_cast<uint32_t>(payload.size()), err),
                  payload);
  }

  RawClient raw_;
  uint64_t size_;
  bool spin_ = false;
  std::byte* mem_ = nullptr;
  uint32_t* db_ = nullptr;
  UniqueFd ev0_, ev3_;
  uint32_t atail_ = 0, ahead_ = 0, itail_ = 0, ihead_ = 0;
  uint16_t aphase_ = 1, iphase_ = 1;

  std::thread dma_thread_;
  std::byte* local_ = nullptr;
  uint64_t local_iova_ = 0, local_size_ = 0;
  std::atomic<DmaMode> mode_{DmaMode::kServe};
  std::atomic<uint64_t> reads_{0}, writes_{0}, bad_{0}, max_outstanding_{0};
  std::mutex write_mu_;
  uint16_t own_id_ = 0x8000;  // ids of our commands sent while the DMA thread runs
  std::mutex reply_mu_;
  std::condition_variable reply_cv_;
  std::map<uint16_t, Message> replies_;
};

}  // namespace gdkv::vfio_user::test
