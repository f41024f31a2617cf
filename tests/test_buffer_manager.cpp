// The buffer manager on the host, with a device played by the test: the
// test takes frames from the pool and writes what a step's gather would
// (admissions, hits, counts) into the record and then the step's end into
// its tracker, as the device does.
// Frames become resident, recency picks victims, and a frame given up is
// reused only once every step that could read it has ended, whatever
// happened to the step's plan. Epochs are 64-bit; a full record ring drops
// new records without blocking; a failed unit map store withholds frames.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "lib/buffer/buffer_manager.hpp"
#include "lib/buffer/host_device.hpp"
#include "lib/buffer/replacement.hpp"
#include "lib/index/head.hpp"

using namespace wkv;

namespace {

// Units 0 to n - 1.
std::vector<uint32_t> first_units(uint32_t n) {
  std::vector<uint32_t> u(n);
  std::iota(u.begin(), u.end(), 0u);
  return u;
}

// The host device, with an injected store failure, something to run as a
// clear begins, and a count of the entries cleared.
class FakeDevice : public HostDevice {
 public:
  Status clear_entries(const uint64_t *entries, uint32_t n) override {
    if (during_clear) during_clear();
    if (fail_clears.load()) return WKV_ERROR(WKV_ERR_DEVICE, "injected store failure");
    const Status st = HostDevice::clear_entries(entries, n);
    cleared += n;
    return st;
  }
  std::atomic<bool> fail_clears{false};
  std::function<void()> during_clear;  // set before the manager evicts
  uint32_t cleared = 0;
};

struct Fixture {
  // Declared before the manager: its thread clears entries of the map
  // until the manager is destroyed (members go in reverse order).
  FakeDevice dev;
  std::vector<uint32_t> unit_map = std::vector<uint32_t>(1024, kNoFrame);  // one head's entries
  BufferManager bm;
  uint32_t head = 0, gen = 0;

  using Reserve = BufferManager::Options::Reserve;
  explicit Fixture(uint32_t units, size_t ring_bytes = 1 << 20, bool reader_quarantine = true,
                   Reserve reserve = Reserve::kReaders)
      : bm(options(units, ring_bytes, reader_quarantine, reserve), &dev) {
    EXPECT_TRUE(bm.start().is_ok());
    head = bm.head_created(&gen);
  }
  static BufferManager::Options options(uint32_t units, size_t ring_bytes, bool reader_quarantine,
                                        Reserve reserve) {
    BufferManager::Options o;
    o.units = units;
    o.ring_bytes = ring_bytes;
    o.reader_quarantine = reader_quarantine;
    o.reserve = reserve;
    return o;
  }
  std::shared_ptr<StepTracker> tracker() {
    std::shared_ptr<StepTracker> t;
    EXPECT_TRUE(bm.new_tracker(&t).is_ok());
    return t;
  }
  uint64_t head_word() const { return (static_cast<uint64_t>(head) << 32) | gen; }
  // An entry of the head's unit map as the device would read it.
  uint32_t entry(uint32_t u) const { return __atomic_load_n(&unit_map[u], __ATOMIC_RELAXED); }

  // One step as a gather runs it: misses admitted into frames taken from
  // the pool (unit u mapped at unit_map[u]), hits logged, then the step's
  // end.
  struct Step {
    StepTracker *tracker = nullptr;
    uint64_t epoch = 0;
    StepRecord rec;
  };
  Step begin_step(StepTracker &t, uint32_t want, uint32_t hit_cap = 64, uint32_t key = 0) {
    Step s;
    s.tracker = &t;
    s.epoch = bm.begin(t);
    const uint64_t h = head_word();
    s.rec = bm.open_record(t, s.epoch, &h, 1, want, hit_cap, key);
    return s;
  }
  // Says the step reads unit map entries from now on, as its gather's CTAs
  // do first; then misses units `units`, admitting each into a frame from
  // the pool while it has one (a unit in `lost` loses its swap: another
  // step mapped it), and logs `hits`. Returns the frames mapped.
  std::vector<uint32_t> run_step(const Step &s, const std::vector<uint32_t> &units,
                                 const std::vector<uint32_t> &hits, const std::set<uint32_t> &lost = {}) {
    BufferManager::reading_on_host(*s.tracker, s.epoch);
    std::vector<uint32_t> frames;
    uint32_t used = 0;
    if (s.rec.header) {
      const FramePool pool = bm.pool();
      for (uint32_t u : units) {
        if (used == s.rec.admit_cap) break;
        const uint32_t f = take_pool_frame(pool);
        uint64_t entry = 0;
        if (f != kNoFrame && !lost.count(u)) {
          __atomic_store_n(&unit_map[u], f, __ATOMIC_RELAXED);
          entry = reinterpret_cast<uint64_t>(&unit_map[u]);
          frames.push_back(f);
        }
        s.rec.admits[used++] = AdmitEntry{entry, f, 0};
      }
      for (size_t i = 0; i < hits.size(); ++i) s.rec.hits[i] = hits[i];
      close_record_on_host(s.rec, pool, used, static_cast<uint32_t>(hits.size()), static_cast<uint32_t>(units.size()));
    }
    return frames;
  }
  void end_step(StepTracker &t, const Step &s) { bm.end_on_host(t, s.epoch); }
  // Runs step s missing n units not read lately (*next, *next + 1, ...,
  // modulo span; *next moves on). Returns how many it admitted.
  uint32_t miss_fresh(const Step &s, uint32_t n, uint32_t *next, uint32_t span) {
    std::vector<uint32_t> units(n);
    for (uint32_t &u : units) u = (*next)++ % span;
    return static_cast<uint32_t>(run_step(s, units, {}).size());
  }
};

}  // namespace

TEST(BufferManager, AdmittedFramesBecomeResidentAndUnmappedOnesReturn) {
  Fixture f(64);
  auto t = f.tracker();
  auto step = f.begin_step(*t, 10);
  ASSERT_NE(step.rec.header, nullptr);
  EXPECT_EQ(step.rec.admit_cap, 10u);
  EXPECT_EQ(f.bm.stats().free, 64u) << "opening a record takes no frame";
  // Unit 4's swap loses (another step mapped it): its frame goes back.
  const auto frames = f.run_step(step, {1, 2, 3, 4}, {}, {4});
  ASSERT_EQ(frames.size(), 3u);
  f.end_step(*t, step);
  ASSERT_TRUE(f.bm.quiesce(5000));
  const BufferManager::Stats s = f.bm.stats();
  EXPECT_EQ(s.admissions, 3u);
  EXPECT_EQ(s.resident, 3u);
  EXPECT_EQ(s.given, 4u) << "four frames taken";
  EXPECT_EQ(s.free + s.resident + s.quarantined, 64u) << "the lost swap's frame went back";
  EXPECT_EQ(f.entry(1), frames[0]);
}

// A step admits at most its bound (the record's room), whatever the pool
// holds.
TEST(BufferManager, AStepAdmitsAtMostItsBound) {
  Fixture f(64);
  auto t = f.tracker();
  auto step = f.begin_step(*t, 2);
  const auto frames = f.run_step(step, {1, 2, 3, 4}, {});
  EXPECT_EQ(frames.size(), 2u);
  f.end_step(*t, step);
  ASSERT_TRUE(f.bm.quiesce(5000));
  const BufferManager::Stats s = f.bm.stats();
  EXPECT_EQ(s.admissions, 2u);
  EXPECT_EQ(s.missed, 4u);
  EXPECT_EQ(s.free + s.resident + s.quarantined, 64u);
}

TEST(BufferManager, EvictsLeastRecentlyUsedFirstAndClearsTheirEntries) {
  Fixture f(16);  // a reserve of 16 / 4 = 4 free frames is kept
  auto t = f.tracker();
  auto a = f.begin_step(*t, 12);
  ASSERT_EQ(a.rec.admit_cap, 12u);
  std::vector<uint32_t> units;
  for (uint32_t u = 0; u < 12; ++u) units.push_back(u);
  const auto frames = f.run_step(a, units, {});
  f.end_step(*t, a);
  ASSERT_TRUE(f.bm.quiesce(5000));
  EXPECT_EQ(f.bm.stats().evictions, 0u) << "4 free frames meet the reserve";
  // Units 0 and 1 are read again: the least recently used are now 2 and 3.
  auto b = f.begin_step(*t, 0);
  f.run_step(b, {}, {frames[0], frames[1]});
  f.end_step(*t, b);
  ASSERT_TRUE(f.bm.quiesce(5000));
  // Two more are admitted: the reserve asks for 2 victims (as soon as the
  // frames are handed out).
  auto c = f.begin_step(*t, 2);
  f.run_step(c, {12, 13}, {});
  f.end_step(*t, c);
  ASSERT_TRUE(f.bm.quiesce(5000));
  for (int i = 0; i < 500 && f.bm.stats().evictions < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(f.bm.stats().evictions, 2u);
  EXPECT_EQ(f.entry(0), frames[0]) << "recently read: kept";
  EXPECT_EQ(f.entry(1), frames[1]);
  EXPECT_EQ(f.entry(2), kNoFrame) << "least recently used: evicted, entry cleared";
  EXPECT_EQ(f.entry(3), kNoFrame);
  EXPECT_NE(f.entry(4), kNoFrame);
}

// A head destroyed while the manager clears its victims' entries (after it
// found the head alive): the release of the head's memory, deferred by its
// owner, waits until the clear has landed, since the stores may go into
// that memory.
TEST(BufferManager, AHeadDestroyedDuringAClearHasItsMemoryReleasedAfterIt) {
  Fixture f(16);  // a reserve of 16 / 4 = 4 free frames
  std::atomic<int> released{0}, released_during_clear{-1};
  f.dev.during_clear = [&] {
    f.bm.head_destroyed(f.head);
    f.bm.defer([&] { ++released; });
    released_during_clear = released.load();
  };
  auto t = f.tracker();
  auto a = f.begin_step(*t, 14);
  ASSERT_EQ(f.run_step(a, first_units(14), {}).size(), 14u);
  f.end_step(*t, a);  // 2 frames free: the manager evicts 2 and clears their entries
  for (int i = 0; i < 5000 && released_during_clear.load() < 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(released_during_clear.load(), 0) << "the release ran while the clear was storing";
  ASSERT_TRUE(f.bm.quiesce(5000));
  EXPECT_EQ(released.load(), 1) << "and ran once the clear had landed";
}

// A frame evicted while a step is in flight (it may have read the frame's
// old entry) is not handed out again until that step has ended.
TEST(BufferManager, QuarantinedFramesWaitForStepsInFlight) {
  Fixture f(8);  // a reserve of 2
  auto t = f.tracker(), reader = f.tracker();
  auto a = f.begin_step(*t, 8);
  const std::vector<uint32_t> all = first_units(8);
  const auto frames = f.run_step(a, all, {});
  // A step of another plan begins reading before the evictions and stays
  // in flight.
  const uint64_t e = f.bm.begin(*reader);
  BufferManager::reading_on_host(*reader, e);
  f.end_step(*t, a);
  ASSERT_TRUE(f.bm.quiesce(5000));
  for (int i = 0; i < 500 && f.bm.stats().evictions < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  BufferManager::Stats s = f.bm.stats();
  ASSERT_GE(s.evictions, 2u);
  EXPECT_EQ(s.free, 0u) << "evicted frames are quarantined while the reader runs";
  EXPECT_GE(s.quarantined, 2u);
  auto c = f.begin_step(*t, 8);
  EXPECT_TRUE(f.run_step(c, {8, 9}, {}).empty()) << "nothing to take while the reader runs";
  f.end_step(*t, c);
  // The reader ends: its pins go, and the frames come back.
  f.bm.end_on_host(*reader, e);
  for (int i = 0; i < 500 && f.bm.stats().free < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  s = f.bm.stats();
  EXPECT_GE(s.free, 2u);
  EXPECT_EQ(s.quarantined, 0u);
}

// Only a gather reads frames, through unit map entries, and it says so
// before its first (the tracker's reading word). A step that has begun but
// not yet reached its gather when the entries are cleared reads the cleared
// entries: it does not hold the evicted frames. One seen reading does.
// (WKV_QUARANTINE=steps, reader_quarantine false: every step begun holds
// them.)
TEST(BufferManager, EvictedFramesWaitOnlyForStepsSeenReading) {
  for (const bool readers : {true, false}) {
    SCOPED_TRACE(readers ? "reader quarantine" : "every step in flight");
    Fixture f(8, 1 << 20, readers);  // a reserve of 2
    auto t = f.tracker(), reading = f.tracker(), queued = f.tracker();
    auto a = f.begin_step(*t, 8);
    const std::vector<uint32_t> all = first_units(8);
    f.run_step(a, all, {});
    const uint64_t er = f.bm.begin(*reading), eq = f.bm.begin(*queued);
    BufferManager::reading_on_host(*reading, er);  // the other is enqueued, not yet at its gather
    f.end_step(*t, a);
    for (int i = 0; i < 500 && f.bm.stats().evictions < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_GE(f.bm.stats().evictions, 2u);
    ASSERT_TRUE(f.bm.quiesce(5000));
    EXPECT_EQ(f.bm.stats().free, 0u) << "a step that may have read the entries holds the frames";
    f.bm.end_on_host(*reading, er);
    for (int i = 0; i < 200 && f.bm.stats().free < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (readers)
      EXPECT_GE(f.bm.stats().free, 2u) << "the step not yet reading does not hold them";
    else
      EXPECT_EQ(f.bm.stats().free, 0u) << "every step begun holds them";
    f.bm.end_on_host(*queued, eq);
    for (int i = 0; i < 500 && f.bm.stats().free < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_GE(f.bm.stats().free, 2u);
    EXPECT_EQ(f.bm.stats().quarantined, 0u);
  }
}

// Two plans' steps in flight at once. An eviction waits for each tracker's
// step seen reading at its clear, not for an epoch: a step of one plan that
// begins reading after the clear (it reads the cleared entries) does not
// hold the frames, even though the other plan's reader had a newer epoch.
// (Stamped with the newest reader's epoch and released once every tracker
// seen reading had passed it, these frames waited for plan A's second step
// too: with two plans overlapping, no better than every step begun.)
TEST(BufferManager, EvictedFramesWaitForEachPlansReaderNotForAnEpoch) {
  Fixture f(8);  // a reserve of 2
  auto t = f.tracker(), a = f.tracker(), b = f.tracker();
  auto fill = f.begin_step(*t, 8);
  const std::vector<uint32_t> all = first_units(8);
  f.run_step(fill, all, {});
  // Plan A enqueues two steps, then plan B one; A's first and B's are reading.
  const uint64_t a1 = f.bm.begin(*a), a2 = f.bm.begin(*a), b1 = f.bm.begin(*b);
  BufferManager::reading_on_host(*a, a1);
  BufferManager::reading_on_host(*b, b1);
  f.end_step(*t, fill);  // the manager takes it and evicts under both readers
  for (int i = 0; i < 500 && f.bm.stats().evictions < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_GE(f.bm.stats().evictions, 2u);
  ASSERT_TRUE(f.bm.quiesce(5000));
  EXPECT_EQ(f.bm.stats().free, 0u) << "A's and B's readers hold them";
  // Both readers end; A's second step begins reading, after the clear.
  f.bm.end_on_host(*a, a1);
  f.bm.end_on_host(*b, b1);
  BufferManager::reading_on_host(*a, a2);
  for (int i = 0; i < 500 && f.bm.stats().free < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_GE(f.bm.stats().free, 2u) << "A's second step read the cleared entries";
  f.bm.end_on_host(*a, a2);
}

// A token's burst of layers, enqueued back to back, misses more than the
// reserve (at most a quarter of the cache) holds: twice as much here. The
// manager evicts as each step's record is taken; the frames it clears
// while the burst's later steps are still queued are free for them, so the
// burst admits what it misses. (Held until every step of the burst had
// ended, as they were before the reading word, the frames ready when the
// burst began were all it could admit: under half.)
TEST(BufferManager, FramesEvictedDuringABurstServeItsLaterSteps) {
  constexpr uint32_t kUnits = 8192, kLayers = 8, kMiss = 512, kRounds = 24;  // 4096 a burst, the reserve 2048
  for (const bool readers : {true, false}) {
    SCOPED_TRACE(readers ? "reader quarantine" : "every step in flight");
    Fixture f(kUnits, 1 << 20, readers);
    f.unit_map.assign(1 << 17, kNoFrame);
    auto t = f.tracker();
    uint32_t next = 0;
    uint64_t admitted_late = 0, missed_late = 0, taken = 0;
    for (uint32_t round = 0; round < kRounds; ++round) {
      std::vector<Fixture::Step> steps;
      for (uint32_t l = 0; l < kLayers; ++l) steps.push_back(f.begin_step(*t, 2 * kMiss));
      for (const Fixture::Step &s : steps) {
        const uint32_t got = f.miss_fresh(s, kMiss, &next, 1 << 17);
        if (round >= kRounds / 2) {
          admitted_late += got;
          missed_late += kMiss;
        }
        f.end_step(*t, s);
        // The manager takes the record, evicts and (with the reading word)
        // frees before the next step reaches its gather: a step's lookup
        // takes longer than a manager's pass.
        taken += kMiss;
        for (int w = 0; w < 5000 && f.bm.stats().missed != taken; ++w)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ASSERT_EQ(f.bm.stats().missed, taken);
        for (int w = 0; readers && w < 5000 && f.bm.stats().free < kMiss; ++w)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    std::printf("%s: a burst admitted %llu of %llu misses\n", readers ? "reader quarantine" : "every step in flight",
                static_cast<unsigned long long>(admitted_late), static_cast<unsigned long long>(missed_late));
    if (readers)
      EXPECT_GE(admitted_late, missed_late * 95 / 100);
    else
      EXPECT_LE(admitted_late, missed_late * 6 / 10);
  }
}

// A 32-layer model's token: 32 steps enqueued back to back, each ending
// some time after the one before (the manager takes each record before the
// next step ends). With reader quarantine, frames evicted after a step are
// free again for the next steps of the same token, so the reserve of free
// frames covers a few steps' misses, not the token's: the rest of the cache
// stays resident. With the burst's reserve (WKV_CACHE_RESERVE=burst), a
// token's misses are kept free. Both admit what they miss.
TEST(BufferManager, TheReserveCoversTheStepsBesideEachOtherNotTheWholeToken) {
  constexpr uint32_t kUnits = 32768, kLayers = 32, kMiss = 200, kRounds = 12;  // 6400 a token; full by round 6
  for (const auto reserve : {Fixture::Reserve::kReaders, Fixture::Reserve::kBurst}) {
    const bool readers = reserve == Fixture::Reserve::kReaders;
    SCOPED_TRACE(readers ? "readers" : "burst");
    Fixture f(kUnits, 1 << 20, true, reserve);
    f.unit_map.assign(1 << 17, kNoFrame);
    auto t = f.tracker();
    uint32_t next = 0;
    uint64_t missed = 0, admitted = 0, taken = 0;
    size_t free_at_token_end = 0;
    for (uint32_t round = 0; round < kRounds; ++round) {
      std::vector<Fixture::Step> steps;
      for (uint32_t l = 0; l < kLayers; ++l) steps.push_back(f.begin_step(*t, 4 * kMiss, 64, l + 1));
      for (const Fixture::Step &s : steps) {
        ASSERT_NE(s.rec.header, nullptr);
        const uint32_t got = f.miss_fresh(s, kMiss, &next, 1 << 17);
        f.end_step(*t, s);
        if (round >= kRounds / 2) {
          missed += kMiss;
          admitted += got;
        }
        taken += kMiss;
        for (int w = 0; w < 5000 && f.bm.stats().missed != taken; ++w)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ASSERT_EQ(f.bm.stats().missed, taken);
      }
      ASSERT_TRUE(f.bm.quiesce(5000));
      free_at_token_end = f.bm.stats().free + f.bm.stats().quarantined;
    }
    std::printf("%s: admitted %llu of %llu misses; %zu frames kept free of %u\n", readers ? "readers" : "burst",
                static_cast<unsigned long long>(admitted), static_cast<unsigned long long>(missed),
                free_at_token_end, kUnits);
    EXPECT_GE(admitted, missed * 95 / 100);
    if (readers)
      EXPECT_LE(free_at_token_end, size_t{5} * kMiss) << "a few steps' misses";
    else
      EXPECT_GE(free_at_token_end, size_t{kLayers} * kMiss) << "a token's misses";
  }
}

// Defect 1 of the redesign: a plan destroyed between lookup and update (or
// never updated) left its epoch in flight for ever, so quarantined frames
// were never released and the cache drained. A step's pins end when its
// kernels end, whatever happens to its plan.
TEST(BufferManager, AStepOfADestroyedPlanStillEndsItsPins) {
  Fixture f(8);
  auto t = f.tracker();
  auto a = f.begin_step(*t, 8);
  const std::vector<uint32_t> all = first_units(8);
  f.run_step(a, all, {});
  auto plan = f.tracker();
  const uint64_t e = f.bm.begin(*plan);  // looked up and assembled, never updated
  BufferManager::reading_on_host(*plan, e);
  f.end_step(*t, a);
  StepTracker *raw = plan.get();
  plan.reset();                           // the plan is destroyed
  for (int i = 0; i < 500 && f.bm.stats().evictions < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(f.bm.stats().free, 0u);
  f.bm.end_on_host(*raw, e);  // its kernels end on the device
  for (int i = 0; i < 500 && f.bm.stats().free < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_GE(f.bm.stats().free, 2u);
}

// Defect 5: epochs were 32-bit, and after 2^32 steps quarantine was stamped
// wrongly. They are 64-bit: ordering holds across 2^32.
TEST(BufferManager, EpochsStayOrderedPastTwoToThe32) {
  Fixture f(8);
  f.bm.advance_epoch((uint64_t{1} << 32) - 3);
  auto t = f.tracker(), reader = f.tracker();
  auto a = f.begin_step(*t, 8);
  EXPECT_EQ(a.epoch, (uint64_t{1} << 32) - 2);
  const std::vector<uint32_t> all = first_units(8);
  f.run_step(a, all, {});
  const uint64_t e = f.bm.begin(*reader);
  BufferManager::reading_on_host(*reader, e);
  f.end_step(*t, a);
  for (int i = 0; i < 5; ++i) f.end_step(*t, f.begin_step(*t, 0));  // epochs past 2^32
  EXPECT_GT(f.bm.epoch(), uint64_t{1} << 32);
  for (int i = 0; i < 500 && f.bm.stats().evictions < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_TRUE(f.bm.quiesce(5000));
  EXPECT_EQ(f.bm.stats().free, 0u) << "the reader of epoch 2^32 - 1 still pins them";
  f.bm.end_on_host(*reader, e);
  for (int i = 0; i < 500 && f.bm.stats().free < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_GE(f.bm.stats().free, 2u);
}

// Defect 7: the manager's queue was unbounded and fell back to allocating
// on the decoding path. Records live in a ring allocated at open; when it is
// full the new step gets none, and nothing blocks.
TEST(BufferManager, AFullRingDropsNewRecordsWithoutBlocking) {
  Fixture f(1024, 4096);
  auto t = f.tracker();
  std::vector<Fixture::Step> open;
  for (int i = 0; i < 64; ++i) open.push_back(f.begin_step(*t, 16, 64));  // none ends yet
  const BufferManager::Stats s = f.bm.stats();
  EXPECT_GT(s.dropped_records, 0u);
  EXPECT_EQ(open.back().rec.header, nullptr);
  EXPECT_EQ(s.free, 1024u) << "records take no frames";
  EXPECT_TRUE(f.run_step(open.back(), {1, 2}, {}).empty()) << "a step without a record admits nothing";
  for (const auto &st : open) f.end_step(*t, st);
  ASSERT_TRUE(f.bm.quiesce(5000));
  EXPECT_EQ(f.bm.stats().free, 1024u) << "every unused frame came back";
  auto again = f.begin_step(*t, 16);
  EXPECT_NE(again.rec.header, nullptr) << "room again once the records are taken";
  f.end_step(*t, again);
}

// Defect 8: after a failed store, evicted frames still mapped were released
// anyway. A frame whose entry could not be cleared is never handed out.
TEST(BufferManager, AFailedEntryStoreWithholdsTheFrames) {
  Fixture f(16);
  f.dev.fail_clears = true;
  auto t = f.tracker();
  auto a = f.begin_step(*t, 14);
  std::vector<uint32_t> units(14);
  for (uint32_t u = 0; u < 14; ++u) units[u] = u;
  f.run_step(a, units, {});
  f.end_step(*t, a);
  for (int i = 0; i < 500 && f.bm.stats().lost < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  f.dev.fail_clears = false;
  ASSERT_TRUE(f.bm.quiesce(5000));
  EXPECT_GE(f.bm.stats().lost, 2u);
  // Whatever a step takes from the pool is mapped nowhere (the manager
  // clears an entry before it frees the frame, so the map read before the
  // step is exact enough: entries are only ever cleared meanwhile).
  for (uint32_t round = 0; round < 3; ++round) {
    auto b = f.begin_step(*t, 16);
    std::set<uint32_t> still_mapped;
    for (uint32_t u = 0; u < 14; ++u)
      if (f.entry(u) != kNoFrame) still_mapped.insert(f.entry(u));
    for (uint32_t fr : f.run_step(b, {100 + 2 * round, 101 + 2 * round}, {}))
      EXPECT_EQ(still_mapped.count(fr), 0u) << "frame " << fr << " is still mapped";
    f.end_step(*t, b);
    ASSERT_TRUE(f.bm.quiesce(5000));
  }
}

TEST(BufferManager, DeferredReleasesRunOnceTheStepsInFlightHaveEnded) {
  Fixture f(0);
  auto t = f.tracker();
  std::atomic<int> ran{0};
  f.bm.defer([&] { ++ran; });
  EXPECT_EQ(ran.load(), 1) << "nothing in flight: at once";
  const uint64_t e = f.bm.begin(*t);
  f.bm.defer([&] { ++ran; });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(ran.load(), 1) << "a step begun before still runs";
  f.bm.end_on_host(*t, e);
  for (int i = 0; i < 500 && ran.load() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(ran.load(), 2);
}

TEST(BufferManager, AdmissionsForADestroyedHeadAreQuarantinedNotResident) {
  Fixture f(16);
  auto t = f.tracker();
  auto a = f.begin_step(*t, 4);
  f.run_step(a, {0, 1, 2, 3}, {});
  f.bm.head_destroyed(f.head);  // the sequence went while its step ran
  f.end_step(*t, a);
  ASSERT_TRUE(f.bm.quiesce(5000));
  for (int i = 0; i < 500 && f.bm.stats().free < 16; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const BufferManager::Stats s = f.bm.stats();
  EXPECT_EQ(s.resident, 0u);
  EXPECT_EQ(s.admissions, 0u);
  EXPECT_EQ(s.free, 16u);
}

// A frame of a head that is gone is evicted without its entry cleared (its
// unit map is not written again): a step enqueued before the head went may
// still read that entry, however late it reaches its gather. Such frames
// wait for every step begun by then, not only for those seen reading.
TEST(BufferManager, FramesOfADeadHeadWaitForEveryStepBegun) {
  Fixture f(64);  // a reserve of 16
  auto t = f.tracker(), queued = f.tracker();
  auto a = f.begin_step(*t, 64);
  const std::vector<uint32_t> all = first_units(64);
  f.run_step(a, all, {});
  f.end_step(*t, a);
  for (int i = 0; i < 500 && f.bm.stats().free < 16; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_TRUE(f.bm.quiesce(5000));
  ASSERT_EQ(f.bm.stats().free, 16u);
  // A step of the head's plan is enqueued, not yet at its gather; the
  // sequence goes; a step of another head takes the free frames, and the
  // manager evicts the dead head's.
  const uint64_t e = f.bm.begin(*queued);
  f.bm.head_destroyed(f.head);
  const uint32_t cleared = f.dev.cleared;
  const uint64_t evicted = f.bm.stats().evictions;
  uint32_t gen2 = 0;
  const uint32_t head2 = f.bm.head_created(&gen2);
  const uint64_t word2 = (static_cast<uint64_t>(head2) << 32) | gen2;
  std::vector<uint32_t> map2(16, kNoFrame);
  const uint64_t eb = f.bm.begin(*t);
  const StepRecord rec = f.bm.open_record(*t, eb, &word2, 1, 16, 64);
  ASSERT_NE(rec.header, nullptr);
  BufferManager::reading_on_host(*t, eb);
  const FramePool pool = f.bm.pool();
  for (uint32_t i = 0; i < 16; ++i) {
    const uint32_t fr = take_pool_frame(pool);
    ASSERT_NE(fr, kNoFrame);
    map2[i] = fr;
    rec.admits[i] = AdmitEntry{reinterpret_cast<uint64_t>(&map2[i]), fr, 0};
  }
  rec.header->used = 16;
  rec.header->missed = 16;
  __atomic_store_n(pool.seen, __atomic_load_n(pool.taken, __ATOMIC_ACQUIRE), __ATOMIC_RELEASE);
  f.bm.end_on_host(*t, eb);
  for (int i = 0; i < 500 && f.bm.stats().evictions < evicted + 16; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_GE(f.bm.stats().evictions, evicted + 16);
  ASSERT_TRUE(f.bm.quiesce(5000));
  EXPECT_EQ(f.dev.cleared, cleared) << "a dead head's entries are not written";
  EXPECT_EQ(f.bm.stats().free, 0u) << "the queued step may still read them";
  f.bm.end_on_host(*queued, e);
  for (int i = 0; i < 500 && f.bm.stats().free < 16; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_GE(f.bm.stats().free, 16u);
}

// Steps that each miss more than they are handed, several in flight before
// the manager takes their records (a runtime enqueues a token's layers back
// to back): the free frames kept ready follow what steps miss, not what they
// managed to admit, so admissions keep up with the misses. (Keeping them at
// four times the recent admissions let a shortage feed itself: on the GPU
// serving benchmark steps admitted 506 of 17,448 misses.)
TEST(BufferManager, FreeFramesFollowDemandWithStepsInFlight) {
  constexpr uint32_t kUnits = 4096, kInFlight = 8, kMiss = 100, kRounds = 60;  // 800 a round: under the quarter kept free
  Fixture f(kUnits);
  f.unit_map.assign(1 << 16, kNoFrame);  // units cycled through: 16x the cache
  auto t = f.tracker();
  uint32_t next = 0;
  uint64_t admitted_late = 0, missed_late = 0;
  for (uint32_t round = 0; round < kRounds; ++round) {
    std::vector<Fixture::Step> steps;
    for (uint32_t i = 0; i < kInFlight; ++i) steps.push_back(f.begin_step(*t, kMiss));
    for (const Fixture::Step &s : steps) {
      const uint32_t got = f.miss_fresh(s, kMiss, &next, 1 << 16);
      if (round >= kRounds / 2) {
        admitted_late += got;
        missed_late += kMiss;
      }
    }
    for (const Fixture::Step &s : steps) f.end_step(*t, s);
    ASSERT_TRUE(f.bm.quiesce(5000));
  }
  EXPECT_GE(admitted_late, missed_late * 9 / 10) << "admitted " << admitted_late << " of " << missed_late
                                                  << " misses over the last " << kRounds / 2 << " rounds";
}

// A runtime enqueues a token's layers back to back, and their steps end one
// by one, the manager taking each record as it ends. A frame it evicts then
// is free again only after the steps in flight, so a burst can admit into
// nothing but the frames ready when it began: the reserve must cover the
// burst's misses, not one step's. (Twice a pass's misses, the target before
// this test, covered two of four steps: the H100's serving benchmark
// admitted a quarter of its misses.) Steps' bounds (`want`) are four times
// what they miss, as a plan's bound is.
TEST(BufferManager, FreeFramesCoverABurstOfStepsEndingOneByOne) {
  constexpr uint32_t kUnits = 8192, kLayers = 4, kMiss = 300, kRounds = 40;  // 1200 a burst: under the quarter
  Fixture f(kUnits);
  f.unit_map.assign(1 << 17, kNoFrame);
  auto t = f.tracker();
  uint32_t next = 0;
  uint64_t admitted_late = 0, missed_late = 0;
  for (uint32_t round = 0; round < kRounds; ++round) {
    std::vector<Fixture::Step> steps;
    for (uint32_t i = 0; i < kLayers; ++i) steps.push_back(f.begin_step(*t, 4 * kMiss));
    for (size_t i = 0; i < steps.size(); ++i) {
      const Fixture::Step &s = steps[i];
      const uint32_t got = f.miss_fresh(s, kMiss, &next, 1 << 17);
      if (round >= kRounds / 2) {
        admitted_late += got;
        missed_late += kMiss;
      }
      f.end_step(*t, s);
      // The manager takes this step's record before the next step ends.
      // After the last one the next burst begins at once, as a runtime's
      // next token does, before the manager's pass frees what the steps of
      // this burst kept in quarantine.
      const uint64_t in_flight = steps.size() - 1 - i;
      if (in_flight == 0) break;
      // Taken once the manager has counted its misses. (Waiting for the
      // backlog to equal the steps in flight, as this test did, failed now
      // and then on a loaded machine: the backlog counts a manager's pass in
      // progress too, and a pass preempted again and again kept it one
      // above for seconds.)
      const uint64_t taken = (uint64_t{round} * kLayers + i + 1) * kMiss;
      for (int w = 0; w < 5000 && f.bm.stats().missed != taken; ++w)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ASSERT_EQ(f.bm.stats().missed, taken);
      ASSERT_GE(f.bm.stats().backlog, in_flight);
    }
  }
  EXPECT_GE(admitted_late, missed_late * 9 / 10) << "admitted " << admitted_late << " of " << missed_late
                                                  << " misses over the last " << kRounds / 2 << " bursts";
  ASSERT_TRUE(f.bm.quiesce(5000));
  const BufferManager::Stats st = f.bm.stats();
  EXPECT_EQ(st.missed, uint64_t{kRounds} * kLayers * kMiss);
}

// The pool's slots are a ring of twice the frames; a slot is written again
// only once every step that could have taken its last position has ended
// (the device reads the slot after taking the position). Frames come back
// while a step is in flight only from records opened before its own (they
// are taken in ring order), so only steps running beside it can make the
// pool go round: here two such steps take and give back frames (their
// swaps lose) while a later step holds position 0. The frames wait on the
// host rather than overwrite position 0's slot, and go in once it has ended.
TEST(BufferManager, APoolSlotIsRewrittenOnlyAfterItsTakerHasEnded) {
  Fixture f(4);  // slots for 8 positions; frames at positions 0 to 3
  const FramePool pool = f.bm.pool();
  ASSERT_EQ(pool.cap, 8u);
  auto t1 = f.tracker(), t2 = f.tracker(), ta = f.tracker();
  auto s1 = f.begin_step(*t1, 4), s2 = f.begin_step(*t2, 4), a = f.begin_step(*ta, 4);
  EXPECT_TRUE(f.run_step(a, {0}, {}, {0}).empty());  // takes position 0, maps nothing; stays in flight
  const uint32_t slot0 = pool.slots[0];
  auto taken_missed = [&](uint64_t missed) {
    for (int i = 0; i < 5000 && f.bm.stats().missed < missed; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return f.bm.stats().missed;
  };
  f.run_step(s1, {1, 2, 3}, {}, {1, 2, 3});  // positions 1 to 3, given back at 4 to 6
  f.end_step(*t1, s1);
  ASSERT_EQ(taken_missed(3), 3u);
  f.run_step(s2, {4, 5, 6}, {}, {4, 5, 6});  // positions 4 to 6, given back at 7 and (held) 8, 9
  f.end_step(*t2, s2);
  ASSERT_EQ(taken_missed(6), 6u);
  EXPECT_EQ(pool.slots[0], slot0) << "position 8 would reuse position 0's slot while its taker runs";
  EXPECT_EQ(f.bm.stats().free, 3u) << "the frames waiting for a slot count as free";
  f.end_step(*ta, a);
  ASSERT_TRUE(f.bm.quiesce(5000));
  for (int i = 0; i < 500 && f.bm.stats().free < 4; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(f.bm.stats().free, 4u);
  // Every frame can be taken again, each once.
  auto c = f.begin_step(*t1, 8);
  const auto frames = f.run_step(c, {10, 11, 12, 13, 14}, {});
  EXPECT_EQ(std::set<uint32_t>(frames.begin(), frames.end()), (std::set<uint32_t>{0, 1, 2, 3}));
  f.end_step(*t1, c);
}

// A token's layers miss unlike amounts, and which layer misses most moves
// from token to token (a sequence of the batch changes topic in one layer's
// retrieval before the others'). Every step of a token's burst is opened
// before any runs, as a runtime enqueues them. Steps take frames from one
// pool as they miss, so each admits what it misses while the reserve lasts,
// whichever layer it is. (Handed a list of frames when their record opened,
// sized by what the same layer missed at the token before, the layer that
// missed most admitted a few percent of its misses, and the frames handed
// to the others sat unused until their steps ended.)
TEST(BufferManager, StepsOfABurstTakeWhatTheyMissFromOnePool) {
  constexpr uint32_t kUnits = 65536, kLayers = 4, kWant = 4000, kRounds = 30, kBig = 3000, kSmall = 100;
  Fixture f(kUnits);
  f.unit_map.assign(1 << 17, kNoFrame);
  auto t = f.tracker();
  uint32_t next = 0;
  uint64_t admitted_big = 0, missed_big = 0, admitted_small = 0, missed_small = 0;
  for (uint32_t round = 0; round < kRounds; ++round) {
    std::vector<Fixture::Step> steps;
    for (uint32_t l = 0; l < kLayers; ++l) steps.push_back(f.begin_step(*t, kWant, 64, l + 1));
    for (uint32_t l = 0; l < kLayers; ++l) {
      const uint32_t miss = l == round % kLayers ? kBig : kSmall;
      const uint32_t got = f.miss_fresh(steps[l], miss, &next, 1 << 17);
      if (round >= kRounds / 2) {
        (miss == kBig ? admitted_big : admitted_small) += got;
        (miss == kBig ? missed_big : missed_small) += miss;
      }
      f.end_step(*t, steps[l]);
    }
    ASSERT_TRUE(f.bm.quiesce(5000));
  }
  std::printf("the layer that missed most admitted %llu of %llu misses, the others %llu of %llu\n",
              static_cast<unsigned long long>(admitted_big), static_cast<unsigned long long>(missed_big),
              static_cast<unsigned long long>(admitted_small), static_cast<unsigned long long>(missed_small));
  EXPECT_GE(admitted_big, missed_big * 95 / 100);
  EXPECT_GE(admitted_small, missed_small * 95 / 100);
  const BufferManager::Stats st = f.bm.stats();
  EXPECT_EQ(st.given, st.admissions) << "every frame taken was mapped";
}

// A change of topic after a run of quiet tokens: every layer of one token
// misses four times what the seven before it did, which together miss
// more than the reserve holds after a change. The reserve of free
// frames follows the peak of what a token's steps miss (decaying slowly),
// not the last token, so the change of topic finds frames for its misses.
// (Following the last token, it found a reserve sized for the quiet ones.)
TEST(BufferManager, AChangeOfTopicAfterQuietTokensFindsFramesReady) {
  constexpr uint32_t kUnits = 65536, kLayers = 4, kWant = 4000, kCycles = 12, kQuiet = 700, kTopic = 3000;
  Fixture f(kUnits);
  f.unit_map.assign(1 << 18, kNoFrame);
  auto t = f.tracker();
  uint32_t next = 0;
  uint64_t admitted = 0, missed = 0;
  for (uint32_t cycle = 0; cycle < kCycles; ++cycle) {
    for (uint32_t token = 0; token < 8; ++token) {
      const uint32_t miss = token == 7 ? kTopic : kQuiet;
      std::vector<Fixture::Step> steps;
      for (uint32_t l = 0; l < kLayers; ++l) steps.push_back(f.begin_step(*t, kWant, 64, l + 1));
      for (uint32_t l = 0; l < kLayers; ++l) {
        const uint32_t got = f.miss_fresh(steps[l], miss, &next, 1 << 18);
        if (cycle >= kCycles / 2 && miss == kTopic) {
          admitted += got;
          missed += miss;
        }
        f.end_step(*t, steps[l]);
      }
      ASSERT_TRUE(f.bm.quiesce(5000));
    }
  }
  std::printf("changes of topic admitted %llu of %llu misses\n", static_cast<unsigned long long>(admitted),
              static_cast<unsigned long long>(missed));
  EXPECT_GE(admitted, missed * 9 / 10);
}

// The replacement policies alone (lib/buffer/replacement.hpp): what each
// gives up first, and that none gives up a frame that is not resident.
namespace {

// Victims until none is left, each erased as the manager does.
std::vector<uint32_t> drain(ReplacementPolicy &p) {
  std::vector<uint32_t> out;
  for (int64_t v; (v = p.victim()) >= 0;) {
    out.push_back(static_cast<uint32_t>(v));
    p.on_erase(static_cast<uint32_t>(v));
  }
  return out;
}

}  // namespace

TEST(Replacement, EveryPolicyGivesUpEachResidentFrameOnceAndNoOther) {
  for (const char *name : {"lru", "clock", "slru"}) {
    SCOPED_TRACE(name);
    auto p = make_policy(name, 16);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(p->victim(), -1) << "nothing resident";
    for (uint32_t f = 0; f < 16; f += 2) p->on_insert(f);  // the even frames
    for (uint32_t f = 0; f < 16; f += 4) p->on_access(f);
    p->on_access(3);  // not resident: ignored
    p->on_erase(6);
    p->on_erase(5);  // not resident: ignored
    std::vector<uint32_t> got = drain(*p);
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, (std::vector<uint32_t>{0, 2, 4, 8, 10, 12, 14}));
    EXPECT_EQ(p->victim(), -1);
  }
  EXPECT_EQ(make_policy("fifo", 4), nullptr);
}

// LRU's promotion threshold: a frame read once it may have reached the
// queue's last quarter (more moves to the front since its own than three
// quarters of the resident frames) moves to the front; one read nearer the
// front keeps its place. Positions count moves and wrap at 2^32: the same
// from a start just below the wrap.
TEST(Replacement, LruMovesAFrameReadInItsLastQuarterToTheFront) {
  for (uint32_t first : {0u, 0xfffffffau}) {
    SCOPED_TRACE(first);
    LruPolicy p(8, first);
    for (uint32_t f = 0; f < 8; ++f) p.on_insert(f);  // 0 is the least recent
    p.on_access(0);  // 8 moves since its own: moves
    p.on_access(1);  // 8 (7 and 0's): moves
    p.on_access(5);  // 4 since: stays
    EXPECT_EQ(drain(p), (std::vector<uint32_t>{2, 3, 4, 5, 6, 7, 0, 1}));
  }
}

// A frame read every few admissions is never given up while new frames
// stream through the cache and push the others out, as with exact LRU;
// each victim is the frame admitted longest ago among those not read.
// Across the positions' wrap and the ring's compactions.
TEST(Replacement, LruKeepsAFrameReadOftenWhileNewFramesStreamThrough) {
  constexpr uint32_t kFrames = 128, kResident = 100;
  for (uint32_t first : {0u, 0xffffff00u}) {
    SCOPED_TRACE(first);
    LruPolicy p(kFrames, first);
    std::deque<uint32_t> order;  // admissions of frames other than `hot`, oldest first
    for (uint32_t f = 0; f < kResident; ++f) {
      p.on_insert(f);
      if (f != 0) order.push_back(f);
    }
    const uint32_t hot = 0;  // the least recent until read
    p.on_access(hot);
    std::vector<uint32_t> free_frames;
    for (uint32_t f = kResident; f < kFrames; ++f) free_frames.push_back(f);
    for (int i = 1; i <= 5000; ++i) {
      if (i % 10 == 0) p.on_access(hot);
      // One new frame in, the victim out.
      const uint32_t in = free_frames.back();
      free_frames.pop_back();
      p.on_insert(in);
      order.push_back(in);
      const int64_t v = p.victim();
      ASSERT_GE(v, 0);
      ASSERT_NE(static_cast<uint32_t>(v), hot) << "after " << i << " admissions";
      ASSERT_EQ(static_cast<uint32_t>(v), order.front()) << "after " << i << " admissions";
      order.pop_front();
      p.on_erase(static_cast<uint32_t>(v));
      free_frames.push_back(static_cast<uint32_t>(v));
    }
  }
}

// LRU against a model of its rule with 64-bit counts (no wrap, no ring):
// a read frame moves to the front once more moves than three quarters of
// the resident frames have happened since its own, and the victim is the
// frame that moved to the front longest ago. Random admissions, reads and
// evictions of a small cache, many moves without an eviction (the ring
// fills with skipped entries and is compacted) and the wrap of the 32-bit
// counts: the same victims throughout.
TEST(Replacement, LruFollowsItsRuleThroughCompactionsAndTheWrap) {
  constexpr uint32_t kFrames = 96;
  for (uint32_t first : {0u, 0xfffff000u}) {
    SCOPED_TRACE(first);
    LruPolicy p(kFrames, first);
    std::vector<uint64_t> stamp(kFrames, 0), order(kFrames, 0);
    std::vector<bool> resident(kFrames, false);
    uint64_t moves = first, seq = 0;
    uint32_t n_resident = 0;
    auto move = [&](uint32_t f) {
      if (static_cast<uint32_t>(moves) == 0xffffffffu) ++moves;  // the policy's count skips its marker
      stamp[f] = moves++;
      order[f] = seq++;
    };
    std::mt19937 rng(first + 1);
    for (int op = 0; op < 20000; ++op) {
      const uint32_t f = rng() % kFrames;
      // A stretch of reads alone: moves without an eviction.
      const uint32_t kind = op >= 5000 && op < 9000 ? 0 : rng() % 20;
      if (kind < 10) {  // a read
        p.on_access(f);
        if (resident[f] && moves - stamp[f] > n_resident / 4 * 3) move(f);
      } else if (kind < 17) {  // admissions outnumber evictions: about 55 frames resident
        p.on_insert(f);
        if (!resident[f]) ++n_resident;
        resident[f] = true;
        move(f);
      } else {
        int64_t want = -1;
        for (uint32_t g = 0; g < kFrames; ++g)
          if (resident[g] && (want < 0 || order[g] < order[want])) want = g;
        ASSERT_EQ(p.victim(), want) << "operation " << op;
        if (want >= 0) {
          p.on_erase(static_cast<uint32_t>(want));
          resident[want] = false;
          --n_resident;
        }
      }
    }
  }
}

// A record's hits go to the policy in one call (on_access_all, which LRU
// serves with its links fetched ahead): the same order of victims as one
// call a hit, frames that are not resident (evicted meanwhile) and frames
// past the cache ignored.
TEST(Replacement, AStepsHitsInOneCallLeaveTheSameOrder) {
  constexpr uint32_t kFrames = 4096;
  for (const char *name : {"lru", "clock", "slru"}) {
    SCOPED_TRACE(name);
    auto one = make_policy(name, kFrames), all = make_policy(name, kFrames);
    for (uint32_t f = 0; f < kFrames; f += 2) {  // odd frames never resident
      one->on_insert(f);
      all->on_insert(f);
    }
    uint64_t x = 88172645463325252ull;
    std::vector<uint32_t> hits;
    for (int record = 0; record < 20; ++record) {
      hits.clear();
      for (int i = 0; i < 700; ++i) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift
        hits.push_back(static_cast<uint32_t>(x % kFrames));
      }
      for (uint32_t h : hits) one->on_access(h);
      if (std::string(name) == "lru") hits.push_back(kFrames + 5);  // past the cache: LRU checks itself
      all->on_access_all(hits.data(), hits.size());
    }
    EXPECT_EQ(drain(*one), drain(*all));
  }
}

TEST(Replacement, ClockKeepsFramesReadOftenThroughASweep) {
  auto p = make_policy("clock", 8);
  for (uint32_t f = 0; f < 8; ++f) p->on_insert(f);
  for (int i = 0; i < 3; ++i) p->on_access(5);  // count 3: four sweeps to go
  p->on_access(2);                              // count 2
  const std::vector<uint32_t> got = drain(*p);
  ASSERT_EQ(got.size(), 8u);
  EXPECT_EQ(got[6], 2u);
  EXPECT_EQ(got[7], 5u);
}

TEST(Replacement, SlruKeepsFramesReadAgainThroughABurstOfNewOnes) {
  // Frames 0..3 read twice (protected), then a burst of 12 frames read once:
  // victims come from the burst; the protected frames go last.
  auto p = make_policy("slru", 16);
  for (uint32_t f = 0; f < 4; ++f) p->on_insert(f);
  for (uint32_t f = 0; f < 4; ++f) p->on_access(f);
  for (uint32_t f = 4; f < 16; ++f) p->on_insert(f);
  const std::vector<uint32_t> got = drain(*p);
  ASSERT_EQ(got.size(), 16u);
  for (size_t i = 0; i < 12; ++i) EXPECT_GE(got[i], 4u) << i;
  // LRU would have given up 0..3 first.
  auto lru = make_policy("lru", 16);
  for (uint32_t f = 0; f < 4; ++f) lru->on_insert(f);
  for (uint32_t f = 0; f < 4; ++f) lru->on_access(f);
  for (uint32_t f = 4; f < 16; ++f) lru->on_insert(f);
  EXPECT_EQ(drain(*lru).front(), 0u);
}

TEST(Replacement, SlruProtectsAtMostItsShare) {
  // Every frame read twice: the protected list holds 80% (12 of 16); the
  // oldest go back to probation and are given up first.
  auto p = make_policy("slru", 16);
  for (uint32_t f = 0; f < 16; ++f) p->on_insert(f);
  for (uint32_t f = 0; f < 16; ++f) p->on_access(f);
  const std::vector<uint32_t> got = drain(*p);
  ASSERT_EQ(got.size(), 16u);
  EXPECT_EQ(std::set<uint32_t>(got.begin(), got.begin() + 4), (std::set<uint32_t>{0, 1, 2, 3}));
}
