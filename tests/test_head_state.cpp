// One head state for every backend: a layer exported to a backend-neutral
// snapshot and imported into another engine decodes bit for bit as before
// and keeps growing the same way; a snapshot of another shape or an
// inconsistent one is refused saying why. And the engine changes nothing
// before it has checked a call: a refused lookup ends no prompt, a growth
// that fails leaves the layer as it was, update needs an assemble, and a
// failed verb leaves the plan holding no step.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <string>

#include "lib/engine/engine.hpp"
#include "lib/engine/plan.hpp"
#include "lib/engine/sequence.hpp"
#include "lib/index/growth.hpp"
#include "lib/index/snapshot.hpp"
#include "support.hpp"
#include "wavekv/wavekv.hpp"

using namespace wkvtest;

namespace {

constexpr uint32_t kQ = 4, kKV = 2, kD = 64;

wkv_config config(uint32_t dtype = WKV_DTYPE_F16, uint32_t d = kD, uint32_t layers = 2) {
  wkv_config c;
  wkv_config_init(&c);
  c.n_layers = layers;
  c.n_q_heads = kQ;
  c.n_kv_heads = kKV;
  c.head_dim = d;
  c.dtype = dtype;
  c.segment_tokens = 512;
  c.update_segment_tokens = 128;
  c.threads = 2;
  return c;
}

// An engine and its sequences through the internal API (snapshots are not
// in the C ABI yet).
struct Internal {
  std::shared_ptr<wkv::Engine> e;
  explicit Internal(const wkv_config &c) { EXPECT_TRUE(wkv::Engine::open(&c, &e).is_ok()); }
  std::shared_ptr<wkv::Sequence> sequence() {
    std::shared_ptr<wkv::Sequence> s;
    EXPECT_TRUE(wkv::Sequence::create(e, &s).is_ok());
    return s;
  }
  void append(wkv::Sequence &s, const std::vector<uint8_t> &k, const std::vector<uint8_t> &v, uint32_t n) {
    const uint32_t d = e->config().c.head_dim;
    for (uint32_t l = 0; l < e->config().c.n_layers; ++l) {
      wkv::Status st = e->append(s, l, k.data(), v.data(), n, kKV * d, d, nullptr);
      ASSERT_TRUE(st.is_ok()) << st.message();
    }
  }
  // Decodes one sequence at one layer; the output in the storage dtype.
  std::vector<uint8_t> decode(const std::shared_ptr<wkv::Sequence> &s, uint32_t layer, const std::vector<uint8_t> &q) {
    const uint32_t d = e->config().c.head_dim;
    std::shared_ptr<wkv::StepTracker> t;
    EXPECT_TRUE(e->buffers().new_tracker(&t).is_ok());
    wkv::Plan plan(e, t);
    std::vector<uint8_t> out(q.size(), 0xff);
    wkv::Status st = e->lookup(plan, &s, 1, layer, q.data(), kQ * d, d, nullptr);
    if (st.is_ok()) st = e->assemble(plan, nullptr);
    if (st.is_ok()) st = e->attend(plan, out.data(), kQ * d, d, nullptr, nullptr);
    EXPECT_TRUE(st.is_ok()) << st.message();
    return out;
  }
};

// Tokens and queries of one context, packed in a dtype.
struct Draw {
  KeyGen gen{kKV, kD, 99};
  uint32_t dtype;
  explicit Draw(uint32_t dt) : dtype(dt) {}
  void tokens(uint32_t n, std::vector<uint8_t> *k, std::vector<uint8_t> *v) {
    std::vector<float> kf, vf;
    gen.next(n, &kf, &vf);
    *k = pack(dtype, kf);
    *v = pack(dtype, vf);
  }
  std::vector<uint8_t> query() {
    std::vector<float> q;
    for (uint32_t h = 0; h < kKV; ++h) gen.query(h, kQ / kKV, &q);
    return pack(dtype, q);
  }
};

// A prompt of `prompt` tokens ended at every layer, then `generated` tokens.
void prompt_then_generate(Internal &in, Draw &draw, wkv::Sequence &s, uint32_t prompt, uint32_t generated) {
  std::vector<uint8_t> k, v;
  draw.tokens(prompt, &k, &v);
  in.append(s, k, v, prompt);
  for (uint32_t l = 0; l < s.n_layers(); ++l) ASSERT_TRUE(in.e->end_prompt(s, l, nullptr).is_ok());
  draw.tokens(generated, &k, &v);
  in.append(s, k, v, generated);
}

wkv::Status export_all(Internal &in, wkv::Sequence &s, std::vector<wkv::LayerSnapshot> *out) {
  out->resize(s.n_layers());
  for (uint32_t l = 0; l < s.n_layers(); ++l)
    WKV_RETURN_IF_ERROR(wkv::export_layer(in.e->index(), s.layer(l), &(*out)[l], nullptr));
  return wkv::Status::ok();
}

wkv::Status import_all(Internal &in, wkv::Sequence &s, const std::vector<wkv::LayerSnapshot> &snap) {
  for (uint32_t l = 0; l < s.n_layers(); ++l) {
    WKV_RETURN_IF_ERROR(wkv::check_snapshot(in.e->config(), snap[l]));
    WKV_RETURN_IF_ERROR(wkv::import_layer(in.e->index(), snap[l], &s.layer(l), nullptr));
  }
  return wkv::Status::ok();
}

}  // namespace

TEST(HeadSnapshot, ImportedLayersDecodeBitForBitAndGrowTheSameWay) {
  for (uint32_t dt : {WKV_DTYPE_F32, WKV_DTYPE_F16, WKV_DTYPE_BF16}) {
    SCOPED_TRACE(testing::Message() << "dtype " << dt);
    Internal a(config(dt)), b(config(dt));
    Draw draw(dt);
    auto sa = a.sequence();
    prompt_then_generate(a, draw, *sa, 1500, 150);  // past an update segment
    std::vector<uint8_t> k, v;

    std::vector<wkv::LayerSnapshot> snap;
    wkv::Status st = export_all(a, *sa, &snap);
    ASSERT_TRUE(st.is_ok()) << st.message();
    EXPECT_EQ(snap[0].tokens, 1650u);
    EXPECT_GT(snap[0].heads[0].segments.size(), 2u);
    auto sb = b.sequence();
    st = import_all(b, *sb, snap);
    ASSERT_TRUE(st.is_ok()) << st.message();
    for (uint32_t l = 0; l < 2; ++l) {
      EXPECT_EQ(sb->layer(l).tokens, sa->layer(l).tokens);
      EXPECT_EQ(sb->layer(l).tail_begin, sa->layer(l).tail_begin);
      EXPECT_EQ(sb->layer(l).heads[1].clusters(), sa->layer(l).heads[1].clusters());
    }
    for (int step = 0; step < 3; ++step) {
      const std::vector<uint8_t> q = draw.query();
      for (uint32_t l = 0; l < 2; ++l) EXPECT_EQ(b.decode(sb, l, q), a.decode(sa, l, q)) << "step " << step;
      // The same tokens to both: growths after the import match too.
      draw.tokens(60, &k, &v);
      a.append(*sa, k, v, 60);
      b.append(*sb, k, v, 60);
    }
    EXPECT_EQ(sb->layer(0).heads[0].segments.size(), sa->layer(0).heads[0].segments.size());
    wkv_stats s;
    wkv_stats_init(&s);
    b.e->fill_stats(&s);
    EXPECT_EQ(s.tokens, 2u * (1650 + 180));
  }
}

// Every head knows what its retrieval zone can hold at most: the n_ret
// largest clusters' members and cache units (the CUDA lookup sizes the
// execution buffer by it). Kept by every growth, prompt and generated, and
// rebuilt by an import; checked against sorting the sizes.
void expect_retrieval_bound(const wkv::Config &cfg, const wkv::HeadState &hs) {
  std::vector<uint32_t> sizes(hs.map.size.begin(), hs.map.size.end());
  std::sort(sizes.begin(), sizes.end(), std::greater<uint32_t>());
  uint32_t n_ret = 0, n_one = 0, n_est = 0;
  wkv::zone_sizes(cfg, hs.clusters(), hs.ones, &n_ret, &n_one, &n_est);
  const uint64_t pt = cfg.page_tokens();
  uint64_t tokens = 0, units = 0;
  for (uint32_t i = 0; i < n_ret && i < sizes.size(); ++i) {
    tokens += sizes[i];
    units += (sizes[i] + pt - 1) / pt;
  }
  EXPECT_EQ(hs.ret_n, n_ret);
  EXPECT_EQ(hs.ret_tokens, tokens);
  EXPECT_EQ(hs.ret_units, units);
  EXPECT_EQ(hs.max_cluster, sizes.empty() ? 0u : sizes[0]);
  uint64_t counted = 0;
  for (uint32_t c : hs.by_size) counted += c;
  EXPECT_EQ(counted, hs.clusters());
  EXPECT_LE(tokens, uint64_t(n_ret) * hs.max_cluster);
}

TEST(HeadSnapshot, EveryHeadKnowsItsRetrievalBoundAfterGrowthsAndImports) {
  for (uint32_t method : {0u, static_cast<uint32_t>(WKV_METHOD_ONES)}) {
    SCOPED_TRACE(testing::Message() << "method " << method);
    wkv_config c = config(WKV_DTYPE_F16);
    c.method |= method;
    Internal a(c), b(c);
    Draw draw(WKV_DTYPE_F16);
    auto sa = a.sequence();
    prompt_then_generate(a, draw, *sa, 2000, 0);
    for (uint32_t h = 0; h < kKV; ++h) expect_retrieval_bound(a.e->config(), sa->layer(1).heads[h]);
    std::vector<uint8_t> k, v;
    draw.tokens(300, &k, &v);  // past two update segments
    a.append(*sa, k, v, 300);
    for (uint32_t l = 0; l < 2; ++l)
      for (uint32_t h = 0; h < kKV; ++h) expect_retrieval_bound(a.e->config(), sa->layer(l).heads[h]);
    std::vector<wkv::LayerSnapshot> snap;
    ASSERT_TRUE(export_all(a, *sa, &snap).is_ok());
    auto sb = b.sequence();
    wkv::Status st = import_all(b, *sb, snap);
    ASSERT_TRUE(st.is_ok()) << st.message();
    for (uint32_t l = 0; l < 2; ++l)
      for (uint32_t h = 0; h < kKV; ++h) {
        expect_retrieval_bound(b.e->config(), sb->layer(l).heads[h]);
        EXPECT_EQ(sb->layer(l).heads[h].ret_tokens, sa->layer(l).heads[h].ret_tokens);
      }
  }
}

TEST(HeadSnapshot, ASnapshotWithoutSpreadsGetsThemFromItsPages) {
  // A file written before clusters had a spread: import computes it from the
  // pages' keys, as the k-means did, and the layer decodes the same.
  Internal a(config(WKV_DTYPE_F16)), b(config(WKV_DTYPE_F16));
  Draw draw(WKV_DTYPE_F16);
  auto sa = a.sequence();
  std::vector<uint8_t> k, v;
  draw.tokens(1500, &k, &v);
  a.append(*sa, k, v, 1500);
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(a.e->end_prompt(*sa, l, nullptr).is_ok());
  std::vector<wkv::LayerSnapshot> snap;
  ASSERT_TRUE(export_all(a, *sa, &snap).is_ok());
  std::vector<std::vector<float>> spreads;
  for (wkv::LayerSnapshot &s : snap)
    for (wkv::HeadSnapshot &h : s.heads) {
      ASSERT_EQ(h.spread.size(), h.size.size());
      spreads.push_back(h.spread);
      h.spread.clear();
    }
  auto sb = b.sequence();
  wkv::Status st = import_all(b, *sb, snap);
  ASSERT_TRUE(st.is_ok()) << st.message();
  std::vector<wkv::LayerSnapshot> again;
  ASSERT_TRUE(export_all(b, *sb, &again).is_ok());
  size_t i = 0;
  for (const wkv::LayerSnapshot &s : again)
    for (const wkv::HeadSnapshot &h : s.heads) {
      const std::vector<float> &want = spreads[i++];
      ASSERT_EQ(h.spread.size(), want.size());
      for (size_t c = 0; c < want.size(); ++c)
        ASSERT_NEAR(h.spread[c], want[c], 1e-6f * std::max(1.f, want[c])) << "cluster " << c;
    }
  const std::vector<uint8_t> q = draw.query();
  for (uint32_t l = 0; l < 2; ++l) EXPECT_EQ(b.decode(sb, l, q), a.decode(sa, l, q));
  // A spread array of the wrong length is refused.
  snap[0].heads[1].spread.assign(3, 0.f);
  EXPECT_FALSE(wkv::check_snapshot(b.e->config(), snap[0]).is_ok());
}

TEST(HeadSnapshot, AnotherShapeIsRefusedSayingWhatDiffers) {
  Internal a(config(WKV_DTYPE_F16)), c(config(WKV_DTYPE_F16, 128));
  Draw draw(WKV_DTYPE_F16);
  auto sa = a.sequence();
  std::vector<uint8_t> k, v;
  draw.tokens(700, &k, &v);
  a.append(*sa, k, v, 700);
  std::vector<wkv::LayerSnapshot> snap;
  ASSERT_TRUE(export_all(a, *sa, &snap).is_ok());
  wkv::Status st = wkv::check_snapshot(c.e->config(), snap[0]);
  EXPECT_EQ(st.code(), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(st.message().find("head_dim 64"), std::string::npos) << st.message();
}

TEST(HeadSnapshot, AnInconsistentSnapshotIsRefusedNamingTheHead) {
  Internal a(config(WKV_DTYPE_F16));
  Draw draw(WKV_DTYPE_F16);
  auto sa = a.sequence();
  std::vector<uint8_t> k, v;
  draw.tokens(1200, &k, &v);
  a.append(*sa, k, v, 1200);
  std::vector<wkv::LayerSnapshot> snap;
  ASSERT_TRUE(export_all(a, *sa, &snap).is_ok());
  ASSERT_TRUE(wkv::check_snapshot(a.e->config(), snap[0]).is_ok());
  auto bad = snap[0];
  bad.heads[1].first_slot[3] += 1;  // a cluster outside its segment's slots
  wkv::Status st = wkv::check_snapshot(a.e->config(), bad);
  EXPECT_EQ(st.code(), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(st.message().find("head 1"), std::string::npos) << st.message();
  bad = snap[0];
  bad.heads[0].tail_k.pop_back();
  EXPECT_EQ(wkv::check_snapshot(a.e->config(), bad).code(), WKV_ERR_INVALID_ARGUMENT);
  bad = snap[0];
  bad.heads[0].segments[0].tokens += 8;
  EXPECT_EQ(wkv::check_snapshot(a.e->config(), bad).code(), WKV_ERR_INVALID_ARGUMENT);
  // And an import into a sequence that already holds tokens is not what
  // import does: it builds a fresh layer aside and swaps it in.
  auto sb = a.sequence();
  ASSERT_TRUE(wkv::import_layer(a.e->index(), snap[0], &sb->layer(0), nullptr).is_ok());
  EXPECT_EQ(sb->layer(0).tokens, 1200u);
}

// An import that runs out of memory (each of its allocations failing in
// turn) is WKV_ERR_OUT_OF_MEMORY and leaves the layer it was to replace as it
// was: its own tokens decode the same bits after. Once memory is there the
// import takes, and decodes as the exported layer does.
TEST(HeadSnapshot, AnImportThatRunsOutOfMemoryLeavesTheLayerAsItWas) {
  Internal a(config(WKV_DTYPE_F16, kD, 1));
  Draw draw(WKV_DTYPE_F16), other(WKV_DTYPE_F16);
  other.gen = KeyGen(kKV, kD, 7);
  auto sa = a.sequence(), sb = a.sequence();
  prompt_then_generate(a, draw, *sa, 1500, 150);
  prompt_then_generate(a, other, *sb, 700, 40);
  std::vector<wkv::LayerSnapshot> snap;
  ASSERT_TRUE(export_all(a, *sa, &snap).is_ok());
  const std::vector<uint8_t> q = draw.query();
  const std::vector<uint8_t> before = a.decode(sb, 0, q), want = a.decode(sa, 0, q);
  uint32_t failed = 0;
  bool imported = false;
  for (uint32_t skip = 0; skip < 64 && !imported; ++skip) {
    a.e->faults().arm(wkv::FaultInjector::kEngineAlloc, 1, skip);
    const wkv::Status st = wkv::import_layer(a.e->index(), snap[0], &sb->layer(0), nullptr);
    a.e->faults().arm(wkv::FaultInjector::kEngineAlloc, 0);
    imported = st.is_ok();  // it made fewer than skip + 1 allocations
    if (imported) break;
    ++failed;
    EXPECT_EQ(st.code(), WKV_ERR_OUT_OF_MEMORY) << "skip " << skip << ": " << st.message();
    EXPECT_EQ(sb->layer(0).tokens, 740u) << "skip " << skip;
    EXPECT_EQ(a.decode(sb, 0, q), before) << "skip " << skip;
  }
  EXPECT_GT(failed, 2u) << "an import allocates its rows, regions and mirror";
  ASSERT_TRUE(imported) << "no import took within 64 allocations";
  EXPECT_EQ(sb->layer(0).tokens, sa->layer(0).tokens);
  EXPECT_EQ(a.decode(sb, 0, q), want);
}

// The CPU engine's compact mirror: each cluster's centroid and value mean
// (value sum / size) in quantize_row's format, whatever their magnitude
// (a mean past f16's range too); a row that is not finite drops the mirror
// (compact_ok false; the growths and imports then append to it no more).
TEST(CompactMirror, HoldsEveryFiniteRowAndDropsAtOneThatIsNot) {
  constexpr uint32_t d = 8, n = 3;
  std::vector<float> centroid(n * d), value_sum(n * d);
  const std::vector<uint32_t> size = {1, 4, 1000};
  for (uint32_t i = 0; i < n * d; ++i) {
    centroid[i] = 0.1f * float(i) - 1.f;
    value_sum[i] = (float(i % d) - 3.f) * 1e8f;  // means of 1e8, 2.5e7, 1e5 a unit: past f16
  }
  wkv::MetaIndex m;
  m.centroid_q8.reserve(2 * n * d);
  m.centroid_q8_scale.reserve(2 * n);
  m.value_mean_q8.reserve(2 * n * d);
  m.value_mean_q8_scale.reserve(2 * n);
  wkv::append_compact(centroid.data(), value_sum.data(), size.data(), n, d, &m);
  ASSERT_TRUE(m.compact_ok);
  ASSERT_EQ(m.value_mean_q8_scale.size(), n);
  for (uint32_t c = 0; c < n; ++c) {
    float mean[d], scale = 0.f;
    int8_t q[d];
    for (uint32_t j = 0; j < d; ++j) mean[j] = value_sum[c * d + j] / float(size[c]);
    wkv::quantize_row(mean, d, q, &scale);
    EXPECT_EQ(m.value_mean_q8_scale[c], scale) << "cluster " << c;
    EXPECT_EQ(std::memcmp(m.value_mean_q8.data() + c * d, q, d), 0) << "cluster " << c;
    wkv::quantize_row(centroid.data() + c * d, d, q, &scale);
    EXPECT_EQ(m.centroid_q8_scale[c], scale) << "cluster " << c;
    EXPECT_EQ(std::memcmp(m.centroid_q8.data() + c * d, q, d), 0) << "cluster " << c;
  }
  // A sum that overflows to infinity: its mean is not finite.
  value_sum[d + 2] = std::numeric_limits<float>::infinity();
  wkv::append_compact(centroid.data(), value_sum.data(), size.data(), n, d, &m);
  EXPECT_FALSE(m.compact_ok);
  EXPECT_TRUE(m.centroid_q8.empty() && m.centroid_q8_scale.empty() && m.value_mean_q8.empty() &&
              m.value_mean_q8_scale.empty());
}

// Defect 9 of the redesign: lookup ended every sequence's prompt (a
// k-means) before it checked q and the stream.
TEST(EngineChecksFirst, ARefusedLookupEndsNoPrompt) {
  wkv_config c = config(WKV_DTYPE_F32, kD, 1);
  wavekv::Engine e(c);
  wavekv::Sequence s(e);
  Draw draw(WKV_DTYPE_F32);
  std::vector<uint8_t> k, v;
  draw.tokens(900, &k, &v);
  s.append(0, k.data(), v.data(), 900);
  wavekv::Plan p(e);
  std::vector<uint8_t> q = draw.query();
  q.resize(q.size() + 4);
  wkv_seq *seqs[1] = {s.get()};
  EXPECT_EQ(wkv_lookup(p.get(), seqs, 1, 0, q.data() + 1, 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(s.info(0).generating, 0u) << "the prompt was not ended by a refused lookup";
  EXPECT_EQ(s.info(0).segments, 1u);
  EXPECT_EQ(wkv_lookup(p.get(), seqs, 1, 0, q.data(), 0, 0, nullptr), WKV_OK) << wkv_last_error();
  EXPECT_EQ(s.info(0).generating, 1u);
}

// Defect 9: a growth failing partway left some heads grown, and the append's
// rollback then miscounted the tail.
TEST(EngineChecksFirst, AGrowthThatFailsLeavesTheLayerAsItWas) {
  wkv_config c = config(WKV_DTYPE_F32, kD, 1);
  c.host_budget_bytes = 16 * 4096;  // 16 pages of 8 tokens: no segment fits
  wavekv::Engine e(c);
  wavekv::Sequence s(e);
  Draw draw(WKV_DTYPE_F32);
  std::vector<uint8_t> k, v;
  draw.tokens(100, &k, &v);
  ASSERT_EQ(wkv_seq_append(s.get(), 0, k.data(), v.data(), 100, 0, 0, nullptr), WKV_OK);
  const wkv_seq_info before = s.info(0);
  draw.tokens(600, &k, &v);
  EXPECT_EQ(wkv_seq_append(s.get(), 0, k.data(), v.data(), 600, 0, 0, nullptr), WKV_ERR_BUDGET);
  const wkv_seq_info after = s.info(0);
  EXPECT_EQ(after.tokens, before.tokens);
  EXPECT_EQ(after.tail, before.tail);
  EXPECT_EQ(after.sink, before.sink);
  EXPECT_EQ(after.segments, 0u);
  EXPECT_EQ(e.stats().pages_used, 0u);
  // Still usable: smaller appends go in, and decoding covers them.
  draw.tokens(50, &k, &v);
  EXPECT_EQ(wkv_seq_append(s.get(), 0, k.data(), v.data(), 50, 0, 0, nullptr), WKV_OK) << wkv_last_error();
  EXPECT_EQ(s.info(0).tokens, 150u);
  EXPECT_EQ(s.info(0).tail, 146u);
}

// Defect 4: update was accepted before assemble.
TEST(EngineChecksFirst, UpdateNeedsAnAssemble) {
  wavekv::Engine e(config(WKV_DTYPE_F32, kD, 1));
  wavekv::Sequence s(e);
  Draw draw(WKV_DTYPE_F32);
  std::vector<uint8_t> k, v;
  draw.tokens(300, &k, &v);
  s.append(0, k.data(), v.data(), 300);
  wavekv::Plan p(e);
  const std::vector<uint8_t> q = draw.query();
  wkv_seq *seqs[1] = {s.get()};
  ASSERT_EQ(wkv_lookup(p.get(), seqs, 1, 0, q.data(), 0, 0, nullptr), WKV_OK);
  EXPECT_EQ(wkv_update(p.get(), nullptr), WKV_ERR_STATE);
  EXPECT_NE(std::string(wkv_last_error()).find("assemble"), std::string::npos) << wkv_last_error();
  ASSERT_EQ(wkv_lookup(p.get(), seqs, 1, 0, q.data(), 0, 0, nullptr), WKV_OK);
  ASSERT_EQ(wkv_assemble(p.get(), nullptr), WKV_OK);
  EXPECT_EQ(wkv_update(p.get(), nullptr), WKV_OK) << wkv_last_error();
}

TEST(EngineChecksFirst, AFailedVerbLeavesThePlanWithoutAStep) {
  wavekv::Engine e(config(WKV_DTYPE_F32, kD, 1));
  wavekv::Sequence s(e);
  Draw draw(WKV_DTYPE_F32);
  std::vector<uint8_t> k, v;
  draw.tokens(300, &k, &v);
  s.append(0, k.data(), v.data(), 300);
  wavekv::Plan p(e);
  const std::vector<uint8_t> q = draw.query();
  std::vector<uint8_t> out(q.size() + 4);
  wkv_seq *seqs[1] = {s.get()};
  ASSERT_EQ(wkv_lookup(p.get(), seqs, 1, 0, q.data(), 0, 0, nullptr), WKV_OK);
  ASSERT_EQ(wkv_assemble(p.get(), nullptr), WKV_OK);
  EXPECT_EQ(wkv_attend(p.get(), out.data() + 1, 0, 0, nullptr, nullptr), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(wkv_attend(p.get(), out.data(), 0, 0, nullptr, nullptr), WKV_ERR_STATE)
      << "the earlier step is gone: no result of a previous query";
  EXPECT_EQ(wkv_update(p.get(), nullptr), WKV_ERR_STATE);
}
