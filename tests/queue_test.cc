// The queue-pair protocol under many concurrent producers, against the real controller.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "gdkv/client.h"
#include "gdkv/commands.h"
#include "gdkv/queue.h"

namespace gdkv {
namespace {

// Answers every Retrieve with success and a "value length" that encodes the key, and counts how
// many times it saw each key: so a lost, duplicated or misrouted command shows.
class EchoBackend final : public Backend {
 public:
  explicit EchoBackend(size_t n) : seen_(n) {}
  void submit(BackendOp* op) override {
    uint32_t id;
    std::memcpy(&id, op->key.bytes, 4);
    if (id < seen_.size()) seen_[id].fetch_add(1, std::memory_order_relaxed);
    op->complete(nvme::Status::kSuccess, id ^ 0x5A5A5A5Au);
  }
  BackendInfo info() const override { return {"echo"}; }
  std::vector<std::atomic<uint32_t>> seen_;
};

TEST(Queue, ManyProducersEveryCommandCompletesExactlyOnce) {
  constexpr uint32_t kThreads = 8;
  constexpr uint32_t kPerThread = 100000;
  auto echo = std::make_shared<EchoBackend>(kThreads * kPerThread);
  ClientOptions o;
  o.queue.depth = 64;
  auto client = Client::open(echo, o).value();
  std::atomic<uint64_t> wrong{0};
  std::vector<std::thread> ts;
  for (uint32_t t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      // Each thread keeps a few commands in flight, so completions interleave across threads.
      constexpr int kWindow = 4;
      uint16_t cids[kWindow];
      uint32_t ids[kWindow];
      int n = 0;
      for (uint32_t i = 0; i < kPerThread; ++i) {
        const uint32_t id = t * kPerThread + i;
        uint8_t key[4];
        std::memcpy(key, &id, 4);
        cids[n] = client->start(cmd::retrieve(key, 4, nullptr, 0)).value();
        ids[n++] = id;
        if (n == kWindow) {
          for (int j = 0; j < kWindow; ++j) {
            CmdResult r = client->wait(cids[j]);
            if (!r.ok() || r.dw0 != (ids[j] ^ 0x5A5A5A5Au)) wrong.fetch_add(1);
          }
          n = 0;
        }
      }
      for (int j = 0; j < n; ++j) {
        CmdResult r = client->wait(cids[j]);
        if (!r.ok() || r.dw0 != (ids[j] ^ 0x5A5A5A5Au)) wrong.fetch_add(1);
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(wrong.load(), 0u) << "completions reached the wrong submitter";
  uint64_t missing = 0, duplicated = 0;
  for (auto& s : echo->seen_) {
    const uint32_t c = s.load();
    if (c == 0) ++missing;
    if (c > 1) ++duplicated;
  }
  EXPECT_EQ(missing, 0u);
  EXPECT_EQ(duplicated, 0u);
  // Every credit came back.
  const QueueRef& q = client->queue();
  EXPECT_EQ(q.ctl->credits_taken, q.ctl->credits_returned);
  EXPECT_EQ(q.ctl->credits_taken, kThreads * kPerThread);
}

// The requester side alone, with a hand-rolled controller loop: back-pressure at depth-1 and phase
// tags across many wrap-arounds of the completion ring.
// A queue pair that cannot be made is an Error naming the reason, not an exception; the
// controller then still serves the queues it has.
TEST(Queue, ABadDepthIsAnErrorNotAnException) {
  Controller ctl(make_memory_backend());
  for (uint32_t depth : {0u, 1u, 3u, 100u, 8192u}) {
    SCOPED_TRACE(depth);
    Result<QueueRef> q = ctl.create_queue({depth, false});
    ASSERT_FALSE(q);
    EXPECT_NE(q.error().find("power of two in [2, 4096]"), std::string::npos) << q.error();
  }
  ClientOptions o;
  o.queue.depth = 5;
  Result<std::unique_ptr<Client>> bad = Client::open(make_memory_backend(), o);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().find("not 5"), std::string::npos) << bad.error();
  EXPECT_FALSE(Client::open(nullptr));
  // The good path still works on the same controller.
  Client c(ctl.create_queue({16, false}).value(), nullptr, &ctl);
  const std::byte v[8] = {};
  EXPECT_EQ(c.put(*Key::from_string("k"), v).status, nvme::Status::kSuccess);
}

TEST(Queue, BackPressureAndPhaseTagsAcrossWraps) {
  constexpr uint32_t kDepth = 8;
  const size_t bytes = QueueLayout::for_depth(kDepth).total;
  auto mem = std::unique_ptr<std::byte[]>(new std::byte[bytes]());
  QueueRef q = QueueRef::over(mem.get(), kDepth, 1);
  uint32_t fetched = 0, posted = 0;
  auto serve = [&] {
    while (q.db->sq_tail != fetched) {
      nvme::Sqe s = q.sq[fetched % kDepth];
      ++fetched;
      nvme::Cqe* e = &q.cq[posted % kDepth];
      e->dw0 = s.cdw10 + 1;
      e->cid = s.cid;
      e->status = static_cast<uint16_t>(((posted / kDepth) & 1) ? 0 : 1);
      ++posted;
    }
  };
  uint16_t cid;
  for (uint32_t round = 0; round < 1000; ++round) {
    std::vector<uint16_t> cids;
    while (queue::try_acquire(q, &cid)) cids.push_back(cid);
    ASSERT_EQ(cids.size(), kDepth - 1) << "credits are depth-1";
    for (size_t i = 0; i < cids.size(); ++i) {
      nvme::Sqe s{};
      s.cid = cids[i];
      s.cdw10 = round * 100 + static_cast<uint32_t>(i);
      queue::submit(q, &s, 1);
    }
    serve();
    for (size_t i = 0; i < cids.size(); ++i) {
      ASSERT_TRUE(queue::poll(q, cids[i]));
      CmdResult r = queue::wait(q, cids[i]);
      ASSERT_EQ(r.dw0, round * 100 + i + 1) << "round " << round;
    }
  }
  EXPECT_EQ(posted, 1000u * (kDepth - 1));
  EXPECT_EQ(q.ctl->cq_head, posted);
}

// Requesters spin on their own slot's `done`: no two command ids may share a cache line.
TEST(Queue, CommandSlotsHaveTheirOwnCacheLine) {
  static_assert(sizeof(CmdSlot) == 64 && alignof(CmdSlot) == 64);
  for (uint32_t d = 2; d <= 4096; d *= 2) {
    const QueueLayout l = QueueLayout::for_depth(d);
    EXPECT_EQ(l.slots % 64, 0u);
    EXPECT_GE(l.control, l.slots + 64 * size_t{d}) << "depth " << d;
  }
  constexpr uint32_t kDepth = 16;
  const size_t bytes = QueueLayout::for_depth(kDepth).total;
  auto* mem = static_cast<std::byte*>(std::aligned_alloc(4096, (bytes + 4095) & ~size_t{4095}));
  ASSERT_NE(mem, nullptr);
  const QueueRef q = QueueRef::over(mem, kDepth, 1);
  for (uint32_t i = 0; i + 1 < kDepth; ++i) {
    const auto a = reinterpret_cast<uintptr_t>(&q.slots[i].done);
    const auto b = reinterpret_cast<uintptr_t>(&q.slots[i + 1].done);
    EXPECT_EQ(b - a, 64u);
    EXPECT_EQ(a / 64, reinterpret_cast<uintptr_t>(&q.slots[i].reserved1) / 64);
  }
  std::free(mem);
}

TEST(Queue, LayoutIsAlignedAndDisjoint) {
  for (uint32_t d = 2; d <= 4096; d *= 2) {
    QueueLayout l = QueueLayout::for_depth(d);
    EXPECT_EQ(l.sq % 64, 0u);
    EXPECT_EQ(l.cq, l.sq + ((64 * d + 63) & ~63ull));
    EXPECT_GT(l.total, l.doorbells);
    EXPECT_TRUE(valid_queue_depth(d));
  }
  EXPECT_FALSE(valid_queue_depth(0));
  EXPECT_FALSE(valid_queue_depth(3));
  EXPECT_FALSE(valid_queue_depth(8192));
}

}  // namespace
}  // namespace gdkv
