// The method's refinements (wkv_config.method, docs/accuracy.md) on small
// synthetic contexts, CPU engine, against the paper's method on the same
// tokens: isolated needles are retrieved, diffuse heads are estimated
// closer, the exact-token budget stays the same. Small enough for the
// sanitizers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "accuracy_support.hpp"

using namespace wkvtest;

TEST(Method, TheDefaultRetrievesIsolatedNeedlesThePaperMisses) {
  const Context ctx(6000, 6, 0.f, 11);
  const Result paper = run(ctx, WKV_METHOD_PAPER, 12, 3.f, true);
  const Result def = run(ctx, WKV_METHOD_DEFAULT, 12, 3.f, true);
  std::printf("needles: paper %u/%u hits, median error %.4f; default %u/%u, %.4f; exact tokens %llu vs %llu\n",
              paper.hits, paper.needle_queries, median(paper.needle_err), def.hits, def.needle_queries,
              median(def.needle_err), static_cast<unsigned long long>(def.attended),
              static_cast<unsigned long long>(paper.attended));
  ASSERT_EQ(def.needle_queries, 24u);
  EXPECT_EQ(def.hits, def.needle_queries);
  EXPECT_LE(paper.hits, paper.needle_queries / 2);
  EXPECT_LT(median(def.needle_err), 0.1);
  EXPECT_GT(median(paper.needle_err), 0.5);
  // The same exact budget, within 10%.
  EXPECT_LE(double(def.attended), 1.1 * double(paper.attended));
}

TEST(Method, TheDefaultEstimatesDiffuseHeadsCloser) {
  // Queries aimed loosely: attention spread over many documents.
  const Context ctx(6000, 0, 0.5f, 12);
  const Result paper = run(ctx, WKV_METHOD_PAPER, 10, 0.6f, false);
  const Result def = run(ctx, WKV_METHOD_DEFAULT, 10, 0.6f, false);
  std::printf("diffuse: paper median error %.4f, default %.4f; exact tokens %llu vs %llu\n", median(paper.err),
              median(def.err), static_cast<unsigned long long>(def.attended),
              static_cast<unsigned long long>(paper.attended));
  EXPECT_LT(median(def.err), 0.7 * median(paper.err));
  EXPECT_LE(double(def.attended), 1.1 * double(paper.attended));
}

TEST(Method, EachBitCanBeTurnedOffAndThePaperIsBitZero) {
  const Context ctx(3000, 2, 0.5f, 13);
  // Every combination runs and decodes finite outputs; the index differs
  // only with OUTLIERS (more clusters: the ones split off).
  uint64_t clusters[16] = {};
  for (uint32_t m = 0; m < 16; ++m) {
    wavekv::Engine e(accuracy_config(m, 1024, 1));
    wavekv::Sequence seq(e);
    wavekv::Plan plan(e);
    const std::vector<uint8_t> k = pack(WKV_DTYPE_F16, ctx.k), v = pack(WKV_DTYPE_F16, ctx.v);
    seq.append(0, k.data(), v.data(), ctx.tokens);
    std::mt19937_64 rng(1);
    const std::vector<uint8_t> q = pack(WKV_DTYPE_F16, ctx.query(rng, 3.f, 0));
    std::vector<uint8_t> out(kQ * kD * 2);
    wkv_seq *sp = seq.get();
    plan.decode(&sp, 1, 0, q.data(), out.data());
    for (float x : unpack(WKV_DTYPE_F16, out, kQ * kD)) ASSERT_TRUE(std::isfinite(x)) << "method " << m;
    clusters[m] = e.stats().clusters;
    EXPECT_EQ(e.config().method, m);
  }
  for (uint32_t m = 0; m < 16; ++m)
    EXPECT_EQ(clusters[m], clusters[m & WKV_METHOD_OUTLIERS]) << "method " << m;
  EXPECT_GT(clusters[WKV_METHOD_OUTLIERS], clusters[0]);
}
