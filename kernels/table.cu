#include "kernels/cuda_common.cuh"
#include "kernels/table_cuda.hpp"

namespace wkv::kernels {
namespace {

constexpr uint32_t kRunsPerLaunch = 32;
constexpr uint32_t kStoresPerLaunch = 240;

struct RunChunk {
  DevRun runs[kRunsPerLaunch];
  uint32_t n;
};
static_assert(sizeof(RunChunk) <= 4000, "kernel parameters are limited to 4 KiB");

struct StoreChunk {
  PtrStore stores[kStoresPerLaunch];
  uint32_t n;
};
static_assert(sizeof(StoreChunk) <= 4000, "kernel parameters are limited to 4 KiB");

struct CopyChunk {
  PageCopy copies[kStoresPerLaunch];
  uint32_t n;
};
static_assert(sizeof(CopyChunk) <= 4000, "kernel parameters are limited to 4 KiB");

// CTA i copies page i of the chunk, 16 bytes a thread per pass.
__global__ void copy_pages_kernel(const CopyChunk chunk, uint32_t vecs) {
  const PageCopy c = chunk.copies[blockIdx.x];
  const uint4 *src = reinterpret_cast<const uint4 *>(c.src);
  uint4 *dst = reinterpret_cast<uint4 *>(c.dst);
  for (uint32_t i = threadIdx.x; i < vecs; i += blockDim.x) dst[i] = src[i];
}

__global__ void upload_runs_kernel(const RunChunk chunk, DevRun *dst) {
  // Word by word: DevRun is 8-byte aligned.
  const uint64_t *src = reinterpret_cast<const uint64_t *>(chunk.runs);
  uint64_t *out = reinterpret_cast<uint64_t *>(dst);
  const uint32_t words = chunk.n * (sizeof(DevRun) / 8);
  for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) out[i] = src[i];
}

__global__ void ptr_store_kernel(const StoreChunk chunk) {
  for (uint32_t i = threadIdx.x; i < chunk.n; i += blockDim.x) {
    // A single aligned 8-byte store: readers see the old or the new value.
    *reinterpret_cast<const uint8_t *volatile *>(chunk.stores[i].addr) = chunk.stores[i].value;
  }
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

Status upload_runs(const DevRun *host_runs, uint32_t n, DevRun *dst, void *stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  for (uint32_t done = 0; done < n; done += kRunsPerLaunch) {
    RunChunk c;
    c.n = n - done < kRunsPerLaunch ? n - done : kRunsPerLaunch;
    for (uint32_t i = 0; i < c.n; ++i) c.runs[i] = host_runs[done + i];
    upload_runs_kernel<<<1, 128, 0, s>>>(c, dst + done);
    WKV_CUDA_CHECK_LAUNCH("upload_runs");
  }
  return Status::ok();
}

Status copy_pages(const PageCopy *copies, uint32_t n, uint32_t bytes, void *stream) {
  if (n == 0) return Status::ok();
  if (copies == nullptr || bytes == 0 || bytes % 16 != 0)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "copy_pages: %u-byte pages are not whole 16-byte vectors", bytes);
  for (uint32_t i = 0; i < n; ++i)
    if ((reinterpret_cast<uintptr_t>(copies[i].src) | reinterpret_cast<uintptr_t>(copies[i].dst)) % 16 != 0)
      return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "copy_pages: copy %u is not 16-byte aligned", i);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  for (uint32_t done = 0; done < n; done += kStoresPerLaunch) {
    CopyChunk c;
    c.n = n - done < kStoresPerLaunch ? n - done : kStoresPerLaunch;
    for (uint32_t i = 0; i < c.n; ++i) c.copies[i] = copies[done + i];
    copy_pages_kernel<<<c.n, 256, 0, s>>>(c, bytes / 16);
    WKV_CUDA_CHECK_LAUNCH("copy_pages");
  }
  return Status::ok();
}

Status apply_ptr_stores(const PtrStore *stores, uint32_t n, void *stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  for (uint32_t done = 0; done < n; done += kStoresPerLaunch) {
    StoreChunk c;
    c.n = n - done < kStoresPerLaunch ? n - done : kStoresPerLaunch;
    for (uint32_t i = 0; i < c.n; ++i) c.stores[i] = stores[done + i];
    ptr_store_kernel<<<1, 256, 0, s>>>(c);
    WKV_CUDA_CHECK_LAUNCH("apply_ptr_stores");
  }
  return Status::ok();
}

Status convert_q(DType t, const void *src, int64_t seq_stride, int64_t head_stride, uint32_t n_seqs,
                 uint32_t n_q_heads, uint32_t d, float *dst, void *stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const uint32_t blocks = n_seqs * n_q_heads;
  return WKV_DISPATCH_DTYPE(t, T, [&]() -> Status {
    convert_q_kernel<T><<<blocks, 128, 0, s>>>(static_cast<const typename DevType<T>::type *>(src), seq_stride,
                                                head_stride, n_q_heads, d, dst);
    WKV_CUDA_CHECK_LAUNCH("convert_q");
    return Status::ok();
  });
}

}  // namespace wkv::kernels
