// The four experts the policies of policy.cc are made of (LRU, LRU-K, ARC, S3-FIFO), each its own
// type, as CacheLib's MM types (MMLru, MM2Q, ...) each own their container and hook into a shared
// item. An expert holds its lists, maps, byte counts and options; a key's node (policy.cc's
// NodeT) inherits each expert's Part, the expert's state in the node. Every expert has the same
// operations, which the engine calls for all its experts in their order:
//   prepare_insert(find, size, kind)   a miss of `size` bytes will be added (before the evictions
//                                      for it); find() returns the key's node or null (only ARC
//                                      looks: a ghost hit moves its target)
//   add(n, size, now, kind, release)   n becomes resident with `size` bytes: the expert takes it
//                                      out of its history or ghost list at n's old size (n->size
//                                      takes `size` after every expert's add), then links it
//   access(n, size, now)               a hit of resident n, now `size` bytes; n->size is still the
//                                      old size (it takes the new one after every expert's access)
//   remove(n)                          resident n is forgotten (deleted): no history
//   victim()                           the resident node this expert evicts next
//   to_history(n)                      resident n is evicted: into the history or ghost list
//   remembers(n)                       whether non-resident n is still in the history or ghost
//                                      list (the engine frees a node no expert remembers)
//   trim(resident, release)            drops history or ghost entries past their bounds (resident:
//                                      the engine's resident entries), release(x) for each
//   collect(w)                         the expert's gauges
// release(x) is the engine's: it frees x unless it is resident or some expert remembers it.
// Private to policy.cc.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>

#include "cache/policy.h"
#include "gdkv/metrics.h"

namespace gdkv::cache::experts {

// kPrefix is the prefix policy (prefix_policy.cc), an expert of the adaptive policy only: a whole
// policy object it keeps in step with the cache, not a part of the node.
enum Expert : uint8_t { kArc, kLruK, kLru, kS3, kPrefix, kExperts };
inline constexpr const char* kExpertNames[kExperts] = {"arc", "lru-k", "lru", "s3-fifo", "prefix"};

template <class N>
struct Link {
  N* prev = nullptr;
  N* next = nullptr;
};

// An intrusive list of nodes N through the link L of their part P (a base of N); front = the
// first pushed (least recently used).
template <class N, class P, Link<N> P::*L>
class List {
 public:
  bool empty() const { return head_ == nullptr; }
  N* front() const { return head_; }
  size_t size() const { return n_; }
  void push_back(N* x) {
    link(x).prev = tail_;
    link(x).next = nullptr;
    if (tail_ != nullptr) {
      link(tail_).next = x;
    } else {
      head_ = x;
    }
    tail_ = x;
    ++n_;
  }
  void erase(N* x) {
    Link<N>& l = link(x);
    if (l.prev != nullptr) {
      link(l.prev).next = l.next;
    } else {
      head_ = l.next;
    }
    if (l.next != nullptr) {
      link(l.next).prev = l.prev;
    } else {
      tail_ = l.prev;
    }
    l.prev = l.next = nullptr;
    --n_;
  }
  void move_to_back(N* x) {
    if (tail_ == x) return;
    erase(x);
    push_back(x);
  }

 private:
  static Link<N>& link(N* x) { return static_cast<P&>(*x).*L; }

  N* head_ = nullptr;
  N* tail_ = nullptr;
  size_t n_ = 0;
};

// ---- LRU ----

template <class N>
struct LruPart {
  Link<N> lru;
};

// Least recently used first; no history.
template <class N>
class LruExpert {
 public:
  using Part = LruPart<N>;
  static constexpr Expert kId = kLru;

  explicit LruExpert(const PolicyOptions&) {}

  template <class Find>
  void prepare_insert(Find&&, uint64_t, AddKind) {}
  template <class Release>
  void add(N* n, uint64_t, uint64_t, AddKind, Release&&) {
    list_.push_back(n);
  }
  void access(N* n, uint64_t, uint64_t) { list_.move_to_back(n); }
  void remove(N* n) { list_.erase(n); }
  N* victim() const { return list_.front(); }
  void to_history(N* n) { list_.erase(n); }
  bool remembers(const N&) const { return false; }
  template <class Release>
  void trim(size_t, Release&&) {}
  void collect(MetricWriter&) const {}

 private:
  List<N, Part, &Part::lru> list_;
};

// ---- LRU-K ----
//
// O'Neil, O'Neil and Weikum's LRU-K. Each key keeps the times of its last K bursts (a burst is a
// reference more than the correlated window after the previous reference; later references of the
// same burst move the burst's time forward instead of counting again). The victim is the entry
// whose K-th most recent burst is oldest. Entries with fewer than K bursts have an infinite
// backward K-distance and go first; among them the tie rule is the oldest retained burst first
// (for K = 2: the entry first referenced longest ago), and an entry a prefetch added without any
// reference is ordered by the time it was added. Evicted keys keep their burst times in a bounded
// history (oldest evicted forgotten first), so a key that returns resumes its count.

struct Refs {
  std::array<uint64_t, kMaxK> hist{};  // hist[0]: most recent burst
  uint64_t last = 0;                   // most recent reference of any kind
  uint64_t added = 0;                  // when a prefetch added it (count == 0 only)
  uint8_t count = 0;                   // bursts remembered, <= K
  bool has_last = false;
};

struct Order {
  uint64_t prio;
  uint64_t id;  // unique: settles equal priorities (a caller repeating a tick) by age
  friend bool operator<(const Order& a, const Order& b) noexcept {
    return a.prio != b.prio ? a.prio < b.prio : a.id < b.id;
  }
};

enum KState : uint8_t { kKNone, kKResident, kKHistory };

// A node's LRU-K state, while resident or remembered.
template <class N>
struct LruKPart {
  Refs refs;
  KState k = kKNone;
  uint64_t k_id = 0;
  typename std::map<Order, N*>::iterator k_pos;  // in the order, while resident
  Link<N> k_fifo;                                // in the history, while remembered
};

template <class N>
class LruKExpert {
 public:
  using Part = LruKPart<N>;
  static constexpr Expert kId = kLruK;

  explicit LruKExpert(const PolicyOptions& o)
      : k_(o.k), window_(o.correlated_window), history_entries_(o.history_entries) {}

  template <class Find>
  void prepare_insert(Find&&, uint64_t, AddKind) {}

  template <class Release>
  void add(N* n, uint64_t, uint64_t now, AddKind kind, Release&&) {
    if (n->k == kKHistory) {
      fifo_.erase(n);  // a returning key resumes its count
    } else {
      n->refs = Refs{};
    }
    if (kind == AddKind::kDemand) {
      reference(n->refs, now);
    } else if (n->refs.count == 0) {
      n->refs.added = now;
    }
    n->k = kKResident;
    n->k_id = next_id_++;
    n->k_pos = order_.emplace(Order{priority(n->refs), n->k_id}, n).first;
  }

  void access(N* n, uint64_t, uint64_t now) {
    auto handle = order_.extract(n->k_pos);
    reference(n->refs, now);
    handle.key() = Order{priority(n->refs), n->k_id};
    n->k_pos = order_.insert(std::move(handle)).position;
  }

  void remove(N* n) {
    order_.erase(n->k_pos);
    n->k = kKNone;
  }

  N* victim() const { return order_.begin()->second; }

  void to_history(N* n) {
    order_.erase(n->k_pos);
    n->k = kKHistory;
    fifo_.push_back(n);
  }

  bool remembers(const N& n) const { return n.k == kKHistory; }

  // The history holds history_entries keys, or as many as are resident if that is 0.
  template <class Release>
  void trim(size_t resident, Release&& release) {
    const uint64_t cap = history_entries_ != 0 ? history_entries_ : std::max<uint64_t>(resident, 1);
    while (fifo_.size() > cap) {
      N* old = fifo_.front();
      fifo_.erase(old);
      old->k = kKNone;
      release(old);
    }
  }

  void collect(MetricWriter& w) const {
    w.gauge("cache_lruk_history_entries", "LRU-K: evicted keys whose reference times it keeps",
            static_cast<double>(fifo_.size()));
  }

 private:
  void reference(Refs& r, uint64_t now) const {
    if (r.has_last && r.count > 0 && now - r.last <= window_) {
      r.hist[0] = now;  // the same burst: it counts once, at its latest time
    } else {
      for (uint32_t i = k_ - 1; i > 0; --i) r.hist[i] = r.hist[i - 1];
      r.hist[0] = now;
      if (r.count < k_) ++r.count;
    }
    r.last = now;
    r.has_last = true;
  }

  // Entries with fewer than K bursts sort before every entry with K (the top bit).
  uint64_t priority(const Refs& r) const {
    constexpr uint64_t kFull = uint64_t{1} << 63;
    if (r.count >= k_) return kFull | (r.hist[k_ - 1] & ~kFull);
    return (r.count == 0 ? r.added : r.hist[r.count - 1]) & ~kFull;
  }

  const uint32_t k_;
  const uint64_t window_;
  const uint64_t history_entries_;     // 0: as many as are resident
  std::map<Order, N*> order_;          // first = its next victim
  List<N, Part, &Part::k_fifo> fifo_;  // history, oldest evicted first
  uint64_t next_id_ = 0;
};

// ---- ARC ----
//
// ARC (Megiddo and Modha) in bytes. T1 holds keys referenced once recently, T2 keys referenced
// again (recency vs frequency); B1 and B2 remember keys recently evicted from each. A miss on a
// key in B1 means T1 was too small, so T1's target p grows; a miss on a key in B2 shrinks it.
// REPLACE evicts from T1 while it is over its target, else from T2. The ghost lists are bounded so
// that T1 + B1 <= c and all four <= 2c. Two additions: a prefetched key enters T1 unreferenced and
// its first use keeps it in T1 (a prefetch is not a first reference), and a second reference
// within the correlated window is the same burst, so it keeps the key in T1 too.

enum ArcList : uint8_t { kT1, kT2, kB1, kB2, kArcNone };

// A node's ARC state.
template <class N>
struct ArcPart {
  ArcList arc = kArcNone;
  bool arc_prefetched = false;
  bool arc_has_last = false;
  uint64_t arc_last = 0;
  Link<N> arc_link;
};

template <class N>
class ArcExpert {
 public:
  using Part = ArcPart<N>;
  static constexpr Expert kId = kArc;

  explicit ArcExpert(const PolicyOptions& o) : window_(o.correlated_window), c_(o.capacity_bytes) {}

  // A demand miss of a key in B1 grows T1's target, one in B2 shrinks it.
  template <class Find>
  void prepare_insert(Find&& find, uint64_t size, AddKind kind) {
    pending_b2_ = false;
    if (kind != AddKind::kDemand) return;
    const N* n = find();
    if (n == nullptr) return;
    if (n->arc == kB1) {
      const uint64_t delta = arc_delta(size, bytes_[kB2], bytes_[kB1]);
      p_ = c_ - p_ < delta ? c_ : p_ + delta;
    } else if (n->arc == kB2) {
      const uint64_t delta = arc_delta(size, bytes_[kB1], bytes_[kB2]);
      p_ = p_ > delta ? p_ - delta : 0;
      pending_b2_ = true;
    }
  }

  template <class Release>
  void add(N* n, uint64_t size, uint64_t now, AddKind kind, Release&& release) {
    // A ghost leaves its list at its old size. A ghost's demand miss returns it to the frequency
    // side, as in ARC; a prefetch does not count as that second reference.
    const bool ghost = n->arc == kB1 || n->arc == kB2;
    if (ghost) unlink(n);
    const ArcList to = ghost && kind == AddKind::kDemand ? kT2 : kT1;
    n->arc_prefetched = kind == AddKind::kPrefetch;
    n->arc_has_last = kind == AddKind::kDemand;
    n->arc_last = now;
    link(n, to, size);
    trim_ghosts(release);
    pending_b2_ = false;
  }

  void access(N* n, uint64_t size, uint64_t now) {
    ArcList to = kT2;
    if (n->arc == kT1 && (n->arc_prefetched || (n->arc_has_last && now - n->arc_last <= window_))) {
      to = kT1;
    }
    unlink(n);  // at its old size
    n->arc_prefetched = false;
    n->arc_has_last = true;
    n->arc_last = now;
    link(n, to, size);
  }

  void remove(N* n) { unlink(n); }

  // REPLACE: T1's least recent entry while T1 is over its target (or at it, after a B2 hit).
  N* victim() const {
    const bool t1 = !lists_[kT1].empty() &&
                    (lists_[kT2].empty() || bytes_[kT1] > p_ || (pending_b2_ && bytes_[kT1] >= p_));
    return (t1 ? lists_[kT1] : lists_[kT2]).front();
  }

  void to_history(N* n) {
    const ArcList ghost = n->arc == kT1 ? kB1 : kB2;
    unlink(n);
    n->arc_prefetched = false;
    link(n, ghost, n->size);
  }

  bool remembers(const N& n) const { return n.arc != kArcNone; }

  template <class Release>
  void trim(size_t, Release&& release) {
    trim_ghosts(release);
  }

  void collect(MetricWriter& w) const {
    w.gauge("cache_arc_recency_target_bytes", "ARC: bytes it aims to give entries used once (p)",
            static_cast<double>(p_));
    w.gauge("cache_arc_recency_bytes", "ARC: bytes of entries referenced once",
            static_cast<double>(bytes_[kT1]));
    w.gauge("cache_arc_frequency_bytes", "ARC: bytes of entries referenced more than once",
            static_cast<double>(bytes_[kT2]));
    w.gauge("cache_arc_ghost_bytes", "ARC: bytes of evicted keys remembered",
            static_cast<double>(bytes_[kB1] + bytes_[kB2]));
  }

 private:
  void link(N* n, ArcList to, uint64_t size) {
    lists_[to].push_back(n);
    n->arc = to;
    bytes_[to] += size;
  }
  void unlink(N* n) {
    lists_[n->arc].erase(n);
    bytes_[n->arc] -= n->size;
    n->arc = kArcNone;
  }

  // ARC's adaptation step for a ghost hit of `size` bytes in the list holding `hit_bytes`:
  // size × max(1, other_bytes / hit_bytes), in [1, c]. A ghost list of zero-length keys only has 0
  // bytes: the ratio is then taken as 1 (no division by zero, no infinity cast to an integer).
  uint64_t arc_delta(uint64_t size, uint64_t other_bytes, uint64_t hit_bytes) const {
    const double s = static_cast<double>(std::max<uint64_t>(size, 1));
    const double ratio =
        hit_bytes == 0 ? 1.0 : static_cast<double>(other_bytes) / static_cast<double>(hit_bytes);
    const double delta = s * std::max(1.0, ratio);
    const double cap = static_cast<double>(std::max<uint64_t>(c_, 1));
    return delta >= cap ? std::max<uint64_t>(c_, 1) : static_cast<uint64_t>(delta);
  }

  template <class Release>
  void drop_lru(ArcList l, Release&& release) {
    N* n = lists_[l].front();
    unlink(n);
    release(n);
  }

  template <class Release>
  void trim_ghosts(Release&& release) {
    while (!lists_[kB1].empty() && bytes_[kT1] + bytes_[kB1] > c_) drop_lru(kB1, release);
    auto total = [&] { return bytes_[kT1] + bytes_[kT2] + bytes_[kB1] + bytes_[kB2]; };
    while (!lists_[kB2].empty() && total() > 2 * c_) drop_lru(kB2, release);
    while (!lists_[kB1].empty() && total() > 2 * c_) drop_lru(kB1, release);
  }

  const uint64_t window_;
  const uint64_t c_;
  std::array<List<N, Part, &Part::arc_link>, 4> lists_;  // by ArcList
  std::array<uint64_t, 4> bytes_{};
  uint64_t p_ = 0;  // target bytes of T1
  bool pending_b2_ = false;
};

// ---- S3-FIFO ----
//
// S3-FIFO (Yang et al., SOSP 2023) in bytes: new keys enter a small FIFO S (a tenth of the
// capacity); a key evicted from S that was hit while there moves to the main FIFO M, one that was
// not leaves and is remembered in a ghost FIFO G. A missed key found in G enters M directly. M is
// a FIFO with a second chance: each hit raises a key's count (at most 3), and a key at M's tail
// with a count is put back at M's head with one less. G remembers at most M's share of the
// capacity in bytes. A prefetched key's first use is its first reference, not a hit.

enum S3Queue : uint8_t { kS3None, kS3Small, kS3Main, kS3Ghost };

// A node's S3-FIFO state.
template <class N>
struct S3Part {
  S3Queue s3 = kS3None;
  uint8_t s3_freq = 0;
  bool s3_prefetched = false;
  Link<N> s3_link;
};

template <class N>
class S3FifoExpert {
 public:
  using Part = S3Part<N>;
  static constexpr Expert kId = kS3;

  explicit S3FifoExpert(const PolicyOptions& o) : c_(o.capacity_bytes) {}

  template <class Find>
  void prepare_insert(Find&&, uint64_t, AddKind) {}

  template <class Release>
  void add(N* n, uint64_t size, uint64_t, AddKind kind, Release&&) {
    const bool ghost = n->s3 == kS3Ghost;
    unlink(n);  // out of G, at its old size
    n->s3_freq = 0;
    n->s3_prefetched = kind == AddKind::kPrefetch;
    link(n, ghost && kind == AddKind::kDemand ? kS3Main : kS3Small, size);
  }

  void access(N* n, uint64_t size, uint64_t) {
    bytes_[n->s3] = bytes_[n->s3] - n->size + size;
    if (n->s3_prefetched) {
      n->s3_prefetched = false;
    } else if (n->s3_freq < 3) {
      ++n->s3_freq;
    }
  }

  void remove(N* n) { unlink(n); }

  // The entry S3-FIFO evicts next. Entries it passes over move (S to M, or back to M's head);
  // M's tail is always reached, as every pass lowers a count.
  N* victim() {
    for (;;) {
      auto& small = lists_[kS3Small];
      auto& main = lists_[kS3Main];
      if (!small.empty() && (bytes_[kS3Small] >= c_ / 10 || main.empty())) {
        N* t = small.front();
        if (t->s3_freq == 0) return t;  // not hit in S: it goes (to G)
        unlink(t);
        t->s3_freq = 0;
        link(t, kS3Main, t->size);
        continue;
      }
      N* t = main.front();
      if (t->s3_freq == 0) return t;
      --t->s3_freq;
      main.move_to_back(t);
    }
  }

  void to_history(N* n) {
    const bool small = n->s3 == kS3Small;
    unlink(n);
    if (small) link(n, kS3Ghost, n->size);
  }

  bool remembers(const N& n) const { return n.s3 != kS3None; }

  // G holds at most M's share of the capacity in bytes, and no more keys than are resident.
  template <class Release>
  void trim(size_t resident, Release&& release) {
    auto& ghost = lists_[kS3Ghost];
    while (!ghost.empty() &&
           (bytes_[kS3Ghost] > c_ - c_ / 10 || ghost.size() > std::max<size_t>(resident, 1))) {
      N* old = ghost.front();
      unlink(old);
      release(old);
    }
  }

  void collect(MetricWriter&) const {}

 private:
  void link(N* n, S3Queue to, uint64_t size) {
    lists_[to].push_back(n);
    n->s3 = to;
    bytes_[to] += size;
  }
  void unlink(N* n) {
    if (n->s3 == kS3None) return;
    lists_[n->s3].erase(n);
    bytes_[n->s3] -= n->size;
    n->s3 = kS3None;
  }

  const uint64_t c_;
  std::array<List<N, Part, &Part::s3_link>, 4> lists_;  // by S3Queue (kS3None unused)
  std::array<uint64_t, 4> bytes_{};
};

}  // namespace gdkv::cache::experts
