// Opening a backend by name (gdkv/backend_registry.h): what the CLI, gdkvd and the tests share.
#pragma once

#include <any>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/backend_registry.h"
#include "gdkv/local_backend.h"
#include "gdkv/rados_backend.h"

namespace gdkv {

struct BackendConfig {
  BackendConfig();  // every registered backend's options at their defaults

  std::string kind = "local";  // a registered backend's name
  MemoryBackendOptions memory;
  LocalBackendOptions local;  // local.path empty: default_store_dir()
  RadosBackendOptions rados;
  // tiered: the local store (`local`) in front of this far tier, a backend that can be one
  // ("rados", or "memory" for tests).
  std::string tiered_far = "rados";
  // Per-namespace byte limits (backend.h); each backend's open passes them on.
  NamespaceQuotas quotas;
  // The options of backends that bring their own struct, by backend name.
  std::map<std::string, std::any> options;

  // Backend `name`'s options struct. REQUIRES: the backend registered an O.
  template <class O>
  O& options_of(const std::string& name) {
    return std::any_cast<O&>(options.at(name));
  }
  template <class O>
  const O& options_of(const std::string& name) const {
    return std::any_cast<const O&>(options.at(name));
  }
};

// The backends this build has, in registration order (librados' only when it was found).
std::vector<std::string> available_backends();

// Opens the backend; an Error (gdkv/result.h, a clear message) on an unknown kind or a failure.
Result<std::shared_ptr<Backend>> open_backend(const BackendConfig& config);

// $GDKV_STORE, else $XDG_DATA_HOME/gdkv, else $HOME/.local/share/gdkv.
std::string default_store_dir();

}  // namespace gdkv
