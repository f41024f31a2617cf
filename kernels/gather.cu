// Execution-buffer assembly (see gather_cuda.hpp for the layout).
//
// Grid: x = run, y = chunks of that run's retrieval clusters. Every thread
// of a run's CTAs shares the steady-zone copy; then each warp copies whole
// clusters, one at a time, unit by unit (page_tokens members): its lanes
// move 16-byte pieces of the unit's rows, kUnroll pieces of K and kUnroll
// of V per lane loaded before any is stored, so that a warp keeps a unit
// (4 KiB at d = 128, 16-bit) of reads in flight. Reads of mapped host pages
// cross PCIe with a latency of a microsecond or more; thousands of warps
// each with several loads outstanding are what fills the link. A unit's
// members are consecutive token slots, so its loads fall in one or two
// pages and coalesce into whole rows.
//
// Hit and miss counts are per unit, kept per lane and summed per warp: two
// atomics per warp, not per unit.
//
// For a decode that attends from frames (GatherArgs::row_src) the same
// walk lays out no row: it writes where each row lives (16 bytes a row)
// and reads only the misses that take a frame, into the frame; hits are
// not read at all, and a miss left without a frame is read by the
// attention from its host pages.
#include "kernels/gather_cuda.hpp"

#include <algorithm>
#include <type_traits>

#include "kernels/cuda_common.cuh"
#include "kernels/table_cuda.hpp"

namespace wkv::kernels {
namespace {

constexpr int kWarps = 8;   // warps per CTA
constexpr int kUnroll = 4;  // 16-byte pieces of K (and of V) in flight per lane
// The gather's CTAs a multiprocessor that ptxas must make room for
// (__launch_bounds__' second argument, which caps the registers); unset,
// none: ptxas chooses (128 registers). Set at configure
// (CUDAFLAGS=-DWKV_GATHER_MIN_CTAS=3) for an A/B (docs/gpu-serving.md, "The
// estimate beside the gather, priced").
#ifdef WKV_GATHER_MIN_CTAS
#define WKV_GATHER_BOUNDS __launch_bounds__(kWarps * 32, WKV_GATHER_MIN_CTAS)
#else
#define WKV_GATHER_BOUNDS __launch_bounds__(kWarps * 32)
#endif

// Takes a frame from the pool (FramePool, device_layout.hpp), or returns
// kNoCacheFrame when it is empty.
__device__ uint32_t take_frame(const FramePool &p) {
  const long long before = static_cast<long long>(atomicAdd(p.avail, ~0ull));  // minus one
  if (before <= 0) {
    atomicAdd(p.avail, 1ull);  // none was published: give the reservation back
    return kNoCacheFrame;
  }
  const unsigned long long t = atomicAdd(p.taken, 1ull);
  return __ldcg(p.slots + t % p.cap);  // L2: another CTA's L1 may hold the line from before the copy
}

__device__ __forceinline__ int4 load_row_piece(const uint8_t *p) {
  return __ldcs(reinterpret_cast<const int4 *>(p));  // streamed: read once
}

// Where a unit's rows are read: K and V of rows [0, split) from k0 / v0 and
// of rows [split, rows) from k1 / v1, each contiguous with row stride prb
// (the rows of pages and frames); with 8-bit pages their scales from ks0 /
// vs0 and ks1 / vs1, a float a row. A frame is one part; a unit in host
// pages is one part, or two where it crosses into the next page. Found
// once per unit, so that a row's address costs no division.
struct UnitSource {
  const uint8_t *k0, *v0, *k1, *v1;
  const float *ks0, *vs0, *ks1, *vs1;
  uint32_t split;
};

__device__ __forceinline__ UnitSource unit_source(const uint8_t *frame, const uint8_t *const *pages, uint32_t slot,
                                                  uint32_t rows, uint32_t pt, uint32_t prb, uint32_t scales_at) {
  UnitSource s;
  s.k1 = s.v1 = nullptr;
  s.ks1 = s.vs1 = nullptr;
  const uint8_t *page = frame;
  uint32_t off = 0;
  if (frame) {
    s.split = rows;
  } else {
    const uint32_t p = slot / pt;
    off = slot - p * pt;
    page = pages[p];
    s.split = min(rows, pt - off);
    if (s.split < rows) {
      const uint8_t *next = pages[p + 1];
      s.k1 = next;
      s.v1 = next + size_t(pt) * prb;
      s.ks1 = reinterpret_cast<const float *>(next + scales_at);
      s.vs1 = s.ks1 + pt;
    }
  }
  s.k0 = page + size_t(off) * prb;
  s.v0 = page + size_t(pt + off) * prb;
  s.ks0 = reinterpret_cast<const float *>(page + scales_at) + off;
  s.vs0 = s.ks0 + pt;
  return s;
}

// Where rows [0, rows) of a unit live, into row_src[row0 ..] (a decode that
// attends from frames): lane by lane, one 16-byte store a row.
template <bool kInt8>
__device__ __forceinline__ void put_row_sources(RowSource *row_src, size_t row0, const UnitSource &s, uint32_t rows,
                                                uint32_t prb, uint32_t lane) {
  for (uint32_t m = lane; m < rows; m += 32) {
    const bool first_part = m < s.split;
    const uint32_t mr = first_part ? m : m - s.split;
    RowSource o;
    o.k = reinterpret_cast<uint64_t>((first_part ? s.k0 : s.k1) + size_t(mr) * prb);
    if constexpr (kInt8)
      o.x = reinterpret_cast<uint64_t>((first_part ? s.ks0 : s.ks1) + mr) | kRowInt8;
    else
      o.x = reinterpret_cast<uint64_t>((first_part ? s.v0 : s.v1) + size_t(mr) * prb);
    row_src[row0 + m] = o;
  }
}

// Sixteen 8-bit values of `piece` times `scale`, rounded to T, at dst (16
// elements of T): dequantize_row's arithmetic (dequantized).
template <typename T>
__device__ __forceinline__ void put_dequantized(uint8_t *dst, const int4 piece, const float scale) {
  using DT = typename DevType<T>::type;
  constexpr uint32_t kBytes = 16 * sizeof(DT);
  alignas(16) DT out[16];
  const int8_t *q = reinterpret_cast<const int8_t *>(&piece);
#pragma unroll
  for (int i = 0; i < 16; ++i) out[i] = dequantized<T>(q[i], scale);
#pragma unroll
  for (uint32_t w = 0; w < kBytes / 16; ++w)
    reinterpret_cast<int4 *>(dst)[w] = reinterpret_cast<const int4 *>(out)[w];
}

// ... of a centered K row, against the 16 f32 centroid values at cen
// rounded to f16 (the reference).
template <typename T>
__device__ __forceinline__ void put_dequantized_centered(uint8_t *dst, const int4 piece, const float scale,
                                                         const float *cen) {
  using DT = typename DevType<T>::type;
  constexpr uint32_t kBytes = 16 * sizeof(DT);
  alignas(16) DT out[16];
  const int8_t *q = reinterpret_cast<const int8_t *>(&piece);
#pragma unroll
  for (int i = 0; i < 16; i += 4) {
    const float4 c = __ldg(reinterpret_cast<const float4 *>(cen + i));
    const float r[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int e = 0; e < 4; ++e)
      out[i + e] = dequantized_centered<T>(q[i + e], scale, f16_rounded(r[e]));
  }
#pragma unroll
  for (uint32_t w = 0; w < kBytes / 16; ++w)
    reinterpret_cast<int4 *>(dst)[w] = reinterpret_cast<const int4 *>(out)[w];
}

// kInt8: pages and frames hold 8-bit rows (GatherArgs::int8_dim), which
// become rows of T in the execution buffer; otherwise T is unused and rows
// are copied as they are. kRows: no row is laid out, only where each lives
// (GatherArgs::row_src), and only misses that take a frame are read.
template <bool kInt8, typename T, bool kRows>
__global__ void WKV_GATHER_BOUNDS gather_kernel(const GatherArgs a) {
  constexpr uint32_t kNone = kNoCacheFrame, kChunk = kUnitMapChunk;
  const uint32_t r = blockIdx.x;
  const DevRun &run = a.runs[r];
  const uint32_t rb = a.row_bytes, cpr = rb / 16, pt = a.page_tokens;
  // Rows of pages and frames: their bytes and 16-byte pieces.
  const uint32_t prb = kInt8 ? a.int8_dim : rb, ppr = prb / 16;
  const uint32_t base = static_cast<uint32_t>(a.lookup.offsets[r]);
  const uint32_t sink = run.sink_tokens, tail = run.tail_tokens;

  // This step reads unit map entries from here on: said before the first
  // (GatherArgs::reading). The fence orders the word before this CTA's
  // loads of entries; the barrier, every thread's after thread 0's fence.
  if (a.reading.done) {
    if (threadIdx.x == 0) {
      const unsigned long long epoch = mark_epoch(a.reading);  // 0: no step's (signal_step_end)
      if (epoch != 0) *reinterpret_cast<volatile unsigned long long *>(a.reading.done) = epoch;
      __threadfence_system();
    }
    __syncthreads();
  }

  // Steady zone: sink rows then tail rows, device to device (or where
  // they live).
  if constexpr (kRows) {
    for (uint32_t t = blockIdx.y * blockDim.x + threadIdx.x; t < sink + tail; t += gridDim.y * blockDim.x) {
      const bool s = t < sink;
      const size_t at = size_t(s ? t : t - sink) * rb;
      a.row_src[base + t] = RowSource{reinterpret_cast<uint64_t>((s ? run.sink_k : run.tail_k) + at),
                                      reinterpret_cast<uint64_t>((s ? run.sink_v : run.tail_v) + at)};
    }
  } else {
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
  }

  // Retrieval clusters, one warp each, unit by unit.
  const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t n_ret = run.n_ret, ret_off = run.ret_off;
  const uint32_t rbase = base + sink + tail;
  uint32_t hits = 0, misses = 0;
  // The step's access record: the launch's, or its graph's (StepVars).
  AdmitEntry *const admits = a.vars ? a.vars->admits : a.admits;
  uint32_t *const hit_log = a.vars ? a.vars->hits : a.hits;
  uint32_t *const record_counts = a.vars ? a.vars->record_counts : a.record_counts;
  const uint32_t admit_cap = a.vars ? a.vars->admit_cap : a.admit_cap;
  const uint32_t hit_cap = a.vars ? a.vars->hit_cap : a.hit_cap;
  const bool admitting = a.pool.cap != 0 && admits != nullptr;
  for (uint32_t i = blockIdx.y * kWarps + warp; i < n_ret; i += gridDim.y * kWarps) {
    const uint32_t id = a.lookup.ret_ids[ret_off + i];
    if (id & kColdCluster) continue;  // a page out: estimated, no member gathered
    const uint32_t first = run.first_slot[id], n = run.size[id];
    const uint32_t dst_row = rbase + a.lookup.ret_pos[ret_off + i];
    const uint32_t ub = run.unit_dir ? run.unit_begin[id] : 0;
    // Centered K rows: the cluster's centroid, where all of it fits f16.
    const float *cen = nullptr;
    if constexpr (kInt8 && !kRows) {
      if (a.centered) {
        const float *c = run.centroid + size_t(id) * prb;
        bool fits = true;
        for (uint32_t e = lane; e < prb; e += 32) fits &= fits_f16(c[e]);
        if (__all_sync(0xffffffffu, fits)) cen = c;
      }
    }
    for (uint32_t j = 0; j * pt < n; ++j) {
      const uint32_t rows = min(pt, n - j * pt), u = ub + j;
      // 1. Where the unit is: its frame in the cache, or its pages.
      uint32_t *entry = run.unit_dir ? run.unit_dir[u / kChunk] + u % kChunk : nullptr;
      const uint32_t f = entry ? *reinterpret_cast<volatile uint32_t *>(entry) : kNone;
      const bool hit = f < a.frames;
      const UnitSource src = unit_source(hit ? a.cache + size_t(f) * a.frame_bytes : nullptr, run.pages,
                                         first + j * pt, rows, pt, prb, a.scales_at);
      if (lane == 0) {
        if (hit)
          ++hits;
        else
          ++misses;
      }
      uint32_t g = 0xffffffffu, af = kNone;
      const size_t row0 = size_t(dst_row) + j * pt;
      // The record's part of a unit, by lane 0, given to the warp: every
      // miss of a mapped unit is counted (the record's demand), whether or
      // not a frame is left for it (g: its admission entry; af: the frame
      // it took, if any); a hit is logged.
      auto record = [&] {
        if (lane == 0) {
          if (!hit && entry && record_counts) {
            g = atomicAdd(&a.work[0], 1u);
            if (admitting && g < admit_cap) af = take_frame(a.pool);
          }
          if (hit && hit_log) {
            const uint32_t h = atomicAdd(&a.work[1], 1u);
            if (h < hit_cap) hit_log[h] = f;
          }
        }
        g = __shfl_sync(0xffffffffu, g, 0);
        af = __shfl_sync(0xffffffffu, af, 0);
      };
      if constexpr (kRows) {
        // Where the rows live: a hit's frame, read by the attention; a
        // miss takes a frame before anything is read, and is read (into
        // the frame) only if it got one.
        record();
        const bool framed = af < a.frames;
        put_row_sources<kInt8>(a.row_src, row0,
                               framed ? unit_source(a.cache + size_t(af) * a.frame_bytes, nullptr, 0, rows, pt, prb,
                                                    a.scales_at)
                                      : src,
                               rows, prb, lane);
      }
      // 2. The rows, kUnroll pieces of K and of V per lane in flight. A
      //    missed unit takes a frame from the pool, if it has one, while
      //    the first loads are in flight (two atomics and a read from L2).
      const uint32_t total = kRows && af >= a.frames ? 0 : rows * ppr;
      for (uint32_t q0 = 0; q0 < total; q0 += 32 * kUnroll) {
        int4 kv[kUnroll], vv[kUnroll];
        float ks[kUnroll], vs[kUnroll];  // with 8-bit rows, their scales
#pragma unroll
        for (int x = 0; x < kUnroll; ++x) {
          const uint32_t q = q0 + x * 32 + lane;
          if (q < total) {
            const uint32_t m = q / ppr, c = q - m * ppr;
            const bool first_part = m < src.split;
            const uint32_t mr = first_part ? m : m - src.split;
            const size_t at = size_t(mr) * prb + size_t(c) * 16;
            kv[x] = load_row_piece((first_part ? src.k0 : src.k1) + at);
            vv[x] = load_row_piece((first_part ? src.v0 : src.v1) + at);
            if constexpr (kInt8) {
              ks[x] = __ldcs((first_part ? src.ks0 : src.ks1) + mr);
              vs[x] = __ldcs((first_part ? src.vs0 : src.vs1) + mr);
            }
          }
        }
        if (!kRows && q0 == 0) record();  // while the first loads are in flight
        uint8_t *frame = af < a.frames ? a.cache + size_t(af) * a.frame_bytes : nullptr;
#pragma unroll
        for (int x = 0; x < kUnroll; ++x) {
          const uint32_t q = q0 + x * 32 + lane;
          if (q < total) {
            const uint32_t m = q / ppr, c = q - m * ppr;
            const size_t row = row0 + m;
            if constexpr (kInt8) {
              // A piece of 16 values becomes 16 values of T in the buffer.
              if constexpr (!kRows) {
                const size_t at = row * rb + size_t(c) * 16 * sizeof(typename DevType<T>::type);
                if (cen)
                  put_dequantized_centered<T>(a.xk + at, kv[x], ks[x], cen + size_t(c) * 16);
                else
                  put_dequantized<T>(a.xk + at, kv[x], ks[x]);
                put_dequantized<T>(a.xv + at, vv[x], vs[x]);
              }
              if (frame && c == 0) {
                reinterpret_cast<float *>(frame + a.scales_at)[m] = ks[x];
                reinterpret_cast<float *>(frame + a.scales_at)[pt + m] = vs[x];
              }
            } else if constexpr (!kRows) {
              reinterpret_cast<int4 *>(a.xk + row * rb)[c] = kv[x];
              reinterpret_cast<int4 *>(a.xv + row * rb)[c] = vv[x];
            }
            if (frame) {
              reinterpret_cast<int4 *>(frame + size_t(m) * prb)[c] = kv[x];
              reinterpret_cast<int4 *>(frame + size_t(pt + m) * prb)[c] = vv[x];
            }
          }
        }
      }
      const bool admit = af < a.frames;
      // 4. Map the admitted frame once its rows are visible to every reader.
      if (admit) {
        __threadfence();
        __syncwarp();
        if (lane == 0) {
          const uint32_t old = atomicCAS(entry, kNone, af);
          admits[g] = AdmitEntry{old == kNone ? reinterpret_cast<uint64_t>(entry) : 0ull, af, r};
        }
      } else if (lane == 0 && admitting && g < admit_cap) {
        admits[g] = AdmitEntry{0ull, kNone, r};  // the pool was empty
      }
    }
  }
  if (a.stats) {
    // The step's exact tokens, once (the lookup wrote the runs' offsets).
    if (r == 0 && blockIdx.y == 0 && threadIdx.x == 0)
      atomicAdd(&a.stats[2], static_cast<unsigned long long>(a.lookup.offsets[a.n_runs]));
    hits = __reduce_add_sync(0xffffffffu, hits);
    misses = __reduce_add_sync(0xffffffffu, misses);
    if (lane == 0) {
      if (hits) atomicAdd(&a.stats[0], static_cast<unsigned long long>(hits));
      if (misses) atomicAdd(&a.stats[1], static_cast<unsigned long long>(misses));
    }
  }

  // 5. The last CTA reports the record's counts and the step's end.
  if (!a.work) return;
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence_system();
  if (atomicAdd(&a.work[2], 1u) != gridDim.x * gridDim.y - 1) return;
  const uint32_t taken = atomicAdd(&a.work[0], 0u), logged = atomicAdd(&a.work[1], 0u);
  if (record_counts) {
    record_counts[0] = admitting ? min(taken, admit_cap) : 0u;
    record_counts[1] = min(logged, hit_cap);
    record_counts[2] = taken;
  }
  if (a.pool.seen) *reinterpret_cast<volatile unsigned long long *>(a.pool.seen) = atomicAdd(a.pool.taken, 0ull);
  a.work[0] = a.work[1] = a.work[2] = 0;  // for the next launch (stream order)
  __threadfence_system();
  if (a.mark.done) *reinterpret_cast<volatile unsigned long long *>(a.mark.done) = mark_epoch(a.mark);
}

}  // namespace

cudaError_t gather_cuda(const GatherArgs &a, cudaStream_t stream) {
  if (a.n_runs == 0) {
    if (a.mark.done) return mark_step_end(a.mark.done, a.mark.epoch, stream);
    return cudaSuccess;
  }
  if (!a.runs || !a.xk || !a.xv || !a.lookup.offsets || !a.lookup.ret_ids || !a.lookup.ret_pos)
    return cudaErrorInvalidValue;
  if (a.row_bytes == 0 || a.row_bytes % 16 != 0 || a.page_tokens == 0) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(a.xk) % 16 != 0 || reinterpret_cast<uintptr_t>(a.xv) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(a.row_src) % 16 != 0)
    return cudaErrorInvalidValue;
  if ((a.admits || a.hits || a.mark.done || a.vars) && !a.work) return cudaErrorInvalidValue;
  if (a.pool.cap && (!a.pool.slots || !a.pool.avail || !a.pool.taken || !a.cache)) return cudaErrorInvalidValue;
  if (a.record_counts && !a.work) return cudaErrorInvalidValue;
  // A frame holds a page slot's rows (and scales): K rows, V rows, scales.
  const size_t slot_used = a.int8_dim ? size_t(a.scales_at) + size_t(8) * a.page_tokens
                                      : size_t(2) * a.page_tokens * a.row_bytes;
  if (a.centered && (!a.int8_dim || a.row_src)) return cudaErrorInvalidValue;
  if (a.int8_dim && (a.int8_dim % 16 != 0 || !dtype_known(a.dtype) ||
                     size_t(a.int8_dim) * dtype_bytes(a.dtype) != a.row_bytes ||
                     a.scales_at != size_t(2) * a.page_tokens * a.int8_dim))
    return cudaErrorInvalidValue;
  if (a.frames > 0 && (!a.cache || a.frame_bytes < slot_used || a.frame_bytes % 16 != 0))
    return cudaErrorInvalidValue;
  if (a.n_runs > 0x7fffffffu) return cudaErrorInvalidValue;
  const uint32_t chunks = std::max<uint32_t>(1, std::min<uint32_t>((a.max_ret + kWarps - 1) / kWarps, 65535));
  const dim3 grid(a.n_runs, chunks), block(kWarps * 32);
  if (a.row_src) {
    // Rows stay where they live: the dtype does not matter.
    if (!a.int8_dim)
      gather_kernel<false, float, true><<<grid, block, 0, stream>>>(a);
    else
      gather_kernel<true, float, true><<<grid, block, 0, stream>>>(a);
  } else if (!a.int8_dim) {
    gather_kernel<false, float, false><<<grid, block, 0, stream>>>(a);
  } else {
    switch (a.dtype) {
      case DType::kF32: gather_kernel<true, float, false><<<grid, block, 0, stream>>>(a); break;
      case DType::kF16: gather_kernel<true, f16, false><<<grid, block, 0, stream>>>(a); break;
      case DType::kBF16: gather_kernel<true, bf16, false><<<grid, block, 0, stream>>>(a); break;
    }
  }
  WKV_CUDA_CHECK_LAUNCH("gather_kernel");
  return cudaSuccess;
}

}  // namespace wkv::kernels
