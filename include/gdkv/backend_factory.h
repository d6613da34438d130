// Opening a backend by name: what the CLI, gdkvd and the tests share.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/local_backend.h"
#include "gdkv/rados_backend.h"

namespace gdkv {

struct BackendConfig {
  std::string kind = "local";  // memory | local | rados | tiered
  MemoryBackendOptions memory;
  LocalBackendOptions local;  // local.path empty: default_store_dir()
  RadosBackendOptions rados;
  // tiered: the local store (`local`) in front of this far tier, "rados" (`rados`) or, for
  // tests, "memory" (`memory`).
  std::string tiered_far = "rados";
};

// The backends this build has ("memory", "local", and "rados" when librados was found).
std::vector<std::string> available_backends();

// Opens the backend; an Error (gdkv/result.h, a clear message) on an unknown kind or a failure.
Result<std::shared_ptr<Backend>> open_backend(const BackendConfig& config);

// $GDKV_STORE, else $XDG_DATA_HOME/gdkv, else $HOME/.local/share/gdkv.
std::string default_store_dir();

}  // namespace gdkv
