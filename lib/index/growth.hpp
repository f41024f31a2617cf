// The index's one growth path, for both backends: appends to the steady
// zone, segment cuts and seeds, page allocation, the commit of a growth to
// the meta index, the mapping table and its device mirror, and the rollback
// of a growth that fails. The backend contributes the k-means and the copies
// (Backend's cluster, write_pages and mem_*), nothing else: the same input
// gives the same cuts and seeds on every backend.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include "lib/backend/backend.hpp"
#include "lib/buffer/buffer_manager.hpp"
#include "lib/common/config.hpp"
#include "lib/common/counters.hpp"
#include "lib/common/faults.hpp"
#include "lib/common/status.hpp"
#include "lib/common/thread_pool.hpp"
#include "lib/index/head.hpp"
#include "lib/store/host_arena.hpp"

namespace wkv {

// What the index works with: the engine's parts, by reference.
struct IndexContext {
  const Config &cfg;
  Backend &backend;
  HostArena &arena;
  ThreadPool &pool;
  EngineCounters &counters;
  BufferManager &buffers;
  std::mutex &growth_mu;  // one growth at a time (the backend's k-means workspace)
  FaultInjector *faults = nullptr;  // kGrowth
  // When the arena refuses pages for the budget: frees at least n pages of
  // the growing sequence (lib/engine/cold.hpp), after which the growth
  // allocates again; `stream` is the growth's. Empty: the refusal stands.
  std::function<Status(uint64_t n, void *stream)> relieve = nullptr;
  // With `relieve`: segments one growth clusters at most (0: no bound), so
  // that a long prompt's pages never need more of the budget at once than
  // the spill tier can free.
  uint32_t max_growth_segments = 0;
  // Reads a page that is not resident (map.pages[p] == kNoPage) into dst:
  // a snapshot of a sequence with cold pages. Empty: no page may be cold.
  std::function<Status(const HeadState &, uint32_t p, uint8_t *dst)> read_cold = nullptr;
  // Tokens from a generated segment's completion to its growth's commit
  // (kGrowthLagTokens; tests set others).
  uint32_t growth_lag = 0;
};

// WKV_METHOD_OUTLIERS: a segment's members whose squared distance to their
// centroid exceeds kOutlierRatio times the segment's mean become clusters of
// one, at most kOutlierShare of its tokens (kernels::split_outliers).
constexpr float kOutlierRatio = 1.5f;
constexpr float kOutlierShare = 0.005f;

// Outliers a segment of `tokens` may have under `method`.
uint32_t outlier_cap(uint32_t method, uint32_t tokens);

// The seed of the k-means of the segment of (layer, head) that begins at
// token `token_begin`: independent streams per segment, the same on every
// backend and however the prompt was split into appends.
uint64_t segment_seed(uint64_t seed, uint32_t layer, uint32_t head, uint64_t token_begin);

// Tokens a generated segment's growth stays pending, on every backend: its
// k-means runs beside the decoding steps of those tokens (CUDA: on the
// engine's growth stream). A segment completes at token
// tail_begin + window + update_segment; its growth commits in the append
// that brings the layer to kGrowthLagTokens more (its commit point), so that
// where a growth commits depends on the tokens alone: not on timing, the
// backend, how the tokens were split into appends, nor a save and load in
// between. 32 tokens: at batch 7 on the H100 the k-means of a token's
// growths (every layer's, completing together) takes a few tokens'
// decoding; the cost is up to 32 more tokens per head attended exactly.
constexpr uint32_t kGrowthLagTokens = 32;

// A growth begun and not committed (LayerState::pending): its segments are
// the front of every head's tail, count of them (the last last_tokens
// long), segment i of head h being job h * count + i; the k-means batch is
// the backend's until the growth commits or is dropped.
struct PendingGrowth {
  ClusterBatch *batch = nullptr;
  uint32_t count = 0, seg_tokens = 0, last_tokens = 0;
  bool generated = false;
  std::vector<ClusterJob> jobs;
  std::vector<uint32_t> first_row, seg_pages, seg_first_page;
  uint32_t npages = 0;
  uint64_t clusters_max = 0;  // the batch's clusters at most
  uint64_t commit_at = 0;     // the commit point: the append reaching it commits
};

// Appends n tokens' K and V rows to a layer: k and v point at token 0,
// head 0 on the engine's device, strides in elements. Clusters the segments
// that complete (the backend's prompt batching decides when, not where).
// All or nothing: on an error nothing is appended and every token stored
// before is intact. The three steps below, for one layer.
Status append_tokens(const IndexContext &ix, LayerState &L, uint32_t layer, const uint8_t *k, const uint8_t *v,
                     uint32_t n, int64_t token_stride, int64_t head_stride, void *stream);

// An append in three steps, so that a batch of sequences shares one copy:
//   stage_append   room for n more rows in every head of the layer (may move
//                  the live rows to new regions; nothing visible changes)
//   append_copies  the copies that write the staged rows, from byte offset
//                  src_off of the caller's tensors (token and head strides
//                  in bytes), added to *out
//   commit_append  counts the rows, once the copies are enqueued, and
//                  clusters the segments that complete; on an error the
//                  layer is as before the stage
// A generating layer's growth is off the decoding path: commit_append
// begins the k-means of a completed update segment and returns without
// waiting for it (the segment stays in the tail, attended exactly); the
// commit_append that reaches the segment's commit point (above) commits
// the growth, before it counts its own rows, and fails, appending nothing,
// if the commit does (the segment then stays in the tail and its growth
// begins again at the next append). Nothing waits for the caller's stream;
// the commit waits for the k-means only if it is not done (counted).
struct StagedAppend {
  uint32_t n = 0;
  uint64_t to_sink = 0, to_tail = 0;  // of the n rows
};
Status stage_append(const IndexContext &ix, LayerState &L, uint32_t n, StagedAppend *out, void *stream);
Status append_copies(const IndexContext &ix, const LayerState &L, const StagedAppend &sa, uint64_t src_off,
                     uint64_t token_pitch, uint64_t head_pitch, std::vector<RowCopy> *out);
Status commit_append(const IndexContext &ix, LayerState &L, uint32_t layer, const StagedAppend &sa, void *stream,
                     bool begin_growths = true);
// A captured step's append (lib/engine/binding.hpp) in the same steps, in
// another order: its copies run after the host's part (a replay follows
// wkv_plan_prepare), so the growths an append would begin after its copies
// begin at the next prepare instead, and a commit comes before the rows are
// staged (its trim may move the tail).
//   begin_due     begins the growth of a generating layer's completed
//                 segment, if one waits (the work enqueued on `stream` so
//                 far writes its rows): the commit point is the same as had
//                 the append that completed it begun it (kGrowthLagTokens
//                 later, so never before this)
//   commit_due    commits the pending growth if the append of n rows
//                 reaches its point (before staging them), then trims the
//                 tails; on an error the growth is dropped (the segment
//                 stays in the tail) and nothing else changes
//   commit_append with begin_growths false, after stage_append: counts
//   uncount_append  takes back rows counted by commit_append that were never
//                 written (a prepared step that failed, or never ran); the
//                 rows' room stays
Status begin_due(const IndexContext &ix, LayerState &L, uint32_t layer, void *stream, bool *began);
Status commit_due(const IndexContext &ix, LayerState &L, uint32_t n, void *stream);
void uncount_append(const IndexContext &ix, LayerState &L, const StagedAppend &sa, uint64_t tail_begin_before);
// Whether begin_due would begin a growth (a generating layer with no growth
// pending and a segment complete beyond the window).
bool growth_due(const IndexContext &ix, const LayerState &L);
// Whether commit_append of `sa` will only count rows: no growth begins or
// commits, so it enqueues nothing and cannot fail (an append may then end
// its step with its copies: Backend::copy_rows_then_end).
bool commit_is_quiet(const IndexContext &ix, const LayerState &L, const StagedAppend &sa);

// Ends the prompt of a layer: clusters what the prompt holds beyond the
// window and switches the layer to generated-token segments. A no-op once
// generating or without tokens. All or nothing.
Status end_prompt(const IndexContext &ix, LayerState &L, uint32_t layer, void *stream);

// Creates the heads of a new layer (their mirrors registered with the
// backend).
void init_layer(const IndexContext &ix, LayerState *L);

// Gives back everything a layer holds: engine memory and pages once no step
// in flight can read them. `counted`: the layer's tokens, segments and
// clusters are in the engine's counters (false for a layer being built).
// Never throws.
void release_layer(const IndexContext &ix, LayerState &L, bool counted = true) noexcept;

// The device mirror of a head's mapping table (no-op on a host-memory
// backend), the one code path that builds it. mirror_reserve makes room for
// `clusters`, `pages` and `units` (cleared unit map chunks included; may
// fail for memory and then changes nothing a step reads); mirror_fill_entries
// copies n_clusters entries from cluster c0 on and the addresses of n_pages
// pages from page p0 on, from host arrays of any kind (fails only if the
// device does, or for host memory); mirror_fill copies the host table's
// entries from c0 and p0 to its end. A growth's commit writes the same
// entries with the rest of its spans (growth.cpp, mirror_entry_spans).
Status mirror_reserve(const IndexContext &ix, HeadState &h, uint32_t clusters, uint32_t pages, uint32_t units,
                      void *stream);
Status mirror_fill_entries(const IndexContext &ix, HeadState &h, uint32_t c0, const uint32_t *first_slot,
                           const uint32_t *size, const uint32_t *unit_begin, uint32_t n_clusters, uint32_t p0,
                           const PageId *pages, uint32_t n_pages, void *stream);
Status mirror_fill(const IndexContext &ix, HeadState &h, uint32_t c0, uint32_t p0, void *stream);

// Whether heads keep the compact copies of their centroids and value sums
// that the device's logits and estimate read: engines on a device backend
// with a 16-bit storage dtype.
bool keeps_meta16(const IndexContext &ix);
// Whether those copies are the 8-bit ones (MetaIndex::centroid8 and
// value_sum8 with their scales) rather than f16 (centroid16, value_sum16):
// where the backend's meta rows are 8 bits and a lane's slice of a row is
// whole words (the logits' eight lanes a row: d a multiple of 32).
bool meta_rows8(const Backend &backend, uint32_t head_dim);
// Whether heads keep the CPU engine's compact mirror that append_compact
// writes: engines on a host-memory backend with a 16-bit storage dtype.
bool keeps_compact(const IndexContext &ix);
// Room in a head's compact mirror for `clusters` clusters in all, in every
// array append_compact writes (growing by doubling). Throws std::bad_alloc.
void compact_reserve(MetaIndex *meta, size_t clusters, uint32_t d);
// Appends n clusters' rows to a CPU engine's compact mirror (MetaIndex: the
// centroids and the value means VS / size, each in 8 bits with a scale a
// row, quantize_row's format), or drops the mirror for good (compact_ok
// false) when a centroid or a value mean is not finite. Pre: room for them
// is reserved (no allocation, no throw).
void append_compact(const float *centroid, const float *value_sum, const uint32_t *size, uint32_t n, uint32_t d,
                    MetaIndex *meta);
// The copies' two operations, the one code path that knows their layout
// (kernels::kMeta16Header bytes, then the rows). meta16_reserve makes room
// for `clusters` rows in each keeping the head's, and clears the overflow
// word of a new copy (a no-op unless keeps_meta16; may fail for memory and
// then changes nothing a step reads); meta16_write narrows (or quantizes)
// n f32 rows of centroids at `centroid` and of value sums at `value_sum`
// (engine memory) into rows c0 .. c0 + n of the copies (a no-op without
// them).
Status meta16_reserve(const IndexContext &ix, HeadState &h, size_t clusters, void *stream);
Status meta16_write(const IndexContext &ix, HeadState &h, size_t c0, const float *centroid, const float *value_sum,
                    size_t n, void *stream);

// Ensures r holds `bytes`, keeping its first `keep` bytes (geometric growth);
// the replaced region is freed once no step in flight can read it. `use`
// says where a new region comes from (Backend::mem_alloc).
Status grow_region(const IndexContext &ix, Region *r, size_t bytes, size_t keep, void *stream,
                   Backend::MemUse use = Backend::MemUse::kEngine);

// Reserves hs.by_size for n new clusters of the given sizes (throws
// std::bad_alloc), so that count_clusters allocates nothing for them.
void reserve_sizes(HeadState &hs, const uint32_t *sizes, size_t n);
// Counts n new clusters of the given sizes into hs (by_size, max_cluster,
// ones), then recomputes the retrieval bound (ret_n, ret_tokens,
// ret_units) for the zone rule of cfg at the head's clusters now. Pre:
// reserve_sizes for them.
void count_clusters(const Config &cfg, HeadState &hs, const uint32_t *sizes, size_t n);

}  // namespace wkv
