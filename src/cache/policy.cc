// LRU, LRU-K, ARC, S3-FIFO and the adaptive policy: experts behind one node and one lookup.
//
// Each of the four "experts" (LRU, LRU-K, ARC, S3-FIFO; policy_experts.h) is its own type that
// owns its lists and byte counts and keeps its state in a part of the node. Engine<Experts...>
// holds the experts and one hash map of nodes; a node inherits the part of each of its experts
// and nothing else (an LRU node holds no LRU-K or ARC state). The engine calls every expert, in
// the order of the template arguments, for each operation on a node, so a hit costs one hash
// lookup however many experts keep it in step (an insert costs a second one when an expert
// looks for the key's history first, prepare_insert). The single-expert policies are
// ExpertPolicy<E> (an Engine<E>); the adaptive policy is an Engine of all four, the prefix policy
// kept in step beside it, and shadow caches that score the experts and choose whose evictions
// it follows.
#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "cache/policy.h"
#include "cache/policy_experts.h"

namespace gdkv::cache {
namespace {

using experts::ArcExpert;
using experts::Expert;
using experts::kArc;
using experts::kExpertNames;
using experts::kExperts;
using experts::kLruK;
using experts::kPrefix;
using experts::kS3;
using experts::LruExpert;
using experts::LruKExpert;
using experts::S3FifoExpert;

// A key's node in an Engine<E...>: the key, its size, whether it is resident, and each expert's
// part (its lists' links and its state).
template <template <class> class... E>
struct NodeT : E<NodeT<E...>>::Part... {
  NsKey key;
  uint64_t size = 0;
  bool resident = false;
};

// The node map and the experts E: every operation calls each expert, in the order of E. It does
// not choose whose victim goes: its owner asks victim(leader) and then evict_node.
template <template <class> class... E>
class Engine {
 public:
  using Node = NodeT<E...>;

  explicit Engine(const PolicyOptions& o) : experts_(E<Node>(o)...) {}

  // `key` (not resident) will be added with `size` bytes: the experts may look at its node (a
  // ghost or history entry); the lookup is made only if one does.
  void prepare_insert(const NsKey& key, uint64_t size, AddKind kind) {
    auto find = [&]() -> const Node* {
      auto it = nodes_.find(key);
      return it == nodes_.end() ? nullptr : &it->second;
    };
    each([&](auto& e) { e.prepare_insert(find, size, kind); });
  }

  // REQUIRES: key not resident.
  void add(const NsKey& key, uint64_t size, uint64_t now, AddKind kind) {
    auto [it, fresh] = nodes_.try_emplace(key);
    Node* n = &it->second;
    if (fresh) n->key = key;
    n->resident = true;
    ++resident_;
    resident_bytes_ += size;
    // Each expert takes n out of its history or ghost list at its old size, then links it with
    // the new one; the node takes the new size after all of them.
    each([&](auto& e) { e.add(n, size, now, kind, release_fn()); });
    n->size = size;
  }

  // A hit of resident n, now `size` bytes. The experts see the old size in n->size.
  void touch(Node* n, uint64_t size, uint64_t now) {
    resident_bytes_ = resident_bytes_ - n->size + size;
    each([&](auto& e) { e.access(n, size, now); });
    n->size = size;
  }

  // Forgets a resident key (no history); false if it is not resident.
  bool remove(const NsKey& key) {
    Node* n = find_resident(key);
    if (n == nullptr) return false;
    each([&](auto& e) { e.remove(n); });
    leave(n);
    release(n);
    return true;
  }

  // The node expert `leader` (one of E) would evict next. REQUIRES: entries() > 0.
  Node* victim(Expert leader) {
    Node* n = nullptr;
    each([&](auto& e) {
      if (e.kId == leader) n = e.victim();
    });
    return n;
  }

  // Evicts resident n: each expert moves it into its history, then drops what its bounds no
  // longer allow. n may be freed.
  void evict_node(Node* n) {
    each([&](auto& e) { e.to_history(n); });
    leave(n);
    release(n);  // n may be gone from here on: the trims free what they drop
    each([&](auto& e) { e.trim(resident_, release_fn()); });
  }

  Node* find_resident(const NsKey& key) {
    auto it = nodes_.find(key);
    return it != nodes_.end() && it->second.resident ? &it->second : nullptr;
  }
  size_t entries() const { return resident_; }
  uint64_t resident_bytes() const { return resident_bytes_; }

  void collect(MetricWriter& w) const {
    std::apply([&](const auto&... e) { (e.collect(w), ...); }, experts_);
  }

 private:
  // Calls f with each expert, in order.
  template <class F>
  void each(F&& f) {
    std::apply([&](auto&... e) { (f(e), ...); }, experts_);
  }

  // The node left the cache (all experts are done with its resident state).
  void leave(Node* n) {
    n->resident = false;
    --resident_;
    resident_bytes_ -= n->size;
  }

  // Frees the node once no expert remembers it.
  void release(Node* n) {
    if (n->resident) return;
    if (std::apply([&](const auto&... e) { return (e.remembers(*n) || ...); }, experts_)) return;
    nodes_.erase(n->key);
  }
  auto release_fn() {
    return [this](Node* n) { release(n); };
  }

  std::tuple<E<Node>...> experts_;
  std::unordered_map<NsKey, Node, NsKeyHash> nodes_;
  size_t resident_ = 0;
  uint64_t resident_bytes_ = 0;
};

// A policy of one expert: "lru", "lru-k", "arc" or "s3-fifo" (and the adaptive policy's shadows).
template <template <class> class E>
class ExpertPolicy final : public EvictionPolicy {
 public:
  using Node = typename Engine<E>::Node;

  explicit ExpertPolicy(const PolicyOptions& o) : engine_(o) {}

  const char* name() const override { return kExpertNames[kId]; }

  void prepare_insert(const NsKey& key, uint64_t size, AddKind kind) override {
    engine_.prepare_insert(key, size, kind);
  }
  void add(const NsKey& key, uint64_t size, uint64_t now, AddKind kind) override {
    engine_.add(key, size, now, kind);
  }
  void record_access(const NsKey& key, uint64_t size, uint64_t now) override {
    if (Node* n = engine_.find_resident(key)) engine_.touch(n, size, now);
  }
  void remove(const NsKey& key) override { engine_.remove(key); }
  bool evict(NsKey* victim) override {
    if (engine_.entries() == 0) return false;
    Node* n = engine_.victim(kId);
    *victim = n->key;
    engine_.evict_node(n);
    return true;
  }
  void evict_key(const NsKey& key) override {
    if (Node* n = engine_.find_resident(key)) engine_.evict_node(n);
  }
  size_t entries() const override { return engine_.entries(); }
  void collect(MetricList& out) const override {
    MetricWriter w(out);
    engine_.collect(w);
  }

  // For the adaptive policy's shadows (shadow_reference).
  Node* find_resident(const NsKey& key) { return engine_.find_resident(key); }
  void touch(Node* n, uint64_t size, uint64_t now) { engine_.touch(n, size, now); }
  uint64_t resident_bytes() const { return engine_.resident_bytes(); }

 private:
  static constexpr Expert kId = E<Node>::kId;
  Engine<E> engine_;
};

// A shadow cache over any policy (the adaptive policy's prefix expert): keys and sizes only, with
// the calls shadow_reference makes of an ExpertPolicy.
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

// The adaptive policy: an Engine of all four experts and the prefix policy, both kept in step with
// the cache; evictions follow the leader (one of the five).
class AdaptivePolicy final : public EvictionPolicy {
 public:
  using Experts = Engine<LruExpert, LruKExpert, ArcExpert, S3FifoExpert>;
  using Node = Experts::Node;

  explicit AdaptivePolicy(const PolicyOptions& o)
      : options_(o), k_(o.k), c_(o.capacity_bytes), engine_(o), prefix_(make_prefix_policy(o)) {
    for (uint8_t e = 0; e < kExperts; ++e) {
      if (o.pin_expert == kExpertNames[e]) leader_ = e;
    }
    adaptive_ = o.pin_expert.empty();
    if (adaptive_) {
      leader_ = kPrefix;  // until the shadows know better: it is rarely far off on KV traffic
      reshard(ideal_shift(o.expected_entries));
    }
  }

  const char* name() const override { return "adaptive"; }

  void prepare_insert(const NsKey& key, uint64_t size, AddKind kind) override {
    prefix_->prepare_insert(key, size, kind);
    engine_.prepare_insert(key, size, kind);
  }

  void add(const NsKey& key, uint64_t size, uint64_t now, AddKind kind) override {
    engine_.add(key, size, now, kind);
    prefix_->add(key, size, now, kind);
    if (adaptive_) observe(key, size, now, kind);
  }

  void record_access(const NsKey& key, uint64_t size, uint64_t now) override {
    Node* n = engine_.find_resident(key);
    if (n == nullptr) return;
    engine_.touch(n, size, now);
    prefix_->record_access(n->key, size, now);
    if (adaptive_) observe(n->key, size, now, AddKind::kDemand);
  }

  void remove(const NsKey& key) override {
    prefix_->remove(key);  // it forgets a remembered key too
    if (!engine_.remove(key)) return;
    if (adaptive_) {
      for (uint8_t e = 0; e < kExperts; ++e) with_shadow(e, [&](auto& s) { s.remove(key); });
    }
  }

  bool evict(NsKey* victim) override {
    if (engine_.entries() == 0) return false;
    if (leader_ == kPrefix) {
      NsKey v;
      Node* n = nullptr;
      if (!prefix_->evict(&v) || (n = engine_.find_resident(v)) == nullptr) return false;  // never
      *victim = v;
      engine_.evict_node(n);
      return true;
    }
    Node* n = engine_.victim(static_cast<Expert>(leader_));
    prefix_->evict_key(n->key);
    *victim = n->key;
    engine_.evict_node(n);
    return true;
  }

  void evict_key(const NsKey& key) override {
    Node* n = engine_.find_resident(key);
    if (n == nullptr) return;
    prefix_->evict_key(key);
    engine_.evict_node(n);
  }

  void record_chain(const NsKey& key, const NsKey& pred) override {
    prefix_->record_chain(key, pred);
    if (adaptive_ && shadow_prefix_ && sampled(key) && sampled(pred)) {
      shadow_prefix_->record_chain(key, pred);
    }
  }
  bool uses_chains() const override { return true; }

  size_t entries() const override { return engine_.entries(); }

  void collect(MetricList& out) const override {
    MetricWriter w(out);
    engine_.collect(w);
    prefix_->collect(out);
    for (uint8_t e = 0; e < kExperts; ++e) {
      const std::string name = e == kLruK ? "lru-" + std::to_string(k_) : kExpertNames[e];
      w.gauge("cache_adaptive_expert_score",
              "adaptive policy: recent hits of each expert policy on its shadow cache", score_[e],
              {{"expert", name}});
      w.gauge("cache_adaptive_leader",
              "adaptive policy: 1 for the expert whose evictions it follows",
              e == leader_ ? 1.0 : 0.0, {{"expert", name}});
    }
    w.counter("cache_adaptive_switches_total", "adaptive policy: times the leading expert changed",
              static_cast<double>(switches_));
  }

 private:
  // ---- Adaptive ----
  //
  // No single policy wins at every size on KV-cache traffic: LRU-2 (frequency) wins when the
  // cache is small next to the working set, LRU (recency) when it is large, ARC often in between.
  // The adaptive policy keeps all four (with S3-FIFO) as experts ordering the cache's entries (its
  // engine), and also runs each alone on a shadow cache of the same capacity that holds keys only
  // and sees the same references. Shadow hits, halved every epoch (several turnovers of the cache),
  // score each expert on the recent past, and evictions follow the best. In a steady workload the
  // cache converges on the contents the best expert would have; a change of workload moves the lead
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
    shadow_arc_ = std::make_unique<ExpertPolicy<ArcExpert>>(so);
    shadow_lruk_ = std::make_unique<ExpertPolicy<LruKExpert>>(so);
    shadow_lru_ = std::make_unique<ExpertPolicy<LruExpert>>(so);
    shadow_s3_ = std::make_unique<ExpertPolicy<S3FifoExpert>>(so);
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
    if (shift_ < kMaxShift && (engine_.entries() >> (shift_ + 1)) >= kShadowEntries) {
      reshard(ideal_shift(engine_.entries()));
    }
    if (++refs_ >= epoch_) {
      refs_ = 0;
      epoch_ = std::max<uint64_t>(kMinEpoch, 4 * engine_.entries());
      for (double& s : score_) s *= 0.5;
      // Fewer entries than the sample was sized for (the first guess may be off): sample more
      // densely, but only once the cache has filled, or every step of the filling would restart
      // the shadows.
      if (const uint32_t want = ideal_shift(engine_.entries());
          want < shift_ && engine_.resident_bytes() >= c_ / 4 * 3) {
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

  const PolicyOptions options_;
  const uint32_t k_;
  const uint64_t c_;

  Experts engine_;
  std::unique_ptr<EvictionPolicy> prefix_;  // the prefix expert, in step with the cache
  bool adaptive_ = false;
  uint8_t leader_ = kArc;  // an Expert (make_policy accepts only a pinned name that is one)
  // The shadows (single-expert policies: keys only, sampled).
  std::unique_ptr<ExpertPolicy<ArcExpert>> shadow_arc_;
  std::unique_ptr<ExpertPolicy<LruKExpert>> shadow_lruk_;
  std::unique_ptr<ExpertPolicy<LruExpert>> shadow_lru_;
  std::unique_ptr<ExpertPolicy<S3FifoExpert>> shadow_s3_;
  std::unique_ptr<Shadow> shadow_prefix_;
  std::array<double, kExperts> score_{};
  uint32_t shift_ = 0;
  uint64_t shadow_capacity_ = 0;
  uint64_t refs_ = 0;
  uint64_t epoch_ = kMinEpoch;
  uint64_t switches_ = 0;
};

}  // namespace

namespace {

// Every policy, by name, in the order the docs list them: the one list of names.
struct NamedPolicy {
  const char* name;
  std::unique_ptr<EvictionPolicy> (*make)(const PolicyOptions& o);
};
bool probation_ok(const PolicyOptions& o) {
  return o.probation_share >= 0 && o.probation_share <= 1;
}
constexpr NamedPolicy kPolicies[] = {
    {"adaptive",
     [](const PolicyOptions& o) -> std::unique_ptr<EvictionPolicy> {
       PolicyOptions a = o;
       a.k = 2;
       if (!probation_ok(o)) return nullptr;
       if (!a.pin_expert.empty() && std::find(std::begin(kExpertNames), std::end(kExpertNames),
                                              a.pin_expert) == std::end(kExpertNames)) {
         return nullptr;
       }
       return std::make_unique<AdaptivePolicy>(a);
     }},
    {"prefix",
     [](const PolicyOptions& o) { return probation_ok(o) ? make_prefix_policy(o) : nullptr; }},
    {"lru-k",
     [](const PolicyOptions& o) -> std::unique_ptr<EvictionPolicy> {
       if (o.k < 1 || o.k > kMaxK) return nullptr;
       return std::make_unique<ExpertPolicy<LruKExpert>>(o);
     }},
    {"lru",
     [](const PolicyOptions& o) -> std::unique_ptr<EvictionPolicy> {
       return std::make_unique<ExpertPolicy<LruExpert>>(o);
     }},
    {"arc",
     [](const PolicyOptions& o) -> std::unique_ptr<EvictionPolicy> {
       return std::make_unique<ExpertPolicy<ArcExpert>>(o);
     }},
    {"s3-fifo",
     [](const PolicyOptions& o) -> std::unique_ptr<EvictionPolicy> {
       return std::make_unique<ExpertPolicy<S3FifoExpert>>(o);
     }},
};

}  // namespace

std::vector<std::string> policy_names() {
  std::vector<std::string> names;
  for (const NamedPolicy& p : kPolicies) names.emplace_back(p.name);
  return names;
}

std::unique_ptr<EvictionPolicy> make_policy(std::string_view name, const PolicyOptions& o) {
  for (const NamedPolicy& p : kPolicies) {
    if (name == p.name) return p.make(o);
  }
  return nullptr;
}

}  // namespace gdkv::cache
