// The real-attention set (shared/data/real-attention; its README): per layer
// a file layerN.f16 holding K and V [kT][kKV][kD], then kQueries queries
// [kQ][kD], all f16. Read by tests/test_real_attention and tests/gpu_accuracy,
// which skip where it is absent.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "support.hpp"

namespace wkvtest::real_attention {

constexpr uint32_t kLayers = 6, kQ = 4, kKV = 2, kD = 128, kT = 8192, kQueries = 64;
constexpr size_t kKVElems = size_t(kT) * kKV * kD;  // of K (and of V) in a layer's file

// The set's folder: under WKV_SHARED_DIR (the folder holding data/), else
// under ../shared.
inline std::string data_dir() {
  const char *env = std::getenv("WKV_SHARED_DIR");
  std::string base = env && *env ? env : "../shared";
  return base + "/data/real-attention";
}

// Layer l's file into *raw (K, then V, then the queries); false when it is
// absent or short.
inline bool read_layer(uint32_t l, std::vector<uint16_t> *raw) {
  std::ifstream f(data_dir() + "/layer" + std::to_string(l) + ".f16", std::ios::binary);
  if (!f) return false;
  const size_t n = 2 * kKVElems + static_cast<size_t>(kQueries) * kQ * kD;
  raw->resize(n);
  f.read(reinterpret_cast<char *>(raw->data()), static_cast<std::streamsize>(n * 2));
  return static_cast<size_t>(f.gcount()) == n * 2;
}

// A layer's keys and values as f32 rows, per KV head.
inline std::vector<HeadRows> head_rows(const uint16_t *K, const uint16_t *V) {
  std::vector<HeadRows> rows(kKV);
  for (uint32_t t = 0; t < kT; ++t)
    for (uint32_t h = 0; h < kKV; ++h)
      for (uint32_t i = 0; i < kD; ++i) {
        const size_t off = (static_cast<size_t>(t) * kKV + h) * kD + i;
        rows[h].k.push_back(wkv::f16_to_float(K[off]));
        rows[h].v.push_back(wkv::f16_to_float(V[off]));
      }
  return rows;
}

}  // namespace wkvtest::real_attention
