// The gdkv command line: exit codes, messages, binary-safe values through files and pipes, on the
// persistent local store (each command is a new process).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "gdkv/settings.h"
#include "setting_samples.h"

namespace {

namespace fs = std::filesystem;

struct CliRun {
  int code;
  std::string out;
  std::string err;
};

class Cli : public ::testing::Test {
 public:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("gdkv-cli-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs `gdkv --store DIR <args>` through the shell (so args may hold pipes and redirections
  // around the command: `pre` runs before it in a pipeline).
  CliRun gdkv(const std::string& args, const std::string& pre = "") {
    const std::string out = (dir_ / "stdout").string(), err = (dir_ / "stderr").string();
    std::string cmd = pre.empty() ? "" : pre + " | ";
    cmd += std::string(GDKV_CLI_PATH) + " --store " + (dir_ / "store").string() + " " + args +
           " >" + out + " 2>" + err;
    int st = std::system(("bash -c '" + cmd + "'").c_str());
    return CliRun{WIFEXITED(st) ? WEXITSTATUS(st) : -1, slurp(out), slurp(err)};
  }
  static std::string slurp(const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  std::string write_random(const std::string& name, size_t n, uint32_t seed) {
    std::string data(n, '\0');
    std::mt19937 rng(seed);
    for (auto& c : data) c = static_cast<char>(rng());
    std::ofstream(dir_ / name, std::ios::binary).write(data.data(), static_cast<long>(n));
    return data;
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

TEST_F(Cli, BinaryValuesRoundTripThroughFilesAndPipes) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{4096}, size_t{300001}}) {
    const std::string data = write_random("in", n, static_cast<uint32_t>(n) + 1);
    ASSERT_EQ(gdkv("put k" + std::to_string(n) + " " + path("in")).code, 0);
    ASSERT_EQ(gdkv("get k" + std::to_string(n) + " -o " + path("out")).code, 0);
    EXPECT_EQ(slurp(path("out")), data) << n;
    // stdin → store, store → stdout.
    ASSERT_EQ(gdkv("put p" + std::to_string(n), "cat " + path("in")).code, 0);
    CliRun r = gdkv("get p" + std::to_string(n));
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.out, data) << n;
  }
}

TEST_F(Cli, ExitCodesAndMessages) {
  write_random("v", 100, 1);
  CliRun r = gdkv("get missing");
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(r.err, "gdkv: get 'missing': key does not exist (87h)\n");
  EXPECT_EQ(gdkv("exists missing").code, 1);
  EXPECT_EQ(gdkv("del missing").code, 1);
  ASSERT_EQ(gdkv("put here " + path("v")).code, 0);
  EXPECT_EQ(gdkv("exists here").code, 0);
  r = gdkv("put here " + path("v") + " --must-not-exist");
  EXPECT_EQ(r.code, 3);
  EXPECT_EQ(r.err, "gdkv: put 'here': key exists (89h)\n");
  r = gdkv("put other " + path("v") + " --must-exist");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("key does not exist (87h)"), std::string::npos);
  EXPECT_EQ(gdkv("del here").code, 0);
  EXPECT_EQ(gdkv("exists here").code, 1);
}

TEST_F(Cli, UsageErrorsExitTwo) {
  for (const std::string& args :
       {std::string(""), std::string("frobnicate"), std::string("get"),
        std::string("get 0123456789abcdefX"), std::string("--hex get abc"),
        std::string("--hex get zz"), std::string("--hex get ") + std::string(34, 'a'),
        std::string("get k --bogus"), std::string("put k /nonexistent/file"),
        std::string("--backend nosuch get k"), std::string("put k a b c"),
        std::string("put k --must-exist --must-not-exist")}) {
    CliRun r = gdkv(args);
    EXPECT_EQ(r.code, 2) << "args: " << args << " stderr: " << r.err;
    EXPECT_FALSE(r.err.empty()) << args;
  }
  for (const char* sub : {"", "put ", "get ", "del ", "exists ", "ls ", "stat ", "bench "}) {
    CliRun r = gdkv(std::string(sub) + "--help");
    EXPECT_EQ(r.code, 0) << sub;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << sub;
  }
}

template <class T>
void every_setting_is_a_flag(Cli& cli, const std::vector<gdkv::Setting<T>>& table) {
  const std::string help = cli.gdkv("--help").out;
  const T defaults;
  for (const gdkv::Setting<T>& x : table) {
    EXPECT_TRUE(help.find(std::string(x.flag) + " ") != std::string::npos ||
                help.find(std::string(x.flag) + ",") != std::string::npos)
        << x.flag;
    const gdkv::SettingValue v = gdkv::testing::other_value(x, defaults);
    std::string flag = x.flag;
    if (x.type == gdkv::SettingInfo::Type::kBool) {
      if (!std::get<bool>(v)) flag = "--no-" + flag.substr(2);
    } else {
      flag += " '" + gdkv::testing::as_argument(x, v) + "'";
    }
    std::string memory = std::string(x.name) == "backend" ? "" : "--backend memory ";
    if (std::string(x.name) == "backend") {
      // A backend that keeps its values in a directory other than the store's is given one.
      const gdkv::BackendRegistration* b = gdkv::find_backend(std::get<std::string>(v));
      if (b != nullptr && b->traits.needs_directory && b->directory_setting != "store") {
        memory = std::string(gdkv::find_setting(b->directory_setting)->flag) + " " +
                 cli.path("dir") + " ";
      }
    }
    CliRun r = cli.gdkv(memory + flag + " stat");
    EXPECT_EQ(r.code, 0) << flag << ": " << r.err;
    if (x.is_integer()) {
      r = cli.gdkv("--backend memory " + std::string(x.flag) + " x stat");
      EXPECT_EQ(r.code, 2) << x.flag;
      r = cli.gdkv("--backend memory " + std::string(x.flag) + " " + std::to_string(x.min - 1) +
                   " stat");
      EXPECT_EQ(r.code, 2) << x.flag;
      EXPECT_NE(r.err.find(x.range_error()), std::string::npos) << r.err;
    }
  }
}

// Every setting of the store's and a connection's tables (gdkv/settings.h) is a flag of the CLI:
// listed in the help, taking a valid value, refusing a bad one with exit 2.
TEST_F(Cli, EverySettingIsAFlag) {
  every_setting_is_a_flag(*this, gdkv::store_settings());
  every_setting_is_a_flag(*this, gdkv::client_settings());
  EXPECT_EQ(gdkv("--reactors 257 stat").code, 2);
  EXPECT_EQ(gdkv("--cache-policy mru stat").code, 2);
}

TEST_F(Cli, HexKeysAndListing) {
  write_random("v", 10, 2);
  ASSERT_EQ(gdkv("--hex put 00ff10 " + path("v")).code, 0);
  ASSERT_EQ(gdkv("--hex put 0001 " + path("v")).code, 0);
  ASSERT_EQ(gdkv("put apple " + path("v")).code, 0);
  ASSERT_EQ(gdkv("put apricot " + path("v")).code, 0);
  ASSERT_EQ(gdkv("put banana " + path("v")).code, 0);
  CliRun r = gdkv("--hex ls");
  EXPECT_EQ(r.out, "0001\n00ff10\n6170706c65\n61707269636f74\n62616e616e61\n");
  r = gdkv("ls --prefix ap");
  EXPECT_EQ(r.out, "apple\napricot\n");
  r = gdkv("ls");
  EXPECT_EQ(r.out, "\\x00\\x01\n\\x00\\xff\\x10\napple\napricot\nbanana\n");
  EXPECT_EQ(gdkv("--hex exists 00FF10").code, 0);
  EXPECT_EQ(gdkv("exists apple").code, 0);
}

TEST_F(Cli, GlobalFlagsBeforeOrAfterTheVerb) {
  const std::string v = write_random("v", 100, 3);
  ASSERT_EQ(gdkv("put --hex 00aa " + path("v")).code, 0);
  ASSERT_EQ(gdkv("put 00bb --hex " + path("v")).code, 0);
  EXPECT_EQ(gdkv("get --hex 00aa").out, v);
  EXPECT_EQ(gdkv("--hex get 00bb").out, v);
  EXPECT_EQ(gdkv("exists 00aa --hex").code, 0);
  EXPECT_EQ(gdkv("exists 00aa").code, 1);  // without --hex the key is the text "00aa"
  EXPECT_EQ(gdkv("ls --hex").out, "00aa\n00bb\n");
  // Another store named after the verb wins over the fixture's, which comes before it.
  ASSERT_EQ(gdkv("put k " + path("v") + " --store " + path("other")).code, 0);
  EXPECT_EQ(gdkv("exists k").code, 1);
  EXPECT_EQ(gdkv("exists k --store " + path("other")).code, 0);
  EXPECT_NE(gdkv("stat --backend memory").out.find("backend   memory"), std::string::npos);
  EXPECT_EQ(gdkv("get --bogus k").code, 2);
}

TEST_F(Cli, StatAndBench) {
  write_random("v", 1000, 3);
  ASSERT_EQ(gdkv("put a " + path("v")).code, 0);
  CliRun r = gdkv("stat");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("backend   local"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("keys      1"), std::string::npos) << r.out;
  r = gdkv("--backend memory bench --duration 0.3 --keys 10 --value-size 512 --json");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("\"ops_per_s\""), std::string::npos);
  EXPECT_NE(r.out.find("\"errors\":0"), std::string::npos);
  EXPECT_EQ(gdkv("bench --qd 0").code, 2);
}

TEST_F(Cli, DemoFindsTheSharedPrefix) {
  CliRun r = gdkv("demo");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("prompt B reuses 16 of"), std::string::npos) << r.out;
  // CliRun again: the blocks persist and are reused.
  r = gdkv("demo");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("stored 0 blocks"), std::string::npos) << r.out;
}

}  // namespace
