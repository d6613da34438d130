// Every setting of gdkv, declared once: the store's (backend, host cache, controller), gdkvd's
// own (socket, clients, /metrics) and a client's connection to gdkvd. Each is one row of a table
// with its name, type, unit, range, default, flag and TOML key, and every front end reads the
// rows: gdkvd's TOML keys, flags and GDKVD_* variables, the gdkv CLI's flags, gdkv.open's and
// gdkv.connect's keywords and the connectors' config (through gdkv.settings()). A setting's
// default is its field's value in a default-constructed settings struct, and the field's
// default is written in that struct alone (ControllerOptions, VfioUserServerOptions,
// VfioUserClientOptions, ...); gdkvd starts from daemon_store_settings() (tools/gdkvd/config.h),
// which names what a long-running node changes. docs/settings.md is generated from the rows.
//
// Thread safety: the tables are immutable once built (on first use, thread-safe).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gdkv/backend_factory.h"
#include "gdkv/cache.h"
#include "gdkv/controller.h"
#include "gdkv/setting.h"
#include "gdkv/vfio_user.h"

namespace gdkv {

// The store: what gdkvd, the CLI and gdkv.open open and serve.
struct StoreSettings {
  BackendConfig backend;
  // The host cache in front of the backend; capacity 0 (the default here): none.
  CacheOptions cache = [] {
    CacheOptions c;
    c.capacity_bytes = 0;
    return c;
  }();
  // Reactors, the largest value, reactor sleep. The namespaces, copy engine and memory hooks are
  // the front end's, not settings.
  ControllerOptions controller;
};

// gdkvd's own settings besides the store's.
struct DaemonSettings {
  // The socket, clients, DMA limits and MSI-X vectors. The namespaces are entries of
  // namespace_settings()' rows ([[namespace]] tables, --namespace); the log and the device
  // memory importer are set by gdkvd itself.
  VfioUserServerOptions server = [] {
    VfioUserServerOptions o;
    o.socket_dir = "/run/gdkvd";
    return o;
  }();
  int32_t metrics_port = 9464;  // -1: no /metrics; 0: any free port (logged)
  // Where /metrics and /removed listen: loopback by default, since /removed lists every
  // namespace's removed keys (tenants read their own over the NVMe connection, log page C0h);
  // "0.0.0.0" for a Prometheus or router on another host.
  std::string metrics_bind = "127.0.0.1";
  bool gpu = true;  // CUDA builds: use the GPU when the machine has one
};

using StoreSetting = Setting<StoreSettings>;
using DaemonSetting = Setting<DaemonSettings>;
using ClientSetting = Setting<VfioUserClientOptions>;
using NamespaceSetting = Setting<VfioUserNamespace>;

// The backend `s` names, with the host cache in front when s.cache.capacity_bytes > 0: the store
// gdkvd, the CLI and gdkv.open serve. An Error with the reason when either cannot be opened.
Result<std::shared_ptr<Backend>> open_store(const StoreSettings& s);

// The tables, each in the order the docs list it.
const std::vector<StoreSetting>& store_settings();
const std::vector<DaemonSetting>& daemon_settings();
// gdkv.connect's, the CLI's --connect and the connectors' (the memory shared with gdkvd, its
// queue, timeouts and wake-ups).
const std::vector<ClientSetting>& client_settings();
// The keys of one of gdkvd's namespaces: a [[namespace]] table's (TOML "namespace.KEY") and
// --namespace KEY=VALUE,...'s. An entry without backend_namespace stores in its nsid's; one
// without a name is called ns<backend_namespace> (gdkvd fills both in).
const std::vector<NamespaceSetting>& namespace_settings();

// The store setting called `name`, or nullptr.
inline const StoreSetting* find_setting(std::string_view name) {
  return find_setting(store_settings(), name);
}

}  // namespace gdkv
