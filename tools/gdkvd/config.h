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
#include "gdkv/vfio_user.h"

namespace gdkvd {

// A long-running node's settings: the library's (gdkv/settings.h), except that the RADOS pool
// evicts like a cache, two reactors serve, and a 1 GiB host cache sits in front.
inline gdkv::StoreSettings daemon_settings() {
  gdkv::StoreSettings s;
  s.backend.rados.evict = true;
  s.reactors = 2;
  s.cache.capacity_bytes = uint64_t{1} << 30;
  return s;
}

struct Config {
  std::string config_file;                // --config / GDKVD_CONFIG
  std::string socket_dir = "/run/gdkvd";  // the vfio-user socket is <socket_dir>/cntrl
  uint32_t socket_mode = 0660;
  int32_t metrics_port = 9464;  // -1: no /metrics; 0: any free port (logged)
  std::string metrics_bind = "0.0.0.0";

  // The backend, the host cache, reactors and the largest value: the settings table's keys
  // ([backend], [cache], [controller]), flags and variables.
  gdkv::StoreSettings store = daemon_settings();
  uint32_t idle_spin_us = 200;
  bool never_sleep = false;
  bool gpu = true;  // CUDA builds: use the GPU copy engine and accept device memory when a GPU is

  uint32_t max_clients = 64;
  uint32_t max_dma_maps = 1024;
  uint32_t dma_reply_timeout_ms = 10000;                // DMA_READ/DMA_WRITE replies (no-fd memory)
  uint64_t message_bounce_bytes = uint64_t{256} << 20;  // bounce memory per client (no-fd memory)
  bool allow_unsealed_memory = false;
  uint16_t msix_vectors = 32;
  std::vector<gdkv::VfioUserNamespace> namespaces;  // empty: nsid 1 for everyone

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
