// wkv_append_batch on a CUDA engine: the batch's one kernel writes every
// sequence's rows where the single-sequence verb would, across index
// growths, from device memory in any stride layout (down to 2-byte
// alignment) and from mapped host memory; the decoding outputs stay exact
// at full retrieval and agree with an engine fed one sequence at a time.
// Skips where no CUDA device exists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gpu_support.hpp"
#include "support.hpp"
#include "wavekv/wavekv.hpp"

using namespace wkvtest;

namespace {

constexpr uint32_t kQ = 8, kKV = 2, kD = 128, kDT = WKV_DTYPE_F16, kN = 4;

wkv_config config() {
  wkv_config c;
  wkv_config_init(&c);
  c.device = WKV_DEVICE_CUDA;
  c.n_layers = 1;
  c.n_q_heads = kQ;
  c.n_kv_heads = kKV;
  c.head_dim = kD;
  c.dtype = kDT;
  c.segment_tokens = 2048;
  c.update_segment_tokens = 256;
  c.window_tokens = 64;
  c.retrieval_frac = 1.0f;  // everything attended exactly: a misplaced row shows
  c.estimation_frac = 0.0f;
  c.device_cache_bytes = 8u << 20;
  c.threads = 2;
  return c;
}

struct Dev {
  void *p = nullptr;
  explicit Dev(size_t n) { EXPECT_EQ(cudaMalloc(&p, n), cudaSuccess); }
  ~Dev() { cudaFree(p); }
};

// kN contexts, each appended to a sequence of the batched engine and one of
// the single engine.
struct Pair {
  wavekv::Engine batched, single;
  std::vector<wavekv::Sequence> bs, ss;
  std::vector<wkv_seq *> bh, sh;
  std::vector<HeadRows> rows[kN];
  std::vector<KeyGen> gens;
  cudaStream_t stream = nullptr;
  explicit Pair(const wkv_config &c = config()) : batched(c), single(c) {
    for (uint32_t i = 0; i < kN; ++i) {
      bs.emplace_back(batched);
      ss.emplace_back(single);
      bh.push_back(bs.back().get());
      sh.push_back(ss.back().get());
      rows[i].resize(kKV);
      gens.emplace_back(kKV, kD, 900 + i);
    }
    cudaStreamCreate(&stream);
  }
  ~Pair() { cudaStreamDestroy(stream); }

  // T tokens of every sequence, f16 values placed at element
  // i * seq_stride + t * token_stride + h * head_stride of a buffer of
  // `elems` elements.
  std::vector<uint16_t> draw(uint32_t T, int64_t seq_stride, int64_t token_stride, int64_t head_stride, size_t elems,
                             std::vector<uint16_t> *vb) {
    std::vector<uint16_t> kb(elems, 0);
    vb->assign(elems, 0);
    for (uint32_t i = 0; i < kN; ++i) {
      std::vector<float> k, v;
      gens[i].next(T, &k, &v);
      for (uint32_t t = 0; t < T; ++t)
        for (uint32_t h = 0; h < kKV; ++h) {
          const size_t src = (static_cast<size_t>(t) * kKV + h) * kD;
          for (uint32_t x = 0; x < kD; ++x) {
            const size_t at = i * seq_stride + t * token_stride + h * head_stride + x;
            kb[at] = wkv::float_to_f16(k[src + x]);
            (*vb)[at] = wkv::float_to_f16(v[src + x]);
            k[src + x] = wkv::f16_to_float(kb[at]);
            v[src + x] = wkv::f16_to_float((*vb)[at]);
          }
          rows[i][h].k.insert(rows[i][h].k.end(), k.begin() + src, k.begin() + src + kD);
          rows[i][h].v.insert(rows[i][h].v.end(), v.begin() + src, v.begin() + src + kD);
        }
    }
    return kb;
  }

  // The same tokens through both engines: one batch call, kN single calls.
  void append(uint32_t T, int64_t seq_stride, int64_t token_stride, int64_t head_stride, bool mapped = false) {
    const size_t elems = (kN - 1) * seq_stride + (T - 1) * token_stride + (kKV - 1) * head_stride + kD;
    std::vector<uint16_t> vh;
    const std::vector<uint16_t> kh = draw(T, seq_stride, token_stride, head_stride, elems, &vh);
    const size_t bytes = elems * 2;
    void *k = nullptr, *v = nullptr;
    std::unique_ptr<Dev> dk, dv;
    if (mapped) {
      ASSERT_EQ(cudaHostAlloc(&k, bytes, cudaHostAllocMapped), cudaSuccess);
      ASSERT_EQ(cudaHostAlloc(&v, bytes, cudaHostAllocMapped), cudaSuccess);
      std::memcpy(k, kh.data(), bytes);
      std::memcpy(v, vh.data(), bytes);
    } else {
      dk = std::make_unique<Dev>(bytes);
      dv = std::make_unique<Dev>(bytes);
      k = dk->p;
      v = dv->p;
      ASSERT_EQ(cudaMemcpy(k, kh.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(v, vh.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
    }
    wavekv::append_batch(bh.data(), kN, 0, k, v, T, seq_stride, token_stride, head_stride, stream);
    for (uint32_t i = 0; i < kN; ++i) {
      const size_t off = i * seq_stride * 2;
      ss[i].append(0, static_cast<uint8_t *>(k) + off, static_cast<uint8_t *>(v) + off, T, token_stride, head_stride,
                   stream);
    }
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    if (mapped) {
      cudaFreeHost(k);
      cudaFreeHost(v);
    }
  }

  // Decodes all kN sequences on both engines: the worst error against
  // exact attention, and the largest difference between the engines.
  // `where` (if given) names the first sequence and head whose output is
  // off, with both errors.
  void check(KeyGen &qgen, double *worst, double *apart, std::string *where = nullptr) {
    std::vector<float> q;
    for (uint32_t i = 0; i < kN; ++i)
      for (uint32_t h = 0; h < kKV; ++h) qgen.query(h, kQ / kKV, &q);
    for (float &x : q) x = round_to(kDT, x);
    const std::vector<uint8_t> qb = pack(kDT, q);
    Dev dq(qb.size()), ob(qb.size()), os(qb.size());
    ASSERT_EQ(cudaMemcpy(dq.p, qb.data(), qb.size(), cudaMemcpyHostToDevice), cudaSuccess);
    wavekv::Plan pb(batched), ps(single);
    pb.decode(bh.data(), kN, 0, dq.p, ob.p, stream);
    ps.decode(sh.data(), kN, 0, dq.p, os.p, stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<uint8_t> hb(qb.size()), hs(qb.size());
    ASSERT_EQ(cudaMemcpy(hb.data(), ob.p, hb.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(hs.data(), os.p, hs.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    const std::vector<float> out_b = unpack(kDT, hb, q.size()), out_s = unpack(kDT, hs, q.size());
    for (uint32_t i = 0; i < kN; ++i)
      for (uint32_t h = 0; h < kQ; ++h) {
        const size_t at = (static_cast<size_t>(i) * kQ + h) * kD;
        std::vector<double> ref;
        exact_attention(&q[at], rows[i][h / (kQ / kKV)], kD, &ref);
        const double w = rel_l2(&out_b[at], ref);
        std::vector<double> other(out_s.begin() + at, out_s.begin() + at + kD);
        const double a = rel_l2(&out_b[at], other), s = rel_l2(&out_s[at], ref);
        *worst = std::max(*worst, w);
        *apart = std::max(*apart, a);
        if (where && where->empty() && (w >= 5e-3 || a >= 5e-3))
          *where = "sequence " + std::to_string(i) + " q head " + std::to_string(h) + ": batched " +
                   std::to_string(w) + " and single " + std::to_string(s) + " from exact, " + std::to_string(a) +
                   " apart";
      }
  }
};

}  // namespace

TEST(GpuBatch, AppendsLandWhereSingleAppendsDoAcrossGrowths) {
  REQUIRE_GPU();
  Pair p;
  KeyGen qgen(kKV, kD, 5);
  // Prompts of 4100 tokens, in batches of 1025 (two segments of 2048 and
  // the rest at the prompt's end).
  for (int part = 0; part < 4; ++part) p.append(1025, 1025 * kKV * kD, kKV * kD, kD);
  for (uint32_t i = 0; i < kN; ++i) {
    p.bs[i].end_prompt(0, p.stream);
    p.ss[i].end_prompt(0, p.stream);
  }
  double worst = 0, apart = 0;
  std::string first_off;  // where and when the outputs first went off
  auto check = [&](uint32_t at) {
    std::string where;
    p.check(qgen, &worst, &apart, &where);
    if (first_off.empty() && !where.empty()) first_off = "after " + std::to_string(at) + " generated tokens, " + where;
  };
  check(0);
  // 700 generated tokens (two growths of 256 in each sequence): packed
  // device memory, token-interleaved with 2-byte alignment (head stride
  // d + 1), several tokens at once, and mapped host memory.
  uint32_t step = 0;
  while (step < 700) {
    if (step % 4 == 1) {
      p.append(1, kKV * (kD + 1), 0, kD + 1);
      step += 1;
    } else if (step % 9 == 2) {
      p.append(3, kKV * kD, kN * kKV * kD, kD);
      step += 3;
    } else if (step % 25 == 3) {
      p.append(1, kKV * kD, 0, kD, true);
      step += 1;
    } else {
      p.append(1, kKV * kD, 0, kD);
      step += 1;
    }
    if (step % 50 < 3) check(step);
  }
  check(step);
  for (uint32_t i = 0; i < kN; ++i) {
    const wkv_seq_info b = p.bs[i].info(0), s = p.ss[i].info(0);
    EXPECT_EQ(b.tokens, 4100u + step);
    EXPECT_EQ(b.tokens, s.tokens);
    EXPECT_EQ(b.segments, s.segments);
    EXPECT_EQ(b.clustered, s.clustered);
    EXPECT_GE(b.segments, 2u + 2u) << "the prompt's two segments (2048 and 1984 tokens) and two growths";
  }
  EXPECT_LT(worst, 5e-3) << "full retrieval must match exact attention; first off " << first_off;
  EXPECT_LT(apart, 5e-3) << "the batched and the single engine must agree; first off " << first_off;
}

// An engine opened while the caller's legacy default stream is held (a
// runtime's work queued there) caches as one opened on an idle device, and
// its cached steps stay exact. The buffer manager's pool of free frames was
// zeroed on the legacy stream but published on a stream of its own, which
// does not wait for it: the zeroing landed after the publish, emptying the
// pool for good, or (the copy done, the counts not yet) leaving every slot
// naming frame 0, so that the units of every sequence read one frame. Under
// GPU contention that order was the common one (six copies of the test
// above failed together).
TEST(GpuBatch, AnEngineOpenedBehindABusyDefaultStreamCachesExactly) {
  REQUIRE_GPU();
  Gate gate;
  std::unique_ptr<Pair> p;
  const bool unforced = gate.run_closed(
      cudaStreamLegacy,
      [&] {
        p = std::make_unique<Pair>();
        // The engines' own streams run meanwhile (their first publish).
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
      },
      std::chrono::seconds(3));
  // Some call of the openings waits for the legacy stream (the runtime's
  // implicit synchronization; so it did on the H100 machine) and the
  // watchdog opens the gate: a pool zeroed there still lost to its publish
  // (this test failed with the zeroing on the legacy stream).
  if (!unforced) std::printf("note: opening the engines waited for the legacy default stream\n");
  KeyGen qgen(kKV, kD, 7);
  for (int part = 0; part < 4; ++part) p->append(1025, 1025 * kKV * kD, kKV * kD, kD);
  for (uint32_t i = 0; i < kN; ++i) {
    p->bs[i].end_prompt(0, p->stream);
    p->ss[i].end_prompt(0, p->stream);
  }
  double worst = 0, apart = 0;
  std::string first_off;
  for (uint32_t step = 0; step < 12; ++step) {
    if (step > 0) p->append(1, kKV * kD, 0, kD);
    std::string where;
    p->check(qgen, &worst, &apart, &where);
    if (first_off.empty() && !where.empty()) first_off = "step " + std::to_string(step) + ", " + where;
  }
  EXPECT_LT(worst, 5e-3) << "full retrieval must match exact attention; first off " << first_off;
  EXPECT_LT(apart, 5e-3) << "the batched and the single engine must agree; first off " << first_off;
  for (wavekv::Engine *e : {&p->batched, &p->single}) {
    const wkv_stats st = e->stats();
    EXPECT_GT(st.cache_admissions, 0u) << "the device cache never admitted a unit (its pool stayed empty)";
    EXPECT_GT(st.cache_hits, 0u);
  }
}

// The issue's "zero host synchronizations in a decode loop that crosses
// index growths": a runtime's loop (one wkv_append_batch and one wkv_decode
// a token) is enqueued behind a gate that holds the stream. Were any call
// to wait for the stream, the loop could not finish before the watchdog
// opened the gate. First the tokens that complete an update segment in
// every sequence (its growth begins: the k-means is enqueued on the
// engine's growth stream, behind the gate too), then, the k-means done,
// the tokens up to the growth's commit (32 tokens later) and beyond. Every
// step's output is then checked against exact attention over the tokens
// appended so far (full retrieval: a row missing or misplaced shows).
TEST(GpuBatch, ADecodeLoopAcrossGrowthsNeverWaitsForTheStream) {
  REQUIRE_GPU();
  wkv_config c = config();
  c.update_segment_tokens = 32;
  c.window_tokens = 16;
  Pair p(c);
  for (int part = 0; part < 2; ++part) p.append(1025, 1025 * kKV * kD, kKV * kD, kD);
  for (uint32_t i = 0; i < kN; ++i) p.bs[i].end_prompt(0, p.stream);
  ASSERT_EQ(cudaStreamSynchronize(p.stream), cudaSuccess);
  std::vector<uint32_t> segments0(kN);
  for (uint32_t i = 0; i < kN; ++i) segments0[i] = p.bs[i].info(0).segments;

  // Inputs staged ahead: a token and a query per sequence and step.
  constexpr uint32_t kSteps = 40;
  const size_t tok_elems = size_t(kN) * kKV * kD, q_elems = size_t(kN) * kQ * kD;
  Dev dk(2 * kSteps * tok_elems * 2), dv(2 * kSteps * tok_elems * 2);
  Dev dq(2 * kSteps * q_elems * 2), dout(2 * kSteps * q_elems * 2);
  std::vector<std::vector<float>> qs;
  std::vector<std::vector<size_t>> lens;  // rows of each sequence at each step
  KeyGen qgen(kKV, kD, 11);
  for (uint32_t st = 0; st < 2 * kSteps; ++st) {
    std::vector<uint16_t> vh;
    const std::vector<uint16_t> kh = p.draw(1, kKV * kD, 0, kD, tok_elems, &vh);
    ASSERT_EQ(cudaMemcpy(static_cast<uint16_t *>(dk.p) + st * tok_elems, kh.data(), tok_elems * 2,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(static_cast<uint16_t *>(dv.p) + st * tok_elems, vh.data(), tok_elems * 2,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    std::vector<float> q;
    for (uint32_t i = 0; i < kN; ++i)
      for (uint32_t h = 0; h < kKV; ++h) qgen.query(h, kQ / kKV, &q);
    for (float &x : q) x = round_to(kDT, x);
    const std::vector<uint8_t> qb = pack(kDT, q);
    ASSERT_EQ(cudaMemcpy(static_cast<uint8_t *>(dq.p) + st * q_elems * 2, qb.data(), qb.size(),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    qs.push_back(q);
    std::vector<size_t> n(kN);
    for (uint32_t i = 0; i < kN; ++i) n[i] = p.rows[i][0].tokens(kD);
    lens.push_back(n);
  }

  wavekv::Plan plan(p.batched);
  Gate gate;
  // Where the loop is (step * 2, +1 in the decode): the watchdog's message.
  std::atomic<uint32_t> at{0};
  gate.on_force = [&] {
    const uint32_t a = at.load();
    ADD_FAILURE() << "the loop was waiting in " << (a % 2 ? "wkv_decode" : "wkv_append_batch") << " of step "
                  << a / 2 << " when the watchdog opened the gate";
  };
  // Under compute-sanitizer the loop runs ungated: the sanitizer's launch
  // hook waits for the device once some 260 launches are in flight (found
  // with the loop's stack when the watchdog fired: inside cuLaunchKernelEx,
  // in the sanitizer's library, at step 28 of 40). The outputs across the
  // growths are still checked.
  const bool gated = !under_sanitizer();
  if (!gated) std::printf("note: under compute-sanitizer, the loop is not gated (only its outputs are checked)\n");
  auto run = [&](auto body) {
    if (gated) return gate.run_closed(p.stream, body, std::chrono::seconds(30));
    body();
    return true;
  };
  auto steps = [&](uint32_t first, uint32_t count) {
    for (uint32_t st = first; st < first + count; ++st) {
      at = 2 * st;
      wavekv::append_batch(p.bh.data(), kN, 0, static_cast<uint16_t *>(dk.p) + st * tok_elems,
                           static_cast<uint16_t *>(dv.p) + st * tok_elems, 1, kKV * kD, 0, kD, p.stream);
      at = 2 * st + 1;
      plan.decode(p.bh.data(), kN, 0, static_cast<uint8_t *>(dq.p) + st * q_elems * 2,
                  static_cast<uint8_t *>(dout.p) + st * q_elems * 2, p.stream);
    }
  };
  // A runtime's warm-up: one decode before the gate. Under CUDA's lazy
  // module loading a kernel's first launch in a process loads its module,
  // which may synchronize the context (docs/gpu-serving.md). Skipped with
  // WKV_TEST_NO_WARMUP=1 (with CUDA_MODULE_LOADING=EAGER it must pass so).
  if (!std::getenv("WKV_TEST_NO_WARMUP")) {
    plan.decode(p.bh.data(), kN, 0, dq.p, dout.p, p.stream);
    ASSERT_EQ(cudaStreamSynchronize(p.stream), cudaSuccess);
  }
  // 1. Every sequence completes an update segment: growths begin.
  EXPECT_TRUE(run([&] { steps(0, kSteps); }))
      << "a call waited for the stream while growths began";
  ASSERT_EQ(cudaStreamSynchronize(p.stream), cudaSuccess);
  for (uint32_t i = 0; i < kN; ++i)
    EXPECT_EQ(p.bs[i].info(0).segments, segments0[i]) << "a growth committed before its lag";
  // 2. Past the lag: the growths commit (and the next ones begin).
  EXPECT_TRUE(run([&] { steps(kSteps, kSteps); }))
      << "a call waited for the stream while growths committed";
  ASSERT_EQ(cudaStreamSynchronize(p.stream), cudaSuccess);
  for (uint32_t i = 0; i < kN; ++i) {
    const wkv_seq_info in = p.bs[i].info(0);
    EXPECT_GE(in.segments, segments0[i] + 1) << "sequence " << i << ": no growth committed";
    EXPECT_EQ(in.tokens, p.rows[i][0].tokens(kD));
  }

  std::vector<uint8_t> out(2 * kSteps * q_elems * 2);
  ASSERT_EQ(cudaMemcpy(out.data(), dout.p, out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  double worst = 0;
  for (uint32_t st = 0; st < 2 * kSteps; ++st) {
    const std::vector<uint8_t> ob(out.begin() + st * q_elems * 2, out.begin() + (st + 1) * q_elems * 2);
    const std::vector<float> o = unpack(kDT, ob, q_elems);
    for (uint32_t i = 0; i < kN; ++i)
      for (uint32_t h = 0; h < kQ; ++h) {
        HeadRows prefix;
        const HeadRows &all = p.rows[i][h / (kQ / kKV)];
        prefix.k.assign(all.k.begin(), all.k.begin() + lens[st][i] * kD);
        prefix.v.assign(all.v.begin(), all.v.begin() + lens[st][i] * kD);
        std::vector<double> ref;
        const size_t at = (size_t(i) * kQ + h) * kD;
        exact_attention(&qs[st][at], prefix, kD, &ref);
        worst = std::max(worst, rel_l2(&o[at], ref));
      }
  }
  EXPECT_LT(worst, 5e-3) << "every step exact at full retrieval, across the growths";
}

// Decode graphs (docs/gpu-serving.md): wkv_decode replays its plan's graph
// of the step's kernels once the batch's shape has come twice. The graph
// reads what changes between steps (the run table, the step's epoch, its
// access record, the output) from device memory its staging launch writes,
// so replays stay exact while appends grow the tails, growths add clusters,
// the output moves from step to step and the batch changes. Checked bit for
// bit against the same steps on an engine that launches the kernels one by
// one (WKV_DECODE_GRAPHS=0), at a partial retrieval (every zone in use),
// over 1200 steps (some 37 growths a sequence).
TEST(GpuBatch, DecodeGraphsReplayExactlyAsTheStateChanges) {
  REQUIRE_GPU();
  wkv_config c = config();
  c.update_segment_tokens = 32;
  c.window_tokens = 16;
  c.retrieval_frac = 0.25f;
  c.estimation_frac = 0.25f;
  std::optional<Pair> on_opened, off_opened;
  {
    wkvtest::ScopedEnv graphs("WKV_DECODE_GRAPHS", nullptr);
    on_opened.emplace(c);
  }
  {
    wkvtest::ScopedEnv graphs("WKV_DECODE_GRAPHS", "0");
    off_opened.emplace(c);
  }
  Pair &on = *on_opened, &off = *off_opened;
  for (Pair *p : {&on, &off}) {
    for (int part = 0; part < 2; ++part) p->append(1025, 1025 * kKV * kD, kKV * kD, kD);
    for (uint32_t i = 0; i < kN; ++i) p->bs[i].end_prompt(0, p->stream);
    ASSERT_EQ(cudaStreamSynchronize(p->stream), cudaSuccess);
  }
  const uint32_t segments0 = on.bs[0].info(0).segments;

  const size_t q_bytes = size_t(kN) * kQ * kD * 2;
  Dev dq(q_bytes), out_on(2 * q_bytes), out_off(q_bytes);
  wavekv::Plan plan_on(on.batched), plan_off(off.batched);
  KeyGen qgen(kKV, kD, 17);
  // 1200 steps; 300 under compute-sanitizer (its kernels are far slower).
  const bool sanitized = under_sanitizer();
  const uint32_t kSteps = sanitized ? 300 : 1200, kHalfAt = kSteps / 2, kWindow = kHalfAt + 20;
  uint32_t mismatched = 0;
  wkv_stats window0{};  // at the first step of a window of replays only
  for (uint32_t st = 0; st < kSteps; ++st) {
    on.append(1, kKV * kD, kKV * kD, kD);
    off.append(1, kKV * kD, kKV * kD, kD);
    std::vector<float> q;
    for (uint32_t i = 0; i < kN; ++i)
      for (uint32_t h = 0; h < kKV; ++h) qgen.query(h, kQ / kKV, &q);
    for (float &x : q) x = round_to(kDT, x);
    const std::vector<uint8_t> qb = pack(kDT, q);
    ASSERT_EQ(cudaMemcpy(dq.p, qb.data(), qb.size(), cudaMemcpyHostToDevice), cudaSuccess);
    // Ten steps from the middle on decode half the batch (a new shape, a
    // new graph); the output alternates between two buffers.
    const uint32_t n = st >= kHalfAt && st < kHalfAt + 10 ? kN / 2 : kN;
    if (st == kWindow) window0 = on.batched.stats();
    void *o = static_cast<uint8_t *>(out_on.p) + (st % 2) * q_bytes;
    plan_on.decode(on.bh.data(), n, 0, dq.p, o, on.stream);
    plan_off.decode(off.bh.data(), n, 0, dq.p, out_off.p, off.stream);
    ASSERT_EQ(cudaStreamSynchronize(on.stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(off.stream), cudaSuccess);
    std::vector<uint8_t> a(q_bytes), b(q_bytes);
    ASSERT_EQ(cudaMemcpy(a.data(), o, q_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(b.data(), out_off.p, q_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    const size_t used = size_t(n) * kQ * kD * 2;
    if (std::memcmp(a.data(), b.data(), used) != 0) ++mismatched;
    const std::vector<float> f = unpack(kDT, a, size_t(n) * kQ * kD);
    for (float x : f) ASSERT_TRUE(std::isfinite(x)) << "step " << st;
  }
  EXPECT_EQ(mismatched, 0u) << "steps whose replayed output differs from the kernels launched one by one";
  EXPECT_GE(on.bs[0].info(0).segments, segments0 + kSteps / 40) << "the steps crossed growths (one every 32 tokens)";
  // The replayed steps end (their epoch reported from StepVars): the buffer
  // manager takes every record.
  wkv_stats s_on = on.batched.stats();
  for (int i = 0; i < 500 && s_on.manager_backlog > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    s_on = on.batched.stats();
  }
  EXPECT_EQ(s_on.manager_backlog, 0u) << "records of replayed steps never taken";
  const wkv_stats s_off = off.batched.stats();
  // Two steps of a shape before its graph; three shapes (the batch, its
  // half, the batch again), and a new graph wherever a growth outgrew a
  // bound or a buffer: most steps still replay.
  EXPECT_GE(s_on.decode_graphs, kSteps * 9 / 10) << "steps replayed as graphs";
  EXPECT_EQ(s_off.decode_graphs, 0u);
  // From kWindow on, nearly every step replays, and the steps admit into
  // the device cache and read from it.
  const uint64_t replayed = s_on.decode_graphs - window0.decode_graphs, window = kSteps - kWindow;
  EXPECT_GE(replayed + 4, window) << "nearly every step of the window replayed";
  EXPECT_GT(s_on.cache_admissions, window0.cache_admissions) << "the window's gathers admit";
  EXPECT_GT(s_on.cache_hits, window0.cache_hits) << "the window's gathers read the cache";
}

namespace {

// An engine of config c with decode graphs on or off (WKV_DECODE_GRAPHS,
// read when the engine opens), and with the graphs' fork on or off
// (WKV_DECODE_FORK: the estimate beside the gather).
wavekv::Engine engine_with_graphs(const wkv_config &c, bool graphs, bool fork = true) {
  wkvtest::ScopedEnv g("WKV_DECODE_GRAPHS", graphs ? nullptr : "0");
  wkvtest::ScopedEnv f("WKV_DECODE_FORK", fork ? nullptr : "0");
  return wavekv::Engine(c);
}

// Two engines of one config fed the same tokens and queries, n sequences
// each: `on` replays decode graphs, `off` launches a step's kernels one by
// one. Their outputs must agree bit for bit.
struct Twin {
  wkv_config c;
  uint32_t n;
  wavekv::Engine on, off;
  std::vector<wavekv::Sequence> son, soff;
  std::vector<wkv_seq *> hon, hoff;
  std::vector<KeyGen> gens;
  // Where keep_rows is set, every token appended: rows[sequence][KV head].
  bool keep_rows = false;
  std::vector<std::vector<HeadRows>> rows;
  cudaStream_t stream = nullptr;
  // `fork`: whether on's graphs run the estimate beside the gather;
  // `priority`: the stream's (cudaStreamCreateWithPriority).
  Twin(const wkv_config &cfg, uint32_t n_seqs, bool fork = true, int priority = 0)
      : c(cfg), n(n_seqs), on(engine_with_graphs(cfg, true, fork)), off(engine_with_graphs(cfg, false)) {
    for (uint32_t i = 0; i < n; ++i) {
      son.emplace_back(on);
      soff.emplace_back(off);
      hon.push_back(son.back().get());
      hoff.push_back(soff.back().get());
      gens.emplace_back(c.n_kv_heads, c.head_dim, 300 + i);
    }
    EXPECT_EQ(cudaStreamCreateWithPriority(&stream, cudaStreamDefault, priority), cudaSuccess);
  }
  ~Twin() { cudaStreamDestroy(stream); }

  // T tokens to every sequence of both engines, in one wkv_append_batch
  // each, from device memory laid out [n][T][KV heads][d].
  void append(uint32_t T) {
    const uint32_t H = c.n_kv_heads, d = c.head_dim;
    std::vector<float> k, v;
    for (uint32_t i = 0; i < n; ++i) gens[i].next(T, &k, &v);
    if (keep_rows) {
      rows.resize(n, std::vector<HeadRows>(H));
      for (size_t x = 0; x < k.size(); ++x) {
        const size_t row = x / d, i = row / (size_t(T) * H), h = row % H;  // [n][T][H][d]
        rows[i][h].k.push_back(round_to(c.dtype, k[x]));
        rows[i][h].v.push_back(round_to(c.dtype, v[x]));
      }
    }
    const std::vector<uint8_t> kb = pack(c.dtype, k), vb = pack(c.dtype, v);
    Dev dk(kb.size()), dv(vb.size());
    ASSERT_EQ(cudaMemcpy(dk.p, kb.data(), kb.size(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dv.p, vb.data(), vb.size(), cudaMemcpyHostToDevice), cudaSuccess);
    const int64_t seq = int64_t(T) * H * d;
    wavekv::append_batch(hon.data(), n, 0, dk.p, dv.p, T, seq, H * d, d, stream);
    wavekv::append_batch(hoff.data(), n, 0, dk.p, dv.p, T, seq, H * d, d, stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  void end_prompt() {
    for (uint32_t i = 0; i < n; ++i) {
      son[i].end_prompt(0, stream);
      soff[i].end_prompt(0, stream);
    }
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  // One decoding step of every sequence on both engines, each through its
  // plan; false where the outputs differ or one is not finite. With
  // `worst` (and keep_rows), the largest relative L2 error of a query
  // head's output against exact attention over its sequence's rows.
  bool decode(KeyGen &qgen, wavekv::Plan &pon, wavekv::Plan &poff, double *worst = nullptr) {
    const uint32_t H = c.n_kv_heads, G = c.n_q_heads / c.n_kv_heads;
    std::vector<float> q;
    for (uint32_t i = 0; i < n; ++i)
      for (uint32_t h = 0; h < H; ++h) qgen.query(h, G, &q);
    for (float &x : q) x = round_to(c.dtype, x);
    const std::vector<uint8_t> qb = pack(c.dtype, q);
    Dev dq(qb.size()), oa(qb.size()), ob(qb.size());
    EXPECT_EQ(cudaMemcpy(dq.p, qb.data(), qb.size(), cudaMemcpyHostToDevice), cudaSuccess);
    pon.decode(hon.data(), n, 0, dq.p, oa.p, stream);
    poff.decode(hoff.data(), n, 0, dq.p, ob.p, stream);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<uint8_t> a(qb.size()), b(qb.size());
    EXPECT_EQ(cudaMemcpy(a.data(), oa.p, a.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(b.data(), ob.p, b.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    const std::vector<float> out = unpack(c.dtype, a, q.size());
    for (float x : out)
      if (!std::isfinite(x)) return false;
    const uint32_t d = c.head_dim;
    for (size_t row = 0; worst && row < q.size() / d; ++row) {
      const size_t i = row / c.n_q_heads, h = row % c.n_q_heads;  // [n][q heads][d]
      std::vector<double> ref;
      exact_attention(&q[row * d], rows.at(i).at(h / G), d, &ref);
      *worst = std::max(*worst, rel_l2(&out[row * d], ref));
    }
    return a == b;
  }
  // The prompt: T tokens a sequence, then its end.
  void prompt(uint32_t T) {
    append(T);
    end_prompt();
  }
  // `steps` steps of one token a sequence; the steps whose outputs differ.
  uint32_t run(uint32_t steps, uint64_t seed) {
    wavekv::Plan pon(on), poff(off);
    KeyGen qgen(c.n_kv_heads, c.head_dim, seed);
    uint32_t off_steps = 0;
    for (uint32_t st = 0; st < steps; ++st) {
      append(1);
      if (!decode(qgen, pon, poff)) ++off_steps;
    }
    return off_steps;
  }
  // `steps` steps (fewer under a sanitizer: `sanitized`), every output bit
  // for bit off's, at least eight in ten replayed as graphs; the steps run.
  uint32_t expect_exact_replays(uint32_t steps, uint32_t sanitized, uint64_t seed) {
    if (under_sanitizer()) steps = sanitized;
    EXPECT_EQ(run(steps, seed), 0u) << "steps whose replayed output differs from the kernels launched one by one";
    EXPECT_GE(on.stats().decode_graphs, steps * 8 / 10) << "steps replayed as graphs";
    return steps;
  }
};

// A config for the graph tests below: every zone in use, a growth every 32
// generated tokens.
wkv_config graph_config(uint32_t q_heads, uint32_t kv_heads) {
  wkv_config c = config();
  c.n_q_heads = q_heads;
  c.n_kv_heads = kv_heads;
  c.update_segment_tokens = 32;
  c.window_tokens = 16;
  c.retrieval_frac = 0.25f;
  c.estimation_frac = 0.25f;
  return c;
}

}  // namespace

// More runs than one staging launch takes (160): 24 sequences of 8 KV heads
// are 192 runs, staged in two launches, the step's variables stored by the
// first. Replays stay bit for bit those of the kernels launched one by one,
// across growths.
TEST(GpuBatch, DecodeGraphsStayExactOverMoreRunsThanOneStagingLaunchTakes) {
  REQUIRE_GPU();
  Twin t(graph_config(32, 8), 24);
  t.prompt(700);
  const uint32_t steps = t.expect_exact_replays(150, 40, 41);
  // The prompt's segment, then one a 32 tokens, less the growth lag.
  EXPECT_GE(t.son[0].info(0).segments, 1u + steps / 50) << "the steps crossed growths";
}

// Every head dimension the kernels take, with query rows that straddle
// the staging's CTAs (1024 elements a CTA: 3 sequences of 6 query heads of
// 80 end the first CTA inside a row): with every cluster attended exactly
// (config()), each query head's output is exact attention over its own
// sequence's rows, replayed or launched one by one.
TEST(GpuBatch, EveryHeadDimensionAttendsEachQueryRowOverItsOwnSequence) {
  REQUIRE_GPU();
  for (uint32_t d : {64u, 80u, 96u, 256u}) {
    SCOPED_TRACE(testing::Message() << "d " << d);
    wkv_config c = config();
    c.n_q_heads = 6;
    c.n_kv_heads = 2;
    c.head_dim = d;
    Twin t(c, 3);
    t.keep_rows = true;
    t.prompt(1100);
    wavekv::Plan pon(t.on), poff(t.off);
    KeyGen qgen(c.n_kv_heads, d, 61);
    double worst = 0;
    for (int step = 0; step < 6; ++step) {
      t.append(1);
      EXPECT_TRUE(t.decode(qgen, pon, poff, &worst)) << "step " << step;
    }
    EXPECT_LT(worst, 5e-3) << "the worst query head against exact attention";
    EXPECT_GE(t.on.stats().decode_graphs, 4u) << "steps replayed as graphs";
  }
}

// An engine without a device cache (a cache smaller than one frame): its
// graphs gather every unit from host pages and open no access record.
TEST(GpuBatch, DecodeGraphsStayExactWithoutADeviceCache) {
  REQUIRE_GPU();
  wkv_config c = graph_config(kQ, kKV);
  c.device_cache_bytes = 1;
  Twin t(c, kN);
  t.prompt(2100);
  t.expect_exact_replays(200, 60, 43);
  const wkv_stats s = t.on.stats();
  EXPECT_EQ(s.device_cache_bytes, 0u) << "the engine has no device cache";
  EXPECT_EQ(s.cache_hits + s.cache_admissions, 0u);
}

// A selection split over several CTAs a run (a cluster of CTAs): runs of
// some 9200 clusters (clusters of 2 tokens) split it four ways on an H100
// (kernels::select_split: slices of at least 2048 clusters while the grid
// stays within half the multiprocessors). The split follows the largest
// run as it grows; replays stay exact.
TEST(GpuBatch, DecodeGraphsStayExactWithTheSelectionSplit) {
  REQUIRE_GPU();
  wkv_config c = graph_config(kQ, kKV);
  c.cluster_tokens = 2;
  Twin t(c, 2);
  for (int part = 0; part < 9; ++part) t.append(2050);
  t.end_prompt();
  EXPECT_GE(t.son[0].info(0).clusters, 2u * 8192u) << "runs (KV heads) of 8192 clusters or more: a split of four";
  t.expect_exact_replays(150, 40, 47);
}

// A graph forks after the selection: the estimate runs on a stream of its
// own beside the offsets and the gather (WKV_DECODE_FORK, on unless
// 0). The tests above run with the fork; this one without, where a graph's
// kernels are the one-by-one launches' in one stream order. Both stay bit
// for bit an engine's without graphs.
TEST(GpuBatch, DecodeGraphsStayExactWithoutTheFork) {
  REQUIRE_GPU();
  Twin t(graph_config(kQ, kKV), kN, /*fork=*/false);
  t.prompt(2100);
  t.expect_exact_replays(150, 40, 53);
}

// More replays in flight than the staging ring has slots (64): with the
// stream held, a runtime's loop enqueues 100 steps (an append and a decode
// each) without a wait; the steps whose slot is still unread launch one by
// one instead of replaying. Once the stream runs, every output is bit for
// bit an engine's without graphs, and replays resume. (No growth commits in
// the loop: a commit waits for its k-means, which follows the held stream;
// ADecodeLoopAcrossGrowthsNeverWaitsForTheStream opens the stream between.)
TEST(GpuBatch, DecodeGraphsPastTheRingsSlotsInFlightLaunchOneByOne) {
  REQUIRE_GPU();
  wkv_config c = graph_config(kQ, kKV);
  c.update_segment_tokens = 4096;
  Twin t(c, kN);
  t.prompt(2100);
  constexpr uint32_t kSteps = 100;
  const uint32_t H = kKV, d = kD;
  const size_t tok_elems = size_t(kN) * H * d, q_elems = size_t(kN) * kQ * d;
  // Inputs staged ahead (a copy would wait for the held stream).
  std::vector<float> k, v, q;
  for (uint32_t st = 0; st < kSteps; ++st)
    for (uint32_t i = 0; i < kN; ++i) t.gens[i].next(1, &k, &v);
  KeyGen qgen(kKV, kD, 53);
  for (uint32_t st = 0; st < kSteps; ++st)
    for (uint32_t i = 0; i < kN; ++i)
      for (uint32_t h = 0; h < kKV; ++h) qgen.query(h, kQ / kKV, &q);
  for (float &x : q) x = round_to(kDT, x);
  const std::vector<uint8_t> kb = pack(kDT, k), vb = pack(kDT, v), qb = pack(kDT, q);
  Dev dk(kb.size()), dv(vb.size()), dq(qb.size()), out_on(qb.size()), out_off(qb.size());
  ASSERT_EQ(cudaMemcpy(dk.p, kb.data(), kb.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dv.p, vb.data(), vb.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dq.p, qb.data(), qb.size(), cudaMemcpyHostToDevice), cudaSuccess);
  auto loop = [&](std::vector<wkv_seq *> &seqs, wavekv::Plan &plan, Dev &out) {
    for (uint32_t st = 0; st < kSteps; ++st) {
      const size_t tok = size_t(st) * tok_elems * 2, qo = size_t(st) * q_elems * 2;
      wavekv::append_batch(seqs.data(), kN, 0, static_cast<uint8_t *>(dk.p) + tok, static_cast<uint8_t *>(dv.p) + tok,
                           1, H * d, 0, d, t.stream);
      plan.decode(seqs.data(), kN, 0, static_cast<uint8_t *>(dq.p) + qo, static_cast<uint8_t *>(out.p) + qo, t.stream);
    }
  };
  wavekv::Plan p_on(t.on), p_off(t.off);
  // Warm-up, ungated: the kernels' modules loaded (a first launch may
  // synchronize), the graph made.
  for (int w = 0; w < 3; ++w) {
    p_on.decode(t.hon.data(), kN, 0, dq.p, out_on.p, t.stream);
    p_off.decode(t.hoff.data(), kN, 0, dq.p, out_off.p, t.stream);
  }
  ASSERT_EQ(cudaStreamSynchronize(t.stream), cudaSuccess);
  const uint64_t before = t.on.stats().decode_graphs;
  Gate gate;
  const bool gated = !under_sanitizer();  // the sanitizer's launch hook waits (see above)
  bool unforced = true;
  if (gated)
    unforced = gate.run_closed(t.stream, [&] { loop(t.hon, p_on, out_on); }, std::chrono::seconds(30));
  else
    loop(t.hon, p_on, out_on);
  EXPECT_TRUE(unforced) << "the loop waited for the held stream";
  const uint64_t in_loop = t.on.stats().decode_graphs - before;
  loop(t.hoff, p_off, out_off);
  ASSERT_EQ(cudaStreamSynchronize(t.stream), cudaSuccess);
  std::vector<uint8_t> a(qb.size()), b(qb.size());
  ASSERT_EQ(cudaMemcpy(a.data(), out_on.p, a.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(b.data(), out_off.p, b.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(a == b) << "outputs differ from the engine without graphs";
  const char *ring_env = std::getenv("WKV_DECODE_RING");
  const bool ring = !(ring_env && std::strcmp(ring_env, "0") == 0);
  if (gated && ring) {
    EXPECT_LE(in_loop, 64u) << "replays while the ring's every slot was unread";
    EXPECT_GE(in_loop, 40u) << "the loop's first steps replay";
  }
  // The stream has run: the slots are free again, and the plan replays.
  const uint64_t after = t.on.stats().decode_graphs;
  EXPECT_TRUE(t.decode(qgen, p_on, p_off));
  EXPECT_TRUE(t.decode(qgen, p_on, p_off));
  EXPECT_GE(t.on.stats().decode_graphs, after + 1) << "replays resume once the stream has run";
}

// Four threads decode batches of their own on one engine, each with its own
// plan and non-blocking stream, their appends and decodes (and the growths
// they begin and commit) interleaved with the others': decode graphs, their
// captures, the plans' staging rings and the shared device cache under
// threads. Two of the threads run on streams of the device's highest
// priority, whose steps are captured on a capture stream of that priority
// (a graph's kernels keep the priority it was captured for). Every output
// is bit for bit that of an engine without graphs fed each thread's steps
// in turn.
TEST(GpuBatch, DecodeGraphsOfFourThreadsOnOneEngineStayExact) {
  REQUIRE_GPU();
  constexpr uint32_t kThreads = 4, kSeqs = 2, kPrompt = 1500;
  const uint32_t steps = under_sanitizer() ? 30 : 150;
  const wkv_config c = graph_config(kQ, kKV);
  wavekv::Engine on = engine_with_graphs(c, true), off = engine_with_graphs(c, false);
  const size_t tok = size_t(kSeqs) * kKV * kD * 2, qbytes = size_t(kSeqs) * kQ * kD * 2;  // bytes a step
  struct Lane {
    std::vector<wavekv::Sequence> son, soff;
    std::vector<wkv_seq *> hon, hoff;
    std::unique_ptr<Dev> dk, dv, dq, out_on, out_off;
    cudaStream_t stream = nullptr;
    std::string failure;
  };
  std::vector<Lane> lanes(kThreads);
  int least = 0, greatest = 0;
  ASSERT_EQ(cudaDeviceGetStreamPriorityRange(&least, &greatest), cudaSuccess);
  for (uint32_t l = 0; l < kThreads; ++l) {
    Lane &ln = lanes[l];
    ASSERT_EQ(cudaStreamCreateWithPriority(&ln.stream, cudaStreamNonBlocking, l % 2 ? greatest : least), cudaSuccess);
    std::vector<KeyGen> gens;
    for (uint32_t i = 0; i < kSeqs; ++i) {
      ln.son.emplace_back(on);
      ln.soff.emplace_back(off);
      ln.hon.push_back(ln.son.back().get());
      ln.hoff.push_back(ln.soff.back().get());
      gens.emplace_back(kKV, kD, 700 + 10 * l + i);
    }
    // The prompts, then every step's token and query, staged in device
    // memory ([step][sequence][...]).
    std::vector<float> k, v, q;
    for (uint32_t i = 0; i < kSeqs; ++i) gens[i].next(kPrompt, &k, &v);
    for (uint32_t st = 0; st < steps; ++st)
      for (uint32_t i = 0; i < kSeqs; ++i) gens[i].next(1, &k, &v);
    KeyGen qgen(kKV, kD, 900 + l);
    for (uint32_t st = 0; st < steps; ++st)
      for (uint32_t i = 0; i < kSeqs; ++i)
        for (uint32_t h = 0; h < kKV; ++h) qgen.query(h, kQ / kKV, &q);
    const std::vector<uint8_t> kb = pack(kDT, k), vb = pack(kDT, v), qb = pack(kDT, q);
    ln.dk = std::make_unique<Dev>(kb.size());
    ln.dv = std::make_unique<Dev>(vb.size());
    ln.dq = std::make_unique<Dev>(qb.size());
    ln.out_on = std::make_unique<Dev>(qb.size());
    ln.out_off = std::make_unique<Dev>(qb.size());
    // On the lane's (non-blocking) stream: a plain cudaMemcpy from pageable
    // memory may still be landing when a non-blocking stream reads.
    ASSERT_EQ(cudaMemcpyAsync(ln.dk->p, kb.data(), kb.size(), cudaMemcpyHostToDevice, ln.stream), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(ln.dv->p, vb.data(), vb.size(), cudaMemcpyHostToDevice, ln.stream), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(ln.dq->p, qb.data(), qb.size(), cudaMemcpyHostToDevice, ln.stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(ln.stream), cudaSuccess);
    // Prompts [sequence][token][head][d]: sequence i at i * kPrompt tokens.
    const int64_t seq_stride = int64_t(kPrompt) * kKV * kD;
    wavekv::append_batch(ln.hon.data(), kSeqs, 0, ln.dk->p, ln.dv->p, kPrompt, seq_stride, kKV * kD, kD, ln.stream);
    wavekv::append_batch(ln.hoff.data(), kSeqs, 0, ln.dk->p, ln.dv->p, kPrompt, seq_stride, kKV * kD, kD, ln.stream);
    for (uint32_t i = 0; i < kSeqs; ++i) {
      ln.son[i].end_prompt(0, ln.stream);
      ln.soff[i].end_prompt(0, ln.stream);
    }
    ASSERT_EQ(cudaStreamSynchronize(ln.stream), cudaSuccess);
  }
  const size_t prompt_bytes = size_t(kSeqs) * kPrompt * kKV * kD * 2;
  // A lane's steps on one engine: an append and a decode a step, a wait for
  // the stream every 16 steps (a runtime that samples now and then).
  auto run = [&](Lane &ln, wavekv::Engine &e, std::vector<wkv_seq *> &seqs, Dev &out) {
    try {
      wavekv::Plan plan(e);
      for (uint32_t st = 0; st < steps; ++st) {
        const uint8_t *k = static_cast<uint8_t *>(ln.dk->p) + prompt_bytes + st * tok;
        const uint8_t *v = static_cast<uint8_t *>(ln.dv->p) + prompt_bytes + st * tok;
        wavekv::append_batch(seqs.data(), kSeqs, 0, k, v, 1, kKV * kD, 0, kD, ln.stream);
        plan.decode(seqs.data(), kSeqs, 0, static_cast<uint8_t *>(ln.dq->p) + st * qbytes,
                    static_cast<uint8_t *>(out.p) + st * qbytes, ln.stream);
        if (st % 16 == 15 && cudaStreamSynchronize(ln.stream) != cudaSuccess) throw std::runtime_error("stream");
      }
      if (cudaStreamSynchronize(ln.stream) != cudaSuccess) throw std::runtime_error("stream");
    } catch (const std::exception &x) {
      ln.failure = x.what();
    }
  };
  {
    std::vector<std::thread> threads;
    for (Lane &ln : lanes) threads.emplace_back([&] { run(ln, on, ln.hon, *ln.out_on); });
    for (std::thread &th : threads) th.join();
  }
  for (Lane &ln : lanes) run(ln, off, ln.hoff, *ln.out_off);
  for (uint32_t l = 0; l < kThreads; ++l) {
    Lane &ln = lanes[l];
    EXPECT_EQ(ln.failure, "") << "thread " << l;
    const size_t n = size_t(steps) * qbytes;
    std::vector<uint8_t> a(n), b(n);
    ASSERT_EQ(cudaMemcpy(a.data(), ln.out_on->p, n, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(b.data(), ln.out_off->p, n, cudaMemcpyDeviceToHost), cudaSuccess);
    uint32_t differ = 0;
    for (uint32_t st = 0; st < steps; ++st)
      differ += std::memcmp(a.data() + st * qbytes, b.data() + st * qbytes, qbytes) != 0;
    EXPECT_EQ(differ, 0u) << "thread " << l << ": steps whose output differs from the engine without graphs";
    EXPECT_EQ(ln.son[0].info(0).segments, ln.soff[0].info(0).segments);
    EXPECT_GE(ln.son[0].info(0).segments, 1u + steps / 50) << "the steps crossed growths";
  }
  EXPECT_GE(on.stats().decode_graphs, uint64_t(kThreads) * steps * 8 / 10) << "steps replayed as graphs";
  for (Lane &ln : lanes) cudaStreamDestroy(ln.stream);
}

// A decode attends from frames (WKV_DECODE_FROM_FRAMES=1; off by default): its
// gather writes where each row lives and its attention reads the rows
// there (device cache frames, host pages, the steady zone), where the
// split verbs (the engine without graphs) lay them out first. The same
// bits either way, with 8-bit pages (dequantized by the attention as the
// gather would) in each storage dtype, with and without a device cache
// (every unit from host pages), across growths.
TEST(GpuBatch, DecodesFromFramesAreTheSplitVerbsBitsWithEightBitPages) {
  REQUIRE_GPU();
  const std::pair<uint32_t, size_t> cases[] = {{WKV_DTYPE_BF16, size_t(8) << 20},
                                               {WKV_DTYPE_BF16, 1},
                                               {WKV_DTYPE_F16, size_t(8) << 20},
                                               {WKV_DTYPE_F32, size_t(8) << 20}};
  for (const auto &[dtype, cache] : cases) {
    SCOPED_TRACE(testing::Message() << "dtype " << dtype << ", device cache bytes " << cache);
    wkv_config c = graph_config(kQ, kKV);
    c.page_format = WKV_PAGE_FORMAT_INT8;
    c.dtype = dtype;
    c.device_cache_bytes = cache;
    wkvtest::ScopedEnv rows("WKV_DECODE_FROM_FRAMES", "1");
    Twin t(c, kN);
    t.prompt(2100);
    t.expect_exact_replays(150, 40, 59);
    const wkv_stats s = t.on.stats();
    if (cache > 1) {
      EXPECT_GT(s.cache_admissions, 0u) << "misses were admitted into frames the attention read";
      EXPECT_GT(s.cache_hits, 0u);
    }
    EXPECT_GT(s.cache_misses, 0u);
  }
}

// The same with the switch off (the default, said explicitly): the decode
// lays its rows out, as before.
TEST(GpuBatch, DecodesThatLayOutTheirRowsStayTheSplitVerbsBits) {
  REQUIRE_GPU();
  wkvtest::ScopedEnv rows("WKV_DECODE_FROM_FRAMES", "0");
  Twin t(graph_config(kQ, kKV), kN);
  t.prompt(2100);
  t.expect_exact_replays(100, 30, 61);
}

// After a decode that attended from frames the plan's execution buffer
// holds no rows: wkv_plan_xbuf and wkv_attend say so (WKV_ERR_STATE) and
// lose nothing; an assemble lays the rows out again. With the switch off a
// decode leaves them laid out.
TEST(GpuBatch, AfterADecodeFromFramesTheExecutionBufferIsRefusedUntilAnAssemble) {
  REQUIRE_GPU();
  for (const bool from_frames : {true, false}) {
    SCOPED_TRACE(testing::Message() << "from frames " << from_frames);
    wkvtest::ScopedEnv rows("WKV_DECODE_FROM_FRAMES", from_frames ? "1" : "0");
    Twin t(graph_config(kQ, kKV), 2);
    t.prompt(700);
    wavekv::Plan pon(t.on), poff(t.off);
    KeyGen qgen(kKV, kD, 67);
    t.append(1);
    ASSERT_TRUE(t.decode(qgen, pon, poff));
    wkv_xbuf_view v;
    wkv_xbuf_view_init(&v);
    Dev out(size_t(2) * kQ * kD * 2), q(size_t(2) * kQ * kD * 2);
    ASSERT_EQ(cudaMemset(q.p, 0, size_t(2) * kQ * kD * 2), cudaSuccess);
    const int want = from_frames ? WKV_ERR_STATE : WKV_OK;
    EXPECT_EQ(wkv_plan_xbuf(pon.get(), &v), want);
    if (from_frames) {
      EXPECT_NE(std::string(wkv_last_error()).find("attended from where its rows live"), std::string::npos);
    }
    EXPECT_EQ(wkv_attend(pon.get(), out.p, 0, 0, nullptr, t.stream), want);
    // The lookup, assemble and attend of the split verbs work after it, and
    // the decodes go on exact.
    wkv_seq *const *seqs = t.hon.data();
    ASSERT_EQ(wkv_lookup(pon.get(), seqs, 2, 0, q.p, 0, 0, t.stream), WKV_OK);
    ASSERT_EQ(wkv_assemble(pon.get(), t.stream), WKV_OK);
    EXPECT_EQ(wkv_plan_xbuf(pon.get(), &v), WKV_OK);
    EXPECT_EQ(wkv_attend(pon.get(), out.p, 0, 0, nullptr, t.stream), WKV_OK);
    EXPECT_EQ(wkv_update(pon.get(), t.stream), WKV_OK);
    ASSERT_EQ(cudaStreamSynchronize(t.stream), cudaSuccess);
    ASSERT_EQ(wkv_lookup(poff.get(), t.hoff.data(), 2, 0, q.p, 0, 0, t.stream), WKV_OK);
    ASSERT_EQ(wkv_assemble(poff.get(), t.stream), WKV_OK);
    ASSERT_EQ(wkv_update(poff.get(), t.stream), WKV_OK);
    for (int step = 0; step < 4; ++step) {
      t.append(1);
      EXPECT_TRUE(t.decode(qgen, pon, poff)) << "step " << step;
    }
  }
}
