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

#include "support.hpp"
#include "wavekv/wavekv.hpp"

using namespace wkvtest;

namespace {

constexpr uint32_t kKV = 2, kG = 2, kQ = kKV * kG, kD = 64;

void unit(std::vector<float> *x) {
  double n = 0;
  for (float v : *x) n += double(v) * v;
  for (float &v : *x) v = static_cast<float>(v / std::sqrt(n));
}

// A context of documents (runs of 64..256 tokens whose keys share a
// direction, over a shared offset, with per-token noise), values with a
// common part, and a few needles per head: keys pushed far along a
// direction of their own, which one query aims at.
struct Context {
  uint32_t tokens = 0;
  std::vector<float> k, v;           // [tokens][kKV][kD]
  std::vector<HeadRows> rows;        // per head
  std::vector<std::vector<float>> doc_dir;  // per (doc, head) [kD]
  std::vector<uint32_t> doc_begin;
  struct Needle {
    uint32_t head, pos;
    std::vector<float> dir;
  };
  std::vector<Needle> needles;

  Context(uint32_t n, uint32_t needles_per_head, float value_mean, uint64_t seed) : tokens(n), rows(kKV) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> g(0.f, 1.f);
    std::uniform_int_distribution<uint32_t> len(64, 256);
    std::vector<float> offset(kKV * kD), vmean(kKV * kD);
    for (float &x : offset) x = 3.f * g(rng);
    for (float &x : vmean) x = value_mean * g(rng);
    for (uint32_t t = 0; t < n; t += len(rng)) doc_begin.push_back(t);
    for (size_t i = 0; i < doc_begin.size() * kKV; ++i) {
      std::vector<float> dir(kD);
      for (float &x : dir) x = g(rng);
      unit(&dir);
      doc_dir.push_back(dir);
    }
    std::uniform_int_distribution<uint32_t> where(300, n - 200);
    for (uint32_t h = 0; h < kKV; ++h)
      for (uint32_t i = 0; i < needles_per_head; ++i) {
        Needle nd{h, where(rng), std::vector<float>(kD)};
        for (float &x : nd.dir) x = g(rng);
        unit(&nd.dir);
        needles.push_back(nd);
      }
    k.resize(size_t(n) * kKV * kD);
    v.resize(k.size());
    size_t doc = 0;
    for (uint32_t t = 0; t < n; ++t) {
      while (doc + 1 < doc_begin.size() && doc_begin[doc + 1] <= t) ++doc;
      for (uint32_t h = 0; h < kKV; ++h) {
        float *kr = &k[(size_t(t) * kKV + h) * kD], *vr = &v[(size_t(t) * kKV + h) * kD];
        for (uint32_t i = 0; i < kD; ++i) {
          kr[i] = offset[h * kD + i] + 8.f * doc_dir[doc * kKV + h][i] + g(rng);
          vr[i] = vmean[h * kD + i] + g(rng);
        }
        for (const Needle &nd : needles)
          if (nd.head == h && nd.pos == t)
            for (uint32_t i = 0; i < kD; ++i) kr[i] += 14.f * nd.dir[i];
        for (uint32_t i = 0; i < kD; ++i) {
          kr[i] = round_to(WKV_DTYPE_F16, kr[i]);
          vr[i] = round_to(WKV_DTYPE_F16, vr[i]);
        }
        rows[h].k.insert(rows[h].k.end(), kr, kr + kD);
        rows[h].v.insert(rows[h].v.end(), vr, vr + kD);
      }
    }
  }

  // A query per q head: aimed at a document with strength `amp`, or, for
  // q head 0 of each KV head, at needle `needle` of that head when >= 0.
  std::vector<float> query(std::mt19937_64 &rng, float amp, int needle) const {
    std::normal_distribution<float> g(0.f, 1.f);
    std::uniform_int_distribution<size_t> pick(0, doc_begin.size() - 1);
    std::vector<float> q(kQ * kD);
    for (uint32_t j = 0; j < kQ; ++j) {
      const uint32_t h = j / kG;
      const size_t doc = pick(rng);
      for (uint32_t i = 0; i < kD; ++i) q[j * kD + i] = 0.3f * g(rng) + amp * doc_dir[doc * kKV + h][i];
      if (needle >= 0 && j % kG == 0) {
        const Needle &nd = needles[h * (needles.size() / kKV) + needle];
        for (uint32_t i = 0; i < kD; ++i) q[j * kD + i] = 0.3f * g(rng) + 10.f * nd.dir[i];
      }
    }
    for (float &x : q) x = round_to(WKV_DTYPE_F16, x);
    return q;
  }
};

struct Result {
  uint32_t hits = 0, needle_queries = 0;
  std::vector<double> err, needle_err;
  uint64_t attended = 0;
};

// Decodes `steps` queries over ctx with one method; a needle step aims q
// head 0 of each KV head at one of its needles.
Result run(const Context &ctx, uint32_t method, uint32_t steps, float amp, bool needle_steps) {
  wkv_config c;
  wkv_config_init(&c);
  c.n_layers = 1;
  c.n_q_heads = kQ;
  c.n_kv_heads = kKV;
  c.head_dim = kD;
  c.dtype = WKV_DTYPE_F16;
  c.segment_tokens = 2048;  // several segments in a short context
  c.threads = 2;
  c.method = method;
  wavekv::Engine e(c);
  wavekv::Plan plan(e);
  wavekv::Sequence seq(e);
  wkv_seq *sp = seq.get();
  const std::vector<uint8_t> k = pack(WKV_DTYPE_F16, ctx.k), v = pack(WKV_DTYPE_F16, ctx.v);
  seq.append(0, k.data(), v.data(), ctx.tokens);
  seq.end_prompt(0);
  Result r;
  std::mt19937_64 rng(5);
  const size_t row = kD * 2;
  const uint64_t before = e.stats().attended_tokens;
  for (uint32_t s = 0; s < steps; ++s) {
    const int needle = needle_steps ? static_cast<int>(s % (ctx.needles.size() / kKV)) : -1;
    const std::vector<float> qf = ctx.query(rng, amp, needle);
    const std::vector<uint8_t> q = pack(WKV_DTYPE_F16, qf);
    std::vector<uint8_t> out(kQ * kD * 2);
    plan.lookup(&sp, 1, 0, q.data());
    plan.assemble();
    plan.attend(out.data());
    const wkv_xbuf_view x = plan.xbuf();
    plan.update();
    const std::vector<float> of = unpack(WKV_DTYPE_F16, out, kQ * kD);
    for (uint32_t j = 0; j < kQ; ++j) {
      const uint32_t h = j / kG;
      std::vector<double> ref;
      exact_attention(&qf[j * kD], ctx.rows[h], kD, &ref);
      const double err = rel_l2(&of[j * kD], ref);
      r.err.push_back(err);
      if (needle < 0 || j % kG != 0) continue;
      const Context::Needle &nd = ctx.needles[h * (ctx.needles.size() / kKV) + needle];
      const std::vector<uint8_t> key = pack(WKV_DTYPE_F16, std::vector<float>(&ctx.rows[h].k[size_t(nd.pos) * kD],
                                                                           &ctx.rows[h].k[size_t(nd.pos + 1) * kD]));
      bool hit = false;
      for (int32_t t = x.offsets[h]; t < x.offsets[h + 1] && !hit; ++t)
        hit = std::memcmp(static_cast<const uint8_t *>(x.k) + size_t(t) * row, key.data(), row) == 0;
      r.hits += hit;
      ++r.needle_queries;
      r.needle_err.push_back(err);
    }
  }
  r.attended = e.stats().attended_tokens - before;
  return r;
}

}  // namespace

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
    wkv_config c;
    wkv_config_init(&c);
    c.n_layers = 1;
    c.n_q_heads = kQ;
    c.n_kv_heads = kKV;
    c.head_dim = kD;
    c.segment_tokens = 1024;
    c.threads = 1;
    c.method = m;
    wavekv::Engine e(c);
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
