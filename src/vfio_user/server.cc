// gdkvd's vfio-user server: the listening socket, one thread per connection, tenant lookup by
// SO_PEERCRED, and teardown of clients that vanish (see gdkv/vfio_user.h).
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <list>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "gdkv/vfio_user.h"
#include "vfio_user/session.h"

namespace gdkv {

namespace {

using vfio_user::DeviceSession;
using vfio_user::Message;
using vfio_user::ReadStatus;
using vfio_user::UniqueFd;

std::string errno_text(int e) { return std::strerror(e); }

// Primary gid from SO_PEERCRED plus the supplementary groups of the peer process. The peer is
// blocked in its handshake while we look, so its /proc entry is the connecting process.
std::vector<uint32_t> peer_groups(const ucred& cred) {
  std::vector<uint32_t> gids{cred.gid};
  std::ifstream in("/proc/" + std::to_string(cred.pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Groups:", 0) != 0) continue;
    std::istringstream s(line.substr(7));
    uint32_t g;
    while (s >> g) gids.push_back(g);
    break;
  }
  return gids;
}

bool allowed(const VfioUserNamespace& ns, const ucred& cred, const std::vector<uint32_t>& gids) {
  if (ns.uids.empty() && ns.gids.empty()) return true;
  if (std::find(ns.uids.begin(), ns.uids.end(), cred.uid) != ns.uids.end()) return true;
  for (uint32_t g : gids) {
    if (std::find(ns.gids.begin(), ns.gids.end(), g) != ns.gids.end()) return true;
  }
  return false;
}

std::string hostname() {
  char h[256] = {};
  if (::gethostname(h, sizeof(h) - 1) != 0) return "localhost";
  return h;
}

}  // namespace

struct Connection {
  uint64_t id = 0;
  UniqueFd sock;
  ucred peer{};
  std::unique_ptr<DeviceSession> session;
  std::thread thread;
  std::atomic<bool> done{false};
};

struct VfioUserServer::Impl {
  Controller& ctl;
  VfioUserServerOptions options;
  std::string path;
  UniqueFd listen_fd;
  UniqueFd wake_fd;  // eventfd: stop the accept loop
  std::thread acceptor;
  std::atomic<bool> running{false};
  std::atomic<bool> stopping{false};

  mutable std::mutex mu;
  std::list<std::unique_ptr<Connection>> conns;
  uint64_t next_id = 1;
  uint32_t next_reactor = 0;

  // Totals of closed connections, so counters never go backwards.
  std::atomic<uint64_t> accepted{0}, rejected{0}, closed{0};
  std::atomic<uint64_t> messages{0}, message_errors{0}, bad_messages{0};
  std::atomic<uint64_t> io_commands{0}, io_errors{0}, admin_commands{0}, bad_doorbells{0};
  std::atomic<uint64_t> dma_messages{0}, dma_bytes{0}, dma_failures{0}, bounced{0};
  std::atomic<uint64_t> interrupts{0}, doorbell_wakeups{0};

  Impl(Controller& c, VfioUserServerOptions o) : ctl(c), options(std::move(o)) {}

  void log(const std::string& line) const {
    if (options.log) {
      options.log(line);
    } else {
      std::fprintf(stderr, "gdkvd: %s\n", line.c_str());
    }
  }

  void accept_loop();
  void serve(Connection* c);
  void reap(bool all);
  vfio_user::SessionConfig session_config(const ucred& peer, uint64_t id);
  void retire(const Connection& c);
};

vfio_user::SessionConfig VfioUserServer::Impl::session_config(const ucred& peer, uint64_t id) {
  vfio_user::SessionConfig sc;
  auto& n = sc.nvme;
  n.cntlid = static_cast<uint16_t>(1 + (id - 1) % 0xFFEF);
  n.ids.vendor = n.ids.subsystem_vendor = options.pci_vendor_id;
  n.ids.device = n.ids.subsystem = options.pci_device_id;
  n.serial = options.serial.empty() ? "gdkv-" + hostname() : options.serial;
  n.max_queue_entries = options.max_queue_entries;
  n.msix_vectors = options.msix_vectors;
  n.max_value_bytes = ctl.options().max_value_bytes;
  n.importer = options.device_memory;
  n.removals = options.removals;
  n.reactor = next_reactor++ % ctl.reactor_count();
  const std::vector<uint32_t> gids = peer_groups(peer);
  std::vector<VfioUserNamespace> spaces = options.namespaces;
  if (spaces.empty()) spaces.push_back(VfioUserNamespace{1, 1, "default", {}, {}, 0});
  for (const VfioUserNamespace& ns : spaces) {
    if (!allowed(ns, peer, gids)) continue;
    bool taken = false;
    for (const auto& v : n.namespaces) taken |= v.nsid == ns.nsid;
    if (!taken) n.namespaces.push_back({ns.nsid, ns.backend_namespace, ns.name});
  }
  sc.dma.max_maps = options.max_dma_maps;
  sc.dma_reply_timeout_ms = options.dma_reply_timeout_ms;
  n.message_bounce_bytes = options.message_bounce_bytes;
  sc.dma.allow_unsealed_memory = options.allow_unsealed_memory;
  return sc;
}

void VfioUserServer::Impl::accept_loop() {
  while (!stopping.load()) {
    pollfd fds[2] = {{listen_fd.get(), POLLIN, 0}, {wake_fd.get(), POLLIN, 0}};
    const int n = ::poll(fds, 2, 1000);
    reap(false);
    if (n <= 0 || stopping.load()) continue;
    if (!(fds[0].revents & POLLIN)) continue;
    UniqueFd s(::accept4(listen_fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!s.valid()) {
      // Out of descriptors: the pending connection stays readable; back off instead of spinning.
      if (errno == EMFILE || errno == ENFILE) {
        log("accept: " + errno_text(errno) + " (raise the open-file limit)");
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      continue;
    }
    ucred peer{};
    socklen_t len = sizeof(peer);
    if (::getsockopt(s.get(), SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0) {
      rejected.fetch_add(1);
      log("rejected a connection: SO_PEERCRED failed: " + errno_text(errno));
      continue;
    }
    std::lock_guard lk(mu);
    if (conns.size() >= options.max_clients) {
      rejected.fetch_add(1);
      log("rejected pid " + std::to_string(peer.pid) + " uid " + std::to_string(peer.uid) + ": " +
          std::to_string(options.max_clients) + " clients already connected");
      continue;
    }
    auto c = std::make_unique<Connection>();
    c->id = next_id++;
    c->sock = std::move(s);
    c->peer = peer;
    try {
      c->session = std::make_unique<DeviceSession>(ctl, session_config(peer, c->id));
    } catch (const std::exception& e) {
      rejected.fetch_add(1);
      log(std::string("rejected a connection: ") + e.what());
      continue;
    }
    accepted.fetch_add(1);
    std::string spaces;
    for (const auto& v : c->session->nvme().config().namespaces) {
      if (!spaces.empty()) spaces += ',';
      spaces += std::to_string(v.nsid);
    }
    log("client " + std::to_string(c->id) + " connected: pid " + std::to_string(peer.pid) +
        " uid " + std::to_string(peer.uid) + " gid " + std::to_string(peer.gid) + ", namespaces [" +
        spaces + "]");
    Connection* raw = c.get();
    conns.push_back(std::move(c));
    raw->thread = std::thread([this, raw] { serve(raw); });
  }
}

void VfioUserServer::Impl::serve(Connection* c) {
  Message m;
  DeviceSession& session = *c->session;
  const auto send = [c](const vfio_user::Header& h, std::span<const std::byte> payload) {
    return vfio_user::write_message(c->sock.get(), h, payload);
  };
  constexpr uint32_t kLoggedRefusals = 20;
  uint32_t refusals = 0;
  for (;;) {
    // DMA_READ/DMA_WRITE requests for message-only memory go out from here too; the timeout
    // lets an overdue reply fail its transfer.
    session.dma_pump(send);
    pollfd fds[2] = {{c->sock.get(), POLLIN, 0}, {session.dma_wake_fd(), POLLIN, 0}};
    if (::poll(fds, 2, 100) < 0 && errno != EINTR) break;
    if (fds[0].revents == 0) continue;
    vfio_user::HeaderError why = vfio_user::HeaderError::kOk;
    const ReadStatus st = vfio_user::read_message(c->sock.get(), m, vfio_user::kMaxMessage, &why);
    if (st == ReadStatus::kEof || st == ReadStatus::kIoError) break;
    messages.fetch_add(1, std::memory_order_relaxed);
    if (st == ReadStatus::kBadHeader) {
      // Framing cannot be trusted past a bad size: answer, then close.
      bad_messages.fetch_add(1, std::memory_order_relaxed);
      const int err = why == vfio_user::HeaderError::kTooLarge ? E2BIG : EINVAL;
      vfio_user::write_message(c->sock.get(), vfio_user::reply_header(m.hdr, 0, err), {});
      log("client " + std::to_string(c->id) + ": malformed message header (size " +
          std::to_string(m.hdr.size) + "): closing");
      break;
    }
    vfio_user::Reply r = session.handle(m);
    m.fds.clear();  // descriptors the handler did not keep
    if (r.hdr.flags & vfio_user::kErrorFlag) {
      message_errors.fetch_add(1, std::memory_order_relaxed);
      // The first refusals of a connection with their reasons: enough for an operator to see
      // what a client got wrong, not a log a hostile client can flood.
      if (++refusals <= kLoggedRefusals) {
        log("client " + std::to_string(c->id) + ": refused " + vfio_user::cmd_name(m.hdr.command) +
            ": " + errno_text(static_cast<int>(r.hdr.error)) + (r.why.empty() ? "" : ": " + r.why) +
            (refusals == kLoggedRefusals ? " (later refusals of this client are not logged)" : ""));
      }
    }
    if (r.send && !vfio_user::write_message(c->sock.get(), r.hdr, r.payload, r.fds)) break;
    if (r.close_after) break;
  }
  // The client is gone (or we are stopping): finish its commands, then free its memory.
  c->session->quiesce();
  std::unique_ptr<DeviceSession> dead;
  {
    std::lock_guard lk(mu);
    retire(*c);
    dead = std::move(c->session);
    c->sock.reset();
  }
  dead.reset();  // unmaps the client's memory, closes its eventfds
  log("client " + std::to_string(c->id) + " disconnected");
  c->done.store(true);
}

void VfioUserServer::Impl::retire(const Connection& c) {
  const auto& s = c.session->nvme().stats();
  io_commands.fetch_add(s.io_commands.load());
  io_errors.fetch_add(s.io_errors.load());
  admin_commands.fetch_add(s.admin_commands.load());
  bad_doorbells.fetch_add(s.bad_doorbells.load());
  bounced.fetch_add(s.bounced_commands.load());
  interrupts.fetch_add(s.interrupts.load());
  doorbell_wakeups.fetch_add(s.doorbell_wakeups.load());
  const auto& d = c.session->stats();
  dma_messages.fetch_add(d.dma_messages.load());
  dma_bytes.fetch_add(d.dma_bytes.load());
  dma_failures.fetch_add(d.dma_failures.load());
  closed.fetch_add(1);
}

void VfioUserServer::Impl::reap(bool all) {
  std::list<std::unique_ptr<Connection>> finished;
  {
    std::lock_guard lk(mu);
    for (auto it = conns.begin(); it != conns.end();) {
      if (all || (*it)->done.load()) {
        finished.push_back(std::move(*it));
        it = conns.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& c : finished) {
    if (c->thread.joinable()) c->thread.join();
  }
}

VfioUserServer::VfioUserServer(Controller& controller, VfioUserServerOptions options)
    : impl_(std::make_unique<Impl>(controller, std::move(options))) {
  impl_->path = impl_->options.socket_dir + "/cntrl";
}

VfioUserServer::~VfioUserServer() { stop(); }

std::string VfioUserServer::socket_path() const { return impl_->path; }

Result<void> VfioUserServer::start() {
  return catch_error([this] { start_listening(); });
}

void VfioUserServer::start_listening() {
  Impl& s = *impl_;
  if (s.running.load()) return;
  // The options are checked here, not in the constructor: start() reports every failure.
  if (s.options.socket_dir.empty())
    throw std::runtime_error("vfio-user server: socket_dir is required");
  if (s.options.msix_vectors == 0 || s.options.msix_vectors > 256) {
    throw std::runtime_error("vfio-user server: msix_vectors must be in [1, 256]");
  }
  const uint32_t backend_ns = s.ctl.options().namespaces;
  for (const auto& ns : s.options.namespaces) {
    if (ns.nsid == 0 || ns.nsid > kMaxNsid) {
      throw std::runtime_error("vfio-user server: namespace ids are 1.." +
                               std::to_string(kMaxNsid));
    }
    if (ns.backend_namespace == 0 || ns.backend_namespace > backend_ns) {
      throw std::runtime_error("vfio-user server: backend namespace " +
                               std::to_string(ns.backend_namespace) +
                               " is beyond the controller's " + std::to_string(backend_ns));
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(s.options.socket_dir, ec);
  if (ec) {
    throw std::runtime_error("cannot create socket directory " + s.options.socket_dir + ": " +
                             ec.message());
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (s.path.size() >= sizeof(addr.sun_path)) {
    throw std::runtime_error("socket path too long (" + std::to_string(s.path.size()) +
                             " bytes, at most " + std::to_string(sizeof(addr.sun_path) - 1) +
                             "): " + s.path);
  }
  std::memcpy(addr.sun_path, s.path.c_str(), s.path.size() + 1);
  // A socket file left by a gdkvd that died is replaced; a live one is not.
  struct stat st;
  if (::lstat(s.path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) throw std::runtime_error(s.path + " exists and is not a socket");
    UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (::connect(probe.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      throw std::runtime_error("another gdkvd is serving " + s.path);
    }
    ::unlink(s.path.c_str());
  }
  s.listen_fd.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s.listen_fd.valid()) throw std::runtime_error("socket: " + errno_text(errno));
  if (::bind(s.listen_fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    throw std::runtime_error("cannot bind " + s.path + ": " + errno_text(errno));
  }
  if (::chmod(s.path.c_str(), s.options.socket_mode) != 0 || ::listen(s.listen_fd.get(), 64) != 0) {
    const int e = errno;
    ::unlink(s.path.c_str());
    throw std::runtime_error("cannot listen on " + s.path + ": " + errno_text(e));
  }
  s.wake_fd.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  s.stopping.store(false);
  s.running.store(true);
  s.acceptor = std::thread([&s] { s.accept_loop(); });
  s.log("serving vfio-user on " + s.path);
}

void VfioUserServer::stop() {
  Impl& s = *impl_;
  if (!s.running.exchange(false)) return;
  s.stopping.store(true);
  const uint64_t one = 1;
  (void)!::write(s.wake_fd.get(), &one, sizeof(one));
  if (s.acceptor.joinable()) s.acceptor.join();
  ::unlink(s.path.c_str());
  s.listen_fd.reset();
  // Wake every connection thread; each finishes its client's commands and tears down.
  {
    std::lock_guard lk(s.mu);
    for (auto& c : s.conns) {
      if (c->sock.valid()) ::shutdown(c->sock.get(), SHUT_RDWR);
    }
  }
  s.reap(true);
  s.log("stopped serving " + s.path);
}

size_t VfioUserServer::clients() const {
  std::lock_guard lk(impl_->mu);
  size_t n = 0;
  for (const auto& c : impl_->conns) n += !c->done.load();
  return n;
}

void VfioUserServer::collect(MetricList& out) const {
  const Impl& s = *impl_;
  uint64_t io = s.io_commands.load(), io_err = s.io_errors.load(), adm = s.admin_commands.load();
  uint64_t bad_db = s.bad_doorbells.load(), maps = 0, map_bytes = 0, live = 0;
  uint64_t dma_msgs = s.dma_messages.load(), dma_bytes = s.dma_bytes.load(),
           dma_fail = s.dma_failures.load(), bounced = s.bounced.load();
  uint64_t irqs = s.interrupts.load(), db_wakeups = s.doorbell_wakeups.load();
  {
    std::lock_guard lk(s.mu);
    for (const auto& c : s.conns) {
      if (c->done.load() || !c->session) continue;
      ++live;
      const auto& st = c->session->nvme().stats();
      io += st.io_commands.load();
      io_err += st.io_errors.load();
      adm += st.admin_commands.load();
      bad_db += st.bad_doorbells.load();
      bounced += st.bounced_commands.load();
      irqs += st.interrupts.load();
      db_wakeups += st.doorbell_wakeups.load();
      const auto& d = c->session->stats();
      dma_msgs += d.dma_messages.load();
      dma_bytes += d.dma_bytes.load();
      dma_fail += d.dma_failures.load();
      maps += c->session->dma().count();
      map_bytes += c->session->dma().bytes();
    }
  }
  MetricWriter w(out);
  auto add = [&](const char* name, const char* help, MetricType t, uint64_t v) {
    w.add(name, help, t, static_cast<double>(v));
  };
  add("vfio_user_clients", "vfio-user clients connected", MetricType::kGauge, live);
  add("vfio_user_connections_total", "vfio-user connections accepted", MetricType::kCounter,
      s.accepted.load());
  add("vfio_user_connections_rejected_total", "vfio-user connections refused at accept",
      MetricType::kCounter, s.rejected.load());
  add("vfio_user_messages_total", "vfio-user messages received", MetricType::kCounter,
      s.messages.load());
  add("vfio_user_message_errors_total", "vfio-user requests answered with an error",
      MetricType::kCounter, s.message_errors.load());
  add("vfio_user_malformed_messages_total", "vfio-user messages with a bad header (closed)",
      MetricType::kCounter, s.bad_messages.load());
  add("vfio_user_dma_maps", "DMA regions mapped by clients", MetricType::kGauge, maps);
  add("vfio_user_dma_mapped_bytes", "bytes of client memory mapped", MetricType::kGauge, map_bytes);
  add("vfio_user_dma_messages_total",
      "DMA_READ/DMA_WRITE requests sent for memory mapped without an fd", MetricType::kCounter,
      dma_msgs);
  add("vfio_user_dma_message_bytes_total", "bytes moved by DMA_READ/DMA_WRITE messages",
      MetricType::kCounter, dma_bytes);
  add("vfio_user_dma_message_failures_total",
      "DMA_READ/DMA_WRITE transfers failed (error reply, timeout, unmapped, disconnect)",
      MetricType::kCounter, dma_fail);
  add("vfio_user_bounced_commands_total",
      "I/O commands whose data lay in memory mapped without an fd", MetricType::kCounter, bounced);
  add("vfio_user_io_commands_total", "NVMe I/O commands fetched from clients", MetricType::kCounter,
      io);
  add("vfio_user_io_errors_total", "NVMe I/O commands completed with an error",
      MetricType::kCounter, io_err);
  add("vfio_user_admin_commands_total", "NVMe admin commands", MetricType::kCounter, adm);
  add("vfio_user_bad_doorbells_total", "invalid doorbell writes ignored", MetricType::kCounter,
      bad_db);
  add("vfio_user_interrupts_total", "MSI-X interrupts signalled to clients", MetricType::kCounter,
      irqs);
  add("vfio_user_doorbell_wakeups_total",
      "sleeping reactors woken through a connection's eventfd (its doorbell ioeventfd, a "
      "doorbell written by message, a DMA reply)",
      MetricType::kCounter, db_wakeups);
}

}  // namespace gdkv
