// A setting as one row of a table: its name, TOML key, flag, type, unit, range or choices, help,
// and where its value lives in a settings struct T. The tables themselves are gdkv/settings.h's
// (the store's, gdkvd's, a connection's), with each backend's rows declared in its registration
// (gdkv/backend_registry.h). setting_row() makes a row from a lambda naming the field, whose type
// gives the setting's type.
//
// Thread safety: rows are immutable once built.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace gdkv {

// A setting's value: an unsigned integer, a flag, text, or a signed integer (metrics_port). A list
// of ids (a namespace's uids) is text, its ids joined by ':' ("1000:1001"; "" is the empty list).
using SettingValue = std::variant<uint64_t, bool, std::string, int64_t>;

// What a row says of a setting, whatever struct it lives in.
struct SettingInfo {
  enum class Type { kU16, kU32, kU64, kI32, kBool, kString, kIdList };
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
  bool is_integer() const {
    return type != Type::kBool && type != Type::kString && type != Type::kIdList;
  }

  // The value at `field` (this row's field of some struct).
  SettingValue get_at(const void* field) const;
  // Sets the value at `field`: "" on success, else why not ("must be in [1, 256]", "'x' is not
  // one of ..."). An integer is taken as uint64_t or int64_t alike.
  std::string set_at(void* field, const SettingValue& v) const;
  // The value as gdkvd's TOML and the docs write it: 5000, true, "adaptive", 0o660, [1000, 1001].
  std::string text_at(const void* field) const;
  // Sets the value at `field` from text as a flag or environment variable spells it: an integer
  // in decimal (octal where the unit is "octal"), true or false, the text itself, ids joined by
  // ':'. "" on success, else why not.
  std::string parse_at(void* field, const std::string& text) const;
};

// A row of the table of settings struct T.
template <class T>
struct Setting : SettingInfo {
  std::function<void*(T&)> field;  // where the value lives

  SettingValue get(const T& s) const { return get_at(field(const_cast<T&>(s))); }
  std::string set(T& s, const SettingValue& v) const { return set_at(field(s), v); }
  std::string text(const T& s) const { return text_at(field(const_cast<T&>(s))); }
  std::string parse(T& s, const std::string& text) const { return parse_at(field(s), text); }
};

// `text` as a TOML basic string, quoted and escaped: "a \"b\"".
std::string toml_string(std::string_view text);

// No limit but the largest TOML integer, so that every value a flag or gdkv.open takes can be
// written to gdkvd's configuration file (--check-config) and read back.
inline constexpr int64_t kSettingAny = std::numeric_limits<int64_t>::max();

// A row of T's table: `Field` is a captureless lambda returning the field's reference, whose
// type gives the setting's type (and caps its range at what the type holds).
template <class T, class Field>
Setting<T> setting_row(const char* name, const char* toml, const char* flag, const char* unit,
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
  } else if constexpr (std::is_same_v<F, std::vector<uint32_t>>) {
    s.type = SettingInfo::Type::kIdList;
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
    s.max = static_cast<int64_t>(
        std::min<uint64_t>(static_cast<uint64_t>(s.max), std::numeric_limits<F>::max()));
  }
  return s;
}

// The same rows, of a struct U that holds a T (`part` returns that T): a backend's rows of
// BackendConfig as rows of the store's settings.
template <class U, class T>
std::vector<Setting<U>> lift_settings(const std::vector<Setting<T>>& rows, T& (*part)(U&)) {
  std::vector<Setting<U>> out;
  for (const Setting<T>& r : rows) {
    Setting<U> s;
    static_cast<SettingInfo&>(s) = r;
    s.field = [inner = r.field, part](U& u) -> void* { return inner(part(u)); };
    out.push_back(std::move(s));
  }
  return out;
}

// The row called `name` (SettingInfo::name) in `table`, or nullptr.
template <class T>
const Setting<T>* find_setting(const std::vector<Setting<T>>& table, std::string_view name) {
  for (const Setting<T>& s : table) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

}  // namespace gdkv
