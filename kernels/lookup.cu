// Lookup on the GPU: the CUDA counterpart of score_clusters, select_zones and
// estimate_zone (kernels/cpu_kernels.cpp), for all runs of a step at once.
//
// Four kernels, in stream order:
//   1. logits_kernel    grid (cluster tiles, R): logits [G][clusters] of each
//                       run into out.logits; reads every centroid once a
//                       pass of four query heads (two at d=256), the f16
//                       copy where the run has one.
//   2. select_kernel    a cluster of CTAs per run on sm_90 (each a slice of
//                       its clusters, meeting through distributed shared
//                       memory; one CTA elsewhere or for small runs):
//                       per-head softmax statistics, scores,
//                       a radix select of the thresholds, compaction in id
//                       order, ret_pos and run_tokens; with n_one > 0 the
//                       thresholds of both classes and of the best n_sel,
//                       and a second round (the estimation zone of the
//                       rest) only where a retrieval cluster falls outside
//                       the best n_sel; every cluster's zone. Where pages
//                       may be out (DevRun::cold_pt), a retrieval cluster
//                       with one is marked kColdCluster, counts no member,
//                       goes after the run's estimation clusters and into
//                       the run's report (DevRun::wants).
//   3. estimate_kernel  (run, group of up to 8 heads) pairs, each split over
//                       a cluster of 8 CTAs on sm_90 that merge through
//                       distributed shared memory: est_out and est_lse,
//                       with the tail folded in where the run has a value
//                       mean; a group's heads share each value sum read.
//   4. offsets_kernel   one CTA: exclusive prefix of run_tokens. Where the
//                       step's mark has a CTA counter (StepMark::ctas), the
//                       estimate's last CTA does it instead (end_lookup),
//                       and the lookup takes one launch fewer.
// lookup_select and lookup_estimate enqueue the same work in two parts (1,
// 2 and 4, the selection's last CTA laying out the offsets; 3), for a
// caller that runs the estimate on a stream of its own beside the gather
// (a decode graph's fork).
// Each kernel is launched with programmatic dependent launch and waits for
// the grid before it (griddepcontrol.wait) before touching memory, so that
// its launch overlaps the tail of the one before.
#include <cooperative_groups.h>

#include <atomic>
#include <cmath>
#include <type_traits>

#include "kernels/cuda_common.cuh"
#include "kernels/lookup_cuda.hpp"

namespace wkv::kernels {
namespace {

constexpr float kNegInf = -INFINITY;
constexpr uint32_t kFull = 0xffffffffu;

// Logits: a CTA scores a tile of kLogitTile clusters of one run; the
// kLogitParts lanes of a group share a cluster, each holding D /
// kLogitParts of its dimensions of the query heads in registers (16-byte
// chunks interleaved where they divide the slice: load_slice), and sum
// their partial dot products by shuffles. Two batches of kLogitBatch clusters'
// loads are in flight per group (the kernel waits on memory, not on
// arithmetic).
constexpr uint32_t kLogitThreads = 256;
constexpr uint32_t kLogitParts = 8;
constexpr uint32_t kLogitSlots = kLogitThreads / kLogitParts;  // clusters a CTA scores at once
constexpr uint32_t kLogitTile = 512;
constexpr uint32_t kLogitBatch = 2;
// 8-bit rows a batch (WKV_LOGIT_ROWS8_BATCH at configure, for A/Bs): 2, as
// f16 rows; 4 (the f16 rows' bytes in flight) spilled and was slower on an
// H100 (bench/RESULTS.md, "2026-12-07, eleventh session").
#ifndef WKV_LOGIT_ROWS8_BATCH
#define WKV_LOGIT_ROWS8_BATCH 2
#endif
constexpr uint32_t kLogitBatch8 = WKV_LOGIT_ROWS8_BATCH;
constexpr uint32_t kSelectThreads = 1024;
constexpr uint32_t kSelectWarps = kSelectThreads / 32;
// CTAs a run's selection is split over, at most (one cluster); over 8, a
// non-portable cluster size where the device allows it (WKV_SELECT_MAX_SPLIT
// at configure, 16: an A/B of the select over every multiprocessor at
// batch 1, not a setting: a cluster of 16 CTAs of 1024 threads needs 16
// multiprocessors of one GPC; select_split takes 16 only where the occupancy
// API says every run's cluster fits at once, and a launch refused all the
// same falls back to one CTA a run, as one of 8 does).
#ifdef WKV_SELECT_MAX_SPLIT
constexpr uint32_t kSelectMaxSplit = WKV_SELECT_MAX_SPLIT;
#else
constexpr uint32_t kSelectMaxSplit = 8;
#endif
static_assert(kSelectMaxSplit == 1 || kSelectMaxSplit == 2 || kSelectMaxSplit == 4 || kSelectMaxSplit == 8 ||
                  kSelectMaxSplit == 16,
              "a power of two, at most 16 (the largest cluster)");
constexpr uint32_t kSelectMinSlice = 2048;  // clusters a CTA's slice keeps, at least
// The estimate's threads a CTA; WKV_ESTIMATE_THREADS (at configure, for an
// A/B) sets another multiple of 32 of at least D / 4.
#ifdef WKV_ESTIMATE_THREADS
constexpr uint32_t kEstThreads = WKV_ESTIMATE_THREADS;
#else
constexpr uint32_t kEstThreads = 256;
#endif
static_assert(kEstThreads % 32 == 0 && kEstThreads >= 64 && kEstThreads <= 1024, "the estimate's CTA size");
// The estimate's CTAs a multiprocessor that ptxas must make room for
// (__launch_bounds__' second argument, which caps the registers); unset,
// none: ptxas chooses (128 registers at d = 128). Set at configure
// (CUDAFLAGS=-DWKV_ESTIMATE_MIN_CTAS=4) for an A/B of how the estimate
// shares multiprocessors with the gather (docs/gpu-serving.md, "The
// estimate beside the gather, priced").
#ifdef WKV_ESTIMATE_MIN_CTAS
#define WKV_ESTIMATE_BOUNDS __launch_bounds__(kEstThreads, WKV_ESTIMATE_MIN_CTAS)
#else
#define WKV_ESTIMATE_BOUNDS __launch_bounds__(kEstThreads)
#endif
constexpr uint32_t kEstSplits = 8;       // CTAs per (run, head group) on sm_90: one cluster
constexpr uint32_t kEstWideSplits = 16;  // ... when that leaves multiprocessors idle (a non-portable cluster size)
constexpr uint32_t kOffsetThreads = 1024;

// What the estimate's last CTA does after its work (end_lookup): with ctas
// (a device word, zero between launches) not null, the offsets of the R
// runs and the step's end.
struct LookupEnd {
  unsigned int *ctas;
  uint32_t R;
  StepMark mark;
};

// Zone sizes of a run, clamped so that n_ret + n_est <= clusters and
// n_one <= n_ret.
struct Zones {
  uint32_t n_ret, n_one, n_est;
};
__device__ __forceinline__ Zones clamp_zones(const DevRun &run) {
  const uint32_t nr = min(run.n_ret, run.clusters);
  return {nr, min(run.n_one, nr), min(run.n_est, run.clusters - nr)};
}

// Order-preserving map of a score to an unsigned key: a larger score has a
// larger key. NaN ranks with -inf and -0 with +0, as select_zones compares.
__device__ __forceinline__ uint32_t score_key(float s) {
  if (isnan(s)) s = kNegInf;
  if (s == 0.f) s = 0.f;
  const uint32_t u = __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}

// Block-wide max and sum (all threads get the result); tmp holds 32 floats.
template <uint32_t kThreads>
__device__ float block_max(float x, float *tmp) {
  constexpr uint32_t nw = kThreads / 32;
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  x = warp_max(x);
  if (lane == 0) tmp[warp] = x;
  __syncthreads();
  float y = lane < nw ? tmp[lane] : kNegInf;
  y = warp_max(y);
  __syncthreads();
  return y;
}
template <uint32_t kThreads>
__device__ float block_sum(float x, float *tmp) {
  constexpr uint32_t nw = kThreads / 32;
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  x = warp_sum(x);
  if (lane == 0) tmp[warp] = x;
  __syncthreads();
  float y = lane < nw ? tmp[lane] : 0.f;
  y = warp_sum(y);
  __syncthreads();
  return y;
}

// Exclusive prefix sum over the block; *total gets the block's sum. tmp
// holds 32 words. Every thread must call it.
template <uint32_t kThreads>
__device__ uint32_t block_excl_scan(uint32_t v, uint32_t *tmp, uint32_t *total) {
  constexpr uint32_t nw = kThreads / 32;
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint32_t x = v;
#pragma unroll
  for (uint32_t o = 1; o < 32; o <<= 1) {
    const uint32_t y = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) tmp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    uint32_t t = lane < nw ? tmp[lane] : 0u;
#pragma unroll
    for (uint32_t o = 1; o < 32; o <<= 1) {
      const uint32_t y = __shfl_up_sync(kFull, t, o);
      if (lane >= o) t += y;
    }
    tmp[lane] = t;
  }
  __syncthreads();
  const uint32_t before = warp ? tmp[warp - 1] : 0u;
  *total = tmp[nw - 1];
  __syncthreads();
  return before + x - v;
}

// Merges two (max, sum of exp(x - max)) pairs.
__device__ __forceinline__ void merge_ms(float &m, float &s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  if (mm == kNegInf) return;  // both empty
  s = (m == kNegInf ? 0.f : s * expf(m - mm)) + (m2 == kNegInf ? 0.f : s2 * expf(m2 - mm));
  m = mm;
}

// 1. Logits ----------------------------------------------------------------

// Loads BYTES bytes (a lane's slice of a centroid row) as 32-bit words, in
// the widest loads the slice's size (and so its alignment) allows.
__device__ __forceinline__ void put_words(uint32_t *o, uint4 v) {
  o[0] = v.x;
  o[1] = v.y;
  o[2] = v.z;
  o[3] = v.w;
}
__device__ __forceinline__ void put_words(uint32_t *o, uint2 v) {
  o[0] = v.x;
  o[1] = v.y;
}
__device__ __forceinline__ void put_words(uint32_t *o, uint32_t v) { o[0] = v; }
// A lane's slice of BYTES bytes of a row, lane `part` of kLogitParts: where
// BYTES is a multiple of 16, 16-byte chunks kLogitParts * 16 bytes apart
// (chunk j at (j * kLogitParts + part) * 16), so that each load of the
// group reads whole sectors; else BYTES contiguous bytes at part * BYTES.
template <uint32_t BYTES>
struct Slicing {
  static constexpr uint32_t kChunk = BYTES % 16 == 0 ? 16 : BYTES;  // bytes a load
  // The row's byte where chunk j of lane part starts.
  __device__ static constexpr uint32_t at(uint32_t j, uint32_t part) { return (j * kLogitParts + part) * kChunk; }
};
// Read-only loads from global memory.
template <uint32_t BYTES>
__device__ __forceinline__ void load_slice(const uint8_t *row, uint32_t part, uint32_t (&out)[BYTES / 4]) {
  constexpr uint32_t CB = Slicing<BYTES>::kChunk;
  using W = std::conditional_t<CB % 16 == 0, uint4, std::conditional_t<CB % 8 == 0, uint2, uint32_t>>;
#pragma unroll
  for (uint32_t j = 0; j < BYTES / CB; ++j) {
    const W *src = reinterpret_cast<const W *>(row + Slicing<BYTES>::at(j, part));
#pragma unroll
    for (uint32_t i = 0; i < CB / sizeof(W); ++i)
      put_words(out + (j * CB + i * sizeof(W)) / 4, __ldg(src + i));
  }
}

// The query heads h0 .. h0 + HP - 1 (zero past G) of qs in a lane's
// registers: element j of the lane's slice is dimension dim(j), as
// load_slice lays the slice out.
template <uint32_t D, uint32_t EB, uint32_t HP>
__device__ __forceinline__ void load_query_slice(const float *qs, uint32_t G, uint32_t h0, uint32_t part,
                                                 float (&qr)[HP][D / kLogitParts]) {
  constexpr uint32_t S = D / kLogitParts;
  constexpr uint32_t CE = Slicing<S * EB>::kChunk / EB;  // elements a chunk
#pragma unroll
  for (uint32_t h = 0; h < HP; ++h)
#pragma unroll
    for (uint32_t j = 0; j < S; ++j) {
      const uint32_t dim = Slicing<S * EB>::at(j / CE, part) / EB + j % CE;
      qr[h][j] = h0 + h < G ? qs[(h0 + h) * D + dim] : 0.f;
    }
}

// Cluster c's logits for heads h0 .. h0 + HP - 1 from the group's slices
// of its row (raw, this lane's; EB bytes an element: 1 int8, scaled by
// row_scale, 2 f16, 4 f32): the lanes' dot products summed by shuffles
// (every lane of the warp calls it), then lane `part` writes head h0 +
// part where `valid`.
template <uint32_t NW, uint32_t HP, uint32_t EB, uint32_t S>
__device__ __forceinline__ void logit_row(const uint32_t (&raw)[NW], const float (&qr)[HP][S], uint32_t part,
                                          uint32_t h0, uint32_t G, uint32_t C, uint32_t c, bool valid, float scale,
                                          const float *fs, const float *__restrict__ spread,
                                          float *__restrict__ lg, float row_scale = 1.0f) {
  float acc[HP];
#pragma unroll
  for (uint32_t h = 0; h < HP; ++h) acc[h] = 0.f;
#pragma unroll
  for (uint32_t w = 0; w < NW; ++w) {
    if constexpr (EB == 1) {
      float x[4];
      int8x4_to_float(raw[w], x);
#pragma unroll
      for (uint32_t h = 0; h < HP; ++h)
#pragma unroll
        for (uint32_t e = 0; e < 4; ++e) acc[h] = fmaf(qr[h][4 * w + e], x[e], acc[h]);
    } else if constexpr (EB == 2) {
      const float2 x = __half22float2(*reinterpret_cast<const __half2 *>(&raw[w]));
#pragma unroll
      for (uint32_t h = 0; h < HP; ++h) {
        acc[h] = fmaf(qr[h][2 * w], x.x, acc[h]);
        acc[h] = fmaf(qr[h][2 * w + 1], x.y, acc[h]);
      }
    } else {
      const float x = __uint_as_float(raw[w]);
#pragma unroll
      for (uint32_t h = 0; h < HP; ++h) acc[h] = fmaf(qr[h][w], x, acc[h]);
    }
  }
#pragma unroll
  for (uint32_t o = kLogitParts / 2; o > 0; o >>= 1)
#pragma unroll
    for (uint32_t h = 0; h < HP; ++h) acc[h] += __shfl_xor_sync(kFull, acc[h], o);
  const uint32_t g = h0 + part;
  if (valid && part < HP && g < G) {
    float v = acc[0];
#pragma unroll
    for (uint32_t h = 1; h < HP; ++h) v = part == h ? acc[h] : v;
    if constexpr (EB == 1) v *= row_scale;  // as score_clusters_q8: (dot x row scale) x scale
    lg[static_cast<size_t>(g) * C + c] = spread ? v * scale + fs[g] * spread[c] : v * scale;
  }
}

// One CTA's tile: clusters [c0, c0 + kLogitTile) of a run, from `rows`
// ([clusters][D], EB bytes an element: 1 int8 with a scale a row at
// row_scale, 2 f16, 4 f32). qs: the run's queries [G][D]; fs: the spread
// factors, read where spread is not null.
template <uint32_t D, uint32_t EB>
__device__ __forceinline__ void logits_tile(const uint8_t *__restrict__ rows, uint32_t C, uint32_t c0, uint32_t G,
                                            float scale, const float *qs, const float *fs,
                                            const float *__restrict__ spread, float *__restrict__ lg,
                                            const float *__restrict__ row_scale = nullptr) {
  constexpr uint32_t S = D / kLogitParts;        // dimensions a lane holds
  constexpr uint32_t NW = S * EB / 4;            // 32-bit words a slice
  constexpr uint32_t HP = D <= 128 ? 4 : 2;      // query heads a pass (registers)
  const uint32_t part = threadIdx.x % kLogitParts, slot = threadIdx.x / kLogitParts;
  for (uint32_t h0 = 0; h0 < G; h0 += HP) {
    float qr[HP][S];
    load_query_slice<D, EB, HP>(qs, G, h0, part, qr);
    // The next batch's loads are issued before this one's arithmetic, so
    // that 2 kB rows a group are in flight.
    constexpr uint32_t kB = EB == 1 ? kLogitBatch8 : kLogitBatch;
    constexpr uint32_t kRounds = kLogitTile / kLogitSlots;
    static_assert(kRounds % kB == 0, "a tile is whole batches");
    // With 8-bit rows each row's scale travels with its bytes (rs).
    auto load_batch = [&](uint32_t k, uint32_t (&raw)[kB][NW], float (&rs)[kB]) {
#pragma unroll
      for (uint32_t b = 0; b < kB; ++b) {
        const uint32_t c = c0 + slot + (k + b) * kLogitSlots;
        if (c < C) {
          load_slice<S * EB>(rows + static_cast<size_t>(c) * D * EB, part, raw[b]);
          if constexpr (EB == 1) rs[b] = __ldg(row_scale + c);
        } else {
#pragma unroll
          for (uint32_t w = 0; w < NW; ++w) raw[b][w] = 0u;
          rs[b] = 0.0f;
        }
      }
    };
    uint32_t next[kB][NW];
    float next_rs[kB];
    load_batch(0, next, next_rs);
    for (uint32_t k = 0; k < kRounds; k += kB) {
      uint32_t raw[kB][NW];
      float rs[kB];
#pragma unroll
      for (uint32_t b = 0; b < kB; ++b) {
        rs[b] = next_rs[b];
#pragma unroll
        for (uint32_t w = 0; w < NW; ++w) raw[b][w] = next[b][w];
      }
      if (k + kB < kRounds) load_batch(k + kB, next, next_rs);
#pragma unroll
      for (uint32_t b = 0; b < kB; ++b) {
        const uint32_t c = c0 + slot + (k + b) * kLogitSlots;
        logit_row<NW, HP, EB>(raw[b], qr, part, h0, G, C, c, c < C, scale, fs, spread, lg, rs[b]);
      }
    }
  }
}

// Grid (tiles of kLogitTile clusters, R): the logits [G][clusters] of each
// run, from the centroids' 8-bit copy where the run has one and every row is
// finite (a quarter of the f32 bytes, and a scale a row), else from their
// f16 copy where the run has one and every centroid fits (half the bytes),
// else from the f32 centroids.
template <uint32_t D>
__global__ void __launch_bounds__(kLogitThreads, D <= 128 ? 2 : 1) logits_kernel(const DevRun *__restrict__ runs, uint32_t G,
                                                               float scale, const float *__restrict__ q,
                                                               float *__restrict__ logits) {
  __shared__ float qs[kMaxGroup * D];
  __shared__ float fs[kMaxGroup];
  wait_prior_grid();
  const uint32_t r = blockIdx.y, tid = threadIdx.x;
  const uint32_t C = runs[r].clusters;
  const uint32_t c0 = blockIdx.x * kLogitTile;
  if (c0 >= C) return;  // uniform over the CTA
  const float *qg = q + static_cast<size_t>(r) * G * D;
  for (uint32_t i = tid; i < G * D; i += kLogitThreads) qs[i] = qg[i];
  __syncthreads();
  // With spreads, head g's logits gain f_g spread[c], f_g = 0.5 scale^2 |q_g|^2 / D
  // (spread_logits: |q_g|^2 summed in order, as the CPU sums it).
  const float *spread = runs[r].spread;
  if (spread && tid < G) {
    float q2 = 0.f;
    for (uint32_t j = 0; j < D; ++j) q2 += qs[tid * D + j] * qs[tid * D + j];
    fs[tid] = 0.5f * scale * scale * q2 / static_cast<float>(D);
  }
  if (spread) __syncthreads();
  float *lg = logits + runs[r].scratch_off;
  const uint8_t *c8 = runs[r].centroid8;
  const uint8_t *c16 = runs[r].centroid16;
  if (D % 32 == 0 && c8 && *reinterpret_cast<const uint32_t *>(c8) == 0) {  // whole words a lane's slice
    if constexpr (D % 32 == 0)
      logits_tile<D, 1>(c8 + kMeta16Header, C, c0, G, scale, qs, fs, spread, lg, runs[r].centroid8_scale);
  } else if (c16 && *reinterpret_cast<const uint32_t *>(c16) == 0) {
    const uint8_t *rows = c16 + kMeta16Header;
    logits_tile<D, 2>(rows, C, c0, G, scale, qs, fs, spread, lg);
  } else {
    logits_tile<D, 4>(reinterpret_cast<const uint8_t *>(runs[r].centroid), C, c0, G, scale, qs, fs, spread, lg);
  }
}

// 2. Scores, selection, ret_pos, run_tokens ---------------------------------

// Selections the selection kernel makes at once, at most: with clusters of
// one ranked apart, the larger clusters' retrieval zone, the clusters of
// one's and the best n_ret + n_est of all (select_kernel, 2c').
constexpr uint32_t kSelTargets = 3;

struct SelectShared {
  float red_m[kSelectWarps], red_s[kSelectWarps];
  float loc_m[kMaxGroup], loc_s[kMaxGroup];  // this CTA's softmax statistics, per head
  float head_m[kMaxGroup], head_inv[kMaxGroup];
  uint32_t hist[kSelTargets][256];      // [target][bin]: this CTA's counts of a pass
  uint32_t total[2][kSelTargets][256];  // [pass parity][target][bin]: the run's, every CTA's counts added in
  uint32_t prefix[kSelTargets], krem[kSelTargets];
  uint32_t wcnt[kSelectWarps][2 * kSelTargets];  // per warp and target: > threshold, == threshold
  uint32_t loc_tot[2 * kSelTargets];             // this CTA's totals of those counts
  uint32_t tot[2 * kSelTargets], before[2 * kSelTargets];  // the run's totals; the CTAs' before this one
  uint32_t ret_n, ret_tokens;      // this CTA's retrieval clusters and their members
  uint32_t cold_n;                 // of them, clusters with a page out (DevRun::cold_pt)
  uint32_t tmp[32];
  uint32_t last;                   // this CTA is the launch's last to end (select_kernel)
};

// A run's selection is split over the CTAs of a thread-block cluster on
// sm_90 (one CTA elsewhere): CTA `rank` of `n` owns the cluster ids
// [lo, hi), a contiguous slice, and the CTAs meet through distributed
// shared memory: softmax statistics and counts are each CTA's, read and
// summed in rank order by every CTA alike; the radix passes' histograms are
// added by every CTA into every CTA's copy (radix_select).
struct Slice {
  uint32_t rank, n, lo, hi;
};

// This CTA's SelectShared seen from the cluster: `p` in CTA k's copy.
template <typename T>
__device__ __forceinline__ T *in_rank(T *p, uint32_t k) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(p, k);
#else
  (void)k;
  return p;
#endif
}
// The value at `p` in each of the run's n CTAs' copies (fill past n): the
// loads unrolled, so that they are in flight together (each is a round trip
// to another multiprocessor's shared memory).
template <typename T>
__device__ __forceinline__ void from_ranks(T *p, uint32_t n, T fill, T (&v)[kSelectMaxSplit]) {
#pragma unroll
  for (uint32_t k = 0; k < kSelectMaxSplit; ++k) v[k] = k < n ? *in_rank(p, k) : fill;
}
// Every thread of every CTA of the cluster arrives; shared memory writes
// before it are visible to every CTA after it.
__device__ __forceinline__ void cluster_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().sync();
#else
  __syncthreads();
#endif
}

// Finds, for target t, the bin of the run's histogram t (total[buf][t],
// every CTA's counts added in) that holds the krem[t]-th largest key among
// those matching prefix[t], and narrows prefix/krem to it. One warp; lane L
// owns bins 255 - 8L down to 248 - 8L.
__device__ void radix_pick(SelectShared &sh, uint32_t buf, uint32_t t, uint32_t shift) {
  const uint32_t lane = threadIdx.x % 32;
  uint32_t cnt[8], local = 0;
#pragma unroll
  for (uint32_t i = 0; i < 8; ++i) {
    cnt[i] = sh.total[buf][t][255 - lane * 8 - i];
    local += cnt[i];
  }
  uint32_t incl = local;
#pragma unroll
  for (uint32_t o = 1; o < 32; o <<= 1) {
    const uint32_t y = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += y;
  }
  const uint32_t k = sh.krem[t];
  __syncwarp();  // every lane has read krem before one lane rewrites it
  const uint32_t excl = incl - local;
  if (excl < k && k <= incl) {
    uint32_t above = excl;
#pragma unroll
    for (uint32_t i = 0; i < 8; ++i) {
      if (above + cnt[i] >= k) {
        sh.prefix[t] |= (255u - lane * 8 - i) << shift;
        sh.krem[t] = k - above;
        break;
      }
      above += cnt[i];
    }
  }
}

// N radix selections at once (N <= kSelTargets), 8 bits a pass from the
// top: for target t with k[t] > 0, the k[t]-th largest of keys(c, t) over
// the run's c < C (this CTA counting its slice). Keys of 0 are never sought
// (every score's key is above 0: score_key), so a key function leaves a
// cluster out by giving it 0. On return sh.prefix[t] is that key, in every
// CTA of the run.
//
// A CTA counts its slice into its own histograms, then adds each non-zero
// count into the run's histograms (total) of every CTA of the run: the
// adds to other multiprocessors' shared memory are sent, not waited for,
// and are sparse (scores crowd into few bins, and later passes count only
// the keys that match the prefix), so that after the pass's one cluster
// barrier each CTA picks from its own shared memory. A pass adds into the
// run's histograms of its parity, and each CTA clears those of the other
// parity (read in the pass before) before it reaches the next barrier, so
// that no CTA's adds of pass n + 2 can precede the clearing of pass n's.
// sh.total must be zero on entry (select_kernel clears it), and is on
// return.
template <uint32_t N, typename Keys>
__device__ void radix_select(SelectShared &sh, const Slice &sl, Keys keys, const uint32_t (&k)[N]) {
  static_assert(N >= 1 && N <= kSelTargets, "targets");
  const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  if (tid < N) {
    sh.prefix[tid] = 0;
    sh.krem[tid] = k[tid];
  }
  for (uint32_t pass = 0; pass < 4; ++pass) {
    const uint32_t shift = 24 - 8 * pass, buf = pass & 1;
    const uint32_t hmask = pass == 0 ? 0u : ~0u << (shift + 8);
    for (uint32_t i = tid; i < N * 256; i += kSelectThreads) {
      (&sh.hist[0][0])[i] = 0;
      (&sh.total[buf ^ 1][0][0])[i] = 0;  // the last pass's, read by this CTA's pick
    }
    __syncthreads();
    uint32_t p[N];
#pragma unroll
    for (uint32_t t = 0; t < N; ++t) p[t] = sh.prefix[t];
    // Scores crowd into few bins (in the first passes every lane of a warp
    // hits one): a warp whose matching lanes share a bin adds once, its
    // first matching lane for all of them; other warps add lane by lane
    // (the hardware serializes the lanes that share an address). A vote
    // and a shuffle cost far less than __match_any_sync, and after the
    // first passes few keys match the prefix: a warp with none skips.
    for (uint32_t base = sl.lo; base < sl.hi; base += kSelectThreads) {
      const uint32_t c = base + tid;
      const bool ok = c < sl.hi;
#pragma unroll
      for (uint32_t t = 0; t < N; ++t) {
        if (k[t] == 0) continue;  // uniform over the run
        const uint32_t key = ok ? keys(c, t) : 0u;
        const uint32_t bin = (key >> shift) & 255u;
        const bool m = ok && (key & hmask) == p[t];
        const uint32_t mb = __ballot_sync(kFull, m);
        if (mb == 0) continue;
        const uint32_t lead = __ffs(mb) - 1;
        const uint32_t lead_bin = __shfl_sync(kFull, bin, lead);
        if (__all_sync(kFull, !m || bin == lead_bin)) {
          if (lane == lead) atomicAdd(&sh.hist[t][lead_bin], __popc(mb));
        } else if (m) {
          atomicAdd(&sh.hist[t][bin], 1u);
        }
      }
    }
    __syncthreads();  // this CTA's counts are complete
    for (uint32_t i = tid; i < N * 256; i += kSelectThreads) {
      const uint32_t v = (&sh.hist[0][0])[i];
      if (v == 0) continue;
      for (uint32_t r = 0; r < sl.n; ++r) atomicAdd(in_rank(&sh.total[buf][0][0] + i, r), v);
    }
    cluster_barrier();  // every CTA's counts are in every CTA's totals
    if (warp < N && k[warp] > 0) radix_pick(sh, buf, warp, shift);
    __syncthreads();  // prefix and krem for the next pass (and the caller)
  }
  // The last pass's totals (parity 1), for the next selection.
  for (uint32_t i = tid; i < N * 256; i += kSelectThreads) (&sh.total[1][0][0])[i] = 0;
}

// Compaction of N selections in id order. Selection t holds the c with
// keys(c, t) > th[t], and the lowest ids of those with keys(c, t) == th[t]
// up to k[t] in all (th[t] = 0xffffffff and k[t] = 0: none). The CTAs of
// the run own consecutive slices and warp w of a CTA a consecutive part of
// its slice; the count of ids below c that selection t holds is gt_t(<c) +
// min(eq_t(<c), need_t). emit(c, in, before) runs for every c of the slice,
// in[t] whether selection t holds c and before[t] that count.
template <uint32_t N, typename Keys, typename Emit>
__device__ void compact(SelectShared &sh, const Slice &sl, Keys keys, const uint32_t (&th)[N],
                        const uint32_t (&k)[N], Emit emit) {
  static_assert(N >= 1 && N <= kSelTargets, "targets");
  const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const uint32_t seg = (sl.hi - sl.lo + kSelectThreads - 1) / kSelectThreads * 32;
  const uint32_t lo = min(sl.hi, sl.lo + warp * seg), hi = min(sl.hi, lo + seg);
  uint32_t cnt[2 * N];
#pragma unroll
  for (uint32_t i = 0; i < 2 * N; ++i) cnt[i] = 0;
  for (uint32_t base = lo; base < hi; base += 32) {
    const uint32_t c = base + lane;
    const bool ok = c < hi;
#pragma unroll
    for (uint32_t t = 0; t < N; ++t) {
      const uint32_t a = ok ? keys(c, t) : 0u;
      cnt[2 * t] += __popc(__ballot_sync(kFull, ok && a > th[t]));
      cnt[2 * t + 1] += __popc(__ballot_sync(kFull, ok && a == th[t]));
    }
  }
  if (lane == 0)
    for (uint32_t i = 0; i < 2 * N; ++i) sh.wcnt[warp][i] = cnt[i];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (uint32_t i = 0; i < 2 * N; ++i) {
      const uint32_t v = sh.wcnt[lane][i];
      uint32_t x = v;
#pragma unroll
      for (uint32_t o = 1; o < 32; o <<= 1) {
        const uint32_t y = __shfl_up_sync(kFull, x, o);
        if (lane >= o) x += y;
      }
      sh.wcnt[lane][i] = x - v;
      if (lane == 31) sh.loc_tot[i] = x;
    }
  }
  cluster_barrier();  // every CTA's totals are complete
  if (tid < 2 * N) {
    uint32_t v[kSelectMaxSplit], before = 0, total = 0;
    from_ranks(&sh.loc_tot[tid], sl.n, 0u, v);
#pragma unroll
    for (uint32_t r = 0; r < kSelectMaxSplit; ++r) {
      if (r < sl.rank) before += v[r];
      total += v[r];
    }
    sh.before[tid] = before;
    sh.tot[tid] = total;
  }
  // (loc_tot is rewritten by the next compaction only after the radix
  // selection between, whose barriers every CTA reaches after this read.)
  __syncthreads();
  uint32_t need[N], gt[N], eq[N];
#pragma unroll
  for (uint32_t t = 0; t < N; ++t) {
    need[t] = k[t] > 0 ? k[t] - sh.tot[2 * t] : 0u;
    gt[t] = sh.before[2 * t] + sh.wcnt[warp][2 * t];
    eq[t] = sh.before[2 * t + 1] + sh.wcnt[warp][2 * t + 1];
  }
  const uint32_t lt = (1u << lane) - 1u;
  for (uint32_t base = lo; base < hi; base += 32) {
    const uint32_t c = base + lane;
    const bool ok = c < hi;
    bool in[N];
    uint32_t before[N];
#pragma unroll
    for (uint32_t t = 0; t < N; ++t) {
      const uint32_t a = ok ? keys(c, t) : 0u;
      const uint32_t b_gt = __ballot_sync(kFull, ok && a > th[t]);
      const uint32_t b_eq = __ballot_sync(kFull, ok && a == th[t]);
      const uint32_t eq_b = eq[t] + __popc(b_eq & lt);
      before[t] = gt[t] + __popc(b_gt & lt) + min(eq_b, need[t]);
      in[t] = ok && (a > th[t] || (a == th[t] && eq_b < need[t]));
      gt[t] += __popc(b_gt);
      eq[t] += __popc(b_eq);
    }
    if (ok) emit(c, in, before);
  }
  __syncthreads();
}

// Whether a page of cluster c is out (in the spill file): its page table
// entry is null.
__device__ __forceinline__ bool cluster_out(const DevRun &run, uint32_t c) {
  const uint32_t first = run.first_slot[c], n = run.size[c], pt = run.cold_pt;
  if (n == 0) return false;
  for (uint32_t p = first / pt; p <= (first + n - 1) / pt; ++p)
    if (run.pages[p] == nullptr) return true;
  return false;
}

// Whether this CTA is the launch's last to get here, counted in ctas (a
// device word, zero between launches; the last CTA clears it after its work,
// for the next launch, which stream order puts after this one). Every thread
// of the CTA calls it after its writes; flag is a shared word. After true,
// the writes the other CTAs issued before their call are visible. Device
// scope suffices: its callers write device memory only (a write to mapped
// host memory would need __threadfence_system in every CTA, as
// signal_step_end has).
__device__ __forceinline__ bool last_cta(unsigned int *ctas, uint32_t *flag) {
  __syncthreads();  // this CTA's writes are issued
  if (threadIdx.x == 0) {
    __threadfence();
    *flag = atomicAdd(ctas, 1u) == gridDim.x * gridDim.y * gridDim.z - 1;
  }
  __syncthreads();
  if (!*flag) return false;
  __threadfence();  // the other CTAs' writes, counted before ours, are visible
  return true;
}

// offsets[r] = the exclusive prefix of run_tokens, r <= R (offsets[R] the
// total), by one CTA of kThreads; tmp holds 32 words. Every thread calls it.
template <uint32_t kThreads>
__device__ void write_offsets(const uint32_t *run_tokens, uint32_t R, int32_t *offsets, uint32_t *tmp) {
  uint32_t carry = 0;
  for (uint32_t base = 0; base < R; base += kThreads) {
    const uint32_t i = base + threadIdx.x;
    const uint32_t v = i < R ? run_tokens[i] : 0u;
    uint32_t total;
    const uint32_t before = block_excl_scan<kThreads>(v, tmp, &total);
    if (i < R) offsets[i] = static_cast<int32_t>(carry + before);
    carry += total;
  }
  if (threadIdx.x == 0) offsets[R] = static_cast<int32_t>(carry);
}

// CTA blockIdx.x % n of run blockIdx.x / n (n = the cluster's size, 1
// without clusters) selects over its slice of the run's clusters. scores
// (optional) is the global score scratch; dynamic shared memory holds the
// keys of the slice when it has at most smem_cap clusters, and after them a
// byte a cluster for the selection with clusters of one ranked apart (bit 0:
// one member; bit 1: in the retrieval zone), so that no key the selection
// evaluates again and again waits on global memory.
__device__ __forceinline__ void select_slice(const DevRun *__restrict__ runs, uint32_t G, const DevLookup &out,
                                             float *scores, uint32_t smem_cap, uint32_t n_split, SelectShared &sh,
                                             uint32_t *keys_s) {
  const uint32_t r = blockIdx.x / n_split, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const DevRun &run = runs[r];
  const uint32_t C = run.clusters;
  const uint32_t share = (C + n_split - 1) / n_split;
  Slice sl;
  sl.rank = blockIdx.x % n_split;
  sl.n = n_split;
  sl.lo = min(C, sl.rank * share);
  sl.hi = min(C, sl.lo + share);
  const Zones z = clamp_zones(run);
  const uint32_t n_ret = z.n_ret, n_sel = z.n_ret + z.n_est;
  const bool use_smem = share <= smem_cap;  // the same in every CTA of the run
  float *sc = scores ? scores + run.scratch_off / G : nullptr;
  const uint32_t steady = run.sink_tokens + run.tail_tokens;
  if (C == 0 || (!use_smem && !sc)) {  // uniform over the run's CTAs
    if (tid == 0 && sl.rank == 0) {
      out.run_tokens[r] = steady;
      if (out.est_extra) out.est_extra[r] = 0;
    }
    return;
  }
  const float *lg = out.logits + run.scratch_off;
  uint8_t *cls_s = reinterpret_cast<uint8_t *>(keys_s + smem_cap);

  // The run's histograms start at zero (radix_select): before the first
  // cluster barrier, after which other CTAs add into them.
  for (uint32_t i = tid; i < 2 * kSelTargets * 256; i += kSelectThreads) (&sh.total[0][0][0])[i] = 0;

  // 2a. Per head: max and sum of exp over the slice; 32 / G warps a head.
  //     Then the run's, merged in rank order by every CTA.
  {
    const uint32_t wph = kSelectWarps / G, g = warp / wph, sub = warp % wph;
    float m = kNegInf, s = 0.f;
    if (g < G) {
      // kBatch independent loads before the first use, then one online
      // softmax step for the batch.
      constexpr uint32_t kBatch = 8;
      const float *row = lg + static_cast<size_t>(g) * C;
      const uint32_t stride = wph * 32;
      for (uint32_t base = sl.lo + sub * 32 + lane; base < sl.hi; base += kBatch * stride) {
        float v[kBatch];
#pragma unroll
        for (uint32_t k = 0; k < kBatch; ++k) {
          const uint32_t c = base + k * stride;
          v[k] = c < sl.hi ? row[c] : kNegInf;
        }
        float bm = v[0];
#pragma unroll
        for (uint32_t k = 1; k < kBatch; ++k) bm = fmaxf(bm, v[k]);
        float bs = 0.f;
        if (bm > kNegInf) {
#pragma unroll
          for (uint32_t k = 0; k < kBatch; ++k) bs += v[k] > kNegInf ? expf(v[k] - bm) : 0.f;
        }
        merge_ms(m, s, bm, bs);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(kFull, m, o), s2 = __shfl_xor_sync(kFull, s, o);
      merge_ms(m, s, m2, s2);
    }
    if (lane == 0) {
      sh.red_m[warp] = m;
      sh.red_s[warp] = s;
    }
    __syncthreads();
    if (tid < G) {
      float hm = kNegInf, hs = 0.f;
      for (uint32_t w = tid * wph; w < (tid + 1) * wph; ++w) merge_ms(hm, hs, sh.red_m[w], sh.red_s[w]);
      sh.loc_m[tid] = hm;
      sh.loc_s[tid] = hs;
    }
    cluster_barrier();  // every CTA's statistics are complete
    if (tid < G) {
      float hm = kNegInf, hs = 0.f;
      float rm[kSelectMaxSplit], rs[kSelectMaxSplit];
      from_ranks(&sh.loc_m[tid], sl.n, kNegInf, rm);
      from_ranks(&sh.loc_s[tid], sl.n, 0.f, rs);
#pragma unroll
      for (uint32_t k = 0; k < kSelectMaxSplit; ++k) merge_ms(hm, hs, rm[k], rs[k]);
      // A head with no finite logit adds nothing, as in score_clusters.
      sh.head_m[tid] = hm;
      sh.head_inv[tid] = hm == kNegInf ? 0.f : 1.f / hs;
    }
    // (No CTA leaves before the others have read its statistics: every
    // path reaches the cluster barriers at the end.)
    __syncthreads();
  }

  // 2b. Scores of the slice, summed over heads in ascending order as
  //     score_clusters does.
  {
    // kBatch clusters a thread at a time, so that their loads overlap.
    constexpr uint32_t kBatch = 4;
    for (uint32_t base = sl.lo + tid; base < sl.hi; base += kBatch * kSelectThreads) {
      float s[kBatch];
#pragma unroll
      for (uint32_t k = 0; k < kBatch; ++k) s[k] = 0.f;
      for (uint32_t g = 0; g < G; ++g) {
        const float hm = sh.head_m[g], inv = sh.head_inv[g];
        const float *row = lg + static_cast<size_t>(g) * C;
        float l[kBatch];
#pragma unroll
        for (uint32_t k = 0; k < kBatch; ++k) {
          const uint32_t c = base + k * kSelectThreads;
          l[k] = c < sl.hi ? row[c] : 0.f;
        }
        if (hm == kNegInf) continue;  // uniform over the block
#pragma unroll
        for (uint32_t k = 0; k < kBatch; ++k) s[k] += expf(l[k] - hm) * inv;
      }
#pragma unroll
      for (uint32_t k = 0; k < kBatch; ++k) {
        const uint32_t c = base + k * kSelectThreads;
        if (c >= sl.hi) break;
        if (sc) sc[c] = s[k];
        if (use_smem) {
          keys_s[c - sl.lo] = score_key(s[k]);
          if (z.n_one) cls_s[c - sl.lo] = run.size[c] == 1 ? 1 : 0;
        }
      }
    }
  }
  if (tid == 0) sh.ret_n = sh.ret_tokens = sh.cold_n = 0;
  __syncthreads();
  auto key = [&](uint32_t c) { return use_smem ? keys_s[c - sl.lo] : score_key(sc[c]); };

  uint32_t *ret_ids = out.ret_ids + run.ret_off;
  uint32_t *est_ids = out.est_ids + run.est_off;
  uint8_t *zone = out.zones + run.scratch_off / G;
  // A retrieval cluster's ret_ids entry; counts this CTA's retrieval
  // clusters and their members, for ret_pos. A cluster with a page out
  // counts no member and is marked for the estimate.
  auto take_ret = [&](uint32_t c) -> uint32_t {
    if (run.stamps) run.stamps[c] = run.stamp;
    atomicAdd(&sh.ret_n, 1u);
    if (run.cold_pt && cluster_out(run, c)) {
      atomicAdd(&sh.cold_n, 1u);
      return c | kColdCluster;
    }
    atomicAdd(&sh.ret_tokens, run.size[c]);
    return c;
  };
  if (z.n_one == 0) {
    // 2c. The paper's zones: the n_sel-th and n_ret-th largest keys, then
    // ret = the top n_ret, est = the rest of the top n_sel.
    if (n_sel == 0) {
      for (uint32_t c = sl.lo + tid; c < sl.hi; c += kSelectThreads) zone[c] = 0;
    } else {
      auto keys = [&](uint32_t c, uint32_t) { return key(c); };
      radix_select<2>(sh, sl, keys, {n_sel, n_ret});
      const uint32_t th[2] = {sh.prefix[0], n_ret > 0 ? sh.prefix[1] : 0xffffffffu};
      compact<2>(sh, sl, keys, th, {n_sel, n_ret}, [&](uint32_t c, const bool (&in)[2], const uint32_t (&b)[2]) {
        if (in[1]) {
          ret_ids[b[1]] = take_ret(c);
        } else if (in[0]) {
          est_ids[b[0] - b[1]] = c;
        }
        zone[c] = in[1] ? 1 : in[0] ? 2 : 0;
      });
    }
  } else {
    // 2c'. Clusters of one ranked apart: the retrieval zone is the top
    // n_reg = n_ret - n_one of the others and the top n_one of them; the
    // estimation zone the top n_est of the rest. One round of selection
    // finds the thresholds of both classes and that of S, the top n_sel of
    // all. Where both classes' thresholds lie above S's, every retrieval
    // cluster is in S and outranks the rest of it, so that the estimation
    // zone is S less the retrieval zone, and one compaction lays out both
    // (select_zones_split's two passes, in one). Otherwise a second round
    // selects the estimation zone from what the retrieval zone left.
    const uint32_t n_reg = n_ret - z.n_one;
    auto is_one = [&](uint32_t c) { return use_smem ? (cls_s[c - sl.lo] & 1) != 0 : run.size[c] == 1; };
    // Target 0: the larger clusters; 1: the clusters of one; 2: all.
    auto keys = [&](uint32_t c, uint32_t t) {
      const uint32_t k = key(c);
      return t == 2 || (t == 1) == is_one(c) ? k : 0u;
    };
    const uint32_t ks[3] = {n_reg, z.n_one, z.n_est > 0 ? n_sel : 0u};
    radix_select<3>(sh, sl, keys, ks);
    const uint32_t th[3] = {n_reg > 0 ? sh.prefix[0] : 0xffffffffu, sh.prefix[1], sh.prefix[2]};
    // The same in every CTA of the run (the thresholds are the run's).
    const bool one_round = z.n_est > 0 && th[0] > th[2] && th[1] > th[2];
    if (one_round) {
      compact<3>(sh, sl, keys, th, ks, [&](uint32_t c, const bool (&in)[3], const uint32_t (&b)[3]) {
        if (in[0] || in[1]) {
          ret_ids[b[0] + b[1]] = take_ret(c);
        } else if (in[2]) {
          est_ids[b[2] - b[0] - b[1]] = c;
        }
        zone[c] = in[0] || in[1] ? 1 : in[2] ? 2 : 0;
      });
    } else {
      const uint32_t th2[2] = {th[0], th[1]};
      compact<2>(sh, sl, keys, th2, {n_reg, z.n_one},
                 [&](uint32_t c, const bool (&in)[2], const uint32_t (&b)[2]) {
                   if (in[0] || in[1]) {
                     ret_ids[b[0] + b[1]] = take_ret(c);
                     if (use_smem) cls_s[c - sl.lo] |= 2;
                   }
                   zone[c] = in[0] || in[1] ? 1 : 0;
                 });
      __syncthreads();  // the zones of the slice written above are read below
      if (z.n_est > 0) {
        auto in_ret = [&](uint32_t c) { return use_smem ? (cls_s[c - sl.lo] & 2) != 0 : zone[c] != 0; };
        auto rest = [&](uint32_t c, uint32_t) { return in_ret(c) ? 0u : key(c); };
        radix_select<1>(sh, sl, rest, {z.n_est});
        const uint32_t th_est[1] = {sh.prefix[0]};
        compact<1>(sh, sl, rest, th_est, {z.n_est}, [&](uint32_t c, const bool (&in)[1], const uint32_t (&b)[1]) {
          if (in[0]) {
            est_ids[b[0]] = c;
            zone[c] = 2;
          }
        });
      }
    }
  }
  // ret_ids of the slice are written (read below); the CTAs' retrieval
  // counts are complete.
  cluster_barrier();
  uint32_t ret_first = 0, ret_total = 0;  // this CTA's first entry; members of the CTAs before it
  uint32_t run_total = 0;                 // members of the run's retrieval clusters
  uint32_t cold_first = 0, run_cold = 0;  // cold clusters of the CTAs before it; of the run
  {
    uint32_t n[kSelectMaxSplit], t[kSelectMaxSplit], o[kSelectMaxSplit];
    from_ranks(&sh.ret_n, sl.n, 0u, n);
    from_ranks(&sh.ret_tokens, sl.n, 0u, t);
    from_ranks(&sh.cold_n, sl.n, 0u, o);
#pragma unroll
    for (uint32_t k = 0; k < kSelectMaxSplit; ++k) {
      if (k < sl.rank) {
        ret_first += n[k];
        ret_total += t[k];
        cold_first += o[k];
      }
      run_total += t[k];
      run_cold += o[k];
    }
  }
  const uint32_t ret_last = ret_first + sh.ret_n;
  cluster_barrier();  // every CTA has read the counts: none leaves before

  // 2e. ret_pos: exclusive prefix of the retrieval clusters' sizes, over
  //     this CTA's entries (a cold cluster's size counts 0). Cold clusters
  //     go after the run's estimation clusters, and into the report.
  uint32_t *ret_pos = out.ret_pos + run.ret_off;
  uint32_t *wants = run.wants;
  for (uint32_t base = ret_first; base < ret_last; base += kSelectThreads) {
    const uint32_t i = base + tid;
    const uint32_t id = i < ret_last ? ret_ids[i] : 0u;
    const bool cold = i < ret_last && (id & kColdCluster) != 0;
    const uint32_t sz = i < ret_last && !cold ? run.size[id] : 0u;
    uint32_t total;
    const uint32_t before = block_excl_scan<kSelectThreads>(sz, sh.tmp, &total);
    if (i < ret_last) ret_pos[i] = ret_total + before;
    ret_total += total;
    if (run.cold_pt) {  // uniform over the block
      uint32_t n_cold;
      const uint32_t at = cold_first + block_excl_scan<kSelectThreads>(cold ? 1u : 0u, sh.tmp, &n_cold);
      if (cold) {
        const uint32_t c = id & ~kColdCluster;
        if (out.est_extra) est_ids[z.n_est + at] = c;
        if (wants && at < run.want_cap) wants[2 + at] = c;
      }
      cold_first += n_cold;
    }
  }
  if (tid == 0 && sl.rank == 0) {
    out.run_tokens[r] = steady + run_total;
    if (out.est_extra) out.est_extra[r] = run_cold;
  }
  if (wants) {  // uniform over the run's CTAs
    // The ids reach the host before the count, the count before the
    // stamp that tells the host the report is this step's.
    __threadfence_system();
    cluster_barrier();
    if (tid == 0 && sl.rank == 0) {
      wants[1] = run_cold;
      __threadfence_system();
      *reinterpret_cast<volatile uint32_t *>(wants) = run.stamp;
    }
  }
}

// The selection (select_slice) of runs.clusters split over n_split CTAs a
// run. Where ctas (a device word, zero between launches) is not null, the
// last CTA to end lays out the offsets, the exclusive prefix of the runs'
// run_tokens (one launch fewer for a caller that runs the estimate beside).
__global__ void __launch_bounds__(kSelectThreads, 1) select_kernel(const DevRun *__restrict__ runs,
                                                                 uint32_t G, DevLookup out,
                                                                 float *scores, uint32_t smem_cap,
                                                                 uint32_t n_split, unsigned int *ctas) {
  extern __shared__ uint32_t keys_s[];
  __shared__ SelectShared sh;
  wait_prior_grid();
  select_slice(runs, G, out, scores, smem_cap, n_split, sh, keys_s);
  if (ctas == nullptr || !last_cta(ctas, &sh.last)) return;  // uniform over the CTA
  write_offsets<kSelectThreads>(out.run_tokens, gridDim.x / n_split, out.offsets, sh.tmp);
  if (threadIdx.x == 0) *ctas = 0;  // for the next launch, which stream order puts after this one
}

// 3. Estimate ----------------------------------------------------------------

// Partial estimates of one CTA for its GT heads: local maxima, denominators
// and numerators, and the staging of one batch of estimation clusters.
template <uint32_t D, uint32_t GT>
struct EstShared {
  float4 red[kEstThreads];
  float num[GT][D];
  float m[GT], den[GT];
  float tmp[kEstThreads / 32][GT];
  uint32_t c[kEstThreads];
  float s[kEstThreads];  // the batch's row scales (8-bit value sums)
  float w[GT][kEstThreads];
};

// Block-wide max (kMax) or sum of GT values at once; every thread gets the
// results in x. One pair of barriers for all GT.
template <uint32_t GT, bool kMax>
__device__ void block_reduce_n(float (&x)[GT], float (*tmp)[GT]) {
  constexpr uint32_t nw = kEstThreads / 32;
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (uint32_t j = 0; j < GT; ++j) {
    x[j] = kMax ? warp_max(x[j]) : warp_sum(x[j]);
    if (lane == 0) tmp[warp][j] = x[j];
  }
  __syncthreads();
#pragma unroll
  for (uint32_t j = 0; j < GT; ++j) {
    float y = tmp[0][j];
    for (uint32_t w = 1; w < nw; ++w) y = kMax ? fmaxf(y, tmp[w][j]) : y + tmp[w][j];
    x[j] = y;
  }
  __syncthreads();
}

// The lookup's last step, in the last CTA of the estimate to end (so that
// the lookup takes one launch fewer): the exclusive prefix of run_tokens
// into offsets, then the step's end (StepMark). run_tokens were written by
// the selection, which ended before the estimate began. Every thread of
// every CTA calls it as the kernel's last statement.
__device__ void end_lookup(const DevLookup &out, const LookupEnd &end) {
  __shared__ uint32_t last, tmp[32];
  if (!last_cta(end.ctas, &last)) return;  // uniform over the CTA
  write_offsets<kEstThreads>(out.run_tokens, end.R, out.offsets, tmp);
  __syncthreads();
  if (threadIdx.x != 0) return;
  *end.ctas = 0;  // for the next launch, which stream order puts after this one
  if (end.mark.done == nullptr) return;
  __threadfence_system();
  *reinterpret_cast<volatile unsigned long long *>(end.mark.done) = mark_epoch(end.mark);
}

// Four columns of a value sum row, from f32 rows, from their f16 copy, or
// from their 8-bit copy (four columns a word; unscaled: the caller weighs
// each row by its scale).
__device__ __forceinline__ float4 value_sum4(const float4 *rows, size_t i) { return __ldg(rows + i); }
__device__ __forceinline__ float4 value_sum4(const uint2 *rows, size_t i) {
  const uint2 raw = __ldg(rows + i);
  const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&raw.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&raw.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float4 value_sum4(const uint32_t *rows, size_t i) {
  float x[4];
  int8x4_to_float(__ldg(rows + i), x);
  return make_float4(x[0], x[1], x[2], x[3]);
}

// A batch's value sums weighted into this thread's accumulators: rows
// rl, rl + rows, ... of the batch's nb clusters (ids cs), the thread's
// four columns col of each, for every head of the group (weights w; from
// 8-bit rows, each row's weights times its scale sc[k]).
template <uint32_t GT, typename Row>
__device__ __forceinline__ void weigh_value_sums(const Row *vs, uint32_t cols, uint32_t col, uint32_t rl,
                                                 uint32_t rows, uint32_t nb, const uint32_t *cs, const float *sc,
                                                 const float (*w)[kEstThreads], float4 (&acc)[GT]) {
  constexpr bool kScaled = std::is_same_v<Row, uint32_t>;
#pragma unroll 8
  for (uint32_t k = rl; k < nb; k += rows) {
    const float4 v = value_sum4(vs, static_cast<size_t>(cs[k]) * cols + col);
    float s = 1.0f;
    if constexpr (kScaled) s = sc[k];
#pragma unroll
    for (uint32_t j = 0; j < GT; ++j) {
      float wk = w[j][k];
      if constexpr (kScaled) wk *= s;
      acc[j].x = fmaf(wk, v.x, acc[j].x);
      acc[j].y = fmaf(wk, v.y, acc[j].y);
      acc[j].z = fmaf(wk, v.z, acc[j].z);
      acc[j].w = fmaf(wk, v.w, acc[j].w);
    }
  }
}

// CTA (hb, split) estimates heads g0 .. g0 + GT - 1 of run r (hb = r * G /
// GT + g0 / GT) over its slice of the estimation clusters, kEstThreads
// clusters a batch: the batch's ids, sizes and the GT heads' logits are
// read once (one thread a cluster), each head's running max shift is raised
// to the batch's max, then each value sum is read once, with 16-byte loads,
// several in flight a thread, and weighted for every head (the heads of a
// group share the clusters and their value sums; a CTA per head read them
// GT times). With kSplits > 1 the kSplits CTAs of one (run, head group)
// form a thread-block cluster and rank 0 merges their partials from
// distributed shared memory.
template <uint32_t D, uint32_t kSplits, uint32_t GT>
__global__ void WKV_ESTIMATE_BOUNDS estimate_kernel(const DevRun *__restrict__ runs,
                                                               uint32_t G, DevLookup out, LookupEnd end) {
  __shared__ EstShared<D, GT> sh;
  wait_prior_grid();
  const uint32_t hb = blockIdx.x / kSplits, split = blockIdx.x % kSplits;
  const uint32_t groups = G / GT;
  const uint32_t r = hb / groups, g0 = (hb % groups) * GT, tid = threadIdx.x;
  const DevRun &run = runs[r];
  const uint32_t C = run.clusters;
  // The estimation zone, then the retrieval clusters found cold.
  const uint32_t n = clamp_zones(run).n_est + (out.est_extra ? out.est_extra[r] : 0u);
  const uint32_t chunk = (n + kSplits - 1) / kSplits;
  const uint32_t i0 = min(n, split * chunk), i1 = min(n, i0 + chunk);
  const uint32_t *ids = out.est_ids + run.est_off;
  const float *lg = out.logits + run.scratch_off + static_cast<size_t>(g0) * C;  // head g0 + j at lg + j C
  const float4 *vs = reinterpret_cast<const float4 *>(run.value_sum);
  // The 8-bit copy where the head keeps one and every row is finite (a
  // quarter of the f32 bytes and a scale a row), else the f16 copy where it
  // keeps one and no sum overflowed it (half the bytes). Every thread reads
  // the same words (only a growth's narrowing writes them, in stream order,
  // never while a step runs), so the choice is the CTA's.
  const uint32_t *vs8 = D % 32 == 0 && run.value_sum8 && *reinterpret_cast<const uint32_t *>(run.value_sum8) == 0
                            ? reinterpret_cast<const uint32_t *>(run.value_sum8 + kMeta16Header)
                            : nullptr;
  const uint2 *vs16 = !vs8 && run.value_sum16 && *reinterpret_cast<const uint32_t *>(run.value_sum16) == 0
                          ? reinterpret_cast<const uint2 *>(run.value_sum16 + kMeta16Header)
                          : nullptr;

  constexpr uint32_t kCols = D / 4, kRows = kEstThreads / kCols;
  static_assert(kRows >= 1, "a thread a four columns of a value row");
  const uint32_t col = tid % kCols, rl = tid / kCols;
  float4 acc[GT];
  float den[GT], m[GT];
#pragma unroll
  for (uint32_t j = 0; j < GT; ++j) {
    acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    den[j] = 0.f;
    m[j] = kNegInf;
  }
  for (uint32_t base = i0; base < i1; base += kEstThreads) {
    const uint32_t nb = min(kEstThreads, i1 - base);
    uint32_t c = 0;
    float l[GT], bm[GT], sz = 0.f;
#pragma unroll
    for (uint32_t j = 0; j < GT; ++j) l[j] = kNegInf;
    if (tid < nb) {
      c = ids[base + tid];
      sz = static_cast<float>(run.size[c]);
      if (vs8) sh.s[tid] = __ldg(run.value_sum8_scale + c);
#pragma unroll
      for (uint32_t j = 0; j < GT; ++j) l[j] = lg[static_cast<size_t>(j) * C + c];
    }
#pragma unroll
    for (uint32_t j = 0; j < GT; ++j) bm[j] = l[j];
    block_reduce_n<GT, true>(bm, sh.tmp);
#pragma unroll
    for (uint32_t j = 0; j < GT; ++j) {
      // A head with no weight yet keeps it: alpha and w are 0.
      const float m_new = fmaxf(m[j], bm[j]);
      const float alpha = m[j] == kNegInf || m_new == kNegInf ? 0.f : expf(m[j] - m_new);
      const float w = l[j] == kNegInf ? 0.f : expf(l[j] - m_new);
      if (tid < nb) sh.w[j][tid] = w;
      den[j] = den[j] * alpha + w * sz;  // per thread; summed at the end
      acc[j].x *= alpha;
      acc[j].y *= alpha;
      acc[j].z *= alpha;
      acc[j].w *= alpha;
      m[j] = m_new;
    }
    if (tid < nb) sh.c[tid] = c;
    __syncthreads();
    if (rl < kRows) {
      if (vs8)
        weigh_value_sums<GT>(vs8, kCols, col, rl, kRows, nb, sh.c, sh.s, sh.w, acc);
      else if (vs16)
        weigh_value_sums<GT>(vs16, kCols, col, rl, kRows, nb, sh.c, nullptr, sh.w, acc);
      else
        weigh_value_sums<GT>(vs, kCols, col, rl, kRows, nb, sh.c, nullptr, sh.w, acc);
    }
    __syncthreads();  // sh.c and sh.w are rewritten next batch
  }
  block_reduce_n<GT, false>(den, sh.tmp);
#pragma unroll
  for (uint32_t j = 0; j < GT; ++j) {
    sh.red[tid] = acc[j];
    __syncthreads();
    if (tid < kCols) {
      float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
      for (uint32_t k = 0; k < kRows; ++k) {
        const float4 v = sh.red[k * kCols + tid];
        s.x += v.x;
        s.y += v.y;
        s.z += v.z;
        s.w += v.w;
      }
      reinterpret_cast<float4 *>(sh.num[j])[tid] = s;
    }
    if (tid == 0) {
      sh.m[j] = m[j];
      sh.den[j] = den[j];
    }
    __syncthreads();  // sh.red is rewritten for the next head
  }

  // The tail (value_mean given): this CTA's share of the clusters of neither
  // zone, their value the head's mean, folded into (m, den, num) of each head.
  if (run.value_mean) {
    const uint8_t *zone = out.zones + run.scratch_off / G;
    const uint32_t cchunk = (C + kSplits - 1) / kSplits;
    const uint32_t c0 = min(C, split * cchunk), c1 = min(C, c0 + cchunk);
    // One pass, kBatch clusters a thread at a time with their loads in
    // flight together: per thread a running (max, sum of size exp(x -
    // max)) per head, merged over the block after.
    constexpr uint32_t kBatch = 4;
    float tm[GT], ts[GT];
#pragma unroll
    for (uint32_t j = 0; j < GT; ++j) tm[j] = kNegInf, ts[j] = 0.f;
    for (uint32_t base = c0 + tid; base < c1; base += kBatch * kEstThreads) {
      float sz[kBatch], x[kBatch][GT];
#pragma unroll
      for (uint32_t k = 0; k < kBatch; ++k) {
        const uint32_t c = base + k * kEstThreads;
        const bool in = c < c1 && zone[c] == 0;
        sz[k] = in ? static_cast<float>(run.size[c]) : 0.f;
#pragma unroll
        for (uint32_t j = 0; j < GT; ++j) x[k][j] = in ? lg[static_cast<size_t>(j) * C + c] : kNegInf;
      }
#pragma unroll
      for (uint32_t j = 0; j < GT; ++j) {
        float bm = x[0][j];
#pragma unroll
        for (uint32_t k = 1; k < kBatch; ++k) bm = fmaxf(bm, x[k][j]);
        if (bm == kNegInf) continue;
        float bs = 0.f;
#pragma unroll
        for (uint32_t k = 0; k < kBatch; ++k) bs += x[k][j] > kNegInf ? sz[k] * expf(x[k][j] - bm) : 0.f;
        merge_ms(tm[j], ts[j], bm, bs);
      }
    }
    // The block's (max, sum) per head: the max first, then each thread's
    // sum rescaled to it.
    float bm[GT];
#pragma unroll
    for (uint32_t j = 0; j < GT; ++j) bm[j] = tm[j];
    block_reduce_n<GT, true>(bm, sh.tmp);
#pragma unroll
    for (uint32_t j = 0; j < GT; ++j) {
      ts[j] = tm[j] > kNegInf ? ts[j] * expf(tm[j] - bm[j]) : 0.f;
      tm[j] = bm[j];
    }
    block_reduce_n<GT, false>(ts, sh.tmp);
#pragma unroll
    for (uint32_t j = 0; j < GT; ++j) {
      if (!(tm[j] > kNegInf && ts[j] > 0.f)) continue;  // uniform over the CTA
      const float m0 = sh.m[j], mm = fmaxf(m0, tm[j]);
      const float a = m0 == kNegInf ? 0.f : expf(m0 - mm), b = expf(tm[j] - mm) * ts[j];
      __syncthreads();  // every thread has read sh.m[j]
      for (uint32_t i = tid; i < D; i += kEstThreads) sh.num[j][i] = sh.num[j][i] * a + b * run.value_mean[i];
      if (tid == 0) {
        sh.m[j] = mm;
        sh.den[j] = sh.den[j] * a + b;
      }
      __syncthreads();
    }
  }

  const size_t rh0 = static_cast<size_t>(r) * G + g0;  // the first head's (run, head) index
  if constexpr (kSplits == 1) {
#pragma unroll
    for (uint32_t j = 0; j < GT; ++j) {
      const bool empty = !(sh.m[j] > kNegInf) || !(sh.den[j] > 0.f);
      const float inv = empty ? 0.f : 1.f / sh.den[j];
      float *est_out = out.est_out + (rh0 + j) * D;
      for (uint32_t i = tid; i < D; i += kEstThreads) est_out[i] = empty ? 0.f : sh.num[j][i] * inv;
      if (tid == 0) out.est_lse[rh0 + j] = empty ? kNegInf : sh.m[j] + logf(sh.den[j]);
    }
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    if (cluster.block_rank() == 0) {
      for (uint32_t j = 0; j < GT; ++j) {
        float mk[kSplits], ek[kSplits];
        float M = kNegInf;
#pragma unroll
        for (uint32_t k = 0; k < kSplits; ++k) {
          mk[k] = cluster.map_shared_rank(sh.m, k)[j];
          M = fmaxf(M, mk[k]);
        }
        float dsum = 0.f;
#pragma unroll
        for (uint32_t k = 0; k < kSplits; ++k) {
          ek[k] = mk[k] == kNegInf || M == kNegInf ? 0.f : expf(mk[k] - M);
          dsum = fmaf(cluster.map_shared_rank(sh.den, k)[j], ek[k], dsum);
        }
        const bool empty = !(M > kNegInf) || !(dsum > 0.f);
        const float inv = empty ? 0.f : 1.f / dsum;
        float *est_out = out.est_out + (rh0 + j) * D;
        for (uint32_t i = tid; i < D; i += kEstThreads) {
          float v = 0.f;
#pragma unroll
          for (uint32_t k = 0; k < kSplits; ++k) v = fmaf(cluster.map_shared_rank(&sh.num[j][0], k)[i], ek[k], v);
          est_out[i] = empty ? 0.f : v * inv;
        }
        if (tid == 0) out.est_lse[rh0 + j] = empty ? kNegInf : M + logf(dsum);
      }
    }
    cluster.sync();  // keeps every CTA's shared memory alive until rank 0 is done
#endif
  }
  if (end.ctas) end_lookup(out, end);
}

// 4. Offsets -----------------------------------------------------------------

__global__ void __launch_bounds__(kOffsetThreads) offsets_kernel(const uint32_t *__restrict__ run_tokens,
                                                                 uint32_t R, int32_t *offsets, StepMark mark) {
  __shared__ uint32_t tmp[32];
  wait_prior_grid();
  write_offsets<kOffsetThreads>(run_tokens, R, offsets, tmp);
  signal_step_end(mark);
}

// Whether fn was compiled for the architecture `arch` (80 for sm_80) or
// later, not JIT-compiled from older PTX: clusters need 90 (built_for_clusters),
// cp.async 80.
bool built_for(const void *fn, int arch) {
  cudaFuncAttributes fa{};
  if (cudaFuncGetAttributes(&fa, fn) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return fa.ptxVersion >= arch;
}
bool built_for_clusters(const void *fn) { return built_for(fn, 90); }

// select_kernel's dynamic shared memory for slices of up to `cap` clusters:
// a key and a class byte each.
constexpr size_t select_smem(uint32_t cap) { return static_cast<size_t>(cap) * (sizeof(uint32_t) + 1); }

// The current device's multiprocessors (asked once per device).
uint32_t multiprocessors() {
  static std::atomic<uint32_t> known[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    (void)cudaGetLastError();
    return 132;
  }
  uint32_t n = known[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || v <= 0) {
      (void)cudaGetLastError();
      v = 132;
    }
    n = static_cast<uint32_t>(v);
    known[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Raises fn's dynamic shared memory limit to `bytes` (once per device).
cudaError_t ensure_smem(const void *fn, size_t bytes, std::atomic<uint64_t> *done) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return set_func_attribute_once(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes), done);
}

// Whether fn may be launched in clusters of 16 CTAs on the current device
// (asked once per device; a refusal is remembered in `refused`).
bool allow_wide_clusters(const void *fn, std::atomic<uint64_t> *done, std::atomic<uint64_t> *refused) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    (void)cudaGetLastError();
    return false;
  }
  const uint64_t bit = uint64_t(1) << dev;
  if (refused->load(std::memory_order_relaxed) & bit) return false;
  if (set_func_attribute_once(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1, done) == cudaSuccess) return true;
  (void)cudaGetLastError();
  refused->fetch_or(bit, std::memory_order_relaxed);
  return false;
}

// The estimate: a CTA per (run, group of GT heads) and split, GT the
// largest of 8, 4, 2, 1 that divides G; 16 splits where 8 would leave
// multiprocessors idle (a long context and a small batch) and the device
// allows clusters of 16.
template <uint32_t D, uint32_t GT>
cudaError_t launch_estimate_gt(const DevRun *runs, uint32_t R, uint32_t G, const DevLookup &out, bool clusters_ok,
                               const LookupEnd &end, cudaStream_t s) {
  static std::atomic<uint64_t> wide_set{0}, wide_refused{0};
  const uint32_t blocks = R * (G / GT);
  if (clusters_ok && blocks * kEstSplits < multiprocessors() &&
      allow_wide_clusters(reinterpret_cast<const void *>(estimate_kernel<D, kEstWideSplits, GT>), &wide_set,
                          &wide_refused)) {
    const cudaError_t err = launch_pdl(estimate_kernel<D, kEstWideSplits, GT>, dim3(blocks * kEstWideSplits),
                                       dim3(kEstThreads), 0, s, kEstWideSplits, runs, G, out, end);
    if (err != cudaErrorInvalidClusterSize) return err;
    (void)cudaGetLastError();  // no room for clusters of 16 (a shared device): clusters of 8
  }
  if (clusters_ok)
    return launch_pdl(estimate_kernel<D, kEstSplits, GT>, dim3(blocks * kEstSplits), dim3(kEstThreads), 0, s,
                      kEstSplits, runs, G, out, end);
  return launch_pdl(estimate_kernel<D, 1, GT>, dim3(blocks), dim3(kEstThreads), 0, s, 1, runs, G, out, end);
}
template <uint32_t D>
cudaError_t launch_estimate(const DevRun *runs, uint32_t R, uint32_t G, const DevLookup &out, bool clusters_ok,
                            const LookupEnd &end, cudaStream_t s) {
  if (G % 8 == 0) return launch_estimate_gt<D, 8>(runs, R, G, out, clusters_ok, end, s);
  if (G % 4 == 0) return launch_estimate_gt<D, 4>(runs, R, G, out, clusters_ok, end, s);
  if (G % 2 == 0) return launch_estimate_gt<D, 2>(runs, R, G, out, clusters_ok, end, s);
  return launch_estimate_gt<D, 1>(runs, R, G, out, clusters_ok, end, s);
}

}  // namespace

// How many clusters of `split` select CTAs (each with the largest slice's
// shared memory) the current device holds at once: the occupancy API's
// answer, asked once per device and split; 0 where it refuses.
uint32_t select_clusters_resident(uint32_t split) {
  static std::atomic<int32_t> known[64][5];  // [device][log2 split]: the answer + 1; 0 unknown
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    (void)cudaGetLastError();
    return 0;
  }
  uint32_t lg = 0;
  while ((1u << lg) < split && lg < 4) ++lg;
  int32_t v = known[dev][lg].load(std::memory_order_relaxed);
  if (v == 0) {
    cudaLaunchConfig_t cfg{};
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = split;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3(split);
    cfg.blockDim = dim3(kSelectThreads);
    cfg.dynamicSmemBytes = select_smem(kLookupSmemClusters);
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    static std::atomic<uint64_t> smem_set{0};  // the query needs the launch's shared memory allowed
    int n = 0;
    if (ensure_smem(reinterpret_cast<const void *>(select_kernel), cfg.dynamicSmemBytes, &smem_set) != cudaSuccess ||
        cudaOccupancyMaxActiveClusters(&n, select_kernel, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();
      n = 0;
    }
    v = n + 1;
    known[dev][lg].store(v, std::memory_order_relaxed);
  }
  return static_cast<uint32_t>(v - 1);
}

namespace {
// Devices on which a split select's launch was refused (a device shared by
// limit, MIG or MPS, where the occupancy API promised a cluster and the
// launch found no room): their selections are not split again.
std::atomic<uint64_t> select_split_refused{0};

uint64_t current_device_bit() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    (void)cudaGetLastError();
    return 0;
  }
  return uint64_t(1) << dev;
}
}  // namespace

uint32_t select_split(uint32_t R, uint32_t clusters) {
  static const bool split_ok = built_for_clusters(reinterpret_cast<const void *>(select_kernel));
  static std::atomic<uint64_t> wide_set{0}, wide_refused{0};
  uint32_t split = 1;
  const uint64_t bit = current_device_bit();
  if (split_ok && bit != 0 && !(select_split_refused.load(std::memory_order_relaxed) & bit)) {
    const uint32_t sms = multiprocessors();
    // A split only where the device holds one cluster of it at all; past 8
    // (a non-portable cluster size, WKV_SELECT_MAX_SPLIT), only where the
    // device allows it and holds all R runs' clusters at once (a cluster
    // of 16 CTAs of 1024 threads takes 16 multiprocessors of one GPC), so
    // that the select stays one wave. What this returns is what
    // select_impl launches: a decode graph's key holds it.
    while (split < kSelectMaxSplit && R * split * 2 <= sms && clusters / (2 * split) >= kSelectMinSlice &&
           (split < 8 ? select_clusters_resident(split * 2) >= 1
                      : allow_wide_clusters(reinterpret_cast<const void *>(select_kernel), &wide_set, &wide_refused) &&
                            select_clusters_resident(split * 2) >= R))
      split *= 2;
  }
  return split;
}

namespace {

cudaError_t offsets_launch(const DevLookup &out, uint32_t R, const StepMark &mark, cudaStream_t s);

// 1 and 2: the logits and the selection; with ctas, the offsets too
// (select_kernel).
template <uint32_t D>
cudaError_t select_impl(const DevRun *runs, uint32_t R, uint32_t G, float scale, const float *q,
                        const DevLookup &out, float *scores, uint32_t max_clusters, uint32_t split_clusters,
                        unsigned int *ctas, cudaStream_t s) {
  static std::atomic<uint64_t> select_smem_set{0};
  if (R > 0 && max_clusters > 0) {
    // 1. Logits.
    const uint32_t tiles = (max_clusters + kLogitTile - 1) / kLogitTile;
    WKV_CUDA_TRY(launch_pdl(logits_kernel<D>, dim3(tiles, R), dim3(kLogitThreads), 0, s, 1, runs, G, scale, q,
                            out.logits));
  }
  if (R == 0) return ctas ? offsets_launch(out, 0, StepMark{}, s) : cudaSuccess;
  // 2. Scores and selection: each run split over a cluster of CTAs while
  //    that keeps slices of kSelectMinSlice clusters and the grid within
  //    one wave (a CTA per multiprocessor).
  const uint32_t split = select_split(R, split_clusters ? split_clusters : max_clusters);
  const uint32_t share = (max_clusters + split - 1) / split;
  const uint32_t cap = share < kLookupSmemClusters ? share : kLookupSmemClusters;
  WKV_CUDA_TRY(ensure_smem(reinterpret_cast<const void *>(select_kernel), select_smem(kLookupSmemClusters),
                           &select_smem_set));
  cudaError_t err = launch_pdl(select_kernel, dim3(R * split), dim3(kSelectThreads), select_smem(cap), s, split,
                               runs, G, out, scores, cap, split, ctas);
  if (err == cudaErrorInvalidClusterSize && split > 1) {
    // No room for the cluster although the occupancy API held one (a device
    // shared by limit): one CTA a run, now and from now on on this device,
    // so that select_split (a decode graph's key) says what runs.
    (void)cudaGetLastError();
    select_split_refused.fetch_or(current_device_bit(), std::memory_order_relaxed);
    const uint32_t cap1 = max_clusters < kLookupSmemClusters ? max_clusters : kLookupSmemClusters;
    err = launch_pdl(select_kernel, dim3(R), dim3(kSelectThreads), select_smem(cap1), s, 1, runs, G, out, scores,
                     cap1, 1u, ctas);
  }
  return err;
}

// 3. The estimate; where end has a CTA counter, its last CTA lays out the
//    offsets and ends the step.
template <uint32_t D>
cudaError_t estimate_impl(const DevRun *runs, uint32_t R, uint32_t G, const DevLookup &out, const LookupEnd &end,
                          cudaStream_t s) {
  static const bool clusters_ok =
      built_for_clusters(reinterpret_cast<const void *>(estimate_kernel<D, kEstSplits, 1>));
  return launch_estimate<D>(runs, R, G, out, clusters_ok, end, s);
}

// 4. The offsets, and the step's end where mark has one.
cudaError_t offsets_launch(const DevLookup &out, uint32_t R, const StepMark &mark, cudaStream_t s) {
  return launch_pdl(offsets_kernel, dim3(1), dim3(kOffsetThreads), 0, s, 1,
                    static_cast<const uint32_t *>(out.run_tokens), R, out.offsets, mark);
}

template <uint32_t D>
cudaError_t lookup_impl(const DevRun *runs, uint32_t R, uint32_t G, float scale, const float *q,
                   const DevLookup &out, float *scores, uint32_t max_clusters, uint32_t split_clusters,
                   const StepMark &mark, cudaStream_t s) {
  WKV_CUDA_TRY(select_impl<D>(runs, R, G, scale, q, out, scores, max_clusters, split_clusters, nullptr, s));
  if (R > 0) {
    // The estimate's last CTA lays out the offsets and ends the step where
    // mark has a CTA counter (one launch fewer).
    const LookupEnd end{mark.ctas, R, mark};
    WKV_CUDA_TRY(estimate_impl<D>(runs, R, G, out, end, s));
    if (end.ctas) return cudaSuccess;
  }
  return offsets_launch(out, R, mark, s);
}

// lookup_zones' checks of its arguments.
cudaError_t check_lookup(const DevRun *runs, uint32_t R, uint32_t G, const float *q, const DevLookup &out,
                         const float *scores, uint32_t max_clusters) {
  if (G == 0 || G > kMaxGroup) return cudaErrorNotSupported;
  if (max_clusters > kLookupSmemClusters && scores == nullptr) return cudaErrorInvalidValue;
  if (R > 0 && (runs == nullptr || q == nullptr || out.ret_ids == nullptr || out.ret_pos == nullptr ||
                out.est_ids == nullptr || out.run_tokens == nullptr || out.est_out == nullptr ||
                out.est_lse == nullptr || (max_clusters > 0 && (out.logits == nullptr || out.zones == nullptr))))
    return cudaErrorInvalidValue;
  if (out.offsets == nullptr) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(q) % 16 != 0) return cudaErrorInvalidValue;
  return cudaSuccess;
}

}  // namespace

cudaError_t lookup_zones(const DevRun *runs, uint32_t R, uint32_t G, uint32_t d, float scale,
                    const float *q, const DevLookup &out, float *scores, uint32_t max_clusters,
                    void *stream, const StepMark &mark, uint32_t split_clusters) {
  WKV_CUDA_TRY(check_lookup(runs, R, G, q, out, scores, max_clusters));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return WKV_DISPATCH_HEAD_DIM(d, HEAD_DIM, [&]() -> cudaError_t {
    return lookup_impl<HEAD_DIM>(runs, R, G, scale, q, out, scores, max_clusters, split_clusters, mark, s);
  });
}

cudaError_t lookup_select(const DevRun *runs, uint32_t R, uint32_t G, uint32_t d, float scale, const float *q,
                          const DevLookup &out, float *scores, uint32_t max_clusters, unsigned int *ctas,
                          void *stream, uint32_t split_clusters) {
  WKV_CUDA_TRY(check_lookup(runs, R, G, q, out, scores, max_clusters));
  if (ctas == nullptr) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return WKV_DISPATCH_HEAD_DIM(d, HEAD_DIM, [&]() -> cudaError_t {
    return select_impl<HEAD_DIM>(runs, R, G, scale, q, out, scores, max_clusters, split_clusters, ctas, s);
  });
}

cudaError_t lookup_estimate(const DevRun *runs, uint32_t R, uint32_t G, uint32_t d, const DevLookup &out,
                            void *stream) {
  if (G == 0 || G > kMaxGroup) return cudaErrorNotSupported;
  if (R == 0) return cudaSuccess;
  if (runs == nullptr || out.est_ids == nullptr || out.est_out == nullptr || out.est_lse == nullptr ||
      out.logits == nullptr || out.zones == nullptr)
    return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return WKV_DISPATCH_HEAD_DIM(d, HEAD_DIM, [&]() -> cudaError_t {
    return estimate_impl<HEAD_DIM>(runs, R, G, out, LookupEnd{nullptr, R, StepMark{}}, s);
  });
}

}  // namespace wkv::kernels
