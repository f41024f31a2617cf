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
