#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "gdkv/commands.h"
#include "gdkv/key.h"
#include "gdkv/nvme_kv.h"

namespace gdkv {
namespace {

TEST(WireFormat, SizesAndOffsets) {
  EXPECT_EQ(sizeof(nvme::Sqe), 64u);
  EXPECT_EQ(sizeof(nvme::Cqe), 16u);
  nvme::Sqe s{};
  auto* raw = reinterpret_cast<uint32_t*>(&s);
  s.cdw10 = 0xAABBCCDD;
  EXPECT_EQ(raw[10], 0xAABBCCDDu);
  s.key_length = 7;
  s.options = 0x02;
  EXPECT_EQ(raw[11], 0x0207u);
  s.opcode = 0x02;
  s.cid = 0x1234;
  EXPECT_EQ(raw[0], 0x12340002u);
  s.dptr.prp.prp1 = 0x1122334455667788ull;
  EXPECT_EQ(raw[6], 0x55667788u);
  EXPECT_EQ(raw[7], 0x11223344u);
  s.set_psdt(nvme::kPsdtSglContiguous);
  EXPECT_EQ((raw[0] >> 14) & 3, 1u);
  EXPECT_EQ(s.psdt(), nvme::kPsdtSglContiguous);
}

TEST(WireFormat, KeyBytesLandInCdw2To3And14To15) {
  uint8_t key[16];
  for (int i = 0; i < 16; ++i) key[i] = static_cast<uint8_t>(0xA0 + i);
  nvme::Sqe s{};
  nvme::pack_key(s, key, 16);
  auto* raw = reinterpret_cast<uint32_t*>(&s);
  EXPECT_EQ(raw[2], 0xA3A2A1A0u);  // byte 0 is the low byte of CDW2
  EXPECT_EQ(raw[3], 0xA7A6A5A4u);
  EXPECT_EQ(raw[14], 0xABAAA9A8u);
  EXPECT_EQ(raw[15], 0xAFAEADACu);
  EXPECT_EQ(raw[11] & 0xFF, 16u);
}

TEST(WireFormat, KeyRoundTripEveryLength) {
  std::mt19937 rng(1);
  for (uint32_t len = 1; len <= 16; ++len) {
    uint8_t key[16];
    for (auto& b : key) b = static_cast<uint8_t>(rng());
    nvme::Sqe s{};
    std::memset(&s, 0xFF, sizeof(s));  // stale bytes past the key must be cleared
    nvme::pack_key(s, key, len);
    Key k = Key::from_sqe(s);
    ASSERT_TRUE(k.valid());
    ASSERT_EQ(k.len, len);
    EXPECT_EQ(0, std::memcmp(k.bytes, key, len));
    for (uint32_t i = len; i < 16; ++i) EXPECT_EQ(k.bytes[i], 0);
    // Through the hex form too.
    auto back = Key::from_hex(k.hex());
    ASSERT_TRUE(back.has_value());
    EXPECT_EQ(*back, k);
  }
}

TEST(WireFormat, InvalidKeyLengthsAreInvalid) {
  nvme::Sqe s{};
  s.key_length = 0;
  EXPECT_FALSE(Key::from_sqe(s).valid());
  s.key_length = 17;
  EXPECT_FALSE(Key::from_sqe(s).valid());
  s.key_length = 255;
  EXPECT_FALSE(Key::from_sqe(s).valid());
}

TEST(WireFormat, StatusField) {
  uint16_t f = nvme::make_status_field(nvme::Status::kKeyNotExist);
  EXPECT_EQ(nvme::status_code(f), nvme::Status::kKeyNotExist);
  EXPECT_EQ(nvme::status_type(f), nvme::kSctGeneric);
  EXPECT_EQ(f & nvme::kCqePhase, 0);
  EXPECT_NE(f & nvme::kCqeDnr, 0);
  EXPECT_EQ(nvme::make_status_field(nvme::Status::kSuccess), 0);
  EXPECT_STREQ(nvme::status_name(nvme::Status::kKeyExists), "key exists");
}

TEST(WireFormat, OpcodeDirectionBits) {
  // Bits 1:0 give the data direction: 01 host→controller, 10 controller→host, 00 none.
  EXPECT_EQ(static_cast<int>(nvme::Opcode::kStore) & 3, 1);
  EXPECT_EQ(static_cast<int>(nvme::Opcode::kRetrieve) & 3, 2);
  EXPECT_EQ(static_cast<int>(nvme::Opcode::kList) & 3, 2);
  EXPECT_EQ(static_cast<int>(nvme::Opcode::kDelete) & 3, 0);
  EXPECT_EQ(static_cast<int>(nvme::Opcode::kExist) & 3, 0);
  EXPECT_EQ(static_cast<int>(nvme::Opcode::kPrefetch) & 3, 1);
  EXPECT_EQ(static_cast<int>(nvme::Opcode::kScatterRetrieve) & 3, 2);
  EXPECT_GE(static_cast<int>(nvme::Opcode::kPrefetch), nvme::kVendorOpcodeFirst);
}

// The KeyList codec: every key length round-trips with 4-byte padding; the writer stops at the
// buffer's end; the reader rejects each kind of damage and passes the entries before it.
// Store options are CDW11 bits 15:8; the ones the controller accepts, each its own bit.
TEST(WireFormat, StoreOptionBits) {
  EXPECT_EQ(nvme::kStoreMustExist, 0x01);
  EXPECT_EQ(nvme::kStoreMustNotExist, 0x02);
  EXPECT_EQ(nvme::kStoreCompressHint, 0x04);
  EXPECT_EQ(nvme::kStoreLowPriority, 0x08);
  EXPECT_EQ(nvme::kStoreOptionsValid, 0x0F);
  nvme::Sqe s{};
  s.options = nvme::kStoreLowPriority | nvme::kStoreMustNotExist;
  EXPECT_EQ(reinterpret_cast<const uint32_t*>(&s)[11], 0x0A00u);
}

TEST(WireFormat, KeyListCodec) {
  std::vector<std::vector<uint8_t>> keys;
  for (uint16_t len = 1; len <= 16; ++len) {
    std::vector<uint8_t> k(len);
    for (uint16_t i = 0; i < len; ++i) k[i] = static_cast<uint8_t>(len * 16 + i);
    keys.push_back(k);
  }
  size_t want = sizeof(nvme::KeyListHeader);
  for (const auto& k : keys) want += nvme::key_list_entry_size(static_cast<uint32_t>(k.size()));
  std::vector<unsigned char> buf(want, 0);
  nvme::KeyListWriter w(buf.data(), buf.size());
  for (const auto& k : keys) ASSERT_TRUE(w.add(k.data(), static_cast<uint16_t>(k.size())));
  EXPECT_FALSE(w.add(keys[0].data(), 1));  // full
  w.finish();
  EXPECT_EQ(w.bytes(), want);
  EXPECT_EQ(w.count(), 16u);
  EXPECT_EQ(want % 4, 0u);
  std::vector<std::vector<uint8_t>> back;
  auto collect = [&](const unsigned char* k, uint16_t len) { back.emplace_back(k, k + len); };
  ASSERT_TRUE(nvme::read_key_list(buf.data(), buf.size(), collect));
  EXPECT_EQ(back, keys);
  // Damage: no header; a count the bytes cannot hold; an entry cut short; key lengths 0 and 17.
  back.clear();
  EXPECT_FALSE(nvme::read_key_list(buf.data(), 3, collect));
  auto with = [&](size_t at, unsigned char v) {
    std::vector<unsigned char> b = buf;
    b[at] = v;
    return b;
  };
  auto big = with(0, 0xFF);
  EXPECT_FALSE(nvme::read_key_list(big.data(), big.size(), collect));
  EXPECT_FALSE(nvme::read_key_list(buf.data(), buf.size() - 1, collect));
  EXPECT_EQ(back.size(), 15u);  // every entry before the cut one
  // Why: a malformed list is 02h, a bad key length 86h.
  EXPECT_EQ(nvme::read_key_list_status(big.data(), big.size(), collect),
            nvme::Status::kInvalidField);
  EXPECT_EQ(nvme::read_key_list_status(buf.data(), buf.size() - 1, collect),
            nvme::Status::kInvalidField);
  for (unsigned char bad : {0, 17}) {
    back.clear();
    auto b = with(4 + nvme::key_list_entry_size(1), bad);  // the second entry's length
    EXPECT_FALSE(nvme::read_key_list(b.data(), b.size(), collect)) << int{bad};
    EXPECT_EQ(back.size(), 1u);
    EXPECT_EQ(nvme::read_key_list_status(b.data(), b.size(), collect),
              nvme::Status::kInvalidKeySize);
  }
  // The extent a piecewise reader computes is the writer's; a smaller buffer or count cuts it.
  auto read_len = [&](uint64_t off, uint16_t* len) {
    if (off + 2 > buf.size()) return false;
    *len = static_cast<uint16_t>(buf[off] | buf[off + 1] << 8);
    return true;
  };
  EXPECT_EQ(nvme::key_list_extent(read_len, buf.size(), 16), want);
  EXPECT_EQ(nvme::key_list_extent(read_len, buf.size(), 1), 4u + nvme::key_list_entry_size(1));
  EXPECT_EQ(nvme::key_list_extent(read_len, 10, 16), 10u);
  EXPECT_EQ(nvme::key_list_extent(read_len, buf.size(), 0), 4u);
  // An empty list.
  std::vector<unsigned char> empty(4, 0);
  nvme::KeyListWriter e(empty.data(), empty.size());
  e.finish();
  back.clear();
  EXPECT_TRUE(nvme::read_key_list(empty.data(), empty.size(), collect));
  EXPECT_TRUE(back.empty());
}

TEST(Keys, HexParsing) {
  EXPECT_FALSE(Key::from_hex("").has_value());
  EXPECT_FALSE(Key::from_hex("a").has_value());
  EXPECT_FALSE(Key::from_hex("zz").has_value());
  EXPECT_FALSE(Key::from_hex(std::string(34, 'a')).has_value());
  EXPECT_EQ(Key::from_hex("00FFaB")->hex(), "00ffab");
  EXPECT_FALSE(Key::from_string("").has_value());
  EXPECT_FALSE(Key::from_string(std::string(17, 'x')).has_value());
  EXPECT_EQ(Key::from_string("hello")->len, 5);
}

TEST(Keys, OrderIsBytesThenLength) {
  Key a = *Key::from_string("ab");
  Key b = *Key::from_string("abc");
  Key c = *Key::from_string("b");
  EXPECT_LT(a, b);
  EXPECT_LT(b, c);
  EXPECT_FALSE(c < a);
}

TEST(Keys, ChainKeysShareAPrefix) {
  std::vector<uint32_t> p1(64), p2(64);
  for (uint32_t i = 0; i < 64; ++i) p1[i] = p2[i] = i * 7;
  p2[40] = 99999;  // diverges in block 2 (16-token blocks)
  auto k1 = chain_keys(p1, 16, "llama3-8b");
  auto k2 = chain_keys(p2, 16, "llama3-8b");
  ASSERT_EQ(k1.size(), 4u);
  ASSERT_EQ(k2.size(), 4u);
  EXPECT_EQ(k1[0], k2[0]);
  EXPECT_EQ(k1[1], k2[1]);
  EXPECT_NE(k1[2], k2[2]);
  EXPECT_NE(k1[3], k2[3]);  // chained: everything after a divergence differs
  for (const Key& k : k1) EXPECT_EQ(k.len, 16);
  // A trailing partial block has no key; a different salt gives different keys.
  EXPECT_EQ(chain_keys(std::span(p1).first(47), 16, "m").size(), 2u);
  EXPECT_NE(chain_keys(p1, 16, "other-model")[0], k1[0]);
  // Continuing from a parent gives the same keys as hashing the whole sequence.
  auto tail = chain_keys(std::span(p1).subspan(32), 16, "llama3-8b", &k1[1]);
  ASSERT_EQ(tail.size(), 2u);
  EXPECT_EQ(tail[0], k1[2]);
  EXPECT_EQ(tail[1], k1[3]);
}

// Pinned values: the Python package's test (python/tests/test_keys.py) checks the same ones, so
// keys derived in Python and in C++ are the same keys.
TEST(Keys, ChainKeysGoldenValues) {
  std::vector<uint32_t> t(48);
  for (uint32_t i = 0; i < 48; ++i) t[i] = i;
  auto k = chain_keys(t, 16, "gdkv-golden");
  ASSERT_EQ(k.size(), 3u);
  EXPECT_EQ(k[0].hex(), "fd89c484d255d92e1edd78443f19b4f0");
  EXPECT_EQ(k[1].hex(), "0007b2bf6e043ecedb83299278cdd0b4");
  EXPECT_EQ(k[2].hex(), "9214b2ff4ccd1303bebde69b044cffcb");
}

TEST(Commands, BuildersFillTheRightFields) {
  uint8_t key[3] = {1, 2, 3};
  char buf[10];
  nvme::Sqe s = cmd::store(key, 3, buf, 10, nvme::kStoreMustNotExist, 2);
  EXPECT_EQ(s.opcode, 0x01);
  EXPECT_EQ(s.nsid, 2u);
  EXPECT_EQ(s.cdw10, 10u);
  EXPECT_EQ(s.key_length, 3);
  EXPECT_EQ(s.options, nvme::kStoreMustNotExist);
  EXPECT_EQ(s.dptr.prp.prp1, reinterpret_cast<uint64_t>(buf));
}

}  // namespace
}  // namespace gdkv
