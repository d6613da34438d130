// A reactor: one thread that polls its pollers, drains backend completions routed to it, and polls
// its copy engine. Private to the controller.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "controller/staging_pool.h"
#include "gdkv/controller.h"
#include "gdkv/copy_engine.h"
#include "gdkv/histogram.h"

namespace gdkv {

// Counters of one reactor: written by the reactor thread only (relaxed), read by collect().
struct ReactorStats {
  static constexpr int kOps = 7;  // store, retrieve, list, delete, exist, prefetch, scatter
  std::atomic<uint64_t> ops[kOps] = {};
  std::atomic<uint64_t> errors[kOps] = {};
  std::atomic<uint64_t> invalid = {};    // rejected before reaching the backend
  std::atomic<uint64_t> bytes_in = {};   // value bytes stored
  std::atomic<uint64_t> bytes_out = {};  // value bytes delivered
  std::atomic<uint64_t> copy_bytes = {};
  std::atomic<uint64_t> copy_ns = {};  // time copies were in flight (for bandwidth)
  std::atomic<uint64_t> busy_polls = {};
  std::atomic<uint64_t> sleeps = {};
  HistogramRecorder latency;  // ns, fetch to completion
};

class Reactor {
 public:
  Reactor(Controller::Impl* ctl, uint32_t index, std::unique_ptr<CopyEngine> engine);
  ~Reactor();

  void start();
  void request_exit();
  void join();

  void add_poller(Poller* p);
  void remove_poller(Poller* p);

  // Routes a finished backend op's command back to this reactor (any thread).
  void post(Command* cmd);
  void wake() noexcept;

  // The reactor running on the calling thread, or null.
  static Reactor* current() noexcept;
  // hint_requester_woken (gdkv/transport.h) for this reactor (its thread only).
  void requester_woken() noexcept { requester_woken_ = true; }

  uint32_t index() const noexcept { return index_; }
  uint32_t* wake_word() noexcept { return &wake_.sleeping; }
  // Wakes the reactor sleeping on `word` (a QueueRef's wake_fn for the queues it serves).
  static void wake_word_fn(uint32_t* word);
  CopyEngine& engine() noexcept { return *engine_; }
  // Staging memory for this reactor's commands; null without ControllerOptions::staging_alloc.
  StagingPool* staging_pool() noexcept { return staging_pool_.get(); }
  ReactorStats& stats() noexcept { return stats_; }
  const ReactorStats& stats() const noexcept { return stats_; }
  std::atomic<uint64_t>& in_flight() noexcept { return in_flight_; }
  const std::atomic<uint64_t>& in_flight() const noexcept { return in_flight_; }

 private:
  void run();
  bool drain_inbox();
  bool poll_once();
  void refresh_pollers();
  // Sleeps until woken (an in-process requester, a poller's wake_fd) or the timeout; false when
  // the timeout ended it.
  bool sleep();

  // The sleep word in-process requesters look at, and the eventfd that wakes the reactor.
  // Standard layout with `sleeping` first, so a QueueRef's wake pointer leads back to `fd`.
  struct WakeWord {
    uint32_t sleeping = 0;  // 1 while sleeping (or about to)
    int fd = -1;            // eventfd
  };

  Controller::Impl* ctl_;
  uint32_t index_;
  std::unique_ptr<CopyEngine> engine_;
  void* staging_arena_ = nullptr;  // from ControllerOptions::staging_alloc, once
  size_t staging_bytes_ = 0;
  std::unique_ptr<StagingPool> staging_pool_;
  std::thread thread_;
  std::atomic<bool> exit_{false};
  WakeWord wake_;
  bool requester_woken_ = false;  // by the last busy poll (reactor thread only)
  int epoll_fd_ = -1;             // wake_.fd and the pollers' wake fds

  std::mutex pollers_mu_;
  std::vector<Poller*> pollers_;  // guarded by pollers_mu_
  std::atomic<uint64_t> pollers_version_{0};
  std::atomic<uint64_t> pollers_seen_{0};  // version the thread runs with
  std::vector<Poller*> active_;            // reactor thread only

  std::mutex inbox_mu_;
  std::vector<Command*> inbox_;  // guarded by inbox_mu_
  std::atomic<bool> inbox_nonempty_{false};
  std::vector<Command*> local_;  // completions posted from this thread
  std::vector<Command*> draining_;

  std::atomic<uint64_t> in_flight_{0};
  ReactorStats stats_;
};

}  // namespace gdkv
