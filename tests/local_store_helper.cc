// Test helper for the local store, run by local_backend_test as a separate process.
//
//   local_store_helper writer DIR LOG [big]
//     Opens the store in DIR and stores (and sometimes deletes) values as fast as it can, at most
//     one op in flight per key, logging "S key version kind" before each submit and
//     "A key version" once acknowledged, with one write(2) per line so a kill -9 loses nothing
//     the kernel accepted. Runs until killed. "big": only values of 1-3 MiB.
//
//   local_store_helper diskfull DIR
//     Mounts a small tmpfs (and, as root, a loop-mounted ext4 image) in a private mount namespace
//     under DIR and on each: fills a store past full from one process and from 60, fills the disk
//     behind an open store, and opens a store whose file system cannot hold one segment. Checks:
//     the capacity is what the file system holds, every Store succeeds or gets 81h (twice at most),
//     nothing acknowledged is lost or altered (only reclaimed, oldest first), the store keeps
//     serving and reopens consistent, and the too-small open fails naming the sizes.
//     Exit 0: pass; 77: cannot mount here (skip); 78: the tmpfs part passed, the ext4 part needs
//     root (skip); else fail. As root, a missing mkfs.ext4 or a failed loop mount fails.
#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gdkv/local_backend.h"
#include "local_test_util.h"

namespace gdkv::local::test {
namespace {

using nvme::Status;
constexpr uint32_t kWriterKeys = 512;
constexpr int kWriterDepth = 16;

// Segments of 32 MiB (several switches per run); capacity far above what 24 runs write (the byte
// budget below bounds a run), so nothing is reclaimed and every acknowledged value must stay.
constexpr uint64_t kRunBudget = 48u << 20;

LocalBackendOptions writer_options(const std::string& dir) {
  LocalBackendOptions o;
  o.path = dir;
  o.segment_bytes = 32u << 20;  // room for batches longer than the 4 staging chunks in flight
  o.capacity_bytes = uint64_t{8} << 30;
  return o;
}

void log_line(int fd, const std::string& s) {
  if (::write(fd, s.data(), s.size()) != static_cast<ssize_t>(s.size())) std::_Exit(3);
}

struct WriterShared {
  int log_fd = -1;
  std::mutex mu;
  std::condition_variable cv;
  std::set<uint32_t> busy;  // keys with an op in flight: ops on one key are sequential
  int inflight = 0;
};

struct WriterOp {
  BackendOp op;
  WriterShared* sh = nullptr;
  // Page-aligned, as the cache's slabs are: large values take the direct (no-copy) write path.
  std::unique_ptr<std::byte, decltype(&std::free)> value{nullptr, &std::free};
  uint32_t key = 0;
  uint64_t version = 0;
};

void writer_done(BackendOp* op, Status s, uint64_t) {
  auto* w = static_cast<WriterOp*>(op->user);
  WriterShared* sh = w->sh;
  const std::string id = std::to_string(w->key) + " " + std::to_string(w->version);
  if (s == Status::kSuccess) {
    log_line(sh->log_fd, "A " + id + "\n");
  } else if (op->kind == BackendOpKind::kDelete && s == Status::kKeyNotExist) {
    log_line(sh->log_fd, "N " + id + "\n");  // a delete of an absent key: changes nothing
  } else {
    log_line(sh->log_fd, "F " + id + " " + std::to_string(static_cast<int>(s)) + "\n");
  }
  {
    std::lock_guard lk(sh->mu);
    sh->busy.erase(w->key);
    --sh->inflight;
  }
  sh->cv.notify_one();
  delete w;
}

int writer(const std::string& dir, const std::string& log, bool big) {
  WriterShared sh;
  sh.log_fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (sh.log_fd < 0) return 2;
  auto store = make_local_backend(writer_options(dir)).value();
  log_line(sh.log_fd, "ready\n");
  std::mt19937_64 rng(std::random_device{}());
  // Versions grow across runs too (microseconds since the epoch), so they never repeat.
  uint64_t version = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch() /
                                           std::chrono::microseconds(1));
  uint64_t written = 0;
  for (;;) {
    if (written > kRunBudget) {
      // A fast disk: stop before the log could wrap; the kill lands while we idle.
      std::this_thread::sleep_for(std::chrono::seconds(1));
      continue;
    }
    uint32_t k;
    {
      std::unique_lock lk(sh.mu);
      sh.cv.wait(lk, [&] { return sh.inflight < kWriterDepth; });
      do {
        k = static_cast<uint32_t>(rng() % kWriterKeys);
      } while (sh.busy.count(k) != 0);
      sh.busy.insert(k);
      ++sh.inflight;
    }
    auto* w = new WriterOp;
    w->sh = &sh;
    w->key = k;
    // In a big run every value is 1–3 MiB: batches then span many staging chunks, and a kill
    // can land between them, leaving a torn last batch for the next open to drop.
    w->version = big ? (++version / 1000 + 1) * 1000 + 999 : ++version;
    version = std::max(version, w->version);
    const bool del = rng() % 10 == 0;
    w->op.key = int_key(k);
    w->op.user = w;
    w->op.done = &writer_done;
    if (del) {
      w->op.kind = BackendOpKind::kDelete;
    } else {
      w->op.kind = BackendOpKind::kPut;
      const auto v = make_value(k, w->version, value_len(k, w->version));
      w->value.reset(static_cast<std::byte*>(
          std::aligned_alloc(4096, (v.size() + 4095) / 4096 * 4096 + 4096)));
      std::memcpy(w->value.get(), v.data(), v.size());
      w->op.value = std::span<const std::byte>(w->value.get(), v.size());
      written += v.size();
    }
    log_line(sh.log_fd,
             "S " + std::to_string(k) + " " + std::to_string(w->version) + (del ? " D\n" : " P\n"));
    store->submit(&w->op);
  }
}

// ---- disk full ----------------------------------------------------------------------------------

#define CHECK(c)                                                                 \
  do {                                                                           \
    if (!(c)) {                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #c); \
      return false;                                                              \
    }                                                                            \
  } while (0)

bool enter_private_mount_namespace() {
  if (::unshare(CLONE_NEWNS) != 0) {
    // Not root: a user namespace lets an unprivileged user mount a tmpfs of its own.
    const uid_t uid = ::getuid();
    const gid_t gid = ::getgid();
    if (::unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) return false;
    auto write_file = [](const char* path, const std::string& s) {
      const int fd = ::open(path, O_WRONLY | O_CLOEXEC);
      if (fd < 0) return false;
      const bool ok = ::write(fd, s.data(), s.size()) == static_cast<ssize_t>(s.size());
      ::close(fd);
      return ok;
    };
    write_file("/proc/self/setgroups", "deny");
    if (!write_file("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1") ||
        !write_file("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1")) {
      return false;
    }
  }
  // Keep our mounts out of the parent namespace (and theirs out of ours).
  return ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0;
}

// Fills a store on a small file system, in one process, and checks what a full disk must give:
// the capacity reported is what the file system holds, every Store succeeds or fails with 81h and
// the store keeps accepting Stores (reclaiming its oldest segment), nothing acknowledged is lost
// or altered, and the store reopens consistent.
bool fill_until_full(const std::string& dir, bool preallocate, uint64_t fs_bytes,
                     const char* what) {
  std::printf("[%s, one process, preallocate=%d]\n", what, preallocate ? 1 : 0);
  LocalBackendOptions o;
  o.path = dir;
  o.segment_bytes = 1u << 20;
  o.capacity_bytes = 64u << 20;  // far more than the file system holds
  o.preallocate = preallocate;
  std::map<uint32_t, uint64_t> acked;  // key → version
  constexpr size_t kLen = 48 << 10;
  constexpr int kPuts = 400;  // 19 MiB: more than twice the file system
  uint64_t version = 1;
  uint32_t next_key = 0;
  int full = 0, ok_late = 0;
  {
    auto store = make_local_backend(o).value();
    const uint64_t cap = store->info().capacity_bytes;
    CHECK(cap >= o.segment_bytes && cap < fs_bytes);
    for (int i = 0; i < kPuts; ++i, ++version) {
      const uint32_t k = next_key++;
      const Status s = put(*store, int_key(k), make_value(k, version, kLen));
      CHECK(s == Status::kSuccess || s == Status::kCapacityExceeded);
      if (s == Status::kSuccess) {
        acked[k] = version;
        if (i >= kPuts / 2) ++ok_late;
      } else {
        ++full;
      }
    }
    std::printf(
        "  capacity %llu bytes (configured %llu); %zu of %d Stores succeeded, %d got 81h; "
        "of the last %d, %d succeeded; %.0f segments reclaimed\n",
        static_cast<unsigned long long>(cap), static_cast<unsigned long long>(o.capacity_bytes),
        acked.size(), kPuts, full, kPuts / 2, ok_late,
        metric(*store, "local_segments_reclaimed_total"));
    // Full, the store reclaims instead of failing: at most the odd batch that met ENOSPC before
    // the store learnt the disk was full (sparse files only find out on write) gets 81h.
    CHECK(full <= 2);
    CHECK(ok_late >= kPuts / 2 - 1);
    CHECK(metric(*store, "local_segments_reclaimed_total") >= 1);
    CHECK(metric(*store, "local_checksum_failures_total") == 0);
    // The newest values are there, byte-exact.
    for (uint32_t k = next_key - 20; k < next_key; ++k) {
      if (acked.count(k) == 0) continue;
      const GetResult r = get(*store, int_key(k));
      CHECK(r.status == Status::kSuccess);
      CHECK(r.data == make_value(k, acked[k], kLen));
    }
  }
  // Reopen: every key the index has reads back byte-exact, the newest ones are there, and what
  // is gone is gone because it was reclaimed (oldest first), never because of the failure.
  auto store = make_local_backend(o).value();
  CHECK(store->info().capacity_bytes < fs_bytes);
  const auto keys = list(*store, Key{}, 1u << 20);
  CHECK(!keys.empty());
  uint32_t oldest_present = ~0u;
  for (const Key& key : keys) {
    uint32_t k;
    std::memcpy(&k, key.bytes + 4, 4);
    CHECK(acked.count(k) == 1);
    const GetResult r = get(*store, key);
    CHECK(r.status == Status::kSuccess);
    CHECK(r.data == make_value(k, acked[k], kLen));
    oldest_present = std::min(oldest_present, k);
  }
  for (const auto& [k, ver] : acked) {
    if (k >= oldest_present)
      CHECK(simple(*store, BackendOpKind::kExists, int_key(k)) == Status::kSuccess);
  }
  // And it still takes Stores after the reopen.
  CHECK(put(*store, int_key(next_key), make_value(next_key, version, kLen)) == Status::kSuccess);
  std::printf("  reopened: %zu keys, all byte-exact; a Store after reopen succeeded\n",
              keys.size());
  return true;
}

// The same through many processes, each opening the store, storing a few values and closing it,
// as `gdkv put` does: each one must learn at open what the file system holds (the cap used to
// live in memory only, so every new process tried to grow, got 81h and stored nothing, for good).
bool fill_from_many_processes(const std::string& dir, uint64_t fs_bytes, const char* what) {
  std::printf("[%s, many processes]\n", what);
  constexpr int kProcs = 60;
  constexpr int kPerProc = 4;
  constexpr size_t kLen = 96 << 10;  // 60 x 4 x 96 KiB = 22.5 MiB, several times the fs
  LocalBackendOptions o;
  o.path = dir;
  o.segment_bytes = 1u << 20;  // capacity_bytes stays at the default 8 GiB
  const std::string log = dir + ".log";
  for (int p = 0; p < kProcs; ++p) {
    std::fflush(stdout);
    const pid_t pid = ::fork();
    if (pid == 0) {
      // The child: one store open, kPerProc Stores, close; a line per Store into the log. Only
      // the first child keeps stderr, so the log shows the open's capacity warning once.
      if (p > 0) ::freopen("/dev/null", "w", stderr);
      int rc = 0;
      try {
        auto store = make_local_backend(o).value();
        const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        for (int i = 0; i < kPerProc; ++i) {
          const uint32_t k = static_cast<uint32_t>(p * kPerProc + i);
          const Status s = put(*store, int_key(k), make_value(k, 1, kLen));
          log_line(fd, std::to_string(k) + " " + std::to_string(static_cast<int>(s)) + "\n");
        }
        ::close(fd);
      } catch (const std::exception& e) {
        std::printf("  child %d: %s\n", p, e.what());
        rc = 3;
      }
      std::_Exit(rc);
    }
    int st = 0;
    CHECK(pid > 0 && ::waitpid(pid, &st, 0) == pid);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  std::map<uint32_t, int> status;
  {
    FILE* f = std::fopen(log.c_str(), "r");
    CHECK(f != nullptr);
    unsigned k = 0;
    int s = 0;
    while (std::fscanf(f, "%u %d", &k, &s) == 2) status[k] = s;
    std::fclose(f);
  }
  CHECK(status.size() == size_t{kProcs} * kPerProc);
  int ok = 0, full = 0, ok_late = 0;
  for (const auto& [k, s] : status) {
    CHECK(s == static_cast<int>(Status::kSuccess) ||
          s == static_cast<int>(Status::kCapacityExceeded));
    if (s == static_cast<int>(Status::kSuccess)) {
      ++ok;
      if (k >= status.size() / 2) ++ok_late;
    } else {
      ++full;
    }
  }
  auto store = make_local_backend(o).value();
  const BackendInfo info = store->info();
  std::printf(
      "  %d of %zu Stores succeeded, %d got 81h (%d of the last %zu succeeded); capacity "
      "%llu bytes\n",
      ok, status.size(), full, ok_late, status.size() / 2,
      static_cast<unsigned long long>(info.capacity_bytes));
  CHECK(info.capacity_bytes < fs_bytes);
  CHECK(full <= 2);
  CHECK(ok_late >= static_cast<int>(status.size() / 2) - 1);
  // Every key the store holds is byte-exact; the newest are there; what is missing is older
  // than everything present (reclaimed oldest first) or was refused.
  const auto keys = list(*store, Key{}, 1u << 20);
  uint32_t oldest_present = ~0u;
  for (const Key& key : keys) {
    uint32_t k;
    std::memcpy(&k, key.bytes + 4, 4);
    CHECK(status.count(k) == 1 && status[k] == 0);
    const GetResult r = get(*store, key);
    CHECK(r.status == Status::kSuccess);
    CHECK(r.data == make_value(k, 1, kLen));
    oldest_present = std::min(oldest_present, k);
  }
  for (const auto& [k, s] : status) {
    if (k >= oldest_present && s == 0) {
      CHECK(simple(*store, BackendOpKind::kExists, int_key(k)) == Status::kSuccess);
    }
  }
  CHECK(status.rbegin()->second == 0);
  std::printf("  reopened: %zu keys, all byte-exact\n", keys.size());
  return true;
}

// The file system fills up behind an open store's back (another file takes the space it counted
// on at open): growing meets ENOSPC, and the store reclaims its oldest segment instead.
bool filled_behind_its_back(const std::string& dir, const char* what) {
  std::printf("[%s, another file fills the disk while the store is open]\n", what);
  LocalBackendOptions o;
  o.path = dir;
  o.segment_bytes = 1u << 20;
  o.capacity_bytes = 64u << 20;
  constexpr size_t kLen = 48 << 10;
  auto store = make_local_backend(o).value();
  const uint64_t cap0 = store->info().capacity_bytes;
  // Take half the file system.
  const std::string ballast = dir + "/../ballast";
  const int fd = ::open(ballast.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  CHECK(fd >= 0 && ::fallocate(fd, 0, 0, static_cast<off_t>(cap0 / 2)) == 0);
  ::close(fd);
  std::map<uint32_t, int> status;
  int full = 0;
  for (uint32_t k = 0; k < 400; ++k) {
    const Status s = put(*store, int_key(k), make_value(k, 1, kLen));
    CHECK(s == Status::kSuccess || s == Status::kCapacityExceeded);
    status[k] = static_cast<int>(s);
    full += s != Status::kSuccess;
  }
  std::printf("  capacity %llu -> %llu bytes; %d of 400 Stores got 81h; %.0f segments reclaimed\n",
              static_cast<unsigned long long>(cap0),
              static_cast<unsigned long long>(store->info().capacity_bytes), full,
              metric(*store, "local_segments_reclaimed_total"));
  CHECK(full == 0);
  CHECK(metric(*store, "local_disk_full_total") >= 1);
  CHECK(store->info().capacity_bytes < cap0);
  for (uint32_t k = 390; k < 400; ++k) {
    const GetResult r = get(*store, int_key(k));
    CHECK(r.status == Status::kSuccess && r.data == make_value(k, 1, kLen));
  }
  store.reset();
  std::filesystem::remove(ballast);
  return true;
}

// A file system that cannot hold even one segment: open fails and says why, with the sizes.
bool too_small_for_one_segment(const std::string& dir, uint32_t segment_bytes, const char* what) {
  std::printf("[%s, segments of %u bytes]\n", what, segment_bytes);
  LocalBackendOptions o;
  o.path = dir;
  o.segment_bytes = segment_bytes;
  auto r = make_local_backend(o);
  CHECK(!r.ok());
  const std::string msg = r.error();
  std::printf("  open: %s\n", msg.c_str());
  CHECK(msg.find("not enough for one segment of " + std::to_string(segment_bytes)) !=
        std::string::npos);
  CHECK(msg.find("of at most") != std::string::npos);
  return true;
}

int diskfull(const std::string& dir) {
  namespace fs = std::filesystem;
  if (!enter_private_mount_namespace()) {
    std::printf("cannot create a private mount namespace here: skipping\n");
    return 77;
  }
  const std::string mnt = dir + "/mnt";
  fs::create_directories(mnt);
  constexpr uint64_t kTmpfs = 8u << 20;
  if (::mount("gdkv-full", mnt.c_str(), "tmpfs", 0, "size=8m") != 0) {
    std::printf("cannot mount a tmpfs here (%s): skipping\n", std::strerror(errno));
    return 77;
  }
  bool ok = fill_until_full(mnt + "/a", true, kTmpfs, "tmpfs 8 MiB") &&
            (fs::remove_all(mnt + "/a"), true) &&
            fill_until_full(mnt + "/b", false, kTmpfs, "tmpfs 8 MiB") &&
            (fs::remove_all(mnt + "/b"), true) &&
            fill_from_many_processes(mnt + "/c", kTmpfs, "tmpfs 8 MiB") &&
            (fs::remove_all(mnt + "/c"), true) &&
            filled_behind_its_back(mnt + "/e", "tmpfs 8 MiB") &&
            (fs::remove_all(mnt + "/e"), true) &&
            too_small_for_one_segment(mnt + "/d", 16u << 20, "tmpfs 8 MiB");
  ::umount(mnt.c_str());
  if (!ok) return 1;

  // A real block file system too, where fallocate and O_DIRECT behave as on an NVMe drive.
  if (::geteuid() != 0) {
    std::printf("[ext4 on a loop device: needs root, skipped]\n");
    return 78;
  }
  if (std::system("command -v mkfs.ext4 >/dev/null 2>&1") != 0) {
    std::printf("[ext4 on a loop device: mkfs.ext4 not installed (e2fsprogs)]\n");
    return 1;
  }
  constexpr uint64_t kExt4 = 16u << 20;
  const std::string img = dir + "/ext4.img";
  const std::string cmd = "truncate -s 16M " + img + " && mkfs.ext4 -q -F " + img +
                          " >/dev/null 2>&1 && mount -o loop " + img + " " + mnt;
  if (std::system(cmd.c_str()) != 0) {
    std::printf("[ext4 on a loop device: mounting failed: %s]\n", cmd.c_str());
    return 1;
  }
  ok = fill_until_full(mnt + "/a", true, kExt4, "ext4 16 MiB on a loop device") &&
       (fs::remove_all(mnt + "/a"), true) &&
       fill_until_full(mnt + "/b", false, kExt4, "ext4 16 MiB on a loop device") &&
       (fs::remove_all(mnt + "/b"), true) &&
       fill_from_many_processes(mnt + "/c", kExt4, "ext4 16 MiB on a loop device") &&
       (fs::remove_all(mnt + "/c"), true) &&
       filled_behind_its_back(mnt + "/e", "ext4 16 MiB on a loop device") &&
       (fs::remove_all(mnt + "/e"), true) &&
       too_small_for_one_segment(mnt + "/d", 32u << 20, "ext4 16 MiB on a loop device");
  ::umount(mnt.c_str());
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace gdkv::local::test

int main(int argc, char** argv) {
  using namespace gdkv::local::test;
  const std::string cmd = argc > 1 ? argv[1] : "";
  try {
    if (cmd == "writer" && (argc == 4 || argc == 5)) {
      return writer(argv[2], argv[3], argc == 5 && std::string(argv[4]) == "big");
    }
    if (cmd == "diskfull" && argc == 3) return diskfull(argv[2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "local_store_helper: %s\n", e.what());
    return 2;
  }
  std::fprintf(stderr, "usage: local_store_helper writer DIR LOG [big] | diskfull DIR\n");
  return 2;
}
