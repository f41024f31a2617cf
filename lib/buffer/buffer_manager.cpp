#include "lib/buffer/buffer_manager.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "lib/index/head.hpp"
#include "lib/common/thread_name.hpp"

namespace wkv {
namespace {

constexpr size_t kWordsPerSlab = 4096;
constexpr size_t kRecordAlign = 64;

using Clock = std::chrono::steady_clock;
uint64_t ns_between(Clock::time_point a, Clock::time_point b) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count());
}

size_t record_bytes(uint32_t admit_cap, uint32_t hit_cap, uint32_t n_runs) {
  size_t b = sizeof(RecordHeader) + 4ull * hit_cap;
  b = (b + 15) & ~size_t{15};
  b += sizeof(AdmitEntry) * admit_cap + 8ull * n_runs;
  return (b + kRecordAlign - 1) & ~(kRecordAlign - 1);
}

// The arrays of a record at h (host addresses).
struct RecordArrays {
  uint32_t *hits;
  AdmitEntry *admits;
  uint64_t *heads;
};
RecordArrays arrays_of(RecordHeader *h) {
  RecordArrays a;
  a.hits = reinterpret_cast<uint32_t *>(reinterpret_cast<uint8_t *>(h) + sizeof(RecordHeader));
  size_t off = (sizeof(RecordHeader) + 4ull * h->hit_cap + 15) & ~size_t{15};
  a.admits = reinterpret_cast<AdmitEntry *>(reinterpret_cast<uint8_t *>(h) + off);
  a.heads = reinterpret_cast<uint64_t *>(a.admits + h->admit_cap);
  return a;
}

}  // namespace

BufferManager::BufferManager(Options opts, Device *device) : opts_(opts), dev_(device) {
  heads_.resize(1);
  if (opts_.units > 0) {
    policy_ = make_policy(opts_.policy, opts_.units);
    if (!policy_) policy_ = std::make_unique<LruPolicy>(opts_.units);  // Engine::open checks the name
    owner_.resize(opts_.units);
    held_.reserve(opts_.units);  // every frame at most once: no allocation under the lock
    scratch_hits_.reserve(16384);  // a record's hit log at most (CudaBackend::open_step_record)
    // A record's admissions at most, and an eviction's victims at most
    // (the reserve's cap): the manager's thread allocates nothing for them.
    scratch_admitted_.reserve(opts_.max_admits);
    const size_t most_victims = opts_.units / 4 + 32;
    scratch_owners_.reserve(most_victims);
    scratch_entries_.reserve(most_victims);
    scratch_ids_.reserve(most_victims);
  }
}

Status BufferManager::start() {
  if (opts_.units > 0) {
    WKV_RETURN_IF_ERROR(dev_->alloc_ring(opts_.ring_bytes, &ring_, &ring_dev_));
    // The pool: its slots (two per frame: a slot is rewritten only once
    // its last taker has ended, and up to a cache of frames may be taken
    // meanwhile) on the device, their host copy and the seen word in one
    // block of pinned, mapped memory; its counts on the device.
    const uint64_t cap = 2ull * opts_.units;
    if (cap > UINT32_MAX) return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "too many device cache frames");
    const size_t slot_bytes = (4 * cap + 63) & ~size_t{63};
    uint8_t *host = nullptr, *dev = nullptr;
    WKV_RETURN_IF_ERROR(dev_->alloc_ring(slot_bytes + 64, &host, &dev));
    void *slots = nullptr, *counts = nullptr;
    WKV_RETURN_IF_ERROR(dev_->alloc_device(4 * cap, &slots));
    WKV_RETURN_IF_ERROR(dev_->alloc_device(2 * sizeof(uint64_t), &counts));
    pool_slots_ = reinterpret_cast<uint32_t *>(host);
    pool_slots_dev_ = reinterpret_cast<const uint32_t *>(dev);
    pool_seen_ = reinterpret_cast<uint64_t *>(host + slot_bytes);
    pool_dev_.slots = static_cast<const uint32_t *>(slots);
    pool_dev_.seen = reinterpret_cast<unsigned long long *>(dev + slot_bytes);
    pool_dev_.avail = static_cast<unsigned long long *>(counts);
    pool_dev_.taken = pool_dev_.avail + 1;
    pool_dev_.cap = static_cast<uint32_t>(cap);
    std::vector<uint32_t> all(opts_.units);
    for (uint32_t u = 0; u < opts_.units; ++u) all[u] = opts_.units - 1 - u;
    {
      std::lock_guard<std::mutex> lock(mu_);
      put_free(all.data(), all.size());
    }
    publish();
  }
  thread_ = std::thread([this] { run(); });
  name_thread(thread_, "wkv-buffers");
  return Status::ok();
}

BufferManager::~BufferManager() {
  // Steps may still run on the device (a caller that closes without waiting
  // for its streams): their memory goes only once they have ended.
  for (int i = 0; i < 200000; ++i) {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t next = epoch_.load() + 1;
    if (oldest_in_flight(lock) == next) break;
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (Pending &p : pending_) p.release();
  pending_.clear();
}

Status BufferManager::new_tracker(std::shared_ptr<StepTracker> *out) {
  auto t = std::make_shared<StepTracker>();
  std::lock_guard<std::mutex> lock(mu_);
  if (free_words_.empty()) {
    uint64_t *host = nullptr, *dev = nullptr;
    WKV_RETURN_IF_ERROR(dev_->alloc_words(kWordsPerSlab, &host, &dev));
    free_words_.reserve(free_words_.size() + kWordsPerSlab / 2);
    // Two words a tracker: done, then reading. Device addresses follow
    // from the host ones by a constant offset.
    for (size_t i = kWordsPerSlab; i > 0; i -= 2) free_words_.push_back(host + i - 2);
    slab_offsets_.push_back({host, dev});
  }
  uint64_t *w = free_words_.back();
  __atomic_store_n(w, 0, __ATOMIC_RELEASE);
  __atomic_store_n(w + 1, 0, __ATOMIC_RELEASE);
  t->done_ = w;
  t->done_dev_ = device_word(w);
  trackers_.push_back(t);
  free_words_.pop_back();
  *out = std::move(t);
  return Status::ok();
}

uint64_t *BufferManager::device_word(uint64_t *host) const {
  for (const auto &s : slab_offsets_)
    if (host >= s.first && host < s.first + kWordsPerSlab) return s.second + (host - s.first);
  return nullptr;
}

uint64_t BufferManager::begin(StepTracker &t) {
  // Published as "taking" first: a scan that runs before the epoch lands
  // treats this tracker as in flight from its last done epoch on.
  t.issued_.store(StepTracker::kTaking, std::memory_order_seq_cst);
  const uint64_t e = epoch_.fetch_add(1, std::memory_order_seq_cst) + 1;
  t.issued_.store(e, std::memory_order_seq_cst);
  return e;
}

void BufferManager::wait_idle(const StepTracker &t) {
  for (int spins = 0;; ++spins) {
    const uint64_t issued = t.issued();
    if (issued != StepTracker::kTaking && t.done() >= issued) return;
    if (spins < 64) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(spins < 1000 ? 10 : 100));
  }
}

uint64_t BufferManager::oldest_in_flight(std::unique_lock<std::mutex> &) {
  uint64_t oldest = epoch_.load(std::memory_order_seq_cst) + 1;
  size_t kept = 0;
  for (size_t i = 0; i < trackers_.size(); ++i) {
    std::shared_ptr<StepTracker> &t = trackers_[i];
    const uint64_t issued = t->issued_.load(std::memory_order_seq_cst);
    const uint64_t done = t->done();
    const bool idle = issued != StepTracker::kTaking && done >= issued;
    if (!idle) oldest = std::min(oldest, done + 1);
    // Forgotten once its owner is gone, its steps have ended and no record
    // in the ring names it.
    if (idle && t.use_count() == 1 && t->records_ == 0) {
      free_words_.push_back(t->done_);
      for (uint32_t m : t->missed_by_key_) keyed_missed_ -= StepTracker::missed_of(m);
      continue;
    }
    if (kept != i) trackers_[kept] = std::move(t);
    ++kept;
  }
  trackers_.resize(kept);
  return oldest;
}

void BufferManager::defer(std::function<void()> release) {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t stamp = epoch_.load(std::memory_order_seq_cst);
  // Not while the manager clears entries: the memory may be a unit map it
  // is storing into (it checked the head alive before a caller destroyed
  // it); its thread runs the release after the clear.
  if (!clearing_ && oldest_in_flight(lock) > stamp) {
    lock.unlock();
    release();
    return;
  }
  pending_.push_back({stamp, std::move(release)});
  lock.unlock();
  cv_.notify_one();
}

uint32_t BufferManager::head_created(uint32_t *gen) {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t id;
  if (!free_heads_.empty()) {
    id = free_heads_.back();
    free_heads_.pop_back();
  } else {
    id = static_cast<uint32_t>(heads_.size());
    heads_.emplace_back();
  }
  heads_[id].alive = true;
  *gen = ++heads_[id].gen;
  return id;
}

void BufferManager::head_destroyed(uint32_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (id == 0 || id >= heads_.size() || !heads_[id].alive) return;
  heads_[id].alive = false;
  free_heads_.push_back(id);
}

StepRecord BufferManager::open_record(StepTracker &t, uint64_t epoch, const uint64_t *heads, uint32_t n_runs,
                                      uint32_t want, uint32_t hit_cap, uint32_t key) {
  StepRecord r;
  if (!ring_) return r;
  if (key > kMaxRecordKey) key = 0;
  const uint32_t admit_cap = std::min(want, opts_.max_admits);
  std::unique_lock<std::mutex> lock(mu_);
  // Frames whose readers ended since the manager's last pass are free now:
  // a burst that begins right after the steps before it ended (a runtime
  // that waits for a token, then enqueues the next) finds the frames its
  // predecessors' evictions made ready.
  const bool release = (!quarantine_.empty() || !evicted_.empty()) && pool_free() < admit_cap;
  if (release) {
    release_quarantined(oldest_in_flight(lock));
    step_releases_.fetch_add(1, std::memory_order_relaxed);
  }
  const size_t bytes = record_bytes(admit_cap, hit_cap, n_runs);
  // 1. Room in the ring: after the newest record, else from the start.
  size_t at = SIZE_MAX;
  if (open_.empty()) {
    ring_head_ = ring_tail_ = 0;
    if (bytes <= opts_.ring_bytes) at = 0;
  } else if (ring_head_ > ring_tail_) {
    if (bytes <= opts_.ring_bytes - ring_head_)
      at = ring_head_;
    else if (bytes < ring_tail_)
      at = 0;
  } else if (ring_head_ < ring_tail_ && bytes <= ring_tail_ - ring_head_) {
    at = ring_head_;
  }
  if (at == SIZE_MAX) {
    ++dropped_;
    lock.unlock();
    if (release) publish(false);
    return r;
  }
  // 2. The header and the units it may admit into.
  RecordHeader *h = reinterpret_cast<RecordHeader *>(ring_ + at);
  std::memset(h, 0, sizeof *h);
  h->epoch = epoch;
  h->tracker = &t;
  h->admit_cap = admit_cap;
  h->hit_cap = hit_cap;
  h->n_runs = n_runs;
  h->bytes = static_cast<uint32_t>(bytes);
  h->key = key;
  RecordArrays a = arrays_of(h);
  std::memcpy(a.heads, heads, 8ull * n_runs);
  open_.push_back(h);
  open_peak_ = std::max(open_peak_, open_.size());
  ++t.records_;
  ring_head_ = at + bytes;
  lock.unlock();
  if (release) publish(false);
  cv_.notify_one();

  const ptrdiff_t dev = ring_dev_ - ring_;
  r.header = reinterpret_cast<RecordHeader *>(reinterpret_cast<uint8_t *>(h) + dev);
  r.hits = reinterpret_cast<uint32_t *>(reinterpret_cast<uint8_t *>(a.hits) + dev);
  r.admits = reinterpret_cast<AdmitEntry *>(reinterpret_cast<uint8_t *>(a.admits) + dev);
  r.heads = reinterpret_cast<uint64_t *>(reinterpret_cast<uint8_t *>(a.heads) + dev);
  r.admit_cap = admit_cap;
  r.hit_cap = hit_cap;
  return r;
}

BufferManager::Stats BufferManager::stats() {
  Stats s;
  std::lock_guard<std::mutex> lock(mu_);
  s.admissions = admissions_.load();
  s.evictions = evictions_.load();
  s.missed = missed_.load();
  s.given = given_.load();
  s.lost = lost_.load();
  s.backlog = open_.size() + (busy_.load() ? 1 : 0);
  s.dropped_records = dropped_;
  s.free = pool_free();
  s.quarantined = quarantined_.load();
  s.resident = resident_.load();
  s.passes = passes_.load();
  s.records_taken = records_taken_.load();
  s.busy_ns = busy_ns_.load();
  s.take_ns = take_ns_.load();
  s.victims_ns = victims_ns_.load();
  s.clear_ns = clear_ns_.load();
  s.release_ns = release_ns_.load();
  s.publish_ns = publish_ns_.load();
  s.reserve_target = reserve_target_.load();
  s.step_releases = step_releases_.load();
  return s;
}

bool BufferManager::quiesce(int timeout_ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (open_.empty() && pending_.empty() && !busy_.load()) return true;
    }
    cv_.notify_one();
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// The manager's thread ----------------------------------------------------------

void BufferManager::run() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_) return;
      const bool waiting = !open_.empty() || !pending_.empty() || !quarantine_.empty() || !evicted_.empty();
      // Steps end on the device, which tells no one: while some are
      // awaited, look again every 50 us.
      if (waiting)
        cv_.wait_for(lock, std::chrono::microseconds(50));
      else
        cv_.wait(lock);
      if (stop_) return;
      busy_.store(true);
    }
    const auto t0 = Clock::now();
    const size_t taken = take_records();
    const auto t1 = Clock::now();
    const bool evicted = evict();
    const auto t_release = Clock::now();
    release_ready();
    const auto t2 = Clock::now();
    publish();
    const auto t3 = Clock::now();
    if (taken > 0 || evicted) {
      passes_.fetch_add(1, std::memory_order_relaxed);
      records_taken_.fetch_add(taken, std::memory_order_relaxed);
      take_ns_.fetch_add(ns_between(t0, t1), std::memory_order_relaxed);
      release_ns_.fetch_add(ns_between(t_release, t2), std::memory_order_relaxed);
      publish_ns_.fetch_add(ns_between(t2, t3), std::memory_order_relaxed);
      busy_ns_.fetch_add(ns_between(t0, t3), std::memory_order_relaxed);
    }
    busy_.store(false);
  }
}

size_t BufferManager::take_records() {
  {
    // The records open at once since the last pass: a peak that decays by
    // an eighth a pass that saw fewer.
    std::lock_guard<std::mutex> lock(mu_);
    open_records_ = std::max(static_cast<double>(std::max<size_t>(open_peak_, 1)), 0.875 * open_records_);
    open_peak_ = open_.size();
  }
  size_t taken = 0;
  for (;; ++taken) {
    RecordHeader *h;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const bool ended = !open_.empty() && open_.front()->tracker->done() >= open_.front()->epoch;
      if (!ended) {
        // Steps that ended between two passes ran beside each other as far
        // as the reserve can tell (Reserve::kReaders).
        if (taken > 0) ended_peak_ = std::max(static_cast<double>(taken), 0.875 * ended_peak_);
        return taken;
      }
      h = open_.front();
    }
    take_record(*h);
    std::lock_guard<std::mutex> lock(mu_);
    --const_cast<StepTracker *>(h->tracker)->records_;
    open_.pop_front();
    ring_tail_ = open_.empty() ? ring_head_ : static_cast<size_t>(reinterpret_cast<uint8_t *>(open_.front()) - ring_);
  }
}

void BufferManager::take_record(const RecordHeader &hc) {
  RecordHeader *h = const_cast<RecordHeader *>(&hc);
  RecordArrays a = arrays_of(h);
  const uint32_t used = std::min(h->used, h->admit_cap), hits = std::min(h->hits, h->hit_cap);
  // 1. Recency: every unit the step read from the cache, in one call (the
  //    policy ignores frames no longer resident and fetches ahead). The
  //    log is the device's: frames past the cache are dropped first. (A
  //    check of each frame's owner here, a random read of a 16-byte entry,
  //    took 110 ns a hit with LRU: at batch 7 the manager spent half the
  //    wall time on it and fell behind the steps.)
  scratch_hits_.clear();
  for (uint32_t i = 0; i < hits; ++i)
    if (a.hits[i] < opts_.units) scratch_hits_.push_back(a.hits[i]);
  policy_->on_access_all(scratch_hits_.data(), scratch_hits_.size());
  // 2. Admissions become resident frames of live heads; frames taken but
  //    not mapped go back to the pool. The lock (which the decoding path's
  //    open_record waits for) is held only to read which of the record's
  //    runs have live heads and to put frames back; owner_ and the policy
  //    are this thread's own.
  uint32_t admitted = 0;
  scratch_live_.assign(h->n_runs, 0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint32_t r = 0; r < h->n_runs; ++r) {
      const uint32_t id = static_cast<uint32_t>(a.heads[r] >> 32), gen = static_cast<uint32_t>(a.heads[r]);
      scratch_live_[r] = id != 0 && id < heads_.size() && heads_[id].alive && heads_[id].gen == gen;
    }
  }
  // A head that dies after this check leaves its frames owned by a dead
  // head, as one that dies after they became resident does: the eviction
  // quarantines them without clearing entries.
  // Frames are spread over the cache: each owner_ entry is a cache miss,
  // fetched a few admissions ahead; the policy fetches its own state
  // (on_insert_all), and resident_ is counted once.
  scratch_free_.clear();
  scratch_quarantine_.clear();
  scratch_admitted_.clear();
  uint32_t taken = 0;
  constexpr uint32_t kAhead = 16;
  for (uint32_t i = 0; i < used; ++i) {
    if (i + kAhead < used && a.admits[i + kAhead].frame < opts_.units)
      __builtin_prefetch(&owner_[a.admits[i + kAhead].frame], 1);
    const AdmitEntry e = a.admits[i];
    const uint32_t u = e.frame;
    if (u >= opts_.units) continue;  // the pool was empty
    ++taken;
    if (e.entry == 0) {
      scratch_free_.push_back(u);  // never mapped: nothing can read it
      continue;
    }
    if (e.run < h->n_runs && scratch_live_[e.run]) {
      const uint64_t head = a.heads[e.run];
      owner_[u] = Owner{static_cast<uint32_t>(head >> 32), static_cast<uint32_t>(head), e.entry};
      scratch_admitted_.push_back(u);
    } else {
      // Mapped in a head that is gone: steps in flight may still read it.
      scratch_quarantine_.push_back(u);
    }
  }
  policy_->on_insert_all(scratch_admitted_.data(), scratch_admitted_.size());
  admitted = static_cast<uint32_t>(scratch_admitted_.size());
  resident_ += admitted;
  std::lock_guard<std::mutex> lock(mu_);
  taken_known_ += taken;
  put_free(scratch_free_.data(), scratch_free_.size());
  if (!scratch_quarantine_.empty()) quarantine(std::move(scratch_quarantine_));
  admissions_ += admitted;
  // What the step missed (a gather that counts nothing reports at least
  // what it logged): its demand for free frames, whatever it could take.
  const uint32_t missed = std::max(h->missed, used);
  missed_ += missed;
  if (h->key != 0) {
    // The tracker outlives its records (records_); only the manager's
    // thread touches this, under mu_.
    StepTracker *t = const_cast<StepTracker *>(h->tracker);
    try {
      if (t->missed_by_key_.size() <= h->key) t->missed_by_key_.resize(h->key + 1, 0);
      uint32_t &m = t->missed_by_key_[h->key];
      const uint32_t now = std::min<uint32_t>(missed, UINT32_MAX - 1);
      keyed_missed_ = keyed_missed_ - StepTracker::missed_of(m) + now;
      m = now + 1;
      keyed_peak_ = std::max(static_cast<double>(keyed_missed_), 0.995 * keyed_peak_);
    } catch (const std::bad_alloc &) {
      // Without the figure, the reserve follows the records' mean alone.
    }
  }
  record_missed_ = 0.75 * record_missed_ + 0.25 * missed;
  record_peak_ = std::max(static_cast<double>(missed), 0.995 * record_peak_);
  given_ += taken;
}

bool BufferManager::evict() {
  if (opts_.units == 0) return false;
  // Free frames to keep ready: what a burst of steps misses (the header
  // says why), at most a quarter of the cache. (Keeping four times the
  // recent admissions let a shortage feed itself: steps admitted what they
  // were handed, and the next target followed that; twice a manager pass's
  // misses left three of four steps of a burst without frames.)
  // With keyed records, at least what the next steps of every key would
  // miss were they to miss what the last ones did, a quarter more.
  std::vector<uint32_t> victims;  // moved into the quarantine
  std::vector<uint64_t> &entries = scratch_entries_;
  std::vector<Owner> &owners = scratch_owners_;
  entries.clear();
  owners.clear();
  size_t need;
  {
    std::lock_guard<std::mutex> lock(mu_);
    size_t want;
    if (opts_.reader_quarantine && opts_.reserve == Options::Reserve::kReaders) {
      const size_t readers = steps_reading(nullptr);
      if (readers > 0) readers_peak_ = std::max(static_cast<double>(readers), 0.875 * readers_peak_);
      // Steps beside each other: at most the records open at once (a pass
      // that takes a backlog does not raise the reserve past the steps
      // that exist).
      const double beside = std::min(std::max(readers_peak_, ended_peak_), open_records_);
      want = static_cast<size_t>(1.25 * record_peak_ * (2 + beside));
    } else {
      const size_t keyed = static_cast<size_t>(1.25 * std::max(static_cast<double>(keyed_missed_), keyed_peak_));
      want = std::max(static_cast<size_t>(1.5 * record_missed_ * open_records_), keyed);
    }
    const size_t target = std::min<size_t>(opts_.units / 4, want + 32);
    reserve_target_.store(target, std::memory_order_relaxed);
    const size_t have = pool_free() + quarantined_.load();  // pool_free counts held frames
    if (have >= target) return false;
    need = target - have;
  }
  // The victims from this thread's own state, without the lock; whose
  // entries to clear (live heads only: a dead head's unit map is not
  // written again, it is freed once the steps in flight have ended) under
  // it, briefly.
  // The policy's victims first, then their owners: each owner_ entry is a
  // cache miss, fetched a few victims ahead rather than one after another.
  const auto t_victims = Clock::now();
  victims.reserve(need);
  while (need-- > 0) {
    const int64_t v = policy_->victim();
    if (v < 0) break;
    const uint32_t u = static_cast<uint32_t>(v);
    policy_->on_erase(u);
    victims.push_back(u);
  }
  constexpr size_t kAhead = 16;
  for (size_t i = 0; i < victims.size(); ++i) {
    if (i + kAhead < victims.size()) __builtin_prefetch(&owner_[victims[i + kAhead]], 1);
    Owner &o = owner_[victims[i]];
    owners.push_back(o);
    o = Owner{};
  }
  resident_ -= victims.size();
  victims_ns_.fetch_add(ns_between(t_victims, Clock::now()), std::memory_order_relaxed);
  // Frames of dead heads: their entries are not cleared, and a step
  // enqueued before its head died may still read one, however late it
  // reaches its gather: they wait for every step begun by now.
  // The victims are sorted out by their heads' liveness, read under the
  // lock once a distinct head (a few hundred at batch 7, for thousands of
  // victims) into this thread's table of head states, with clearing_ set:
  // a head destroyed after the read has its unit map's release deferred
  // until the clear has landed. (Checking each victim under the lock held
  // it, which the decoding path's open_record takes, for thousands of
  // victims a pass; where the table cannot grow, that is what happens.)
  std::vector<uint32_t> of_dead;
  if (!victims.empty()) {
    uint32_t top = 0;
    for (const Owner &o : owners) top = std::max(top, o.head);
    bool table = true;
    if (head_state_.size() <= top) {
      try {
        head_state_.resize(size_t{top} + 1);
        head_mark_.resize(size_t{top} + 1, 0);
      } catch (const std::bad_alloc &) {
        table = false;
      }
    }
    std::vector<uint32_t> &distinct = scratch_ids_;  // reserved: at most one a victim
    distinct.clear();
    if (table) {
      if (++mark_ == 0) {  // the marks wrapped: none may look current
        std::fill(head_mark_.begin(), head_mark_.end(), 0u);
        mark_ = 1;
      }
      for (const Owner &o : owners)
        if (head_mark_[o.head] != mark_) {
          head_mark_[o.head] = mark_;
          distinct.push_back(o.head);
        }
    }
    std::unique_lock<std::mutex> lock(mu_);
    clearing_ = true;  // until the stores have landed: defer() holds releases
    const HeadSlot *state = head_state_.data();
    if (table) {
      for (uint32_t id : distinct) head_state_[id] = id < heads_.size() ? heads_[id] : HeadSlot{};
      lock.unlock();
    } else {
      state = heads_.data();  // under the lock to the end of the loop
    }
    const size_t n_state = table ? head_state_.size() : heads_.size();
    size_t kept = 0;
    for (size_t i = 0; i < victims.size(); ++i) {
      const Owner &o = owners[i];
      if (o.head < n_state && state[o.head].alive && state[o.head].gen == o.gen) {
        entries.push_back(o.entry);
        victims[kept++] = victims[i];
      } else {
        of_dead.push_back(victims[i]);
      }
    }
    victims.resize(kept);
    if (!of_dead.empty()) {
      if (!lock.owns_lock()) lock.lock();
      evictions_ += of_dead.size();
      quarantine(std::move(of_dead));
    }
  }
  // 1. Clear the live victims' unit map entries (one each) and wait: steps
  //    that begin after this read the host pages. 2. Quarantine until the
  //    steps that began before have ended. If the stores failed, the
  //    entries may still point at the frames: they are lost to the cache
  //    rather than reused under a reader.
  Status st = Status::ok();
  if (!entries.empty()) {
    const auto t0 = Clock::now();
    st = dev_->clear_entries(entries.data(), static_cast<uint32_t>(entries.size()));
    clear_ns_.fetch_add(ns_between(t0, Clock::now()), std::memory_order_relaxed);
  }
  std::lock_guard<std::mutex> lock(mu_);
  clearing_ = false;
  if (victims.empty()) return !owners.empty();
  if (!st.is_ok()) {
    lost_ += victims.size();
    return true;
  }
  const size_t n_victims = victims.size();
  // Read after the stores have completed (clear_entries waited for them;
  // the fence pairs with each gather CTA's): a step not seen reading now
  // reads the cleared entries (the header).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (opts_.reader_quarantine) {
    std::vector<Reader> readers;
    steps_reading(&readers);
    quarantine_evicted(std::move(victims), std::move(readers));
  } else {
    quarantine(std::move(victims));
  }
  evictions_ += n_victims;
  return true;
}

size_t BufferManager::steps_reading(std::vector<Reader> *out) const {
  size_t n = 0;
  for (const std::shared_ptr<StepTracker> &t : trackers_) {
    // The reading word first: a step that ends between the two loads is
    // not counted, one that begins reading after them reads cleared
    // entries.
    const uint64_t reading = t->reading();
    if (reading > t->done()) {
      ++n;
      if (out) out->push_back({t, reading});
    }
  }
  return n;
}

void BufferManager::release_quarantined(uint64_t oldest) {
  // Stamps never decrease along the queue: the frames whose readers have
  // ended are a prefix, and the decoding path pays for what it frees, not
  // for what stays.
  while (!quarantine_.empty() && quarantine_.front().stamp < oldest) {
    const std::vector<uint32_t> &units = quarantine_.front().units;
    put_free(units.data(), units.size());
    quarantined_ -= units.size();
    quarantine_.pop_front();
  }
  // Evicted batches, each once every step seen reading at its clear has
  // ended (its tracker's done word past the step's epoch). A few batches,
  // each of a few readers: one per manager pass, freed a step or two later.
  for (auto it = evicted_.begin(); it != evicted_.end();) {
    bool ended = true;
    for (const Reader &r : it->readers) ended = ended && r.tracker->done() >= r.epoch;
    if (!ended) {
      ++it;
      continue;
    }
    put_free(it->units.data(), it->units.size());
    quarantined_ -= it->units.size();
    it = evicted_.erase(it);
  }
}

void BufferManager::quarantine(std::vector<uint32_t> &&units) {
  // Stamped with the epoch counter as it is now: every step that may still
  // read these frames began before. Only the manager's thread queues, with
  // a counter that only grows: in stamp order.
  const uint64_t stamp = epoch_.load(std::memory_order_seq_cst);
  const size_t n = units.size();
  quarantine_.push_back({stamp, std::move(units)});
  quarantined_ += n;
}

void BufferManager::quarantine_evicted(std::vector<uint32_t> &&units, std::vector<Reader> &&readers) {
  const size_t n = units.size();
  evicted_.push_back(Evicted{std::move(readers), std::move(units)});
  quarantined_ += n;
}

size_t BufferManager::fill_slots(const uint32_t *units, size_t n) {
  // Position p reuses the slot of p - cap: only once its taker has ended.
  const uint64_t cap = pool_dev_.cap;
  const uint64_t room = read_mark_ + cap > produced_ ? read_mark_ + cap - produced_ : 0;
  const size_t m = static_cast<size_t>(std::min<uint64_t>(n, room));
  for (size_t i = 0; i < m;) {
    const uint64_t at = produced_ % cap;
    const size_t len = static_cast<size_t>(std::min<uint64_t>(m - i, cap - at));
    std::memcpy(pool_slots_ + at, units + i, len * sizeof(uint32_t));
    produced_ += len;
    i += len;
  }
  return m;
}

void BufferManager::put_free(const uint32_t *units, size_t n) {
  // Frames wait in held_ from the first that has no slot on, so that the
  // pool hands them out in the order they were freed. held_ has room for
  // every frame (reserved once): no allocation.
  const size_t placed = held_.empty() ? fill_slots(units, n) : 0;
  held_.insert(held_.end(), units + placed, units + n);
}

void BufferManager::publish(bool wait) {
  std::unique_lock<std::mutex> order(publish_mu_, std::defer_lock);
  if (wait)
    order.lock();
  else if (!order.try_lock())
    return;  // the manager's thread is publishing; its next pass takes the rest
  uint64_t first, n;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first = published_;
    n = produced_ - published_;
    published_ = produced_;
  }
  if (n == 0) return;
  // The host copy of these slots is not written again before their takers
  // have ended (put_free), so the copy reads them as they are now.
  if (!dev_->publish_frames(pool_slots_, pool_slots_dev_, const_cast<uint32_t *>(pool_dev_.slots), first, n,
                            pool_dev_.cap,
                            reinterpret_cast<uint64_t *>(pool_dev_.avail))
           .is_ok())
    lost_ += n;
}

void BufferManager::advance_pool(uint64_t oldest) {
  if (!pool_slots_) return;
  // A checkpoint: every position below `seen` was taken by a step begun by
  // now (its epoch at most this stamp); once the steps in flight now have
  // ended, their takers have read those slots.
  const uint64_t seen = __atomic_load_n(pool_seen_, __ATOMIC_ACQUIRE);
  if ((checkpoints_.empty() ? read_mark_ : checkpoints_.back().seen) < seen && checkpoints_.size() < 4096) {
    try {
      checkpoints_.push_back({epoch_.load(std::memory_order_seq_cst), seen});
    } catch (const std::bad_alloc &) {
      // A later pass checkpoints again; the mark only waits longer.
    }
  }
  while (!checkpoints_.empty() && checkpoints_.front().stamp < oldest) {
    read_mark_ = std::max(read_mark_, checkpoints_.front().seen);
    checkpoints_.pop_front();
  }
  // The held frames that have slots now, from the front (held_ keeps its
  // reserved capacity).
  const size_t placed = fill_slots(held_.data(), held_.size());
  held_.erase(held_.begin(), held_.begin() + static_cast<ptrdiff_t>(placed));
}

size_t BufferManager::pool_free() const {
  if (!pool_slots_) return 0;
  const uint64_t seen = __atomic_load_n(pool_seen_, __ATOMIC_ACQUIRE);
  const uint64_t taken = std::max(taken_known_, seen);
  return (produced_ > taken ? static_cast<size_t>(produced_ - taken) : 0) + held_.size();
}

bool BufferManager::release_ready() {
  std::vector<Pending> ready;
  uint64_t oldest;
  {
    std::unique_lock<std::mutex> lock(mu_);
    oldest = oldest_in_flight(lock);
    size_t kept = 0;
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (pending_[i].stamp < oldest)
        ready.push_back(std::move(pending_[i]));
      else
        pending_[kept++] = std::move(pending_[i]);
    }
    pending_.resize(kept);
    // Quarantined frames whose readers have ended are free again.
    advance_pool(oldest);
    release_quarantined(oldest);
  }
  for (Pending &p : ready) p.release();
  return !ready.empty();
}

}  // namespace wkv
