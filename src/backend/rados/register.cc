// The rados backend's registration (gdkv/backend_registry.h): its settings and how to open it.
#include <vector>

#include "gdkv/backend_factory.h"
#include "gdkv/backend_registry.h"
#include "gdkv/rados_backend.h"

// ---- registration (gdkv/backend_registry.h) ----

void gdkv_register_backend_rados(std::vector<gdkv::BackendRegistration>& registry) {
  using gdkv::kSettingAny;
  using gdkv::setting_row;
  using C = gdkv::BackendConfig;
  gdkv::BackendRegistration b;
  constexpr int64_t kHour = 3'600'000;
  b.name = "rados";
  b.help = "a Ceph RADOS pool every node shares";
  b.traits.can_time_out = true;
  b.traits.can_be_far_tier = true;
  b.traits.needs_cluster = true;
  b.settings.push_back(setting_row<C>(
      "pool", "backend.pool", "--pool", "", 0, 0, {}, "RADOS pool",
      [](C & c) -> auto& { return c.rados.pool; }));
  b.settings.push_back(setting_row<C>(
      "ceph_conf", "backend.ceph_conf", "--ceph-conf", "", 0, 0, {},
      "ceph.conf (empty: $CEPH_CONF, else /etc/ceph/ceph.conf)",
      [](C & c) -> auto& { return c.rados.ceph_conf; }));
  b.settings.push_back(setting_row<C>(
      "ceph_client", "backend.ceph_client", "--ceph-client", "", 0, 0, {}, "Ceph client name",
      [](C & c) -> auto& { return c.rados.client_name; }));
  b.settings.push_back(setting_row<C>(
      "ceph_keyring", "backend.ceph_keyring", "--ceph-keyring", "", 0, 0, {},
      "Ceph keyring (empty: what ceph.conf says)", [](C & c) -> auto& { return c.rados.keyring; }));
  b.settings.push_back(setting_row<C>(
      "namespace_prefix", "backend.namespace_prefix", "--namespace-prefix", "", 0, 0, {},
      "NVMe namespace N lives in RADOS namespace prefix + N",
      [](C & c) -> auto& { return c.rados.namespace_prefix; }));
  b.settings.push_back(setting_row<C>(
      "ceph_timeout_ms", "backend.ceph_timeout_ms", "--ceph-timeout-ms", "ms", 1, kHour, {},
      "a RADOS op not done by then fails (82h, NotReadyError)",
      [](C & c) -> auto& { return c.rados.ceph_timeout_ms; }));
  b.settings.push_back(setting_row<C>(
      "evict", "backend.evict", "--evict", "", 0, 0, {},
      "evict the coldest blocks when the RADOS pool passes its high watermark",
      [](C & c) -> auto& { return c.rados.evict; }));
  b.settings.push_back(setting_row<C>(
      "evict_high_percent", "backend.evict_high_percent", "--evict-high-percent", "%", 1, 100, {},
      "pool fill (% of capacity) that starts eviction",
      [](C & c) -> auto& { return c.rados.evict_high_percent; }));
  b.settings.push_back(setting_row<C>(
      "evict_low_percent", "backend.evict_low_percent", "--evict-low-percent", "%", 0, 99, {},
      "pool fill (% of capacity) eviction brings it back to",
      [](C & c) -> auto& { return c.rados.evict_low_percent; }));
  b.settings.push_back(setting_row<C>(
      "evict_interval_ms", "backend.evict_interval_ms", "--evict-interval-ms", "ms", 1, kHour, {},
      "time between a node's pool fill checks",
      [](C & c) -> auto& { return c.rados.evict_interval_ms; }));
  b.settings.push_back(setting_row<C>(
      "pool_capacity", "backend.pool_capacity_bytes", "--pool-capacity", "bytes", 0, kSettingAny,
      {}, "what the pool may hold (0: its quota, else stored + free space)",
      [](C & c) -> auto& { return c.rados.pool_capacity_bytes; }));
  b.settings.push_back(setting_row<C>(
      "atime_interval_ms", "backend.atime_interval_ms", "--atime-interval-ms", "ms", 0, kSettingAny,
      {}, "a read refreshes a block's access time when it is older than this",
      [](C & c) -> auto& { return c.rados.atime_interval_ms; }));
  b.settings.push_back(setting_row<C>(
      "events_object", "backend.events_object", "--events-object", "", 0, 0, {},
      "the RADOS object Deletes are notified on (empty: no notifications)",
      [](C & c) -> auto& { return c.rados.events_object; }));
  b.open = [](const C& c) -> gdkv::Result<std::shared_ptr<gdkv::Backend>> {
    gdkv::RadosBackendOptions o = c.rados;
    o.quotas = c.quotas;
    return gdkv::make_rados_backend(o);
  };
  registry.push_back(std::move(b));
}
