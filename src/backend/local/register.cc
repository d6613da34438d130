// The local store's registration (gdkv/backend_registry.h): its settings and how to open it.
#include <vector>

#include "gdkv/backend_factory.h"
#include "gdkv/backend_registry.h"
#include "gdkv/local_backend.h"

// ---- registration (gdkv/backend_registry.h) ----

void gdkv_register_backend_local(std::vector<gdkv::BackendRegistration>& registry) {
  using gdkv::kSettingAny;
  using gdkv::setting_row;
  using C = gdkv::BackendConfig;
  gdkv::BackendRegistration b;
  b.name = "local";
  b.help = "the embedded log-structured store on local NVMe";
  b.traits.needs_directory = true;
  b.directory_setting = "store";
  b.settings.push_back(setting_row<C>(
      "store", "backend.store", "--store", "", 0, 0, {},
      "local store directory (empty: $GDKV_STORE, else ~/.local/share/gdkv)",
      [](C & c) -> auto& { return c.local.path; }));
  b.settings.push_back(setting_row<C>(
      "capacity", "backend.capacity_bytes", "--capacity", "bytes", 1, kSettingAny, {},
      "local store capacity", [](C & c) -> auto& { return c.local.capacity_bytes; }));
  b.settings.push_back(setting_row<C>(
      "segment_bytes", "backend.segment_bytes", "--segment-bytes", "bytes", 1, kSettingAny, {},
      "local store segment size (a new store's)",
      [](C & c) -> auto& { return c.local.segment_bytes; }));
  b.open = [](const C& c) -> gdkv::Result<std::shared_ptr<gdkv::Backend>> {
    gdkv::LocalBackendOptions o = c.local;
    if (o.path.empty()) o.path = gdkv::default_store_dir();
    o.quotas = c.quotas;
    return gdkv::make_local_backend(o);
  };
  registry.push_back(std::move(b));
}
