// Host arenas: page slots, free list, budget, fault injection, concurrency.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <vector>
#include <cstring>
#include <set>
#include <thread>

#include "lib/store/host_arena.hpp"

using wkv::HostArena;
using wkv::PageId;

namespace {
HostArena::Options opts(uint64_t budget = 0) {
  HostArena::Options o;
  o.page_bytes = 4096;
  o.chunk_bytes = 1 << 20;  // 256 pages
  o.budget_bytes = budget;
  return o;
}
}  // namespace

TEST(HostArena, HandsOutDistinctAlignedWritablePages) {
  HostArena a(opts());
  std::vector<PageId> ids(600);
  ASSERT_TRUE(a.allocate(600, ids.data()).is_ok());
  std::set<uint8_t *> seen;
  for (PageId id : ids) {
    uint8_t *p = a.page_ptr(id);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    std::memset(p, static_cast<int>(id & 0xff), a.page_bytes());
    seen.insert(p);
  }
  EXPECT_EQ(seen.size(), ids.size());
  for (PageId id : ids) EXPECT_EQ(a.page_ptr(id)[a.page_bytes() - 1], static_cast<uint8_t>(id & 0xff));
  HostArena::Stats s = a.stats();
  EXPECT_EQ(s.pages_used, 600u);
  EXPECT_EQ(s.chunks, 3u);
}

TEST(HostArena, ReusesReleasedPagesBeforeGrowing) {
  HostArena a(opts());
  std::vector<PageId> ids(256);
  ASSERT_TRUE(a.allocate(256, ids.data()).is_ok());
  a.release(ids.data(), 100);
  std::vector<PageId> more(100);
  ASSERT_TRUE(a.allocate(100, more.data()).is_ok());
  EXPECT_EQ(a.stats().chunks, 1u);
  std::sort(more.begin(), more.end());
  std::vector<PageId> first(ids.begin(), ids.begin() + 100);
  std::sort(first.begin(), first.end());
  EXPECT_EQ(more, first);
}

TEST(HostArena, RefusesBeyondBudgetAllOrNothing) {
  HostArena a(opts(300 * 4096));
  std::vector<PageId> ids(400);
  ASSERT_TRUE(a.allocate(250, ids.data()).is_ok());
  wkv::Status s = a.allocate(60, ids.data() + 250);
  EXPECT_EQ(s.code(), WKV_ERR_BUDGET);
  EXPECT_NE(s.message().find("budget"), std::string::npos);
  EXPECT_EQ(a.stats().pages_used, 250u);
  EXPECT_LE(a.stats().bytes_reserved, 300u * 4096);
  ASSERT_TRUE(a.allocate(50, ids.data() + 250).is_ok()) << "exactly the budget fits";
  EXPECT_EQ(a.allocate(1, ids.data() + 300).code(), WKV_ERR_BUDGET);
}

TEST(HostArena, ChunkFailureIsReportedAndRecoverable) {
  HostArena a(opts());
  a.inject_chunk_failures(1);
  PageId id;
  EXPECT_EQ(a.allocate(1, &id).code(), WKV_ERR_OUT_OF_MEMORY);
  EXPECT_EQ(a.stats().pages_used, 0u);
  EXPECT_TRUE(a.allocate(1, &id).is_ok());
}

TEST(HostArena, RegisterHookFailureFailsTheAllocation) {
  HostArena::Options o = opts();
  int registered = 0, unregistered = 0;
  bool refuse = true;
  o.on_register = [&](void *, size_t) {
    if (refuse) return WKV_ERROR(WKV_ERR_DEVICE, "pinning refused");
    ++registered;
    return wkv::Status::ok();
  };
  o.on_unregister = [&](void *, size_t) { ++unregistered; };
  {
    HostArena a(o);
    PageId id;
    EXPECT_EQ(a.allocate(1, &id).code(), WKV_ERR_DEVICE);
    refuse = false;
    EXPECT_TRUE(a.allocate(1, &id).is_ok());
  }
  EXPECT_EQ(registered, 1);
  EXPECT_EQ(unregistered, 1);
}

TEST(HostArena, ConcurrentAllocateAndRelease) {
  HostArena a(opts());
  std::vector<std::thread> th;
  for (int t = 0; t < 4; ++t)
    th.emplace_back([&a, t] {
      std::vector<PageId> ids(37);
      for (int i = 0; i < 200; ++i) {
        ASSERT_TRUE(a.allocate(37, ids.data()).is_ok());
        for (PageId id : ids) a.page_ptr(id)[0] = static_cast<uint8_t>(t);
        for (PageId id : ids) ASSERT_EQ(a.page_ptr(id)[0], static_cast<uint8_t>(t));
        a.release(ids.data(), 37);
      }
    });
  for (auto &x : th) x.join();
  EXPECT_EQ(a.stats().pages_used, 0u);
}

// Options::ahead: once fewer than two chunks' pages are free, chunks are
// mapped and registered on the arena's own thread until there are, so that
// the allocations that need them find them ready and register nothing
// themselves; allocations and releases go on while a chunk is being
// registered; a budget with no room for another chunk gets none.
TEST(HostArena, AheadRegistersTheNextChunksOnItsOwnThread) {
  HostArena::Options o = opts(4u << 20);  // room for four chunks of 256 pages
  o.ahead = true;
  std::mutex mu;
  std::vector<std::thread::id> registered_on;
  o.on_register = [&](void *, size_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // as pinning takes its time
    std::lock_guard<std::mutex> lock(mu);
    registered_on.push_back(std::this_thread::get_id());
    return wkv::Status::ok();
  };
  auto wait_chunks = [](const HostArena &a, uint64_t n) {
    for (int i = 0; i < 400 && a.stats().chunks < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return a.stats().chunks;
  };
  HostArena a(o);
  std::vector<PageId> ids(600);
  ASSERT_TRUE(a.allocate(100, ids.data()).is_ok());  // the first chunk, on this thread; 156 free: two more wanted
  // Meanwhile the arena serves what it has.
  PageId more[40];
  ASSERT_TRUE(a.allocate(40, more).is_ok());
  a.release(more, 40);
  EXPECT_EQ(wait_chunks(a, 3), 3u);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(a.stats().chunks, 3u) << "668 pages free: two chunks' worth, nothing more ahead";
  EXPECT_EQ(a.stats().chunks_ahead, 2u);
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_EQ(registered_on.size(), 3u);
    EXPECT_EQ(registered_on[0], std::this_thread::get_id());
    EXPECT_NE(registered_on[1], std::this_thread::get_id()) << "the second chunk was registered ahead";
    EXPECT_NE(registered_on[2], std::this_thread::get_id()) << "the third chunk was registered ahead";
  }
  ASSERT_TRUE(a.allocate(500, ids.data() + 100).is_ok());  // from the chunks added ahead: 168 free, a fourth wanted
  EXPECT_EQ(wait_chunks(a, 4), 4u);
  EXPECT_EQ(a.stats().chunks_ahead, 3u);
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(registered_on.size(), 4u) << "no chunk registered on the allocating thread after the first";
  }
  // The budget holds four chunks: a fifth is never added ahead, and an
  // allocation beyond the budget is refused as before.
  std::vector<PageId> rest(424);
  ASSERT_TRUE(a.allocate(424, rest.data()).is_ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(a.stats().chunks, 4u);
  EXPECT_EQ(a.allocate(1, rest.data()).code(), WKV_ERR_BUDGET);
}
