// Every setting of gdkv, declared once: the store's (backend, host cache, controller), gdkvd's
// own (socket, clients, /metrics) and a client's connection to gdkvd. Each is one row of a table
// with its name, type, unit, range, default, flag and TOML key, and every front end reads the
// rows: gdkvd's TOML keys, flags and GDKVD_* variables, the gdkv CLI's flags, gdkv.open's and
// gdkv.connect's keywords and the connectors' config (through gdkv.settings()). A setting's
// default is its field's value in a default-constructed settings struct, and the field's
// default is written in that struct alone (ControllerOptions, VfioUserServerOptions,
// VfioUserClientOptions, ...); gdkvd starts from daemon_store_settings() (tools/gdkvd/config.h),
// which names what a long-running node changes. docs/settings.md is generated from the rows.
//
// Thread safety: the tables are immutable once built (on first use, thread-safe).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "gdkv/backend_factory.h"
#include "gdkv/cache.h"
#include "gdkv/controller.h"
#include "gdkv/vfio_user.h"

namespace gdkv {

// The store: what gdkvd, the CLI and gdkv.open open and serve.
struct StoreSettings {
  BackendConfig backend;
  // The host cache in front of the backend; capacity 0 (the default here): none.
  CacheOptions cache = [] {
    CacheOptions c;
    c.capacity_bytes = 0;
    return c;
  }();
  // Reactors, the largest value, reactor sleep. The namespaces, copy engine and memory hooks are
  // the front end's, not settings.
  ControllerOptions controller;
};

// gdkvd's own settings besides the store's.
struct DaemonSettings {
  // The socket, clients, DMA limits and MSI-X vectors. The namespaces ([[namespace]] tables),
  // log and device memory importer are set by gdkvd itself, not by rows.
  VfioUserServerOptions server = [] {
    VfioUserServerOptions o;
    o.socket_dir = "/run/gdkvd";
    return o;
  }();
  int32_t metrics_port = 9464;  // -1: no /metrics; 0: any free port (logged)
  std::string metrics_bind = "0.0.0.0";
  bool gpu = true;  // CUDA builds: use the GPU when the machine has one
};

// A setting's value: an unsigned integer, a flag, text, or a signed integer (metrics_port).
using SettingValue = std::variant<uint64_t, bool, std::string, int64_t>;

// What a row says of a setting, whatever struct it lives in.
struct SettingInfo {
  enum class Type { kU16, kU32, kU64, kI32, kBool, kString };
  const char* name;  // gdkv.open's, gdkv.connect's and the connectors' key: "ceph_timeout_ms"
  const char* toml;  // gdkvd's TOML key, "table.key" or "key" (the file's top level):
                     // "backend.ceph_timeout_ms"; "" where gdkvd's file has none (a client's)
  const char* flag;  // the flag, "--ceph-timeout-ms"; gdkvd's environment variable is GDKVD_ and
                     // the flag in capitals: GDKVD_CEPH_TIMEOUT_MS
  Type type;
  const char* unit;                  // "bytes", "ms", "us", "%", "octal" (permissions) or ""
  int64_t min = 0, max = 0;          // integers: the accepted range
  std::vector<std::string> choices;  // text: the accepted values (empty: any)
  const char* help;

  // What set() says of a value of the wrong kind ("must be an integer", "must be true or
  // false", "must be a string") and of an integer out of range ("must be in [1, 256]"): the
  // front ends say the same of the values they cannot even hand to set() (a TOML float).
  const char* type_error() const;
  std::string range_error() const;
  bool is_integer() const { return type != Type::kBool && type != Type::kString; }

  // The value at `field` (this row's field of some struct).
  SettingValue get_at(const void* field) const;
  // Sets the value at `field`: "" on success, else why not ("must be in [1, 256]", "'x' is not
  // one of ..."). An integer is taken as uint64_t or int64_t alike.
  std::string set_at(void* field, const SettingValue& v) const;
  // The value as gdkvd's TOML and the docs write it: 5000, true, "adaptive", 0o660.
  std::string text_at(const void* field) const;
};

// A row of the table of settings struct T.
template <class T>
struct Setting : SettingInfo {
  void* (*field)(T&);  // where the value lives

  SettingValue get(const T& s) const { return get_at(field(const_cast<T&>(s))); }
  std::string set(T& s, const SettingValue& v) const { return set_at(field(s), v); }
  std::string text(const T& s) const { return text_at(field(const_cast<T&>(s))); }
};
using StoreSetting = Setting<StoreSettings>;
using DaemonSetting = Setting<DaemonSettings>;
using ClientSetting = Setting<VfioUserClientOptions>;

// `text` as a TOML basic string, quoted and escaped: "a \"b\"".
std::string toml_string(std::string_view text);

// The backend `s` names, with the host cache in front when s.cache.capacity_bytes > 0: the store
// gdkvd, the CLI and gdkv.open serve. An Error with the reason when either cannot be opened.
Result<std::shared_ptr<Backend>> open_store(const StoreSettings& s);

// The tables, each in the order the docs list it.
const std::vector<StoreSetting>& store_settings();
const std::vector<DaemonSetting>& daemon_settings();
// gdkv.connect's, the CLI's --connect and the connectors' (the memory shared with gdkvd, its
// queue, timeouts and wake-ups).
const std::vector<ClientSetting>& client_settings();

// The row called `name` (SettingInfo::name) in `table`, or nullptr.
template <class T>
const Setting<T>* find_setting(const std::vector<Setting<T>>& table, std::string_view name) {
  for (const Setting<T>& s : table) {
    if (name == s.name) return &s;
  }
  return nullptr;
}
// The store setting called `name`, or nullptr.
inline const StoreSetting* find_setting(std::string_view name) {
  return find_setting(store_settings(), name);
}

}  // namespace gdkv
