// Decoding throughput of the CUDA engine at serving scale, through the C ABI
// as a runtime calls it (issue: GPU decoding at serving scale).
//
// Workload: Llama3-8B attention geometry (32 q heads, 8 KV heads, head_dim
// 128, bf16), L layers (4; every layer holds the same context, so that one
// exact reference serves them all); a batch of B sequences of about T tokens
// each (sequence i has T + 97 i, so that their index growths fall on
// different steps); the device cache 5% of the KV held; the rest in the
// engine's pinned host arena. A decoding step is what a runtime does per
// token: for each layer one wkv_append_batch of the new token of every
// sequence and one wkv_decode of the batch, enqueued back to back, then one
// synchronization (the runtime samples the next token). The timed run is
// long enough (update_segment_tokens + 64 tokens) for every sequence to cross
// an index growth, whose cost it includes.
//
// Keys with realistic structure, generated on the device
// (tools/serving_workload.hpp, which `wavekv bench cache` replays on the
// host): a large shared offset (in the lowest RoPE frequencies, where it
// survives rotation, as in real models), topics in runs of 512 tokens (64
// topics), noise, then RoPE (theta 500000) at the token's position. Values
// follow the topic plus noise. Queries have temporal locality: each focuses
// on one topic for 8 consecutive steps, then moves on, with RoPE at the
// query's position.
//
// Printed per batch: per-layer step time (a token's wall time / L),
// tokens/s for a 32-layer model (32 / L tokens' time: the layers of a model
// are independent here), host time to enqueue one layer's step (median and
// worst, from the enqueue of a token's L layers / L; the device never makes
// it wait, the queue being empty at each token's start), cache hit ratio and bytes
// missed per step (read over PCIe), GPU and host memory of the engine, and
// the relative L2 error against exact attention of the same steps (the
// bench's own exact kernel, f32). The anchor, PyTorch SDPA with the KV on
// the GPU, is measured by bench/gpu_full_attention.py in the same script run
// (tools/gpu-check.sh serving) and passed in the environment:
//   WKV_FULL_ATTN_MS     "B:ms,B:ms,..." per-layer step of full attention
//   WKV_FULL_BATCH_MAX   the largest batch whose 32-layer KV fits the GPU
//   WKV_STREAM_MS        full attention of one layer of T tokens, batch 1,
//                        with the KV streamed from pinned host memory
// and WKV_SERVING_CACHE_FRACTION sets the device cache (0.05 of the KV).
// WKV_SERVING_CAPTURE=1: the timed run is a graph of the bench's own that
// holds every layer's append and decode (wkv_plan_bind), replayed after a
// wkv_plan_prepare a token, as a runtime that captures its model's step;
// the next token's prepare runs while the device runs the replay.
// The spill tier (cold pages, docs/spill.md): WKV_SERVING_HOST_BUDGET_GIB
// bounds the engine's host arena and WKV_SERVING_SPILL_DIR names the spill
// file's directory; with both, the KV beyond the budget goes to disk and the
// bench prints the prompt's ingest time, what was written, and per token
// what was read back and how many retrievals were estimated for want of it.
// WKV_SERVING_HOST_META_ROWS=1: the meta index's f32 rows in pinned host
// memory (WKV_CONFIG_HOST_META_ROWS), counted in host_GiB.
// WKV_SERVING_STREAMS=W (verbs only): the batch decoded as W parts (of
// about B / W sequences), each with its own plan on its own stream, the
// token's layers enqueued part after part (layer 0 of every part, then
// layer 1, ...), then every stream synchronized: a runtime that runs
// micro-batches side by side, so that one part's transfers of missed pages
// overlap another's lookup. Accuracy and every figure cover the whole batch
// (gpu_GiB the parts' plans too); at most one part a sequence.
// Usage: gpu_serving_bench [tokens] [batches, comma-separated] [steps, at least 64] [layers]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "tools/serving_workload.hpp"
#include "wavekv/wavekv.h"

namespace {

using wkv_workload::kD;
using wkv_workload::kFocusSteps;
using wkv_workload::kH;
using wkv_workload::kQ;

using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point t) { return std::chrono::duration<double, std::micro>(Clock::now() - t).count(); }

#define CHECK(x)                                                                              \
  do {                                                                                        \
    int rc_ = (x);                                                                            \
    if (rc_) {                                                                                \
      std::fprintf(stderr, "%s failed: %s %s\n", #x, wkv_status_name(rc_), wkv_last_error()); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)
#define CU(x)                                                               \
  do {                                                                      \
    cudaError_t e_ = (x);                                                   \
    if (e_ != cudaSuccess) {                                                \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)

// A runtime's own kernels around a captured step (WKV_SERVING_CAPTURE=1):
// the step's new K, V and query copied into the tensors the capture keeps
// (a model's projections write them), step `*at` of the staged ones; and
// layer 0's output kept for the accuracy check, the step counted.
__global__ void load_step(const unsigned *at, const __nv_bfloat16 *nk, const __nv_bfloat16 *nv,
                          const __nv_bfloat16 *q, uint64_t tok_elems, uint64_t q_elems, __nv_bfloat16 *k_dst,
                          __nv_bfloat16 *v_dst, __nv_bfloat16 *q_dst) {
  const uint64_t st = *at;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < tok_elems; i += gridDim.x * blockDim.x) {
    k_dst[i] = nk[st * tok_elems + i];
    v_dst[i] = nv[st * tok_elems + i];
  }
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < q_elems; i += gridDim.x * blockDim.x)
    q_dst[i] = q[st * q_elems + i];
}
__global__ void keep_step(const unsigned *at, const __nv_bfloat16 *src, __nv_bfloat16 *out, uint64_t q_elems) {
  const uint64_t st = *at;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < q_elems; i += gridDim.x * blockDim.x)
    out[st * q_elems + i] = src[i];
}
__global__ void next_step(unsigned *at) { *at += 1; }

// Token p of sequence `seq`: K and V rows [kH][kD] of one token.
__global__ void gen_tokens(__nv_bfloat16 *k, __nv_bfloat16 *v, uint32_t seq, uint32_t pos0, uint32_t n,
                           uint64_t token_stride) {
  const uint32_t t = blockIdx.x, h = blockIdx.y, j = threadIdx.x;  // j < kD / 2
  if (t >= n) return;
  float k_lo, k_hi, v_lo, v_hi;
  wkv_workload::token_pair(seq, pos0 + t, h, j, &k_lo, &k_hi, &v_lo, &v_hi);
  __nv_bfloat16 *kr = k + t * token_stride + h * kD;
  __nv_bfloat16 *vr = v + t * token_stride + h * kD;
  kr[j] = __float2bfloat16(k_lo);
  kr[j + kD / 2] = __float2bfloat16(k_hi);
  vr[j] = __float2bfloat16(v_lo);
  vr[j + kD / 2] = __float2bfloat16(v_hi);
}

// The query of sequence `seq` at decoding step `step` (position pos): q
// heads [kQ][kD], focused on one topic for focus_steps steps.
__global__ void gen_query(__nv_bfloat16 *q, uint32_t seq, uint32_t step, uint32_t pos, uint32_t focus_steps,
                          float noise) {
  const uint32_t qh = blockIdx.x, j = threadIdx.x;
  float lo, hi;
  wkv_workload::query_pair(seq, step, pos, qh, j, focus_steps, noise, &lo, &hi);
  q[qh * kD + j] = __float2bfloat16(lo);
  q[qh * kD + j + kD / 2] = __float2bfloat16(hi);
}

// Exact attention of one (sequence, q head) over its first len tokens, f32:
// scores into scratch, then softmax and the weighted sum of values.
__global__ void exact_attention(const __nv_bfloat16 *const *k, const __nv_bfloat16 *const *v, const uint32_t *len,
                                const __nv_bfloat16 *q, uint32_t q_stride, float *scratch, uint64_t scratch_stride,
                                float *out) {
  const uint32_t s = blockIdx.y, qh = blockIdx.x, h = qh / (kQ / kH), L = len[s];
  const __nv_bfloat16 *K = k[s], *V = v[s];
  float *sc = scratch + (uint64_t(s) * kQ + qh) * scratch_stride;
  __shared__ float qs[kD], red[256];
  for (uint32_t i = threadIdx.x; i < kD; i += blockDim.x)
    qs[i] = __bfloat162float(q[uint64_t(s) * q_stride + qh * kD + i]);
  __syncthreads();
  const float scale = rsqrtf(static_cast<float>(kD));
  float mx = -INFINITY;
  for (uint32_t t = threadIdx.x; t < L; t += blockDim.x) {
    const __nv_bfloat16 *kr = K + (uint64_t(t) * kH + h) * kD;
    float dot = 0.f;
    for (uint32_t i = 0; i < kD; ++i) dot += qs[i] * __bfloat162float(kr[i]);
    sc[t] = dot * scale;
    mx = fmaxf(mx, dot * scale);
  }
  red[threadIdx.x] = mx;
  __syncthreads();
  for (uint32_t w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + w]);
    __syncthreads();
  }
  mx = red[0];
  __syncthreads();
  float sum = 0.f;
  for (uint32_t t = threadIdx.x; t < L; t += blockDim.x) {
    sc[t] = expf(sc[t] - mx);
    sum += sc[t];
  }
  red[threadIdx.x] = sum;
  __syncthreads();
  for (uint32_t w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
    __syncthreads();
  }
  sum = red[0];
  if (threadIdx.x < kD) {
    float acc = 0.f;
    for (uint32_t t = 0; t < L; ++t) acc += sc[t] * __bfloat162float(V[(uint64_t(t) * kH + h) * kD + threadIdx.x]);
    out[(uint64_t(s) * kQ + qh) * kD + threadIdx.x] = acc / sum;
  }
}

// Query locality, from the environment: steps a query keeps its topic
// (WKV_SERVING_FOCUS_STEPS, 8) and the noise added at each step
// (WKV_SERVING_QUERY_NOISE, 0.3 of the topic's scale).
uint32_t focus_steps() {
  const char *e = std::getenv("WKV_SERVING_FOCUS_STEPS");
  return e && std::atoi(e) > 0 ? std::atoi(e) : kFocusSteps;
}
float query_noise() {
  const char *e = std::getenv("WKV_SERVING_QUERY_NOISE");
  return e ? static_cast<float>(std::atof(e)) : wkv_workload::kQueryNoise;
}

double quantile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

std::map<uint32_t, double> parse_ms(const char *env) {
  std::map<uint32_t, double> m;
  if (!env) return m;
  std::string s(env);
  size_t at = 0;
  while (at < s.size()) {
    size_t comma = s.find(',', at);
    if (comma == std::string::npos) comma = s.size();
    const std::string item = s.substr(at, comma - at);
    const size_t colon = item.find(':');
    if (colon != std::string::npos) m[std::atoi(item.c_str())] = std::atof(item.c_str() + colon + 1);
    at = comma + 1;
  }
  return m;
}

struct Row {
  bool captured = false;  // WKV_SERVING_CAPTURE=1: the runtime's own graph of the whole step
  uint32_t parts = 1;     // WKV_SERVING_STREAMS: parts of the batch decoded side by side
  uint32_t batch = 0, tokens = 0;
  double step_ms = 0, host_med_us = 0, host_max_us = 0, host_p99_us = 0;
  double hit = 0, miss_mb = 0, gpu_gib = 0, host_gib = 0, err_med = 0, err_p90 = 0;
  double append_us = 0, decode_us = 0;
  double admit_per_step = 0, evict_per_step = 0, miss_per_step = 0;  // units of page_tokens members
  double given_per_step = 0;  // free frames the buffer manager handed to steps
  uint64_t records_dropped = 0;  // steps that got no record (the manager's ring full)
  uint64_t pin_fallbacks = 0;    // host arena chunks left pageable (read through HMM, slowly)
  uint64_t growths = 0, growth_waits = 0;  // growths deferred in the timed run, and commits that waited
  uint64_t graphs = 0;  // decodes of the timed run replayed as their plan's graph (of steps * L)
  // The buffer manager's thread in the timed run: its busy share of the
  // wall time (and of that, taking records, choosing victims, clearing
  // entries, releasing quarantined frames, publishing),
  // its mean pass, records a pass; the reserve it aimed for at the end and
  // the frames resident then.
  double manager_busy = 0, manager_take = 0, manager_victims = 0, manager_clear = 0, manager_release = 0,
         manager_publish = 0;
  double manager_pass_us = 0, records_per_pass = 0;
  double step_releases = 0;  // of the records taken, those whose opening released frames on the decoding thread
  uint64_t reserve = 0, resident = 0;
  double split_us[5] = {0, 0, 0, 0, 0};  // append, lookup, assemble, attend, update
  double device_us[5] = {0, 0, 0, 0, 0};  // the same verbs' device time (events around each)
  double device_mean_us[5] = {0, 0, 0, 0, 0};
  uint64_t growth_steps = 0;
  // The spill tier (with a host budget and a spill directory).
  double ingest_s = 0;                 // the prompts' appends and ends, wall time
  uint64_t cold_pages = 0, page_bytes = 0, spill_bytes = 0, written_prompt = 0;
  double read_per_token = 0, written_per_token = 0, estimated_per_token = 0;
  uint64_t read_errors = 0, write_errors = 0;
};

// The engine's "buffer_manager" figures (wkv_engine_stats_json).
nlohmann::json manager_stats(wkv_engine *e) {
  char *json = nullptr;
  CHECK(wkv_engine_stats_json(e, &json));
  nlohmann::json j = nlohmann::json::parse(json)["buffer_manager"];
  wkv_free(json);
  return j;
}

// Per token: units missed, frames handed to the token's steps and units
// admitted (deltas of wkv_stats, read once the manager is caught up), then
// the tokens in quartiles by misses.
struct TokenStats {
  wkv_stats last;
  std::vector<double> missed, given, admitted;
  void take(wkv_engine *e) {
    wkv_stats now;
    for (int i = 0; i < 400; ++i) {  // up to 20 ms for the manager's passes
      wkv_stats_init(&now);
      CHECK(wkv_engine_stats(e, &now));
      if (now.manager_backlog == 0) break;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    missed.push_back(double(now.cache_misses - last.cache_misses));
    given.push_back(double(now.cache_frames_given - last.cache_frames_given));
    admitted.push_back(double(now.cache_admissions - last.cache_admissions));
    last = now;
  }
  void print(uint32_t L) const {
    std::vector<size_t> order(missed.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return missed[a] < missed[b]; });
    std::printf("      per token, by quartile of misses (units a layer-step: missed / given / admitted):");
    for (int qt = 0; qt < 4; ++qt) {
      const size_t lo = order.size() * qt / 4, hi = order.size() * (qt + 1) / 4;
      double m = 0, g = 0, a = 0;
      for (size_t i = lo; i < hi; ++i) {
        m += missed[order[i]];
        g += given[order[i]];
        a += admitted[order[i]];
      }
      const double n = double(std::max<size_t>(hi - lo, 1)) * L;
      std::printf(" q%d %.0f / %.0f / %.0f;", qt + 1, m / n, g / n, a / n);
    }
    std::printf("\n");
  }
};

// WKV_SERVING_STREAMS: the parts asked for (1 where unset or below 1).
uint32_t serving_streams() {
  const char *ps = std::getenv("WKV_SERVING_STREAMS");
  return ps ? static_cast<uint32_t>(std::max(1, std::atoi(ps))) : 1;
}

// WKV_SERVING_HOST_META_ROWS=1: the engine opened with
// WKV_CONFIG_HOST_META_ROWS.
bool host_meta_rows() {
  const char *m = std::getenv("WKV_SERVING_HOST_META_ROWS");
  return m && std::atoi(m) > 0;
}

Row run(uint32_t T, uint32_t B, uint32_t steps, uint32_t L) {
  Row row;
  row.batch = B;
  row.tokens = T;
  const uint64_t tok = uint64_t(kH) * kD;  // elements of one token's K (or V)
  cudaStream_t s;
  CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  // The context of every sequence and the tokens of every step, on the
  // device (the exact reference reads them; wavekv copies them in).
  std::vector<__nv_bfloat16 *> hk(B), hv(B);
  std::vector<uint32_t> len(B);
  for (uint32_t i = 0; i < B; ++i) {
    len[i] = T + 97 * i;
    const uint64_t n = uint64_t(len[i]) + steps;
    CU(cudaMalloc(&hk[i], n * tok * 2));
    CU(cudaMalloc(&hv[i], n * tok * 2));
    for (uint64_t p = 0; p < n; p += 65535) {
      const uint32_t m = static_cast<uint32_t>(std::min<uint64_t>(65535, n - p));
      gen_tokens<<<dim3(m, kH), kD / 2, 0, s>>>(hk[i] + p * tok, hv[i] + p * tok, i, static_cast<uint32_t>(p), m,
                                                 tok);
    }
  }
  // The step's new tokens, [steps][B][kH][kD], and queries [steps][B][kQ][kD].
  __nv_bfloat16 *nk, *nv, *q, *out;
  CU(cudaMalloc(&nk, uint64_t(steps) * B * tok * 2));
  CU(cudaMalloc(&nv, uint64_t(steps) * B * tok * 2));
  CU(cudaMalloc(&q, uint64_t(steps) * B * kQ * kD * 2));
  CU(cudaMalloc(&out, uint64_t(steps) * B * kQ * kD * 2));
  __nv_bfloat16 *scratch_out;
  CU(cudaMalloc(&scratch_out, uint64_t(B) * kQ * kD * 2));
  for (uint32_t st = 0; st < steps; ++st)
    for (uint32_t i = 0; i < B; ++i) {
      const uint64_t p = len[i] + st;
      CU(cudaMemcpyAsync(nk + (uint64_t(st) * B + i) * tok, hk[i] + p * tok, tok * 2, cudaMemcpyDeviceToDevice, s));
      CU(cudaMemcpyAsync(nv + (uint64_t(st) * B + i) * tok, hv[i] + p * tok, tok * 2, cudaMemcpyDeviceToDevice, s));
      gen_query<<<kQ, kD / 2, 0, s>>>(q + (uint64_t(st) * B + i) * kQ * kD, i, st, static_cast<uint32_t>(p),
                                      focus_steps(), query_noise());
    }
  CU(cudaStreamSynchronize(s));
  size_t free0 = 0, total = 0;
  CU(cudaMemGetInfo(&free0, &total));

  wkv_config c;
  wkv_config_init(&c);
  c.device = WKV_DEVICE_CUDA;
  c.n_layers = L;
  c.n_q_heads = kQ;
  c.n_kv_heads = kH;
  c.head_dim = kD;
  c.dtype = WKV_DTYPE_BF16;
  uint64_t kv = 0;
  for (uint32_t i = 0; i < B; ++i) kv += uint64_t(len[i]) * tok * 2 * 2 * L;
  const char *frac = std::getenv("WKV_SERVING_CACHE_FRACTION");  // of the KV held; 0.05 by default
  c.device_cache_bytes = static_cast<uint64_t>(double(kv) * (frac ? std::atof(frac) : 0.05));
  if (const char *b = std::getenv("WKV_SERVING_HOST_BUDGET_GIB"))
    c.host_budget_bytes = static_cast<uint64_t>(std::atof(b) * double(1ull << 30));
  c.spill_dir = std::getenv("WKV_SERVING_SPILL_DIR");
  if (host_meta_rows()) c.flags |= WKV_CONFIG_HOST_META_ROWS;
  wkv_engine *e;
  CHECK(wkv_engine_open(&c, &e));
  std::vector<wkv_seq *> seqs(B);
  const auto ingest = Clock::now();
  for (uint32_t i = 0; i < B; ++i) {
    CHECK(wkv_seq_create(e, &seqs[i]));
    for (uint32_t l = 0; l < L; ++l) {
      CHECK(wkv_seq_append(seqs[i], l, hk[i], hv[i], len[i], 0, 0, s));
      CHECK(wkv_seq_end_prompt(seqs[i], l, s));
    }
  }
  wkv_plan *plan;
  CHECK(wkv_plan_create(e, &plan));
  CU(cudaStreamSynchronize(s));
  row.ingest_s = us_since(ingest) / 1e6;
  {
    wkv_stats x;
    wkv_stats_init(&x);
    CHECK(wkv_engine_stats(e, &x));
    row.written_prompt = x.spill_pages_written;
    row.page_bytes = x.page_bytes;
  }

  // WKV_SERVING_STREAMS: the batch's parts, part p being sequences
  // [first[p], first[p + 1]), its plan plans[p] on stream streams[p] (part
  // 0: the plan and stream above).
  const uint32_t asked = serving_streams();
  const uint32_t P = std::min(B, asked);
  row.parts = P;
  std::vector<uint32_t> first(P + 1);
  for (uint32_t p = 0; p <= P; ++p) first[p] = B * p / P;
  std::vector<wkv_plan *> plans{plan};
  std::vector<cudaStream_t> streams{s};
  for (uint32_t p = 1; p < P; ++p) {
    plans.push_back(nullptr);
    CHECK(wkv_plan_create(e, &plans.back()));
    streams.push_back(nullptr);
    CU(cudaStreamCreateWithFlags(&streams.back(), cudaStreamNonBlocking));
  }
  // One layer of a token for every part: the new tokens appended (where
  // nk is given) and the batch decoded, from the token's slices at st;
  // o, where not null, takes the outputs ([B][kQ][kD]).
  const auto enqueue_layer = [&](uint32_t l, uint64_t st, const __nv_bfloat16 *qs, __nv_bfloat16 *o, bool append) {
    for (uint32_t p = 0; p < P; ++p) {
      const uint32_t f = first[p], n = first[p + 1] - f;
      if (append)
        CHECK(wkv_append_batch(seqs.data() + f, n, l, nk + (st * B + f) * tok, nv + (st * B + f) * tok, 1, 0, 0, 0,
                               streams[p]));
      CHECK(wkv_decode(plans[p], seqs.data() + f, n, l, qs + uint64_t(f) * kQ * kD, 0, 0,
                       (o ? o : scratch_out) + uint64_t(f) * kQ * kD, 0, 0, streams[p]));
    }
  };
  const auto sync_all = [&] {
    for (cudaStream_t x : streams) CU(cudaStreamSynchronize(x));
  };

  // Warm-up: 16 steps of the first queries (not timed), not appended, so
  // that the timed run starts from the same context: the cache warms.
  for (uint32_t w = 0; w < 16; ++w) {
    for (uint32_t l = 0; l < L; ++l) enqueue_layer(l, 0, q + uint64_t(w % 8) * B * kQ * kD, out, false);
    sync_all();
  }
  size_t free1 = 0;
  CU(cudaMemGetInfo(&free1, &total));
  wkv_stats st0;
  wkv_stats_init(&st0);
  CHECK(wkv_engine_stats(e, &st0));
  const nlohmann::json manager0 = manager_stats(e);

  // WKV_SERVING_TOKEN_STATS=1 (a diagnostic: timings then include it): the
  // cache's figures token by token, once the buffer manager has taken the
  // token's records.
  std::unique_ptr<TokenStats> token_stats;
  if (const char *ts = std::getenv("WKV_SERVING_TOKEN_STATS"); ts && std::atoi(ts) > 0) {
    token_stats = std::make_unique<TokenStats>();
    token_stats->last = st0;
  }
  // WKV_SERVING_CAPTURE=1: the step of every layer captured once into a
  // graph of the bench's own (as a runtime captures its model's step) with
  // the kernels that load its inputs and keep layer 0's output, replayed
  // after a wkv_plan_prepare a token: host time is the prepare and one
  // launch.
  const bool captured = std::getenv("WKV_SERVING_CAPTURE") && std::atoi(std::getenv("WKV_SERVING_CAPTURE")) > 0;
  row.captured = captured;
  if (captured && asked > 1) {
    std::fprintf(stderr, "gpu_serving_bench: WKV_SERVING_STREAMS times the verbs, not a captured step\n");
    std::exit(2);
  }
  cudaGraphExec_t exec = nullptr;
  __nv_bfloat16 *ck = nullptr, *cv = nullptr, *cq = nullptr, *cout = nullptr;
  unsigned *at = nullptr;
  if (captured) {
    CU(cudaMalloc(&ck, uint64_t(B) * tok * 2));
    CU(cudaMalloc(&cv, uint64_t(B) * tok * 2));
    CU(cudaMalloc(&cq, uint64_t(B) * kQ * kD * 2));
    CU(cudaMalloc(&cout, uint64_t(B) * kQ * kD * 2));
    CU(cudaMalloc(&at, sizeof(unsigned)));
    CU(cudaMemset(at, 0, sizeof(unsigned)));
    CHECK(wkv_plan_bind(plan, seqs.data(), B, steps + 64, s));
    cudaGraph_t g;
    CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    load_step<<<64, 256, 0, s>>>(at, nk, nv, q, uint64_t(B) * tok, uint64_t(B) * kQ * kD, ck, cv, cq);
    for (uint32_t l = 0; l < L; ++l) {
      CHECK(wkv_append_batch(seqs.data(), B, l, ck, cv, 1, 0, 0, 0, s));
      CHECK(wkv_decode(plan, seqs.data(), B, l, cq, 0, 0, l == 0 ? cout : scratch_out, 0, 0, s));
    }
    keep_step<<<64, 256, 0, s>>>(at, cout, out, uint64_t(B) * kQ * kD);
    next_step<<<1, 1, 0, s>>>(at);
    CU(cudaStreamEndCapture(s, &g));
    // With the nodes' priorities (the capture streams'): the decode's
    // estimate keeps the priority its fork gives it (docs/runtime-capture.md).
    CU(cudaGraphInstantiate(&exec, g, cudaGraphInstantiateFlagUseNodePriority));
    CU(cudaGraphDestroy(g));
    CU(cudaStreamSynchronize(s));
  }
  // The timed run: per token, append + decode for each layer, then one
  // synchronization. Layer 0's outputs are kept for the accuracy check.
  std::vector<double> host(steps), host_append(steps);
  const auto t0 = Clock::now();
  // Captured: the next token's prepare runs while the device runs this
  // one's replay (it needs no input of the step: a runtime calls it before
  // it samples); the last one, never launched, is taken back by the unbind.
  double prepared_us = 0;
  if (captured) {
    const auto a = Clock::now();
    CHECK(wkv_plan_prepare(plan, s));
    prepared_us = us_since(a);
  }
  for (uint32_t st = 0; st < steps && captured; ++st) {
    const auto a = Clock::now();
    CU(cudaGraphLaunch(exec, s));
    const double launch_us = us_since(a);
    const auto b = Clock::now();
    CHECK(wkv_plan_prepare(plan, s));  // the next token's
    host_append[st] = prepared_us / L;  // this token's prepare, a layer
    host[st] = (prepared_us + launch_us) / L;
    prepared_us = us_since(b);
    CU(cudaStreamSynchronize(s));
    if (token_stats) token_stats->take(e);
  }
  for (uint32_t st = 0; st < steps && !captured; ++st) {
    double app = 0;
    const auto a = Clock::now();
    for (uint32_t l = 0; l < L; ++l) {
      if (P > 1) {
        // Parts side by side: the appends' host time is not split out.
        enqueue_layer(l, st, q + uint64_t(st) * B * kQ * kD, l == 0 ? out + uint64_t(st) * B * kQ * kD : nullptr,
                      true);
        continue;
      }
      const auto b = Clock::now();
      CHECK(wkv_append_batch(seqs.data(), B, l, nk + uint64_t(st) * B * tok, nv + uint64_t(st) * B * tok, 1, 0, 0,
                             0, s));
      app += us_since(b);
      CHECK(wkv_decode(plan, seqs.data(), B, l, q + uint64_t(st) * B * kQ * kD, 0, 0,
                       l == 0 ? out + uint64_t(st) * B * kQ * kD : scratch_out, 0, 0, s));
    }
    host[st] = us_since(a) / L;
    host_append[st] = app / L;
    sync_all();
    if (token_stats) token_stats->take(e);
  }
  const double wall_us = us_since(t0) / L;
  if (token_stats) token_stats->print(L);
  if (captured) {
    CHECK(wkv_plan_unbind(plan, s));  // the split verbs below take the plan unbound
    CU(cudaGraphExecDestroy(exec));
    for (void *p : {static_cast<void *>(ck), static_cast<void *>(cv), static_cast<void *>(cq),
                    static_cast<void *>(cout), static_cast<void *>(at)})
      CU(cudaFree(p));
  }
  wkv_stats st1;
  wkv_stats_init(&st1);
  CHECK(wkv_engine_stats(e, &st1));
  const nlohmann::json manager1 = manager_stats(e);
  row.step_ms = wall_us / 1e3 / steps;
  {
    // The buffer manager's thread over the timed run (its share of the
    // wall time): whether it keeps up with the steps.
    const auto delta = [&](const char *k) {
      return double(manager1[k].get<uint64_t>() - manager0[k].get<uint64_t>());
    };
    const double wall_ns = wall_us * L * 1e3, passes = std::max(delta("passes"), 1.0);
    row.manager_busy = delta("busy_ns") / wall_ns;
    row.manager_take = delta("take_ns") / wall_ns;
    row.manager_victims = delta("victims_ns") / wall_ns;
    row.manager_clear = delta("clear_ns") / wall_ns;
    row.manager_release = delta("release_ns") / wall_ns;
    row.manager_publish = delta("publish_ns") / wall_ns;
    row.manager_pass_us = delta("busy_ns") / passes / 1e3;
    row.records_per_pass = delta("records_taken") / passes;
    row.reserve = manager1["reserve_target"].get<uint64_t>();
    row.step_releases = delta("step_releases") / std::max(delta("records_taken"), 1.0);
    row.resident = manager1["resident_frames"].get<uint64_t>();
  }
  row.host_med_us = quantile(host, 0.5);
  row.append_us = quantile(host_append, 0.5);
  std::vector<double> host_decode(steps);
  for (uint32_t st = 0; st < steps; ++st) host_decode[st] = host[st] - host_append[st];
  row.decode_us = quantile(host_decode, 0.5);
  row.host_p99_us = quantile(host, 0.99);
  row.host_max_us = quantile(host, 1.0);
  for (double h : host) row.growth_steps += h > 1000.0;  // a token whose enqueue waited (an index growth)
  const double hits = double(st1.cache_hits - st0.cache_hits), misses = double(st1.cache_misses - st0.cache_misses);
  row.hit = hits + misses > 0 ? hits / (hits + misses) : 0;
  // A unit's bytes read: K and V rows of page_tokens members, with 8-bit
  // pages their scales too (a slot's padding is not read).
  wkv_config ec;
  ec.size = sizeof ec;
  CHECK(wkv_engine_config(e, &ec));
  const double token_bytes = ec.page_format == WKV_PAGE_FORMAT_INT8 ? double(kD + 4) : double(kD * 2);
  const double unit_bytes = 2.0 * std::floor(double(ec.page_bytes) / token_bytes) * token_bytes;
  row.miss_mb = misses * unit_bytes / (double(steps) * L) / 1e6;
  row.miss_per_step = misses / (double(steps) * L);
  row.admit_per_step = double(st1.cache_admissions - st0.cache_admissions) / (double(steps) * L);
  row.evict_per_step = double(st1.cache_evictions - st0.cache_evictions) / (double(steps) * L);
  row.given_per_step = double(st1.cache_frames_given - st0.cache_frames_given) / (double(steps) * L);
  row.records_dropped = st1.cache_records_dropped - st0.cache_records_dropped;
  row.pin_fallbacks = st1.pin_fallbacks;
  row.growths = st1.growths_deferred - st0.growths_deferred;
  row.growth_waits = st1.growth_waits - st0.growth_waits;
  row.graphs = st1.decode_graphs - st0.decode_graphs;
  row.gpu_gib = double(free0 - free1) / (1ull << 30);
  row.cold_pages = st1.spill_cold_pages;
  row.spill_bytes = st1.spill_bytes_used;
  row.read_per_token = double(st1.spill_pages_read - st0.spill_pages_read) / steps;
  row.written_per_token = double(st1.spill_pages_written - st0.spill_pages_written) / steps;
  row.estimated_per_token = double(st1.spill_estimated - st0.spill_estimated) / steps;
  row.read_errors = st1.spill_read_errors;
  row.write_errors = st1.spill_write_errors;
  row.host_gib = double(st1.host_bytes_reserved) / (1ull << 30);
  // The f32 rows in host memory: a centroid and a value sum a cluster (the
  // regions' spare capacity, up to half again, not counted).
  if (host_meta_rows()) row.host_gib += double(st1.clusters) * 2 * kD * sizeof(float) / (1ull << 30);

  // Host time of each verb (the split form of wkv_decode), per layer, 64
  // more tokens with a synchronization per token; their outputs are not
  // checked and their tokens are the timed run's last ones again (the
  // engine only sees more tokens).
  // Events between the verbs (recorded outside the host timings) give each
  // verb's device time.
  {
    std::vector<double> t[5], dt[5];
    std::vector<cudaEvent_t> ev(6 * L);
    for (cudaEvent_t &x : ev) CU(cudaEventCreate(&x));
    for (uint32_t x = 0; x < 64; ++x) {
      const uint32_t st = steps - 64 + x;
      for (uint32_t l = 0; l < L; ++l) {
        cudaEvent_t *e6 = &ev[6 * l];
        CU(cudaEventRecord(e6[0], s));
        auto a = Clock::now();
        CHECK(wkv_append_batch(seqs.data(), B, l, nk + uint64_t(st) * B * tok, nv + uint64_t(st) * B * tok, 1, 0, 0,
                               0, s));
        t[0].push_back(us_since(a));
        CU(cudaEventRecord(e6[1], s));
        a = Clock::now();
        CHECK(wkv_lookup(plan, seqs.data(), B, l, q + uint64_t(st) * B * kQ * kD, 0, 0, s));
        t[1].push_back(us_since(a));
        CU(cudaEventRecord(e6[2], s));
        a = Clock::now();
        CHECK(wkv_assemble(plan, s));
        t[2].push_back(us_since(a));
        CU(cudaEventRecord(e6[3], s));
        a = Clock::now();
        CHECK(wkv_attend(plan, scratch_out, 0, 0, nullptr, s));
        t[3].push_back(us_since(a));
        CU(cudaEventRecord(e6[4], s));
        a = Clock::now();
        CHECK(wkv_update(plan, s));
        t[4].push_back(us_since(a));
        CU(cudaEventRecord(e6[5], s));
      }
      CU(cudaStreamSynchronize(s));
      for (uint32_t l = 0; l < L; ++l)
        for (int i = 0; i < 5; ++i) {
          float ms = 0;
          CU(cudaEventElapsedTime(&ms, ev[6 * l + i], ev[6 * l + i + 1]));
          dt[i].push_back(1e3 * ms);
        }
    }
    for (cudaEvent_t &x : ev) cudaEventDestroy(x);
    for (int i = 0; i < 5; ++i) {
      row.split_us[i] = quantile(t[i], 0.5);
      row.device_us[i] = quantile(dt[i], 0.5);
      double sum = 0;
      for (double x : dt[i]) sum += x;
      row.device_mean_us[i] = dt[i].empty() ? 0 : sum / double(dt[i].size());
    }
  }

  // Accuracy: 24 steps spread over the run against exact attention over
  // the same tokens (the prefix each step saw).
  __nv_bfloat16 **dk, **dv;
  uint32_t *dlen;
  float *scratch, *ref;
  uint32_t max_len = 0;
  for (uint32_t i = 0; i < B; ++i) max_len = std::max(max_len, len[i] + steps);
  CU(cudaMalloc(&dk, B * sizeof(void *)));
  CU(cudaMalloc(&dv, B * sizeof(void *)));
  CU(cudaMalloc(&dlen, B * sizeof(uint32_t)));
  CU(cudaMalloc(&scratch, uint64_t(B) * kQ * max_len * sizeof(float)));
  CU(cudaMalloc(&ref, uint64_t(B) * kQ * kD * sizeof(float)));
  CU(cudaMemcpy(dk, hk.data(), B * sizeof(void *), cudaMemcpyHostToDevice));
  CU(cudaMemcpy(dv, hv.data(), B * sizeof(void *), cudaMemcpyHostToDevice));
  std::vector<double> errs;
  std::vector<float> hr(uint64_t(B) * kQ * kD);
  std::vector<__nv_bfloat16> ho(hr.size());
  for (uint32_t k = 0; k < 24; ++k) {
    const uint32_t st = static_cast<uint32_t>(uint64_t(k) * (steps - 1) / 23);
    std::vector<uint32_t> l(B);
    for (uint32_t i = 0; i < B; ++i) l[i] = len[i] + st + 1;
    CU(cudaMemcpy(dlen, l.data(), B * sizeof(uint32_t), cudaMemcpyHostToDevice));
    exact_attention<<<dim3(kQ, B), 256, 0, s>>>(dk, dv, dlen, q + uint64_t(st) * B * kQ * kD, kQ * kD, scratch,
                                                max_len, ref);
    CU(cudaStreamSynchronize(s));
    CU(cudaMemcpy(hr.data(), ref, hr.size() * 4, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(ho.data(), out + uint64_t(st) * B * kQ * kD, ho.size() * 2, cudaMemcpyDeviceToHost));
    for (uint32_t r = 0; r < B * kQ; ++r) {
      double num = 0, den = 0;
      for (uint32_t j = 0; j < kD; ++j) {
        const double a = __bfloat162float(ho[uint64_t(r) * kD + j]), b = hr[uint64_t(r) * kD + j];
        num += (a - b) * (a - b);
        den += b * b;
      }
      errs.push_back(std::sqrt(num / std::max(den, 1e-30)));
    }
  }
  row.err_med = quantile(errs, 0.5);
  row.err_p90 = quantile(errs, 0.9);

  for (wkv_plan *x : plans) wkv_plan_destroy(x);
  for (uint32_t p = 1; p < P; ++p) cudaStreamDestroy(streams[p]);
  for (wkv_seq *x : seqs) wkv_seq_destroy(x);
  wkv_engine_close(e);
  for (uint32_t i = 0; i < B; ++i) {
    cudaFree(hk[i]);
    cudaFree(hv[i]);
  }
  for (void *p : {static_cast<void *>(nk), static_cast<void *>(nv), static_cast<void *>(q), static_cast<void *>(out),
                  static_cast<void *>(dk), static_cast<void *>(dv), static_cast<void *>(dlen),
                  static_cast<void *>(scratch), static_cast<void *>(ref), static_cast<void *>(scratch_out)})
    cudaFree(p);
  cudaStreamDestroy(s);
  return row;
}

}  // namespace

int main(int argc, char **argv) {
  const uint32_t T = argc > 1 ? std::atoi(argv[1]) : 131072;
  std::vector<uint32_t> batches;
  {
    std::string list = argc > 2 ? argv[2] : "1,2,4,7";
    for (size_t at = 0; at < list.size();) {
      size_t comma = list.find(',', at);
      if (comma == std::string::npos) comma = list.size();
      batches.push_back(std::atoi(list.substr(at, comma - at).c_str()));
      at = comma + 1;
    }
  }
  const uint32_t steps = argc > 3 ? std::atoi(argv[3]) : 1024 + 64;  // update_segment_tokens + 64
  const uint32_t L = argc > 4 ? std::atoi(argv[4]) : 4;
  // The split form's timing replays the last 64 tokens (run(): steps - 64 + x).
  if (steps < 64 || L == 0) {
    std::fprintf(stderr, "gpu_serving_bench: steps must be at least 64 (got %s) and layers at least 1 (got %s)\n",
                 argc > 3 ? argv[3] : "the default", argc > 4 ? argv[4] : "the default");
    return 2;
  }
  const auto full = parse_ms(std::getenv("WKV_FULL_ATTN_MS"));
  const uint32_t full_max = std::getenv("WKV_FULL_BATCH_MAX") ? std::atoi(std::getenv("WKV_FULL_BATCH_MAX")) : 0;
  const double stream_ms = std::getenv("WKV_STREAM_MS") ? std::atof(std::getenv("WKV_STREAM_MS")) : 0;

  const char *frac = std::getenv("WKV_SERVING_CACHE_FRACTION");
  std::printf("serving: %u layers, %u q heads, %u KV heads, d=%u, bf16, ~%u tokens per sequence, %u tokens per "
              "batch, a synchronization per token, device cache %.2f of the KV (in bf16), queries hold a topic %u "
              "steps with noise %.2f; pages %s; step = per layer; tokens/s = batch / (32 x step)\n",
              L, kQ, kH, kD, T, steps, frac ? std::atof(frac) : 0.05, focus_steps(), query_noise(),
              std::getenv("WKV_PAGE_FORMAT") && std::atoi(std::getenv("WKV_PAGE_FORMAT")) == WKV_PAGE_FORMAT_INT8
                  ? "8-bit with a scale a row (WKV_PAGE_FORMAT=1)"
                  : "bf16");
  if (std::getenv("WKV_SERVING_CAPTURE") && std::atoi(std::getenv("WKV_SERVING_CAPTURE")) > 0)
    std::printf("steps captured: every layer's append and decode in one graph of the bench's own (with its input "
                "and output kernels), a wkv_plan_prepare and one launch a token; host_us = (prepare + launch) / "
                "layers\n");
  if (serving_streams() > 1)
    std::printf("batches in %u parts side by side (WKV_SERVING_STREAMS; at most one a sequence): a plan and a stream "
                "a part, a token's layers enqueued part after part, every stream synchronized a token\n",
                serving_streams());
  std::printf("%5s %9s %9s %9s %9s %9s %6s %8s %7s %7s %9s %9s %9s %9s\n", "batch", "step_ms", "tok/s32", "host_us",
              "host_p99", "host_max", "waits", "hit", "miss_MB", "gpu_GiB", "host_GiB", "err_med", "err_p90",
              "vs_full");
  double best_w = 0, best_f = 0, last_step_ms = 0;
  uint32_t best_wb = 0, best_fb = 0;
  for (uint32_t B : batches) {
    const Row r = run(T, B, steps, L);
    const double tps = B / (32.0 * r.step_ms / 1e3);
    last_step_ms = r.step_ms;
    double ratio = 0;
    auto f = full.find(B);
    if (f != full.end() && f->second > 0) ratio = (B / r.step_ms) / (B / f->second);
    std::printf("%5u %9.3f %9.1f %9.1f %9.1f %9.1f %6llu %8.3f %7.2f %7.2f %9.2f %9.4f %9.4f %9s\n", B, r.step_ms, tps,
                r.host_med_us, r.host_p99_us, r.host_max_us, static_cast<unsigned long long>(r.growth_steps), r.hit,
                r.miss_mb, r.gpu_gib, r.host_gib, r.err_med, r.err_p90,
                ratio > 0 ? (std::to_string(ratio).substr(0, 5) + "x").c_str() : "-");
    std::printf("      cache units per layer-step: %.0f missed, %.0f frames given, %.0f admitted, %.0f evicted; "
                "%llu steps without a record; %llu host chunks not pinned; %llu growths deferred, %llu waited for; "
                "%llu decodes replayed as graphs\n",
                r.miss_per_step, r.given_per_step, r.admit_per_step, r.evict_per_step,
                static_cast<unsigned long long>(r.records_dropped), static_cast<unsigned long long>(r.pin_fallbacks),
                static_cast<unsigned long long>(r.growths), static_cast<unsigned long long>(r.growth_waits),
                static_cast<unsigned long long>(r.graphs));
    std::printf("      buffer manager: busy %.0f%% of the wall time (taking records %.0f%%, choosing victims %.0f%%, "
                "clearing entries %.0f%%, releasing %.0f%%, publishing %.0f%%), %.1f us a pass, %.2f records a pass; "
                "reserve %llu frames, %llu resident; %.0f%% of steps released frames on the decoding thread\n",
                100 * r.manager_busy, 100 * r.manager_take, 100 * r.manager_victims, 100 * r.manager_clear,
                100 * r.manager_release, 100 * r.manager_publish,
                r.manager_pass_us, r.records_per_pass, static_cast<unsigned long long>(r.reserve),
                static_cast<unsigned long long>(r.resident), 100 * r.step_releases);
    if (r.captured)
      std::printf("      host us a layer (medians): wkv_plan_prepare %.1f, cudaGraphLaunch %.1f (one launch a token); "
                  "split form, uncaptured: append %.1f, lookup %.1f, assemble %.1f, attend %.1f, update %.1f\n",
                  r.append_us, r.decode_us, r.split_us[0], r.split_us[1], r.split_us[2], r.split_us[3],
                  r.split_us[4]);
    else if (r.parts > 1)
      std::printf("      %u parts of the batch side by side, a plan and a stream each; host us (medians, split "
                  "form, the whole batch on one stream): append %.1f, lookup %.1f, assemble %.1f, attend %.1f, "
                  "update %.1f\n",
                  r.parts, r.split_us[0], r.split_us[1], r.split_us[2], r.split_us[3], r.split_us[4]);
    else
      std::printf("      host us (medians): wkv_append_batch %.1f, wkv_decode %.1f; split form: append %.1f, lookup "
                  "%.1f, assemble %.1f, attend %.1f, update %.1f\n",
                  r.append_us, r.decode_us, r.split_us[0], r.split_us[1], r.split_us[2], r.split_us[3],
                  r.split_us[4]);
    std::printf("      device us (medians, split form): append %.1f, lookup %.1f, assemble %.1f, attend %.1f, "
                "update %.1f\n",
                r.device_us[0], r.device_us[1], r.device_us[2], r.device_us[3], r.device_us[4]);
    std::printf("      device us (means, split form): append %.1f, lookup %.1f, assemble %.1f, attend %.1f, "
                "update %.1f\n",
                r.device_mean_us[0], r.device_mean_us[1], r.device_mean_us[2], r.device_mean_us[3],
                r.device_mean_us[4]);
    if (std::getenv("WKV_SERVING_SPILL_DIR")) {
      const double pb = double(r.page_bytes);
      std::printf("      spill: prompts ingested in %.1f s, %.2f GiB written out meanwhile; now %.2f GiB of KV on disk "
                  "(%.2f GiB of spill file); per token (all %u layers): %.2f MB read back, %.2f MB written, %.1f "
                  "retrievals estimated for want of a page; %llu read errors, %llu write errors\n",
                  r.ingest_s, double(r.written_prompt) * pb / double(1ull << 30),
                  double(r.cold_pages) * pb / double(1ull << 30), double(r.spill_bytes) / double(1ull << 30), L,
                  r.read_per_token * pb / 1e6, r.written_per_token * pb / 1e6, r.estimated_per_token,
                  static_cast<unsigned long long>(r.read_errors), static_cast<unsigned long long>(r.write_errors));
    }
    std::fflush(stdout);
    if (tps > best_w) best_w = tps, best_wb = B;
  }
  for (auto &[B, ms] : full) {
    if (full_max && B > full_max) continue;
    const double tps = B / (32.0 * ms / 1e3);
    std::printf("full attention (PyTorch SDPA, KV on the GPU), batch %u: %.3f ms per layer, %.1f tokens/s over 32 "
                "layers\n",
                B, ms, tps);
    if (tps > best_f) best_f = tps, best_fb = B;
  }
  if (best_f > 0)
    std::printf("best throughput: wavekv %.1f tokens/s (batch %u) vs full attention %.1f tokens/s (batch %u, its "
                "32-layer KV bound %u): %.2fx\n",
                best_w, best_wb, best_f, best_fb, full_max, best_w / best_f);
  if (stream_ms > 0 && batches.size() == 1 && batches[0] == 1)
    std::printf("batch 1 at %u tokens: full attention streaming the KV from pinned host memory %.2f ms per layer; "
                "wavekv %.3f ms per layer (%.1fx), %.2f ms per token over 32 layers\n",
                T, stream_ms, last_step_ms, stream_ms / last_step_ms, 32 * last_step_ms);
  return 0;
}
