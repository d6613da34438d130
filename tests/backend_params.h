// Backends the controller suites run against: memory always, local in a temporary directory, and
// rados when a cluster is configured (GDKV_CEPH_CONF, set by scripts/test).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gdkv/backend_factory.h"

namespace gdkv::test {

inline std::vector<std::string> backend_kinds() { return available_backends(); }

// A fresh, empty backend of `kind` (local and tiered: a local store of `segment_bytes` segments
// in a directory of its own, removed with the fixture); null if that backend can't run here.
class BackendFixture {
 public:
  std::shared_ptr<Backend> open(const std::string& kind, uint64_t capacity = uint64_t{1} << 30,
                                uint32_t segment_bytes = 16u << 20) {
    BackendConfig c;
    c.kind = kind;
    c.memory.capacity_bytes = capacity;
    if (kind == "local" || kind == "tiered") {
      dir_ = std::filesystem::temp_directory_path() /
             ("gdkv-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
      std::filesystem::create_directories(dir_);
      c.local.path = dir_.string();
      c.local.capacity_bytes = std::max<uint64_t>(capacity, uint64_t{256} << 20);
      c.local.segment_bytes = segment_bytes;
    }
    if (kind == "tiered") {
      // The local store in front of RADOS when there is a cluster, else of the memory backend.
      const char* conf = std::getenv("GDKV_CEPH_CONF");
      c.tiered_far = conf != nullptr && *conf != '\0' ? "rados" : "memory";
    }
    if (kind == "rados" || (kind == "tiered" && c.tiered_far == "rados")) {
      const char* conf = std::getenv("GDKV_CEPH_CONF");
      if (conf == nullptr || *conf == '\0') return nullptr;
      c.rados.ceph_conf = conf;
      c.rados.pool = "gdkv-rep3";
      // A namespace of our own, so earlier runs' objects never show up in List.
      std::random_device rd;
      c.rados.namespace_prefix =
          "t" + std::to_string(::getpid()) + "-" + std::to_string(rd()) + "-";
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
