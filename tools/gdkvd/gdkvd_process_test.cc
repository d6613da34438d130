// gdkvd as a real child process with real client processes: every opcode over the socket, four
// clients at once, a client killed mid-I/O (the daemon keeps serving and frees its maps), tenants
// confined to their namespaces (children run as other uids), and SIGTERM (clean exit, the socket
// removed, acknowledged writes durable across a restart).
#include <arpa/inet.h>
#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gdkv/client.h"
#include "gdkv/commands.h"
#include "gdkv/vfio_user.h"
#include "vfio_user_test_util.h"

#ifndef GDKVD_PATH
#error "GDKVD_PATH must name the gdkvd binary"
#endif

namespace {

using gdkv::CmdResult;
using gdkv::Key;
using gdkv::RemovedKeys;
using gdkv::nvme::Status;
using gdkv::vfio_user::test::TempDir;
using Clock = std::chrono::steady_clock;

std::vector<std::byte> pattern(size_t n, uint64_t seed) {
  std::vector<std::byte> v(n);
  std::mt19937_64 g(seed);
  for (auto& b : v) b = static_cast<std::byte>(g());
  return v;
}

// prefix + i, appended (GCC 12 warns falsely on operator+ with temporaries).
Key key_of(const std::string& prefix, int i) {
  std::string s = prefix;
  s += std::to_string(i);
  return *Key::from_string(s);
}

// The fields of a /proc stat file after the command name (in parentheses, which may hold
// spaces), from field 3 (the state) on; empty if the file is gone (a thread or process exited).
std::string stat_fields(const std::filesystem::path& stat_file) {
  std::ifstream in(stat_file);
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? "" : stat.substr(paren + 2);
}

// A gdkvd child process; its stderr goes to <dir>/gdkvd-<n>.log.
class Daemon {
 public:
  Daemon(const std::string& dir, std::vector<std::string> extra) : dir_(dir) {
    static int instance = 0;
    log_ = dir + "/gdkvd-" + std::to_string(instance++) + ".log";
    std::vector<std::string> args = {GDKVD_PATH, "--socket-dir",   dir + "/sock", "--metrics-port",
                                     "0",        "--metrics-bind", "127.0.0.1",   "--reactors",
                                     "2",        "--idle-spin-us", "1000",        "--socket-mode",
                                     "0666"};
    args.insert(args.end(), extra.begin(), extra.end());
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      ::dup2(fd, 2);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
  }
  ~Daemon() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  std::string socket_dir() const { return dir_ + "/sock"; }
  pid_t pid() const { return pid_; }

  // SIGSTOP, and true once every thread has stopped (state T in /proc/PID/task/*/stat): the
  // kernel stops a process's threads one after another, and a reactor serves calls until then.
  bool freeze(int timeout_ms = 10000) {
    if (::kill(pid_, SIGSTOP) != 0) return false;
    const std::string tasks = "/proc/" + std::to_string(pid_) + "/task";
    const auto end = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (Clock::now() < end) {
      bool all = true, any = false;
      std::error_code ec;
      for (const auto& t : std::filesystem::directory_iterator(tasks, ec)) {
        const std::string fields = stat_fields(t.path() / "stat");
        if (fields.empty()) continue;  // it exited
        any = true;
        all = all && (fields[0] == 'T' || fields[0] == 't');
      }
      if (!ec && any && all) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  }

  // Waits until the daemon logged "ready".
  bool wait_ready(int timeout_ms = 20000) {
    const auto end = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (Clock::now() < end) {
      if (log().find("ready:") != std::string::npos) return true;
      int st;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  std::string log() const {
    std::ifstream in(log_);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  int metrics_port() const {
    const std::string l = log();
    const auto at = l.find("127.0.0.1:");
    return at == std::string::npos ? -1 : std::atoi(l.c_str() + at + 10);
  }
  // A gauge or counter from /metrics (-1 if absent).
  double metric(const std::string& name) const {
    const int port = metrics_port();
    const int s = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    std::string body;
    if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
      const char req[] = "GET /metrics HTTP/1.0\r\n\r\n";
      (void)!::write(s, req, sizeof(req) - 1);
      char buf[4096];
      ssize_t n;
      while ((n = ::read(s, buf, sizeof(buf))) > 0) body.append(buf, static_cast<size_t>(n));
    }
    ::close(s);
    std::istringstream in(body);
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind(name + " ", 0) == 0) return std::atof(line.c_str() + name.size() + 1);
    }
    return -1;
  }
  // Sends `sig` and returns the exit status (-1 if it did not exit in time).
  int stop(int sig = SIGTERM, int timeout_ms = 20000) {
    ::kill(pid_, sig);
    const auto end = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (Clock::now() < end) {
      int st;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  size_t open_fds() const {
    size_t n = 0;
    for (auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(pid_) + "/fd")) {
      (void)e;
      ++n;
    }
    return n;
  }

 private:
  std::string dir_, log_;
  pid_t pid_ = -1;
};

// Runs `body` in a child process; returns a pid to wait on. The child exits with body()'s value
// (any exception is exit code 99).
template <class F>
pid_t spawn(F body) {
  const pid_t p = ::fork();
  if (p == 0) {
    int rc = 99;
    try {
      rc = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: %s\n", ::getpid(), e.what());
    }
    ::_exit(rc);
  }
  return p;
}

int wait_child(pid_t p) {
  int st = 0;
  ::waitpid(p, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

TEST(GdkvdProcess, EveryOpcodeThroughTheDaemon) {
  TempDir dir("proc");
  Daemon d(dir.path(), {"--backend", "memory", "--cache-bytes", "16777216"});
  ASSERT_TRUE(d.wait_ready()) << d.log();
  auto dev = gdkv::VfioUserDevice::open(d.socket_dir()).value();
  auto c = dev->make_client().value();
  const Key k = *Key::from_string("alpha");
  const auto v = pattern(300000, 3);  // spans many pages
  ASSERT_TRUE(c->put(k, v).ok());
  std::vector<std::byte> out;
  ASSERT_TRUE(c->get(k, out).ok());
  EXPECT_EQ(out, v);
  EXPECT_TRUE(c->exists(k).ok());
  EXPECT_EQ(c->put(k, v, gdkv::nvme::kStoreMustNotExist).status, Status::kKeyExists);
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(c->put(key_of("l", i), pattern(8, i)).ok());
  std::vector<Key> keys;
  ASSERT_TRUE(c->list_all(keys).ok());
  EXPECT_EQ(keys.size(), 21u);
  EXPECT_TRUE(c->prefetch(std::span(keys).first(3)).ok());
  auto* dst = static_cast<std::byte*>(dev->alloc(4096));
  const gdkv::nvme::ScatterEntry pieces[2] = {{reinterpret_cast<uint64_t>(dst), 10, 100},
                                              {reinterpret_cast<uint64_t>(dst + 100), 200000, 50}};
  ASSERT_TRUE(c->scatter_get(k, pieces).ok());
  EXPECT_EQ(std::memcmp(dst, v.data() + 10, 100), 0);
  EXPECT_EQ(std::memcmp(dst + 100, v.data() + 200000, 50), 0);
  dev->free(dst);
  ASSERT_TRUE(c->del(k).ok());
  EXPECT_EQ(c->get(k, out).status, Status::kKeyNotExist);
  gdkv::nvme::Sqe s = gdkv::cmd::exist(k.bytes, k.len);
  s.opcode = 0x99;
  EXPECT_EQ(c->execute(s).status, Status::kInvalidOpcode);
  EXPECT_GT(d.metric("gdkv_vfio_user_io_commands_total"), 20);
  EXPECT_EQ(d.metric("gdkv_vfio_user_clients"), 1);
  c.reset();
  dev.reset();
  EXPECT_EQ(d.stop(), 0) << d.log();
}

// Wake-ups through the real daemon (docs/vfio-user.md "Wake-ups"): after every pause the reactor
// sleeps, the client's doorbell signals its ioeventfd and the client's wait blocks on its
// completion interrupt; every value comes back exact, and gdkvd's counters show both paths used.
TEST(GdkvdProcess, WakeUpsThroughTheDaemon) {
  TempDir dir("proc");
  Daemon d(dir.path(), {"--backend", "memory", "--cache-bytes", "16777216"});
  ASSERT_TRUE(d.wait_ready()) << d.log();
  auto dev = gdkv::VfioUserDevice::open(d.socket_dir()).value();
  ASSERT_TRUE(dev->doorbell_wakeups());
  ASSERT_TRUE(dev->completion_wakeups());
  auto c = dev->make_client().value();
  for (int i = 0; i < 20; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // > --idle-spin-us 1000
    const Key k = key_of("w", i);
    const auto v = pattern(4096 + static_cast<size_t>(i), 100 + static_cast<uint64_t>(i));
    ASSERT_TRUE(c->put(k, v).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::vector<std::byte> out;
    ASSERT_TRUE(c->get(k, out).ok());
    EXPECT_EQ(out, v);
  }
  EXPECT_GT(d.metric("gdkv_vfio_user_doorbell_wakeups_total"), 0);
  EXPECT_GT(d.metric("gdkv_vfio_user_interrupts_total"), 0);
  c.reset();
  dev.reset();
  EXPECT_EQ(d.stop(), 0) << d.log();
}

// A gdkvd killed while a call waits: the call fails within the liveness period (not the I/O
// timeout), the Client says why, and every later call fails at once.
TEST(GdkvdProcess, DaemonKilledMidCallFailsTheClientInBoundedTime) {
  TempDir dir("prockill");
  Daemon d(dir.path(), {"--backend", "memory"});
  ASSERT_TRUE(d.wait_ready()) << d.log();
  gdkv::VfioUserClientOptions o;
  o.admin_timeout_ms = 500;
  o.timeout_ms = 60000;  // far longer than the test may take: the liveness check must act
  auto dev = gdkv::VfioUserDevice::open(d.socket_dir(), o).value();
  auto c = dev->make_client().value();
  const Key k = *Key::from_string("k");
  ASSERT_TRUE(c->put(k, pattern(4096, 1)).ok());
  ASSERT_TRUE(d.freeze());  // the next call is in flight when the daemon dies
  std::vector<std::byte> out(4096);
  CmdResult r{};
  Clock::time_point done;
  std::thread caller([&] {
    r = c->get(k, std::span<std::byte>(out));
    done = Clock::now();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto killed = Clock::now();
  ASSERT_EQ(::kill(d.pid(), SIGKILL), 0);
  caller.join();
  EXPECT_EQ(r.status, Status::kAbortRequested);
  EXPECT_EQ(c->failure(), gdkv::ClientFailure::kPeerGone);
  EXPECT_GE(done, killed);                            // the call waited until the daemon died...
  EXPECT_LT(done - killed, std::chrono::seconds(2));  // ...and not much longer
  const auto t0 = Clock::now();
  EXPECT_EQ(c->exists(k).status, Status::kAbortRequested);
  EXPECT_EQ(c->put(k, pattern(10, 2)).status, Status::kAbortRequested);
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(100));
  c.reset();
  dev.reset();
}

// A gdkvd that stops answering (frozen) fails the call after the I/O timeout.
TEST(GdkvdProcess, FrozenDaemonTimesOut) {
  TempDir dir("procfreeze");
  Daemon d(dir.path(), {"--backend", "memory"});
  ASSERT_TRUE(d.wait_ready()) << d.log();
  gdkv::VfioUserClientOptions o;
  o.admin_timeout_ms = 500;
  o.timeout_ms = 300;
  auto dev = gdkv::VfioUserDevice::open(d.socket_dir(), o).value();
  auto c = dev->make_client().value();
  const Key k = *Key::from_string("k");
  ASSERT_TRUE(c->put(k, pattern(100, 1)).ok());
  ASSERT_TRUE(d.freeze());
  const auto t0 = Clock::now();
  EXPECT_EQ(c->exists(k).status, Status::kAbortRequested);
  const auto waited = Clock::now() - t0;
  EXPECT_GE(waited, std::chrono::milliseconds(300));
  EXPECT_LT(waited, std::chrono::seconds(3));
  EXPECT_EQ(c->failure(), gdkv::ClientFailure::kTimeout);
  // The failure closed the connection: destroying it does not wait for the frozen daemon.
  const auto t1 = Clock::now();
  c.reset();
  dev.reset();
  EXPECT_LT(Clock::now() - t1, std::chrono::seconds(1));
  ASSERT_EQ(::kill(d.pid(), SIGCONT), 0);
  // The daemon is back; a new connection works (with the default timeouts: the resumed daemon
  // is still tearing the old connection down).
  auto c2 = gdkv::connect_vfio_user(d.socket_dir(), gdkv::VfioUserClientOptions{}).value();
  EXPECT_TRUE(c2->exists(k).ok());
  c2.reset();
  EXPECT_EQ(d.stop(), 0) << d.log();
}

TEST(GdkvdProcess, FourClientProcessesAtOnce) {
  TempDir dir("proc4");
  Daemon d(dir.path(), {"--backend", "memory", "--reactors", "1"});
  ASSERT_TRUE(d.wait_ready()) << d.log();
  std::vector<pid_t> kids;
  for (int p = 0; p < 4; ++p) {
    kids.push_back(spawn([&, p] {
      auto c = gdkv::connect_vfio_user(d.socket_dir()).value();
      for (int i = 0; i < 40; ++i) {
        std::string prefix = "p";
        prefix += std::to_string(p);
        prefix += '-';
        const Key k = key_of(prefix, i);
        const auto v = pattern(1000 + 37 * i, p * 10000 + i);
        if (!c->put(k, v).ok()) return 1;
        std::vector<std::byte> out;
        if (!c->get(k, out).ok() || out != v) return 2;
      }
      // Everyone's keys are visible to everyone (one namespace, one backend).
      std::vector<Key> all;
      return c->list_all(all).ok() ? 0 : 3;
    }));
  }
  for (pid_t k : kids) EXPECT_EQ(wait_child(k), 0);
  auto c = gdkv::connect_vfio_user(d.socket_dir()).value();
  std::vector<Key> all;
  ASSERT_TRUE(c->list_all(all).ok());
  EXPECT_EQ(all.size(), 160u);
  c.reset();
  EXPECT_EQ(d.stop(), 0);
}

TEST(GdkvdProcess, ClientKilledMidIo) {
  TempDir dir("prockill");
  Daemon d(dir.path(), {"--backend", "memory"});
  ASSERT_TRUE(d.wait_ready()) << d.log();
  // A bystander that must keep working.
  auto dev = gdkv::VfioUserDevice::open(d.socket_dir()).value();
  auto bystander = dev->make_client().value();
  ASSERT_TRUE(bystander->put(*Key::from_string("safe"), pattern(100, 1)).ok());
  for (int i = 0; i < 30 && d.metric("gdkv_vfio_user_dma_maps") != 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // A /metrics connection may still be closing: take the count once it is steady.
  size_t fds_before = d.open_fds();
  for (int i = 0; i < 50; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const size_t now = d.open_fds();
    if (now == fds_before) break;
    fds_before = now;
  }
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t victim = spawn([&] {
    auto vdev = gdkv::VfioUserDevice::open(d.socket_dir()).value();
    auto c = vdev->make_client(64).value();
    constexpr uint32_t kSize = 256 * 1024;
    auto* buf = static_cast<std::byte*>(vdev->alloc(size_t{32} * kSize, 4096));
    const Key k = *Key::from_string("big");
    std::vector<std::byte> v(kSize, std::byte{5});
    if (!c->put(k, v).ok()) return 1;
    bool told = false;
    for (;;) {  // keep 32 large Retrieves in flight until killed
      std::vector<uint16_t> cids;
      for (int i = 0; i < 32; ++i) {
        cids.push_back(
            c->start(gdkv::cmd::retrieve(k.bytes, k.len, buf + size_t{kSize} * i, kSize)).value());
      }
      if (!told) {
        (void)!::write(ready[1], "x", 1);
        told = true;
      }
      for (uint16_t id : cids) (void)c->wait(id);
    }
  });
  char x;
  ASSERT_EQ(::read(ready[0], &x, 1), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  ::kill(victim, SIGKILL);
  EXPECT_EQ(wait_child(victim), 128 + SIGKILL);
  // The daemon notices, drains the victim's commands, and unmaps its memory.
  for (int i = 0; i < 200 && d.metric("gdkv_vfio_user_clients") != 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(d.metric("gdkv_vfio_user_clients"), 1);
  EXPECT_EQ(d.metric("gdkv_vfio_user_dma_maps"), 1);  // only the bystander's
  // The victim's descriptors (socket, memory fd, doorbell fd) are closed; /metrics connections
  // close asynchronously, so allow a moment.
  for (int i = 0; i < 100 && d.open_fds() > fds_before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_LE(d.open_fds(), fds_before);
  std::vector<std::byte> out;
  EXPECT_TRUE(bystander->get(*Key::from_string("safe"), out).ok());
  auto fresh = gdkv::connect_vfio_user(d.socket_dir()).value();
  EXPECT_TRUE(fresh->get(*Key::from_string("big"), out).ok());
  EXPECT_EQ(out.size(), 256u * 1024);
  ::close(ready[0]);
  ::close(ready[1]);
  fresh.reset();
  bystander.reset();
  dev.reset();
  EXPECT_EQ(d.stop(), 0);
}

// Runs body as uid/gid `id` in a child.
template <class F>
int as_user(uint32_t id, F body) {
  return wait_child(spawn([&] {
    if (::setgroups(0, nullptr) != 0 || ::setgid(id) != 0 || ::setuid(id) != 0) return 98;
    return body();
  }));
}

// "--config FILE" for a memory-backend gdkvd whose file holds `namespaces` ([[namespace]] tables).
std::vector<std::string> tenant_config(const TempDir& dir, const std::string& namespaces) {
  const std::string conf = dir.path() + "/gdkvd.toml";
  std::ofstream(conf) << "[backend]\nkind = \"memory\"\n" << namespaces;
  return {"--config", conf};
}

TEST(GdkvdProcess, TenantsSeeOnlyTheirNamespaces) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run clients as other users";
  TempDir dir("proctenant");
  Daemon d(dir.path(),
           tenant_config(dir,
                         "[[namespace]]\nnsid = 1\nbackend_namespace = 1\nname = \"tenant-a\"\n"
                         "uids = [4101]\n"
                         "[[namespace]]\nnsid = 2\nbackend_namespace = 2\nname = \"tenant-b\"\n"
                         "uids = [4102]\n"
                         "[[namespace]]\nnsid = 1\nbackend_namespace = 3\n"
                         "name = \"tenant-b-default\"\nuids = [4102]\n"));
  ASSERT_TRUE(d.wait_ready()) << d.log();
  const std::string sock = d.socket_dir();
  // Tenant A: namespace 1 only; B's namespace 2 does not exist for it.
  EXPECT_EQ(as_user(4101,
                    [&] {
                      auto dev = gdkv::VfioUserDevice::open(sock).value();
                      if (dev->namespaces() != std::vector<uint32_t>{1}) return 1;
                      auto c = dev->make_client().value();
                      const Key k = *Key::from_string("secret");
                      if (!c->put(k, pattern(50, 1), 0, 1).ok()) return 2;
                      if (c->exists(k, 2).status != Status::kInvalidNamespace) return 3;
                      if (c->put(k, pattern(50, 1), 0, 2).status != Status::kInvalidNamespace) {
                        return 4;
                      }
                      return 0;
                    }),
            0);
  // Tenant B: nsid 1 is its own namespace (backend 3): A's key is not there; nsid 2 is B's.
  EXPECT_EQ(as_user(4102,
                    [&] {
                      auto dev = gdkv::VfioUserDevice::open(sock).value();
                      if (dev->namespaces() != std::vector<uint32_t>{1, 2}) return 1;
                      auto c = dev->make_client().value();
                      const Key k = *Key::from_string("secret");
                      std::vector<std::byte> out;
                      if (c->get(k, out, 1).status != Status::kKeyNotExist) return 2;
                      if (!c->put(k, pattern(50, 2), 0, 2).ok()) return 3;
                      std::vector<Key> keys;
                      if (!c->list_all(keys, 1).ok() || !keys.empty()) return 4;
                      return 0;
                    }),
            0);
  // A stranger (another uid) sees no namespace at all.
  EXPECT_EQ(as_user(4103,
                    [&] {
                      auto dev = gdkv::VfioUserDevice::open(sock).value();
                      if (!dev->namespaces().empty()) return 1;
                      auto c = dev->make_client().value();
                      return c->exists(*Key::from_string("secret"), 1).status ==
                                     Status::kInvalidNamespace
                                 ? 0
                                 : 2;
                    }),
            0);
  // A's value is still A's.
  EXPECT_EQ(as_user(4101,
                    [&] {
                      auto c = gdkv::connect_vfio_user(sock).value();
                      std::vector<std::byte> out;
                      return c->get(*Key::from_string("secret"), out, 1).ok() &&
                                     out == pattern(50, 1)
                                 ? 0
                                 : 1;
                    }),
            0);
  EXPECT_EQ(d.stop(), 0);
}

// Each tenant reads the removed keys of its own namespaces over its connection (log page C0h):
// A's deletes never reach B, and A cannot ask for B's namespace.
TEST(GdkvdProcess, TenantsReadOnlyTheirRemovals) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run clients as other users";
  TempDir dir("procremoved");
  Daemon d(dir.path(),
           tenant_config(dir,
                         "[[namespace]]\nnsid = 1\nbackend_namespace = 1\nname = \"tenant-a\"\n"
                         "uids = [4101]\n"
                         "[[namespace]]\nnsid = 1\nbackend_namespace = 2\nname = \"tenant-b\"\n"
                         "uids = [4102]\n"
                         "[[namespace]]\nnsid = 2\nbackend_namespace = 3\nname = \"tenant-b-2\"\n"
                         "uids = [4102]\n"));
  ASSERT_TRUE(d.wait_ready()) << d.log();
  const std::string sock = d.socket_dir();
  // (The children are forked: each reads from cursor 0, the log's start.)
  ASSERT_EQ(as_user(4101,
                    [&] {
                      auto dev = gdkv::VfioUserDevice::open(sock).value();
                      RemovedKeys start;
                      if (!dev->removed(1, std::nullopt, &start).ok()) return 1;
                      auto c = dev->make_client().value();
                      for (const char* name : {"a-1", "a-2", "shared"}) {
                        const Key k = *Key::from_string(name);
                        if (!c->put(k, pattern(50, 1), 0, 1).ok() || !c->del(k, 1).ok()) return 2;
                      }
                      RemovedKeys mine;
                      if (!dev->removed(1, start.next, &mine).ok() || mine.records.size() != 3) {
                        return 3;
                      }
                      // B's second namespace does not exist for A.
                      if (dev->removed(2, start.next, &mine).status != Status::kInvalidNamespace) {
                        return 4;
                      }
                      return 0;
                    }),
            0);
  EXPECT_EQ(as_user(4102,
                    [&] {
                      auto dev = gdkv::VfioUserDevice::open(sock).value();
                      RemovedKeys page;
                      // B's nsid 1 (backend namespace 2): none of A's three deletes.
                      if (!dev->removed(1, 0, &page).ok()) return 1;
                      if (!page.records.empty() || page.lost) return 2;
                      auto c = dev->make_client().value();
                      const Key k = *Key::from_string("shared");
                      if (!c->put(k, pattern(50, 2), 0, 1).ok() || !c->del(k, 1).ok()) return 3;
                      if (!dev->removed(1, page.next, &page).ok()) return 4;
                      if (page.records.size() != 1 || !(page.records[0].key == k)) return 5;
                      if (!dev->removed(2, 0, &page).ok() || !page.records.empty()) {
                        return 6;
                      }
                      return 0;
                    }),
            0);
  // A stranger has no namespace: no page either.
  EXPECT_EQ(
      as_user(4103,
              [&] {
                auto dev = gdkv::VfioUserDevice::open(sock).value();
                RemovedKeys page;
                return dev->removed(1, std::nullopt, &page).status == Status::kInvalidNamespace ? 0
                                                                                                : 1;
              }),
      0);
  EXPECT_EQ(d.stop(), 0);
}

TEST(GdkvdProcess, SigtermIsCleanAndDurable) {
  TempDir dir("procterm");
  const std::string store = dir.path() + "/store";
  std::vector<std::string> args = {"--backend",  "local",     "--store",       store,
                                   "--capacity", "268435456", "--cache-bytes", "0"};
  {
    Daemon d(dir.path(), args);
    ASSERT_TRUE(d.wait_ready()) << d.log();
    auto c = gdkv::connect_vfio_user(d.socket_dir()).value();
    for (int i = 0; i < 50; ++i) ASSERT_TRUE(c->put(key_of("durable", i), pattern(5000, i)).ok());
    // SIGTERM with the client still connected: the daemon closes it and exits 0.
    EXPECT_EQ(d.stop(SIGTERM), 0) << d.log();
    EXPECT_FALSE(std::filesystem::exists(d.socket_dir() + "/cntrl"));
    EXPECT_NE(d.log().find("stopped cleanly"), std::string::npos);
  }
  Daemon d2(dir.path(), args);
  ASSERT_TRUE(d2.wait_ready()) << d2.log();
  auto c = gdkv::connect_vfio_user(d2.socket_dir()).value();
  for (int i = 0; i < 50; ++i) {
    std::vector<std::byte> out;
    ASSERT_TRUE(c->get(key_of("durable", i), out).ok()) << i;
    EXPECT_EQ(out, pattern(5000, i));
  }
  c.reset();
  EXPECT_EQ(d2.stop(SIGINT), 0);
}

TEST(GdkvdProcess, ConfigErrorsExitTwo) {
  TempDir dir("procconf");
  Daemon d(dir.path(), {"--backend", "tape"});
  EXPECT_FALSE(d.wait_ready(5000));
  EXPECT_NE(d.log().find("tape"), std::string::npos);
}

// Minor page faults of process `pid` so far, all its threads (/proc/PID/stat field 10).
uint64_t minor_faults(pid_t pid) {
  std::istringstream rest(stat_fields("/proc/" + std::to_string(pid) + "/stat"));
  std::string f;
  for (int field = 3; field < 10; ++field) rest >> f;
  uint64_t minflt = 0;
  rest >> minflt;
  return minflt;
}

// Zero-copy Stores of 2 MiB values under new keys, each round, as Mooncake Store's
// benchmark writes them. After a warm-up that fills the memory backend (and the cache), gdkvd
// must take them without faulting in fresh memory: the values land in the arena's prepared,
// recycled memory. The bound is 8 faults per value; fresh 4 KiB pages would be 512 per value.
// The local store is measured the same way: its staging is mapped and populated at open, and a
// 2 MiB value in aligned shared memory is written to the file straight from it.
struct FaultCase {
  const char* name;
  std::vector<std::string> args;  // "STORE" becomes a directory of the test's
  bool evicts;                    // the memory backend: the warm-up filled it
};

class NewKeyStores : public ::testing::TestWithParam<FaultCase> {};

TEST_P(NewKeyStores, FaultNoFreshMemory) {
  constexpr size_t kValue = size_t{2} << 20;
  constexpr int kWarm = 96;  // 192 MiB through a 128 MiB memory store: eviction has begun
  constexpr int kBurst = 200;
  TempDir dir("faults");
  std::vector<std::string> args = GetParam().args;
  for (auto& a : args) {
    if (a == "STORE") a = dir.path() + "/store";
  }
  Daemon d(dir.path(), args);
  ASSERT_TRUE(d.wait_ready()) << d.log();
  auto dev = gdkv::VfioUserDevice::open(d.socket_dir()).value();
  auto c = dev->make_client().value();
  auto* buf = static_cast<std::byte*>(dev->alloc(kValue, 4096));
  ASSERT_NE(buf, nullptr);
  const auto v = pattern(kValue, 38);
  std::memcpy(buf, v.data(), kValue);
  const std::span<const std::byte> value(buf, kValue);
  int n = 0;
  auto put_new = [&] {
    std::memcpy(buf, &n, sizeof(n));  // each value differs from the last
    return c->put(key_of("new", n++), value).status;
  };
  for (int i = 0; i < kWarm; ++i) ASSERT_EQ(put_new(), Status::kSuccess) << i;
  const uint64_t before = minor_faults(d.pid());
  const auto start = Clock::now();
  for (int i = 0; i < kBurst; ++i) ASSERT_EQ(put_new(), Status::kSuccess) << i;
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  const uint64_t faults = minor_faults(d.pid()) - before;
  // For information only (one Store at a time on a shared machine): no bound.
  std::printf("%d new-key 2 MiB Stores, one at a time: %.2f GB/s\n", kBurst,
              static_cast<double>(kBurst) * kValue / secs / 1e9);
  std::printf("gdkvd minor faults over %d new-key 2 MiB Stores (%s): %llu (%.1f per value)\n",
              kBurst, GetParam().name, static_cast<unsigned long long>(faults),
              static_cast<double>(faults) / kBurst);
  EXPECT_LT(faults, uint64_t{8} * kBurst);
  // The newest value is there, whole.
  std::vector<std::byte> out;
  ASSERT_EQ(c->get(key_of("new", n - 1), out).status, Status::kSuccess);
  EXPECT_EQ(out, std::vector<std::byte>(buf, buf + kValue));
  if (GetParam().evicts) {
    EXPECT_EQ(c->exists(key_of("new", 0)).status, Status::kKeyNotExist);
    EXPECT_GT(d.metric("gdkv_backend_evictions_total{backend=\"memory\"}"), 100);
  }
  dev->free(buf);
  c.reset();
  dev.reset();
  EXPECT_EQ(d.stop(), 0) << d.log();
}

const std::string kMemory128 = std::to_string(128 << 20);
INSTANTIATE_TEST_SUITE_P(
    Backends, NewKeyStores,
    ::testing::Values(FaultCase{"MemoryCacheOff",
                                {"--backend", "memory", "--memory-capacity", kMemory128,
                                 "--cache-bytes", "0"},
                                true},
                      FaultCase{"MemoryCacheOn",
                                {"--backend", "memory", "--memory-capacity", kMemory128,
                                 "--cache-bytes", std::to_string(64 << 20)},
                                true},
                      FaultCase{"LocalCacheOff",
                                {"--backend", "local", "--store", "STORE", "--cache-bytes", "0"},
                                false}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
