// CPU kernels: the CPU backend's hot paths and the references for the CUDA
// kernels. Single-threaded by design (the engine spreads heads and segments
// over its thread pool); vectorised with `omp simd` under -fopenmp-simd.
#include "kernels/cpu_kernels.hpp"
#include "kernels/kmeans_init.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(WKV_NO_TARGET_CLONES)
#include <immintrin.h>
#endif

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
// A loop over a caller's private scratch that ThreadSanitizer need not
// check; the TSan build is detected as lib/common/thread_pool.hpp does, and
// has no clones (clang will not combine them with this attribute).
#if defined(__SANITIZE_THREAD__)
#define WKV_PRIVATE_SCRATCH __attribute__((no_sanitize("thread")))
#else
#define WKV_PRIVATE_SCRATCH
#endif

// Loops that need F16C (f16 rows converted in registers) or explicit AVX2
// register tiles are written with intrinsics under WKV_V3 and picked at run
// time by has_v3(); each has a portable twin that gives the same result up
// to rounding. Needs GCC or Clang on x86-64, not ifunc.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(WKV_NO_TARGET_CLONES)
#define WKV_HAVE_V3 1
#define WKV_V3 __attribute__((target("avx2,fma,f16c")))
bool has_v3() {
  static const bool yes = __builtin_cpu_supports("avx2") &&
                          __builtin_cpu_supports("fma") &&
                          cpu_has_f16c_bit();
  return yes;
}
#endif

#if defined(WKV_HAVE_V3)
// Eight elements of a row as f32: 16-bit types converted in registers.
WKV_V3 inline __m256 load8(const float *p) { return _mm256_loadu_ps(p); }
WKV_V3 inline __m256 load8(const f16 *p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}
WKV_V3 inline __m256 load8(const bf16 *p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
WKV_V3 inline __m256 load8(const int8_t *p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// Sums of eight vectors, in order: [sum a0, sum a1, ..., sum a7].
WKV_V3 inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3,
                           __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                       _mm256_permute2f128_ps(h0, h1, 0x31));
}
#endif

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

// The largest of x[0, n), -infinity for n == 0; NaNs are skipped (a NaN
// compare is false), as std::max skips a NaN second argument. Eight
// running maxima: one chain would wait on the compare's latency.
WKV_INLINE float max_of(const float *x, uint32_t n) {
  float mx[8] = {kNegInf, kNegInf, kNegInf, kNegInf,
                 kNegInf, kNegInf, kNegInf, kNegInf};
  uint32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const float *xi = x + i;  // x[i + k] with 32-bit i + k would not be contiguous
#pragma omp simd
    for (uint32_t k = 0; k < 8; ++k) mx[k] = xi[k] > mx[k] ? xi[k] : mx[k];
  }
  for (; i < n; ++i) mx[0] = x[i] > mx[0] ? x[i] : mx[0];
  float m = kNegInf;
  for (uint32_t k = 0; k < 8; ++k) m = mx[k] > m ? mx[k] : m;
  return m;
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
// Not instrumented by ThreadSanitizer: its four arrays are kmeans_segment's
// own, which no other thread sees (a race there cannot exist), and checking
// each of its loads was 95% of the sanitized suite's index builds.
WKV_PRIVATE_SCRATCH WKV_HOT void assign_panels(const float *xp, uint32_t T4,
                                               const float *cp, uint32_t k,
                                               uint32_t d, float *best,
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


// Scoring ------------------------------------------------------------------

// The storage dtype of a 16-bit row type (f32 rows are read in place).
template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<f16>() { return DType::kF16; }
template <> constexpr DType dtype_of<bf16>() { return DType::kBF16; }


// Centroid rows per pass over the heads: 16 KiB at d = 128, kept in L1
// while every head pair reads them.
constexpr uint32_t kScoreRows = 32;

// Turns the scaled logits [G][C] into the group's scores: score[c] is the
// sum over heads of softmax_c(logits[g][.])[c].
WKV_HOT void score_softmax(const float *logits, uint32_t G, uint32_t C,
                           float *score) {
  std::fill(score, score + C, 0.f);
  for (uint32_t g = 0; g < G; ++g) {
    const float *lg = logits + size_t(g) * C;
    const float m = max_of(lg, C);
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

// logits[c] += f * spread[c].
WKV_HOT void add_spread(float *logits, const float *spread, uint32_t C,
                        float f) {
#pragma omp simd
  for (uint32_t c = 0; c < C; ++c) logits[c] += f * spread[c];
}

// Unscaled logits of G heads over nt f32 rows into s[g * ld + c], cloned:
// every decoding step scores every cluster of every sequence, layer and kv
// head.
WKV_HOT void logits_rows(const float *q, uint32_t G, const float *rows,
                         uint32_t nt, uint32_t d, float *s, size_t ld) {
  for (uint32_t c0 = 0; c0 < nt; c0 += kScoreRows)
    block_logits(q, G, rows + size_t(c0) * d, std::min(kScoreRows, nt - c0),
                 d, s + c0, ld);
}

WKV_HOT void scale_in_place(float *x, size_t n, float scale) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) x[i] *= scale;
}

// Unscaled logits of G heads over C rows of T (f16, bf16, or int8 without
// its row scales), portable: each block of rows is converted to f32 on the
// stack first (exactly for int8).
constexpr uint32_t kScoreBufFloats = 8192;
inline float row_value(const int8_t *r, size_t j) { return float(r[j]); }
template <typename T> float row_value(const T *r, size_t j) { return load(r, j); }
inline void rows_to_float(const int8_t *src, float *dst, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) dst[i] = float(src[i]);
}
template <typename T> void rows_to_float(const T *src, float *dst, size_t n) { to_float(dtype_of<T>(), src, dst, n); }
template <typename T>
void unscaled_logits(const float *q, uint32_t G, const T *centroid, uint32_t C, uint32_t d, float *logits) {
  if (d > kScoreBufFloats) {  // rows longer than the buffer: one at a time
    for (uint32_t c = 0; c < C; ++c)
      for (uint32_t g = 0; g < G; ++g) {
        const float *qg = q + size_t(g) * d;
        const T *r = centroid + size_t(c) * d;
        float acc = 0.f;
        for (uint32_t j = 0; j < d; ++j) acc += qg[j] * row_value(r, j);
        logits[size_t(g) * C + c] = acc;
      }
  } else {
    alignas(64) float buf[kScoreBufFloats];
    const uint32_t rows = std::max(1u, std::min(kScoreRows, kScoreBufFloats / std::max(d, 1u)));
    for (uint32_t c0 = 0; c0 < C; c0 += rows) {
      const uint32_t nr = std::min(rows, C - c0);
      rows_to_float(centroid + size_t(c0) * d, buf, size_t(nr) * d);
      logits_rows(q, G, buf, nr, d, logits + c0, C);
    }
  }
}

// Scaled logits over 16-bit centroids, portable.
template <typename T>
void score_logits_16(const float *q, uint32_t G, const T *centroid, uint32_t C,
                     uint32_t d, float scale, float *logits) {
  unscaled_logits(q, G, centroid, C, d, logits);
  scale_in_place(logits, size_t(G) * C, scale);
}

// Scaled logits over 8-bit centroid rows with one scale a row, portable:
// each logit multiplied by its row's scale and by `scale`, in that order.
void score_logits_q8(const float *q, uint32_t G, const int8_t *rows,
                     const float *row_scale, uint32_t C, uint32_t d,
                     float scale, float *logits) {
  unscaled_logits(q, G, rows, C, d, logits);
  for (uint32_t g = 0; g < G; ++g) {
    float *lg = logits + size_t(g) * C;
#pragma omp simd
    for (uint32_t c = 0; c < C; ++c) lg[c] = (lg[c] * row_scale[c]) * scale;
  }
}

#if defined(WKV_HAVE_V3)
// Scaled logits of G heads over C centroid rows of f16, or of int8 with one
// scale a row (row_scale, unused for f16), converted in registers: two rows
// by four heads per pass, eight accumulation chains. Scoring streams the
// whole mirror every step, so this is bound by memory bandwidth; halving
// (f16) or quartering (int8) the bytes against f32 is the point.
// Pre: d % 8 == 0.
template <typename T>
WKV_V3 void score_logits_v3(const float *q, uint32_t G, const T *centroid,
                            const float *row_scale, uint32_t C, uint32_t d,
                            float scale, float *logits) {
  const __m256 vscale = _mm256_set1_ps(scale);
  for (uint32_t c0 = 0; c0 < C; c0 += kScoreRows) {
    const uint32_t ce = std::min(C, c0 + kScoreRows);
    for (uint32_t g0 = 0; g0 < G; g0 += 4) {
      const uint32_t gn = std::min(4u, G - g0);
      // Heads past G repeat the last one; their results are dropped.
      const float *q0 = q + size_t(g0) * d;
      const float *q1 = q + size_t(g0 + std::min(1u, gn - 1)) * d;
      const float *q2 = q + size_t(g0 + std::min(2u, gn - 1)) * d;
      const float *q3 = q + size_t(g0 + std::min(3u, gn - 1)) * d;
      float *lg = logits + size_t(g0) * C;
      for (uint32_t c = c0; c < ce; c += 2) {
        const T *r0 = centroid + size_t(c) * d;
        const T *r1 = c + 1 < ce ? r0 + d : r0;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (uint32_t j = 0; j < d; j += 8) {
          const __m256 k0 = load8(r0 + j), k1 = load8(r1 + j);
          __m256 x = _mm256_loadu_ps(q0 + j);
          a0 = _mm256_fmadd_ps(x, k0, a0);
          b0 = _mm256_fmadd_ps(x, k1, b0);
          x = _mm256_loadu_ps(q1 + j);
          a1 = _mm256_fmadd_ps(x, k0, a1);
          b1 = _mm256_fmadd_ps(x, k1, b1);
          x = _mm256_loadu_ps(q2 + j);
          a2 = _mm256_fmadd_ps(x, k0, a2);
          b2 = _mm256_fmadd_ps(x, k1, b2);
          x = _mm256_loadu_ps(q3 + j);
          a3 = _mm256_fmadd_ps(x, k0, a3);
          b3 = _mm256_fmadd_ps(x, k1, b3);
        }
        __m256 dots = hsum8(a0, a1, a2, a3, b0, b1, b2, b3);
        if constexpr (std::is_same_v<T, int8_t>) {
          // Lanes 0-3 are row c's, 4-7 row c + 1's: (dot * row scale) * scale.
          const float s1 = row_scale[c + 1 < ce ? c + 1 : c];
          dots = _mm256_mul_ps(dots, _mm256_insertf128_ps(_mm256_set1_ps(row_scale[c]),
                                                          _mm_set1_ps(s1), 1));
        }
        alignas(32) float s[8];
        _mm256_store_ps(s, _mm256_mul_ps(dots, vscale));
        for (uint32_t g = 0; g < gn; ++g) lg[size_t(g) * C + c] = s[g];
        if (c + 1 < ce)
          for (uint32_t g = 0; g < gn; ++g) lg[size_t(g) * C + c + 1] = s[4 + g];
      }
    }
  }
}
#endif

// Selection --------------------------------------------------------------

// An order-preserving integer key of a score: a larger score has a larger
// key. NaN ranks as -infinity and -0 as +0, the strict order of
// select_zones (score descending, then id ascending).
// Integer operations only, so that the loops over it have no branch.
WKV_INLINE uint32_t score_key(float s) {
  uint32_t u = float_to_bits(s + 0.f);  // -0 + 0 is +0
  const uint32_t nan = 0u - uint32_t((u & 0x7fffffffu) > 0x7f800000u);
  u = (u & ~nan) | (0xff800000u & nan);  // -infinity's bits
  const uint32_t neg = 0u - (u >> 31);
  return u ^ (neg | 0x80000000u);
}

// Radix selection over keys taken relative to the smallest: the top 11
// bits of the range of every key, then 11 bits at a time of the keys that
// share the higher bits of the one sought. Rounds of 11 bits keep the
// histogram in L1.
constexpr uint32_t kRadixBits = 11;
constexpr uint32_t kRadixBins = 1u << kRadixBits;

// Walks a histogram from its highest bin down to the bin that holds the
// k-th largest element (1-based). On return k is the rank within that bin.
inline uint32_t radix_walk(const uint32_t *hist, uint32_t bins, uint32_t *k) {
  uint32_t b = bins - 1;
  while (*k > hist[b]) *k -= hist[b--];
  return b;
}

// The key of rank k and how many elements equal to it rank within the top k
// (the lowest ids among them under the tie rule).
struct RankKey {
  uint32_t key;
  uint32_t take;
};

// Finishes a radix selection among the keys[0, n) with key >> shift ==
// prefix: k is the rank sought among them. Reads the keys only, so that two
// ranks can be sought among the same keys.
inline RankKey radix_finish(const uint32_t *keys, uint32_t n, uint32_t prefix,
                            uint32_t shift, uint32_t k, uint32_t *hist) {
  while (shift > 0) {
    const uint32_t w = std::min(shift, kRadixBits), low = shift - w;
    const uint32_t mask = (1u << w) - 1;
    std::fill(hist, hist + (1u << w), 0u);
    for (uint32_t i = 0; i < n; ++i)
      hist[(keys[i] >> low) & mask] += (keys[i] >> shift) == prefix;
    prefix = (prefix << w) | radix_walk(hist, 1u << w, &k);
    shift = low;
  }
  return RankKey{prefix, k};
}

// Below this many keys one histogram is counted rather than four.
constexpr uint32_t kRadixManyKeys = 4096;

// Keys gathered for the later radix rounds on the stack; bins holding more
// keys than this are finished from the whole key array.
constexpr uint32_t kRadixCand = 2048;

// The body of select_zones, cloned.
WKV_HOT void select_impl(const float *score, uint32_t C, uint32_t n_ret,
                         uint32_t n_est, uint32_t *ret, uint32_t *est,
                         uint32_t *keys) {
  const uint32_t n_sel = n_ret + n_est;
  if (n_sel == 0) return;
  // 1. Keys relative to the smallest, and the histogram of the top bits of
  //    their range. Scores crowd into few bins, and consecutive increments
  //    of one counter wait on each other through memory: four histograms
  //    break the chain.
  uint32_t kmin = UINT32_MAX, kmax = 0;
#pragma omp simd reduction(min : kmin) reduction(max : kmax)
  for (uint32_t i = 0; i < C; ++i) {
    const uint32_t key = score_key(score[i]);
    keys[i] = key;
    kmin = key < kmin ? key : kmin;
    kmax = key > kmax ? key : kmax;
  }
  uint32_t bits = 0;
  while (bits < 32 && ((kmax - kmin) >> bits) != 0) ++bits;
  const uint32_t shift = bits > kRadixBits ? bits - kRadixBits : 0;
#pragma omp simd
  for (uint32_t i = 0; i < C; ++i) keys[i] -= kmin;
  uint32_t hist[kRadixBins];
  if (C < kRadixManyKeys) {
    // Few keys: clearing and adding four histograms would cost more than
    // the chains they break.
    std::fill(hist, hist + kRadixBins, 0u);
    for (uint32_t i = 0; i < C; ++i) ++hist[keys[i] >> shift];
  } else {
    uint32_t part[4][kRadixBins] = {};
    uint32_t i4 = 0;
    for (; i4 + 4 <= C; i4 += 4) {
      const uint32_t *k4 = keys + i4;
      ++part[0][k4[0] >> shift];
      ++part[1][k4[1] >> shift];
      ++part[2][k4[2] >> shift];
      ++part[3][k4[3] >> shift];
    }
    for (; i4 < C; ++i4) ++part[0][keys[i4] >> shift];
#pragma omp simd
    for (uint32_t b = 0; b < kRadixBins; ++b)
      hist[b] = (part[0][b] + part[1][b]) + (part[2][b] + part[3][b]);
  }
  // 2. The bins of both ranks sought, and the rank within each.
  uint32_t k_sel = n_sel, k_ret = std::max(n_ret, 1u);
  const uint32_t b_sel = radix_walk(hist, kRadixBins, &k_sel);
  const uint32_t b_ret = radix_walk(hist, kRadixBins, &k_ret);
  // 3. The exact keys of both ranks, from the keys of their bins: gathered
  //    on the stack when they fit, b_sel's at sel[0, n_s) and b_ret's (when
  //    in another bin) at rb[0, n_r), each region with one spare slot for
  //    the stores of keys not kept.
  RankKey sk, rk{UINT32_MAX, 0};  // no key reaches rk: nothing retrieved
  const uint32_t n_s = hist[b_sel], n_r = b_ret != b_sel ? hist[b_ret] : 0;
  if (n_s + n_r + 2 <= kRadixCand) {
    uint32_t cand[kRadixCand];
    uint32_t *sel = cand, *rb = cand + n_s + 1;
    uint32_t ns = 0, nr = 0;
    for (uint32_t i = 0; i < C; ++i) {
      const uint32_t key = keys[i], top = key >> shift;
      sel[ns] = key;
      ns += top == b_sel;
      rb[nr] = key;
      nr += top == b_ret && b_ret != b_sel;
    }
    sk = radix_finish(sel, n_s, b_sel, shift, k_sel, hist);
    if (n_ret > 0)
      rk = b_ret == b_sel ? radix_finish(sel, n_s, b_ret, shift, k_ret, hist)
                          : radix_finish(rb, n_r, b_ret, shift, k_ret, hist);
  } else {
    sk = radix_finish(keys, C, b_sel, shift, k_sel, hist);
    if (n_ret > 0) rk = radix_finish(keys, C, b_ret, shift, k_ret, hist);
  }
  // 4. Ids in ascending order: above a threshold, or equal to it and among
  //    the first `take` such ids. The store goes to a sink when the id is
  //    in neither zone, so the loop has no branch to mispredict.
  uint32_t nr = 0, ne = 0, eq_r = 0, eq_s = 0, sink = 0;
  for (uint32_t i = 0; i < C; ++i) {
    const uint32_t key = keys[i];
    const bool at_r = key == rk.key, at_s = key == sk.key;
    const bool in_r = key > rk.key || (at_r && eq_r < rk.take);
    const bool in_s = key > sk.key || (at_s && eq_s < sk.take);
    eq_r += at_r;
    eq_s += at_s;
    uint32_t *dst = in_r ? ret + nr : in_s ? est + ne : &sink;
    *dst = i;
    nr += in_r;
    ne += in_s & !in_r;
  }
}

// Tail ---------------------------------------------------------------------

// w[c] = size[c], but 0 for the ids of ret and est.
void tail_weights(uint32_t C, const uint32_t *ret, uint32_t n_ret,
                  const uint32_t *est, uint32_t n_est, const uint32_t *size,
                  float *w) {
  for (uint32_t c = 0; c < C; ++c) w[c] = static_cast<float>(size[c]);
  for (uint32_t i = 0; i < n_ret; ++i) w[ret[i]] = 0.f;
  for (uint32_t i = 0; i < n_est; ++i) w[est[i]] = 0.f;
}

// sum over c of w[c] exp(lg[c] - m), m >= every lg[c]; eight chains.
WKV_HOT float tail_sum(const float *lg, const float *w, uint32_t C, float m) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  uint32_t c = 0;
  for (; c + 8 <= C; c += 8) {
    const float *l8 = lg + c, *w8 = w + c;
#pragma omp simd
    for (uint32_t k = 0; k < 8; ++k) acc[k] += w8[k] * exp_nonpos(l8[k] - m);
  }
  for (; c < C; ++c) acc[0] += w[c] * exp_nonpos(lg[c] - m);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// Estimation -------------------------------------------------------------

// Clusters whose weights are computed per pass of estimate_zone_group.
constexpr uint32_t kEstChunk = 64;
// Value rows prefetched ahead of the one being accumulated: the ids are
// sorted but sparse, which the hardware prefetcher does not follow.
constexpr uint32_t kEstPrefetch = 8;
// Columns of 8-bit value rows converted to f32 per pass (portable path).
constexpr uint32_t kEstSlice = 256;

// Prefetches the value rows of clusters ids[from, to).
template <typename V>
WKV_INLINE void est_prefetch(const uint32_t *ids, uint32_t from, uint32_t to,
                             const V *rows, uint32_t d) {
  const size_t bytes = size_t(d) * sizeof(V);
  for (uint32_t p = from; p < to; ++p) {
    const char *r = reinterpret_cast<const char *>(rows + size_t(ids[p]) * d);
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(r + off);
  }
}

// o_g[j] += w[g][i] x0[j] + ... + w[g][i + 3] x3[j] for j < len and GN <= 4
// heads, the terms added one by one in cluster order as estimate_zone adds
// them: each row is read once for all heads.
template <uint32_t GN>
WKV_INLINE void est_fma4(const float (*w)[kEstChunk], uint32_t i,
                         const float *x0, const float *x1, const float *x2,
                         const float *x3, uint32_t len, float *const *o,
                         uint32_t j0) {
  constexpr uint32_t g1 = GN > 1 ? 1 : 0, g2 = GN > 2 ? 2 : 0, g3 = GN > 3 ? 3 : 0;
  float *o0 = o[0] + j0, *o1 = o[g1] + j0, *o2 = o[g2] + j0, *o3 = o[g3] + j0;
  const float w00 = w[0][i], w01 = w[0][i + 1], w02 = w[0][i + 2], w03 = w[0][i + 3];
  const float w10 = w[g1][i], w11 = w[g1][i + 1], w12 = w[g1][i + 2], w13 = w[g1][i + 3];
  const float w20 = w[g2][i], w21 = w[g2][i + 1], w22 = w[g2][i + 2], w23 = w[g2][i + 3];
  const float w30 = w[g3][i], w31 = w[g3][i + 1], w32 = w[g3][i + 2], w33 = w[g3][i + 3];
#pragma omp simd
  for (uint32_t j = 0; j < len; ++j) {
    const float a0 = x0[j], a1 = x1[j], a2 = x2[j], a3 = x3[j];
    float r = o0[j];
    r += w00 * a0;
    r += w01 * a1;
    r += w02 * a2;
    r += w03 * a3;
    o0[j] = r;
    if (GN > 1) {
      float t = o1[j];
      t += w10 * a0;
      t += w11 * a1;
      t += w12 * a2;
      t += w13 * a3;
      o1[j] = t;
    }
    if (GN > 2) {
      float t = o2[j];
      t += w20 * a0;
      t += w21 * a1;
      t += w22 * a2;
      t += w23 * a3;
      o2[j] = t;
    }
    if (GN > 3) {
      float t = o3[j];
      t += w30 * a0;
      t += w31 * a1;
      t += w32 * a2;
      t += w33 * a3;
      o3[j] = t;
    }
  }
}

// o_g[j] += w[g][i] x[j] for j < len.
template <uint32_t GN>
WKV_INLINE void est_fma1(const float (*w)[kEstChunk], uint32_t i,
                         const float *x, uint32_t len, float *const *o,
                         uint32_t j0) {
  for (uint32_t g = 0; g < GN; ++g) {
    const float wg = w[g][i];
    float *og = o[g] + j0;
#pragma omp simd
    for (uint32_t j = 0; j < len; ++j) og[j] += wg * x[j];
  }
}

// Accumulates the value rows (V = float: value sums; int8_t: value means,
// their row scales in the weights) of the chunk's nc clusters ids[0, nc)
// into o for GN heads; ids[nc, pf_n) are prefetched ahead.
template <uint32_t GN, typename V>
WKV_INLINE void est_accumulate(const float (*w)[kEstChunk], const uint32_t *ids,
                               uint32_t pf_n, uint32_t nc, const V *rows,
                               uint32_t d, float *const *o) {
  alignas(64) float buf[std::is_same_v<V, float> ? 1 : 4][kEstSlice];
  uint32_t i = 0;
  for (; i + 4 <= nc; i += 4) {
    est_prefetch(ids, std::min(i + kEstPrefetch, pf_n), std::min(i + kEstPrefetch + 4, pf_n), rows, d);
    const V *r0 = rows + size_t(ids[i]) * d, *r1 = rows + size_t(ids[i + 1]) * d,
            *r2 = rows + size_t(ids[i + 2]) * d, *r3 = rows + size_t(ids[i + 3]) * d;
    if constexpr (std::is_same_v<V, float>) {
      est_fma4<GN>(w, i, r0, r1, r2, r3, d, o, 0);
    } else {
      for (uint32_t j0 = 0; j0 < d; j0 += kEstSlice) {
        const uint32_t len = std::min(kEstSlice, d - j0);
        rows_to_float(r0 + j0, buf[0], len);
        rows_to_float(r1 + j0, buf[1], len);
        rows_to_float(r2 + j0, buf[2], len);
        rows_to_float(r3 + j0, buf[3], len);
        est_fma4<GN>(w, i, buf[0], buf[1], buf[2], buf[3], len, o, j0);
      }
    }
  }
  for (; i < nc; ++i) {
    const V *r = rows + size_t(ids[i]) * d;
    if constexpr (std::is_same_v<V, float>) {
      est_fma1<GN>(w, i, r, d, o, 0);
    } else {
      for (uint32_t j0 = 0; j0 < d; j0 += kEstSlice) {
        const uint32_t len = std::min(kEstSlice, d - j0);
        rows_to_float(r + j0, buf[0], len);
        est_fma1<GN>(w, i, buf[0], len, o, j0);
      }
    }
  }
}

#if defined(WKV_HAVE_V3)
// est_accumulate for 8-bit (or 16-bit) value rows, converted in
// registers. Pre: d % 8 == 0.
template <uint32_t GN, typename V>
WKV_V3 void est_accumulate_v3(const float (*w)[kEstChunk],
                              const uint32_t *ids, uint32_t pf_n,
                              uint32_t nc, const V *rows, uint32_t d,
                              float *const *o) {
  uint32_t i = 0;
  for (; i + 4 <= nc; i += 4) {
    est_prefetch(ids, std::min(i + kEstPrefetch, pf_n), std::min(i + kEstPrefetch + 4, pf_n), rows, d);
    const V *r0 = rows + size_t(ids[i]) * d, *r1 = rows + size_t(ids[i + 1]) * d,
            *r2 = rows + size_t(ids[i + 2]) * d, *r3 = rows + size_t(ids[i + 3]) * d;
    // Weights and output pointers in locals: the stores through o would
    // otherwise make the compiler reload both.
    __m256 wv[GN][4];
    float *og[GN];
    for (uint32_t g = 0; g < GN; ++g) {
      og[g] = o[g];
      for (uint32_t c = 0; c < 4; ++c) wv[g][c] = _mm256_set1_ps(w[g][i + c]);
    }
    for (uint32_t j = 0; j < d; j += 8) {
      const __m256 x0 = load8(r0 + j), x1 = load8(r1 + j), x2 = load8(r2 + j),
                   x3 = load8(r3 + j);
      for (uint32_t g = 0; g < GN; ++g) {
        __m256 acc = _mm256_loadu_ps(og[g] + j);
        acc = _mm256_fmadd_ps(wv[g][0], x0, acc);
        acc = _mm256_fmadd_ps(wv[g][1], x1, acc);
        acc = _mm256_fmadd_ps(wv[g][2], x2, acc);
        acc = _mm256_fmadd_ps(wv[g][3], x3, acc);
        _mm256_storeu_ps(og[g] + j, acc);
      }
    }
  }
  for (; i < nc; ++i) {
    const V *r = rows + size_t(ids[i]) * d;
    __m256 wv[GN];
    float *og[GN];
    for (uint32_t g = 0; g < GN; ++g) {
      og[g] = o[g];
      wv[g] = _mm256_set1_ps(w[g][i]);
    }
    for (uint32_t j = 0; j < d; j += 8) {
      const __m256 x = load8(r + j);
      for (uint32_t g = 0; g < GN; ++g)
        _mm256_storeu_ps(og[g] + j, _mm256_fmadd_ps(wv[g], x, _mm256_loadu_ps(og[g] + j)));
    }
  }
}
#endif

// estimate_zone for heads [0, gn) of a group, gn <= 4, all at once, from
// value sums (V = float) or 8-bit value means (V = int8_t, row_scale their
// rows' scales; the sizes, then the scales, go into the weights).
template <typename V>
WKV_INLINE void estimate_heads(const float *logits, uint32_t gn, size_t ld,
                               const uint32_t *ids, uint32_t n, const V *rows,
                               const float *row_scale, const uint32_t *size,
                               uint32_t d, float *out, float *lse) {
  constexpr bool kMeans = !std::is_same_v<V, float>;
  // 1. Per head the max-shift over the zone. A head with no finite logit
  //    shifts by 0, so that its weights come out 0 rather than NaN.
  float m[4] = {kNegInf, kNegInf, kNegInf, kNegInf};
  for (uint32_t g = 0; g < gn; ++g) {
    const float *lg = logits + size_t(g) * ld;
    float mx[4] = {kNegInf, kNegInf, kNegInf, kNegInf};  // four chains
    uint32_t i = 0;
    for (; i + 4 <= n; i += 4)
      for (uint32_t k = 0; k < 4; ++k) {
        const float x = lg[ids[i + k]];
        mx[k] = x > mx[k] ? x : mx[k];
      }
    for (; i < n; ++i) mx[0] = lg[ids[i]] > mx[0] ? lg[ids[i]] : mx[0];
    for (uint32_t k = 0; k < 4; ++k) m[g] = mx[k] > m[g] ? mx[k] : m[g];
  }
  float *o[4];
  double den[4] = {0.0, 0.0, 0.0, 0.0};
  for (uint32_t g = 0; g < gn; ++g) {
    o[g] = out + size_t(g) * d;
    std::fill(o[g], o[g] + d, 0.f);
  }
  // 2. Weights of a chunk of clusters, then their value rows.
#if defined(WKV_HAVE_V3)
  [[maybe_unused]] const bool v3 = kMeans && has_v3() && d % 8 == 0;
#endif
  alignas(64) float w[4][kEstChunk];
  for (uint32_t i0 = 0; i0 < n; i0 += kEstChunk) {
    const uint32_t nc = std::min(kEstChunk, n - i0);
    const uint32_t *cid = ids + i0;
    for (uint32_t g = 0; g < gn; ++g) {
      const float *lg = logits + size_t(g) * ld;
      const float shift = m[g] == kNegInf ? 0.f : m[g];
      float *wg = w[g];
      double dsum = 0.0;
      if constexpr (kMeans) {
#pragma omp simd reduction(+ : dsum)
        for (uint32_t i = 0; i < nc; ++i) {
          wg[i] = exp_nonpos(lg[cid[i]] - shift) * float(size[cid[i]]);
          dsum += double(wg[i]);
        }
        // The rows' scales weigh their 8-bit values, not the denominator.
        for (uint32_t i = 0; i < nc; ++i) wg[i] *= row_scale[cid[i]];
      } else {
#pragma omp simd reduction(+ : dsum)
        for (uint32_t i = 0; i < nc; ++i) {
          wg[i] = exp_nonpos(lg[cid[i]] - shift);
          dsum += double(wg[i]) * size[cid[i]];
        }
      }
      den[g] += dsum;
    }
#if defined(WKV_HAVE_V3)
    if constexpr (kMeans) {
      if (v3) {
        switch (gn) {
          case 1: est_accumulate_v3<1>(w, cid, n - i0, nc, rows, d, o); break;
          case 2: est_accumulate_v3<2>(w, cid, n - i0, nc, rows, d, o); break;
          case 3: est_accumulate_v3<3>(w, cid, n - i0, nc, rows, d, o); break;
          default: est_accumulate_v3<4>(w, cid, n - i0, nc, rows, d, o); break;
        }
        continue;
      }
    }
#endif
    switch (gn) {
      case 1: est_accumulate<1>(w, cid, n - i0, nc, rows, d, o); break;
      case 2: est_accumulate<2>(w, cid, n - i0, nc, rows, d, o); break;
      case 3: est_accumulate<3>(w, cid, n - i0, nc, rows, d, o); break;
      default: est_accumulate<4>(w, cid, n - i0, nc, rows, d, o); break;
    }
  }
  // 3. Normalise.
  for (uint32_t g = 0; g < gn; ++g) {
    if (m[g] == kNegInf || !(den[g] > 0.0)) {  // empty, no weight, or size 0
      std::fill(o[g], o[g] + d, 0.f);
      lse[g] = kNegInf;
      continue;
    }
    const float inv = static_cast<float>(1.0 / den[g]);
#pragma omp simd
    for (uint32_t j = 0; j < d; ++j) o[g][j] *= inv;
    lse[g] = m[g] + static_cast<float>(std::log(den[g]));
  }
}

WKV_HOT void estimate_group_sums(const float *logits, uint32_t G, size_t ld,
                                 const uint32_t *ids, uint32_t n,
                                 const float *value_sum, const uint32_t *size,
                                 uint32_t d, float *out, float *lse) {
  for (uint32_t g0 = 0; g0 < G; g0 += 4)
    estimate_heads(logits + size_t(g0) * ld, std::min(4u, G - g0), ld, ids, n,
                   value_sum, nullptr, size, d, out + size_t(g0) * d, lse + g0);
}

WKV_HOT void estimate_group_means(const float *logits, uint32_t G, size_t ld,
                                  const uint32_t *ids, uint32_t n,
                                  const int8_t *value_mean, const float *value_mean_scale,
                                  const uint32_t *size, uint32_t d, float *out, float *lse) {
  for (uint32_t g0 = 0; g0 < G; g0 += 4)
    estimate_heads(logits + size_t(g0) * ld, std::min(4u, G - g0), ld, ids, n,
                   value_mean, value_mean_scale, size, d, out + size_t(g0) * d, lse + g0);
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

#if defined(WKV_HAVE_V3)
// Tokens per block of the v3 attention: their K and V rows (16 KiB in f16
// at d = 128) stay in L1 while every group of four heads reads them.
constexpr uint32_t kV3Block = 32;

// Online-softmax step of GN <= 4 heads q [GN][d] over nt <= kV3Block tokens
// k, v [nt][d] read straight from storage: K and V are converted in
// registers rather than through a buffer, the logits of two tokens by GN
// heads come from one pass over q, and P.V keeps sixteen output lanes of
// every head in registers across the block. m, l, o as in attend_block.
// Pre: d % 8 == 0.
template <uint32_t GN, typename T>
WKV_V3 void attend_block_v3(const float *q, const T *k, const T *v,
                            uint32_t nt, uint32_t d, float scale, float *m,
                            float *l, float *o) {
  alignas(32) float p[4][kV3Block];
  const __m256 vscale = _mm256_set1_ps(scale);
  // 1. Logits.
  for (uint32_t t = 0; t < nt; t += 2) {
    const T *k0 = k + size_t(t) * d;
    const T *k1 = t + 1 < nt ? k0 + d : k0;
    __m256 a[4], b[4];
    for (uint32_t g = 0; g < 4; ++g) a[g] = b[g] = _mm256_setzero_ps();
    for (uint32_t j = 0; j < d; j += 8) {
      const __m256 x0 = load8(k0 + j), x1 = load8(k1 + j);
      for (uint32_t g = 0; g < GN; ++g) {
        const __m256 qv = _mm256_loadu_ps(q + size_t(g) * d + j);
        a[g] = _mm256_fmadd_ps(qv, x0, a[g]);
        b[g] = _mm256_fmadd_ps(qv, x1, b[g]);
      }
    }
    alignas(32) float s[8];
    _mm256_store_ps(s, _mm256_mul_ps(hsum8(a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]), vscale));
    for (uint32_t g = 0; g < GN; ++g) {
      p[g][t] = s[g];
      p[g][t + 1] = s[4 + g];  // t + 1 < kV3Block: the block is even
    }
  }
  // 2. Weights against the running max; o is rescaled in step 3.
  float alpha[4];
  for (uint32_t g = 0; g < GN; ++g) {
    float *pg = p[g];
    const float new_m = std::max(m[g], max_of(pg, nt));
    if (new_m == kNegInf) {  // nothing has weight yet
      std::fill(pg, pg + nt, 0.f);
      alpha[g] = 1.f;
      continue;
    }
    alpha[g] = exp_nonpos(m[g] - new_m);  // 0 on the first block
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (uint32_t t = 0; t < nt; ++t) {
      pg[t] = exp_nonpos(pg[t] - new_m);
      sum += pg[t];
    }
    l[g] = l[g] * alpha[g] + sum;
    m[g] = new_m;
  }
  // 3. o = alpha o + P.V, sixteen lanes of every head at a time: 2 GN
  //    independent accumulation chains.
  for (uint32_t j = 0; j < d; j += 16) {
    const bool two = j + 16 <= d;  // d % 16 == 8 leaves eight lanes at the end
    __m256 acc0[4], acc1[4];
    for (uint32_t g = 0; g < GN; ++g) acc0[g] = acc1[g] = _mm256_setzero_ps();
    for (uint32_t t = 0; t < nt; ++t) {
      const T *vr = v + size_t(t) * d + j;
      const __m256 x0 = load8(vr);
      const __m256 x1 = two ? load8(vr + 8) : _mm256_setzero_ps();
      for (uint32_t g = 0; g < GN; ++g) {
        const __m256 w = _mm256_broadcast_ss(&p[g][t]);
        acc0[g] = _mm256_fmadd_ps(w, x0, acc0[g]);
        acc1[g] = _mm256_fmadd_ps(w, x1, acc1[g]);
      }
    }
    for (uint32_t g = 0; g < GN; ++g) {
      float *og = o + size_t(g) * d + j;
      const __m256 al = _mm256_set1_ps(alpha[g]);
      _mm256_storeu_ps(og, _mm256_fmadd_ps(al, _mm256_loadu_ps(og), acc0[g]));
      if (two) _mm256_storeu_ps(og + 8, _mm256_fmadd_ps(al, _mm256_loadu_ps(og + 8), acc1[g]));
    }
  }
}

// attend_impl on the v3 path: heads in groups of up to 32 whose running
// state sits on the stack, tokens in blocks, and within a block the heads
// four at a time. Pre: d % 8 == 0.
template <typename T>
WKV_V3 void attend_v3(const float *q, uint32_t G, const T *k, const T *v,
                      uint32_t n, uint32_t d, float scale, float *out,
                      float *lse) {
  float m[kHeadGroup], l[kHeadGroup];
  for (uint32_t h0 = 0; h0 < G; h0 += kHeadGroup) {
    const uint32_t hn = std::min(kHeadGroup, G - h0);
    float *oh = out + size_t(h0) * d;
    std::fill(oh, oh + size_t(hn) * d, 0.f);
    std::fill(m, m + hn, kNegInf);
    std::fill(l, l + hn, 0.f);
    for (uint32_t t0 = 0; t0 < n; t0 += kV3Block) {
      const uint32_t nt = std::min(kV3Block, n - t0);
      const T *kb = k + size_t(t0) * d, *vb = v + size_t(t0) * d;
      for (uint32_t g = 0; g < hn; g += 4) {
        const float *qg = q + size_t(h0 + g) * d;
        float *og = oh + size_t(g) * d;
        switch (std::min(4u, hn - g)) {
          case 1: attend_block_v3<1>(qg, kb, vb, nt, d, scale, m + g, l + g, og); break;
          case 2: attend_block_v3<2>(qg, kb, vb, nt, d, scale, m + g, l + g, og); break;
          case 3: attend_block_v3<3>(qg, kb, vb, nt, d, scale, m + g, l + g, og); break;
          default: attend_block_v3<4>(qg, kb, vb, nt, d, scale, m + g, l + g, og); break;
        }
      }
    }
    finish_heads(hn, d, m, l, oh, lse + h0);
  }
}
#endif

}  // namespace

// Fills *out but for spread and n_outliers from an assignment of T tokens
// to clusters [0, k): drops empty clusters (the others keep their relative
// order), lists members in ascending token order, and sums keys and values
// in double in that order.
static void compact_clusters(const uint32_t *assign, uint32_t k, const float *keys,
                      const float *values, uint32_t T, uint32_t d,
                      SegmentClusters *out) {
  std::vector<uint32_t> count(k, 0u);
  for (uint32_t i = 0; i < T; ++i) ++count[assign[i]];
  std::vector<uint32_t> renum(k, UINT32_MAX);
  uint32_t kk = 0;
  for (uint32_t c = 0; c < k; ++c)
    if (count[c] > 0) renum[c] = kk++;
  out->n_clusters = kk;
  out->size.assign(kk, 0u);
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

// The squared distance of two f32 rows: exact differences and squares in
// double, summed in order (the device sums in another order).
static double sq_dist(const float *a, const float *b, uint32_t d) {
  double s = 0.0;
  for (uint32_t j = 0; j < d; ++j) {
    const double x = double(a[j]) - double(b[j]);
    s += x * x;
  }
  return s;
}

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
  out->spread.clear();
  out->n_outliers = 0;
  if (T == 0) return;
  const uint32_t k = std::clamp<uint32_t>(p.n_clusters, 1, T);
  const uint32_t T4 = round_up(T, kTileP);
  const uint32_t k16 = round_up(k, kTileC);

  // The device k-means's arithmetic (kernels/kmeans.cu), so that the CPU
  // engine is the reference of the CUDA engine's index: the mean in double
  // (exact for 16-bit keys in any order) rounded to f32; the centered,
  // normalised points and the directions rounded to f16 (unit vectors: f16
  // holds them to 2^-12); dot products of those in f32, whose products are
  // exact, so only their summation order differs from the device's; member
  // sums in f32 in ascending token order, as the device's. Near-ties may
  // still resolve differently (tests/gpu_engine measures the agreement).
  std::vector<double> mean(d, 0.0);
  for (uint32_t i = 0; i < T; ++i) {
    const float *key = keys + size_t(i) * d;
#pragma omp simd
    for (uint32_t j = 0; j < d; ++j) mean[j] += key[j];
  }
  std::vector<float> mean_f(d);
  for (uint32_t j = 0; j < d; ++j) mean_f[j] = static_cast<float>(mean[j] / T);
  std::vector<float> xp(size_t(T4) * d, 0.f);
  std::vector<float> row(d);
  for (uint32_t i = 0; i < T; ++i) {
    const float *key = keys + size_t(i) * d;
    float norm2 = 0.f;
    for (uint32_t j = 0; j < d; ++j) {
      row[j] = key[j] - mean_f[j];
      norm2 += row[j] * row[j];
    }
    const float inv = norm2 > 0.f ? 1.f / std::sqrt(norm2) : 0.f;
    for (uint32_t j = 0; j < d; ++j) row[j] *= inv;
    round_to_f16(row.data(), d);
    float *dst = xp.data() + size_t(i / kTileP) * kTileP * d + i % kTileP;
    for (uint32_t j = 0; j < d; ++j) dst[size_t(j) * kTileP] = row[j];
  }
  auto point = [&](uint32_t i, uint32_t j) {
    return xp[size_t(i / kTileP) * kTileP * d + size_t(j) * kTileP + i % kTileP];
  };

  // k distinct initial points, the device's: a seeded permutation of [0, T).
  std::vector<float> dir(size_t(k) * d);
  for (uint32_t c = 0; c < k; ++c) {
    const uint32_t at = seeded_perm(c, T, p.seed);
    for (uint32_t j = 0; j < d; ++j) dir[size_t(c) * d + j] = point(at, j);
  }

  std::vector<float> cp(size_t(k16) * d, 0.f);
  std::vector<float> best(T4);
  std::vector<uint32_t> arg(T4), assign(T, UINT32_MAX), count(k);
  std::vector<float> sum(size_t(k) * d);
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

    std::fill(sum.begin(), sum.end(), 0.f);
    std::fill(count.begin(), count.end(), 0u);
    for (uint32_t i = 0; i < T; ++i) {
      float *s = sum.data() + size_t(assign[i]) * d;
      const float *x = xp.data() + size_t(i / kTileP) * kTileP * d + i % kTileP;
      for (uint32_t j = 0; j < d; ++j) s[j] += x[size_t(j) * kTileP];
      ++count[assign[i]];
    }
    for (uint32_t c = 0; c < k; ++c) {
      if (count[c] == 0) continue;
      const float *s = sum.data() + size_t(c) * d;
      float norm2 = 0.f;
      for (uint32_t j = 0; j < d; ++j) norm2 += s[j] * s[j];
      if (!(norm2 > 0.f)) continue;
      const float inv = 1.f / std::sqrt(norm2);
      float *dc = dir.data() + size_t(c) * d;
      for (uint32_t j = 0; j < d; ++j) dc[j] = s[j] * inv;
      round_to_f16(dc, d);
    }
  }

  // Compact: drop empty clusters, keep the survivors in index order.
  compact_clusters(assign.data(), k, keys, values, T, d, out);
  split_outliers(p.outliers, p.outlier_ratio, keys, values, d, out);
}

static void split_impl(uint32_t cap, float ratio, const float *keys,
                       const float *values, uint32_t d, SegmentClusters *sc);

void split_outliers(uint32_t cap, float ratio, const float *keys,
                    const float *values, uint32_t d, SegmentClusters *sc) {
  split_impl(cap, ratio, keys, values, d, sc);
  sc->value_total.assign(d, 0.0);
  for (uint32_t c = 0; c < sc->n_clusters; ++c)
    for (uint32_t j = 0; j < d; ++j) sc->value_total[j] += sc->value_sum[size_t(c) * d + j];
}

// split_outliers but for the value totals.
static void split_impl(uint32_t cap, float ratio, const float *keys,
                       const float *values, uint32_t d, SegmentClusters *sc) {
  const uint32_t T = static_cast<uint32_t>(sc->order.size());
  const uint32_t C = sc->n_clusters;
  sc->n_outliers = 0;
  sc->spread.assign(C, 0.f);
  if (T == 0) return;
  // 1. Squared distances r[p] of the member at position p to its centroid
  //    (exact differences and squares in double, summed in order j), the
  //    spread of every cluster and the segment's mean distance.
  std::vector<double> r(T);
  double total = 0.0;
  for (uint32_t c = 0; c < C; ++c) {
    const float *cen = sc->centroid.data() + size_t(c) * d;
    double sum = 0.0;
    for (uint32_t p = sc->begin[c]; p < sc->begin[c + 1]; ++p) {
      r[p] = sq_dist(keys + size_t(sc->order[p]) * d, cen, d);
      sum += r[p];
    }
    sc->spread[c] = static_cast<float>(sum / sc->size[c]);
    total += sum;
  }
  if (cap == 0 || !(ratio > 0.f)) return;
  const double bar = double(ratio) * (total / T);
  // 2. Candidates: beyond the bar, in a cluster of two or more, and not the
  //    member of its cluster nearest the centroid (the first such on ties),
  //    which keeps every cluster non-empty.
  std::vector<uint32_t> cand;
  for (uint32_t c = 0; c < C; ++c) {
    const uint32_t b = sc->begin[c], e = sc->begin[c + 1];
    if (e - b < 2) continue;
    uint32_t keep = b;
    for (uint32_t p = b + 1; p < e; ++p)
      if (r[p] < r[keep]) keep = p;
    for (uint32_t p = b; p < e; ++p)
      if (p != keep && r[p] > bar) cand.push_back(p);
  }
  // 3. At most cap of them: the farthest, the lower position on ties; then
  //    in position order again.
  if (cand.size() > cap) {
    std::nth_element(cand.begin(), cand.begin() + cap, cand.end(),
                     [&](uint32_t a, uint32_t b) { return r[a] > r[b] || (r[a] == r[b] && a < b); });
    cand.resize(cap);
    std::sort(cand.begin(), cand.end());
  }
  const uint32_t n_out = static_cast<uint32_t>(cand.size());
  if (n_out == 0) return;
  // 4. The new layout: every cluster keeps its other members in order, and
  //    the outliers follow as singletons in position order.
  std::vector<char> out_at(T, 0);
  for (uint32_t p : cand) out_at[p] = 1;
  std::vector<uint32_t> order(T), begin(C + n_out + 1, 0), size(C + n_out);
  std::vector<char> changed(C, 0);
  uint32_t at = 0;
  for (uint32_t c = 0; c < C; ++c) {
    begin[c] = at;
    for (uint32_t p = sc->begin[c]; p < sc->begin[c + 1]; ++p) {
      if (out_at[p]) {
        changed[c] = 1;
        continue;
      }
      order[at++] = sc->order[p];
    }
    size[c] = at - begin[c];
  }
  for (uint32_t i = 0; i < n_out; ++i) {
    begin[C + i] = at;
    order[at++] = sc->order[cand[i]];
    size[C + i] = 1;
  }
  begin[C + n_out] = at;
  sc->order.swap(order);
  sc->begin.swap(begin);
  sc->size.swap(size);
  // 5. Sums of the clusters that lost members (as compact_clusters sums
  //    them) and their spread; a singleton is its own key and value.
  sc->centroid.resize(size_t(C + n_out) * d);
  sc->value_sum.resize(size_t(C + n_out) * d);
  sc->spread.resize(C + n_out);
  std::vector<double> ksum(d), vsum(d);
  for (uint32_t c = 0; c < C; ++c) {
    if (!changed[c]) continue;
    std::fill(ksum.begin(), ksum.end(), 0.0);
    std::fill(vsum.begin(), vsum.end(), 0.0);
    for (uint32_t p = sc->begin[c]; p < sc->begin[c + 1]; ++p) {
      const float *key = keys + size_t(sc->order[p]) * d;
      const float *val = values + size_t(sc->order[p]) * d;
      for (uint32_t j = 0; j < d; ++j) {
        ksum[j] += key[j];
        vsum[j] += val[j];
      }
    }
    float *cen = sc->centroid.data() + size_t(c) * d;
    const double inv = 1.0 / sc->size[c];
    for (uint32_t j = 0; j < d; ++j) {
      cen[j] = static_cast<float>(ksum[j] * inv);
      sc->value_sum[size_t(c) * d + j] = static_cast<float>(vsum[j]);
    }
    double sum = 0.0;
    for (uint32_t p = sc->begin[c]; p < sc->begin[c + 1]; ++p)
      sum += sq_dist(keys + size_t(sc->order[p]) * d, cen, d);
    sc->spread[c] = static_cast<float>(sum / sc->size[c]);
  }
  for (uint32_t i = 0; i < n_out; ++i) {
    const uint32_t t = sc->order[sc->begin[C + i]];
    std::copy(keys + size_t(t) * d, keys + size_t(t + 1) * d, sc->centroid.data() + size_t(C + i) * d);
    std::copy(values + size_t(t) * d, values + size_t(t + 1) * d, sc->value_sum.data() + size_t(C + i) * d);
    sc->spread[C + i] = 0.f;
  }
  sc->n_clusters = C + n_out;
  sc->n_outliers = n_out;
}

void spread_logits(const float *q, uint32_t G, const float *spread,
                   uint32_t C, uint32_t d, float scale, float *logits) {
  for (uint32_t g = 0; g < G; ++g) {
    const float *qg = q + size_t(g) * d;
    float q2 = 0.f;
    for (uint32_t j = 0; j < d; ++j) q2 += qg[j] * qg[j];
    add_spread(logits + size_t(g) * C, spread, C, 0.5f * scale * scale * q2 / float(d));
  }
}

void score_clusters(const float *q, uint32_t G, const float *centroid,
                    uint32_t C, uint32_t d, float scale, float *logits,
                    float *score, const float *spread) {
  logits_rows(q, G, centroid, C, d, logits, C);
  scale_in_place(logits, size_t(G) * C, scale);
  if (spread) spread_logits(q, G, spread, C, d, scale, logits);
  score_softmax(logits, G, C, score);
}

bool score_clusters(DType t, const float *q, uint32_t G, const void *centroid,
                    uint32_t C, uint32_t d, float scale, float *logits,
                    float *score, const float *spread) {
  switch (t) {
    case DType::kF32:
      score_clusters(q, G, static_cast<const float *>(centroid), C, d, scale,
                     logits, score, spread);
      return true;
    case DType::kF16:
#if defined(WKV_HAVE_V3)
      if (has_v3() && d % 8 == 0) {
        score_logits_v3(q, G, static_cast<const f16 *>(centroid), nullptr,
                        C, d, scale, logits);
        break;
      }
#endif
      score_logits_16(q, G, static_cast<const f16 *>(centroid), C, d, scale,
                      logits);
      break;
    case DType::kBF16:
      score_logits_16(q, G, static_cast<const bf16 *>(centroid), C, d, scale,
                      logits);
      break;
    default:
      return false;
  }
  if (spread) spread_logits(q, G, spread, C, d, scale, logits);
  score_softmax(logits, G, C, score);
  return true;
}

void score_clusters_q8(const float *q, uint32_t G, const int8_t *rows,
                       const float *row_scale, uint32_t C, uint32_t d,
                       float scale, float *logits, float *score,
                       const float *spread) {
#if defined(WKV_HAVE_V3)
  if (has_v3() && d % 8 == 0)
    score_logits_v3(q, G, rows, row_scale, C, d, scale, logits);
  else
#endif
    score_logits_q8(q, G, rows, row_scale, C, d, scale, logits);
  if (spread) spread_logits(q, G, spread, C, d, scale, logits);
  score_softmax(logits, G, C, score);
}

// Selection finds the keys of the n_sel-th and n_ret-th ranked clusters by
// radix selection over order-preserving integer keys of the scores, then
// reads the ids out in one scan, so the outputs come out sorted without a
// sort: O(C), and branch-free but for the short walks over histograms.
void select_zones(const float *score, uint32_t C, uint32_t n_ret,
                  uint32_t n_est, uint32_t *ret, uint32_t *est,
                  uint32_t *scratch) {
  select_impl(score, C, n_ret, n_est, ret, est, scratch);
}

// Sets this small are selected from directly rather than by radix.
constexpr uint32_t kDirectSelect = 1024;

// select_zones_split in two passes where it can: S, the n_sel best of all
// (one select_zones), holds both zones whenever it holds n_reg larger
// clusters; the retrieval zone is then the n_reg best larger clusters of S
// and the n_one best clusters of one (of S, or of all where S has fewer),
// and the estimation zone the rest of S less its worst, one for each
// cluster of one retrieved from outside S. Otherwise in three selections.
void select_zones_split(const float *score, const uint32_t *size, uint32_t C,
                        uint32_t n_reg, uint32_t n_one, uint32_t n_est,
                        uint32_t *ret, uint32_t *est, uint32_t *scratch) {
  // Ranks in select_zones's order: score key descending, then id.
  auto before = [&](uint32_t a, uint32_t b) {
    const uint32_t ka = score_key(score[a]), kb = score_key(score[b]);
    return ka > kb || (ka == kb && a < b);
  };
  uint32_t *sel = scratch, *ids = scratch + C, *keys = scratch + 2 * size_t(C);
  float *sub = reinterpret_cast<float *>(scratch + 3 * size_t(C));
  uint32_t unused = 0;  // select_impl's estimation output where none is asked
  const uint32_t n_sel = n_reg + n_one + n_est;
  // 1. S, ascending.
  select_impl(score, C, n_sel, 0, sel, &unused, keys);
  uint32_t s_reg = 0;
  for (uint32_t i = 0; i < n_sel; ++i) s_reg += size[sel[i]] != 1;
  if (s_reg >= n_reg) {
    // 2. The n_reg best larger clusters of S (a direct partial selection
    //    where S is small).
    uint32_t n = 0;
    if (n_sel <= kDirectSelect) {
      for (uint32_t i = 0; i < n_sel; ++i) ids[n] = sel[i], n += size[sel[i]] != 1;
      if (n_reg < n) std::nth_element(ids, ids + n_reg, ids + n, before);
      std::sort(ids, ids + n_reg);
    } else {
      for (uint32_t i = 0; i < n_sel; ++i) ids[n] = sel[i], sub[n] = score[sel[i]], n += size[sel[i]] != 1;
      select_impl(sub, n, n_reg, 0, ret, &unused, keys);  // ret: positions, for now
      for (uint32_t i = 0; i < n_reg; ++i) ids[i] = ids[ret[i]];
    }
    // 3. The n_one best clusters of one: of S when it has enough.
    uint32_t *one = ids + n_reg, n1 = 0;
    for (uint32_t i = 0; i < n_sel; ++i) one[n1] = sel[i], n1 += size[sel[i]] == 1;
    uint32_t outside = 0;
    if (n1 < n_one) {
      n1 = 0;
      for (uint32_t c = 0; c < C; ++c) one[n1] = c, n1 += size[c] == 1;
    }
    if (n_one < n1) std::nth_element(one, one + n_one, one + n1, before);
    std::sort(one, one + n_one);
    std::merge(ids, ids + n_reg, one, one + n_one, ret);
    // 4. The rest of S, less its `outside` worst.
    for (uint32_t i = 0, j = 0; i < n_one; ++i) {
      while (j < n_sel && sel[j] < one[i]) ++j;
      outside += !(j < n_sel && sel[j] == one[i]);
    }
    uint32_t n_rest = 0;
    for (uint32_t i = 0, j = 0; i < n_sel; ++i) {
      while (j < n_reg + n_one && ret[j] < sel[i]) ++j;
      if (j < n_reg + n_one && ret[j] == sel[i]) continue;
      sel[n_rest++] = sel[i];
    }
    for (uint32_t k = 0; k < outside; ++k) {  // few: one scan each
      uint32_t worst = 0;
      for (uint32_t i = 1; i < n_rest; ++i)
        if (before(sel[worst], sel[i])) worst = i;
      std::copy(sel + worst + 1, sel + n_rest, sel + worst);
      --n_rest;
    }
    std::copy(sel, sel + n_est, est);
    return;
  }
  // 5. Otherwise: the larger clusters' n_reg best, the n_one best of one,
  //    then the n_est best of the rest, each by select_zones over the
  //    clusters in question in id order (ties still break to the lower id).
  auto top = [&](uint32_t n, uint32_t k, uint32_t *out) {
    select_impl(sub, n, k, 0, out, &unused, keys);
    for (uint32_t i = 0; i < k; ++i) out[i] = ids[out[i]];
  };
  uint32_t n = 0;
  for (uint32_t c = 0; c < C; ++c) ids[n] = c, sub[n] = score[c], n += size[c] != 1;
  top(n, n_reg, sel);
  n = 0;
  for (uint32_t c = 0; c < C; ++c) ids[n] = c, sub[n] = score[c], n += size[c] == 1;
  top(n, n_one, sel + n_reg);
  std::merge(sel, sel + n_reg, sel + n_reg, sel + n_reg + n_one, ret);
  n = 0;
  for (uint32_t c = 0, i = 0; c < C; ++c) {
    if (i < n_reg + n_one && ret[i] == c) {
      ++i;
      continue;
    }
    ids[n] = c;
    sub[n++] = score[c];
  }
  top(n, n_est, est);
}

void estimate_tail(const float *logits, uint32_t G, size_t ld, uint32_t C,
                   const uint32_t *ret, uint32_t n_ret, const uint32_t *est,
                   uint32_t n_est, const uint32_t *size,
                   const float *value_mean, uint32_t d, float *out,
                   float *lse, float *scratch) {
  tail_weights(C, ret, n_ret, est, n_est, size, scratch);
  for (uint32_t g = 0; g < G; ++g) {
    const float *lg = logits + size_t(g) * ld;
    const float m = max_of(lg, C);
    if (m == kNegInf) continue;  // no cluster has any weight
    const float den = tail_sum(lg, scratch, C, m);
    if (!(den > 0.f)) continue;  // no tail, or its weight underflows
    const float tail_lse = m + std::log(den);
    lse[g] = merge_partials(out + size_t(g) * d, lse[g], value_mean, tail_lse, d, out + size_t(g) * d);
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

void estimate_zone_group(const float *logits, uint32_t G, size_t ld,
                         const uint32_t *ids, uint32_t n,
                         const float *value_sum, const uint32_t *size,
                         uint32_t d, float *out, float *lse) {
  estimate_group_sums(logits, G, ld, ids, n, value_sum, size, d, out, lse);
}

void estimate_zone_group_means(const float *logits, uint32_t G, size_t ld,
                               const uint32_t *ids, uint32_t n,
                               const int8_t *value_mean, const float *value_mean_scale,
                               const uint32_t *size, uint32_t d, float *out, float *lse) {
  estimate_group_means(logits, G, ld, ids, n, value_mean, value_mean_scale, size, d, out, lse);
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

bool attend_exact(DType t, const float *q, uint32_t G, const void *k,
                  const void *v, uint32_t n, uint32_t d, float scale,
                  float *out, float *lse) {
  if (!dtype_known(t)) return false;
  if (n == 0) {
    std::fill(out, out + size_t(G) * d, 0.f);
    std::fill(lse, lse + G, kNegInf);
    return true;
  }
  return WKV_DISPATCH_DTYPE(t, T, false, [&] {
#if defined(WKV_HAVE_V3)
    if (has_v3() && d % 8 == 0) {
      attend_v3(q, G, static_cast<const T *>(k), static_cast<const T *>(v), n,
                d, scale, out, lse);
      return true;
    }
#endif
    attend_impl(q, G, static_cast<const T *>(k), static_cast<const T *>(v),
                n, d, scale, out, lse);
    return true;
  });
}

bool attend_reference_f64(DType t, const float *q, uint32_t G,
                          const void *const *k_rows, const void *const *v_rows,
                          uint32_t n, uint32_t d, double scale, double *out,
                          double *lse) {
  // Two passes that each recompute the logits: the kernel allocates nothing.
  return WKV_DISPATCH_DTYPE(t, T, false, [&] {
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
    return true;
  });
}

float dot(const float *a, const float *b, uint32_t d) {
  return dot_split(a, b, d);
}

}  // namespace wkv::kernels
