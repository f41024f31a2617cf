#include "tools/exact.hpp"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define WKV_TOOL_HAVE_AVX2_KERNEL 1
#endif

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu_kernels.hpp"
#include "wavekv/wavekv.h"

namespace wkv_tool {
namespace {

#if defined(WKV_TOOL_HAVE_AVX2_KERNEL)
// The baseline's own kernel for AVX2 + FMA + F16C machines: K and V rows
// converted in registers (vcvtph2ps) rather than through a buffer, a block
// of 32 tokens' logits for up to four query heads at a time from one pass
// over the block's keys, a vectorised exp, and the block's P.V accumulated
// eight output lanes at a time with the four heads' accumulators in
// registers. About 1.5 times the throughput of kernels::attend_exact on f16
// (~200 against ~350 cycles per token and KV head of 4 q heads, on Zen 3),
// so that the baseline is what a tuned runtime would run; the library
// kernel remains the fallback everywhere else.
#define WKV_AVX2 __attribute__((target("avx2,fma,f16c")))

constexpr uint32_t kBlock = 32;
constexpr uint32_t kHeads = 4;

WKV_AVX2 inline __m256 load8(const uint16_t *p, uint32_t dtype) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
  if (dtype == WKV_DTYPE_F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // bf16
}
WKV_AVX2 inline __m256 load8(const float *p, uint32_t) { return _mm256_loadu_ps(p); }

WKV_AVX2 inline float hsum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0 (Cephes' expf polynomial, ~1 ulp); 0 below -87.
WKV_AVX2 inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// Online softmax of gn <= kHeads query heads q [gn][d] over n tokens.
// m, l, o: running max, sum and unnormalised output [gn][d].
template <typename T>
WKV_AVX2 void attend_heads(const float *q, uint32_t gn, const T *k, const T *v, uint32_t n, uint32_t d,
                           uint32_t dtype, float scale, float *m, float *l, float *o) {
  alignas(32) float p[kHeads][kBlock];
  for (uint32_t t0 = 0; t0 < n; t0 += kBlock) {
    const uint32_t nt = std::min(kBlock, n - t0);
    // 1. Logits, two tokens per pass over the query rows.
    for (uint32_t t = 0; t < nt; t += 2) {
      const T *k0 = k + size_t(t0 + t) * d;
      const T *k1 = t + 1 < nt ? k0 + d : k0;
      __m256 a0[kHeads], a1[kHeads];
      for (uint32_t g = 0; g < kHeads; ++g) a0[g] = a1[g] = _mm256_setzero_ps();
      for (uint32_t j = 0; j < d; j += 8) {
        const __m256 x0 = load8(k0 + j, dtype), x1 = load8(k1 + j, dtype);
        for (uint32_t g = 0; g < gn; ++g) {
          const __m256 qv = _mm256_loadu_ps(q + size_t(g) * d + j);
          a0[g] = _mm256_fmadd_ps(qv, x0, a0[g]);
          a1[g] = _mm256_fmadd_ps(qv, x1, a1[g]);
        }
      }
      for (uint32_t g = 0; g < gn; ++g) {
        p[g][t] = hsum(a0[g]) * scale;
        if (t + 1 < nt) p[g][t + 1] = hsum(a1[g]) * scale;
      }
    }
    // 2. Softmax weights against the running max.
    for (uint32_t g = 0; g < gn; ++g) {
      float bmax = -INFINITY;
      for (uint32_t t = 0; t < nt; ++t) bmax = std::max(bmax, p[g][t]);
      for (uint32_t t = nt; t < kBlock; ++t) p[g][t] = -INFINITY;
      const float new_m = std::max(m[g], bmax);
      const float alpha = m[g] == -INFINITY ? 0.f : std::exp(m[g] - new_m);
      const __m256 mm = _mm256_set1_ps(new_m);
      __m256 sum = _mm256_setzero_ps();
      for (uint32_t t = 0; t < kBlock; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(&p[g][t]), mm));
        _mm256_store_ps(&p[g][t], e);
        sum = _mm256_add_ps(sum, e);
      }
      l[g] = l[g] * alpha + hsum(sum);
      m[g] = new_m;
      if (alpha != 1.f) {
        const __m256 a = _mm256_set1_ps(alpha);
        float *og = o + size_t(g) * d;
        for (uint32_t j = 0; j < d; j += 8) _mm256_storeu_ps(og + j, _mm256_mul_ps(a, _mm256_loadu_ps(og + j)));
      }
    }
    // 3. P.V, sixteen output lanes of every head at a time: eight
    //    independent accumulation chains keep both FMA pipes busy.
    uint32_t j = 0;
    for (; j + 16 <= d; j += 16) {
      __m256 a0[kHeads], a1[kHeads];
      for (uint32_t g = 0; g < gn; ++g) {
        a0[g] = _mm256_loadu_ps(o + size_t(g) * d + j);
        a1[g] = _mm256_loadu_ps(o + size_t(g) * d + j + 8);
      }
      for (uint32_t t = 0; t < nt; ++t) {
        const T *vr = v + size_t(t0 + t) * d + j;
        const __m256 x0 = load8(vr, dtype), x1 = load8(vr + 8, dtype);
        for (uint32_t g = 0; g < gn; ++g) {
          const __m256 pg = _mm256_broadcast_ss(&p[g][t]);
          a0[g] = _mm256_fmadd_ps(pg, x0, a0[g]);
          a1[g] = _mm256_fmadd_ps(pg, x1, a1[g]);
        }
      }
      for (uint32_t g = 0; g < gn; ++g) {
        _mm256_storeu_ps(o + size_t(g) * d + j, a0[g]);
        _mm256_storeu_ps(o + size_t(g) * d + j + 8, a1[g]);
      }
    }
    for (; j < d; j += 8) {
      __m256 acc[kHeads];
      for (uint32_t g = 0; g < gn; ++g) acc[g] = _mm256_loadu_ps(o + size_t(g) * d + j);
      for (uint32_t t = 0; t < nt; ++t) {
        const __m256 x = load8(v + size_t(t0 + t) * d + j, dtype);
        for (uint32_t g = 0; g < gn; ++g) acc[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(&p[g][t]), x, acc[g]);
      }
      for (uint32_t g = 0; g < gn; ++g) _mm256_storeu_ps(o + size_t(g) * d + j, acc[g]);
    }
  }
}

// Pre: d % 8 == 0, n >= 1.
template <typename T>
void attend_avx2(const float *q, uint32_t G, const T *k, const T *v, uint32_t n, uint32_t d, uint32_t dtype,
                 float scale, float *out, float *lse) {
  for (uint32_t g0 = 0; g0 < G; g0 += kHeads) {
    const uint32_t gn = std::min(kHeads, G - g0);
    float m[kHeads], l[kHeads];
    std::fill(m, m + kHeads, -INFINITY);
    std::fill(l, l + kHeads, 0.f);
    float *o = out + size_t(g0) * d;
    std::fill(o, o + size_t(gn) * d, 0.f);
    attend_heads(q + size_t(g0) * d, gn, k, v, n, d, dtype, scale, m, l, o);
    for (uint32_t g = 0; g < gn; ++g) {
      const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
      for (uint32_t j = 0; j < d; ++j) o[size_t(g) * d + j] *= inv;
      lse[g0 + g] = l[g] > 0.f ? m[g] + std::log(l[g]) : -INFINITY;
    }
  }
}

bool have_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         wkv::cpu_has_f16c_bit();
  return ok;
}
#else
bool have_avx2() { return false; }
template <typename T>
void attend_avx2(const float *, uint32_t, const T *, const T *, uint32_t, uint32_t, uint32_t, float, float *,
                 float *) {}
#endif
#undef WKV_AVX2

}  // namespace

WorkerPool::WorkerPool(unsigned threads) {
  if (threads == 0) threads = 1;
  for (unsigned i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread &t : workers_) t.join();
}

// Takes indices until none is left. Pre: mu_ not held.
void WorkerPool::drain() {
  for (;;) {
    size_t i;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (next_ >= n_) return;
      i = next_++;
    }
    (*fn_)(i);
  }
}

void WorkerPool::work() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      wake_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      ++busy_;
    }
    drain();
    {
      std::lock_guard<std::mutex> lk(mu_);
      --busy_;
    }
    done_.notify_all();
  }
}

void WorkerPool::run(size_t n, const std::function<void(size_t)> &fn) {
  if (n == 0) return;
  if (workers_.empty() || n == 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    ++generation_;
  }
  wake_.notify_all();
  drain();
  // Every index is taken; wait for the workers still running theirs. A
  // worker that wakes only now finds nothing left and leaves at once.
  std::unique_lock<std::mutex> lk(mu_);
  done_.wait(lk, [&] { return busy_ == 0; });
  fn_ = nullptr;
  n_ = next_ = 0;
}

ExactAttention::ExactAttention(WorkerPool &pool, uint32_t dtype, uint32_t kv_heads,
                               uint32_t q_heads, uint32_t head_dim, uint32_t chunk_tokens)
    : pool_(pool), dtype_(dtype), H_(kv_heads), G_(q_heads / kv_heads), d_(head_dim),
      chunk_(chunk_tokens), fast_(have_avx2() && head_dim % 8 == 0) {}

void ExactAttention::use_library_kernel(bool yes) { fast_ = !yes && have_avx2() && d_ % 8 == 0; }

void ExactAttention::run(const void *k, const void *v, uint64_t head_stride, uint64_t n,
                         const float *q, float *out) {
  const uint64_t chunks = std::max<uint64_t>(1, (n + chunk_ - 1) / chunk_);
  const size_t esz = dtype_ == 0 ? 4 : 2;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d_));
  const size_t parts = static_cast<size_t>(H_) * chunks;
  part_out_.resize(parts * G_ * d_);
  part_lse_.resize(parts * G_);
  // 1. Every (KV head, chunk) on the pool.
  pool_.run(parts, [&](size_t i) {
    const uint32_t h = static_cast<uint32_t>(i / chunks);
    const uint64_t t0 = (i % chunks) * chunk_;
    const uint32_t nt = static_cast<uint32_t>(std::min<uint64_t>(chunk_, n - t0));
    const size_t row = (static_cast<size_t>(h) * head_stride + t0) * d_ * esz;
    const float *qh = q + static_cast<size_t>(h) * G_ * d_;
    const uint8_t *kr = static_cast<const uint8_t *>(k) + row, *vr = static_cast<const uint8_t *>(v) + row;
    float *po = &part_out_[i * G_ * d_], *pl = &part_lse_[i * G_];
    if (fast_) {
      if (dtype_ == WKV_DTYPE_F32)
        attend_avx2(qh, G_, reinterpret_cast<const float *>(kr), reinterpret_cast<const float *>(vr), nt, d_,
                    dtype_, scale, po, pl);
      else
        attend_avx2(qh, G_, reinterpret_cast<const uint16_t *>(kr), reinterpret_cast<const uint16_t *>(vr), nt,
                    d_, dtype_, scale, po, pl);
    } else {
      wkv::kernels::attend_exact(static_cast<wkv::DType>(dtype_), qh, G_, kr, vr, nt, d_, scale, po, pl);
    }
  });
  // 2. Merge the chunks of each query head in log space.
  pool_.run(H_, [&](size_t h) {
    for (uint32_t g = 0; g < G_; ++g) {
      float *o = out + (h * G_ + g) * d_;
      const size_t first = h * chunks;
      std::copy_n(&part_out_[(first * G_ + g) * d_], d_, o);
      float lse = part_lse_[first * G_ + g];
      for (uint64_t c = 1; c < chunks; ++c) {
        const size_t p = first + c;
        lse = wkv::kernels::merge_partials(o, lse, &part_out_[(p * G_ + g) * d_],
                                           part_lse_[p * G_ + g], d_, o);
      }
    }
  });
}

namespace {

// Products of two floats are exact in double; the sum is kept in double.
inline double dot_f64(const float *a, const float *b, uint32_t d) {
  double s0 = 0, s1 = 0;
  uint32_t j = 0;
  for (; j + 2 <= d; j += 2) {
    s0 += double(a[j]) * double(b[j]);
    s1 += double(a[j + 1]) * double(b[j + 1]);
  }
  for (; j < d; ++j) s0 += double(a[j]) * double(b[j]);
  return s0 + s1;
}

}  // namespace

void attend_f64(WorkerPool &pool, const float *k32, const float *v32, uint64_t head_stride,
                const std::vector<Range> &ranges, uint32_t kv_heads, uint32_t q_heads,
                uint32_t head_dim, const float *q, double *out, Probe *probe) {
  const uint32_t G = q_heads / kv_heads, d = head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  uint64_t n = 0;
  for (const Range &r : ranges) n += r.end - r.begin;
  if (probe) {
    probe->sink_share.assign(q_heads, 0.0);
    probe->probe_share.assign(q_heads, 0.0);
    probe->oracle_out.assign(probe->oracle_budget ? static_cast<size_t>(q_heads) * d : 0, 0.0);
    probe->probe_in_oracle.assign(q_heads, 0);
    probe->top_share.assign(q_heads, 0.0);
  }
  pool.run(q_heads, [&](size_t j) {
    const uint32_t h = static_cast<uint32_t>(j / G);
    const float *qj = q + j * d;
    const float *kh = k32 + static_cast<size_t>(h) * head_stride * d;
    const float *vh = v32 + static_cast<size_t>(h) * head_stride * d;
    double *o = out + j * d;
    std::fill(o, o + d, 0.0);
    if (n == 0) return;
    std::vector<double> logit(n);
    size_t i = 0;
    double m = -std::numeric_limits<double>::infinity();
    for (const Range &r : ranges)
      for (uint64_t t = r.begin; t < r.end; ++t, ++i) {
        logit[i] = dot_f64(qj, kh + t * d, d) * scale;
        m = std::max(m, logit[i]);
      }
    double sum = 0, sink = 0, hit = 0;
    const int64_t pp = probe ? probe->probe_pos[j] : -1;
    i = 0;
    for (const Range &r : ranges)
      for (uint64_t t = r.begin; t < r.end; ++t, ++i) {
        const double w = std::exp(logit[i] - m);
        sum += w;
        if (probe && t < probe->sink_tokens) sink += w;
        if (static_cast<int64_t>(t) == pp) hit += w;
        const float *vr = vh + t * d;
        for (uint32_t e = 0; e < d; ++e) o[e] += w * vr[e];
      }
    for (uint32_t e = 0; e < d; ++e) o[e] /= sum;
    if (!probe) return;
    probe->sink_share[j] = sink / sum;
    probe->probe_share[j] = hit / sum;
    {
      // The share of the ceil(top_frac n) highest weights.
      const uint64_t k = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(probe->top_frac * double(n))));
      std::vector<double> top(logit);
      if (k < n)
        std::nth_element(top.begin(), top.begin() + (k - 1), top.end(), [](double a, double b) { return a > b; });
      double mass = 0;
      for (uint64_t t = 0; t < std::min<uint64_t>(k, n); ++t) mass += std::exp(top[t] - m);
      probe->top_share[j] = mass / sum;
    }
    if (probe->oracle_budget == 0) return;
    // Oracle: the budget's highest logits only (ties at the threshold may
    // add a token or two).
    double threshold = -std::numeric_limits<double>::infinity();
    if (probe->oracle_budget < n) {
      std::vector<double> top(logit);
      std::nth_element(top.begin(), top.begin() + (probe->oracle_budget - 1), top.end(),
                       [](double a, double b) { return a > b; });
      threshold = top[probe->oracle_budget - 1];
    }
    double *oo = &probe->oracle_out[j * d];
    double osum = 0;
    i = 0;
    for (const Range &r : ranges)
      for (uint64_t t = r.begin; t < r.end; ++t, ++i) {
        if (logit[i] < threshold) continue;
        if (static_cast<int64_t>(t) == pp) probe->probe_in_oracle[j] = 1;
        const double w = std::exp(logit[i] - m);
        osum += w;
        const float *vr = vh + t * d;
        for (uint32_t e = 0; e < d; ++e) oo[e] += w * vr[e];
      }
    for (uint32_t e = 0; e < d; ++e) oo[e] /= osum;
  });
}

}  // namespace wkv_tool

#undef WKV_TOOL_HAVE_AVX2_KERNEL
