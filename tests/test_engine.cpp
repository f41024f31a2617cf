// The engine through its public ABI (via the C++ RAII header): decoding
// against exact attention, index growth, and that errors lose nothing.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "support.hpp"
#include "wavekv/wavekv.hpp"

using namespace wkvtest;

namespace {

struct Shape {
  uint32_t layers = 1, q_heads = 4, kv_heads = 2, d = 64, dtype = WKV_DTYPE_F32;
};

wkv_config small_config(const Shape &s, float retrieval = 0.018f, float estimation = 0.232f) {
  wkv_config c;
  wkv_config_init(&c);
  c.n_layers = s.layers;
  c.n_q_heads = s.q_heads;
  c.n_kv_heads = s.kv_heads;
  c.head_dim = s.d;
  c.dtype = s.dtype;
  c.segment_tokens = 1024;
  c.update_segment_tokens = 256;
  c.retrieval_frac = retrieval;
  c.estimation_frac = estimation;
  c.threads = 2;
  return c;
}

// A sequence with a mirror of every row it stores, per layer and kv head.
struct Mirror {
  Shape s;
  wavekv::Sequence seq;
  std::vector<std::vector<HeadRows>> rows;  // [layer][head]
  KeyGen gen;

  Mirror(const wavekv::Engine &e, const Shape &shape, uint64_t seed)
      : s(shape), seq(e), rows(shape.layers, std::vector<HeadRows>(shape.kv_heads)), gen(shape.kv_heads, shape.d, seed) {}

  // Appends n tokens to every layer; returns the first failing status.
  int append(uint32_t n) {
    std::vector<float> k, v;
    gen.next(n, &k, &v);
    for (float &x : k) x = round_to(s.dtype, x);
    for (float &x : v) x = round_to(s.dtype, x);
    auto kb = pack(s.dtype, k), vb = pack(s.dtype, v);
    for (uint32_t l = 0; l < s.layers; ++l) {
      int rc = wkv_seq_append(seq.get(), l, kb.data(), vb.data(), n, 0, 0, nullptr);
      if (rc != WKV_OK) return rc;
      for (uint32_t t = 0; t < n; ++t)
        for (uint32_t h = 0; h < s.kv_heads; ++h) {
          size_t off = (static_cast<size_t>(t) * s.kv_heads + h) * s.d;
          auto &r = rows[l][h];
          r.k.insert(r.k.end(), k.begin() + off, k.begin() + off + s.d);
          r.v.insert(r.v.end(), v.begin() + off, v.begin() + off + s.d);
        }
    }
    return WKV_OK;
  }

  // A query [q_heads][d], rounded to the dtype.
  std::vector<float> query() {
    std::vector<float> q;
    uint32_t G = s.q_heads / s.kv_heads;
    for (uint32_t h = 0; h < s.kv_heads; ++h) gen.query(h, G, &q);
    for (float &x : q) x = round_to(s.dtype, x);
    return q;
  }

  // Worst relative L2 error of out [q_heads][d] against exact attention.
  double worst_error(uint32_t layer, const std::vector<float> &q, const std::vector<float> &out) const {
    uint32_t G = s.q_heads / s.kv_heads;
    double worst = 0;
    std::vector<double> ref;
    for (uint32_t h = 0; h < s.q_heads; ++h) {
      exact_attention(&q[static_cast<size_t>(h) * s.d], rows[layer][h / G], s.d, &ref);
      worst = std::max(worst, rel_l2(&out[static_cast<size_t>(h) * s.d], ref));
    }
    return worst;
  }
};

// Decodes a batch; returns outputs [n][q_heads][d] as floats.
std::vector<float> decode(wavekv::Plan &plan, std::vector<Mirror *> batch, uint32_t layer,
                          const std::vector<float> &q, uint32_t dtype) {
  const Shape &s = batch[0]->s;
  std::vector<wkv_seq *> seqs;
  for (Mirror *m : batch) seqs.push_back(m->seq.get());
  auto qb = pack(dtype, q);
  std::vector<uint8_t> ob(q.size() * wkv::dtype_bytes(static_cast<wkv::DType>(dtype)), 0xff);
  plan.decode(seqs.data(), static_cast<uint32_t>(seqs.size()), layer, qb.data(), ob.data());
  (void)s;
  return unpack(dtype, ob, q.size());
}

}  // namespace

TEST(Decode, FullRetrievalEqualsExactAttention) {
  for (Shape s : {Shape{1, 4, 2, 64, WKV_DTYPE_F32}, Shape{2, 8, 2, 128, WKV_DTYPE_F32},
                  Shape{1, 3, 3, 80, WKV_DTYPE_F32}, Shape{1, 8, 1, 96, WKV_DTYPE_F32},
                  Shape{1, 2, 1, 256, WKV_DTYPE_F32}}) {
    SCOPED_TRACE(testing::Message() << "d=" << s.d << " q=" << s.q_heads << " kv=" << s.kv_heads);
    wavekv::Engine e(small_config(s, 1.0f, 0.0f));
    wavekv::Plan plan(e);
    Mirror a(e, s, 1), b(e, s, 2);
    ASSERT_EQ(a.append(2500), WKV_OK);
    ASSERT_EQ(b.append(700), WKV_OK);
    for (int step = 0; step < 3; ++step) {
      for (uint32_t l = 0; l < s.layers; ++l) {
        std::vector<float> qa = a.query(), qb = b.query(), q = qa;
        q.insert(q.end(), qb.begin(), qb.end());
        std::vector<float> out = decode(plan, {&a, &b}, l, q, s.dtype);
        std::vector<float> oa(out.begin(), out.begin() + qa.size()), obv(out.begin() + qa.size(), out.end());
        EXPECT_LT(a.worst_error(l, qa, oa), 1e-5);
        EXPECT_LT(b.worst_error(l, qb, obv), 1e-5);
      }
      ASSERT_EQ(a.append(1), WKV_OK);
      ASSERT_EQ(b.append(1), WKV_OK);
    }
    EXPECT_GT(a.seq.info(0).clusters, 0u);
  }
}

TEST(Decode, HalfPrecisionStorageMatchesExactAttention) {
  for (uint32_t dt : {WKV_DTYPE_F16, WKV_DTYPE_BF16}) {
    Shape s{1, 8, 2, 128, dt};
    wavekv::Engine e(small_config(s, 1.0f, 0.0f));
    wavekv::Plan plan(e);
    Mirror a(e, s, 3);
    ASSERT_EQ(a.append(1500), WKV_OK);
    std::vector<float> q = a.query();
    std::vector<float> out = decode(plan, {&a}, 0, q, dt);
    EXPECT_LT(a.worst_error(0, q, out), 1e-2) << "dtype " << dt;
  }
}

TEST(Decode, DefaultBudgetBeatsSinkAndWindow) {
  Shape s{1, 8, 2, 64, WKV_DTYPE_F32};
  wkv_config c = small_config(s);
  c.segment_tokens = 8192;
  wavekv::Engine e(c);
  wavekv::Plan plan(e);
  Mirror a(e, s, 4);
  ASSERT_EQ(a.append(8000), WKV_OK);
  std::vector<double> ours, base;
  const uint32_t G = s.q_heads / s.kv_heads;
  for (int step = 0; step < 16; ++step) {
    std::vector<float> q = a.query();
    std::vector<float> out = decode(plan, {&a}, 0, q, s.dtype);
    for (uint32_t h = 0; h < s.q_heads; ++h) {
      const HeadRows &rows = a.rows[0][h / G];
      size_t n = rows.tokens(s.d);
      std::vector<char> keep(n, 0);
      for (size_t t = 0; t < n; ++t) keep[t] = t < 4 || t + 64 >= n;
      std::vector<double> ref, sw;
      exact_attention(&q[h * s.d], rows, s.d, &ref);
      exact_attention(&q[h * s.d], rows, s.d, &sw, &keep);
      ours.push_back(rel_l2(&out[h * s.d], ref));
      base.push_back(rel_l2(sw, ref));
    }
  }
  std::printf("median rel. L2 error %.4f, sink+window %.4f\n", median(ours), median(base));
  EXPECT_LT(median(ours), 0.5 * median(base));
}

TEST(Index, GrowsBySegmentsAsTokensAreGenerated) {
  Shape s{1, 2, 2, 64, WKV_DTYPE_F32};
  wkv_config c = small_config(s, 1.0f, 0.0f);
  c.segment_tokens = 8192;
  c.update_segment_tokens = 1024;
  wavekv::Engine e(c);
  wavekv::Plan plan(e);
  Mirror a(e, s, 5);
  ASSERT_EQ(a.append(1000), WKV_OK);
  wkv_seq_info i = a.seq.info(0);
  EXPECT_EQ(i.segments, 0u) << "a short prompt is not clustered before its first lookup";
  EXPECT_EQ(i.generating, 0u);
  decode(plan, {&a}, 0, a.query(), s.dtype);
  i = a.seq.info(0);
  EXPECT_EQ(i.generating, 1u);
  EXPECT_EQ(i.segments, 1u);
  EXPECT_EQ(i.sink, 4u);
  EXPECT_EQ(i.tail, 64u);
  EXPECT_EQ(i.clustered, 932u);
  for (int t = 0; t < 10000; ++t) {
    ASSERT_EQ(a.append(1), WKV_OK);
    if (t % 2500 == 0) decode(plan, {&a}, 0, a.query(), s.dtype);
  }
  i = a.seq.info(0);
  EXPECT_EQ(i.tokens, 11000u);
  EXPECT_EQ(i.segments, 1u + 10000u / 1024u);
  EXPECT_EQ(i.tail, 64u + 10000u % 1024u);
  EXPECT_EQ(i.clustered + i.sink + i.tail, i.tokens);
  std::vector<float> q = a.query();
  EXPECT_LT(a.worst_error(0, q, decode(plan, {&a}, 0, q, s.dtype)), 1e-5);
}

TEST(Index, ChunkedPrefillBuildsTheSameIndexAsOneAppend) {
  Shape s{1, 4, 2, 64, WKV_DTYPE_F32};
  wkv_config c = small_config(s);
  wavekv::Engine e(c);
  wavekv::Plan plan(e);
  Mirror a(e, s, 6), b(e, s, 6);
  ASSERT_EQ(a.append(3000), WKV_OK);
  for (uint32_t n : {1u, 999u, 1000u, 500u, 500u}) ASSERT_EQ(b.append(n), WKV_OK);
  std::vector<float> q = a.query();
  std::vector<float> oa = decode(plan, {&a}, 0, q, s.dtype);
  std::vector<float> ob = decode(plan, {&b}, 0, q, s.dtype);
  EXPECT_EQ(a.seq.info(0).clusters, b.seq.info(0).clusters);
  EXPECT_EQ(oa, ob);
}

TEST(Decode, SplitPathAndMergeMatchDecode) {
  Shape s{1, 4, 2, 64, WKV_DTYPE_F32};
  wavekv::Engine e(small_config(s));
  wavekv::Plan plan(e);
  Mirror a(e, s, 7);
  ASSERT_EQ(a.append(3000), WKV_OK);
  std::vector<float> q = a.query();
  std::vector<float> whole = decode(plan, {&a}, 0, q, s.dtype);
  wkv_seq *seq = a.seq.get();
  plan.lookup(&seq, 1, 0, q.data());
  plan.assemble();
  std::vector<float> split(q.size()), lse(s.q_heads);
  plan.attend(split.data(), lse.data());
  EXPECT_EQ(split, whole);
  // Attend ourselves over the execution buffer, then merge the estimate in.
  wkv_xbuf_view xv = plan.xbuf();
  ASSERT_EQ(xv.n_runs, s.kv_heads);
  const uint32_t G = s.q_heads / s.kv_heads;
  std::vector<float> mine(q.size());
  std::vector<float> mine_lse(s.q_heads);
  for (uint32_t h = 0; h < s.q_heads; ++h) {
    uint32_t r = h / G;
    HeadRows rows;
    const float *k = static_cast<const float *>(xv.k), *v = static_cast<const float *>(xv.v);
    rows.k.assign(k + xv.offsets[r] * s.d, k + xv.offsets[r + 1] * s.d);
    rows.v.assign(v + xv.offsets[r] * s.d, v + xv.offsets[r + 1] * s.d);
    std::vector<double> o;
    mine_lse[h] = static_cast<float>(exact_attention(&q[h * s.d], rows, s.d, &o));
    for (uint32_t i = 0; i < s.d; ++i) mine[h * s.d + i] = static_cast<float>(o[i]);
  }
  plan.merge(mine.data(), mine_lse.data());
  for (size_t i = 0; i < mine.size(); ++i) EXPECT_NEAR(mine[i], whole[i], 1e-4);
  for (uint32_t h = 0; h < s.q_heads; ++h) EXPECT_NEAR(mine_lse[h], lse[h], 1e-3);
  plan.update();
}

TEST(Decode, SameSeedSameResult) {
  Shape s{1, 4, 2, 64, WKV_DTYPE_F32};
  std::vector<float> outs[2];
  std::vector<float> q;
  for (int run = 0; run < 2; ++run) {
    wavekv::Engine e(small_config(s));
    wavekv::Plan plan(e);
    Mirror a(e, s, 8);
    ASSERT_EQ(a.append(2000), WKV_OK);
    if (run == 0) q = a.query();
    outs[run] = decode(plan, {&a}, 0, q, s.dtype);
  }
  EXPECT_EQ(outs[0], outs[1]);
}

TEST(Errors, BudgetExhaustionLosesNothing) {
  Shape s{2, 4, 2, 64, WKV_DTYPE_F32};
  wkv_config c = small_config(s, 1.0f, 0.0f);
  c.host_chunk_bytes = 1 << 20;
  c.host_budget_bytes = 1 << 20;
  wavekv::Engine e(c);
  wavekv::Plan plan(e);
  Mirror a(e, s, 9);
  int rc = WKV_OK;
  uint64_t before = 0;
  // Append until the budget refuses.
  for (int i = 0; i < 100 && rc == WKV_OK; ++i) {
    before = a.seq.info(0).tokens;
    rc = a.append(1024);
  }
  ASSERT_EQ(rc, WKV_ERR_BUDGET);
  EXPECT_NE(std::string(wkv_last_error()).find("budget"), std::string::npos) << wkv_last_error();
  // The mirror got the failed chunk for layer 0 only if layer 0 succeeded:
  // re-derive what the engine holds and check it is consistent and intact.
  for (uint32_t l = 0; l < s.layers; ++l) {
    wkv_seq_info i = a.seq.info(l);
    EXPECT_EQ(i.clustered + i.sink + i.tail, i.tokens);
    a.rows[l][0].k.resize(i.tokens * s.d);
    a.rows[l][0].v.resize(i.tokens * s.d);
    a.rows[l][1].k.resize(i.tokens * s.d);
    a.rows[l][1].v.resize(i.tokens * s.d);
    EXPECT_GE(i.tokens, before);
  }
  wkv_stats st = e.stats();
  EXPECT_LE(st.host_bytes_reserved, c.host_budget_bytes);
  for (uint32_t l = 0; l < s.layers; ++l) {
    std::vector<float> q = a.query();
    int drc = WKV_OK;
    std::vector<float> out;
    try {
      out = decode(plan, {&a}, l, q, s.dtype);
    } catch (const wavekv::Error &err) {
      drc = err.code();  // finishing the prompt may itself need pages
    }
    if (drc == WKV_OK)
      EXPECT_LT(a.worst_error(l, q, out), 1e-5);
    else
      EXPECT_EQ(drc, WKV_ERR_BUDGET);
  }
}

TEST(Errors, StaleOrOutOfOrderPlansAreRefused) {
  Shape s{1, 4, 2, 64, WKV_DTYPE_F32};
  wavekv::Engine e(small_config(s));
  wavekv::Plan plan(e);
  Mirror a(e, s, 10);
  ASSERT_EQ(a.append(500), WKV_OK);
  EXPECT_EQ(wkv_assemble(plan.get(), nullptr), WKV_ERR_STATE);
  std::vector<float> q = a.query(), out(q.size());
  EXPECT_EQ(wkv_attend(plan.get(), out.data(), 0, 0, nullptr, nullptr), WKV_ERR_STATE);
  wkv_seq *seq = a.seq.get();
  plan.lookup(&seq, 1, 0, q.data());
  ASSERT_EQ(a.append(1), WKV_OK);
  EXPECT_EQ(wkv_assemble(plan.get(), nullptr), WKV_ERR_STATE);
  plan.lookup(&seq, 1, 0, q.data());
  plan.assemble();
  plan.attend(out.data());
}

TEST(Lifetime, SequenceOutlivesItsEngineHandle) {
  Shape s{1, 4, 2, 64, WKV_DTYPE_F32};
  auto e = std::make_unique<wavekv::Engine>(small_config(s, 1.0f, 0.0f));
  wavekv::Plan plan(*e);
  Mirror a(*e, s, 11);
  ASSERT_EQ(a.append(900), WKV_OK);
  e.reset();
  std::vector<float> q = a.query();
  EXPECT_LT(a.worst_error(0, q, decode(plan, {&a}, 0, q, s.dtype)), 1e-5);
}

// The engine's own threads carry names (`top -H`, `ps -L`, perf): the
// buffer manager's and, with a statistics file, the publisher's, each once
// among the threads the engine started (by thread id: another engine's
// threads may still be leaving the process); gone once it is closed.
TEST(Lifetime, TheEnginesThreadsAreNamed) {
  if (!std::filesystem::exists("/proc/self/task")) GTEST_SKIP() << "skipped: no /proc/self/task";
  auto threads = [] {
    std::map<std::string, std::string> out;  // thread id -> name
    for (const auto &t : std::filesystem::directory_iterator("/proc/self/task")) {
      std::ifstream f(t.path() / "comm");
      std::string n;
      if (std::getline(f, n)) out[t.path().filename().string()] = n;
    }
    return out;
  };
  const auto before = threads();
  const std::string stats = ::testing::TempDir() + "wkv-thread-names.json";
  Shape s;
  wkv_config c = small_config(s);
  c.stats_path = stats.c_str();
  std::map<std::string, std::string> started;
  {
    wavekv::Engine e(c);
    for (const auto &[tid, name] : threads())
      if (!before.count(tid)) started[tid] = name;
  }
  std::multiset<std::string> names;
  for (const auto &[tid, name] : started) names.insert(name);
  EXPECT_EQ(names.count("wkv-buffers"), 1u);
  EXPECT_EQ(names.count("wkv-stats"), 1u);
  // Joined at close; the kernel drops a joined thread's entry soon after.
  bool gone = false;
  for (int i = 0; i < 200 && !gone; ++i) {
    const auto now = threads();
    gone = true;
    for (const auto &[tid, name] : started)
      if ((name == "wkv-buffers" || name == "wkv-stats") && now.count(tid)) gone = false;
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(gone) << "the engine's threads end with it";
  std::remove(stats.c_str());
}

TEST(Stress, ThreadsShareOneEngine) {
  Shape s{2, 4, 2, 64, WKV_DTYPE_F32};
  wavekv::Engine e(small_config(s, 1.0f, 0.0f));
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      wavekv::Plan plan(e);
      Mirror a(e, s, 100 + t);
      if (a.append(300 + 100 * t) != WKV_OK) failures++;
      for (int step = 0; step < 6; ++step) {
        if (a.append(97) != WKV_OK) failures++;
        for (uint32_t l = 0; l < s.layers; ++l) {
          std::vector<float> q = a.query();
          if (a.worst_error(l, q, decode(plan, {&a}, l, q, s.dtype)) > 1e-5) failures++;
        }
      }
    });
  for (auto &th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(e.stats().sequences, 0u);
  // A sequence destroyed while another thread's step was in flight gives its
  // pages back from the buffer manager's thread, once that step has ended:
  // soon after the join, not necessarily before it (seen under load).
  for (int i = 0; i < 5000 && e.stats().pages_used != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(e.stats().pages_used, 0u);
}
