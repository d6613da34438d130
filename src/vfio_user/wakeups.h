// Wake-ups between the client driver and gdkvd's reactors (docs/vfio-user.md "Wake-ups"): the
// doorbell wake-up a requester sends a sleeping reactor, and how a waiting Client blocks on its
// queue's completion interrupt (IrqWaiter).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <utility>

#include "gdkv/client.h"
#include "vfio_user/socket_io.h"

namespace gdkv::vfio_user {

// The connection's doorbell ioeventfd, found by its sleeping word (in the doorbell page): a
// QueueRef's wake_fn gets only the word. Registered while the connection lives.
void register_doorbell(const uint32_t* word, int fd);
void unregister_doorbell(const uint32_t* word);

// QueueRef::wake_fn of gdkvd's queues: the doorbell was rung and the reactor sleeps. Only the
// thread that flips the word (to 0) pays for the system call; the reactor clears it when it
// wakes. Also writes this thread's CPU into the word after it (kWakeWakerCpuOffset).
void wake_reactor(uint32_t* word);

// Whether this thread woke a reactor since it last asked (then its next wait blocks at once).
bool take_woke_reactor();

// How a waiting Client blocks on its queue's completion interrupt. One waiting thread at a time
// (the sleeper) arms the CQ, looks at its command once more and blocks on the eventfd; the others
// wait on a futex the sleeper bumps when it wakes, so every waiter looks again after any
// interrupt. Nothing is lost: a waiter that found the sleeper role taken read the generation
// first, and the sleeper bumps it only after giving the role up.
class IrqWaiter final : public CompletionWaiter {
 public:
  // A sleeper that heard nothing looks again after this (an interrupt lost, gdkvd gone).
  static constexpr long kBlockNs = 1'000'000;
  static constexpr uint32_t kMissLimit = 8;   // spins in a row that saw nothing: stop spinning
  static constexpr uint32_t kRetrySpin = 64;  // then every 64th wait spins again

  IrqWaiter(UniqueFd efd, uint32_t* arm, std::chrono::nanoseconds spin)
      : efd_(std::move(efd)), arm_(arm), spin_(spin) {}
  // Spins unless this thread just woke the reactor or recent spins never saw a completion (the
  // reactor shares our core, or the backend is slower than the spin); then one wait in
  // kRetrySpin spins again to find out whether that changed.
  std::chrono::nanoseconds spin() override {
    if (take_woke_reactor()) return {};
    const uint32_t n = __atomic_add_fetch(&waits_, 1u, __ATOMIC_RELAXED);
    if (__atomic_load_n(&misses_, __ATOMIC_RELAXED) >= kMissLimit && n % kRetrySpin != 0) {
      return {};
    }
    return spin_;
  }
  void spun(bool completed) override {
    if (spin_.count() == 0) return;
    if (completed) {
      __atomic_store_n(&misses_, 0u, __ATOMIC_RELAXED);
    } else if (__atomic_load_n(&misses_, __ATOMIC_RELAXED) < kMissLimit) {
      __atomic_fetch_add(&misses_, 1u, __ATOMIC_RELAXED);
    }
  }

  void block(const QueueRef& q, uint16_t cid) override;

 private:
  UniqueFd efd_;   // the CQ's MSI-X eventfd (non-blocking)
  uint32_t* arm_;  // the CQ's arm word in the doorbell page
  std::chrono::nanoseconds spin_;
  std::atomic<bool> sleeper_{false};
  uint32_t gen_ = 0;      // futex word
  uint32_t waiters_ = 0;  // threads waiting on gen_
  uint32_t waits_ = 0;    // spin() calls (relaxed: a heuristic)
  uint32_t misses_ = 0;   // spins in a row that ended without the completion
};

}  // namespace gdkv::vfio_user
