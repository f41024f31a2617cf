// Accuracy on attention captured from a real model (shared/data/real-attention),
// the default method beside the paper's (WKV_METHOD_PAPER) on the same tokens
// and queries, at the default budget: over all layers, query heads and queries
// the median relative L2 error of the attention output must be at most 0.035
// and its 90th percentile at most 0.75 of the paper's method's; in every layer
// the median must be below the sink-and-window baseline's and not above the
// paper's method's; the exact tokens within 10% of the paper's. Skips where
// the data is absent.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>

#include "real_attention_data.hpp"
#include "support.hpp"
#include "wavekv/wavekv.hpp"

using namespace wkvtest;

namespace {

using namespace wkvtest::real_attention;

// Under the sanitizers, which look for memory and thread errors rather than
// at the figures, the first layer alone (the index builds are ten times
// slower there), with the per-layer checks, and the exact references (in
// double, over every visible token) of one query in 8: every query still
// appends and decodes.
#if defined(WKV_SANITIZED)
constexpr uint32_t kLayersRun = 1, kQueryStride = 8;
#else
constexpr uint32_t kLayersRun = kLayers, kQueryStride = 1;
#endif

}  // namespace

TEST(RealAttention, DefaultBudgetIsAccurateOnEveryLayer) {
  std::string dir = data_dir();
  std::vector<uint16_t> raw;
  if (!read_layer(0, &raw))
    GTEST_SKIP() << "real attention data not found under " << dir << " (set WKV_SHARED_DIR)";

  // The paper's method and the default one side by side, over the same
  // tokens and queries.
  struct Run {
    uint32_t method;
    std::unique_ptr<wavekv::Engine> e;
    std::unique_ptr<wavekv::Plan> plan;
    std::unique_ptr<wavekv::Sequence> seq;
    std::vector<double> all;
  };
  Run runs[2];
  runs[0].method = WKV_METHOD_PAPER;
  runs[1].method = WKV_METHOD_DEFAULT;
  for (Run &r : runs) {
    wkv_config c;
    wkv_config_init(&c);
    c.n_layers = kLayers;
    c.n_q_heads = kQ;
    c.n_kv_heads = kKV;
    c.head_dim = kD;
    c.dtype = WKV_DTYPE_F16;
    c.method = r.method;
    r.e = std::make_unique<wavekv::Engine>(c);
    r.plan = std::make_unique<wavekv::Plan>(*r.e);
    r.seq = std::make_unique<wavekv::Sequence>(*r.e);
  }

  const uint32_t prompt = kT - kQueries;
  if (kLayersRun < kLayers) std::printf("sanitizer build: layers 0 to %u of %u\n", kLayersRun - 1, kLayers);
  for (uint32_t l = 0; l < kLayersRun; ++l) {
    ASSERT_TRUE(read_layer(l, &raw)) << "layer " << l;
    const uint16_t *K = raw.data(), *V = K + kKVElems, *Q = V + kKVElems;
    const std::vector<HeadRows> rows = head_rows(K, V);
    // The prompt, then one generated token before each query: query j sees
    // tokens 0 .. prompt + j.
    for (Run &r : runs) r.seq->append(l, K, V, prompt);
    std::vector<double> ours[2], base;
    std::vector<uint16_t> out(kQ * kD);
    for (uint32_t j = 0; j < kQueries; ++j) {
      size_t tok = static_cast<size_t>(prompt + j) * kKV * kD;
      const uint16_t *q = Q + static_cast<size_t>(j) * kQ * kD;
      const uint32_t n = prompt + j + 1;
      const bool checked = j % kQueryStride == 0;
      std::vector<std::vector<double>> ref(kQ), sw(kQ);
      std::vector<float> qf(kD);
      for (uint32_t h = 0; h < kQ && checked; ++h) {
        const HeadRows &r = rows[h / (kQ / kKV)];
        for (uint32_t i = 0; i < kD; ++i) qf[i] = wkv::f16_to_float(q[h * kD + i]);
        std::vector<char> keep(n, 0);
        for (uint32_t t = 0; t < n; ++t) keep[t] = t < 4 || t + 64 >= n;
        exact_attention(qf.data(), r, kD, &ref[h], nullptr, n);
        exact_attention(qf.data(), r, kD, &sw[h], &keep, n);
        base.push_back(rel_l2(sw[h], ref[h]));
      }
      for (int m = 0; m < 2; ++m) {
        Run &r = runs[m];
        r.seq->append(l, K + tok, V + tok, 1);
        wkv_seq *sp = r.seq->get();
        r.plan->decode(&sp, 1, l, q, out.data());
        for (uint32_t h = 0; h < kQ && checked; ++h) {
          std::vector<float> of(kD);
          for (uint32_t i = 0; i < kD; ++i) of[i] = wkv::f16_to_float(out[h * kD + i]);
          ours[m].push_back(rel_l2(of.data(), ref[h]));
        }
      }
    }
    const double mb = median(base);
    std::printf("layer %u: median rel. L2 error %.4f p90 %.4f (paper's method %.4f p90 %.4f; sink+window %.4f)\n", l,
                median(ours[1]), quantile(ours[1], 0.9), median(ours[0]), quantile(ours[0], 0.9), mb);
    EXPECT_LT(median(ours[1]), mb) << "layer " << l;
    EXPECT_LE(median(ours[1]), median(ours[0])) << "layer " << l << ": the default is worse than the paper's method";
    for (int m = 0; m < 2; ++m) runs[m].all.insert(runs[m].all.end(), ours[m].begin(), ours[m].end());
  }
  const std::vector<double> &def = runs[1].all, &paper = runs[0].all;
  const double m = median(def), p90 = quantile(def, 0.9), paper_p90 = quantile(paper, 0.9);
  std::printf("all layers: median rel. L2 error %.4f p90 %.4f (paper's method %.4f p90 %.4f; bounds 0.035 and "
              "0.75x the paper's p90)\n",
              m, p90, median(paper), paper_p90);
  if (kLayersRun == kLayers) {
    EXPECT_LE(m, 0.035);
    EXPECT_LE(p90, 0.75 * paper_p90);
  } else {
    // Layers 0 and 1 are the set's hardest (about 0.23 with the paper's
    // method): the bounds hold for the whole set, checked without sanitizers.
    std::printf("sanitizer build: the bounds over all layers are not checked\n");
  }
  // At the paper's exact-token budget (within 10%).
  const double att_def = double(runs[1].e->stats().attended_tokens), att_paper = double(runs[0].e->stats().attended_tokens);
  std::printf("exact tokens: %.0f (paper's method %.0f)\n", att_def, att_paper);
  EXPECT_LE(att_def, 1.1 * att_paper);
}
