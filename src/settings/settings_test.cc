// The settings table: names unique in every front end, defaults valid, each value set and read
// back, bad values refused with the reason.
#include "gdkv/settings.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "setting_samples.h"

namespace gdkv {
namespace {

// Names, TOML keys and flags are unique across the three tables: gdkvd and the CLI take two of
// them on one command line, and gdkv.connect and the connectors read store and client names
// from one dict.
TEST(Settings, NamesAreUniqueInEveryFrontEnd) {
  std::set<std::string> names, keys, flags;
  auto check = [&](const SettingInfo& x) {
    EXPECT_TRUE(names.insert(x.name).second) << x.name;
    if (*x.toml != '\0') {
      EXPECT_TRUE(keys.insert(x.toml).second) << x.toml;
    }
    if (*x.flag != '\0') {
      EXPECT_TRUE(flags.insert(x.flag).second) << x.flag;
      EXPECT_EQ(std::string(x.flag).rfind("--", 0), 0u) << x.flag;
    }
    EXPECT_LE(x.min, x.max) << x.name;
  };
  for (const StoreSetting& x : store_settings()) {
    check(x);
    EXPECT_NE(std::string(x.toml).find('.'), std::string::npos) << x.toml;  // in a table
    EXPECT_EQ(find_setting(x.name), &x);
  }
  for (const DaemonSetting& x : daemon_settings()) {
    check(x);
    EXPECT_EQ(std::string(x.toml).find('.'), std::string::npos) << x.toml;  // the top level
    EXPECT_EQ(find_setting(daemon_settings(), x.name), &x);
  }
  for (const ClientSetting& x : client_settings()) {
    check(x);
    EXPECT_STREQ(x.toml, "") << x.name;  // gdkvd's file has no client settings
    EXPECT_EQ(find_setting(client_settings(), x.name), &x);
  }
  for (const NamespaceSetting& x : namespace_settings()) {
    check(x);
    EXPECT_EQ(std::string(x.toml).rfind("namespace.", 0), 0u) << x.toml;  // [[namespace]]
    EXPECT_STREQ(x.flag, "") << x.name;  // a key of --namespace, no flag of its own
  }
  for (const StoreSetting& x : store_settings()) EXPECT_STRNE(x.flag, "") << x.name;
  for (const DaemonSetting& x : daemon_settings()) EXPECT_STRNE(x.flag, "") << x.name;
  for (const ClientSetting& x : client_settings()) EXPECT_STRNE(x.flag, "") << x.name;
  EXPECT_EQ(find_setting("op_timeout_ms"), nullptr);
  EXPECT_NE(find_setting("ceph_timeout_ms"), nullptr);
}

template <class T>
void expect_defaults_valid(const std::vector<Setting<T>>& table) {
  const T defaults;
  for (const Setting<T>& x : table) {
    T s;
    EXPECT_EQ(x.set(s, x.get(defaults)), "") << x.name;
    const SettingValue v = testing::other_value(x, defaults);
    ASSERT_EQ(x.set(s, v), "") << x.name;
    EXPECT_EQ(x.get(s), v) << x.name;
  }
}

TEST(Settings, DefaultsAreValidValues) {
  expect_defaults_valid(store_settings());
  expect_defaults_valid(daemon_settings());
  expect_defaults_valid(client_settings());
  expect_defaults_valid(namespace_settings());
  const StoreSettings defaults;
  EXPECT_EQ(find_setting("backend")->text(defaults), "\"local\"");
  EXPECT_EQ(find_setting("ceph_timeout_ms")->text(defaults), "5000");
  EXPECT_EQ(find_setting("cache_bytes")->text(defaults), "0");
  EXPECT_EQ(find_setting("cache_policy")->text(defaults), "\"adaptive\"");
  EXPECT_EQ(find_setting("evict")->text(defaults), "false");
}

TEST(Settings, EachValueIsSetAndReadBack) {
  StoreSettings s;
  for (const StoreSetting& x : store_settings()) {
    const SettingValue v = testing::other_value(x, s);
    ASSERT_EQ(x.set(s, v), "") << x.name;
    EXPECT_EQ(x.get(s), v) << x.name;
  }
  // The fields themselves, for a few.
  EXPECT_EQ(s.backend.rados.ceph_timeout_ms, 5001u);
  EXPECT_TRUE(s.backend.rados.evict);
  EXPECT_EQ(s.controller.reactors, 2u);
  EXPECT_EQ(s.backend.kind, "files");  // the first choice that is not the default
}

TEST(Settings, BadValuesAreRefusedWithTheReason) {
  StoreSettings s;
  const StoreSetting& reactors = *find_setting("reactors");
  EXPECT_EQ(reactors.set(s, uint64_t{0}), "must be in [1, 256]");
  EXPECT_EQ(reactors.set(s, uint64_t{257}), "must be in [1, 256]");
  EXPECT_EQ(reactors.set(s, std::string("2")), "must be an integer");
  EXPECT_EQ(reactors.set(s, true), "must be an integer");
  EXPECT_EQ(reactors.set(s, int64_t{-1}), "must be in [1, 256]");
  EXPECT_EQ(s.controller.reactors, 1u);  // unchanged
  EXPECT_EQ(find_setting("evict")->set(s, uint64_t{1}), "must be true or false");
  // A list of ids: text with ':' between ids, as a flag spells it.
  VfioUserNamespace n;
  const NamespaceSetting& uids = *find_setting(namespace_settings(), "uids");
  EXPECT_EQ(uids.parse(n, "0:4294967295"), "");
  EXPECT_EQ(n.uids, (std::vector<uint32_t>{0, 4294967295u}));
  EXPECT_EQ(uids.text(n), "[0, 4294967295]");
  EXPECT_EQ(uids.get(n), SettingValue{std::string("0:4294967295")});
  for (const char* bad : {"4294967296", "1:", ":1", "1::2", "-1", "x", "+1", " 1"}) {
    EXPECT_EQ(uids.parse(n, bad), "must be a list of ids in [0, 4294967295]") << bad;
  }
  EXPECT_EQ(uids.set(n, uint64_t{1}), "must be a list of ids in [0, 4294967295]");
  EXPECT_EQ(n.uids.size(), 2u);  // unchanged
  EXPECT_EQ(uids.parse(n, ""), "");
  EXPECT_TRUE(n.uids.empty());
  EXPECT_EQ(find_setting("pool")->set(s, uint64_t{1}), "must be a string");
  EXPECT_EQ(find_setting("backend")->set(s, std::string("disk")),
            "'disk' is not one of files, local, memory, rados, tiered");
  EXPECT_EQ(
      find_setting("cache_policy")->set(s, std::string("mru")).rfind("'mru' is not one of", 0), 0u);
  // A 32-bit field's range ends at its type's.
  EXPECT_EQ(find_setting("atime_interval_ms")->set(s, uint64_t{1} << 32),
            "must be in [0, 4294967295]");
  EXPECT_EQ(find_setting("pool")->set(s, std::string("p\"q")), "");
  EXPECT_EQ(find_setting("pool")->text(s), "\"p\\\"q\"");
}

// gdkvd's settings: a signed port with -1 for off, octal permissions, a 16-bit count.
TEST(Settings, DaemonRowsOfEveryType) {
  DaemonSettings d;
  const DaemonSetting& port = *find_setting(daemon_settings(), "metrics_port");
  EXPECT_EQ(port.text(d), "9464");
  EXPECT_EQ(port.set(d, int64_t{-1}), "");
  EXPECT_EQ(d.metrics_port, -1);
  EXPECT_EQ(port.get(d), SettingValue{int64_t{-1}});
  EXPECT_EQ(port.set(d, int64_t{-2}), "must be in [-1, 65535]");
  EXPECT_EQ(port.set(d, uint64_t{65536}), "must be in [-1, 65535]");
  EXPECT_EQ(port.set(d, uint64_t{1} << 63), "must be in [-1, 65535]");
  const DaemonSetting& mode = *find_setting(daemon_settings(), "socket_mode");
  EXPECT_EQ(mode.text(d), "0o660");
  EXPECT_EQ(mode.set(d, uint64_t{01000}), "must be in [0o0, 0o777]");
  const DaemonSetting& msix = *find_setting(daemon_settings(), "msix_vectors");
  EXPECT_EQ(msix.set(d, uint64_t{256}), "");
  EXPECT_EQ(d.server.msix_vectors, 256);
  EXPECT_EQ(msix.set(d, uint64_t{257}), "must be in [1, 256]");
  EXPECT_EQ(find_setting(daemon_settings(), "socket_dir")->text(d), "\"/run/gdkvd\"");
}

// The defaults are the structs' own: one place each.
TEST(Settings, DefaultsAreTheStructsOwn) {
  const VfioUserClientOptions client;
  EXPECT_EQ(std::get<uint64_t>(find_setting(client_settings(), "shared_memory_bytes")->get(client)),
            client.shared_memory_bytes);
  EXPECT_EQ(std::get<uint64_t>(find_setting(client_settings(), "timeout_ms")->get(client)),
            client.timeout_ms);
  const DaemonSettings daemon;
  EXPECT_EQ(std::get<uint64_t>(find_setting(daemon_settings(), "max_clients")->get(daemon)),
            VfioUserServerOptions{}.max_clients);
  const StoreSettings store;
  EXPECT_EQ(std::get<uint64_t>(find_setting("idle_spin_us")->get(store)),
            ControllerOptions{}.idle_spin_us);
}

}  // namespace
}  // namespace gdkv
