// Metrics out of the process: Prometheus text exposition (format 0.0.4) of a MetricList, the
// table `gdkv stat` prints, an HTTP server answering GET /metrics (and /removed, the feed of
// removed keys), and the copy-engine peak that DMA utilisation is measured against.
//
// Exposition: every name gets the `gdkv_` prefix (unless it has it already) and characters
// Prometheus does not allow become '_'; samples of one name are grouped under one HELP and one
// TYPE line (the first sample's help and type), in order of first appearance; label values are
// escaped (\\, \", \n).
//
// MetricsServer: one thread with a poll() loop. Each connection gets one response and is closed;
// requests over 8 KiB of headers get 431, malformed ones 400, other methods 405, other paths 404;
// a connection idle or unfinished after 5 s is dropped and at most 64 are served at once, so slow
// or hostile clients cannot stall it or make it grow. The source callback runs on the server
// thread (collect() functions are thread-safe).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "gdkv/copy_engine.h"
#include "gdkv/key.h"
#include "gdkv/metrics.h"
#include "gdkv/result.h"

namespace gdkv {

// Prometheus text exposition format 0.0.4.
std::string prometheus_text(const MetricList& metrics);

// A fixed-width table (metric, labels, value), one sample per line, grouped as above.
std::string metrics_table(const MetricList& metrics);

// The keys the store no longer holds, in the order it reported them (Backend::set_removal_handler),
// for subscribers that follow them by polling: gdkvd serves it at /removed on the metrics port
// (every namespace, for routers) and, one namespace at a time, as the vendor log page C0h of its
// vfio-user device (docs/integrations.md, "KV events"). Each removal gets the next sequence number
// (from 1); the newest `capacity` are kept. Thread-safe; add() is a short critical section,
// callable from a backend's threads, and readers copy what they need under the lock and format it
// outside, so a subscriber never holds the data path up for longer than a bounded copy.
class RemovalLog {
 public:
  struct Record {
    uint64_t seq;
    uint32_t nsid;  // the backend namespace; 0 (with an empty key): removals may have been missed
    Key key;
  };
  // What one read returns (slice()).
  struct Slice {
    uint64_t boot = 0;   // this log's life (see json())
    uint64_t last = 0;   // the newest sequence number given (0: none yet)
    uint64_t first = 0;  // the oldest kept (last + 1 when none)
    // The cursor to pass as `after` next: the newest sequence number this read looked at (so a
    // namespace's subscriber moves past other namespaces' records); `last` without `after`.
    uint64_t next = 0;
    bool lost = false;  // records were dropped before they were read, or `after` is not of this
                        // life (after > last), or a record with nsid 0 was passed over
    bool more = false;  // records after `next` remain: read again at once
    std::vector<Record> records;  // oldest first
  };

  explicit RemovalLog(size_t capacity = 65536);
  void add(uint32_t nsid, const Key& key);  // nsid 0, empty key: removals may have been missed
  // The records after `after`, oldest first: at most `max` of them, looking at no more than
  // `max_scan` records. With `nsid` only that backend namespace's records are returned (a record
  // with nsid 0 sets `lost` instead); without it every record is, those with nsid 0 included.
  // Without `after` (nullopt) no records: a new subscriber starts from `last`.
  Slice slice(std::optional<uint64_t> after, size_t max,
              std::optional<uint32_t> nsid = std::nullopt, size_t max_scan = 16384) const;
  // The answer to GET /removed[?after=SEQ] as JSON (slice() of every namespace):
  //   {"boot": B, "last": L, "first": F, "lost": bool, "removed": [[seq, nsid, "hex key"], ...]}
  // B names this log's life (a new one after a restart: a subscriber's cursor is then void);
  // L is the newest sequence number given (0: none yet); F the oldest kept (L + 1 when none).
  // Without `after` (nullopt) no records: a new subscriber starts from L. With it, the records
  // after `after`, oldest first, at most `max`; "lost" says that some were dropped before the
  // subscriber read them (F > after + 1) or that `after` is not of this life (after > L).
  std::string json(std::optional<uint64_t> after, size_t max = 4096) const;

 private:
  const size_t capacity_;
  const uint64_t boot_;
  mutable std::mutex mu_;
  std::deque<Record> records_;
  uint64_t last_ = 0;
};

class MetricsServer {
 public:
  // Listens on bind_address:port (port 0: the kernel picks a free one, see port()) and serves
  // `source()` at /metrics, and `removals` (when not null; it must outlive the server) at
  // /removed. An Error (gdkv/result.h) with a clear message when it cannot listen.
  static Result<std::unique_ptr<MetricsServer>> start(uint16_t port,
                                                      std::function<MetricList()> source,
                                                      const std::string& bind_address = "127.0.0.1",
                                                      const RemovalLog* removals = nullptr);
  ~MetricsServer();  // stops the thread and closes every connection
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  uint16_t port() const;  // the port it listens on

 private:
  MetricsServer(uint16_t port, std::function<MetricList()> source, const std::string& bind_address,
                const RemovalLog* removals);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct CopyPeakOptions {
  size_t bytes = size_t{32} << 20;  // bytes per timed copy, default 32 MiB
  uint32_t rounds = 4;              // timed copies; the fastest counts (one untimed before)
  // Where to copy from and to; null: host buffers allocated here. The GPU runtime passes pinned
  // host memory and device memory so the link itself is measured. Each needs `bytes` bytes.
  const void* src = nullptr;
  MemKind src_kind = MemKind::kHost;
  void* dst = nullptr;
  MemKind dst_kind = MemKind::kHost;
};

// The engine's peak copy bandwidth in bytes per second (0 if a copy failed), for the
// dma_link_peak_bytes_per_second gauge. Takes tens of milliseconds.
// REQUIRES: called on the thread that owns `engine` (or before its reactor starts).
double measure_copy_peak_bps(CopyEngine& engine, const CopyPeakOptions& options = {});

}  // namespace gdkv
