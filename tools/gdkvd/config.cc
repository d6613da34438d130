// gdkvd configuration: TOML (toml++), GDKVD_* environment variables and flags (CLI11).
#include "config.h"

#include "settings_flags.h"

#include <toml++/toml.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

namespace gdkvd {

namespace {

// Reads typed values from TOML tables, remembering the first error with its line.
class Reader {
 public:
  Reader(const std::string& name, std::string* error) : name_(name), error_(error) {}
  bool ok() const { return ok_; }

  bool fail(const toml::node* n, const std::string& key, const std::string& msg) {
    if (ok_) {
      std::ostringstream s;
      s << name_;
      if (n != nullptr && n->source().begin.line != 0) s << ":" << n->source().begin.line;
      s << ": " << key << ": " << msg;
      *error_ = s.str();
    }
    ok_ = false;
    return false;
  }

  // Unknown keys are errors: a typo must not silently fall back to a default.
  void known_keys(const toml::table& t, const std::string& prefix,
                  const std::vector<std::string>& keys) {
    for (auto&& [k, v] : t) {
      const std::string key(k.str());
      if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
        // The one setting renamed (the RADOS timeout has one name in every front end).
        fail(&v, prefix + key,
             key == "op_timeout_ms" ? "unknown key (renamed ceph_timeout_ms)" : "unknown key");
      }
    }
  }

  // The settings table's keys of TOML table `name` ([backend], [controller], [cache]) into `s`;
  // `own` are the other keys gdkvd reads from that table itself.
  void settings(const toml::table& t, const std::string& name, gdkv::StoreSettings& s,
                std::vector<std::string> own) {
    const std::string prefix = name + ".";
    std::vector<const gdkv::Setting*> here;
    for (const gdkv::Setting& x : gdkv::store_settings()) {
      if (std::string(x.toml).rfind(prefix, 0) == 0) {
        here.push_back(&x);
        own.emplace_back(x.toml + prefix.size());
      }
    }
    known_keys(t, prefix, own);
    for (const gdkv::Setting* x : here) {
      const toml::node* n = t.get(x->toml + prefix.size());
      if (n == nullptr) continue;
      gdkv::SettingValue v;
      if (const auto i = n->value_exact<int64_t>()) {
        if (*i < 0) {
          fail(n, x->toml,
               x->type == gdkv::Setting::Type::kString ? x->type_error() : x->range_error());
          continue;
        }
        v = static_cast<uint64_t>(*i);
      } else if (const auto b = n->value_exact<bool>()) {
        v = *b;
      } else if (const auto str = n->value_exact<std::string>()) {
        v = *str;
      } else {  // a float, an array, a table
        fail(n, x->toml, x->type_error());
        continue;
      }
      if (const std::string err = x->set(s, v); !err.empty()) fail(n, x->toml, err);
    }
  }

  template <class T>
  void uint(const toml::table& t, const std::string& prefix, const char* key, T& out,
            uint64_t min = 0, uint64_t max = std::numeric_limits<T>::max()) {
    const toml::node* n = t.get(key);
    if (n == nullptr) return;
    const auto v = n->value<int64_t>();
    if (!n->is_integer() || !v) {
      fail(n, prefix + key, "must be an integer");
      return;
    }
    if (*v < 0 || static_cast<uint64_t>(*v) < min || static_cast<uint64_t>(*v) > max) {
      fail(n, prefix + key,
           "must be in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
      return;
    }
    out = static_cast<T>(*v);
  }

  void boolean(const toml::table& t, const std::string& prefix, const char* key, bool& out) {
    const toml::node* n = t.get(key);
    if (n == nullptr) return;
    if (!n->is_boolean()) {
      fail(n, prefix + key, "must be true or false");
      return;
    }
    out = *n->value<bool>();
  }

  void string(const toml::table& t, const std::string& prefix, const char* key, std::string& out) {
    const toml::node* n = t.get(key);
    if (n == nullptr) return;
    if (!n->is_string()) {
      fail(n, prefix + key, "must be a string");
      return;
    }
    out = *n->value<std::string>();
  }

  void uint_list(const toml::table& t, const std::string& prefix, const char* key,
                 std::vector<uint32_t>& out) {
    const toml::node* n = t.get(key);
    if (n == nullptr) return;
    const toml::array* a = n->as_array();
    if (a == nullptr) {
      fail(n, prefix + key, "must be an array of integers");
      return;
    }
    for (const toml::node& e : *a) {
      const auto v = e.value<int64_t>();
      if (!e.is_integer() || !v || *v < 0 || *v > std::numeric_limits<uint32_t>::max()) {
        fail(&e, prefix + key, "entries must be ids in [0, 4294967295]");
        return;
      }
      out.push_back(static_cast<uint32_t>(*v));
    }
  }

  const toml::table* table(const toml::table& t, const char* key) {
    const toml::node* n = t.get(key);
    if (n == nullptr) return nullptr;
    if (!n->is_table()) {
      fail(n, key, "must be a table ([" + std::string(key) + "])");
      return nullptr;
    }
    return n->as_table();
  }

 private:
  std::string name_;
  std::string* error_;
  bool ok_ = true;
};

std::string read_file(const std::string& path, std::string* error) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *error = "cannot read config file '" + path + "': " + std::strerror(errno);
    return {};
  }
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

bool load_toml(const std::string& text, const std::string& name, Config& c, std::string* error) {
  toml::table root;
  try {
    root = toml::parse(text, name);
  } catch (const toml::parse_error& e) {
    std::ostringstream s;
    s << name << ":" << e.source().begin.line << ": " << e.description();
    *error = s.str();
    return false;
  }
  Reader r(name, error);
  r.known_keys(
      root, "",
      {"socket_dir", "socket_mode", "metrics_port", "metrics_bind", "max_clients", "max_dma_maps",
       "dma_reply_timeout_ms", "message_bounce_bytes", "allow_unsealed_memory", "msix_vectors",
       "gpu", "backend", "controller", "cache", "namespace"});
  r.string(root, "", "socket_dir", c.socket_dir);
  r.uint(root, "", "socket_mode", c.socket_mode, 0, 0777);
  if (const toml::node* n = root.get("metrics_port")) {
    const auto v = n->value<int64_t>();
    if (!n->is_integer() || !v || *v < -1 || *v > 65535) {
      r.fail(n, "metrics_port", "must be -1 (off) or a port in [0, 65535]");
    } else {
      c.metrics_port = static_cast<int32_t>(*v);
    }
  }
  r.string(root, "", "metrics_bind", c.metrics_bind);
  r.uint(root, "", "max_clients", c.max_clients, 1, 4096);
  r.uint(root, "", "max_dma_maps", c.max_dma_maps, 1, 65535);
  r.uint(root, "", "dma_reply_timeout_ms", c.dma_reply_timeout_ms, 1, 3600000);
  r.uint(root, "", "message_bounce_bytes", c.message_bounce_bytes, uint64_t{1} << 20,
         uint64_t{1} << 40);
  r.boolean(root, "", "allow_unsealed_memory", c.allow_unsealed_memory);
  r.uint(root, "", "msix_vectors", c.msix_vectors, 1, 256);
  r.boolean(root, "", "gpu", c.gpu);

  if (const toml::table* t = r.table(root, "backend")) r.settings(*t, "backend", c.store, {});
  if (const toml::table* t = r.table(root, "controller")) {
    r.settings(*t, "controller", c.store, {"idle_spin_us", "never_sleep"});
    r.uint(*t, "controller.", "idle_spin_us", c.idle_spin_us);
    r.boolean(*t, "controller.", "never_sleep", c.never_sleep);
  }
  if (const toml::table* t = r.table(root, "cache")) r.settings(*t, "cache", c.store, {});
  if (const toml::node* n = root.get("namespace")) {
    const toml::array* a = n->as_array();
    if (a == nullptr || !a->is_array_of_tables()) {
      r.fail(n, "namespace", "must be an array of tables ([[namespace]])");
    } else {
      c.namespaces.clear();
      for (const toml::node& e : *a) {
        const toml::table& t = *e.as_table();
        gdkv::VfioUserNamespace ns;
        r.known_keys(t, "namespace.", {"nsid", "backend_namespace", "name", "uids", "gids"});
        r.uint(t, "namespace.", "nsid", ns.nsid, 1, 1024);
        ns.backend_namespace = ns.nsid;
        r.uint(t, "namespace.", "backend_namespace", ns.backend_namespace, 1, 1024);
        r.string(t, "namespace.", "name", ns.name);
        r.uint_list(t, "namespace.", "uids", ns.uids);
        r.uint_list(t, "namespace.", "gids", ns.gids);
        if (ns.name.empty()) ns.name = "ns" + std::to_string(ns.backend_namespace);
        c.namespaces.push_back(std::move(ns));
      }
    }
  }
  return r.ok();
}

bool validate(Config& c, std::string* error) {
  const auto kinds = gdkv::available_backends();
  if (std::find(kinds.begin(), kinds.end(), c.store.backend.kind) == kinds.end()) {
    std::string all;
    for (const auto& k : kinds) {
      if (!all.empty()) all += ", ";
      all += k;
    }
    *error = "backend '" + c.store.backend.kind + "' is not available (this build has " + all + ")";
    return false;
  }
  if (c.socket_dir.empty()) {
    *error = "socket_dir must not be empty";
    return false;
  }
  if (c.socket_dir.size() + 6 > 107) {
    *error = "socket_dir is too long for a UNIX socket path: " + c.socket_dir;
    return false;
  }
  if (c.store.backend.rados.evict &&
      c.store.backend.rados.evict_low_percent >= c.store.backend.rados.evict_high_percent) {
    *error = "backend.evict_low_percent (" +
             std::to_string(c.store.backend.rados.evict_low_percent) +
             ") must be below backend.evict_high_percent (" +
             std::to_string(c.store.backend.rados.evict_high_percent) + ")";
    return false;
  }
  // Within one tenant's view every nsid must be unique; entries for different tenants may share
  // an nsid (each peer sees the first entry it is allowed).
  for (size_t i = 0; i < c.namespaces.size(); ++i) {
    for (size_t j = i + 1; j < c.namespaces.size(); ++j) {
      const auto& a = c.namespaces[i];
      const auto& b = c.namespaces[j];
      if (a.nsid == b.nsid && a.uids.empty() && a.gids.empty()) {
        *error = "namespace " + std::to_string(a.nsid) +
                 " is open to everyone and configured again: the later entry would never be seen";
        return false;
      }
    }
  }
  return true;
}

std::string to_toml(const Config& c) {
  std::ostringstream s;
  s << "socket_dir = \"" << c.socket_dir << "\"\n";
  s << "socket_mode = 0o" << std::oct << c.socket_mode << std::dec << "\n";
  s << "metrics_port = " << c.metrics_port << "\n";
  s << "metrics_bind = \"" << c.metrics_bind << "\"\n";
  s << "max_clients = " << c.max_clients << "\n";
  s << "max_dma_maps = " << c.max_dma_maps << "\n";
  s << "dma_reply_timeout_ms = " << c.dma_reply_timeout_ms << "\n";
  s << "message_bounce_bytes = " << c.message_bounce_bytes << "\n";
  s << "allow_unsealed_memory = " << (c.allow_unsealed_memory ? "true" : "false") << "\n";
  s << "msix_vectors = " << c.msix_vectors << "\n";
  s << "gpu = " << (c.gpu ? "true" : "false") << "\n";
  for (const std::string table : {"backend", "controller", "cache"}) {
    s << "\n[" << table << "]\n";
    for (const gdkv::Setting& x : gdkv::store_settings()) {
      const std::string key = x.toml;
      if (key.rfind(table + ".", 0) == 0) {
        s << key.substr(table.size() + 1) << " = " << x.text(c.store) << "\n";
      }
    }
    if (table == "controller") {
      s << "idle_spin_us = " << c.idle_spin_us
        << "\nnever_sleep = " << (c.never_sleep ? "true" : "false") << "\n";
    }
  }
  for (const auto& ns : c.namespaces) {
    s << "\n[[namespace]]\nnsid = " << ns.nsid << "\nbackend_namespace = " << ns.backend_namespace
      << "\nname = \"" << ns.name << "\"\nuids = [";
    for (size_t i = 0; i < ns.uids.size(); ++i) s << (i ? ", " : "") << ns.uids[i];
    s << "]\ngids = [";
    for (size_t i = 0; i < ns.gids.size(); ++i) s << (i ? ", " : "") << ns.gids[i];
    s << "]\n";
  }
  return s.str();
}

int load(int argc, char** argv, Config& c, std::string* error) {
  // The file first, so environment and flags override it: find --config before CLI11 runs.
  std::string file;
  if (const char* e = std::getenv("GDKVD_CONFIG"); e != nullptr && *e != '\0') file = e;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--config" && i + 1 < argc) file = argv[i + 1];
    if (a.rfind("--config=", 0) == 0) file = a.substr(9);
  }
  if (!file.empty()) {
    const std::string text = read_file(file, error);
    if (!error->empty()) return 2;
    if (!load_toml(text, file, c, error)) return 2;
    c.config_file = file;
  }

  // The one variable renamed, as its TOML key and flag were: set, it would be ignored in silence.
  if (std::getenv("GDKVD_OP_TIMEOUT_MS") != nullptr) {
    *error = "GDKVD_OP_TIMEOUT_MS: renamed GDKVD_CEPH_TIMEOUT_MS";
    return 2;
  }

  CLI::App app{"gdkvd: the gdkv controller as a vfio-user NVMe-KV device"};
  // A flag given twice: the last one wins (wrappers append overrides).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  std::string dummy;
  app.add_option("--config", dummy, "TOML configuration file (GDKVD_CONFIG)");
  auto opt = [&](const char* flag, auto& var, const char* help, const char* env) {
    return app.add_option(flag, var, help)->envname(env);
  };
  opt("--socket-dir", c.socket_dir, "directory of the vfio-user socket <dir>/cntrl",
      "GDKVD_SOCKET_DIR");
  opt("--socket-mode", c.socket_mode, "permissions of the socket (octal, e.g. 0660)",
      "GDKVD_SOCKET_MODE")
      ->transform([](const std::string& s) {
        size_t used = 0;
        unsigned long v = 01000;
        try {
          v = std::stoul(s, &used, 8);
        } catch (const std::exception&) {
        }
        if (used != s.size() || v > 0777) {
          throw CLI::ValidationError("--socket-mode", "'" + s + "' is not octal permissions");
        }
        return std::to_string(v);
      });
  opt("--metrics-port", c.metrics_port, "/metrics port (-1: off, 0: any free port)",
      "GDKVD_METRICS_PORT")
      ->check(CLI::Range(-1, 65535));
  opt("--metrics-bind", c.metrics_bind, "address /metrics listens on", "GDKVD_METRICS_BIND");
  // The settings table: --backend, --capacity, --cache-bytes, ... with GDKVD_BACKEND, ...
  gdkv_tools::add_setting_flags(app, c.store, "GDKVD_");
  opt("--idle-spin-us", c.idle_spin_us, "microseconds a reactor spins idle before sleeping",
      "GDKVD_IDLE_SPIN_US");
  app.add_flag("--never-sleep,!--may-sleep", c.never_sleep,
               "reactors poll without ever sleeping (lowest latency, one core each)")
      ->envname("GDKVD_NEVER_SLEEP");
  opt("--max-clients", c.max_clients, "vfio-user connections at once", "GDKVD_MAX_CLIENTS")
      ->check(CLI::Range(1u, 4096u));
  app.add_flag("--allow-unsealed-memory", c.allow_unsealed_memory,
               "accept DMA memory a client could shrink (SPDK hugepages; trusted clients only)")
      ->envname("GDKVD_ALLOW_UNSEALED_MEMORY");
  app.add_flag("--gpu,!--no-gpu", c.gpu, "use the GPU when this build and machine have one")
      ->envname("GDKVD_GPU");
  app.add_flag("--check-config", c.check_only, "print the effective configuration and exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    app.exit(e);
    return 1;
  } catch (const CLI::ParseError& e) {
    *error = e.what();
    return 2;
  }
  if (!validate(c, error)) return 2;
  return 0;
}

}  // namespace gdkvd
