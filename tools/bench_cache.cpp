// `wavekv bench cache`: what a device block cache of a given size can hold
// of a decoding workload's retrieval, by replacement policy, against the
// best any policy can do.
//
// A CPU engine decodes the workload (the lookups choose the retrieval zone
// as a CUDA engine's do: the same index and zone rules) and every step's
// retrieved units (page_tokens members of a cluster, as the device cache
// holds them) are traced in order. The trace is then replayed against
// caches of the given sizes, each a fraction of the KV held (the serving
// benchmark's device cache is 5%), under:
//   lru, clock, slru
//          the engine's own policies (lib/buffer/replacement.hpp: LRU with
//          lazy promotion, the default; CLOCK with a two-bit count;
//          segmented LRU), every miss admitted;
//   lru+near, clock+near, slru+near
//          score-aware: the same policy, and before each lookup's reads
//          the cached units of its estimation zone's best clusters (--near
//          times as many as it retrieves, by their best logit in the query
//          group) are touched as if read, so that clusters the queries
//          come close to stay cached (nothing is admitted for them);
//   engine the engine's buffer manager itself, its thread running as in an
//          engine: a miss is admitted only to a frame the manager handed
//          ahead (run_engine), one lookup every --step-us;
//   opt    Belady's optimum with bypass: on a miss, the unit is admitted
//          only if it is read again before some resident unit is, and then
//          takes the frame of the resident read again last (or never). No
//          policy that sees only the past reads more of the trace from the
//          cache: it bounds the hit ratio that a cache of that size can
//          reach on the workload.
// and "first" counts the misses no cache can avoid: units read for the
// first time in the run (after the warm-up).
//
// The engine's cache admits fewer misses than lru (its frames are handed
// to a step ahead, bench/RESULTS.md "Why half the misses"): engine replays
// that on the host's clock, the host playing the GPU's gather, and so
// depends on the host's load (run it on an idle machine). The bytes a step
// misses at a policy's ratio, over the host-to-device link (--link-gbs),
// bound the step's time from below whatever its kernels do.
//
// Workloads:
//   serving  bench/gpu_serving_bench.cu's (tools/serving_workload.hpp):
//            --batch sequences of --tokens tokens (sequence i has 97 i
//            more), 8 KV heads, 32 q heads, d = 128, bf16, one layer (the
//            benchmark's layers repeat one context and one query stream);
//            each step appends one token per sequence, then decodes; as
//            in the benchmark, 16 warm-up decodes of the first 8 steps'
//            queries (not appended) come first and are not counted.
//   real     the real-attention set (--real-dir): its 6 layers (or the first
//            --layers) of one sequence, the 8128-token prompt, then 64
//            steps of the model's queries, one token appended before each;
//            the first step (a cold cache) is not counted.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <limits>
#include <memory>
#include <queue>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "lib/engine/engine.hpp"
#include "lib/engine/plan.hpp"
#include "lib/engine/sequence.hpp"
#include "lib/buffer/buffer_manager.hpp"
#include "lib/buffer/host_device.hpp"
#include "lib/buffer/replacement.hpp"
#include "tools/commands.hpp"
#include "tools/exact.hpp"
#include "tools/serving_workload.hpp"
#include "tools/synth.hpp"

namespace wkv_tool {

namespace {

// Every unit a workload's steps retrieved, in order.
struct Trace {
  std::vector<uint32_t> unit;    // dense id of the unit read (a run's unit of a stream)
  std::vector<uint32_t> rows;    // its rows (a cluster's last unit may be short)
  std::vector<uint32_t> run;     // the run of its lookup that read it
  std::vector<size_t> step_end;  // accesses before the end of each step
  // Each lookup (a layer-step, the engine's access record): accesses before
  // its end, its record key (layer + 1), the units a CUDA engine would let
  // it admit (the bound of its retrieval, as the engine sizes it), and its
  // runs' heads (dense ids of (stream, KV head)) from heads_begin on.
  std::vector<size_t> lookup_end, heads_begin;
  std::vector<uint32_t> lookup_key, lookup_want, heads;
  // Each lookup's near units (the +near policies), near_end[x] the end of
  // lookup x's.
  std::vector<uint32_t> near_unit;
  std::vector<size_t> near_end;
  uint32_t n_units = 0, n_heads = 0;  // distinct units and heads
  // The first access counted.
  size_t first_counted() const { return counted_from == 0 ? 0 : step_end[counted_from - 1]; }
  uint32_t counted_from = 0;     // first step counted (those before warm the cache)
  uint32_t layers = 1;           // layers a step covers
  uint64_t kv_units = 0;         // the KV held, in units: what the cache's fraction is of
  uint32_t page_tokens = 0, row_bytes = 0;
  uint64_t ret_tokens = 0;       // retrieved tokens over the counted steps
};

// Assigns dense ids to (stream, KV head, unit) and records a plan's lookup.
class Recorder {
 public:
  // group: q heads a KV head serves; near: the near clusters recorded, of
  // the retrieval zone's (0: none).
  Recorder(Trace *t, uint32_t group, double near) : t_(t), group_(group), near_(near) {}

  // The retrieval of `plan`'s latest lookup at `layer`: run r of the plan
  // is sequence seqs[r / H] and head r % H; stream identifies the sequence
  // and layer (units of different streams are different units).
  void lookup(const wkv::Plan &plan, const std::vector<std::shared_ptr<wkv::Sequence>> &seqs, uint32_t layer,
              const std::vector<uint32_t> &stream_of_seq, bool counted) {
    const uint32_t pt = t_->page_tokens;
    uint64_t want = 0;
    t_->heads_begin.push_back(t_->heads.size());
    for (uint32_t ri = 0; ri < plan.runs.size(); ++ri) {
      const wkv::RunPlan &r = plan.runs[ri];
      const wkv::HeadState &hs = seqs[r.seq]->layer(layer).heads[r.head];
      const uint64_t prefix = (uint64_t(stream_of_seq[r.seq]) << 48) | (uint64_t(r.head) << 32);
      auto [head, fresh_head] = heads_.try_emplace(prefix, static_cast<uint32_t>(heads_.size()));
      t_->heads.push_back(head->second);
      for (uint32_t i = 0; i < r.n_ret; ++i) {
        const uint32_t c = plan.ret_ids[r.ret_off + i], size = hs.map.size[c], ub = hs.map.unit_begin[c];
        for (uint32_t j = 0; j * pt < size; ++j) {
          t_->unit.push_back(id(prefix | (ub + j)));
          t_->rows.push_back(std::min(pt, size - j * pt));
          t_->run.push_back(ri);
        }
        if (counted) t_->ret_tokens += size;
      }
      want += wkv::ret_units_bound(hs, r.n_ret, pt);  // what a CUDA engine lets the step admit
      if (near_ > 0) record_near(plan, r, hs, prefix);
    }
    t_->lookup_end.push_back(t_->unit.size());
    t_->near_end.push_back(t_->near_unit.size());
    t_->lookup_key.push_back(layer + 1);
    t_->lookup_want.push_back(static_cast<uint32_t>(std::min<uint64_t>(want, UINT32_MAX)));
    t_->n_units = static_cast<uint32_t>(ids_.size());
    t_->n_heads = static_cast<uint32_t>(heads_.size());
  }
  void end_step() { t_->step_end.push_back(t_->unit.size()); }

 private:
  uint32_t id(uint64_t key) { return ids_.try_emplace(key, static_cast<uint32_t>(ids_.size())).first->second; }

  // The units of run r's best estimation-zone clusters, ranked by their
  // best logit in the query group (the plan's logits: G rows of r.clusters).
  void record_near(const wkv::Plan &plan, const wkv::RunPlan &r, const wkv::HeadState &hs, uint64_t prefix) {
    const uint32_t n = std::min<uint32_t>(r.n_est, static_cast<uint32_t>(near_ * r.n_ret));
    if (n == 0) return;
    const float *logits = &plan.logits[r.logits_off];
    ranked_.clear();
    for (uint32_t i = 0; i < r.n_est; ++i) {
      const uint32_t c = plan.est_ids[r.est_off + i];
      float best = logits[c];
      for (uint32_t g = 1; g < group_; ++g) best = std::max(best, logits[size_t(g) * r.clusters + c]);
      ranked_.emplace_back(best, c);
    }
    std::partial_sort(ranked_.begin(), ranked_.begin() + n, ranked_.end(), std::greater<>());
    const uint32_t pt = t_->page_tokens;
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t c = ranked_[i].second;
      for (uint32_t j = 0; j * pt < hs.map.size[c]; ++j) t_->near_unit.push_back(id(prefix | (hs.map.unit_begin[c] + j)));
    }
  }

  Trace *t_;
  uint32_t group_;
  double near_;
  std::unordered_map<uint64_t, uint32_t> ids_, heads_;
  std::vector<std::pair<float, uint32_t>> ranked_;
};

std::shared_ptr<wkv::Engine> open_engine(const Options &o, uint32_t layers, uint32_t q_heads, uint32_t kv_heads,
                                         uint32_t d, uint32_t dtype, unsigned threads) {
  wkv_config c;
  wkv_config_init(&c);
  if (o.page_bytes) c.page_bytes = static_cast<uint32_t>(o.page_bytes);
  c.n_layers = layers;
  c.n_q_heads = q_heads;
  c.n_kv_heads = kv_heads;
  c.head_dim = d;
  c.dtype = dtype;
  c.threads = threads;
  std::shared_ptr<wkv::Engine> e;
  ok(wkv::Engine::open(&c, &e), "opening the engine");
  return e;
}

// The serving benchmark's workload (file comment).
Trace trace_serving(const Options &o) {
  namespace w = wkv_workload;
  const uint32_t B = static_cast<uint32_t>(o.batch), steps = static_cast<uint32_t>(o.steps);
  const uint32_t focus = static_cast<uint32_t>(o.repeat);
  const float noise = static_cast<float>(o.noise);
  const unsigned threads = o.resolved_threads();
  WorkerPool pool(threads);
  std::shared_ptr<wkv::Engine> e = open_engine(o, 1, w::kQ, w::kH, w::kD, WKV_DTYPE_BF16, threads);
  Trace t;
  t.page_tokens = e->config().page_tokens();
  t.row_bytes = e->config().page_token_bytes();  // a row in a page, with its scale where it has one
  const uint32_t tok = w::kH * w::kD;  // elements of one token's K (or V)

  // The tokens of sequence i at positions [p0, p0 + n), as bf16 rows.
  std::vector<float> k32, v32;
  std::vector<uint16_t> kb, vb;
  auto tokens = [&](uint32_t i, uint32_t p0, uint32_t n) {
    k32.resize(size_t(n) * tok);
    v32.resize(size_t(n) * tok);
    pool.run(n, [&](size_t x) {
      for (uint32_t h = 0; h < w::kH; ++h)
        for (uint32_t j = 0; j < w::kD / 2; ++j) {
          float *k = &k32[x * tok + h * w::kD], *v = &v32[x * tok + h * w::kD];
          w::token_pair(i, p0 + static_cast<uint32_t>(x), h, j, &k[j], &k[j + w::kD / 2], &v[j], &v[j + w::kD / 2]);
        }
    });
    kb.resize(k32.size());
    vb.resize(v32.size());
    to_storage(WKV_DTYPE_BF16, k32.data(), kb.data(), k32.size());
    to_storage(WKV_DTYPE_BF16, v32.data(), vb.data(), v32.size());
  };
  std::vector<float> q32(size_t(B) * w::kQ * w::kD);
  std::vector<uint16_t> qb(q32.size());
  // The queries of step `step`, at the position of the step's token.
  auto queries = [&](const std::vector<uint32_t> &len, uint32_t step) {
    for (uint32_t i = 0; i < B; ++i)
      for (uint32_t qh = 0; qh < w::kQ; ++qh)
        for (uint32_t j = 0; j < w::kD / 2; ++j) {
          float *q = &q32[(size_t(i) * w::kQ + qh) * w::kD];
          w::query_pair(i, step, len[i] + step, qh, j, focus, noise, &q[j], &q[j + w::kD / 2]);
        }
    to_storage(WKV_DTYPE_BF16, q32.data(), qb.data(), q32.size());
  };

  std::vector<std::shared_ptr<wkv::Sequence>> seqs(B);
  std::vector<uint32_t> len(B), stream(B);
  {
    uint64_t total = 0;
    for (uint32_t i = 0; i < B; ++i) total += o.tokens + 97ull * i;
    Progress p("generating and ingesting", total);
    uint64_t done_all = 0;
    for (uint32_t i = 0; i < B; ++i) {
      len[i] = static_cast<uint32_t>(o.tokens + 97ull * i);
      stream[i] = i;
      ok(wkv::Sequence::create(e, &seqs[i]), "creating a sequence");
      for (uint32_t done = 0; done < len[i];) {
        const uint32_t m = std::min<uint32_t>(8192, len[i] - done);
        tokens(i, done, m);
        ok(e->append(*seqs[i], 0, reinterpret_cast<const uint8_t *>(kb.data()),
                     reinterpret_cast<const uint8_t *>(vb.data()), m, tok, w::kD, nullptr),
           "append");
        done += m;
        p.update(done_all + done);
      }
      done_all += len[i];
      ok(e->end_prompt(*seqs[i], 0, nullptr), "end of the prompt");
    }
    p.finish();
  }
  uint64_t held = 0;
  for (uint32_t i = 0; i < B; ++i) held += len[i];
  t.kv_units = held * w::kH / t.page_tokens;

  std::shared_ptr<wkv::StepTracker> tracker;
  ok(e->buffers().new_tracker(&tracker), "a plan's tracker");
  wkv::Plan plan(e, tracker);
  Recorder rec(&t, w::kQ / w::kH, o.near);
  const int64_t q_seq = int64_t(w::kQ) * w::kD;
  // Warm-up: the first 8 steps' queries twice, on the prompt.
  constexpr uint32_t kWarmup = 16;
  for (uint32_t s = 0; s < kWarmup; ++s) {
    queries(len, s % 8);
    ok(e->lookup(plan, seqs.data(), B, 0, qb.data(), q_seq, w::kD, nullptr), "lookup");
    rec.lookup(plan, seqs, 0, stream, false);
    rec.end_step();
  }
  t.counted_from = kWarmup;
  Progress p("decoding", steps);
  for (uint32_t s = 0; s < steps; ++s) {
    for (uint32_t i = 0; i < B; ++i) {
      tokens(i, len[i] + s, 1);
      ok(e->append(*seqs[i], 0, reinterpret_cast<const uint8_t *>(kb.data()),
                   reinterpret_cast<const uint8_t *>(vb.data()), 1, tok, w::kD, nullptr),
         "append");
    }
    queries(len, s);
    ok(e->lookup(plan, seqs.data(), B, 0, qb.data(), q_seq, w::kD, nullptr), "lookup");
    rec.lookup(plan, seqs, 0, stream, true);
    rec.end_step();
    p.update(s + 1);
  }
  p.finish();
  return t;
}

// The real-attention set (file comment); false where it is absent.
bool trace_real(const Options &o, Trace *out) {
  const uint32_t L = static_cast<uint32_t>(o.layers);
  std::vector<std::vector<uint16_t>> raw(L);
  for (uint32_t l = 0; l < L; ++l)
    if (!read_real_layer(o.real_dir, l, &raw[l])) return false;
  const unsigned threads = o.resolved_threads();
  std::shared_ptr<wkv::Engine> e = open_engine(o, L, kRealQ, kRealKV, kRealD, WKV_DTYPE_F16, threads);
  Trace &t = *out;
  t.layers = L;
  t.page_tokens = e->config().page_tokens();
  t.row_bytes = e->config().page_token_bytes();  // a row in a page, with its scale where it has one
  const uint32_t prompt = kRealT - kRealQueries, d = kRealD;
  const size_t kv = size_t(kRealT) * kRealKV * d;
  std::vector<std::shared_ptr<wkv::Sequence>> seqs(1);
  ok(wkv::Sequence::create(e, &seqs[0]), "creating the sequence");
  for (uint32_t l = 0; l < L; ++l) {
    const uint8_t *K = reinterpret_cast<const uint8_t *>(raw[l].data());
    ok(e->append(*seqs[0], l, K, K + kv * 2, prompt, kRealKV * d, d, nullptr), "append");
    ok(e->end_prompt(*seqs[0], l, nullptr), "end of the prompt");
  }
  t.kv_units = uint64_t(prompt) * kRealKV * L / t.page_tokens;
  std::shared_ptr<wkv::StepTracker> tracker;
  ok(e->buffers().new_tracker(&tracker), "a plan's tracker");
  wkv::Plan plan(e, tracker);
  Recorder rec(&t, kRealQ / kRealKV, o.near);
  t.counted_from = 1;
  for (uint32_t j = 0; j < kRealQueries; ++j) {
    for (uint32_t l = 0; l < L; ++l) {
      const uint8_t *K = reinterpret_cast<const uint8_t *>(raw[l].data()), *V = K + kv * 2;
      const size_t row = size_t(prompt + j) * kRealKV * d * 2;
      ok(e->append(*seqs[0], l, K + row, V + row, 1, kRealKV * d, d, nullptr), "append");
      const uint8_t *Q = V + kv * 2 + size_t(j) * kRealQ * d * 2;
      ok(e->lookup(plan, seqs.data(), 1, l, Q, int64_t(kRealQ) * d, d, nullptr), "lookup");
      rec.lookup(plan, seqs, l, {l}, j >= t.counted_from);
    }
    rec.end_step();
  }
  return true;
}

// What one policy at one size read from the cache over the counted steps.
struct Outcome {
  uint64_t hits = 0, misses = 0;
  uint64_t missed_rows = 0;
};

constexpr uint32_t kNever = std::numeric_limits<uint32_t>::max();

// Hits and misses of the counted accesses: `hit(i)` replays access i and
// says whether the cache held its unit.
template <typename F> Outcome replay(const Trace &t, F &&hit) {
  Outcome r;
  const size_t first = t.first_counted();
  for (size_t i = 0; i < t.unit.size(); ++i) {
    const bool h = hit(i);
    if (i < first) continue;
    if (h) {
      ++r.hits;
    } else {
      ++r.misses;
      r.missed_rows += t.rows[i];
    }
  }
  return r;
}

// The engine's replacement policy `name` (lib/buffer/replacement.hpp) over
// `cap` frames, every miss admitted: to a free frame while there is one,
// then to the policy's victim's. With `near`, each lookup's near units that
// are cached are touched before its reads.
Outcome replay_policy(const Trace &t, uint32_t n_units, uint64_t cap, const std::string &name, bool near) {
  const uint32_t frames = static_cast<uint32_t>(cap);
  std::unique_ptr<wkv::ReplacementPolicy> policy = wkv::make_policy(name, frames);
  std::vector<uint32_t> frame_of(n_units, kNever), unit_in(frames, kNever);
  uint32_t used = 0;
  size_t lookup = 0;  // the next lookup whose reads begin
  return replay(t, [&](size_t i) {
    for (; near && lookup < t.lookup_end.size() && i == (lookup ? t.lookup_end[lookup - 1] : 0); ++lookup)
      for (size_t k = lookup ? t.near_end[lookup - 1] : 0; k < t.near_end[lookup]; ++k)
        if (const uint32_t f = frame_of[t.near_unit[k]]; f != kNever) policy->on_access(f);
    const uint32_t u = t.unit[i];
    if (frame_of[u] != kNever) {
      policy->on_access(frame_of[u]);
      return true;
    }
    uint32_t f = used;
    if (used < frames) {
      ++used;
    } else {
      const int64_t v = policy->victim();
      if (v < 0) throw WkvError("bench cache: policy " + name + " gave no victim with every frame resident");
      f = static_cast<uint32_t>(v);
      policy->on_erase(f);
      frame_of[unit_in[f]] = kNever;
    }
    unit_in[f] = u;
    frame_of[u] = f;
    policy->on_insert(f);
    return false;
  });
}

// The engine's buffer manager (lib/buffer/buffer_manager.hpp) over `cap`
// frames, its thread running as in an engine, each lookup of the trace one
// step whose access record the manager takes: the step reads the unit map,
// logs its hits, and takes a frame from the pool for each miss while the
// pool has one (as the CUDA gather does, up to the record's room), one step
// every `step_us` (a serving step's length on the GPU; 0: back to back).
// Unlike the policies above, a miss is admitted only if the manager has
// handed a free frame ahead of the step: this is what the engine's cache
// would hold, on the host's clock.
Outcome run_engine(const Trace &t, uint32_t n_units, uint64_t cap, uint64_t step_us) {
  std::vector<uint32_t> unit_map(n_units, wkv::kNoFrame);  // before the manager: its thread clears entries
  wkv::HostDevice dev;
  wkv::BufferManager::Options mo;
  mo.units = static_cast<uint32_t>(cap);
  wkv::BufferManager bm(mo, &dev);
  ok(bm.start(), "starting the buffer manager");
  std::shared_ptr<wkv::StepTracker> tracker;
  ok(bm.new_tracker(&tracker), "a tracker");
  std::vector<uint64_t> words(t.n_heads);
  for (uint64_t &w : words) {
    uint32_t gen = 0;
    const uint32_t id = bm.head_created(&gen);
    w = (static_cast<uint64_t>(id) << 32) | gen;
  }
  const wkv::FramePool pool = bm.pool();
  const size_t first = t.first_counted();
  Outcome r;
  std::vector<uint64_t> heads;
  auto next = Clock::now();
  size_t i = 0;
  for (size_t x = 0; x < t.lookup_end.size(); ++x) {
    const size_t h_end = x + 1 < t.heads_begin.size() ? t.heads_begin[x + 1] : t.heads.size();
    heads.clear();
    for (size_t k = t.heads_begin[x]; k < h_end; ++k) heads.push_back(words[t.heads[k]]);
    const uint32_t want = t.lookup_want[x];
    const uint64_t epoch = bm.begin(*tracker);
    const wkv::StepRecord rec = bm.open_record(*tracker, epoch, heads.data(), static_cast<uint32_t>(heads.size()),
                                               want, std::min<uint32_t>(want, 16384), t.lookup_key[x]);
    wkv::BufferManager::reading_on_host(*tracker, epoch);
    uint32_t used = 0, missed = 0, hits = 0;
    for (; i < t.lookup_end[x]; ++i) {
      const uint32_t u = t.unit[i];
      const uint32_t f = __atomic_load_n(&unit_map[u], __ATOMIC_RELAXED);
      if (f != wkv::kNoFrame) {
        if (rec.header && hits < rec.hit_cap) rec.hits[hits] = f;
        ++hits;
        if (i >= first) ++r.hits;
        continue;
      }
      ++missed;
      if (i >= first) {
        ++r.misses;
        r.missed_rows += t.rows[i];
      }
      if (rec.header && used < rec.admit_cap) rec.admits[used++] = wkv::admit_on_host(pool, &unit_map[u], t.run[i]);
    }
    if (rec.header) wkv::close_record_on_host(rec, pool, used, hits, missed);
    bm.end_on_host(*tracker, epoch);
    if (step_us) {
      next += std::chrono::microseconds(step_us);
      std::this_thread::sleep_until(next);
    }
  }
  if (!bm.quiesce(60000)) throw WkvError("bench cache: the buffer manager did not take every record within 60 s");
  for (uint64_t w : words) bm.head_destroyed(static_cast<uint32_t>(w >> 32));
  return r;
}

Outcome run_opt(const Trace &t, uint32_t n_units, uint64_t cap) {
  // next[i]: the access that reads access i's unit again (kNever: none).
  std::vector<uint32_t> next(t.unit.size()), last(n_units, kNever);
  for (size_t i = t.unit.size(); i-- > 0;) {
    next[i] = last[t.unit[i]];
    last[t.unit[i]] = static_cast<uint32_t>(i);
  }
  // Residents by their next read, latest on top; an entry is stale once its
  // unit has been read again or evicted (its next read no longer matches).
  std::vector<uint32_t> due(n_units, 0);
  std::vector<uint8_t> in(n_units, 0);
  std::priority_queue<std::pair<uint32_t, uint32_t>> heap;  // (next read, unit)
  uint64_t resident = 0;
  auto top = [&]() {
    while (!heap.empty() && (!in[heap.top().second] || due[heap.top().second] != heap.top().first)) heap.pop();
    return heap.top();
  };
  return replay(t, [&](size_t i) {
    const uint32_t u = t.unit[i], nx = next[i];
    if (in[u]) {
      due[u] = nx;
      heap.emplace(nx, u);
      return true;
    }
    if (nx == kNever) return false;  // never read again: bypassed
    if (resident >= cap) {
      const auto far = top();
      if (far.first <= nx) return false;  // every resident is read before this unit: bypassed
      in[far.second] = 0;
      heap.pop();
      --resident;
    }
    in[u] = 1;
    due[u] = nx;
    heap.emplace(nx, u);
    ++resident;
    return false;
  });
}

// Misses of units read for the first time in the counted steps.
Outcome run_first(const Trace &t, uint32_t n_units) {
  std::vector<uint8_t> seen(n_units, 0);
  return replay(t, [&](size_t i) {
    const uint32_t u = t.unit[i];
    if (seen[u]) return true;
    seen[u] = 1;
    return false;
  });
}

}  // namespace

void declare_bench_cache(CLI::App &cmd, Options *o) {
  o->workload = "serving";
  o->tokens = 131072;
  o->steps = 1088;
  o->repeat = wkv_workload::kFocusSteps;
  o->noise = wkv_workload::kQueryNoise;
  o->batch = 1;
  o->fractions = "0.025,0.05,0.1,0.2";
  o->policy = "lru,clock,opt";
  o->step_us = 560;
  o->link_gbs = 55;
  o->near = 1;
  o->real_dir = "../shared/data/real-attention";
  o->layers = kRealLayers;
  cmd.add_option("--workload", o->workload, "serving (the GPU serving benchmark's) or real (the real-attention set)")
      ->check(CLI::IsMember({"serving", "real"}))
      ->capture_default_str();
  cmd.add_option("--tokens", o->tokens, "serving: prompt tokens of each sequence")
      ->check(CLI::Range(uint64_t{1024}, uint64_t{1} << 24))
      ->capture_default_str();
  cmd.add_option("--batch", o->batch, "serving: sequences sharing the cache")->check(CLI::Range(1, 64))->capture_default_str();
  cmd.add_option("--steps", o->steps, "serving: decoding steps traced (after 16 warm-up decodes)")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  cmd.add_option("--repeat", o->repeat, "serving: steps a query holds its topic")->check(CLI::Range(1, 1000000))->capture_default_str();
  cmd.add_option("--noise", o->noise, "serving: the queries' noise, of the topic's scale")
      ->check(CLI::Range(0.0, 10.0))
      ->capture_default_str();
  cmd.add_option("--real-dir", o->real_dir, "real: the real-attention set (layerN.f16 files)")->capture_default_str();
  cmd.add_option("--layers", o->layers, "real: the set's layers replayed, from the first")
      ->check(CLI::Range(1u, kRealLayers))
      ->capture_default_str();
  cmd.add_option("--fractions", o->fractions, "cache sizes, fractions of the KV held, comma-separated")->capture_default_str();
  cmd.add_option("--policy", o->policy,
                 "policies, comma-separated (the engine's lru, clock, slru, every miss admitted; each with +near, "
                 "score-aware; engine, its buffer manager; opt)")
      ->capture_default_str();
  cmd.add_option("--near", o->near,
                 "+near policies: the estimation zone's best clusters touched a lookup, of the clusters it retrieves")
      ->check(CLI::Range(0.0, 100.0))
      ->capture_default_str();
  cmd.add_option("--step-us", o->step_us, "engine: microseconds from one lookup's start to the next's (0: back to back)")
      ->check(CLI::Range(uint64_t{0}, uint64_t{1000000}))
      ->capture_default_str();
  cmd.add_option("--page-bytes", o->page_bytes,
                 "bytes of a page's K (or V) rows, and so of a cache unit's (0: the engine's default, 2048)")
      ->check(CLI::Range(uint64_t{0}, uint64_t{1} << 24))
      ->capture_default_str();
  cmd.add_option("--link-gbs", o->link_gbs, "host-to-device GB/s, for the misses' transfer time")
      ->check(CLI::Range(0.1, 10000.0))
      ->capture_default_str();
  cmd.add_option("--threads", o->threads, "engine and generator threads (0: all cores)")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  cmd.add_flag("--json", o->json, "print one JSON object instead of the table");
}

int run_bench_cache(const Options &o) {
  std::vector<double> fractions;
  for (const std::string &f : split_list(o.fractions)) {
    size_t used = 0;
    double x = 0;
    try {
      x = std::stod(f, &used);
    } catch (const std::exception &) {
      used = 0;
    }
    if (used != f.size() || !(x > 0 && x <= 1)) throw UsageError("bench cache: --fractions: '" + f + "' is not in (0, 1]");
    fractions.push_back(x);
  }
  const std::vector<std::string> policies = split_list(o.policy);
  // "<policy>+near": the engine's policy and whether it is score-aware.
  const std::string kNear = "+near";
  const auto is_near = [&](const std::string &p) {
    return p.size() > kNear.size() && p.compare(p.size() - kNear.size(), kNear.size(), kNear) == 0;
  };
  const auto base_of = [&](const std::string &p) { return is_near(p) ? p.substr(0, p.size() - kNear.size()) : p; };
  bool any_near = false;
  for (const std::string &p : policies) {
    any_near |= is_near(p);
    if (p != "opt" && p != "engine" && !wkv::make_policy(base_of(p), 1))
      throw UsageError("bench cache: --policy: unknown policy '" + p + "'");
  }
  Options traced = o;
  if (!any_near) traced.near = 0;  // nothing to record
  if (fractions.empty() || policies.empty()) throw UsageError("bench cache: --fractions and --policy need one entry");

  Trace t;
  if (o.workload == "real") {
    if (!trace_real(traced, &t)) {
      std::printf("wavekv bench cache: skipped, no real-attention data under %s (--real-dir)\n", o.real_dir.c_str());
      return 0;
    }
  } else {
    t = trace_serving(traced);
  }
  if (t.unit.size() >= kNever) throw UsageError("bench cache: more than 2^32 units read; fewer --steps or --batch");
  const uint32_t n_units = t.n_units;
  const uint64_t counted_steps = t.step_end.size() - t.counted_from;
  const uint64_t layer_steps = std::max<uint64_t>(counted_steps * t.layers, 1);
  const double unit_bytes = 2.0 * t.page_tokens * t.row_bytes;  // a unit: K rows, then V rows (and scales)
  const double row_pair = 2.0 * t.row_bytes;                    // a token's K and V row
  const Outcome first = run_first(t, n_units);
  const uint64_t reads = first.hits + first.misses;
  const double retrieved_tokens = double(t.ret_tokens) / double(layer_steps);  // a layer-step's
  const double retrieved_mb = retrieved_tokens * row_pair / 1e6;

  struct Cell {
    std::string policy;
    double fraction;
    uint64_t frames;
    Outcome r;
  };
  std::vector<Cell> cells;
  for (double f : fractions) {
    const uint64_t cap = std::max<uint64_t>(1, static_cast<uint64_t>(f * double(t.kv_units)));
    for (const std::string &p : policies) {
      const Outcome r = p == "opt"      ? run_opt(t, n_units, cap)
                        : p == "engine" ? run_engine(t, n_units, cap, o.step_us)
                                        : replay_policy(t, n_units, cap, base_of(p), is_near(p));
      cells.push_back({p, f, cap, r});
    }
  }
  const auto hit_ratio = [](const Outcome &r) { return double(r.hits) / double(std::max<uint64_t>(1, r.hits + r.misses)); };
  const auto mb_step = [&](const Outcome &r) { return double(r.missed_rows) * row_pair / 1e6 / double(layer_steps); };
  const auto link_ms = [&](const Outcome &r) { return mb_step(r) / o.link_gbs; };  // MB / (GB/s) = ms

  const std::string what =
      o.workload == "real"
          ? "real-attention set, " + std::to_string(o.layers) + " layers x 2 KV heads, 8128-token prompt, 64 steps"
          : "serving workload, batch " + std::to_string(o.batch) + " x " + std::to_string(o.tokens) + " tokens, " +
                std::to_string(o.steps) + " steps, topic held " + std::to_string(o.repeat) + " steps, noise " +
                fixed(o.noise, 2);
  if (o.json) {
    nlohmann::ordered_json runs = nlohmann::ordered_json::array();
    for (const Cell &c : cells)
      runs.push_back({{"policy", c.policy},
                      {"fraction", c.fraction},
                      {"frames", c.frames},
                      {"hit_ratio", hit_ratio(c.r)},
                      {"missed_units", c.r.misses},
                      {"missed_mb_per_layer_step", mb_step(c.r)},
                      {"link_ms_per_layer_step", link_ms(c.r)}});
    const nlohmann::ordered_json j = {
        {"command", "bench cache"},
        {"workload", o.workload},
        {"tokens", o.workload == "real" ? uint64_t(kRealT - kRealQueries) : o.tokens},
        {"batch", o.workload == "real" ? uint64_t(1) : o.batch},
        {"steps", counted_steps},
        {"layers", t.layers},
        {"repeat", o.repeat},
        {"noise", o.noise},
        {"page_tokens", t.page_tokens},
        {"kv_units", t.kv_units},
        {"units_read", reads},
        {"retrieved_tokens_per_layer_step", retrieved_tokens},
        {"retrieved_mb_per_layer_step", retrieved_mb},
        {"first_reads", first.misses},
        {"first_read_ratio", 1.0 - hit_ratio(first)},
        {"link_gbs", o.link_gbs},
        {"near", traced.near},
        {"runs", runs}};
    std::cout << j.dump() << std::endl;
    return 0;
  }
  std::printf("wavekv bench cache: %s; units of %u tokens (%.0f bytes read a unit)\n", what.c_str(), t.page_tokens,
              unit_bytes);
  std::printf("a layer-step retrieves %.0f tokens (%.2f MB) in %.0f units; the KV held is %llu units\n",
              retrieved_tokens, retrieved_mb, double(reads) / double(layer_steps),
              static_cast<unsigned long long>(t.kv_units));
  std::printf("read for the first time (no cache holds them): %.3f of the units read, %.2f MB a layer-step\n",
              1.0 - hit_ratio(first), mb_step(first));
  Table tab;
  tab.row({"cache (of the KV)", "frames", "policy", "hit ratio", "MB missed a layer-step",
           "transfer ms a layer-step at " + fixed(o.link_gbs, 0) + " GB/s"});
  for (const Cell &c : cells)
    tab.row({fixed(c.fraction * 100, 1) + "%", std::to_string(c.frames), c.policy, fixed(hit_ratio(c.r), 3),
             fixed(mb_step(c.r), 2), fixed(link_ms(c.r), 3)});
  std::cout << tab.str();
  if (any_near)
    std::printf("+near: before a lookup's reads, the cached units of its estimation zone's best %.1fx as many clusters "
                "as it retrieves are touched\n",
                o.near);
  std::printf("lru, clock, slru: the engine's policies, every miss admitted; engine: its buffer manager, a miss "
              "admitted to a frame handed ahead (a lookup every %llu us); opt: Belady's optimum with bypass, the most "
              "hits any policy can have at that size\n",
              static_cast<unsigned long long>(o.step_us));
  return 0;
}

}  // namespace wkv_tool
