// Client's batch calls return one result per key: a key that fails fails only itself, and the
// others are done (put, deleted, read, looked up) as if it were not in the batch.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/client.h"

namespace gdkv {
namespace {

using nvme::Status;

Key key(const std::string& s) { return *Key::from_string(s); }

// A view of a string that outlives it (a temporary would leave the view dangling).
std::span<const std::byte> bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}
std::span<const std::byte> bytes(std::string&&) = delete;

// The memory backend, except that every op on a key in `broken` fails with 82h (not ready), as a
// RADOS object on a down placement group would.
class BrokenKeysBackend final : public Backend {
 public:
  explicit BrokenKeysBackend(std::set<std::string> broken)
      : inner_(make_memory_backend()), broken_(std::move(broken)) {}
  void submit(BackendOp* op) override {
    if (broken_.count(std::string(op->key.view())) != 0) {
      op->complete(Status::kNamespaceNotReady);
      return;
    }
    inner_->submit(op);
  }
  BackendInfo info() const override { return inner_->info(); }

 private:
  std::shared_ptr<Backend> inner_;
  std::set<std::string> broken_;
};

class ClientBatch : public ::testing::Test {
 protected:
  void SetUp() override {
    auto c = Client::open(std::make_shared<BrokenKeysBackend>(std::set<std::string>{"bad"}));
    ASSERT_TRUE(c) << c.error();
    client_ = std::move(*c);
  }
  // Stores each key's name as its value, one put at a time.
  void put_names(const std::vector<std::string>& names) {
    for (const auto& n : names) ASSERT_TRUE(client_->put(key(n), bytes(n)).ok()) << n;
  }
  std::unique_ptr<Client> client_;
};

std::vector<Key> keys_of(const std::vector<std::string>& names) {
  std::vector<Key> out;
  for (const auto& n : names) out.push_back(key(n));
  return out;
}

TEST_F(ClientBatch, PutManyStoresEveryKeyButTheFailedOne) {
  const std::vector<std::string> names = {"a", "bad", "c", "d"};
  const std::vector<std::string> vals = {"va", "vb", "vc", "vd"};
  std::vector<std::span<const std::byte>> spans;
  for (const auto& v : vals) spans.push_back(bytes(v));
  const auto keys = keys_of(names);
  const auto r = client_->put_many(keys, spans);
  ASSERT_EQ(r.size(), 4u);
  EXPECT_TRUE(r[0].ok());
  EXPECT_EQ(r[1].status, Status::kNamespaceNotReady);
  EXPECT_TRUE(r[2].ok());
  EXPECT_TRUE(r[3].ok());
  for (size_t i : {0u, 2u, 3u}) {
    std::vector<std::byte> out;
    ASSERT_TRUE(client_->get(keys[i], out).ok()) << names[i];
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(out.data()), out.size()), vals[i]);
  }
}

TEST_F(ClientBatch, PutManyWithMustNotExistFailsOnlyTheKeysThatExist) {
  put_names({"b"});
  const auto keys = keys_of({"a", "b", "c"});
  const std::string value = "new";
  std::vector<std::span<const std::byte>> spans(3, bytes(value));
  const auto r = client_->put_many(keys, spans, nvme::kStoreMustNotExist);
  EXPECT_TRUE(r[0].ok());
  EXPECT_EQ(r[1].status, Status::kKeyExists);
  EXPECT_TRUE(r[2].ok());
  std::vector<std::byte> out;
  ASSERT_TRUE(client_->get(keys[1], out).ok());
  EXPECT_EQ(out.size(), 1u);  // "b", not replaced
}

TEST_F(ClientBatch, CountMismatchFailsEveryKeyAndSendsNothing) {
  const auto keys = keys_of({"a", "b"});
  const std::string value = "x";
  std::vector<std::span<const std::byte>> one(1, bytes(value));
  for (const auto& r : client_->put_many(keys, one)) EXPECT_EQ(r.status, Status::kInvalidField);
  std::vector<std::span<const nvme::ScatterEntry>> none;
  for (const auto& r : client_->get_many_into(keys, none)) {
    EXPECT_EQ(r.status, Status::kInvalidField);
  }
  EXPECT_EQ(client_->exists(keys[0]).status, Status::kKeyNotExist);
}

TEST_F(ClientBatch, ExistsManyTellsMissingFromFailed) {
  put_names({"a", "c"});
  const auto r = client_->exists_many(keys_of({"a", "b", "bad", "c"}));
  ASSERT_EQ(r.size(), 4u);
  EXPECT_TRUE(r[0].ok());
  EXPECT_EQ(r[1].status, Status::kKeyNotExist);
  EXPECT_EQ(r[2].status, Status::kNamespaceNotReady);
  EXPECT_TRUE(r[3].ok());
}

TEST_F(ClientBatch, DelManyDeletesEveryKeyButTheFailedAndMissingOnes) {
  put_names({"a", "c"});
  const auto keys = keys_of({"a", "bad", "b", "c"});
  const auto r = client_->del_many(keys);
  EXPECT_TRUE(r[0].ok());
  EXPECT_EQ(r[1].status, Status::kNamespaceNotReady);
  EXPECT_EQ(r[2].status, Status::kKeyNotExist);
  EXPECT_TRUE(r[3].ok());
  EXPECT_EQ(client_->exists(keys[0]).status, Status::kKeyNotExist);
  EXPECT_EQ(client_->exists(keys[3]).status, Status::kKeyNotExist);
}

TEST_F(ClientBatch, GetManyIntoReadsEveryValueIntoItsPieces) {
  put_names({"one", "three", "fourteen-bytes"});
  const auto keys = keys_of({"one", "bad", "nope", "three", "fourteen-bytes"});
  char a[8] = {}, b[8] = {}, c[8] = {}, d[2] = {}, e1[4] = {}, e2[20] = {};
  auto piece = [](void* p, uint32_t off, uint32_t len) {
    return nvme::ScatterEntry{reinterpret_cast<uint64_t>(p), off, len};
  };
  std::vector<std::vector<nvme::ScatterEntry>> outs = {
      {piece(a, 0, 8)},
      {piece(b, 0, 8)},
      {piece(c, 0, 8)},
      {piece(d, 0, 2)},                      // shorter than the value: its first bytes
      {piece(e1, 0, 4), piece(e2, 4, 20)}};  // a Scatter Retrieve: split across two buffers
  const std::vector<std::span<const nvme::ScatterEntry>> spans(outs.begin(), outs.end());
  const auto r = client_->get_many_into(keys, spans);
  ASSERT_EQ(r.size(), 5u);
  ASSERT_TRUE(r[0].ok());
  EXPECT_EQ(r[0].dw0, 3u);
  EXPECT_EQ(std::string(a, 3), "one");
  EXPECT_EQ(r[1].status, Status::kNamespaceNotReady);
  EXPECT_EQ(r[2].status, Status::kKeyNotExist);
  ASSERT_TRUE(r[3].ok());
  EXPECT_EQ(r[3].dw0, 5u);  // the full length, though 2 bytes landed
  EXPECT_EQ(std::string(d, 2), "th");
  ASSERT_TRUE(r[4].ok());
  EXPECT_EQ(r[4].dw0, 14u);
  std::string got(e1, 4);
  got.append(e2, 10);
  EXPECT_EQ(got, "fourteen-bytes");
}

TEST_F(ClientBatch, LookupPrefixStopsAtTheFirstMissingOrFailedKey) {
  std::vector<std::string> names;
  for (int i = 0; i < 100; ++i) {
    std::string n = "k";
    n += std::to_string(i);
    names.push_back(n);
  }
  put_names(names);
  const auto keys = keys_of(names);
  CmdResult stop{};
  EXPECT_EQ(client_->lookup_prefix(keys, 1, &stop), 100u);
  EXPECT_TRUE(stop.ok());

  // A run ended by a missing key in a later round (past the first 16 and 32).
  auto with_gap = keys;
  with_gap[70] = key("gap");
  EXPECT_EQ(client_->lookup_prefix(with_gap, 1, &stop), 70u);
  EXPECT_EQ(stop.status, Status::kKeyNotExist);

  // Ended by a key whose Exist failed: the keys before it are the run, and *stop says why.
  auto with_bad = keys;
  with_bad[5] = key("bad");
  EXPECT_EQ(client_->lookup_prefix(with_bad, 1, &stop), 5u);
  EXPECT_EQ(stop.status, Status::kNamespaceNotReady);

  EXPECT_EQ(client_->lookup_prefix(std::span<const Key>{}, 1, &stop), 0u);
  EXPECT_TRUE(stop.ok());
}

}  // namespace
}  // namespace gdkv
