// The state of one (sequence, layer, KV head): everything the engine knows
// of it, in one type with one owner (its sequence), used by both backends.
//
//   steady zone    the sink's rows and the unclustered tail's rows
//   segments       runs of tokens clustered together, in token order
//   meta index     per cluster: centroid, value sum and spread (f32)
//   mapping table  per cluster: its first token slot and size; the page list
//   mirror         the device's copy of the mapping table (CUDA engines only),
//                  written by lib/index/growth.cpp alone, after the host's
//
// Bulk arrays (rows, centroids, value sums, the mirror) live in engine memory:
// host memory on a CPU engine, device memory on a CUDA engine. A Region is a
// block of it, allocated, copied and freed through the backend (Backend's
// mem_* functions); its layout is the same on both. Everything else is host
// memory. Nothing here knows which backend it serves: a head moves between
// engines as a HeadSnapshot (lib/index/snapshot.hpp).
//
// A cluster's members are stored contiguously in cluster order in the token
// slots of the head's page list: member m of cluster c is in slot
// first_slot[c] + m, that is page pages[slot / page_tokens], row
// slot % page_tokens. Each segment starts on a fresh page.
//
// For the device block cache a cluster is cut into units of page_tokens
// members (the last one shorter): unit j of cluster c holds members
// [j * page_tokens, (j + 1) * page_tokens), has index unit_begin[c] + j in
// the head, and is laid out like a page (K rows, then V rows). The mirror's
// unit map says, per unit, which device cache frame holds it (or none).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/device_layout.hpp"
#include "kernels/dtype.hpp"
#include "lib/common/meta_alloc.hpp"
#include "lib/store/host_arena.hpp"
#include "lib/store/spill.hpp"

namespace wkv {

class StepTracker;

// A block of engine memory.
struct Region {
  uint8_t *p = nullptr;
  size_t bytes = 0;  // capacity
  template <typename T> T *as() const { return reinterpret_cast<T *>(p); }
};

// K and V rows in engine memory, [rows][row_bytes] each. Live rows are
// [begin, begin + n) of the regions: consuming from the front only moves
// begin; appending may move the live rows to the front of new regions.
struct Rows {
  Region k, v;
  uint64_t begin = 0, n = 0;
  uint64_t cap = 0;  // rows the regions hold
  size_t row_bytes = 0;
  uint8_t *k_at(uint64_t i) const { return k.p + (begin + i) * row_bytes; }
  uint8_t *v_at(uint64_t i) const { return v.p + (begin + i) * row_bytes; }
};

// A run of tokens clustered together.
struct SegmentDesc {
  uint64_t token_begin;    // first token of the sequence it covers
  uint32_t tokens;         // tokens in the segment
  uint32_t cluster_begin;  // first cluster id
  uint32_t clusters;       // clusters (empty ones dropped)
  uint32_t page_begin;     // first index into the head's page list
  uint32_t pages;
  uint32_t generated;      // 1 if made of generated tokens
};

// Per cluster c < clusters: centroid[c * d .. + d), the plain mean of its
// member keys, value_sum[c * d .. + d), the sum of their values, and
// spread[c], the mean squared distance of its member keys to the centroid,
// f32 in engine memory. Scoring streams every centroid at every step and
// estimation a quarter of the value rows, so the steps read compact copies
// where there are (engines with a 16-bit storage dtype; fewer bytes is
// about as much less time):
// - on a CPU engine, a mirror of the centroids and of the value means
//   VS / size, each in 8 bits a component with a scale a row
//   (kernels/dtype.hpp's quantize_row: centroid_q8, centroid_q8_scale,
//   value_mean_q8, value_mean_q8_scale); empty for good once a value is not
//   finite (compact_ok false), when the step reads the f32 arrays;
// - on a CUDA engine, in device memory, the centroids and the value sums in
//   8 bits (centroid8, value_sum8: an overflow word the device sets when a
//   row is not finite, then [clusters][d] int8; centroid8_scale,
//   value_sum8_scale: [clusters] f32), or in f16 where the backend keeps
//   16-bit meta rows or d is not a multiple of 32 (centroid16, value_sum16,
//   laid out likewise with f16 rows, the word set when a value does not
//   fit), which the logits and the estimate read (kernels::DevRun). The f32
//   arrays stay: saves read them, and a step reads them where a copy
//   overflowed.
struct MetaIndex {
  Region centroid, value_sum, spread;
  Region centroid16, centroid8, centroid8_scale, value_sum16, value_sum8, value_sum8_scale;
  MetaVector<int8_t> centroid_q8;
  MetaVector<float> centroid_q8_scale;
  MetaVector<int8_t> value_mean_q8;
  MetaVector<float> value_mean_q8_scale;
  bool compact_ok = true;  // the mirror holds every cluster
};

// The cluster mapping table (host): where each cluster's members are.
struct MappingTable {
  MetaVector<uint32_t> first_slot;  // [clusters]
  MetaVector<uint32_t> size;        // [clusters]
  MetaVector<uint32_t> unit_begin;  // [clusters + 1]: units before cluster c
  MetaVector<PageId> pages;         // the head's host pages
  uint32_t clusters() const { return static_cast<uint32_t>(size.size()); }
  uint32_t units() const { return unit_begin.empty() ? 0 : unit_begin.back(); }
};

// Entries of one chunk of a unit map: chunks never move, so that the buffer
// manager may store into them while growths extend the map.
constexpr uint32_t kUnitChunk = kernels::kUnitMapChunk;
// A unit map entry of a unit no cache frame holds.
constexpr uint32_t kNoFrame = kernels::kNoCacheFrame;

// The device's copy of a head's mapping table (CUDA engines). first_slot,
// size and unit_begin as in MappingTable; pages[p] the device-accessible
// address of page p; unit_dir[i] the device address of unit map chunk i,
// whose entries are frames of the device cache or kNoFrame.
// With cold pages (Config::cold_pages), stamps[c] is the lookup stamp of
// cluster c's latest retrieval, written by the device's selection (the
// cold tier's recency); pages[p] is null while page p is out.
struct HeadMirror {
  Region first_slot, size, unit_begin, pages, unit_dir;
  Region stamps;
  MetaVector<Region> unit_chunks;  // host list of the chunks unit_dir points at
  uint32_t cache_id = 0;           // the head's id in the buffer manager (0: none)
  uint32_t cache_gen = 0;
};

// The head's mean value over its clustered tokens, which estimates the
// clusters beyond the estimation zone (WKV_METHOD_TAIL): value_total, the
// sum of the segments' value totals (each the sum of its clusters' f32
// value sums in cluster order, in double), in segment order, and mean
// (engine memory, f32 [d]) = value_total / tokens.
struct ValueMean {
  MetaVector<double> value_total;  // [d] host
  uint64_t tokens = 0;             // clustered tokens
  Region mean;
};

// Cold pages (lib/engine/cold.hpp): pages of the head written to the spill
// file under host-budget pressure, on CPU engines with a spill file and a
// host budget. Such a page's map.pages entry is kNoPage and its extent is
// extent[p]; a retrieval-zone cluster with a page not resident is
// estimated instead, and its pages are read back for later steps.
// last_used[c] is the sequence's lookup stamp when cluster c was last
// retrieved (or created): the replacement's recency. Empty until used.
struct ColdPages {
  // kKept: resident, wanted again while being written; the disowned write
  // still reads its slot, so the page may neither go again nor lose its
  // slot until that write is done.
  enum State : uint8_t { kResident = 0, kOnDisk, kReading, kWriting, kFailed, kKept };
  MetaVector<uint32_t> last_used;  // [clusters]
  MetaVector<uint8_t> state;       // [pages]
  MetaVector<SpillExtent> extent;  // [pages]: valid unless kResident / kWriting
  MetaVector<uint32_t> want;       // pages the last lookup asks to read back
  uint32_t out = 0;                // pages not resident
  // CUDA: a host page the device's selection reports the retrieval-zone
  // clusters it found out in (kernels::DevRun::wants); kNoPage: none yet.
  PageId report = kNoPage;
};

struct HeadState {
  Rows sink, tail;
  MetaVector<SegmentDesc> segments;
  MetaIndex meta;
  MappingTable map;
  HeadMirror mirror;
  ValueMean values;
  ColdPages cold;
  uint32_t max_cluster = 0;  // largest cluster size
  uint32_t ones = 0;         // clusters of one member
  // Clusters by size: by_size[s] clusters of s members (s <= max_cluster),
  // and what the retrieval zone can hold at the head's clusters now (the
  // n_ret largest, n_ret as the zone rule gives it: count_clusters): so a
  // lookup sizes its execution buffer by real sizes, not n_ret times the
  // largest.
  MetaVector<uint32_t> by_size;
  uint32_t ret_n = 0;        // the n_ret the bound below is for
  uint64_t ret_tokens = 0;   // members of the ret_n largest clusters
  uint64_t ret_units = 0;    // their cache units
  uint32_t clusters() const { return map.clusters(); }
};

// The cache units a retrieval zone of n_ret clusters holds at its largest,
// and so what a step may admit for the head: the n_ret largest clusters'
// units (HeadState::ret_units, kept by every growth), n_ret times the
// largest cluster's should the two ever disagree, never more than the
// head's units.
inline uint64_t ret_units_bound(const HeadState &hs, uint32_t n_ret, uint32_t page_tokens) {
  const uint64_t per_cluster = (hs.max_cluster + page_tokens - 1) / page_tokens;
  const uint64_t units = hs.ret_n == n_ret ? hs.ret_units : static_cast<uint64_t>(n_ret) * per_cluster;
  return units < hs.map.units() ? units : hs.map.units();
}

// A generated segment's growth whose k-means runs on the device while the
// layer decodes (lib/index/growth.hpp); the segment stays in the tail, the
// steady zone, until it commits.
struct PendingGrowth;
struct PendingGrowthFree {
  void operator()(PendingGrowth *p) const;
};

// The heads of one layer of a sequence and what they share: tokens
// [0, sink) sit in each head's sink, [tail_begin, tokens) in its tail, and
// everything between in clustered segments. Sink and tail are the steady
// zone.
struct LayerState {
  uint64_t tokens = 0;      // appended to this layer
  uint64_t tail_begin = 0;  // first unclustered token (>= the sink's tokens)
  bool generating = false;  // set when the prompt ends
  uint64_t version = 0;     // bumped by every change, checked by plans
  uint64_t last_lookup = 0; // the sequence's stamp of this layer's latest lookup
  // CUDA with cold pages: the tracker and epoch of the layer's latest
  // gather (whether a lookup is open is the sequence's: Sequence::
  // layer_open).
  std::shared_ptr<StepTracker> reader;
  uint64_t read_epoch = 0;
  // The sequence's step whose growth last wrote pages of the layer (the
  // device writes them after the call): none of them may be written out by
  // the host before that step has ended.
  uint64_t grown_epoch = 0;
  // The growth begun and not yet committed, if any (one at a time).
  std::unique_ptr<PendingGrowth, PendingGrowthFree> pending;
  std::vector<HeadState> heads;

  // The layer's pages (every head has as many): a call that changes the
  // count grew the layer, whose newest pages the device writes after the
  // call (grown_epoch).
  size_t pages() const { return heads.empty() ? 0 : heads[0].map.pages.size(); }
};

}  // namespace wkv
