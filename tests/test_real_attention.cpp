// Accuracy on attention captured from a real model (shared/data/real-attention):
// at the default budget, the median relative L2 error of the attention output
// over all layers, query heads and queries must be at most 0.06, and below
// the sink-and-window baseline in every layer. Skips where the data is absent.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "support.hpp"
#include "wavekv/wavekv.hpp"

using namespace wkvtest;

namespace {

constexpr uint32_t kLayers = 6, kQ = 4, kKV = 2, kD = 128, kT = 8192, kQueries = 64;

std::string data_dir() {
  const char *env = std::getenv("WKV_SHARED_DIR");
  std::string base = env && *env ? env : "../shared";
  return base + "/data/real-attention";
}

bool read_layer(const std::string &path, std::vector<uint16_t> *raw) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  size_t n = static_cast<size_t>(kT) * kKV * kD * 2 + static_cast<size_t>(kQueries) * kQ * kD;
  raw->resize(n);
  f.read(reinterpret_cast<char *>(raw->data()), static_cast<std::streamsize>(n * 2));
  return static_cast<size_t>(f.gcount()) == n * 2;
}

}  // namespace

TEST(RealAttention, DefaultBudgetIsAccurateOnEveryLayer) {
  std::string dir = data_dir();
  std::vector<uint16_t> raw;
  if (!read_layer(dir + "/layer0.f16", &raw))
    GTEST_SKIP() << "real attention data not found under " << dir << " (set WKV_SHARED_DIR)";

  wkv_config c;
  wkv_config_init(&c);
  c.n_layers = kLayers;
  c.n_q_heads = kQ;
  c.n_kv_heads = kKV;
  c.head_dim = kD;
  c.dtype = WKV_DTYPE_F16;
  wavekv::Engine e(c);
  wavekv::Plan plan(e);
  wavekv::Sequence seq(e);
  wkv_seq *sp = seq.get();

  const uint32_t prompt = kT - kQueries;
  std::vector<double> all;
  for (uint32_t l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(read_layer(dir + "/layer" + std::to_string(l) + ".f16", &raw)) << "layer " << l;
    const uint16_t *K = raw.data(), *V = K + static_cast<size_t>(kT) * kKV * kD, *Q = V + static_cast<size_t>(kT) * kKV * kD;
    std::vector<HeadRows> rows(kKV);
    for (uint32_t t = 0; t < kT; ++t)
      for (uint32_t h = 0; h < kKV; ++h)
        for (uint32_t i = 0; i < kD; ++i) {
          size_t off = (static_cast<size_t>(t) * kKV + h) * kD + i;
          rows[h].k.push_back(wkv::f16_to_float(K[off]));
          rows[h].v.push_back(wkv::f16_to_float(V[off]));
        }
    // The prompt, then one generated token before each query: query j sees
    // tokens 0 .. prompt + j.
    seq.append(l, K, V, prompt);
    std::vector<double> ours, base;
    std::vector<uint16_t> out(kQ * kD);
    for (uint32_t j = 0; j < kQueries; ++j) {
      size_t tok = static_cast<size_t>(prompt + j) * kKV * kD;
      seq.append(l, K + tok, V + tok, 1);
      const uint16_t *q = Q + static_cast<size_t>(j) * kQ * kD;
      plan.decode(&sp, 1, l, q, out.data());
      const uint32_t n = prompt + j + 1;
      for (uint32_t h = 0; h < kQ; ++h) {
        HeadRows visible;
        const HeadRows &r = rows[h / (kQ / kKV)];
        visible.k.assign(r.k.begin(), r.k.begin() + static_cast<size_t>(n) * kD);
        visible.v.assign(r.v.begin(), r.v.begin() + static_cast<size_t>(n) * kD);
        std::vector<float> qf(kD), of(kD);
        for (uint32_t i = 0; i < kD; ++i) {
          qf[i] = wkv::f16_to_float(q[h * kD + i]);
          of[i] = wkv::f16_to_float(out[h * kD + i]);
        }
        std::vector<double> ref, sw;
        std::vector<char> keep(n, 0);
        for (uint32_t t = 0; t < n; ++t) keep[t] = t < 4 || t + 64 >= n;
        exact_attention(qf.data(), visible, kD, &ref);
        exact_attention(qf.data(), visible, kD, &sw, &keep);
        ours.push_back(rel_l2(of.data(), ref));
        base.push_back(rel_l2(sw, ref));
      }
    }
    double m = median(ours), mb = median(base);
    std::printf("layer %u: median rel. L2 error %.4f p90 %.4f (sink+window %.4f)\n", l, m, quantile(ours, 0.9), mb);
    EXPECT_LT(m, mb) << "layer " << l;
    all.insert(all.end(), ours.begin(), ours.end());
  }
  double m = median(all);
  std::printf("all layers: median rel. L2 error %.4f p90 %.4f (bound 0.06; independent implementation 0.047)\n", m,
              quantile(all, 0.9));
  EXPECT_LE(m, 0.06);
}
