// The settings table: names unique in every front end, defaults valid, each value set and read
// back, bad values refused with the reason.
#include "gdkv/settings.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "setting_samples.h"

namespace gdkv {
namespace {

TEST(Settings, NamesAreUniqueInEveryFrontEnd) {
  std::set<std::string> names, keys, flags;
  for (const Setting& x : store_settings()) {
    EXPECT_TRUE(names.insert(x.name).second) << x.name;
    EXPECT_TRUE(keys.insert(x.toml).second) << x.toml;
    EXPECT_TRUE(flags.insert(x.flag).second) << x.flag;
    EXPECT_EQ(std::string(x.flag).rfind("--", 0), 0u) << x.flag;
    EXPECT_NE(std::string(x.toml).find('.'), std::string::npos) << x.toml;
    EXPECT_EQ(find_setting(x.name), &x);
  }
  EXPECT_EQ(find_setting("op_timeout_ms"), nullptr);
  EXPECT_NE(find_setting("ceph_timeout_ms"), nullptr);
}

TEST(Settings, DefaultsAreValidValues) {
  const StoreSettings defaults;
  for (const Setting& x : store_settings()) {
    StoreSettings s;
    EXPECT_EQ(x.set(s, x.get(defaults)), "") << x.name;
  }
  EXPECT_EQ(find_setting("backend")->text(defaults), "\"local\"");
  EXPECT_EQ(find_setting("ceph_timeout_ms")->text(defaults), "5000");
  EXPECT_EQ(find_setting("cache_bytes")->text(defaults), "0");
  EXPECT_EQ(find_setting("cache_policy")->text(defaults), "\"adaptive\"");
  EXPECT_EQ(find_setting("evict")->text(defaults), "false");
}

TEST(Settings, EachValueIsSetAndReadBack) {
  StoreSettings s;
  for (const Setting& x : store_settings()) {
    const SettingValue v = testing::other_value(x, s);
    ASSERT_EQ(x.set(s, v), "") << x.name;
    EXPECT_EQ(x.get(s), v) << x.name;
  }
  // The fields themselves, for a few.
  EXPECT_EQ(s.backend.rados.ceph_timeout_ms, 5001u);
  EXPECT_TRUE(s.backend.rados.evict);
  EXPECT_EQ(s.reactors, 2u);
  EXPECT_EQ(s.backend.kind, "memory");
}

TEST(Settings, BadValuesAreRefusedWithTheReason) {
  StoreSettings s;
  const Setting& reactors = *find_setting("reactors");
  EXPECT_EQ(reactors.set(s, uint64_t{0}), "must be in [1, 256]");
  EXPECT_EQ(reactors.set(s, uint64_t{257}), "must be in [1, 256]");
  EXPECT_EQ(reactors.set(s, std::string("2")), "must be an integer");
  EXPECT_EQ(reactors.set(s, true), "must be an integer");
  EXPECT_EQ(s.reactors, 1u);  // unchanged
  EXPECT_EQ(find_setting("evict")->set(s, uint64_t{1}), "must be true or false");
  EXPECT_EQ(find_setting("pool")->set(s, uint64_t{1}), "must be a string");
  EXPECT_EQ(find_setting("backend")->set(s, std::string("disk")),
            "'disk' is not one of memory, local, rados, tiered");
  EXPECT_EQ(
      find_setting("cache_policy")->set(s, std::string("mru")).rfind("'mru' is not one of", 0), 0u);
  // A 32-bit field's range ends at its type's.
  EXPECT_EQ(find_setting("atime_interval_ms")->set(s, uint64_t{1} << 32),
            "must be in [0, 4294967295]");
  EXPECT_EQ(find_setting("pool")->set(s, std::string("p\"q")), "");
  EXPECT_EQ(find_setting("pool")->text(s), "\"p\\\"q\"");
}

}  // namespace
}  // namespace gdkv
