// For the settings tests (gdkv/settings.h): a valid value of each setting that differs from the
// one `s` holds, as TOML, flag and Python would write it.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

#include "gdkv/settings.h"

namespace gdkv::testing {

template <class T>
SettingValue other_value(const Setting<T>& x, const T& s) {
  const SettingValue now = x.get(s);
  if (const uint64_t* n = std::get_if<uint64_t>(&now)) {
    return static_cast<int64_t>(*n) < x.max ? *n + 1 : *n - 1;
  }
  if (const int64_t* n = std::get_if<int64_t>(&now)) return *n < x.max ? *n + 1 : *n - 1;
  if (const bool* b = std::get_if<bool>(&now)) return !*b;
  if (x.type == SettingInfo::Type::kIdList) {  // one more id
    const std::string& ids = std::get<std::string>(now);
    return ids.empty() ? "1" : ids + ":1";
  }
  for (const std::string& c : x.choices) {
    if (c != std::get<std::string>(now)) return c;
  }
  const std::string& text = std::get<std::string>(now);
  return text.empty() ? "other" : text + "-other";
}

// As a command line or environment variable spells it (octal for permissions).
inline std::string as_argument(const SettingInfo& x, const SettingValue& v) {
  if (const uint64_t* n = std::get_if<uint64_t>(&v)) {
    if (std::string_view(x.unit) != "octal") return std::to_string(*n);
    char text[32];
    std::snprintf(text, sizeof text, "0%llo", static_cast<unsigned long long>(*n));
    return text;
  }
  if (const int64_t* n = std::get_if<int64_t>(&v)) return std::to_string(*n);
  if (const bool* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  return std::get<std::string>(v);
}

}  // namespace gdkv::testing
