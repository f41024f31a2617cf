// Device k-means over a batch of segments, and the page writes that follow
// it. The algorithm is kmeans_segment's (kernels/cpu_kernels.cpp); see
// kmeans_cuda.hpp for the contract.
//
// One batch runs as a fixed sequence of launches on one stream:
//   1. descriptors to the device (by value through kernel parameters, so no
//      host copy is enqueued and the call can be captured in a graph);
//   2. the mean key of every segment (double partials, then a fixed-order
//      sum), and the centered, normalised keys X as f16 rows;
//   3. k initial directions per segment: X rows at k distinct positions
//      drawn by a seeded permutation of [0, T);
//   4. `iters` rounds of
//        assign  argmax over the directions of every point,
//        order   a stable counting sort per segment (bucket_kernel): the
//                count and start of each cluster and its members, ascending
//                by token (where k is too large for its shared-memory table,
//                the assignment emits sort keys (segment, cluster) and
//                counts, and a radix sort and a scan of the whole batch give
//                the same),
//        update  normalised member sums (not after the last assignment);
//      a segment whose assignment stopped changing skips the products and
//      the update (kmeans_segment stops there too: it is a fixed point);
//   5. compaction: renumbering without empty clusters, begin, order, size,
//      and the centroids and value sums from the original rows (double);
//   6. split_outliers (kernels/cpu_kernels.hpp): each member's distance to
//      its centroid, the clusters' spread, the outliers split off as
//      clusters of one, and the segment's value total (split_kernel, one CTA
//      per segment).
// Sums run one warp per cluster; a cluster of more than kBigCluster members
// (repeated tokens) is listed and summed by a whole CTA instead.
//
// Cost on an H100 (S = 128 segments of 8192 tokens, d = 128, k = 512, 10
// rounds, random keys: 6.06 ms; ncu per kernel, tools/gpu-check.sh profile):
// the assignment is 70% of it (0.42 ms a round, ~330 TFLOP/s on mma.sync);
// the update 0.10 ms a round (bandwidth bound, reading X); the fixed passes
// (mean, normalisation, centroids) 0.7 ms; the counting sort and the gaps
// between launches 0.16 ms in all (the radix sort and scan it replaced took
// 0.05 ms a round: the batch took 6.53 ms with them). A wgmma
// (sm_90a) assignment is the next step if it must go faster. The kCublas
// path measured 23 ms: its [T][k] f32 scores cross device memory twice a
// round.
//
// Determinism: nothing is summed by float atomics. Counts are integer
// atomics; every float sum runs in a fixed order (sorted members, fixed
// shuffle patterns), so a seed and an input give the same bits on one GPU
// model.
//
// Precision: X and the directions are f16. They are unit vectors, so f16's
// 11-bit significand (finer than bf16's 8 bits at the same cost) holds them
// to 2^-12; dot products accumulate in f32. Near-ties may resolve
// differently from the CPU's f32 products, which changes no guarantee.
//
// Workspace layout (each region 256-byte aligned, in this order), for S
// segments, Tm = largest T, Km = largest k, N = sum of T, R = rounds:
//   segs      [S] DevSeg
//   mean_part [S][ceil(Tm / kMeanRows)][d] double
//   mean      [S][d] float
//   x         [S][Tm][d] f16, row (s, i) at s * Tm + i (rows >= T zero)
//   dirs      [S][Km][d] f16 (rows >= k zero)
//   assign    [S][Tm] uint32
//   flags     [R][S] uint32: round r changed segment s's assignment
//   keys0/1, vals0/1 [N] uint32: sort double buffers (key s * Km + c,
//             value s * Tm + i), segment s at tok_off[s]
//   counts    [S][Km] uint32, then the big-cluster list's length
//   starts, renum, big [S][Km] uint32 (big: clusters summed by a CTA)
//   cub       radix sort / scan temporary storage
//   resid     [N] double: squared distance of each member to its centroid,
//             by position in `order` (split_kernel)
//   order2    [N] uint32: the order being rebuilt (split_kernel)
//   flags2    [N] uint8: members split off (split_kernel)
//   changed   [S][K] uint8: clusters that lost members (split_kernel)
//   scores    kCublas only: [chunk][Tm][Km] float
#include "kernels/kmeans_cuda.hpp"

#include <cublas_v2.h>  // types and declarations only: the library is loaded at first use
#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <cub/cub.cuh>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cuda_common.cuh"
#include "kernels/kmeans_init.hpp"

namespace wkv::kernels {
namespace {

constexpr uint32_t kMeanRows = 512;    // rows per mean partial
constexpr uint32_t kNormRows = 64;     // rows per CTA of the normalisation
constexpr uint32_t kSegsPerUpload = 48;

// A segment as the kernels see it.
struct DevSeg {
  const void *keys;
  const void *values;
  uint32_t T;        // tokens
  uint32_t k;        // clamped cluster count
  uint32_t tok_off;  // first entry in order / sort buffers
  uint32_t clu_off;  // first cluster slot in the outputs
  uint64_t seed;
  uint32_t cap;      // outliers it may have (split_outliers)
  float ratio;       // split_outliers's ratio
};

struct SegUpload {
  DevSeg seg[kSegsPerUpload];
};

__global__ void upload_segs_kernel(const __grid_constant__ SegUpload u, uint32_t n, DevSeg *dst) {
  if (threadIdx.x < n) dst[threadIdx.x] = u.seg[threadIdx.x];
}

bool head_dim_ok(uint32_t d) { return d == 64 || d == 80 || d == 96 || d == 128 || d == 256; }

inline size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

uint32_t clamp_k(uint32_t k, uint32_t T) { return kmeans_clamp_k(k, T); }

uint32_t bit_width(uint64_t x) {
  uint32_t b = 0;
  while (x) ++b, x >>= 1;
  return b;
}

// The workspace regions for one shape.
struct Layout {
  size_t segs, mean_part, mean, x, dirs, assign, flags, keys0, keys1, vals0, vals1;
  size_t counts, starts, renum, big, cub, scores, resid, order2, flags2, changed, total;
  size_t cub_bytes;
  uint32_t nchunk, rounds, score_chunk;
};

cudaError_t cub_temp_bytes(uint64_t n_items, uint64_t n_clusters, int end_bit, size_t *bytes) {
  size_t sort_bytes = 0, scan_bytes = 0;
  cub::DoubleBuffer<uint32_t> k(nullptr, nullptr), v(nullptr, nullptr);
  WKV_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, k, v,
                                                 static_cast<int>(n_items), 0, end_bit));
  WKV_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<uint32_t *>(nullptr),
                                               static_cast<uint32_t *>(nullptr),
                                               static_cast<int>(n_clusters)));
  *bytes = std::max(sort_bytes, scan_bytes);
  return cudaSuccess;
}

cudaError_t make_layout(const KMeansBatchParams &p, const KMeansBatchShape &sh, int end_bit, Layout *L) {
  const uint64_t S = sh.segments, Tm = sh.max_tokens, Km = sh.max_clusters, N = sh.total_tokens;
  const uint64_t d = p.head_dim;
  if (S == 0 || Tm == 0 || Km == 0 || N == 0)
    return cudaErrorInvalidValue;
  if (Tm > kKMeansMaxTokens || Km > Tm)
    return cudaErrorInvalidValue;
  if (S > 65535 || N > (1ull << 31) - 1 || S * Km > (1ull << 31) - 1 || S * Tm > 0xffffffffull)
    return cudaErrorInvalidValue;
  L->nchunk = static_cast<uint32_t>((Tm + kMeanRows - 1) / kMeanRows);
  L->rounds = std::max<uint32_t>(p.iters, 1);
  WKV_CUDA_TRY(cub_temp_bytes(N, S * Km, end_bit, &L->cub_bytes));
  size_t off = 0;
  auto take = [&](size_t bytes) {
    size_t at = off;
    off += align256(bytes);
    return at;
  };
  L->segs = take(S * sizeof(DevSeg));
  L->mean_part = take(S * L->nchunk * d * sizeof(double));
  L->mean = take(S * d * sizeof(float));
  L->x = take(S * Tm * d * 2);
  L->dirs = take(S * Km * d * 2);
  L->assign = take(S * Tm * 4);
  L->flags = take(uint64_t(L->rounds) * S * 4);
  L->keys0 = take(N * 4);
  L->keys1 = take(N * 4);
  L->vals0 = take(N * 4);
  L->vals1 = take(N * 4);
  L->counts = take((S * Km + 1) * 4);  // + the big-cluster list's length
  L->starts = take(S * Km * 4);
  L->renum = take(S * Km * 4);
  L->big = take(S * Km * 4);
  L->cub = take(L->cub_bytes);
  L->resid = take(N * sizeof(double));
  L->order2 = take(N * 4);
  L->flags2 = take(N);
  L->changed = take(S * std::max(sh.max_out, sh.max_clusters));
  L->score_chunk = 0;
  L->scores = off;
  if (p.assign == KMeansAssign::kCublas) {
    const uint64_t one = Tm * Km * 4;
    L->score_chunk = static_cast<uint32_t>(std::clamp<uint64_t>(p.score_bytes / one, 1, S));
    L->scores = take(L->score_chunk * one);
  }
  L->total = off;
  return cudaSuccess;
}

// Device helpers --------------------------------------------------------------



// Elements e .. e + 3 (e a multiple of 4) of a row array as floats, in one
// 8-byte (16-bit types) or 16-byte (f32) load. Rows of d elements, d a
// multiple of 16, keep every such group aligned.
template <typename T> __device__ __forceinline__ float4 load4(const void *base, size_t e);
template <> __device__ __forceinline__ float4 load4<float>(const void *base, size_t e) {
  return __ldg(reinterpret_cast<const float4 *>(static_cast<const float *>(base) + e));
}
template <> __device__ __forceinline__ float4 load4<f16>(const void *base, size_t e) {
  const uint2 u = __ldg(reinterpret_cast<const uint2 *>(static_cast<const __half *>(base) + e));
  __half2 a, b;
  memcpy(&a, &u.x, 4);
  memcpy(&b, &u.y, 4);
  const float2 fa = __half22float2(a), fb = __half22float2(b);
  return make_float4(fa.x, fa.y, fb.x, fb.y);
}
template <> __device__ __forceinline__ float4 load4<bf16>(const void *base, size_t e) {
  const uint2 u = __ldg(reinterpret_cast<const uint2 *>(static_cast<const __nv_bfloat16 *>(base) + e));
  __nv_bfloat162 a, b;
  memcpy(&a, &u.x, 4);
  memcpy(&b, &u.y, 4);
  const float2 fa = __bfloat1622float2(a), fb = __bfloat1622float2(b);
  return make_float4(fa.x, fa.y, fb.x, fb.y);
}

// (v, i) ranks above (bv, bi): larger value, then lower index.
__device__ __forceinline__ bool better(float v, uint32_t i, float bv, uint32_t bi) {
  return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// 2. Mean and normalisation ----------------------------------------------------

// Partial column sums (double) of kMeanRows rows: part[s][chunk][d]. Each
// thread sums 4 columns of every kRows-th row.
template <typename T, int D>
__global__ void __launch_bounds__(256) mean_partial_kernel(const DevSeg *segs, uint32_t nchunk,
                                                           double *part) {
  constexpr int kGroups = D / 4;          // 4-column groups per row
  constexpr int kRows = 256 / kGroups;    // rows per pass
  constexpr int kActive = kRows * kGroups;
  __shared__ double red[kRows][D];
  const uint32_t s = blockIdx.y, chunk = blockIdx.x;
  const uint32_t Tn = segs[s].T;
  const void *keys = segs[s].keys;
  const int t = threadIdx.x, g = t % kGroups, r0 = t / kGroups;
  double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
  const uint32_t rb = chunk * kMeanRows;
  if (t < kActive && rb < Tn) {
    const uint32_t re = min(Tn, rb + kMeanRows);
#pragma unroll 4
    for (uint32_t r = rb + r0; r < re; r += kRows) {
      const float4 v = load4<T>(keys, size_t(r) * D + 4 * g);
      a0 += v.x;
      a1 += v.y;
      a2 += v.z;
      a3 += v.w;
    }
  }
  if (t < kActive) {
    red[r0][4 * g] = a0;
    red[r0][4 * g + 1] = a1;
    red[r0][4 * g + 2] = a2;
    red[r0][4 * g + 3] = a3;
  }
  __syncthreads();
  for (int j = t; j < D; j += 256) {
    double sum = 0.0;
#pragma unroll
    for (int q = 0; q < kRows; ++q) sum += red[q][j];
    part[(size_t(s) * nchunk + chunk) * D + j] = sum;
  }
}

template <int D>
__global__ void mean_final_kernel(const DevSeg *segs, uint32_t nchunk, const double *part, float *mean) {
  const uint32_t s = blockIdx.x;
  for (int j = threadIdx.x; j < D; j += blockDim.x) {
    double sum = 0.0;
    for (uint32_t c = 0; c < nchunk; ++c) sum += part[(size_t(s) * nchunk + c) * D + j];
    mean[size_t(s) * D + j] = static_cast<float>(sum / segs[s].T);
  }
}

// x[s][i] = (key_i - mean) / |key_i - mean| as f16 (zero for a zero vector,
// and for the padding rows T <= i < Tm). One warp per row, 4 columns per
// lane and step.
template <typename T, int D>
__global__ void __launch_bounds__(256) normalize_kernel(const DevSeg *segs, const float *mean, uint32_t Tm,
                                                        __half *x) {
  constexpr int G = D / 4, Q = (G + 31) / 32;
  __shared__ float4 m[G];
  const uint32_t s = blockIdx.y;
  for (int g = threadIdx.x; g < G; g += blockDim.x) m[g] = reinterpret_cast<const float4 *>(mean + size_t(s) * D)[g];
  __syncthreads();
  const uint32_t Tn = segs[s].T;
  const void *keys = segs[s].keys;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (uint32_t r = blockIdx.x * kNormRows + warp; r < min(Tm, (blockIdx.x + 1) * kNormRows); r += 8) {
    uint2 *dst = reinterpret_cast<uint2 *>(x + (size_t(s) * Tm + r) * D);
    float4 v[Q];
    float n2 = 0.f;
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      const int g = lane + 32 * q;
      v[q] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (g < G && r < Tn) {
        const float4 k = load4<T>(keys, size_t(r) * D + 4 * g), mu = m[g];
        v[q] = make_float4(k.x - mu.x, k.y - mu.y, k.z - mu.z, k.w - mu.w);
      }
      n2 += v[q].x * v[q].x + v[q].y * v[q].y + v[q].z * v[q].z + v[q].w * v[q].w;
    }
    n2 = warp_sum(n2);
    const float inv = n2 > 0.f ? 1.f / sqrtf(n2) : 0.f;
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      const int g = lane + 32 * q;
      if (g < G) {
        const __half2 a = __floats2half2_rn(v[q].x * inv, v[q].y * inv);
        const __half2 b = __floats2half2_rn(v[q].z * inv, v[q].w * inv);
        uint2 u;
        memcpy(&u.x, &a, 4);
        memcpy(&u.y, &b, 4);
        dst[g] = u;
      }
    }
  }
}

// 3. Initial directions: dirs[s][c] = x[s][perm(c)] for c < k, zero above.
// One thread per 16-byte chunk.
template <int D>
__global__ void init_dirs_kernel(const DevSeg *segs, const __half *x, uint32_t Tm, uint32_t Km,
                                 uint64_t n_chunks, __half *dirs) {
  constexpr uint32_t CH = D / 8;
  const uint64_t q = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (q >= n_chunks) return;
  const uint32_t cid = static_cast<uint32_t>(q / CH), ch = static_cast<uint32_t>(q % CH);
  const uint32_t s = cid / Km, c = cid % Km;
  int4 val = make_int4(0, 0, 0, 0);
  if (c < segs[s].k) {
    const uint32_t i = seeded_perm(c, segs[s].T, segs[s].seed);
    val = reinterpret_cast<const int4 *>(x + (size_t(s) * Tm + i) * D)[ch];
  }
  reinterpret_cast<int4 *>(dirs + size_t(cid) * D)[ch] = val;
}

// 4. Assignment -----------------------------------------------------------------

// What an assignment writes for each point.
struct AssignOut {
  uint32_t *assign;  // [S][Tm]
  uint32_t *flags;   // [R][S]
  uint32_t *counts;  // [S][Km]; with keys and vals, only for the radix sort
  uint32_t *keys;    // [N], or null: bucket_kernel orders the points
  uint32_t *vals;    // [N]
};

// Records point i of segment s going to cluster a.
__device__ __forceinline__ void emit(const AssignOut &o, uint32_t s, uint32_t i, uint32_t a, uint32_t Tm,
                                     uint32_t Km, uint32_t S, uint32_t tok_off, uint32_t round) {
  const uint32_t g = s * Tm + i;
  if (round == 0 || o.assign[g] != a) o.flags[round * S + s] = 1;
  o.assign[g] = a;
  if (o.keys) {
    atomicAdd(&o.counts[s * Km + a], 1u);
    o.keys[tok_off + i] = s * Km + a;
    o.vals[tok_off + i] = g;
  }
}

// A converged segment (its previous round changed nothing) keeps its
// assignment: the rows are re-emitted for this round's sort.
__device__ __forceinline__ bool converged(const uint32_t *flags, uint32_t S, uint32_t s, uint32_t round) {
  return round > 0 && flags[(round - 1) * S + s] == 0;
}

template <int D> struct FusedCfg {
  static constexpr int BM = 128;                 // points per CTA
  static constexpr int BN = D > 128 ? 64 : 128;  // directions per tile
  static constexpr int WN = BN / 2;              // directions per warp (8 warps: 4 x 2)
  static constexpr int NT = WN / 8;              // n8 tiles per warp
  static constexpr int LDS = D + 8;              // smem row pitch (halves): ldmatrix without conflicts
  static constexpr int CH = D / 8;               // 16-byte chunks per row
  static constexpr size_t kSmem = size_t(BM + 2 * BN) * LDS * sizeof(__half);
  static constexpr int kMinBlocks = D > 128 ? 1 : 2;
};

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void *smem) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Fused assignment: a CTA holds 128 points of one segment in shared memory
// and streams the segment's directions past them in double-buffered tiles;
// tensor cores (mma.sync m16n8k16, f16 in, f32 accumulate) give the dot
// products and each thread keeps the running argmax of its 4 rows. Warps
// are 4 (rows) x 2 (directions); the two halves meet in shared memory.
// Directions are visited in ascending order within each thread, and every
// merge prefers the lower index on equal values: ties go to the lower index.
template <int D>
__global__ void __launch_bounds__(256, FusedCfg<D>::kMinBlocks)
    assign_fused_kernel(const DevSeg *segs, const __half *x, const __half *dirs, uint32_t Tm, uint32_t Km,
                        uint32_t S, uint32_t round, AssignOut o) {
  using C = FusedCfg<D>;
  const uint32_t s = blockIdx.y;
  const uint32_t Tn = segs[s].T, k = segs[s].k, tok_off = segs[s].tok_off;
  const uint32_t row0 = blockIdx.x * C::BM;
  if (row0 >= Tn) return;
  const int tid = threadIdx.x;
  if (converged(o.flags, S, s, round)) {
    if (tid < C::BM && row0 + tid < Tn)
      emit(o, s, row0 + tid, o.assign[s * Tm + row0 + tid], Tm, Km, S, tok_off, round);
    return;
  }
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half *sA = reinterpret_cast<__half *>(smem_raw);
  __half *sB = sA + C::BM * C::LDS;
  __shared__ float red_v[C::BM];
  __shared__ uint32_t red_i[C::BM];
  const int lane = tid & 31, warp = tid >> 5, wm = warp & 3, wn = warp >> 2;

  const __half *xs = x + size_t(s) * Tm * D;
  for (int q = tid; q < C::BM * C::CH; q += 256) {
    const int r = q / C::CH, c = q % C::CH;
    const bool v = row0 + r < Tn;
    cp_async16(sA + r * C::LDS + c * 8, xs + size_t(v ? row0 + r : 0) * D + c * 8, v);
  }
  const __half *ds = dirs + size_t(s) * Km * D;
  auto load_tile = [&](int tile, int buf) {
    __half *dst = sB + buf * C::BN * C::LDS;
    for (int q = tid; q < C::BN * C::CH; q += 256) {
      const int r = q / C::CH, c = q % C::CH;
      const uint32_t col = tile * C::BN + r;
      const bool v = col < k;
      cp_async16(dst + r * C::LDS + c * 8, ds + size_t(v ? col : 0) * D + c * 8, v);
    }
  };
  const int ntiles = (k + C::BN - 1) / C::BN;
  load_tile(0, 0);
  cp_async_commit();

  float best[4];
  uint32_t bidx[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) best[j] = -INFINITY, bidx[j] = 0;

  for (int t = 0; t < ntiles; ++t) {
    if (t + 1 < ntiles) {
      load_tile(t + 1, (t + 1) & 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const __half *b = sB + (t & 1) * C::BN * C::LDS;
    float acc[2][C::NT][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < C::NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
        ldmatrix_x4(a[mi], sA + (wm * 32 + mi * 16 + (lane & 15)) * C::LDS + kk * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int nj = 0; nj < C::NT / 2; ++nj) {
        uint32_t r[4];
        ldmatrix_x4(r, b + (wn * C::WN + nj * 16 + (lane & 7) + ((lane >> 4) << 3)) * C::LDS + kk * 16 +
                           ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          mma16816(acc[mi][2 * nj], a[mi], r[0], r[1]);
          mma16816(acc[mi][2 * nj + 1], a[mi], r[2], r[3]);
        }
      }
    }
    // Fragment layout: acc[mi][ni][h * 2 + e] is row wm*32 + mi*16 + h*8 +
    // lane/4, column wn*WN + ni*8 + 2*(lane%4) + e of the tile.
    const uint32_t cbase = t * C::BN + wn * C::WN + 2 * (lane & 3);
#pragma unroll
    for (int ni = 0; ni < C::NT; ++ni)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint32_t col = cbase + ni * 8 + e;
        if (col < k) {
#pragma unroll
          for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float v = acc[mi][ni][h * 2 + e];
              if (v > best[mi * 2 + h]) best[mi * 2 + h] = v, bidx[mi * 2 + h] = col;
            }
        }
      }
    __syncthreads();  // the buffer of tile t is refilled next iteration
  }
  // Merge the 4 lanes of a row, then the two column halves.
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best[j], off);
      const uint32_t oi = __shfl_xor_sync(0xffffffffu, bidx[j], off);
      if (better(ov, oi, best[j], bidx[j])) best[j] = ov, bidx[j] = oi;
    }
  if (wn == 1 && (lane & 3) == 0) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = wm * 32 + (j >> 1) * 16 + (j & 1) * 8 + (lane >> 2);
      red_v[row] = best[j];
      red_i[row] = bidx[j];
    }
  }
  __syncthreads();
  if (wn == 0 && (lane & 3) == 0) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = wm * 32 + (j >> 1) * 16 + (j & 1) * 8 + (lane >> 2);
      uint32_t a = bidx[j];
      if (better(red_v[row], red_i[row], best[j], bidx[j])) a = red_i[row];
      if (row0 + row < Tn) emit(o, s, row0 + row, a, Tm, Km, S, tok_off, round);
    }
  }
}

// Ordering the points by cluster ----------------------------------------------------

// A stable counting sort of one segment's assignment per CTA, in place of a
// radix sort of the whole batch: the same counts, starts and member order
// (ascending by token within a cluster), without the sort's passes over
// device memory. Warp w takes the w-th contiguous share of the tokens and
// counts its members per cluster in its row of a [warps][Km] table; a scan
// down the warps and one across the clusters turn the table into each
// warp's first position per cluster; the warps then place their tokens in
// order (lanes with equal clusters ranked by __match_any_sync). A converged
// segment keeps the previous round's order, which is its own to keep.
constexpr int kBucketWarps = 32;
constexpr size_t kBucketSmemMax = 200 * 1024;
inline size_t bucket_smem(uint32_t Km) { return size_t(kBucketWarps + 1) * Km * sizeof(uint32_t); }

__global__ void __launch_bounds__(kBucketWarps * 32)
    bucket_kernel(const DevSeg *segs, const uint32_t *assign, const uint32_t *flags, uint32_t Tm, uint32_t Km,
                  uint32_t S, uint32_t round, uint32_t *counts, uint32_t *starts, uint32_t *sorted,
                  uint32_t *big_n) {
  constexpr int kThreads = kBucketWarps * 32;
  using Scan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  extern __shared__ uint32_t bucket_smem_raw[];
  const uint32_t s = blockIdx.x;
  if (s == 0 && threadIdx.x == 0) *big_n = 0;  // the update's big-cluster list, per round
  if (converged(flags, S, s, round)) return;
  uint32_t *tab = bucket_smem_raw, *tot = bucket_smem_raw + kBucketWarps * Km;
  const uint32_t T = segs[s].T, tok_off = segs[s].tok_off;
  const uint32_t tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  for (uint32_t q = tid; q < kBucketWarps * Km; q += kThreads) tab[q] = 0;
  __syncthreads();
  const uint32_t share = ((T + kBucketWarps - 1) / kBucketWarps + 31) & ~31u;
  const uint32_t lo = min(T, w * share), hi = min(T, lo + share);
  const uint32_t *as = assign + size_t(s) * Tm;
  uint32_t *row = tab + w * Km;
  // 1. Members per (warp, cluster).
  for (uint32_t b = lo; b < hi; b += 32) {
    const uint32_t i = b + lane;
    const bool v = i < hi;
    const uint32_t a = v ? as[i] : 0xffffffffu;
    const uint32_t m = __match_any_sync(0xffffffffu, a);
    if (v && __ffs(m) - 1 == static_cast<int>(lane)) row[a] += __popc(m);
    __syncwarp();
  }
  __syncthreads();
  // 2. Down the warps: each warp's offset within its cluster; the counts.
  for (uint32_t c = tid; c < Km; c += kThreads) {
    uint32_t run = 0;
    for (int j = 0; j < kBucketWarps; ++j) {
      const uint32_t n = tab[j * Km + c];
      tab[j * Km + c] = run;
      run += n;
    }
    tot[c] = run;
    counts[size_t(s) * Km + c] = run;
  }
  __syncthreads();
  // 3. Across the clusters: starts (clusters >= k are empty and start at
  //    the segment's end), then every warp's first position per cluster.
  const uint32_t per = (Km + kThreads - 1) / kThreads;
  const uint32_t c0 = min(Km, tid * per), c1 = min(Km, c0 + per);
  uint32_t local = 0;
  for (uint32_t c = c0; c < c1; ++c) local += tot[c];
  uint32_t before;
  Scan(scan_tmp).ExclusiveSum(local, before);
  for (uint32_t c = c0; c < c1; ++c) {
    const uint32_t n = tot[c];
    tot[c] = tok_off + before;
    before += n;
  }
  __syncthreads();
  for (uint32_t c = tid; c < Km; c += kThreads) {
    const uint32_t st = tot[c];
    starts[size_t(s) * Km + c] = st;
    for (int j = 0; j < kBucketWarps; ++j) tab[j * Km + c] += st;
  }
  __syncthreads();
  // 4. Every warp places its tokens in order.
  for (uint32_t b = lo; b < hi; b += 32) {
    const uint32_t i = b + lane;
    const bool v = i < hi;
    const uint32_t a = v ? as[i] : 0xffffffffu;
    const uint32_t m = __match_any_sync(0xffffffffu, a);
    if (v) sorted[row[a] + __popc(m & ((1u << lane) - 1))] = s * Tm + i;
    __syncwarp();
    if (v && __ffs(m) - 1 == static_cast<int>(lane)) row[a] += __popc(m);
    __syncwarp();
  }
}

// cuBLAS path: argmax of score rows [Tm][Km] of segments s0.., one warp per
// point.
__global__ void argmax_scores_kernel(const DevSeg *segs, const float *scores, uint32_t s0, uint32_t n_segs,
                                     uint32_t Tm, uint32_t Km, uint32_t S, uint32_t round, AssignOut o) {
  const uint64_t w = (uint64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (w >= uint64_t(n_segs) * Tm) return;
  const uint32_t sl = static_cast<uint32_t>(w / Tm), i = static_cast<uint32_t>(w % Tm), s = s0 + sl;
  if (i >= segs[s].T) return;
  const uint32_t k = segs[s].k;
  const float *row = scores + (size_t(sl) * Tm + i) * Km;
  float best = -INFINITY;
  uint32_t bi = 0;
  for (uint32_t c = lane; c < k; c += 32) {
    const float v = row[c];
    if (v > best) best = v, bi = c;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, off);
    const uint32_t oi = __shfl_xor_sync(0xffffffffu, bi, off);
    if (better(ov, oi, best, bi)) best = ov, bi = oi;
  }
  if (lane == 0) emit(o, s, i, bi, Tm, Km, S, segs[s].tok_off, round);
}

// Update: direction of cluster (s, c) = normalised sum of its members' x
// rows in sorted (ascending token) order. Empty and zero-sum clusters, and
// clusters of segments whose last assignment changed nothing, keep theirs.
// One warp per cluster; a cluster of more than kBigCluster members goes on
// a list for update_big_kernel, which spreads it over a CTA, so that one
// huge cluster (repeated tokens) does not serialise the round.

template <int D> struct Vec4 {
  static constexpr int G = D / 4;             // 4-element groups per row
  static constexpr int Q = (G + 31) / 32;     // groups per lane
};

// acc += rows mem[b .. e) of x, lane's groups; in member order.
template <int D>
__device__ __forceinline__ void sum_x_rows(const __half *x, const uint32_t *mem, uint32_t b, uint32_t e, int lane,
                                           float4 (&acc)[Vec4<D>::Q]) {
  using V = Vec4<D>;
  auto add = [&](uint32_t row) {
#pragma unroll
    for (int q = 0; q < V::Q; ++q) {
      const int g = lane + 32 * q;
      if (g < V::G) {
        const float4 f = load4<f16>(x, size_t(row) * D + 4 * g);
        acc[q].x += f.x;
        acc[q].y += f.y;
        acc[q].z += f.z;
        acc[q].w += f.w;
      }
    }
  };
  uint32_t m = b;
  for (; m + 4 <= e; m += 4) {
    const uint32_t r0 = mem[m], r1 = mem[m + 1], r2 = mem[m + 2], r3 = mem[m + 3];
    add(r0);
    add(r1);
    add(r2);
    add(r3);
  }
  for (; m < e; ++m) add(mem[m]);
}

// Writes the normalised sum (whole warp) unless it is zero.
template <int D>
__device__ __forceinline__ void write_dir(const float4 (&acc)[Vec4<D>::Q], int lane, __half *dir) {
  using V = Vec4<D>;
  float n2 = 0.f;
#pragma unroll
  for (int q = 0; q < V::Q; ++q)
    n2 += acc[q].x * acc[q].x + acc[q].y * acc[q].y + acc[q].z * acc[q].z + acc[q].w * acc[q].w;
  n2 = warp_sum(n2);
  if (!(n2 > 0.f)) return;
  const float inv = 1.f / sqrtf(n2);
#pragma unroll
  for (int q = 0; q < V::Q; ++q) {
    const int g = lane + 32 * q;
    if (g < V::G) {
      const __half2 a = __floats2half2_rn(acc[q].x * inv, acc[q].y * inv);
      const __half2 b = __floats2half2_rn(acc[q].z * inv, acc[q].w * inv);
      uint2 u;
      memcpy(&u.x, &a, 4);
      memcpy(&u.y, &b, 4);
      reinterpret_cast<uint2 *>(dir)[g] = u;
    }
  }
}

// Clusters above this many members are summed by a whole CTA.
constexpr uint32_t kBigCluster = 256;
constexpr int kBigWarps = 16;        // warps per big-cluster CTA (update)
constexpr int kBigWarpsSums = 8;     // warps per big-cluster CTA (centroids: double partials)
constexpr unsigned kBigBlocks = 264;  // CTAs walking the big-cluster list

// Big-cluster list: *big_n clusters, ids in big_ids. Order of appends is
// not deterministic; each cluster's result is.
template <int D>
__global__ void __launch_bounds__(256) update_kernel(const DevSeg *segs, const __half *x, const uint32_t *counts,
                                                     const uint32_t *starts, const uint32_t *vals, uint32_t Km,
                                                     uint32_t S, uint32_t round, const uint32_t *flags,
                                                     uint32_t *big_n, uint32_t *big_ids, __half *dirs) {
  const uint32_t cid = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (cid >= S * Km) return;
  const uint32_t s = cid / Km, c = cid % Km;
  if (c >= segs[s].k || flags[round * S + s] == 0) return;
  const uint32_t cnt = counts[cid];
  if (cnt == 0) return;
  if (cnt > kBigCluster) {
    if (lane == 0) big_ids[atomicAdd(big_n, 1u)] = cid;
    return;
  }
  float4 acc[Vec4<D>::Q];
#pragma unroll
  for (int q = 0; q < Vec4<D>::Q; ++q) acc[q] = make_float4(0.f, 0.f, 0.f, 0.f);
  sum_x_rows<D>(x, vals + starts[cid], 0, cnt, lane, acc);
  write_dir<D>(acc, lane, dirs + size_t(cid) * D);
}

// The listed big clusters: warp w sums the w-th contiguous share of the
// members, and warp 0 adds the shares in warp order.
template <int D>
__global__ void __launch_bounds__(kBigWarps * 32) update_big_kernel(const __half *x, const uint32_t *counts,
                                                                    const uint32_t *starts, const uint32_t *vals,
                                                                    const uint32_t *big_n, const uint32_t *big_ids,
                                                                    __half *dirs) {
  using V = Vec4<D>;
  __shared__ float4 part[kBigWarps][V::G];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t n = *big_n;
  for (uint32_t b = blockIdx.x; b < n; b += gridDim.x) {
    const uint32_t cid = big_ids[b], cnt = counts[cid];
    const uint32_t lo = static_cast<uint32_t>(uint64_t(cnt) * warp / kBigWarps);
    const uint32_t hi = static_cast<uint32_t>(uint64_t(cnt) * (warp + 1) / kBigWarps);
    float4 acc[V::Q];
#pragma unroll
    for (int q = 0; q < V::Q; ++q) acc[q] = make_float4(0.f, 0.f, 0.f, 0.f);
    sum_x_rows<D>(x, vals + starts[cid], lo, hi, lane, acc);
#pragma unroll
    for (int q = 0; q < V::Q; ++q)
      if (lane + 32 * q < V::G) part[warp][lane + 32 * q] = acc[q];
    __syncthreads();
    if (warp == 0) {
#pragma unroll
      for (int q = 0; q < V::Q; ++q) {
        acc[q] = make_float4(0.f, 0.f, 0.f, 0.f);
        const int g = lane + 32 * q;
        if (g < V::G)
          for (int w = 0; w < kBigWarps; ++w) {
            const float4 p = part[w][g];
            acc[q].x += p.x;
            acc[q].y += p.y;
            acc[q].z += p.z;
            acc[q].w += p.w;
          }
      }
      write_dir<D>(acc, lane, dirs + size_t(cid) * D);
    }
    __syncthreads();
  }
}

// 5. Compaction -------------------------------------------------------------------

// One CTA per segment: renumbers the non-empty clusters in index order and
// writes n_clusters, begin and size.
__global__ void __launch_bounds__(256) finalize_kernel(const DevSeg *segs, const uint32_t *counts,
                                                       const uint32_t *starts, uint32_t Km, uint32_t *renum,
                                                       KMeansBatchOut out) {
  using Scan = cub::BlockScan<uint32_t, 256>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ uint32_t carry;
  const uint32_t s = blockIdx.x, tid = threadIdx.x;
  const DevSeg sg = segs[s];
  const size_t base = size_t(s) * Km;
  if (tid == 0) carry = 0;
  __syncthreads();
  for (uint32_t c0 = 0; c0 < sg.k; c0 += 256) {
    const uint32_t c = c0 + tid;
    const uint32_t cnt = c < sg.k ? counts[base + c] : 0;
    uint32_t ex, agg;
    Scan(tmp).ExclusiveSum(cnt > 0 ? 1u : 0u, ex, agg);
    const uint32_t o = carry + ex;
    if (c < sg.k) {
      renum[base + c] = cnt > 0 ? o : 0xffffffffu;
      if (cnt > 0) {
        out.begin[sg.clu_off + s + o] = starts[base + c] - sg.tok_off;
        out.size[sg.clu_off + o] = cnt;
      }
    }
    __syncthreads();
    if (tid == 0) carry += agg;
    __syncthreads();
  }
  const uint32_t n = carry;
  if (tid == 0) out.n_clusters[s] = n;
  for (uint32_t o = n + tid; o <= sg.k; o += 256) out.begin[sg.clu_off + s + o] = sg.T;
  for (uint32_t o = n + tid; o < sg.k; o += 256) out.size[sg.clu_off + o] = 0;
}

// order[p] = segment-local token of sorted entry p.
__global__ void order_kernel(const uint32_t *vals, uint32_t N, uint32_t Tm, uint32_t *order) {
  const uint32_t p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p < N) order[p] = vals[p] % Tm;
}

// Centroid (mean of original keys) and value sum (of original values) of
// every kept cluster, in double over the members in ascending token order;
// one warp per cluster, big clusters listed for centroid_big_kernel. Unused
// slots (c >= n_clusters) are zeroed.

// ks, vs += original key and value rows of members mem[b .. e) (slots
// s * Tm + i), lane's groups.
template <typename T, int D>
__device__ __forceinline__ void sum_kv_rows(const DevSeg &sg, const uint32_t *mem, uint32_t b, uint32_t e,
                                            uint32_t Tm, int lane, double (&ks)[Vec4<D>::Q][4],
                                            double (&vs)[Vec4<D>::Q][4]) {
  using V = Vec4<D>;
  constexpr int U = 4;  // members whose rows are loaded before any is added
  uint32_t m = b;
  for (; m < e; m += U) {
    float4 k[U][V::Q], v[U][V::Q];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t i = m + u < e ? mem[m + u] % Tm : 0;
#pragma unroll
      for (int q = 0; q < V::Q; ++q) {
        const int g = lane + 32 * q;
        if (m + u < e && g < V::G) {
          k[u][q] = load4<T>(sg.keys, size_t(i) * D + 4 * g);
          v[u][q] = load4<T>(sg.values, size_t(i) * D + 4 * g);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int q = 0; q < V::Q; ++q)
        if (m + u < e && lane + 32 * q < V::G) {
          ks[q][0] += k[u][q].x, ks[q][1] += k[u][q].y, ks[q][2] += k[u][q].z, ks[q][3] += k[u][q].w;
          vs[q][0] += v[u][q].x, vs[q][1] += v[u][q].y, vs[q][2] += v[u][q].z, vs[q][3] += v[u][q].w;
        }
  }
}

template <int D>
__device__ __forceinline__ void write_sums(const double (&ks)[Vec4<D>::Q][4], const double (&vs)[Vec4<D>::Q][4],
                                           uint32_t cnt, int lane, float *centroid, float *value_sum) {
  const double inv = 1.0 / cnt;
#pragma unroll
  for (int q = 0; q < Vec4<D>::Q; ++q) {
    const int g = lane + 32 * q;
    if (g < Vec4<D>::G) {
      reinterpret_cast<float4 *>(centroid)[g] =
          make_float4(static_cast<float>(ks[q][0] * inv), static_cast<float>(ks[q][1] * inv),
                      static_cast<float>(ks[q][2] * inv), static_cast<float>(ks[q][3] * inv));
      reinterpret_cast<float4 *>(value_sum)[g] =
          make_float4(static_cast<float>(vs[q][0]), static_cast<float>(vs[q][1]), static_cast<float>(vs[q][2]),
                      static_cast<float>(vs[q][3]));
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(256) centroid_kernel(const DevSeg *segs, const uint32_t *counts,
                                                       const uint32_t *starts, const uint32_t *renum,
                                                       const uint32_t *vals, uint32_t Tm, uint32_t Km,
                                                       uint32_t S, uint32_t *big_n, uint32_t *big_ids,
                                                       KMeansBatchOut out) {
  using V = Vec4<D>;
  const uint32_t cid = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (cid >= S * Km) return;
  const uint32_t s = cid / Km, c = cid % Km;
  const DevSeg sg = segs[s];
  if (c >= sg.k) return;
  if (c >= out.n_clusters[s]) {
    for (int j = lane; j < D; j += 32) {
      out.centroid[size_t(sg.clu_off + c) * D + j] = 0.f;
      out.value_sum[size_t(sg.clu_off + c) * D + j] = 0.f;
    }
  }
  const uint32_t cnt = counts[cid];
  if (cnt == 0) return;
  if (cnt > kBigCluster) {
    if (lane == 0) big_ids[atomicAdd(big_n, 1u)] = cid;
    return;
  }
  double ks[V::Q][4] = {}, vs[V::Q][4] = {};
  sum_kv_rows<T, D>(sg, vals + starts[cid], 0, cnt, Tm, lane, ks, vs);
  const size_t o = size_t(sg.clu_off) + renum[cid];
  write_sums<D>(ks, vs, cnt, lane, out.centroid + o * D, out.value_sum + o * D);
}

template <typename T, int D>
__global__ void __launch_bounds__(kBigWarpsSums * 32)
    centroid_big_kernel(const DevSeg *segs, const uint32_t *counts, const uint32_t *starts, const uint32_t *renum,
                        const uint32_t *vals, uint32_t Tm, uint32_t Km, const uint32_t *big_n,
                        const uint32_t *big_ids, KMeansBatchOut out) {
  using V = Vec4<D>;
  __shared__ double part_k[kBigWarpsSums][D], part_v[kBigWarpsSums][D];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t n = *big_n;
  for (uint32_t b = blockIdx.x; b < n; b += gridDim.x) {
    const uint32_t cid = big_ids[b], cnt = counts[cid];
    const DevSeg sg = segs[cid / Km];
    const uint32_t lo = static_cast<uint32_t>(uint64_t(cnt) * warp / kBigWarpsSums);
    const uint32_t hi = static_cast<uint32_t>(uint64_t(cnt) * (warp + 1) / kBigWarpsSums);
    double ks[V::Q][4] = {}, vs[V::Q][4] = {};
    sum_kv_rows<T, D>(sg, vals + starts[cid], lo, hi, Tm, lane, ks, vs);
#pragma unroll
    for (int q = 0; q < V::Q; ++q) {
      const int g = lane + 32 * q;
      if (g < V::G)
        for (int e = 0; e < 4; ++e) part_k[warp][4 * g + e] = ks[q][e], part_v[warp][4 * g + e] = vs[q][e];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
      for (int q = 0; q < V::Q; ++q) {
        const int g = lane + 32 * q;
        for (int e = 0; e < 4; ++e) {
          ks[q][e] = 0.0, vs[q][e] = 0.0;
          if (g < V::G)
            for (int w = 0; w < kBigWarpsSums; ++w) ks[q][e] += part_k[w][4 * g + e], vs[q][e] += part_v[w][4 * g + e];
        }
      }
      const size_t o = size_t(sg.clu_off) + renum[cid];
      write_sums<D>(ks, vs, cnt, lane, out.centroid + o * D, out.value_sum + o * D);
    }
    __syncthreads();
  }
}

// 6. Outliers, spread, value totals ---------------------------------------------

constexpr int kSplitThreads = 256;
constexpr int kSplitWarps = kSplitThreads / 32;

__device__ __forceinline__ double warp_sum_d(double x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The squared distance of a key row to a centroid row (exact differences
// and squares in double; lanes over 4-column groups, then a warp sum).
template <typename T, int D>
__device__ __forceinline__ double sq_dist_row(const void *keys, uint32_t row, const float *cen, int lane) {
  double s = 0.0;
  for (int g = lane; g < D / 4; g += 32) {
    const float4 k = load4<T>(keys, size_t(row) * D + 4 * g);
    const float4 c = *reinterpret_cast<const float4 *>(cen + 4 * g);
    const double x = double(k.x) - double(c.x), y = double(k.y) - double(c.y);
    const double z = double(k.z) - double(c.z), w = double(k.w) - double(c.w);
    s += x * x + y * y + z * z + w * w;
  }
  return warp_sum_d(s);
}

// Block-wide sum of an integer; every thread gets it. tmp holds kSplitWarps words.
__device__ __forceinline__ uint32_t block_count(uint32_t v, uint32_t *tmp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) tmp[warp] = v;
  __syncthreads();
  uint32_t t = 0;
  for (int w = 0; w < kSplitWarps; ++w) t += tmp[w];
  return t;
}

// split_outliers for segment blockIdx.x, on the compacted clusters of the
// k-means; see kernels/cpu_kernels.hpp for the rule. Phases, each ended by a
// barrier: 1. distances r (by position), spreads and the segment's mean
// distance; 2. the outliers (candidates, then the cap largest by a bitwise
// search over the doubles' bits); 3. the new order, begin and size; 4. the
// sums and spread of the clusters that lost members, the clusters of one;
// 5. empty slots, counts, and the value total.
template <typename T, int D>
__global__ void __launch_bounds__(kSplitThreads) split_kernel(const DevSeg *segs, KMeansBatchOut out, double *resid,
                                                              uint32_t *order2, uint8_t *flags, uint8_t *changed,
                                                              uint32_t K_stride) {
  using Scan = cub::BlockScan<uint32_t, kSplitThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ double part[kSplitWarps];
  __shared__ uint32_t tmp[kSplitWarps];
  __shared__ uint32_t carry;
  const uint32_t s = blockIdx.x, tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const DevSeg sg = segs[s];
  const uint32_t nt = sg.T, K = sg.k + sg.cap, C = out.n_clusters[s];
  uint32_t *begin = out.begin + sg.clu_off + s;
  uint32_t *size = out.size + sg.clu_off;
  uint32_t *order = out.order + sg.tok_off;
  float *centroid = out.centroid + size_t(sg.clu_off) * D;
  float *value_sum = out.value_sum + size_t(sg.clu_off) * D;
  float *spread = out.spread + sg.clu_off;
  double *r = resid + sg.tok_off;
  uint32_t *rebuilt = order2 + sg.tok_off;
  uint8_t *flag = flags + sg.tok_off;
  uint8_t *chg = changed + size_t(s) * K_stride;

  // 1. Distances, spreads, the segment's total.
  double total = 0.0;
  for (uint32_t c = warp; c < C; c += kSplitWarps) {
    const uint32_t b = begin[c], e = begin[c + 1];
    const float *cen = centroid + size_t(c) * D;
    double sum = 0.0;
    for (uint32_t p = b; p < e; ++p) {
      const double x = sq_dist_row<T, D>(sg.keys, order[p], cen, lane);
      if (lane == 0) r[p] = x;
      sum += x;
    }
    if (lane == 0) spread[c] = static_cast<float>(sum / (e - b));
    total += sum;
  }
  if (lane == 0) part[warp] = total;
  for (uint32_t c = tid; c < C; c += kSplitThreads) chg[c] = 0;
  __syncthreads();
  total = 0.0;
  for (int w = 0; w < kSplitWarps; ++w) total += part[w];

  uint32_t n_out = 0;
  if (sg.cap > 0 && sg.ratio > 0.f) {
    // 2. Candidates: beyond the bar, not their cluster's nearest member.
    const double bar = double(sg.ratio) * (total / nt);
    for (uint32_t c = warp; c < C; c += kSplitWarps) {
      const uint32_t b = begin[c], e = begin[c + 1];
      uint32_t keep = b;  // the nearest, the first on ties
      double best = INFINITY;
      for (uint32_t p0 = b; p0 < e; p0 += 32) {
        const uint32_t p = p0 + lane;
        double v = p < e ? r[p] : INFINITY;
        uint32_t at = p;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          const double v2 = __shfl_xor_sync(0xffffffffu, v, o);
          const uint32_t a2 = __shfl_xor_sync(0xffffffffu, at, o);
          if (v2 < v || (v2 == v && a2 < at)) v = v2, at = a2;
        }
        if (v < best) best = v, keep = at;  // earlier chunks win ties
      }
      for (uint32_t p = b + lane; p < e; p += 32) flag[p] = (e - b >= 2 && p != keep && r[p] > bar) ? 1 : 0;
    }
    __syncthreads();
    uint32_t cnt = 0;
    for (uint32_t p = tid; p < nt; p += kSplitThreads) cnt += flag[p];
    const uint32_t n_cand = block_count(cnt, tmp);
    n_out = n_cand;
    if (n_cand > sg.cap) {
      // The cap-th largest r among candidates: r >= 0, so its bits order
      // as the values do.
      unsigned long long prefix = 0;
      for (int bit = 63; bit >= 0; --bit) {
        const unsigned long long trial = prefix | (1ull << bit);
        uint32_t c2 = 0;
        for (uint32_t p = tid; p < nt; p += kSplitThreads)
          c2 += flag[p] && static_cast<unsigned long long>(__double_as_longlong(r[p])) >= trial;
        if (block_count(c2, tmp) >= sg.cap) prefix = trial;
      }
      uint32_t gt = 0;
      for (uint32_t p = tid; p < nt; p += kSplitThreads)
        gt += flag[p] && static_cast<unsigned long long>(__double_as_longlong(r[p])) > prefix;
      const uint32_t need = sg.cap - block_count(gt, tmp);
      // Keep those above, and the first `need` equal ones in position order.
      if (tid == 0) carry = 0;
      __syncthreads();
      for (uint32_t p0 = 0; p0 < nt; p0 += kSplitThreads) {
        const uint32_t p = p0 + tid;
        const bool cand = p < nt && flag[p];
        const unsigned long long bits = cand ? static_cast<unsigned long long>(__double_as_longlong(r[p])) : 0ull;
        const uint32_t eq = cand && bits == prefix ? 1u : 0u;
        uint32_t ex, agg;
        Scan(scan_tmp).ExclusiveSum(eq, ex, agg);
        if (cand) flag[p] = bits > prefix || (eq && carry + ex < need) ? 1 : 0;
        __syncthreads();
        if (tid == 0) carry += agg;
        __syncthreads();
      }
      n_out = sg.cap;
    }
    __syncthreads();
  }

  if (n_out > 0) {
    // 3. New layout into `rebuilt` (the segment's share of order2), then begin, size and order. Each thread
    //    reads its cluster's old bounds before any is rewritten.
    if (tid == 0) carry = 0;
    __syncthreads();
    for (uint32_t c0 = 0; c0 < C; c0 += kSplitThreads) {
      const uint32_t c = c0 + tid;
      uint32_t b = 0, e = 0, kept = 0;
      if (c < C) {
        b = begin[c];
        e = begin[c + 1];
        for (uint32_t p = b; p < e; ++p) kept += flag[p] ? 0u : 1u;
      }
      uint32_t ex, agg;
      Scan(scan_tmp).ExclusiveSum(kept, ex, agg);
      const uint32_t nb = carry + ex;
      if (c < C) {
        uint32_t at = nb;
        for (uint32_t p = b; p < e; ++p)
          if (!flag[p]) rebuilt[at++] = order[p];
        chg[c] = kept != e - b ? 1 : 0;
      }
      __syncthreads();  // every thread of the chunk has read its bounds
      if (c < C) {
        begin[c] = nb;
        size[c] = kept;
      }
      if (tid == 0) carry += agg;
      __syncthreads();
    }
    // The outliers, in position order, after the kept members.
    const uint32_t kept_total = nt - n_out;
    if (tid == 0) carry = 0;
    __syncthreads();
    for (uint32_t p0 = 0; p0 < nt; p0 += kSplitThreads) {
      const uint32_t p = p0 + tid;
      const uint32_t f = p < nt ? flag[p] : 0u;
      uint32_t ex, agg;
      Scan(scan_tmp).ExclusiveSum(f, ex, agg);
      if (f) {
        const uint32_t i = carry + ex;
        rebuilt[kept_total + i] = order[p];
        begin[C + i] = kept_total + i;
        size[C + i] = 1;
      }
      __syncthreads();
      if (tid == 0) carry += agg;
      __syncthreads();
    }
    for (uint32_t p = tid; p < nt; p += kSplitThreads) order[p] = rebuilt[p];
    __syncthreads();

    // 4. Sums and spread of the clusters that lost members (members in
    //    order, in double, as the CPU's); clusters of one are their rows.
    for (uint32_t c = warp; c < C + n_out; c += kSplitWarps) {
      float *cen = centroid + size_t(c) * D;
      float *vs = value_sum + size_t(c) * D;
      if (c >= C) {
        const uint32_t t = order[begin[c]];
        for (int g = lane; g < D / 4; g += 32) {
          reinterpret_cast<float4 *>(cen)[g] = load4<T>(sg.keys, size_t(t) * D + 4 * g);
          reinterpret_cast<float4 *>(vs)[g] = load4<T>(sg.values, size_t(t) * D + 4 * g);
        }
        if (lane == 0) spread[c] = 0.f;
        continue;
      }
      if (!chg[c]) continue;
      const uint32_t b = begin[c], n = size[c];
      double ks[Vec4<D>::Q][4] = {}, vsum[Vec4<D>::Q][4] = {};
      sum_kv_rows<T, D>(sg, order, b, b + n, 0xffffffffu, lane, ks, vsum);
      write_sums<D>(ks, vsum, n, lane, cen, vs);
      __syncwarp();
      double sum = 0.0;
      for (uint32_t p = b; p < b + n; ++p) sum += sq_dist_row<T, D>(sg.keys, order[p], cen, lane);
      if (lane == 0) spread[c] = static_cast<float>(sum / n);
    }
  }
  __syncthreads();

  // 5. Empty slots, the counts, the value total.
  const uint32_t C2 = C + n_out;
  for (uint32_t o = C2 + tid; o < K; o += kSplitThreads) {
    size[o] = 0;
    spread[o] = 0.f;
    for (int j = 0; j < D; ++j) centroid[size_t(o) * D + j] = value_sum[size_t(o) * D + j] = 0.f;
  }
  for (uint32_t o = C2 + 1 + tid; o <= K; o += kSplitThreads) begin[o] = nt;
  if (tid == 0) {
    begin[C2] = nt;
    out.n_clusters[s] = C2;
    out.n_outliers[s] = n_out;
  }
  for (int j = tid; j < D; j += kSplitThreads) {
    double v = 0.0;
    for (uint32_t c = 0; c < C2; ++c) v += value_sum[size_t(c) * D + j];
    out.value_total[size_t(s) * D + j] = v;
  }
}

// Host side ---------------------------------------------------------------------

#define WKV_CUBLAS_CHECK(stmt)                                                                  \
  do {                                                                                          \
    cublasStatus_t wkv_cb_ = (stmt);                                                            \
    if (wkv_cb_ != CUBLAS_STATUS_SUCCESS)                                                       \
      return wkv_cb_ == CUBLAS_STATUS_ALLOC_FAILED ? cudaErrorMemoryAllocation : cudaErrorUnknown; \
  } while (0)

// cuBLAS serves only KMeansAssign::kCublas, which the engine never takes
// (its growths run the fused assignment; the tests and the gather bench
// compare the two). Linked, it made every process that loads libwavekv map
// libcublas and libcublasLt (about 600 MB, 220 MB resident after their
// relocations, 0.2 s: a `wavekv verify` or a Python import paid that), so
// it is opened here when the first handle is made, and never closed.
struct CublasApi {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  // The C entry point (cublas_api.h also declares a C++ overload of it).
  cublasStatus_t (*gemm_strided_batched)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                         const void *, const void *, cudaDataType, int, long long, const void *,
                                         cudaDataType, int, long long, const void *, void *, cudaDataType, int,
                                         long long, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
  static_assert(std::is_same_v<decltype(static_cast<decltype(gemm_strided_batched)>(&cublasGemmStridedBatchedEx)),
                               decltype(gemm_strided_batched)>,
                "the type is cublas_api.h's C declaration");
};

// The loaded library's entry points, or null where it cannot be opened
// (then kmeans_cublas_create fails and nothing else is called).
const CublasApi *cublas_api() {
  static const CublasApi *const api = []() -> const CublasApi * {
#define WKV_KMEANS_STR2(x) #x
#define WKV_KMEANS_STR(x) WKV_KMEANS_STR2(x)
    const std::string soname = "libcublas.so." WKV_KMEANS_STR(CUBLAS_VER_MAJOR);
#undef WKV_KMEANS_STR
#undef WKV_KMEANS_STR2
    // By its name (LD_LIBRARY_PATH, the caller's run path, the loader's
    // cache), else beside the CUDA runtime this process uses: a toolkit
    // keeps both in one directory.
    void *lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
    Dl_info rt{};
    if (!lib && dladdr(reinterpret_cast<const void *>(&cudaGetDeviceCount), &rt) && rt.dli_fname) {
      std::string dir = rt.dli_fname;
      dir.erase(dir.find_last_of('/') + 1);
      lib = dlopen((dir + soname).c_str(), RTLD_NOW | RTLD_LOCAL);
    }
    if (!lib) return nullptr;
    static CublasApi a;
    a.create = reinterpret_cast<decltype(a.create)>(dlsym(lib, "cublasCreate_v2"));
    a.destroy = reinterpret_cast<decltype(a.destroy)>(dlsym(lib, "cublasDestroy_v2"));
    a.set_stream = reinterpret_cast<decltype(a.set_stream)>(dlsym(lib, "cublasSetStream_v2"));
    a.gemm_strided_batched = reinterpret_cast<decltype(a.gemm_strided_batched)>(dlsym(lib, "cublasGemmStridedBatchedEx"));
    if (!a.create || !a.destroy || !a.set_stream || !a.gemm_strided_batched) return nullptr;
    return &a;
  }();
  return api;
}

template <typename T, int D>
cudaError_t run_batch(const KMeansBatchParams &p, const std::vector<DevSeg> &hsegs, const KMeansBatchShape &sh,
                 const Layout &L, int end_bit, const KMeansBatchOut &out, uint8_t *ws, void *cublas,
                 cudaStream_t stream) {
  const uint32_t S = sh.segments, Tm = sh.max_tokens, Km = sh.max_clusters;
  const uint32_t N = static_cast<uint32_t>(sh.total_tokens);
  DevSeg *segs = reinterpret_cast<DevSeg *>(ws + L.segs);
  double *mean_part = reinterpret_cast<double *>(ws + L.mean_part);
  float *mean = reinterpret_cast<float *>(ws + L.mean);
  __half *x = reinterpret_cast<__half *>(ws + L.x);
  __half *dirs = reinterpret_cast<__half *>(ws + L.dirs);
  AssignOut ao;
  ao.assign = reinterpret_cast<uint32_t *>(ws + L.assign);
  ao.flags = reinterpret_cast<uint32_t *>(ws + L.flags);
  ao.counts = reinterpret_cast<uint32_t *>(ws + L.counts);
  uint32_t *keys0 = reinterpret_cast<uint32_t *>(ws + L.keys0), *keys1 = reinterpret_cast<uint32_t *>(ws + L.keys1);
  uint32_t *vals0 = reinterpret_cast<uint32_t *>(ws + L.vals0), *vals1 = reinterpret_cast<uint32_t *>(ws + L.vals1);
  ao.keys = keys0;
  ao.vals = vals0;
  uint32_t *starts = reinterpret_cast<uint32_t *>(ws + L.starts);
  uint32_t *renum = reinterpret_cast<uint32_t *>(ws + L.renum);
  uint32_t *big_ids = reinterpret_cast<uint32_t *>(ws + L.big);
  void *cub_tmp = ws + L.cub;
  float *scores = reinterpret_cast<float *>(ws + L.scores);

  // 1. Descriptors.
  for (uint32_t s0 = 0; s0 < S; s0 += kSegsPerUpload) {
    SegUpload u;
    std::memset(&u, 0, sizeof(u));
    const uint32_t n = std::min(kSegsPerUpload, S - s0);
    std::copy(hsegs.begin() + s0, hsegs.begin() + s0 + n, u.seg);
    upload_segs_kernel<<<1, kSegsPerUpload, 0, stream>>>(u, n, segs + s0);
    WKV_CUDA_CHECK_LAUNCH("upload_segs_kernel");
  }
  // 2. Mean and X.
  mean_partial_kernel<T, D><<<dim3(L.nchunk, S), 256, 0, stream>>>(segs, L.nchunk, mean_part);
  WKV_CUDA_CHECK_LAUNCH("mean_partial_kernel");
  mean_final_kernel<D><<<S, std::min(D, 256), 0, stream>>>(segs, L.nchunk, mean_part, mean);
  WKV_CUDA_CHECK_LAUNCH("mean_final_kernel");
  normalize_kernel<T, D><<<dim3((Tm + kNormRows - 1) / kNormRows, S), 256, 0, stream>>>(segs, mean, Tm, x);
  WKV_CUDA_CHECK_LAUNCH("normalize_kernel");
  // 3. Initial directions.
  {
    const uint64_t chunks = uint64_t(S) * Km * (D / 8);
    init_dirs_kernel<D><<<static_cast<unsigned>((chunks + 255) / 256), 256, 0, stream>>>(segs, x, Tm, Km, chunks,
                                                                                         dirs);
    WKV_CUDA_CHECK_LAUNCH("init_dirs_kernel");
  }
  WKV_CUDA_CHECK(cudaMemsetAsync(ao.flags, 0, size_t(L.rounds) * S * 4, stream));
  // The points are ordered by bucket_kernel where a segment's table fits in
  // shared memory (k up to ~1500), by a radix sort of the batch otherwise.
  // The kernel's shared-memory limit is one value per device (kBucketSmemMax,
  // or less where the device offers less), so that concurrent batches never
  // set it under each other.
  bool bucket = false;
  if (p.order == KMeansOrder::kAuto) {
    int dev = 0, optin = 0;
    cudaFuncAttributes fa;
    WKV_CUDA_CHECK(cudaGetDevice(&dev));
    WKV_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    WKV_CUDA_CHECK(cudaFuncGetAttributes(&fa, bucket_kernel));
    const size_t offered = optin > 0 ? size_t(optin) : 0;  // less the kernel's static shared memory
    const size_t cap = std::min(kBucketSmemMax, offered - std::min(fa.sharedSizeBytes, offered));
    if (bucket_smem(Km) <= cap) {
      WKV_CUDA_CHECK(
          cudaFuncSetAttribute(bucket_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(cap)));
      bucket = true;
      ao.keys = ao.vals = nullptr;
    }
  }
  using C = FusedCfg<D>;
  if (p.assign == KMeansAssign::kFused)
    WKV_CUDA_CHECK(cudaFuncSetAttribute(assign_fused_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(C::kSmem)));
  if (p.assign == KMeansAssign::kCublas)
    WKV_CUBLAS_CHECK(cublas_api()->set_stream(static_cast<cublasHandle_t>(cublas), stream));
  const uint32_t n_cid = S * Km;
  uint32_t *big_n = ao.counts + n_cid;  // zeroed every round (with the counts, or by bucket_kernel)
  const unsigned warp_blocks = static_cast<unsigned>((uint64_t(n_cid) * 32 + 255) / 256);
  const uint32_t *sorted_vals = vals0;
  // 4. Rounds.
  for (uint32_t r = 0; r < L.rounds; ++r) {
    if (!bucket) WKV_CUDA_CHECK(cudaMemsetAsync(ao.counts, 0, (size_t(n_cid) + 1) * 4, stream));
    if (p.assign == KMeansAssign::kFused) {
      assign_fused_kernel<D><<<dim3((Tm + C::BM - 1) / C::BM, S), 256, C::kSmem, stream>>>(segs, x, dirs, Tm,
                                                                                         Km, S, r, ao);
      WKV_CUDA_CHECK_LAUNCH("assign_fused_kernel");
    } else {
      const float one = 1.f, zero = 0.f;
      for (uint32_t s0 = 0; s0 < S; s0 += L.score_chunk) {
        const uint32_t cs = std::min(L.score_chunk, S - s0);
        // Column-major view: scores (Km x Tm, ld Km) = dirs^T (Km x d) * x (d x Tm),
        // i.e. row-major scores[i][c] = x_i . dir_c.
        WKV_CUBLAS_CHECK(cublas_api()->gemm_strided_batched(
            static_cast<cublasHandle_t>(cublas), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(Km),
            static_cast<int>(Tm), D, &one, dirs + size_t(s0) * Km * D, CUDA_R_16F, D,
            static_cast<long long>(Km) * D, x + size_t(s0) * Tm * D, CUDA_R_16F, D,
            static_cast<long long>(Tm) * D, &zero, scores, CUDA_R_32F, static_cast<int>(Km),
            static_cast<long long>(Tm) * Km, static_cast<int>(cs), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        const uint64_t threads = uint64_t(cs) * Tm * 32;
        argmax_scores_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
            segs, scores, s0, cs, Tm, Km, S, r, ao);
        WKV_CUDA_CHECK_LAUNCH("argmax_scores_kernel");
      }
    }
    if (bucket) {
      bucket_kernel<<<S, kBucketWarps * 32, bucket_smem(Km), stream>>>(segs, ao.assign, ao.flags, Tm, Km, S, r,
                                                                       ao.counts, starts, vals0, big_n);
      WKV_CUDA_CHECK_LAUNCH("bucket_kernel");
      sorted_vals = vals0;
    } else {
      cub::DoubleBuffer<uint32_t> kb(keys0, keys1), vb(vals0, vals1);
      size_t tmp_bytes = L.cub_bytes;
      WKV_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_tmp, tmp_bytes, kb, vb, static_cast<int>(N), 0, end_bit,
                                                     stream));
      sorted_vals = vb.Current();
      tmp_bytes = L.cub_bytes;
      WKV_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(cub_tmp, tmp_bytes, ao.counts, starts,
                                                   static_cast<int>(n_cid), stream));
    }
    if (r + 1 < L.rounds) {
      update_kernel<D><<<warp_blocks, 256, 0, stream>>>(segs, x, ao.counts, starts, sorted_vals, Km, S, r,
                                                        ao.flags, big_n, big_ids, dirs);
      WKV_CUDA_CHECK_LAUNCH("update_kernel");
      update_big_kernel<D><<<kBigBlocks, kBigWarps * 32, 0, stream>>>(x, ao.counts, starts, sorted_vals, big_n,
                                                                      big_ids, dirs);
      WKV_CUDA_CHECK_LAUNCH("update_big_kernel");
    }
  }
  // 5. Compaction.
  finalize_kernel<<<S, 256, 0, stream>>>(segs, ao.counts, starts, Km, renum, out);
  WKV_CUDA_CHECK_LAUNCH("finalize_kernel");
  order_kernel<<<(N + 255) / 256, 256, 0, stream>>>(sorted_vals, N, Tm, out.order);
  WKV_CUDA_CHECK_LAUNCH("order_kernel");
  // The last round ran no update: the list is empty here.
  centroid_kernel<T, D><<<warp_blocks, 256, 0, stream>>>(segs, ao.counts, starts, renum, sorted_vals, Tm, Km, S,
                                                        big_n, big_ids, out);
  WKV_CUDA_CHECK_LAUNCH("centroid_kernel");
  centroid_big_kernel<T, D><<<kBigBlocks, kBigWarpsSums * 32, 0, stream>>>(segs, ao.counts, starts, renum,
                                                                          sorted_vals, Tm, Km, big_n, big_ids, out);
  WKV_CUDA_CHECK_LAUNCH("centroid_big_kernel");
  // 6. Outliers, spread, value totals.
  split_kernel<T, D><<<S, kSplitThreads, 0, stream>>>(segs, out, reinterpret_cast<double *>(ws + L.resid),
                                                      reinterpret_cast<uint32_t *>(ws + L.order2), ws + L.flags2,
                                                      ws + L.changed, std::max(sh.max_out, sh.max_clusters));
  WKV_CUDA_CHECK_LAUNCH("split_kernel");
  return cudaSuccess;
}

// Pages ---------------------------------------------------------------------------

// Thread q of `stride` moves 16-byte chunks q, q + stride, ... of the job:
// chunk (slot j, piece c) of K and of V.
__device__ __forceinline__ void write_job(const WritePagesJob &job, uint32_t cpr, uint32_t row_bytes,
                                          uint32_t pt, uint64_t q, uint64_t stride) {
  const uint64_t total = uint64_t(job.tokens) * cpr;
  for (; q < total; q += stride) {
    const uint32_t j = static_cast<uint32_t>(q / cpr), c = static_cast<uint32_t>(q % cpr);
    const uint32_t src = job.order[j];
    uint8_t *page = job.pages[j / pt];
    const uint32_t row = j % pt;
    const int4 kv = __ldg(reinterpret_cast<const int4 *>(job.k + size_t(src) * row_bytes) + c);
    const int4 vv = __ldg(reinterpret_cast<const int4 *>(job.v + size_t(src) * row_bytes) + c);
    reinterpret_cast<int4 *>(page + size_t(row) * row_bytes)[c] = kv;
    reinterpret_cast<int4 *>(page + size_t(pt + row) * row_bytes)[c] = vv;
  }
}

constexpr uint32_t kPageJobsPerLaunch = 64;

struct PageJobChunk {
  WritePagesJob j[kPageJobsPerLaunch];
  uint32_t n;
};
static_assert(sizeof(PageJobChunk) <= 4000, "kernel parameters are limited to 4 KiB");

// CTA (x, y) moves job y's chunks x * blockDim.x + threadIdx.x, ...
__global__ void write_pages_kernel(const __grid_constant__ PageJobChunk chunk, uint32_t cpr, uint32_t row_bytes,
                                   uint32_t pt) {
  write_job(chunk.j[blockIdx.y], cpr, row_bytes, pt, uint64_t(blockIdx.x) * blockDim.x + threadIdx.x,
            uint64_t(gridDim.x) * blockDim.x);
}

__global__ void write_pages_batch_kernel(const WritePagesJob *jobs, uint32_t cpr, uint32_t row_bytes,
                                         uint32_t pt) {
  const WritePagesJob job = jobs[blockIdx.y];
  write_job(job, cpr, row_bytes, pt, uint64_t(blockIdx.x) * blockDim.x + threadIdx.x,
            uint64_t(gridDim.x) * blockDim.x);
}

cudaError_t check_page_args(uint32_t row_bytes, uint32_t page_tokens) {
  if (row_bytes == 0 || row_bytes % 16 != 0)
    return cudaErrorInvalidValue;
  if (page_tokens == 0) return cudaErrorInvalidValue;
  return cudaSuccess;
}

constexpr uint32_t kPageBlocksMax = 2048;

// 8-bit rows: warp w of `warps` quantizes rows w, w + warps, ... of the job,
// row 2j the K row of slot j and 2j + 1 its V row; lane L holds elements
// 4g .. 4g + 3 for g = L, L + 32, ... < head_dim / 4, and stores them as one
// word. The arithmetic is quantize_row's (kernels/dtype.hpp), operation for
// operation.
constexpr uint32_t kInt8WriteWarps = 8;
constexpr uint32_t kInt8MaxGroups = 2;  // head_dim / 4 / 32, head_dim <= 256

// The cluster of slot j of a centered job: the last c with begin[c] <= j
// (a binary search; every lane finds the same).
__device__ __forceinline__ uint32_t cluster_of_slot(const WritePagesJob &job, uint32_t j) {
  uint32_t lo = 0, hi = job.clusters;  // the answer lies in [lo, hi)
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (job.begin[mid] <= j)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

template <typename T>
__device__ __forceinline__ void write_job_int8(const WritePagesJob &job, const Int8PageLayout &l, uint64_t w,
                                               uint64_t warps) {
  using DT = typename DevType<T>::type;
  const uint32_t lane = threadIdx.x & 31, groups = l.head_dim / 4;
  const bool centered = l.centered && job.clusters > 0;
  for (uint64_t i = w; i < 2ull * job.tokens; i += warps) {
    const uint32_t j = static_cast<uint32_t>(i >> 1), is_v = static_cast<uint32_t>(i & 1);
    const DT *x = reinterpret_cast<const DT *>((is_v ? job.v : job.k) +
                                               size_t(job.order[j]) * l.head_dim * sizeof(DT));
    // Centered K rows: less the cluster's centroid rounded to f16, where
    // every component of it fits f16 (centered_reference).
    float ref[kInt8MaxGroups][4];
    bool less_ref = false;
    if (centered && !is_v) {
      const float *cen = job.centroid + size_t(cluster_of_slot(job, j)) * l.head_dim;
      bool fits = true;
#pragma unroll
      for (uint32_t k = 0; k < kInt8MaxGroups; ++k) {
        const uint32_t g = lane + 32 * k;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float c = g < groups ? cen[4 * g + e] : 0.0f;
          fits &= fits_f16(c);
          ref[k][e] = f16_rounded(c);
        }
      }
      less_ref = __all_sync(0xffffffffu, fits);
    }
    float v[kInt8MaxGroups][4];
    Int8Row rq;
#pragma unroll
    for (uint32_t k = 0; k < kInt8MaxGroups; ++k) {
      const uint32_t g = lane + 32 * k;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        v[k][e] = g < groups ? DevType<T>::to_f(x[4 * g + e]) : 0.0f;
        if (less_ref) v[k][e] = __fsub_rn(v[k][e], ref[k][e]);
        rq.take(v[k][e]);
      }
    }
    const float scale = rq.scale_warp();
    uint8_t *page = job.pages[j / l.page_tokens];
    const uint32_t row = (is_v ? l.page_tokens : 0u) + j % l.page_tokens;
#pragma unroll
    for (uint32_t k = 0; k < kInt8MaxGroups; ++k) {
      const uint32_t g = lane + 32 * k;
      if (g >= groups) continue;
      uint32_t word = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) word |= (static_cast<uint32_t>(Int8Row::level(v[k][e], scale)) & 0xffu) << (8 * e);
      reinterpret_cast<uint32_t *>(page + size_t(row) * l.head_dim)[g] = word;
    }
    if (lane == 0) reinterpret_cast<float *>(page + l.scales_at)[row] = scale;
  }
}

template <typename T>
__global__ void __launch_bounds__(kInt8WriteWarps * 32)
    write_pages_int8_kernel(const __grid_constant__ PageJobChunk chunk, const Int8PageLayout l) {
  write_job_int8<T>(chunk.j[blockIdx.y], l, uint64_t(blockIdx.x) * kInt8WriteWarps + (threadIdx.x >> 5),
                    uint64_t(gridDim.x) * kInt8WriteWarps);
}

}  // namespace

cudaError_t kmeans_batch_workspace_size(const KMeansBatchParams &p, const KMeansBatchShape &shape, size_t *bytes) {
  if (!bytes) return cudaErrorInvalidValue;
  if (!head_dim_ok(p.head_dim))
    return cudaErrorNotSupported;
  Layout L;
  WKV_CUDA_TRY(make_layout(p, shape, 32, &L));
  *bytes = L.total;
  return cudaSuccess;
}

cudaError_t kmeans_cublas_create(void **handle) {
  if (!handle) return cudaErrorInvalidValue;
  const CublasApi *api = cublas_api();
  if (!api) return cudaErrorSharedObjectInitFailed;  // libcublas is not installed
  cublasHandle_t h = nullptr;
  WKV_CUBLAS_CHECK(api->create(&h));
  *handle = h;
  return cudaSuccess;
}

void kmeans_cublas_destroy(void *handle) {
  if (handle) cublas_api()->destroy(static_cast<cublasHandle_t>(handle));  // a handle means it loaded
}

cudaError_t kmeans_batch_cuda(const KMeansBatchParams &p, const KMeansSegmentDesc *segs, uint32_t n,
                         const KMeansBatchOut &out, void *workspace, size_t workspace_bytes, void *cublas,
                         cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (!segs || !workspace || !out.n_clusters || !out.n_outliers || !out.begin || !out.order || !out.centroid ||
      !out.value_sum || !out.size || !out.spread || !out.value_total)
    return cudaErrorInvalidValue;
  if (p.assign == KMeansAssign::kCublas && !cublas)
    return cudaErrorInvalidValue;
  if (p.assign != KMeansAssign::kFused && p.assign != KMeansAssign::kCublas)
    return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
    return cudaErrorInvalidValue;
  std::vector<DevSeg> hsegs(n);
  uint64_t tok = 0, clu = 0;
  for (uint32_t s = 0; s < n; ++s) {
    const KMeansSegmentDesc &d = segs[s];
    if (d.tokens == 0 || d.tokens > kKMeansMaxTokens)
      return cudaErrorInvalidValue;
    if (!d.keys || !d.values) return cudaErrorInvalidValue;
    hsegs[s] = DevSeg{d.keys,   d.values, d.tokens, clamp_k(d.clusters, d.tokens), static_cast<uint32_t>(tok),
                      static_cast<uint32_t>(clu), d.seed, std::min(d.outliers, d.tokens), d.outlier_ratio};
    tok += d.tokens;
    clu += kmeans_out_clusters(d);
  }
  const KMeansBatchShape sh = kmeans_batch_shape(segs, n);
  const int end_bit = static_cast<int>(std::max<uint32_t>(1, bit_width(uint64_t(sh.segments) * sh.max_clusters - 1)));
  Layout L;
  WKV_CUDA_TRY(make_layout(p, sh, end_bit, &L));
  if (L.total > workspace_bytes)
    return cudaErrorInvalidValue;
  uint8_t *ws = static_cast<uint8_t *>(workspace);
  return WKV_DISPATCH_HEAD_DIM(p.head_dim, HD, [&]() -> cudaError_t {
    switch (p.dtype) {
      case DType::kF32: return run_batch<float, HD>(p, hsegs, sh, L, end_bit, out, ws, cublas, stream);
      case DType::kF16: return run_batch<f16, HD>(p, hsegs, sh, L, end_bit, out, ws, cublas, stream);
      case DType::kBF16: return run_batch<bf16, HD>(p, hsegs, sh, L, end_bit, out, ws, cublas, stream);
    }
    return cudaErrorNotSupported;
  });
}

cudaError_t write_pages_cuda(const WritePagesJob &job, uint32_t row_bytes, uint32_t page_tokens, cudaStream_t stream) {
  return write_pages_many_cuda(&job, 1, row_bytes, page_tokens, stream);
}

cudaError_t check_page_jobs(const WritePagesJob *jobs, uint32_t n, uint32_t row_bytes, uint32_t page_tokens) {
  WKV_CUDA_TRY(check_page_args(row_bytes, page_tokens));
  if (n > 0 && !jobs) return cudaErrorInvalidValue;
  for (uint32_t i = 0; i < n; ++i)
    if (jobs[i].tokens > 0 && (!jobs[i].order || !jobs[i].k || !jobs[i].v || !jobs[i].pages ||
                               (jobs[i].clusters > 0 && (!jobs[i].begin || !jobs[i].centroid))))
      return cudaErrorInvalidValue;
  return cudaSuccess;
}

cudaError_t write_pages_many_cuda(const WritePagesJob *jobs, uint32_t n, uint32_t row_bytes, uint32_t page_tokens,
                                  cudaStream_t stream) {
  // Every job checked before the first launch: a refusal enqueues nothing.
  WKV_CUDA_TRY(check_page_jobs(jobs, n, row_bytes, page_tokens));
  const uint32_t cpr = row_bytes / 16;
  for (uint32_t done = 0; done < n; done += kPageJobsPerLaunch) {
    PageJobChunk c;
    c.n = 0;
    uint32_t most = 0;
    for (uint32_t i = done; i < n && i < done + kPageJobsPerLaunch; ++i) {
      const WritePagesJob &job = jobs[i];
      if (job.tokens == 0) continue;
      c.j[c.n++] = job;
      most = std::max(most, job.tokens);
    }
    if (c.n == 0) continue;
    const uint64_t chunks = uint64_t(most) * cpr;
    const unsigned bx = static_cast<unsigned>(std::min<uint64_t>((chunks + 255) / 256, kPageBlocksMax));
    write_pages_kernel<<<dim3(bx, c.n), 256, 0, stream>>>(c, cpr, row_bytes, page_tokens);
    WKV_CUDA_CHECK_LAUNCH("write_pages_kernel");
  }
  return cudaSuccess;
}

cudaError_t write_pages_batch_cuda(const WritePagesJob *jobs, uint32_t n, uint32_t max_tokens, uint32_t row_bytes,
                              uint32_t page_tokens, cudaStream_t stream) {
  WKV_CUDA_TRY(check_page_args(row_bytes, page_tokens));
  if (n == 0 || max_tokens == 0) return cudaSuccess;
  if (!jobs) return cudaErrorInvalidValue;
  if (n > 65535) return cudaErrorInvalidValue;
  const uint32_t cpr = row_bytes / 16;
  const uint64_t chunks = uint64_t(max_tokens) * cpr;
  const unsigned bx = static_cast<unsigned>(std::min<uint64_t>((chunks + 255) / 256, 256));
  write_pages_batch_kernel<<<dim3(bx, n), 256, 0, stream>>>(jobs, cpr, row_bytes, page_tokens);
  WKV_CUDA_CHECK_LAUNCH("write_pages_batch_kernel");
  return cudaSuccess;
}

cudaError_t write_pages_int8_many_cuda(const WritePagesJob *jobs, uint32_t n, const Int8PageLayout &l,
                                       cudaStream_t stream) {
  if (l.head_dim == 0 || l.head_dim % 16 != 0 || l.head_dim > 4 * 32 * kInt8MaxGroups ||
      l.scales_at != 2 * l.page_tokens * l.head_dim || !dtype_known(l.dtype))
    return cudaErrorInvalidValue;
  WKV_CUDA_TRY(check_page_jobs(jobs, n, l.head_dim, l.page_tokens));
  for (uint32_t done = 0; done < n; done += kPageJobsPerLaunch) {
    PageJobChunk c;
    c.n = 0;
    uint32_t most = 0;
    for (uint32_t i = done; i < n && i < done + kPageJobsPerLaunch; ++i) {
      if (jobs[i].tokens == 0) continue;
      c.j[c.n++] = jobs[i];
      most = std::max(most, jobs[i].tokens);
    }
    if (c.n == 0) continue;
    const unsigned bx = static_cast<unsigned>(
        std::min<uint64_t>((2ull * most + kInt8WriteWarps - 1) / kInt8WriteWarps, kPageBlocksMax));
    const dim3 grid(bx, c.n), block(kInt8WriteWarps * 32);
    switch (l.dtype) {
      case DType::kF32: write_pages_int8_kernel<float><<<grid, block, 0, stream>>>(c, l); break;
      case DType::kF16: write_pages_int8_kernel<f16><<<grid, block, 0, stream>>>(c, l); break;
      case DType::kBF16: write_pages_int8_kernel<bf16><<<grid, block, 0, stream>>>(c, l); break;
    }
    WKV_CUDA_CHECK_LAUNCH("write_pages_int8_kernel");
  }
  return cudaSuccess;
}

}  // namespace wkv::kernels
