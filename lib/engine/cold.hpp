// Cold pages: the spill tier under a live sequence (docs/spill.md).
//
// On a CPU engine with a spill file and a host budget, host pages leave for
// the spill file when the budget runs short and come back when they are
// wanted, while the sequence keeps decoding:
//
//   replacement  a page's recency is the latest lookup stamp of the clusters
//                it holds (ColdPages::last_used, written by each lookup for
//                its retrieval zone, and by a growth for new clusters); the
//                oldest pages go first, oldest tokens first among equals.
//                Pages that a layer's latest lookup retrieved never go, so
//                a plan between its lookup and its assemble reads what it
//                chose.
//   writes       at the end of a lookup, when fewer than `reserve` pages of
//                the budget are free, the sequence's coldest pages are
//                handed to the pager's thread, which writes them; the next
//                call that installs finished work frees their slots. A
//                growth that finds the budget full writes synchronously
//                (relieve), then allocates again.
//   reads        a retrieval-zone cluster with a page not resident is
//                estimated for the step (its centroid and value sum never
//                leave memory) and its pages are read back on the pager's
//                thread; a later lookup installs them. A step never waits
//                on the disk.
//
// Ownership: only the sequence's own calls (one thread at a time, as for
// every wkv_seq) change its pages and their states. The pager's thread
// touches nothing of the sequence but the ColdShared it was handed: it
// writes page slots the sequence keeps until the result is installed, and
// reads into slots of its own that the install hands over.
//
// A read back that fails (I/O or checksum) leaves its page on disk, marked
// failed: its clusters are estimated from then on, and anything that needs
// the page's bytes (save, restore) fails with the read's error.
//
// On a CUDA engine (Options::device) the steps run on the device after
// their calls return, and the device decides which clusters are retrieved:
//
//   page table   a page out has a null entry in the device page table
//                (HeadMirror::pages); the selection estimates a retrieval
//                cluster with one (kernels::DevRun::cold_pt). Entries
//                change in stream order, on the stream of the call that
//                installs (Backend::point_pages).
//   recency      the selection stamps each retrieval cluster in device
//                memory (HeadMirror::stamps); choosing pages to write
//                reads them back first (Backend::read_stamps).
//   wants        the selection reports the clusters it found out in a host
//                page of each head (ColdPages::report); the layer's next
//                lookup asks for their pages.
//   slots        a page written out gives its slot back once every step
//                begun before has ended (BufferManager::defer). A layer
//                that a plan has looked up and not yet assembled is open (a
//                count of such lookups, as several plans may hold one:
//                Sequence::open_lookups): a plan may still gather what its
//                selection chose, so none of the layer's pages go.
//                A growth that relieves the budget waits for the gathers
//                that read the layers it takes pages from (LayerState::
//                reader), then frees the slots at once.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "lib/backend/backend.hpp"
#include "lib/buffer/buffer_manager.hpp"
#include "lib/common/counters.hpp"
#include "lib/common/status.hpp"
#include "lib/index/head.hpp"
#include "lib/store/host_arena.hpp"
#include "lib/store/spill.hpp"

namespace wkv {

class Sequence;

// What a sequence shares with the pager's thread.
struct ColdShared {
  struct Done {
    uint64_t gen = 0;
    bool write = false;
    uint32_t layer = 0, head = 0, page = 0;
    PageId id = kNoPage;  // a read's new page
    SpillExtent extent;   // a write's extent
    Status st;
  };
  std::mutex mu;
  std::condition_variable cv;
  uint64_t gen = 0;   // bumped to disown the jobs handed over before
  uint32_t busy = 0;  // jobs of the sequence on the pager's thread now
  uint32_t reads = 0, writes = 0;  // jobs handed over and not yet done
  std::vector<Done> done;
};

class ColdTier {
 public:
  struct Options {
    uint64_t budget_pages = 0;  // the host budget in page slots
    uint32_t page_tokens = 0;
    uint64_t segment_pages = 0;  // pages of one prompt segment of every KV head
    uint32_t batch = 64;        // pages one request of the pager moves at most
    bool device = false;        // a CUDA engine's (see above)
  };
  ColdTier(Options opts, SpillFile &spill, HostArena &arena, EngineCounters &counters, Backend &backend,
           BufferManager &buffers);
  ~ColdTier();  // joins the pager's thread; jobs left are dropped
  ColdTier(const ColdTier &) = delete;
  ColdTier &operator=(const ColdTier &) = delete;

  // Free slots the tier keeps for reads back and growths.
  uint64_t reserve() const { return reserve_; }
  // Prompt segments one growth may cluster (IndexContext): their pages stay
  // within a quarter of the budget.
  uint32_t max_growth_segments() const { return max_growth_segments_; }

  // Before a lookup of `layer` on `stream`: installs finished work, stamps
  // the layer, sizes the head's arrays; on a CUDA engine, takes the layer's
  // last report (its pages are asked for by end_lookup).
  void begin_lookup(Sequence &seq, uint32_t layer, void *stream);
  // The step of a CUDA engine's lookup: what the selection of `run` reads
  // and writes for the cold tier (kernels::DevRun::cold_pt, stamps, wants).
  void fill_run(const LayerState &L, const HeadState &hs, kernels::DevRun *run) const;
  // After a CUDA engine's assemble: the layer's latest gather is the
  // plan's step at `epoch` (the plan then closes its lookup).
  static void assembled(LayerState &L, const std::shared_ptr<StepTracker> &tracker, uint64_t epoch);
  // After it: hands the pages it wants to the pager, and writes cold pages
  // out when the budget runs short.
  void end_lookup(Sequence &seq, uint32_t layer);
  // A growth on `stream` found the budget full: writes at least `pages`
  // cold pages of the sequence (plus the reserve) synchronously and frees
  // their slots. WKV_ERR_BUDGET when the sequence has none to give.
  Status relieve(Sequence &seq, uint64_t pages, void *stream);
  // Disowns the sequence's jobs, waits for the one the pager may be doing,
  // and settles what came back: the sequence's pages are each resident or
  // on disk afterwards (for eviction, saving and destruction).
  void settle(Sequence &seq);
  // Gives every extent of the sequence's cold pages back (its destruction).
  void release(Sequence &seq) noexcept;
  // Reads page p of a head from its extent into dst (a save).
  Status read_page(const HeadState &hs, uint32_t p, uint8_t *dst);

 private:
  struct Job {
    std::shared_ptr<ColdShared> owner;
    uint64_t gen = 0;
    bool write = false;
    uint32_t layer = 0, head = 0, page = 0;
    const uint8_t *src = nullptr;  // write: the page's slot
    SpillExtent extent;            // read
  };
  struct Victim {
    uint32_t hot, page, layer, head;
  };

  // What an install changes beyond the host's tables: device page table
  // entries to point again, slots to give back.
  struct Changes {
    std::vector<std::pair<HeadState *, uint32_t>> point;  // (head, page)
    std::vector<PageId> freed;
  };
  void install(Sequence &seq, void *stream);
  void install_one(Sequence &seq, const ColdShared::Done &d, Changes &ch);
  // Points the device's page table entries and gives the slots back: at
  // once with `now` (no step in flight reads them), else after the steps
  // in flight.
  void apply(Changes &ch, void *stream, bool now);
  // Takes the reports of the lookup of L at stamp `before` (CUDA).
  void take_reports(LayerState &L, uint64_t before);
  // The sequence's coldest pages that may go, at most n of them.
  std::vector<Victim> choose(Sequence &seq, uint64_t n);
  // Waits for the step of `t` at `epoch` (a gather), or a device error.
  Status wait_for(const StepTracker &t, uint64_t epoch);
  void submit(std::vector<Job> &jobs);
  void run();
  void run_batch(std::vector<Job> &batch);

  Options opts_;
  uint64_t reserve_ = 0;
  uint32_t max_growth_segments_ = 1;
  SpillFile &spill_;
  HostArena &arena_;
  EngineCounters &counters_;
  Backend &backend_;
  BufferManager &buffers_;
  uint32_t want_cap_ = 0;  // cluster ids a report holds
  std::mutex mu_;  // guards the queue
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool stop_ = false;
  std::thread thread_;
};

// A lookup stamp as ColdPages::last_used holds it (saturating at 2^32 - 1).
uint32_t cold_stamp(uint64_t stamp);
// Sizes a head's cold arrays to its pages and clusters (new clusters get
// `stamp`).
void cold_fit(HeadState &hs, uint64_t stamp);
// Whether every page of cluster c is resident; a page being written is
// kept (its write is disowned), a page on disk is added to hs.cold.want.
bool cold_resident(HeadState &hs, uint32_t c, uint32_t page_tokens);

}  // namespace wkv
