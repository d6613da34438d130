// The "prefix" policy: the cache's default for KV-cache traffic (docs/cache.md, "prefix").
//
// Three ideas, each from how KV-cache blocks are used:
//   1. A block seen once is usually never seen again (one-off documents, the question at the end of
//      a prompt), so new blocks enter a small probation segment and only a block referenced again
//      reaches the protected segment (segmented LRU, as in 2Q and SLRU).
//   2. Keys are tiny next to values, so the history of evicted keys (a ghost FIFO of keys only) can
//      remember more keys than the cache holds: a miss on a remembered key was reused within about
//      two cache turnovers and goes straight to the protected segment.
//   3. A block is worth something only while its chain predecessor is cached (a prefix hit ends at
//      the first miss), so within a segment a block read right after its predecessor is placed just
//      before it in eviction order, not after it: chains are evicted from their tails, and a
//      block's predecessor is never in a lower segment than the block.
// The probation segment's share is hill-climbed on the hit ratio (as Caffeine sizes its window):
// every period the share moves one step; when the hit ratio fell, or at a bound, the direction
// turns; the step shrinks over time. Small caches next to the working set want a small probation
// segment, large ones (where a chat's previous turn, seen once, comes back while still cached) a
// larger one.
#include <algorithm>
#include <memory>
#include <unordered_map>

#include "cache/policy.h"

namespace gdkv::cache {
namespace {

enum Where : uint8_t { kProbation, kProtected, kGhost };

struct PNode {
  NsKey key;
  uint64_t size = 0;
  PNode* prev = nullptr;  // in its segment's list, or in the ghost FIFO
  PNode* next = nullptr;
  Where where = kGhost;
  bool unread = false;  // a prefetch added it and nobody has read it yet
};

// An intrusive list; front = the next to go.
class PList {
 public:
  PNode* front() const { return head_; }
  bool empty() const { return head_ == nullptr; }
  uint64_t size() const { return n_; }
  uint64_t bytes() const { return bytes_; }

  void push_back(PNode* x) { insert_before(x, nullptr); }
  // Inserts x just before `pos` (nearer the front); pos null = at the back.
  void insert_before(PNode* x, PNode* pos) {
    x->next = pos;
    x->prev = pos != nullptr ? pos->prev : tail_;
    (x->prev != nullptr ? x->prev->next : head_) = x;
    (pos != nullptr ? pos->prev : tail_) = x;
    ++n_;
    bytes_ += x->size;
  }
  void erase(PNode* x) {
    (x->prev != nullptr ? x->prev->next : head_) = x->next;
    (x->next != nullptr ? x->next->prev : tail_) = x->prev;
    x->prev = x->next = nullptr;
    --n_;
    bytes_ -= x->size;
  }

 private:
  PNode* head_ = nullptr;
  PNode* tail_ = nullptr;
  uint64_t n_ = 0;
  uint64_t bytes_ = 0;
};

// The probation share starts at 1/64 of the capacity and stays within [1/128, 7/8]; the first step
// is 1/32 of the capacity and shrinks by 2% per period down to 1/512.
constexpr double kShareStart = 1.0 / 64, kShareMin = 1.0 / 128, kShareMax = 7.0 / 8;
constexpr double kStepStart = 1.0 / 32, kStepMin = 1.0 / 512, kStepDecay = 0.98;
// A period is this many times the resident entries in references (at least kMinPeriod).
constexpr uint64_t kPeriodTurnovers = 8, kMinPeriod = 4096;
// Evicted keys remembered: this many times the resident entries (at least kMinHistory).
constexpr uint64_t kHistoryFactor = 2, kMinHistory = 64;

class PrefixPolicy final : public EvictionPolicy {
 public:
  explicit PrefixPolicy(const PolicyOptions& o)
      : c_(o.capacity_bytes),
        history_(o.history_entries),
        share_(kShareStart),
        step_(kStepStart),
        pinned_(o.probation_share > 0) {
    if (pinned_) share_ = std::clamp(o.probation_share, 0.0, 1.0);
  }

  const char* name() const override { return "prefix"; }
  bool uses_chains() const override { return true; }

  void add(const NsKey& key, uint64_t size, uint64_t now, AddKind kind) override {
    (void)now;
    auto [it, fresh] = nodes_.try_emplace(key);
    PNode* n = &it->second;
    bool remembered = false;
    if (fresh) {
      n->key = key;
    } else {
      remembered = n->where == kGhost;  // REQUIRES: not resident, so a ghost
      ghost_.erase(n);
    }
    n->size = size;
    n->unread = kind == AddKind::kPrefetch;
    if (kind == AddKind::kDemand) count(false);
    // A remembered key was reused within the history's reach: protected. So is a remembered key
    // that a prefetch brings back (chain prediction only fetches keys it saw before, and a
    // prefetched block is read soon: in a small probation segment it would be evicted first).
    // A prefetch is not a reference, though: its first read does not promote it.
    n->where = remembered ? kProtected : kProbation;
    list(n->where).push_back(n);
  }

  void record_access(const NsKey& key, uint64_t size, uint64_t now) override {
    (void)now;
    auto it = nodes_.find(key);
    if (it == nodes_.end() || it->second.where == kGhost) return;
    PNode* n = &it->second;
    count(true);
    list(n->where).erase(n);
    n->size = size;
    if (n->where == kProbation && !n->unread) n->where = kProtected;  // referenced again
    n->unread = false;
    list(n->where).push_back(n);
  }

  void record_chain(const NsKey& key, const NsKey& pred) override {
    auto k = nodes_.find(key);
    auto p = nodes_.find(pred);
    if (k == nodes_.end() || p == nodes_.end() || k == p) return;
    PNode* kn = &k->second;
    PNode* pn = &p->second;
    if (kn->where == kGhost || pn->where == kGhost) return;
    if (kn->where == kProtected && pn->where == kProbation) {
      // Every read of the block passed its predecessor: the predecessor has been read as often.
      probation_.erase(pn);
      pn->where = kProtected;
      pn->unread = false;
      protected_.push_back(pn);
    }
    if (kn->where != pn->where) return;  // the block is in probation: it goes first anyway
    PList& l = list(kn->where);
    l.erase(kn);
    l.insert_before(kn, pn);
  }

  void remove(const NsKey& key) override {
    auto it = nodes_.find(key);
    if (it == nodes_.end()) return;
    PNode* n = &it->second;
    list(n->where).erase(n);
    nodes_.erase(it);
  }

  bool evict(NsKey* victim) override {
    PNode* n = nullptr;
    if (!probation_.empty() && (protected_.empty() || static_cast<double>(probation_.bytes()) >
                                                          share_ * static_cast<double>(c_))) {
      n = probation_.front();
    } else if (!protected_.empty()) {
      n = protected_.front();
    } else {
      return false;
    }
    *victim = n->key;
    to_ghost(n);
    return true;
  }

  void evict_key(const NsKey& key) override {
    auto it = nodes_.find(key);
    if (it == nodes_.end() || it->second.where == kGhost) return;
    to_ghost(&it->second);
  }

  size_t entries() const override { return probation_.size() + protected_.size(); }

  void collect(MetricList& out) const override {
    MetricWriter w(out);
    auto gauge = [&](const char* name, const char* help, double v) { w.gauge(name, help, v); };
    gauge("cache_prefix_probation_target_bytes",
          "prefix policy: bytes it aims to give blocks seen once (hill-climbed)",
          share_ * static_cast<double>(c_));
    gauge("cache_prefix_probation_bytes", "prefix policy: bytes of blocks seen once",
          static_cast<double>(probation_.bytes()));
    gauge("cache_prefix_protected_bytes", "prefix policy: bytes of blocks seen again",
          static_cast<double>(protected_.bytes()));
    gauge("cache_prefix_history_entries", "prefix policy: evicted keys remembered",
          static_cast<double>(ghost_.size()));
  }

 private:
  PList& list(Where w) {
    return w == kProbation ? probation_ : w == kProtected ? protected_ : ghost_;
  }

  void to_ghost(PNode* n) {
    list(n->where).erase(n);
    n->where = kGhost;
    n->unread = false;
    ghost_.push_back(n);
    const uint64_t limit =
        history_ > 0 ? history_ : std::max(kMinHistory, kHistoryFactor * entries());
    while (ghost_.size() > limit) {
      PNode* old = ghost_.front();
      ghost_.erase(old);
      nodes_.erase(old->key);
    }
  }

  // Hill climbing on the hit ratio of demand references.
  void count(bool hit) {
    ++refs_;
    hits_ += hit;
    const uint64_t period = std::max(kMinPeriod, kPeriodTurnovers * entries());
    if (pinned_ || refs_ < period) return;
    const double ratio = static_cast<double>(hits_) / static_cast<double>(refs_);
    if (ratio < last_ratio_) up_ = !up_;
    last_ratio_ = ratio;
    share_ = std::clamp(share_ + (up_ ? step_ : -step_), kShareMin, kShareMax);
    // At a bound the next step goes back, so a flat stretch (no hits either way) is crossed, not
    // sat in.
    if (share_ == kShareMin || share_ == kShareMax) up_ = share_ == kShareMin;
    step_ = std::max(kStepMin, step_ * kStepDecay);
    refs_ = hits_ = 0;
  }

  uint64_t c_;
  uint64_t history_;
  double share_;
  double step_;
  bool pinned_;
  bool up_ = true;
  double last_ratio_ = 0;
  uint64_t refs_ = 0, hits_ = 0;
  PList probation_, protected_, ghost_;
  std::unordered_map<NsKey, PNode, NsKeyHash> nodes_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_prefix_policy(const PolicyOptions& o) {
  return std::make_unique<PrefixPolicy>(o);
}

}  // namespace gdkv::cache
