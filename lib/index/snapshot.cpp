#include "lib/index/snapshot.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>

namespace wkv {
namespace {

Status copy_rows_out(const IndexContext &ix, const Rows &r, std::vector<uint8_t> *k, std::vector<uint8_t> *v,
                     void *stream) {
  const size_t bytes = r.n * r.row_bytes;
  k->resize(bytes);
  v->resize(bytes);
  if (bytes == 0) return Status::ok();
  WKV_RETURN_IF_ERROR(ix.backend.mem_copy(k->data(), r.k_at(0), bytes, stream));
  return ix.backend.mem_copy(v->data(), r.v_at(0), bytes, stream);
}

Status copy_rows_in(const IndexContext &ix, const std::vector<uint8_t> &k, const std::vector<uint8_t> &v,
                    size_t row_bytes, Rows *r, void *stream) {
  const uint64_t n = k.size() / row_bytes;
  r->row_bytes = row_bytes;
  if (n == 0) return Status::ok();
  WKV_RETURN_IF_ERROR(ix.backend.mem_alloc(n * row_bytes, stream, &r->k));
  WKV_RETURN_IF_ERROR(ix.backend.mem_alloc(n * row_bytes, stream, &r->v));
  r->cap = n;
  WKV_RETURN_IF_ERROR(ix.backend.mem_copy(r->k.p, k.data(), n * row_bytes, stream));
  WKV_RETURN_IF_ERROR(ix.backend.mem_copy(r->v.p, v.data(), n * row_bytes, stream));
  r->n = n;
  return Status::ok();
}

// The spread of every cluster of a checked snapshot from its pages' keys,
// as split_outliers computes it (kernels/cpu_kernels.hpp).
// With 8-bit pages the keys are the pages' rows dequantized to the storage
// dtype (centered rows against their cluster's reference), as attention
// reads them: such spreads differ a little from those a growth computes
// from the rows as appended.
std::vector<float> spread_from_pages(const HeadSnapshot &o, const Config &cfg) {
  const uint32_t d = cfg.c.head_dim, pt = cfg.page_tokens(), scales_at = cfg.page_scales_at();
  const size_t row = cfg.page_row_bytes(), slot = cfg.page_slot_bytes();
  const DType dt = cfg.dtype();
  const size_t C = o.size.size();
  std::vector<float> spread(C), key(d), ref(d);
  std::vector<uint8_t> deq(cfg.row_bytes());
  for (size_t c = 0; c < C; ++c) {
    const float *cen = o.centroid.data() + c * d;
    const bool has_ref = cfg.centered_keys() && centered_reference(cen, d, ref.data());
    double sum = 0.0;
    for (uint32_t m = 0; m < o.size[c]; ++m) {
      const uint64_t s = uint64_t(o.first_slot[c]) + m;
      const uint8_t *page = o.pages.data() + (s / pt) * slot;
      if (cfg.int8_pages()) {
        float scale;
        std::memcpy(&scale, page + scales_at + (s % pt) * 4, 4);
        const int8_t *q = reinterpret_cast<const int8_t *>(page + (s % pt) * row);
        if (has_ref)
          dequantize_row_centered(dt, q, scale, ref.data(), d, deq.data());
        else
          dequantize_row(dt, q, scale, d, deq.data());
        to_float(dt, deq.data(), key.data(), d);
      } else {
        to_float(dt, page + (s % pt) * row, key.data(), d);
      }
      double r = 0.0;
      for (uint32_t j = 0; j < d; ++j) {
        const double x = double(key[j]) - double(cen[j]);
        r += x * x;
      }
      sum += r;
    }
    spread[c] = static_cast<float>(sum / o.size[c]);
  }
  return spread;
}

// The head's value totals as its growths summed them (ValueMean: by
// segment, in order) into *v; returns the mean value.
std::vector<float> head_value_mean(const HeadSnapshot &o, uint32_t d, ValueMean *v) {
  std::vector<double> seg(d);
  v->value_total.assign(d, 0.0);
  v->tokens = 0;
  for (const SegmentDesc &g : o.segments) {
    std::fill(seg.begin(), seg.end(), 0.0);
    for (uint32_t c = g.cluster_begin; c < g.cluster_begin + g.clusters; ++c)
      for (uint32_t j = 0; j < d; ++j) seg[j] += o.value_sum[size_t(c) * d + j];
    for (uint32_t j = 0; j < d; ++j) v->value_total[j] += seg[j];
    v->tokens += g.tokens;
  }
  std::vector<float> mean(d);
  for (uint32_t j = 0; j < d; ++j) mean[j] = static_cast<float>(v->value_total[j] / static_cast<double>(v->tokens));
  return mean;
}

// Whether an 8-bit row and its scale are what quantize_row writes
// (kernels/dtype.hpp): a zero row with a scale of zero or kInt8NanScale, or
// a finite scale of a row at or above the floor with values in [-127, 127].
// Anything else, which only a crafted or damaged file holds, would decode
// differently on the two backends (an infinite scale makes 0 * inf, whose
// NaN's bits differ; a subnormal one, products that flush-to-zero alters).
bool int8_row_written(const uint8_t *row, float scale, uint32_t d) {
  constexpr float kMinScale = kInt8RowFloor / 127.0f, kMaxScale = std::numeric_limits<float>::max() / 127.0f;
  uint32_t bits;
  std::memcpy(&bits, &scale, 4);
  const int8_t *q = reinterpret_cast<const int8_t *>(row);
  if (scale == 0.0f || bits == kInt8NanScale)
    return bits != 0x80000000u && std::all_of(q, q + d, [](int8_t v) { return v == 0; });
  return scale >= kMinScale && scale <= kMaxScale && std::none_of(q, q + d, [](int8_t v) { return v == -128; });
}

#define SNAP_CHECK(cond, ...) \
  do {                        \
    if (!(cond)) return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, __VA_ARGS__); \
  } while (0)

}  // namespace

SnapshotShape snapshot_shape(const Config &cfg) {
  SnapshotShape s;
  s.n_kv_heads = cfg.c.n_kv_heads;
  s.head_dim = cfg.c.head_dim;
  s.dtype = cfg.c.dtype;
  s.page_format = cfg.c.page_format;
  s.page_tokens = cfg.page_tokens();
  s.page_slot_bytes = cfg.page_slot_bytes();
  s.sink_tokens = cfg.c.sink_tokens;
  s.window_tokens = cfg.c.window_tokens;
  s.segment_tokens = cfg.c.segment_tokens;
  s.update_segment_tokens = cfg.c.update_segment_tokens;
  return s;
}

Status export_layer(const IndexContext &ix, const LayerState &L, LayerSnapshot *out, void *stream) {
  const uint32_t d = ix.cfg.c.head_dim;
  const size_t slot = ix.cfg.page_slot_bytes();
  try {
    out->shape = snapshot_shape(ix.cfg);
    out->tokens = L.tokens;
    out->tail_begin = L.tail_begin;
    out->generating = L.generating;
    out->heads.assign(L.heads.size(), HeadSnapshot{});
    for (size_t h = 0; h < L.heads.size(); ++h) {
      const HeadState &hs = L.heads[h];
      HeadSnapshot &o = out->heads[h];
      WKV_RETURN_IF_ERROR(copy_rows_out(ix, hs.sink, &o.sink_k, &o.sink_v, stream));
      WKV_RETURN_IF_ERROR(copy_rows_out(ix, hs.tail, &o.tail_k, &o.tail_v, stream));
      o.segments.assign(hs.segments.begin(), hs.segments.end());
      const size_t C = hs.clusters();
      o.centroid.resize(C * d);
      o.value_sum.resize(C * d);
      o.spread.resize(C);
      if (C > 0) {
        WKV_RETURN_IF_ERROR(ix.backend.mem_copy(o.centroid.data(), hs.meta.centroid.p, C * d * 4, stream));
        WKV_RETURN_IF_ERROR(ix.backend.mem_copy(o.value_sum.data(), hs.meta.value_sum.p, C * d * 4, stream));
        WKV_RETURN_IF_ERROR(ix.backend.mem_copy(o.spread.data(), hs.meta.spread.p, C * 4, stream));
      }
      o.first_slot.assign(hs.map.first_slot.begin(), hs.map.first_slot.end());
      o.size.assign(hs.map.size.begin(), hs.map.size.end());
      o.pages.resize(hs.map.pages.size() * slot);
    }
    // Pages are written by the device in stream order: wait, then read.
    WKV_RETURN_IF_ERROR(ix.backend.mem_sync(stream));
    for (size_t h = 0; h < L.heads.size(); ++h) {
      const HeadState &hs = L.heads[h];
      for (size_t p = 0; p < hs.map.pages.size(); ++p) {
        uint8_t *dst = out->heads[h].pages.data() + p * slot;
        if (hs.map.pages[p] != kNoPage) {
          std::memcpy(dst, ix.arena.page_ptr(hs.map.pages[p]), slot);
          continue;
        }
        if (!ix.read_cold) return WKV_ERROR(WKV_ERR_INTERNAL, "a page of layer head %zu is not resident", h);
        WKV_RETURN_IF_ERROR(ix.read_cold(hs, static_cast<uint32_t>(p), dst));
      }
    }
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for a snapshot");
  }
  return Status::ok();
}

Status check_snapshot(const Config &cfg, const LayerSnapshot &s) {
  const SnapshotShape want = snapshot_shape(cfg);
  const SnapshotShape &got = s.shape;
  SNAP_CHECK(got.n_kv_heads == want.n_kv_heads && got.head_dim == want.head_dim && got.dtype == want.dtype,
             "snapshot shape (n_kv_heads %u, head_dim %u, dtype %u) differs from the engine's (%u, %u, %u)",
             got.n_kv_heads, got.head_dim, got.dtype, want.n_kv_heads, want.head_dim, want.dtype);
  SNAP_CHECK(got.page_format == want.page_format, "snapshot page format %s differs from the engine's (%s)",
             page_format_name(got.page_format), page_format_name(want.page_format));
  SNAP_CHECK(got.page_tokens == want.page_tokens && got.page_slot_bytes == want.page_slot_bytes,
             "snapshot pages (%u tokens, %u bytes) differ from the engine's (%u, %u)", got.page_tokens,
             got.page_slot_bytes, want.page_tokens, want.page_slot_bytes);
  SNAP_CHECK(got.sink_tokens == want.sink_tokens && got.window_tokens == want.window_tokens &&
                 got.segment_tokens == want.segment_tokens && got.update_segment_tokens == want.update_segment_tokens,
             "snapshot zones (sink %u, window %u, segments %u / %u) differ from the engine's (%u, %u, %u / %u)",
             got.sink_tokens, got.window_tokens, got.segment_tokens, got.update_segment_tokens, want.sink_tokens,
             want.window_tokens, want.segment_tokens, want.update_segment_tokens);
  SNAP_CHECK(s.heads.size() == want.n_kv_heads, "snapshot has %zu heads, the engine %u", s.heads.size(),
             want.n_kv_heads);
  const size_t row = cfg.row_bytes(), slot = want.page_slot_bytes;
  const uint32_t d = want.head_dim, pt = want.page_tokens;
  const uint64_t sink = std::min<uint64_t>(s.tokens, want.sink_tokens);
  SNAP_CHECK(s.tail_begin >= sink && s.tail_begin <= s.tokens, "snapshot tail begins at %llu of %llu tokens",
             static_cast<unsigned long long>(s.tail_begin), static_cast<unsigned long long>(s.tokens));
  for (size_t h = 0; h < s.heads.size(); ++h) {
    const HeadSnapshot &o = s.heads[h];
    SNAP_CHECK(o.sink_k.size() == sink * row && o.sink_v.size() == o.sink_k.size(),
               "head %zu: the sink holds %zu bytes, not %llu rows", h, o.sink_k.size(),
               static_cast<unsigned long long>(sink));
    const uint64_t tail = s.tokens - s.tail_begin;
    SNAP_CHECK(o.tail_k.size() == tail * row && o.tail_v.size() == o.tail_k.size(),
               "head %zu: the tail holds %zu bytes, not %llu rows", h, o.tail_k.size(),
               static_cast<unsigned long long>(tail));
    const size_t C = o.size.size();
    SNAP_CHECK(o.first_slot.size() == C && o.centroid.size() == C * d && o.value_sum.size() == C * d,
               "head %zu: %zu cluster sizes but %zu first slots, %zu centroid and %zu value sum values", h, C,
               o.first_slot.size(), o.centroid.size(), o.value_sum.size());
    SNAP_CHECK(o.spread.size() == C || o.spread.empty(), "head %zu: %zu cluster sizes but %zu spreads", h, C,
               o.spread.size());
    SNAP_CHECK(o.pages.size() % slot == 0, "head %zu: page bytes %zu not a multiple of %zu", h, o.pages.size(),
               slot);
    const uint64_t n_pages = o.pages.size() / slot;
    // Segments tile [sink, tail_begin) in order, clusters and pages too.
    uint64_t token = sink, cluster = 0, page = 0;
    for (size_t i = 0; i < o.segments.size(); ++i) {
      const SegmentDesc &g = o.segments[i];
      SNAP_CHECK(g.token_begin == token && g.cluster_begin == cluster && g.page_begin == page &&
                     g.tokens > 0 && g.pages == (g.tokens + pt - 1) / pt && g.clusters <= g.tokens,
                 "head %zu: segment %zu is out of order or inconsistent", h, i);
      uint64_t members = 0;
      for (uint64_t c = g.cluster_begin; c < uint64_t(g.cluster_begin) + g.clusters; ++c) {
        SNAP_CHECK(c < C && o.size[c] > 0, "head %zu: segment %zu names cluster %llu of %zu", h, i,
                   static_cast<unsigned long long>(c), C);
        const uint64_t first = o.first_slot[c];
        SNAP_CHECK(first == (page * pt + members) && first + o.size[c] <= (page + g.pages) * pt,
                   "head %zu: cluster %llu lies outside its segment's pages", h, static_cast<unsigned long long>(c));
        members += o.size[c];
      }
      SNAP_CHECK(members == g.tokens, "head %zu: segment %zu has %llu members for %u tokens", h, i,
                 static_cast<unsigned long long>(members), g.tokens);
      token += g.tokens;
      cluster += g.clusters;
      page += g.pages;
    }
    SNAP_CHECK(token == s.tail_begin && cluster == C && page == n_pages,
               "head %zu: segments cover %llu tokens, %llu clusters, %llu pages (expected %llu, %zu, %llu)", h,
               static_cast<unsigned long long>(token), static_cast<unsigned long long>(cluster),
               static_cast<unsigned long long>(page), static_cast<unsigned long long>(s.tail_begin), C,
               static_cast<unsigned long long>(n_pages));
    if (!cfg.int8_pages()) continue;
    // 8-bit rows: every token's K and V row as quantize_row writes them.
    const uint32_t scales = cfg.page_scales_at();
    for (const SegmentDesc &g : o.segments)
      for (uint64_t at = uint64_t(g.page_begin) * pt; at < uint64_t(g.page_begin) * pt + g.tokens; ++at) {
        const uint8_t *pg = o.pages.data() + (at / pt) * slot;
        for (uint32_t r : {uint32_t(at % pt), uint32_t(pt + at % pt)}) {
          float scale;
          std::memcpy(&scale, pg + scales + size_t(r) * 4, 4);
          SNAP_CHECK(int8_row_written(pg + size_t(r) * d, scale, d),
                     "head %zu: the 8-bit %s row of token slot %llu (scale %g) is none that quantization writes", h,
                     r < pt ? "K" : "V", static_cast<unsigned long long>(at), static_cast<double>(scale));
        }
      }
  }
  return Status::ok();
}

Status import_layer(const IndexContext &ix, const LayerSnapshot &s, LayerState *out, void *stream) {
  const uint32_t d = ix.cfg.c.head_dim, pt = ix.cfg.page_tokens();
  const size_t row = ix.cfg.row_bytes(), slot = ix.cfg.page_slot_bytes();
  // Built aside, then moved in: a failure releases what the build took.
  LayerState L;
  init_layer(ix, &L);
  struct Guard {
    const IndexContext &ix;
    LayerState &L;
    bool keep = false;
    ~Guard() {
      if (!keep) release_layer(ix, L, false);
    }
  } guard{ix, L};
  uint64_t steady = 0, clusters = 0, segments = 0;
  for (size_t h = 0; h < s.heads.size(); ++h) {
    const HeadSnapshot &o = s.heads[h];
    HeadState &hs = L.heads[h];
    WKV_RETURN_IF_ERROR(copy_rows_in(ix, o.sink_k, o.sink_v, row, &hs.sink, stream));
    WKV_RETURN_IF_ERROR(copy_rows_in(ix, o.tail_k, o.tail_v, row, &hs.tail, stream));
    steady += hs.sink.n + hs.tail.n;
    const size_t C = o.size.size(), n_pages = o.pages.size() / slot;
    try {
      hs.segments.assign(o.segments.begin(), o.segments.end());
      hs.map.first_slot.assign(o.first_slot.begin(), o.first_slot.end());
      hs.map.size.assign(o.size.begin(), o.size.end());
      hs.map.unit_begin.resize(C + 1);
      for (size_t c = 0; c < C; ++c) hs.map.unit_begin[c + 1] = hs.map.unit_begin[c] + (o.size[c] + pt - 1) / pt;
      hs.map.pages.resize(n_pages);
    } catch (const std::bad_alloc &) {
      return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory importing a head");
    }
    // Pages first, so that a failure below gives them back with the layer.
    Status st = ix.arena.allocate(static_cast<uint32_t>(n_pages), hs.map.pages.data());
    if (!st.is_ok()) {
      hs.map.pages.clear();
      return st;
    }
    for (size_t p = 0; p < n_pages; ++p) std::memcpy(ix.arena.page_ptr(hs.map.pages[p]), o.pages.data() + p * slot, slot);
    if (C > 0) {
      std::vector<float> spread;
      std::vector<float> mean;
      try {
        if (o.spread.empty()) spread = spread_from_pages(o, ix.cfg);
        mean = head_value_mean(o, d, &hs.values);
      } catch (const std::bad_alloc &) {
        return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory importing a head");
      }
      WKV_RETURN_IF_ERROR(grow_region(ix, &hs.meta.centroid, C * d * 4, 0, stream, Backend::MemUse::kMetaRows));
      WKV_RETURN_IF_ERROR(grow_region(ix, &hs.meta.value_sum, C * d * 4, 0, stream, Backend::MemUse::kMetaRows));
      WKV_RETURN_IF_ERROR(grow_region(ix, &hs.meta.spread, C * 4, 0, stream));
      WKV_RETURN_IF_ERROR(grow_region(ix, &hs.values.mean, d * 4, 0, stream));
      // Rows in host memory (WKV_CONFIG_HOST_META_ROWS) come from a pool in
      // stream order: the stream reaches their allocation before the host
      // writes them (a cold path: loads only).
      if (ix.backend.mem_mapped_host(Backend::MemUse::kMetaRows)) WKV_RETURN_IF_ERROR(ix.backend.mem_sync(stream));
      WKV_RETURN_IF_ERROR(ix.backend.mem_copy(hs.meta.centroid.p, o.centroid.data(), C * d * 4, stream));
      WKV_RETURN_IF_ERROR(ix.backend.mem_copy(hs.meta.value_sum.p, o.value_sum.data(), C * d * 4, stream));
      WKV_RETURN_IF_ERROR(
          ix.backend.mem_copy(hs.meta.spread.p, o.spread.empty() ? spread.data() : o.spread.data(), C * 4, stream));
      WKV_RETURN_IF_ERROR(ix.backend.mem_copy(hs.values.mean.p, mean.data(), d * 4, stream));
      WKV_RETURN_IF_ERROR(meta16_reserve(ix, hs, C, stream));
      WKV_RETURN_IF_ERROR(
          meta16_write(ix, hs, 0, hs.meta.centroid.as<float>(), hs.meta.value_sum.as<float>(), C, stream));
    }
    if (keeps_compact(ix)) {
      // The CPU engine's compact mirror, rebuilt as its growths build it.
      try {
        compact_reserve(&hs.meta, C, d);
      } catch (const std::bad_alloc &) {
        return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory importing a head");
      }
      append_compact(o.centroid.data(), o.value_sum.data(), o.size.data(), static_cast<uint32_t>(C), d, &hs.meta);
    }
    try {
      reserve_sizes(hs, o.size.data(), o.size.size());
    } catch (const std::bad_alloc &) {
      return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for the cluster sizes of a loaded head");
    }
    count_clusters(ix.cfg, hs, o.size.data(), o.size.size());
    WKV_RETURN_IF_ERROR(mirror_reserve(ix, hs, static_cast<uint32_t>(C), static_cast<uint32_t>(n_pages),
                                       hs.map.units(), stream));
    WKV_RETURN_IF_ERROR(mirror_fill(ix, hs, 0, 0, stream));
    clusters += C;
    segments += o.segments.size();
  }
  L.tokens = s.tokens;
  L.tail_begin = s.tail_begin;
  L.generating = s.generating;
  L.version = 1;
  guard.keep = true;
  ix.counters.tokens.fetch_add(L.tokens);
  ix.counters.steady_rows.fetch_add(steady);
  ix.counters.clusters.fetch_add(clusters);
  ix.counters.segments.fetch_add(segments);
  std::swap(*out, L);
  // The empty layer it replaces still has its heads registered (init_layer).
  release_layer(ix, L, false);
  return Status::ok();
}

}  // namespace wkv
