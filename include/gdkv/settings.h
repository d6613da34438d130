// The store's settings, declared once: the backend, the host cache and the controller's size.
// Every front end reads this table: gdkvd's TOML keys, flags and GDKVD_* variables, the gdkv
// CLI's flags, gdkv.open's keywords and the connectors' extra config (through gdkv.settings()).
// A setting's default is its field's value in a default StoreSettings; gdkvd starts from
// daemon_settings() (tools/gdkvd/config.h), which names what a long-running node changes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "gdkv/backend_factory.h"
#include "gdkv/cache.h"

namespace gdkv {

struct StoreSettings {
  BackendConfig backend;
  // The host cache in front of the backend; capacity 0 (the default here): none.
  CacheOptions cache = [] {
    CacheOptions c;
    c.capacity_bytes = 0;
    return c;
  }();
  uint32_t reactors = 1;                          // controller reactor threads
  uint64_t max_value_bytes = uint64_t{64} << 20;  // the largest value a Store accepts
};

// A setting's value: an unsigned integer, a flag or text.
using SettingValue = std::variant<uint64_t, bool, std::string>;

struct Setting {
  enum class Type { kU32, kU64, kBool, kString };
  const char* name;  // gdkv.open's keyword and the connectors' key: "ceph_timeout_ms"
  const char* toml;  // gdkvd's TOML key, "table.key": "backend.ceph_timeout_ms"
  const char* flag;  // gdkvd's and the gdkv CLI's flag, "--ceph-timeout-ms"; gdkvd's environment
                     // variable is GDKVD_ and the flag in capitals: GDKVD_CEPH_TIMEOUT_MS
  Type type;
  const char* unit;                  // "bytes", "ms", "%" or ""
  uint64_t min = 0, max = 0;         // integers: the accepted range
  std::vector<std::string> choices;  // text: the accepted values (empty: any)
  const char* help;
  void* (*field)(StoreSettings&);  // where the value lives

  SettingValue get(const StoreSettings& s) const;
  // Sets the value: "" on success, else why not ("must be in [1, 256]", "'x' is not one of ...").
  std::string set(StoreSettings& s, const SettingValue& v) const;
  // What set() says of a value of the wrong kind ("must be an integer", "must be true or
  // false", "must be a string") and of an integer out of range ("must be in [1, 256]"): the
  // front ends say the same of the values they cannot even hand to set() (a TOML float, a
  // negative number).
  const char* type_error() const;
  std::string range_error() const;
  // The value as gdkvd's TOML and the docs write it: 5000, true, "adaptive".
  std::string text(const StoreSettings& s) const;
};

// The backend `s` names, with the host cache in front when s.cache.capacity_bytes > 0: the store
// gdkvd, the CLI and gdkv.open serve. An Error with the reason when either cannot be opened.
Result<std::shared_ptr<Backend>> open_store(const StoreSettings& s);

// Every setting, in the order the docs list them.
const std::vector<Setting>& store_settings();
// The setting called `name` (Setting::name), or nullptr.
const Setting* find_setting(std::string_view name);

}  // namespace gdkv
