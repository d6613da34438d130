// The files backend (files_backend.h): one checksummed file per value, written atomically.
#include "files_backend.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "gdkv/backend_factory.h"
#include "gdkv/backend_registry.h"

namespace gdkv {
namespace {

using nvme::Status;

constexpr char kMagic[8] = {'G', 'D', 'K', 'V', 'F', 'I', 'L', '1'};
// The header every value file starts with.
struct Header {
  char magic[8];
  uint32_t version;
  uint32_t key_len;
  uint8_t key[16];
  uint64_t value_len;
  uint64_t checksum;  // XXH3-64 of the value
};
static_assert(sizeof(Header) == 48);

// An fd closed when it goes out of scope.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

bool write_all(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::write(fd, c, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* p, size_t n, off_t at) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = ::pread(fd, c, n, at);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    at += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// A failed write's status: a full file system or quota is 81h, anything else 88h.
Status write_error(int err) {
  return err == ENOSPC || err == EDQUOT ? Status::kCapacityExceeded : Status::kUnrecoveredError;
}

std::string hostname() {
  char h[256] = {};
  if (::gethostname(h, sizeof h - 1) != 0) return "host";
  std::string s(h);
  std::replace(s.begin(), s.end(), '.', '_');
  return s;
}

class FilesBackend final : public Backend {
 public:
  explicit FilesBackend(const FilesBackendOptions& o) : options_(o), host_(hostname()) {}

  ~FilesBackend() override {
    drain();
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  // Creates the directory, removes this machine's leftover temporary files and learns what the
  // namespaces hold; then starts the threads.
  Result<void> open() {
    if (::mkdir(options_.path.c_str(), 0755) != 0 && errno != EEXIST) {
      return Error{"files backend: cannot create " + options_.path + ": " + std::strerror(errno)};
    }
    DIR* top = ::opendir(options_.path.c_str());
    if (top == nullptr) {
      return Error{"files backend: cannot read " + options_.path + ": " + std::strerror(errno)};
    }
    struct Found {
      NsKey key;
      uint64_t bytes;
      timespec mtime;
    };
    std::vector<Found> found;
    while (const dirent* e = ::readdir(top)) {
      const std::string ns = e->d_name;
      if (ns.rfind("ns", 0) != 0) continue;
      char* end = nullptr;
      const unsigned long nsid = std::strtoul(ns.c_str() + 2, &end, 10);
      if (*end != '\0' || nsid == 0 || nsid > UINT32_MAX) continue;
      const std::string dir = options_.path + "/" + ns;
      DIR* d = ::opendir(dir.c_str());
      if (d == nullptr) continue;
      while (const dirent* f = ::readdir(d)) {
        const std::string name = f->d_name;
        struct stat st {};
        if (name.rfind(".tmp.", 0) == 0) {
          if (leftover(name)) ::unlink((dir + "/" + name).c_str());
          continue;
        }
        const std::optional<Key> k = Key::from_hex(name);
        if (!k || ::stat((dir + "/" + name).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
        found.push_back({NsKey{static_cast<uint32_t>(nsid), *k}, uint64_t(st.st_size), st.st_mtim});
      }
      ::closedir(d);
    }
    ::closedir(top);
    std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
      return a.mtime.tv_sec != b.mtime.tv_sec ? a.mtime.tv_sec < b.mtime.tv_sec
                                              : a.mtime.tv_nsec < b.mtime.tv_nsec;
    });
    for (const Found& f : found) remember(f.key, f.bytes);
    for (uint32_t i = 0; i < std::max<uint32_t>(options_.threads, 1); ++i) {
      threads_.emplace_back([this] { work(); });
    }
    return {};
  }

  void submit(BackendOp* op) override {
    {
      std::lock_guard lk(mu_);
      queue_.push_back(op);
    }
    work_cv_.notify_one();
  }

  BackendInfo info() const override {
    std::lock_guard lk(index_mu_);
    BackendInfo i;
    i.name = "files";
    i.keys = index_.size();
    i.bytes_used = used_;
    i.capacity_bytes = options_.capacity_bytes;
    return i;
  }

  void collect(MetricList& out) const override {
    MetricWriter w(out);
    w.add("files_corrupt_total", "value files that failed their check (read as 88h)",
          MetricType::kCounter, double(corrupt_.load()));
    w.add("files_evictions_total", "values removed to stay within capacity_bytes",
          MetricType::kCounter, double(evictions_.load()));
  }

  void drain() override {
    std::unique_lock lk(mu_);
    idle_cv_.wait(lk, [this] { return queue_.empty() && active_ == 0; });
  }

  void set_removal_handler(InvalidationHandler h) override { removals_.set(std::move(h)); }

 private:
  std::string folder(uint32_t nsid) const { return options_.path + "/ns" + std::to_string(nsid); }
  std::string file(uint32_t nsid, const Key& k) const { return folder(nsid) + "/" + k.hex(); }

  // A temporary file this machine's process left behind: ".tmp.<host>.<pid>.<seq>" whose
  // process is gone (or is this one, from an earlier backend).
  bool leftover(const std::string& name) const {
    const std::string mine = ".tmp." + host_ + ".";
    if (name.rfind(mine, 0) != 0) return false;
    const long pid = std::strtol(name.c_str() + mine.size(), nullptr, 10);
    return pid <= 0 || pid == ::getpid() ||
           (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH);
  }

  void work() {
    for (;;) {
      BackendOp* op = nullptr;
      {
        std::unique_lock lk(mu_);
        work_cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        op = queue_.front();
        queue_.pop_front();
        ++active_;
      }
      run(op);
      {
        std::lock_guard lk(mu_);
        --active_;
      }
      idle_cv_.notify_all();
    }
  }

  void run(BackendOp* op) {
    switch (op->kind) {
      case BackendOpKind::kPut:
        return put(op);
      case BackendOpKind::kGet:
        return get(op);
      case BackendOpKind::kDelete:
        return erase(op);
      case BackendOpKind::kExists: {
        struct stat st {};
        return op->complete(::stat(file(op->nsid, op->key).c_str(), &st) == 0
                                ? Status::kSuccess
                                : Status::kKeyNotExist);
      }
      case BackendOpKind::kList:
        return list(op);
    }
    op->complete(Status::kInvalidOpcode);
  }

  void put(BackendOp* op) {
    const uint64_t bytes = sizeof(Header) + op->value.size();
    if (options_.capacity_bytes > 0 && bytes > options_.capacity_bytes) {
      return op->complete(Status::kCapacityExceeded);
    }
    const std::string dir = folder(op->nsid), target = file(op->nsid, op->key);
    struct stat st {};
    const bool exists = ::stat(target.c_str(), &st) == 0;
    if ((op->store_options & nvme::kStoreMustExist) && !exists) {
      return op->complete(Status::kKeyNotExist);
    }
    if ((op->store_options & nvme::kStoreMustNotExist) && exists) {
      return op->complete(Status::kKeyExists);
    }
    make_room(NsKey{op->nsid, op->key}, bytes);
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
      return op->complete(write_error(errno));
    }
    const std::string tmp = dir + "/.tmp." + host_ + "." + std::to_string(::getpid()) + "." +
                            std::to_string(seq_.fetch_add(1));
    Header h{};
    std::memcpy(h.magic, kMagic, sizeof kMagic);
    h.version = 1;
    h.key_len = op->key.len;
    std::memcpy(h.key, op->key.bytes, op->key.len);
    h.value_len = op->value.size();
    h.checksum = XXH3_64bits(op->value.data(), op->value.size());
    {
      Fd f(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
      if (f.fd < 0) return op->complete(write_error(errno));
      if (!write_all(f.fd, &h, sizeof h) || !write_all(f.fd, op->value.data(), op->value.size()) ||
          ::fdatasync(f.fd) != 0) {
        const int err = errno;
        ::unlink(tmp.c_str());
        return op->complete(write_error(err));
      }
    }
    if (op->store_options & nvme::kStoreMustNotExist) {
      // Atomic "create if absent": link fails if another writer got there first.
      const int rc = ::link(tmp.c_str(), target.c_str());
      const int err = errno;
      ::unlink(tmp.c_str());
      if (rc != 0) return op->complete(err == EEXIST ? Status::kKeyExists : write_error(err));
    } else if (::rename(tmp.c_str(), target.c_str()) != 0) {
      const int err = errno;
      ::unlink(tmp.c_str());
      return op->complete(write_error(err));
    }
    Fd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (d.fd < 0 || ::fsync(d.fd) != 0) return op->complete(write_error(errno));
    remember(NsKey{op->nsid, op->key}, bytes);
    op->complete(Status::kSuccess);
  }

  void get(BackendOp* op) {
    Fd f(::open(file(op->nsid, op->key).c_str(), O_RDONLY | O_CLOEXEC));
    if (f.fd < 0) {
      return op->complete(errno == ENOENT ? Status::kKeyNotExist : Status::kUnrecoveredError);
    }
    Header h{};
    struct stat st {};
    if (::fstat(f.fd, &st) != 0 || !read_all(f.fd, &h, sizeof h, 0) ||
        std::memcmp(h.magic, kMagic, sizeof kMagic) != 0 || h.key_len != op->key.len ||
        std::memcmp(h.key, op->key.bytes, op->key.len) != 0 ||
        h.value_len != uint64_t(st.st_size) - sizeof(Header)) {
      return corrupt(op);
    }
    // Read into the caller's buffer when it takes the whole value, else into our own; check
    // the checksum before saying success.
    std::span<std::byte> out = op->sink(op, h.value_len);
    std::vector<std::byte> own;
    std::span<std::byte> into = out;
    if (out.size() < h.value_len) {
      own.resize(h.value_len);
      into = own;
    }
    into = into.first(h.value_len);
    if (!read_all(f.fd, into.data(), into.size(), sizeof(Header)) ||
        XXH3_64bits(into.data(), into.size()) != h.checksum) {
      return corrupt(op);
    }
    if (!own.empty() && !out.empty()) std::memcpy(out.data(), own.data(), out.size());
    op->complete(Status::kSuccess, h.value_len);
  }

  void corrupt(BackendOp* op) {
    corrupt_.fetch_add(1);
    op->complete(Status::kUnrecoveredError);
  }

  void erase(BackendOp* op) {
    if (::unlink(file(op->nsid, op->key).c_str()) != 0) {
      return op->complete(errno == ENOENT ? Status::kKeyNotExist : Status::kUnrecoveredError);
    }
    forget(NsKey{op->nsid, op->key});
    removals_(op->nsid, op->key);
    op->complete(Status::kSuccess);
  }

  void list(BackendOp* op) {
    std::vector<Key> keys;
    if (DIR* d = ::opendir(folder(op->nsid).c_str())) {
      while (const dirent* e = ::readdir(d)) {
        const std::optional<Key> k = Key::from_hex(e->d_name);
        if (k && (op->key.len == 0 || !(*k < op->key))) keys.push_back(*k);
      }
      ::closedir(d);
    }
    std::sort(keys.begin(), keys.end());
    if (keys.size() > op->list_max) keys.resize(op->list_max);
    op->keys = std::move(keys);
    op->complete(Status::kSuccess);
  }

  // The index of what this node knows the folder holds, oldest first, for capacity_bytes.
  void remember(const NsKey& k, uint64_t bytes) {
    std::lock_guard lk(index_mu_);
    forget_locked(k);
    order_.push_back(k);
    index_[k] = {bytes, std::prev(order_.end())};
    used_ += bytes;
  }
  void forget(const NsKey& k) {
    std::lock_guard lk(index_mu_);
    forget_locked(k);
  }
  void forget_locked(const NsKey& k) {
    auto it = index_.find(k);
    if (it == index_.end()) return;
    used_ -= it->second.bytes;
    order_.erase(it->second.at);
    index_.erase(it);
  }

  // Removes the oldest values until `bytes` more fit. `k`'s own old copy counts as free but stays
  // in the index: a Store that then fails leaves it there, counted.
  void make_room(const NsKey& k, uint64_t bytes) {
    if (options_.capacity_bytes == 0) return;
    std::vector<NsKey> victims;
    {
      std::lock_guard lk(index_mu_);
      uint64_t used = used_;
      if (auto own = index_.find(k); own != index_.end()) used -= own->second.bytes;
      for (auto it = order_.begin(); used + bytes > options_.capacity_bytes && it != order_.end();
           ++it) {
        if (*it == k) continue;
        used -= index_[*it].bytes;
        victims.push_back(*it);
      }
      for (const NsKey& v : victims) forget_locked(v);
    }
    for (const NsKey& v : victims) {
      if (::unlink(file(v.nsid, v.key).c_str()) == 0) {
        evictions_.fetch_add(1);
        removals_(v.nsid, v.key);
      }
    }
  }

  struct Entry {
    uint64_t bytes;
    std::list<NsKey>::iterator at;
  };

  const FilesBackendOptions options_;
  const std::string host_;
  std::atomic<uint64_t> seq_{0};
  std::atomic<uint64_t> corrupt_{0}, evictions_{0};
  InvalidationHook removals_;

  mutable std::mutex mu_;  // the queue
  std::condition_variable work_cv_, idle_cv_;
  std::deque<BackendOp*> queue_;
  uint32_t active_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;

  mutable std::mutex index_mu_;
  std::unordered_map<NsKey, Entry, NsKeyHash> index_;
  std::list<NsKey> order_;  // oldest first
  uint64_t used_ = 0;
};

}  // namespace

Result<std::shared_ptr<Backend>> make_files_backend(const FilesBackendOptions& options) {
  if (options.path.empty()) return Error{"files backend: files_dir must name a directory"};
  auto b = std::make_shared<FilesBackend>(options);
  if (auto opened = b->open(); !opened) return Error{opened.error()};
  return std::shared_ptr<Backend>(std::move(b));
}

}  // namespace gdkv

// ---- registration (gdkv/backend_registry.h) ----

void gdkv_register_backend_files(std::vector<gdkv::BackendRegistration>& registry) {
  using gdkv::FilesBackendOptions;
  using gdkv::setting_row;
  using C = gdkv::BackendConfig;
  gdkv::BackendRegistration b;
  b.name = "files";
  b.help = "one checksummed file per value in a directory (a shared mount: every node's tier)";
  b.traits.needs_directory = true;
  b.traits.can_be_far_tier = true;
  b.directory_setting = "files_dir";
  b.default_options = FilesBackendOptions{};
  b.settings.push_back(setting_row<C>(
      "files_dir", "backend.files_dir", "--files-dir", "", 0, 0, {},
      "the files backend's directory (on a shared mount, a tier every node shares)",
      [](C & c) -> auto& { return c.options_of<FilesBackendOptions>("files").path; }));
  b.settings.push_back(setting_row<C>(
      "files_capacity", "backend.files_capacity_bytes", "--files-capacity", "bytes", 0,
      gdkv::kSettingAny, {}, "what the files backend may hold (0: no limit of its own)",
      [](C & c) -> auto& { return c.options_of<FilesBackendOptions>("files").capacity_bytes; }));
  b.settings.push_back(setting_row<C>(
      "files_threads", "backend.files_threads", "--files-threads", "", 1, 256, {},
      "threads doing the files backend's file system calls",
      [](C & c) -> auto& { return c.options_of<FilesBackendOptions>("files").threads; }));
  b.open = [](const C& c) -> gdkv::Result<std::shared_ptr<gdkv::Backend>> {
    return gdkv::make_files_backend(c.options_of<FilesBackendOptions>("files"));
  };
  registry.push_back(std::move(b));
}
