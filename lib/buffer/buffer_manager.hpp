// The buffer manager: frames, pins and epochs.
//
// Frames are the device block cache's units (lib/index/head.hpp: page_tokens
// members of one cluster, laid out like a page) and the host pages a step
// reads. A step pins every frame it may read from the moment it takes its
// epoch until its kernels have ended; nothing is freed, reused or moved while
// a step that could read it is in flight.
//
// Epochs. One 64-bit counter for the engine. Every verb that enqueues work
// reading engine memory (lookup, assemble, attend, merge, an append) takes a
// fresh epoch in its owner's StepTracker (a plan's, or a sequence's for its
// appends), and its last kernel writes that epoch into the tracker's done
// word when it ends (the CPU backend writes it on return). A tracker whose
// done word is behind its issued epoch has a step in flight; the oldest
// epoch in flight is the least done + 1 over such trackers. A step ends
// when its kernels end, whatever happens to its plan: destroyed, abandoned
// between lookup and update, or never updated, nothing stays pinned.
//
// Quarantine. A frame given up at epoch S (a destroyed sequence's pages and
// device arrays, a frame mapped in a head that is gone) is released only
// once the oldest epoch in flight is past S: every step that could have
// seen it has ended (a frame of a head that is gone is evicted so too: its
// entry is not cleared). A cache unit of a live head evicted by the manager
// waits for fewer steps: only a gather finds frames, and it finds a frame
// only through its unit map entry (a decode that attends from frames reads
// the frames its gather found, or took, later in the same step, which has
// not ended before its attention has). Every gather CTA writes its step's
// epoch into its tracker's reading word (fenced, at system scope) before it
// reads an entry; the manager clears the victims' entries, waits for the
// stores, then reads the reading words. A step whose mark it does not see
// reads the cleared entries (the two sides' fences: one of them sees the
// other's write), so the frames wait only for the steps it sees reading:
// each batch keeps, for every tracker then seen reading (its reading word
// past its done word), the epoch it was reading, and is released once each
// of those trackers' done words has reached it. A token's burst of layers,
// enqueued back to back, thus reuses within the burst what the manager
// evicted after its first steps ended, rather than only at the next token.
// (Options::reader_quarantine false: every step begun so far, as before.)
//
// The device cache (CUDA engines). Free frames sit in one pool for every
// step (kernels/device_layout.hpp, FramePool: a ring of frame ids in device
// memory that the host fills from its copy and publishes, and device counts
// that gathers advance). A step's assemble opens an access record in a ring
// of pinned, mapped host memory, allocated at open; its gather kernel
// takes a frame from the pool for each unit it misses, copies the unit into
// it as it lays it out in the execution buffer (a miss crosses PCIe once),
// maps it in the head's unit map with a compare-and-swap, and logs the
// admission and every unit it found in the cache. A step takes what it
// misses, while the pool lasts: nothing is set aside for a step that would
// then sit unused while the steps after it, in the same burst, miss.
// (Each step used to be handed a list of frames when its record opened,
// sized by what its layer missed last, copied under the lock and back only
// when the step ended; bench/RESULTS.md, "one pool of free frames".) The
// manager's thread takes records once their step has ended:
// hits refresh recency, admissions become resident frames, frames taken but
// not mapped go back to the pool. It keeps a reserve of free frames by
// evicting the policy's victims: clear the unit map entries (a kernel on
// its own stream, which it waits for), quarantine, then back to the pool.
// When the ring is full, a step gets no record: it admits nothing and its
// hits refresh nothing (recency is a hint; the decoding path never blocks
// or allocates for it). Dropping an older record instead would lose the
// units its step admitted.
//
// Lock order: mu_ is a leaf. The manager thread holds it only to move
// records, free units and deferred releases between queues, never across a
// device wait; the decoding path holds it for a few instructions per step.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/device_layout.hpp"
#include "lib/buffer/replacement.hpp"
#include "lib/common/status.hpp"

namespace wkv {

class BufferManager;

// The steps in flight of one owner (a plan, or a sequence's appends).
class StepTracker {
 public:
  // Where a kernel writes the epoch of its step when it ends (device address
  // of a mapped host word on a CUDA engine, a host address otherwise).
  uint64_t *done_device() const { return done_dev_; }
  // The epoch of the last step begun (0: none).
  uint64_t issued() const { return issued_.load(std::memory_order_acquire); }
  // The epoch of the last step ended.
  // (The word is written by a kernel, or by the host on a CPU engine: atomic
  // loads and stores on the host side.)
  uint64_t done() const { return __atomic_load_n(done_, __ATOMIC_ACQUIRE); }
  // Where a gather writes the epoch of its step before it reads a unit map
  // entry (the word after the done word), and the last epoch written there.
  uint64_t *reading_device() const { return done_dev_ + 1; }
  uint64_t reading() const { return __atomic_load_n(done_ + 1, __ATOMIC_ACQUIRE); }

 private:
  friend class BufferManager;
  static constexpr uint64_t kTaking = ~uint64_t{0};  // taking an epoch now
  std::atomic<uint64_t> issued_{0};
  uint64_t *done_ = nullptr;  // and the reading word after it
  uint64_t *done_dev_ = nullptr;
  uint32_t records_ = 0;  // records in the ring that name it (guarded by the manager's mu_)
  // Per record key: what the last record taken with that key missed, plus
  // one (0: none yet; missed_of decodes). Guarded by the manager's mu_.
  std::vector<uint32_t> missed_by_key_;
  static uint32_t missed_of(uint32_t entry) { return entry ? entry - 1 : 0; }
};

// One access record of a step, in the ring (pinned, mapped host memory).
// The host fills the header and `heads` before the step's gather is
// enqueued; the gather writes the rest; the manager reads it after the step.
//
//   RecordHeader
//   uint32_t   hits[hit_cap]       units it read from the cache
//   AdmitEntry admits[admit_cap]   what it did with its i-th miss, i < used
//   uint64_t   heads[n_runs]       the run's head: cache id << 32 | generation
struct RecordHeader {
  uint64_t epoch;
  const StepTracker *tracker;
  uint32_t admit_cap, hit_cap, n_runs;
  uint32_t used;    // written by the device: admission entries (<= admit_cap)
  uint32_t hits;    // written by the device, right after used: hit log entries (<= hit_cap)
  uint32_t missed;  // written by the device, right after hits: units missed (what it could admit)
  uint32_t bytes;   // the record's size in the ring
  uint32_t key;     // which of its tracker's kinds of step (a layer + 1; 0: none)
  uint32_t pad[4];
};
static_assert(sizeof(RecordHeader) == 64, "RecordHeader is one 64-byte line");
static_assert(offsetof(RecordHeader, hits) == offsetof(RecordHeader, used) + 4 &&
                  offsetof(RecordHeader, missed) == offsetof(RecordHeader, used) + 8,
              "the gather writes used, hits, missed");

// What a gather did with a miss (kernels/device_layout.hpp).
using kernels::AdmitEntry;
using kernels::FramePool;
static_assert(sizeof(AdmitEntry) == 16, "AdmitEntry is 16 bytes");

// A record as the step's kernels see it (device addresses of mapped memory).
struct StepRecord {
  RecordHeader *header = nullptr;  // nullptr: no record (nothing admitted or logged)
  uint32_t *hits = nullptr;
  AdmitEntry *admits = nullptr;
  uint64_t *heads = nullptr;
  uint32_t admit_cap = 0, hit_cap = 0;
};

class BufferManager {
 public:
  // What the backend does for the manager.
  class Device {
   public:
    virtual ~Device() = default;
    // n 8-byte words that the device writes and the host reads (pinned,
    // mapped on CUDA), zeroed; *dev their device address. Freed at close.
    virtual Status alloc_words(size_t n, uint64_t **host, uint64_t **dev) = 0;
    // Ring memory for the access records (pinned, mapped on CUDA); *dev its
    // device address. Freed at close.
    virtual Status alloc_ring(size_t bytes, uint8_t **host, uint8_t **dev) = 0;
    // `bytes` of zeroed device memory (the pool's slots and counts). Freed
    // at close.
    virtual Status alloc_device(size_t bytes, void **dev) = 0;
    // Publishes n frames to the pool: copies host_slots[i % cap] to
    // dev_slots[i % cap] for i in [first, first + n), then adds n to
    // *avail, in that order, with work enqueued now (no wait). host_slots
    // is alloc_ring memory and host_slots_dev its device address. Calls are
    // serialized by the caller.
    virtual Status publish_frames(const uint32_t *host_slots, const uint32_t *host_slots_dev, uint32_t *dev_slots,
                                  uint64_t first, uint64_t n, uint32_t cap, uint64_t *avail) = 0;
    // Stores kNoFrame at n unit map entries (device addresses) and waits for
    // the stores: afterwards no step that begins reads those frames.
    virtual Status clear_entries(const uint64_t *entries, uint32_t n) = 0;
  };

  struct Options {
    uint32_t units = 0;         // device cache frames (0: no cache)
    size_t ring_bytes = 32u << 20;
    uint32_t max_admits = 16384;  // units one step admits at most
    std::string policy = "lru";  // the replacement policy (make_policy)
    // An evicted frame waits for the steps seen reading when its entry was
    // cleared (true), or for every step begun by then (false).
    bool reader_quarantine = true;
    // The reserve of free frames (evict): what the steps that may take
    // frames before an eviction's frames are free would miss (kReaders,
    // with reader_quarantine: a few steps), or what a whole burst of steps
    // would (kBurst: every layer of a token, as step quarantine needs).
    enum class Reserve { kReaders, kBurst };
    Reserve reserve = Reserve::kReaders;
  };

  struct Stats {
    uint64_t admissions = 0, evictions = 0;
    uint64_t missed = 0, given = 0;  // units the records' steps missed; frames they took from the pool
    uint64_t lost = 0;             // frames withheld after a failed unit map store
    uint64_t backlog = 0;          // records not yet taken
    uint64_t dropped_records = 0;  // steps that got no record (ring full)
    uint64_t resident = 0, free = 0, quarantined = 0;
    // The manager's thread: passes that took a record or evicted, the
    // records it took, its time in them (steady clock), of which taking
    // records, choosing victims (the policy's, and their owners), clearing
    // entries (the device's stores and the wait for them), releasing
    // quarantined frames and publishing frees; the reserve it last aimed
    // for. A busy time near the wall time says the manager falls behind
    // the steps.
    uint64_t passes = 0, records_taken = 0;
    uint64_t busy_ns = 0, take_ns = 0, victims_ns = 0, clear_ns = 0, release_ns = 0, publish_ns = 0;
    uint64_t reserve_target = 0;
    // Records opened that released quarantined frames and published the
    // pool on the decoding thread (open_record, when the pool was below the
    // step's bound): host time of a step spent on the manager's work.
    uint64_t step_releases = 0;
  };

  BufferManager(Options opts, Device *device);
  ~BufferManager();
  BufferManager(const BufferManager &) = delete;
  BufferManager &operator=(const BufferManager &) = delete;

  // Allocates the ring and starts the manager's thread.
  Status start();

  // A tracker for a new plan or sequence. Kept by the manager until its
  // owner has dropped it and its last step has ended.
  Status new_tracker(std::shared_ptr<StepTracker> *out);
  // Takes an epoch for a step of `t` about to be enqueued.
  uint64_t begin(StepTracker &t);
  // The step of `t` at `epoch` ended on the host (the CPU backend's verbs).
  void end_on_host(StepTracker &t, uint64_t epoch) { __atomic_store_n(t.done_, epoch, __ATOMIC_RELEASE); }
  // The step of `t` at `epoch` is about to read unit map entries, written
  // from the host as a gather writes it (tests that play the device).
  static void reading_on_host(StepTracker &t, uint64_t epoch) {
    __atomic_store_n(t.done_ + 1, epoch, __ATOMIC_SEQ_CST);
  }
  // Waits until every step of `t` begun so far has ended: its done word has
  // caught up with its last epoch. For reading an owner's memory from the
  // host without knowing the streams its work went to (a sequence saved to
  // a file after appends on the caller's streams). Polls, backing off to
  // 100 us sleeps; no device synchronization. Pre: no step of `t` begins
  // meanwhile.
  static void wait_idle(const StepTracker &t);

  // Runs `release` once every step begun so far has ended, on the manager's
  // thread (or at once when none is in flight). For frames given up: a
  // destroyed sequence's pages and device arrays, a plan's buffers.
  void defer(std::function<void()> release);

  // The device cache ------------------------------------------------------
  uint32_t units() const { return opts_.units; }
  // An id for a head whose unit map the cache may store into; released by
  // head_destroyed. *gen tells a reused id's incarnations apart.
  uint32_t head_created(uint32_t *gen);
  void head_destroyed(uint32_t id);

  // Opens the access record of a step of `t` at `epoch` over n_runs runs
  // (heads[r] of each), with room to admit up to `want` units (at most
  // max_admits) and to log `hit_cap` hits. An empty record when the ring
  // is full. `key` (at most kMaxRecordKey; 0: none) names the kind of step,
  // a layer + 1 for a decoding step: the reserve of free frames covers what
  // the next step of every key would miss, were it to miss what the last
  // one did.
  static constexpr uint32_t kMaxRecordKey = 4096;
  StepRecord open_record(StepTracker &t, uint64_t epoch, const uint64_t *heads, uint32_t n_runs,
                         uint32_t want, uint32_t hit_cap, uint32_t key = 0);

  Stats stats();
  // The pool of free frames as the device sees it (cap 0 without a cache).
  FramePool pool() const { return pool_dev_; }

  // Waits (up to `timeout_ms`) until every record of an ended step has been
  // taken and every release that can run has run. For tests and stats.
  bool quiesce(int timeout_ms);
  // The last epoch taken; moves the counter on to `epoch` (tests of
  // epochs past 2^32).
  uint64_t epoch() const { return epoch_.load(); }
  void advance_epoch(uint64_t epoch) { epoch_.store(std::max(epoch_.load(), epoch)); }

 private:
  struct Owner {  // a resident frame's head and unit map entry
    uint32_t head = 0, gen = 0;
    uint64_t entry = 0;
  };
  struct Pending {  // a release waiting for the steps in flight
    uint64_t stamp;
    std::function<void()> release;
  };
  struct Quarantined {  // frames given up together, waiting for the steps in flight
    uint64_t stamp;
    std::vector<uint32_t> units;
  };
  struct HeadSlot {
    uint32_t gen = 0;
    bool alive = false;
  };

  void run();
  // Pre: mu_ held. The oldest epoch in flight (or the next one if none);
  // forgets trackers whose owners are gone and whose steps have ended.
  uint64_t oldest_in_flight(std::unique_lock<std::mutex> &held);
  // The device address of a done word. Pre: mu_ held.
  uint64_t *device_word(uint64_t *host) const;
  // Takes the ended records at the ring's tail; how many. Pre: mu_ not
  // held.
  size_t take_records();
  // Applies one record: recency, admissions, and what its step missed.
  void take_record(const RecordHeader &h);
  // Evicts until the reserve is met; whether it evicted. Pre: mu_ not
  // held.
  bool evict();
  // Runs releases whose steps have ended. Pre: mu_ not held.
  bool release_ready();
  // Frees the quarantined frames stamped before `oldest` (the oldest epoch
  // in flight) and the evicted batches whose readers have ended, a batch
  // at a time: the decoding path calls it (open_record), so its cost is a
  // few copies, not a loop over frames. Pre: mu_ held.
  void release_quarantined(uint64_t oldest);
  // A step seen reading unit map entries and not yet ended: its tracker
  // (held until the batch is freed) and its epoch.
  struct Reader {
    std::shared_ptr<StepTracker> tracker;
    uint64_t epoch;
  };
  // The steps seen reading now, one a tracker (the newest: a tracker's
  // steps end in order), appended to *out where set; how many. Pre: mu_
  // held.
  size_t steps_reading(std::vector<Reader> *out) const;
  // Queues a batch of frames given up now, released once the oldest epoch
  // in flight is past the epoch counter as it is now (every step begun so
  // far). Pre: mu_ held.
  void quarantine(std::vector<uint32_t> &&units);
  // Queues a batch of evicted frames whose entries are cleared, released
  // once each of `readers` (steps_reading() after the clear) has ended.
  // Pre: mu_ held.
  void quarantine_evicted(std::vector<uint32_t> &&units, std::vector<Reader> &&readers);
  // Writes frames into the pool's next slots (or holds them while their
  // slots may still be read) for publish(), in at most two copies. Pre:
  // mu_ held.
  void put_free(const uint32_t *units, size_t n);
  // Writes the first of n frames into the pool's free slots, as many as
  // have one (at most two copies); returns how many. Pre: mu_ held.
  size_t fill_slots(const uint32_t *units, size_t n);
  // Publishes the frames written since the last call to the device. The
  // decoding path leaves it to the manager's thread when that is
  // publishing (`wait` false). Pre: mu_ not held.
  void publish(bool wait = true);
  // Moves the pool's read mark on (positions whose takers have ended) and
  // writes held frames that now have room. Pre: mu_ held; `oldest` the
  // oldest epoch in flight.
  void advance_pool(uint64_t oldest);
  // Frames in the pool not yet taken, as far as the host knows (steps in
  // flight may have taken more), and frames held. Pre: mu_ held.
  size_t pool_free() const;

  Options opts_;
  Device *dev_;
  std::atomic<uint64_t> epoch_{0};

  std::mutex mu_;  // guards everything below up to the manager's own state
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<std::shared_ptr<StepTracker>> trackers_;
  std::vector<uint64_t *> free_words_;  // done words of dropped trackers
  std::vector<std::pair<uint64_t *, uint64_t *>> slab_offsets_;  // word slabs: host, device
  std::vector<Pending> pending_;
  bool clearing_ = false;  // the manager's thread is storing into unit maps (evict)
  // The pool (FramePool): 2 x units slots on the device (and their host
  // copy), its counts on the device. `produced_` positions written so far,
  // `published_` of them copied and counted on the device; `taken_known_` the frames
  // that taken records took, `pool_seen_` the positions taken as the last
  // gather to end saw them. A slot is written again only when its last
  // position is below `read_mark_`: positions whose takers have ended,
  // known from checkpoints (the seen count, and the epoch then) once the
  // steps in flight at the checkpoint have ended. Frames without a slot
  // wait in `held_`.
  struct PoolCheckpoint {
    uint64_t stamp, seen;
  };
  FramePool pool_dev_;
  uint32_t *pool_slots_ = nullptr;  // host copy of the slots (pinned), written under mu_
  const uint32_t *pool_slots_dev_ = nullptr;  // its device address (mapped)
  uint64_t *pool_seen_ = nullptr;
  uint64_t produced_ = 0, published_ = 0, taken_known_ = 0, read_mark_ = 0;
  std::mutex publish_mu_;  // serializes publish(): ranges reach the device in order (before mu_)
  std::deque<PoolCheckpoint> checkpoints_;
  std::vector<uint32_t> held_;
  std::deque<Quarantined> quarantine_;  // frames given up, until the steps begun by then end (stamps in order)
  struct Evicted {  // frames evicted together, waiting for the steps seen reading at their clear
    std::vector<Reader> readers;
    std::vector<uint32_t> units;
  };
  std::deque<Evicted> evicted_;
  std::vector<HeadSlot> heads_;  // [0] unused
  std::vector<uint32_t> free_heads_;
  uint8_t *ring_ = nullptr, *ring_dev_ = nullptr;
  size_t ring_head_ = 0, ring_tail_ = 0;  // bytes, head = next write
  std::deque<RecordHeader *> open_;       // records in ring order
  uint64_t dropped_ = 0;
  std::atomic<uint64_t> admissions_{0}, evictions_{0}, lost_{0}, resident_{0}, quarantined_{0};
  std::atomic<uint64_t> missed_{0}, given_{0};

  // The manager thread's own state (no lock).
  std::unique_ptr<ReplacementPolicy> policy_;
  std::vector<Owner> owner_;  // [units]
  std::vector<uint8_t> scratch_live_;  // take_record: whether each run's head is live
  std::vector<uint32_t> scratch_free_, scratch_quarantine_;  // take_record: frames taken back
  std::vector<uint32_t> scratch_hits_;                        // take_record: the hits in the cache
  std::vector<uint32_t> scratch_admitted_;                    // take_record: frames that became resident
  std::vector<Owner> scratch_owners_;                         // evict: the victims' owners
  std::vector<uint64_t> scratch_entries_;                     // evict: the live victims' unit map entries
  std::vector<uint32_t> scratch_ids_;                         // evict: the victims' heads, distinct
  // evict: heads' states as read at the last clear (by id; read under the
  // lock for the victims' heads only), and which ids a pass has read
  // (marked with mark_).
  std::vector<HeadSlot> head_state_;
  std::vector<uint32_t> head_mark_;
  uint32_t mark_ = 0;
  // What steps miss, and how many begin before the manager can act on it.
  // A frame evicted while steps are in flight is free again only once they
  // have ended, so the frames ready when a burst of steps begins (a token's
  // layers, enqueued back to back) are all that burst can admit into: the
  // eviction keeps ready the misses of a record (recent records' mean)
  // times the records open at once (the peak since the manager's last pass,
  // or seven eighths of the figure before if larger: a burst's peak is seen
  // at its first record's take, when the eviction for the next burst
  // begins), with half as much again for the spread between steps, at most
  // a quarter of the cache.
  double record_missed_ = 0;
  // What the next step of every key of every live tracker would miss, were
  // it to miss what the last one did: the sum of the trackers'
  // missed_by_key_ (a runtime's next token; guarded by mu_). The reserve
  // covers it too.
  uint64_t keyed_missed_ = 0;
  // Its peak, decaying by half a percent a keyed record taken (about 35
  // tokens of four layers to halve): the reserve covers a change of topic
  // (a token that misses several times what the tokens before it did)
  // rather than the token before. (Following the last token alone, the
  // tokens after a run of quiet ones found a reserve sized for those and
  // admitted a fifth of their misses; with the peak, hit ratio 0.67 ->
  // 0.75 at batch 1 and 0.58-0.60 -> 0.63-0.66 at batch 7 on the H100.)
  double keyed_peak_ = 0;
  // With reader quarantine (Reserve::kReaders), frames evicted once a step
  // has ended are free again when the steps then reading have ended, not
  // the burst: the reserve covers the steps that may take frames
  // meanwhile: those running beside each other (the steps seen reading at
  // an eviction, or the records taken in one pass, steps that ended
  // between two passes; each a peak decaying by an eighth a pass that saw
  // some) and two more (the one reaching its gather as the eviction runs,
  // and the next), each missing what the most missing record did (a peak
  // decaying as keyed_peak_ does: a change of topic's first step), a
  // quarter more. A 32-layer model's burst would otherwise keep a quarter
  // of the cache free for a token's misses.
  double record_peak_ = 0;
  double readers_peak_ = 0, ended_peak_ = 0;
  double open_records_ = 1;
  size_t open_peak_ = 0;  // records open at once since the last pass (guarded by mu_)
  std::thread thread_;
  std::atomic<bool> busy_{false};
  // Stats: the manager's passes and time (written by its thread).
  std::atomic<uint64_t> passes_{0}, records_taken_{0}, busy_ns_{0}, take_ns_{0}, victims_ns_{0}, clear_ns_{0},
      release_ns_{0}, publish_ns_{0};
  std::atomic<uint64_t> reserve_target_{0};
  std::atomic<uint64_t> step_releases_{0};
};

}  // namespace wkv
