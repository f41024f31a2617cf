// CPU kernels: the CPU backend's hot paths and the references for the CUDA
// kernels. Single-threaded by design (the engine spreads heads and segments
// over its thread pool); vectorised with `omp simd` under -fopenmp-simd.
#include "kernels/cpu_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>

namespace wkv::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The build targets baseline x86-64 (SSE2, no FMA). The three loops that
// dominate run time (k-means assignment, cluster scoring, exact attention)
// get an extra x86-64-v3 (AVX2 + FMA) clone, picked once at load time from
// the CPU's features: about twice as fast. Results are deterministic on one
// machine; the two clones may differ in the last bits (FMA rounds once,
// vector width changes the order of reductions). Clones need GCC or Clang
// and ifunc (ELF, glibc); WKV_NO_TARGET_CLONES turns them off.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && \
    !defined(WKV_NO_TARGET_CLONES)
#define WKV_HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define WKV_HOT
#endif
// GCC inlines a helper into a clone of another -march only when forced.
#define WKV_INLINE inline __attribute__((always_inline))

WKV_INLINE uint32_t round_up(uint32_t x, uint32_t m) { return (x + m - 1) / m * m; }

// Four dot products of `a` with four rows; one vector chain per row hides
// the add latency that a single reduction would be bound by.
WKV_INLINE void dot4(const float *a, const float *b0, const float *b1,
                 const float *b2, const float *b3, uint32_t d, float *s) {
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (uint32_t j = 0; j < d; ++j) {
    s0 += a[j] * b0[j];
    s1 += a[j] * b1[j];
    s2 += a[j] * b2[j];
    s3 += a[j] * b3[j];
  }
  s[0] = s0;
  s[1] = s1;
  s[2] = s2;
  s[3] = s3;
}

// One dot product split into four contiguous quarters, for the same reason.
WKV_INLINE float dot_split(const float *a, const float *b, uint32_t d) {
  const uint32_t q = d / 4;
  const float *a1 = a + q, *a2 = a + 2 * q, *a3 = a + 3 * q;
  const float *b1 = b + q, *b2 = b + 2 * q, *b3 = b + 3 * q;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (uint32_t j = 0; j < q; ++j) {
    s0 += a[j] * b[j];
    s1 += a1[j] * b1[j];
    s2 += a2[j] * b2[j];
    s3 += a3[j] * b3[j];
  }
  float s = (s0 + s1) + (s2 + s3);
  for (uint32_t j = 4 * q; j < d; ++j) s += a[j] * b[j];
  return s;
}

// Dot products of two vectors a, b with four rows r, r + d, r + 2d, r + 3d:
// eight independent chains, six loads per eight multiply-adds.
WKV_INLINE void dot_2x4(const float *a, const float *b, const float *r, uint32_t d,
                    float *sa, float *sb) {
  const float *r1 = r + d, *r2 = r + 2 * d, *r3 = r + 3 * d;
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
  float b0 = 0.f, b1 = 0.f, b2 = 0.f, b3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3, b0, b1, b2, b3)
  for (uint32_t j = 0; j < d; ++j) {
    a0 += a[j] * r[j];
    a1 += a[j] * r1[j];
    a2 += a[j] * r2[j];
    a3 += a[j] * r3[j];
    b0 += b[j] * r[j];
    b1 += b[j] * r1[j];
    b2 += b[j] * r2[j];
    b3 += b[j] * r3[j];
  }
  sa[0] = a0, sa[1] = a1, sa[2] = a2, sa[3] = a3;
  sb[0] = b0, sb[1] = b1, sb[2] = b2, sb[3] = b3;
}

// Unscaled logits of heads q [G][d] over rows kb [nt][d] into s[g * ld + t].
WKV_INLINE void block_logits(const float *q, uint32_t G, const float *kb,
                             uint32_t nt, uint32_t d, float *s, size_t ld) {
  uint32_t g = 0;
  for (; g + 2 <= G; g += 2) {
    const float *qa = q + size_t(g) * d, *qb = qa + d;
    float *sa = s + g * ld, *sb = sa + ld;
    uint32_t t = 0;
    for (; t + 4 <= nt; t += 4)
      dot_2x4(qa, qb, kb + size_t(t) * d, d, sa + t, sb + t);
    for (; t < nt; ++t) {
      sa[t] = dot_split(qa, kb + size_t(t) * d, d);
      sb[t] = dot_split(qb, kb + size_t(t) * d, d);
    }
  }
  if (g < G) {
    const float *qa = q + size_t(g) * d;
    float *sa = s + g * ld;
    uint32_t t = 0;
    for (; t + 4 <= nt; t += 4) {
      const float *r = kb + size_t(t) * d;
      dot4(qa, r, r + d, r + 2 * d, r + 3 * d, d, sa + t);
    }
    for (; t < nt; ++t) sa[t] = dot_split(qa, kb + size_t(t) * d, d);
  }
}

WKV_INLINE float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
WKV_INLINE uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// exp(x) for x <= 0: every softmax weight after the max shift. libm's expf
// is a call per element and keeps the weight loops scalar; this one is
// branch-free and vectorises (within 2 ulp of exp). Below -86 it returns 0
// rather than a subnormal, a relative weight under 5e-38; -inf gives 0 and
// NaN stays NaN.
WKV_INLINE float exp_nonpos(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds
  const float t = x * 1.44269504088896341f + kRound;
  const float n = t - kRound;  // round(x / ln 2)
  // x - n ln 2 with ln 2 split in two so that n * hi is exact.
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float y = 1.f / 5040;
  y = y * r + 1.f / 720;
  y = y * r + 1.f / 120;
  y = y * r + 1.f / 24;
  y = y * r + 1.f / 6;
  y = y * r + 0.5f;
  y = y * r + 1.f;
  y = y * r + 1.f;
  // Times 2^n: n sits in the low mantissa bits of t.
  const uint32_t scaled = float_to_bits(y) + (float_to_bits(t) << 23);
  // Range checks on the bits: float compares would keep the loop scalar.
  const int32_t mag = static_cast<int32_t>(float_to_bits(x) & 0x7fffffffu);
  const uint32_t is_nan = 0u - uint32_t(mag > 0x7f800000);
  const uint32_t is_tiny = 0u - uint32_t(mag > 0x42ac0000);  // |x| > 86
  return bits_to_float((float_to_bits(x) & is_nan) | (scaled & ~is_tiny));
}

// k-means ---------------------------------------------------------------

// The assignment step is a [T x d] x [d x k] product followed by an argmax
// per row. Both operands are packed into panels so that the register tile
// (kTileP points x kTileC centroids, 8 AVX2 accumulators) reads them
// contiguously:
//   points     xp[T4 / kTileP][d][kTileP]   T4 = T rounded up, pad rows zero
//   directions cp[K16 / kTileC][d][kTileC]  K16 = k rounded up, pad zero
// Each accumulator sums over j in order, so the result does not depend on
// how the compiler vectorises across centroids.
constexpr uint32_t kTileP = 4;
constexpr uint32_t kTileC = 16;
// Centroid panels swept per pass over the points: about 128 KiB, so that
// they stay in L2 while every point panel streams past them.
constexpr uint32_t kCentroidBlockFloats = 32768;

// For each point i < T4, raises best[i]/arg[i] to the highest dot product
// with directions [0, k). Directions are visited in ascending order and only
// a strictly larger dot replaces the best, so ties go to the lower index.
WKV_HOT void assign_panels(const float *xp, uint32_t T4, const float *cp,
                           uint32_t k, uint32_t d, float *best,
                           uint32_t *arg) {
  const uint32_t k16 = round_up(k, kTileC);
  const uint32_t block = std::max<uint32_t>(
      kTileC, kCentroidBlockFloats / (kTileC * std::max(d, 1u)) * kTileC);
  for (uint32_t cb = 0; cb < k16; cb += block) {
    const uint32_t ce = std::min(k16, cb + block);
    for (uint32_t i0 = 0; i0 < T4; i0 += kTileP) {
      const float *xpanel = xp + size_t(i0) * d;
      for (uint32_t c0 = cb; c0 < ce; c0 += kTileC) {
        float acc[kTileP][kTileC] = {};
        const float *a = xpanel;
        const float *c = cp + size_t(c0) * d;
        for (uint32_t j = 0; j < d; ++j, a += kTileP, c += kTileC) {
#pragma omp simd
          for (uint32_t q = 0; q < kTileC; ++q)
            for (uint32_t p = 0; p < kTileP; ++p) acc[p][q] += a[p] * c[q];
        }
        const uint32_t nc = std::min(kTileC, k - c0);
        for (uint32_t p = 0; p < kTileP; ++p) {
          for (uint32_t q = 0; q < nc; ++q) {
            if (acc[p][q] > best[i0 + p]) {
              best[i0 + p] = acc[p][q];
              arg[i0 + p] = c0 + q;
            }
          }
        }
      }
    }
  }
}

// Uniform integer in [0, n), n >= 1, without modulo bias; defined here
// rather than by std::uniform_int_distribution, whose output differs
// between standard libraries.
inline uint64_t uniform_below(std::mt19937_64 &rng, uint64_t n) {
  const uint64_t threshold = (0 - n) % n;  // 2^64 mod n
  for (;;) {
    const uint64_t x = rng();
    if (x >= threshold) return x % n;
  }
}

// Scoring ------------------------------------------------------------------

// Centroid rows per pass over the heads: 16 KiB at d = 128, kept in L1
// while every head pair reads them.
constexpr uint32_t kScoreRows = 32;

// The body of score_clusters, cloned: every decoding step scores every
// cluster of every sequence, layer and kv head, as much work as the exact
// attention itself.
WKV_HOT void score_impl(const float *q, uint32_t G, const float *centroid,
                        uint32_t C, uint32_t d, float scale, float *logits,
                        float *score) {
  for (uint32_t c0 = 0; c0 < C; c0 += kScoreRows)
    block_logits(q, G, centroid + size_t(c0) * d, std::min(kScoreRows, C - c0),
                 d, logits + c0, C);
  std::fill(score, score + C, 0.f);
  for (uint32_t g = 0; g < G; ++g) {
    float *lg = logits + size_t(g) * C;
#pragma omp simd
    for (uint32_t c = 0; c < C; ++c) lg[c] *= scale;
    float m = kNegInf;
    for (uint32_t c = 0; c < C; ++c) m = std::max(m, lg[c]);
    if (m == kNegInf) continue;  // no cluster has any weight for this head
    // The weights are computed twice rather than stored: the kernel has no
    // scratch, and the exp is cheap next to the logits.
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (uint32_t c = 0; c < C; ++c) sum += exp_nonpos(lg[c] - m);
    const float inv = 1.f / sum;
#pragma omp simd
    for (uint32_t c = 0; c < C; ++c) score[c] += exp_nonpos(lg[c] - m) * inv;
  }
}

// Attention ----------------------------------------------------------------

// K and V of one block of tokens as f32, on the stack: 32 KiB each.
constexpr uint32_t kBlockFloats = 8192;
constexpr uint32_t kMaxBlockTokens = 64;
// Heads whose running max and sum sit on the stack while a block is reused.
constexpr uint32_t kHeadGroup = 32;

// Online-softmax step of G <= kHeadGroup heads over nt <= kMaxBlockTokens
// tokens kb, vb [nt][d] (f32). m, l: running max and sum per head; out
// [G][d]: running unnormalised output.
WKV_HOT void attend_block(const float *q, uint32_t G, const float *kb,
                          const float *vb, uint32_t nt, uint32_t d,
                          float scale, float *m, float *l, float *out) {
  float logits[kHeadGroup * kMaxBlockTokens];
  block_logits(q, G, kb, nt, d, logits, kMaxBlockTokens);
  for (uint32_t g = 0; g < G; ++g) {
    float *s = logits + size_t(g) * kMaxBlockTokens;
#pragma omp simd
    for (uint32_t t = 0; t < nt; ++t) s[t] *= scale;
    float bmax = kNegInf;
    for (uint32_t t = 0; t < nt; ++t) bmax = std::max(bmax, s[t]);
    const float new_m = std::max(m[g], bmax);
    if (new_m == kNegInf) continue;  // nothing has weight yet
    const float alpha = exp_nonpos(m[g] - new_m);  // 0 on the first block
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (uint32_t t = 0; t < nt; ++t) {
      s[t] = exp_nonpos(s[t] - new_m);
      sum += s[t];
    }
    l[g] = l[g] * alpha + sum;
    m[g] = new_m;
    float *o = out + size_t(g) * d;
    if (alpha != 1.f) {
#pragma omp simd
      for (uint32_t j = 0; j < d; ++j) o[j] *= alpha;
    }
    // Eight rows per pass over o: one load and store of o per eight
    // multiply-adds; the iterations over j are independent chains.
    uint32_t t = 0;
    for (; t + 8 <= nt; t += 8) {
      const float *v0 = vb + size_t(t) * d, *v1 = v0 + d, *v2 = v1 + d,
                  *v3 = v2 + d, *v4 = v3 + d, *v5 = v4 + d, *v6 = v5 + d,
                  *v7 = v6 + d;
      const float *p = s + t;
#pragma omp simd
      for (uint32_t j = 0; j < d; ++j) {
        float acc = o[j];
        acc += p[0] * v0[j];
        acc += p[1] * v1[j];
        acc += p[2] * v2[j];
        acc += p[3] * v3[j];
        acc += p[4] * v4[j];
        acc += p[5] * v5[j];
        acc += p[6] * v6[j];
        acc += p[7] * v7[j];
        o[j] = acc;
      }
    }
    for (; t < nt; ++t) {
      const float *v0 = vb + size_t(t) * d;
      const float p0 = s[t];
#pragma omp simd
      for (uint32_t j = 0; j < d; ++j) o[j] += p0 * v0[j];
    }
  }
}

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::kF32; }
template <> constexpr DType dtype_of<f16>() { return DType::kF16; }
template <> constexpr DType dtype_of<bf16>() { return DType::kBF16; }

// Writes the normalised output and lse of heads [0, G) from their running
// state.
inline void finish_heads(uint32_t G, uint32_t d, const float *m,
                         const float *l, float *out, float *lse) {
  for (uint32_t g = 0; g < G; ++g) {
    float *o = out + size_t(g) * d;
    if (!(l[g] > 0.f)) {  // every logit was -inf
      std::fill(o, o + d, 0.f);
      lse[g] = kNegInf;
      continue;
    }
    const float inv = 1.f / l[g];
#pragma omp simd
    for (uint32_t j = 0; j < d; ++j) o[j] *= inv;
    lse[g] = m[g] + std::log(l[g]);
  }
}

// Token-by-token online softmax reading storage directly; only for 16-bit
// rows too long (d > kBlockFloats) for the block buffers.
template <typename T>
void attend_unbuffered(const float *q, uint32_t G, const T *k, const T *v,
                       uint32_t n, uint32_t d, float scale, float *out,
                       float *lse) {
  for (uint32_t g = 0; g < G; ++g) {
    const float *qg = q + size_t(g) * d;
    float *o = out + size_t(g) * d;
    std::fill(o, o + d, 0.f);
    float m = kNegInf, l = 0.f;
    for (uint32_t t = 0; t < n; ++t) {
      const T *kr = k + size_t(t) * d, *vr = v + size_t(t) * d;
      float s = 0.f;
      for (uint32_t j = 0; j < d; ++j) s += qg[j] * load(kr, j);
      s *= scale;
      const float new_m = std::max(m, s);
      if (new_m == kNegInf) continue;
      const float alpha = exp_nonpos(m - new_m), p = exp_nonpos(s - new_m);
      l = l * alpha + p;
      m = new_m;
      for (uint32_t j = 0; j < d; ++j) o[j] = o[j] * alpha + p * load(vr, j);
    }
    finish_heads(1, d, &m, &l, o, lse + g);
  }
}

template <typename T>
void attend_impl(const float *q, uint32_t G, const T *k, const T *v,
                 uint32_t n, uint32_t d, float scale, float *out,
                 float *lse) {
  constexpr bool kDirect = std::is_same_v<T, float>;
  const uint32_t bt = kDirect || d == 0
                          ? kMaxBlockTokens
                          : std::min(kMaxBlockTokens, kBlockFloats / d);
  if (bt == 0) {
    attend_unbuffered(q, G, k, v, n, d, scale, out, lse);
    return;
  }
  alignas(64) float kbuf[kDirect ? 1 : kBlockFloats];
  alignas(64) float vbuf[kDirect ? 1 : kBlockFloats];
  float m[kHeadGroup], l[kHeadGroup];
  for (uint32_t g0 = 0; g0 < G; g0 += kHeadGroup) {
    const uint32_t gn = std::min(kHeadGroup, G - g0);
    const float *qg = q + size_t(g0) * d;
    float *og = out + size_t(g0) * d;
    std::fill(og, og + size_t(gn) * d, 0.f);
    std::fill(m, m + gn, kNegInf);
    std::fill(l, l + gn, 0.f);
    for (uint32_t t0 = 0; t0 < n; t0 += bt) {
      const uint32_t nt = std::min(bt, n - t0);
      const T *kr = k + size_t(t0) * d, *vr = v + size_t(t0) * d;
      if constexpr (kDirect) {
        attend_block(qg, gn, kr, vr, nt, d, scale, m, l, og);
      } else {
        to_float(dtype_of<T>(), kr, kbuf, size_t(nt) * d);
        to_float(dtype_of<T>(), vr, vbuf, size_t(nt) * d);
        attend_block(qg, gn, kbuf, vbuf, nt, d, scale, m, l, og);
      }
    }
    finish_heads(gn, d, m, l, og, lse + g0);
  }
}

}  // namespace

// Zero vectors: a key equal to the segment mean has no direction. It is left
// zero, so its dot with every direction is 0 and the tie rule puts it in the
// lowest-numbered cluster; a cluster whose members sum to zero keeps its
// previous direction, as an empty one does. iters == 0 still assigns once.
void kmeans_segment(const KMeansParams &p, const float *keys,
                    const float *values, uint32_t T, uint32_t d,
                    SegmentClusters *out) {
  out->n_clusters = 0;
  out->order.clear();
  out->begin.assign(1, 0);
  out->centroid.clear();
  out->value_sum.clear();
  out->size.clear();
  if (T == 0) return;
  const uint32_t k = std::clamp<uint32_t>(p.n_clusters, 1, T);
  const uint32_t T4 = round_up(T, kTileP);
  const uint32_t k16 = round_up(k, kTileC);

  // Centered, normalised points, packed for the assignment kernel.
  std::vector<double> mean(d, 0.0);
  for (uint32_t i = 0; i < T; ++i) {
    const float *key = keys + size_t(i) * d;
#pragma omp simd
    for (uint32_t j = 0; j < d; ++j) mean[j] += key[j];
  }
  for (uint32_t j = 0; j < d; ++j) mean[j] /= T;
  std::vector<float> xp(size_t(T4) * d, 0.f);
  std::vector<float> row(d);
  for (uint32_t i = 0; i < T; ++i) {
    const float *key = keys + size_t(i) * d;
    double norm2 = 0.0;
    for (uint32_t j = 0; j < d; ++j) {
      row[j] = static_cast<float>(key[j] - mean[j]);
      norm2 += double(row[j]) * row[j];
    }
    const float inv = norm2 > 0.0 ? static_cast<float>(1.0 / std::sqrt(norm2)) : 0.f;
    float *dst = xp.data() + size_t(i / kTileP) * kTileP * d + i % kTileP;
    for (uint32_t j = 0; j < d; ++j) dst[size_t(j) * kTileP] = row[j] * inv;
  }
  auto point = [&](uint32_t i, uint32_t j) {
    return xp[size_t(i / kTileP) * kTileP * d + size_t(j) * kTileP + i % kTileP];
  };

  // k distinct initial points: a partial Fisher-Yates shuffle.
  std::vector<uint32_t> idx(T);
  for (uint32_t i = 0; i < T; ++i) idx[i] = i;
  std::mt19937_64 rng(p.seed);
  for (uint32_t i = 0; i < k; ++i)
    std::swap(idx[i], idx[i + uniform_below(rng, T - i)]);
  std::vector<float> dir(size_t(k) * d);
  for (uint32_t c = 0; c < k; ++c)
    for (uint32_t j = 0; j < d; ++j) dir[size_t(c) * d + j] = point(idx[c], j);

  std::vector<float> cp(size_t(k16) * d, 0.f);
  std::vector<float> best(T4);
  std::vector<uint32_t> arg(T4), assign(T, UINT32_MAX), count(k);
  std::vector<double> sum(size_t(k) * d);
  const uint32_t rounds = std::max<uint32_t>(p.iters, 1);
  for (uint32_t r = 0; r < rounds; ++r) {
    for (uint32_t c = 0; c < k; ++c) {
      float *dst = cp.data() + size_t(c / kTileC) * kTileC * d + c % kTileC;
      for (uint32_t j = 0; j < d; ++j) dst[size_t(j) * kTileC] = dir[size_t(c) * d + j];
    }
    std::fill(best.begin(), best.end(), kNegInf);
    std::fill(arg.begin(), arg.end(), 0u);
    assign_panels(xp.data(), T4, cp.data(), k, d, best.data(), arg.data());
    bool changed = false;
    for (uint32_t i = 0; i < T; ++i) {
      changed |= assign[i] != arg[i];
      assign[i] = arg[i];
    }
    if (!changed || r + 1 == rounds) break;

    std::fill(sum.begin(), sum.end(), 0.0);
    std::fill(count.begin(), count.end(), 0u);
    for (uint32_t i = 0; i < T; ++i) {
      double *s = sum.data() + size_t(assign[i]) * d;
      const float *x = xp.data() + size_t(i / kTileP) * kTileP * d + i % kTileP;
      for (uint32_t j = 0; j < d; ++j) s[j] += x[size_t(j) * kTileP];
      ++count[assign[i]];
    }
    for (uint32_t c = 0; c < k; ++c) {
      if (count[c] == 0) continue;
      const double *s = sum.data() + size_t(c) * d;
      double norm2 = 0.0;
      for (uint32_t j = 0; j < d; ++j) norm2 += s[j] * s[j];
      if (!(norm2 > 0.0)) continue;
      const double inv = 1.0 / std::sqrt(norm2);
      for (uint32_t j = 0; j < d; ++j) dir[size_t(c) * d + j] = static_cast<float>(s[j] * inv);
    }
  }

  // Compact: drop empty clusters, keep the survivors in index order.
  std::fill(count.begin(), count.end(), 0u);
  for (uint32_t i = 0; i < T; ++i) ++count[assign[i]];
  std::vector<uint32_t> renum(k, UINT32_MAX);
  uint32_t kk = 0;
  for (uint32_t c = 0; c < k; ++c)
    if (count[c] > 0) renum[c] = kk++;
  out->n_clusters = kk;
  out->size.resize(kk);
  out->begin.assign(kk + 1, 0);
  for (uint32_t c = 0; c < k; ++c)
    if (count[c] > 0) out->size[renum[c]] = count[c];
  for (uint32_t c = 0; c < kk; ++c) out->begin[c + 1] = out->begin[c] + out->size[c];
  out->order.resize(T);
  std::vector<uint32_t> fill(out->begin.begin(), out->begin.end() - 1);
  for (uint32_t i = 0; i < T; ++i) out->order[fill[renum[assign[i]]]++] = i;

  out->centroid.resize(size_t(kk) * d);
  out->value_sum.resize(size_t(kk) * d);
  std::vector<double> ksum(d), vsum(d);
  for (uint32_t c = 0; c < kk; ++c) {
    std::fill(ksum.begin(), ksum.end(), 0.0);
    std::fill(vsum.begin(), vsum.end(), 0.0);
    for (uint32_t e = out->begin[c]; e < out->begin[c + 1]; ++e) {
      const float *key = keys + size_t(out->order[e]) * d;
      const float *val = values + size_t(out->order[e]) * d;
#pragma omp simd
      for (uint32_t j = 0; j < d; ++j) {
        ksum[j] += key[j];
        vsum[j] += val[j];
      }
    }
    const double inv = 1.0 / out->size[c];
    for (uint32_t j = 0; j < d; ++j) {
      out->centroid[size_t(c) * d + j] = static_cast<float>(ksum[j] * inv);
      out->value_sum[size_t(c) * d + j] = static_cast<float>(vsum[j]);
    }
  }
}

void score_clusters(const float *q, uint32_t G, const float *centroid,
                    uint32_t C, uint32_t d, float scale, float *logits,
                    float *score) {
  score_impl(q, G, centroid, C, d, scale, logits, score);
}

// Selection runs two nth_element passes over scratch under one strict total
// order (score descending, id ascending; NaN ranks with -inf), then reads
// the two boundary elements back as thresholds in one scan over ids, so the
// outputs come out sorted without a sort: O(C) expected.
void select_zones(const float *score, uint32_t C, uint32_t n_ret,
                  uint32_t n_est, uint32_t *ret, uint32_t *est,
                  uint32_t *scratch) {
  const uint32_t n_sel = n_ret + n_est;
  if (n_sel == 0) return;
  auto key = [score](uint32_t i) {
    const float s = score[i];
    return std::isnan(s) ? kNegInf : s;
  };
  auto before = [&key](uint32_t a, uint32_t b) {
    const float sa = key(a), sb = key(b);
    return sa > sb || (sa == sb && a < b);
  };
  for (uint32_t i = 0; i < C; ++i) scratch[i] = i;
  std::nth_element(scratch, scratch + (n_sel - 1), scratch + C, before);
  const uint32_t last_sel = scratch[n_sel - 1];
  uint32_t last_ret = 0;
  if (n_ret > 0) {
    std::nth_element(scratch, scratch + (n_ret - 1), scratch + n_sel, before);
    last_ret = scratch[n_ret - 1];
  }
  uint32_t nr = 0, ne = 0;
  for (uint32_t i = 0; i < C; ++i) {
    if (before(last_sel, i)) continue;  // ranks below the selection
    if (n_ret > 0 && !before(last_ret, i)) {
      ret[nr++] = i;
    } else {
      est[ne++] = i;
    }
  }
}

float estimate_zone(const float *logits, const uint32_t *ids, uint32_t n,
                    const float *value_sum, const uint32_t *size, uint32_t d,
                    float *out) {
  std::fill(out, out + d, 0.f);
  float m = kNegInf;
  for (uint32_t i = 0; i < n; ++i) m = std::max(m, logits[ids[i]]);
  if (m == kNegInf) return kNegInf;  // empty, or no cluster with weight
  double den = 0.0;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t c = ids[i];
    const float w = exp_nonpos(logits[c] - m);
    den += double(w) * size[c];
    const float *vs = value_sum + size_t(c) * d;
#pragma omp simd
    for (uint32_t j = 0; j < d; ++j) out[j] += w * vs[j];
  }
  if (!(den > 0.0)) {  // only clusters of size 0
    std::fill(out, out + d, 0.f);
    return kNegInf;
  }
  const float inv = static_cast<float>(1.0 / den);
#pragma omp simd
  for (uint32_t j = 0; j < d; ++j) out[j] *= inv;
  return m + static_cast<float>(std::log(den));
}

float merge_partials(const float *o_a, float lse_a, const float *o_b,
                     float lse_b, uint32_t d, float *out) {
  const float m = std::max(lse_a, lse_b);
  if (m == kNegInf) {
    std::fill(out, out + d, 0.f);
    return kNegInf;
  }
  // exp(-inf - m) is 0, so an empty side drops out; its o (possibly
  // garbage) is never read, which also keeps 0 * NaN out of the result.
  const float wa = std::exp(lse_a - m), wb = std::exp(lse_b - m);
  const float sum = wa + wb;  // in [1, 2]
  const float ca = wa / sum, cb = wb / sum;
  if (wa == 0.f) {
#pragma omp simd
    for (uint32_t j = 0; j < d; ++j) out[j] = o_b[j];
  } else if (wb == 0.f) {
    if (out != o_a) std::copy(o_a, o_a + d, out);
  } else {
#pragma omp simd
    for (uint32_t j = 0; j < d; ++j) out[j] = ca * o_a[j] + cb * o_b[j];
  }
  return m + std::log(sum);
}

void attend_exact(DType t, const float *q, uint32_t G, const void *k,
                  const void *v, uint32_t n, uint32_t d, float scale,
                  float *out, float *lse) {
  if (n == 0) {
    std::fill(out, out + size_t(G) * d, 0.f);
    std::fill(lse, lse + G, kNegInf);
    return;
  }
  WKV_DISPATCH_DTYPE(t, T, [&] {
    attend_impl(q, G, static_cast<const T *>(k), static_cast<const T *>(v),
                n, d, scale, out, lse);
  });
}

void attend_reference_f64(DType t, const float *q, uint32_t G,
                          const void *const *k_rows, const void *const *v_rows,
                          uint32_t n, uint32_t d, double scale, double *out,
                          double *lse) {
  // Two passes that each recompute the logits: the kernel allocates nothing.
  WKV_DISPATCH_DTYPE(t, T, [&] {
    auto logit = [&](const float *qg, uint32_t i) {
      const T *kr = static_cast<const T *>(k_rows[i]);
      double s = 0.0;
      for (uint32_t j = 0; j < d; ++j) s += double(qg[j]) * load(kr, j);
      return s * scale;
    };
    for (uint32_t g = 0; g < G; ++g) {
      const float *qg = q + size_t(g) * d;
      double *o = out + size_t(g) * d;
      std::fill(o, o + d, 0.0);
      double m = -std::numeric_limits<double>::infinity();
      for (uint32_t i = 0; i < n; ++i) m = std::max(m, logit(qg, i));
      if (n == 0 || m == -std::numeric_limits<double>::infinity()) {
        lse[g] = -std::numeric_limits<double>::infinity();
        continue;
      }
      double sum = 0.0;
      for (uint32_t i = 0; i < n; ++i) {
        const double w = std::exp(logit(qg, i) - m);
        sum += w;
        const T *vr = static_cast<const T *>(v_rows[i]);
        for (uint32_t j = 0; j < d; ++j) o[j] += w * load(vr, j);
      }
      for (uint32_t j = 0; j < d; ++j) o[j] /= sum;
      lse[g] = m + std::log(sum);
    }
  });
}

float dot(const float *a, const float *b, uint32_t d) {
  return dot_split(a, b, d);
}

}  // namespace wkv::kernels
