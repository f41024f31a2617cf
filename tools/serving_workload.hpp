// The serving benchmark's workload, for the device (bench/gpu_serving_bench.cu
// generates it there) and the host (`wavekv bench cache` replays it on a CPU
// engine): one definition, so that both see the same keys and queries.
//
// Llama3-8B attention geometry (32 q heads, 8 KV heads, head_dim 128). Keys
// with realistic structure: a large shared offset (in the lowest RoPE
// frequencies, where it survives rotation, as in real models), topics in
// runs of kSpan tokens (kTopics topics), noise, then RoPE (theta 500000) at
// the token's position. Values follow the topic plus noise. Queries have
// temporal locality: each focuses on one topic for `focus_steps`
// consecutive steps (8 by default), then moves on, with noise (0.3 of the
// topic's scale by default) and RoPE at the query's position.
//
// Element j < kD / 2 of a head gives the pair (j, j + kD / 2) of its row
// (RoPE's rotate-half convention); the row's other elements follow from the
// other j.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define WKV_HD __host__ __device__ __forceinline__
#else
#define WKV_HD inline
#endif

namespace wkv_workload {

constexpr uint32_t kQ = 32, kH = 8, kD = 128, kTopics = 64, kSpan = 512, kFocusSteps = 8;
constexpr float kQueryNoise = 0.3f;

WKV_HD uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// About N(0, 1): a sum of four uniforms, centred and scaled.
WKV_HD float gauss(uint64_t key) {
  const uint64_t h = mix(key);
  float s = 0.f;
  for (int i = 0; i < 4; ++i) s += static_cast<float>((h >> (16 * i)) & 0xffff) / 65535.f;
  return (s - 2.f) * 1.7320508f;
}
WKV_HD float basis(uint32_t what, uint32_t topic, uint32_t h, uint32_t i) {
  return gauss((uint64_t(what) << 48) ^ (uint64_t(topic) << 32) ^ (uint64_t(h) << 16) ^ i);
}
// The shared offset: large, in the 8 lowest RoPE frequencies of each half.
WKV_HD float offset(uint32_t h, uint32_t i) {
  const uint32_t j = i % (kD / 2);
  return j >= kD / 2 - 8 ? 6.f * basis(1, 0, h, i) : 0.f;
}
// RoPE of the pair (a, b) at element j < kD / 2 and position pos.
WKV_HD void rope(uint32_t pos, uint32_t j, float a, float b, float *lo, float *hi) {
  const float angle = static_cast<float>(pos) * powf(500000.f, -2.f * static_cast<float>(j) / kD);
  float s, c;
#ifdef __CUDA_ARCH__
  sincosf(angle, &s, &c);
#else
  s = std::sin(angle);
  c = std::cos(angle);
#endif
  *lo = a * c - b * s;
  *hi = a * s + b * c;
}

// Token p of sequence `seq`, head h, element pair j < kD / 2: its key
// (after RoPE) and value elements j and j + kD / 2.
WKV_HD void token_pair(uint32_t seq, uint32_t p, uint32_t h, uint32_t j, float *k_lo, float *k_hi, float *v_lo,
                       float *v_hi) {
  const uint32_t topic = static_cast<uint32_t>(mix((uint64_t(seq) << 32) ^ (p / kSpan)) % kTopics);
  const uint64_t nk = (uint64_t(seq) << 40) ^ (uint64_t(p) << 12) ^ (h << 8);
  const float a = offset(h, j) + basis(2, topic, h, j) + 0.5f * gauss(nk ^ j);
  const float b = offset(h, j + kD / 2) + basis(2, topic, h, j + kD / 2) + 0.5f * gauss(nk ^ (j + kD / 2));
  rope(p, j, a, b, k_lo, k_hi);
  const uint64_t nv = nk ^ (1ull << 63);
  *v_lo = basis(3, topic, h, j) + 0.5f * gauss(nv ^ j);
  *v_hi = basis(3, topic, h, j + kD / 2) + 0.5f * gauss(nv ^ (j + kD / 2));
}

// The query of sequence `seq` at decoding step `step` (position pos), q head
// qh, element pair j < kD / 2 (after RoPE).
WKV_HD void query_pair(uint32_t seq, uint32_t step, uint32_t pos, uint32_t qh, uint32_t j, uint32_t focus_steps,
                       float noise, float *lo, float *hi) {
  const uint32_t h = qh / (kQ / kH);
  const uint32_t topic = static_cast<uint32_t>(mix((uint64_t(seq) << 32) ^ (step / focus_steps) ^ 0xabc) % kTopics);
  const uint64_t nq = (uint64_t(seq) << 40) ^ (uint64_t(step) << 12) ^ (qh << 4) ^ 0x5;
  const float a = 0.15f * offset(h, j) + basis(2, topic, h, j) + noise * gauss(nq ^ (j << 20));
  const float b = 0.15f * offset(h, j + kD / 2) + basis(2, topic, h, j + kD / 2) + noise * gauss(nq ^ ((j + kD / 2) << 20));
  rope(pos, j, a, b, lo, hi);
}

}  // namespace wkv_workload
