// The local store's index against std::map as a model, under random churn (deletion by backward
// shift is where open addressing goes wrong), plus the on-disk format's parsers on damaged input.
#include "backend/local/index.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "backend/local/format.h"

namespace gdkv::local {
namespace {

Key key_of(uint32_t i) {
  // Short keys too: key length is part of identity ("a" and "a\0" differ).
  uint8_t b[16] = {};
  std::memcpy(b, &i, sizeof(i));
  return Key::from_bytes(b, 1 + i % 16);
}

TEST(LocalIndex, MatchesAMapUnderChurn) {
  Index idx;
  std::map<std::pair<uint32_t, Key>, uint32_t> model;
  std::mt19937 rng(7);
  for (int step = 0; step < 200000; ++step) {
    const uint32_t k = rng() % 5000;
    const uint32_t ns = 1 + rng() % 3;
    const Key key = key_of(k);
    if (rng() % 3 == 0) {
      Location old;
      const bool had = idx.erase(ns, key, &old);
      auto it = model.find({ns, key});
      ASSERT_EQ(had, it != model.end());
      if (had) {
        EXPECT_EQ(old.offset, it->second);
        model.erase(it);
      }
    } else {
      Location loc;
      loc.offset = static_cast<uint32_t>(step);
      loc.set_checksum(uint64_t{0xabcdef} << 32 | static_cast<uint32_t>(step));
      const bool had = idx.upsert(ns, key, loc, nullptr);
      ASSERT_EQ(had, model.count({ns, key}) == 1);
      model[{ns, key}] = static_cast<uint32_t>(step);
    }
    ASSERT_EQ(idx.size(), model.size());
  }
  for (const auto& [k, off] : model) {
    const Location* l = idx.find(k.first, k.second);
    ASSERT_NE(l, nullptr);
    EXPECT_EQ(l->offset, off);
    EXPECT_EQ(l->checksum(), uint64_t{0xabcdef} << 32 | off);
  }
  size_t n = 0;
  idx.for_each([&](uint32_t ns, const Key& k, const Location& l) {
    ++n;
    EXPECT_EQ(model.at({ns, k}), l.offset);
  });
  EXPECT_EQ(n, model.size());
  EXPECT_EQ(idx.find(9, key_of(1)), nullptr);
}

TEST(LocalFormat, ParsersRejectDamage) {
  Superblock s{};
  s.magic = kSuperMagic;
  s.version = kFormatVersion;
  s.block_bytes = kBlock;
  s.segment_bytes = 1u << 20;
  s.store_id = 42;
  seal(s);
  std::vector<std::byte> blk(kBlock);
  std::memcpy(blk.data(), &s, sizeof(s));
  ASSERT_TRUE(parse_superblock(blk.data()).has_value());
  for (size_t i = 0; i < sizeof(s); ++i) {
    std::vector<std::byte> bad = blk;
    bad[i] ^= std::byte{0x10};
    EXPECT_FALSE(parse_superblock(bad.data()).has_value()) << "byte " << i;
  }

  // A batch of one inline record and one block-aligned record, then every single-byte flip of
  // the header and entries must be refused.
  std::vector<std::byte> area(kBlock);
  BatchHeader h{};
  h.magic = kBatchMagic;
  h.store_id = 42;
  h.seq = 3;
  h.batch = 9;
  h.offset = kBlock;
  h.count = 2;
  h.header_bytes = kBlock;
  h.total_bytes = 3 * kBlock;
  std::memcpy(area.data(), &h, sizeof(h));
  RecordEntry a{};
  a.magic = kRecordMagic;
  a.type = static_cast<uint8_t>(RecordType::kPut);
  a.key_len = 3;
  a.nsid = 1;
  a.value_len = 10;
  a.value_off = kBlock + 64 + 128;
  seal(a);
  RecordEntry b = a;
  b.value_len = 5000;
  b.value_off = 2 * kBlock;
  seal(b);
  std::memcpy(area.data() + 64, &a, 64);
  std::memcpy(area.data() + 128, &b, 64);
  seal_batch(area.data());
  auto parsed = peek_batch_header(area.data(), area.size(), 42, 3, kBlock, 1u << 20);
  ASSERT_TRUE(parsed.has_value());
  ASSERT_TRUE(check_batch_entries(area.data(), *parsed, 1u << 20));
  for (size_t i = 0; i < 192; ++i) {
    std::vector<std::byte> bad = area;
    bad[i] ^= std::byte{0x01};
    auto p = peek_batch_header(bad.data(), bad.size(), 42, 3, kBlock, 1u << 20);
    EXPECT_TRUE(!p || !check_batch_entries(bad.data(), *p, 1u << 20)) << "byte " << i;
  }
  // Wrong store, wrong segment life, wrong place.
  EXPECT_FALSE(peek_batch_header(area.data(), area.size(), 43, 3, kBlock, 1u << 20));
  EXPECT_FALSE(peek_batch_header(area.data(), area.size(), 42, 4, kBlock, 1u << 20));
  EXPECT_FALSE(peek_batch_header(area.data(), area.size(), 42, 3, 2 * kBlock, 1u << 20));
  // A batch claiming to run past its segment.
  EXPECT_FALSE(peek_batch_header(area.data(), area.size(), 42, 3, kBlock, 3 * kBlock));
}

}  // namespace
}  // namespace gdkv::local
