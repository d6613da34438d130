// Backends register themselves: each is its folder under src/backend/ and one registration
// (name, traits, its settings' rows, how to open it), which the factory (open_backend), the
// settings table (gdkv/settings.h), the tests' backend parameters and, through the binding,
// Python read. docs/architecture.md, "Adding a backend", says how to add one.
//
// A folder's CMakeLists.txt declares it with gdkv_backend(NAME SOURCES ...), and its sources
// define `void gdkv_register_backend_NAME(std::vector<gdkv::BackendRegistration>&)`; the build
// calls every folder's function once, in the folders' alphabetical order.
//
// Thread safety: the registry is built on first use (thread-safe) and never changes after.
#pragma once

#include <any>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/result.h"
#include "gdkv/setting.h"

namespace gdkv {

struct BackendConfig;

// What the layers above need to know of a backend without naming it.
struct BackendTraits {
  bool can_time_out = false;     // ops fail with 82h (NotReadyError) when a remote service stalls
  bool needs_directory = false;  // keeps values in a directory: its row is directory_setting
  bool can_be_far_tier = false;  // may sit behind the local store in `tiered`
  bool needs_cluster = false;    // reaches a Ceph cluster (the tests start one on 127.0.0.1)
  bool has_far_tier = false;     // `tiered`: the local store in front of a far tier
};

struct BackendRegistration {
  std::string name;  // BackendConfig::kind, the `backend` setting's value
  std::string help;
  BackendTraits traits;
  std::string directory_setting;  // with needs_directory: the name of the row naming it
  // Its settings: rows of BackendConfig, the [backend] keys of gdkvd's TOML. Values live in
  // BackendConfig's member for the backend (memory, local, rados), or, for a backend that brings
  // its own options struct, in BackendConfig::options under its name (default_options).
  std::vector<Setting<BackendConfig>> settings;
  std::any default_options;  // empty: none in BackendConfig::options
  std::function<Result<std::shared_ptr<Backend>>(const BackendConfig&)> open;
};

// Every backend of this build, in registration order.
const std::vector<BackendRegistration>& backend_registry();
// The backend called `name`, or nullptr.
const BackendRegistration* find_backend(std::string_view name);

}  // namespace gdkv
