#include "lib/index/growth.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <utility>
#include <vector>

namespace wkv {
namespace {

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Moves the live rows to the front of new regions of `cap` rows (cap >= n);
// the old regions go once no step in flight, nor the work enqueued on
// `stream` so far, reads them. All or nothing.
Status move_rows(const IndexContext &ix, Rows *rows, uint64_t cap, void *stream) {
  const size_t bytes = cap * rows->row_bytes;
  Region k, v;
  WKV_RETURN_IF_ERROR(ix.backend.mem_alloc(bytes, stream, &k));
  Status st = ix.backend.mem_alloc(bytes, stream, &v);
  if (st.is_ok() && rows->n > 0) {
    st = ix.backend.mem_copy(k.p, rows->k_at(0), rows->n * rows->row_bytes, stream);
    if (st.is_ok()) st = ix.backend.mem_copy(v.p, rows->v_at(0), rows->n * rows->row_bytes, stream);
  }
  if (!st.is_ok()) {
    ix.backend.mem_free(&k, stream);
    ix.backend.mem_free(&v, stream);
    return st;
  }
  std::swap(rows->k, k);
  std::swap(rows->v, v);
  ix.backend.mem_free_after(&k, stream);
  ix.backend.mem_free_after(&v, stream);
  rows->begin = 0;
  rows->cap = cap;
  return Status::ok();
}

// Room for `add` more rows after the live ones, the live rows moved to the
// front of new regions when the old ones are full. All or nothing.
Status reserve_rows(const IndexContext &ix, Rows *rows, uint64_t add, uint64_t min_cap, void *stream) {
  const uint64_t need = rows->n + add;
  if (rows->begin + need <= rows->cap) return Status::ok();
  return move_rows(ix, rows, std::max<uint64_t>({need, rows->n + rows->n / 2, min_cap}), stream);
}

// Gives a generating layer's tails back what a prompt left in them: a tail
// sized for a whole prompt keeps that size while growths consume it from the
// front (512 MiB per layer at 128K tokens, 8 KV heads, d=128, f16), so once
// a tail holds less than a quarter of its capacity its live rows move to a
// region of 1.5x of them (at least `min_rows`). Best effort: without memory
// for the move the tail stays as it is.
void trim_tails(const IndexContext &ix, LayerState &L, uint64_t min_rows, void *stream) {
  for (HeadState &h : L.heads) {
    const uint64_t want = std::max<uint64_t>(min_rows, h.tail.n + h.tail.n / 2);
    if (h.tail.cap >= 4 * want && !move_rows(ix, &h.tail, want, stream).is_ok()) return;
  }
}

}  // namespace

void append_compact(const float *centroid, const float *value_sum, const uint32_t *size, uint32_t n, uint32_t d,
                    MetaIndex *meta) {
  constexpr float kMax = std::numeric_limits<float>::max();
  bool finite = true;  // a NaN fails the compares too
  for (size_t i = 0; i < size_t(n) * d; ++i) finite &= std::fabs(centroid[i]) <= kMax;
  for (uint32_t c = 0; c < n; ++c)
    for (uint32_t j = 0; j < d; ++j) finite &= std::fabs(value_sum[size_t(c) * d + j] / size[c]) <= kMax;
  if (!finite) {
    MetaVector<int8_t>().swap(meta->centroid_q8);
    MetaVector<float>().swap(meta->centroid_q8_scale);
    MetaVector<int8_t>().swap(meta->value_mean_q8);
    MetaVector<float>().swap(meta->value_mean_q8_scale);
    meta->compact_ok = false;
    return;
  }
  const size_t at = meta->centroid_q8_scale.size(), m = size_t(n) * d;
  meta->centroid_q8.resize(at * d + m);
  meta->centroid_q8_scale.resize(at + n);
  meta->value_mean_q8.resize(at * d + m);
  meta->value_mean_q8_scale.resize(at + n);
  float mean[256];  // head_dim <= 256 (checked at open)
  for (uint32_t c = 0; c < n; ++c) {
    quantize_row(centroid + size_t(c) * d, d, meta->centroid_q8.data() + (at + c) * d,
                 meta->centroid_q8_scale.data() + at + c);
    for (uint32_t j = 0; j < d; ++j) mean[j] = value_sum[size_t(c) * d + j] / size[c];
    quantize_row(mean, d, meta->value_mean_q8.data() + (at + c) * d, meta->value_mean_q8_scale.data() + at + c);
  }
}

namespace {

template <typename V> void reserve_total(V &v, size_t n) {
  if (n > v.capacity()) v.reserve(std::max(n, v.capacity() * 2));
}

// One head's share of a growth, staged before anything changes.
struct HeadGrowth {
  uint32_t add_c = 0, add_p = 0, add_u = 0;
  std::vector<double> value_total;  // the head's after the growth
  std::vector<float> value_mean;
  std::vector<uint32_t> first_slot, size, unit_begin;  // the new entries
  std::vector<PageId> pages;
};

// Begins the growth of `count` segments of `seg_tokens` tokens (the last
// one `last_tokens`) from the front of every head's tail: cuts, seeds and
// the backend's k-means, nothing visible changed.
Status grow_begin(const IndexContext &ix, LayerState &L, uint32_t layer, uint32_t count, uint32_t seg_tokens,
                  uint32_t last_tokens, bool generated, void *stream,
                  std::unique_ptr<PendingGrowth, PendingGrowthFree> *out) {
  const Config &cfg = ix.cfg;
  const uint32_t H = static_cast<uint32_t>(L.heads.size());
  const uint32_t d = cfg.c.head_dim, pt = cfg.page_tokens();
  const uint32_t S = count * H;
  std::unique_ptr<PendingGrowth, PendingGrowthFree> pg;
  // 1. Cuts and seeds: segment i of head h is job h * count + i.
  try {
    pg.reset(new PendingGrowth);
    pg->jobs.resize(S);
    pg->first_row.resize(S);
    pg->seg_pages.resize(S);
    pg->seg_first_page.resize(S);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory planning %u segments", S);
  }
  pg->count = count;
  pg->seg_tokens = seg_tokens;
  pg->last_tokens = last_tokens;
  pg->generated = generated;
  uint32_t npages = 0;
  for (uint32_t h = 0; h < H; ++h) {
    uint32_t first = 0;
    for (uint32_t i = 0; i < count; ++i) {
      const uint32_t si = h * count + i;
      ClusterJob &j = pg->jobs[si];
      j.tokens = i + 1 == count ? last_tokens : seg_tokens;
      j.keys = L.heads[h].tail.k_at(first);
      j.values = L.heads[h].tail.v_at(first);
      j.clusters = std::max<uint32_t>(1, (j.tokens + cfg.c.cluster_tokens - 1) / cfg.c.cluster_tokens);
      j.seed = segment_seed(cfg.c.seed, layer, h, L.tail_begin + first);
      j.outliers = outlier_cap(cfg.c.method, j.tokens);
      j.outlier_ratio = kOutlierRatio;
      pg->first_row[si] = first;
      pg->seg_pages[si] = (j.tokens + pt - 1) / pt;
      pg->seg_first_page[si] = npages;
      npages += pg->seg_pages[si];
      first += j.tokens;
      pg->clusters_max += kernels::kmeans_out_clusters(j);
    }
  }
  pg->npages = npages;
  // The host arrays the commit copies to engine memory, staged in the
  // batch's scratch (HeadGrowth below): per head, its clusters' first
  // slots, sizes and unit ends, its page addresses and its mean value.
  const size_t scratch = 3 * pg->clusters_max * 4 + size_t(npages) * 8 + size_t(H) * (d * 4 + 64);
  std::lock_guard<std::mutex> growth_lock(ix.growth_mu);
  WKV_RETURN_IF_ERROR(ix.backend.cluster_begin(pg->jobs.data(), S, scratch, stream, &pg->batch));
  *out = std::move(pg);
  return Status::ok();
}

// The narrowings of n centroid and value sum rows from c0 on into the
// head's compact copies (kernels::kMeta16Header bytes, then the rows; the
// 8-bit centroid rows' scales in their own region), each passed to
// emit(const SpanWrite &); none where the head keeps none.
template <typename Emit>
void meta16_spans(const IndexContext &ix, HeadState &h, size_t c0, const float *centroid, const float *value_sum,
                  size_t n, Emit &&emit) {
  const size_t d = ix.cfg.c.head_dim;
  MetaIndex &m = h.meta;
  struct Rows8 {
    Region *rows, *scales;
    const float *src;
  };
  for (const Rows8 &c : {Rows8{&m.centroid8, &m.centroid8_scale, centroid},
                         Rows8{&m.value_sum8, &m.value_sum8_scale, value_sum}})
    if (c.rows->p)
      emit(SpanWrite{c.rows->p + kernels::kMeta16Header + c0 * d, c.src, n * d,
                     reinterpret_cast<uint32_t *>(c.rows->p), reinterpret_cast<float *>(c.scales->p) + c0,
                     static_cast<uint32_t>(d)});
  const std::pair<Region *, const float *> copies[] = {{&m.centroid16, centroid}, {&m.value_sum16, value_sum}};
  for (const std::pair<Region *, const float *> &c : copies) {
    Region &r = *c.first;
    if (r.p) emit(SpanWrite{r.p + kernels::kMeta16Header + c0 * d * 2, c.second, n * d, r.as<uint32_t>()});
  }
}

// Where the mirror keeps n_clusters entries from cluster c0 on and n_pages
// page addresses from page p0 on, read from the arrays given.
void mirror_entry_spans(HeadState &h, uint32_t c0, const uint32_t *first_slot, const uint32_t *size,
                        const uint32_t *unit_begin, uint32_t n_clusters, uint32_t p0, const uint8_t *const *addrs,
                        uint32_t n_pages, std::vector<SpanWrite> *out) {
  HeadMirror &m = h.mirror;
  if (n_clusters > 0) {
    out->push_back(SpanWrite{m.first_slot.p + size_t(c0) * 4, first_slot, size_t(n_clusters) * 4});
    out->push_back(SpanWrite{m.size.p + size_t(c0) * 4, size, size_t(n_clusters) * 4});
    // unit_begin[c0 + 1 ..]: entry 0 is written when the head is created.
    out->push_back(SpanWrite{m.unit_begin.p + (size_t(c0) + 1) * 4, unit_begin, size_t(n_clusters) * 4});
  }
  if (n_pages > 0) out->push_back(SpanWrite{m.pages.p + size_t(p0) * 8, addrs, size_t(n_pages) * 8});
}

// Where the commit stages a head's arrays in the batch's scratch: first
// slots, sizes and unit ends of its new clusters, its page addresses, its
// mean value; each 8-byte aligned.
struct HeadScratch {
  uint32_t *first_slot, *size, *unit_begin;
  const uint8_t **addr;
  float *value_mean;
};

HeadScratch carve(uint8_t *&at, uint32_t clusters, uint32_t pages, uint32_t d) {
  auto take = [&at](size_t bytes) {
    uint8_t *p = at;
    at += round_up(bytes, 8);
    return p;
  };
  HeadScratch hs;
  hs.first_slot = reinterpret_cast<uint32_t *>(take(size_t(clusters) * 4));
  hs.size = reinterpret_cast<uint32_t *>(take(size_t(clusters) * 4));
  hs.unit_begin = reinterpret_cast<uint32_t *>(take(size_t(clusters) * 4));
  hs.addr = reinterpret_cast<const uint8_t **>(take(size_t(pages) * 8));
  hs.value_mean = reinterpret_cast<float *>(take(size_t(d) * 4));
  return hs;
}

// Commits a begun growth: the k-means results (waiting for them unless
// ready), pages, mapping entries and meta rows; all or nothing. The batch
// ends either way (pg.batch is null after).
Status grow_commit(const IndexContext &ix, LayerState &L, PendingGrowth &pg, void *stream) {
  const Config &cfg = ix.cfg;
  const uint32_t H = static_cast<uint32_t>(L.heads.size());
  const uint32_t d = cfg.c.head_dim, pt = cfg.page_tokens();
  const uint32_t count = pg.count, seg_tokens = pg.seg_tokens, last_tokens = pg.last_tokens;
  const bool generated = pg.generated;
  const uint64_t consumed = static_cast<uint64_t>(count - 1) * seg_tokens + last_tokens;
  const uint32_t S = count * H;
  const std::vector<ClusterJob> &jobs = pg.jobs;
  const std::vector<uint32_t> &first_row = pg.first_row, &seg_pages = pg.seg_pages,
                              &seg_first_page = pg.seg_first_page;
  const uint32_t npages = pg.npages;
  // The batch ends on every path, after whatever this commit enqueued.
  struct BatchEnd {
    Backend &b;
    PendingGrowth &pg;
    void *s;
    ~BatchEnd() {
      b.cluster_end(pg.batch, s);
      pg.batch = nullptr;
    }
  } batch_end{ix.backend, pg, stream};
  if (ix.faults && ix.faults->fail(FaultInjector::kGrowth))
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of memory for a growth of %u segments (injected)", S);
  std::lock_guard<std::mutex> growth_lock(ix.growth_mu);
  std::vector<PageId> ids;
  std::vector<HeadGrowth> grow;
  try {
    grow.resize(H);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory planning %u segments", S);
  }

  // 2. The k-means's results, then pages, all or nothing.
  ClusterOut out;
  WKV_RETURN_IF_ERROR(ix.backend.cluster_take(pg.batch, stream, &out));
  try {
    ids.resize(npages);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for %u page ids", npages);
  }
  Status got = ix.arena.allocate(npages, ids.data());
  if (got.code() == WKV_ERR_BUDGET && ix.relieve) {
    Status freed = ix.relieve(npages, stream);
    got = freed.is_ok() ? ix.arena.allocate(npages, ids.data()) : freed;
  }
  WKV_RETURN_IF_ERROR(got);
  struct PageGuard {
    HostArena &arena;
    std::vector<PageId> &ids;
    bool keep = false;
    ~PageGuard() {
      if (!keep) arena.release(ids.data(), static_cast<uint32_t>(ids.size()));
    }
  } page_guard{ix.arena, ids};

  // 3. The new mapping entries of every head, and room for them everywhere:
  //    host tables, engine memory, the mirror. Growing a region keeps its
  //    contents, so a failure here leaves every head as it was.
  const bool compact = keeps_compact(ix);
  try {
    for (uint32_t h = 0; h < H; ++h) {
      HeadState &hs = L.heads[h];
      HeadGrowth &g = grow[h];
      uint32_t p = static_cast<uint32_t>(hs.map.pages.size()), u = hs.map.units();
      for (uint32_t i = 0; i < count; ++i) {
        const uint32_t si = h * count + i;
        const uint32_t nc = out.n_clusters[si];
        const uint32_t *b = out.begin + out.clu_off[si] + si;
        const uint32_t *sz = out.size + out.clu_off[si];
        for (uint32_t c = 0; c < nc; ++c) {
          g.first_slot.push_back(p * pt + b[c]);
          g.size.push_back(sz[c]);
          u += (sz[c] + pt - 1) / pt;
          g.unit_begin.push_back(u);
        }
        for (uint32_t j = 0; j < seg_pages[si]; ++j) g.pages.push_back(ids[seg_first_page[si] + j]);
        g.add_c += nc;
        p += seg_pages[si];
      }
      g.add_p = static_cast<uint32_t>(g.pages.size());
      g.add_u = u - hs.map.units();
      g.value_total.assign(hs.values.value_total.begin(), hs.values.value_total.end());
      g.value_total.resize(d, 0.0);
      for (uint32_t i = 0; i < count; ++i)
        for (uint32_t j = 0; j < d; ++j) g.value_total[j] += out.value_total[size_t(h * count + i) * d + j];
      const double tokens = static_cast<double>(hs.values.tokens + consumed);
      g.value_mean.resize(d);
      for (uint32_t j = 0; j < d; ++j) g.value_mean[j] = static_cast<float>(g.value_total[j] / tokens);
      reserve_total(hs.values.value_total, d);
      const uint32_t C1 = hs.clusters() + g.add_c;
      reserve_total(hs.map.first_slot, C1);
      reserve_total(hs.map.size, C1);
      reserve_total(hs.map.unit_begin, C1 + 1);
      reserve_total(hs.map.pages, hs.map.pages.size() + g.add_p);
      reserve_total(hs.segments, hs.segments.size() + count);
      reserve_sizes(hs, g.size.data(), g.size.size());
      if (compact && hs.meta.compact_ok) compact_reserve(&hs.meta, C1, d);
    }
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for the mapping table of a growth");
  }
  for (uint32_t h = 0; h < H; ++h) {
    HeadState &hs = L.heads[h];
    const HeadGrowth &g = grow[h];
    const size_t C1 = hs.clusters() + g.add_c;
    WKV_RETURN_IF_ERROR(grow_region(ix, &hs.meta.centroid, C1 * d * sizeof(float),
                                    size_t(hs.clusters()) * d * sizeof(float), stream, Backend::MemUse::kMetaRows));
    WKV_RETURN_IF_ERROR(grow_region(ix, &hs.meta.value_sum, C1 * d * sizeof(float),
                                    size_t(hs.clusters()) * d * sizeof(float), stream, Backend::MemUse::kMetaRows));
    WKV_RETURN_IF_ERROR(grow_region(ix, &hs.meta.spread, C1 * sizeof(float), size_t(hs.clusters()) * sizeof(float),
                                    stream));
    WKV_RETURN_IF_ERROR(meta16_reserve(ix, hs, C1, stream));
    WKV_RETURN_IF_ERROR(grow_region(ix, &hs.values.mean, d * sizeof(float), 0, stream));
    WKV_RETURN_IF_ERROR(mirror_reserve(ix, hs, static_cast<uint32_t>(C1),
                                       static_cast<uint32_t>(hs.map.pages.size() + g.add_p),
                                       hs.map.units() + g.add_u, stream));
  }

  // 4. The device's work, beyond what any step reads: meta rows, mirror
  //    entries, clustered rows into their pages. Host memory for the lists
  //    below can fail before anything is enqueued; after the first launch
  //    only a failing device can, and nothing visible has changed yet.
  std::vector<PageWriteJob> writes;
  std::vector<SpanWrite> spans, means;
  try {
    writes.resize(S);
    means.resize(H);
    spans.reserve(size_t(H) * (5 * count + 4));  // meta rows, their compact copies, the mirror
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for the writes of %u segments", S);
  }
  const bool mirrored = !ix.backend.host_memory();
  uint8_t *scratch = ix.backend.cluster_scratch(pg.batch);
  for (uint32_t h = 0; h < H; ++h) {
    HeadState &hs = L.heads[h];
    const HeadGrowth &g = grow[h];
    const HeadScratch st = carve(scratch, g.add_c, g.add_p, d);
    std::copy(g.first_slot.begin(), g.first_slot.end(), st.first_slot);
    std::copy(g.size.begin(), g.size.end(), st.size);
    std::copy(g.unit_begin.begin(), g.unit_begin.end(), st.unit_begin);
    for (uint32_t i = 0; i < g.add_p; ++i) st.addr[i] = ix.backend.page_address(g.pages[i]);
    std::copy(g.value_mean.begin(), g.value_mean.end(), st.value_mean);
    means[h] = SpanWrite{hs.values.mean.p, st.value_mean, d * sizeof(float)};
    uint32_t c = hs.clusters(), pp = 0;
    for (uint32_t i = 0; i < count; ++i) {
      const uint32_t si = h * count + i;
      const uint32_t nc = out.n_clusters[si];
      const size_t co = out.clu_off[si];
      spans.push_back(SpanWrite{hs.meta.centroid.as<float>() + size_t(c) * d, out.centroid + co * d,
                                size_t(nc) * d * sizeof(float)});
      spans.push_back(SpanWrite{hs.meta.value_sum.as<float>() + size_t(c) * d, out.value_sum + co * d,
                                size_t(nc) * d * sizeof(float)});
      spans.push_back(SpanWrite{hs.meta.spread.as<float>() + c, out.spread + co, size_t(nc) * sizeof(float)});
      meta16_spans(ix, hs, c, out.centroid + co * d, out.value_sum + co * d, nc,
                   [&spans](const SpanWrite &w) { spans.push_back(w); });  // reserved above: no throw
      PageWriteJob &w = writes[si];
      w.order = out.order + out.tok_off[si];
      w.k = hs.tail.k_at(first_row[si]);
      w.v = hs.tail.v_at(first_row[si]);
      w.pages = g.pages.data() + pp;
      w.dev_pages = hs.mirror.pages.p ? hs.mirror.pages.as<uint8_t *>() + hs.map.pages.size() + pp : nullptr;
      w.tokens = jobs[si].tokens;
      if (cfg.centered_keys()) {
        w.clusters = nc;
        w.begin = out.begin + co + si;
        w.begin_engine = out.begin_engine + co + si;
        w.size = out.size + co;
        w.centroid = out.centroid + co * d;
      }
      c += nc;
      pp += seg_pages[si];
    }
    if (mirrored)
      mirror_entry_spans(hs, hs.clusters(), st.first_slot, st.size, st.unit_begin, g.add_c,
                         static_cast<uint32_t>(hs.map.pages.size()), st.addr, g.add_p, &spans);
  }
  // On CUDA a launch per 80 spans or 96 segments, not a driver call per copy
  // (a generated segment's growth of 8 KV heads: 72 spans, 8 page jobs, 8
  // means, three launches): meta rows and mirror entries, the clustered
  // rows into their pages (reading the mirror's new page addresses), then
  // the mean values. Each call checks all its jobs before it launches any
  // and allocates no host memory.
  WKV_RETURN_IF_ERROR(ix.backend.write_spans(spans.data(), static_cast<uint32_t>(spans.size()), stream));
  WKV_RETURN_IF_ERROR(ix.backend.write_pages(writes.data(), S, stream));
  // The mean value changes in place, last: a step ordered after this growth
  // reads it with the clusters above, one before it has read it already.
  WKV_RETURN_IF_ERROR(ix.backend.write_spans(means.data(), H, stream));

  // 5. Commit (nothing can fail from here): mapping tables, segments, the
  //    compact mirror, and the tails lose their clustered front.
  page_guard.keep = true;
  uint64_t new_clusters = 0;
  for (uint32_t h = 0; h < H; ++h) {
    HeadState &hs = L.heads[h];
    const HeadGrowth &g = grow[h];
    uint32_t c = hs.clusters(), p = static_cast<uint32_t>(hs.map.pages.size());
    for (uint32_t i = 0; i < count; ++i) {
      const uint32_t si = h * count + i;
      const uint32_t nc = out.n_clusters[si];
      SegmentDesc sd{};
      sd.token_begin = L.tail_begin + first_row[si];
      sd.tokens = jobs[si].tokens;
      sd.cluster_begin = c;
      sd.clusters = nc;
      sd.page_begin = p;
      sd.pages = seg_pages[si];
      sd.generated = generated ? 1 : 0;
      hs.segments.push_back(sd);
      if (compact && hs.meta.compact_ok)
        append_compact(out.centroid + out.clu_off[si] * d, out.value_sum + out.clu_off[si] * d,
                       out.size + out.clu_off[si], nc, d, &hs.meta);
      c += nc;
      p += seg_pages[si];
    }
    hs.map.first_slot.insert(hs.map.first_slot.end(), g.first_slot.begin(), g.first_slot.end());
    hs.map.size.insert(hs.map.size.end(), g.size.begin(), g.size.end());
    hs.map.unit_begin.insert(hs.map.unit_begin.end(), g.unit_begin.begin(), g.unit_begin.end());
    hs.map.pages.insert(hs.map.pages.end(), g.pages.begin(), g.pages.end());
    count_clusters(ix.cfg, hs, g.size.data(), g.size.size());  // reserved: no throw
    hs.values.value_total.assign(g.value_total.begin(), g.value_total.end());  // reserved: no throw
    hs.values.tokens += consumed;
    hs.tail.begin += consumed;
    hs.tail.n -= consumed;
    new_clusters += g.add_c;
  }
  L.tail_begin += consumed;
  ix.counters.segments.fetch_add(S);
  ix.counters.clusters.fetch_add(new_clusters);
  ix.counters.steady_rows.fetch_sub(consumed * H);
  return Status::ok();
}

// A growth begun and committed at once (a prompt's: it waits for the
// k-means).
Status grow(const IndexContext &ix, LayerState &L, uint32_t layer, uint32_t count, uint32_t seg_tokens,
            uint32_t last_tokens, bool generated, void *stream) {
  std::unique_ptr<PendingGrowth, PendingGrowthFree> pg;
  WKV_RETURN_IF_ERROR(grow_begin(ix, L, layer, count, seg_tokens, last_tokens, generated, stream, &pg));
  return grow_commit(ix, L, *pg, stream);
}

}  // namespace

void PendingGrowthFree::operator()(PendingGrowth *p) const { delete p; }


uint32_t outlier_cap(uint32_t method, uint32_t tokens) {
  if (!(method & WKV_METHOD_OUTLIERS)) return 0;
  return static_cast<uint32_t>(static_cast<double>(kOutlierShare) * tokens);
}

uint64_t segment_seed(uint64_t seed, uint32_t layer, uint32_t head, uint64_t token_begin) {
  // splitmix64's finaliser over the combined words.
  const uint64_t a = (static_cast<uint64_t>(layer) << 32) | head;
  uint64_t z = seed ^ (a * 0x9e3779b97f4a7c15ull) ^ (token_begin + 0x632be59bd9b4e019ull + (a << 6));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

bool keeps_meta16(const IndexContext &ix) {
  return !ix.backend.host_memory() && ix.cfg.dtype() != DType::kF32;
}

bool keeps_compact(const IndexContext &ix) {
  return ix.backend.host_memory() && ix.cfg.dtype() != DType::kF32;
}

void compact_reserve(MetaIndex *meta, size_t clusters, uint32_t d) {
  reserve_total(meta->centroid_q8, clusters * d);
  reserve_total(meta->centroid_q8_scale, clusters);
  reserve_total(meta->value_mean_q8, clusters * d);
  reserve_total(meta->value_mean_q8_scale, clusters);
}

bool meta_rows8(const Backend &backend, uint32_t head_dim) {
  return backend.meta_row_bits() == 8 && head_dim % 32 == 0;
}

Status meta16_reserve(const IndexContext &ix, HeadState &h, size_t clusters, void *stream) {
  if (!keeps_meta16(ix)) return Status::ok();
  const size_t d = ix.cfg.c.head_dim, head = kernels::kMeta16Header;
  const bool rows8 = meta_rows8(ix.backend, ix.cfg.c.head_dim);
  struct Copy {
    Region *r;
    size_t header, row;  // bytes
  };
  MetaIndex &m = h.meta;
  const Copy copies[] = {{rows8 ? &m.centroid8 : &m.centroid16, head, rows8 ? d : 2 * d},
                         {rows8 ? &m.value_sum8 : &m.value_sum16, head, rows8 ? d : 2 * d},
                         {rows8 ? &m.centroid8_scale : nullptr, 0, sizeof(float)},
                         {rows8 ? &m.value_sum8_scale : nullptr, 0, sizeof(float)}};
  for (const Copy &c : copies) {
    if (!c.r) continue;
    const bool fresh = c.r->p == nullptr;
    WKV_RETURN_IF_ERROR(
        grow_region(ix, c.r, c.header + clusters * c.row, c.header + size_t(h.clusters()) * c.row, stream));
    if (fresh && c.header) WKV_RETURN_IF_ERROR(ix.backend.mem_fill(c.r->p, 0, c.header, stream));
  }
  return Status::ok();
}

Status meta16_write(const IndexContext &ix, HeadState &h, size_t c0, const float *centroid, const float *value_sum,
                    size_t n, void *stream) {
  // narrow_f16's or quantize_rows8's own launch per copy, sized to the
  // whole table (a load narrows every row at once).
  Status st = Status::ok();
  meta16_spans(ix, h, c0, centroid, value_sum, n, [&](const SpanWrite &w) {
    if (!st.is_ok()) return;
    const float *src = static_cast<const float *>(w.src);
    st = w.quant_row ? ix.backend.quantize_rows8(src, w.n / w.quant_row, w.quant_row, static_cast<int8_t *>(w.dst),
                                                 w.quant_scales, w.narrow_overflow, stream)
                     : ix.backend.narrow_f16(src, w.n, w.dst, w.narrow_overflow, stream);
  });
  return st;
}

Status grow_region(const IndexContext &ix, Region *r, size_t bytes, size_t keep, void *stream, Backend::MemUse use) {
  if (bytes <= r->bytes) return Status::ok();
  Region fresh;
  WKV_RETURN_IF_ERROR(
      ix.backend.mem_alloc(round_up(std::max(bytes, r->bytes + r->bytes / 2), 256), stream, &fresh, use));
  if (keep > 0) {
    const SpanWrite copy{fresh.p, r->p, std::min(keep, r->bytes)};
    Status st = ix.backend.mem_mapped_host(use) ? ix.backend.write_spans(&copy, 1, stream)
                                                : ix.backend.mem_copy(copy.dst, copy.src, copy.n, stream);
    if (!st.is_ok()) {
      ix.backend.mem_free(&fresh, stream);
      return st;
    }
  }
  std::swap(*r, fresh);
  ix.backend.mem_free_after(&fresh, stream);
  return Status::ok();
}

Status mirror_reserve(const IndexContext &ix, HeadState &h, uint32_t clusters, uint32_t pages, uint32_t units,
                      void *stream) {
  if (ix.backend.host_memory()) return Status::ok();
  HeadMirror &m = h.mirror;
  const uint32_t C0 = h.clusters(), P0 = static_cast<uint32_t>(h.map.pages.size());
  WKV_RETURN_IF_ERROR(grow_region(ix, &m.first_slot, size_t(clusters) * 4, size_t(C0) * 4, stream));
  WKV_RETURN_IF_ERROR(grow_region(ix, &m.size, size_t(clusters) * 4, size_t(C0) * 4, stream));
  const bool first = m.unit_begin.p == nullptr;
  WKV_RETURN_IF_ERROR(grow_region(ix, &m.unit_begin, (size_t(clusters) + 1) * 4, (size_t(C0) + 1) * 4, stream));
  if (first) WKV_RETURN_IF_ERROR(ix.backend.mem_fill(m.unit_begin.p, 0, 4, stream));  // unit_begin[0]
  WKV_RETURN_IF_ERROR(grow_region(ix, &m.pages, size_t(pages) * 8, size_t(P0) * 8, stream));
  if (ix.cfg.cold_pages()) {
    // Recency stamps: a new cluster's is 0 until a lookup retrieves it (the
    // host's own stamp for it counts until then, lib/engine/cold.cpp).
    WKV_RETURN_IF_ERROR(grow_region(ix, &m.stamps, size_t(clusters) * 4, size_t(C0) * 4, stream));
    if (clusters > C0)
      WKV_RETURN_IF_ERROR(ix.backend.mem_fill(m.stamps.p + size_t(C0) * 4, 0, size_t(clusters - C0) * 4, stream));
  }
  // Unit map chunks: allocated, cleared and listed in the directory now;
  // no step reads past the head's units until the growth commits.
  const size_t chunks = (units + kUnitChunk - 1) / kUnitChunk, had = m.unit_chunks.size();
  if (chunks <= had) return Status::ok();
  try {
    m.unit_chunks.reserve(chunks);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for a unit map");
  }
  WKV_RETURN_IF_ERROR(grow_region(ix, &m.unit_dir, chunks * 8, had * 8, stream));
  for (size_t i = had; i < chunks; ++i) {
    Region c;
    WKV_RETURN_IF_ERROR(ix.backend.mem_alloc(size_t(kUnitChunk) * 4, stream, &c));
    Status st = ix.backend.mem_fill(c.p, 0xff, size_t(kUnitChunk) * 4, stream);  // kNoFrame
    if (st.is_ok()) st = ix.backend.mem_store64(m.unit_dir.p + i * 8, reinterpret_cast<uintptr_t>(c.p), stream);
    if (!st.is_ok()) {
      ix.backend.mem_free(&c, stream);
      return st;
    }
    m.unit_chunks.push_back(c);  // reserved above: no throw
  }
  return Status::ok();
}

Status mirror_fill_entries(const IndexContext &ix, HeadState &h, uint32_t c0, const uint32_t *first_slot,
                           const uint32_t *size, const uint32_t *unit_begin, uint32_t n_clusters, uint32_t p0,
                           const PageId *pages, uint32_t n_pages, void *stream) {
  if (ix.backend.host_memory()) return Status::ok();
  std::vector<const uint8_t *> addr;
  std::vector<SpanWrite> spans;
  try {
    addr.resize(n_pages);
    spans.reserve(4);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for %u page addresses", n_pages);
  }
  for (uint32_t i = 0; i < n_pages; ++i) addr[i] = ix.backend.page_address(pages[i]);
  mirror_entry_spans(h, c0, first_slot, size, unit_begin, n_clusters, p0, addr.data(), n_pages, &spans);
  // Host arrays of any kind: copies, which read them before returning.
  for (const SpanWrite &w : spans) WKV_RETURN_IF_ERROR(ix.backend.mem_copy(w.dst, w.src, w.n, stream));
  return Status::ok();
}

Status mirror_fill(const IndexContext &ix, HeadState &h, uint32_t c0, uint32_t p0, void *stream) {
  const MappingTable &t = h.map;
  return mirror_fill_entries(ix, h, c0, t.first_slot.data() + c0, t.size.data() + c0, t.unit_begin.data() + c0 + 1,
                             t.clusters() - c0, p0, t.pages.data() + p0, static_cast<uint32_t>(t.pages.size()) - p0,
                             stream);
}

void init_layer(const IndexContext &ix, LayerState *L) {
  const size_t row = ix.cfg.row_bytes();
  L->heads.resize(ix.cfg.c.n_kv_heads);
  for (HeadState &h : L->heads) {
    h.sink.row_bytes = h.tail.row_bytes = row;
    h.map.unit_begin.push_back(0);
    ix.backend.on_head_created(h);
  }
}

void release_layer(const IndexContext &ix, LayerState &L, bool counted) noexcept {
  // A pending growth is abandoned: nothing read its outputs, and the memory
  // freed below waits for its k-means (Backend::cluster_end).
  if (L.pending) {
    if (L.pending->batch) ix.backend.cluster_end(L.pending->batch, nullptr);
    L.pending.reset();
  }
  for (HeadState &h : L.heads) {
    ix.backend.on_head_destroyed(h);
    for (Region *r : {&h.sink.k, &h.sink.v, &h.tail.k, &h.tail.v, &h.meta.centroid, &h.meta.value_sum, &h.meta.spread,
                      &h.meta.centroid16, &h.meta.centroid8, &h.meta.centroid8_scale, &h.meta.value_sum16,
                      &h.meta.value_sum8, &h.meta.value_sum8_scale, &h.values.mean,
                      &h.mirror.first_slot, &h.mirror.size, &h.mirror.unit_begin, &h.mirror.pages, &h.mirror.unit_dir,
                      &h.mirror.stamps})
      ix.backend.mem_free_deferred(r);
    for (Region &c : h.mirror.unit_chunks) ix.backend.mem_free_deferred(&c);
    // Pages too may be read by a step in flight (a CUDA gather).
    try {
      // Cold pages (kNoPage) are the spill file's, not the arena's.
      ix.buffers.defer([&arena = ix.arena, pages = std::move(h.map.pages)]() mutable {
        pages.erase(std::remove(pages.begin(), pages.end(), kNoPage), pages.end());
        arena.release(pages.data(), static_cast<uint32_t>(pages.size()));
      });
    } catch (...) {
      // Out of memory for the release itself: the pages stay allocated
      // (counted in use) rather than being reused under a reader.
    }
    if (counted) {
      ix.counters.segments.fetch_sub(h.segments.size());
      ix.counters.clusters.fetch_sub(h.clusters());
      ix.counters.steady_rows.fetch_sub(h.sink.n + h.tail.n);
    }
  }
  if (counted) ix.counters.tokens.fetch_sub(L.tokens);
  L.heads.clear();
  L.tokens = L.tail_begin = 0;
}

namespace {

// The segments the next growth clusters, of `left` still to cluster.
uint32_t growth_part(const IndexContext &ix, uint32_t left) {
  return ix.max_growth_segments ? std::min(left, ix.max_growth_segments) : left;
}

}  // namespace

Status stage_append(const IndexContext &ix, LayerState &L, uint32_t n, StagedAppend *out, void *stream) {
  const Config &cfg = ix.cfg;
  const uint32_t sink = cfg.c.sink_tokens;
  StagedAppend sa;
  sa.n = n;
  sa.to_sink = L.tokens < sink ? std::min<uint64_t>(sink - L.tokens, n) : 0;
  sa.to_tail = n - sa.to_sink;
  // A tail is sized for what a generating layer gathers between two
  // growths (the window and an update segment), not for the prompt.
  const uint64_t tail_min = cfg.c.window_tokens + cfg.c.update_segment_tokens + 1;
  // Rows that move invalidate the plans looked up before (their run tables
  // hold the old addresses, freed once their steps have ended), whether or
  // not the append then succeeds.
  Status st = Status::ok();
  bool moved = false;
  bool ordered = false;
  for (HeadState &h : L.heads) {
    const uint8_t *sink_k = h.sink.k.p, *tail_k = h.tail.k.p;
    // A pending growth's k-means reads the tail's front where it is: the
    // old region may go only after it (on the device; the host waits not).
    if (st.is_ok() && L.pending && !ordered && sa.to_tail && h.tail.begin + h.tail.n + sa.to_tail > h.tail.cap) {
      st = ix.backend.cluster_after(L.pending->batch, stream);
      ordered = true;
    }
    if (st.is_ok() && sa.to_sink) st = reserve_rows(ix, &h.sink, sa.to_sink, sink, stream);
    if (st.is_ok() && sa.to_tail) st = reserve_rows(ix, &h.tail, sa.to_tail, tail_min, stream);
    moved |= h.sink.k.p != sink_k || h.tail.k.p != tail_k;
  }
  if (moved) L.version++;
  WKV_RETURN_IF_ERROR(st);
  *out = sa;
  return Status::ok();
}

Status append_copies(const IndexContext &ix, const LayerState &L, const StagedAppend &sa, uint64_t src_off,
                     uint64_t token_pitch, uint64_t head_pitch, std::vector<RowCopy> *out) {
  (void)ix;
  try {
    for (size_t hd = 0; hd < L.heads.size(); ++hd) {
      const HeadState &h = L.heads[hd];
      const uint64_t off = src_off + hd * head_pitch;
      if (sa.to_sink)
        out->push_back(RowCopy{h.sink.k_at(h.sink.n), h.sink.v_at(h.sink.n), off, static_cast<uint32_t>(sa.to_sink)});
      if (sa.to_tail)
        out->push_back(RowCopy{h.tail.k_at(h.tail.n), h.tail.v_at(h.tail.n), off + sa.to_sink * token_pitch,
                               static_cast<uint32_t>(sa.to_tail)});
    }
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for an append's copies");
  }
  return Status::ok();
}

namespace {
// The segments complete beyond the window once n more rows count, the tail
// beginning at tail_begin: what commit_append clusters (a prompt's only in
// batches of the backend's size).
uint32_t segments_ready(const IndexContext &ix, const LayerState &L, uint64_t tail_begin, uint32_t n) {
  const Config &cfg = ix.cfg;
  const uint64_t tail = L.tokens + n - tail_begin;
  const uint32_t seg = L.generating ? cfg.c.update_segment_tokens : cfg.c.segment_tokens;
  const uint64_t ready = tail > cfg.c.window_tokens ? tail - cfg.c.window_tokens : 0;
  const uint32_t count = static_cast<uint32_t>(ready / seg);
  return !L.generating && count < ix.backend.prompt_batch_segments() ? 0 : count;
}
}  // namespace

bool commit_is_quiet(const IndexContext &ix, const LayerState &L, const StagedAppend &sa) {
  // A pending growth: it commits at its point, and no other begins before.
  if (L.pending) return L.tokens + sa.n < L.pending->commit_at;
  const uint32_t sink = ix.cfg.c.sink_tokens;
  const uint64_t tail_begin = L.tokens < sink ? std::min<uint64_t>(sink, L.tokens + sa.n) : L.tail_begin;
  return segments_ready(ix, L, tail_begin, sa.n) == 0;
}

Status commit_append(const IndexContext &ix, LayerState &L, uint32_t layer, const StagedAppend &sa, void *stream,
                     bool begin_growths) {
  const Config &cfg = ix.cfg;
  const uint32_t H = static_cast<uint32_t>(L.heads.size()), sink = cfg.c.sink_tokens, n = sa.n;
  // A pending growth commits in the append that reaches its commit point,
  // before this append's
  // rows count (waiting for its k-means if not done); if it fails, this
  // append fails too
  // (its copies wrote past the live rows, which nothing reads) and the
  // segment stays in the tail for a later growth.
  bool grew = false;
  if (L.pending && L.tokens + n >= L.pending->commit_at) {
    if (!ix.backend.cluster_ready(L.pending->batch)) ix.counters.growth_waits.fetch_add(1);
    Status st = grow_commit(ix, L, *L.pending, stream);
    L.pending.reset();
    if (!st.is_ok()) return st;
    L.version++;
    grew = true;
  }
  for (HeadState &h : L.heads) {
    h.sink.n += sa.to_sink;
    h.tail.n += sa.to_tail;
  }
  const uint64_t tail_begin = L.tail_begin;
  if (L.tokens < sink) L.tail_begin = std::min<uint64_t>(sink, L.tokens + n);

  // Cluster the segments complete beyond the window. Where they are cut
  // never depends on how the prompt was split into appends, nor on when
  // the backend clusters them.
  const uint32_t seg = L.generating ? cfg.c.update_segment_tokens : cfg.c.segment_tokens;
  const uint32_t count = segments_ready(ix, L, L.tail_begin, n);
  ix.counters.steady_rows.fetch_add(static_cast<uint64_t>(n) * H);
  // Under a host budget with cold pages, in growths of at most
  // max_growth_segments: once one has succeeded the tokens are kept, and
  // segments a later one could not take wait in the tail (the steady zone,
  // attended exactly) for the next growth. A generating layer's growth is
  // left pending until its commit point, one at a time.
  for (uint32_t done = 0; begin_growths && done < count && !L.pending;) {
    // A generating layer's segments grow one by one, each committing at its
    // own point: which segments grow together never depends on how the
    // tokens were split into appends.
    const uint32_t c = L.generating ? 1 : growth_part(ix, count - done);
    std::unique_ptr<PendingGrowth, PendingGrowthFree> pg;
    Status st = grow_begin(ix, L, layer, c, seg, seg, L.generating, stream, &pg);
    // The commit point: where the segments complete, plus the lag; the
    // append that brings the layer there commits (this one, with lag 0, a
    // growth begun again after a failed commit, or a sequence loaded with
    // its segment in the tail and its point reached): the same append as
    // in an uninterrupted run.
    const uint64_t commit_at = L.tail_begin + static_cast<uint64_t>(c) * seg + cfg.c.window_tokens + ix.growth_lag;
    if (st.is_ok() && L.generating && L.tokens + n < commit_at) {
      pg->commit_at = commit_at;
      L.pending = std::move(pg);
      ix.counters.growths_deferred.fetch_add(1);
      break;
    }
    if (st.is_ok()) st = grow_commit(ix, L, *pg, stream);
    if (st.is_ok()) {
      done += c;
      grew = true;
      continue;
    }
    if (done > 0) break;
    // The layer's tokens as before the call.
    for (HeadState &h : L.heads) {
      h.sink.n -= sa.to_sink;
      h.tail.n -= sa.to_tail;
    }
    L.tail_begin = tail_begin;
    ix.counters.steady_rows.fetch_sub(static_cast<uint64_t>(n) * H);
    return st;
  }
  L.tokens += n;
  L.version++;
  ix.counters.tokens.fetch_add(n);
  // Not while a k-means reads the tails.
  if (grew && L.generating && !L.pending)
    trim_tails(ix, L, cfg.c.window_tokens + cfg.c.update_segment_tokens + 1, stream);
  return Status::ok();
}

bool growth_due(const IndexContext &ix, const LayerState &L) {
  return L.generating && !L.pending && segments_ready(ix, L, L.tail_begin, 0) > 0;
}

Status begin_due(const IndexContext &ix, LayerState &L, uint32_t layer, void *stream, bool *began) {
  *began = false;
  if (!growth_due(ix, L)) return Status::ok();
  const Config &cfg = ix.cfg;
  const uint32_t seg = cfg.c.update_segment_tokens;
  std::unique_ptr<PendingGrowth, PendingGrowthFree> pg;
  WKV_RETURN_IF_ERROR(grow_begin(ix, L, layer, 1, seg, seg, true, stream, &pg));
  pg->commit_at = L.tail_begin + seg + cfg.c.window_tokens + ix.growth_lag;
  L.pending = std::move(pg);
  ix.counters.growths_deferred.fetch_add(1);
  *began = true;
  return Status::ok();
}

Status commit_due(const IndexContext &ix, LayerState &L, uint32_t n, void *stream) {
  if (!L.pending || L.tokens + n < L.pending->commit_at) return Status::ok();
  if (!ix.backend.cluster_ready(L.pending->batch)) ix.counters.growth_waits.fetch_add(1);
  Status st = grow_commit(ix, L, *L.pending, stream);
  L.pending.reset();
  WKV_RETURN_IF_ERROR(st);
  L.version++;
  const Config &cfg = ix.cfg;
  trim_tails(ix, L, cfg.c.window_tokens + cfg.c.update_segment_tokens + 1, stream);
  return Status::ok();
}

void uncount_append(const IndexContext &ix, LayerState &L, const StagedAppend &sa, uint64_t tail_begin_before) {
  for (HeadState &h : L.heads) {
    h.sink.n -= sa.to_sink;
    h.tail.n -= sa.to_tail;
  }
  L.tail_begin = tail_begin_before;
  L.tokens -= sa.n;
  L.version++;
  ix.counters.steady_rows.fetch_sub(static_cast<uint64_t>(sa.n) * L.heads.size());
  ix.counters.tokens.fetch_sub(sa.n);
}

Status append_tokens(const IndexContext &ix, LayerState &L, uint32_t layer, const uint8_t *k, const uint8_t *v,
                     uint32_t n, int64_t token_stride, int64_t head_stride, void *stream) {
  const size_t esz = dtype_bytes(ix.cfg.dtype());
  StagedAppend sa;
  WKV_RETURN_IF_ERROR(stage_append(ix, L, n, &sa, stream));
  std::vector<RowCopy> copies;
  WKV_RETURN_IF_ERROR(append_copies(ix, L, sa, 0, static_cast<uint64_t>(token_stride) * esz,
                                    static_cast<uint64_t>(head_stride) * esz, &copies));
  WKV_RETURN_IF_ERROR(ix.backend.copy_rows(copies.data(), static_cast<uint32_t>(copies.size()), k, v,
                                           static_cast<size_t>(token_stride) * esz, ix.cfg.row_bytes(), stream));
  return commit_append(ix, L, layer, sa, stream);
}

Status end_prompt(const IndexContext &ix, LayerState &L, uint32_t layer, void *stream) {
  if (L.generating || L.tokens == 0) return Status::ok();
  const Config &cfg = ix.cfg;
  const uint64_t tail = L.tokens - L.tail_begin;
  const uint64_t ready = tail > cfg.c.window_tokens ? tail - cfg.c.window_tokens : 0;
  if (ready > 0) {
    const uint32_t seg = cfg.c.segment_tokens;
    const uint32_t count = static_cast<uint32_t>((ready + seg - 1) / seg);
    const uint32_t last = static_cast<uint32_t>(ready - static_cast<uint64_t>(count - 1) * seg);
    // In growths of at most max_growth_segments (as append_tokens): a
    // failure leaves the prompt open, with what was clustered kept.
    for (uint32_t done = 0; done < count;) {
      const uint32_t c = growth_part(ix, count - done);
      WKV_RETURN_IF_ERROR(grow(ix, L, layer, c, seg, done + c == count ? last : seg, false, stream));
      done += c;
    }
  }
  L.generating = true;
  L.version++;
  trim_tails(ix, L, cfg.c.window_tokens + cfg.c.update_segment_tokens + 1, stream);
  return Status::ok();
}

void reserve_sizes(HeadState &hs, const uint32_t *sizes, size_t n) {
  const uint32_t largest = n == 0 ? 0 : *std::max_element(sizes, sizes + n);
  if (largest >= hs.by_size.size()) hs.by_size.reserve(static_cast<size_t>(largest) + 1);
}

void count_clusters(const Config &cfg, HeadState &hs, const uint32_t *sizes, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t sz = sizes[i];
    if (sz >= hs.by_size.size()) hs.by_size.resize(static_cast<size_t>(sz) + 1, 0);  // within the reservation
    ++hs.by_size[sz];
    hs.max_cluster = std::max(hs.max_cluster, sz);
    hs.ones += sz == 1;
  }
  // The bound: the n_ret largest clusters, from the largest size down.
  uint32_t n_ret = 0, n_one = 0, n_est = 0;
  zone_sizes(cfg, hs.clusters(), hs.ones, &n_ret, &n_one, &n_est);
  const uint64_t pt = cfg.page_tokens();
  uint64_t tokens = 0, units = 0;
  uint32_t left = n_ret;
  for (size_t s = hs.by_size.size(); s-- > 1 && left > 0;) {
    const uint32_t take = std::min(left, hs.by_size[s]);
    tokens += uint64_t(take) * s;
    units += uint64_t(take) * ((s + pt - 1) / pt);
    left -= take;
  }
  hs.ret_n = n_ret;
  hs.ret_tokens = tokens;
  hs.ret_units = units;
}

}  // namespace wkv
