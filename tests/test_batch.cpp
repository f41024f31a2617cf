// wkv_append_batch: one token (or a few) appended to many sequences of a
// layer in one call. The same tokens appended one sequence at a time give
// the same index and the same decoding outputs bit for bit, across index
// growths, in any stride layout; misuse is refused and changes nothing; a
// growth that fails in the middle of a batch leaves exactly what the header
// says (the sequences before the failing one hold their tokens, the rest
// none) and the engine goes on.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "lib/engine/engine.hpp"
#include "lib/engine/plan.hpp"
#include "lib/engine/sequence.hpp"
#include "engine_support.hpp"
#include "support.hpp"
#include "wavekv/wavekv.hpp"

using namespace wkvtest;

namespace {

constexpr uint32_t kQ = 8, kKV = 2, kD = 64, kLayers = 2;

wkv_config batch_config(uint32_t dtype) {
  wkv_config c;
  wkv_config_init(&c);
  c.n_layers = kLayers;
  c.n_q_heads = kQ;
  c.n_kv_heads = kKV;
  c.head_dim = kD;
  c.dtype = dtype;
  c.segment_tokens = 512;
  c.update_segment_tokens = 64;
  c.window_tokens = 32;
  c.sink_tokens = 4;
  c.threads = 1;
  return c;
}

// Tokens for n sequences: keys and values [n][T][H][d], f32, rounded to
// the dtype, packed into it.
struct Batch {
  uint32_t n, T;
  std::vector<uint8_t> k, v;
};

Batch make_batch(std::vector<KeyGen> &gens, uint32_t T, uint32_t dtype) {
  Batch b{static_cast<uint32_t>(gens.size()), T, {}, {}};
  std::vector<float> k, v;
  for (KeyGen &g : gens) g.next(T, &k, &v);
  b.k = pack(dtype, k);
  b.v = pack(dtype, v);
  return b;
}

// Decodes the sequences with one query per sequence; the outputs, packed.
std::vector<uint8_t> decode(wkv_plan *plan, const std::vector<wkv_seq *> &seqs, uint32_t layer,
                            const std::vector<uint8_t> &q, uint32_t dtype) {
  const size_t esz = wkv::dtype_bytes(static_cast<wkv::DType>(dtype));
  std::vector<uint8_t> out(seqs.size() * kQ * kD * esz);
  const int rc = wkv_decode(plan, seqs.data(), static_cast<uint32_t>(seqs.size()), layer, q.data(), 0, 0, out.data(),
                            0, 0, nullptr);
  EXPECT_EQ(rc, WKV_OK) << wkv_last_error();
  return out;
}

std::vector<uint8_t> queries(KeyGen &g, uint32_t n, uint32_t dtype) {
  std::vector<float> q;
  for (uint32_t s = 0; s < n; ++s)
    for (uint32_t h = 0; h < kKV; ++h) g.query(h, kQ / kKV, &q);
  return pack(dtype, q);
}

wkv_seq_info info(const wavekv::Sequence &s, uint32_t layer) {
  wkv_seq_info i;
  wkv_seq_info_init(&i);
  EXPECT_EQ(wkv_seq_info_get(s.get(), layer, &i), WKV_OK) << wkv_last_error();
  return i;
}

void expect_same_info(const wavekv::Sequence &a, const wavekv::Sequence &b, uint32_t layer) {
  const wkv_seq_info x = info(a, layer), y = info(b, layer);
  EXPECT_EQ(x.tokens, y.tokens);
  EXPECT_EQ(x.clustered, y.clustered);
  EXPECT_EQ(x.sink, y.sink);
  EXPECT_EQ(x.tail, y.tail);
  EXPECT_EQ(x.segments, y.segments);
  EXPECT_EQ(x.clusters, y.clusters);
  EXPECT_EQ(x.pages, y.pages);
}

class AppendBatch : public ::testing::TestWithParam<uint32_t> {};

}  // namespace

// Four sequences of different prompt lengths, then 300 generated tokens
// (four or five growths of 64 tokens each), one or three at a time, in a
// layout that is not packed: the batch verb and the single verb agree bit
// for bit in every decoding output and in the index.
TEST_P(AppendBatch, MatchesAppendingOneSequenceAtATime) {
  const uint32_t dtype = GetParam(), N = 4;
  const size_t esz = wkv::dtype_bytes(static_cast<wkv::DType>(dtype));
  const wkv_config c = batch_config(dtype);
  wavekv::Engine batched(c), single(c);
  std::vector<wavekv::Sequence> bs, ss;
  std::vector<wkv_seq *> bh, sh;
  std::vector<KeyGen> gens;
  for (uint32_t i = 0; i < N; ++i) {
    bs.emplace_back(batched);
    ss.emplace_back(single);
    bh.push_back(bs.back().get());
    sh.push_back(ss.back().get());
    gens.emplace_back(kKV, kD, 100 + i);
  }
  // Prompts: 1500 + 300 i tokens, the first 1200 of them in batches of
  // 400 (the first crossing the sink), the rest one sequence at a time.
  for (uint32_t part = 0; part < 3; ++part) {
    const Batch b = make_batch(gens, 400, dtype);
    for (uint32_t l = 0; l < kLayers; ++l) {
      ASSERT_EQ(wkv_append_batch(bh.data(), N, l, b.k.data(), b.v.data(), 400, 0, 0, 0, nullptr), WKV_OK)
          << wkv_last_error();
      for (uint32_t i = 0; i < N; ++i) {
        const size_t off = static_cast<size_t>(i) * 400 * kKV * kD * esz;
        ASSERT_EQ(wkv_seq_append(sh[i], l, b.k.data() + off, b.v.data() + off, 400, 0, 0, nullptr), WKV_OK);
      }
    }
  }
  for (uint32_t i = 0; i < N; ++i) {
    std::vector<KeyGen> one{gens[i]};
    const uint32_t extra = 300 + 300 * i;
    const Batch b = make_batch(one, extra, dtype);
    gens[i] = one[0];
    for (uint32_t l = 0; l < kLayers; ++l) {
      ASSERT_EQ(wkv_seq_append(bh[i], l, b.k.data(), b.v.data(), extra, 0, 0, nullptr), WKV_OK);
      ASSERT_EQ(wkv_seq_append(sh[i], l, b.k.data(), b.v.data(), extra, 0, 0, nullptr), WKV_OK);
    }
  }
  wavekv::Plan bp(batched), sp(single);
  KeyGen qgen(kKV, kD, 7);
  for (uint32_t l = 0; l < kLayers; ++l) {
    const auto q = queries(qgen, N, dtype);
    ASSERT_EQ(decode(bp.get(), bh, l, q, dtype), decode(sp.get(), sh, l, q, dtype)) << "after the prompts";
  }

  // Generation, in a layout [T][layer][N][H] padded: token stride
  // kLayers * N * (H * d + 8), sequence stride H * d + 8, head stride d.
  const int64_t head_stride = kD, seq_stride = kKV * kD + 8;
  const int64_t token_stride = kLayers * N * seq_stride;
  for (uint32_t step = 0, made = 0; made < 300; ++step) {
    const uint32_t T = step % 5 == 4 ? 3 : 1;  // now and then three tokens (speculative decoding)
    std::vector<std::vector<float>> k(N), v(N);
    for (uint32_t i = 0; i < N; ++i) gens[i].next(T * kLayers, &k[i], &v[i]);
    std::vector<float> kb(static_cast<size_t>(T) * token_stride, 0.f), vb(kb.size(), 0.f);
    for (uint32_t t = 0; t < T; ++t)
      for (uint32_t l = 0; l < kLayers; ++l)
        for (uint32_t i = 0; i < N; ++i)
          for (uint32_t h = 0; h < kKV; ++h)
            for (uint32_t x = 0; x < kD; ++x) {
              const size_t dst = t * token_stride + (l * N + i) * seq_stride + h * head_stride + x;
              const size_t src = ((static_cast<size_t>(l) * T + t) * kKV + h) * kD + x;
              kb[dst] = k[i][src];
              vb[dst] = v[i][src];
            }
    const auto kp = pack(dtype, kb), vp = pack(dtype, vb);
    for (uint32_t l = 0; l < kLayers; ++l) {
      const size_t at = static_cast<size_t>(l) * N * seq_stride * esz;
      ASSERT_EQ(wkv_append_batch(bh.data(), N, l, kp.data() + at, vp.data() + at, T, seq_stride, token_stride,
                                 head_stride, nullptr),
                WKV_OK)
          << wkv_last_error();
      for (uint32_t i = 0; i < N; ++i) {
        const size_t off = at + static_cast<size_t>(i) * seq_stride * esz;
        ASSERT_EQ(wkv_seq_append(sh[i], l, kp.data() + off, vp.data() + off, T, token_stride, head_stride, nullptr),
                  WKV_OK);
      }
    }
    made += T;
    if (step % 7 == 0 || made >= 300)
      for (uint32_t l = 0; l < kLayers; ++l) {
        const auto q = queries(qgen, N, dtype);
        ASSERT_EQ(decode(bp.get(), bh, l, q, dtype), decode(sp.get(), sh, l, q, dtype)) << "step " << step;
      }
  }
  for (uint32_t i = 0; i < N; ++i)
    for (uint32_t l = 0; l < kLayers; ++l) {
      expect_same_info(bs[i], ss[i], l);
      EXPECT_GE(info(bs[i], l).segments, 2u + 4u) << "the generation grew the index";
    }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, AppendBatch, ::testing::Values(WKV_DTYPE_F16, WKV_DTYPE_F32));

// Every misuse is refused with its code and message, and no sequence
// changes.
TEST(AppendBatchMisuse, IsRefusedAndChangesNothing) {
  const uint32_t dtype = WKV_DTYPE_F32;
  const wkv_config c = batch_config(dtype);
  wavekv::Engine e(c), other(c);
  wavekv::Sequence a(e), b(e), foreign(other);
  std::vector<KeyGen> gens{KeyGen(kKV, kD, 1), KeyGen(kKV, kD, 2)};
  const Batch prompt = make_batch(gens, 700, dtype);
  wkv_seq *ab[] = {a.get(), b.get()};
  ASSERT_EQ(wkv_append_batch(ab, 2, 0, prompt.k.data(), prompt.v.data(), 700, 0, 0, 0, nullptr), WKV_OK);
  const Batch one = make_batch(gens, 1, dtype);
  const void *k = one.k.data(), *v = one.v.data();

  wkv_seq *dup[] = {a.get(), a.get()};
  wkv_seq *mixed[] = {a.get(), foreign.get()};
  wkv_seq *with_null[] = {a.get(), nullptr};
  wkv_seq *dead = nullptr;
  ASSERT_EQ(wkv_seq_create(e.get(), &dead), WKV_OK);
  wkv_seq_destroy(dead);
  wkv_seq *with_dead[] = {a.get(), dead};
  struct Case {
    const char *what;
    int rc;
    int want;
    const char *says;
  } cases[] = {
      {"seqs NULL", wkv_append_batch(nullptr, 2, 0, k, v, 1, 0, 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT, "seqs"},
      {"n_seqs 0", wkv_append_batch(ab, 0, 0, k, v, 1, 0, 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT, "n_seqs"},
      {"listed twice", wkv_append_batch(dup, 2, 0, k, v, 1, 0, 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT, "twice"},
      {"two engines", wkv_append_batch(mixed, 2, 0, k, v, 1, 0, 0, 0, nullptr), WKV_ERR_INVALID_HANDLE,
       "another engine"},
      {"a null handle", wkv_append_batch(with_null, 2, 0, k, v, 1, 0, 0, 0, nullptr), WKV_ERR_INVALID_HANDLE, ""},
      {"a destroyed one", wkv_append_batch(with_dead, 2, 0, k, v, 1, 0, 0, 0, nullptr), WKV_ERR_INVALID_HANDLE, ""},
      {"layer", wkv_append_batch(ab, 2, kLayers, k, v, 1, 0, 0, 0, nullptr), WKV_ERR_OUT_OF_RANGE, "layer"},
      {"k NULL", wkv_append_batch(ab, 2, 0, nullptr, v, 1, 0, 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT, "k is NULL"},
      {"v NULL", wkv_append_batch(ab, 2, 0, k, nullptr, 1, 0, 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT, "v is NULL"},
      {"n_tokens 0", wkv_append_batch(ab, 2, 0, k, v, 0, 0, 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT, "n_tokens"},
      {"negative seq_stride", wkv_append_batch(ab, 2, 0, k, v, 1, -1, 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT,
       "negative"},
      {"overlapping heads", wkv_append_batch(ab, 2, 0, k, v, 1, 0, 0, kD - 1, nullptr), WKV_ERR_INVALID_ARGUMENT,
       ""},
      {"beyond 2^63", wkv_append_batch(ab, 2, 0, k, v, 1, INT64_MAX / 2, 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT,
       "too large"},
      {"misaligned k", wkv_append_batch(ab, 2, 0, static_cast<const uint8_t *>(k) + 1, v, 1, 0, 0, 0, nullptr),
       WKV_ERR_INVALID_ARGUMENT, "aligned"},
  };
  for (const Case &cs : cases) {
    EXPECT_EQ(cs.rc, cs.want) << cs.what;
  }
  // Messages (the last call's only): one more time for a few.
  EXPECT_EQ(wkv_append_batch(dup, 2, 0, k, v, 1, 0, 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::strstr(wkv_last_error(), "wkv_append_batch"), nullptr) << wkv_last_error();
  EXPECT_NE(std::strstr(wkv_last_error(), "twice"), nullptr) << wkv_last_error();
  EXPECT_EQ(wkv_append_batch(mixed, 2, 0, k, v, 1, 0, 0, 0, nullptr), WKV_ERR_INVALID_HANDLE);
  EXPECT_NE(std::strstr(wkv_last_error(), "sequence 1"), nullptr) << wkv_last_error();
  EXPECT_EQ(wkv_append_batch(ab, 2, 0, k, v, 1, -4, 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::strstr(wkv_last_error(), "seq_stride"), nullptr) << wkv_last_error();

  EXPECT_EQ(info(a, 0).tokens, 700u);
  EXPECT_EQ(info(b, 0).tokens, 700u);
  EXPECT_EQ(info(foreign, 0).tokens, 0u);
  // And the engine goes on.
  ASSERT_EQ(wkv_append_batch(ab, 2, 0, k, v, 1, 0, 0, 0, nullptr), WKV_OK) << wkv_last_error();
  EXPECT_EQ(info(a, 0).tokens, 701u);
  EXPECT_EQ(info(b, 0).tokens, 701u);
}

// A growth refused in each sequence of a batch in turn: the sequences
// before the one the message names hold the token, that one and those after
// it do not; every sequence still decodes exactly, and appending the missing
// tokens again works. Engine memory refused while making room for the rows
// (before the copy) appends nothing to any sequence.
TEST(AppendBatchFaults, AFailureMidBatchLeavesWhatTheHeaderSays) {
  constexpr uint32_t N = 3;
  wkv_config c = batch_config(WKV_DTYPE_F32);
  c.n_layers = 1;
  c.retrieval_frac = 1.0f;
  c.estimation_frac = 0.0f;
  for (uint32_t skip = 0; skip < N; ++skip) {
    std::shared_ptr<wkv::Engine> e;
    ASSERT_TRUE(wkv::Engine::open(&c, &e).is_ok());
    e->set_growth_lag(0);  // the growth, and its failure, in the append that completes the segment
    std::vector<std::shared_ptr<wkv::Sequence>> seqs(N);
    std::vector<wkv::Sequence *> raw;
    std::vector<std::vector<HeadRows>> rows(N, std::vector<HeadRows>(kKV));
    std::vector<KeyGen> gens;
    for (uint32_t i = 0; i < N; ++i) {
      ASSERT_TRUE(wkv::Sequence::create(e, &seqs[i]).is_ok());
      raw.push_back(seqs[i].get());
      gens.emplace_back(kKV, kD, 40 + i);
    }
    auto append = [&](uint32_t first, uint32_t n, uint32_t T) {
      std::vector<float> k, v;
      for (uint32_t i = first; i < first + n; ++i) gens[i].next(T, &k, &v);
      const wkv::Status st = e->append_batch(raw.data() + first, n, 0, reinterpret_cast<const uint8_t *>(k.data()),
                                             reinterpret_cast<const uint8_t *>(v.data()), T, T * kKV * kD, kKV * kD,
                                             kD, nullptr, "test");
      e->faults().arm(wkv::FaultInjector::kGrowth, 0);
      e->faults().arm(wkv::FaultInjector::kEngineAlloc, 0);
      // The mirror follows the sequences that hold the tokens now.
      for (uint32_t i = first; i < first + n; ++i) {
        if (seqs[i]->layer(0).tokens != rows[i][0].tokens(kD) + T) continue;
        for (uint32_t t = 0; t < T; ++t)
          for (uint32_t h = 0; h < kKV; ++h) {
            const size_t off = ((static_cast<size_t>(i - first) * T + t) * kKV + h) * kD;
            rows[i][h].k.insert(rows[i][h].k.end(), k.begin() + off, k.begin() + off + kD);
            rows[i][h].v.insert(rows[i][h].v.end(), v.begin() + off, v.begin() + off + kD);
          }
      }
      return st;
    };
    // The first append makes room in fresh sequences (sink and tail, K and
    // V: four regions each): refused at sequence `skip`'s, nothing is
    // appended anywhere.
    e->faults().arm(wkv::FaultInjector::kEngineAlloc, 1, 4 * skip + 2);
    wkv::Status st = append(0, N, 600);
    EXPECT_EQ(st.code(), WKV_ERR_OUT_OF_MEMORY) << st.message();
    for (uint32_t i = 0; i < N; ++i) EXPECT_EQ(seqs[i]->layer(0).tokens, 0u) << "skip " << skip;
    // A prompt, then generated tokens up to one short of a growth in every
    // sequence: the next token makes each of them grow.
    ASSERT_TRUE(append(0, N, 600).is_ok());
    for (uint32_t i = 0; i < N; ++i) ASSERT_TRUE(e->end_prompt(*seqs[i], 0, nullptr).is_ok());
    while (seqs[0]->layer(0).tokens - seqs[0]->layer(0).tail_begin < c.window_tokens + c.update_segment_tokens - 1)
      ASSERT_TRUE(append(0, N, 1).is_ok());
    std::vector<uint64_t> before(N);
    for (uint32_t i = 0; i < N; ++i) before[i] = seqs[i]->layer(0).tokens;
    e->faults().arm(wkv::FaultInjector::kGrowth, 1, skip);
    st = append(0, N, 1);
    EXPECT_EQ(st.code(), WKV_ERR_OUT_OF_MEMORY) << st.message();
    for (uint32_t i = 0; i < N; ++i)
      EXPECT_EQ(seqs[i]->layer(0).tokens, before[i] + (i < skip ? 1 : 0)) << "skip " << skip << " sequence " << i;
    if (skip > 0) {
      EXPECT_NE(st.message().find(wkv::format("sequence %u:", skip)), std::string::npos) << st.message();
    }
    // Exact decoding of every sequence, then the missing tokens again.
    for (uint32_t i = 0; i < N; ++i)
      EXPECT_LT(decode_error(e, seqs[i], rows[i], gens[i], kQ, kD), 1e-5) << "skip " << skip << " sequence " << i;
    ASSERT_TRUE(append(skip, N - skip, 1).is_ok());
    for (uint32_t i = 0; i < N; ++i) {
      EXPECT_EQ(seqs[i]->layer(0).tokens, before[i] + 1);
      EXPECT_EQ(seqs[i]->layer(0).heads[0].segments.size(), 2u + 1u) << "the prompt's two and the growth";
    }
  }
}

// A tail sized for a whole prompt gives its room back once the prompt is
// clustered (it used to keep it for the sequence's life: 512 MiB per layer
// of a 128K-token prompt at 8 KV heads), and decoding stays exact across
// the move and the growths after it.
TEST(AppendBatchTails, APromptsTailIsTrimmedWhenItEnds) {
  wkv_config c = batch_config(WKV_DTYPE_F32);
  c.n_layers = 1;
  c.retrieval_frac = 1.0f;
  c.estimation_frac = 0.0f;
  std::shared_ptr<wkv::Engine> e;
  ASSERT_TRUE(wkv::Engine::open(&c, &e).is_ok());
  std::shared_ptr<wkv::Sequence> seq;
  ASSERT_TRUE(wkv::Sequence::create(e, &seq).is_ok());
  std::vector<HeadRows> rows(kKV);
  KeyGen gen(kKV, kD, 77);
  auto append = [&](uint32_t n) {
    std::vector<float> k, v;
    gen.next(n, &k, &v);
    wkv::Sequence *s = seq.get();
    ASSERT_TRUE(e->append_batch(&s, 1, 0, reinterpret_cast<const uint8_t *>(k.data()),
                                reinterpret_cast<const uint8_t *>(v.data()), n, 0, kKV * kD, kD, nullptr, "test")
                    .is_ok());
    for (uint32_t t = 0; t < n; ++t)
      for (uint32_t h = 0; h < kKV; ++h) {
        const size_t off = (static_cast<size_t>(t) * kKV + h) * kD;
        rows[h].k.insert(rows[h].k.end(), k.begin() + off, k.begin() + off + kD);
        rows[h].v.insert(rows[h].v.end(), v.begin() + off, v.begin() + off + kD);
      }
  };
  auto worst_error = [&] { return decode_error(e, seq, rows, gen, kQ, kD); };
  append(6000);
  const uint64_t min_rows = c.window_tokens + c.update_segment_tokens + 1;
  EXPECT_GE(seq->layer(0).heads[0].tail.cap, 6000u - c.sink_tokens) << "the prompt's rows";
  ASSERT_TRUE(e->end_prompt(*seq, 0, nullptr).is_ok());
  for (const wkv::HeadState &h : seq->layer(0).heads) {
    EXPECT_EQ(h.tail.n, c.window_tokens);
    EXPECT_LT(h.tail.cap, 4 * min_rows) << "the prompt's room given back";
  }
  EXPECT_LT(worst_error(), 1e-5);
  for (int i = 0; i < 300; ++i) append(1);  // crosses a growth of 64
  EXPECT_GE(seq->layer(0).heads[0].segments.size(), 2u + 1u);
  for (const wkv::HeadState &h : seq->layer(0).heads) EXPECT_LT(h.tail.cap, 4 * min_rows);
  EXPECT_LT(worst_error(), 1e-5);
}

// A batch that fails after moving a sequence's tail to a larger region (a
// later sequence refused its room) appends nothing, and the plan looked up
// before is refused: its run table names the old region, freed once its
// step ended. (It used to pass the version check and read freed memory.)
TEST(AppendBatchFaults, AFailedBatchThatMovedRowsInvalidatesEarlierPlans) {
  wkv_config c = batch_config(WKV_DTYPE_F32);
  c.n_layers = 1;
  std::shared_ptr<wkv::Engine> e;
  ASSERT_TRUE(wkv::Engine::open(&c, &e).is_ok());
  std::shared_ptr<wkv::Sequence> a, fresh;
  ASSERT_TRUE(wkv::Sequence::create(e, &a).is_ok());
  ASSERT_TRUE(wkv::Sequence::create(e, &fresh).is_ok());
  KeyGen gen(kKV, kD, 91);
  auto tokens = [&](uint32_t n, uint32_t seqs, std::vector<float> *k, std::vector<float> *v) {
    for (uint32_t i = 0; i < seqs; ++i) gen.next(n, k, v);
  };
  std::vector<float> k, v;
  tokens(600, 1, &k, &v);
  wkv::Sequence *one = a.get();
  ASSERT_TRUE(e->append_batch(&one, 1, 0, reinterpret_cast<const uint8_t *>(k.data()),
                              reinterpret_cast<const uint8_t *>(v.data()), 600, 0, 0, 0, nullptr, "test")
                  .is_ok());
  ASSERT_TRUE(e->end_prompt(*a, 0, nullptr).is_ok());
  const wkv::Rows &tail = a->layer(0).heads[0].tail;
  const uint32_t fill = static_cast<uint32_t>(tail.cap - tail.begin - tail.n) + 1;  // one more than fits: a move

  std::shared_ptr<wkv::StepTracker> t;
  ASSERT_TRUE(e->buffers().new_tracker(&t).is_ok());
  wkv::Plan plan(e, t);
  std::vector<float> q;
  for (uint32_t h = 0; h < kKV; ++h) gen.query(h, kQ / kKV, &q);
  ASSERT_TRUE(e->lookup(plan, &a, 1, 0, q.data(), kQ * kD, kD, nullptr).is_ok());

  const uint8_t *before = tail.k.p;
  const uint64_t tokens_before = a->layer(0).tokens;
  k.clear();
  v.clear();
  tokens(fill, 2, &k, &v);
  wkv::Sequence *both[] = {a.get(), fresh.get()};
  // a's tail moves (two regions per head), then the fresh sequence's first
  // region is refused.
  e->faults().arm(wkv::FaultInjector::kEngineAlloc, 1, 2 * kKV);
  const wkv::Status st = e->append_batch(both, 2, 0, reinterpret_cast<const uint8_t *>(k.data()),
                                         reinterpret_cast<const uint8_t *>(v.data()), fill, 0, 0, 0, nullptr, "test");
  e->faults().arm(wkv::FaultInjector::kEngineAlloc, 0);
  EXPECT_EQ(st.code(), WKV_ERR_OUT_OF_MEMORY) << st.message();
  EXPECT_NE(tail.k.p, before) << "the tail moved";
  EXPECT_EQ(a->layer(0).tokens, tokens_before);
  EXPECT_EQ(fresh->layer(0).tokens, 0u);
  const wkv::Status as = e->assemble(plan, nullptr);
  EXPECT_EQ(as.code(), WKV_ERR_STATE) << as.message();
  // Looked up again, the step reads the new region.
  ASSERT_TRUE(e->lookup(plan, &a, 1, 0, q.data(), kQ * kD, kD, nullptr).is_ok());
  EXPECT_TRUE(e->assemble(plan, nullptr).is_ok());
}

namespace {

// One decoding step of layer 0 of `seq` for the query q (f32 engines).
std::vector<float> decode_one(const std::shared_ptr<wkv::Engine> &e, std::shared_ptr<wkv::Sequence> &seq,
                              const std::vector<float> &q) {
  std::shared_ptr<wkv::StepTracker> t;
  EXPECT_TRUE(e->buffers().new_tracker(&t).is_ok());
  wkv::Plan plan(e, t);
  std::vector<float> out(q.size());
  wkv::Status st = e->lookup(plan, &seq, 1, 0, q.data(), kQ * kD, kD, nullptr);
  if (st.is_ok()) st = e->assemble(plan, nullptr);
  if (st.is_ok()) st = e->attend(plan, out.data(), kQ * kD, kD, nullptr, nullptr);
  EXPECT_TRUE(st.is_ok()) << st.message();
  return out;
}

}  // namespace

// A generated segment's growth committed growth_lag tokens after the
// append that completes it (as on a device, whose k-means runs beside the
// decoding steps): until then the segment stays in the steady zone and
// decoding is exact over it; once it commits, the index and every decoding
// output are those of an engine that committed at once, bit for bit. A
// commit that fails fails its append (nothing appended, the growth
// dropped); the append of the same tokens again begins the growth anew and,
// its commit point reached, commits it at once with the same clusters. A
// sequence destroyed with a growth pending frees everything (ASan).
TEST(GrowthLag, CommitsLaterWithTheSameClustersAndExactDecodingMeanwhile) {
  wkv_config c = batch_config(WKV_DTYPE_F32);
  c.n_layers = 1;
  constexpr uint32_t kLag = 5;
  std::shared_ptr<wkv::Engine> now, later;
  ASSERT_TRUE(wkv::Engine::open(&c, &now).is_ok());
  ASSERT_TRUE(wkv::Engine::open(&c, &later).is_ok());
  now->set_growth_lag(0);
  later->set_growth_lag(kLag);
  std::shared_ptr<wkv::Sequence> a, b, dropped;
  ASSERT_TRUE(wkv::Sequence::create(now, &a).is_ok());
  ASSERT_TRUE(wkv::Sequence::create(later, &b).is_ok());
  ASSERT_TRUE(wkv::Sequence::create(later, &dropped).is_ok());
  KeyGen gen(kKV, kD, 77), qgen(kKV, kD, 78);
  bool fail_next_commit = true;
  uint32_t deferred = 0, failed = 0;
  auto append = [&](uint32_t T) {
    std::vector<float> k, v;
    gen.next(T, &k, &v);
    const auto *kp = reinterpret_cast<const uint8_t *>(k.data());
    const auto *vp = reinterpret_cast<const uint8_t *>(v.data());
    ASSERT_TRUE(now->append(*a, 0, kp, vp, T, kKV * kD, kD, nullptr).is_ok());
    ASSERT_TRUE(later->append(*dropped, 0, kp, vp, T, kKV * kD, kD, nullptr).is_ok());
    const bool commits = b->layer(0).pending && b->layer(0).tokens + T >= b->layer(0).pending->commit_at;
    if (commits && fail_next_commit) {
      // The commit fails: this append appends nothing, the growth is
      // dropped, and the same tokens go in again.
      fail_next_commit = false;
      const uint64_t before = b->layer(0).tokens, segs = b->layer(0).heads[0].segments.size();
      later->faults().arm(wkv::FaultInjector::kGrowth, 1);
      const wkv::Status st = later->append(*b, 0, kp, vp, T, kKV * kD, kD, nullptr);
      later->faults().arm(wkv::FaultInjector::kGrowth, 0);
      EXPECT_EQ(st.code(), WKV_ERR_OUT_OF_MEMORY) << st.message();
      EXPECT_EQ(b->layer(0).tokens, before);
      EXPECT_EQ(b->layer(0).heads[0].segments.size(), segs);
      EXPECT_FALSE(b->layer(0).pending) << "the failed growth is dropped";
      ++failed;
    }
    ASSERT_TRUE(later->append(*b, 0, kp, vp, T, kKV * kD, kD, nullptr).is_ok());
  };
  append(600);
  ASSERT_TRUE(now->end_prompt(*a, 0, nullptr).is_ok());
  ASSERT_TRUE(later->end_prompt(*b, 0, nullptr).is_ok());
  ASSERT_TRUE(later->end_prompt(*dropped, 0, nullptr).is_ok());
  for (uint32_t step = 0; step < 400; ++step) {
    append(1);
    const wkv::LayerState &La = a->layer(0), &Lb = b->layer(0);
    ASSERT_EQ(La.tokens, Lb.tokens);
    if (Lb.pending) {
      ++deferred;
      EXPECT_EQ(Lb.heads[0].segments.size() + 1, La.heads[0].segments.size()) << "step " << step;
      EXPECT_LT(Lb.tokens, Lb.pending->commit_at);
      // The pending segment is still in the tail, the steady zone, which
      // decoding attends exactly.
      for (uint32_t h = 0; h < kKV; ++h)
        EXPECT_EQ(Lb.heads[h].tail.n, La.heads[h].tail.n + c.update_segment_tokens) << "step " << step;
      std::vector<float> q;
      for (uint32_t h = 0; h < kKV; ++h) qgen.query(h, kQ / kKV, &q);
      for (float x : decode_one(later, b, q)) ASSERT_TRUE(std::isfinite(x)) << "step " << step;
      continue;
    }
    ASSERT_EQ(La.heads[0].segments.size(), Lb.heads[0].segments.size()) << "step " << step;
    for (uint32_t h = 0; h < kKV; ++h) {
      const wkv::HeadState &x = La.heads[h], &y = Lb.heads[h];
      ASSERT_EQ(x.map.size, y.map.size) << "step " << step;
      ASSERT_EQ(x.map.first_slot, y.map.first_slot) << "step " << step;
      ASSERT_EQ(x.tail.n, y.tail.n);
    }
    std::vector<float> q;
    for (uint32_t h = 0; h < kKV; ++h) qgen.query(h, kQ / kKV, &q);
    ASSERT_EQ(decode_one(now, a, q), decode_one(later, b, q)) << "step " << step;
  }
  EXPECT_GE(a->layer(0).heads[0].segments.size(), 2u + 5u) << "the generation grew the index";
  EXPECT_GT(deferred, 0u);
  EXPECT_EQ(failed, 1u);
  // b's growths and dropped's, each deferred once: the failed one, begun
  // again past its commit point, committed at once.
  const auto grown = [](const std::shared_ptr<wkv::Sequence> &s) {
    return s->layer(0).heads[0].segments.size() - 2 + (s->layer(0).pending ? 1 : 0);
  };
  EXPECT_EQ(later->counters().growths_deferred.load(), grown(b) + grown(dropped));
  // A sequence destroyed with its growth pending.
  while (!dropped->layer(0).pending) append(1);
  dropped.reset();
  EXPECT_EQ(later->counters().growth_waits.load(), 0u) << "the CPU's k-means is done when begun";
}

// commit_is_quiet, which lets an append end its steps with its copies (a
// CUDA engine's one launch for both): it says "quiet" exactly where the
// append then begins no growth and commits none, over a prompt appended in
// pieces, its end, and generated tokens across growths with a lag.
TEST(GrowthLag, AQuietCommitIsOneThatBeginsAndCommitsNothing) {
  wkv_config c = batch_config(WKV_DTYPE_F32);
  c.n_layers = 1;
  std::shared_ptr<wkv::Engine> e;
  ASSERT_TRUE(wkv::Engine::open(&c, &e).is_ok());
  e->set_growth_lag(5);
  std::shared_ptr<wkv::Sequence> s;
  ASSERT_TRUE(wkv::Sequence::create(e, &s).is_ok());
  KeyGen gen(kKV, kD, 91);
  uint32_t quiet = 0, loud = 0;
  auto append = [&](uint32_t T) {
    std::vector<float> k, v;
    gen.next(T, &k, &v);
    wkv::LayerState &L = s->layer(0);
    const wkv::IndexContext ix = e->index();
    wkv::StagedAppend sa;
    ASSERT_TRUE(wkv::stage_append(ix, L, T, &sa, nullptr).is_ok());  // the append stages again: room is there
    const bool predicted = wkv::commit_is_quiet(ix, L, sa);
    const wkv::PendingGrowth *pending = L.pending.get();
    const size_t segments = L.heads[0].segments.size();
    const uint64_t deferred = e->counters().growths_deferred.load();
    ASSERT_TRUE(e->append(*s, 0, reinterpret_cast<const uint8_t *>(k.data()),
                          reinterpret_cast<const uint8_t *>(v.data()), T, kKV * kD, kD, nullptr)
                    .is_ok());
    const bool observed = L.pending.get() == pending && L.heads[0].segments.size() == segments &&
                          e->counters().growths_deferred.load() == deferred;
    EXPECT_EQ(predicted, observed) << "an append of " << T << " at " << L.tokens << " tokens";
    ++(observed ? quiet : loud);
  };
  for (uint32_t part = 0; part < 6; ++part) append(250);
  ASSERT_TRUE(e->end_prompt(*s, 0, nullptr).is_ok());
  for (uint32_t step = 0; step < 300; ++step) append(step % 7 == 3 ? 3 : 1);
  EXPECT_GT(loud, 4u) << "growths began and committed";
  EXPECT_GT(quiet, 200u);
}
