// The engine on a GPU, through the public ABI: it matches the CPU engine and
// exact attention, a whole step can be captured in a CUDA graph and replayed,
// the block cache warms up and respects its size, and bad input is refused
// without harming the engine. Skips where no CUDA device exists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "gpu_support.hpp"
#include "support.hpp"
#include "wavekv/wavekv.hpp"

using namespace wkvtest;

namespace {

constexpr uint32_t kQ = 8, kKV = 2, kD = 128, kDT = WKV_DTYPE_F16;

wkv_config config(uint32_t device, float retrieval = 0.018f, float estimation = 0.232f,
                  uint64_t cache_bytes = 8u << 20) {
  wkv_config c;
  wkv_config_init(&c);
  c.device = device;
  c.n_layers = 1;
  c.n_q_heads = kQ;
  c.n_kv_heads = kKV;
  c.head_dim = kD;
  c.dtype = kDT;
  c.segment_tokens = 2048;
  c.update_segment_tokens = 512;
  c.retrieval_frac = retrieval;
  c.estimation_frac = estimation;
  c.device_cache_bytes = cache_bytes;
  c.threads = 2;
  return c;
}

// Device memory holding a copy of a host vector.
struct DevVec {
  void *p = nullptr;
  size_t n = 0;
  explicit DevVec(const std::vector<uint8_t> &h) : n(h.size()) {
    EXPECT_EQ(cudaMalloc(&p, n), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, h.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
  }
  explicit DevVec(size_t bytes) : n(bytes) { EXPECT_EQ(cudaMalloc(&p, n), cudaSuccess); }
  ~DevVec() { cudaFree(p); }
  std::vector<uint8_t> host() const {
    std::vector<uint8_t> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

// The manager applies a step's accesses after the step, on its own thread:
// waits (up to 10 s) until it has applied every step's, so that the next
// step can see them (a busy machine may otherwise run several steps first).
bool manager_caught_up(const wavekv::Engine &e) {
  for (int i = 0; i < 2000; ++i) {
    if (e.stats().manager_backlog == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

// Generated tokens and queries of one context, its rows kept for exact
// attention.
struct Context {
  std::vector<HeadRows> rows{kKV};
  KeyGen gen;
  explicit Context(uint64_t seed) : gen(kKV, kD, seed) {}

  // n fresh tokens rounded to the storage type, packed [n][kKV][kD].
  void draw(uint32_t n, std::vector<uint8_t> *kb, std::vector<uint8_t> *vb) {
    std::vector<float> k, v;
    gen.next(n, &k, &v);
    for (float &x : k) x = round_to(kDT, x);
    for (float &x : v) x = round_to(kDT, x);
    *kb = pack(kDT, k);
    *vb = pack(kDT, v);
    for (uint32_t t = 0; t < n; ++t)
      for (uint32_t h = 0; h < kKV; ++h) {
        size_t off = (static_cast<size_t>(t) * kKV + h) * kD;
        rows[h].k.insert(rows[h].k.end(), k.begin() + off, k.begin() + off + kD);
        rows[h].v.insert(rows[h].v.end(), v.begin() + off, v.begin() + off + kD);
      }
  }
  std::vector<float> query() {
    std::vector<float> q;
    for (uint32_t h = 0; h < kKV; ++h) gen.query(h, kQ / kKV, &q);
    for (float &x : q) x = round_to(kDT, x);
    return q;
  }
  // Worst relative L2 error over the query heads against exact attention.
  double error(const std::vector<float> &q, const std::vector<float> &out) {
    std::vector<double> ref;
    double worst = 0;
    for (uint32_t h = 0; h < kQ; ++h) {
      exact_attention(&q[h * kD], rows[h / (kQ / kKV)], kD, &ref);
      worst = std::max(worst, rel_l2(&out[h * kD], ref));
    }
    return worst;
  }
};

// One context appended to a CPU and a CUDA sequence alike.
struct Twin : Context {
  wavekv::Engine cpu, gpu;
  wavekv::Sequence scpu, sgpu;
  wavekv::Plan pcpu, pgpu;
  cudaStream_t stream = nullptr;

  Twin(float r, float e, uint64_t cache_bytes = 8u << 20)
      : Context(42),
        cpu(config(WKV_DEVICE_CPU, r, e)), gpu(config(WKV_DEVICE_CUDA, r, e, cache_bytes)), scpu(cpu), sgpu(gpu),
        pcpu(cpu), pgpu(gpu) {
    cudaStreamCreate(&stream);
  }
  ~Twin() { cudaStreamDestroy(stream); }

  void append(uint32_t n) {
    std::vector<uint8_t> kb, vb;
    draw(n, &kb, &vb);
    scpu.append(0, kb.data(), vb.data(), n);
    DevVec dk(kb), dv(vb);
    sgpu.append(0, dk.p, dv.p, n, 0, 0, stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  std::vector<float> decode_cpu(const std::vector<float> &q) {
    auto qb = pack(kDT, q);
    std::vector<uint8_t> ob(qb.size());
    wkv_seq *s = scpu.get();
    pcpu.decode(&s, 1, 0, qb.data(), ob.data());
    return unpack(kDT, ob, q.size());
  }
  std::vector<float> decode_gpu(const std::vector<float> &q) {
    DevVec dq(pack(kDT, q)), dout(q.size() * 2);
    wkv_seq *s = sgpu.get();
    pgpu.decode(&s, 1, 0, dq.p, dout.p, stream);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    return unpack(kDT, dout.host(), q.size());
  }
};

}  // namespace

TEST(GpuEngine, FullRetrievalMatchesCpuEngineAndExactAttention) {
  REQUIRE_GPU();
  Twin t(1.0f, 0.0f);
  t.append(5000);
  for (int step = 0; step < 4; ++step) {
    std::vector<float> q = t.query();
    std::vector<float> g = t.decode_gpu(q), c = t.decode_cpu(q);
    EXPECT_LT(t.error(q, g), 1e-2);
    EXPECT_LT(t.error(q, c), 1e-2);
    t.append(300);  // crosses an update segment
  }
  EXPECT_EQ(t.sgpu.info(0).segments, t.scpu.info(0).segments);
  EXPECT_EQ(t.sgpu.info(0).tail, t.scpu.info(0).tail);
}

// A CUDA engine gathers 16 complete prompt segments per head before it
// clusters them during the appends (a layer's prompt in one batch); the cuts
// are the CPU engine's, so the end of the prompt leaves the same index.
TEST(GpuEngine, PromptSegmentsAreBatchedWithTheCpuEnginesCuts) {
  REQUIRE_GPU();
  Twin t(1.0f, 0.0f);
  for (int i = 0; i < 10; ++i) t.append(3000);  // 30000 = sink 4 + window 64 + 14.6 segments
  EXPECT_EQ(t.scpu.info(0).segments, 14u);
  EXPECT_EQ(t.sgpu.info(0).segments, 0u);
  EXPECT_EQ(t.sgpu.info(0).tail, 30000u - 4u);
  t.append(3000);  // 16.08 segments beyond the window
  EXPECT_EQ(t.scpu.info(0).segments, 16u);
  EXPECT_EQ(t.sgpu.info(0).segments, 16u);
  t.append(500);
  t.scpu.end_prompt(0);
  t.sgpu.end_prompt(0, t.stream);
  const wkv_seq_info c = t.scpu.info(0), g = t.sgpu.info(0);
  EXPECT_EQ(g.segments, 17u);
  EXPECT_EQ(g.segments, c.segments);
  EXPECT_EQ(g.tail, c.tail);
  EXPECT_EQ(g.clustered, c.clustered);
  EXPECT_EQ(g.pages, c.pages);
  EXPECT_EQ(g.generating, 1u);
  for (int step = 0; step < 2; ++step) {
    std::vector<float> q = t.query();
    EXPECT_LT(t.error(q, t.decode_gpu(q)), 1e-2);
    EXPECT_LT(t.error(q, t.decode_cpu(q)), 1e-2);
    t.append(1);
  }
}

TEST(GpuEngine, DefaultBudgetIsAsAccurateAsTheCpuEngine) {
  REQUIRE_GPU();
  Twin t(0.018f, 0.232f);
  t.append(12000);
  std::vector<double> eg, ec;
  for (int step = 0; step < 16; ++step) {
    std::vector<float> q = t.query();
    eg.push_back(t.error(q, t.decode_gpu(q)));
    ec.push_back(t.error(q, t.decode_cpu(q)));
  }
  std::printf("median worst-head error: gpu %.4f cpu %.4f\n", median(eg), median(ec));
  EXPECT_LT(median(eg), median(ec) * 1.25 + 0.01);
}

// Until whole-step graphs exist, a step captured into a CUDA graph would
// replay its run table and epochs as they were: capturing is refused before
// anything is enqueued or changed, and the engine stays usable (the capture
// ends cleanly, with nothing of the engine in it).
TEST(GpuEngine, CapturingAStepIsRefusedAndChangesNothing) {
  REQUIRE_GPU();
  Twin t(0.018f, 0.232f);
  t.append(6000);
  std::vector<float> q = t.query();
  std::vector<float> direct = t.decode_gpu(q);
  DevVec dq(pack(kDT, q)), dout(q.size() * 2);
  std::vector<uint8_t> kb, vb;
  t.draw(1, &kb, &vb);
  DevVec dk(kb), dv(vb);
  wkv_seq *s = t.sgpu.get();
  const wkv_seq_info before = t.sgpu.info(0);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(t.stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const int rc_decode = wkv_decode(t.pgpu.get(), &s, 1, 0, dq.p, 0, 0, dout.p, 0, 0, t.stream);
  const std::string msg = wkv_last_error();
  const int rc_append = wkv_seq_append(s, 0, dk.p, dv.p, 1, 0, 0, t.stream);
  const int rc_lookup = wkv_lookup(t.pgpu.get(), &s, 1, 0, dq.p, 0, 0, t.stream);
  ASSERT_EQ(cudaStreamEndCapture(t.stream, &graph), cudaSuccess) << "the refused calls left the capture valid";
  EXPECT_EQ(rc_decode, WKV_ERR_UNSUPPORTED);
  EXPECT_NE(msg.find("captured"), std::string::npos) << msg;
  EXPECT_EQ(rc_append, WKV_ERR_UNSUPPORTED);
  EXPECT_EQ(rc_lookup, WKV_ERR_UNSUPPORTED);
  size_t nodes = 1;
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
  EXPECT_EQ(nodes, 0u) << "nothing was enqueued";
  cudaGraphDestroy(graph);
  EXPECT_EQ(t.sgpu.info(0).tokens, before.tokens) << "nothing was appended";
  EXPECT_EQ(t.decode_gpu(q), direct) << "the engine is as before";
}

// Defect 1 of the redesign: a plan destroyed between lookup and update (or a
// step never updated) left its epoch in flight for ever; quarantined frames
// were never released again and the cache drained to nothing. Here every
// step's plan is destroyed right after its assemble, over a cache smaller
// than what the steps read: frames keep being evicted and admitted again.
TEST(GpuEngine, AbandonedStepsStillGiveTheirFramesBack) {
  REQUIRE_GPU();
  Twin t(0.2f, 0.2f, 96 * 4096);
  t.append(12000);
  std::vector<std::unique_ptr<DevVec>> keep;
  for (int i = 0; i < 40; ++i) {
    std::vector<float> q = t.query();
    keep.push_back(std::make_unique<DevVec>(pack(kDT, q)));
    wavekv::Plan p(t.gpu);
    wkv_seq *s = t.sgpu.get();
    ASSERT_EQ(wkv_lookup(p.get(), &s, 1, 0, keep.back()->p, 0, 0, t.stream), WKV_OK) << wkv_last_error();
    ASSERT_EQ(wkv_assemble(p.get(), t.stream), WKV_OK) << wkv_last_error();
  }  // each plan destroyed with its step in flight, never updated
  ASSERT_EQ(cudaStreamSynchronize(t.stream), cudaSuccess);
  ASSERT_TRUE(manager_caught_up(t.gpu));
  const wkv_stats s0 = t.gpu.stats();
  std::printf("after 40 abandoned steps: %llu admissions, %llu evictions (cache of 96 frames)\n",
              static_cast<unsigned long long>(s0.cache_admissions),
              static_cast<unsigned long long>(s0.cache_evictions));
  EXPECT_GT(s0.cache_admissions, 2u * 96u) << "frames were freed and admitted again";
  EXPECT_GT(s0.cache_evictions, 96u);
  // The cache still serves: a repeated query hits.
  std::vector<float> q = t.query();
  t.decode_gpu(q);
  ASSERT_TRUE(manager_caught_up(t.gpu));
  const wkv_stats s1 = t.gpu.stats();
  EXPECT_LT(t.error(q, t.decode_gpu(q)), 1e-1);
  const wkv_stats s2 = t.gpu.stats();
  EXPECT_GT(s2.cache_hits, s1.cache_hits);
}

TEST(GpuEngine, CacheWarmsUpOverRepeatedQueriesAndKeepsItsSize) {
  REQUIRE_GPU();
  Twin t(0.05f, 0.2f);
  t.append(8000);
  std::vector<float> q = t.query();
  std::vector<float> first = t.decode_gpu(q);
  ASSERT_TRUE(manager_caught_up(t.gpu));
  wkv_stats s0 = t.gpu.stats();
  EXPECT_GT(s0.cache_admissions, 0u) << "the first step's misses are admitted";
  for (int i = 0; i < 6; ++i) {
    t.decode_gpu(q);
    ASSERT_TRUE(manager_caught_up(t.gpu));
  }
  wkv_stats s1 = t.gpu.stats();
  uint64_t hits = s1.cache_hits - s0.cache_hits, misses = s1.cache_misses - s0.cache_misses;
  std::printf("after warm-up: %llu hits, %llu misses, %llu admissions, %llu evictions\n",
              static_cast<unsigned long long>(hits), static_cast<unsigned long long>(misses),
              static_cast<unsigned long long>(s1.cache_admissions),
              static_cast<unsigned long long>(s1.cache_evictions));
  EXPECT_EQ(misses, 0u) << "the same query again reads only cached pages";
  EXPECT_GT(hits, 0u);
  EXPECT_EQ(s1.device_cache_bytes <= (8u << 20), true);
  EXPECT_EQ(t.decode_gpu(q), first) << "cached pages give the same result";
}

// A cache of 64 pages under steps that each read ~2000: every step evicts,
// and steps are enqueued back to back, so the manager evicts while later
// steps are in flight. A slot is reused only once no step that could read
// its old page is in flight: every result stays exact.
TEST(GpuEngine, EvictionsNeverTouchPagesOfStepsInFlight) {
  REQUIRE_GPU();
  Twin t(1.0f, 0.0f, 64 * 4096);
  t.append(8000);
  constexpr int kSteps = 24;
  std::vector<std::vector<float>> qs;
  std::vector<std::unique_ptr<DevVec>> dq, dout;
  for (int i = 0; i < kSteps; ++i) {
    qs.push_back(t.query());
    dq.push_back(std::make_unique<DevVec>(pack(kDT, qs.back())));
    dout.push_back(std::make_unique<DevVec>(qs.back().size() * 2));
  }
  wkv_seq *s = t.sgpu.get();
  for (int i = 0; i < kSteps; ++i)
    ASSERT_EQ(wkv_decode(t.pgpu.get(), &s, 1, 0, dq[i]->p, 0, 0, dout[i]->p, 0, 0, t.stream), WKV_OK)
        << wkv_last_error();
  ASSERT_EQ(cudaStreamSynchronize(t.stream), cudaSuccess);
  for (int i = 0; i < kSteps; ++i)
    EXPECT_LT(t.error(qs[i], unpack(kDT, dout[i]->host(), qs[i].size())), 1e-2) << "step " << i;
  ASSERT_TRUE(manager_caught_up(t.gpu));
  const wkv_stats st = t.gpu.stats();
  std::printf("%llu admissions, %llu evictions, %llu hits, %llu misses\n",
              static_cast<unsigned long long>(st.cache_admissions),
              static_cast<unsigned long long>(st.cache_evictions), static_cast<unsigned long long>(st.cache_hits),
              static_cast<unsigned long long>(st.cache_misses));
  EXPECT_GT(st.cache_evictions, 0u);
  EXPECT_LE(st.device_cache_bytes, 64u * 4096u);
  // Then one step at a time, the manager caught up in between: each step
  // reads the mirror as the previous step's admissions and evictions left
  // it (a step reads 32 times the cache, so it evicts its own admissions).
  for (int i = 0; i < 6; ++i) {
    std::vector<float> q = t.query();
    EXPECT_LT(t.error(q, t.decode_gpu(q)), 1e-2) << "step " << i << " after the manager caught up";
    ASSERT_TRUE(manager_caught_up(t.gpu));
  }
}

// Two threads grow the indexes of two sequences of one engine at once, each
// on its own stream, then decode. The engine's k-means buffers serve every
// growth: they take turns, and each waits on the device for the previous
// one's reads. The 8 MiB cache holds fewer pages than one step reads, so the
// manager evicts pages it admitted for the same step (this caught a mirror
// left on a quarantined slot). Both sequences stay exact.
TEST(GpuEngine, ConcurrentGrowthsOnTwoStreamsStayExact) {
  REQUIRE_GPU();
  wavekv::Engine gpu(config(WKV_DEVICE_CUDA, 1.0f, 0.0f));
  struct Side : Context {
    wavekv::Sequence seq;
    wavekv::Plan plan;
    cudaStream_t stream = nullptr;
    double worst = 0;
    std::string failure;
    Side(const wavekv::Engine &e, uint64_t seed) : Context(seed), seq(e), plan(e) {
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    }
    ~Side() { cudaStreamDestroy(stream); }
    // Device copies of host bytes, ordered on this (non-blocking) stream:
    // a plain cudaMemcpy from pageable memory may still be landing when a
    // non-blocking stream reads.
    std::unique_ptr<DevVec> upload(const std::vector<uint8_t> &h) {
      auto d = std::make_unique<DevVec>(h.size());
      EXPECT_EQ(cudaMemcpyAsync(d->p, h.data(), h.size(), cudaMemcpyHostToDevice, stream), cudaSuccess);
      return d;
    }
    void add(uint32_t n) {
      std::vector<uint8_t> kb, vb;
      draw(n, &kb, &vb);
      auto dk = upload(kb), dv = upload(vb);
      seq.append(0, dk->p, dv->p, n, 0, 0, stream);
      cudaStreamSynchronize(stream);
    }
    void run() {
      try {
        add(7000);
        seq.end_prompt(0, stream);
        for (int i = 0; i < 6; ++i) add(300);  // an update segment every other append
        for (int i = 0; i < 3; ++i) {
          std::vector<float> q = query();
          auto dq = upload(pack(kDT, q));
          DevVec dout(q.size() * 2);
          wkv_seq *s = seq.get();
          plan.decode(&s, 1, 0, dq->p, dout.p, stream);
          cudaStreamSynchronize(stream);
          worst = std::max(worst, error(q, unpack(kDT, dout.host(), q.size())));
        }
      } catch (const std::exception &e) {
        failure = e.what();
      }
    }
  };
  Side a(gpu, 7), b(gpu, 8);
  std::thread ta([&] { a.run(); }), tb([&] { b.run(); });
  ta.join();
  tb.join();
  EXPECT_EQ(a.failure, "");
  EXPECT_EQ(b.failure, "");
  EXPECT_LT(a.worst, 1e-2);
  EXPECT_LT(b.worst, 1e-2);
  EXPECT_EQ(a.seq.info(0).segments, b.seq.info(0).segments);
}

// Defect 3: destroying a sequence synchronized the device and freed every
// head buffer with cudaFree. Its memory now goes in stream order once the
// steps that read it have ended: the destroy returns while the device is
// still busy with the sequence's own work.
TEST(GpuEngine, DestroyingASequenceDoesNotWaitForTheDevice) {
  REQUIRE_GPU();
  Twin t(1.0f, 0.0f);
  t.append(3000);
  t.sgpu.end_prompt(0, t.stream);  // t's own index built before the count below
  ASSERT_EQ(cudaStreamSynchronize(t.stream), cudaSuccess);
  wkv_stats s0 = t.gpu.stats();
  auto seq = std::make_unique<wavekv::Sequence>(t.gpu);
  std::vector<uint8_t> kb, vb;
  Context other(7);  // its own tokens: t's reference holds t's only
  other.draw(5000, &kb, &vb);
  DevVec dk(kb), dv(vb);
  seq->append(0, dk.p, dv.p, 5000, 0, 0, t.stream);
  seq->end_prompt(0, t.stream);  // the index is built (a growth waits for its stream)
  ASSERT_EQ(cudaStreamSynchronize(t.stream), cudaSuccess);
  std::vector<float> q = t.query();
  DevVec dq(pack(kDT, q)), dout(q.size() * 2);  // (cudaMemcpy would wait for the stream below)
  t.decode_gpu(q);  // the kernels loaded (lazy loading takes a while the first time)
  // The stream is held for 1.5 s behind a host function; an append of the
  // sequence and a decode of it wait behind it.
  ASSERT_EQ(cudaLaunchHostFunc(
                t.stream, [](void *) { std::this_thread::sleep_for(std::chrono::milliseconds(1500)); }, nullptr),
            cudaSuccess);
  seq->append(0, dk.p, dv.p, 10, 0, 0, t.stream);
  auto plan = std::make_unique<wavekv::Plan>(t.gpu);
  wkv_seq *s = seq->get();
  ASSERT_EQ(wkv_decode(plan->get(), &s, 1, 0, dq.p, 0, 0, dout.p, 0, 0, t.stream), WKV_OK) << wkv_last_error();
  const auto t0 = std::chrono::steady_clock::now();
  seq.reset();   // the plan still holds it
  plan.reset();  // the sequence's last reference: its memory is released
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(ms, 100.0) << "destroying waited for the device";
  ASSERT_EQ(cudaStreamQuery(t.stream), cudaErrorNotReady) << "the device is still busy with the sequence";
  ASSERT_EQ(cudaStreamSynchronize(t.stream), cudaSuccess);
  ASSERT_TRUE(manager_caught_up(t.gpu));
  for (int i = 0; i < 400 && t.gpu.stats().pages_used != s0.pages_used; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // the releases run on the manager's thread
  const wkv_stats s1 = t.gpu.stats();
  EXPECT_EQ(s1.sequences, s0.sequences);
  EXPECT_EQ(s1.tokens, s0.tokens);
  EXPECT_EQ(s1.pages_used, s0.pages_used) << "the pages came back once the steps had ended";
  EXPECT_LT(t.error(q, t.decode_gpu(q)), 1e-2) << "the other sequence is untouched";
}

// Defect 6: verbs set the engine's device and never restored the caller's.
TEST(GpuEngine, VerbsLeaveTheCallersDeviceCurrent) {
  REQUIRE_GPU();
  int n = 0;
  ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  if (n < 2) GTEST_SKIP() << "needs two CUDA devices";
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  wkv_config c = config(WKV_DEVICE_CUDA, 1.0f, 0.0f);
  c.device_id = 1;
  wavekv::Engine e(c);
  wavekv::Sequence seq(e);
  wavekv::Plan plan(e);
  Context ctx(5);
  std::vector<uint8_t> kb, vb;
  ctx.draw(2000, &kb, &vb);
  DevVec dk(kb), dv(vb);
  std::vector<float> q = ctx.query();
  DevVec dq(pack(kDT, q)), dout(q.size() * 2);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto current = [] {
    int d = -1;
    cudaGetDevice(&d);
    return d;
  };
  ASSERT_EQ(wkv_seq_append(seq.get(), 0, dk.p, dv.p, 2000, 0, 0, nullptr), WKV_OK) << wkv_last_error();
  EXPECT_EQ(current(), 0);
  wkv_seq *s = seq.get();
  ASSERT_EQ(wkv_lookup(plan.get(), &s, 1, 0, dq.p, 0, 0, nullptr), WKV_OK) << wkv_last_error();
  EXPECT_EQ(current(), 0);
  ASSERT_EQ(wkv_assemble(plan.get(), nullptr), WKV_OK);
  ASSERT_EQ(wkv_attend(plan.get(), dout.p, 0, 0, nullptr, nullptr), WKV_OK);
  ASSERT_EQ(wkv_update(plan.get(), nullptr), WKV_OK);
  EXPECT_EQ(current(), 0);
  (void)e.stats();
  EXPECT_EQ(current(), 0);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_LT(ctx.error(q, unpack(kDT, dout.host(), q.size())), 1e-2);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

TEST(GpuEngine, BadInputIsRefusedAndTheEngineStaysUsable) {
  REQUIRE_GPU();
  Twin t(1.0f, 0.0f);
  t.append(3000);
  std::vector<float> q = t.query();
  auto qb = pack(kDT, q);
  std::vector<uint8_t> ob(qb.size());
  wkv_seq *s = t.sgpu.get();
  // Host pointers where device pointers are needed.
  EXPECT_EQ(wkv_decode(t.pgpu.get(), &s, 1, 0, qb.data(), 0, 0, ob.data(), 0, 0, t.stream),
            WKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(wkv_last_error()).find("host pointer"), std::string::npos) << wkv_last_error();
  EXPECT_EQ(wkv_seq_append(s, 0, qb.data(), qb.data(), 1, 0, 0, t.stream), WKV_ERR_INVALID_ARGUMENT);
  // Misaligned device buffer.
  DevVec big(qb.size() * 2 + 16);
  EXPECT_EQ(wkv_decode(t.pgpu.get(), &s, 1, 0, static_cast<uint8_t *>(big.p) + 1, 0, 0, big.p, 0, 0, t.stream),
            WKV_ERR_INVALID_ARGUMENT);
  // Device out of memory: a cache larger than any GPU.
  wkv_config huge = config(WKV_DEVICE_CUDA);
  huge.device_cache_bytes = 1ull << 50;
  wkv_engine *e = nullptr;
  EXPECT_EQ(wkv_engine_open(&huge, &e), WKV_ERR_OUT_OF_MEMORY) << wkv_last_error();
  EXPECT_EQ(e, nullptr);
  // Still usable and exact.
  EXPECT_LT(t.error(q, t.decode_gpu(q)), 1e-2);
}

TEST(GpuEngine, StreamOfAnotherDeviceIsRefused) {
  REQUIRE_GPU();
  int n = 0;
  ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  if (n < 2) GTEST_SKIP() << "needs two CUDA devices";
  Twin t(1.0f, 0.0f);  // the engine on device 0
  t.append(3000);
  std::vector<float> q = t.query();
  DevVec dq(pack(kDT, q)), dout(q.size() * 2);
  cudaStream_t other = nullptr;
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  ASSERT_EQ(cudaStreamCreate(&other), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  wkv_seq *s = t.sgpu.get();
  EXPECT_EQ(wkv_decode(t.pgpu.get(), &s, 1, 0, dq.p, 0, 0, dout.p, 0, 0, other), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(wkv_last_error()).find("device 1"), std::string::npos) << wkv_last_error();
  EXPECT_EQ(wkv_seq_append(s, 0, dq.p, dq.p, 1, 0, 0, other), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(t.sgpu.info(0).tokens, 3000u);  // nothing appended
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(other), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  // Still usable and exact on its own stream.
  EXPECT_LT(t.error(q, t.decode_gpu(q)), 1e-2);
}

