// Shared by the CUDA kernels: error checks that return a Status (never
// abort), storage-type traits, and the dispatch of run-time head dims and
// dtypes to compile-time constants.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "lib/common/dtype.hpp"
#include "lib/common/status.hpp"

namespace wkv::kernels {

// Turns a CUDA error into a Status naming the statement, file and line.
inline Status cuda_status(cudaError_t err, const char *stmt, const char *file, int line) {
  if (err == cudaSuccess) return Status::ok();
  // Consumed here, so that a later launch check does not report it again
  // (the engine stays usable after, say, a failed allocation).
  (void)cudaGetLastError();
  int code = err == cudaErrorMemoryAllocation ? WKV_ERR_OUT_OF_MEMORY : WKV_ERR_DEVICE;
  return Status(code, format("CUDA error %s (%s) in %s at %s:%d", cudaGetErrorName(err),
                             cudaGetErrorString(err), stmt, file, line));
}

#define WKV_CUDA_CHECK(stmt)                                                        \
  do {                                                                              \
    cudaError_t wkv_err_ = (stmt);                                                  \
    if (wkv_err_ != cudaSuccess)                                                    \
      return ::wkv::kernels::cuda_status(wkv_err_, #stmt, __FILE__, __LINE__);      \
  } while (0)

// After a launch: the launch error, if any (does not synchronize).
#define WKV_CUDA_CHECK_LAUNCH(name) WKV_CUDA_CHECK(cudaGetLastError())

// Programmatic dependent launch: a kernel launched with launch_pdl() may
// start while the grid before it on the stream finishes, so it calls
// wait_prior_grid() before it touches memory; its launch then overlaps the
// tail of the one before.

// Waits until the grid this one depends on has completed and its writes are
// visible; a no-op without one (and before sm_90).
__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Launches kernel on s with programmatic dependent launch, as clusters of
// cluster_x CTAs when cluster_x > 1.
template <typename... Params, typename... Args>
Status launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                  uint32_t cluster_x, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  uint32_t n = 1;
  if (cluster_x > 1) {
    attr[1].id = cudaLaunchAttributeClusterDimension;
    attr[1].val.clusterDim.x = cluster_x;
    attr[1].val.clusterDim.y = 1;
    attr[1].val.clusterDim.z = 1;
    n = 2;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  WKV_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
  return Status::ok();
}

// Storage types on the device: float, __half, __nv_bfloat16.
template <typename T> struct DevType;
template <> struct DevType<float> {
  using type = float;
  static __device__ __forceinline__ float to_f(float x) { return x; }
  static __device__ __forceinline__ float from_f(float x) { return x; }
};
template <> struct DevType<f16> {
  using type = __half;
  static __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_f(float x) { return __float2half_rn(x); }
};
template <> struct DevType<bf16> {
  using type = __nv_bfloat16;
  static __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float x) { return __float2bfloat16_rn(x); }
};

// Calls body with constexpr HEAD_DIM set to d, or returns WKV_ERR_UNSUPPORTED.
#define WKV_DISPATCH_HEAD_DIM(d, HEAD_DIM, ...)                                      \
  [&]() -> ::wkv::Status {                                                           \
    switch (d) {                                                                     \
      case 64: { constexpr uint32_t HEAD_DIM = 64; return __VA_ARGS__(); }           \
      case 80: { constexpr uint32_t HEAD_DIM = 80; return __VA_ARGS__(); }           \
      case 96: { constexpr uint32_t HEAD_DIM = 96; return __VA_ARGS__(); }           \
      case 128: { constexpr uint32_t HEAD_DIM = 128; return __VA_ARGS__(); }         \
      case 256: { constexpr uint32_t HEAD_DIM = 256; return __VA_ARGS__(); }         \
      default:                                                                       \
        return WKV_ERROR(WKV_ERR_UNSUPPORTED, "head_dim %u has no CUDA kernel", (unsigned)(d)); \
    }                                                                                \
  }()

}  // namespace wkv::kernels
