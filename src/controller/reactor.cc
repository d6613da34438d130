#include "controller/reactor.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <string>

#include "controller/controller_impl.h"
#include "gdkv/queue.h"

namespace gdkv {

namespace {
thread_local Reactor* tls_reactor = nullptr;

// A sleeping reactor wakes after this at the latest: the bound on a wake-up lost to requesters
// that cannot wake it (GPU threads, hosts that do not signal the doorbell eventfd).
constexpr int kSleepTimeoutMs = 5;

void signal_eventfd(int fd) {
  const uint64_t one = 1;
  // A full counter (EAGAIN) is still a pending wake-up.
  (void)!::write(fd, &one, sizeof(one));
}
}  // namespace

void Reactor::wake_word_fn(uint32_t* word) {
  // Only the thread that flips the word from sleeping pays for the system call. `word` is the
  // first member of a WakeWord (standard layout), so the pointer converts back to it.
  static_assert(offsetof(WakeWord, sleeping) == 0);
  if (__atomic_exchange_n(word, 0u, __ATOMIC_SEQ_CST) != 0) {
    signal_eventfd(reinterpret_cast<WakeWord*>(word)->fd);
  }
}

Reactor::Reactor(Controller::Impl* ctl, uint32_t index, std::unique_ptr<CopyEngine> engine)
    : ctl_(ctl), index_(index), engine_(std::move(engine)) {
  wake_.fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (wake_.fd < 0 || epoll_fd_ < 0) {
    const int e = errno;
    if (wake_.fd >= 0) ::close(wake_.fd);
    if (epoll_fd_ >= 0) ::close(epoll_fd_);
    throw std::runtime_error(std::string("reactor eventfd/epoll: ") + std::strerror(e));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;  // ours; a poller's wake fd carries its Poller
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_.fd, &ev) != 0) {
    const int e = errno;
    ::close(wake_.fd);
    ::close(epoll_fd_);
    throw std::runtime_error(std::string("reactor epoll_ctl: ") + std::strerror(e));
  }
  const ControllerOptions& o = ctl_->options;
  if (o.staging_alloc && o.staging_pool_bytes > 0) {
    staging_bytes_ = std::bit_ceil(std::max(o.staging_pool_bytes, StagingPool::kMinBlock));
    staging_arena_ = o.staging_alloc(staging_bytes_);
    if (staging_arena_ == nullptr) throw std::runtime_error("allocating the staging pool failed");
    staging_pool_ = std::make_unique<StagingPool>(staging_arena_, staging_bytes_,
                                                  ctl_->next_region_id.fetch_add(1));
  }
}

Reactor::~Reactor() {
  request_exit();
  join();
  // Every command has finished (Controller::stop), so no block of the pool is in use.
  staging_pool_.reset();
  if (staging_arena_ != nullptr) {
    const ControllerOptions& o = ctl_->options;
    if (o.staging_free) {
      o.staging_free(staging_arena_, staging_bytes_);
    }
  }
  ::close(epoll_fd_);
  ::close(wake_.fd);
}

Reactor* Reactor::current() noexcept { return tls_reactor; }

void hint_requester_woken() noexcept {
  if (tls_reactor != nullptr) tls_reactor->requester_woken();
}

void Reactor::start() {
  thread_ = std::thread([this] { run(); });
}

void Reactor::request_exit() {
  exit_.store(true);
  wake();
}

void Reactor::join() {
  if (thread_.joinable()) thread_.join();
}

void Reactor::wake() noexcept { wake_word_fn(&wake_.sleeping); }

void Reactor::add_poller(Poller* p) {
  std::lock_guard lk(pollers_mu_);
  if (const int fd = p->wake_fd(); fd >= 0) {
    // Failure only costs latency: the reactor still wakes within its sleep timeout.
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = p;
    (void)::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
  }
  pollers_.push_back(p);
  pollers_version_.fetch_add(1);
  wake();
}

void Reactor::remove_poller(Poller* p) {
  uint64_t version;
  {
    std::lock_guard lk(pollers_mu_);
    const size_t before = pollers_.size();
    pollers_.erase(std::remove(pollers_.begin(), pollers_.end(), p), pollers_.end());
    if (pollers_.size() != before) {
      if (const int fd = p->wake_fd(); fd >= 0)
        (void)::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
    }
    version = pollers_version_.fetch_add(1) + 1;
  }
  if (current() == this) {
    refresh_pollers();
    return;
  }
  // Wait until the reactor thread runs with a list that no longer holds p.
  while (thread_.joinable() && !exit_.load() && pollers_seen_.load() < version) {
    wake();
    std::this_thread::yield();
  }
}

void Reactor::refresh_pollers() {
  std::lock_guard lk(pollers_mu_);
  active_ = pollers_;
  pollers_seen_.store(pollers_version_.load());
}

void Reactor::post(Command* cmd) {
  if (tls_reactor == this) {
    local_.push_back(cmd);
    return;
  }
  {
    std::lock_guard lk(inbox_mu_);
    inbox_.push_back(cmd);
    inbox_nonempty_.store(true, std::memory_order_release);
  }
  // Store-buffering with the reactor's sleep (run): the flag's store must be visible before we
  // look for a sleeper, and a release store followed by a load gives no such order (x86 and C++
  // let the load pass it). tests/handshake_model_test.cc checks both sides.
  atomic::fence();
  if (__atomic_load_n(&wake_.sleeping, __ATOMIC_SEQ_CST) != 0) wake();
}

bool Reactor::drain_inbox() {
  draining_.clear();
  if (inbox_nonempty_.load(std::memory_order_acquire)) {
    std::lock_guard lk(inbox_mu_);
    draining_.swap(inbox_);
    inbox_nonempty_.store(false, std::memory_order_relaxed);
  }
  if (!local_.empty()) {
    draining_.insert(draining_.end(), local_.begin(), local_.end());
    local_.clear();
  }
  for (Command* c : draining_) ctl_->on_backend_done(c);
  return !draining_.empty();
}

bool Reactor::poll_once() {
  if (pollers_seen_.load(std::memory_order_relaxed) !=
      pollers_version_.load(std::memory_order_acquire)) {
    refresh_pollers();
  }
  bool busy = drain_inbox();
  for (Poller* p : active_) busy |= p->poll();
  busy |= engine_->poll();
  return busy;
}

void Reactor::run() {
  tls_reactor = this;
  const uint64_t spin_ns = uint64_t{ctl_->options.idle_spin_us} * 1000;
  uint64_t idle_since = now_ns();
  uint32_t idle_iters = 0;
  // No idle spin before the next sleep: the last busy poll woke a blocked requester (it may be
  // queued on this core), or a sleep timed out and its look found nothing (a reactor idle for
  // long would otherwise spin idle_spin_us every kSleepTimeoutMs: 4% of a core).
  bool sleep_now = false;
  for (;;) {
    if (exit_.load(std::memory_order_relaxed) && in_flight_.load() == 0) break;
    requester_woken_ = false;
    if (poll_once()) {
      stats_.busy_polls.store(stats_.busy_polls.load(std::memory_order_relaxed) + 1,
                              std::memory_order_relaxed);
      idle_iters = 0;
      sleep_now = requester_woken_;
      continue;
    }
    // Reading the clock on every idle iteration costs more than the poll; check it every 64.
    // A requester just woken from its wait may be queued on this core: no spin then.
    if (!(sleep_now && !ctl_->options.never_sleep)) {
      if ((++idle_iters & 63) != 0) {
        atomic::pause();
        continue;
      }
      const uint64_t now = now_ns();
      if (idle_iters == 64) idle_since = now;
      if (ctl_->options.never_sleep || now - idle_since < spin_ns) {
        atomic::pause();
        continue;
      }
    }
    sleep_now = false;
    // Announce the sleep, then look once more: a requester that rang before seeing the flag is
    // caught by this poll; one that rings after sees the flag and wakes us. Remote requesters
    // see their poller's flag (announce_sleep) and signal its wake fd.
    __atomic_store_n(&wake_.sleeping, 1u, __ATOMIC_SEQ_CST);
    for (Poller* p : active_) p->announce_sleep(true);
    // The polls below load with acquire, which may pass the seq_cst stores above (AArch64's RCpc
    // LDAPR does, as C++ allows): without a full fence a requester could miss the flag while we
    // miss its work, and we would sleep through it until the timeout.
    atomic::fence();
    if (poll_once() || exit_.load()) {
      __atomic_store_n(&wake_.sleeping, 0u, __ATOMIC_SEQ_CST);
      for (Poller* p : active_) p->announce_sleep(false);
      idle_iters = 0;
      continue;
    }
    stats_.sleeps.store(stats_.sleeps.load(std::memory_order_relaxed) + 1,
                        std::memory_order_relaxed);
    sleep_now = !sleep();
    __atomic_store_n(&wake_.sleeping, 0u, __ATOMIC_SEQ_CST);
    for (Poller* p : active_) p->announce_sleep(false);
    idle_iters = 0;
  }
  tls_reactor = nullptr;
}

bool Reactor::sleep() {
  epoll_event evs[16];
  const int n = ::epoll_wait(epoll_fd_, evs, 16, kSleepTimeoutMs);
  // Drain what woke us (every fd is a non-blocking eventfd: ours or a poller's), so the next
  // sleep waits again. A signal that arrives after this read is seen by the next epoll_wait. A
  // poller removed meanwhile is still alive and its fd open: remove_poller returns only once
  // this thread refreshed its list, after this.
  for (int i = 0; i < n; ++i) {
    auto* p = static_cast<Poller*>(evs[i].data.ptr);
    uint64_t v;
    if (p == nullptr) {
      (void)!::read(wake_.fd, &v, sizeof(v));
    } else if (::read(p->wake_fd(), &v, sizeof(v)) == sizeof(v)) {
      p->woken_by_fd();
    }
  }
  return n != 0;
}

}  // namespace gdkv
