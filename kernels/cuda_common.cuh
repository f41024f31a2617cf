// Shared by the CUDA kernels: error checks that return the cudaError_t
// (never abort), storage-type traits, and the dispatch of run-time head dims
// and dtypes to compile-time constants. Kernels include nothing of the
// engine: they return a cudaError_t (cudaErrorInvalidValue for arguments they
// refuse, cudaErrorNotSupported for a head_dim or dtype they have no
// instantiation for), and the engine turns it into its own status.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kernels/device_layout.hpp"
#include "kernels/dtype.hpp"

namespace wkv::kernels {

// Returns the error of a CUDA call, if any.
#define WKV_CUDA_CHECK(stmt)                   \
  do {                                         \
    const cudaError_t wkv_err_ = (stmt);       \
    if (wkv_err_ != cudaSuccess) return wkv_err_; \
  } while (0)

// The same for a call of ours that returns a cudaError_t.
#define WKV_CUDA_TRY(expr) WKV_CUDA_CHECK(expr)

// After a launch: the launch error, if any (does not synchronize). Taken
// with cudaGetLastError, so that it is not reported again by a later check.
#define WKV_CUDA_CHECK_LAUNCH(name) WKV_CUDA_CHECK(cudaGetLastError())

// Sets fn's attribute `attr` to `value` once per device: an attribute
// belongs to the current device's context. `done` holds a bit per device
// (ids past 63 set it at every call).
inline cudaError_t set_func_attribute_once(const void *fn, cudaFuncAttribute attr, int value,
                                           std::atomic<uint64_t> *done) {
  int dev = 0;
  WKV_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = dev >= 0 && dev < 64 ? uint64_t(1) << dev : 0;
  if (bit && (done->load(std::memory_order_relaxed) & bit)) return cudaSuccess;
  WKV_CUDA_CHECK(cudaFuncSetAttribute(fn, attr, value));
  done->fetch_or(bit, std::memory_order_relaxed);
  return cudaSuccess;
}

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

// The epoch a StepMark reports: its own, or the step's (StepVars).
__device__ __forceinline__ unsigned long long mark_epoch(const StepMark &m) {
  return m.epoch_at ? *reinterpret_cast<const volatile unsigned long long *>(m.epoch_at) : m.epoch;
}

// Reports the end of a step (StepMark, kernels/device_layout.hpp). Every
// thread of every CTA calls it as its kernel's last statement: each CTA
// fences its writes (mapped host memory included) and counts itself; the
// last one writes the epoch, so that the host sees it only after every
// write of the kernel, and of the kernels it waited for.
__device__ __forceinline__ void signal_step_end(const StepMark &m) {
  if (m.done == nullptr) return;
  __syncthreads();
  if (threadIdx.x != 0 || threadIdx.y != 0 || threadIdx.z != 0) return;
  __threadfence_system();
  const unsigned total = gridDim.x * gridDim.y * gridDim.z;
  if (total > 1) {
    if (atomicAdd(m.ctas, 1u) != total - 1) return;
    *m.ctas = 0;  // for the next launch, which stream order puts after this one
    __threadfence_system();
  }
  // Epoch 0 is no step's: a captured step that no prepare wrote
  // (bound_stage_kernel) reports no end.
  const unsigned long long epoch = mark_epoch(m);
  if (epoch != 0) *reinterpret_cast<volatile unsigned long long *>(m.done) = epoch;
}

// Launches kernel on s with programmatic dependent launch, as clusters of
// cluster_x CTAs when cluster_x > 1.
template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
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
  return cudaLaunchKernelEx(&cfg, kernel, args...);
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

// T's quiet NaN, the bits the CPU writes for a row of NaN scale
// (kernels/dtype.hpp), whatever the payloads.
template <typename T>
__device__ __forceinline__ typename DevType<T>::type quiet_nan() {
  if constexpr (std::is_same_v<T, float>)
    return __uint_as_float(kInt8NanScale);
  else if constexpr (std::is_same_v<T, f16>)
    return __ushort_as_half(0x7e00);
  else
    return __ushort_as_bfloat16(0x7fc0);
}
// An 8-bit value q of a row with scale `scale` in the storage type T:
// dequantize_row's arithmetic (q x scale rounded to T); a NaN scale gives
// T's quiet NaN.
template <typename T>
__device__ __forceinline__ typename DevType<T>::type dequantized(int8_t q, float scale) {
  if (scale != scale) return quiet_nan<T>();
  return DevType<T>::from_f(__fmul_rn(static_cast<float>(q), scale));
}
// Centered K rows' reference rule (centered_reference, kernels/dtype.cpp):
// a centroid is a reference only where every component fits f16 (finite
// and within its range; false for NaN), and each component is then used
// rounded to f16.
__device__ __forceinline__ bool fits_f16(float c) { return fabsf(c) <= 65504.0f; }
__device__ __forceinline__ float f16_rounded(float c) { return __half2float(__float2half_rn(c)); }
// ... of a centered K row against its reference value ref:
// dequantize_row_centered's arithmetic (one fused multiply-add, then T).
template <typename T>
__device__ __forceinline__ typename DevType<T>::type dequantized_centered(int8_t q, float scale, float ref) {
  if (scale != scale) return quiet_nan<T>();
  return DevType<T>::from_f(__fmaf_rn(static_cast<float>(q), scale, ref));
}

// The four int8 components of w, exactly, as f32 (f[0..3]): each byte
// biased to unsigned is placed under the exponent of 2^23 (one byte
// permute) and the bias taken off (one exact add), which the FP32 pipes do
// at full rate where an int-to-float conversion runs at a fraction of it.
__device__ __forceinline__ void int8x4_to_float(uint32_t w, float *f) {
  const uint32_t u = w ^ 0x80808080u;  // x + 128 in each byte
#pragma unroll
  for (uint32_t e = 0; e < 4; ++e)
    f[e] = __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7650u | e)) - 8388736.0f;  // 2^23 + 128
}

// quantize_row's arithmetic (kernels/dtype.hpp) for a row that one warp
// holds, each step one IEEE operation correctly rounded, so the CPU's
// bytes: every lane takes its values into its Int8Row (take), the warp
// agrees on the row's scale (scale_warp: every lane calls it), then each
// value's level (level).
struct Int8Row {
  float amax = 0.0f;
  bool finite = true;
  __device__ __forceinline__ void take(float v) {
    const float a = fabsf(v);
    finite &= a <= 3.402823466e38f;  // false for NaN and inf
    amax = a > amax ? a : amax;
  }
  // The row's scale: 0 for a row under the floor, NaN for a row that is
  // not finite (finite then false in every lane), else amax / 127.
  __device__ __forceinline__ float scale_warp() {
    // Non-negative floats order as their bits.
    amax = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(amax)));
    finite = __all_sync(0xffffffffu, finite);
    if (!finite) return __uint_as_float(kInt8NanScale);
    return amax < kInt8RowFloor ? 0.0f : __fdiv_rn(amax, 127.0f);
  }
  // v's level in a row of that scale (rintf: nearest even); a row of scale
  // 0 or NaN holds zeros.
  static __device__ __forceinline__ int32_t level(float v, float scale) {
    const float r = scale > 0.0f ? rintf(__fdiv_rn(v, scale)) : 0.0f;
    return static_cast<int32_t>(fminf(fmaxf(r, -127.0f), 127.0f));
  }
};

// The head whose full dot product lane j holds after reduce_heads: the
// bit reversal of j's low log2(HC) bits.
template <uint32_t HC>
__device__ __forceinline__ uint32_t head_of_lane(uint32_t j) {
  uint32_t h = 0;
#pragma unroll
  for (uint32_t b = 1, w = HC / 2; b < HC; b <<= 1, w >>= 1)
    if (j & b) h += w;
  return h;
}

// Sums v[h] over kLanes aligned lanes (a power of two, at least HC) for every
// head h with a transposing butterfly: each halving step keeps half of the
// heads (chosen by one lane bit) and adds the partner's copy of that half,
// so after log2(HC) steps one value is left, which the remaining butterfly
// steps complete (HC - 1 + log2(kLanes / HC) shuffles for all heads, not
// HC log2 kLanes). Returns the sum for head_of_lane(lane).
template <uint32_t HC, uint32_t kLanes>
__device__ __forceinline__ float reduce_heads(float (&v)[HC], uint32_t lane) {
#pragma unroll
  for (uint32_t n = HC, m = 1; n > 1; n >>= 1, m <<= 1) {
    const bool upper = lane & m;
#pragma unroll
    for (uint32_t i = 0; i < n / 2; ++i) {
      const float send = upper ? v[i] : v[i + n / 2];
      const float keep = upper ? v[i + n / 2] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, m);
    }
  }
  float x = v[0];
#pragma unroll
  for (uint32_t m = HC; m < kLanes; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// Asynchronous copies into shared memory (sm_80 and later): 16 bytes from
// src where ok, else 16 zero bytes (src is not read, but must be a valid
// address); a group of this thread's copies committed; the wait until at
// most N of its groups are in flight. The "memory" clobbers keep the
// compiler from moving shared-memory accesses across them.
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool ok) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Calls body with constexpr HEAD_DIM set to d, or returns cudaErrorNotSupported.
#define WKV_DISPATCH_HEAD_DIM(d, HEAD_DIM, ...)                                      \
  [&]() -> cudaError_t {                                                             \
    switch (d) {                                                                     \
      case 64: { constexpr uint32_t HEAD_DIM = 64; return __VA_ARGS__(); }           \
      case 80: { constexpr uint32_t HEAD_DIM = 80; return __VA_ARGS__(); }           \
      case 96: { constexpr uint32_t HEAD_DIM = 96; return __VA_ARGS__(); }           \
      case 128: { constexpr uint32_t HEAD_DIM = 128; return __VA_ARGS__(); }         \
      case 256: { constexpr uint32_t HEAD_DIM = 256; return __VA_ARGS__(); }         \
      default:                                                                       \
        return cudaErrorNotSupported;                                                \
    }                                                                                \
  }()

}  // namespace wkv::kernels
