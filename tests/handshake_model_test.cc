// The reactor's sleep handshake (src/controller/reactor.cc, Reactor::run and Reactor::post) and
// the requester's doorbell (include/gdkv/queue.h, publish) checked by exhaustive model checking.
//
// The handshake is a store-buffering (Dekker) pattern: the reactor announces its sleep (stores the
// wake word) and then looks for work once more (loads the SQ tail); a requester publishes work
// (stores the tail) and then looks for a sleeper (loads the wake word). A wake-up is lost when
// both loads miss the other's store: the reactor sleeps (until the futex timeout) with work
// queued. Hardware that lets a load pass an earlier store to another address allows exactly that
// unless a full fence separates them: x86 for plain stores, AArch64 for a release store followed
// by an RCpc acquire load (LDAPR), and C++ for any store and load that are not both seq_cst.
//
// The model: each thread's stores go into its own FIFO store buffer and reach memory later, in
// order, at any point (TSO plus what C++ allows for non-seq_cst pairs); a load reads the thread's
// youngest buffered store to that variable, else memory; a fence waits for the thread's buffer to
// drain; a seq_cst load waits for the thread's buffered seq_cst stores (the seq_cst total order).
// Every interleaving of instructions and buffer drains is explored. ThreadSanitizer cannot check
// this (it does not model fences, and a lost wake-up is not a data race).
//
// The wake-ups of remote clients (docs/vfio-user.md "Wake-ups") are the same pattern
// twice over shared memory: the reactor announces its sleep in the connection's doorbell page as
// well (NvmeController::announce_sleep) before its fence and last look, and the client looks at
// that word after ringing (queue::publish); and, the other way, a waiting client arms its CQ
// (IrqWaiter::block) and looks at the CQ once more while gdkvd posts a CQE and then looks at the
// arm word (NvmeController::signal_irqs).
#include <gtest/gtest.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <set>
#include <string>
#include <vector>

namespace {

enum class Ord { kRelaxed, kAcquire, kRelease, kSeqCst };
// kWake: the reactor's in-process sleep word; kTail: work (SQ tail doorbell, inbox flag);
// kSleeping: the sleeping word in a connection's doorbell page; kCqe: a posted CQE's status;
// kArm: a CQ's arm word.
enum Var : int { kWake, kTail, kSleeping, kCqe, kArm, kVars };

struct Op {
  enum Kind { kStore, kLoad, kFence } kind;
  Var var = kWake;
  int value = 0;  // kStore
  Ord ord = Ord::kRelaxed;
};
Op store(Var v, int value, Ord o) { return {Op::kStore, v, value, o}; }
Op load(Var v, Ord o) { return {Op::kLoad, v, 0, o}; }
Op fence() { return {Op::kFence}; }

struct Buffered {
  Var var;
  int value;
  bool seq_cst;
};
struct Thread {
  size_t pc = 0;
  std::deque<Buffered> buffer;
  std::vector<int> loaded;  // what each load returned, in order
};
struct State {
  int mem[kVars] = {};
  Thread t[2];
};

using Program = std::vector<Op>;

// Every final state's loaded values, over all executions of the two programs.
std::set<std::pair<std::vector<int>, std::vector<int>>> outcomes(const Program& a,
                                                                 const Program& b) {
  const Program* prog[2] = {&a, &b};
  std::set<std::pair<std::vector<int>, std::vector<int>>> out;
  std::function<void(const State&)> explore = [&](const State& s) {
    bool done = true;
    for (int i = 0; i < 2; ++i) {
      const Thread& th = s.t[i];
      // A buffered store reaches memory.
      if (!th.buffer.empty()) {
        done = false;
        State n = s;
        const Buffered b = n.t[i].buffer.front();
        n.t[i].buffer.pop_front();
        n.mem[b.var] = b.value;
        explore(n);
      }
      if (th.pc == prog[i]->size()) continue;
      done = false;
      const Op& op = (*prog[i])[th.pc];
      State n = s;
      Thread& nt = n.t[i];
      switch (op.kind) {
        case Op::kStore:
          nt.buffer.push_back({op.var, op.value, op.ord == Ord::kSeqCst});
          break;
        case Op::kFence:
          if (!th.buffer.empty()) continue;  // waits for the drain steps above
          break;
        case Op::kLoad: {
          if (op.ord == Ord::kSeqCst) {
            bool sc_pending = false;
            for (const Buffered& b : th.buffer) sc_pending |= b.seq_cst;
            if (sc_pending) continue;
          }
          int v = n.mem[op.var];
          for (const Buffered& b : th.buffer) {
            if (b.var == op.var) v = b.value;
          }
          nt.loaded.push_back(v);
          break;
        }
      }
      ++nt.pc;
      explore(n);
    }
    if (done) out.insert({s.t[0].loaded, s.t[1].loaded});
  };
  explore(State{});
  return out;
}

// The reactor's last look before sleeping (Reactor::run): announce, then poll the tail.
Program reactor(bool with_fence) {
  Program p{store(kWake, 1, Ord::kSeqCst)};
  if (with_fence) p.push_back(fence());
  p.push_back(load(kTail, Ord::kAcquire));  // atomic::load of db->sq_tail in QueuePoller::poll
  return p;
}

// A requester ringing the doorbell (publish): store the tail, fence, look for a sleeper.
Program requester(bool with_fence) {
  Program p{store(kTail, 1, Ord::kRelease)};
  if (with_fence) p.push_back(fence());
  p.push_back(load(kWake, Ord::kAcquire));
  return p;
}

// Reactor::post, a backend completion from another thread: publish the inbox, then look for a
// sleeper with a seq_cst load. The reactor polls the inbox flag with an acquire load.
Program poster(bool with_fence) {
  Program p{store(kTail, 1, Ord::kRelease)};  // inbox_nonempty_ (kTail stands for "work")
  if (with_fence) p.push_back(fence());
  p.push_back(load(kWake, Ord::kSeqCst));
  return p;
}

// The reactor's last look with remote clients on it: both sleep words, then the fence.
Program reactor_remote(bool with_fence) {
  Program p{store(kWake, 1, Ord::kSeqCst), store(kSleeping, 1, Ord::kSeqCst)};
  if (with_fence) p.push_back(fence());
  p.push_back(load(kTail, Ord::kAcquire));  // load_db of the SQ tail in NvmeController::fetch_io
  return p;
}

// A remote client ringing: queue::publish's doorbell store and fence, then the sleeping word
// (QueueRef::wake points at it; wake_reactor signals the ioeventfd).
Program remote_requester(bool with_fence) {
  Program p{store(kTail, 1, Ord::kRelease)};
  if (with_fence) p.push_back(fence());
  p.push_back(load(kSleeping, Ord::kAcquire));
  return p;
}

// gdkvd completing: the CQE's status (release), a fence, then the arm word (signal_irqs).
Program completer(bool with_fence) {
  Program p{store(kCqe, 1, Ord::kRelease)};
  if (with_fence) p.push_back(fence());
  p.push_back(load(kArm, Ord::kSeqCst));
  return p;
}

// The sleeping waiter: arm, a fence, then the CQE's phase (queue::poll's acquire load).
Program waiter(bool with_fence) {
  Program p{store(kArm, 1, Ord::kSeqCst)};
  if (with_fence) p.push_back(fence());
  p.push_back(load(kCqe, Ord::kAcquire));
  return p;
}

bool lost_wakeup(const Program& r, const Program& q) {
  for (const auto& [rl, ql] : outcomes(r, q)) {
    if (rl.back() == 0 && ql.back() == 0) return true;  // no work seen, no sleeper seen
  }
  return false;
}

TEST(HandshakeModel, TheCheckerFindsStoreBuffering) {
  // Plain store buffering: both loads can miss both stores; with fences on both sides they can't.
  const Program a{store(kWake, 1, Ord::kRelaxed), load(kTail, Ord::kRelaxed)};
  const Program b{store(kTail, 1, Ord::kRelaxed), load(kWake, Ord::kRelaxed)};
  EXPECT_TRUE(lost_wakeup(a, b));
  const Program af{store(kWake, 1, Ord::kRelaxed), fence(), load(kTail, Ord::kRelaxed)};
  const Program bf{store(kTail, 1, Ord::kRelaxed), fence(), load(kWake, Ord::kRelaxed)};
  EXPECT_FALSE(lost_wakeup(af, bf));
  // seq_cst on all four accesses is enough too (the seq_cst total order).
  const Program as{store(kWake, 1, Ord::kSeqCst), load(kTail, Ord::kSeqCst)};
  const Program bs{store(kTail, 1, Ord::kSeqCst), load(kWake, Ord::kSeqCst)};
  EXPECT_FALSE(lost_wakeup(as, bs));
  // Every outcome of a program with no shared variable conflict is found: 4 of them.
  EXPECT_EQ(outcomes(a, b).size(), 4u);
}

// What the reactor did before: a seq_cst store of the wake word, then an acquire load of the tail.
// The requester fences, but the reactor's load may still pass its own store: a lost wake-up.
TEST(HandshakeModel, WithoutTheReactorsFenceAWakeUpCanBeLost) {
  EXPECT_TRUE(lost_wakeup(reactor(false), requester(true)));
  EXPECT_TRUE(lost_wakeup(reactor(false), poster(false)));
}

// The code now: a fence after announcing the sleep, and one in post() before it looks for a
// sleeper (publish() had its fence already).
TEST(HandshakeModel, WithBothFencesNoWakeUpIsLost) {
  EXPECT_FALSE(lost_wakeup(reactor(true), requester(true)));
  EXPECT_FALSE(lost_wakeup(reactor(true), poster(true)));
  // Either fence alone is not enough.
  EXPECT_TRUE(lost_wakeup(reactor(true), requester(false)));
  EXPECT_TRUE(lost_wakeup(reactor(true), poster(false)));
}

// A remote client's doorbell against a sleeping reactor: with the reactor's fence after both sleep
// words and publish()'s fence, the client sees the word (and signals the ioeventfd) or the reactor
// sees the tail; without either fence the reactor can sleep through the doorbell.
TEST(HandshakeModel, RemoteDoorbellWakeUpIsNeverLost) {
  EXPECT_FALSE(lost_wakeup(reactor_remote(true), remote_requester(true)));
  EXPECT_TRUE(lost_wakeup(reactor_remote(false), remote_requester(true)));
  EXPECT_TRUE(lost_wakeup(reactor_remote(true), remote_requester(false)));
  // An in-process requester on the same reactor still wakes it through its own word.
  EXPECT_FALSE(lost_wakeup(reactor_remote(true), requester(true)));
}

// A completion against a client about to block: with both fences the client sees the CQE or
// gdkvd sees the arm word (and signals the CQ's eventfd); either fence alone is not enough.
TEST(HandshakeModel, CompletionInterruptIsNeverLost) {
  EXPECT_FALSE(lost_wakeup(waiter(true), completer(true)));
  EXPECT_TRUE(lost_wakeup(waiter(false), completer(true)));
  EXPECT_TRUE(lost_wakeup(waiter(true), completer(false)));
}

}  // namespace
