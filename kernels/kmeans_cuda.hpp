// Segmented spherical k-means on the device, and the write of clustered
// segments into pages. Plain C++ (only the CUDA runtime's type declarations): the CUDA backend's host
// code includes it with any C++ compiler.
//
// The device k-means is kmeans_segment (kernels/cpu_kernels.hpp) batched:
// one call clusters S segments (every KV head and segment of a layer) with
// the same algorithm, and the same output contract per segment. It is
// deterministic for a given input and seed on one GPU model, but does not
// pick the same initial points as the CPU version, so the clusters differ.
#pragma once

#include <cstddef>
#include <cstdint>

#include <driver_types.h>  // cudaError_t, cudaStream_t

#include "kernels/dtype.hpp"
#include "kernels/kmeans_types.hpp"

namespace wkv::kernels {

// How the assignment step computes its [T x d] x [d x k] product.
enum class KMeansAssign : uint32_t {
  // One tensor-core kernel computes the dot products and keeps the argmax
  // in registers: the [T][k] scores never reach memory. Default.
  kFused = 0,
  // cublasGemmStridedBatchedEx (f16 inputs, f32 accumulation) into an f32
  // score buffer, then an argmax kernel. Segments are padded to the batch's
  // largest T and k and run in chunks whose scores fit score_bytes.
  kCublas = 1,
};

// How each round orders the points by cluster (the same result either way).
enum class KMeansOrder : uint32_t {
  // A counting sort per segment in shared memory where its [32][k] table
  // fits (k up to ~1500), else kRadix. Default.
  kAuto = 0,
  // A radix sort of the whole batch's (segment, cluster) keys and a scan.
  kRadix = 1,
};

// Parameters shared by every segment of a batch.
struct KMeansBatchParams {
  DType dtype = DType::kF16;     // storage type of keys and values
  uint32_t head_dim = 0;         // d: 64, 80, 96, 128 or 256
  uint32_t iters = 10;           // assignment rounds (0 behaves as 1)
  KMeansAssign assign = KMeansAssign::kFused;
  KMeansOrder order = KMeansOrder::kAuto;
  size_t score_bytes = 64u << 20;  // kCublas only: score buffer bound (64 MiB)
};

// Bytes of device workspace that kmeans_batch_cuda needs for any batch within
// `shape` under `p`. Allocate once (cudaMalloc: 256-byte aligned) and reuse;
// cudaErrorInvalidValue for an unsupported shape or head_dim.
cudaError_t kmeans_batch_workspace_size(const KMeansBatchParams &p,
                                   const KMeansBatchShape &shape, size_t *bytes);

// Creates and destroys the cuBLAS handle that kmeans_batch_cuda takes
// (cublasHandle_t as void*). One handle per stream that runs k-means at a
// time; destroying nullptr is a no-op. libcublas is opened (dlopen) by the
// first create, not linked: cudaErrorSharedObjectInitFailed where it is
// not installed.
cudaError_t kmeans_cublas_create(void **handle);
void kmeans_cublas_destroy(void *handle);

// Clusters n segments (host descriptors `segs`, device data) into `out`,
// all enqueued on `stream`; returns without waiting. Host memory is read
// only during the call (no host copy is enqueued, so the call may be
// captured in a CUDA graph). `workspace` holds at least
// kmeans_batch_workspace_size(p, kmeans_batch_shape(segs, n)) bytes, is
// 256-byte aligned, and is not used by other work until the stream reaches
// this point. `cublas` (from kmeans_cublas_create) is needed only for
// KMeansAssign::kCublas and may be null otherwise; the call binds it to
// `stream`.
//
// Errors: cudaErrorInvalidValue (T = 0 or above kKMeansMaxTokens,
// workspace too small, a null pointer), cudaErrorNotSupported (head_dim),
// a CUDA error (a CUDA or cuBLAS failure at launch).
cudaError_t kmeans_batch_cuda(const KMeansBatchParams &p,
                         const KMeansSegmentDesc *segs, uint32_t n,
                         const KMeansBatchOut &out, void *workspace,
                         size_t workspace_bytes, void *cublas,
                         cudaStream_t stream);

// Page writes ------------------------------------------------------------

// One segment of one head to write into its pages, in cluster order: token
// slot j gets row order[j] of the segment. Slot j lives in page
// pages[j / page_tokens] at row j % page_tokens: its K row at
// page + row * row_bytes, its V row at page + (page_tokens + row) * row_bytes.
// Every pointer is device-accessible (pages are usually pinned, mapped host
// memory: the kernel writes over PCIe) and 16-byte aligned.
struct WritePagesJob {
  const uint32_t *order = nullptr;  // [tokens] segment-local row indices
  const uint8_t *k = nullptr;       // [tokens][row_bytes] the segment's K rows
  const uint8_t *v = nullptr;       // [tokens][row_bytes] its V rows
  uint8_t *const *pages = nullptr;  // [ceil(tokens / page_tokens)] page addresses
  uint32_t tokens = 0;
  // Centered keys (Int8PageLayout::centered): the segment's clusters,
  // cluster c's slots from begin[c] on (device, [clusters + 1]), its
  // centroid at centroid[c * head_dim] (device, f32).
  uint32_t clusters = 0;
  const uint32_t *begin = nullptr;
  const float *centroid = nullptr;
};

// Writes one segment (`job` in host memory, its pointers device-accessible).
// row_bytes is a multiple of 16. cudaErrorInvalidValue otherwise.
cudaError_t write_pages_cuda(const WritePagesJob &job, uint32_t row_bytes,
                        uint32_t page_tokens, cudaStream_t stream);

// What write_pages_many_cuda refuses (cudaErrorInvalidValue): rows that
// are not whole 16-byte words, no page tokens, a job with tokens and a null
// pointer. Launches nothing.
cudaError_t check_page_jobs(const WritePagesJob *jobs, uint32_t n, uint32_t row_bytes, uint32_t page_tokens);

// Writes n jobs (`jobs` in host memory, reusable at once) in launches of
// up to 96 jobs passed by value; every job is checked before the first
// launch, so a refusal enqueues nothing.
cudaError_t write_pages_many_cuda(const WritePagesJob *jobs, uint32_t n, uint32_t row_bytes,
                                  uint32_t page_tokens, cudaStream_t stream);

// Writes n jobs in one launch; `jobs` is a device array, max_tokens bounds
// every job's tokens (it sizes the grid).
cudaError_t write_pages_batch_cuda(const WritePagesJob *jobs, uint32_t n,
                              uint32_t max_tokens, uint32_t row_bytes,
                              uint32_t page_tokens, cudaStream_t stream);

// 8-bit pages (WKV_PAGE_FORMAT_INT8): a page holds K rows then V rows of
// head_dim bytes, then page_tokens K scales and page_tokens V scales (f32)
// from byte scales_at. The source rows are in `dtype`.
struct Int8PageLayout {
  DType dtype = DType::kF16;
  uint32_t head_dim = 0;
  uint32_t page_tokens = 0;
  uint32_t scales_at = 0;  // 2 * page_tokens * head_dim
  // WKV_PAGE_FORMAT_INT8_CENTERED: each K row less its cluster's reference
  // (centered_reference, kernels/dtype.hpp), as the CPU writes it.
  bool centered = false;
};

// write_pages_many_cuda with each row quantized as quantize_row does
// (kernels/dtype.hpp), bit for bit: a warp a row. cudaErrorInvalidValue
// for what check_page_jobs refuses or a layout that is not 8-bit pages'.
cudaError_t write_pages_int8_many_cuda(const WritePagesJob *jobs, uint32_t n, const Int8PageLayout &layout,
                                       cudaStream_t stream);

}  // namespace wkv::kernels
