// Backends the shared suites run against: every registered one, set up by its traits (rados and a
// tiered pair over RADOS only when a cluster is configured: GDKV_CEPH_CONF, set by scripts/test).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "gdkv/backend_factory.h"

namespace gdkv::test {

// Every registered backend (gdkv/backend_registry.h).
inline std::vector<std::string> backend_kinds() { return available_backends(); }

// A row of some backend's settings (gdkv/backend_registry.h), by name.
inline const Setting<BackendConfig>& backend_setting(const std::string& name) {
  for (const BackendRegistration& b : backend_registry()) {
    if (const Setting<BackendConfig>* r = find_setting(b.settings, name)) return *r;
  }
  throw std::invalid_argument("no backend has a setting '" + name + "'");
}

// A fresh, empty backend of `kind`, set up by its traits: a directory of its own (removed with
// the fixture) for one that needs a directory, with the local store's segments of
// `segment_bytes`; the test cluster (GDKV_CEPH_CONF, set by scripts/test) and a RADOS namespace of
// its own for one that needs a cluster; a far tier for `tiered` (RADOS with a cluster, else
// memory). Null if that backend can't run here (no cluster).
class BackendFixture {
 public:
  std::shared_ptr<Backend> open(const std::string& kind, uint64_t capacity = uint64_t{1} << 30,
                                uint32_t segment_bytes = 16u << 20) {
    const BackendRegistration* reg = find_backend(kind);
    if (reg == nullptr) throw std::invalid_argument("no backend '" + kind + "'");
    const char* conf = std::getenv("GDKV_CEPH_CONF");
    const bool cluster = conf != nullptr && *conf != '\0';
    BackendConfig c;
    c.kind = kind;
    c.memory.capacity_bytes = capacity;
    bool needs_cluster = reg->traits.needs_cluster;
    if (reg->traits.has_far_tier) {
      c.tiered_far = "memory";
      for (const BackendRegistration& b : backend_registry()) {
        if (cluster && b.traits.can_be_far_tier && b.traits.needs_cluster) c.tiered_far = b.name;
      }
      needs_cluster = find_backend(c.tiered_far)->traits.needs_cluster;
    }
    if (reg->traits.needs_directory) {
      dir_ = std::filesystem::temp_directory_path() /
             ("gdkv-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
      std::filesystem::create_directories(dir_);
      EXPECT_EQ(backend_setting(reg->directory_setting).set(c, dir_.string()), "");
      c.local.capacity_bytes = std::max<uint64_t>(capacity, uint64_t{256} << 20);
      c.local.segment_bytes = segment_bytes;
    }
    if (needs_cluster) {
      if (!cluster) return nullptr;
      EXPECT_EQ(backend_setting("ceph_conf").set(c, std::string(conf)), "");
      EXPECT_EQ(backend_setting("pool").set(c, std::string("gdkv-rep3")), "");
      // A namespace of our own, so earlier runs' objects never show up in List.
      std::random_device rd;
      EXPECT_EQ(backend_setting("namespace_prefix")
                    .set(c, "t" + std::to_string(::getpid()) + "-" + std::to_string(rd()) + "-"),
                "");
    }
    return open_backend(c).value();
  }
  ~BackendFixture() {
    if (!dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    }
  }

 private:
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::filesystem::path dir_;
};

}  // namespace gdkv::test
