// The CPU backend: host memory stands in for the device (no cache tier), the
// kernels are the CPU references, and work is spread over the engine's pool
// across (sequence, KV head) runs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu_kernels.hpp"
#include "lib/engine/engine.hpp"
#include "lib/engine/plan.hpp"
#include "lib/engine/sequence.hpp"

namespace wkv {
namespace {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(Engine &e) : e_(e) {}
  uint32_t device() const override { return WKV_DEVICE_CPU; }
  Status append(Sequence &seq, uint32_t layer, const uint8_t *k, const uint8_t *v, uint32_t n,
                int64_t token_stride, int64_t head_stride, void *) override {
    return seq.append_host(layer, k, v, n, token_stride, head_stride);
  }
  Status finish_prompt(Sequence &seq, uint32_t layer, void *) override {
    return seq.finish_prompt_host(layer);
  }
  Status lookup(Plan &plan) override;
  Status assemble(Plan &plan) override;
  Status attend(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse) override;
  Status merge(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
               int64_t lse_seq_stride) override;
  Status update(Plan &plan) override;
  void xbuf(const Plan &plan, wkv_xbuf_view *view) override {
    view->n_runs = static_cast<uint32_t>(plan.runs.size());
    view->n_tokens = static_cast<uint64_t>(plan.offsets[plan.runs.size()]);
    view->k = plan.xk.data();
    view->v = plan.xv.data();
    view->offsets = plan.offsets.data();
  }

 private:
  Engine &e_;
};

Status CpuBackend::lookup(Plan &plan) {
  const Config &cfg = e_.config();
  const uint32_t d = cfg.c.head_dim, nq = cfg.c.n_q_heads, G = cfg.group();
  const float scale = cfg.scale();
  uint64_t ret_total = 0, est_total = 0;
  for (const RunPlan &r : plan.runs) {
    ret_total += r.n_ret;
    est_total += r.n_est;
  }
  // scores and scratch are laid out like logits, one row per run instead of G.
  e_.pool().parallel_for(plan.runs.size(), [&](size_t ri) {
    RunPlan &r = plan.runs[ri];
    const MetaIndex &meta = plan.seqs[r.seq]->layer(plan.layer).heads[r.head].index.meta;
    const float *q = &plan.q[(static_cast<size_t>(r.seq) * nq + static_cast<size_t>(r.head) * G) * d];
    float *est_out = &plan.est_out[(static_cast<size_t>(r.seq) * nq + static_cast<size_t>(r.head) * G) * d];
    float *est_lse = &plan.est_lse[static_cast<size_t>(r.seq) * nq + static_cast<size_t>(r.head) * G];
    if (r.clusters == 0) {
      std::fill(est_out, est_out + static_cast<size_t>(G) * d, 0.0f);
      std::fill(est_lse, est_lse + G, -std::numeric_limits<float>::infinity());
      return;
    }
    float *logits = &plan.logits[r.logits_off];
    // The per-run offset into scores/scratch is logits_off / G.
    float *score = &plan.scores[r.logits_off / G];
    uint32_t *scratch = &plan.scratch[r.logits_off / G];
    uint32_t *ret_ids = plan.ret_ids.data() + r.ret_off, *est_ids = plan.est_ids.data() + r.est_off;
    // Scoring and estimation read the meta index's f16 mirror where there
    // is one: half the bytes of the f32 arrays, and both are bound by them.
    const bool mirror = meta.has_f16();
    if (mirror)
      kernels::score_clusters(DType::kF16, q, G, meta.centroid_f16.data(), r.clusters, d, scale, logits, score);
    else
      kernels::score_clusters(q, G, meta.centroid.data(), r.clusters, d, scale, logits, score);
    kernels::select_zones(score, r.clusters, r.n_ret, r.n_est, ret_ids, est_ids, scratch);
    // One pass over the value rows serves the whole query group.
    if (mirror)
      kernels::estimate_zone_group_means(logits, G, r.clusters, est_ids, r.n_est, meta.value_mean_f16.data(),
                                         meta.size.data(), d, est_out, est_lse);
    else
      kernels::estimate_zone_group(logits, G, r.clusters, est_ids, r.n_est, meta.value_sum.data(),
                                   meta.size.data(), d, est_out, est_lse);
    uint64_t toks = 0;
    for (uint32_t i = 0; i < r.n_ret; ++i) toks += meta.size[ret_ids[i]];
    r.ret_tokens = toks;
  });
  e_.counters().retrieved_clusters.fetch_add(ret_total);
  e_.counters().estimated_clusters.fetch_add(est_total);
  return Status::ok();
}

Status CpuBackend::assemble(Plan &plan) {
  const Config &cfg = e_.config();
  const size_t row = cfg.row_bytes();
  const uint32_t pt = cfg.page_tokens();
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
  HostArena &arena = e_.arena();
  e_.pool().parallel_for(plan.runs.size(), [&](size_t ri) {
    const RunPlan &r = plan.runs[ri];
    const HeadState &hs = plan.seqs[r.seq]->layer(plan.layer).heads[r.head];
    uint8_t *xk = plan.xk.data() + static_cast<size_t>(plan.offsets[ri]) * row;
    uint8_t *xv = plan.xv.data() + static_cast<size_t>(plan.offsets[ri]) * row;
    size_t t = 0;
    auto put = [&](const uint8_t *k, const uint8_t *v, size_t rows) {
      std::memcpy(xk + t * row, k, rows * row);
      std::memcpy(xv + t * row, v, rows * row);
      t += rows;
    };
    put(hs.sink.k_data(), hs.sink.v_data(), hs.sink.rows());
    put(hs.tail.k_data(), hs.tail.v_data(), hs.tail.rows());
    for (uint32_t i = 0; i < r.n_ret; ++i) {
      const ClusterDesc &cd = hs.index.map[plan.ret_ids[r.ret_off + i]];
      uint32_t page = cd.page, off = cd.offset, left = cd.size;
      while (left > 0) {
        uint32_t n = std::min(left, pt - off);
        const uint8_t *slot = arena.page_ptr(hs.index.pages[page]);
        put(slot + static_cast<size_t>(off) * row, slot + static_cast<size_t>(pt + off) * row, n);
        left -= n;
        off = 0;
        ++page;
      }
    }
  });
  e_.counters().attended_tokens.fetch_add(total);
  return Status::ok();
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
  e_.pool().parallel_for(plan.runs.size(), [&](size_t ri) {
    const RunPlan &r = plan.runs[ri];
    const size_t qh = static_cast<size_t>(r.seq) * nq + static_cast<size_t>(r.head) * G;
    float *o = &plan.exact_out[qh * d];
    float *l = &plan.exact_lse[qh];
    uint32_t n = static_cast<uint32_t>(plan.offsets[ri + 1] - plan.offsets[ri]);
    kernels::attend_exact(dt, &plan.q[qh * d], G, plan.xk.data() + plan.offsets[ri] * row,
                          plan.xv.data() + plan.offsets[ri] * row, n, d, cfg.scale(), o, l);
    for (uint32_t g = 0; g < G; ++g) {
      float merged = kernels::merge_partials(o + g * d, l[g], &plan.est_out[(qh + g) * d],
                                             plan.est_lse[qh + g], d, o + g * d);
      uint8_t *dst = static_cast<uint8_t *>(out) +
                     (static_cast<size_t>(r.seq) * seq_stride +
                      static_cast<size_t>(r.head * G + g) * head_stride) * esz;
      from_float(dt, o + g * d, dst, d);
      if (lse) lse[static_cast<size_t>(r.seq) * nq + r.head * G + g] = merged;
    }
  });
  return Status::ok();
}

Status CpuBackend::merge(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
                         int64_t lse_seq_stride) {
  const Config &cfg = e_.config();
  const uint32_t d = cfg.c.head_dim, nq = cfg.c.n_q_heads;
  const DType dt = cfg.dtype();
  const size_t esz = dtype_bytes(dt);
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
}

Status CpuBackend::update(Plan &plan) {
  // No cache tier on the CPU: the access record only refreshes recency, which
  // the spill tier uses to pick cold clusters.
  for (const RunPlan &r : plan.runs) {
    MappingTable &map = plan.seqs[r.seq]->layer(plan.layer).heads[r.head].index.map;
    for (uint32_t i = 0; i < r.n_ret; ++i) map[plan.ret_ids[r.ret_off + i]].last_access = plan.epoch;
  }
  return Status::ok();
}

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(Engine &engine) { return std::make_unique<CpuBackend>(engine); }

}  // namespace wkv
