#include "kernels/cuda_common.cuh"
#include "kernels/table_cuda.hpp"

namespace wkv::kernels {
namespace {

constexpr uint32_t kRunsPerLaunch = 27;  // DevRun is 144 bytes
constexpr uint32_t kWordsPerLaunch = 480;

struct RunChunk {
  DevRun runs[kRunsPerLaunch];
  uint32_t n;
};
static_assert(sizeof(RunChunk) <= 4000, "kernel parameters are limited to 4 KiB");

struct WordChunk {
  uint64_t addrs[kWordsPerLaunch];
  uint32_t n, value;
};
static_assert(sizeof(WordChunk) <= 4000, "kernel parameters are limited to 4 KiB");

__global__ void store_words_kernel(const WordChunk chunk) {
  for (uint32_t i = threadIdx.x; i < chunk.n; i += blockDim.x)
    *reinterpret_cast<volatile uint32_t *>(chunk.addrs[i]) = chunk.value;
}

__global__ void mark_kernel(unsigned long long *done, unsigned long long epoch) {
  __threadfence_system();
  *reinterpret_cast<volatile unsigned long long *>(done) = epoch;
}

__global__ void upload_runs_kernel(const RunChunk chunk, DevRun *dst) {
  // Word by word: DevRun is 8-byte aligned.
  const uint64_t *src = reinterpret_cast<const uint64_t *>(chunk.runs);
  uint64_t *out = reinterpret_cast<uint64_t *>(dst);
  const uint32_t words = chunk.n * (sizeof(DevRun) / 8);
  for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) out[i] = src[i];
}

template <typename T>
__global__ void convert_q_kernel(const typename DevType<T>::type *src, int64_t seq_stride,
                                 int64_t head_stride, uint32_t nq, uint32_t d, float *dst) {
  const uint32_t s = blockIdx.x / nq, h = blockIdx.x % nq;
  const typename DevType<T>::type *row = src + s * seq_stride + h * head_stride;
  float *out = dst + (static_cast<size_t>(s) * nq + h) * d;
  for (uint32_t i = threadIdx.x; i < d; i += blockDim.x) out[i] = DevType<T>::to_f(row[i]);
}

}  // namespace

static_assert(sizeof(DevRun) % 8 == 0, "DevRun is copied in 8-byte words");

cudaError_t upload_runs(const DevRun *host_runs, uint32_t n, DevRun *dst, void *stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  for (uint32_t done = 0; done < n; done += kRunsPerLaunch) {
    RunChunk c;
    c.n = n - done < kRunsPerLaunch ? n - done : kRunsPerLaunch;
    for (uint32_t i = 0; i < c.n; ++i) c.runs[i] = host_runs[done + i];
    upload_runs_kernel<<<1, 128, 0, s>>>(c, dst + done);
    WKV_CUDA_CHECK_LAUNCH("upload_runs");
  }
  return cudaSuccess;
}

cudaError_t mark_step_end(unsigned long long *done, unsigned long long epoch, void *stream) {
  if (!done) return cudaErrorInvalidValue;
  mark_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(done, epoch);
  WKV_CUDA_CHECK_LAUNCH("mark_kernel");
  return cudaSuccess;
}

cudaError_t store_words(const uint64_t *addrs, uint32_t n, uint32_t value, void *stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  for (uint32_t done = 0; done < n; done += kWordsPerLaunch) {
    WordChunk c;
    c.n = n - done < kWordsPerLaunch ? n - done : kWordsPerLaunch;
    c.value = value;
    for (uint32_t i = 0; i < c.n; ++i) c.addrs[i] = addrs[done + i];
    store_words_kernel<<<1, 256, 0, s>>>(c);
    WKV_CUDA_CHECK_LAUNCH("store_words");
  }
  return cudaSuccess;
}

cudaError_t convert_q(DType t, const void *src, int64_t seq_stride, int64_t head_stride, uint32_t n_seqs,
                 uint32_t n_q_heads, uint32_t d, float *dst, void *stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const uint32_t blocks = n_seqs * n_q_heads;
  return WKV_DISPATCH_DTYPE(t, T, cudaErrorNotSupported, [&]() -> cudaError_t {
    convert_q_kernel<T><<<blocks, 128, 0, s>>>(static_cast<const typename DevType<T>::type *>(src), seq_stride,
                                                head_stride, n_q_heads, d, dst);
    WKV_CUDA_CHECK_LAUNCH("convert_q");
    return cudaSuccess;
  });
}

}  // namespace wkv::kernels
