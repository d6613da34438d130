// The rados backend's eviction: the pool's fill, the live evicting nodes, and the pass that
// removes the coldest blocks of this node's slice of the pool (docs/rados.md, "The pool as a
// cache: access times and eviction").
#include <map>
#include <string_view>

#include "backend/rados/rados_internal.h"

namespace gdkv::rados_detail {

// The pool's stored bytes (one copy: what quotas count; librados' pool statistics count every
// replica) and the bytes it can still take (max_avail: the cluster's free space over the pool's
// replication or coding, below the full ratio), from the monitor's `df`.
bool RadosBackend::pool_df(uint64_t* stored, uint64_t* max_avail) const {
  librados::bufferlist in, out;
  std::string outs;
  if (rados_.mon_command(R"({"prefix": "df", "format": "json"})", in, &out, &outs) < 0) {
    return false;
  }
  const std::string json(out.c_str(), out.length());
  size_t at = std::string::npos;
  for (const char* form : {"\"name\":\"", "\"name\": \""}) {
    at = json.find(form + options_.pool + "\"");
    if (at != std::string::npos) break;
  }
  if (at == std::string::npos) return false;
  const auto number = [&](const char* field, uint64_t* v) {
    const auto f = json.find(field, at);
    if (f == std::string::npos) return false;
    *v = std::strtoull(json.c_str() + f + std::strlen(field), nullptr, 10);  // skips spaces
    return true;
  };
  return number("\"stored\":", stored) && number("\"max_avail\":", max_avail);
}

RadosBackend::Fill RadosBackend::read_fill() const {
  Fill f;
  uint64_t avail = 0;
  if (!pool_df(&f.used, &avail)) return f;
  f.capacity = options_.pool_capacity_bytes;
  if (f.capacity == 0) f.capacity = pool_quota();
  f.quota = f.capacity != 0;
  if (!f.quota) f.capacity = f.used + avail;  // what the pool holds and can still take
  if (f.capacity != 0) f.ratio = static_cast<double>(f.used) / static_cast<double>(f.capacity);
  return f;
}

// The pool's byte quota (0: none or unknown).
uint64_t RadosBackend::pool_quota() const {
  const std::string cmd =
      R"({"prefix": "osd pool get-quota", "pool": ")" + options_.pool + R"(", "format": "json"})";
  librados::bufferlist in, out;
  std::string outs;
  if (rados_.mon_command(cmd, in, &out, &outs) < 0) return 0;
  const std::string json(out.c_str(), out.length());
  const auto at = json.find("\"quota_max_bytes\":");
  if (at == std::string::npos) return 0;
  return std::strtoull(json.c_str() + at + 18, nullptr, 10);
}

// The live evicting nodes, sorted, and our place among them; false if we are not among them.
bool RadosBackend::membership(size_t* index, size_t* count, std::vector<uint64_t>* ids) {
  std::list<obj_watch_t> watchers;
  if (base_.list_watchers(watch_oid(false), &watchers) < 0) return false;
  ids->clear();
  for (const auto& w : watchers) ids->push_back(static_cast<uint64_t>(w.watcher_id));
  std::sort(ids->begin(), ids->end());
  ids->erase(std::unique(ids->begin(), ids->end()), ids->end());
  const auto me = std::find(ids->begin(), ids->end(), rados_.get_instance_id());
  if (me == ids->end()) return false;
  *index = static_cast<size_t>(me - ids->begin());
  *count = ids->size();
  return true;
}

RadosBackend::NsQuota* RadosBackend::quota_of(const std::string& nspace) {
  for (auto& q : quotas_) {
    if (q.nspace == nspace) return &q;
  }
  return nullptr;
}

// Appends gdkv's objects (hex names in namespaces starting with the prefix) in our slice of the
// hash space: of RADOS namespace `nspace`, or of all of them (librados::all_nspaces). False if
// the listing failed.
bool RadosBackend::list_slice(const std::string& nspace, size_t index, size_t count,
                              std::vector<Candidate>* out) {
  librados::IoCtx io;
  io.dup(base_);
  io.set_namespace(nspace);
  librados::ObjectCursor start, finish;
  io.object_list_slice(io.object_list_begin(), io.object_list_end(), index, count, &start, &finish);
  auto cursor = std::make_unique<librados::ObjectCursor>(start);
  while (!io.object_list_is_end(*cursor) && *cursor < finish) {
    std::vector<librados::ObjectItem> items;
    auto next = std::make_unique<librados::ObjectCursor>();
    if (io.object_list(*cursor, finish, 1024, {}, &items, next.get()) < 0) return false;
    for (auto& item : items) {
      if (item.nspace.rfind(options_.namespace_prefix, 0) != 0) continue;
      const auto k = Key::from_hex(item.oid);
      if (!k || k->hex() != item.oid) continue;
      Candidate c;
      c.nspace = item.nspace;
      c.oid = item.oid;
      c.quota = quota_of(item.nspace);
      out->push_back(std::move(c));
    }
    if (items.empty()) break;
    cursor = std::move(next);
  }
  return true;
}

// Quota'd namespaces' bytes are measured by slices: each node sees only its own. Each publishes
// its slices' bytes as an xattr of the evictors object ("gdkv.held.<client id>": "nsid:bytes"
// pairs; xattrs, not omap, so erasure-coded pools work too) and adds the other live nodes' last
// reports to its own. A report is as old as its node's last pass (one interval).

// Adds the other live nodes' reports to *held (per quotas_ entry); names the reports of nodes no
// longer watching in *stale.
void RadosBackend::add_others_held(const std::vector<uint64_t>& members,
                                   std::vector<uint64_t>* held, std::vector<std::string>* stale) {
  std::map<std::string, librados::bufferlist> attrs;
  if (base_.getxattrs(watch_oid(false), attrs) < 0) return;
  const uint64_t me = rados_.get_instance_id();
  for (auto& [name, value] : attrs) {
    if (name.compare(0, kHeldXattr.size(), kHeldXattr) != 0) continue;
    const uint64_t id = std::strtoull(name.c_str() + kHeldXattr.size(), nullptr, 10);
    if (id == me) continue;
    if (!std::binary_search(members.begin(), members.end(), id)) {
      stale->push_back(name);  // a node gone: its slices are the live nodes' now
      continue;
    }
    const std::string text(value.c_str(), value.length());
    for (const char* p = text.c_str(); *p != '\0';) {
      char* end = nullptr;
      const auto nsid = static_cast<uint32_t>(std::strtoul(p, &end, 10));
      if (end == p || *end != ':') break;
      const uint64_t bytes = std::strtoull(end + 1, &end, 10);
      for (size_t i = 0; i < quotas_.size(); ++i) {
        if (quotas_[i].nsid == nsid) (*held)[i] += bytes;
      }
      p = end;
      while (*p == ' ') ++p;
    }
  }
}

// Publishes our slices' bytes per quotas_ entry (after this pass's removals) and removes the
// stale reports.
void RadosBackend::publish_held(const std::vector<uint64_t>& mine,
                                const std::vector<std::string>& stale) {
  std::string text;
  for (size_t i = 0; i < quotas_.size(); ++i) {
    text += std::to_string(quotas_[i].nsid) + ":" + std::to_string(mine[i]) + " ";
  }
  librados::bufferlist bl;
  bl.append(text);
  librados::ObjectWriteOperation w;
  w.setxattr((std::string(kHeldXattr) + std::to_string(rados_.get_instance_id())).c_str(), bl);
  // FULL_TRY: a full pool must not park the maintenance thread. A failure only leaves the others
  // an older report.
  base_.operate(watch_oid(false), &w, librados::OPERATION_FULL_TRY);
  // One op each: another node may have removed one already (ENODATA fails its whole op).
  for (const auto& name : stale) {
    librados::ObjectWriteOperation rm;
    rm.rmxattr(name.c_str());
    base_.operate(watch_oid(false), &rm, librados::OPERATION_FULL_TRY);
  }
}

// An evicted object as the key it held (its name is the key's hex; its RADOS namespace
// namespace_prefix + nsid).
void RadosBackend::report_eviction(const Candidate& c) {
  const std::string& pre = options_.namespace_prefix;
  const auto k = Key::from_hex(c.oid);
  if (!k || c.nspace.size() <= pre.size() || c.nspace.compare(0, pre.size(), pre) != 0) return;
  uint32_t nsid = 0;
  for (size_t i = pre.size(); i < c.nspace.size(); ++i) {
    const char ch = c.nspace[i];
    if (ch < '0' || ch > '9' || nsid > 100000000) return;
    nsid = nsid * 10 + static_cast<uint32_t>(ch - '0');
  }
  if (nsid != 0) removals_(nsid, *k);
}

librados::IoCtx& RadosBackend::evict_ioctx(const std::string& nspace) {
  auto& io = evict_ns_[nspace];
  if (!io) {
    io = std::make_unique<librados::IoCtx>();
    io->dup(base_);
    io->set_namespace(nspace);
  }
  return *io;
}

// Runs `issue` for items [0, n) with at most kWindow RADOS ops in flight; each returns its
// completion (nullptr: nothing issued). Every completion has been waited for on return.
template <typename Issue, typename Done>
void RadosBackend::windowed(size_t n, Issue issue, Done done) {
  constexpr size_t kWindow = 64;
  std::deque<std::pair<size_t, librados::AioCompletion*>> flight;
  auto reap = [&] {
    auto [i, c] = flight.front();
    flight.pop_front();
    c->wait_for_complete();
    done(i, c->get_return_value());
    c->release();
  };
  for (size_t i = 0; i < n; ++i) {
    if (flight.size() == kWindow) reap();
    if (librados::AioCompletion* c = issue(i)) flight.emplace_back(i, c);
  }
  while (!flight.empty()) reap();
}

// Removes the candidates of `order` in that order until `to_free` of their bytes are gone. Each
// removal is conditional on the access time the scan saw (cmpxattr), so a block read or stored
// since is kept; removed ones are marked, reported and counted. Returns the bytes freed.
uint64_t RadosBackend::remove_coldest(const std::vector<Candidate*>& order, uint64_t to_free) {
  uint64_t freed = 0;
  size_t next = 0;
  while (freed < to_free && next < order.size()) {
    // Plan as many removals as would free the rest if they all succeed; a block touched
    // since the scan (ECANCELED) or gone (ENOENT) frees nothing, and the next round goes on.
    const size_t first = next;
    uint64_t planned = freed;
    while (planned < to_free && next < order.size()) planned += order[next++]->size;
    std::vector<std::unique_ptr<librados::ObjectWriteOperation>> writes(next - first);
    windowed(
        next - first,
        [&](size_t i) -> librados::AioCompletion* {
          const Candidate& c = *order[first + i];
          writes[i] = std::make_unique<librados::ObjectWriteOperation>();
          if (c.atime_rc == 0 && c.atime.length() != 0) {
            writes[i]->cmpxattr(rados::kAtimeXattr, LIBRADOS_CMPXATTR_OP_EQ, c.atime);
          }
          writes[i]->remove();
          auto* comp = librados::Rados::aio_create_completion();
          if (evict_ioctx(c.nspace).aio_operate(c.oid, comp, writes[i].get(),
                                                librados::OPERATION_FULL_TRY) < 0) {
            comp->release();
            return nullptr;
          }
          return comp;
        },
        [&](size_t i, int r) {
          Candidate& c = *order[first + i];
          if (r == 0) {
            c.removed = true;
            freed += c.size;
            evictions_.fetch_add(1, std::memory_order_relaxed);
            if (c.quota != nullptr) c.quota->evictions.fetch_add(1, std::memory_order_relaxed);
            report_eviction(c);
            evicted_bytes_.fetch_add(c.size, std::memory_order_relaxed);
          } else if (r == -ECANCELED) {
            evict_kept_.fetch_add(1, std::memory_order_relaxed);
          }
        });
  }
  return freed;
}

// One pass (docs/rados.md, "The pool as a cache" and "Quotas"). This node scans its slice of
// the hash space: all of gdkv's objects when the pool is past its high watermark, else only the
// quota'd namespaces' (none without quotas: the pass ends at the fill check).
//  1. Quotas: a namespace holding more than its quota (all nodes' slices: ours measured now, the
//     others' as they last reported) is trimmed to evict_low_percent of it, each node removing
//     the coldest of its own slice of that namespace in proportion (its slice's bytes scaled by
//     low x quota / held), so no node needs the others' objects.
//  2. The pool: past the high mark, the coldest blocks of the slice go until the slice is at its
//     share of the low mark; blocks of namespaces without a quota (or still over theirs) first,
//     so a flood in one namespace does not evict a namespace within its quota while the quotas
//     fit in the pool.
// A node that dies mid-pass leaves its slice to the next membership.
void RadosBackend::evict_pass() {
  const auto t0 = Clock::now();
  const Fill f = read_fill();
  fill_ppm_.store(static_cast<uint64_t>(f.ratio * 1e6), std::memory_order_relaxed);
  capacity_bytes_.store(f.capacity, std::memory_order_relaxed);
  pool_used_bytes_.store(f.used, std::memory_order_relaxed);
  // A Store refused for space (81h) forces the pass: the pool is full in the monitor's view,
  // whatever the statistics, which lag, say.
  const bool forced = full_seen_.exchange(false, std::memory_order_acq_rel);
  const bool pool_over =
      f.capacity != 0 && (f.ratio * 100 >= options_.evict_high_percent || forced);
  if (!pool_over && quotas_.empty()) return;
  size_t index = 0, count = 1;
  std::vector<uint64_t> members;
  if (!membership(&index, &count, &members)) return;  // our watch is not (yet) in: skip
  members_.store(count, std::memory_order_relaxed);
  if (pool_over) evict_passes_.fetch_add(1, std::memory_order_relaxed);

  // Scan our slice: every candidate's size and access time.
  std::vector<Candidate> cands;
  if (pool_over) {
    if (!list_slice(librados::all_nspaces, index, count, &cands)) return;
  } else {
    for (const auto& q : quotas_) {
      if (!list_slice(q.nspace, index, count, &cands)) return;
    }
  }
  std::vector<std::unique_ptr<librados::ObjectReadOperation>> reads(cands.size());
  windowed(
      cands.size(),
      [&](size_t i) -> librados::AioCompletion* {
        Candidate& c = cands[i];
        reads[i] = std::make_unique<librados::ObjectReadOperation>();
        reads[i]->stat(&c.size, &c.mtime, &c.stat_rc);
        reads[i]->getxattr(rados::kAtimeXattr, &c.atime, &c.atime_rc);
        reads[i]->set_op_flags2(librados::OP_FAILOK);
        auto* comp = librados::Rados::aio_create_completion();
        if (evict_ioctx(c.nspace).aio_operate(c.oid, comp, reads[i].get(), nullptr) < 0) {
          comp->release();
          c.stat_rc = -EIO;
          return nullptr;
        }
        return comp;
      },
      [&](size_t i, int r) {
        if (r < 0) cands[i].stat_rc = r;
        cands[i].atime_ms = parse_atime(cands[i].atime, cands[i].atime_rc);
      });
  reads.clear();
  std::erase_if(cands, [](const Candidate& c) { return c.stat_rc < 0; });
  // Coldest first (no access time counts as the oldest); the larger of two equally cold first.
  std::sort(cands.begin(), cands.end(), [](const Candidate& a, const Candidate& b) {
    return a.atime_ms != b.atime_ms ? a.atime_ms < b.atime_ms : a.size > b.size;
  });
  uint64_t slice_bytes = 0;
  for (const auto& c : cands) slice_bytes += c.size;
  const double low = options_.evict_low_percent / 100.0;

  // 1. Quotas.
  const auto slice_of = [&](std::vector<uint64_t>* mine) {
    mine->assign(quotas_.size(), 0);
    for (const auto& c : cands) {
      if (c.quota != nullptr && !c.removed) (*mine)[c.quota - quotas_.data()] += c.size;
    }
  };
  std::vector<uint64_t> mine;
  slice_of(&mine);
  std::vector<uint64_t> held = mine;
  std::vector<std::string> stale;
  if (!quotas_.empty()) add_others_held(members, &held, &stale);
  for (size_t i = 0; i < quotas_.size(); ++i) {
    const NsQuota& q = quotas_[i];
    if (held[i] <= q.limit || mine[i] == 0) continue;
    const auto target =
        static_cast<uint64_t>(static_cast<double>(mine[i]) * low * static_cast<double>(q.limit) /
                              static_cast<double>(held[i]));
    std::vector<Candidate*> order;
    for (auto& c : cands) {
      if (c.quota == &q) order.push_back(&c);
    }
    const uint64_t freed = remove_coldest(order, mine[i] - target);
    slice_bytes -= freed;
    held[i] -= freed;
  }
  slice_of(&mine);

  // 2. The pool's watermarks: our slice's share of the low one.
  if (pool_over) {
    uint64_t target = 0;
    if (f.quota) {
      target =
          static_cast<uint64_t>(low * static_cast<double>(f.capacity) / static_cast<double>(count));
    } else {
      const double fill = std::max(f.ratio, options_.evict_high_percent / 100.0);
      target = static_cast<uint64_t>(static_cast<double>(slice_bytes) * low / fill);
    }
    // Already at its share: the statistics were behind, nothing to do.
    if (slice_bytes > target) {
      std::vector<Candidate*> order;
      for (bool protected_pass : {false, true}) {
        for (auto& c : cands) {
          if (c.removed) continue;
          const bool within_quota =
              c.quota != nullptr && held[c.quota - quotas_.data()] <= c.quota->limit;
          if (within_quota == protected_pass) order.push_back(&c);
        }
      }
      remove_coldest(order, slice_bytes - target);
    }
  }

  if (!quotas_.empty()) {
    std::vector<uint64_t> before = mine;
    slice_of(&mine);
    for (size_t i = 0; i < quotas_.size(); ++i) {
      held[i] -= std::min(held[i], before[i] - mine[i]);
      quotas_[i].held.store(held[i], std::memory_order_relaxed);
    }
    publish_held(mine, stale);
  }

  const auto now = Clock::now();
  const double since = std::chrono::duration<double>(now - last_pass_at_).count();
  if (last_pass_at_ != Clock::time_point{} && since > 0) {
    evict_rate_milli_.store(
        static_cast<uint64_t>(static_cast<double>(evictions_.load() - evictions_at_last_pass_) /
                              since * 1e3),
        std::memory_order_relaxed);
  }
  last_pass_at_ = now;
  evictions_at_last_pass_ = evictions_.load();
  last_pass_ms_.store(
      static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count()),
      std::memory_order_relaxed);
}

}  // namespace gdkv::rados_detail
