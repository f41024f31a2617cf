// Device benchmark of the gather (execution-buffer assembly) and of the
// device k-means, each beside an anchor measured in the same run.
//
//   gather: 2 KiB pages (d = 128 f16, 8 tokens: K 2 KiB + V 2 KiB per page
//           slot) in a large pool of pinned, mapped host memory, in random
//           order; ~256 MiB of K+V assembled per launch from clusters of
//           8..24 tokens; GB/s = K+V bytes of the retrieval zone / kernel
//           time (events, median of 20). Anchor: cudaMemcpyAsync H2D of one
//           pinned buffer of the same size. The same with every page in a
//           device pool (all hits) beside a device-to-device cudaMemcpyAsync.
//   kmeans: one layer's index build, S = 128 segments (8 KV heads x 16
//           segments of 8192 tokens), d = 128 f16, k = 512, 10 rounds, both
//           assignment paths; and the page writes of the same tokens into
//           mapped host pages.
//
// Usage: gpu_gather_bench [gather] [kmeans] [kmeans-profile] [--pool-gib N]
// [--mib M] (gather and kmeans by default; kmeans-profile runs two fused
// k-means calls and nothing else, for a profiler). Exits non-zero on any CUDA error or a wrong
// gather result.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/gather_cuda.hpp"
#include "kernels/kmeans_cuda.hpp"

using namespace wkv::kernels;

#define CK(x)                                                                                      \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)
#define OK(x)                                                                                      \
  do {                                                                                             \
    const cudaError_t s_ = (x);                                                                          \
    if (s_ != cudaSuccess) {                                                                             \
      std::fprintf(stderr, "error at %s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(s_));      \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median milliseconds of `reps` runs of f, each timed with events, after
// `warm` untimed runs.
template <typename F> double time_ms(F &&f, int reps, int warm = 3) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < warm; ++i) f();
  CK(cudaDeviceSynchronize());
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t = 0;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return median(ms);
}

// Fills n bytes with a non-zero pattern, on all cores.
void fill_pattern(uint8_t *p, size_t n, uint64_t seed) {
  const unsigned nt = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> th;
  const size_t words = n / 8, per = (words + nt - 1) / nt;
  for (unsigned t = 0; t < nt; ++t)
    th.emplace_back([=] {
      uint64_t *w = reinterpret_cast<uint64_t *>(p);
      for (size_t i = t * per; i < std::min(words, (t + 1) * per); ++i)
        w[i] = (i + seed) * 0x9e3779b97f4a7c15ull ^ 0x5bd1e995ull;
    });
  for (auto &x : th) x.join();
}

template <typename T> T *to_device(const std::vector<T> &h) {
  T *d = nullptr;
  CK(cudaMalloc(&d, std::max<size_t>(16, h.size() * sizeof(T))));
  if (!h.empty()) CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// Gather ---------------------------------------------------------------------------

constexpr uint32_t kRowBytes = 256;  // d = 128, f16
constexpr uint32_t kPageTokens = 8;  // K 2 KiB + V 2 KiB
constexpr uint32_t kSlotBytes = 2 * kPageTokens * kRowBytes;

// One gather problem over a page pool at `pool` (device-accessible) whose
// bytes the host reads at `pool_host` (null: skip the check).
struct GatherProblem {
  GatherArgs args;
  uint64_t ret_bytes = 0;  // K+V bytes of the retrieval zone
  uint64_t steady_bytes = 0;
  uint32_t rows = 0;
  // For the check.
  std::vector<std::vector<uint32_t>> first_slot, size, ret_ids, ret_pos, page_ids;
  std::vector<int32_t> offsets;
  std::vector<uint32_t> sink, tail;
  std::vector<uint8_t> steady_k;  // per run: sink rows then tail rows (K); V = K ^ 0xff
};

GatherProblem make_problem(uint8_t *pool, uint64_t pool_pages, uint32_t runs, uint64_t target_bytes,
                           uint64_t seed) {
  GatherProblem g;
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> perm(pool_pages);
  std::iota(perm.begin(), perm.end(), 0u);
  std::shuffle(perm.begin(), perm.end(), rng);
  const uint64_t pages_per_run = pool_pages / runs;
  const uint64_t tokens_per_run = target_bytes / (2 * kRowBytes) / runs;
  std::vector<DevRun> dr(runs);
  std::vector<uint32_t> all_ids, all_pos;
  g.offsets.assign(runs + 1, 0);
  g.first_slot.resize(runs);
  g.size.resize(runs);
  g.ret_ids.resize(runs);
  g.ret_pos.resize(runs);
  g.page_ids.resize(runs);
  uint32_t max_ret = 0;
  for (uint32_t r = 0; r < runs; ++r) {
    auto &fs = g.first_slot[r], &sz = g.size[r];
    const uint64_t slots = pages_per_run * kPageTokens;
    for (uint64_t s = 0;;) {
      const uint32_t n = 8 + rng() % 17;
      if (s + n > slots) break;
      fs.push_back(static_cast<uint32_t>(s));
      sz.push_back(n);
      s += n;
    }
    std::vector<uint32_t> ids(fs.size());
    std::iota(ids.begin(), ids.end(), 0u);
    std::shuffle(ids.begin(), ids.end(), rng);
    uint64_t tok = 0;
    auto &ri = g.ret_ids[r];
    for (uint32_t id : ids) {
      if (tok >= tokens_per_run) break;
      ri.push_back(id);
      tok += sz[id];
    }
    std::sort(ri.begin(), ri.end());
    uint32_t pos = 0;
    for (uint32_t id : ri) g.ret_pos[r].push_back(pos), pos += sz[id];
    std::vector<uint8_t *> pages(pages_per_run);
    for (uint64_t p = 0; p < pages_per_run; ++p) {
      const uint32_t id = perm[r * pages_per_run + p];
      g.page_ids[r].push_back(id);
      pages[p] = pool + uint64_t(id) * kSlotBytes;
    }
    const uint32_t sink = 4, tail = 64;
    g.sink.push_back(sink);
    g.tail.push_back(tail);
    std::vector<uint8_t> sk((sink + tail) * kRowBytes);
    for (size_t i = 0; i < sk.size(); ++i) sk[i] = static_cast<uint8_t>(rng());
    std::vector<uint8_t> sv(sk);
    for (auto &b : sv) b ^= 0xff;
    g.steady_k.insert(g.steady_k.end(), sk.begin(), sk.end());
    uint8_t *dk = to_device(sk), *dv = to_device(sv);
    DevRun &d = dr[r];
    std::memset(&d, 0, sizeof(d));
    d.size = to_device(sz);
    d.first_slot = to_device(fs);
    d.pages = to_device(pages);
    d.sink_k = dk;
    d.sink_v = dv;
    d.tail_k = dk + sink * kRowBytes;
    d.tail_v = dv + sink * kRowBytes;
    d.clusters = static_cast<uint32_t>(fs.size());
    d.n_ret = static_cast<uint32_t>(ri.size());
    d.sink_tokens = sink;
    d.tail_tokens = tail;
    d.ret_off = static_cast<uint32_t>(all_ids.size());
    all_ids.insert(all_ids.end(), ri.begin(), ri.end());
    all_pos.insert(all_pos.end(), g.ret_pos[r].begin(), g.ret_pos[r].end());
    g.offsets[r + 1] = g.offsets[r] + static_cast<int32_t>(sink + tail + pos);
    g.ret_bytes += uint64_t(pos) * 2 * kRowBytes;
    g.steady_bytes += uint64_t(sink + tail) * 2 * kRowBytes;
    max_ret = std::max(max_ret, d.n_ret);
  }
  g.rows = static_cast<uint32_t>(g.offsets[runs]);
  GatherArgs &a = g.args;
  a.runs = to_device(dr);
  a.n_runs = runs;
  a.lookup.ret_ids = to_device(all_ids);
  a.lookup.ret_pos = to_device(all_pos);
  a.lookup.offsets = to_device(g.offsets);
  a.max_ret = max_ret;
  a.row_bytes = kRowBytes;
  a.page_tokens = kPageTokens;
  CK(cudaMalloc(&a.xk, size_t(g.rows) * kRowBytes));
  CK(cudaMalloc(&a.xv, size_t(g.rows) * kRowBytes));
  CK(cudaMalloc(&a.stats, 16));
  return g;
}

// Compares the assembled K and V with a CPU gather from the pool's host image.
bool check_problem(const GatherProblem &g, const uint8_t *pool_host) {
  std::vector<uint8_t> xk(size_t(g.rows) * kRowBytes), xv(xk.size());
  CK(cudaMemcpy(xk.data(), g.args.xk, xk.size(), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(xv.data(), g.args.xv, xv.size(), cudaMemcpyDeviceToHost));
  size_t steady_at = 0;
  for (uint32_t r = 0; r < g.args.n_runs; ++r) {
    size_t row = g.offsets[r];
    const size_t sb = size_t(g.sink[r] + g.tail[r]) * kRowBytes;
    if (std::memcmp(&xk[row * kRowBytes], &g.steady_k[steady_at], sb) != 0) return false;
    for (size_t i = 0; i < sb; ++i)
      if (xv[row * kRowBytes + i] != (g.steady_k[steady_at + i] ^ 0xff)) return false;
    steady_at += sb;
    row += g.sink[r] + g.tail[r];
    for (size_t i = 0; i < g.ret_ids[r].size(); ++i) {
      const uint32_t id = g.ret_ids[r][i];
      for (uint32_t m = 0; m < g.size[r][id]; ++m) {
        const uint32_t slot = g.first_slot[r][id] + m;
        const uint8_t *page = pool_host + uint64_t(g.page_ids[r][slot / kPageTokens]) * kSlotBytes;
        const size_t dst = (row + g.ret_pos[r][i] + m) * kRowBytes;
        if (std::memcmp(&xk[dst], page + (slot % kPageTokens) * kRowBytes, kRowBytes) != 0) return false;
        if (std::memcmp(&xv[dst], page + (kPageTokens + slot % kPageTokens) * kRowBytes, kRowBytes) != 0)
          return false;
      }
    }
  }
  return true;
}

int bench_gather(double pool_gib, double mib) {
  const uint64_t pool_bytes = uint64_t(pool_gib * (1ull << 30)) / kSlotBytes * kSlotBytes;
  const uint64_t pool_pages = pool_bytes / kSlotBytes;
  const uint64_t target = uint64_t(mib * (1 << 20));
  const uint32_t runs = 64;  // e.g. 8 sequences x 8 KV heads
  std::printf("gather: pool %.2f GiB pinned mapped (%llu pages of %u B), %u runs, ~%.0f MiB K+V per launch\n",
              pool_bytes / double(1ull << 30), (unsigned long long)pool_pages, kSlotBytes, runs, mib);
  uint8_t *pool = nullptr;
  CK(cudaHostAlloc(reinterpret_cast<void **>(&pool), pool_bytes, cudaHostAllocMapped));
  fill_pattern(pool, pool_bytes, 1);
  uint8_t *pool_dev = nullptr;
  CK(cudaHostGetDevicePointer(reinterpret_cast<void **>(&pool_dev), pool, 0));

  // Misses: every page in host memory.
  GatherProblem miss = make_problem(pool_dev, pool_pages, runs, target, 7);
  CK(cudaMemset(miss.args.xk, 0xee, size_t(miss.rows) * kRowBytes));
  CK(cudaMemset(miss.args.xv, 0xee, size_t(miss.rows) * kRowBytes));
  CK(cudaMemset(miss.args.stats, 0, 16));
  OK(gather_cuda(miss.args, nullptr));
  CK(cudaDeviceSynchronize());
  const bool miss_ok = check_problem(miss, pool);
  unsigned long long cnt[2];
  CK(cudaMemcpy(cnt, miss.args.stats, 16, cudaMemcpyDeviceToHost));
  std::printf("  miss problem: %u rows, retrieval %.1f MiB K+V, steady %.2f MiB; check %s; hits %llu misses %llu\n",
              miss.rows, miss.ret_bytes / 1048576.0, miss.steady_bytes / 1048576.0, miss_ok ? "ok" : "FAILED",
              cnt[0], cnt[1]);
  const double t_miss = time_ms([&] { OK(gather_cuda(miss.args, nullptr)); }, 20);
  const double t_miss_nocount = time_ms(
      [&] {
        GatherArgs a = miss.args;
        a.stats = nullptr;
        OK(gather_cuda(a, nullptr));
      },
      20);

  // Anchor: one large pinned H2D copy of the same size.
  const size_t anchor_bytes = miss.ret_bytes;
  uint8_t *hbuf = nullptr, *dbuf = nullptr, *dbuf2 = nullptr;
  CK(cudaHostAlloc(reinterpret_cast<void **>(&hbuf), anchor_bytes, cudaHostAllocDefault));
  fill_pattern(hbuf, anchor_bytes, 3);
  CK(cudaMalloc(&dbuf, anchor_bytes));
  CK(cudaMalloc(&dbuf2, anchor_bytes));
  const double t_h2d = time_ms([&] { CK(cudaMemcpyAsync(dbuf, hbuf, anchor_bytes, cudaMemcpyHostToDevice)); }, 20);

  // Device pages: the same problem with every page in device memory (the
  // bandwidth of reads from the device; the cache's frames are read the same
  // way, counted as hits).
  const uint64_t dev_pages = std::min<uint64_t>(pool_pages, (2ull << 30) / kSlotBytes);
  uint8_t *dpool = nullptr;
  CK(cudaMalloc(&dpool, dev_pages * kSlotBytes));
  CK(cudaMemcpy(dpool, pool, dev_pages * kSlotBytes, cudaMemcpyHostToDevice));
  GatherProblem hit = make_problem(dpool, dev_pages, runs, target, 8);
  CK(cudaMemset(hit.args.stats, 0, 16));
  OK(gather_cuda(hit.args, nullptr));
  CK(cudaDeviceSynchronize());
  const bool hit_ok = check_problem(hit, pool);
  CK(cudaMemcpy(cnt, hit.args.stats, 16, cudaMemcpyDeviceToHost));
  std::printf("  device-page problem: retrieval %.1f MiB; check %s; hits %llu misses %llu\n", hit.ret_bytes / 1048576.0,
              hit_ok ? "ok" : "FAILED", cnt[0], cnt[1]);
  const double t_hit = time_ms([&] { OK(gather_cuda(hit.args, nullptr)); }, 20);
  const double t_d2d = time_ms([&] { CK(cudaMemcpyAsync(dbuf2, dbuf, anchor_bytes, cudaMemcpyDeviceToDevice)); }, 20);

  auto gbs = [](uint64_t bytes, double ms) { return bytes / (ms * 1e-3) / 1e9; };
  std::printf("\n| what | bytes (MiB) | median ms (20) | GB/s | vs anchor |\n|---|---|---|---|---|\n");
  const double a_h2d = gbs(anchor_bytes, t_h2d), a_d2d = gbs(anchor_bytes, t_d2d);
  std::printf("| anchor: cudaMemcpyAsync H2D, pinned | %.1f | %.3f | %.1f | 1.00 |\n", anchor_bytes / 1048576.0,
              t_h2d, a_h2d);
  std::printf("| gather, all misses (mapped host pages) | %.1f | %.3f | %.1f | %.2f |\n",
              miss.ret_bytes / 1048576.0, t_miss, gbs(miss.ret_bytes, t_miss), gbs(miss.ret_bytes, t_miss) / a_h2d);
  std::printf("| gather, all misses, no counters | %.1f | %.3f | %.1f | %.2f |\n", miss.ret_bytes / 1048576.0,
              t_miss_nocount, gbs(miss.ret_bytes, t_miss_nocount), gbs(miss.ret_bytes, t_miss_nocount) / a_h2d);
  std::printf("| anchor: cudaMemcpyAsync D2D | %.1f | %.3f | %.1f | 1.00 |\n", anchor_bytes / 1048576.0, t_d2d,
              a_d2d);
  std::printf("| gather, all hits (device pages) | %.1f | %.3f | %.1f | %.2f |\n", hit.ret_bytes / 1048576.0, t_hit,
              gbs(hit.ret_bytes, t_hit), gbs(hit.ret_bytes, t_hit) / a_d2d);
  std::printf("(GB/s = K+V bytes of the retrieval zone / kernel time; the steady zone is copied too but not counted)\n\n");
  return miss_ok && hit_ok ? 0 : 1;
}

// K-means --------------------------------------------------------------------------

__device__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}
__device__ float unif(uint64_t x) { return (hash32(x) >> 8) * (1.f / 16777216.f) * 2.f - 1.f; }

// Keys like post-RoPE ones: per segment a shared mean, 48 topic directions
// holding for runs of 24 tokens, plus noise; values uniform.
__global__ void gen_kv(__half *k, __half *v, uint32_t S, uint32_t T, uint32_t d) {
  const uint64_t n = uint64_t(S) * T * d;
  for (uint64_t e = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; e < n; e += uint64_t(gridDim.x) * blockDim.x) {
    const uint32_t j = e % d;
    const uint64_t row = e / d;
    const uint32_t s = static_cast<uint32_t>(row / T), i = static_cast<uint32_t>(row % T);
    const uint32_t topic = hash32((uint64_t(s) << 32) | (i / 24)) % 48;
    const float mean = 3.f * unif((uint64_t(s) << 40) ^ (1ull << 39) ^ j);
    const float dir = 2.f * unif((uint64_t(s) << 40) ^ (uint64_t(topic) << 20) ^ j ^ (1ull << 38));
    k[e] = __float2half_rn(mean + dir + 0.5f * unif(e * 3 + 1));
    v[e] = __float2half_rn(unif(e * 3 + 2));
  }
}

// Two fused 10-round calls and nothing else: a clean trace for a profiler
// (ncu --print-summary per-kernel).
int profile_kmeans() {
  const uint32_t S = 128, T = 8192, d = 128, k = 512;
  __half *keys = nullptr, *vals = nullptr;
  const size_t n = size_t(S) * T * d;
  CK(cudaMalloc(&keys, n * 2));
  CK(cudaMalloc(&vals, n * 2));
  gen_kv<<<4096, 256>>>(keys, vals, S, T, d);
  CK(cudaGetLastError());
  std::vector<KMeansSegmentDesc> segs(S);
  for (uint32_t s = 0; s < S; ++s) {
    segs[s].keys = keys + size_t(s) * T * d;
    segs[s].values = vals + size_t(s) * T * d;
    segs[s].tokens = T;
    segs[s].clusters = k;
    segs[s].seed = 1000 + s;
  }
  // Outliers as the engine's default method splits them (lib/index/growth.hpp).
  for (KMeansSegmentDesc &sg : segs) {
    sg.outliers = T / 200;
    sg.outlier_ratio = 1.5f;
  }
  const size_t K = k + T / 200;  // cluster slots per segment
  KMeansBatchOut out;
  CK(cudaMalloc(&out.n_clusters, S * 4));
  CK(cudaMalloc(&out.n_outliers, S * 4));
  CK(cudaMalloc(&out.begin, (size_t(S) * K + S) * 4));
  CK(cudaMalloc(&out.order, size_t(S) * T * 4));
  CK(cudaMalloc(&out.size, size_t(S) * K * 4));
  CK(cudaMalloc(&out.centroid, size_t(S) * K * d * 4));
  CK(cudaMalloc(&out.value_sum, size_t(S) * K * d * 4));
  CK(cudaMalloc(&out.spread, size_t(S) * K * 4));
  CK(cudaMalloc(&out.value_total, size_t(S) * d * 8));
  KMeansBatchParams p;
  p.dtype = wkv::DType::kF16;
  p.head_dim = d;
  size_t ws_bytes = 0;
  OK(kmeans_batch_workspace_size(p, kmeans_batch_shape(segs.data(), S), &ws_bytes));
  void *ws = nullptr;
  CK(cudaMalloc(&ws, ws_bytes));
  for (int i = 0; i < 2; ++i) OK(kmeans_batch_cuda(p, segs.data(), S, out, ws, ws_bytes, nullptr, nullptr));
  CK(cudaDeviceSynchronize());
  std::printf("kmeans-profile: 2 fused calls done\n");
  return 0;
}

// out = keys, except that 6 of every 7 rows of a segment repeat its row 0.
__global__ void skew_keys(const __half *keys, __half *out, uint32_t S, uint32_t T, uint32_t d) {
  const uint64_t n = uint64_t(S) * T * d;
  for (uint64_t e = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; e < n; e += uint64_t(gridDim.x) * blockDim.x) {
    const uint64_t row = e / d;
    const uint32_t i = static_cast<uint32_t>(row % T);
    out[e] = i % 7 == 0 ? keys[e] : keys[(row - i) * d + e % d];
  }
}

int bench_kmeans(double pool_gib) {
  const uint32_t S = 128, T = 8192, d = 128, k = 512;
  std::printf("kmeans: S=%u segments x T=%u tokens, d=%u f16, k=%u\n", S, T, d, k);
  __half *keys = nullptr, *vals = nullptr;
  const size_t n = size_t(S) * T * d;
  CK(cudaMalloc(&keys, n * 2));
  CK(cudaMalloc(&vals, n * 2));
  gen_kv<<<4096, 256>>>(keys, vals, S, T, d);
  CK(cudaGetLastError());
  std::vector<KMeansSegmentDesc> segs(S);
  for (uint32_t s = 0; s < S; ++s) {
    segs[s].keys = keys + size_t(s) * T * d;
    segs[s].values = vals + size_t(s) * T * d;
    segs[s].tokens = T;
    segs[s].clusters = k;
    segs[s].seed = 1000 + s;
  }
  // Outliers as the engine's default method splits them (lib/index/growth.hpp).
  for (KMeansSegmentDesc &sg : segs) {
    sg.outliers = T / 200;
    sg.outlier_ratio = 1.5f;
  }
  const KMeansBatchShape sh = kmeans_batch_shape(segs.data(), S);
  const size_t K = k + T / 200;  // cluster slots per segment
  KMeansBatchOut out;
  CK(cudaMalloc(&out.n_clusters, S * 4));
  CK(cudaMalloc(&out.n_outliers, S * 4));
  CK(cudaMalloc(&out.begin, (size_t(S) * K + S) * 4));
  CK(cudaMalloc(&out.order, size_t(S) * T * 4));
  CK(cudaMalloc(&out.size, size_t(S) * K * 4));
  CK(cudaMalloc(&out.centroid, size_t(S) * K * d * 4));
  CK(cudaMalloc(&out.value_sum, size_t(S) * K * d * 4));
  CK(cudaMalloc(&out.spread, size_t(S) * K * 4));
  CK(cudaMalloc(&out.value_total, size_t(S) * d * 8));
  void *cublas = nullptr;
  OK(kmeans_cublas_create(&cublas));
  std::printf("\n| path | iters | workspace MiB | median ms (5) | clusters kept |\n|---|---|---|---|---|\n");
  double t_fused10 = 0, t_fused1 = 0;
  for (KMeansAssign path : {KMeansAssign::kFused, KMeansAssign::kCublas})
    for (uint32_t iters : {1u, 10u}) {
      KMeansBatchParams p;
      p.dtype = wkv::DType::kF16;
      p.head_dim = d;
      p.iters = iters;
      p.assign = path;
      size_t ws_bytes = 0;
      OK(kmeans_batch_workspace_size(p, sh, &ws_bytes));
      void *ws = nullptr;
      CK(cudaMalloc(&ws, ws_bytes));
      const double t = time_ms([&] { OK(kmeans_batch_cuda(p, segs.data(), S, out, ws, ws_bytes, cublas, nullptr)); },
                               5, 1);
      std::vector<uint32_t> nc(S);
      CK(cudaMemcpy(nc.data(), out.n_clusters, S * 4, cudaMemcpyDeviceToHost));
      const uint64_t kept = std::accumulate(nc.begin(), nc.end(), uint64_t(0));
      std::printf("| %s | %u | %.0f | %.3f | %llu of %u |\n", path == KMeansAssign::kFused ? "fused" : "cublas",
                  iters, ws_bytes / 1048576.0, t, (unsigned long long)kept, S * k);
      if (path == KMeansAssign::kFused) (iters == 10 ? t_fused10 : t_fused1) = t;
      CK(cudaFree(ws));
    }
  std::printf("fused: %.3f ms per extra round; index build (10 rounds) %.3f ms\n", (t_fused10 - t_fused1) / 9,
              t_fused10);
  {
    // The anchor of the counting sort: the same batch ordered by a radix
    // sort of the batch's keys each round (the kRadix path).
    KMeansBatchParams p;
    p.dtype = wkv::DType::kF16;
    p.head_dim = d;
    p.order = KMeansOrder::kRadix;
    size_t ws_bytes = 0;
    OK(kmeans_batch_workspace_size(p, sh, &ws_bytes));
    void *ws = nullptr;
    CK(cudaMalloc(&ws, ws_bytes));
    const double t = time_ms([&] { OK(kmeans_batch_cuda(p, segs.data(), S, out, ws, ws_bytes, nullptr, nullptr)); },
                             5, 1);
    std::printf("fused, 10 rounds: counting sort per segment %.3f ms, radix sort of the batch %.3f ms (%.2fx)\n",
                t_fused10, t, t / t_fused10);
    CK(cudaFree(ws));
  }
  {
    // A 131072-token prompt of 8 KV heads: 15 full segments a head and a
    // last one of 8124 tokens (the sink and the window stay out). The
    // engine clusters them in one batch; it used to take two (the full ones
    // while the prompt was appended, the last ones at the first lookup).
    KMeansBatchParams p;
    p.dtype = wkv::DType::kF16;
    p.head_dim = d;
    std::vector<KMeansSegmentDesc> last(segs.begin(), segs.begin() + 8);
    for (KMeansSegmentDesc &g : last) {
      g.tokens = 8124;
      g.clusters = (8124 + 15) / 16;
    }
    size_t ws_bytes = 0;
    OK(kmeans_batch_workspace_size(p, sh, &ws_bytes));
    void *ws = nullptr;
    CK(cudaMalloc(&ws, ws_bytes));
    const double t_big =
        time_ms([&] { OK(kmeans_batch_cuda(p, segs.data(), 120, out, ws, ws_bytes, nullptr, nullptr)); }, 5, 1);
    const double t_small =
        time_ms([&] { OK(kmeans_batch_cuda(p, last.data(), 8, out, ws, ws_bytes, nullptr, nullptr)); }, 5, 1);
    std::vector<KMeansSegmentDesc> prompt(segs.begin(), segs.begin() + 120);
    prompt.insert(prompt.end(), last.begin(), last.end());
    const double t_one =
        time_ms([&] { OK(kmeans_batch_cuda(p, prompt.data(), 128, out, ws, ws_bytes, nullptr, nullptr)); }, 5, 1);
    std::printf("fused, a 131072-token prompt in one batch (120 segments + 8 of 8124 tokens): %.3f ms; "
                "in two: %.3f + %.3f = %.3f ms\n", t_one, t_big, t_small, t_big + t_small);
    // The small batch replayed from a CUDA graph: how much of it is launches.
    cudaStream_t cs;
    CK(cudaStreamCreate(&cs));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal));
    const cudaError_t st = kmeans_batch_cuda(p, last.data(), 8, out, ws, ws_bytes, nullptr, cs);
    const cudaError_t ce = cudaStreamEndCapture(cs, &graph);
    if (st == cudaSuccess && ce == cudaSuccess && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
      const double t_graph = time_ms([&] { CK(cudaGraphLaunch(exec, cs)); }, 5, 1);
      std::printf("fused, the 8-segment batch replayed from a CUDA graph: %.3f ms\n", t_graph);
      cudaGraphExecDestroy(exec);
    } else {
      (void)cudaGetLastError();
      std::printf("fused, the 8-segment batch could not be captured (%s; %s)\n", cudaGetErrorString(st),
                  cudaGetErrorString(ce));
    }
    if (graph) cudaGraphDestroy(graph);
    CK(cudaStreamDestroy(cs));
    CK(cudaFree(ws));
  }
  {
    // Skewed keys: 6 of every 7 tokens of a segment repeat its first key, so
    // each segment has one cluster of ~7000 members.
    __half *skew = nullptr;
    CK(cudaMalloc(&skew, n * 2));
    skew_keys<<<4096, 256>>>(keys, skew, S, T, d);
    CK(cudaGetLastError());
    std::vector<KMeansSegmentDesc> sk(segs);
    for (uint32_t s = 0; s < S; ++s) sk[s].keys = skew + size_t(s) * T * d;
    KMeansBatchParams p;
    p.dtype = wkv::DType::kF16;
    p.head_dim = d;
    size_t ws_bytes = 0;
    OK(kmeans_batch_workspace_size(p, sh, &ws_bytes));
    void *ws = nullptr;
    CK(cudaMalloc(&ws, ws_bytes));
    const double t = time_ms([&] { OK(kmeans_batch_cuda(p, sk.data(), S, out, ws, ws_bytes, nullptr, nullptr)); }, 5, 1);
    std::vector<uint32_t> sz(size_t(S) * k);
    CK(cudaMemcpy(sz.data(), out.size, sz.size() * 4, cudaMemcpyDeviceToHost));
    std::printf("fused, skewed keys (largest cluster %u members): %.3f ms\n", *std::max_element(sz.begin(), sz.end()), t);
    CK(cudaFree(ws));
    CK(cudaFree(skew));
  }

  // Page writes of the same tokens into mapped host pages, in the k-means order.
  const uint64_t pages_per_seg = T / kPageTokens, need = uint64_t(S) * pages_per_seg * kSlotBytes;
  const uint64_t pool_bytes = std::max<uint64_t>(need, uint64_t(pool_gib * (1ull << 30)) / kSlotBytes * kSlotBytes);
  uint8_t *pool = nullptr, *pool_dev = nullptr;
  CK(cudaHostAlloc(reinterpret_cast<void **>(&pool), pool_bytes, cudaHostAllocMapped));
  CK(cudaHostGetDevicePointer(reinterpret_cast<void **>(&pool_dev), pool, 0));
  std::mt19937_64 rng(5);
  std::vector<uint32_t> perm(pool_bytes / kSlotBytes);
  std::iota(perm.begin(), perm.end(), 0u);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<WritePagesJob> jobs(S);
  for (uint32_t s = 0; s < S; ++s) {
    std::vector<uint8_t *> pages(pages_per_seg);
    for (uint64_t p = 0; p < pages_per_seg; ++p) pages[p] = pool_dev + uint64_t(perm[s * pages_per_seg + p]) * kSlotBytes;
    jobs[s].order = out.order + size_t(s) * T;
    jobs[s].k = reinterpret_cast<const uint8_t *>(keys + size_t(s) * T * d);
    jobs[s].v = reinterpret_cast<const uint8_t *>(vals + size_t(s) * T * d);
    jobs[s].pages = to_device(pages);
    jobs[s].tokens = T;
  }
  WritePagesJob *djobs = to_device(jobs);
  const double t_pages =
      time_ms([&] { OK(write_pages_batch_cuda(djobs, S, T, kRowBytes, kPageTokens, nullptr)); }, 5, 1);
  // Check one segment's first page against the order.
  std::vector<uint32_t> order0(kPageTokens);
  CK(cudaMemcpy(order0.data(), out.order, kPageTokens * 4, cudaMemcpyDeviceToHost));
  std::vector<uint8_t> row(kRowBytes);
  CK(cudaMemcpy(row.data(), keys + size_t(order0[1]) * d, kRowBytes, cudaMemcpyDeviceToHost));
  const bool pages_ok = std::memcmp(pool + uint64_t(perm[0]) * kSlotBytes + kRowBytes, row.data(), kRowBytes) == 0;
  const uint64_t moved = uint64_t(S) * T * 2 * kRowBytes;
  std::printf("write pages: %.0f MiB K+V into mapped host pages: %.3f ms, %.1f GB/s (check %s)\n\n",
              moved / 1048576.0, t_pages, moved / (t_pages * 1e-3) / 1e9, pages_ok ? "ok" : "FAILED");
  kmeans_cublas_destroy(cublas);
  return pages_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char **argv) {
  bool gather = false, kmeans = false, profile = false;
  double pool_gib = 4, mib = 256;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "gather") gather = true;
    else if (a == "kmeans") kmeans = true;
    else if (a == "kmeans-profile") profile = true;
    else if (a == "--pool-gib" && i + 1 < argc) pool_gib = std::atof(argv[++i]);
    else if (a == "--mib" && i + 1 < argc) mib = std::atof(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [gather] [kmeans] [kmeans-profile] [--pool-gib N] [--mib M]\n", argv[0]);
      return 64;
    }
  }
  if (!gather && !kmeans && !profile) gather = kmeans = true;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("skipped: no CUDA device\n");
    return 77;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n\n", prop.name, prop.multiProcessorCount);
  int rc = 0;
  if (gather) rc |= bench_gather(pool_gib, mib);
  if (kmeans) rc |= bench_kmeans(1.0);
  if (profile) rc |= profile_kmeans();
  return rc;
}
