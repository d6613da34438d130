// In-process queue pairs (see queue_poller.cc). Private to the controller.
#pragma once

#include <deque>
#include <memory>
#include <vector>

#include "controller/controller_impl.h"

namespace gdkv {

// Data pointers of a requester in this process: plain virtual addresses. Registered regions give
// memory its kind (host or device); strict mode accepts registered memory only.
class InProcessSpace final : public AddressSpace {
 public:
  InProcessSpace(Controller::Impl* ctl, bool strict) : ctl_(ctl), strict_(strict) {}
  nvme::Status map_data(const nvme::Sqe& sqe, size_t len, bool for_write,
                        DataSegments& out) override;
  nvme::Status map_range(uint64_t addr, size_t len, bool for_write, DataSegments& out) override;

 private:
  Controller::Impl* ctl_;
  bool strict_;
};

class QueuePoller final : public Poller {
 public:
  QueuePoller(Controller::Impl* ctl, const QueueOptions& options, uint16_t qid, uint32_t* wake);
  ~QueuePoller() override;
  bool poll() override;
  const QueueRef& ref() const { return ref_; }

 private:
  static constexpr uint32_t kMaxBatch =
      64;  // SQEs fetched per poll, so one queue can't starve others
  struct Pending {
    uint16_t cid;
    nvme::Status status;
    uint32_t dw0;
  };
  static void on_complete(Command* cmd, nvme::Status status, uint32_t dw0);
  bool post(uint16_t cid, nvme::Status status, uint32_t dw0);
  bool flush_overflow();

  Controller::Impl* ctl_;
  InProcessSpace space_;
  void* block_ = nullptr;
  QueueRef ref_;
  uint32_t fetched_ = 0;  // SQEs taken (counter)
  uint32_t posted_ = 0;   // CQEs written (counter)
  std::unique_ptr<Command[]> commands_;
  uint32_t command_count_ = 0;
  std::vector<Command*> free_;
  std::deque<Pending> overflow_;  // completions waiting for room in the CQ
};

}  // namespace gdkv
