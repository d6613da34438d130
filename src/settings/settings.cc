// The settings tables (include/gdkv/settings.h).
#include "gdkv/settings.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace gdkv {
namespace {

constexpr int64_t kAny = kSettingAny;
constexpr int64_t kHour = 3'600'000;

BackendConfig& backend_of(StoreSettings& s) { return s.backend; }

// Help text built at run time, kept for the program's life (rows hold a const char*).
const char* help_text(std::string text) {
  static std::vector<std::unique_ptr<std::string>> texts;
  texts.push_back(std::make_unique<std::string>(std::move(text)));
  return texts.back()->c_str();
}

std::vector<StoreSetting> make_store_table() {
  using S = StoreSettings;
  std::vector<StoreSetting> t;
  // The backend, and each backend's own rows (its registration's).
  std::vector<std::string> kinds;
  std::string help = "which backend:";
  for (const BackendRegistration& b : backend_registry()) {
    kinds.push_back(b.name);
    help += (kinds.size() > 1 ? "; " : " ") + b.name + ", " + b.help;
  }
  t.push_back(setting_row<S>(
      "backend", "backend.kind", "--backend", "", 0, 0, kinds, "",
      [](S & s) -> auto& { return s.backend.kind; }));
  t.back().help = help_text(std::move(help));
  for (const BackendRegistration& b : backend_registry()) {
    for (StoreSetting& r : lift_settings<S, BackendConfig>(b.settings, &backend_of)) {
      t.push_back(std::move(r));
    }
  }
  // The controller.
  t.push_back(setting_row<S>(
      "reactors", "controller.reactors", "--reactors", "", 1, 256, {}, "reactor threads",
      [](S & s) -> auto& { return s.controller.reactors; }));
  t.push_back(setting_row<S>(
      "max_value_bytes", "controller.max_value_bytes", "--max-value", "bytes", 1, uint64_t{1} << 32,
      {}, "the largest value a Store accepts",
      [](S & s) -> auto& { return s.controller.max_value_bytes; }));
  t.push_back(setting_row<S>(
      "idle_spin_us", "controller.idle_spin_us", "--idle-spin-us", "us", 0, 1'000'000, {},
      "a reactor with no work spins this long before it sleeps (0: sleeps at once)",
      [](S & s) -> auto& { return s.controller.idle_spin_us; }));
  t.push_back(setting_row<S>(
      "never_sleep", "controller.never_sleep", "--never-sleep", "", 0, 0, {},
      "reactors poll without ever sleeping (lowest latency, one core each)",
      [](S & s) -> auto& { return s.controller.never_sleep; }));
  // The host cache.
  t.push_back(setting_row<S>(
      "cache_bytes", "cache.bytes", "--cache-bytes", "bytes", 0, kAny, {},
      "host cache in front of the backend (0: none)",
      [](S & s) -> auto& { return s.cache.capacity_bytes; }));
  t.push_back(setting_row<S>(
      "cache_policy", "cache.policy", "--cache-policy", "", 0, 0, cache_policies(),
      "the host cache's eviction policy", [](S & s) -> auto& { return s.cache.policy; }));
  t.push_back(setting_row<S>(
      "prefetch_depth", "cache.prefetch_depth", "--prefetch-depth", "", 0, 1024, {},
      "blocks the cache fetches ahead along a learned chain (0: off)",
      [](S & s) -> auto& { return s.cache.prefetch_depth; }));
  return t;
}

std::vector<DaemonSetting> make_daemon_table() {
  using D = DaemonSettings;
  std::vector<DaemonSetting> t;
  t.push_back(setting_row<D>(
      "socket_dir", "socket_dir", "--socket-dir", "", 0, 0, {},
      "directory of the vfio-user socket <dir>/cntrl (created if missing)",
      [](D & d) -> auto& { return d.server.socket_dir; }));
  t.push_back(setting_row<D>(
      "socket_mode", "socket_mode", "--socket-mode", "octal", 0, 0777, {},
      "permissions of the socket file", [](D & d) -> auto& { return d.server.socket_mode; }));
  t.push_back(setting_row<D>(
      "max_clients", "max_clients", "--max-clients", "", 1, 4096, {},
      "vfio-user connections at once; more are closed at accept",
      [](D & d) -> auto& { return d.server.max_clients; }));
  t.push_back(setting_row<D>(
      "max_dma_maps", "max_dma_maps", "--max-dma-maps", "", 1, 65535, {},
      "DMA_MAP regions per connection", [](D & d) -> auto& { return d.server.max_dma_maps; }));
  t.push_back(setting_row<D>(
      "dma_reply_timeout_ms", "dma_reply_timeout_ms", "--dma-reply-timeout-ms", "ms", 1, kHour, {},
      "a DMA_READ/DMA_WRITE reply later than this fails the command (memory without an fd)",
      [](D & d) -> auto& { return d.server.dma_reply_timeout_ms; }));
  t.push_back(setting_row<D>(
      "message_bounce_bytes", "message_bounce_bytes", "--message-bounce-bytes", "bytes", 1 << 20,
      int64_t{1} << 40, {}, "bounce memory per client for memory without an fd",
      [](D & d) -> auto& { return d.server.message_bounce_bytes; }));
  t.push_back(setting_row<D>(
      "allow_unsealed_memory", "allow_unsealed_memory", "--allow-unsealed-memory", "", 0, 0, {},
      "accept DMA memory a client could shrink (SPDK hugepages; trusted clients only)",
      [](D & d) -> auto& { return d.server.allow_unsealed_memory; }));
  t.push_back(setting_row<D>(
      "msix_vectors", "msix_vectors", "--msix-vectors", "", 1, 256, {},
      "MSI-X vectors of the device", [](D & d) -> auto& { return d.server.msix_vectors; }));
  t.push_back(setting_row<D>(
      "metrics_port", "metrics_port", "--metrics-port", "", -1, 65535, {},
      "/metrics and /removed port (-1: off, 0: any free port)",
      [](D & d) -> auto& { return d.metrics_port; }));
  t.push_back(setting_row<D>(
      "metrics_bind", "metrics_bind", "--metrics-bind", "", 0, 0, {}, "address /metrics listens on",
      [](D & d) -> auto& { return d.metrics_bind; }));
  t.push_back(setting_row<D>(
      "gpu", "gpu", "--gpu", "", 0, 0, {},
      "CUDA builds: use the GPU copy engines and accept device memory when a GPU is there",
      [](D & d) -> auto& { return d.gpu; }));
  return t;
}

std::vector<ClientSetting> make_client_table() {
  using C = VfioUserClientOptions;
  std::vector<ClientSetting> t;
  t.push_back(setting_row<C>(
      "shared_memory_bytes", "", "--shared-memory-bytes", "bytes", 1 << 20, kAny, {},
      "memory shared with gdkvd (queues, staged values; committed only when touched)",
      [](C & c) -> auto& { return c.shared_memory_bytes; }));
  t.push_back(setting_row<C>(
      "queue_depth", "", "--queue-depth", "", 2, 4096, {}, "I/O queue entries (a power of two)",
      [](C & c) -> auto& { return c.queue_depth; }));
  t.push_back(setting_row<C>(
      "timeout_ms", "", "--timeout-ms", "ms", 1, kHour, {},
      "an I/O command gdkvd does not complete by then fails, and the client with it",
      [](C & c) -> auto& { return c.timeout_ms; }));
  t.push_back(setting_row<C>(
      "admin_timeout_ms", "", "--admin-timeout-ms", "ms", 1, kHour, {},
      "connecting, closing and admin commands wait at most this long",
      [](C & c) -> auto& { return c.admin_timeout_ms; }));
  t.push_back(setting_row<C>(
      "wakeups", "", "--wakeups", "", 0, 0, {},
      "wake a sleeping reactor and wait on interrupts (off: poll and yield)",
      [](C & c) -> auto& { return c.wakeups; }));
  t.push_back(setting_row<C>(
      "wait_spin_us", "", "--wait-spin-us", "us", 0, 1'000'000, {},
      "a waiting client spins this long before it blocks on its completion interrupt",
      [](C & c) -> auto& { return c.wait_spin_us; }));
  return t;
}

std::vector<NamespaceSetting> make_namespace_table() {
  using N = VfioUserNamespace;
  std::vector<NamespaceSetting> t;
  t.push_back(setting_row<N>(
      "nsid", "namespace.nsid", "", "", 1, kMaxNsid, {}, "the NVMe namespace ID clients see",
      [](N & n) -> auto& { return n.nsid; }));
  t.push_back(setting_row<N>(
      "backend_namespace", "namespace.backend_namespace", "", "", 1, kMaxNsid, {},
      "where its keys live: RADOS namespace ns<N>, the local store's index N (default: the nsid)",
      [](N & n) -> auto& { return n.backend_namespace; }));
  t.push_back(setting_row<N>(
      "name", "namespace.name", "", "", 0, 0, {},
      "for logs and the namespace's NGUID (default: ns<backend_namespace>)",
      [](N & n) -> auto& { return n.name; }));
  t.push_back(setting_row<N>(
      "capacity_bytes", "namespace.capacity_bytes", "", "bytes", 0, kAny, {},
      "bytes its keys may hold in the host cache and the store (0: no limit of its own); at the "
      "limit it evicts its own least recently used values, never another namespace's",
      [](N & n) -> auto& { return n.capacity_bytes; }));
  t.push_back(setting_row<N>(
      "uids", "namespace.uids", "", "", 0, 0, {},
      "peers with one of these uids may use it (uids and gids both empty: everyone)",
      [](N & n) -> auto& { return n.uids; }));
  t.push_back(setting_row<N>(
      "gids", "namespace.gids", "", "", 0, 0, {},
      "peers with one of these primary or supplementary gids may use it",
      [](N & n) -> auto& { return n.gids; }));
  return t;
}

}  // namespace

Result<std::shared_ptr<Backend>> open_store(const StoreSettings& s) {
  auto backend = open_backend(s.backend);
  if (!backend || s.cache.capacity_bytes == 0) return backend;
  CacheOptions cache = s.cache;
  cache.quotas = s.backend.quotas;
  return make_cached_backend(*backend, cache);
}

const std::vector<StoreSetting>& store_settings() {
  static const std::vector<StoreSetting> table = make_store_table();
  return table;
}

const std::vector<DaemonSetting>& daemon_settings() {
  static const std::vector<DaemonSetting> table = make_daemon_table();
  return table;
}

const std::vector<ClientSetting>& client_settings() {
  static const std::vector<ClientSetting> table = make_client_table();
  return table;
}

const std::vector<NamespaceSetting>& namespace_settings() {
  static const std::vector<NamespaceSetting> table = make_namespace_table();
  return table;
}

}  // namespace gdkv
