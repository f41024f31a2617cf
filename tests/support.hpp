// Test support: synthetic keys with the structure of real ones, an exact
// attention reference in double, error measures. Header-only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/dtype.hpp"
#include "wavekv/wavekv.h"

namespace wkvtest {

// Rows of one (layer, kv head) as the engine stores them (rounded to the
// storage dtype), in token order.
struct HeadRows {
  std::vector<float> k, v;  // [tokens][d]
  size_t tokens(uint32_t d) const { return k.size() / d; }
};

inline float round_to(uint32_t dtype, float x) {
  switch (dtype) {
    case WKV_DTYPE_F16: return wkv::f16_to_float(wkv::float_to_f16(x));
    case WKV_DTYPE_BF16: return wkv::bf16_to_float(wkv::float_to_bf16(x));
    default: return x;
  }
}

// Packs floats into the storage dtype.
inline std::vector<uint8_t> pack(uint32_t dtype, const std::vector<float> &x) {
  std::vector<uint8_t> out(x.size() * wkv::dtype_bytes(static_cast<wkv::DType>(dtype)));
  wkv::from_float(static_cast<wkv::DType>(dtype), x.data(), out.data(), x.size());
  return out;
}
inline std::vector<float> unpack(uint32_t dtype, const std::vector<uint8_t> &x, size_t n) {
  std::vector<float> out(n);
  wkv::to_float(static_cast<wkv::DType>(dtype), x.data(), out.data(), n);
  return out;
}

// Generates tokens [n][H][d] whose keys cluster around topic directions with
// positional locality (runs of ~span tokens share a topic), on top of a large
// shared mean, as post-RoPE keys of real models do.
class KeyGen {
 public:
  KeyGen(uint32_t H, uint32_t d, uint64_t seed, uint32_t topics = 32, uint32_t span = 200)
      : H_(H), d_(d), rng_(seed), span_(span) {
    std::normal_distribution<float> n(0.f, 1.f);
    mean_.resize(static_cast<size_t>(H) * d);
    for (float &x : mean_) x = 3.0f * n(rng_);
    topic_.resize(static_cast<size_t>(topics) * H * d);
    for (float &x : topic_) x = 1.5f * n(rng_);
    topics_ = topics;
  }
  // Appends n tokens' keys and values to k, v (each [n][H][d]).
  void next(uint32_t n, std::vector<float> *k, std::vector<float> *v) {
    std::normal_distribution<float> g(0.f, 1.f);
    std::uniform_int_distribution<uint32_t> pick(0, topics_ - 1);
    for (uint32_t t = 0; t < n; ++t, ++pos_) {
      if (pos_ % span_ == 0) cur_ = pick(rng_);
      for (uint32_t h = 0; h < H_; ++h)
        for (uint32_t i = 0; i < d_; ++i) {
          size_t j = static_cast<size_t>(h) * d_ + i;
          k->push_back(mean_[j] + topic_[(static_cast<size_t>(cur_) * H_ + h) * d_ + i] + 0.5f * g(rng_));
          v->push_back(g(rng_));
        }
    }
  }
  // A query [G][d] for kv head h aimed near a topic.
  void query(uint32_t h, uint32_t G, std::vector<float> *q) {
    std::normal_distribution<float> g(0.f, 1.f);
    uint32_t t = std::uniform_int_distribution<uint32_t>(0, topics_ - 1)(rng_);
    for (uint32_t a = 0; a < G; ++a)
      for (uint32_t i = 0; i < d_; ++i)
        q->push_back(0.6f * topic_[(static_cast<size_t>(t) * H_ + h) * d_ + i] + 0.3f * g(rng_));
  }

 private:
  uint32_t H_, d_;
  std::mt19937_64 rng_;
  uint32_t span_, topics_ = 0, cur_ = 0;
  uint64_t pos_ = 0;
  std::vector<float> mean_, topic_;
};

// Exact attention of one query over rows (all, or those with keep[t]; the
// first `limit` only, where given) in double: out[d], returns lse.
inline double exact_attention(const float *q, const HeadRows &rows, uint32_t d, std::vector<double> *out,
                              const std::vector<char> *keep = nullptr, size_t limit = SIZE_MAX) {
  const size_t n = std::min(rows.tokens(d), limit);
  double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> s(n);
  double m = -INFINITY;
  for (size_t t = 0; t < n; ++t) {
    if (keep && !(*keep)[t]) continue;
    double acc = 0;
    for (uint32_t i = 0; i < d; ++i) acc += static_cast<double>(q[i]) * rows.k[t * d + i];
    s[t] = acc * scale;
    m = std::max(m, s[t]);
  }
  out->assign(d, 0.0);
  double z = 0;
  for (size_t t = 0; t < n; ++t) {
    if (keep && !(*keep)[t]) continue;
    double w = std::exp(s[t] - m);
    z += w;
    for (uint32_t i = 0; i < d; ++i) (*out)[i] += w * rows.v[t * d + i];
  }
  for (double &x : *out) x /= z;
  return m + std::log(z);
}

inline double rel_l2(const float *got, const std::vector<double> &ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    double e = got[i] - ref[i];
    num += e * e;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}
inline double rel_l2(const std::vector<double> &got, const std::vector<double> &ref) {
  std::vector<float> g(got.begin(), got.end());
  return rel_l2(g.data(), ref);
}

// The q-quantile (0..1) by linear interpolation.
inline double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const double at = q * (v.size() - 1);
  const size_t i = static_cast<size_t>(at);
  return i + 1 < v.size() ? v[i] + (at - i) * (v[i + 1] - v[i]) : v[i];
}

inline double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

}  // namespace wkvtest
