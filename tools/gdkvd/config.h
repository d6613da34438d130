// gdkvd's configuration: a TOML file, then GDKVD_* environment variables, then command-line
// flags, each overriding the one before (docs/deployment.md lists every key).
//
// Errors are precise and never fatal inside the parser: load() returns false with a message such
// as "gdkvd.toml:12: backend.kind: 'disk' is not one of memory, local, rados".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gdkv/settings.h"

namespace gdkvd {

// A long-running node's store settings: the library's (gdkv/settings.h), except that the RADOS
// pool evicts like a cache, two reactors serve, and a 1 GiB host cache sits in front.
inline gdkv::StoreSettings daemon_store_settings() {
  gdkv::StoreSettings s;
  s.backend.rados.evict = true;
  s.controller.reactors = 2;
  s.cache.capacity_bytes = uint64_t{1} << 30;
  return s;
}

// Every value is a row of a settings table (gdkv/settings.h) except the namespaces.
struct Config {
  std::string config_file;  // --config / GDKVD_CONFIG
  // The socket, clients, /metrics, the GPU (gdkv::daemon_settings(): the file's top-level keys);
  // daemon.server.namespaces are the [[namespace]] tables (empty: nsid 1 for everyone).
  gdkv::DaemonSettings daemon;
  // The backend, the host cache and the controller (gdkv::store_settings(): [backend], [cache],
  // [controller]).
  gdkv::StoreSettings store = daemon_store_settings();
  bool check_only = false;  // --check-config: validate, print, exit
};

// Parses argv (flags and environment) on top of the TOML file named by --config/GDKVD_CONFIG.
// Returns 0 to run, 1 when the program should exit 0 at once (--help printed), 2 on a usage or
// configuration error (message in *error).
int load(int argc, char** argv, Config& out, std::string* error);

// Reads a TOML document into `out` (used by load(); exposed for tests). `name` labels errors.
bool load_toml(const std::string& text, const std::string& name, Config& out, std::string* error);

// Checks cross-field rules (namespaces, sizes); fills defaults that depend on other fields.
bool validate(Config& c, std::string* error);

// The effective configuration as TOML (for --check-config and the startup log).
std::string to_toml(const Config& c);

}  // namespace gdkvd
