// The CPU backend: host memory stands in for the device (no cache tier),
// the kernels are the CPU references, and work is spread over the engine's
// pool across (sequence, KV head) runs. Every verb runs to its end before it
// returns, so its step ends there too.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>

#include "kernels/cpu_kernels.hpp"
#include "lib/engine/engine.hpp"
#include "lib/engine/plan.hpp"
#include "lib/engine/sequence.hpp"

namespace wkv {
namespace {

// The machine's physical memory in bytes (the most any one host allocation
// could be backed by), or SIZE_MAX where it cannot be read.
size_t physical_memory_bytes() {
  static const size_t bytes = [] {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0) return std::numeric_limits<size_t>::max();
    size_t b;
    return __builtin_mul_overflow(static_cast<size_t>(pages), static_cast<size_t>(page), &b)
               ? std::numeric_limits<size_t>::max()
               : b;
  }();
  return bytes;
}

class CpuBackend final : public Backend, public BufferManager::Device {
 public:
  explicit CpuBackend(Engine &e) : e_(e) {}
  ~CpuBackend() override {
    for (uint64_t *w : words_) delete[] w;
  }

  uint32_t device() const override { return WKV_DEVICE_CPU; }
  Status check_stream(void *, const char *) override { return Status::ok(); }
  Status check_pointer(const void *p, const char *what, size_t align, const void **device) override {
    if (reinterpret_cast<uintptr_t>(p) % align != 0)
      return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "%s (%p) is not aligned to its %zu-byte elements", what, p, align);
    if (device) *device = p;
    return Status::ok();
  }

  // Engine memory is host memory.
  bool host_memory() const override { return true; }
  using Backend::mem_alloc;
  Status mem_alloc(size_t bytes, void *, Region *out, MemUse) override {
    // More than the machine's memory is refused here rather than asked of
    // the allocator: where the kernel overcommits (vm.overcommit_memory=1)
    // the request would be granted and the process killed once it touched it.
    if (bytes > physical_memory_bytes())
      return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "%zu bytes of host memory asked for, more than the machine's %zu",
                       bytes, physical_memory_bytes());
    const size_t n = (std::max<size_t>(bytes, 1) + 255) & ~size_t{255};
    void *p = e_.faults().fail(FaultInjector::kEngineAlloc) ? nullptr : std::aligned_alloc(256, n);
    if (!p) return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for %zu bytes", bytes);
    out->p = static_cast<uint8_t *>(p);
    out->bytes = n;
    return Status::ok();
  }
  void mem_free(Region *r, void *) override {
    std::free(r->p);
    *r = Region{};
  }
  void mem_free_deferred(Region *r) override {
    if (!r->p) return;
    uint8_t *p = r->p;
    *r = Region{};
    try {
      e_.buffers().defer([p] { std::free(p); });
    } catch (...) {
      // Out of memory for the release itself: kept rather than freed under
      // a reader.
    }
  }  void mem_free_after(Region *r, void *) override { mem_free_deferred(r); }  // no queued work

  Status mem_copy(void *dst, const void *src, size_t bytes, void *) override {
    if (bytes) std::memcpy(dst, src, bytes);
    return Status::ok();
  }
  Status mem_copy_rows(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t width, size_t rows,
                       void *) override {
    for (size_t i = 0; i < rows; ++i)
      std::memcpy(static_cast<uint8_t *>(dst) + i * dst_pitch, static_cast<const uint8_t *>(src) + i * src_pitch,
                  width);
    return Status::ok();
  }
  Status mem_fill(void *dst, uint8_t byte, size_t bytes, void *) override {
    std::memset(dst, byte, bytes);
    return Status::ok();
  }
  Status mem_store64(void *dst, uint64_t value, void *) override {
    std::memcpy(dst, &value, sizeof value);
    return Status::ok();
  }
  Status mem_sync(void *) override { return Status::ok(); }

  // Index growth: every complete segment is clustered as it completes.
  uint32_t prompt_batch_segments() const override { return 1; }
  // The CPU clusters at once: a batch is ready when begun (its growth
  // still commits kGrowthLagTokens later, as on a device).
  Status cluster_begin(const ClusterJob *jobs, uint32_t n, size_t scratch, void *, ClusterBatch **out) override;
  uint8_t *cluster_scratch(ClusterBatch *b) override;
  bool cluster_ready(ClusterBatch *) override { return true; }
  Status cluster_take(ClusterBatch *b, void *, ClusterOut *out) override;
  void cluster_end(ClusterBatch *b, void *) override { delete b; }
  Status write_pages(const PageWriteJob *jobs, uint32_t n, void *) override;
  const uint8_t *page_address(PageId id) override { return e_.arena().page_ptr(id); }
  Status end_work(StepTracker &t, uint64_t epoch, void *) override {
    e_.buffers().end_on_host(t, epoch);
    return Status::ok();
  }

  // The buffer manager's words are plain host memory.
  BufferManager::Device *buffer_device() override { return this; }
  Status alloc_words(size_t n, uint64_t **host, uint64_t **dev) override {
    uint64_t *w = new (std::nothrow) uint64_t[n]();
    if (!w) return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for step trackers");
    std::lock_guard<std::mutex> lock(words_mu_);
    words_.push_back(w);
    *host = *dev = w;
    return Status::ok();
  }
  Status alloc_ring(size_t, uint8_t **, uint8_t **) override {
    return WKV_ERROR(WKV_ERR_INTERNAL, "the CPU backend has no device cache");
  }
  Status alloc_device(size_t, void **) override {
    return WKV_ERROR(WKV_ERR_INTERNAL, "the CPU backend has no device cache");
  }
  Status publish_frames(const uint32_t *, const uint32_t *, uint32_t *, uint64_t, uint64_t, uint32_t,
                        uint64_t *) override {
    return WKV_ERROR(WKV_ERR_INTERNAL, "the CPU backend has no device cache");
  }
  Status clear_entries(const uint64_t *, uint32_t) override {
    return WKV_ERROR(WKV_ERR_INTERNAL, "the CPU backend has no device cache");
  }

  void xbuf(const Plan &plan, wkv_xbuf_view *view) override {
    view->n_runs = static_cast<uint32_t>(plan.runs.size());
    view->n_tokens = static_cast<uint64_t>(plan.offsets[plan.runs.size()]);
    view->k = plan.xk.data();
    view->v = plan.xv.data();
    view->offsets = plan.offsets.data();
  }
  Status lookup(Plan &plan) override;
  Status assemble(Plan &plan) override;
  Status attend(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse) override;
  Status merge(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
               int64_t lse_seq_stride) override;

 private:
  // Runs body as one step of the plan's tracker: it ends when body returns.
  template <typename Fn> Status step(Plan &plan, Fn &&body) {
    const uint64_t epoch = e_.buffers().begin(plan.tracker());
    Status st = body();
    e_.buffers().end_on_host(plan.tracker(), epoch);
    return st;
  }

  Engine &e_;
  std::mutex words_mu_;
  std::vector<uint64_t *> words_;
};

// A k-means batch's outputs, packed as a device batch's (ClusterOut).
struct CpuClusterBatch final : ClusterBatch {
  std::vector<uint32_t> n, nout, begin, size, order;
  std::vector<uint64_t> tok_off, clu_off;
  std::vector<float> centroid, value_sum, spread;
  std::vector<double> vtot;
  std::vector<uint64_t> scratch;  // 8-byte aligned
};

uint8_t *CpuBackend::cluster_scratch(ClusterBatch *b) {
  return reinterpret_cast<uint8_t *>(static_cast<CpuClusterBatch *>(b)->scratch.data());
}

Status CpuBackend::cluster_begin(const ClusterJob *jobs, uint32_t n, size_t scratch, void *, ClusterBatch **out) {
  const Config &cfg = e_.config();
  const uint32_t d = cfg.c.head_dim;
  const DType dt = cfg.dtype();
  std::vector<kernels::SegmentClusters> sc;
  std::unique_ptr<CpuClusterBatch> kb;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    kb = std::make_unique<CpuClusterBatch>();
    kb->scratch.resize((scratch + 7) / 8);
    sc.resize(n);
    kb->tok_off.resize(n);
    kb->clu_off.resize(n);
    kernels::kmeans_batch_offsets(jobs, n, kb->tok_off.data(), kb->clu_off.data());
    e_.pool().parallel_for(n, [&](size_t i) {
      const ClusterJob &j = jobs[i];
      std::vector<float> kf(size_t(j.tokens) * d), vf(size_t(j.tokens) * d);
      to_float(dt, j.keys, kf.data(), kf.size());
      to_float(dt, j.values, vf.data(), vf.size());
      kernels::KMeansParams kp;
      kp.n_clusters = j.clusters;
      kp.iters = cfg.c.kmeans_iters;
      kp.seed = j.seed;
      kp.outliers = j.outliers;
      kp.outlier_ratio = j.outlier_ratio;
      kernels::kmeans_segment(kp, kf.data(), vf.data(), j.tokens, d, &sc[i]);
    });
    // 2. Packed as the device's batch: segment s at tok_off[s], clu_off[s].
    const kernels::KMeansBatchShape shape = kernels::kmeans_batch_shape(jobs, n);
    uint64_t sum_k = 0;
    for (uint32_t i = 0; i < n; ++i) sum_k += kernels::kmeans_out_clusters(jobs[i]);
    kb->n.assign(n, 0);
    kb->nout.assign(n, 0);
    kb->begin.assign(sum_k + n, 0);
    kb->size.assign(sum_k, 0);
    kb->order.assign(shape.total_tokens, 0);
    kb->centroid.assign(sum_k * d, 0.f);
    kb->value_sum.assign(sum_k * d, 0.f);
    kb->spread.assign(sum_k, 0.f);
    kb->vtot.assign(size_t(n) * d, 0.0);
    for (uint32_t i = 0; i < n; ++i) {
      const kernels::SegmentClusters &s = sc[i];
      const uint64_t co = kb->clu_off[i], to = kb->tok_off[i];
      kb->n[i] = s.n_clusters;
      kb->nout[i] = s.n_outliers;
      std::copy(s.begin.begin(), s.begin.end(), kb->begin.begin() + co + i);
      std::copy(s.size.begin(), s.size.end(), kb->size.begin() + co);
      std::copy(s.order.begin(), s.order.end(), kb->order.begin() + to);
      std::copy(s.centroid.begin(), s.centroid.end(), kb->centroid.begin() + co * d);
      std::copy(s.value_sum.begin(), s.value_sum.end(), kb->value_sum.begin() + co * d);
      std::copy(s.spread.begin(), s.spread.end(), kb->spread.begin() + co);
      std::copy(s.value_total.begin(), s.value_total.end(), kb->vtot.begin() + size_t(i) * d);
    }
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory clustering %u segments", n);
  }
  e_.counters().kmeans_ns.fetch_add(static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count()));
  *out = kb.release();
  return Status::ok();
}

Status CpuBackend::cluster_take(ClusterBatch *b, void *, ClusterOut *out) {
  CpuClusterBatch &kb = static_cast<CpuClusterBatch &>(*b);
  out->n_clusters = kb.n.data();
  out->n_outliers = kb.nout.data();
  out->begin = kb.begin.data();
  out->begin_engine = kb.begin.data();
  out->size = kb.size.data();
  out->tok_off = kb.tok_off.data();
  out->clu_off = kb.clu_off.data();
  out->order = kb.order.data();
  out->centroid = kb.centroid.data();
  out->value_sum = kb.value_sum.data();
  out->spread = kb.spread.data();
  out->value_total = kb.vtot.data();
  return Status::ok();
}

Status CpuBackend::write_pages(const PageWriteJob *jobs, uint32_t n, void *) {
  const Config &cfg = e_.config();
  const uint32_t pt = cfg.page_tokens(), d = cfg.c.head_dim;
  const size_t row = cfg.row_bytes();
  HostArena &arena = e_.arena();
  // A page: K rows, V rows (page_row_bytes apart), and with 8-bit rows the K
  // scales then the V scales (Config::page_scales_at). Centered keys: a K
  // row less its cluster's reference (centered_reference), where it has one.
  const bool int8 = cfg.int8_pages(), centered = cfg.centered_keys();
  const DType dt = cfg.dtype();
  const uint32_t scales_at = cfg.page_scales_at(), prow = cfg.page_row_bytes();
  for (uint32_t i = 0; i < n; ++i)
    if (centered && jobs[i].tokens > 0 && (!jobs[i].begin || !jobs[i].size || !jobs[i].centroid))
      return WKV_ERROR(WKV_ERR_INTERNAL, "a page write of centered keys without its clusters");
  e_.pool().parallel_for(n, [&](size_t i) {
    const PageWriteJob &j = jobs[i];
    float x[256], ref[256];  // head_dim <= 256 (checked at open)
    uint32_t c = 0;              // the cluster of token t (centered keys)
    bool has_ref = false;
    for (uint32_t t = 0; t < j.tokens; ++t) {
      if (centered && (t == 0 || t >= j.begin[c] + j.size[c])) {
        while (c + 1 < j.clusters && t >= j.begin[c] + j.size[c]) ++c;
        has_ref = centered_reference(j.centroid + size_t(c) * d, d, ref);
      }
      uint8_t *slot = arena.page_ptr(j.pages[t / pt]);
      const size_t src = static_cast<size_t>(j.order[t]) * row;
      const uint32_t r = t % pt;
      uint8_t *k = slot + static_cast<size_t>(r) * prow, *v = slot + static_cast<size_t>(pt + r) * prow;
      if (!int8) {
        std::memcpy(k, j.k + src, row);
        std::memcpy(v, j.v + src, row);
        continue;
      }
      float *scales = reinterpret_cast<float *>(slot + scales_at);
      to_float(dt, j.k + src, x, d);
      if (has_ref)
        quantize_row_centered(x, ref, d, reinterpret_cast<int8_t *>(k), &scales[r]);
      else
        quantize_row(x, d, reinterpret_cast<int8_t *>(k), &scales[r]);
      to_float(dt, j.v + src, x, d);
      quantize_row(x, d, reinterpret_cast<int8_t *>(v), &scales[pt + r]);
    }
  });
  return Status::ok();
}

Status CpuBackend::lookup(Plan &plan) {
  const Config &cfg = e_.config();
  const uint32_t d = cfg.c.head_dim, nq = cfg.c.n_q_heads, G = cfg.group();
  const float scale = cfg.scale();
  const DType dt = cfg.dtype();
  const size_t esz = dtype_bytes(dt);
  const uint32_t n = plan.n_seqs, method = cfg.c.method;
  size_t ret = 0, est = 0, lg = 0;
  for (const RunPlan &r : plan.runs) {
    ret += r.n_ret;
    est += r.n_est;
    lg += static_cast<size_t>(G) * r.clusters;
  }
  try {
    grow_to(plan.q, static_cast<size_t>(n) * nq * d);
    grow_to(plan.ret_ids, ret);
    grow_to(plan.est_ids, est);
    grow_to(plan.logits, lg);
    grow_to(plan.scores, lg / G);
    grow_to(plan.scratch, 4 * (lg / G));
    grow_to(plan.est_out, static_cast<size_t>(n) * nq * d);
    grow_to(plan.est_lse, static_cast<size_t>(n) * nq);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for a lookup");
  }
  // The query in f32 (it may change after the call).
  for (uint32_t i = 0; i < n; ++i)
    for (uint32_t h = 0; h < nq; ++h)
      to_float(dt,
               static_cast<const uint8_t *>(plan.q_src) +
                   (static_cast<size_t>(i) * plan.q_seq_stride + static_cast<size_t>(h) * plan.q_head_stride) * esz,
               &plan.q[(static_cast<size_t>(i) * nq + h) * d], d);
  std::atomic<uint64_t> cold_total{0};
  return step(plan, [&]() -> Status {
    // scores are laid out like logits, one row per run instead of G; scratch
    // likewise with four rows.
    e_.pool().parallel_for(plan.runs.size(), [&](size_t ri) {
      RunPlan &r = plan.runs[ri];
      HeadState &hs = plan.seqs[r.seq]->layer(plan.layer).heads[r.head];
      const float *q = &plan.q[(static_cast<size_t>(r.seq) * nq + static_cast<size_t>(r.head) * G) * d];
      float *est_out = &plan.est_out[(static_cast<size_t>(r.seq) * nq + static_cast<size_t>(r.head) * G) * d];
      float *est_lse = &plan.est_lse[static_cast<size_t>(r.seq) * nq + static_cast<size_t>(r.head) * G];
      if (r.clusters == 0) {
        std::fill(est_out, est_out + static_cast<size_t>(G) * d, 0.0f);
        std::fill(est_lse, est_lse + G, -std::numeric_limits<float>::infinity());
        return;
      }
      float *logits = &plan.logits[r.logits_off];
      float *score = &plan.scores[r.logits_off / G];
      uint32_t *scratch = &plan.scratch[4 * (r.logits_off / G)];
      uint32_t *ret_ids = plan.ret_ids.data() + r.ret_off, *est_ids = plan.est_ids.data() + r.est_off;
      const MetaIndex &meta = hs.meta;
      const uint32_t *size = hs.map.size.data();
      // Scoring and estimation read the compact mirror where there is one:
      // 8-bit centroid rows and value means, a quarter of the f32 arrays'
      // bytes, which bound both.
      const bool compact = meta.compact_ok && meta.centroid_q8_scale.size() == r.clusters;
      const float *spread = method & WKV_METHOD_SPREAD ? meta.spread.as<float>() : nullptr;
      if (compact)
        kernels::score_clusters_q8(q, G, meta.centroid_q8.data(), meta.centroid_q8_scale.data(), r.clusters, d, scale,
                                   logits, score, spread);
      else
        kernels::score_clusters(q, G, meta.centroid.as<float>(), r.clusters, d, scale, logits, score, spread);
      if (r.n_one > 0)
        kernels::select_zones_split(score, size, r.clusters, r.n_ret - r.n_one, r.n_one, r.n_est, ret_ids, est_ids,
                                    scratch);
      else
        kernels::select_zones(score, r.clusters, r.n_ret, r.n_est, ret_ids, est_ids, scratch);
      // One pass over the value rows serves the whole query group.
      if (compact)
        kernels::estimate_zone_group_means(logits, G, r.clusters, est_ids, r.n_est, meta.value_mean_q8.data(),
                                           meta.value_mean_q8_scale.data(), size, d, est_out, est_lse);
      else
        kernels::estimate_zone_group(logits, G, r.clusters, est_ids, r.n_est, meta.value_sum.as<float>(), size, d,
                                     est_out, est_lse);
      if (method & WKV_METHOD_TAIL)
        kernels::estimate_tail(logits, G, r.clusters, r.clusters, ret_ids, r.n_ret, est_ids, r.n_est, size,
                               hs.values.mean.as<float>(), d, est_out, est_lse, score);  // scores are spent
      // Cold pages: a retrieval-zone cluster with a page on disk is
      // estimated instead (the tail above already left it out), and its
      // pages are asked for (hs.cold.want).
      if (!hs.cold.last_used.empty()) {
        const uint32_t stamp = cold_stamp(plan.seqs[r.seq]->layer(plan.layer).last_lookup);
        uint32_t keep = 0, cold = 0;
        uint32_t *cold_ids = scratch;  // spent by the selection
        for (uint32_t i = 0; i < r.n_ret; ++i) {
          const uint32_t id = ret_ids[i];
          hs.cold.last_used[id] = stamp;
          if (cold_resident(hs, id, cfg.page_tokens()))
            ret_ids[keep++] = id;
          else
            cold_ids[cold++] = id;
        }
        if (cold > 0) {
          thread_local std::vector<float> o, l;
          o.resize(static_cast<size_t>(G) * d);
          l.resize(G);
          if (compact)
            kernels::estimate_zone_group_means(logits, G, r.clusters, cold_ids, cold, meta.value_mean_q8.data(),
                                               meta.value_mean_q8_scale.data(), size, d, o.data(), l.data());
          else
            kernels::estimate_zone_group(logits, G, r.clusters, cold_ids, cold, meta.value_sum.as<float>(), size, d,
                                         o.data(), l.data());
          for (uint32_t g = 0; g < G; ++g)
            est_lse[g] = kernels::merge_partials(est_out + static_cast<size_t>(g) * d, est_lse[g],
                                                 o.data() + static_cast<size_t>(g) * d, l[g], d,
                                                 est_out + static_cast<size_t>(g) * d);
          r.n_ret = keep;
          cold_total.fetch_add(cold, std::memory_order_relaxed);
        }
      }
      uint64_t toks = 0;
      for (uint32_t i = 0; i < r.n_ret; ++i) toks += size[ret_ids[i]];
      r.ret_tokens = toks;
    });
    const uint64_t cold = cold_total.load();
    e_.counters().cold_estimated.fetch_add(cold);
    ret -= cold;
    est += cold;
    e_.counters().retrieved_clusters.fetch_add(ret);
    e_.counters().estimated_clusters.fetch_add(est);
    return Status::ok();
  });
}

Status CpuBackend::assemble(Plan &plan) {
  const Config &cfg = e_.config();
  const size_t row = cfg.row_bytes();
  const uint32_t pt = cfg.page_tokens(), d = cfg.c.head_dim, scales_at = cfg.page_scales_at();
  const bool int8 = cfg.int8_pages(), centered = cfg.centered_keys();
  const DType dt = cfg.dtype();
  // 1. Offsets of the ragged runs.
  uint64_t total = 0;
  try {
    grow_to(plan.offsets, plan.runs.size() + 1);
    for (size_t i = 0; i < plan.runs.size(); ++i) {
      plan.offsets[i] = static_cast<int32_t>(total);
      total += plan.runs[i].steady_tokens + plan.runs[i].ret_tokens;
      if (total > static_cast<uint64_t>(std::numeric_limits<int32_t>::max()))
        return WKV_ERROR(WKV_ERR_BUDGET, "execution buffer would exceed 2^31 tokens");
    }
    plan.offsets[plan.runs.size()] = static_cast<int32_t>(total);
    grow_to(plan.xk, total * row);
    grow_to(plan.xv, total * row);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for an execution buffer of %llu tokens",
                     static_cast<unsigned long long>(total));
  }
  // 2. Steady zone, then the retrieval clusters page by page.
  std::atomic<bool> gone{false};
  return step(plan, [&]() -> Status {
    HostArena &arena = e_.arena();
    e_.pool().parallel_for(plan.runs.size(), [&](size_t ri) {
      const RunPlan &r = plan.runs[ri];
      const HeadState &hs = plan.seqs[r.seq]->layer(plan.layer).heads[r.head];
      uint8_t *xk = plan.xk.data() + static_cast<size_t>(plan.offsets[ri]) * row;
      uint8_t *xv = plan.xv.data() + static_cast<size_t>(plan.offsets[ri]) * row;
      size_t t = 0;
      auto put = [&](const uint8_t *k, const uint8_t *v, size_t rows) {
        if (rows == 0) return;  // k and v may be null then
        std::memcpy(xk + t * row, k, rows * row);
        std::memcpy(xv + t * row, v, rows * row);
        t += rows;
      };
      // m rows of a page from row `off` on, 8-bit rows dequantized (centered
      // K rows against `ref` where it is set).
      auto put_page = [&](const uint8_t *page, uint32_t off, uint32_t m, const float *ref) {
        if (!int8) {
          put(page + static_cast<size_t>(off) * row, page + static_cast<size_t>(pt + off) * row, m);
          return;
        }
        const float *scales = reinterpret_cast<const float *>(page + scales_at);
        for (uint32_t i = off; i < off + m; ++i, ++t) {
          const int8_t *kq = reinterpret_cast<const int8_t *>(page + static_cast<size_t>(i) * d);
          if (ref)
            dequantize_row_centered(dt, kq, scales[i], ref, d, xk + t * row);
          else
            dequantize_row(dt, kq, scales[i], d, xk + t * row);
          dequantize_row(dt, reinterpret_cast<const int8_t *>(page + static_cast<size_t>(pt + i) * d),
                         scales[pt + i], d, xv + t * row);
        }
      };
      put(hs.sink.k_at(0), hs.sink.v_at(0), hs.sink.n);
      put(hs.tail.k_at(0), hs.tail.v_at(0), hs.tail.n);
      float ref[256];  // head_dim <= 256
      for (uint32_t i = 0; i < r.n_ret; ++i) {
        const uint32_t id = plan.ret_ids[r.ret_off + i];
        const bool has_ref =
            centered && centered_reference(hs.meta.centroid.as<float>() + static_cast<size_t>(id) * d, d, ref);
        uint32_t slot = hs.map.first_slot[id], left = hs.map.size[id];
        while (left > 0) {
          const uint32_t off = slot % pt, m = std::min(left, pt - off);
          const PageId id_p = hs.map.pages[slot / pt];
          if (id_p == kNoPage) {  // spilled since the lookup: never read as data
            gone.store(true, std::memory_order_relaxed);
            return;
          }
          const uint8_t *page = arena.page_ptr(id_p);
          put_page(page, off, m, has_ref ? ref : nullptr);
          left -= m;
          slot += m;
        }
      }
    });
    if (gone.load())
      return WKV_ERROR(WKV_ERR_STATE, "a page the lookup chose was spilled since; look up again");
    e_.counters().attended_tokens.fetch_add(total);
    return Status::ok();
  });
}

Status CpuBackend::attend(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse) {
  const Config &cfg = e_.config();
  const uint32_t d = cfg.c.head_dim, nq = cfg.c.n_q_heads, G = cfg.group();
  const size_t row = cfg.row_bytes();
  const DType dt = cfg.dtype();
  const size_t esz = dtype_bytes(dt);
  try {
    grow_to(plan.exact_out, static_cast<size_t>(plan.n_seqs) * nq * d);
    grow_to(plan.exact_lse, static_cast<size_t>(plan.n_seqs) * nq);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for attention scratch");
  }
  return step(plan, [&]() -> Status {
    e_.pool().parallel_for(plan.runs.size(), [&](size_t ri) {
      const RunPlan &r = plan.runs[ri];
      const size_t qh = static_cast<size_t>(r.seq) * nq + static_cast<size_t>(r.head) * G;
      float *o = &plan.exact_out[qh * d];
      float *l = &plan.exact_lse[qh];
      const uint32_t n = static_cast<uint32_t>(plan.offsets[ri + 1] - plan.offsets[ri]);
      kernels::attend_exact(dt, &plan.q[qh * d], G, plan.xk.data() + plan.offsets[ri] * row,
                            plan.xv.data() + plan.offsets[ri] * row, n, d, cfg.scale(), o, l);
      for (uint32_t g = 0; g < G; ++g) {
        const float merged = kernels::merge_partials(o + g * d, l[g], &plan.est_out[(qh + g) * d],
                                                     plan.est_lse[qh + g], d, o + g * d);
        uint8_t *dst = static_cast<uint8_t *>(out) + (static_cast<size_t>(r.seq) * seq_stride +
                                                      static_cast<size_t>(r.head * G + g) * head_stride) *
                                                         esz;
        from_float(dt, o + g * d, dst, d);
        if (lse) lse[static_cast<size_t>(r.seq) * nq + r.head * G + g] = merged;
      }
    });
    return Status::ok();
  });
}

Status CpuBackend::merge(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
                         int64_t lse_seq_stride) {
  const Config &cfg = e_.config();
  const uint32_t d = cfg.c.head_dim, nq = cfg.c.n_q_heads;
  const DType dt = cfg.dtype();
  const size_t esz = dtype_bytes(dt);
  return step(plan, [&]() -> Status {
    e_.pool().parallel_for(plan.n_seqs, [&](size_t s) {
      float o[256];  // head_dim <= 256 (checked at open)
      for (uint32_t h = 0; h < nq; ++h) {
        uint8_t *dst = static_cast<uint8_t *>(out) +
                       (s * static_cast<size_t>(seq_stride) + static_cast<size_t>(h) * head_stride) * esz;
        to_float(dt, dst, o, d);
        float &l = lse[s * static_cast<size_t>(lse_seq_stride) + h];
        const size_t qh = s * nq + h;
        l = kernels::merge_partials(o, l, &plan.est_out[qh * d], plan.est_lse[qh], d, o);
        from_float(dt, o, dst, d);
      }
    });
    return Status::ok();
  });
}

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(Engine &engine) { return std::make_unique<CpuBackend>(engine); }

}  // namespace wkv
