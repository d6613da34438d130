// The settings tables (include/gdkv/settings.h).
#include "gdkv/settings.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <string_view>
#include <type_traits>
#include <utility>

namespace gdkv {
namespace {

// One row of T's table: `Field` is a captureless lambda returning the field's reference, whose
// type gives the setting's type (and caps its range at what the type holds).
template <class T, class Field>
Setting<T> row(const char* name, const char* toml, const char* flag, const char* unit,
               int64_t min, int64_t max, std::vector<std::string> choices, const char* help,
               Field) {
  using F = std::remove_reference_t<decltype(Field{}(std::declval<T&>()))>;
  Setting<T> s;
  s.name = name;
  s.toml = toml;
  s.flag = flag;
  s.unit = unit;
  s.min = min;
  s.max = max;
  s.choices = std::move(choices);
  s.help = help;
  s.field = [](T& x) -> void* { return &Field{}(x); };
  if constexpr (std::is_same_v<F, bool>) {
    s.type = SettingInfo::Type::kBool;
  } else if constexpr (std::is_same_v<F, std::string>) {
    s.type = SettingInfo::Type::kString;
  } else if constexpr (std::is_same_v<F, int32_t>) {
    s.type = SettingInfo::Type::kI32;
    s.min = std::max<int64_t>(s.min, std::numeric_limits<int32_t>::min());
    s.max = std::min<int64_t>(s.max, std::numeric_limits<int32_t>::max());
  } else {
    static_assert(std::is_same_v<F, uint16_t> || std::is_same_v<F, uint32_t> ||
                  std::is_same_v<F, uint64_t>);
    s.type = sizeof(F) == 2   ? SettingInfo::Type::kU16
             : sizeof(F) == 4 ? SettingInfo::Type::kU32
                              : SettingInfo::Type::kU64;
    s.max = static_cast<int64_t>(std::min<uint64_t>(static_cast<uint64_t>(s.max),
                                                    std::numeric_limits<F>::max()));
  }
  return s;
}

// No limit but the largest TOML integer, so that every value a flag or gdkv.open takes can be
// written to gdkvd's configuration file (--check-config) and read back.
constexpr int64_t kAny = std::numeric_limits<int64_t>::max();
constexpr int64_t kHour = 3'600'000;

std::vector<StoreSetting> make_store_table() {
  using S = StoreSettings;
  std::vector<StoreSetting> t;
  // The backend.
  t.push_back(row<S>(
      "backend", "backend.kind", "--backend", "", 0, 0, {"memory", "local", "rados", "tiered"},
      "memory, local, rados or tiered (local in front of rados)",
      [](S & s) -> auto& { return s.backend.kind; }));
  t.push_back(row<S>(
      "store", "backend.store", "--store", "", 0, 0, {},
      "local store directory (empty: $GDKV_STORE, else ~/.local/share/gdkv)",
      [](S & s) -> auto& { return s.backend.local.path; }));
  t.push_back(row<S>(
      "capacity", "backend.capacity_bytes", "--capacity", "bytes", 1, kAny, {},
      "local store capacity", [](S & s) -> auto& { return s.backend.local.capacity_bytes; }));
  t.push_back(row<S>(
      "segment_bytes", "backend.segment_bytes", "--segment-bytes", "bytes", 1, kAny, {},
      "local store segment size (a new store's)",
      [](S & s) -> auto& { return s.backend.local.segment_bytes; }));
  t.push_back(row<S>(
      "memory_capacity", "backend.memory_capacity_bytes", "--memory-capacity", "bytes", 1, kAny, {},
      "memory backend capacity (full, it evicts least recently used)",
      [](S & s) -> auto& { return s.backend.memory.capacity_bytes; }));
  t.push_back(row<S>(
      "pool", "backend.pool", "--pool", "", 0, 0, {}, "RADOS pool",
      [](S & s) -> auto& { return s.backend.rados.pool; }));
  t.push_back(row<S>(
      "ceph_conf", "backend.ceph_conf", "--ceph-conf", "", 0, 0, {},
      "ceph.conf (empty: $CEPH_CONF, else /etc/ceph/ceph.conf)",
      [](S & s) -> auto& { return s.backend.rados.ceph_conf; }));
  t.push_back(row<S>(
      "ceph_client", "backend.ceph_client", "--ceph-client", "", 0, 0, {}, "Ceph client name",
      [](S & s) -> auto& { return s.backend.rados.client_name; }));
  t.push_back(row<S>(
      "ceph_keyring", "backend.ceph_keyring", "--ceph-keyring", "", 0, 0, {},
      "Ceph keyring (empty: what ceph.conf says)",
      [](S & s) -> auto& { return s.backend.rados.keyring; }));
  t.push_back(row<S>(
      "namespace_prefix", "backend.namespace_prefix", "--namespace-prefix", "", 0, 0, {},
      "NVMe namespace N lives in RADOS namespace prefix + N",
      [](S & s) -> auto& { return s.backend.rados.namespace_prefix; }));
  t.push_back(row<S>(
      "ceph_timeout_ms", "backend.ceph_timeout_ms", "--ceph-timeout-ms", "ms", 1, kHour, {},
      "a RADOS op not done by then fails (82h, NotReadyError)",
      [](S & s) -> auto& { return s.backend.rados.ceph_timeout_ms; }));
  t.push_back(row<S>(
      "evict", "backend.evict", "--evict", "", 0, 0, {},
      "evict the coldest blocks when the RADOS pool passes its high watermark",
      [](S & s) -> auto& { return s.backend.rados.evict; }));
  t.push_back(row<S>(
      "evict_high_percent", "backend.evict_high_percent", "--evict-high-percent", "%", 1, 100, {},
      "pool fill (% of capacity) that starts eviction",
      [](S & s) -> auto& { return s.backend.rados.evict_high_percent; }));
  t.push_back(row<S>(
      "evict_low_percent", "backend.evict_low_percent", "--evict-low-percent", "%", 0, 99, {},
      "pool fill (% of capacity) eviction brings it back to",
      [](S & s) -> auto& { return s.backend.rados.evict_low_percent; }));
  t.push_back(row<S>(
      "evict_interval_ms", "backend.evict_interval_ms", "--evict-interval-ms", "ms", 1, kHour, {},
      "time between a node's pool fill checks",
      [](S & s) -> auto& { return s.backend.rados.evict_interval_ms; }));
  t.push_back(row<S>(
      "pool_capacity", "backend.pool_capacity_bytes", "--pool-capacity", "bytes", 0, kAny, {},
      "what the pool may hold (0: its quota, else stored + free space)",
      [](S & s) -> auto& { return s.backend.rados.pool_capacity_bytes; }));
  t.push_back(row<S>(
      "atime_interval_ms", "backend.atime_interval_ms", "--atime-interval-ms", "ms", 0, kAny, {},
      "a read refreshes a block's access time when it is older than this",
      [](S & s) -> auto& { return s.backend.rados.atime_interval_ms; }));
  t.push_back(row<S>(
      "events_object", "backend.events_object", "--events-object", "", 0, 0, {},
      "the RADOS object Deletes are notified on (empty: no notifications)",
      [](S & s) -> auto& { return s.backend.rados.events_object; }));
  // The controller.
  t.push_back(row<S>(
      "reactors", "controller.reactors", "--reactors", "", 1, 256, {}, "reactor threads",
      [](S & s) -> auto& { return s.controller.reactors; }));
  t.push_back(row<S>(
      "max_value_bytes", "controller.max_value_bytes", "--max-value", "bytes", 1, uint64_t{1} << 32,
      {}, "the largest value a Store accepts", [](S & s) -> auto& { return s.controller.max_value_bytes; }));
  t.push_back(row<S>(
      "idle_spin_us", "controller.idle_spin_us", "--idle-spin-us", "us", 0, 1'000'000, {},
      "a reactor with no work spins this long before it sleeps (0: sleeps at once)",
      [](S & s) -> auto& { return s.controller.idle_spin_us; }));
  t.push_back(row<S>(
      "never_sleep", "controller.never_sleep", "--never-sleep", "", 0, 0, {},
      "reactors poll without ever sleeping (lowest latency, one core each)",
      [](S & s) -> auto& { return s.controller.never_sleep; }));
  // The host cache.
  t.push_back(row<S>(
      "cache_bytes", "cache.bytes", "--cache-bytes", "bytes", 0, kAny, {},
      "host cache in front of the backend (0: none)",
      [](S & s) -> auto& { return s.cache.capacity_bytes; }));
  t.push_back(row<S>(
      "cache_policy", "cache.policy", "--cache-policy", "", 0, 0, cache_policies(),
      "the host cache's eviction policy", [](S & s) -> auto& { return s.cache.policy; }));
  t.push_back(row<S>(
      "prefetch_depth", "cache.prefetch_depth", "--prefetch-depth", "", 0, 1024, {},
      "blocks the cache fetches ahead along a learned chain (0: off)",
      [](S & s) -> auto& { return s.cache.prefetch_depth; }));
  return t;
}

std::vector<DaemonSetting> make_daemon_table() {
  using D = DaemonSettings;
  std::vector<DaemonSetting> t;
  t.push_back(row<D>(
      "socket_dir", "socket_dir", "--socket-dir", "", 0, 0, {},
      "directory of the vfio-user socket <dir>/cntrl (created if missing)",
      [](D & d) -> auto& { return d.server.socket_dir; }));
  t.push_back(row<D>(
      "socket_mode", "socket_mode", "--socket-mode", "octal", 0, 0777, {},
      "permissions of the socket file", [](D & d) -> auto& { return d.server.socket_mode; }));
  t.push_back(row<D>(
      "max_clients", "max_clients", "--max-clients", "", 1, 4096, {},
      "vfio-user connections at once; more are closed at accept",
      [](D & d) -> auto& { return d.server.max_clients; }));
  t.push_back(row<D>(
      "max_dma_maps", "max_dma_maps", "--max-dma-maps", "", 1, 65535, {},
      "DMA_MAP regions per connection", [](D & d) -> auto& { return d.server.max_dma_maps; }));
  t.push_back(row<D>(
      "dma_reply_timeout_ms", "dma_reply_timeout_ms", "--dma-reply-timeout-ms", "ms", 1, kHour,
      {}, "a DMA_READ/DMA_WRITE reply later than this fails the command (memory without an fd)",
      [](D & d) -> auto& { return d.server.dma_reply_timeout_ms; }));
  t.push_back(row<D>(
      "message_bounce_bytes", "message_bounce_bytes", "--message-bounce-bytes", "bytes", 1 << 20,
      int64_t{1} << 40, {}, "bounce memory per client for memory without an fd",
      [](D & d) -> auto& { return d.server.message_bounce_bytes; }));
  t.push_back(row<D>(
      "allow_unsealed_memory", "allow_unsealed_memory", "--allow-unsealed-memory", "", 0, 0, {},
      "accept DMA memory a client could shrink (SPDK hugepages; trusted clients only)",
      [](D & d) -> auto& { return d.server.allow_unsealed_memory; }));
  t.push_back(row<D>(
      "msix_vectors", "msix_vectors", "--msix-vectors", "", 1, 256, {},
      "MSI-X vectors of the device", [](D & d) -> auto& { return d.server.msix_vectors; }));
  t.push_back(row<D>(
      "metrics_port", "metrics_port", "--metrics-port", "", -1, 65535, {},
      "/metrics and /removed port (-1: off, 0: any free port)",
      [](D & d) -> auto& { return d.metrics_port; }));
  t.push_back(row<D>(
      "metrics_bind", "metrics_bind", "--metrics-bind", "", 0, 0, {},
      "address /metrics listens on", [](D & d) -> auto& { return d.metrics_bind; }));
  t.push_back(row<D>(
      "gpu", "gpu", "--gpu", "", 0, 0, {},
      "CUDA builds: use the GPU copy engines and accept device memory when a GPU is there",
      [](D & d) -> auto& { return d.gpu; }));
  return t;
}

std::vector<ClientSetting> make_client_table() {
  using C = VfioUserClientOptions;
  std::vector<ClientSetting> t;
  t.push_back(row<C>(
      "shared_memory_bytes", "", "--shared-memory-bytes", "bytes", 1 << 20, kAny, {},
      "memory shared with gdkvd (queues, staged values; committed only when touched)",
      [](C & c) -> auto& { return c.shared_memory_bytes; }));
  t.push_back(row<C>(
      "queue_depth", "", "--queue-depth", "", 2, 4096, {},
      "I/O queue entries (a power of two)", [](C & c) -> auto& { return c.queue_depth; }));
  t.push_back(row<C>(
      "timeout_ms", "", "--timeout-ms", "ms", 1, kHour, {},
      "an I/O command gdkvd does not complete by then fails, and the client with it",
      [](C & c) -> auto& { return c.timeout_ms; }));
  t.push_back(row<C>(
      "admin_timeout_ms", "", "--admin-timeout-ms", "ms", 1, kHour, {},
      "connecting, closing and admin commands wait at most this long",
      [](C & c) -> auto& { return c.admin_timeout_ms; }));
  t.push_back(row<C>(
      "wakeups", "", "--wakeups", "", 0, 0, {},
      "wake a sleeping reactor and wait on interrupts (off: poll and yield)",
      [](C & c) -> auto& { return c.wakeups; }));
  t.push_back(row<C>(
      "wait_spin_us", "", "--wait-spin-us", "us", 0, 1'000'000, {},
      "a waiting client spins this long before it blocks on its completion interrupt",
      [](C & c) -> auto& { return c.wait_spin_us; }));
  return t;
}

}  // namespace

Result<std::shared_ptr<Backend>> open_store(const StoreSettings& s) {
  auto backend = open_backend(s.backend);
  if (!backend || s.cache.capacity_bytes == 0) return backend;
  return make_cached_backend(*backend, s.cache);
}

const std::vector<StoreSetting>& store_settings() {
  static const std::vector<StoreSetting> table = make_store_table();
  return table;
}

const std::vector<DaemonSetting>& daemon_settings() {
  static const std::vector<DaemonSetting> table = make_daemon_table();
  return table;
}

const std::vector<ClientSetting>& client_settings() {
  static const std::vector<ClientSetting> table = make_client_table();
  return table;
}

SettingValue SettingInfo::get_at(const void* p) const {
  switch (type) {
    case Type::kU16:
      return uint64_t{*static_cast<const uint16_t*>(p)};
    case Type::kU32:
      return uint64_t{*static_cast<const uint32_t*>(p)};
    case Type::kU64:
      return *static_cast<const uint64_t*>(p);
    case Type::kI32:
      return int64_t{*static_cast<const int32_t*>(p)};
    case Type::kBool:
      return *static_cast<const bool*>(p);
    case Type::kString:
      break;
  }
  return *static_cast<const std::string*>(p);
}

std::string SettingInfo::set_at(void* p, const SettingValue& v) const {
  if (is_integer()) {
    // Either kind of integer; min and max are within int64_t, so a uint64_t past it is out.
    int64_t n = 0;
    if (const uint64_t* u = std::get_if<uint64_t>(&v)) {
      if (*u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return range_error();
      n = static_cast<int64_t>(*u);
    } else if (const int64_t* i = std::get_if<int64_t>(&v)) {
      n = *i;
    } else {
      return type_error();
    }
    if (n < min || n > max) return range_error();
    switch (type) {
      case Type::kU16:
        *static_cast<uint16_t*>(p) = static_cast<uint16_t>(n);
        break;
      case Type::kU32:
        *static_cast<uint32_t*>(p) = static_cast<uint32_t>(n);
        break;
      case Type::kU64:
        *static_cast<uint64_t*>(p) = static_cast<uint64_t>(n);
        break;
      default:
        *static_cast<int32_t*>(p) = static_cast<int32_t>(n);
    }
    return {};
  }
  if (type == Type::kBool) {
    const bool* b = std::get_if<bool>(&v);
    if (b == nullptr) return type_error();
    *static_cast<bool*>(p) = *b;
    return {};
  }
  const std::string* text = std::get_if<std::string>(&v);
  if (text == nullptr) return type_error();
  if (!choices.empty() && std::find(choices.begin(), choices.end(), *text) == choices.end()) {
    std::string all;
    for (const auto& c : choices) all += (all.empty() ? "" : ", ") + c;
    return "'" + *text + "' is not one of " + all;
  }
  *static_cast<std::string*>(p) = *text;
  return {};
}

const char* SettingInfo::type_error() const {
  switch (type) {
    case Type::kBool:
      return "must be true or false";
    case Type::kString:
      return "must be a string";
    default:
      return "must be an integer";
  }
}

std::string SettingInfo::range_error() const {
  if (std::string_view(unit) == "octal") {
    char text[48];
    std::snprintf(text, sizeof text, "must be in [0o%llo, 0o%llo]",
                  static_cast<unsigned long long>(min), static_cast<unsigned long long>(max));
    return text;
  }
  return "must be in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
}

std::string SettingInfo::text_at(const void* p) const {
  const SettingValue v = get_at(p);
  if (const uint64_t* n = std::get_if<uint64_t>(&v)) {
    if (std::string_view(unit) == "octal") {  // as TOML writes it
      char text[32];
      std::snprintf(text, sizeof text, "0o%llo", static_cast<unsigned long long>(*n));
      return text;
    }
    return std::to_string(*n);
  }
  if (const int64_t* n = std::get_if<int64_t>(&v)) return std::to_string(*n);
  if (const bool* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  return toml_string(std::get<std::string>(v));
}

std::string toml_string(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {  // a TOML \uXXXX escape
      char esc[8];
      std::snprintf(esc, sizeof esc, "\\u%04x", static_cast<unsigned>(c));
      out += esc;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace gdkv
