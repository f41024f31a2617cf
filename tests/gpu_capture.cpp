// Steps a runtime captures (wkv_plan_bind, docs/runtime-capture.md): a
// bound plan's appends and decodes of every layer captured into one CUDA
// graph of the test's own, replayed after a wkv_plan_prepare each. Every
// replay is checked bit for bit against an engine fed the same tokens and
// queries through the uncaptured verbs, across index growths; the loop
// enqueues steps behind a gate without waiting for the stream; the faults a
// runtime can make (a replay without prepare, a graph of an earlier
// binding, a graph missing a call, steps prepared and never launched) give
// NaN and an error, never a wrong result, and lose nothing stored. Skips
// where no CUDA device exists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gpu_support.hpp"
#include "support.hpp"
#include "wavekv/wavekv.hpp"

using namespace wkvtest;

namespace {

constexpr uint32_t kQ = 8, kKV = 2, kD = 128, kDT = WKV_DTYPE_F16, kN = 4, kL = 2;
constexpr size_t kTokBytes = size_t(kN) * kKV * kD * 2, kQBytes = size_t(kN) * kQ * kD * 2;

wkv_config config() {
  wkv_config c;
  wkv_config_init(&c);
  c.device = WKV_DEVICE_CUDA;
  c.n_layers = kL;
  c.n_q_heads = kQ;
  c.n_kv_heads = kKV;
  c.head_dim = kD;
  c.dtype = kDT;
  c.segment_tokens = 2048;
  c.update_segment_tokens = 32;  // a growth every 32 tokens
  c.window_tokens = 16;
  c.retrieval_frac = 0.25f;  // every zone in use
  c.estimation_frac = 0.25f;
  c.device_cache_bytes = 8u << 20;
  c.threads = 2;
  return c;
}

// The two long tests' configuration under racecheck, where a replayed step
// takes some 10 s (every kernel's shared memory tracked): a growth every 16
// tokens, so that fewer steps cross one.
wkv_config racecheck_config() {
  wkv_config c = config();
  if (under_racecheck()) c.update_segment_tokens = 16;
  return c;
}

std::unique_ptr<Buf> device_bytes(size_t n) { return std::make_unique<Buf>(true, std::vector<uint8_t>(n, 0)); }

// Two engines fed the same tokens and queries: `cap` through a bound plan's
// captured step, `ref` through the verbs. The step's tensors are fixed (a
// runtime's graph keeps its buffers): each layer's new K and V, query, and
// the outputs of each engine.
struct Runs {
  wavekv::Engine cap, ref;
  std::vector<wavekv::Sequence> cs, rs;
  std::vector<wkv_seq *> ch, rh;
  std::vector<KeyGen> gens;  // [seq][layer]
  KeyGen qgen{kKV, kD, 17};
  cudaStream_t stream = nullptr;
  std::unique_ptr<Buf> k[kL], v[kL], q[kL], out_cap[kL], out_ref[kL];
  wavekv::Plan plan_cap, plan_ref;
  // Whether `ref` is fed and stepped: not in the long tests under racecheck,
  // which look for hazards in the captured engine's kernels (the values are
  // checked in every other run).
  bool with_ref = true;

  explicit Runs(const wkv_config &c = config()) : cap(c), ref(c), plan_cap(cap), plan_ref(ref) {
    for (uint32_t i = 0; i < kN; ++i) {
      cs.emplace_back(cap);
      rs.emplace_back(ref);
      ch.push_back(cs.back().get());
      rh.push_back(rs.back().get());
      for (uint32_t l = 0; l < kL; ++l) gens.emplace_back(kKV, kD, 700 + 10 * i + l);
    }
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    for (uint32_t l = 0; l < kL; ++l) {
      k[l] = device_bytes(kTokBytes);
      v[l] = device_bytes(kTokBytes);
      q[l] = device_bytes(kQBytes);
      out_cap[l] = device_bytes(kQBytes);
      out_ref[l] = device_bytes(kQBytes);
    }
  }
  ~Runs() {
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  }

  // T tokens of sequence i at layer l, packed [T][kKV][kD] f16.
  void draw(uint32_t i, uint32_t l, uint32_t T, std::vector<uint8_t> *kb, std::vector<uint8_t> *vb) {
    std::vector<float> kf, vf;
    gens[i * kL + l].next(T, &kf, &vf);
    *kb = pack(kDT, kf);
    *vb = pack(kDT, vf);
  }
  // The prompt, through both engines, every layer ended.
  void prompt(uint32_t T) {
    for (uint32_t i = 0; i < kN; ++i)
      for (uint32_t l = 0; l < kL; ++l) {
        std::vector<uint8_t> kb, vb;
        draw(i, l, T, &kb, &vb);
        Buf dk(true, kb), dv(true, vb);
        cs[i].append(l, dk.p, dv.p, T, 0, 0, stream);
        cs[i].end_prompt(l, stream);
        if (with_ref) {
          rs[i].append(l, dk.p, dv.p, T, 0, 0, stream);
          rs[i].end_prompt(l, stream);
        }
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      }
  }
  // The next token of every sequence and layer, and the queries, as host
  // bytes: per layer K, V ([kN][kKV][kD]) and q ([kN][kQ][kD]).
  struct Inputs {
    std::vector<uint8_t> k[kL], v[kL], q[kL];
  };
  Inputs next() {
    Inputs in;
    for (uint32_t l = 0; l < kL; ++l) {
      for (uint32_t i = 0; i < kN; ++i) {
        std::vector<uint8_t> kb, vb;
        draw(i, l, 1, &kb, &vb);
        in.k[l].insert(in.k[l].end(), kb.begin(), kb.end());
        in.v[l].insert(in.v[l].end(), vb.begin(), vb.end());
      }
      std::vector<float> qf;
      for (uint32_t i = 0; i < kN; ++i)
        for (uint32_t h = 0; h < kKV; ++h) qgen.query(h, kQ / kKV, &qf);
      in.q[l] = pack(kDT, qf);
    }
    return in;
  }
  // (After the stream's work: the copies go on the legacy stream, which a
  // non-blocking stream's replays do not order.)
  void load(const Inputs &in) {
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    for (uint32_t l = 0; l < kL; ++l) {
      ASSERT_EQ(cudaMemcpy(k[l]->p, in.k[l].data(), kTokBytes, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(v[l]->p, in.v[l].data(), kTokBytes, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(q[l]->p, in.q[l].data(), kQBytes, cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  // The reference engine's step over the loaded inputs.
  void ref_step() {
    for (uint32_t l = 0; l < kL; ++l) {
      wavekv::append_batch(rh.data(), kN, l, k[l]->p, v[l]->p, 1, 0, 0, 0, stream);
      plan_ref.decode(rh.data(), kN, l, q[l]->p, out_ref[l]->p, stream);
    }
  }
  // A step through both engines: the next inputs, a prepare and a replay of
  // `exec`, the reference's verbs (with_ref).
  void step(cudaGraphExec_t exec) {
    load(next());
    plan_cap.prepare(stream);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    if (with_ref) ref_step();
  }
  // The captured engine's step, captured: per layer an append and a decode
  // (or `only_layer`'s alone), on `stream`.
  cudaGraphExec_t capture(int only_layer = -1) {
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    int rc = WKV_OK;
    for (uint32_t l = 0; l < kL && rc == WKV_OK; ++l) {
      if (only_layer >= 0 && l != static_cast<uint32_t>(only_layer)) continue;
      rc = wkv_append_batch(ch.data(), kN, l, k[l]->p, v[l]->p, 1, 0, 0, 0, stream);
      if (rc == WKV_OK)
        rc = wkv_decode(plan_cap.get(), ch.data(), kN, l, q[l]->p, 0, 0, out_cap[l]->p, 0, 0, stream);
    }
    EXPECT_EQ(rc, WKV_OK) << wkv_last_error();
    EXPECT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
    cudaGraphDestroy(g);
    return exec;
  }
  // Whether the captured engine's outputs equal the reference's, byte for
  // byte, every layer (and are finite).
  bool same_outputs(std::string *why) {
    for (uint32_t l = 0; l < kL; ++l) {
      const std::vector<uint8_t> a = out_cap[l]->host(), b = out_ref[l]->host();
      for (float x : unpack(kDT, a, size_t(kN) * kQ * kD))
        if (!std::isfinite(x)) {
          *why = "layer " + std::to_string(l) + ": a value not finite";
          return false;
        }
      if (a != b) {
        *why = "layer " + std::to_string(l) + " differs";
        return false;
      }
    }
    return true;
  }
  bool all_nan(uint32_t l) {
    for (float x : unpack(kDT, out_cap[l]->host(), size_t(kN) * kQ * kD))
      if (!std::isnan(x)) return false;
    return true;
  }
};

// A token and a query through both engines uncaptured, compared: the
// sequences after a binding are as the reference's.
void expect_same_uncaptured_step(Runs &r) {
  const Runs::Inputs in = r.next();
  r.load(in);
  for (uint32_t l = 0; l < kL; ++l) {
    wavekv::append_batch(r.ch.data(), kN, l, r.k[l]->p, r.v[l]->p, 1, 0, 0, 0, r.stream);
    r.plan_cap.decode(r.ch.data(), kN, l, r.q[l]->p, r.out_cap[l]->p, r.stream);
  }
  r.ref_step();
  ASSERT_EQ(cudaStreamSynchronize(r.stream), cudaSuccess);
  std::string why;
  EXPECT_TRUE(r.same_outputs(&why)) << why;
  for (uint32_t i = 0; i < kN; ++i)
    for (uint32_t l = 0; l < kL; ++l) EXPECT_EQ(r.cs[i].info(l).tokens, r.rs[i].info(l).tokens);
}

}  // namespace

// The step of two layers captured once and replayed 2000 times, each replay
// after a prepare, across some 60 growths a sequence and layer: every replay's
// output is the verbs', bit for bit; the tokens counted are the same; after
// the binding ends, the sequences decode as the reference's.
TEST(GpuCapture, ReplaysStayExactAcrossGrowths) {
  REQUIRE_GPU();
  const SanitizerPhases phases;
  Runs r(racecheck_config());
  // Under racecheck: the short prompt the fault tests use, 32 steps over
  // growths of 16 tokens, the captured engine alone (racecheck_config): some
  // 10 s a replayed step there, so a call's time holds the test. A growth
  // begins (its k-means, the growth's kernels with shared memory, runs) at
  // the 16th step and would commit at the 48th (segment, window and the
  // growth lag past the prompt's tail): racecheck sees the first.
  r.with_ref = !under_racecheck();
  r.prompt(under_racecheck() ? 300 : 2100);
  phases.mark("prompt");
  const uint32_t kSteps = under_racecheck() ? 32 : under_sanitizer() ? 120 : 2000;
  r.plan_cap.bind(r.ch.data(), kN, kSteps, r.stream);
  const uint32_t segments0 = r.cs[0].info(1).segments;
  const uint64_t began0 = r.cap.stats().growths_deferred;
  cudaGraphExec_t exec = r.capture();
  ASSERT_NE(exec, nullptr);
  phases.mark("bind and capture");
  uint32_t mismatched = 0;
  std::string first;
  for (uint32_t st = 0; st < kSteps; ++st) {
    r.step(exec);
    ASSERT_EQ(cudaStreamSynchronize(r.stream), cudaSuccess);
    std::string why;
    if (r.with_ref && !r.same_outputs(&why)) {
      if (first.empty()) first = "step " + std::to_string(st) + ": " + why;
      ++mismatched;
    }
    if (st % 10 == 9) phases.mark("step " + std::to_string(st + 1));
  }
  EXPECT_EQ(mismatched, 0u) << "replays whose output is not the verbs'; first " << first;
  for (uint32_t i = 0; i < kN && r.with_ref; ++i)
    for (uint32_t l = 0; l < kL; ++l) {
      const wkv_seq_info a = r.cs[i].info(l), b = r.rs[i].info(l);
      EXPECT_EQ(a.tokens, b.tokens);
      EXPECT_EQ(a.segments, b.segments);
      EXPECT_EQ(a.clusters, b.clusters);
    }
  // A growth commits every 32 tokens from the 64th on (under racecheck,
  // growths of 16 tokens begin from the 16th step).
  if (under_racecheck())
    EXPECT_GT(r.cap.stats().growths_deferred, began0) << "a growth began among the replays";
  else
    EXPECT_GE(r.cs[0].info(1).segments, segments0 + (kSteps - 64) / 32) << "the replays crossed growths";
  EXPECT_EQ(wkv_plan_prepare(r.plan_cap.get(), r.stream), WKV_ERR_BUDGET) << "max_steps prepared";
  r.plan_cap.unbind(r.stream);
  cudaGraphExecDestroy(exec);
  if (r.with_ref) expect_same_uncaptured_step(r);
  const wkv_stats s = r.cap.stats();
  EXPECT_GT(s.cache_hits, 0u) << "the replays' gathers read the device cache";
}

// A runtime's loop enqueued behind a gate that holds the stream: each step
// copies its inputs into the captured tensors (stream-ordered), prepares and
// launches the graph, and copies the outputs out; windows of 15 steps (the
// host may run 16 ahead) over some 100 tokens, which begin growths in one
// window and commit them in a later one. Were any prepare to wait for the
// stream, the watchdog would have to open the gate. Then every step's
// output is checked against the verbs'.
TEST(GpuCapture, ALoopOfPreparesAndReplaysNeverWaitsForTheStream) {
  REQUIRE_GPU();
  const SanitizerPhases phases;
  Runs r(racecheck_config());
  // Under racecheck the short prompt, 2 windows, not 7, over growths of 16
  // tokens, the captured engine alone (as in ReplaysStayExactAcrossGrowths):
  // growths begin in the loop, none commits.
  r.with_ref = !under_racecheck();
  r.prompt(under_racecheck() ? 300 : 2100);
  phases.mark("prompt");
  const uint32_t kWindow = 15, kWindows = under_racecheck() ? 2 : 7, kSteps = kWindow * kWindows;
  std::vector<Runs::Inputs> ins;
  for (uint32_t st = 0; st < kSteps; ++st) ins.push_back(r.next());
  // Inputs staged on the device, outputs collected there.
  std::unique_ptr<Buf> sk[kL], sv[kL], sq[kL], so[kL];
  for (uint32_t l = 0; l < kL; ++l) {
    std::vector<uint8_t> kb, vb, qb;
    for (const Runs::Inputs &in : ins) {
      kb.insert(kb.end(), in.k[l].begin(), in.k[l].end());
      vb.insert(vb.end(), in.v[l].begin(), in.v[l].end());
      qb.insert(qb.end(), in.q[l].begin(), in.q[l].end());
    }
    sk[l] = std::make_unique<Buf>(true, kb);
    sv[l] = std::make_unique<Buf>(true, vb);
    sq[l] = std::make_unique<Buf>(true, qb);
    so[l] = device_bytes(kSteps * kQBytes);
  }
  r.plan_cap.bind(r.ch.data(), kN, kSteps, r.stream);
  cudaGraphExec_t exec = r.capture();
  ASSERT_NE(exec, nullptr);
  // (No warm-up: the graph's kernels load when it is instantiated, the
  // check a growth's begin enqueues when the plan is bound, the k-means's
  // and a commit's with the prompt's growths; CUDA's lazy loading may
  // synchronize at a kernel's first launch: docs/gpu-serving.md.)
  auto at = [](const std::unique_ptr<Buf> &b, uint32_t st, size_t bytes) {
    return static_cast<uint8_t *>(b->p) + size_t(st) * bytes;
  };
  auto steps = [&](uint32_t first) {
    for (uint32_t st = first; st < first + kWindow; ++st) {
      for (uint32_t l = 0; l < kL; ++l) {
        cudaMemcpyAsync(r.k[l]->p, at(sk[l], st, kTokBytes), kTokBytes, cudaMemcpyDeviceToDevice, r.stream);
        cudaMemcpyAsync(r.v[l]->p, at(sv[l], st, kTokBytes), kTokBytes, cudaMemcpyDeviceToDevice, r.stream);
        cudaMemcpyAsync(r.q[l]->p, at(sq[l], st, kQBytes), kQBytes, cudaMemcpyDeviceToDevice, r.stream);
      }
      r.plan_cap.prepare(r.stream);
      cudaGraphLaunch(exec, r.stream);
      for (uint32_t l = 0; l < kL; ++l)
        cudaMemcpyAsync(at(so[l], st, kQBytes), r.out_cap[l]->p, kQBytes, cudaMemcpyDeviceToDevice, r.stream);
    }
  };
  const bool gated = !under_sanitizer();
  if (!gated) std::printf("note: under compute-sanitizer, the loop is not gated (only its outputs are checked)\n");
  const uint64_t began0 = r.cap.stats().growths_deferred;
  const uint32_t segments0 = r.cs[0].info(0).segments;
  for (uint32_t w = 0; w < kWindows; ++w) {
    Gate gate;
    if (gated)
      EXPECT_TRUE(gate.run_closed(r.stream, [&] { steps(w * kWindow); }, std::chrono::seconds(30)))
          << "a prepare of window " << w << " waited for the stream";
    else
      steps(w * kWindow);
    ASSERT_EQ(cudaStreamSynchronize(r.stream), cudaSuccess);
    phases.mark("window " + std::to_string(w + 1));
  }
  EXPECT_GT(r.cap.stats().growths_deferred, began0) << "growths began in the loop";
  if (!under_racecheck()) {
    EXPECT_GT(r.cs[0].info(0).segments, segments0) << "growths committed in the loop";
  }
  r.plan_cap.unbind(r.stream);
  cudaGraphExecDestroy(exec);
  if (!r.with_ref) return;
  uint32_t mismatched = 0;
  for (uint32_t st = 0; st < kSteps; ++st) {
    r.load(ins[st]);
    r.ref_step();
    ASSERT_EQ(cudaStreamSynchronize(r.stream), cudaSuccess);
    for (uint32_t l = 0; l < kL; ++l) {
      std::vector<uint8_t> got(kQBytes);
      ASSERT_EQ(cudaMemcpy(got.data(), at(so[l], st, kQBytes), kQBytes, cudaMemcpyDeviceToHost), cudaSuccess);
      if (got != r.out_ref[l]->host()) ++mismatched;
    }
  }
  EXPECT_EQ(mismatched, 0u) << "steps whose captured output is not the verbs'";
  phases.mark("the reference's steps");
}

// A replay without a prepare: no work, NaN out, and the binding faults; the
// next prepare says why; unbinding loses nothing (the sequences then decode
// as the reference's, which never saw the replay).
TEST(GpuCapture, AReplayWithoutPrepareWritesNaNAndBreaksTheBinding) {
  REQUIRE_GPU();
  Runs r;
  r.prompt(300);
  r.plan_cap.bind(r.ch.data(), kN, 64, r.stream);
  cudaGraphExec_t exec = r.capture();
  for (int st = 0; st < 3; ++st) {
    r.step(exec);
  }
  ASSERT_EQ(cudaStreamSynchronize(r.stream), cudaSuccess);
  std::string why;
  EXPECT_TRUE(r.same_outputs(&why)) << why;
  const uint64_t tokens = r.cs[0].info(0).tokens;
  ASSERT_EQ(cudaGraphLaunch(exec, r.stream), cudaSuccess);  // not prepared
  ASSERT_EQ(cudaStreamSynchronize(r.stream), cudaSuccess);
  for (uint32_t l = 0; l < kL; ++l) EXPECT_TRUE(r.all_nan(l)) << "layer " << l;
  EXPECT_EQ(wkv_plan_prepare(r.plan_cap.get(), r.stream), WKV_ERR_STATE);
  EXPECT_NE(std::string(wkv_last_error()).find("without wkv_plan_prepare"), std::string::npos) << wkv_last_error();
  // Every later replay, prepared or not, does nothing.
  ASSERT_EQ(cudaGraphLaunch(exec, r.stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(r.stream), cudaSuccess);
  EXPECT_TRUE(r.all_nan(0));
  EXPECT_EQ(r.cs[0].info(0).tokens, tokens);
  r.plan_cap.unbind(r.stream);
  expect_same_uncaptured_step(r);
  cudaGraphExecDestroy(exec);
}

// Steps prepared and never launched: unbind takes their tokens back (they
// were counted, never written); a prepare before the previous replay was
// launched (its growth would read rows not yet written) faults once it
// begins a growth.
TEST(GpuCapture, StepsPreparedAndNeverReplayedAreTakenBack) {
  REQUIRE_GPU();
  Runs r;
  r.prompt(300);
  r.plan_cap.bind(r.ch.data(), kN, 64, r.stream);
  cudaGraphExec_t exec = r.capture();
  r.step(exec);
  const uint64_t tokens = r.cs[0].info(0).tokens;
  r.plan_cap.prepare(r.stream);
  r.plan_cap.prepare(r.stream);
  EXPECT_EQ(r.cs[0].info(0).tokens, tokens + 2) << "prepared tokens count";
  r.plan_cap.unbind(r.stream);
  for (uint32_t i = 0; i < kN; ++i)
    for (uint32_t l = 0; l < kL; ++l) EXPECT_EQ(r.cs[i].info(l).tokens, tokens) << "seq " << i << " layer " << l;
  expect_same_uncaptured_step(r);
  cudaGraphExecDestroy(exec);
}

// Graphs that do not hold the binding's step: one of an earlier binding,
// and one holding a part of a step captured twice. Each faults: NaN, and
// the next prepare names the fault.
TEST(GpuCapture, GraphsOfAnotherBindingOrMissingACallFault) {
  REQUIRE_GPU();
  Runs r;
  r.prompt(300);
  r.plan_cap.bind(r.ch.data(), kN, 64, r.stream);
  cudaGraphExec_t old = r.capture();
  r.step(old);
  r.plan_cap.unbind(r.stream);
  // A new binding, its own step; the old graph replayed after a prepare.
  r.plan_cap.bind(r.ch.data(), kN, 64, r.stream);
  cudaGraphExec_t fresh = r.capture();
  r.load(r.next());
  r.plan_cap.prepare(r.stream);
  ASSERT_EQ(cudaGraphLaunch(old, r.stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(r.stream), cudaSuccess);
  EXPECT_TRUE(r.all_nan(0));
  EXPECT_EQ(wkv_plan_prepare(r.plan_cap.get(), r.stream), WKV_ERR_STATE);
  EXPECT_NE(std::string(wkv_last_error()).find("earlier binding"), std::string::npos) << wkv_last_error();
  r.plan_cap.unbind(r.stream);  // takes back the step the fresh graph never ran
  expect_same_uncaptured_step(r);
  cudaGraphExecDestroy(fresh);

  // A step captured in two graphs (layer 0's calls, then layer 1's): a
  // replay of either misses the other's calls.
  r.plan_cap.bind(r.ch.data(), kN, 64, r.stream);
  cudaGraphExec_t first = r.capture(0), second = r.capture(1);
  r.load(r.next());
  r.plan_cap.prepare(r.stream);
  ASSERT_EQ(cudaGraphLaunch(second, r.stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(r.stream), cudaSuccess);
  EXPECT_TRUE(r.all_nan(1)) << "layer 1's calls ran without layer 0's before them";
  EXPECT_EQ(wkv_plan_prepare(r.plan_cap.get(), r.stream), WKV_ERR_STATE);
  EXPECT_NE(std::string(wkv_last_error()).find("every captured call"), std::string::npos) << wkv_last_error();
  r.plan_cap.unbind(r.stream);
  expect_same_uncaptured_step(r);
  cudaGraphExecDestroy(first);
  cudaGraphExecDestroy(second);
  cudaGraphExecDestroy(old);
}

// While bound, the batch cannot change under the capture: its sequences
// refuse every other append, lookup, prompt end and save, the plan every
// other step; misuse of the new verbs is refused with nothing changed; a
// bound plan destroyed frees its sequences.
TEST(GpuCapture, ABindingRefusesWhatWouldChangeItsBatch) {
  REQUIRE_GPU();
  Runs r;
  r.prompt(300);
  wkv_plan *p = r.plan_cap.get();
  EXPECT_EQ(wkv_plan_prepare(p, r.stream), WKV_ERR_STATE) << "not bound";
  EXPECT_EQ(wkv_plan_unbind(p, r.stream), WKV_ERR_STATE) << "not bound";
  EXPECT_EQ(wkv_plan_bind(p, nullptr, kN, 0, r.stream), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(wkv_plan_bind(nullptr, r.ch.data(), kN, 0, r.stream), WKV_ERR_INVALID_HANDLE);
  std::vector<wkv_seq *> twice = {r.ch[0], r.ch[0]};
  EXPECT_EQ(wkv_plan_bind(p, twice.data(), 2, 0, r.stream), WKV_ERR_INVALID_ARGUMENT);
  {
    wavekv::Sequence empty(r.cap);
    wkv_seq *e = empty.get();
    EXPECT_EQ(wkv_plan_bind(p, &e, 1, 0, r.stream), WKV_ERR_INVALID_ARGUMENT) << "a sequence without tokens";
  }
  r.plan_cap.bind(r.ch.data(), kN, 8, r.stream);
  EXPECT_EQ(wkv_plan_bind(p, r.ch.data(), kN, 0, r.stream), WKV_ERR_STATE) << "bound already";
  wavekv::Plan other(r.cap);
  EXPECT_EQ(wkv_plan_bind(other.get(), r.ch.data(), 1, 0, r.stream), WKV_ERR_STATE) << "a sequence bound already";
  EXPECT_EQ(wkv_plan_prepare(p, r.stream), WKV_ERR_STATE) << "nothing captured";
  // Uncaptured use of the batch or the plan.
  const uint64_t tokens = r.cs[0].info(0).tokens;
  EXPECT_EQ(wkv_append_batch(r.ch.data(), kN, 0, r.k[0]->p, r.v[0]->p, 1, 0, 0, 0, r.stream), WKV_ERR_STATE);
  EXPECT_EQ(wkv_seq_append(r.ch[1], 0, r.k[0]->p, r.v[0]->p, 1, 0, 0, r.stream), WKV_ERR_STATE);
  EXPECT_EQ(wkv_decode(p, r.ch.data(), kN, 0, r.q[0]->p, 0, 0, r.out_cap[0]->p, 0, 0, r.stream), WKV_ERR_STATE);
  EXPECT_EQ(wkv_decode(other.get(), r.ch.data(), kN, 0, r.q[0]->p, 0, 0, r.out_cap[0]->p, 0, 0, r.stream),
            WKV_ERR_STATE);
  EXPECT_EQ(wkv_seq_end_prompt(r.ch[0], 0, r.stream), WKV_ERR_STATE);
  EXPECT_EQ(wkv_seq_save(r.ch[0], "/nonexistent-dir/x.wkv", 0), WKV_ERR_STATE);
  EXPECT_EQ(r.cs[0].info(0).tokens, tokens);
  // Captures that are not the binding's step: refused, the capture left
  // valid and empty.
  cudaGraph_t g = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(r.stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  std::vector<wkv_seq *> reversed(r.ch.rbegin(), r.ch.rend());
  EXPECT_EQ(wkv_append_batch(reversed.data(), kN, 0, r.k[0]->p, r.v[0]->p, 1, 0, 0, 0, r.stream), WKV_ERR_STATE);
  EXPECT_EQ(wkv_append_batch(r.ch.data(), kN, 0, r.k[0]->p, r.v[0]->p, 2, 0, 0, 0, r.stream),
            WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(wkv_append_batch(r.ch.data(), kN - 1, 0, r.k[0]->p, r.v[0]->p, 1, 0, 0, 0, r.stream), WKV_ERR_STATE);
  EXPECT_EQ(wkv_decode(other.get(), r.ch.data(), kN, 0, r.q[0]->p, 0, 0, r.out_cap[0]->p, 0, 0, r.stream),
            WKV_ERR_UNSUPPORTED)
      << "an unbound plan's capture";
  EXPECT_EQ(wkv_plan_prepare(p, r.stream), WKV_ERR_UNSUPPORTED) << "prepare on a stream being captured";
  ASSERT_EQ(cudaStreamEndCapture(r.stream, &g), cudaSuccess);
  size_t nodes = 1;
  ASSERT_EQ(cudaGraphGetNodes(g, nullptr, &nodes), cudaSuccess);
  EXPECT_EQ(nodes, 0u) << "nothing was enqueued";
  cudaGraphDestroy(g);
  // The step, then its budget of 8 steps.
  cudaGraphExec_t exec = r.capture();
  for (int st = 0; st < 8; ++st) {
    r.step(exec);
  }
  EXPECT_EQ(wkv_plan_prepare(p, r.stream), WKV_ERR_BUDGET);
  ASSERT_EQ(cudaStreamSynchronize(r.stream), cudaSuccess);
  std::string why;
  EXPECT_TRUE(r.same_outputs(&why)) << why;
  // A capture after the first prepare: refused.
  ASSERT_EQ(cudaStreamBeginCapture(r.stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(wkv_append_batch(r.ch.data(), kN, 0, r.k[0]->p, r.v[0]->p, 1, 0, 0, 0, r.stream), WKV_ERR_STATE);
  ASSERT_EQ(cudaStreamEndCapture(r.stream, &g), cudaSuccess);
  cudaGraphDestroy(g);
  cudaGraphExecDestroy(exec);
  // The plan destroyed while bound: its sequences are free again.
  {
    wavekv::Plan doomed(r.cap);
    r.plan_cap.unbind(r.stream);
    doomed.bind(r.ch.data(), kN, 8, r.stream);
  }
  expect_same_uncaptured_step(r);
}
