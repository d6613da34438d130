// The store's settings (gdkv/settings.h) as CLI11 flags: one per setting, as the table names it,
// for gdkvd and the gdkv CLI alike. Header-only: both programs link CLI11, the library does not.
#pragma once

#include <CLI/CLI.hpp>
#include <cctype>
#include <string>

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

// Adds every setting's flag, bound to its field in `s` (a flag not given leaves the field as it
// is, so a configuration file read before keeps its values). Booleans get --name and --no-name.
// `env_prefix` non-empty: each flag also reads the environment variable env_name(prefix, flag).
// The help text ends with the value `s` holds now (the default, unless a file set it).
inline void add_setting_flags(CLI::App& app, gdkv::StoreSettings& s,
                              const std::string& env_prefix = {}) {
  for (const gdkv::Setting& x : gdkv::store_settings()) {
    std::string help = std::string(x.help) + " (";
    if (*x.unit != '\0') help += std::string(x.unit) + ", ";
    help += "now " + x.text(s) + ")";
    CLI::Option* o = nullptr;
    void* field = x.field(s);
    switch (x.type) {
      case gdkv::Setting::Type::kU32:
        o = app.add_option(x.flag, *static_cast<uint32_t*>(field), help)
                ->check(CLI::Range(x.min, x.max));
        break;
      case gdkv::Setting::Type::kU64:
        o = app.add_option(x.flag, *static_cast<uint64_t*>(field), help)
                ->check(CLI::Range(x.min, x.max));
        break;
      case gdkv::Setting::Type::kBool:
        o = app.add_flag(std::string(x.flag) + ",!--no-" + (x.flag + 2), *static_cast<bool*>(field),
                         help);
        break;
      case gdkv::Setting::Type::kString:
        o = app.add_option(x.flag, *static_cast<std::string*>(field), help);
        if (!x.choices.empty()) o->check(CLI::IsMember(x.choices));
        break;
    }
    if (!env_prefix.empty()) o->envname(env_name(env_prefix, x.flag));
  }
}

}  // namespace gdkv_tools
