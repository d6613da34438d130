// The rados backend's background ops (access time refreshes, delete notifications), its
// watches (delete notifications from other nodes, the set of evicting nodes) and the
// maintenance thread that re-establishes them and runs eviction passes.
#include "backend/rados/rados_internal.h"

namespace gdkv::rados_detail {

RadosBackend::Background* RadosBackend::background(std::atomic<uint64_t>* failures) {
  auto* b = new Background{this, nullptr, failures, {}};
  live_.fetch_add(1, std::memory_order_relaxed);
  b->c = librados::Rados::aio_create_completion(b, [](librados::completion_t, void* arg) {
    auto* bg = static_cast<Background*>(arg);
    if (bg->c->get_return_value() < 0) bg->failures->fetch_add(1, std::memory_order_relaxed);
    bg->self->end_background(bg);
  });
  return b;
}

void RadosBackend::end_background(Background* b) {
  b->c->release();
  delete b;
  live_.fetch_sub(1, std::memory_order_release);
}

// A read found the block's access time older than the interval: refresh it. The object must
// still exist (assert_exists), so a touch never recreates a block deleted meanwhile.
void RadosBackend::touch(librados::IoCtx* io, const Key& key) {
  Background* b = background(&touch_failures_);
  librados::ObjectWriteOperation w;
  w.assert_exists();
  librados::bufferlist abl;
  abl.append(std::to_string(wall_ms()));
  w.setxattr(rados::kAtimeXattr, abl);
  atime_updates_.fetch_add(1, std::memory_order_relaxed);
  if (io->aio_operate(key.hex(), b->c, &w, librados::OPERATION_FULL_TRY) < 0) {
    touch_failures_.fetch_add(1, std::memory_order_relaxed);
    end_background(b);
  }
}

// Tells the other nodes' backends that `key` is gone: {nsid (le32), key length, key bytes,
// the RADOS namespace}. Receivers with another namespace prefix (another view of the pool)
// ignore it.
void RadosBackend::notify_delete(uint32_t nsid, const Key& key) {
  if (options_.events_object.empty()) return;
  Background* b = background(&notify_failures_);
  char head[5 + nvme::kMaxKeyLength];
  std::memcpy(head, &nsid, 4);
  head[4] = static_cast<char>(key.len);
  std::memcpy(head + 5, key.bytes, key.len);
  b->payload.append(head, 5 + key.len);
  b->payload.append(options_.namespace_prefix + std::to_string(nsid));
  notifies_sent_.fetch_add(1, std::memory_order_relaxed);
  if (base_.aio_notify(options_.events_object, b->c, b->payload, options_.ceph_timeout_ms,
                       nullptr) < 0) {
    notify_failures_.fetch_add(1, std::memory_order_relaxed);
    end_background(b);
  }
}

void RadosBackend::Watcher::handle_notify(uint64_t notify_id, uint64_t cookie, uint64_t notifier,
                                          librados::bufferlist& bl) {
  if (events_) b_->on_notify(notifier, bl);
  librados::bufferlist none;
  b_->base_.notify_ack(b_->watch_oid(events_), notify_id, cookie, none);
}

void RadosBackend::Watcher::handle_error(uint64_t, int err) { b_->on_watch_error(events_, err); }

// Deletes through this node, deletes other nodes notified (only with an invalidation handler:
// it is what watches) and this node's evictions; another node's evictions are its own feed's.
void RadosBackend::set_removal_handler(InvalidationHandler h) { removals_.set(std::move(h)); }

void RadosBackend::set_invalidation_handler(InvalidationHandler h) {
  const bool want = static_cast<bool>(h);
  handler_.set(std::move(h));
  if (!want || options_.events_object.empty()) return;
  std::lock_guard lk(maint_mu_);
  events_.wanted = true;
  ensure_watch(events_, true);  // now, so notifications flow from the first op on
}

void RadosBackend::on_notify(uint64_t notifier, librados::bufferlist& bl) {
  if (notifier == rados_.get_instance_id()) return;  // our own Delete: the caller knows
  std::string m;
  bl.begin().copy(bl.length(), m);
  if (m.size() < 6) return;
  uint32_t nsid = 0;
  std::memcpy(&nsid, m.data(), 4);
  Key key;
  key.len = static_cast<uint8_t>(m[4]);
  if (nsid == 0 || key.len == 0 || key.len > nvme::kMaxKeyLength || m.size() < 5u + key.len) {
    return;
  }
  std::memcpy(key.bytes, m.data() + 5, key.len);
  if (m.compare(5 + key.len, std::string::npos, options_.namespace_prefix + std::to_string(nsid)) !=
      0) {
    return;  // another view of the pool
  }
  invalidations_received_.fetch_add(1, std::memory_order_relaxed);
  handler_(nsid, key);
  removals_(nsid, key);
}

// The watch broke (our session to its OSD was lost for longer than the watch timeout, or
// notifications may have been missed): notifications may have been lost, so whoever keeps
// copies drops or rechecks them all, now and again once the watch is back.
void RadosBackend::on_watch_error(bool events, int err) {
  watch_errors_.fetch_add(1, std::memory_order_relaxed);
  std::fprintf(stderr, "gdkv rados: watch on %s lost (%s); re-establishing\n",
               watch_oid(events).c_str(), std::strerror(-err));
  {
    std::lock_guard lk(maint_mu_);
    Watch& w = events ? events_ : evictors_;
    w.live = false;
    w.lost = true;
  }
  maint_cv_.notify_all();
  if (events) {
    handler_(0, Key{});
    removals_(0, Key{});
  }
}

// REQUIRES: maint_mu_ held. Blocks for up to the op timeout.
void RadosBackend::ensure_watch(Watch& w, bool events) {
  if (!w.wanted || w.live) return;
  if (w.ctx) {
    base_.unwatch2(w.handle);  // the broken one; its error is of no interest
    w.ctx.reset();
  }
  w.ctx = std::make_unique<Watcher>(this, events);
  const int r = base_.watch2(watch_oid(events), &w.handle, w.ctx.get());
  if (r < 0) {
    w.ctx.reset();
    return;  // retried by the maintenance thread
  }
  const bool again = w.lost;
  w.live = true;
  w.lost = false;
  // A watch that had broken is back: what was deleted in between was not notified.
  if (events && again) {
    handler_(0, Key{});
    removals_(0, Key{});
  }
}

// REQUIRES: the maintenance thread has stopped (nothing re-establishes a watch meanwhile).
void RadosBackend::unwatch_all() {
  {
    std::lock_guard lk(maint_mu_);
    for (Watch* w : {&events_, &evictors_}) {
      if (w->ctx) base_.unwatch2(w->handle);
      w->live = false;
      w->wanted = false;
    }
  }
  // Outside the lock: a callback still running (on_watch_error takes maint_mu_) must finish
  // before the flush returns. No watch callback runs after this.
  rados_.watch_flush();
  std::lock_guard lk(maint_mu_);
  events_.ctx.reset();
  evictors_.ctx.reset();
}

// Re-establishes broken watches (every second) and runs eviction passes.
void RadosBackend::run_maintenance() {
  std::unique_lock lk(maint_mu_);
  evictors_.wanted = options_.evict;
  auto next_pass = Clock::now() + std::chrono::milliseconds(options_.evict_interval_ms);
  while (!stop_maint_) {
    ensure_watch(events_, true);
    ensure_watch(evictors_, false);
    const auto wake = std::min(next_pass, Clock::now() + std::chrono::seconds(1));
    maint_cv_.wait_until(lk, wake, [this] { return stop_maint_ || full_seen_.load(); });
    if (stop_maint_ || !options_.evict) continue;
    if (Clock::now() < next_pass && !full_seen_.load()) continue;
    lk.unlock();
    evict_pass();
    lk.lock();
    next_pass = Clock::now() + std::chrono::milliseconds(options_.evict_interval_ms);
  }
}

}  // namespace gdkv::rados_detail
