#include "lib/engine/cold.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <new>
#include <thread>

#include "lib/engine/sequence.hpp"
#include "lib/common/thread_name.hpp"
#include "wavekv/wavekv.h"

namespace wkv {

uint32_t cold_stamp(uint64_t s) {
  return static_cast<uint32_t>(std::min<uint64_t>(s, std::numeric_limits<uint32_t>::max()));
}

void cold_fit(HeadState &hs, uint64_t stamp) {
  ColdPages &cp = hs.cold;
  const size_t pages = hs.map.pages.size(), clusters = hs.clusters();
  if (cp.state.size() < pages) {
    cp.state.resize(pages, ColdPages::kResident);
    cp.extent.resize(pages);
  }
  if (cp.last_used.size() < clusters) cp.last_used.resize(clusters, cold_stamp(stamp));
}

bool cold_resident(HeadState &hs, uint32_t c, uint32_t pt) {
  ColdPages &cp = hs.cold;
  const uint32_t first = hs.map.first_slot[c], n = hs.map.size[c];
  bool resident = true;
  for (uint32_t p = first / pt; p <= (first + n - 1) / pt; ++p) {
    switch (cp.state[p]) {
      case ColdPages::kResident:
      case ColdPages::kKept:
        break;
      case ColdPages::kWriting:
        cp.state[p] = ColdPages::kKept;  // wanted again: its write is disowned
        break;
      case ColdPages::kOnDisk:
        cp.state[p] = ColdPages::kReading;
        cp.want.push_back(p);
        resident = false;
        break;
      default:  // being read back, or failed
        resident = false;
    }
  }
  return resident;
}

ColdTier::ColdTier(Options opts, SpillFile &spill, HostArena &arena, EngineCounters &counters, Backend &backend,
                   BufferManager &buffers)
    : opts_(opts), spill_(spill), arena_(arena), counters_(counters), backend_(backend), buffers_(buffers) {
  want_cap_ = static_cast<uint32_t>(arena_.page_bytes() / 4 - 2);
  // A 32nd of the budget, at least two batches: room for the reads of a few
  // steps and for a growth's pages before the next writes free more.
  reserve_ = std::max<uint64_t>(opts_.budget_pages / 32, 2 * uint64_t(opts_.batch));
  reserve_ = std::max<uint64_t>(1, std::min<uint64_t>(reserve_, opts_.budget_pages / 4));
  // A growth's pages within a quarter of the budget.
  max_growth_segments_ = static_cast<uint32_t>(
      std::max<uint64_t>(1, opts_.budget_pages / 4 / std::max<uint64_t>(1, opts_.segment_pages)));
  thread_ = std::thread([this] { run(); });
  name_thread(thread_, "wkv-cold");
}

ColdTier::~ColdTier() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void ColdTier::submit(std::vector<Job> &jobs) {
  if (jobs.empty()) return;
  {
    std::lock_guard<std::mutex> lock(jobs.front().owner->mu);
    (jobs.front().write ? jobs.front().owner->writes : jobs.front().owner->reads) +=
        static_cast<uint32_t>(jobs.size());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Job &j : jobs) queue_.push_back(std::move(j));
  }
  jobs.clear();
  cv_.notify_one();
}

void ColdTier::run() {
  std::vector<Job> batch;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      // One owner, one kind, up to a batch.
      const Job &first = queue_.front();
      const ColdShared *owner = first.owner.get();
      const bool write = first.write;
      while (!queue_.empty() && batch.size() < opts_.batch && queue_.front().owner.get() == owner &&
             queue_.front().write == write) {
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    run_batch(batch);
    batch.clear();
  }
}

void ColdTier::run_batch(std::vector<Job> &batch) {
  // The sequence may be destroyed meanwhile: its shared state lives while
  // this runs, even once the disowned jobs (and their references) are gone.
  const std::shared_ptr<ColdShared> hold = batch.front().owner;
  ColdShared &owner = *hold;
  const bool write = batch.front().write;
  // Jobs of an older generation were disowned: dropped unseen.
  {
    std::lock_guard<std::mutex> lock(owner.mu);
    (write ? owner.writes : owner.reads) -= static_cast<uint32_t>(batch.size());
    batch.erase(std::remove_if(batch.begin(), batch.end(), [&](const Job &j) { return j.gen != owner.gen; }),
                batch.end());
    if (batch.empty()) {
      owner.cv.notify_all();
      return;
    }
    owner.busy++;
  }
  const size_t n = batch.size(), page = arena_.page_bytes();
  std::vector<ColdShared::Done> done(n);
  Status st = Status::ok();
  try {
    for (size_t i = 0; i < n; ++i) {
      done[i].gen = batch[i].gen;
      done[i].write = write;
      done[i].layer = batch[i].layer;
      done[i].head = batch[i].head;
      done[i].page = batch[i].page;
    }
    if (write) {
      std::vector<const uint8_t *> src(n);
      std::vector<SpillExtent> ext(n);
      for (size_t i = 0; i < n; ++i) src[i] = batch[i].src;
      st = spill_.write_many(src.data(), n, page, ext.data());
      for (size_t i = 0; i < n; ++i) {
        done[i].st = st;
        if (st.is_ok()) done[i].extent = ext[i];
      }
    } else {
      // Slots for what can be read now; the rest waits for a later lookup.
      std::vector<SpillExtent> ext;
      std::vector<uint8_t *> dst;
      std::vector<size_t> which;
      for (size_t i = 0; i < n; ++i) {
        PageId id = kNoPage;
        done[i].st = arena_.allocate(1, &id);
        if (!done[i].st.is_ok()) continue;
        done[i].id = id;
        ext.push_back(batch[i].extent);
        dst.push_back(arena_.page_ptr(id));
        which.push_back(i);
      }
      std::vector<Status> each(which.size());
      st = spill_.read_many(ext.data(), dst.data(), which.size(), each.data());
      for (size_t k = 0; k < which.size(); ++k) done[which[k]].st = st.is_ok() ? each[k] : st;
    }
  } catch (const std::bad_alloc &) {
    st = WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory in the spill tier");
    for (ColdShared::Done &d : done)
      if (d.st.is_ok()) d.st = st;
  }
  std::lock_guard<std::mutex> lock(owner.mu);
  owner.busy--;
  for (ColdShared::Done &d : done) {
    if (d.gen == owner.gen) {
      try {
        owner.done.push_back(d);
        continue;
      } catch (const std::bad_alloc &) {
      }
    }
    // Disowned meanwhile (or no room to report it): undone here.
    if (d.id != kNoPage) arena_.release(&d.id, 1);
    if (d.write && d.st.is_ok()) spill_.release(d.extent);
  }
  owner.cv.notify_all();
}

void ColdTier::install_one(Sequence &seq, const ColdShared::Done &d, Changes &ch) {
  LayerState &L = seq.layer(d.layer);
  HeadState &hs = L.heads[d.head];
  ColdPages &cp = hs.cold;
  uint8_t &state = cp.state[d.page];
  if (d.write) {
    if (state == ColdPages::kKept) {
      // Disowned when wanted again: the page stays, its slot free to go.
      if (d.st.is_ok()) spill_.release(d.extent);
      state = ColdPages::kResident;
      return;
    }
    if (state != ColdPages::kWriting || !d.st.is_ok()) {
      // Wanted again since (the lookup kept it), or the write failed: the
      // page stays; a later lookup tries again.
      if (d.st.is_ok()) spill_.release(d.extent);
      if (state == ColdPages::kWriting) state = ColdPages::kResident;
      if (!d.st.is_ok()) counters_.spill_write_errors.fetch_add(1);
      return;
    }
    if (opts_.device && seq.layer_open(d.layer)) {
      // A plan may yet gather the page (its selection saw it resident):
      // it stays, as if wanted again.
      spill_.release(d.extent);
      state = ColdPages::kResident;
      return;
    }
    const PageId id = hs.map.pages[d.page];
    cp.extent[d.page] = d.extent;
    state = ColdPages::kOnDisk;
    hs.map.pages[d.page] = kNoPage;
    cp.out++;
    counters_.cold_pages.fetch_add(1);
    counters_.cold_pages_written.fetch_add(1);
    // A CPU engine's steps run inside their calls, and the layer's latest
    // lookup never chose this page: nothing reads the slot now. A CUDA
    // engine's page table entry goes null, and the slot back once the
    // steps in flight have ended (or at once: `now`).
    // (On a CUDA engine the slot goes through `ch`: apply gives it back once
    // the entry is pointed, at once or after the steps in flight; it is kept
    // if the entry could not be pointed.)
    if (opts_.device) {
      ch.point.emplace_back(&hs, d.page);
      ch.freed.push_back(id);
    } else {
      arena_.release(&id, 1);
    }
    return;
  }
  if (state != ColdPages::kReading) {  // cannot happen: reads are disowned first
    if (d.id != kNoPage) arena_.release(&d.id, 1);
    return;
  }
  if (d.st.is_ok()) {
    spill_.release(cp.extent[d.page]);
    cp.extent[d.page] = SpillExtent{};
    hs.map.pages[d.page] = d.id;
    if (opts_.device) ch.point.emplace_back(&hs, d.page);
    state = ColdPages::kResident;
    cp.out--;
    counters_.cold_pages.fetch_sub(1);
    counters_.cold_pages_read.fetch_add(1);
    return;
  }
  if (d.id != kNoPage) arena_.release(&d.id, 1);
  if (d.st.code() == WKV_ERR_BUDGET || d.st.code() == WKV_ERR_OUT_OF_MEMORY) {
    // No room yet (the writes that make it are installed by this same
    // call): asked for again by the layer's next lookup.
    try {
      cp.want.push_back(d.page);
    } catch (const std::bad_alloc &) {
      state = ColdPages::kOnDisk;
    }
    return;
  }
  state = ColdPages::kFailed;
  counters_.spill_read_errors.fetch_add(1);
}

void ColdTier::apply(Changes &ch, void *stream, bool now) {
  // Grouped by head: one call per run of the same head.
  std::vector<uint32_t> pages;
  Status st = Status::ok();
  for (size_t i = 0; i < ch.point.size();) {
    HeadState *hs = ch.point[i].first;
    pages.clear();
    for (; i < ch.point.size() && ch.point[i].first == hs; ++i) pages.push_back(ch.point[i].second);
    Status s = backend_.point_pages(*hs, pages.data(), static_cast<uint32_t>(pages.size()), stream);
    if (st.is_ok()) st = s;
  }
  ch.point.clear();
  if (!st.is_ok()) {
    // An entry may still point at a slot given back: keep the slots (counted
    // in use) rather than reuse them under a reader.
    counters_.spill_write_errors.fetch_add(1);
    ch.freed.clear();
    return;
  }
  if (ch.freed.empty()) return;
  if (now) {
    arena_.release(ch.freed.data(), static_cast<uint32_t>(ch.freed.size()));
  } else {
    buffers_.defer([&arena = arena_, ids = std::move(ch.freed)] {
      arena.release(ids.data(), static_cast<uint32_t>(ids.size()));
    });
  }
  ch.freed.clear();
}

void ColdTier::install(Sequence &seq, void *stream) {
  ColdShared &sh = *seq.cold();
  std::vector<ColdShared::Done> done;
  {
    std::lock_guard<std::mutex> lock(sh.mu);
    if (sh.done.empty()) return;
    done.swap(sh.done);
  }
  Changes ch;
  for (const ColdShared::Done &d : done) install_one(seq, d, ch);
  apply(ch, stream, false);
}

void ColdTier::begin_lookup(Sequence &seq, uint32_t layer, void *stream) {
  install(seq, stream);
  LayerState &L = seq.layer(layer);
  const uint64_t before = L.last_lookup;
  const uint64_t stamp = seq.next_stamp();
  L.last_lookup = stamp;
  // Clusters new since the last fit (a growth) rank as used just before
  // this lookup: recent, but not kept the way its retrievals are.
  for (HeadState &hs : L.heads) cold_fit(hs, stamp - 1);
  if (opts_.device) take_reports(L, before);
}

void ColdTier::take_reports(LayerState &L, uint64_t before) {
  const uint32_t pt = opts_.page_tokens;
  uint64_t found = 0;
  for (HeadState &hs : L.heads) {
    ColdPages &cp = hs.cold;
    if (cp.report == kNoPage) {
      // The report's page, once: without room this step goes unreported.
      PageId id = kNoPage;
      if (arena_.allocate(1, &id).is_ok()) {
        cp.report = id;
        std::memset(arena_.page_ptr(id), 0, 8);
      }
      continue;
    }
    // Written by the device: the stamp last, after the rest is visible. A
    // report of another lookup (the step not run yet, or none) is left.
    uint32_t *w = reinterpret_cast<uint32_t *>(arena_.page_ptr(cp.report));
    if (before == 0 || __atomic_load_n(&w[0], __ATOMIC_ACQUIRE) != cold_stamp(before)) continue;
    const uint32_t count = __atomic_load_n(&w[1], __ATOMIC_RELAXED);
    const uint32_t n = std::min(count, want_cap_), C = hs.clusters();
    try {
      for (uint32_t i = 0; i < n; ++i) {
        const uint32_t c = w[2 + i];
        if (c < C) (void)cold_resident(hs, c, pt);
      }
    } catch (const std::bad_alloc &) {
      // No room to ask: the pages stay on disk, asked for again when a
      // lookup finds them out.
      for (uint32_t p : cp.want) cp.state[p] = ColdPages::kOnDisk;
      cp.want.clear();
    }
    w[0] = 0;
    found += count;
  }
  if (found > 0) {
    counters_.cold_estimated.fetch_add(found);
    counters_.retrieved_clusters.fetch_sub(found);
    counters_.estimated_clusters.fetch_add(found);
  }
}

void ColdTier::fill_run(const LayerState &L, const HeadState &hs, kernels::DevRun *run) const {
  run->cold_pt = opts_.page_tokens;
  run->stamp = cold_stamp(L.last_lookup);
  run->stamps = hs.mirror.stamps.as<uint32_t>();
  if (hs.cold.report != kNoPage) {
    run->wants = reinterpret_cast<uint32_t *>(const_cast<uint8_t *>(backend_.page_address(hs.cold.report)));
    run->want_cap = want_cap_;
  }
}

void ColdTier::assembled(LayerState &L, const std::shared_ptr<StepTracker> &tracker, uint64_t epoch) {
  L.reader = tracker;
  L.read_epoch = epoch;
}

std::vector<ColdTier::Victim> ColdTier::choose(Sequence &seq, uint64_t n) {
  std::vector<Victim> cand;
  std::vector<uint32_t> hot;
  std::vector<uint32_t> dev;
  const uint32_t pt = opts_.page_tokens, now = cold_stamp(seq.stamp());
  for (uint32_t l = 0; l < seq.n_layers(); ++l) {
    LayerState &L = seq.layer(l);
    // A CUDA engine's layer that is open, or whose newest pages the device
    // may not have written yet, gives none now.
    if (opts_.device && (seq.layer_open(l) || L.grown_epoch > seq.tracker().done())) continue;
    const uint32_t keep = L.last_lookup ? cold_stamp(L.last_lookup) : std::numeric_limits<uint32_t>::max();
    for (uint32_t h = 0; h < L.heads.size(); ++h) {
      HeadState &hs = L.heads[h];
      cold_fit(hs, seq.stamp() ? seq.stamp() - 1 : 0);
      if (opts_.device && hs.clusters() > 0) {
        // The device's stamps, where they are newer (a stamp from the
        // future is a cluster the device has not written yet).
        dev.resize(hs.clusters());
        if (backend_.read_stamps(hs, dev.data(), hs.clusters()).is_ok())
          for (uint32_t c = 0; c < hs.clusters(); ++c)
            if (dev[c] <= now && dev[c] > hs.cold.last_used[c]) hs.cold.last_used[c] = dev[c];
      }
      const uint32_t P = static_cast<uint32_t>(hs.map.pages.size());
      hot.assign(P, 0);
      for (uint32_t c = 0; c < hs.clusters(); ++c) {
        const uint32_t first = hs.map.first_slot[c], size = hs.map.size[c], s = hs.cold.last_used[c];
        for (uint32_t p = first / pt; p <= (first + size - 1) / pt; ++p) hot[p] = std::max(hot[p], s);
      }
      for (uint32_t p = 0; p < P; ++p)
        if (hs.cold.state[p] == ColdPages::kResident && hs.map.pages[p] != kNoPage && (keep == 0 || hot[p] < keep))
          cand.push_back(Victim{hot[p], p, l, h});
    }
  }
  // Oldest first; among equals the oldest tokens, spread over the heads.
  auto older = [](const Victim &a, const Victim &b) {
    if (a.hot != b.hot) return a.hot < b.hot;
    if (a.page != b.page) return a.page < b.page;
    if (a.layer != b.layer) return a.layer < b.layer;
    return a.head < b.head;
  };
  if (cand.size() > n) {
    std::nth_element(cand.begin(), cand.begin() + static_cast<ptrdiff_t>(n), cand.end(), older);
    cand.resize(n);
  }
  std::sort(cand.begin(), cand.end(), older);
  return cand;
}

void ColdTier::end_lookup(Sequence &seq, uint32_t layer) {
  std::vector<Job> jobs;
  LayerState &L = seq.layer(layer);
  const uint64_t gen = [&] {
    std::lock_guard<std::mutex> lock(seq.cold()->mu);
    return seq.cold()->gen;
  }();
  auto job = [&](bool write, uint32_t l, uint32_t h, uint32_t p) {
    Job j;
    j.owner = seq.cold();
    j.gen = gen;
    j.write = write;
    j.layer = l;
    j.head = h;
    j.page = p;
    return j;
  };
  try {
    for (uint32_t h = 0; h < L.heads.size(); ++h) {
      ColdPages &cp = L.heads[h].cold;
      for (uint32_t p : cp.want) {
        jobs.push_back(job(false, layer, h, p));
        jobs.back().extent = cp.extent[p];
      }
      cp.want.clear();
    }
    const uint64_t asked = jobs.size();
    submit(jobs);
    // Writes, when the free pages fall short of the reserve plus the reads
    // asked for, and none of the sequence's writes are under way: room for
    // the reads, which the pager retries at the next lookups.
    const HostArena::Stats a = arena_.stats();
    const uint64_t used = a.pages_used, budget = opts_.budget_pages;
    const uint64_t free = budget > used ? budget - used : 0;
    uint64_t reads = 0;
    bool writing;
    {
      std::lock_guard<std::mutex> lock(seq.cold()->mu);
      writing = seq.cold()->writes > 0;
      reads = seq.cold()->reads;
    }
    const uint64_t need = reserve_ + std::min<uint64_t>(std::max(reads, asked), budget / 2);
    if (free >= need || writing) return;
    for (const Victim &v : choose(seq, need + reserve_ - free)) {
      HeadState &hs = seq.layer(v.layer).heads[v.head];
      hs.cold.state[v.page] = ColdPages::kWriting;
      jobs.push_back(job(true, v.layer, v.head, v.page));
      jobs.back().src = arena_.page_ptr(hs.map.pages[v.page]);
    }
    submit(jobs);
  } catch (const std::bad_alloc &) {
    // No memory to hand work over: pages asked for go back on disk, and
    // pages chosen stay; a later lookup tries again.
    for (const Job &j : jobs) {
      uint8_t &s = seq.layer(j.layer).heads[j.head].cold.state[j.page];
      s = j.write ? ColdPages::kResident : ColdPages::kOnDisk;
    }
    for (HeadState &hs : L.heads) {
      for (uint32_t p : hs.cold.want) hs.cold.state[p] = ColdPages::kOnDisk;
      hs.cold.want.clear();
    }
  }
}

// Waits until the step of `t` at `epoch` has ended (polls, backing off).
// A device that fails meanwhile never ends it: every 100 ms of waiting
// the device is asked for its state (a sticky error shows on any stream),
// and its error ends the wait. A step that is merely slow (held back by
// the caller's events, say) is waited for, as a stream synchronization
// would.
Status ColdTier::wait_for(const StepTracker &t, uint64_t epoch) {
  auto checked = std::chrono::steady_clock::now();
  for (int spins = 0; t.done() < epoch; ++spins) {
    if (spins < 64) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 1000 ? 10 : 100));
    const auto now = std::chrono::steady_clock::now();
    if (now - checked < std::chrono::milliseconds(100)) continue;
    checked = now;
    Status st = backend_.mem_sync(backend_.io_stream());
    if (!st.is_ok())
      return WKV_ERROR(WKV_ERR_DEVICE, "waiting for the gathers that read pages to write out: %s",
                       st.message().c_str());
  }
  return Status::ok();
}

Status ColdTier::relieve(Sequence &seq, uint64_t pages, void *stream) {
  if (pages > opts_.budget_pages)
    return WKV_ERROR(WKV_ERR_BUDGET,
                     "a growth needs %llu pages at once, more than the host budget holds (%llu): the budget must "
                     "hold at least a segment of every KV head of a layer",
                     static_cast<unsigned long long>(pages), static_cast<unsigned long long>(opts_.budget_pages));
  try {
    install(seq, stream);
    std::vector<Victim> v = choose(seq, pages + reserve_);
    if (v.empty())
      return WKV_ERROR(WKV_ERR_BUDGET, "the host budget is full and the sequence has no page that may leave");
    if (opts_.device) {
      // The slots go back at once: the gathers that may read them end
      // first (none of an open layer's pages was chosen).
      std::vector<uint8_t> seen(seq.n_layers(), 0);
      for (const Victim &x : v) {
        const LayerState &L = seq.layer(x.layer);
        if (!seen[x.layer] && L.reader) WKV_RETURN_IF_ERROR(wait_for(*L.reader, L.read_epoch));
        seen[x.layer] = 1;
      }
    }
    const size_t page = arena_.page_bytes();
    Changes ch;
    for (size_t b = 0; b < v.size(); b += opts_.batch) {
      const size_t n = std::min<size_t>(opts_.batch, v.size() - b);
      std::vector<const uint8_t *> src(n);
      std::vector<SpillExtent> ext(n);
      for (size_t i = 0; i < n; ++i) src[i] = arena_.page_ptr(seq.layer(v[b + i].layer).heads[v[b + i].head].map.pages[v[b + i].page]);
      Status st = spill_.write_many(src.data(), n, page, ext.data());
      if (!st.is_ok()) {
        counters_.spill_write_errors.fetch_add(1);
        // What was written stays out; the caller's allocation fails if it
        // still does not fit.
        return b > 0 ? Status::ok() : st;
      }
      for (size_t i = 0; i < n; ++i) {
        ColdShared::Done d;
        d.write = true;
        d.layer = v[b + i].layer;
        d.head = v[b + i].head;
        d.page = v[b + i].page;
        d.extent = ext[i];
        seq.layer(d.layer).heads[d.head].cold.state[d.page] = ColdPages::kWriting;
        install_one(seq, d, ch);
      }
      apply(ch, stream, true);
    }
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory choosing pages to spill");
  }
  return Status::ok();
}

void ColdTier::settle(Sequence &seq) {
  ColdShared &sh = *seq.cold();
  std::vector<ColdShared::Done> done;
  {
    std::unique_lock<std::mutex> lock(sh.mu);
    sh.gen++;
    sh.cv.wait(lock, [&] { return sh.busy == 0; });
    done.swap(sh.done);
  }
  // What came back before the sequence disowned it is still its own (on a
  // CUDA engine, its page table entries on the I/O stream, waited for: no
  // step the caller enqueues next may see them change).
  Changes ch;
  for (const ColdShared::Done &d : done) install_one(seq, d, ch);
  if (!ch.point.empty() || !ch.freed.empty()) {
    void *io = backend_.io_stream();
    const bool pointed = !ch.point.empty();
    apply(ch, io, false);
    if (pointed) (void)backend_.mem_sync(io);
  }
  for (uint32_t l = 0; l < seq.n_layers(); ++l)
    for (HeadState &hs : seq.layer(l).heads) {
      for (uint8_t &s : hs.cold.state) {
        if (s == ColdPages::kWriting || s == ColdPages::kKept) s = ColdPages::kResident;
        if (s == ColdPages::kReading) s = ColdPages::kOnDisk;
      }
      hs.cold.want.clear();
    }
}

void ColdTier::release(Sequence &seq) noexcept {
  for (uint32_t l = 0; l < seq.n_layers(); ++l)
    for (HeadState &hs : seq.layer(l).heads) {
      ColdPages &cp = hs.cold;
      if (cp.report != kNoPage) {
        // A step in flight may still write it.
        try {
          buffers_.defer([&arena = arena_, id = cp.report] { arena.release(&id, 1); });
        } catch (...) {
          // No memory for the release: the page stays allocated.
        }
        cp.report = kNoPage;
      }
      for (size_t p = 0; p < cp.state.size(); ++p)
        if (cp.state[p] == ColdPages::kOnDisk || cp.state[p] == ColdPages::kFailed) {
          spill_.release(cp.extent[p]);
          cp.extent[p] = SpillExtent{};
        }
      counters_.cold_pages.fetch_sub(cp.out);
      cp.out = 0;
    }
}

Status ColdTier::read_page(const HeadState &hs, uint32_t p, uint8_t *dst) {
  const SpillPiece piece{dst, arena_.page_bytes()};
  Status st = spill_.read(hs.cold.extent[p], &piece, 1);
  if (!st.is_ok())
    return WKV_ERROR(st.code(), "reading back page %u of a head from the spill file: %s", p, st.message().c_str());
  return st;
}

}  // namespace wkv
