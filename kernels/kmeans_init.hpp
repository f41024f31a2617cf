// The initial points of segmented k-means, shared by the CPU reference
// (kernels/cpu_kernels.cpp) and the device k-means (kernels/kmeans.cu) so
// that both start every segment from the same k tokens for the same seed.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define WKV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define WKV_HOST_DEVICE inline
#endif

namespace wkv::kernels {

WKV_HOST_DEVICE uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// A seeded bijection of [0, T): a 4-round Feistel network on the smallest
// even-bit domain holding T, cycle-walked back into range. The first k
// images of 0, 1, 2, ... are k distinct, well-spread tokens: segment point
// seeded_perm(c, T, seed) starts cluster c.
WKV_HOST_DEVICE uint32_t seeded_perm(uint32_t x, uint32_t T, uint64_t seed) {
  uint32_t bits = 2;
  while ((1u << bits) < T) ++bits;
  bits += bits & 1;
  const uint32_t half = bits / 2, mask = (1u << half) - 1;
  const uint32_t s0 = static_cast<uint32_t>(seed), s1 = static_cast<uint32_t>(seed >> 32);
  do {
    uint32_t L = x >> half, R = x & mask;
    for (uint32_t r = 0; r < 4; ++r) {
      const uint32_t rk = mix32(s0 ^ mix32(s1 + 0x9e3779b9u * (r + 1)));
      const uint32_t F = mix32(R ^ rk) & mask;
      const uint32_t nl = R;
      R = L ^ F;
      L = nl;
    }
    x = (L << half) | R;
  } while (x >= T);
  return x;
}

}  // namespace wkv::kernels
