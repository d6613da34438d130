#include "gdkv/backend_factory.h"

#include "gdkv/tiered_backend.h"

#include <cstdlib>
#include <stdexcept>

namespace gdkv {

std::vector<std::string> available_backends() {
  std::vector<std::string> v{"memory", "local"};
#ifdef GDKV_HAVE_RADOS
  v.push_back("rados");
  v.push_back("tiered");
#endif
  return v;
}

std::string default_store_dir() {
  if (const char* s = std::getenv("GDKV_STORE"); s != nullptr && *s != '\0') return s;
  if (const char* x = std::getenv("XDG_DATA_HOME"); x != nullptr && *x != '\0') {
    return std::string(x) + "/gdkv";
  }
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') {
    return std::string(h) + "/.local/share/gdkv";
  }
  return "/tmp/gdkv-store";
}

Result<std::shared_ptr<Backend>> open_backend(const BackendConfig& config) {
  if (config.kind == "memory") return make_memory_backend(config.memory);
  if (config.kind == "local") {
    LocalBackendOptions o = config.local;
    if (o.path.empty()) o.path = default_store_dir();
    return make_local_backend(o);
  }
  if (config.kind == "rados") {
#ifdef GDKV_HAVE_RADOS
    return make_rados_backend(config.rados);
#else
    return Error{"this gdkv was built without librados: the rados backend is missing"};
#endif
  }
  if (config.kind == "tiered") {
    if (config.tiered_far != "rados" && config.tiered_far != "memory") {
      return Error{"tiered: the far tier is rados or memory, not '" + config.tiered_far + "'"};
    }
    BackendConfig near = config, far = config;
    near.kind = "local";
    far.kind = config.tiered_far;
    auto n = open_backend(near);
    if (!n) return Error{n.error()};
    auto f = open_backend(far);
    if (!f) return Error{f.error()};
    return make_tiered_backend(std::move(*n), std::move(*f));
  }
  return Error{"unknown backend '" + config.kind + "' (memory, local, rados or tiered)"};
}

}  // namespace gdkv
