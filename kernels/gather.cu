// Execution-buffer assembly (see gather_cuda.hpp for the layout).
//
// Grid: x = run, y = chunks of that run's retrieval clusters. Every thread
// of a run's CTAs shares the steady-zone copy; then each warp copies whole
// clusters, one at a time: its lanes move 16-byte pieces of consecutive
// member rows, kUnroll pieces of K and kUnroll of V per lane loaded before
// any is stored, so that a warp keeps 4 KiB of page reads in flight. Reads
// of mapped host pages cross PCIe with a latency of a microsecond or more;
// thousands of warps each with several loads outstanding are what fills
// the link. Members are consecutive token slots, so a warp's loads fall in
// one or two pages at a time and coalesce into whole rows.
//
// Hit and miss counts are per page touched, kept per lane and summed per
// warp: two atomics per warp, not per page.
#include "kernels/gather_cuda.hpp"

#include <algorithm>

#include "kernels/cuda_common.cuh"

namespace wkv::kernels {
namespace {

constexpr int kWarps = 8;   // warps per CTA
constexpr int kUnroll = 4;  // 16-byte pieces of K (and of V) in flight per lane

__device__ __forceinline__ int4 load_page(const uint8_t *p) {
  return __ldcs(reinterpret_cast<const int4 *>(p));  // streamed: read once
}

__global__ void __launch_bounds__(kWarps * 32) gather_kernel(const GatherArgs a) {
  const uint32_t r = blockIdx.x;
  const DevRun &run = a.runs[r];
  const uint32_t rb = a.row_bytes, cpr = rb / 16, pt = a.page_tokens;
  const uint32_t base = static_cast<uint32_t>(a.lookup.offsets[r]);
  const uint32_t sink = run.sink_tokens, tail = run.tail_tokens;

  // Steady zone: sink rows then tail rows, device to device.
  const uint32_t steady = (sink + tail) * cpr;
  for (uint32_t q = blockIdx.y * blockDim.x + threadIdx.x; q < steady; q += gridDim.y * blockDim.x) {
    const uint32_t t = q / cpr, c = q - t * cpr;
    const uint8_t *sk, *sv;
    if (t < sink) {
      sk = run.sink_k + size_t(t) * rb;
      sv = run.sink_v + size_t(t) * rb;
    } else {
      sk = run.tail_k + size_t(t - sink) * rb;
      sv = run.tail_v + size_t(t - sink) * rb;
    }
    const int4 kv = __ldg(reinterpret_cast<const int4 *>(sk) + c);
    const int4 vv = __ldg(reinterpret_cast<const int4 *>(sv) + c);
    reinterpret_cast<int4 *>(a.xk + size_t(base + t) * rb)[c] = kv;
    reinterpret_cast<int4 *>(a.xv + size_t(base + t) * rb)[c] = vv;
  }

  // Retrieval clusters, one warp each.
  const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t n_ret = run.n_ret, ret_off = run.ret_off;
  const uint32_t rbase = base + sink + tail;
  const uintptr_t cache_lo = reinterpret_cast<uintptr_t>(a.cache_base);
  const uint8_t *const *pages = run.pages;
  const uint32_t *first_slot = run.first_slot, *size = run.size;
  uint32_t hits = 0, misses = 0;
  for (uint32_t i = blockIdx.y * kWarps + warp; i < n_ret; i += gridDim.y * kWarps) {
    const uint32_t id = a.lookup.ret_ids[ret_off + i];
    const uint32_t first = first_slot[id], n = size[id];
    const uint32_t dst_row = rbase + a.lookup.ret_pos[ret_off + i];
    if (n == 0) continue;
    for (uint32_t p = first / pt + lane; p <= (first + n - 1) / pt; p += 32) {
      const uintptr_t addr = reinterpret_cast<uintptr_t>(pages[p]);
      if (addr - cache_lo < a.cache_bytes)
        ++hits;
      else
        ++misses;
    }
    const uint32_t total = n * cpr;
    for (uint32_t q0 = 0; q0 < total; q0 += 32 * kUnroll) {
      int4 kv[kUnroll], vv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint32_t q = q0 + u * 32 + lane;
        if (q < total) {
          const uint32_t m = q / cpr, c = q - m * cpr;
          const uint32_t slot = first + m;
          const uint8_t *page = pages[slot / pt];
          const uint32_t row = slot % pt;
          kv[u] = load_page(page + size_t(row) * rb + size_t(c) * 16);
          vv[u] = load_page(page + size_t(pt + row) * rb + size_t(c) * 16);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint32_t q = q0 + u * 32 + lane;
        if (q < total) {
          const uint32_t m = q / cpr, c = q - m * cpr;
          reinterpret_cast<int4 *>(a.xk + size_t(dst_row + m) * rb)[c] = kv[u];
          reinterpret_cast<int4 *>(a.xv + size_t(dst_row + m) * rb)[c] = vv[u];
        }
      }
    }
  }
  if (a.counters) {
    hits = __reduce_add_sync(0xffffffffu, hits);
    misses = __reduce_add_sync(0xffffffffu, misses);
    if (lane == 0) {
      if (hits) atomicAdd(&a.counters[0], static_cast<unsigned long long>(hits));
      if (misses) atomicAdd(&a.counters[1], static_cast<unsigned long long>(misses));
    }
  }
}

}  // namespace

Status gather_cuda(const GatherArgs &a, cudaStream_t stream) {
  if (a.n_runs == 0) return Status::ok();
  if (!a.runs || !a.xk || !a.xv || !a.lookup.offsets || !a.lookup.ret_ids || !a.lookup.ret_pos)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "gather: a null pointer");
  if (a.row_bytes == 0 || a.row_bytes % 16 != 0)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "gather: row_bytes %u is not a positive multiple of 16",
                     a.row_bytes);
  if (a.page_tokens == 0) return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "gather: page_tokens is 0");
  if (reinterpret_cast<uintptr_t>(a.xk) % 16 != 0 || reinterpret_cast<uintptr_t>(a.xv) % 16 != 0)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "gather: execution buffer not 16-byte aligned");
  if (a.n_runs > 0x7fffffffu) return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "gather: %u runs", a.n_runs);
  const uint32_t chunks = std::max<uint32_t>(1, std::min<uint32_t>((a.max_ret + kWarps - 1) / kWarps, 65535));
  gather_kernel<<<dim3(a.n_runs, chunks), kWarps * 32, 0, stream>>>(a);
  WKV_CUDA_CHECK_LAUNCH("gather_kernel");
  return Status::ok();
}

}  // namespace wkv::kernels
