// The settings tables (gdkv/settings.h) as CLI11 flags: one per row, as the row names it, for
// gdkvd and the gdkv CLI alike. Header-only: both programs link CLI11, the library does not.
#pragma once

#include <CLI/CLI.hpp>
#include <cctype>
#include <string>
#include <string_view>
#include <vector>

#include "gdkv/settings.h"

namespace gdkv_tools {

// GDKVD_CEPH_TIMEOUT_MS for --ceph-timeout-ms and prefix "GDKVD_".
inline std::string env_name(const std::string& prefix, const char* flag) {
  std::string e = prefix;
  for (const char* p = flag + 2; *p != '\0'; ++p) {
    e += *p == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(*p)));
  }
  return e;
}

// Adds every row's flag, bound to its field in `s` (a flag not given leaves the field as it is,
// so a configuration file read before keeps its values). Booleans get --name and --no-name; an
// integer takes decimal, or octal where the row's unit is "octal" (0660). `env_prefix`
// non-empty: each flag also reads the environment variable env_name(prefix, flag). The help
// text ends with the value `s` holds now (the default, unless a file set it).
template <class T>
void add_setting_flags(CLI::App& app, const std::vector<gdkv::Setting<T>>& table, T& s,
                       const std::string& env_prefix = {}) {
  for (const gdkv::Setting<T>& x : table) {
    std::string help = std::string(x.help) + " (";
    if (*x.unit != '\0') help += std::string(x.unit) + ", ";
    help += "now " + x.text(s) + ")";
    CLI::Option* o = nullptr;
    void* field = x.field(s);
    const gdkv::SettingInfo* info = &x;
    // Integers go through parse_at, so every front end gives the same range message.
    const CLI::callback_t integer = [info, field](const CLI::results_t& r) {
      const std::string& text = r.back();
      if (const std::string err = info->parse_at(field, text); !err.empty()) {
        throw CLI::ValidationError(info->flag, "'" + text + "': " + err);
      }
      return true;
    };
    switch (x.type) {
      case gdkv::SettingInfo::Type::kBool:
        o = app.add_flag(std::string(x.flag) + ",!--no-" + (x.flag + 2), *static_cast<bool*>(field),
                         help);
        break;
      case gdkv::SettingInfo::Type::kString:
        o = app.add_option(x.flag, *static_cast<std::string*>(field), help);
        if (!x.choices.empty()) o->check(CLI::IsMember(x.choices));
        break;
      default:
        o = app.add_option(x.flag, integer, help)->type_name("INT")->allow_extra_args(false);
    }
    if (!env_prefix.empty()) o->envname(env_name(env_prefix, x.flag));
  }
}

}  // namespace gdkv_tools
