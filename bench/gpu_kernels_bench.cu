// Micro-benchmark of the CUDA lookup and attention kernels: median device
// time per call (CUDA events), against the bytes each call must read.
// Inputs are random (never zeros) and rotate over enough copies to exceed
// the L2 cache where the working set of one call would fit in it.
//
//   gpu_kernels_bench            prints one table
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/attention_cuda.hpp"
#include "kernels/device_layout.hpp"
#include "kernels/lookup_cuda.hpp"

using namespace wkv;
using namespace wkv::kernels;

#define CHECK_CUDA(x)                                                                      \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)
#define CHECK_STATUS(x)                                                                    \
  do {                                                                                     \
    const cudaError_t s_ = (x);                                                                       \
    if (s_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(s_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

namespace {

__global__ void fill_kernel(uint16_t *p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    const float f = (static_cast<float>(x & 0xffffff) / 16777216.f) * 2.f - 1.f;
    p[i] = __half_as_ushort(__float2half_rn(f));
  }
}
__global__ void fill_f32(float *p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    p[i] = (static_cast<float>(x & 0xffffff) / 16777216.f) * 2.f - 1.f;
  }
}

// Median over 9 samples of the mean device time per call of `batch` calls
// issued back to back (so that host launch overhead overlaps device work,
// as in a decoding loop); f(i) issues call i.
template <typename F>
double median_us(F &&f, int batch, int warm = 5) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < warm; ++i) f(i);
  std::vector<double> t;
  int call = 0;
  for (int k = 0; k < 9; ++k) {
    CHECK_CUDA(cudaEventRecord(a));
    for (int i = 0; i < batch; ++i) f(call++);
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1e3 / batch);
  }
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

__global__ void read_kernel(const uint4 *p, size_t n, uint32_t *sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x12345678u) *sink = x;
}

void bench_read() {
  const size_t bytes = size_t(1) << 30;
  uint4 *a;
  uint32_t *sink;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&sink, 4));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const double us = median_us([&](int) { read_kernel<<<sms * 8, 512>>>(a, bytes / 16, sink); }, 3);
  std::printf("%-44s %10.1f us %8.0f GB/s (read)\n", "device read 1 GiB", us, bytes / us / 1e3);
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(sink));
}

void bench_copy() {
  const size_t bytes = size_t(1) << 30;
  void *a, *b;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  const double us = median_us([&](int) { CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, 3);
  std::printf("%-44s %10.1f us %8.0f GB/s (read+write)\n", "device copy 1 GiB", us, 2.0 * bytes / us / 1e3);
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
}

// R runs of `tokens` tokens, f16, d = 128.
void bench_attend(uint32_t R, uint32_t tokens, uint32_t G, uint32_t d, int copies) {
  const size_t total = size_t(R) * tokens, row = size_t(d);
  std::vector<uint16_t *> k(copies), v(copies);
  for (int c = 0; c < copies; ++c) {
    CHECK_CUDA(cudaMalloc(&k[c], total * row * 2));
    CHECK_CUDA(cudaMalloc(&v[c], total * row * 2));
    fill_kernel<<<1024, 256>>>(k[c], total * row, 2 * c + 1);
    fill_kernel<<<1024, 256>>>(v[c], total * row, 2 * c + 2);
  }
  std::vector<int32_t> offs(R + 1);
  for (uint32_t r = 0; r <= R; ++r) offs[r] = static_cast<int32_t>(size_t(r) * tokens);
  int32_t *d_offs;
  float *q, *est_out, *est_lse, *lse, *scratch;
  uint16_t *out;
  CHECK_CUDA(cudaMalloc(&d_offs, (R + 1) * 4));
  CHECK_CUDA(cudaMemcpy(d_offs, offs.data(), (R + 1) * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&q, size_t(R) * G * d * 4));
  CHECK_CUDA(cudaMalloc(&est_out, size_t(R) * G * d * 4));
  CHECK_CUDA(cudaMalloc(&est_lse, size_t(R) * G * 4));
  CHECK_CUDA(cudaMalloc(&lse, size_t(R) * G * 4));
  CHECK_CUDA(cudaMalloc(&out, size_t(R) * G * d * 2));
  fill_f32<<<64, 256>>>(q, size_t(R) * G * d, 7);
  fill_f32<<<64, 256>>>(est_out, size_t(R) * G * d, 8);
  fill_f32<<<64, 256>>>(est_lse, size_t(R) * G, 9);
  const size_t sf = attend_ragged_scratch_floats(R, G, d, tokens);
  CHECK_CUDA(cudaMalloc(&scratch, sf * 4));
  CHECK_CUDA(cudaDeviceSynchronize());
  const uint32_t H = R >= 8 ? 8 : R;
  const float scale = 1.f / std::sqrt(float(d));
  char name[96];
  std::snprintf(name, sizeof name, "attend f16 d=%u G=%u R=%u x %u tok", d, G, R, tokens);
  nvtxRangePushA(name);
  const double us = median_us(
      [&](int i) {
        const int c = i % copies;
        CHECK_STATUS(attend_ragged(DType::kF16, d_offs, k[c], v[c], q, R, H, G, d, scale, tokens, est_out, est_lse,
                                   out, int64_t(H) * G * d, d, lse, scratch, sf, nullptr));
      },
      20);
  nvtxRangePop();
  const double bytes = double(total) * row * 2 * 2;
  std::printf("%-44s %10.1f us %8.0f GB/s (K+V read)\n", name, us, bytes / us / 1e3);
  for (int c = 0; c < copies; ++c) {
    CHECK_CUDA(cudaFree(k[c]));
    CHECK_CUDA(cudaFree(v[c]));
  }
  for (void *p : {(void *)d_offs, (void *)q, (void *)est_out, (void *)est_lse, (void *)lse, (void *)scratch,
                  (void *)out})
    CHECK_CUDA(cudaFree(p));
}

// R runs of C clusters each, d = 128, engine zone rule (1.8% / 23.2%).
void bench_lookup(uint32_t R, uint32_t C, uint32_t G, uint32_t d, int copies) {
  const uint32_t n_ret = static_cast<uint32_t>(std::ceil(0.018 * C - 1e-9));
  const uint32_t n_est = static_cast<uint32_t>(std::floor(0.232 * C + 0.5));
  std::vector<float *> cent(copies);
  float *vs, *q, *est_out, *est_lse, *logits, *scores;
  uint32_t *size, *ret_ids, *ret_pos, *est_ids, *run_tokens;
  int32_t *offsets;
  for (int c = 0; c < copies; ++c) {
    CHECK_CUDA(cudaMalloc(&cent[c], size_t(R) * C * d * 4));
    fill_f32<<<1024, 256>>>(cent[c], size_t(R) * C * d, 100 + c);
  }
  CHECK_CUDA(cudaMalloc(&vs, size_t(R) * C * d * 4));
  fill_f32<<<1024, 256>>>(vs, size_t(R) * C * d, 11);
  std::vector<uint32_t> hsize(size_t(R) * C);
  std::mt19937 rng(1);
  for (auto &x : hsize) x = 1 + rng() % 40;
  CHECK_CUDA(cudaMalloc(&size, hsize.size() * 4));
  CHECK_CUDA(cudaMemcpy(size, hsize.data(), hsize.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&q, size_t(R) * G * d * 4));
  fill_f32<<<64, 256>>>(q, size_t(R) * G * d, 12);
  CHECK_CUDA(cudaMalloc(&est_out, size_t(R) * G * d * 4));
  CHECK_CUDA(cudaMalloc(&est_lse, size_t(R) * G * 4));
  CHECK_CUDA(cudaMalloc(&logits, size_t(R) * G * C * 4));
  CHECK_CUDA(cudaMalloc(&scores, size_t(R) * C * 4));
  CHECK_CUDA(cudaMalloc(&ret_ids, size_t(R) * n_ret * 4 + 4));
  CHECK_CUDA(cudaMalloc(&ret_pos, size_t(R) * n_ret * 4 + 4));
  CHECK_CUDA(cudaMalloc(&est_ids, size_t(R) * n_est * 4 + 4));
  CHECK_CUDA(cudaMalloc(&run_tokens, size_t(R) * 4));
  CHECK_CUDA(cudaMalloc(&offsets, size_t(R + 1) * 4));
  std::vector<std::vector<DevRun>> runs(copies, std::vector<DevRun>(R));
  std::vector<DevRun *> d_runs(copies);
  for (int c = 0; c < copies; ++c) {
    for (uint32_t r = 0; r < R; ++r) {
      DevRun &x = runs[c][r];
      x = DevRun{};
      x.centroid = cent[c] + size_t(r) * C * d;
      x.value_sum = vs + size_t(r) * C * d;
      x.size = size + size_t(r) * C;
      x.clusters = C;
      x.n_ret = n_ret;
      x.n_est = n_est;
      x.sink_tokens = 4;
      x.tail_tokens = 64;
      x.ret_off = r * n_ret;
      x.est_off = r * n_est;
      x.scratch_off = r * G * C;
    }
    CHECK_CUDA(cudaMalloc(&d_runs[c], R * sizeof(DevRun)));
    CHECK_CUDA(cudaMemcpy(d_runs[c], runs[c].data(), R * sizeof(DevRun), cudaMemcpyHostToDevice));
  }
  DevLookup out{ret_ids, ret_pos, est_ids, run_tokens, est_out, est_lse, offsets, logits};
  CHECK_CUDA(cudaDeviceSynchronize());
  const float scale = 1.f / std::sqrt(float(d));
  char name[96];
  std::snprintf(name, sizeof name, "lookup d=%u G=%u R=%u x %u clusters", d, G, R, C);
  nvtxRangePushA(name);
  const double us = median_us(
      [&](int i) {
        CHECK_STATUS(lookup_zones(d_runs[i % copies], R, G, d, scale, q, out, nullptr, C, nullptr));
      },
      20);
  nvtxRangePop();
  const double bytes = double(R) * C * d * 4 + double(R) * n_est * d * 4;
  std::printf("%-44s %10.1f us %8.0f GB/s (centroids + est VS)\n", name, us, bytes / us / 1e3);
  for (int c = 0; c < copies; ++c) {
    CHECK_CUDA(cudaFree(cent[c]));
    CHECK_CUDA(cudaFree(d_runs[c]));
  }
  for (void *p : {(void *)vs, (void *)q, (void *)est_out, (void *)est_lse, (void *)logits, (void *)scores,
                  (void *)size, (void *)ret_ids, (void *)ret_pos, (void *)est_ids, (void *)run_tokens,
                  (void *)offsets})
    CHECK_CUDA(cudaFree(p));
}

}  // namespace

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  cudaDeviceProp p{};
  CHECK_CUDA(cudaGetDeviceProperties(&p, 0));
  std::printf("%s, %d SMs, L2 %d MiB\n", p.name, p.multiProcessorCount, p.l2CacheSize >> 20);
  bench_copy();
  bench_read();
  bench_attend(8, 2500, 4, 128, 8);
  bench_attend(8, 2500, 8, 128, 8);
  bench_attend(32, 2500, 4, 128, 2);
  bench_attend(1, 131072, 4, 128, 2);
  bench_attend(1, 131072, 8, 128, 2);
  bench_attend(8, 32768, 4, 128, 1);
  bench_attend(8, 2500, 4, 64, 8);
  bench_attend(8, 2500, 4, 256, 8);
  bench_lookup(8, 8192, 4, 128, 2);
  bench_lookup(32, 8192, 4, 128, 1);
  bench_lookup(8, 2048, 4, 128, 8);
  return 0;
}
