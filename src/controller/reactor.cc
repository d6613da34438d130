#include "controller/reactor.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <ctime>
#include <stdexcept>

#include "controller/controller_impl.h"
#include "gdkv/queue.h"

namespace gdkv {

namespace {
thread_local Reactor* tls_reactor = nullptr;

void futex_wait(uint32_t* word, uint32_t expected, long timeout_ns) {
  timespec ts{0, timeout_ns};
  syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, expected, &ts, nullptr, 0);
}
void futex_wake(uint32_t* word) {
  syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
}
}  // namespace

void Reactor::wake_word_fn(uint32_t* word) {
  // Only the thread that flips the word from sleeping pays for the system call.
  if (__atomic_exchange_n(word, 0u, __ATOMIC_SEQ_CST) != 0) futex_wake(word);
}

Reactor::Reactor(Controller::Impl* ctl, uint32_t index, std::unique_ptr<CopyEngine> engine)
    : ctl_(ctl), index_(index), engine_(std::move(engine)) {
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
}

Reactor* Reactor::current() noexcept { return tls_reactor; }

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

void Reactor::wake() noexcept { wake_word_fn(&wake_word_); }

void Reactor::add_poller(Poller* p) {
  std::lock_guard lk(pollers_mu_);
  pollers_.push_back(p);
  pollers_version_.fetch_add(1);
  wake();
}

void Reactor::remove_poller(Poller* p) {
  uint64_t version;
  {
    std::lock_guard lk(pollers_mu_);
    pollers_.erase(std::remove(pollers_.begin(), pollers_.end(), p), pollers_.end());
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
  if (__atomic_load_n(&wake_word_, __ATOMIC_SEQ_CST) != 0) wake();
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
  for (;;) {
    if (exit_.load(std::memory_order_relaxed) && in_flight_.load() == 0) break;
    if (poll_once()) {
      stats_.busy_polls.store(stats_.busy_polls.load(std::memory_order_relaxed) + 1,
                              std::memory_order_relaxed);
      idle_iters = 0;
      continue;
    }
    // Reading the clock on every idle iteration costs more than the poll; check it every 64.
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
    // Announce the sleep, then look once more: a requester that rang before seeing the flag is
    // caught by this poll; one that rings after sees the flag and wakes us.
    __atomic_store_n(&wake_word_, 1u, __ATOMIC_SEQ_CST);
    // The polls below load with acquire, which may pass the seq_cst store above (AArch64's RCpc
    // LDAPR does, as C++ allows): without a full fence a requester could miss the flag while we
    // miss its work, and we would sleep through it until the futex timeout.
    atomic::fence();
    if (poll_once() || exit_.load()) {
      __atomic_store_n(&wake_word_, 0u, __ATOMIC_SEQ_CST);
      idle_iters = 0;
      continue;
    }
    stats_.sleeps.store(stats_.sleeps.load(std::memory_order_relaxed) + 1,
                        std::memory_order_relaxed);
    // The timeout bounds the cost of a wake-up lost to a requester that cannot wake us.
    futex_wait(&wake_word_, 1u, 5'000'000);
    __atomic_store_n(&wake_word_, 0u, __ATOMIC_SEQ_CST);
    idle_iters = 0;
  }
  tls_reactor = nullptr;
}

}  // namespace gdkv
