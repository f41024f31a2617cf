// Misuse of the C ABI never crashes and loses nothing, as a caller trying it
// found it would (the hardening issue's findings 1 to 6; the settings of
// finding 4 are tests/test_config.cpp's): destroyed, foreign and mistyped
// handles are refused even after their memory and slots are reused;
// allocations that cannot be served are statuses, not aborts; valid but
// degenerate input is not undefined behaviour (the sanitizer builds check);
// a refused verb leaves the plan holding no step; strides whose extent
// overflows are refused.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "support.hpp"
#include "wavekv/wavekv.h"

using namespace wkvtest;

namespace {

constexpr uint32_t kQ = 4, kKV = 2, kD = 64;

wkv_config config(uint32_t sink = 4) {
  wkv_config c;
  wkv_config_init(&c);
  c.n_layers = 1;
  c.n_q_heads = kQ;
  c.n_kv_heads = kKV;
  c.head_dim = kD;
  c.dtype = WKV_DTYPE_F32;
  c.segment_tokens = 256;
  c.update_segment_tokens = 128;
  c.sink_tokens = sink;
  c.threads = 1;
  return c;
}

struct Open {
  wkv_engine *e = nullptr;
  explicit Open(const wkv_config &c) { EXPECT_EQ(wkv_engine_open(&c, &e), WKV_OK) << wkv_last_error(); }
  ~Open() { wkv_engine_close(e); }
};

// n tokens of random K and V, packed [n][kKV][kD] f32.
std::vector<float> tokens(uint32_t n, uint32_t seed) {
  std::vector<float> x(static_cast<size_t>(n) * kKV * kD);
  uint32_t s = seed * 2654435761u + 1;
  for (float &v : x) {
    s = s * 1664525u + 1013904223u;
    v = static_cast<float>(s >> 8) / 16777216.0f - 0.5f;
  }
  return x;
}

uint64_t tokens_of(wkv_seq *s) {
  wkv_seq_info info;
  wkv_seq_info_init(&info);
  EXPECT_EQ(wkv_seq_info_get(s, 0, &info), WKV_OK) << wkv_last_error();
  return info.tokens;
}

}  // namespace

// Finding 1: the handle check read a freed handle's magic word; once a new
// sequence reused the address (about 250 cycles), an append through the
// destroyed handle wrote into the other sequence.
TEST(Misuse, ADestroyedHandleIsRefusedEvenAfterItsSlotIsReused) {
  Open o(config());
  const std::vector<float> kv = tokens(8, 1);
  wkv_seq *dead = nullptr;
  ASSERT_EQ(wkv_seq_create(o.e, &dead), WKV_OK);
  wkv_seq_destroy(dead);
  wkv_seq *live = nullptr;
  for (int i = 0; i < 300; ++i) {
    ASSERT_EQ(wkv_seq_create(o.e, &live), WKV_OK);
    if (i + 1 < 300) wkv_seq_destroy(live);
  }
  EXPECT_EQ(wkv_seq_append(dead, 0, kv.data(), kv.data(), 8, 0, 0, nullptr), WKV_ERR_INVALID_HANDLE);
  EXPECT_NE(std::string(wkv_last_error()).find("not a live wkv_seq"), std::string::npos) << wkv_last_error();
  EXPECT_EQ(tokens_of(live), 0u) << "nothing was written into the live sequence";
  wkv_seq_info info;
  wkv_seq_info_init(&info);
  EXPECT_EQ(wkv_seq_info_get(dead, 0, &info), WKV_ERR_INVALID_HANDLE);
  wkv_seq_destroy(dead);  // destroying twice is a no-op
  wkv_seq_destroy(dead);
  EXPECT_EQ(wkv_seq_append(live, 0, kv.data(), kv.data(), 8, 0, 0, nullptr), WKV_OK) << wkv_last_error();
  EXPECT_EQ(tokens_of(live), 8u);
  wkv_seq_destroy(live);
}

// Handles do not cross a fork: a child has none of its parent's engine
// threads. There every call with a parent's handle is WKV_ERR_STATE, and
// destroying them (as a child's exit does through a binding's finalizers)
// returns at once; it used to wait forever for the threads. A child opens
// and uses an engine of its own, and the parent's engine goes on.
TEST(Misuse, HandlesDoNotCrossAFork) {
  wkv_config c = config();
  c.threads = 2;
  Open o(c);
  const std::vector<float> kv = tokens(600, 5), q = tokens(2, 6);
  std::vector<float> out(kQ * kD);
  wkv_seq *s = nullptr;
  wkv_plan *p = nullptr;
  ASSERT_EQ(wkv_seq_create(o.e, &s), WKV_OK);
  ASSERT_EQ(wkv_seq_append(s, 0, kv.data(), kv.data(), 600, 0, 0, nullptr), WKV_OK) << wkv_last_error();
  ASSERT_EQ(wkv_plan_create(o.e, &p), WKV_OK);
  ASSERT_EQ(wkv_decode(p, &s, 1, 0, q.data(), 0, 0, out.data(), 0, 0, nullptr), WKV_OK) << wkv_last_error();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(60);  // a hang ends the child with SIGALRM, which the parent reports
    int bad = 0;
    bad += wkv_seq_append(s, 0, kv.data(), kv.data(), 8, 0, 0, nullptr) != WKV_ERR_STATE;
    bad += std::string(wkv_last_error()).find("another process") == std::string::npos;
    bad += wkv_decode(p, &s, 1, 0, q.data(), 0, 0, out.data(), 0, 0, nullptr) != WKV_ERR_STATE;
    wkv_stats st;
    wkv_stats_init(&st);
    bad += wkv_engine_stats(o.e, &st) != WKV_ERR_STATE;
    wkv_plan_destroy(p);
    wkv_seq_destroy(s);
    wkv_engine_close(o.e);
    bad += wkv_engine_stats(o.e, &st) != WKV_ERR_INVALID_HANDLE;  // closed: the handle is gone
#if !defined(__SANITIZE_THREAD__)  // (TSan ends a child that starts threads after a fork)
    wkv_engine *mine = nullptr;
    wkv_seq *ms = nullptr;
    wkv_plan *mp = nullptr;
    bad += wkv_engine_open(&c, &mine) != WKV_OK;
    bad += wkv_seq_create(mine, &ms) != WKV_OK;
    bad += wkv_seq_append(ms, 0, kv.data(), kv.data(), 600, 0, 0, nullptr) != WKV_OK;
    bad += wkv_plan_create(mine, &mp) != WKV_OK;
    bad += wkv_decode(mp, &ms, 1, 0, q.data(), 0, 0, out.data(), 0, 0, nullptr) != WKV_OK;
    wkv_plan_destroy(mp);
    wkv_seq_destroy(ms);
    wkv_engine_close(mine);
#endif
    _exit(bad == 0 ? 0 : 10 + bad);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child ended by signal " << WTERMSIG(status) << " (14: it hung)";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "10 + the number of checks that failed in the child";
  EXPECT_EQ(wkv_seq_append(s, 0, kv.data(), kv.data(), 8, 0, 0, nullptr), WKV_OK) << wkv_last_error();
  EXPECT_EQ(tokens_of(s), 608u);
  EXPECT_EQ(wkv_decode(p, &s, 1, 0, q.data(), 0, 0, out.data(), 0, 0, nullptr), WKV_OK) << wkv_last_error();
  wkv_plan_destroy(p);
  wkv_seq_destroy(s);
}

// A NaN or an infinity in a key, a value or a query is refused on a CPU
// engine, nothing appended: one NaN key used to reach its cluster's
// centroid and turn every later output of its head into zeros (lse -inf),
// silently. Finite extremes are taken.
TEST(Misuse, NonFiniteInputIsRefusedAndNothingIsStored) {
  Open o(config());
  std::vector<float> kv = tokens(600, 7), q = tokens(2, 8);
  std::vector<float> out(kQ * kD), clean(kQ * kD);
  wkv_seq *s = nullptr;
  wkv_plan *p = nullptr;
  ASSERT_EQ(wkv_seq_create(o.e, &s), WKV_OK);
  ASSERT_EQ(wkv_plan_create(o.e, &p), WKV_OK);
  ASSERT_EQ(wkv_seq_append(s, 0, kv.data(), kv.data(), 300, 0, 0, nullptr), WKV_OK) << wkv_last_error();
  ASSERT_EQ(wkv_decode(p, &s, 1, 0, q.data(), 0, 0, clean.data(), 0, 0, nullptr), WKV_OK) << wkv_last_error();
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  for (float x : bad) {
    std::vector<float> k = kv, v = kv;
    k[(299 * kKV + 1) * kD + 5] = x;  // the last token's second head
    EXPECT_EQ(wkv_seq_append(s, 0, k.data(), kv.data(), 300, 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(wkv_last_error()).find("k holds a NaN or an infinity (sequence 0, token 299, head 1)"),
              std::string::npos)
        << wkv_last_error();
    v[7] = x;
    EXPECT_EQ(wkv_seq_append(s, 0, kv.data(), v.data(), 1, 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT);
    wkv_seq *batch[] = {s};
    EXPECT_EQ(wkv_append_batch(batch, 1, 0, k.data(), kv.data(), 300, 0, 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(tokens_of(s), 300u) << "nothing appended";
    std::vector<float> qb = q;
    qb[3 * kD + 1] = x;
    EXPECT_EQ(wkv_decode(p, &s, 1, 0, qb.data(), 0, 0, out.data(), 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(wkv_last_error()).find("q holds a NaN"), std::string::npos) << wkv_last_error();
    EXPECT_EQ(wkv_lookup(p, &s, 1, 0, qb.data(), 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT);
  }
  ASSERT_EQ(wkv_decode(p, &s, 1, 0, q.data(), 0, 0, out.data(), 0, 0, nullptr), WKV_OK) << wkv_last_error();
  EXPECT_EQ(out, clean) << "the sequence decodes as before the refused calls";
  std::vector<float> big = kv;
  big[0] = std::numeric_limits<float>::max();
  EXPECT_EQ(wkv_seq_append(s, 0, big.data(), kv.data(), 1, 0, 0, nullptr), WKV_OK) << "finite, if extreme";
  wkv_plan_destroy(p);
  wkv_seq_destroy(s);
}

TEST(Misuse, ADestroyedPlanIsRefusedNotAnsweredWithAnotherPlansStep) {
  Open o(config());
  const std::vector<float> kv = tokens(300, 2), q = tokens(2, 3);
  wkv_seq *s = nullptr;
  ASSERT_EQ(wkv_seq_create(o.e, &s), WKV_OK);
  ASSERT_EQ(wkv_seq_append(s, 0, kv.data(), kv.data(), 300, 0, 0, nullptr), WKV_OK);
  wkv_plan *dead = nullptr, *live = nullptr;
  ASSERT_EQ(wkv_plan_create(o.e, &dead), WKV_OK);
  wkv_plan_destroy(dead);
  ASSERT_EQ(wkv_plan_create(o.e, &live), WKV_OK);
  std::vector<float> out(kQ * kD);
  ASSERT_EQ(wkv_decode(live, &s, 1, 0, q.data(), 0, 0, out.data(), 0, 0, nullptr), WKV_OK) << wkv_last_error();
  EXPECT_EQ(wkv_attend(dead, out.data(), 0, 0, nullptr, nullptr), WKV_ERR_INVALID_HANDLE);
  EXPECT_EQ(wkv_update(dead, nullptr), WKV_ERR_INVALID_HANDLE);
  wkv_plan_destroy(dead);
  wkv_plan_destroy(live);
  wkv_seq_destroy(s);
}

TEST(Misuse, ForeignMistypedAndClosedHandlesAreRefused) {
  wkv_engine *e = nullptr;
  const wkv_config c = config();
  ASSERT_EQ(wkv_engine_open(&c, &e), WKV_OK);
  wkv_seq *s = nullptr;
  wkv_plan *p = nullptr;
  ASSERT_EQ(wkv_seq_create(e, &s), WKV_OK);
  ASSERT_EQ(wkv_plan_create(e, &p), WKV_OK);
  const std::vector<float> kv = tokens(4, 4);
  int local = 0;
  wkv_seq *foreign = reinterpret_cast<wkv_seq *>(&local);
  EXPECT_EQ(wkv_seq_append(foreign, 0, kv.data(), kv.data(), 4, 0, 0, nullptr), WKV_ERR_INVALID_HANDLE);
  EXPECT_EQ(wkv_seq_append(reinterpret_cast<wkv_seq *>(p), 0, kv.data(), kv.data(), 4, 0, 0, nullptr),
            WKV_ERR_INVALID_HANDLE);
  EXPECT_EQ(wkv_assemble(reinterpret_cast<wkv_plan *>(s), nullptr), WKV_ERR_INVALID_HANDLE);
  wkv_seq *out = nullptr;
  EXPECT_EQ(wkv_seq_create(reinterpret_cast<wkv_engine *>(s), &out), WKV_ERR_INVALID_HANDLE);
  wkv_engine_close(e);
  wkv_engine_close(e);  // twice: a no-op
  EXPECT_EQ(wkv_seq_create(e, &out), WKV_ERR_INVALID_HANDLE);
  // The sequence and the plan outlive their engine's handle.
  EXPECT_EQ(wkv_seq_append(s, 0, kv.data(), kv.data(), 4, 0, 0, nullptr), WKV_OK) << wkv_last_error();
  wkv_plan_destroy(p);
  wkv_seq_destroy(s);
}

// Finding 2: allocations the host cannot serve aborted the process (the
// metadata allocator's operator new); an extent overflowing 64 bits was
// accepted.
TEST(Misuse, AllocationsThatCannotBeServedAreStatusesNotAborts) {
  Open o(config());
  wkv_seq *s = nullptr;
  ASSERT_EQ(wkv_seq_create(o.e, &s), WKV_OK);
  const std::vector<float> kv = tokens(8, 5);
  // Room for 4 billion tokens' rows (a terabyte) cannot be had: refused
  // before a row is read.
  const int rc = wkv_seq_append(s, 0, kv.data(), kv.data(), 0xFFFFFF00u, 0, 0, nullptr);
  EXPECT_EQ(rc, WKV_ERR_OUT_OF_MEMORY) << wkv_last_error();
  EXPECT_EQ(tokens_of(s), 0u);
  // token_stride * n_tokens past 2^64.
  EXPECT_EQ(wkv_seq_append(s, 0, kv.data(), kv.data(), 16, int64_t{1} << 60, 0, nullptr), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(wkv_seq_append(s, 0, kv.data(), kv.data(), 8, 0, 0, nullptr), WKV_OK) << "still usable";
  wkv_seq_destroy(s);

  wkv_config small = config();
  small.host_budget_bytes = 1u << 20;
  Open b(small);
  ASSERT_EQ(wkv_seq_create(b.e, &s), WKV_OK);
  const std::vector<float> many = tokens(8000, 6);
  EXPECT_EQ(wkv_seq_append(s, 0, many.data(), many.data(), 8000, 0, 0, nullptr), WKV_ERR_BUDGET) << wkv_last_error();
  EXPECT_EQ(tokens_of(s), 0u);
  EXPECT_EQ(wkv_seq_append(s, 0, many.data(), many.data(), 100, 0, 0, nullptr), WKV_OK) << wkv_last_error();
  wkv_seq_destroy(s);
}

// Finding 3: a prompt of 1 to 4 tokens (the sink), sink_tokens 0, or a
// batch with a 1-token sequence made assemble memcpy from a null pointer
// (undefined behaviour, reported by UBSan in the sanitizer builds).
TEST(Misuse, TinyPromptsAndAnEmptySinkDecodeExactly) {
  for (uint32_t sink : {4u, 0u}) {
    Open o(config(sink));
    wkv_seq *seqs[5];
    std::vector<std::vector<float>> kv;
    for (uint32_t i = 0; i < 5; ++i) {
      ASSERT_EQ(wkv_seq_create(o.e, &seqs[i]), WKV_OK);
      kv.push_back(tokens(i + 1, 10 + i));
      ASSERT_EQ(wkv_seq_append(seqs[i], 0, kv[i].data(), kv[i].data(), i + 1, 0, 0, nullptr), WKV_OK);
    }
    wkv_plan *p = nullptr;
    ASSERT_EQ(wkv_plan_create(o.e, &p), WKV_OK);
    const std::vector<float> q = tokens(5 * kQ * kD / (kKV * kD), 20);
    std::vector<float> out(5 * kQ * kD);
    ASSERT_EQ(wkv_decode(p, seqs, 5, 0, q.data(), 0, 0, out.data(), 0, 0, nullptr), WKV_OK) << wkv_last_error();
    // Exact attention over each sequence's few tokens.
    for (uint32_t i = 0; i < 5; ++i)
      for (uint32_t h = 0; h < kQ; ++h) {
        HeadRows rows;
        const uint32_t kvh = h / (kQ / kKV);
        for (uint32_t t = 0; t <= i; ++t) {
          const float *r = &kv[i][(static_cast<size_t>(t) * kKV + kvh) * kD];
          rows.k.insert(rows.k.end(), r, r + kD);
          rows.v.insert(rows.v.end(), r, r + kD);
        }
        std::vector<double> ref;
        exact_attention(&q[(static_cast<size_t>(i) * kQ + h) * kD], rows, kD, &ref);
        EXPECT_LT(rel_l2(&out[(static_cast<size_t>(i) * kQ + h) * kD], ref), 1e-5) << "sink " << sink << " seq " << i;
      }
    wkv_plan_destroy(p);
    for (wkv_seq *s : seqs) wkv_seq_destroy(s);
  }
}

// Finding 5: a decode refused for its output left the plan's earlier step in
// place, so a following attend answered with the previous query's result.
TEST(Misuse, ARefusedDecodeLeavesThePlanWithoutAStep) {
  Open o(config());
  wkv_seq *s = nullptr;
  ASSERT_EQ(wkv_seq_create(o.e, &s), WKV_OK);
  const std::vector<float> kv = tokens(400, 7), q = tokens(2, 8);
  ASSERT_EQ(wkv_seq_append(s, 0, kv.data(), kv.data(), 400, 0, 0, nullptr), WKV_OK);
  wkv_plan *p = nullptr;
  ASSERT_EQ(wkv_plan_create(o.e, &p), WKV_OK);
  std::vector<float> out(kQ * kD), lse(kQ);
  ASSERT_EQ(wkv_decode(p, &s, 1, 0, q.data(), 0, 0, out.data(), 0, 0, nullptr), WKV_OK);
  ASSERT_EQ(wkv_lookup(p, &s, 1, 0, q.data(), 0, 0, nullptr), WKV_OK);
  ASSERT_EQ(wkv_assemble(p, nullptr), WKV_OK);
  EXPECT_EQ(wkv_decode(p, &s, 1, 0, q.data(), 0, 0, nullptr, 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(wkv_attend(p, out.data(), 0, 0, nullptr, nullptr), WKV_ERR_STATE);
  EXPECT_EQ(wkv_merge(p, out.data(), 0, 0, lse.data(), 0, nullptr), WKV_ERR_STATE);
  ASSERT_EQ(wkv_lookup(p, &s, 1, 0, q.data(), 0, 0, nullptr), WKV_OK);
  EXPECT_EQ(wkv_decode(p, &s, 1, 0, q.data(), 0, 0, out.data(), 0, 1, nullptr), WKV_ERR_INVALID_ARGUMENT)
      << "a head_stride smaller than a row";
  EXPECT_EQ(wkv_merge(p, out.data(), 0, 0, lse.data(), 0, nullptr), WKV_ERR_STATE);
  wkv_plan_destroy(p);
  wkv_seq_destroy(s);
}

// Finding 6: a head_stride near 2^62 overflowed (signed) inside the stride
// check; a token_stride of 2^62 was accepted and read token 0 twice.
TEST(Misuse, StridesWhoseExtentOverflowsAreRefused) {
  Open o(config());
  wkv_seq *s = nullptr;
  ASSERT_EQ(wkv_seq_create(o.e, &s), WKV_OK);
  const std::vector<float> kv = tokens(4, 9);
  EXPECT_EQ(wkv_seq_append(s, 0, kv.data(), kv.data(), 2, 0, (int64_t{1} << 62) + 7, nullptr),
            WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(wkv_seq_append(s, 0, kv.data(), kv.data(), 2, int64_t{1} << 62, 0, nullptr), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(wkv_last_error()).find("2^63"), std::string::npos) << wkv_last_error();
  EXPECT_EQ(wkv_seq_append(s, 0, kv.data(), kv.data(), 2, std::numeric_limits<int64_t>::max(), 0, nullptr),
            WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(tokens_of(s), 0u);
  ASSERT_EQ(wkv_seq_append(s, 0, kv.data(), kv.data(), 4, 0, 0, nullptr), WKV_OK);
  wkv_plan *p = nullptr;
  ASSERT_EQ(wkv_plan_create(o.e, &p), WKV_OK);
  std::vector<float> q(kQ * kD, 0.1f), out(kQ * kD);
  EXPECT_EQ(wkv_decode(p, &s, 1, 0, q.data(), 0, int64_t{1} << 62, out.data(), 0, 0, nullptr),
            WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(wkv_decode(p, &s, 1, 0, q.data(), 0, 0, out.data(), std::numeric_limits<int64_t>::max(), 0, nullptr),
            WKV_OK) << "one sequence: its seq_stride is never used";
  wkv_plan_destroy(p);
  wkv_seq_destroy(s);
}

// Steps a runtime captures (wkv_plan_bind, 0.9) on a CPU engine: refused as
// unsupported with nothing changed; prepare and unbind of a plan that is
// not bound, and every verb through destroyed, foreign or mistyped
// handles, refused. (The CUDA engine's side: tests/gpu_capture.cpp.)
TEST(Misuse, BindingVerbsRefuseWhatTheyCannotServe) {
  Open o(config());
  const std::vector<float> kv = tokens(300, 5), q = tokens(2, 6);
  wkv_seq *s = nullptr;
  wkv_plan *p = nullptr, *dead = nullptr;
  ASSERT_EQ(wkv_seq_create(o.e, &s), WKV_OK);
  ASSERT_EQ(wkv_seq_append(s, 0, kv.data(), kv.data(), 300, 0, 0, nullptr), WKV_OK);
  ASSERT_EQ(wkv_plan_create(o.e, &p), WKV_OK);
  ASSERT_EQ(wkv_plan_create(o.e, &dead), WKV_OK);
  wkv_plan_destroy(dead);
  EXPECT_EQ(wkv_plan_bind(p, &s, 1, 0, nullptr), WKV_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(wkv_last_error()).find("CUDA"), std::string::npos) << wkv_last_error();
  EXPECT_EQ(wkv_plan_prepare(p, nullptr), WKV_ERR_STATE);
  EXPECT_EQ(wkv_plan_unbind(p, nullptr), WKV_ERR_STATE);
  EXPECT_EQ(wkv_plan_bind(p, nullptr, 1, 0, nullptr), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(wkv_plan_bind(p, &s, 0, 0, nullptr), WKV_ERR_INVALID_ARGUMENT);
  wkv_seq *twice[2] = {s, s};
  EXPECT_EQ(wkv_plan_bind(p, twice, 2, 0, nullptr), WKV_ERR_INVALID_ARGUMENT);
  for (wkv_plan *bad : {static_cast<wkv_plan *>(nullptr), dead, reinterpret_cast<wkv_plan *>(s)}) {
    EXPECT_EQ(wkv_plan_bind(bad, &s, 1, 0, nullptr), WKV_ERR_INVALID_HANDLE);
    EXPECT_EQ(wkv_plan_prepare(bad, nullptr), WKV_ERR_INVALID_HANDLE);
    EXPECT_EQ(wkv_plan_unbind(bad, nullptr), WKV_ERR_INVALID_HANDLE);
  }
  // Nothing changed: the sequence decodes and appends as before.
  std::vector<float> out(kQ * kD);
  EXPECT_EQ(wkv_decode(p, &s, 1, 0, q.data(), 0, 0, out.data(), 0, 0, nullptr), WKV_OK) << wkv_last_error();
  EXPECT_EQ(wkv_seq_append(s, 0, kv.data(), kv.data(), 1, 0, 0, nullptr), WKV_OK) << wkv_last_error();
  EXPECT_EQ(tokens_of(s), 301u);
  wkv_plan_destroy(p);
  wkv_seq_destroy(s);
}
