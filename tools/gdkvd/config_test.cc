// gdkvd configuration: TOML keys, error messages with line numbers, and the precedence
// file < environment < flags.
#include "config.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

namespace gdkvd {
namespace {

int run(std::vector<std::string> args, Config& c, std::string* err) {
  args.insert(args.begin(), "gdkvd");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return load(static_cast<int>(argv.size()), argv.data(), c, err);
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
  EXPECT_EQ(c.socket_dir, "/tmp/x");
  EXPECT_EQ(c.socket_mode, 0666u);
  EXPECT_EQ(c.metrics_port, -1);
  EXPECT_EQ(c.reactors, 3u);
  EXPECT_EQ(c.dma_reply_timeout_ms, 250u);
  EXPECT_EQ(c.message_bounce_bytes, 16u << 20);
  EXPECT_TRUE(c.never_sleep);
  ASSERT_EQ(c.namespaces.size(), 2u);
  EXPECT_EQ(c.namespaces[0].backend_namespace, 4u);
  EXPECT_EQ(c.namespaces[0].uids, (std::vector<uint32_t>{1000, 1001}));
  EXPECT_EQ(c.namespaces[0].name, "ns4");
  EXPECT_EQ(c.namespaces[1].gids, (std::vector<uint32_t>{20}));
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
  EXPECT_FALSE(load_toml("[controller]\nreactors = 0\n", "c.toml", c, &err));
  EXPECT_NE(err.find("c.toml:2: controller.reactors: must be in [1, 256]"), std::string::npos);
  EXPECT_FALSE(load_toml("x = [", "d.toml", c, &err));
  EXPECT_EQ(err.rfind("d.toml:1:", 0), 0u) << err;
  EXPECT_FALSE(load_toml("namespace = 3\n", "e.toml", c, &err));
  EXPECT_FALSE(load_toml("message_bounce_bytes = 4096\n", "h.toml", c, &err));  // < 1 MiB
  EXPECT_FALSE(load_toml("[[namespace]]\nnsid = 2000\n", "f.toml", c, &err));
  EXPECT_FALSE(load_toml("[[namespace]]\nuids = [-1]\n", "g.toml", c, &err));
  Config v;
  v.backend.kind = "disk";
  EXPECT_FALSE(validate(v, &err));
  v = Config{};
  v.backend.kind = "memory";
  v.namespaces = {{1, 1, "a", {}, {}}, {1, 2, "b", {5}, {}}};
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
  EXPECT_EQ(c.socket_dir, "/from/file");  // file
  EXPECT_EQ(c.metrics_port, 2222);        // environment over file
  EXPECT_EQ(c.reactors, 7u);              // flag over environment
  EXPECT_EQ(c.socket_mode, 0600u);
  EXPECT_EQ(c.backend.memory.capacity_bytes, 1000u);  // file
  Config m;
  ASSERT_EQ(run({"--config", path, "--memory-capacity", "268435456"}, m, &err), 0) << err;
  EXPECT_EQ(m.backend.memory.capacity_bytes, uint64_t{256} << 20);  // flag over file
  EXPECT_EQ(Config{}.backend.memory.capacity_bytes, uint64_t{1} << 30);
  ::unsetenv("GDKVD_METRICS_PORT");
  ::unsetenv("GDKVD_REACTORS");
  Config bad;
  EXPECT_EQ(run({"--config", path, "--socket-mode", "99"}, bad, &err), 2);
  EXPECT_EQ(run({"--backend", "tape"}, bad, &err), 2);
  EXPECT_EQ(run({"--config", "/nonexistent/gdkvd.toml"}, bad, &err), 2);
  EXPECT_NE(err.find("cannot read config file"), std::string::npos);
  ::unlink(path);
}

}  // namespace
}  // namespace gdkvd
