#include "lib/engine/sequence.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <new>
#include <vector>

#include "kernels/cpu_kernels.hpp"
#include "lib/engine/engine.hpp"

namespace wkv {

Sequence::Sequence(std::shared_ptr<Engine> engine, uint64_t id)
    : engine_(std::move(engine)), id_(id) {
  const Config &cfg = engine_->config();
  layers_.resize(cfg.c.n_layers);
  for (LayerState &l : layers_) {
    l.heads.resize(cfg.c.n_kv_heads);
    for (HeadState &h : l.heads) {
      h.sink.init(cfg.row_bytes());
      h.tail.init(cfg.row_bytes());
    }
  }
  engine_->counters().sequences.fetch_add(1);
}

Sequence::~Sequence() {
  engine_->backend().on_destroy(*this);
  EngineCounters &ctr = engine_->counters();
  for (LayerState &l : layers_) {
    ctr.tokens.fetch_sub(l.tokens);
    for (HeadState &h : l.heads) {
      engine_->arena().release(h.index.pages.data(), static_cast<uint32_t>(h.index.pages.size()));
      ctr.segments.fetch_sub(h.index.segments.size());
      ctr.clusters.fetch_sub(h.index.meta.clusters());
    }
    ctr.steady_rows.fetch_sub((l.sink_rows(engine_->config().c.sink_tokens) + l.tail_rows()) * l.heads.size());
  }
  ctr.sequences.fetch_sub(1);
}

Status Sequence::append(uint32_t layer, const uint8_t *k, const uint8_t *v, uint32_t n,
                        int64_t token_stride, int64_t head_stride, void *stream) {
  return engine_->backend().append(*this, layer, k, v, n, token_stride, head_stride, stream);
}

Status Sequence::finish_prompt(uint32_t layer, void *stream) {
  // A layer without tokens has no prompt to end: it stays in its prompt.
  if (layers_[layer].generating || layers_[layer].tokens == 0) return Status::ok();
  return engine_->backend().finish_prompt(*this, layer, stream);
}

Status Sequence::append_host(uint32_t layer, const uint8_t *k, const uint8_t *v, uint32_t n,
                             int64_t token_stride, int64_t head_stride) {
  const Config &cfg = engine_->config();
  LayerState &L = layers_[layer];
  const uint32_t sink = cfg.c.sink_tokens;
  const size_t esz = dtype_bytes(cfg.dtype());
  const uint64_t to_sink = L.tokens < sink ? std::min<uint64_t>(sink - L.tokens, n) : 0;
  const uint64_t to_tail = n - to_sink;

  // 1. Room for the new rows (may throw; nothing visible changes).
  try {
    for (HeadState &h : L.heads) {
      h.sink.reserve_more(to_sink);
      h.tail.reserve_more(to_tail);
    }
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory appending %u tokens", n);
  }
  // 2. Copy the rows in.
  for (uint32_t hd = 0; hd < L.heads.size(); ++hd) {
    HeadState &h = L.heads[hd];
    for (uint32_t t = 0; t < n; ++t) {
      size_t off = (static_cast<size_t>(t) * token_stride + static_cast<size_t>(hd) * head_stride) * esz;
      if (t < to_sink)
        h.sink.push(k + off, v + off);
      else
        h.tail.push(k + off, v + off);
    }
  }
  if (L.tokens < sink) L.tail_begin = std::min<uint64_t>(sink, L.tokens + n);

  // 3. Cluster every complete segment beyond the window.
  const uint64_t tail = L.tokens + n - L.tail_begin;
  const uint32_t seg = L.generating ? cfg.c.update_segment_tokens : cfg.c.segment_tokens;
  const uint64_t ready = tail > cfg.c.window_tokens ? tail - cfg.c.window_tokens : 0;
  const uint32_t count = static_cast<uint32_t>(ready / seg);
  if (count > 0) {
    Status s = cluster_front(layer, count, seg, seg, L.generating);
    if (!s.is_ok()) {
      // Roll the rows back: the layer is as before the call.
      for (HeadState &h : L.heads) {
        h.sink.pop_back(to_sink);
        h.tail.pop_back(to_tail);
      }
      if (L.tokens < sink) L.tail_begin = L.tokens;
      return s;
    }
  }
  L.tokens += n;
  L.version++;
  engine_->counters().tokens.fetch_add(n);
  engine_->counters().steady_rows.fetch_add(static_cast<uint64_t>(n) * L.heads.size());
  if (count > 0)
    engine_->counters().steady_rows.fetch_sub(static_cast<uint64_t>(count) * seg * L.heads.size());
  return Status::ok();
}

Status Sequence::finish_prompt_host(uint32_t layer) {
  LayerState &L = layers_[layer];
  if (L.generating) return Status::ok();
  const Config &cfg = engine_->config();
  const uint64_t tail = L.tokens - L.tail_begin;
  const uint64_t ready = tail > cfg.c.window_tokens ? tail - cfg.c.window_tokens : 0;
  if (ready > 0) {
    const uint32_t seg = cfg.c.segment_tokens;
    uint32_t count = static_cast<uint32_t>((ready + seg - 1) / seg);
    uint32_t last = static_cast<uint32_t>(ready - static_cast<uint64_t>(count - 1) * seg);
    WKV_RETURN_IF_ERROR(cluster_front(layer, count, seg, last, false));
    engine_->counters().steady_rows.fetch_sub(ready * L.heads.size());
  }
  L.generating = true;
  L.version++;
  return Status::ok();
}

namespace {

// One segment of one head, between clustering and commit.
struct PendingSegment {
  uint32_t head = 0;
  uint32_t first_row = 0;  // in the tail
  uint32_t tokens = 0;
  uint32_t first_page = 0;  // index into the allocated page ids
  uint32_t pages = 0;
  kernels::SegmentClusters clusters;
};

uint64_t mix_seed(uint64_t seed, uint64_t a, uint64_t b) {
  // splitmix64 finaliser over the combined words: independent streams per
  // (layer, head, segment start).
  uint64_t z = seed ^ (a * 0x9e3779b97f4a7c15ull) ^ (b + 0x632be59bd9b4e019ull + (a << 6));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Appends a segment's clusters to the meta index's f16 mirror, or drops the
// mirror for good when a value does not fit in f16. Pre: the mirror holds
// every cluster so far and has room for these (no allocation, no throw).
void append_f16_mirror(const kernels::SegmentClusters &sc, uint32_t d, MetaIndex *meta) {
  constexpr float kF16Max = 65504.0f;
  bool fits = true;  // a NaN fails the compares too
  for (float x : sc.centroid) fits &= std::fabs(x) <= kF16Max;
  for (uint32_t c = 0; c < sc.n_clusters; ++c)
    for (uint32_t j = 0; j < d; ++j) fits &= std::fabs(sc.value_sum[static_cast<size_t>(c) * d + j] / sc.size[c]) <= kF16Max;
  if (!fits) {
    MetaVector<f16>().swap(meta->centroid_f16);
    MetaVector<f16>().swap(meta->value_mean_f16);
    return;
  }
  const size_t at = meta->centroid_f16.size(), n = sc.centroid.size();
  meta->centroid_f16.resize(at + n);
  meta->value_mean_f16.resize(at + n);
  from_float(DType::kF16, sc.centroid.data(), meta->centroid_f16.data() + at, n);
  float mean[256];  // head_dim <= 256 (checked at open)
  for (uint32_t c = 0; c < sc.n_clusters; ++c) {
    for (uint32_t j = 0; j < d; ++j) mean[j] = sc.value_sum[static_cast<size_t>(c) * d + j] / sc.size[c];
    from_float(DType::kF16, mean, meta->value_mean_f16.data() + at + static_cast<size_t>(c) * d, d);
  }
}

}  // namespace

Status Sequence::cluster_front(uint32_t layer, uint32_t count, uint32_t seg_tokens,
                               uint32_t last_tokens, bool generated) {
  const Config &cfg = engine_->config();
  LayerState &L = layers_[layer];
  const uint32_t H = static_cast<uint32_t>(L.heads.size());
  const uint32_t d = cfg.c.head_dim;
  const uint32_t pt = cfg.page_tokens();
  const uint32_t row = cfg.row_bytes();
  const DType dt = cfg.dtype();

  // 1. Plan the segments and their pages.
  std::vector<PendingSegment> pend;
  std::vector<PageId> ids;
  try {
    pend.resize(static_cast<size_t>(count) * H);
    uint32_t npages = 0;
    for (uint32_t hd = 0; hd < H; ++hd) {
      uint32_t first = 0;
      for (uint32_t s = 0; s < count; ++s) {
        PendingSegment &p = pend[static_cast<size_t>(hd) * count + s];
        p.head = hd;
        p.first_row = first;
        p.tokens = s + 1 == count ? last_tokens : seg_tokens;
        p.first_page = npages;
        p.pages = (p.tokens + pt - 1) / pt;
        npages += p.pages;
        first += p.tokens;
      }
    }
    ids.resize(npages);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory planning segments");
  }
  // 2. Pages, all or nothing.
  WKV_RETURN_IF_ERROR(engine_->arena().allocate(static_cast<uint32_t>(ids.size()), ids.data()));
  auto give_back = [&] { engine_->arena().release(ids.data(), static_cast<uint32_t>(ids.size())); };

  // 3. Cluster every (head, segment) on the pool.
  auto t0 = std::chrono::steady_clock::now();
  try {
    engine_->pool().parallel_for(pend.size(), [&](size_t i) {
      PendingSegment &p = pend[i];
      const RowQueue &tail = L.heads[p.head].tail;
      std::vector<float> kf(static_cast<size_t>(p.tokens) * d), vf(static_cast<size_t>(p.tokens) * d);
      to_float(dt, tail.k_row(p.first_row), kf.data(), kf.size());
      to_float(dt, tail.v_row(p.first_row), vf.data(), vf.size());
      kernels::KMeansParams kp;
      kp.n_clusters = std::max<uint32_t>(1, (p.tokens + cfg.c.cluster_tokens - 1) / cfg.c.cluster_tokens);
      kp.iters = cfg.c.kmeans_iters;
      kp.seed = mix_seed(cfg.c.seed, (static_cast<uint64_t>(layer) << 32) | p.head,
                         L.tail_begin + p.first_row);
      kernels::kmeans_segment(kp, kf.data(), vf.data(), p.tokens, d, &p.clusters);
    });
    // 4. Room in every destination, so that the commit cannot fail.
    for (uint32_t hd = 0; hd < H; ++hd) {
      HeadIndex &ix = L.heads[hd].index;
      size_t add_c = 0, add_p = 0;
      for (uint32_t s = 0; s < count; ++s) {
        const PendingSegment &p = pend[static_cast<size_t>(hd) * count + s];
        add_c += p.clusters.n_clusters;
        add_p += p.pages;
      }
      auto reserve = [](auto &v, size_t more) {
        if (v.size() + more > v.capacity()) v.reserve(std::max(v.size() + more, v.capacity() * 2));
      };
      reserve(ix.meta.centroid, add_c * d);
      if (dt != DType::kF32 && ix.meta.centroid_f16.size() == ix.meta.centroid.size()) {
        reserve(ix.meta.centroid_f16, add_c * d);
        reserve(ix.meta.value_mean_f16, add_c * d);
      }
      reserve(ix.meta.value_sum, add_c * d);
      reserve(ix.meta.size, add_c);
      reserve(ix.map, add_c);
      reserve(ix.pages, add_p);
      reserve(ix.segments, count);
    }
  } catch (const std::bad_alloc &) {
    give_back();
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory clustering %u segments", count);
  }
  engine_->counters().kmeans_ns.fetch_add(static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count()));

  // 5. Commit (no failure from here): write pages in cluster order, then
  //    append meta index, mapping table, page list and segment.
  HostArena &arena = engine_->arena();
  engine_->pool().parallel_for(H, [&](size_t hd) {
    HeadState &h = L.heads[hd];
    HeadIndex &ix = h.index;
    for (uint32_t s = 0; s < count; ++s) {
      PendingSegment &p = pend[hd * count + s];
      const kernels::SegmentClusters &sc = p.clusters;
      const uint32_t page_base = static_cast<uint32_t>(ix.pages.size());
      for (uint32_t j = 0; j < p.tokens; ++j) {
        uint32_t src = p.first_row + sc.order[j];
        uint8_t *slot = arena.page_ptr(ids[p.first_page + j / pt]);
        std::memcpy(slot + static_cast<size_t>(j % pt) * row, h.tail.k_row(src), row);
        std::memcpy(slot + static_cast<size_t>(pt + j % pt) * row, h.tail.v_row(src), row);
      }
      const uint32_t cluster_base = ix.meta.clusters();
      for (uint32_t c = 0; c < sc.n_clusters; ++c) {
        uint32_t b = sc.begin[c];
        ClusterDesc desc{};
        desc.page = page_base + b / pt;
        desc.offset = static_cast<uint16_t>(b % pt);
        desc.tier = Tier::kHost;
        desc.flags = 0;
        desc.size = sc.size[c];
        desc.last_access = 0;
        ix.map.push_back(desc);
        ix.meta.size.push_back(sc.size[c]);
      }
      // With 16-bit storage the f16 mirror follows (K and V stored in f32
      // are scored and estimated in f32).
      if (dt != DType::kF32 && ix.meta.centroid_f16.size() == ix.meta.centroid.size())
        append_f16_mirror(sc, d, &ix.meta);
      ix.meta.centroid.insert(ix.meta.centroid.end(), sc.centroid.begin(), sc.centroid.end());
      ix.meta.value_sum.insert(ix.meta.value_sum.end(), sc.value_sum.begin(), sc.value_sum.end());
      ix.pages.insert(ix.pages.end(), ids.begin() + p.first_page, ids.begin() + p.first_page + p.pages);
      SegmentDesc sd{};
      sd.token_begin = L.tail_begin + p.first_row;
      sd.tokens = p.tokens;
      sd.cluster_begin = cluster_base;
      sd.clusters = sc.n_clusters;
      sd.page_begin = page_base;
      sd.pages = p.pages;
      sd.generated = generated ? 1 : 0;
      ix.segments.push_back(sd);
    }
  });
  uint64_t consumed = static_cast<uint64_t>(count - 1) * seg_tokens + last_tokens;
  uint64_t new_clusters = 0;
  for (const PendingSegment &p : pend) new_clusters += p.clusters.n_clusters;
  for (HeadState &h : L.heads) h.tail.pop_front(consumed);
  L.tail_begin += consumed;
  engine_->counters().segments.fetch_add(static_cast<uint64_t>(count) * H);
  engine_->counters().clusters.fetch_add(new_clusters);
  return Status::ok();
}

}  // namespace wkv
