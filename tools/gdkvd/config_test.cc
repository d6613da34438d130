// gdkvd configuration: TOML keys, error messages with line numbers, and the precedence
// file < environment < flags.
#include "config.h"

#include "setting_samples.h"
#include "settings_flags.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

namespace gdkvd {
namespace {

std::string gdkv_tools_env(const char* flag) { return gdkv_tools::env_name("GDKVD_", flag); }

int run(std::vector<std::string> args, Config& c, std::string* err) {
  args.insert(args.begin(), "gdkvd");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return load(static_cast<int>(argv.size()), argv.data(), c, err);
}

// /removed lists every namespace's removed keys: gdkvd serves it on loopback unless told.
TEST(Config, MetricsListenOnLoopbackByDefault) {
  EXPECT_EQ(Config{}.daemon.metrics_bind, "127.0.0.1");
  Config c;
  std::string err;
  ::unsetenv(gdkv_tools_env("--metrics-bind").c_str());
  ASSERT_EQ(run({}, c, &err), 0) << err;
  EXPECT_EQ(c.daemon.metrics_bind, "127.0.0.1");
}

TEST(Config, Toml) {
  Config c;
  std::string err;
  ASSERT_TRUE(load_toml(R"(
socket_dir = "/tmp/x"
socket_mode = 0o666
metrics_port = -1
dma_reply_timeout_ms = 250
message_bounce_bytes = 16777216
[backend]
kind = "memory"
[controller]
reactors = 3
never_sleep = true
[cache]
bytes = 0
[[namespace]]
nsid = 1
backend_namespace = 4
uids = [1000, 1001]
[[namespace]]
nsid = 1
backend_namespace = 5
name = "b"
gids = [20]
)",
                        "t.toml", c, &err))
      << err;
  EXPECT_EQ(c.daemon.server.socket_dir, "/tmp/x");
  EXPECT_EQ(c.daemon.server.socket_mode, 0666u);
  EXPECT_EQ(c.daemon.metrics_port, -1);
  EXPECT_EQ(c.store.controller.reactors, 3u);
  EXPECT_EQ(c.daemon.server.dma_reply_timeout_ms, 250u);
  EXPECT_EQ(c.daemon.server.message_bounce_bytes, 16u << 20);
  EXPECT_TRUE(c.store.controller.never_sleep);
  const auto& namespaces = c.daemon.server.namespaces;
  ASSERT_EQ(namespaces.size(), 2u);
  EXPECT_EQ(namespaces[0].backend_namespace, 4u);
  EXPECT_EQ(namespaces[0].uids, (std::vector<uint32_t>{1000, 1001}));
  EXPECT_EQ(namespaces[0].name, "ns4");
  EXPECT_EQ(namespaces[1].gids, (std::vector<uint32_t>{20}));
  EXPECT_TRUE(validate(c, &err)) << err;
  // The effective configuration reads back the same.
  Config again;
  ASSERT_TRUE(load_toml(to_toml(c), "echo", again, &err)) << err << "\n" << to_toml(c);
  EXPECT_EQ(to_toml(again), to_toml(c));
}

TEST(Config, ErrorsNameTheLine) {
  Config c;
  std::string err;
  EXPECT_FALSE(load_toml("socket_dir = 3\n", "a.toml", c, &err));
  EXPECT_EQ(err, "a.toml:1: socket_dir: must be a string");
  EXPECT_FALSE(load_toml("\n[controller]\nreactorz = 2\n", "b.toml", c, &err));
  EXPECT_EQ(err, "b.toml:3: controller.reactorz: unknown key");
  EXPECT_FALSE(load_toml("[backend]\nop_timeout_ms = 2000\n", "r.toml", c, &err));
  EXPECT_EQ(err, "r.toml:2: backend.op_timeout_ms: unknown key (renamed ceph_timeout_ms)");
  Config t;
  ASSERT_TRUE(load_toml("[backend]\nceph_timeout_ms = 2000\n", "t.toml", t, &err)) << err;
  EXPECT_EQ(t.store.backend.rados.ceph_timeout_ms, 2000u);
  EXPECT_FALSE(load_toml("[controller]\nreactors = 0\n", "c.toml", c, &err));
  EXPECT_NE(err.find("c.toml:2: controller.reactors: must be in [1, 256]"), std::string::npos);
  EXPECT_FALSE(load_toml("x = [", "d.toml", c, &err));
  EXPECT_EQ(err.rfind("d.toml:1:", 0), 0u) << err;
  EXPECT_FALSE(load_toml("namespace = 3\n", "e.toml", c, &err));
  EXPECT_FALSE(load_toml("message_bounce_bytes = 4096\n", "h.toml", c, &err));  // < 1 MiB
  EXPECT_FALSE(load_toml("[[namespace]]\nnsid = 2000\n", "f.toml", c, &err));
  EXPECT_FALSE(load_toml("[[namespace]]\nuids = [-1]\n", "g.toml", c, &err));
  Config v;
  v.store.backend.kind = "disk";
  EXPECT_FALSE(validate(v, &err));
  v = Config{};
  v.store.backend.kind = "memory";
  v.daemon.server.namespaces = {{1, 1, "a", {}, {}}, {1, 2, "b", {5}, {}}};
  EXPECT_FALSE(validate(v, &err));  // the second entry could never be seen
}

TEST(Config, FileThenEnvironmentThenFlags) {
  char path[] = "/tmp/gdkvd-config-XXXXXX";
  const int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  ::close(fd);
  {
    std::ofstream f(path);
    f << "socket_dir = \"/from/file\"\nmetrics_port = 1111\n[backend]\nkind = \"memory\"\n"
         "memory_capacity_bytes = 1000\n[controller]\nreactors = 5\n";
  }
  ::setenv("GDKVD_METRICS_PORT", "2222", 1);
  ::setenv("GDKVD_REACTORS", "6", 1);
  Config c;
  std::string err;
  ASSERT_EQ(run({"--config", path, "--reactors", "7", "--socket-mode", "0600"}, c, &err), 0) << err;
  EXPECT_EQ(c.daemon.server.socket_dir, "/from/file");  // file
  EXPECT_EQ(c.daemon.metrics_port, 2222);               // environment over file
  EXPECT_EQ(c.store.controller.reactors, 7u);           // flag over environment
  EXPECT_EQ(c.daemon.server.socket_mode, 0600u);
  EXPECT_EQ(c.store.backend.memory.capacity_bytes, 1000u);  // file
  Config m;
  ASSERT_EQ(run({"--config", path, "--memory-capacity", "268435456"}, m, &err), 0) << err;
  EXPECT_EQ(m.store.backend.memory.capacity_bytes, uint64_t{256} << 20);  // flag over file
  EXPECT_EQ(Config{}.store.backend.memory.capacity_bytes, uint64_t{1} << 30);
  ::unsetenv("GDKVD_METRICS_PORT");
  ::unsetenv("GDKVD_REACTORS");
  Config bad;
  EXPECT_EQ(run({"--config", path, "--socket-mode", "99"}, bad, &err), 2);
  EXPECT_EQ(run({"--backend", "tape"}, bad, &err), 2);
  EXPECT_EQ(run({"--config", "/nonexistent/gdkvd.toml"}, bad, &err), 2);
  EXPECT_NE(err.find("cannot read config file"), std::string::npos);
  // The RADOS timeout's old variable is refused, not ignored (as its TOML key and flag are).
  ::setenv("GDKVD_OP_TIMEOUT_MS", "1000", 1);
  EXPECT_EQ(run({"--backend", "memory"}, bad, &err), 2);
  EXPECT_EQ(err, "GDKVD_OP_TIMEOUT_MS: renamed GDKVD_CEPH_TIMEOUT_MS");
  ::unsetenv("GDKVD_OP_TIMEOUT_MS");
  EXPECT_EQ(run({"--op-timeout-ms", "1000"}, bad, &err), 2);
  ::unlink(path);
}

// Every row of `table` reaches gdkvd through its TOML key, its flag and its GDKVD_ variable, and
// the effective configuration prints it. `part` picks the table's struct out of a Config.
template <class T, class Part>
void every_setting_in_every_form(const std::vector<gdkv::Setting<T>>& table, Part part) {
  using gdkv::testing::as_argument;
  using gdkv::testing::other_value;
  Config defaults;
  for (const gdkv::Setting<T>& x : table) {
    const gdkv::SettingValue v = other_value(x, part(defaults));
    const std::string key = x.toml;
    const size_t dot = key.find('.');
    const std::string table_line = dot == std::string::npos ? "" : "[" + key.substr(0, dot) + "]\n";
    const std::string name = dot == std::string::npos ? key : key.substr(dot + 1);
    std::string err;
    Config file;
    T expect = part(defaults);
    ASSERT_EQ(x.set(expect, v), "");
    ASSERT_TRUE(load_toml(table_line + name + " = " + x.text(expect) + "\n", "s.toml", file, &err))
        << key << ": " << err;
    EXPECT_EQ(x.get(part(file)), v) << key;
    EXPECT_NE(to_toml(file).find(name + " = " + x.text(expect) + "\n"), std::string::npos) << key;

    Config flag;
    const bool is_bool = x.type == gdkv::SettingInfo::Type::kBool;
    std::vector<std::string> args{"--backend", "memory"};
    if (is_bool) {
      args.push_back(std::get<bool>(v) ? x.flag : "--no-" + std::string(x.flag + 2));
    } else {
      args.insert(args.end(), {x.flag, as_argument(x, v)});
    }
    if (key == "backend.kind") args.erase(args.begin(), args.begin() + 2);
    ASSERT_EQ(run(args, flag, &err), 0) << x.flag << ": " << err;
    EXPECT_EQ(x.get(part(flag)), v) << x.flag;

    const std::string env = gdkv_tools_env(x.flag);
    ::setenv(env.c_str(), as_argument(x, v).c_str(), 1);
    Config from_env;
    const int rc = run(key == "backend.kind" ? std::vector<std::string>{}
                                             : std::vector<std::string>{"--backend", "memory"},
                       from_env, &err);
    ::unsetenv(env.c_str());
    ASSERT_EQ(rc, 0) << env << ": " << err;
    EXPECT_EQ(x.get(part(from_env)), v) << env;
  }
}

TEST(Config, EverySettingInEveryForm) {
  const Config defaults;
  EXPECT_EQ(defaults.store.controller.reactors, 2u);  // daemon_store_settings()
  EXPECT_TRUE(defaults.store.backend.rados.evict);
  EXPECT_EQ(defaults.store.cache.capacity_bytes, uint64_t{1} << 30);
  every_setting_in_every_form(
      gdkv::store_settings(), [](Config & c) -> auto& { return c.store; });
  every_setting_in_every_form(
      gdkv::daemon_settings(), [](Config & c) -> auto& { return c.daemon; });
}

// What --check-config prints reads back as the same settings, whatever a flag or variable set:
// strings with quotes, backslashes and control characters, and the largest sizes.
TEST(Config, PrintedConfigurationReadsBack) {
  Config c;
  const gdkv::StoreSetting* store = gdkv::find_setting("store");
  const gdkv::StoreSetting* capacity = gdkv::find_setting("capacity");
  ASSERT_NE(store, nullptr);
  ASSERT_NE(capacity, nullptr);
  const std::string odd = "/a \"b\" \\c\nd\te\x01\x7f";
  ASSERT_EQ(store->set(c.store, odd), "");
  ASSERT_EQ(capacity->set(c.store, capacity->max), "");
  EXPECT_NE(capacity->set(c.store, uint64_t(capacity->max) + 1), "");
  // gdkvd's own strings too: the socket directory, the metrics address, a namespace's name.
  const std::string dir = "/tmp/a\"b\\c";
  c.daemon.server.socket_dir = dir;
  c.daemon.metrics_bind = "x\"y";
  c.daemon.server.namespaces = {{1, 1, "n\"s\n", {}, {}}};
  Config back;
  std::string err;
  ASSERT_TRUE(load_toml(to_toml(c), "printed.toml", back, &err)) << err << "\n" << to_toml(c);
  EXPECT_EQ(store->get(back.store), gdkv::SettingValue{odd});
  EXPECT_EQ(capacity->get(back.store), gdkv::SettingValue{uint64_t(capacity->max)});
  EXPECT_EQ(back.daemon.server.socket_dir, dir);
  EXPECT_EQ(back.daemon.metrics_bind, "x\"y");
  ASSERT_EQ(back.daemon.server.namespaces.size(), 1u);
  EXPECT_EQ(back.daemon.server.namespaces[0].name, "n\"s\n");
  EXPECT_EQ(to_toml(back), to_toml(c));
}

// A variable set to a string TOML must escape (the socket directory with a quote) comes back from
// --check-config's output unchanged.
TEST(Config, CheckConfigOfAnEnvironmentValueReadsBack) {
  ::setenv("GDKVD_SOCKET_DIR", "/tmp/a\"b", 1);
  Config c;
  std::string err;
  const int rc = run({"--backend", "memory", "--check-config"}, c, &err);
  ::unsetenv("GDKVD_SOCKET_DIR");
  ASSERT_EQ(rc, 0) << err;
  EXPECT_TRUE(c.check_only);
  Config back;
  ASSERT_TRUE(load_toml(to_toml(c), "checked.toml", back, &err)) << err << "\n" << to_toml(c);
  EXPECT_EQ(back.daemon.server.socket_dir, "/tmp/a\"b");
}

// Namespaces are rows too: [[namespace]] keys, --namespace KEY=VALUE,... (again for each) and
// GDKVD_NAMESPACES read the same rows, refuse the same values, and print back as they were read.
TEST(Config, NamespacesFromFlagsAndEnvironmentReadBack) {
  Config c;
  std::string err;
  ASSERT_EQ(run({"--backend", "memory", "--namespace", "nsid=2,name=a\"b,uids=1000:1001",
                 "--namespace", "nsid=3,backend_namespace=7,gids=20"},
                c, &err),
            0)
      << err;
  const auto& ns = c.daemon.server.namespaces;
  ASSERT_EQ(ns.size(), 2u);
  EXPECT_EQ(ns[0].nsid, 2u);
  EXPECT_EQ(ns[0].backend_namespace, 2u);  // its nsid's, when not given
  EXPECT_EQ(ns[0].name, "a\"b");
  EXPECT_EQ(ns[0].uids, (std::vector<uint32_t>{1000, 1001}));
  EXPECT_EQ(ns[1].backend_namespace, 7u);
  EXPECT_EQ(ns[1].name, "ns7");
  EXPECT_EQ(ns[1].gids, (std::vector<uint32_t>{20}));
  Config back;
  ASSERT_TRUE(load_toml(to_toml(c), "printed.toml", back, &err)) << err << "\n" << to_toml(c);
  EXPECT_EQ(to_toml(back), to_toml(c));

  // The flags replace the file's entries; the variable holds several, space-separated.
  ::setenv("GDKVD_NAMESPACES", "nsid=4 nsid=5,uids=7", 1);
  Config e;
  const int rc = run({"--backend", "memory"}, e, &err);
  ::unsetenv("GDKVD_NAMESPACES");
  ASSERT_EQ(rc, 0) << err;
  ASSERT_EQ(e.daemon.server.namespaces.size(), 2u);
  EXPECT_EQ(e.daemon.server.namespaces[1].uids, (std::vector<uint32_t>{7}));

  const std::pair<const char*, const char*> bad[] = {
      {"nsid=0", "--namespace 'nsid=0': nsid: must be in [1, 1024]"},
      {"nsid=2,uids=1:x", "--namespace 'nsid=2,uids=1:x': uids: must be a list of ids"},
      {"uids=1::2", "--namespace 'uids=1::2': uids: must be a list of ids"},
      {"uids=4294967296", "--namespace 'uids=4294967296': uids: must be a list of ids"},
      {"nsid=2,", "--namespace 'nsid=2,': '' is not KEY=VALUE"},
      {"size=1", "--namespace 'size=1': size: unknown key"},
  };
  for (const auto& [spec, want] : bad) {
    Config x;
    EXPECT_EQ(run({"--backend", "memory", "--namespace", spec}, x, &err), 2) << spec;
    EXPECT_EQ(err.rfind(want, 0), 0u) << err;
  }
  for (const char* text : {"[[namespace]]\nuids = \"1\"\n", "[[namespace]]\nuids = [\"a\"]\n",
                           "[[namespace]]\ngids = [1.5]\n"}) {
    Config x;
    EXPECT_FALSE(load_toml(text, "n.toml", x, &err)) << text;
    EXPECT_NE(err.find("must be a list of ids"), std::string::npos) << err;
  }
}

TEST(Config, NamespaceQuotasGoToTheirBackendNamespace) {
  Config c;
  std::string err;
  ASSERT_EQ(run({"--backend", "memory", "--namespace", "nsid=1,capacity_bytes=4096,uids=1",
                 "--namespace", "nsid=1,backend_namespace=3,capacity_bytes=8192", "--namespace",
                 "nsid=2,backend_namespace=3,capacity_bytes=8192", "--namespace", "nsid=4"},
                c, &err),
            0)
      << err;
  EXPECT_EQ(c.store.backend.quotas, (gdkv::NamespaceQuotas{{1, 4096}, {3, 8192}}));
  Config back;
  ASSERT_TRUE(load_toml(to_toml(c), "printed.toml", back, &err)) << err;
  ASSERT_TRUE(validate(back, &err)) << err;
  EXPECT_EQ(back.store.backend.quotas, c.store.backend.quotas);

  Config x;
  EXPECT_EQ(run({"--backend", "memory", "--namespace", "nsid=1,capacity_bytes=4096,uids=1",
                 "--namespace", "nsid=2,backend_namespace=1,capacity_bytes=1"},
                x, &err),
            2);
  EXPECT_EQ(err, "backend namespace 1 is given two capacity_bytes (4096 and 1)");
  EXPECT_EQ(run({"--backend", "memory", "--namespace", "capacity_bytes=-1"}, x, &err), 2);
}

TEST(Config, SettingsRefuseBadValuesWithTheirReason) {
  Config c;
  std::string err;
  const std::pair<const char*, const char*> cases[] = {
      {"[backend]\nevict = 1\n", "s.toml:2: backend.evict: must be true or false"},
      {"[backend]\npool = 3\n", "s.toml:2: backend.pool: must be a string"},
      {"[cache]\nbytes = -1\n", "s.toml:2: cache.bytes: must be in [0, 9223372036854775807]"},
      {"[cache]\nbytes = 1.5\n", "s.toml:2: cache.bytes: must be an integer"},
      {"[cache]\npolicy = \"mru\"\n", "s.toml:2: cache.policy: 'mru' is not one of adaptive, "},
      {"[backend]\nkind = \"disk\"\n",
       "s.toml:2: backend.kind: 'disk' is not one of files, local, memory, rados, tiered"},
  };
  for (const auto& [text, want] : cases) {
    EXPECT_FALSE(load_toml(text, "s.toml", c, &err)) << text;
    EXPECT_EQ(err.rfind(want, 0), 0u) << err;
  }
  Config bad;
  EXPECT_EQ(run({"--evict-high-percent", "101"}, bad, &err), 2);
  EXPECT_EQ(run({"--cache-policy", "mru"}, bad, &err), 2);
}

}  // namespace
}  // namespace gdkvd
