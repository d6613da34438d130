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

  // The rows of `table` that live in TOML table `name` (the top level: "") into `s`; `own` are
  // the other keys of that table (its subtables, or keys gdkvd reads itself).
  template <class T>
  void settings(const toml::table& t, const std::string& name,
                const std::vector<gdkv::Setting<T>>& table, T& s, std::vector<std::string> own) {
    const std::string prefix = name.empty() ? "" : name + ".";
    std::vector<const gdkv::Setting<T>*> here;
    for (const gdkv::Setting<T>& x : table) {
      const std::string key = x.toml;
      const bool in_table = name.empty() ? !key.empty() && key.find('.') == std::string::npos
                                         : key.rfind(prefix, 0) == 0;
      if (in_table) {
        here.push_back(&x);
        own.push_back(key.substr(prefix.size()));
      }
    }
    known_keys(t, prefix, own);
    for (const gdkv::Setting<T>* x : here) {
      const toml::node* n = t.get(x->toml + prefix.size());
      if (n == nullptr) continue;
      gdkv::SettingValue v;
      if (x->type == gdkv::SettingInfo::Type::kIdList && !n->is_array()) {
        fail(n, x->toml, x->type_error());  // TOML writes a list as an array, never as text
        continue;
      }
      if (const auto i = n->value_exact<int64_t>()) {
        v = *i;  // set() takes either sign, and says what is out of range
      } else if (const auto b = n->value_exact<bool>()) {
        v = *b;
      } else if (const auto str = n->value_exact<std::string>()) {
        v = *str;
      } else if (const toml::array* a = n->as_array();
                 a != nullptr && x->type == gdkv::SettingInfo::Type::kIdList) {
        std::string ids;  // as set() takes a list: "1000:1001"
        for (const toml::node& e : *a) {
          const auto id = e.value_exact<int64_t>();
          if (!id || *id < 0) {
            ids = "-";  // set() says what is wrong
            break;
          }
          if (!ids.empty()) ids += ':';
          ids += std::to_string(*id);
        }
        v = ids;
      } else {  // a float, an array, a table
        fail(n, x->toml, x->type_error());
        continue;
      }
      if (const std::string err = x->set(s, v); !err.empty()) fail(n, x->toml, err);
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

// What an entry leaves out: its nsid's backend namespace (unless `backend_given`), and a name.
void complete_namespace(gdkv::VfioUserNamespace& ns, bool backend_given) {
  if (!backend_given) ns.backend_namespace = ns.nsid;
  if (ns.name.empty()) ns.name = "ns" + std::to_string(ns.backend_namespace);
}

// One --namespace value, "nsid=2,name=a,uids=1000:1001": the keys of gdkv::namespace_settings().
bool parse_namespace(const std::string& spec, gdkv::VfioUserNamespace& ns, std::string* error) {
  bool backend_given = false;
  for (size_t at = 0; at <= spec.size();) {
    const size_t end = std::min(spec.find(',', at), spec.size());
    const std::string item = spec.substr(at, end - at);
    at = end + 1;
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    const gdkv::NamespaceSetting* x = gdkv::find_setting(gdkv::namespace_settings(), key);
    std::string err;
    if (eq == std::string::npos) {
      err = "'" + item + "' is not KEY=VALUE";
    } else if (x == nullptr) {
      err = key + ": unknown key";
    } else {
      err = x->parse(ns, item.substr(eq + 1));
      if (!err.empty()) err = key + ": " + err;
    }
    if (!err.empty()) {
      *error = "--namespace '" + spec + "': " + err;
      return false;
    }
    backend_given = backend_given || key == "backend_namespace";
  }
  complete_namespace(ns, backend_given);
  return true;
}

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
  r.settings(root, "", gdkv::daemon_settings(), c.daemon,
             {"backend", "controller", "cache", "namespace"});
  for (const char* table : {"backend", "controller", "cache"}) {
    if (const toml::table* t = r.table(root, table)) {
      r.settings(*t, table, gdkv::store_settings(), c.store, {});
    }
  }
  if (const toml::node* n = root.get("namespace")) {
    const toml::array* a = n->as_array();
    if (a == nullptr || !a->is_array_of_tables()) {
      r.fail(n, "namespace", "must be an array of tables ([[namespace]])");
    } else {
      c.daemon.server.namespaces.clear();
      for (const toml::node& e : *a) {
        const toml::table& t = *e.as_table();
        gdkv::VfioUserNamespace ns;
        r.settings(t, "namespace", gdkv::namespace_settings(), ns, {});
        complete_namespace(ns, t.contains("backend_namespace"));
        c.daemon.server.namespaces.push_back(std::move(ns));
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
  const std::string& socket_dir = c.daemon.server.socket_dir;
  if (socket_dir.empty()) {
    *error = "socket_dir must not be empty";
    return false;
  }
  if (socket_dir.size() + 6 > 107) {
    *error = "socket_dir is too long for a UNIX socket path: " + socket_dir;
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
  const auto& namespaces = c.daemon.server.namespaces;
  for (size_t i = 0; i < namespaces.size(); ++i) {
    for (size_t j = i + 1; j < namespaces.size(); ++j) {
      const auto& a = namespaces[i];
      const auto& b = namespaces[j];
      if (a.nsid == b.nsid && a.uids.empty() && a.gids.empty()) {
        *error = "namespace " + std::to_string(a.nsid) +
                 " is open to everyone and configured again: the later entry would never be seen";
        return false;
      }
    }
  }
  // A quota belongs to the backend namespace: entries that share one must not disagree on it.
  c.store.backend.quotas.clear();
  for (const auto& ns : namespaces) {
    if (ns.capacity_bytes == 0) continue;
    auto [it, added] = c.store.backend.quotas.emplace(ns.backend_namespace, ns.capacity_bytes);
    if (!added && it->second != ns.capacity_bytes) {
      *error = "backend namespace " + std::to_string(ns.backend_namespace) +
               " is given two capacity_bytes (" + std::to_string(it->second) + " and " +
               std::to_string(ns.capacity_bytes) + ")";
      return false;
    }
  }
  return true;
}

std::string to_toml(const Config& c) {
  std::ostringstream s;
  for (const gdkv::DaemonSetting& x : gdkv::daemon_settings()) {
    s << x.toml << " = " << x.text(c.daemon) << "\n";
  }
  for (const std::string table : {"backend", "controller", "cache"}) {
    s << "\n[" << table << "]\n";
    for (const gdkv::StoreSetting& x : gdkv::store_settings()) {
      const std::string key = x.toml;
      if (key.rfind(table + ".", 0) == 0) {
        s << key.substr(table.size() + 1) << " = " << x.text(c.store) << "\n";
      }
    }
  }
  for (const auto& ns : c.daemon.server.namespaces) {
    s << "\n[[namespace]]\n";
    for (const gdkv::NamespaceSetting& x : gdkv::namespace_settings()) {
      s << (x.toml + std::strlen("namespace.")) << " = " << x.text(ns) << "\n";
    }
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
  // The tables: --socket-dir, --max-clients, ... and --backend, --capacity, --cache-bytes, ...
  // with GDKVD_SOCKET_DIR, GDKVD_BACKEND, ...
  gdkv_tools::add_setting_flags(app, gdkv::daemon_settings(), c.daemon, "GDKVD_");
  gdkv_tools::add_setting_flags(app, gdkv::store_settings(), c.store, "GDKVD_");
  // Namespaces: each --namespace replaces the file's [[namespace]] tables with its entries.
  std::vector<std::string> namespaces;
  app.add_option("--namespace", namespaces,
                 "a namespace, KEY=VALUE,... of nsid, backend_namespace, name, uids, gids (ids "
                 "joined by ':'); again for each (GDKVD_NAMESPACES: space-separated)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->envname("GDKVD_NAMESPACES")
      ->delimiter(' ');
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
  if (!namespaces.empty()) {
    c.daemon.server.namespaces.clear();
    for (const std::string& spec : namespaces) {
      gdkv::VfioUserNamespace ns;
      if (!parse_namespace(spec, ns, error)) return 2;
      c.daemon.server.namespaces.push_back(std::move(ns));
    }
  }
  if (!validate(c, error)) return 2;
  return 0;
}

}  // namespace gdkvd
