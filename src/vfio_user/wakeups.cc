// Wake-ups between the client driver and gdkvd's reactors (wakeups.h).
#include "vfio_user/wakeups.h"

#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "vfio_user/nvme_defs.h"

namespace gdkv::vfio_user {

namespace {

// A QueueRef's wake_fn gets only the sleeping word (in the connection's doorbell page); the
// connection's doorbell ioeventfd is found by it here. Looked up only when the reactor sleeps.
std::mutex g_doorbell_fds_mu;
std::unordered_map<const uint32_t*, int> g_doorbell_fds;  // guarded by g_doorbell_fds_mu

void signal_fd(int fd) {
  const uint64_t one = 1;
  (void)!::write(fd, &one, sizeof(one));  // a full counter (EAGAIN) is still a wake-up
}

// Set when this thread woke a reactor: its next wait blocks at once. The woken reactor often
// runs on this thread's core (the scheduler wakes it where it last ran or beside its waker), and
// there a spin only delays it: back-to-back calls with both on one core took 28 us (p50) with a
// 20 us spin here and 18 us without; after a pause the spin bought nothing (57 us either way on
// the 2-core test VM, whose cross-core wake-up alone is ~80 us; docs/benchmarks.md).
thread_local bool tls_woke_reactor = false;

long futex(uint32_t* word, int op, uint32_t val, const timespec* ts) {
  return ::syscall(SYS_futex, word, op, val, ts, nullptr, 0);
}

}  // namespace

void register_doorbell(const uint32_t* word, int fd) {
  std::lock_guard lk(g_doorbell_fds_mu);
  g_doorbell_fds[word] = fd;
}

void unregister_doorbell(const uint32_t* word) {
  std::lock_guard lk(g_doorbell_fds_mu);
  g_doorbell_fds.erase(word);
}

bool take_woke_reactor() { return std::exchange(tls_woke_reactor, false); }

void wake_reactor(uint32_t* word) {
  if (__atomic_exchange_n(word, 0u, __ATOMIC_SEQ_CST) == 0) return;
  tls_woke_reactor = true;
  // Where we run: a reactor woken on this CPU sleeps right after posting our completion, so we
  // are not left queued behind its idle spin (the word follows the sleeping word).
  static_assert(kWakeWakerCpuOffset == kWakeSleepingOffset + 4);
  __atomic_store_n(word + 1, cpu_word(::sched_getcpu()), __ATOMIC_RELAXED);
  int fd = -1;
  {
    std::lock_guard lk(g_doorbell_fds_mu);
    auto it = g_doorbell_fds.find(word);
    if (it != g_doorbell_fds.end()) fd = it->second;
  }
  if (fd >= 0) signal_fd(fd);
}

void IrqWaiter::block(const QueueRef& q, uint16_t cid) {
  const uint32_t gen = __atomic_load_n(&gen_, __ATOMIC_SEQ_CST);
  bool no = false;
  if (!sleeper_.compare_exchange_strong(no, true, std::memory_order_seq_cst)) {
    __atomic_fetch_add(&waiters_, 1u, __ATOMIC_SEQ_CST);
    if (!queue::poll(q, cid)) {
      const timespec ts{0, kBlockNs};
      (void)futex(&gen_, FUTEX_WAIT_PRIVATE, gen, &ts);
    }
    __atomic_fetch_sub(&waiters_, 1u, __ATOMIC_SEQ_CST);
    return;
  }
  // Arm, then look (store-buffering with gdkvd's post-then-look-at-the-arm: both fence).
  // The arm word says where we block (2 + CPU; 1: unknown): gdkvd gives up its core when it
  // wakes a waiter on it.
  __atomic_store_n(arm_, cpu_word(::sched_getcpu()), __ATOMIC_SEQ_CST);
  atomic::fence();
  if (!queue::poll(q, cid)) {
    pollfd pf{efd_.get(), POLLIN, 0};
    (void)::poll(&pf, 1, static_cast<int>(kBlockNs / 1'000'000));
    uint64_t v;
    (void)!::read(efd_.get(), &v, sizeof(v));
  }
  sleeper_.store(false, std::memory_order_seq_cst);
  __atomic_fetch_add(&gen_, 1u, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&waiters_, __ATOMIC_SEQ_CST) != 0) {
    (void)futex(&gen_, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr);
  }
}

}  // namespace gdkv::vfio_user
