// A backend-neutral snapshot of the heads of one layer of a sequence: what
// they hold, in host memory, in the layouts of lib/index/head.hpp, without
// anything either backend keeps for itself (regions, mirrors, cache frames,
// page ids). A snapshot taken from a CPU engine imports into a CUDA engine
// and the other way round; it is what a sequence file holds, what the spill
// tier moves, and how a head moves between engines.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lib/common/status.hpp"
#include "lib/index/growth.hpp"

namespace wkv {

// What a file holds of a head. Everything else of a HeadState is derived
// at import: the unit map from the sizes, the head's mean value (ValueMean)
// from the value sums by segment, the count of clusters of one, the CPU
// engine's compact 8-bit mirror.
struct HeadSnapshot {
  std::vector<uint8_t> sink_k, sink_v;  // [sink rows][row_bytes]
  std::vector<uint8_t> tail_k, tail_v;  // [tail rows][row_bytes]
  std::vector<SegmentDesc> segments;
  std::vector<float> centroid, value_sum;  // [clusters][head_dim]
  // [clusters]: mean squared distance of each cluster's keys to its
  // centroid (MetaIndex). Empty in a snapshot written before clusters had
  // a spread: import then computes it from the pages' keys.
  std::vector<float> spread;
  std::vector<uint32_t> first_slot, size;  // [clusters]
  // [pages][page_slot_bytes]: K rows, then V rows (and with 8-bit rows, K
  // scales then V scales: Config::page_scales_at)
  std::vector<uint8_t> pages;
};

// The settings a snapshot's layout depends on; a target engine must match.
struct SnapshotShape {
  uint32_t n_kv_heads = 0, head_dim = 0, dtype = 0;
  uint32_t page_format = 0;  // WKV_PAGE_FORMAT_*
  uint32_t page_tokens = 0, page_slot_bytes = 0;
  uint32_t sink_tokens = 0, window_tokens = 0;
  uint32_t segment_tokens = 0, update_segment_tokens = 0;
};

struct LayerSnapshot {
  SnapshotShape shape;
  uint64_t tokens = 0, tail_begin = 0;
  bool generating = false;
  std::vector<HeadSnapshot> heads;
};

SnapshotShape snapshot_shape(const Config &cfg);

// Copies a layer into a snapshot. Waits for `stream` (the layer's appends
// and growths must be on it or done).
Status export_layer(const IndexContext &ix, const LayerState &L, LayerSnapshot *out, void *stream);

// Checks a snapshot against the engine's shape and against itself (every
// array its size, every cluster within its pages, segments in order):
// WKV_ERR_INVALID_ARGUMENT saying what differs or what is inconsistent.
Status check_snapshot(const Config &cfg, const LayerSnapshot &s);

// Builds a layer from a snapshot into *L, which must be empty (no token).
// All or nothing. Pre: check_snapshot passed.
Status import_layer(const IndexContext &ix, const LayerSnapshot &s, LayerState *L, void *stream);

}  // namespace wkv
