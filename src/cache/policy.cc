// LRU, LRU-K, ARC, S3-FIFO and the adaptive policy, as one engine template.
//
// Every policy is an Engine<experts> running some of four "experts" (LRU, LRU-K, ARC, S3-FIFO). A
// key has one node that carries each expert's state, so the adaptive policy, which keeps all in
// step, pays one hash lookup per reference rather than one per expert. The single-expert policies
// are the same code compiled with the other experts left out, node state included: an LRU node
// holds no LRU-K or ARC state (NodeT's parts are empty bases then).
#include <algorithm>
#include <array>
#include <bit>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "cache/policy.h"

namespace gdkv::cache {
namespace {

// kPrefix is the prefix policy (prefix_policy.cc), an expert of the adaptive policy only: a whole
// policy object it keeps in step with the cache, not a part of the node.
enum Expert : uint8_t { kArc, kLruK, kLru, kS3, kPrefix, kExperts };
constexpr const char* kExpertNames[kExperts] = {"arc", "lru-k", "lru", "s3-fifo", "prefix"};

constexpr uint32_t bit(Expert e) { return 1u << e; }
constexpr uint32_t kAllExperts = bit(kArc) | bit(kLruK) | bit(kLru) | bit(kS3) | bit(kPrefix);

template <class N>
struct LinkT {
  N* prev = nullptr;
  N* next = nullptr;
};
template <int I>
struct Empty {};

// ---- LRU-K state ----
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

// ---- ARC state ----
//
// ARC (Megiddo and Modha) in bytes. T1 holds keys referenced once recently, T2 keys referenced
// again (recency vs frequency); B1 and B2 remember keys recently evicted from each. A miss on a
// key in B1 means T1 was too small, so T1's target p grows; a miss on a key in B2 shrinks it.
// REPLACE evicts from T1 while it is over its target, else from T2. The ghost lists are bounded so
// that T1 + B1 <= c and all four <= 2c. Two additions: a prefetched key enters T1 unreferenced and
// its first use keeps it in T1 (a prefetch is not a first reference), and a second reference
// within the correlated window is the same burst, so it keeps the key in T1 too.

enum ArcList : uint8_t { kT1, kT2, kB1, kB2, kArcNone };

// ---- S3-FIFO state ----
//
// S3-FIFO (Yang et al., SOSP 2023) in bytes: new keys enter a small FIFO S (a tenth of the
// capacity); a key evicted from S that was hit while there moves to the main FIFO M, one that was
// not leaves and is remembered in a ghost FIFO G. A missed key found in G enters M directly. M is
// a FIFO with a second chance: each hit raises a key's count (at most 3), and a key at M's tail
// with a count is put back at M's head with one less. G remembers at most M's share of the
// capacity in bytes. A prefetched key's first use is its first reference, not a hit.

enum S3Queue : uint8_t { kS3None, kS3Small, kS3Main, kS3Ghost };

struct S3Part {
  S3Queue s3 = kS3None;
  uint8_t s3_freq = 0;
  bool s3_prefetched = false;
};

// A node's LRU-K state, while resident or remembered.
template <class N>
struct LruKPart {
  Refs refs;
  KState k = kKNone;
  uint64_t k_id = 0;
  typename std::map<Order, N*>::iterator k_pos;  // in the order, while resident
};
// A node's ARC state.
struct ArcPart {
  ArcList arc = kArcNone;
  bool arc_prefetched = false;
  bool arc_has_last = false;
  uint64_t arc_last = 0;
};

// A key's node in an Engine<M>: the parts of the experts in M (the others are empty bases).
template <uint32_t M>
struct NodeT : std::conditional_t<(M & bit(kLruK)) != 0, LruKPart<NodeT<M>>, Empty<0>>,
               std::conditional_t<(M & bit(kArc)) != 0, ArcPart, Empty<1>>,
               std::conditional_t<(M & bit(kS3)) != 0, S3Part, Empty<2>> {
  using Link = LinkT<NodeT>;
  NsKey key;
  uint64_t size = 0;
  bool resident = false;
  Link lru;
  Link k_fifo;  // LRU-K's history, while remembered
  Link arc_link;
  Link s3_link;
};

// An intrusive list through one of a node's links; front = least recently used.
template <class Node, LinkT<Node> Node::*L>
class List {
 public:
  using Link = LinkT<Node>;
  bool empty() const { return head_ == nullptr; }
  Node* front() const { return head_; }
  size_t size() const { return n_; }
  void push_back(Node* x) {
    (x->*L).prev = tail_;
    (x->*L).next = nullptr;
    if (tail_ != nullptr) {
      (tail_->*L).next = x;
    } else {
      head_ = x;
    }
    tail_ = x;
    ++n_;
  }
  void erase(Node* x) {
    Link& l = x->*L;
    if (l.prev != nullptr) {
      (l.prev->*L).next = l.next;
    } else {
      head_ = l.next;
    }
    if (l.next != nullptr) {
      (l.next->*L).prev = l.prev;
    } else {
      tail_ = l.prev;
    }
    l.prev = l.next = nullptr;
    --n_;
  }
  void move_to_back(Node* x) {
    if (tail_ == x) return;
    erase(x);
    push_back(x);
  }

 private:
  Node* head_ = nullptr;
  Node* tail_ = nullptr;
  size_t n_ = 0;
};

// A shadow cache over any policy (the adaptive policy's prefix expert): keys and sizes only, with
// the calls shadow_reference makes of a single-expert Engine.
class Shadow {
 public:
  using Entry = std::pair<const NsKey, uint64_t>;  // key, size
  explicit Shadow(std::unique_ptr<EvictionPolicy> p) : p_(std::move(p)) {}
  Entry* find_resident(const NsKey& key) {
    auto it = sizes_.find(key);
    return it == sizes_.end() ? nullptr : &*it;
  }
  void touch(Entry* e, uint64_t size, uint64_t now) {
    bytes_ = bytes_ - e->second + size;
    e->second = size;
    p_->record_access(e->first, size, now);
  }
  uint64_t resident_bytes() const { return bytes_; }
  bool evict(NsKey* victim) {
    if (!p_->evict(victim)) return false;
    auto it = sizes_.find(*victim);
    bytes_ -= it->second;
    sizes_.erase(it);
    return true;
  }
  void prepare_insert(const NsKey& key, uint64_t size, AddKind kind) {
    p_->prepare_insert(key, size, kind);
  }
  void add(const NsKey& key, uint64_t size, uint64_t now, AddKind kind) {
    p_->add(key, size, now, kind);
    sizes_[key] = size;
    bytes_ += size;
  }
  void remove(const NsKey& key) {
    auto it = sizes_.find(key);
    if (it == sizes_.end()) return;
    p_->remove(key);
    bytes_ -= it->second;
    sizes_.erase(it);
  }
  void record_chain(const NsKey& key, const NsKey& pred) { p_->record_chain(key, pred); }

 private:
  std::unique_ptr<EvictionPolicy> p_;
  std::unordered_map<NsKey, uint64_t, NsKeyHash> sizes_;
  uint64_t bytes_ = 0;
};

// M: a bit per Expert. Several experts: the adaptive policy, with shadow caches to score them.
template <uint32_t M>
class Engine final : public EvictionPolicy {
 public:
  using Node = NodeT<M>;
  static constexpr bool kAdaptive = std::popcount(M) > 1;
  static_assert(kAdaptive || (M & bit(kPrefix)) == 0, "the prefix policy alone is its own class");

  // `name`: what name() reports.
  Engine(const char* name, const PolicyOptions& o)
      : name_(name), options_(o), k_(o.k), window_(o.correlated_window), c_(o.capacity_bytes) {
    for (uint8_t e = 0; e < kExperts; ++e) {
      if (has(static_cast<Expert>(e)) && o.pin_expert == kExpertNames[e]) leader_ = e;
    }
    if (!has(static_cast<Expert>(leader_))) {
      for (uint8_t e = 0; e < kExperts; ++e) {
        if (has(static_cast<Expert>(e))) {
          leader_ = e;
          break;
        }
      }
    }
    if constexpr (kAdaptive) {
      prefix_ = make_prefix_policy(o);
      adaptive_ = o.pin_expert.empty();
      if (adaptive_) {
        leader_ = kPrefix;  // until the shadows know better: it is rarely far off on KV traffic
        reshard(ideal_shift(o.expected_entries));
      }
    }
  }

  const char* name() const override { return name_; }

  void prepare_insert(const NsKey& key, uint64_t size, AddKind kind) override {
    if constexpr (has(kPrefix)) prefix_->prepare_insert(key, size, kind);
    pending_b2_ = false;
    if constexpr (has(kArc)) {
      if (kind != AddKind::kDemand) return;
      auto it = nodes_.find(key);
      if (it == nodes_.end()) return;
      const Node& n = it->second;
      if (n.arc == kB1) {
        const uint64_t delta = arc_delta(size, bytes_[kB2], bytes_[kB1]);
        p_ = c_ - p_ < delta ? c_ : p_ + delta;
      } else if (n.arc == kB2) {
        const uint64_t delta = arc_delta(size, bytes_[kB1], bytes_[kB2]);
        p_ = p_ > delta ? p_ - delta : 0;
        pending_b2_ = true;
      }
    } else {
      (void)key, (void)size, (void)kind;
    }
  }

  void add(const NsKey& key, uint64_t size, uint64_t now, AddKind kind) override {
    auto [it, fresh] = nodes_.try_emplace(key);
    Node* n = &it->second;
    if (fresh) n->key = key;
    // An ARC ghost leaves its list at its old size, before the node takes the new one.
    bool arc_ghost = false;
    if constexpr (has(kArc)) {
      arc_ghost = n->arc == kB1 || n->arc == kB2;
      if (arc_ghost) arc_unlink(n);
    }
    bool s3_ghost = false;
    if constexpr (has(kS3)) {
      s3_ghost = n->s3 == kS3Ghost;
      s3_unlink(n);
    }
    n->resident = true;
    n->size = size;
    ++resident_;
    resident_bytes_ += size;
    if constexpr (has(kLru)) lru_.push_back(n);
    if constexpr (has(kLruK)) lruk_add(n, now, kind);
    if constexpr (has(kArc)) arc_add(n, now, kind, arc_ghost);
    if constexpr (has(kS3)) s3_add(n, kind, s3_ghost);
    if constexpr (has(kPrefix)) prefix_->add(key, size, now, kind);
    pending_b2_ = false;
    if constexpr (kAdaptive) {
      if (adaptive_) observe(key, size, now, kind);
    }
  }

  void record_access(const NsKey& key, uint64_t size, uint64_t now) override {
    if (Node* n = find_resident(key)) touch(n, size, now);
  }

  void touch(Node* n, uint64_t size, uint64_t now) {
    const NsKey& key = n->key;
    resident_bytes_ = resident_bytes_ - n->size + size;
    if constexpr (has(kS3)) s3_access(n, size);  // before the node takes the new size
    if constexpr (has(kArc)) arc_access(n, size, now);
    n->size = size;
    if constexpr (has(kLru)) lru_.move_to_back(n);
    if constexpr (has(kLruK)) lruk_access(n, now);
    if constexpr (has(kPrefix)) prefix_->record_access(key, size, now);
    if constexpr (kAdaptive) {
      if (adaptive_) observe(key, size, now, AddKind::kDemand);
    }
  }

  void remove(const NsKey& key) override {
    if constexpr (has(kPrefix)) prefix_->remove(key);  // it forgets a remembered key too
    auto it = nodes_.find(key);
    if (it == nodes_.end() || !it->second.resident) return;
    Node* n = &it->second;
    if constexpr (has(kLru)) lru_.erase(n);
    if constexpr (has(kLruK)) {
      order_.erase(n->k_pos);
      n->k = kKNone;
    }
    if constexpr (has(kArc)) arc_unlink(n);
    if constexpr (has(kS3)) s3_unlink(n);
    leave(n);
    release(n);
    if constexpr (kAdaptive) {
      if (adaptive_) {
        for (uint8_t e = 0; e < kExperts; ++e) with_shadow(e, [&](auto& s) { s.remove(key); });
      }
    }
  }

  bool evict(NsKey* victim) override {
    if (resident_ == 0) return false;
    Node* n = nullptr;
    if constexpr (has(kLru)) {
      if (leader_ == kLru) n = lru_.front();
    }
    if constexpr (has(kLruK)) {
      if (leader_ == kLruK) n = order_.begin()->second;
    }
    if constexpr (has(kArc)) {
      if (leader_ == kArc) {
        const bool t1 = !arc_lists_[kT1].empty() && (arc_lists_[kT2].empty() || bytes_[kT1] > p_ ||
                                                     (pending_b2_ && bytes_[kT1] >= p_));
        n = (t1 ? arc_lists_[kT1] : arc_lists_[kT2]).front();
      }
    }
    if constexpr (has(kS3)) {
      if (leader_ == kS3) n = s3_victim();
    }
    if constexpr (has(kPrefix)) {
      if (leader_ == kPrefix) {
        NsKey v;
        if (!prefix_->evict(&v) || (n = find_resident(v)) == nullptr) return false;  // never
        *victim = v;
        evict_node(n);
        return true;
      }
      prefix_->evict_key(n->key);
    }
    *victim = n->key;
    evict_node(n);
    return true;
  }

  void evict_key(const NsKey& key) override {
    auto it = nodes_.find(key);
    if (it == nodes_.end() || !it->second.resident) return;
    if constexpr (has(kPrefix)) prefix_->evict_key(key);
    evict_node(&it->second);
  }

  void record_chain(const NsKey& key, const NsKey& pred) override {
    if constexpr (has(kPrefix)) {
      prefix_->record_chain(key, pred);
      if (adaptive_ && shadow_prefix_ && sampled(key) && sampled(pred)) {
        shadow_prefix_->record_chain(key, pred);
      }
    } else {
      (void)key, (void)pred;
    }
  }
  bool uses_chains() const override { return has(kPrefix); }

  size_t entries() const override { return resident_; }

  void collect(MetricList& out) const override {
    auto gauge = [&](const char* name, const char* help, double v,
                     std::vector<std::pair<std::string, std::string>> labels = {}) {
      out.push_back(Metric{name, help, MetricType::kGauge, std::move(labels), v});
    };
    if constexpr (has(kLruK)) {
      gauge("cache_lruk_history_entries", "LRU-K: evicted keys whose reference times it keeps",
            static_cast<double>(fifo_.size()));
    }
    if constexpr (has(kArc)) {
      gauge("cache_arc_recency_target_bytes", "ARC: bytes it aims to give entries used once (p)",
            static_cast<double>(p_));
      gauge("cache_arc_recency_bytes", "ARC: bytes of entries referenced once",
            static_cast<double>(bytes_[kT1]));
      gauge("cache_arc_frequency_bytes", "ARC: bytes of entries referenced more than once",
            static_cast<double>(bytes_[kT2]));
      gauge("cache_arc_ghost_bytes", "ARC: bytes of evicted keys remembered",
            static_cast<double>(bytes_[kB1] + bytes_[kB2]));
    }
    if constexpr (kAdaptive) {
      prefix_->collect(out);
      for (uint8_t e = 0; e < kExperts; ++e) {
        if (!has(static_cast<Expert>(e))) continue;
        const std::string name = e == kLruK ? "lru-" + std::to_string(k_) : kExpertNames[e];
        gauge("cache_adaptive_expert_score",
              "adaptive policy: recent hits of each expert policy on its shadow cache", score_[e],
              {{"expert", name}});
        gauge("cache_adaptive_leader",
              "adaptive policy: 1 for the expert whose evictions it follows",
              e == leader_ ? 1.0 : 0.0, {{"expert", name}});
      }
      out.push_back(Metric{"cache_adaptive_switches_total",
                           "adaptive policy: times the leading expert changed",
                           MetricType::kCounter,
                           {},
                           static_cast<double>(switches_)});
    }
  }

  Node* find_resident(const NsKey& key) {
    auto it = nodes_.find(key);
    return it != nodes_.end() && it->second.resident ? &it->second : nullptr;
  }
  uint64_t resident_bytes() const { return resident_bytes_; }

 private:
  static constexpr bool has(Expert e) { return (M & bit(e)) != 0; }

  // The node left the cache (all experts are done with its resident state).
  void leave(Node* n) {
    n->resident = false;
    --resident_;
    resident_bytes_ -= n->size;
  }

  // Frees the node once no expert remembers it.
  void release(Node* n) {
    if (n->resident) return;
    if constexpr (has(kLruK)) {
      if (n->k == kKHistory) return;
    }
    if constexpr (has(kArc)) {
      if (n->arc != kArcNone) return;
    }
    if constexpr (has(kS3)) {
      if (n->s3 != kS3None) return;
    }
    nodes_.erase(n->key);
  }

  void evict_node(Node* n) {
    if constexpr (has(kLru)) lru_.erase(n);
    if constexpr (has(kLruK)) lruk_to_history(n);
    if constexpr (has(kArc)) arc_to_ghost(n);
    if constexpr (has(kS3)) s3_to_ghost(n);
    leave(n);
    release(n);  // n may be gone from here on: the trims free what they drop
    if constexpr (has(kLruK)) trim_history();
    if constexpr (has(kArc)) trim_ghosts();
    if constexpr (has(kS3)) s3_trim_ghost();
  }

  // ---- LRU-K ----

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

  void lruk_add(Node* n, uint64_t now, AddKind kind) {
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

  void lruk_access(Node* n, uint64_t now) {
    auto handle = order_.extract(n->k_pos);
    reference(n->refs, now);
    handle.key() = Order{priority(n->refs), n->k_id};
    n->k_pos = order_.insert(std::move(handle)).position;
  }

  void lruk_to_history(Node* n) {
    order_.erase(n->k_pos);
    n->k = kKHistory;
    fifo_.push_back(n);
  }

  void trim_history() {
    const uint64_t cap =
        options_.history_entries != 0 ? options_.history_entries : std::max<uint64_t>(resident_, 1);
    while (fifo_.size() > cap) {
      Node* old = fifo_.front();
      fifo_.erase(old);
      old->k = kKNone;
      release(old);
    }
  }

  // ---- ARC ----

  static bool arc_resident(ArcList l) { return l == kT1 || l == kT2; }

  void arc_link(Node* n, ArcList to) {
    arc_lists_[to].push_back(n);
    n->arc = to;
    bytes_[to] += n->size;
  }
  void arc_unlink(Node* n) {
    arc_lists_[n->arc].erase(n);
    bytes_[n->arc] -= n->size;
    n->arc = kArcNone;
  }

  // `ghost`: the key was in B1 or B2 (and has been unlinked from it).
  void arc_add(Node* n, uint64_t now, AddKind kind, bool ghost) {
    // A ghost's demand miss returns it to the frequency side, as in ARC; a prefetch does not count
    // as that second reference.
    const ArcList to = ghost && kind == AddKind::kDemand ? kT2 : kT1;
    n->arc_prefetched = kind == AddKind::kPrefetch;
    n->arc_has_last = kind == AddKind::kDemand;
    n->arc_last = now;
    arc_link(n, to);
    trim_ghosts();
  }

  void arc_access(Node* n, uint64_t size, uint64_t now) {
    ArcList to = kT2;
    if (n->arc == kT1 && (n->arc_prefetched || (n->arc_has_last && now - n->arc_last <= window_))) {
      to = kT1;
    }
    arc_unlink(n);
    n->size = size;
    n->arc_prefetched = false;
    n->arc_has_last = true;
    n->arc_last = now;
    arc_link(n, to);
  }

  void arc_to_ghost(Node* n) {
    const ArcList ghost = n->arc == kT1 ? kB1 : kB2;
    arc_unlink(n);
    n->arc_prefetched = false;
    arc_link(n, ghost);
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

  void arc_drop_lru(ArcList l) {
    Node* n = arc_lists_[l].front();
    arc_unlink(n);
    release(n);
  }

  void trim_ghosts() {
    while (!arc_lists_[kB1].empty() && bytes_[kT1] + bytes_[kB1] > c_) arc_drop_lru(kB1);
    auto total = [&] { return bytes_[kT1] + bytes_[kT2] + bytes_[kB1] + bytes_[kB2]; };
    while (!arc_lists_[kB2].empty() && total() > 2 * c_) arc_drop_lru(kB2);
    while (!arc_lists_[kB1].empty() && total() > 2 * c_) arc_drop_lru(kB1);
  }

  // ---- S3-FIFO ----

  void s3_link(Node* n, S3Queue to) {
    s3_lists_[to].push_back(n);
    n->s3 = to;
    s3_bytes_[to] += n->size;
  }
  void s3_unlink(Node* n) {
    if (n->s3 == kS3None) return;
    s3_lists_[n->s3].erase(n);
    s3_bytes_[n->s3] -= n->size;
    n->s3 = kS3None;
  }

  // `ghost`: the key was in G (and has been unlinked from it, at its old size).
  void s3_add(Node* n, AddKind kind, bool ghost) {
    n->s3_freq = 0;
    n->s3_prefetched = kind == AddKind::kPrefetch;
    s3_link(n, ghost && kind == AddKind::kDemand ? kS3Main : kS3Small);
  }

  void s3_access(Node* n, uint64_t size) {
    s3_bytes_[n->s3] = s3_bytes_[n->s3] - n->size + size;
    if (n->s3_prefetched) {
      n->s3_prefetched = false;
    } else if (n->s3_freq < 3) {
      ++n->s3_freq;
    }
  }

  // The entry S3-FIFO evicts next. Entries it passes over move (S to M, or back to M's head);
  // M's tail is always reached, as every pass lowers a count.
  Node* s3_victim() {
    for (;;) {
      auto& small = s3_lists_[kS3Small];
      auto& main = s3_lists_[kS3Main];
      if (!small.empty() && (s3_bytes_[kS3Small] >= c_ / 10 || main.empty())) {
        Node* t = small.front();
        if (t->s3_freq == 0) return t;  // not hit in S: it goes (to G)
        s3_unlink(t);
        t->s3_freq = 0;
        s3_link(t, kS3Main);
        continue;
      }
      Node* t = main.front();
      if (t->s3_freq == 0) return t;
      --t->s3_freq;
      main.move_to_back(t);
    }
  }

  void s3_to_ghost(Node* n) {
    const bool small = n->s3 == kS3Small;
    s3_unlink(n);
    if (small) s3_link(n, kS3Ghost);
  }

  void s3_trim_ghost() {
    auto& ghost = s3_lists_[kS3Ghost];
    while (!ghost.empty() &&
           (s3_bytes_[kS3Ghost] > c_ - c_ / 10 || ghost.size() > std::max<size_t>(resident_, 1))) {
      Node* old = ghost.front();
      s3_unlink(old);
      release(old);
    }
  }

  // ---- Adaptive ----
  //
  // No single policy wins at every size on KV-cache traffic: LRU-2 (frequency) wins when the
  // cache is small next to the working set, LRU (recency) when it is large, ARC often in between.
  // The adaptive policy keeps all three as experts ordering the cache's entries (the state above),
  // and also runs each alone on a shadow cache of the same capacity that holds keys only and sees
  // the same references. Shadow hits, halved every epoch (several turnovers of the cache), score
  // each expert on the recent past, and evictions follow the best. In a steady workload the cache
  // converges on the contents the best expert would have; a change of workload moves the lead
  // within a few epochs. The shadows follow a fixed sample of the key space (SHARDS, spatial
  // sampling) once the cache holds many entries, so they cost a fraction of a lookup per reference.

  static constexpr uint64_t kShadowEntries = 2048;  // sampled keys a shadow aims to hold
  static constexpr uint32_t kMaxShift = 6;
  static constexpr uint64_t kMinEpoch = 65536;  // references

  static uint32_t ideal_shift(uint64_t entries) {
    uint32_t shift = 0;
    while (shift < kMaxShift && (entries >> (shift + 1)) >= kShadowEntries) ++shift;
    return shift;
  }

  // Starts the shadows afresh, following one key in 2^shift. Scores restart; the leader stays.
  void reshard(uint32_t shift) {
    shift_ = shift;
    shadow_capacity_ = c_ >> shift;
    PolicyOptions so = options_;
    so.capacity_bytes = shadow_capacity_;
    so.pin_expert.clear();
    if (so.history_entries != 0)
      so.history_entries = std::max<uint64_t>(so.history_entries >> shift, 1);
    score_.fill(0);
    shadow_arc_ = std::make_unique<Engine<bit(kArc)>>(kExpertNames[kArc], so);
    shadow_lruk_ = std::make_unique<Engine<bit(kLruK)>>(kExpertNames[kLruK], so);
    shadow_lru_ = std::make_unique<Engine<bit(kLru)>>(kExpertNames[kLru], so);
    shadow_s3_ = std::make_unique<Engine<bit(kS3)>>(kExpertNames[kS3], so);
    shadow_prefix_ = std::make_unique<Shadow>(make_prefix_policy(so));
  }

  bool sampled(const NsKey& key) const {
    return shift_ == 0 || (NsKeyHash{}(key)*0x2545F4914F6CDD1Dull) >> (64 - shift_) == 0;
  }

  void observe(const NsKey& key, uint64_t size, uint64_t now, AddKind kind) {
    if (sampled(key)) {
      for (uint8_t e = 0; e < kExperts; ++e) {
        with_shadow(e, [&](auto& s) { shadow_reference(s, e, key, size, now, kind); });
      }
    }
    // More entries than the sample was sized for: sample more sparsely at once (cheap check).
    if (shift_ < kMaxShift && (resident_ >> (shift_ + 1)) >= kShadowEntries) {
      reshard(ideal_shift(resident_));
    }
    if (++refs_ >= epoch_) {
      refs_ = 0;
      epoch_ = std::max<uint64_t>(kMinEpoch, 4 * resident_);
      for (double& s : score_) s *= 0.5;
      // Fewer entries than the sample was sized for (the first guess may be off): sample more
      // densely, but only once the cache has filled, or every step of the filling would restart
      // the shadows.
      if (const uint32_t want = ideal_shift(resident_);
          want < shift_ && resident_bytes_ >= c_ / 4 * 3) {
        reshard(want);
      }
    }
    uint8_t best = leader_;
    for (uint8_t e = 0; e < kExperts; ++e) {
      if (score_[e] > score_[best]) best = e;
    }
    // Hysteresis: a lead of a few hits is noise, and each switch costs the cache some contents.
    // ARC must lead by more: it is the middle ground between the other two, and on a sampled
    // shadow it often looks as good as the better of them when it is slightly worse.
    const double margin = best == kArc ? 1.005 : 1.001;
    if (best != leader_ && score_[best] > score_[leader_] * margin + 8) {
      leader_ = best;
      ++switches_;
    }
  }

  // Calls f with expert e's shadow, if there is one.
  template <class F>
  void with_shadow(uint8_t e, F&& f) {
    switch (e) {
      case kArc:
        if (shadow_arc_) f(*shadow_arc_);
        break;
      case kLruK:
        if (shadow_lruk_) f(*shadow_lruk_);
        break;
      case kS3:
        if (shadow_s3_) f(*shadow_s3_);
        break;
      case kPrefix:
        if (shadow_prefix_) f(*shadow_prefix_);
        break;
      default:
        if (shadow_lru_) f(*shadow_lru_);
    }
  }

  template <class Shadow>
  void shadow_reference(Shadow& s, uint8_t e, const NsKey& key, uint64_t size, uint64_t now,
                        AddKind kind) {
    NsKey v;
    if (auto* n = s.find_resident(key)) {
      if (kind == AddKind::kPrefetch) return;  // a prefetch is not a reference
      score_[e] += 1;
      s.touch(n, size, now);
      while (s.resident_bytes() > shadow_capacity_ && s.evict(&v)) {
      }
      return;
    }
    if (size > shadow_capacity_) return;
    s.prepare_insert(key, size, kind);
    while (s.resident_bytes() + size > shadow_capacity_ && s.evict(&v)) {
    }
    s.add(key, size, now, kind);
  }

  const char* name_;
  const PolicyOptions options_;
  const uint32_t k_;
  const uint64_t window_;
  const uint64_t c_;

  std::unordered_map<NsKey, Node, NsKeyHash> nodes_;
  size_t resident_ = 0;
  uint64_t resident_bytes_ = 0;
  // LRU
  List<Node, &Node::lru> lru_;
  // LRU-K
  std::map<Order, Node*> order_;    // first = its next victim
  List<Node, &Node::k_fifo> fifo_;  // history, oldest evicted first
  uint64_t next_id_ = 0;
  // ARC
  std::array<List<Node, &Node::arc_link>, 4> arc_lists_;
  std::array<uint64_t, 4> bytes_{};
  uint64_t p_ = 0;  // target bytes of T1
  bool pending_b2_ = false;
  // S3-FIFO
  std::array<List<Node, &Node::s3_link>, 4> s3_lists_;  // by S3Queue (kS3None unused)
  std::array<uint64_t, 4> s3_bytes_{};
  // Adaptive
  bool adaptive_ = false;
  uint8_t leader_ = kExperts;
  // The adaptive policy's shadows (single-expert engines: keys only, sampled).
  std::unique_ptr<Engine<bit(kArc)>> shadow_arc_;
  std::unique_ptr<Engine<bit(kLruK)>> shadow_lruk_;
  std::unique_ptr<Engine<bit(kLru)>> shadow_lru_;
  std::unique_ptr<Engine<bit(kS3)>> shadow_s3_;
  std::unique_ptr<Shadow> shadow_prefix_;
  std::unique_ptr<EvictionPolicy> prefix_;  // the prefix expert, in step with the cache
  std::array<double, kExperts> score_{};
  uint32_t shift_ = 0;
  uint64_t shadow_capacity_ = 0;
  uint64_t refs_ = 0;
  uint64_t epoch_ = kMinEpoch;
  uint64_t switches_ = 0;
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_policy(std::string_view name, const PolicyOptions& o) {
  if (name == "prefix") {
    if (!(o.probation_share >= 0 && o.probation_share <= 1)) return nullptr;
    return make_prefix_policy(o);
  }
  if (name == "lru") return std::make_unique<Engine<bit(kLru)>>("lru", o);
  if (name == "lru-k") {
    if (o.k < 1 || o.k > kMaxK) return nullptr;
    return std::make_unique<Engine<bit(kLruK)>>("lru-k", o);
  }
  if (name == "arc") return std::make_unique<Engine<bit(kArc)>>("arc", o);
  if (name == "s3-fifo") return std::make_unique<Engine<bit(kS3)>>("s3-fifo", o);
  if (name == "adaptive") {
    PolicyOptions a = o;
    a.k = 2;
    if (!(o.probation_share >= 0 && o.probation_share <= 1)) return nullptr;
    if (!a.pin_expert.empty() && std::find(std::begin(kExpertNames), std::end(kExpertNames),
                                           a.pin_expert) == std::end(kExpertNames)) {
      return nullptr;
    }
    return std::make_unique<Engine<kAllExperts>>("adaptive", a);
  }
  return nullptr;
}

}  // namespace gdkv::cache
