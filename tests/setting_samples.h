// For the settings tests (gdkv/settings.h): a valid value of each setting that differs from the
// one `s` holds, as TOML, flag and Python would write it.
#pragma once

#include <string>

#include "gdkv/settings.h"

namespace gdkv::testing {

inline SettingValue other_value(const Setting& x, const StoreSettings& s) {
  const SettingValue now = x.get(s);
  if (const uint64_t* n = std::get_if<uint64_t>(&now)) return *n < x.max ? *n + 1 : *n - 1;
  if (const bool* b = std::get_if<bool>(&now)) return !*b;
  for (const std::string& c : x.choices) {
    if (c != std::get<std::string>(now)) return c;
  }
  const std::string& text = std::get<std::string>(now);
  return text.empty() ? "other" : text + "-other";
}

// As a command line or environment variable spells it.
inline std::string as_argument(const SettingValue& v) {
  if (const uint64_t* n = std::get_if<uint64_t>(&v)) return std::to_string(*n);
  if (const bool* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  return std::get<std::string>(v);
}

}  // namespace gdkv::testing
