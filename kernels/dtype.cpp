#include "kernels/dtype.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(WKV_NO_TARGET_CLONES)
#include <immintrin.h>
#endif
#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace wkv {
namespace {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// f16 to float with integer operations, branch-free so that it vectorises
// on baseline x86-64: without F16C a _Float16 cast is a libgcc call per
// element (~6 ns), and GCC does not vectorise the cast even with F16C; this
// runs at ~0.55 ns (SSE2) and ~0.35 ns (x86-64-v3 clone) per element. The
// fallback where the CPU has no F16C, and the tail of the F16C path. No
// float operand is ever subnormal, so a caller that set flush-to-zero or
// denormals-are-zero still gets exact values.
// Bit-identical to f16_to_float for all 65536 inputs (signalling NaNs come
// out quiet in both).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && \
    !defined(WKV_NO_TARGET_CLONES)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
void f16_to_float_portable(const f16 *__restrict src, float *__restrict dst,
                           size_t n) {
  // Exponent and mantissa in a float's position; compared as int32 (they
  // fit in 31 bits) because SSE2 has no unsigned compare.
  constexpr int32_t kMinNormal = 0x0400 << 13;
  constexpr int32_t kInf = 0x7c00 << 13;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t h = src[i].bits;
    const int32_t em = static_cast<int32_t>((h & 0x7fffu) << 13);
    const uint32_t normal = uint32_t(em) + ((127u - 15u) << 23);
    const uint32_t subnormal = float_to_bits(
        static_cast<float>(static_cast<int32_t>(h & 0x3ffu)) * 0x1p-24f);
    const uint32_t special =
        uint32_t(em) | 0x7f800000u | (em > kInf ? 0x00400000u : 0u);
    const uint32_t is_sub = 0u - uint32_t(em < kMinNormal);
    const uint32_t is_special = 0u - uint32_t(em >= kInf);
    const uint32_t bits = (subnormal & is_sub) | (special & is_special) |
                          (normal & ~(is_sub | is_special));
    dst[i] = bits_to_float(bits | ((h & 0x8000u) << 16));
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(WKV_NO_TARGET_CLONES)
// With F16C the hardware converts eight at a time (vcvtph2ps, ~0.05 ns per
// element): attention over f16 storage converts every K and V row it reads,
// so this is the CPU backend's hottest conversion. vcvtph2ps ignores DAZ
// and quiets signalling NaNs as the scalar cast does, so it too is bit-
// identical to f16_to_float. Picked at run time from the CPU's features.
__attribute__((target("avx2,f16c"))) void f16_to_float_f16c(
    const f16 *__restrict src, float *__restrict dst, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i *>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(src + i + 8));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(a));
    _mm256_storeu_ps(dst + i + 8, _mm256_cvtph_ps(b));
  }
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(src + i))));
  if (i < n) f16_to_float_portable(src + i, dst + i, n - i);
}

bool cpu_has_f16c() {
  static const bool yes = __builtin_cpu_supports("avx2") && cpu_has_f16c_bit();
  return yes;
}

inline void f16_to_float_n(const f16 *src, float *dst, size_t n) {
  if (cpu_has_f16c())
    f16_to_float_f16c(src, dst, n);
  else
    f16_to_float_portable(src, dst, n);
}
#else
inline void f16_to_float_n(const f16 *src, float *dst, size_t n) { f16_to_float_portable(src, dst, n); }
#endif

// Floats to f16, rounded to nearest even: F16C eight at a time where the CPU
// has it (vcvtps2ph; without F16C the scalar conversion is a library call a
// value). Bit-identical to float_to_f16 for all 2^32 inputs, NaNs included
// (checked exhaustively against GCC's conversion on 2026-12-06).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(WKV_NO_TARGET_CLONES)
__attribute__((target("avx2,f16c"))) void float_to_f16_f16c(const float *__restrict src, f16 *__restrict dst,
                                                            size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i *>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) dst[i].bits = float_to_f16(src[i]);
}
#endif

inline void float_to_f16_n(const float *src, f16 *dst, size_t n) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(WKV_NO_TARGET_CLONES)
  if (cpu_has_f16c()) {
    float_to_f16_f16c(src, dst, n);
    return;
  }
#endif
  for (size_t i = 0; i < n; ++i) dst[i].bits = float_to_f16(src[i]);
}

}  // namespace

#if defined(__x86_64__)
bool cpu_has_f16c_bit() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

bool to_float(DType t, const void *src, float *dst, size_t n) {
  if (t == DType::kF16) {
    f16_to_float_n(static_cast<const f16 *>(src), dst, n);
    return true;
  }
  return WKV_DISPATCH_DTYPE(t, T, false, [&] {
    const T *s = static_cast<const T *>(src);
    for (size_t i = 0; i < n; ++i) dst[i] = load(s, i);
    return true;
  });
}

bool from_float(DType t, const float *src, void *dst, size_t n) {
  if (t == DType::kF16) {
    float_to_f16_n(src, static_cast<f16 *>(dst), n);
    return true;
  }
  return WKV_DISPATCH_DTYPE(t, T, false, [&] {
    T *o = static_cast<T *>(dst);
    for (size_t i = 0; i < n; ++i) store(o, i, src[i]);
    return true;
  });
}

void round_to_f16(float *x, size_t n) {
  f16 h[256];
  for (size_t c = 0; c < n; c += 256) {
    const size_t m = std::min<size_t>(256, n - c);
    float_to_f16_n(x + c, h, m);
    f16_to_float_n(h, x + c, m);
  }
}

void quantize_row(const float *x, uint32_t d, int8_t *q, float *scale) {
  float amax = 0.0f;
  bool finite = true;
  for (uint32_t i = 0; i < d; ++i) {
    const float a = std::fabs(x[i]);
    finite &= a <= std::numeric_limits<float>::max();  // false for NaN and inf
    amax = a > amax ? a : amax;
  }
  if (!finite || amax < kInt8RowFloor) {
    std::memset(q, 0, d);
    *scale = finite ? 0.0f : bits_to_float(kInt8NanScale);
    return;
  }
  const float s = amax / 127.0f;
  for (uint32_t i = 0; i < d; ++i) {
    const float r = std::nearbyint(x[i] / s);  // the current mode: nearest even
    q[i] = static_cast<int8_t>(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
  }
  *scale = s;
}

namespace {

// d copies of the dtype's quiet NaN at dst.
void put_nan_row(DType t, uint32_t d, void *dst) {
  uint8_t *o = static_cast<uint8_t *>(dst);
  const uint32_t nan32 = kInt8NanScale;
  const uint16_t nan16 = t == DType::kF16 ? 0x7e00u : 0x7fc0u;
  for (uint32_t i = 0; i < d; ++i) {
    if (t == DType::kF32)
      std::memcpy(o + 4 * size_t(i), &nan32, 4);
    else
      std::memcpy(o + 2 * size_t(i), &nan16, 2);
  }
}

// x[i] = fma(q[i], scale, ref[i]) (one rounding): the x86-64-v3 clone uses
// the hardware's fused multiply-add, eight at a time; the default clone
// libm's (correctly rounded, slow).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(WKV_NO_TARGET_CLONES)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
void fma_row(const int8_t *__restrict q, float scale, const float *__restrict ref, float *__restrict x, uint32_t d) {
  for (uint32_t i = 0; i < d; ++i) x[i] = std::fma(static_cast<float>(q[i]), scale, ref[i]);
}

}  // namespace

bool centered_reference(const float *centroid, uint32_t d, float *ref) {
  for (uint32_t i = 0; i < d; ++i)
    if (!(std::fabs(centroid[i]) <= 65504.0f)) return false;  // NaN, infinite or past f16's range
  std::copy(centroid, centroid + d, ref);
  round_to_f16(ref, d);
  return true;
}

void quantize_row_centered(const float *x, const float *ref, uint32_t d, int8_t *q, float *scale) {
  float r[256];  // head_dim <= 256
  for (uint32_t i = 0; i < d; ++i) r[i] = x[i] - ref[i];
  quantize_row(r, d, q, scale);
}

bool dequantize_row_centered(DType t, const int8_t *q, float scale, const float *ref, uint32_t d, void *dst) {
  if (!dtype_known(t)) return false;
  if (scale != scale) {
    put_nan_row(t, d, dst);
    return true;
  }
  float x[256];  // head_dim <= 256
  fma_row(q, scale, ref, x, d);
  from_float(t, x, dst, d);
  return true;
}

namespace {
// Whether no element's exponent bits (`mask`) are all ones.
template <typename U> bool exponents_below(const void *src, size_t n, U mask) {
  const U *x = static_cast<const U *>(src);
  U all = 0;  // an OR of each element's exponent == mask test, branch-free
  for (size_t i = 0; i < n; ++i) {
    U w;
    std::memcpy(&w, x + i, sizeof(U));
    all |= static_cast<U>((w & mask) == mask);
  }
  return all == 0;
}
}  // namespace

bool all_finite(DType t, const void *src, size_t n) {
  switch (t) {
    case DType::kF32: return exponents_below<uint32_t>(src, n, 0x7f800000u);
    case DType::kF16: return exponents_below<uint16_t>(src, n, 0x7c00u);
    case DType::kBF16: return exponents_below<uint16_t>(src, n, 0x7f80u);
  }
  return false;
}

bool dequantize_row(DType t, const int8_t *q, float scale, uint32_t d, void *dst) {
  if (!dtype_known(t)) return false;
  if (scale != scale) {  // the dtype's quiet NaN, whatever the scale's payload
    put_nan_row(t, d, dst);
    return true;
  }
  float x[256];  // head_dim <= 256
  for (uint32_t c = 0; c < d; c += 256) {
    const uint32_t n = std::min<uint32_t>(256, d - c);
    for (uint32_t i = 0; i < n; ++i) x[i] = static_cast<float>(q[c + i]) * scale;
    from_float(t, x, static_cast<uint8_t *>(dst) + size_t(c) * dtype_bytes(t), n);
  }
  return true;
}

}  // namespace wkv
