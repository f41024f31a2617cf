// Exact attention over the ragged execution buffer on the GPU (flash-decoding)
// merged with the estimate: the CUDA counterpart of attend_exact +
// merge_partials (kernels/cpu_kernels.cpp).
//
// attend_kernel, grid (R, n_splits), 4 warps: CTA (r, split) attends its
// slice of run r's tokens for all G query heads. Each warp streams blocks of
// rows through its own cp.async pipeline in shared memory (K and V read once
// from device memory with 16-byte copies); warps take blocks in turn, and
// when G > 8 the heads are split over warps that read the same rows.
//
// Inside a warp, a row of d elements is spread over kLpr lanes (8 elements a
// lane, 16-byte reads), so 32 / kLpr rows are in flight per step. A lane
// holds q and the output accumulator of its 8 elements for HC <= 8 heads in
// registers. Per row, the HC partial dot products are reduced over the kLpr
// lanes with a transposing butterfly (HC - 1 + log2(kLpr / HC) shuffles for
// all heads, not HC log2 kLpr), after which lane j holds the logit of head
// head_of_lane(j). The online softmax runs once per block of kU steps; the
// probabilities go through shared memory to every lane for the V update.
//
// Attending from frames (a decode; AttendRows), a block's rows are copied
// from where each lives, by the row sources the gather wrote (RowSource):
// a warp keeps its blocks' sources in shared memory, each block's fetched
// kStages blocks ahead of its rows in the same cp.async groups, so that
// their latency hides as the rows' does; an 8-bit row's D bytes go to the
// start of its slot and its two scales beside the stage, and it is read
// back dequantized to the storage type and then to f32, as the gather
// would have laid it out: the same floats, the same blocks, the same bits
// as over a laid-out buffer (the runs' splits are counted for the laid-out
// kernel in both cases).
//
// combine_kernel, one CTA per (run, head, 32 elements): merges the splits in
// log space (32 lanes of splits in parallel), then the estimate exactly as
// merge_partials does, and writes the output in the storage dtype (and the
// lse). Both kernels use programmatic dependent launch: each waits for the
// grid before it (griddepcontrol.wait) before touching memory, so that its
// launch overlaps the tail of the one before.
#include <atomic>
#include <cmath>

#include "kernels/attention_cuda.hpp"
#include "kernels/cuda_common.cuh"

namespace wkv::kernels {
namespace {

constexpr float kNegInf = -INFINITY;
constexpr uint32_t kFull = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

constexpr uint32_t kWarps = 4;
constexpr uint32_t kThreads = kWarps * 32;
constexpr uint32_t kU = 4;            // row steps per softmax block
constexpr uint32_t kE = 8;            // elements of a row per lane
constexpr uint32_t kMaxG = 32;        // query heads per KV head
constexpr uint32_t kMinChunk = 64;    // fewest tokens worth a split of its own
constexpr uint32_t kMaxCtas = 2048;   // bound of R * n_splits (sizes the scratch)
// Shared memory budget of one warp's pipeline (bytes): sets the stages.
#ifndef WKV_ATTEND_WARP_SMEM
#define WKV_ATTEND_WARP_SMEM 16384
#endif
// ... attending from frames, whose rows come from device memory (not from
// a buffer just written, partly in L2): more stages in flight.
#ifndef WKV_ATTEND_SRC_WARP_SMEM
#define WKV_ATTEND_SRC_WARP_SMEM 24576
#endif
constexpr uint32_t kCombineThreads = 256;
constexpr uint32_t kCombineCols = 8;  // float4 columns (32 elements) per combine CTA
constexpr uint32_t kCombineLanes = kCombineThreads / kCombineCols;  // splits summed in parallel

// merge_partials' rule for an exact part (log-sum-exp la) and an estimate
// (lb): their weights, and a merged element in which a side of zero weight
// is left out, so that its value (unset, or infinite) never reaches the sum.
struct MergeWeights {
  bool empty;      // neither side holds any weight: the output is 0
  float wa, wb;    // exp(l - max)
  float ca, cb;    // wa and wb over their sum
  float lse;       // of the merged output
};
__device__ __forceinline__ MergeWeights merge_weights(float la, float lb) {
  MergeWeights m;
  const float mm = fmaxf(la, lb);
  m.empty = mm == kNegInf;
  m.wa = m.empty ? 0.f : expf(la - mm);
  m.wb = m.empty ? 0.f : expf(lb - mm);
  const float sum = m.wa + m.wb;
  m.ca = m.empty ? 0.f : m.wa / sum;
  m.cb = m.empty ? 0.f : m.wb / sum;
  m.lse = m.empty ? kNegInf : mm + logf(sum);
  return m;
}
// a() and e() give the two sides' element; each is called only when its
// side has weight.
template <typename A, typename E>
__device__ __forceinline__ float merged(const MergeWeights &m, A &&a, E &&e) {
  if (m.empty) return 0.f;
  if (m.wa == 0.f) return e();
  if (m.wb == 0.f) return a();
  return m.ca * a() + m.cb * e();
}

constexpr uint32_t pow2ceil(uint32_t x) {
  uint32_t p = 1;
  while (p < x) p <<= 1;
  return p;
}
constexpr uint32_t clampu(uint32_t x, uint32_t lo, uint32_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Compile-time geometry of one (storage type, head_dim), with kSmem bytes
// of a warp's pipeline.
template <typename Tag, uint32_t D, uint32_t kSmem = WKV_ATTEND_WARP_SMEM>
struct Shape {
  static constexpr uint32_t kVec = 16 / sizeof(Tag);           // elements per 16-byte slot
  static constexpr uint32_t kSlots = D / kVec;                 // slots per row
  static constexpr uint32_t kLpr = pow2ceil(D / kE);           // lanes per row: 8, 16 or 32
  static constexpr uint32_t kRpw = 32 / kLpr;                  // rows per warp step
  static constexpr uint32_t kSpl = kE / kVec;                  // slots per lane: 1 or 2
  static constexpr uint32_t kRows = kU * kRpw;                 // rows per block
  static constexpr uint32_t kRowBytes = D * sizeof(Tag);
  static constexpr uint32_t kBlockBytes = kRows * kRowBytes;   // K (or V) of one block
  static constexpr uint32_t kStages = clampu(kSmem / (2 * kBlockBytes), 2, 6);
  static constexpr uint32_t kWarpBytes = kStages * 2 * kBlockBytes;
  static constexpr uint32_t kPsFloats = kRows * 8 + 8;         // p [kRows][HC] and alpha [HC]
  // Attending from frames (kSrc): a warp's row sources [2 kStages][kRows]
  // (a block's are fetched kStages blocks before its rows) and scales
  // [kStages][2][kRows].
  static constexpr uint32_t kSrcSlots = 2 * kStages;
  static constexpr uint32_t kSrcBytes = kRows * (kSrcSlots * sizeof(RowSource) + kStages * 2 * sizeof(float));
  static_assert(D % kVec == 0 && kLpr * kE >= D && kLpr <= 32, "row does not fit a warp");
  static_assert(kRowBytes % 16 == 0, "rows must be whole 16-byte slots");
};

// The pipeline's shape of attend_kernel's instance (kSrc: from frames).
template <typename Tag, uint32_t D, bool kSrc>
using AttendShape = Shape<Tag, D, kSrc ? WKV_ATTEND_SRC_WARP_SMEM : WKV_ATTEND_WARP_SMEM>;

template <uint32_t HC, typename Tag, uint32_t D, bool kSrc>
constexpr size_t attend_smem_bytes() {
  using S = AttendShape<Tag, D, kSrc>;
  const size_t pipe = static_cast<size_t>(kWarps) * S::kWarpBytes + kWarps * S::kPsFloats * sizeof(float) +
                      (kSrc ? kWarps * S::kSrcBytes : 0);
  const size_t comb = (2 * kWarps * kMaxG + static_cast<size_t>(kWarps) * HC * D) * sizeof(float);
  return pipe > comb ? pipe : comb;
}

__device__ __forceinline__ void cp_async4(void *dst, const void *src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src) : "memory");
}

// 16 bytes of storage to floats.
template <typename Tag> __device__ __forceinline__ void slot_to_float(const uint4 &v, float *f);
template <> __device__ __forceinline__ void slot_to_float<float>(const uint4 &v, float *f) {
  f[0] = __uint_as_float(v.x);
  f[1] = __uint_as_float(v.y);
  f[2] = __uint_as_float(v.z);
  f[3] = __uint_as_float(v.w);
}
template <> __device__ __forceinline__ void slot_to_float<f16>(const uint4 &v, float *f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 h;
    memcpy(&h, &w[i], 4);
    const float2 x = __half22float2(h);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}
template <> __device__ __forceinline__ void slot_to_float<bf16>(const uint4 &v, float *f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// The kE elements of lane j of a row in shared memory (zeros past the row).
template <typename Tag, uint32_t D>
__device__ __forceinline__ void load_row(const uint8_t *row, uint32_t j, float *f) {
  using S = Shape<Tag, D>;
#pragma unroll
  for (uint32_t w = 0; w < S::kSpl; ++w) {
    const uint32_t slot = j + S::kLpr * w;
    if (slot < S::kSlots) {
      slot_to_float<Tag>(*reinterpret_cast<const uint4 *>(row + slot * 16), f + w * S::kVec);
    } else {
#pragma unroll
      for (uint32_t i = 0; i < S::kVec; ++i) f[w * S::kVec + i] = 0.f;
    }
  }
}

// Two products q x scale rounded to the storage type Tag and back to f32:
// dequantized's arithmetic (the gather's), a pair at a time.
template <typename Tag>
__device__ __forceinline__ void round_pair(float a, float b, float *f) {
  if constexpr (std::is_same_v<Tag, float>) {
    f[0] = a;
    f[1] = b;
  } else if constexpr (std::is_same_v<Tag, f16>) {
    const float2 x = __half22float2(__floats2half2_rn(a, b));
    f[0] = x.x;
    f[1] = x.y;
  } else {
    const __nv_bfloat162 x = __floats2bfloat162_rn(a, b);
    f[0] = __low2float(x);
    f[1] = __high2float(x);
  }
}

// The kE elements of lane j of an 8-bit row in shared memory (its D bytes
// at `row`) with scale `scale`, as the gather would have laid them out in
// the storage type (dequantized: a NaN scale gives Tag's quiet NaN) and
// load_row would read them back.
template <typename Tag, uint32_t D>
__device__ __forceinline__ void load_row_int8(const uint8_t *row, uint32_t j, float scale, float *f) {
  using S = Shape<Tag, D>;
  constexpr uint32_t kWords = S::kVec / 4;  // 32-bit words of 8-bit values a slot
  static_assert(S::kVec % 4 == 0, "a slot's 8-bit values are whole words");
  const bool nan_scale = scale != scale;
  const float nan_value = DevType<Tag>::to_f(quiet_nan<Tag>());
#pragma unroll
  for (uint32_t w = 0; w < S::kSpl; ++w) {
    const uint32_t slot = j + S::kLpr * w;
    float *o = f + w * S::kVec;
    if (slot < S::kSlots) {
      uint32_t raw[kWords];
      if constexpr (kWords == 2) {
        const uint2 x = *reinterpret_cast<const uint2 *>(row + slot * S::kVec);
        raw[0] = x.x;
        raw[1] = x.y;
      } else {
        raw[0] = *reinterpret_cast<const uint32_t *>(row + slot * S::kVec);
      }
#pragma unroll
      for (uint32_t k = 0; k < kWords; ++k) {
        float q[4];
        int8x4_to_float(raw[k], q);
        round_pair<Tag>(__fmul_rn(q[0], scale), __fmul_rn(q[1], scale), o + 4 * k);
        round_pair<Tag>(__fmul_rn(q[2], scale), __fmul_rn(q[3], scale), o + 4 * k + 2);
      }
      if (nan_scale) {
#pragma unroll
        for (uint32_t i = 0; i < S::kVec; ++i) o[i] = nan_value;
      }
    } else {
#pragma unroll
      for (uint32_t i = 0; i < S::kVec; ++i) o[i] = 0.f;
    }
  }
}

template <typename Tag, uint32_t D, uint32_t HC, bool kSrc>
__global__ void __launch_bounds__(kThreads, 2)
    attend_kernel(const int32_t *__restrict__ offsets, const uint8_t *__restrict__ xk,
                  const uint8_t *__restrict__ xv, const float *__restrict__ q, uint32_t G, float qscale,
                  uint32_t n_splits, float *__restrict__ part_o, float *__restrict__ part_lse, AttendRows rs) {
  using S = AttendShape<Tag, D, kSrc>;
  extern __shared__ uint4 dyn_smem[];
  uint8_t *smem = reinterpret_cast<uint8_t *>(dyn_smem);
  wait_prior_grid();
  const uint32_t r = blockIdx.x, split = blockIdx.y;
  const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int32_t beg = offsets[r];
  const uint32_t n = static_cast<uint32_t>(offsets[r + 1] - beg);
  // The run's real length splits it (the host knows only a bound, the
  // retrieval at its head's largest clusters): n_splits slices of at least
  // kMinChunk tokens.
  const uint32_t chunk = max(kMinChunk, (n + n_splits - 1) / n_splits);
  const uint64_t t0_wide = static_cast<uint64_t>(split) * chunk;
  float *po = part_o + (static_cast<size_t>(r) * n_splits + split) * G * D;
  float *pl = part_lse + (static_cast<size_t>(r) * n_splits + split) * G;
  if (t0_wide >= n) {  // past the run's end: an empty partial
    for (uint32_t i = tid; i < G * D; i += kThreads) po[i] = 0.f;
    for (uint32_t g = tid; g < G; g += kThreads) pl[g] = kNegInf;
    return;
  }
  const uint32_t t0 = static_cast<uint32_t>(t0_wide);
  const uint32_t t1 = min(n, t0 + chunk);

  // Warp roles: head group hg (heads g0 .. g0 + HC) and token warp tw.
  const uint32_t hgn = (G + HC - 1) / HC;
  const uint32_t hgp = hgn <= 1 ? 1 : (hgn <= 2 ? 2 : 4);
  const uint32_t ntw = kWarps / hgp, hg = warp % hgp, tw = warp / hgp;
  const uint32_t g0 = hg * HC;
  const bool active = g0 < G;
  const uint32_t rg = lane / S::kLpr, j = lane % S::kLpr;
  const uint32_t hid = head_of_lane<HC>(j);

  // q of this lane's elements, in log2 units.
  float qf[HC][kE];
#pragma unroll
  for (uint32_t h = 0; h < HC; ++h) {
    const uint32_t g = g0 + h;
#pragma unroll
    for (uint32_t w = 0; w < S::kSpl; ++w) {
      const uint32_t slot = j + S::kLpr * w;
      const bool ok = g < G && slot < S::kSlots;
      const float *src = q + (static_cast<size_t>(r) * G + (ok ? g : 0)) * D + (ok ? slot : 0) * S::kVec;
#pragma unroll
      for (uint32_t i = 0; i < S::kVec; i += 4) {
        const float4 x = ok ? __ldg(reinterpret_cast<const float4 *>(src + i)) : make_float4(0.f, 0.f, 0.f, 0.f);
        qf[h][w * S::kVec + i + 0] = x.x * qscale;
        qf[h][w * S::kVec + i + 1] = x.y * qscale;
        qf[h][w * S::kVec + i + 2] = x.z * qscale;
        qf[h][w * S::kVec + i + 3] = x.w * qscale;
      }
    }
  }

  float acc[HC][kE];
#pragma unroll
  for (uint32_t h = 0; h < HC; ++h)
#pragma unroll
    for (uint32_t e = 0; e < kE; ++e) acc[h][e] = 0.f;
  float m_run = kNegInf, l_run = 0.f;

  const uint32_t nblk = (t1 - t0 + S::kRows - 1) / S::kRows;
  const uint32_t mine = active && nblk > tw ? (nblk - tw + ntw - 1) / ntw : 0;
  uint8_t *wsm = smem + warp * S::kWarpBytes;
  float *ps = reinterpret_cast<float *>(smem + kWarps * S::kWarpBytes) + warp * S::kPsFloats;
  float *alpha_s = ps + S::kRows * HC;
  // Attending from frames: this warp's row sources, a block's in slot
  // block % kSrcSlots, and its rows' scales, a stage each.
  uint8_t *src_sm = smem + kWarps * S::kWarpBytes + kWarps * S::kPsFloats * sizeof(float) + warp * S::kSrcBytes;
  RowSource *rsrc = reinterpret_cast<RowSource *>(src_sm);  // [kSrcSlots][kRows]
  float *rscale = reinterpret_cast<float *>(src_sm + S::kSrcSlots * S::kRows * sizeof(RowSource));  // [kStages][2][kRows]

  // Whether lane `row` < kRows has a row of block i, and where its source is.
  auto source_at = [&](uint32_t i, const RowSource **at) -> bool {
    const uint32_t rb = t0 + (tw + i * ntw) * S::kRows;
    *at = rs.src + static_cast<size_t>(beg) + rb + lane;
    return i < mine && lane < S::kRows && rb + lane < t1;
  };
  if constexpr (kSrc) {
    // The first kStages blocks' sources ({0, 0} past the slice: a zero row
    // of the storage type).
#pragma unroll
    for (uint32_t i = 0; i < S::kStages; ++i) {
      const RowSource *at;
      const RowSource x = source_at(i, &at) ? *at : RowSource{0, 0};
      if (lane < S::kRows) rsrc[i * S::kRows + lane] = x;
    }
    __syncwarp();
  }

  // Copies block i of this warp into its stage; rows past t1 are zero-filled
  // (from a valid address, reading nothing). Always commits a group, empty
  // past the end, so that the wait count stays fixed. From frames, each row
  // comes from where its source says, an 8-bit row's D bytes at the start
  // of its slot and its scales beside the stage; the group also fetches
  // block i + kStages's sources, which block i + kStages's copies (issued
  // once this group is complete) read.
  auto issue = [&](uint32_t i) {
    if (i < mine) {
      const uint32_t rb = t0 + (tw + i * ntw) * S::kRows;
      const uint32_t valid = min(S::kRows, t1 - rb) * S::kRowBytes;
      uint8_t *dk = wsm + (i % S::kStages) * 2 * S::kBlockBytes;
      uint8_t *dv = dk + S::kBlockBytes;
      if constexpr (kSrc) {
        const RowSource *src = rsrc + (i % S::kSrcSlots) * S::kRows;
#pragma unroll
        for (uint32_t c = lane * 16; c < S::kBlockBytes; c += 512) {
          const uint32_t row = c / S::kRowBytes, within = c % S::kRowBytes;
          const RowSource x = src[row];
          const bool int8 = x.x & kRowInt8;
          if (int8 && within >= D) continue;  // past an 8-bit row's bytes: never read
          const bool ok = c < valid;
          const uint8_t *k = reinterpret_cast<const uint8_t *>(x.k) + within;
          const uint8_t *v = int8 ? k + rs.v_bytes : reinterpret_cast<const uint8_t *>(x.x) + within;
          cp_async16(dk + c, ok ? k : xk, ok);
          cp_async16(dv + c, ok ? v : xv, ok);
        }
        if (lane < S::kRows && (src[lane].x & kRowInt8)) {
          const float *ks = reinterpret_cast<const float *>(src[lane].x & ~kRowInt8);
          float *sc = rscale + (i % S::kStages) * 2 * S::kRows;
          cp_async4(sc + lane, ks);
          cp_async4(sc + S::kRows + lane, ks + rs.vs_floats);
        }
        const RowSource *at;
        const bool has = source_at(i + S::kStages, &at);
        if (lane < S::kRows) cp_async16(rsrc + ((i + S::kStages) % S::kSrcSlots) * S::kRows + lane, has ? at : rs.src, has);
      } else {
        const size_t src = (static_cast<size_t>(beg) + rb) * S::kRowBytes;
#pragma unroll
        for (uint32_t c = lane * 16; c < S::kBlockBytes; c += 512) {
          const bool ok = c < valid;
          cp_async16(dk + c, ok ? xk + src + c : xk, ok);
          cp_async16(dv + c, ok ? xv + src + c : xv, ok);
        }
      }
    }
    cp_async_commit();
  };

#pragma unroll
  for (uint32_t i = 0; i + 1 < S::kStages; ++i) issue(i);
  for (uint32_t i = 0; i < mine; ++i) {
    issue(i + S::kStages - 1);
    cp_async_wait<S::kStages - 1>();
    __syncwarp();
    const uint8_t *sk = wsm + (i % S::kStages) * 2 * S::kBlockBytes;
    const uint8_t *sv = sk + S::kBlockBytes;
    const uint32_t rb = t0 + (tw + i * ntw) * S::kRows;
    const uint32_t nrows = min(S::kRows, t1 - rb);
    // From frames: whether each of this lane's rows is 8-bit, and its scales.
    const RowSource *bsrc = rsrc + (i % S::kSrcSlots) * S::kRows;
    const float *bscale = rscale + (i % S::kStages) * 2 * S::kRows;
    auto row_values = [&](const uint8_t *block, uint32_t row, bool v, float *f) {
      if constexpr (kSrc) {
        if (bsrc[row].x & kRowInt8) {
          load_row_int8<Tag, D>(block + row * S::kRowBytes, j, bscale[(v ? S::kRows : 0) + row], f);
          return;
        }
      }
      load_row<Tag, D>(block + row * S::kRowBytes, j, f);
    };

    // Logits of kU rows per lane group, for head hid.
    float s[kU];
#pragma unroll
    for (uint32_t u = 0; u < kU; ++u) {
      const uint32_t row = u * S::kRpw + rg;
      float kf[kE];
      row_values(sk, row, false, kf);
      float part[HC];
#pragma unroll
      for (uint32_t h = 0; h < HC; ++h) {
        float a = 0.f;
#pragma unroll
        for (uint32_t e = 0; e < kE; ++e) a = fmaf(qf[h][e], kf[e], a);
        part[h] = a;
      }
      const float x = reduce_heads<HC, S::kLpr>(part, lane);
      s[u] = row < nrows ? x : kNegInf;
    }

    // Online softmax over the block: one max shift per head.
    float mx = s[0];
#pragma unroll
    for (uint32_t u = 1; u < kU; ++u) mx = fmaxf(mx, s[u]);
#pragma unroll
    for (uint32_t m = S::kLpr; m < 32; m <<= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, m));
    const float m_new = fmaxf(m_run, mx);
    const float alpha = m_new == kNegInf ? 1.f : exp2f(m_run - m_new);
    float psum = 0.f;
#pragma unroll
    for (uint32_t u = 0; u < kU; ++u) {
      s[u] = s[u] == kNegInf ? 0.f : exp2f(s[u] - m_new);
      psum += s[u];
    }
    l_run = l_run * alpha + psum;
    m_run = m_new;
    if (j < HC) {
#pragma unroll
      for (uint32_t u = 0; u < kU; ++u) ps[(u * S::kRpw + rg) * HC + hid] = s[u];
      if (rg == 0) alpha_s[hid] = alpha;
    }
    __syncwarp();

    // Rescale, then accumulate p * V for every head.
#pragma unroll
    for (uint32_t h = 0; h < HC; ++h) {
      const float a = alpha_s[h];
#pragma unroll
      for (uint32_t e = 0; e < kE; ++e) acc[h][e] *= a;
    }
#pragma unroll
    for (uint32_t u = 0; u < kU; ++u) {
      const uint32_t row = u * S::kRpw + rg;
      float vf[kE];
      row_values(sv, row, true, vf);
      float p[HC];
      const float *pr = ps + row * HC;
      if constexpr (HC % 4 == 0) {
#pragma unroll
        for (uint32_t h = 0; h < HC; h += 4) {
          const float4 x = *reinterpret_cast<const float4 *>(pr + h);
          p[h] = x.x;
          p[h + 1] = x.y;
          p[h + 2] = x.z;
          p[h + 3] = x.w;
        }
      } else {
#pragma unroll
        for (uint32_t h = 0; h < HC; ++h) p[h] = pr[h];
      }
#pragma unroll
      for (uint32_t h = 0; h < HC; ++h)
#pragma unroll
        for (uint32_t e = 0; e < kE; ++e) acc[h][e] = fmaf(p[h], vf[e], acc[h][e]);
    }
    __syncwarp();  // ps, this stage and its sources' slot are rewritten next
  }
  cp_async_wait<0>();

  // Rows of one warp share the max shift: sum over the row groups.
#pragma unroll
  for (uint32_t m = S::kLpr; m < 32; m <<= 1) {
#pragma unroll
    for (uint32_t h = 0; h < HC; ++h)
#pragma unroll
      for (uint32_t e = 0; e < kE; ++e) acc[h][e] += __shfl_xor_sync(kFull, acc[h][e], m);
    l_run += __shfl_xor_sync(kFull, l_run, m);
  }
  __syncthreads();  // every warp is done with the pipeline's shared memory

  // Merge the token warps in log space through shared memory.
  float *cm = reinterpret_cast<float *>(smem);  // [kWarps][kMaxG]
  float *cl = cm + kWarps * kMaxG;                 // [kWarps][kMaxG]
  float *co = cl + kWarps * kMaxG;                 // [ntw][G][D]
  if (active && rg == 0) {
    if (j < HC && g0 + hid < G) {
      cm[tw * kMaxG + g0 + hid] = m_run;
      cl[tw * kMaxG + g0 + hid] = l_run;
    }
#pragma unroll
    for (uint32_t h = 0; h < HC; ++h) {
      const uint32_t g = g0 + h;
      if (g >= G) continue;
#pragma unroll
      for (uint32_t w = 0; w < S::kSpl; ++w) {
        const uint32_t slot = j + S::kLpr * w;
        if (slot >= S::kSlots) continue;
        float *dst = co + (static_cast<size_t>(tw) * G + g) * D + slot * S::kVec;
#pragma unroll
        for (uint32_t i = 0; i < S::kVec; ++i) dst[i] = acc[h][w * S::kVec + i];
      }
    }
  }
  __syncthreads();
  for (uint32_t idx = tid; idx < G * D; idx += kThreads) {
    const uint32_t g = idx / D, i = idx % D;
    float M = kNegInf;
    for (uint32_t t = 0; t < ntw; ++t) M = fmaxf(M, cm[t * kMaxG + g]);
    float W = 0.f, o = 0.f;
    if (M > kNegInf) {
      for (uint32_t t = 0; t < ntw; ++t) {
        const float mt = cm[t * kMaxG + g];
        if (mt == kNegInf) continue;
        const float e = exp2f(mt - M);
        W = fmaf(cl[t * kMaxG + g], e, W);
        o = fmaf(co[(static_cast<size_t>(t) * G + g) * D + i], e, o);
      }
    }
    const bool empty = !(M > kNegInf) || !(W > 0.f);
    po[idx] = empty ? 0.f : o / W;
    if (i == 0) pl[g] = empty ? kNegInf : (M + log2f(W)) * kLn2;
  }
}

// CTA (rh, chunk) merges the splits of head g of run r (rh = r * G + g) for
// elements 32 chunk .. 32 chunk + 31, then the estimate, and writes out.
template <typename Tag>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const float *__restrict__ part_o, const float *__restrict__ part_lse, uint32_t n_splits,
                   uint32_t G, uint32_t D, uint32_t H, const float *__restrict__ est_out,
                   const float *__restrict__ est_lse, typename DevType<Tag>::type *out, int64_t seq_stride,
                   int64_t head_stride, float *lse, StepMark mark, const StepVars *vars) {
  __shared__ float w_s[kMaxCtas];
  __shared__ float4 red[kCombineLanes][kCombineCols];
  __shared__ float tmp[32];
  wait_prior_grid();
  if (vars) {  // a decode graph's output, read as the kernel runs
    out = static_cast<typename DevType<Tag>::type *>(vars->out);
    seq_stride = vars->out_seq_stride;
    head_stride = vars->out_head_stride;
    lse = vars->lse;
  }
  const uint32_t rh = blockIdx.x, chunk = blockIdx.y, r = rh / G, g = rh % G, sq = r / H, h = r % H;
  const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  constexpr uint32_t nw = kCombineThreads / 32;
  const float *pl = part_lse + static_cast<size_t>(r) * n_splits * G + g;

  float M = kNegInf;
  for (uint32_t s = tid; s < n_splits; s += kCombineThreads) M = fmaxf(M, pl[static_cast<size_t>(s) * G]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(kFull, M, o));
  if (lane == 0) tmp[warp] = M;
  __syncthreads();
  M = tmp[0];
  for (uint32_t w = 1; w < nw; ++w) M = fmaxf(M, tmp[w]);
  __syncthreads();

  float W = 0.f;
  for (uint32_t s = tid; s < n_splits; s += kCombineThreads) {
    const float l = pl[static_cast<size_t>(s) * G];
    const float w = (M == kNegInf || l == kNegInf) ? 0.f : expf(l - M);
    w_s[s] = w;
    W += w;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) W += __shfl_xor_sync(kFull, W, o);
  if (lane == 0) tmp[warp] = W;
  __syncthreads();  // also publishes w_s
  W = 0.f;
  for (uint32_t w = 0; w < nw; ++w) W += tmp[w];

  // merge_partials of (exact, estimate).
  const float la = (M == kNegInf || !(W > 0.f)) ? kNegInf : M + logf(W);
  const MergeWeights mw = merge_weights(la, est_lse ? est_lse[rh] : kNegInf);

  // Sum of w_s o_s over the splits: lane sl of column col takes splits
  // sl, sl + kCombineLanes, ...
  const uint32_t col = tid % kCombineCols, sl = tid / kCombineCols;
  const uint32_t i0 = chunk * kCombineCols * 4 + col * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (mw.wa != 0.f && i0 < D) {
    const size_t split_stride = static_cast<size_t>(G) * D;
    const float *po = part_o + static_cast<size_t>(r) * n_splits * split_stride + static_cast<size_t>(g) * D + i0;
#pragma unroll 4
    for (uint32_t s = sl; s < n_splits; s += kCombineLanes) {
      const float w = w_s[s];
      const float4 v = __ldg(reinterpret_cast<const float4 *>(po + s * split_stride));
      acc.x = fmaf(w, v.x, acc.x);
      acc.y = fmaf(w, v.y, acc.y);
      acc.z = fmaf(w, v.z, acc.z);
      acc.w = fmaf(w, v.w, acc.w);
    }
  }
  red[sl][col] = acc;
  __syncthreads();
  // No output: a captured step that may not work (bound_stage_kernel).
  if (tid < kCombineCols && i0 < D && out) {
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    for (uint32_t k = 0; k < kCombineLanes; ++k) {
      const float4 v = red[k][tid];
      a.x += v.x;
      a.y += v.y;
      a.z += v.z;
      a.w += v.w;
    }
    const float inv_w = W > 0.f ? 1.f / W : 0.f;
    const float oa[4] = {a.x * inv_w, a.y * inv_w, a.z * inv_w, a.w * inv_w};
    using T = typename DevType<Tag>::type;
    T *dst = out + static_cast<int64_t>(sq) * seq_stride + static_cast<int64_t>(h * G + g) * head_stride + i0;
    const float *eo = est_out ? est_out + static_cast<size_t>(rh) * D + i0 : nullptr;
#pragma unroll
    for (uint32_t k = 0; k < 4; ++k)
      dst[k] = DevType<Tag>::from_f(merged(mw, [&] { return oa[k]; }, [&] { return eo[k]; }));
  }
  if (chunk == 0 && tid == 0 && lse && out) lse[static_cast<size_t>(sq) * H * G + h * G + g] = mw.lse;
  signal_step_end(mark);
}

// One warp per (sequence, q head): the caller's output and lse merged with
// the estimate in place.
template <typename Tag>
__global__ void __launch_bounds__(128)
    merge_kernel(typename DevType<Tag>::type *out, int64_t seq_stride, int64_t head_stride, float *lse,
                 int64_t lse_seq_stride, const float *__restrict__ est_out, const float *__restrict__ est_lse,
                 uint32_t n_seqs, uint32_t nq, uint32_t D, StepMark mark) {
  wait_prior_grid();
  const uint32_t lane = threadIdx.x % 32;
  const uint64_t row = static_cast<uint64_t>(blockIdx.x) * 4 + threadIdx.x / 32;
  if (row < static_cast<uint64_t>(n_seqs) * nq) {
    const uint32_t sq = static_cast<uint32_t>(row / nq), h = static_cast<uint32_t>(row % nq);
    using T = typename DevType<Tag>::type;
    T *o = out + static_cast<int64_t>(sq) * seq_stride + static_cast<int64_t>(h) * head_stride;
    float *l = lse + static_cast<int64_t>(sq) * lse_seq_stride + h;
    const float *eo = est_out + row * D;
    const MergeWeights mw = merge_weights(*l, est_lse[row]);
    for (uint32_t i = lane; i < D; i += 32)
      o[i] = DevType<Tag>::from_f(merged(mw, [&] { return DevType<Tag>::to_f(o[i]); }, [&] { return eo[i]; }));
    __syncwarp();  // every lane has read *l
    if (lane == 0) *l = mw.lse;
  }
  signal_step_end(mark);
}

// Splits per run: enough to fill the device once, never shorter than
// kMinChunk tokens, and R * n_splits <= max(R, kMaxCtas).
uint32_t split_bound(uint32_t R, uint32_t max_tokens) {
  const uint32_t by_tokens = (max_tokens + kMinChunk - 1) / kMinChunk;
  const uint32_t by_ctas = R >= kMaxCtas ? 1u : kMaxCtas / R;
  uint32_t n = by_tokens < by_ctas ? by_tokens : by_ctas;
  return n < 1 ? 1u : n;
}

template <typename Tag, uint32_t D, uint32_t HC>
cudaError_t attend_impl(const int32_t *offsets, const void *xk, const void *xv, const float *q, uint32_t R,
                   uint32_t H, uint32_t G, float scale, uint32_t max_tokens, const float *est_out,
                   const float *est_lse, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
                   float *scratch, size_t scratch_floats, const StepMark &mark, const StepVars *vars,
                   const AttendRows &rows, cudaStream_t s) {
  auto *laid_out = attend_kernel<Tag, D, HC, false>;
  auto *from_frames = attend_kernel<Tag, D, HC, true>;
  constexpr size_t smem = attend_smem_bytes<HC, Tag, D, false>();
  constexpr size_t smem_src = attend_smem_bytes<HC, Tag, D, true>();
  // The shared memory limits, once per device (an attribute of the device's
  // context), and the CTAs that fill the device once, read once: the
  // kernel over a laid-out buffer's, for both, so that a decode from frames
  // splits its runs as the split verbs do (and gives their bits).
  static std::atomic<uint64_t> smem_set{0}, smem_src_set{0};
  if (rows.src)
    WKV_CUDA_TRY(set_func_attribute_once(reinterpret_cast<const void *>(from_frames),
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_src),
                                         &smem_src_set));
  else
    WKV_CUDA_TRY(set_func_attribute_once(reinterpret_cast<const void *>(laid_out),
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem),
                                         &smem_set));
  int dev = 0;
  WKV_CUDA_CHECK(cudaGetDevice(&dev));
  static const int fill = [&]() -> int {
    int sms = 0, per_sm = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, laid_out, kThreads, smem) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return sms * (per_sm > 0 ? per_sm : 1);
  }();
  const uint32_t bound = split_bound(R, max_tokens);
  const uint32_t target = fill > 0 ? static_cast<uint32_t>(fill < static_cast<int>(kMaxCtas) ? fill : kMaxCtas) : 264u;
  uint32_t n_splits = target / R;
  if (n_splits > bound) n_splits = bound;
  if (n_splits < 1) n_splits = 1;
  const size_t need = static_cast<size_t>(R) * n_splits * G * (D + 1);
  if (scratch_floats < need || scratch == nullptr)
    return cudaErrorInvalidValue;
  float *part_o = scratch;
  float *part_lse = scratch + static_cast<size_t>(R) * n_splits * G * D;
  if (rows.src) {
    // The row sources stand in as the (never read) address of zero-filled rows.
    const uint8_t *any = reinterpret_cast<const uint8_t *>(rows.src);
    WKV_CUDA_TRY(launch_pdl(from_frames, dim3(R, n_splits), dim3(kThreads), smem_src, s, 1, offsets, any, any, q, G,
                            scale * kLog2e, n_splits, part_o, part_lse, rows));
  } else {
    WKV_CUDA_TRY(launch_pdl(laid_out, dim3(R, n_splits), dim3(kThreads), smem, s, 1, offsets,
                            static_cast<const uint8_t *>(xk), static_cast<const uint8_t *>(xv), q, G,
                            scale * kLog2e, n_splits, part_o, part_lse, rows));
  }
  using T = typename DevType<Tag>::type;
  const uint32_t chunks = (D + kCombineCols * 4 - 1) / (kCombineCols * 4);
  return launch_pdl(combine_kernel<Tag>, dim3(R * G, chunks), dim3(kCombineThreads), 0, s, 1,
                    static_cast<const float *>(part_o), static_cast<const float *>(part_lse), n_splits, G, D, H,
                    est_out, est_lse, static_cast<T *>(out), seq_stride, head_stride, lse, mark, vars);
}

template <typename Tag, uint32_t D>
cudaError_t attend_dispatch_group(uint32_t G, const int32_t *offsets, const void *xk, const void *xv, const float *q,
                             uint32_t R, uint32_t H, float scale, uint32_t max_tokens, const float *est_out,
                             const float *est_lse, void *out, int64_t seq_stride, int64_t head_stride,
                             float *lse, float *scratch, size_t scratch_floats, const StepMark &mark,
                             const StepVars *vars, const AttendRows &rows, cudaStream_t s) {
#define WKV_ATTEND_HC(HC)                                                                                   \
  attend_impl<Tag, D, HC>(offsets, xk, xv, q, R, H, G, scale, max_tokens, est_out, est_lse, out, seq_stride, \
                          head_stride, lse, scratch, scratch_floats, mark, vars, rows, s)
  if (G <= 1) return WKV_ATTEND_HC(1);
  if (G <= 2) return WKV_ATTEND_HC(2);
  if (G <= 4) return WKV_ATTEND_HC(4);
  return WKV_ATTEND_HC(8);
#undef WKV_ATTEND_HC
}

}  // namespace

size_t attend_ragged_scratch_floats(uint32_t R, uint32_t G, uint32_t d, uint32_t max_tokens) {
  return static_cast<size_t>(R) * split_bound(R, max_tokens) * G * (d + 1);
}

cudaError_t attend_ragged(DType t, const int32_t *offsets, const void *xk, const void *xv, const float *q,
                     uint32_t R, uint32_t H, uint32_t G, uint32_t d, float scale, uint32_t max_tokens,
                     const float *est_out, const float *est_lse, void *out, int64_t seq_stride,
                     int64_t head_stride, float *lse, float *scratch, size_t scratch_floats, void *stream,
                     const StepMark &mark, const StepVars *vars, const AttendRows &rows) {
  if (G == 0 || G > kMaxG)
    return cudaErrorNotSupported;
  if (H == 0 || R % H != 0)
    return cudaErrorInvalidValue;
  if ((est_out == nullptr) != (est_lse == nullptr))
    return cudaErrorInvalidValue;
  if (R == 0) return cudaSuccess;
  if (offsets == nullptr || (rows.src == nullptr && (xk == nullptr || xv == nullptr)) || q == nullptr ||
      (out == nullptr && vars == nullptr))
    return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(xk) % 16 != 0 || reinterpret_cast<uintptr_t>(xv) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(q) % 16 != 0 || reinterpret_cast<uintptr_t>(rows.src) % 16 != 0 ||
      rows.v_bytes % 16 != 0)
    return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return WKV_DISPATCH_HEAD_DIM(d, HEAD_DIM, [&]() -> cudaError_t {
    return WKV_DISPATCH_DTYPE(t, Tag, cudaErrorNotSupported, [&]() -> cudaError_t {
      return attend_dispatch_group<Tag, HEAD_DIM>(G, offsets, xk, xv, q, R, H, scale, max_tokens, est_out, est_lse,
                                                  out, seq_stride, head_stride, lse, scratch, scratch_floats, mark,
                                                  vars, rows, s);
    });
  });
}

cudaError_t merge_estimate(DType t, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
                      int64_t lse_seq_stride, const float *est_out, const float *est_lse, uint32_t n_seqs,
                      uint32_t n_q_heads, uint32_t d, void *stream, const StepMark &mark) {
  const uint64_t rows = static_cast<uint64_t>(n_seqs) * n_q_heads;
  if (rows == 0) return cudaSuccess;
  if (out == nullptr || lse == nullptr || est_out == nullptr || est_lse == nullptr)
    return cudaErrorInvalidValue;
  if (d == 0 || d > 256) return cudaErrorNotSupported;
  if ((rows + 3) / 4 > 0x7fffffffu) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const uint32_t blocks = static_cast<uint32_t>((rows + 3) / 4);
  return WKV_DISPATCH_DTYPE(t, Tag, cudaErrorNotSupported, [&]() -> cudaError_t {
    return launch_pdl(merge_kernel<Tag>, dim3(blocks), dim3(128), 0, s, 1,
                      static_cast<typename DevType<Tag>::type *>(out), seq_stride, head_stride, lse, lse_seq_stride,
                      est_out, est_lse, n_seqs, n_q_heads, d, mark);
  });
}

}  // namespace wkv::kernels
