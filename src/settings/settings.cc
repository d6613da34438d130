// The settings table (include/gdkv/settings.h).
#include "gdkv/settings.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <type_traits>
#include <utility>

namespace gdkv {
namespace {

// One row: `Field` is a captureless lambda returning the field's reference, whose type gives the
// setting's type.
template <class Field>
Setting row(const char* name, const char* toml, const char* flag, const char* unit, uint64_t min,
            uint64_t max, std::vector<std::string> choices, const char* help, Field) {
  using T = std::remove_reference_t<decltype(Field{}(std::declval<StoreSettings&>()))>;
  Setting s{name, toml,
            flag, Setting::Type::kString,
            unit, min,
            max,  std::move(choices),
            help, [](StoreSettings& x) -> void* { return &Field{}(x); }};
  if constexpr (std::is_same_v<T, bool>) {
    s.type = Setting::Type::kBool;
  } else if constexpr (std::is_same_v<T, std::string>) {
    s.type = Setting::Type::kString;
  } else {
    static_assert(std::is_same_v<T, uint32_t> || std::is_same_v<T, uint64_t>);
    s.type = sizeof(T) == 4 ? Setting::Type::kU32 : Setting::Type::kU64;
    s.max = std::min<uint64_t>(s.max, std::numeric_limits<T>::max());
  }
  return s;
}

// No limit but the largest TOML integer, so that every value a flag or gdkv.open takes can be
// written to gdkvd's configuration file (--check-config) and read back.
constexpr uint64_t kAny = std::numeric_limits<int64_t>::max();
constexpr uint64_t kHour = 3'600'000;

std::vector<Setting> make_table() {
  using S = StoreSettings;
  std::vector<Setting> t;
  // The backend.
  t.push_back(row(
      "backend", "backend.kind", "--backend", "", 0, 0, {"memory", "local", "rados", "tiered"},
      "memory, local, rados or tiered (local in front of rados)",
      [](S & s) -> auto& { return s.backend.kind; }));
  t.push_back(row(
      "store", "backend.store", "--store", "", 0, 0, {},
      "local store directory (empty: $GDKV_STORE, else ~/.local/share/gdkv)",
      [](S & s) -> auto& { return s.backend.local.path; }));
  t.push_back(row(
      "capacity", "backend.capacity_bytes", "--capacity", "bytes", 1, kAny, {},
      "local store capacity", [](S & s) -> auto& { return s.backend.local.capacity_bytes; }));
  t.push_back(row(
      "segment_bytes", "backend.segment_bytes", "--segment-bytes", "bytes", 1, kAny, {},
      "local store segment size (a new store's)",
      [](S & s) -> auto& { return s.backend.local.segment_bytes; }));
  t.push_back(row(
      "memory_capacity", "backend.memory_capacity_bytes", "--memory-capacity", "bytes", 1, kAny, {},
      "memory backend capacity (full, it evicts least recently used)",
      [](S & s) -> auto& { return s.backend.memory.capacity_bytes; }));
  t.push_back(row(
      "pool", "backend.pool", "--pool", "", 0, 0, {}, "RADOS pool",
      [](S & s) -> auto& { return s.backend.rados.pool; }));
  t.push_back(row(
      "ceph_conf", "backend.ceph_conf", "--ceph-conf", "", 0, 0, {},
      "ceph.conf (empty: $CEPH_CONF, else /etc/ceph/ceph.conf)",
      [](S & s) -> auto& { return s.backend.rados.ceph_conf; }));
  t.push_back(row(
      "ceph_client", "backend.ceph_client", "--ceph-client", "", 0, 0, {}, "Ceph client name",
      [](S & s) -> auto& { return s.backend.rados.client_name; }));
  t.push_back(row(
      "ceph_keyring", "backend.ceph_keyring", "--ceph-keyring", "", 0, 0, {},
      "Ceph keyring (empty: what ceph.conf says)",
      [](S & s) -> auto& { return s.backend.rados.keyring; }));
  t.push_back(row(
      "namespace_prefix", "backend.namespace_prefix", "--namespace-prefix", "", 0, 0, {},
      "NVMe namespace N lives in RADOS namespace prefix + N",
      [](S & s) -> auto& { return s.backend.rados.namespace_prefix; }));
  t.push_back(row(
      "ceph_timeout_ms", "backend.ceph_timeout_ms", "--ceph-timeout-ms", "ms", 1, kHour, {},
      "a RADOS op not done by then fails (82h, NotReadyError)",
      [](S & s) -> auto& { return s.backend.rados.ceph_timeout_ms; }));
  t.push_back(row(
      "evict", "backend.evict", "--evict", "", 0, 0, {},
      "evict the coldest blocks when the RADOS pool passes its high watermark",
      [](S & s) -> auto& { return s.backend.rados.evict; }));
  t.push_back(row(
      "evict_high_percent", "backend.evict_high_percent", "--evict-high-percent", "%", 1, 100, {},
      "pool fill (% of capacity) that starts eviction",
      [](S & s) -> auto& { return s.backend.rados.evict_high_percent; }));
  t.push_back(row(
      "evict_low_percent", "backend.evict_low_percent", "--evict-low-percent", "%", 0, 99, {},
      "pool fill (% of capacity) eviction brings it back to",
      [](S & s) -> auto& { return s.backend.rados.evict_low_percent; }));
  t.push_back(row(
      "evict_interval_ms", "backend.evict_interval_ms", "--evict-interval-ms", "ms", 1, kHour, {},
      "time between a node's pool fill checks",
      [](S & s) -> auto& { return s.backend.rados.evict_interval_ms; }));
  t.push_back(row(
      "pool_capacity", "backend.pool_capacity_bytes", "--pool-capacity", "bytes", 0, kAny, {},
      "what the pool may hold (0: its quota, else stored + free space)",
      [](S & s) -> auto& { return s.backend.rados.pool_capacity_bytes; }));
  t.push_back(row(
      "atime_interval_ms", "backend.atime_interval_ms", "--atime-interval-ms", "ms", 0, kAny, {},
      "a read refreshes a block's access time when it is older than this",
      [](S & s) -> auto& { return s.backend.rados.atime_interval_ms; }));
  t.push_back(row(
      "events_object", "backend.events_object", "--events-object", "", 0, 0, {},
      "the RADOS object Deletes are notified on (empty: no notifications)",
      [](S & s) -> auto& { return s.backend.rados.events_object; }));
  // The controller.
  t.push_back(row(
      "reactors", "controller.reactors", "--reactors", "", 1, 256, {}, "reactor threads",
      [](S & s) -> auto& { return s.reactors; }));
  t.push_back(row(
      "max_value_bytes", "controller.max_value_bytes", "--max-value", "bytes", 1, uint64_t{1} << 32,
      {}, "the largest value a Store accepts", [](S & s) -> auto& { return s.max_value_bytes; }));
  // The host cache.
  t.push_back(row(
      "cache_bytes", "cache.bytes", "--cache-bytes", "bytes", 0, kAny, {},
      "host cache in front of the backend (0: none)",
      [](S & s) -> auto& { return s.cache.capacity_bytes; }));
  t.push_back(row(
      "cache_policy", "cache.policy", "--cache-policy", "", 0, 0, cache_policies(),
      "the host cache's eviction policy", [](S & s) -> auto& { return s.cache.policy; }));
  t.push_back(row(
      "prefetch_depth", "cache.prefetch_depth", "--prefetch-depth", "", 0, 1024, {},
      "blocks the cache fetches ahead along a learned chain (0: off)",
      [](S & s) -> auto& { return s.cache.prefetch_depth; }));
  return t;
}

}  // namespace

Result<std::shared_ptr<Backend>> open_store(const StoreSettings& s) {
  auto backend = open_backend(s.backend);
  if (!backend || s.cache.capacity_bytes == 0) return backend;
  return make_cached_backend(*backend, s.cache);
}

const std::vector<Setting>& store_settings() {
  static const std::vector<Setting> table = make_table();
  return table;
}

const Setting* find_setting(std::string_view name) {
  for (const Setting& s : store_settings()) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

SettingValue Setting::get(const StoreSettings& s) const {
  void* p = field(const_cast<StoreSettings&>(s));
  switch (type) {
    case Type::kU32:
      return uint64_t{*static_cast<uint32_t*>(p)};
    case Type::kU64:
      return *static_cast<uint64_t*>(p);
    case Type::kBool:
      return *static_cast<bool*>(p);
    case Type::kString:
      break;
  }
  return *static_cast<std::string*>(p);
}

std::string Setting::set(StoreSettings& s, const SettingValue& v) const {
  void* p = field(s);
  switch (type) {
    case Type::kU32:
    case Type::kU64: {
      const uint64_t* n = std::get_if<uint64_t>(&v);
      if (n == nullptr) return type_error();
      if (*n < min || *n > max) return range_error();
      if (type == Type::kU32) {
        *static_cast<uint32_t*>(p) = static_cast<uint32_t>(*n);
      } else {
        *static_cast<uint64_t*>(p) = *n;
      }
      return {};
    }
    case Type::kBool: {
      const bool* b = std::get_if<bool>(&v);
      if (b == nullptr) return type_error();
      *static_cast<bool*>(p) = *b;
      return {};
    }
    case Type::kString:
      break;
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

const char* Setting::type_error() const {
  switch (type) {
    case Type::kBool:
      return "must be true or false";
    case Type::kString:
      return "must be a string";
    default:
      return "must be an integer";
  }
}

std::string Setting::range_error() const {
  return "must be in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
}

std::string Setting::text(const StoreSettings& s) const {
  const SettingValue v = get(s);
  if (const uint64_t* n = std::get_if<uint64_t>(&v)) return std::to_string(*n);
  if (const bool* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  std::string out = "\"";
  for (const char c : std::get<std::string>(v)) {
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
