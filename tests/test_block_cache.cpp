// The block cache's bookkeeping: LRU order, quarantine of evicted slots,
// capacity, and dropping a sequence.
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "lib/buffer/block_cache.hpp"

using wkv::BlockCache;
using wkv::LruPolicy;
using wkv::PageKey;

namespace {
BlockCache make(uint32_t slots) { return BlockCache(slots, std::make_unique<LruPolicy>(slots)); }
PageKey key(uint32_t page, uint64_t seq = 1) { return PageKey{seq, 0, page}; }
}  // namespace

TEST(BlockCache, EvictsLeastRecentlyUsedFirst) {
  BlockCache c = make(3);
  for (uint32_t p = 0; p < 3; ++p) EXPECT_GE(c.admit(key(p), 0).slot, 0);
  c.find(key(0), true);  // 1 is now the least recently used
  BlockCache::Admission a = c.admit(key(3), 1);
  ASSERT_TRUE(a.evicted);
  EXPECT_EQ(a.victim, key(1));
  EXPECT_EQ(a.slot, -1) << "the victim's slot is quarantined, not reused at once";
  EXPECT_EQ(c.find(key(1), false), -1);
  EXPECT_GE(c.find(key(0), false), 0);
}

TEST(BlockCache, QuarantinedSlotIsReusedOnlyAfterItsEpoch) {
  BlockCache c = make(2);
  int64_t s0 = c.admit(key(0), 0).slot;
  c.admit(key(1), 0);
  BlockCache::Admission a = c.admit(key(2), 5);
  EXPECT_EQ(a.slot, -1);
  EXPECT_EQ(c.quarantined(), 1u);
  c.release_quarantine(5);  // a step that began at epoch 5 may still run
  EXPECT_EQ(c.quarantined(), 1u);
  c.release_quarantine(6);
  EXPECT_EQ(c.quarantined(), 0u);
  BlockCache::Admission b = c.admit(key(2), 6);
  EXPECT_EQ(b.slot, s0);
  EXPECT_FALSE(b.evicted);
}

TEST(BlockCache, NeverHoldsMoreThanItsSlots) {
  BlockCache c = make(16);
  std::mt19937 rng(1);
  uint64_t epoch = 0;
  for (int i = 0; i < 5000; ++i) {
    PageKey k = key(rng() % 64, rng() % 3);
    if (c.find(k, true) < 0) c.admit(k, epoch);
    if (i % 7 == 0) c.release_quarantine(++epoch);
    ASSERT_LE(c.resident() + c.quarantined(), 16u);
  }
}

TEST(BlockCache, HitRatioRisesOverRepeatedQueries) {
  BlockCache c = make(64);
  std::mt19937 rng(2);
  uint64_t epoch = 0;
  auto round = [&] {
    int hits = 0;
    for (uint32_t p = 0; p < 48; ++p) {  // a working set smaller than the cache
      if (c.find(key(p), true) >= 0) ++hits;
      else c.admit(key(p), epoch);
    }
    c.release_quarantine(++epoch);
    return hits;
  };
  EXPECT_EQ(round(), 0);
  EXPECT_EQ(round(), 48);
}

TEST(BlockCache, DroppingASequenceFreesItsSlotsAfterQuarantine) {
  BlockCache c = make(8);
  for (uint32_t p = 0; p < 4; ++p) c.admit(key(p, 7), 0);
  for (uint32_t p = 0; p < 4; ++p) c.admit(key(p, 8), 0);
  auto dropped = c.drop_sequence(7, 3);
  EXPECT_EQ(dropped.size(), 4u);
  EXPECT_EQ(c.resident(), 4u);
  EXPECT_LT(c.admit(key(9, 8), 3).slot, 0) << "no free slot until the quarantine ends";
  c.release_quarantine(4);
  EXPECT_GE(c.admit(key(10, 8), 4).slot, 0);
}
