// Scheduler hints over any eviction policy (policy.h, HintedPolicy; docs/cache.md).
//
// Protection is lazy: a hint only records the key. When the inner policy picks a hinted key as
// its victim, the key is "rescued" into the protected set instead of leaving (the inner policy
// has already moved it to its history of evicted keys, so a later read is a reference to a
// remembered key, which is what it is). So hints cost nothing until they matter, and a policy's
// own order is untouched for keys nobody hinted.
//
// Bounds: hints_ holds at most max_hints keys (the oldest hint goes first); protected bytes stay
// within max_share of the capacity (a victim that would exceed it leaves); when the inner policy
// has nothing left, the protected key hinted last (read furthest in the future) goes.
#include <deque>
#include <map>
#include <unordered_map>

#include "cache/policy.h"

namespace gdkv::cache {
namespace {

class Hinted final : public HintedPolicy {
 public:
  Hinted(std::unique_ptr<EvictionPolicy> inner, const HintOptions& o)
      : inner_(std::move(inner)),
        o_(o),
        budget_(static_cast<uint64_t>(static_cast<double>(o.capacity_bytes) * o.max_share)) {}

  const char* name() const override { return inner_->name(); }

  void hint(const NsKey& key, uint64_t size, uint64_t now) override {
    now_ = now;
    const uint64_t seq = ++seq_;
    auto [it, fresh] = hints_.try_emplace(key);
    Hint& h = it->second;
    h.seq = seq;
    if (size != 0) h.size = size;
    h.expires = o_.ttl == 0 ? UINT64_MAX : now + o_.ttl;
    if (auto p = prot_.find(key); p != prot_.end()) {  // hinted again: the newer order counts
      if (p->second.aged) {
        p->second.aged = false;  // its aged_ entry is skipped now
      } else {
        by_seq_.erase(p->second.seq);
      }
      p->second.seq = seq;
      by_seq_.emplace(seq, key);
    }
    order_.push_back({key, seq});
    if (fresh) {
      while (hints_.size() > o_.max_hints) age_oldest();
    }
    if (order_.size() > 2 * o_.max_hints + 64) compact();
  }

  bool hinted(const NsKey& key) const override {
    auto it = hints_.find(key);
    return it != hints_.end() && it->second.expires >= now_;
  }
  uint64_t hints() const override { return hints_.size(); }
  uint64_t protected_bytes() const override { return prot_bytes_; }

  void prepare_insert(const NsKey& key, uint64_t size, AddKind kind) override {
    inner_->prepare_insert(key, size, kind);
  }

  void add(const NsKey& key, uint64_t size, uint64_t now, AddKind kind) override {
    now_ = now;
    if (kind == AddKind::kDemand) {
      drop_hint(key);  // a read (or a Store) that missed: hint used
    } else if (auto h = hints_.find(key); h != hints_.end()) {
      h->second.size = size;  // fetched ahead of its hinted read
    }
    inner_->add(key, size, now, kind);
  }

  // Every cache hit comes here: with no hint given, it costs two emptiness checks.
  void record_access(const NsKey& key, uint64_t size, uint64_t now) override {
    now_ = now;
    if (auto p = prot_.empty() ? prot_.end() : prot_.find(key); p != prot_.end()) {
      // Read while protected: back into the inner policy, as a returning key.
      unprotect(p);
      drop_hint(key);
      inner_->prepare_insert(key, size, AddKind::kDemand);
      inner_->add(key, size, now, AddKind::kDemand);
      return;
    }
    drop_hint(key);  // the hinted read happened
    inner_->record_access(key, size, now);
  }

  void remove(const NsKey& key) override {
    drop_hint(key);
    if (auto p = prot_.find(key); p != prot_.end()) return unprotect(p);
    inner_->remove(key);
  }

  bool evict(NsKey* victim) override {
    expire();
    // Hints that aged out unread: their blocks go first.
    while (!aged_.empty()) {
      const NsKey k = aged_.front();
      aged_.pop_front();
      auto p = prot_.find(k);
      if (p == prot_.end() || !p->second.aged) continue;
      unprotect(p);
      *victim = k;
      return true;
    }
    NsKey v;
    while (inner_->evict(&v)) {
      auto h = hints_.find(v);
      if (h == hints_.end() || prot_bytes_ + h->second.size > budget_) {
        *victim = v;
        return true;
      }
      protect(v, h->second);  // rescued; ask the inner policy again
      ++rescued_;
    }
    if (by_seq_.empty()) return false;
    // Only hinted keys are left: the one hinted last is read last.
    auto last = std::prev(by_seq_.end());
    const NsKey k = last->second;
    auto p = prot_.find(k);
    unprotect(p);
    drop_hint(k);
    *victim = k;
    return true;
  }

  void record_chain(const NsKey& key, const NsKey& pred) override {
    if (!prot_.contains(key) && !prot_.contains(pred)) inner_->record_chain(key, pred);
  }
  bool uses_chains() const override { return inner_->uses_chains(); }

  void evict_key(const NsKey& key) override {
    drop_hint(key);
    if (auto p = prot_.find(key); p != prot_.end()) return unprotect(p);
    inner_->evict_key(key);
  }

  size_t entries() const override { return inner_->entries() + prot_.size(); }

  void collect(MetricList& out) const override {
    inner_->collect(out);
    MetricWriter w(out);
    w.gauge("cache_hints", "scheduler hints remembered", static_cast<double>(hints_.size()));
    w.gauge("cache_hint_protected_bytes", "resident bytes kept only by hints",
            static_cast<double>(prot_bytes_));
    w.counter("cache_hint_rescued_total", "evictions a hint turned away",
              static_cast<double>(rescued_));
  }

 private:
  struct Hint {
    uint64_t seq = 0;
    uint64_t expires = 0;
    uint64_t size = 0;  // its bytes while resident (0: not known to be)
  };
  struct Prot {
    uint64_t size = 0;
    uint64_t seq = 0;   // key in by_seq_ (0 once aged)
    bool aged = false;  // its hint aged out or was pushed out: goes first
  };
  using ProtMap = std::unordered_map<NsKey, Prot, NsKeyHash>;

  void protect(const NsKey& k, const Hint& h) {
    prot_[k] = Prot{h.size, h.seq, false};
    by_seq_.emplace(h.seq, k);
    prot_bytes_ += h.size;
  }

  void unprotect(ProtMap::iterator p) {
    if (!p->second.aged) by_seq_.erase(p->second.seq);
    prot_bytes_ -= p->second.size;
    prot_.erase(p);
  }

  // The hint on `k` is gone (read, deleted, aged): a protected key becomes first to go.
  void age(const NsKey& k) {
    auto p = prot_.find(k);
    if (p == prot_.end() || p->second.aged) return;
    by_seq_.erase(p->second.seq);
    p->second.aged = true;
    p->second.seq = 0;
    aged_.push_back(k);
  }

  void drop_hint(const NsKey& k) {
    if (!hints_.empty()) hints_.erase(k);
  }

  // Pops stale order_ entries; the front live one is the oldest hint.
  void age_oldest() {
    while (!order_.empty()) {
      const auto [k, seq] = order_.front();
      order_.pop_front();
      auto h = hints_.find(k);
      if (h == hints_.end() || h->second.seq != seq) continue;
      hints_.erase(h);
      age(k);
      return;
    }
  }

  void expire() {
    if (o_.ttl == 0) return;
    while (!order_.empty()) {
      const auto& [k, seq] = order_.front();
      auto h = hints_.find(k);
      if (h != hints_.end() && h->second.seq == seq) {
        if (h->second.expires >= now_) return;
        const NsKey key = k;
        hints_.erase(h);
        order_.pop_front();
        age(key);
        continue;
      }
      order_.pop_front();
    }
  }

  void compact() {
    std::deque<std::pair<NsKey, uint64_t>> live;
    for (const auto& e : order_) {
      auto h = hints_.find(e.first);
      if (h != hints_.end() && h->second.seq == e.second) live.push_back(e);
    }
    order_.swap(live);
  }

  std::unique_ptr<EvictionPolicy> inner_;
  const HintOptions o_;
  const uint64_t budget_;
  uint64_t now_ = 0;
  uint64_t seq_ = 0;
  uint64_t prot_bytes_ = 0;
  uint64_t rescued_ = 0;
  std::unordered_map<NsKey, Hint, NsKeyHash> hints_;
  std::deque<std::pair<NsKey, uint64_t>> order_;  // hints by age (stale entries skipped)
  ProtMap prot_;
  std::map<uint64_t, NsKey> by_seq_;  // protected keys with a live hint, by hint order
  std::deque<NsKey> aged_;            // protected keys whose hint is gone
};

}  // namespace

std::unique_ptr<HintedPolicy> make_hinted_policy(std::unique_ptr<EvictionPolicy> inner,
                                                 const HintOptions& options) {
  if (!inner) return nullptr;
  return std::make_unique<Hinted>(std::move(inner), options);
}

}  // namespace gdkv::cache
