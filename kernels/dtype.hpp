// Storage dtypes of keys, values, queries and outputs, and their conversion
// to and from float. Accumulation is always in float (or double in tests).
// Below both the kernels and the engine: it includes nothing of either (the
// engine checks that the values match the public header's WKV_DTYPE_*).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace wkv {

enum class DType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kBF16 = 2,
};

inline bool dtype_known(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }
inline uint32_t dtype_bytes(DType t) { return t == DType::kF32 ? 4u : 2u; }
inline const char *dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
  }
  return "unknown";
}

// IEEE binary16 and bfloat16 as raw bits; conversions round to nearest even.
// The compiler converts binary16 (F16C where the target has it): _Float16
// with GCC 12 and clang 15 on, __fp16 (storage only, same conversions) with
// older clang (the fuzz build), which lacks _Float16 on x86.
#if defined(__clang__) && __clang_major__ < 15
using half_t = __fp16;
#else
using half_t = _Float16;
#endif
struct f16 { uint16_t bits; };
struct bf16 { uint16_t bits; };

#if defined(__FLT16_MANT_DIG__)
inline float f16_to_float(uint16_t h) {
  half_t x;
  std::memcpy(&x, &h, 2);
  float f = static_cast<float>(x);
#if defined(__clang__) && __clang_major__ < 15
  // compiler-rt's conversion keeps a signalling NaN signalling; F16C and
  // GCC's quiet it. Quiet it here too, so that every build agrees.
  if (f != f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u |= 0x00400000u;
    std::memcpy(&f, &u, 4);
  }
#endif
  return f;
}
inline uint16_t float_to_f16(float f) {
  half_t x = static_cast<half_t>(f);
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}
#else
// Compilers without _Float16 on this target (clang before 15 on x86, which
// builds the fuzz targets): the same conversions with float arithmetic
// (Marat Dukhan's FP16 library, MIT), exact but for NaN payloads (every NaN
// becomes 0x7e00).
namespace f16_soft {
inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace f16_soft
inline float f16_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normal = f16_soft::from_bits((two_w >> 4) + (0xe0u << 23)) * 0x1.0p-112f;
  const float subnormal = f16_soft::from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  return f16_soft::from_bits(sign | f16_soft::bits(two_w < (1u << 27) ? subnormal : normal));
}
inline uint16_t float_to_f16(float f) {
  float base = (f < 0 ? -f : f) * 0x1.0p+112f * 0x1.0p-110f;
  const uint32_t w = f16_soft::bits(f), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xff000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = f16_soft::from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = f16_soft::bits(base);
  const uint32_t nonsign = ((b >> 13) & 0x7c00u) + (b & 0x0fffu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}
#endif
inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Element access by compile-time storage type: T is float, f16 or bf16.
template <typename T> inline float load(const T *p, size_t i);
template <> inline float load<float>(const float *p, size_t i) { return p[i]; }
template <> inline float load<f16>(const f16 *p, size_t i) { return f16_to_float(p[i].bits); }
template <> inline float load<bf16>(const bf16 *p, size_t i) { return bf16_to_float(p[i].bits); }

template <typename T> inline void store(T *p, size_t i, float x);
template <> inline void store<float>(float *p, size_t i, float x) { p[i] = x; }
template <> inline void store<f16>(f16 *p, size_t i, float x) { p[i].bits = float_to_f16(x); }
template <> inline void store<bf16>(bf16 *p, size_t i, float x) { p[i].bits = float_to_bf16(x); }

#if defined(__x86_64__)
// Whether the CPU converts binary16 in hardware (F16C; CPUID leaf 1, ECX bit
// 29). Asked of CPUID directly: not every compiler's __builtin_cpu_supports
// knows "f16c".
bool cpu_has_f16c_bit();
#endif

// Converts n elements of type `t` at src to float. False (nothing written)
// for an unknown dtype.
bool to_float(DType t, const void *src, float *dst, size_t n);
// Converts n floats to type `t` at dst. False for an unknown dtype.
bool from_float(DType t, const float *src, void *dst, size_t n);

// Whether the n elements at src (of dtype t) are all finite: no NaN, no
// infinity (an element whose exponent bits are all ones). False for an
// unknown dtype.
bool all_finite(DType t, const void *src, size_t n);
// Rounds n floats to f16's values in place (to f16 and back, nearest even;
// through the bulk conversions: F16C where the CPU has it, bit-identical to
// f16_to_float(float_to_f16(x)) a value, which without F16C is two library
// calls a value).
void round_to_f16(float *x, size_t n);

// 8-bit rows with one f32 scale each (pages of WKV_PAGE_FORMAT_INT8). The
// CUDA page writes and gather (kernels/kmeans.cu, kernels/gather.cu) do the
// same arithmetic and must write the same bytes: every operation is one
// IEEE operation correctly rounded (no contraction into a fused multiply-
// add is possible: there is no a * b + c).
//   scale = max |x| / 127, q = x / scale rounded to nearest even;
//   a row whose largest magnitude is below kInt8RowFloor is all zero with a
//   scale of 0 (so that neither the scale nor any product is subnormal,
//   and a caller's flush-to-zero changes nothing; a 16-bit float's smallest
//   magnitude is far above it); a row with a NaN or an infinity has a NaN
//   scale (kInt8NanScale) and zero values.
//   (The CPU rounds in the thread's rounding mode, nearest even unless a
//   caller changed it with fesetround; CUDA always rounds to nearest even.)
//   x' = q * scale rounded to the storage dtype; a NaN scale gives the
//   dtype's quiet NaN (0x7e00 f16, 0x7fc0 bf16, 0x7fc00000 f32) on both
//   backends, whatever their NaN payloads.
constexpr float kInt8RowFloor = 0x1p-100f;
constexpr uint32_t kInt8NanScale = 0x7fc00000u;
void quantize_row(const float *x, uint32_t d, int8_t *q, float *scale);
// dst: d elements of `t`. False (nothing written) for an unknown dtype.
bool dequantize_row(DType t, const int8_t *q, float scale, uint32_t d, void *dst);

// Centered K rows (WKV_PAGE_FORMAT_INT8_CENTERED): a key row is kept as its
// difference from a reference, its cluster's centroid rounded to f16
// (nearest even), where every component of the centroid is finite and
// within f16's range (centered_reference true); otherwise the row is kept
// plain (quantize_row). The reference is what a 16-bit meta index holds, so
// either engine can rebuild it from its centroids alone.
//   quantize_row_centered: quantize_row of x - ref (each difference one
//   IEEE subtraction; a finite x less a reference within f16's range
//   cannot overflow, FLT_MAX + 65504 rounding to FLT_MAX);
//   dequantize_row_centered: x' = fma(q, scale, ref) rounded to the storage
//   dtype, a NaN scale giving the dtype's quiet NaN as dequantize_row.
bool centered_reference(const float *centroid, uint32_t d, float *ref);
void quantize_row_centered(const float *x, const float *ref, uint32_t d, int8_t *q, float *scale);
bool dequantize_row_centered(DType t, const int8_t *q, float scale, const float *ref, uint32_t d, void *dst);

// Calls the lambda (...) with T the storage type of `t` (float, f16, bf16)
// and returns its result; for an unknown dtype returns `unknown` instead.
#define WKV_DISPATCH_DTYPE(t, T, unknown, ...)        \
  [&] {                                               \
    switch (t) {                                      \
      case ::wkv::DType::kF32: { using T = float; return __VA_ARGS__(); } \
      case ::wkv::DType::kF16: { using T = ::wkv::f16; return __VA_ARGS__(); } \
      case ::wkv::DType::kBF16: { using T = ::wkv::bf16; return __VA_ARGS__(); } \
    }                                                 \
    return unknown;                                   \
  }()

}  // namespace wkv
