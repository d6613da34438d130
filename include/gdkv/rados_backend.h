// The `rados` backend: values in a Ceph RADOS pool through librados' asynchronous C++ API, so
// every node's gdkv shares one cache. One object per key, named by the key in lower-case hex, in
// the RADOS namespace of the NVMe namespace ("ns<N>"); the value is the object's data and the
// record header (identity digest, checksum) an xattr, which erasure-coded pools support too.
// CRUSH places objects; replication or erasure coding is the pool's configuration.
//
// Thread safety: as every Backend (see backend.h). Only built when librados is found
// (GDKV_HAVE_RADOS).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "gdkv/backend.h"
#include "gdkv/result.h"

namespace gdkv {

struct RadosBackendOptions {
  std::string ceph_conf;  // path to ceph.conf; empty: $CEPH_CONF, then /etc/ceph/ceph.conf
  std::string client_name = "client.admin";  // cephx identity
  std::string keyring;                       // empty: what ceph.conf says
  std::string pool = "gdkv-rep3";            // replicated or erasure-coded: both work
  std::string namespace_prefix = "ns";       // RADOS namespace of NVMe namespace N is prefix + N
  // Milliseconds, default 5000: every op completes by then, a dead or unreachable cluster with
  // kNamespaceNotReady (82h). Must be > 0. Also bounds librados' own OSD and monitor op timeouts
  // (rounded up to seconds) and, when the configuration is slower, makes librados notice a laggy
  // OSD within a third of it, so an OSD failure costs seconds, not the whole budget.
  uint32_t ceph_timeout_ms = 5000;
  uint32_t connect_timeout_ms = 10000;  // milliseconds, default 10000: construction gives up then
  // Objects without the "gdkv.hdr" xattr (stored by `rados put` or another tool) are returned as
  // they are, unverified and counted; false: they read as unrecovered errors (88h). Default true.
  bool allow_raw_objects = true;

  // ---- The shared pool as a cache (docs/rados.md, "The pool as a cache") ----
  // Every Store stamps its object with an access time (xattr gdkv.atime, milliseconds since the
  // epoch); a Retrieve refreshes it when it is older than this many milliseconds (default 60000).
  // So recency costs one small RADOS write per block per interval per node at most, none per hit.
  uint32_t atime_interval_ms = 60000;
  // Eviction, off by default (one-shot tools; gdkvd turns it on): every evict_interval_ms each
  // node reads the pool's fill, and when it passes evict_high_percent of the pool's capacity, the
  // live nodes each remove the coldest blocks of their share of the object hash space until the
  // pool is back at evict_low_percent. Only gdkv's objects (hex names in gdkv's namespaces) go.
  bool evict = false;
  uint32_t evict_high_percent = 90;  // 1..100, > evict_low_percent
  uint32_t evict_low_percent = 80;
  uint32_t evict_interval_ms = 10000;
  // Bytes the pool may hold. 0 (default): the pool's quota (`ceph osd pool set-quota max_bytes`)
  // when it has one, else what the pool stores plus `ceph df`'s max_avail for it. Fill counts
  // stored bytes (one copy), as quotas do.
  uint64_t pool_capacity_bytes = 0;
  // Delete notifications: a backend with an invalidation handler watches this object (in the
  // pool's default namespace) and every Delete notifies it, so other nodes drop the key from
  // the tiers above their backend. Evicting nodes also watch `<events_object>.evictors`: its
  // watchers are the live nodes that split eviction. Empty: no watch, no notifications.
  std::string events_object = "gdkv.events";
  // Per-namespace limits (backend.h): bytes a RADOS namespace may hold in the pool, counted as
  // eviction counts them (one copy: the objects' sizes). Default: none. A Store larger than its
  // namespace's quota fails at once with 81h. Held to by evicting nodes (`evict` on; a backend
  // with it off, a one-shot tool, only refuses those Stores): every evict_interval_ms each node
  // measures its slice of every quota'd namespace and adds the other nodes' last reports
  // (xattrs of `<events_object>.evictors`); a namespace over its quota loses its own coldest
  // blocks until it is back at evict_low_percent of it, each node trimming its own slice in
  // proportion. Periodic, so a namespace can pass its quota by what is stored into it in about
  // two intervals and a pass. Pool-wide eviction takes blocks of namespaces within their quota
  // last. Every node should be given the same quotas.
  NamespaceQuotas quotas;
};

// Maps a librados return code to the NVMe status gdkv reports (docs/rados.md has the table).
nvme::Status rados_status(int rados_rc) noexcept;

// Connects to the cluster and opens the pool. An Error (gdkv/result.h) with a clear message on
// failure (no cluster, no pool, bad credentials, bad options).
Result<std::shared_ptr<Backend>> make_rados_backend(const RadosBackendOptions& options);

}  // namespace gdkv
