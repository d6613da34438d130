// The rados backend's metrics (collect), the pool statistics info() returns (refresh_stats)
// and the error count by status.
#include "backend/rados/rados_internal.h"

namespace gdkv::rados_detail {

void RadosBackend::collect(MetricList& out) const {
  MetricWriter w(out, {{"backend", "rados"}});
  const auto counter = [&](const char* name, const char* help, uint64_t v,
                           MetricLabels extra = {}) {
    w.counter(name, help, static_cast<double>(v), std::move(extra));
  };
  const auto load = [](const std::atomic<uint64_t>& a) {
    return a.load(std::memory_order_relaxed);
  };
  counter("backend_ops_total", "ops submitted to the backend", load(ops_));
  for (size_t i = 0; i < kKinds; ++i) {
    counter("rados_ops_total", "rados backend ops by kind", load(kind_ops_[i]),
            {{"op", backend_op_name(static_cast<BackendOpKind>(i))}});
  }
  counter("backend_errors_total",
          "ops that failed (statuses other than success, key not found, key exists)",
          load(errors_));
  counter("backend_timeouts_total", "ops that hit the op timeout (82h)", load(timeouts_));
  counter("backend_checksum_failures_total",
          "values whose record header or checksum did not match (88h)", load(checksum_failures_));
  counter("rados_raw_reads_total", "values read without a gdkv record header (unverified)",
          load(raw_reads_));
  counter("rados_submit_thread_ops_total",
          "ops started on the submit thread (Stores, and ops queued behind one)",
          load(submit_thread_ops_));
  counter("backend_read_bytes_total", "value bytes read", load(read_bytes_));
  counter("backend_written_bytes_total", "value bytes stored", load(written_bytes_));
  counter("rados_atime_updates_total",
          "access times refreshed by reads (at most one per block "
          "per atime interval)",
          load(atime_updates_));
  counter("rados_atime_update_failures_total", "access time refreshes that failed",
          load(touch_failures_));
  counter("rados_delete_notifies_total", "Deletes announced to the other nodes",
          load(notifies_sent_));
  counter("rados_delete_notify_failures_total",
          "delete notifications that failed or were not acknowledged by every node in time",
          load(notify_failures_));
  counter("rados_remote_deletes_total", "Deletes by other nodes this node was told of",
          load(invalidations_received_));
  counter("rados_watch_errors_total", "watches lost (notifications may have been missed)",
          load(watch_errors_));
  counter("rados_evict_passes_total", "eviction passes that found the pool over its high mark",
          load(evict_passes_));
  counter("rados_evictions_total", "blocks this node evicted from the pool", load(evictions_));
  counter("rados_evicted_bytes_total", "value bytes this node evicted", load(evicted_bytes_));
  counter("rados_evict_kept_total",
          "eviction candidates kept because they were read or stored after the scan",
          load(evict_kept_));
  const auto gauge = [&](const char* name, const char* help, double v) { w.gauge(name, help, v); };
  gauge("rados_pool_fill_ratio",
        "the pool's fill at the last eviction check (of its capacity or quota, else the "
        "cluster's raw fill)",
        static_cast<double>(load(fill_ppm_)) / 1e6);
  gauge("rados_pool_used_bytes", "the pool's bytes at the last eviction check",
        static_cast<double>(load(pool_used_bytes_)));
  gauge("rados_pool_capacity_bytes", "what the pool's fill is measured against",
        static_cast<double>(load(capacity_bytes_)));
  gauge("rados_evict_nodes", "live evicting nodes sharing the last pass",
        static_cast<double>(load(members_)));
  gauge("rados_evictions_per_second",
        "blocks this node evicted per second, between its last two evicting passes",
        static_cast<double>(load(evict_rate_milli_)) / 1e3);
  gauge("rados_evict_last_pass_seconds", "duration of the last eviction pass",
        static_cast<double>(load(last_pass_ms_)) / 1e3);
  gauge("backend_inflight", "ops submitted and not yet completed",
        static_cast<double>(inflight_.load(std::memory_order_relaxed)));
  // Namespaces with a quota, labelled as every tier labels them.
  for (const auto& q : quotas_) {
    add_namespace_metrics(out, "rados", q.nsid, static_cast<double>(q.held.load()),
                          static_cast<double>(q.evictions.load()));
  }
}

void RadosBackend::refresh_stats() const {
  std::list<std::string> pools{options_.pool};
  librados::stats_map stats;
  BackendInfo i;
  i.name = "rados";
  if (rados_.get_pool_stats(pools, stats) == 0) {
    if (auto it = stats.find(options_.pool); it != stats.end()) {
      i.keys = it->second.num_objects;  // the whole pool, every namespace
      i.bytes_used = it->second.num_bytes;
    }
  }
  librados::cluster_stat_t cs{};
  if (rados_.cluster_stat(cs) == 0) i.capacity_bytes = cs.kb * 1024;  // raw, before replication
  const Fill f = read_fill();
  if (f.capacity != 0) i.bytes_used = f.used;  // one copy, not every replica
  i.fill_ratio = f.ratio;
  i.fill_capacity_bytes = f.capacity;
  i.evictions = evictions_.load(std::memory_order_relaxed);
  std::lock_guard lk(info_mu_);
  info_ = i;
  stats_at_ = Clock::now();
  stats_queued_ = false;
}

void RadosBackend::count_status(Status s) noexcept {
  if (s != Status::kSuccess && s != Status::kKeyNotExist && s != Status::kKeyExists) {
    errors_.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace gdkv::rados_detail
