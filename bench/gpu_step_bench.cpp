// GPU decoding-step benchmark of the CUDA engine, each figure beside an
// anchor measured in the same run:
//   1. host synchronizations per decoding step: steps are enqueued behind a
//      long spinning kernel; a step whose enqueue returns before the spin
//      ends did not wait for the device (anchor: a cudaStreamSynchronize
//      enqueued the same way, which must wait);
//   2. host time on the critical path per layer at batch 1, split into
//      lookup, assemble, attend, update (anchor: one empty kernel launch);
//   3. index build for N tokens x H KV heads: the device time of the
//      k-means (the engine's kmeans_ns), and the wall time of the whole
//      ingest (prefill appends and first lookup: k-means, mapping table,
//      pages written to pinned host memory), once with a cold host arena
//      (its chunks pinned on the way) and once warm. The anchor, PyTorch's
//      causal prefill attention of the same layer, is timed by
//      bench/gpu_prefill_anchor.py in the same script run and passed in
//      WKV_PREFILL_ANCHOR_MS, which adds the ratios.
// Usage: gpu_step_bench [tokens] [kv_heads] [q_heads] [head_dim]
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "wavekv/wavekv.h"

namespace {

using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point t) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t).count();
}

__global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
__global__ void empty() {}

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

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char **argv) {
  const uint32_t T = argc > 1 ? std::atoi(argv[1]) : 131072;
  const uint32_t H = argc > 2 ? std::atoi(argv[2]) : 8;
  const uint32_t Q = argc > 3 ? std::atoi(argv[3]) : 32;
  const uint32_t D = argc > 4 ? std::atoi(argv[4]) : 128;
  wkv_config c;
  wkv_config_init(&c);
  c.device = WKV_DEVICE_CUDA;
  c.n_layers = 1;
  c.n_q_heads = Q;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.dtype = WKV_DTYPE_F16;
  wkv_engine *e;
  CHECK(wkv_engine_open(&c, &e));
  cudaStream_t s;
  CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  // Keys with structure: a shared offset plus topic directions in runs.
  std::mt19937 rng(1);
  std::normal_distribution<float> n01(0.f, 1.f);
  const size_t per_tok = static_cast<size_t>(H) * D;
  std::vector<__half> hk(static_cast<size_t>(T) * per_tok), hv(hk.size());
  std::vector<float> mean(per_tok), topic(64 * per_tok);
  for (float &x : mean) x = 2.f * n01(rng);
  for (float &x : topic) x = n01(rng);
  for (uint32_t t = 0; t < T; ++t) {
    uint32_t tp = (t / 256 * 2654435761u) % 64;
    for (size_t i = 0; i < per_tok; ++i) {
      hk[t * per_tok + i] = __float2half(mean[i] + topic[tp * per_tok + i] + 0.5f * n01(rng));
      hv[t * per_tok + i] = __float2half(n01(rng));
    }
  }
  void *dk, *dv;
  CU(cudaMalloc(&dk, hk.size() * 2));
  CU(cudaMalloc(&dv, hv.size() * 2));
  CU(cudaMemcpy(dk, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice));
  CU(cudaMemcpy(dv, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice));

  // 3. Index build: the prompt's appends, its end (one k-means batch of the
  //    whole layer), the first lookup.
  wkv_seq *seq;
  CHECK(wkv_seq_create(e, &seq));
  wkv_plan *plan;
  CHECK(wkv_plan_create(e, &plan));
  void *dq, *dout;
  CU(cudaMalloc(&dq, static_cast<size_t>(Q) * D * 2));
  CU(cudaMalloc(&dout, static_cast<size_t>(Q) * D * 2));
  std::vector<__half> hq(static_cast<size_t>(Q) * D);
  for (auto &x : hq) x = __float2half(0.3f * n01(rng));
  CU(cudaMemcpy(dq, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice));
  CU(cudaDeviceSynchronize());
  auto t0 = Clock::now();
  CHECK(wkv_seq_append(seq, 0, dk, dv, T, 0, 0, s));
  CHECK(wkv_seq_end_prompt(seq, 0, s));
  CHECK(wkv_lookup(plan, &seq, 1, 0, dq, 0, 0, s));
  CU(cudaStreamSynchronize(s));
  const double build_ms = us_since(t0) / 1e3;
  wkv_stats st;
  wkv_stats_init(&st);
  CHECK(wkv_engine_stats(e, &st));
  std::printf("ingest, cold arena: %u tokens x %u kv heads: %.2f ms wall (k-means device time %.2f ms), "
              "%llu clusters\n",
              T, H, build_ms, st.kmeans_ns / 1e6, static_cast<unsigned long long>(st.clusters));
  // The same build again once the host arena's chunks are pinned: the
  // first sequence's pages go back to the arena, which keeps its chunks.
  wkv_plan_destroy(plan);  // the plan holds its sequences until it is reused or destroyed
  wkv_seq_destroy(seq);
  CHECK(wkv_seq_create(e, &seq));
  CHECK(wkv_plan_create(e, &plan));
  const uint64_t km0 = st.kmeans_ns;
  t0 = Clock::now();
  CHECK(wkv_seq_append(seq, 0, dk, dv, T, 0, 0, s));
  CHECK(wkv_seq_end_prompt(seq, 0, s));
  CHECK(wkv_lookup(plan, &seq, 1, 0, dq, 0, 0, s));
  CU(cudaStreamSynchronize(s));
  const double warm_ms = us_since(t0) / 1e3;
  wkv_stats_init(&st);
  CHECK(wkv_engine_stats(e, &st));
  const double warm_km_ms = (st.kmeans_ns - km0) / 1e6;
  std::printf("ingest, warm arena: %.2f ms wall (k-means device time %.2f ms)\n", warm_ms, warm_km_ms);

  // Warm up.
  for (int i = 0; i < 20; ++i) CHECK(wkv_decode(plan, &seq, 1, 0, dq, 0, 0, dout, 0, 0, s));
  CU(cudaStreamSynchronize(s));

  // 2. Critical-path host time per verb, batch 1 (device work overlaps).
  std::vector<double> lk, as, at, up, total, launch;
  for (int i = 0; i < 200; ++i) {
    auto a = Clock::now();
    CHECK(wkv_lookup(plan, &seq, 1, 0, dq, 0, 0, s));
    double t1 = us_since(a);
    auto b = Clock::now();
    CHECK(wkv_assemble(plan, s));
    double t2 = us_since(b);
    auto cc = Clock::now();
    CHECK(wkv_attend(plan, dout, 0, 0, nullptr, s));
    double t3 = us_since(cc);
    auto d = Clock::now();
    CHECK(wkv_update(plan, s));
    double t4 = us_since(d);
    lk.push_back(t1);
    as.push_back(t2);
    at.push_back(t3);
    up.push_back(t4);
    total.push_back(t1 + t2 + t3 + t4);
    auto l = Clock::now();
    empty<<<1, 1, 0, s>>>();
    launch.push_back(us_since(l));
    if (i % 20 == 19) CU(cudaStreamSynchronize(s));
  }
  CU(cudaStreamSynchronize(s));

  // Device time of a step (events).
  cudaEvent_t ev0, ev1;
  CU(cudaEventCreate(&ev0));
  CU(cudaEventCreate(&ev1));
  std::vector<double> dev_ms;
  for (int i = 0; i < 50; ++i) {
    CU(cudaEventRecord(ev0, s));
    CHECK(wkv_decode(plan, &seq, 1, 0, dq, 0, 0, dout, 0, 0, s));
    CU(cudaEventRecord(ev1, s));
    CU(cudaEventSynchronize(ev1));
    float ms;
    CU(cudaEventElapsedTime(&ms, ev0, ev1));
    dev_ms.push_back(ms);
  }

  // 1. Host waits: enqueue steps behind a 20 ms spin.
  const long long spin_cycles = 20LL * 1000 * 1000 * 2;  // ~20 ms at ~2 GHz
  int waited = 0, steps = 50;
  for (int i = 0; i < steps; ++i) {
    spin<<<1, 1, 0, s>>>(spin_cycles / 10);
    auto a = Clock::now();
    CHECK(wkv_decode(plan, &seq, 1, 0, dq, 0, 0, dout, 0, 0, s));
    if (us_since(a) > 1000.0) ++waited;  // the spin is ~2 ms: a wait shows
  }
  CU(cudaStreamSynchronize(s));
  spin<<<1, 1, 0, s>>>(spin_cycles / 10);
  auto a = Clock::now();
  CU(cudaStreamSynchronize(s));
  const double anchor_wait = us_since(a);

  std::printf("\n%-44s %12s %12s\n", "figure", "wavekv", "anchor");
  std::printf("%-44s %12d %12s\n", "host waits in 50 decode steps (behind spin)", waited, "-");
  std::printf("%-44s %12.0f %12.0f\n", "  spin anchor: a real wait lasts (us)", 0.0, anchor_wait);
  std::printf("%-44s %12.1f %12.1f\n", "critical-path host us/step (median)", median(total), median(launch));
  std::printf("%-44s %12.1f\n", "  lookup us", median(lk));
  std::printf("%-44s %12.1f\n", "  assemble us", median(as));
  std::printf("%-44s %12.1f\n", "  attend us", median(at));
  std::printf("%-44s %12.1f\n", "  update (buffer manager) us", median(up));
  std::printf("%-44s %12.3f\n", "device time per step (ms, median)", median(dev_ms));
  const char *anchor_env = std::getenv("WKV_PREFILL_ANCHOR_MS");
  const double anchor_ms = anchor_env ? std::atof(anchor_env) : 0.0;
  auto row_ms = [&](const char *what, double ms) {
    if (anchor_ms > 0)
      std::printf("%-44s %12.2f %12.2f  (%.1f%% of it)\n", what, ms, anchor_ms, 100.0 * ms / anchor_ms);
    else
      std::printf("%-44s %12.2f %12s\n", what, ms, "-");
  };
  row_ms("index build: k-means ms (device time)", warm_km_ms);
  row_ms("ingest ms, warm arena (k-means, pages out)", warm_ms);
  row_ms("ingest ms, cold arena (pins host memory)", build_ms);
  wkv_stats_init(&st);
  CHECK(wkv_engine_stats(e, &st));
  std::printf("cache: %llu hits, %llu misses (units of page_tokens members), %llu bytes\n", static_cast<unsigned long long>(st.cache_hits),
              static_cast<unsigned long long>(st.cache_misses), static_cast<unsigned long long>(st.device_cache_bytes));
  wkv_plan_destroy(plan);
  wkv_seq_destroy(seq);
  wkv_engine_close(e);
  return 0;
}
