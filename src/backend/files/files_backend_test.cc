// The files backend: opened by its registration alone, values checked on the way out, atomic
// Stores that survive a process killed mid-stream, capacity, and two instances sharing a folder
// (two nodes on one shared mount). The shared semantics suites (controller_semantics_test,
// tiered_backend_test) run it through tests/backend_params.h like every registered backend.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "backend/files/files_backend.h"
#include "cache_test_util.h"
#include "gdkv/backend_factory.h"
#include "gdkv/settings.h"

namespace gdkv {
namespace {

namespace fs = std::filesystem;
using nvme::Status;
using test::SyncOp;

Key key(const std::string& s) { return *Key::from_string(s); }
// "k<i>" (written out: g++ 12 warns falsely of overlapping copies in "k" + std::to_string(i)).
Key numbered(int i) {
  std::string s = "k";
  s += std::to_string(i);
  return key(s);
}

class FilesBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("gdkv-files-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Opened through the store's settings table, by the rows the registration declares.
  std::shared_ptr<Backend> open(uint64_t capacity = 0) {
    StoreSettings s;
    EXPECT_EQ(find_setting("backend")->set(s, std::string("files")), "");
    EXPECT_EQ(find_setting("files_dir")->set(s, dir_.string()), "");
    EXPECT_EQ(find_setting("files_capacity")->set(s, capacity), "");
    return open_store(s).value();
  }
  std::string get(Backend& b, const Key& k, Status* s = nullptr) {
    SyncOp op(BackendOpKind::kGet, k);
    const Status st = op.run(b);
    if (s != nullptr) *s = st;
    return st == Status::kSuccess ? op.value() : std::string();
  }
  fs::path file_of(const std::string& k, uint32_t nsid = 1) {
    return dir_ / ("ns" + std::to_string(nsid)) / key(k).hex();
  }

  fs::path dir_;
};

TEST_F(FilesBackendTest, RegisteredWithItsTraitsAndSettings) {
  const BackendRegistration* r = find_backend("files");
  ASSERT_NE(r, nullptr);
  EXPECT_TRUE(r->traits.needs_directory);
  EXPECT_TRUE(r->traits.can_be_far_tier);
  EXPECT_FALSE(r->traits.can_time_out);
  EXPECT_EQ(r->directory_setting, "files_dir");
  const auto kinds = available_backends();
  EXPECT_NE(std::find(kinds.begin(), kinds.end(), "files"), kinds.end());
  StoreSettings s;
  EXPECT_EQ(find_setting("files_threads")->set(s, uint64_t{0}), "must be in [1, 256]");
  EXPECT_EQ(find_setting("files_dir")->text(s), "\"\"");
  s.backend.kind = "files";
  EXPECT_FALSE(open_store(s));  // no directory: a clear error, not a crash
}

TEST_F(FilesBackendTest, StoresReadsListsAndDeletes) {
  auto b = open();
  ASSERT_EQ(test::put(*b, key("a"), "alpha"), Status::kSuccess);
  ASSERT_EQ(test::put(*b, key("b"), std::string(100000, 'b')), Status::kSuccess);
  EXPECT_EQ(get(*b, key("a")), "alpha");
  EXPECT_EQ(get(*b, key("b")), std::string(100000, 'b'));
  EXPECT_EQ(test::put(*b, key("a"), "x", nvme::kStoreMustNotExist), Status::kKeyExists);
  EXPECT_EQ(test::put(*b, key("c"), "x", nvme::kStoreMustExist), Status::kKeyNotExist);
  ASSERT_EQ(test::put(*b, key("a"), "again", nvme::kStoreMustExist), Status::kSuccess);
  EXPECT_EQ(get(*b, key("a")), "again");
  SyncOp list(BackendOpKind::kList, Key{});
  list.op.list_max = 10;
  ASSERT_EQ(list.run(*b), Status::kSuccess);
  EXPECT_EQ(list.op.keys, (std::vector<Key>{key("a"), key("b")}));
  SyncOp del(BackendOpKind::kDelete, key("a"));
  EXPECT_EQ(del.run(*b), Status::kSuccess);
  SyncOp again(BackendOpKind::kDelete, key("a"));
  EXPECT_EQ(again.run(*b), Status::kKeyNotExist);
  SyncOp exists(BackendOpKind::kExists, key("b"));
  EXPECT_EQ(exists.run(*b), Status::kSuccess);
  EXPECT_EQ(b->info().keys, 1u);
  // A short buffer gets the value's first bytes and its full length.
  SyncOp shortget(BackendOpKind::kGet, key("b"));
  shortget.op.sink = [](BackendOp* op, uint64_t) {
    auto* self = static_cast<SyncOp*>(op->user);
    self->sink_buf.assign(10, std::byte{0});
    return std::span<std::byte>(self->sink_buf);
  };
  ASSERT_EQ(shortget.run(*b), Status::kSuccess);
  EXPECT_EQ(shortget.len, 100000u);
  EXPECT_EQ(test::string_of(shortget.sink_buf), std::string(10, 'b'));
}

// A file cut short, a flipped byte, a file under another key's name or a stranger's bytes is
// 88h and counted: never returned as data.
TEST_F(FilesBackendTest, DamagedFilesAreNeverReturnedAsData) {
  auto b = open();
  for (const char* k : {"cut", "flip", "moved", "junk"}) {
    ASSERT_EQ(test::put(*b, key(k), std::string(4096, k[0])), Status::kSuccess);
  }
  fs::resize_file(file_of("cut"), fs::file_size(file_of("cut")) - 1);
  {
    std::fstream f(file_of("flip"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(48 + 100);
    f.put('X');
  }
  fs::copy_file(file_of("junk"), file_of("moved"), fs::copy_options::overwrite_existing);
  std::ofstream(file_of("junk"), std::ios::trunc) << "not a gdkv file";
  for (const char* k : {"cut", "flip", "moved", "junk"}) {
    Status s;
    EXPECT_EQ(get(*b, key(k), &s), "") << k;
    EXPECT_EQ(s, Status::kUnrecoveredError) << k;
  }
  EXPECT_EQ(test::metric(*b, "files_corrupt_total"), 4);
}

// Two instances on one folder are two nodes on a shared mount: what one stores the other reads,
// lists and deletes.
TEST_F(FilesBackendTest, TwoNodesShareOneFolder) {
  auto a = open(), b = open();
  ASSERT_EQ(test::put(*a, key("shared"), "from a"), Status::kSuccess);
  EXPECT_EQ(get(*b, key("shared")), "from a");
  ASSERT_EQ(test::put(*b, key("shared"), "from b"), Status::kSuccess);
  EXPECT_EQ(get(*a, key("shared")), "from b");
  SyncOp del(BackendOpKind::kDelete, key("shared"));
  ASSERT_EQ(del.run(*b), Status::kSuccess);
  Status s;
  get(*a, key("shared"), &s);
  EXPECT_EQ(s, Status::kKeyNotExist);
}

// Namespaces are separate folders.
TEST_F(FilesBackendTest, NamespacesApart) {
  auto b = open();
  SyncOp put2(BackendOpKind::kPut, key("k"), test::bytes_of("two"));
  put2.op.nsid = 2;
  ASSERT_EQ(put2.run(*b), Status::kSuccess);
  Status s;
  get(*b, key("k"), &s);
  EXPECT_EQ(s, Status::kKeyNotExist);
  EXPECT_TRUE(fs::exists(file_of("k", 2)));
}

// Over capacity_bytes the oldest values go, as removals; values found at open count too.
TEST_F(FilesBackendTest, CapacityRemovesTheOldestFirst) {
  const uint64_t each = 48 + 1000;
  {
    auto b = open(3 * each);
    for (const char* k : {"k0", "k1", "k2"}) {
      ASSERT_EQ(test::put(*b, key(k), std::string(1000, k[1])), Status::kSuccess);
    }
  }
  // The order the next open finds them in: by modification time (set apart here, as writes
  // within one clock tick share a time).
  const auto now = fs::file_time_type::clock::now();
  for (int i = 0; i < 3; ++i) {
    fs::last_write_time(file_of("k" + std::string(1, char('0' + i))),
                        now - std::chrono::hours(3 - i));
  }
  auto b = open(3 * each);
  EXPECT_EQ(b->info().bytes_used, 3 * each);
  std::mutex mu;
  std::vector<std::string> removed;
  b->set_removal_handler([&](uint32_t, const Key& k) {
    std::lock_guard lk(mu);
    removed.push_back(k.hex());
  });
  ASSERT_EQ(test::put(*b, key("k3"), std::string(1000, '3')), Status::kSuccess);
  Status s;
  get(*b, key("k0"), &s);
  EXPECT_EQ(s, Status::kKeyNotExist);
  EXPECT_EQ(get(*b, key("k3")), std::string(1000, '3'));
  EXPECT_EQ(b->info().bytes_used, 3 * each);
  // Replacing a value frees its own old bytes first: nothing else goes.
  ASSERT_EQ(test::put(*b, key("k3"), std::string(1000, 'r')), Status::kSuccess);
  EXPECT_EQ(b->info().keys, 3u);
  EXPECT_EQ(b->info().bytes_used, 3 * each);
  EXPECT_EQ(test::put(*b, key("big"), std::string(3 * each, 'x')), Status::kCapacityExceeded);
  b->set_removal_handler(nullptr);
  EXPECT_EQ(removed, std::vector<std::string>{key("k0").hex()});
  EXPECT_EQ(test::metric(*b, "files_evictions_total"), 1);
}

// A process killed (SIGKILL) in the middle of a stream of Stores: every acknowledged value reads
// back whole, the value being written is either absent or whole, and the temporary file it left
// is removed at the next open.
TEST_F(FilesBackendTest, AcknowledgedStoresSurviveAKill) {
  int acks[2];
  ASSERT_EQ(::pipe(acks), 0);
  const auto value = [](int i) {
    return std::string(64 * 1024 + i, static_cast<char>('a' + i % 26));
  };
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(acks[0]);
    FilesBackendOptions o;
    o.path = dir_.string();
    o.threads = 1;
    auto b = make_files_backend(o).value();
    for (int i = 0;; ++i) {
      if (test::put(*b, numbered(i), value(i)) != Status::kSuccess) ::_exit(3);
      if (::write(acks[1], &i, sizeof i) != sizeof i) ::_exit(4);
    }
  }
  ::close(acks[1]);
  int last = -1, i = 0;
  while (last < 40 && ::read(acks[0], &i, sizeof i) == sizeof i) last = i;
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  while (::read(acks[0], &i, sizeof i) == sizeof i) last = i;  // acks sent before the kill
  ::close(acks[0]);
  ASSERT_GE(last, 40);
  auto b = open();
  for (int k = 0; k <= last; ++k) {
    EXPECT_EQ(get(*b, numbered(k)), value(k)) << k;
  }
  Status s;
  const std::string next = get(*b, numbered(last + 1), &s);
  if (s == Status::kSuccess) {
    EXPECT_EQ(next, value(last + 1));
  }
  for (const auto& e : fs::directory_iterator(dir_ / "ns1")) {
    EXPECT_NE(e.path().filename().string().rfind(".tmp.", 0), 0u) << e.path();
  }
}

}  // namespace
}  // namespace gdkv
