// Cold pages on a CUDA engine (lib/engine/cold.hpp): with a spill file and a
// host budget smaller than its KV, a CUDA engine keeps taking tokens and
// decoding. Pages beyond the budget leave host memory, their entries in the
// device's page table go null, the device's selection estimates the
// retrieval clusters it finds out and reports them, and their pages come back
// for later steps. Checked through the C ABI against a CUDA engine that holds
// everything: once a query's pages are back its output is bit for bit the
// in-memory engine's; generating under the budget stays as accurate; a plan
// between its lookup and its assemble gathers what it chose while a growth
// relieves the budget; saving, evicting, restoring and destroying lose
// nothing and leak nothing. Skips where no CUDA device exists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "files_support.hpp"
#include "gpu_support.hpp"
#include "spill_support.hpp"
#include "wavekv/wavekv.hpp"

using namespace wkvtest;

namespace {

constexpr Shape kShape{2, 8, 2, 128, WKV_DTYPE_F16};
constexpr uint32_t kPrompt = 8000;

// Retrieval and estimation fractions larger than the defaults (more
// retrievals a step to find out) unless asked.
wkv_config config(const std::string &dir, uint64_t host_budget, float retrieval = 0.1f, float estimation = 0.3f) {
  wkv_config c = file_config(kShape);
  c.device = WKV_DEVICE_CUDA;
  c.segment_tokens = 1024;
  c.update_segment_tokens = 256;
  c.device_cache_bytes = 1u << 20;
  c.retrieval_frac = retrieval;
  c.estimation_frac = estimation;
  c.host_budget_bytes = host_budget;
  c.host_chunk_bytes = 1u << 20;
  c.spill_dir = dir.empty() ? nullptr : dir.c_str();
  return c;
}

struct Gpu {
  wavekv::Engine engine;
  explicit Gpu(const wkv_config &c) : engine(c) {}

  void append(wavekv::Sequence &s, const std::vector<uint8_t> &k, const std::vector<uint8_t> &v, uint32_t n,
              uint32_t first_layer = 0, uint32_t layers = kShape.layers) {
    Buf dk(true, k), dv(true, v);
    for (uint32_t l = first_layer; l < first_layer + layers; ++l) s.append(l, dk.p, dv.p, n);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // before the buffers go
  }
  void prompt(wavekv::Sequence &s, Context &ctx) {
    std::vector<uint8_t> k, v;
    ctx.tokens(kPrompt, &k, &v);
    append(s, k, v, kPrompt);
    for (uint32_t l = 0; l < kShape.layers; ++l) s.end_prompt(l);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  // Every layer's output for one query, as stored (f16).
  std::vector<uint8_t> decode(wavekv::Sequence &s, const std::vector<uint8_t> &q) {
    wavekv::Plan p(engine);
    Buf dq(true, q), dout(true, std::vector<uint8_t>(q.size(), 0xee));
    std::vector<uint8_t> all;
    for (uint32_t l = 0; l < kShape.layers; ++l) {
      wkv_seq *seq = s.get();
      p.decode(&seq, 1, l, dq.p, dout.p);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<uint8_t> out = dout.host();
      all.insert(all.end(), out.begin(), out.end());
    }
    return all;
  }
  // Decodes q until a step estimated nothing for want of a page, waiting
  // for the pager between steps; returns that step's output. The device's
  // report of a step is taken by the layer's next lookup, so a step is
  // known clean once the decode after it added nothing to spill_estimated.
  std::vector<uint8_t> decode_until_resident(wavekv::Sequence &s, const std::vector<uint8_t> &q, int steps,
                                             bool *resident) {
    *resident = false;
    std::vector<uint8_t> prev = decode(s, q);
    uint64_t last = engine.stats().spill_estimated;
    for (int i = 0; i < steps; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      std::vector<uint8_t> out = decode(s, q);
      const uint64_t now = engine.stats().spill_estimated;
      if (now == last) {
        *resident = true;
        return prev;
      }
      last = now;
      prev = std::move(out);
    }
    return prev;
  }
};

std::vector<float> to_f32(const std::vector<uint8_t> &x) { return unpack(kShape.dtype, x, x.size() / 2); }

// The pages of a sequence of kPrompt tokens, from an engine without a budget.
uint64_t pages_of(wkv_stats *st) {
  Gpu g(config("", 0));
  wavekv::Sequence seq(g.engine);
  Context ctx(kShape);
  g.prompt(seq, ctx);
  *st = g.engine.stats();
  return st->pages_used;
}

// The pages wkv_seq_info says are in the spill file, summed over layers.
uint64_t spilled_pages(const wavekv::Sequence &seq) {
  uint64_t n = 0;
  for (uint32_t l = 0; l < kShape.layers; ++l) n += seq.info(l).spilled_pages;
  return n;
}

// The host pages of a cold engine beyond its sequences' KV: each head's
// report page once it has been looked up.
constexpr uint64_t kReportPages = uint64_t(kShape.layers) * kShape.kv_heads;

// Waits (a second at most) for the slots given back after the steps in
// flight to be released: pages_used + cold pages == want.
void settle_pages(const wavekv::Engine &e, uint64_t want) {
  for (int i = 0; i < 100; ++i) {
    const wkv_stats x = e.stats();
    if (x.pages_used + x.spill_cold_pages == want) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// A cold engine whose budget holds a third of a kPrompt-token sequence's
// pages, and that sequence with its prompt in (the rest on disk).
struct ThirdInMemory {
  wkv_stats full{};
  uint64_t pages = pages_of(&full);
  ScratchDir dir;
  Gpu cold{config(dir.path(), pages / 3 * full.page_bytes)};
  wavekv::Sequence seq{cold.engine};
  Context ctx{kShape};
  ThirdInMemory() { cold.prompt(seq, ctx); }
};

}  // namespace

// The budget holds a third of the KV: the prompt goes in with the rest on
// disk; decoding estimates what it finds out, reads it back, and then gives
// exactly the in-memory engine's output.
TEST(GpuColdPages, AFullBudgetSpillsAndDecodingGoesOnExactly) {
  REQUIRE_GPU();
  wkv_stats full;
  const uint64_t pages = pages_of(&full);
  ASSERT_GT(pages, 1000u);
  const uint64_t budget = pages / 3 * full.page_bytes;

  Gpu mem(config("", 0));
  wavekv::Sequence ref(mem.engine);
  Context c1(kShape);
  mem.prompt(ref, c1);

  ScratchDir dir;
  Gpu cold(config(dir.path(), budget));
  wavekv::Sequence seq(cold.engine);
  Context c2(kShape);
  cold.prompt(seq, c2);
  const wkv_stats st = cold.engine.stats();
  std::printf("pages %llu, budget %llu pages, cold %llu, written %llu\n", (unsigned long long)pages,
              (unsigned long long)(budget / full.page_bytes), (unsigned long long)st.spill_cold_pages,
              (unsigned long long)st.spill_pages_written);
  EXPECT_LE(st.pages_used * st.page_bytes, budget);
  EXPECT_GE(st.spill_cold_pages, pages - budget / full.page_bytes);
  EXPECT_EQ(st.pages_used + st.spill_cold_pages, pages);
  EXPECT_EQ(spilled_pages(seq), st.spill_cold_pages);

  uint64_t estimated = 0;
  for (int i = 0; i < 4; ++i) {
    const std::vector<uint8_t> q = c1.query();
    const std::vector<uint8_t> want = mem.decode(ref, q);
    bool resident = false;
    const std::vector<uint8_t> got = cold.decode_until_resident(seq, q, 200, &resident);
    ASSERT_TRUE(resident) << "query " << i << ": its pages never all came back";
    const std::vector<float> a = to_f32(got), b = to_f32(want);
    double num = 0, den = 0;
    for (size_t j = 0; j < a.size(); ++j) num += double(a[j] - b[j]) * (a[j] - b[j]), den += double(b[j]) * b[j];
    EXPECT_TRUE(got == want) << "query " << i << ": with every page back, the output is the in-memory one "
                             << "(relative difference " << std::sqrt(num / std::max(den, 1e-30)) << ")";
    const wkv_stats x = cold.engine.stats();
    EXPECT_LE(x.pages_used * x.page_bytes, budget);
    settle_pages(cold.engine, pages + kReportPages);
    const wkv_stats y = cold.engine.stats();
    EXPECT_EQ(y.pages_used + y.spill_cold_pages, pages + kReportPages);
    EXPECT_EQ(spilled_pages(seq), y.spill_cold_pages);
    estimated = y.spill_estimated;
  }
  const wkv_stats x = cold.engine.stats();
  std::printf("estimated %llu, read %llu, written %llu\n", (unsigned long long)x.spill_estimated,
              (unsigned long long)x.spill_pages_read, (unsigned long long)x.spill_pages_written);
  EXPECT_GT(estimated, 0u) << "some retrievals found their pages out";
  EXPECT_GT(x.spill_pages_read, 0u);
  EXPECT_EQ(x.spill_read_errors, 0u);
  EXPECT_EQ(x.spill_write_errors, 0u);
}

// Generating under a full budget (growths of update segments relieve it),
// a new query every step (no temporal locality: the worst case for reading
// back), two thirds of the KV out, the default zones (as test_cold):
// against exact attention the cold engine's error stays near the in-memory
// engine's.
TEST(GpuColdPages, GeneratingUnderAFullBudgetStaysAsAccurateAsInMemory) {
  REQUIRE_GPU();
  wkv_stats full;
  const uint64_t pages = pages_of(&full);
  const uint64_t budget = pages / 3 * full.page_bytes;
  const wkv_config defaults = file_config(kShape);
  const float r = defaults.retrieval_frac, e = defaults.estimation_frac;
  Gpu mem(config("", 0, r, e));
  ScratchDir dir;
  Gpu cold(config(dir.path(), budget, r, e));
  wavekv::Sequence ref(mem.engine), seq(cold.engine);
  Context c1(kShape), c2(kShape);
  mem.prompt(ref, c1);
  cold.prompt(seq, c2);
  const uint32_t d = kShape.head_dim, H = kShape.kv_heads, G = kShape.q_heads / kShape.kv_heads;
  StoredRows rows(kShape);
  rows.take(kPrompt);
  std::vector<double> err_mem, err_cold;
  std::vector<uint8_t> k, v;
  for (int step = 0; step < 120; ++step) {
    c1.tokens(1, &k, &v);
    rows.take(1);
    mem.append(ref, k, v, 1);
    cold.append(seq, k, v, 1);
    const std::vector<uint8_t> q = c1.query();
    const std::vector<float> qf = to_f32(q);
    const std::vector<float> a = to_f32(mem.decode(ref, q)), b = to_f32(cold.decode(seq, q));
    for (uint32_t h = 0; h < H; ++h)
      for (uint32_t g = 0; g < G; ++g) {
        const size_t at = (size_t(h) * G + g) * d;  // layer 0
        std::vector<double> exact;
        exact_attention(qf.data() + at, rows.head(h), d, &exact);
        err_mem.push_back(rel_l2(a.data() + at, exact));
        err_cold.push_back(rel_l2(b.data() + at, exact));
      }
  }
  const wkv_stats x = cold.engine.stats();
  std::printf("error against exact attention: in memory median %.4f p90 %.4f; with cold pages median %.4f p90 %.4f; "
              "estimated %llu, read %llu, written %llu\n",
              median(err_mem), quantile(err_mem, 0.9), median(err_cold), quantile(err_cold, 0.9),
              (unsigned long long)x.spill_estimated, (unsigned long long)x.spill_pages_read,
              (unsigned long long)x.spill_pages_written);
  EXPECT_GT(x.spill_estimated, 0u);
  EXPECT_LT(median(err_cold), median(err_mem) * 1.5 + 0.02);
  EXPECT_LT(quantile(err_cold, 0.9), quantile(err_mem, 0.9) * 1.5 + 0.05);
  EXPECT_LE(x.pages_used * x.page_bytes, budget);
  EXPECT_EQ(x.tokens, mem.engine.stats().tokens);
  EXPECT_EQ(x.spill_read_errors, 0u);
  EXPECT_EQ(x.spill_write_errors, 0u);
}

// Two plans look layer 0 up (a query whose pages are back, and a new one);
// before the first assembles, growths of layer 1 find the budget full and
// write pages out. The layer looked up is open until both plans have
// assembled (with `later_first`, the second plan assembles, attends and
// updates before the growths): none of its pages goes, and the first plan
// gathers what it chose (memcheck runs this).
static void two_plans_keep_their_pages(bool later_first) {
  wkv_stats full;
  const uint64_t pages = pages_of(&full);
  ScratchDir dir;
  Gpu cold(config(dir.path(), pages / 3 * full.page_bytes));
  Gpu mem(config("", 0));
  wavekv::Sequence seq(cold.engine), ref(mem.engine);
  Context c1(kShape), c2(kShape);
  cold.prompt(seq, c1);
  mem.prompt(ref, c2);
  const std::vector<uint8_t> q = c1.query();
  bool resident = false;
  (void)cold.decode_until_resident(seq, q, 200, &resident);
  ASSERT_TRUE(resident);
  const uint64_t written = cold.engine.stats().spill_pages_written;

  wavekv::Plan p(cold.engine), p2(cold.engine);
  const std::vector<uint8_t> q2 = c1.query();
  Buf dq(true, q), dout(true, std::vector<uint8_t>(q.size(), 0xee));
  Buf dq2(true, q2), dout2(true, std::vector<uint8_t>(q.size(), 0xee));
  wkv_seq *sp = seq.get();
  p.lookup(&sp, 1, 0, dq.p);
  p2.lookup(&sp, 1, 0, dq2.p);
  auto second = [&] {
    p2.assemble();
    p2.attend(dout2.p);
    p2.update();
  };
  if (later_first) second();
  std::vector<uint8_t> k, v;
  c1.tokens(3000, &k, &v);  // layer 1 only: growths under a full budget
  cold.append(seq, k, v, 3000, 1, 1);
  EXPECT_GT(cold.engine.stats().spill_pages_written, written) << "the growths wrote pages out";
  p.assemble();
  p.attend(dout.p);
  p.update();
  if (!later_first) second();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (float x : to_f32(dout2.host())) ASSERT_TRUE(std::isfinite(x));
  // Layer 0 is as it was: its output is the in-memory engine's.
  Buf mq(true, q), mout(true, std::vector<uint8_t>(q.size(), 0xee));
  wavekv::Plan pm(mem.engine);
  wkv_seq *rp = ref.get();
  pm.decode(&rp, 1, 0, mq.p, mout.p);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(dout.host() == mout.host()) << "the plan gathered the pages it chose";
}

TEST(GpuColdPages, APlanBetweenLookupAndAssembleKeepsItsPages) {
  REQUIRE_GPU();
  two_plans_keep_their_pages(false);
}

// The later plan assembling first closes its own lookup, not the layer.
TEST(GpuColdPages, AnEarlierPlanKeepsItsPagesWhenALaterOneAssemblesFirst) {
  REQUIRE_GPU();
  two_plans_keep_their_pages(true);
}

// A plan destroyed between its lookup and its assemble closes the lookup:
// while it holds it, growths of layer 1 take none of layer 0's pages; once
// it is gone they do again (ties of age go to the lower layer first).
TEST(GpuColdPages, AnAbandonedLookupLetsTheLayersPagesGoAgain) {
  REQUIRE_GPU();
  ThirdInMemory t;
  Gpu &cold = t.cold;
  wavekv::Sequence &seq = t.seq;
  Context &c1 = t.ctx;
  const std::vector<uint8_t> q = c1.query();
  bool resident = false;
  (void)cold.decode_until_resident(seq, q, 200, &resident);
  ASSERT_TRUE(resident);
  const uint64_t written = cold.engine.stats().spill_pages_written;
  const uint64_t before = seq.info(0).spilled_pages;
  std::vector<uint8_t> k, v;
  uint64_t held;
  {
    wavekv::Plan p(cold.engine);
    Buf dq(true, q);
    wkv_seq *sp = seq.get();
    p.lookup(&sp, 1, 0, dq.p);
    c1.tokens(3000, &k, &v);
    cold.append(seq, k, v, 3000, 1, 1);
    ASSERT_GT(cold.engine.stats().spill_pages_written, written) << "the growths wrote pages out";
    held = seq.info(0).spilled_pages;
    EXPECT_LE(held, before) << "layer 0 is open: none of its pages went";
  }
  c1.tokens(3000, &k, &v);
  cold.append(seq, k, v, 3000, 1, 1);
  EXPECT_GT(seq.info(0).spilled_pages, held) << "the abandoned lookup was closed: layer 0 gives pages again";
  for (float x : to_f32(cold.decode(seq, q))) ASSERT_TRUE(std::isfinite(x));
}

// Saved with cold pages, the file decodes in memory as the reference;
// evicted and restored, the sequence decodes as before; destroyed, it gives
// the spill file's space and its pages back.
TEST(GpuColdPages, SaveEvictRestoreAndDestroyLoseNothing) {
  REQUIRE_GPU();
  wkv_stats full;
  const uint64_t pages = pages_of(&full);
  Gpu mem(config("", 0));
  wavekv::Sequence ref(mem.engine);
  Context c1(kShape);
  mem.prompt(ref, c1);
  ScratchDir dir;
  {
    Gpu cold(config(dir.path(), pages / 3 * full.page_bytes));
    {
      wavekv::Sequence seq(cold.engine);
      Context c2(kShape);
      cold.prompt(seq, c2);
      ASSERT_GT(cold.engine.stats().spill_cold_pages, 0u);
      const std::vector<uint8_t> q = c1.query();
      (void)cold.decode(seq, q);  // reads in flight, maybe
      seq.save(dir.file("cold.wkv"));
      wavekv::Sequence loaded = wavekv::Sequence::load(mem.engine, dir.file("cold.wkv"));
      const std::vector<uint8_t> q2 = c1.query();
      EXPECT_TRUE(mem.decode(loaded, q2) == mem.decode(ref, q2)) << "the file holds every page";

      bool resident = false;
      const std::vector<uint8_t> before = cold.decode_until_resident(seq, q2, 200, &resident);
      ASSERT_TRUE(resident);
      seq.evict();
      EXPECT_EQ(cold.engine.stats().evicted_sequences, 1u);
      const std::vector<uint8_t> after = cold.decode_until_resident(seq, q2, 200, &resident);
      ASSERT_TRUE(resident);
      EXPECT_TRUE(after == before);
      EXPECT_EQ(cold.engine.stats().evicted_sequences, 0u);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    settle_pages(cold.engine, 0);
    const wkv_stats x = cold.engine.stats();
    EXPECT_EQ(x.spill_cold_pages, 0u);
    EXPECT_EQ(x.spill_bytes_used, 0u) << "a destroyed sequence's cold pages give their space back";
    EXPECT_EQ(x.pages_used, 0u);
  }
  EXPECT_EQ(dir.names(), std::vector<std::string>{"cold.wkv"}) << "nothing left of the spill file";
}

// A flipped bit in every spilled page: each read back fails its checksum,
// the page stays out (its device page table entry null: its clusters are
// estimated from then on, decoding stays finite), the failures are counted,
// and saving the sequence fails rather than writing bad KV.
TEST(GpuColdPages, ACorruptSpilledPageIsAnErrorNeverData) {
  REQUIRE_GPU();
  ThirdInMemory t;
  Gpu &cold = t.cold;
  wavekv::Sequence &seq = t.seq;
  const ScratchDir &dir = t.dir;
  const wkv_stats st = cold.engine.stats();
  ASSERT_GT(st.spill_cold_pages, 0u);
  const int fd = reopen_spill_file(dir.path());
  ASSERT_GE(fd, 0);
  const uint64_t span = (st.page_bytes + 4095) / 4096 * 4096;
  for (uint64_t at = 100; at < st.spill_file_bytes; at += span) flip_byte(fd, at);
  ::close(fd);
  Context q(kShape, 11);
  for (int i = 0; i < 40 && cold.engine.stats().spill_read_errors == 0; ++i) {
    for (float x : to_f32(cold.decode(seq, q.query()))) ASSERT_TRUE(std::isfinite(x));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const wkv_stats x = cold.engine.stats();
  EXPECT_GT(x.spill_read_errors, 0u);
  EXPECT_EQ(x.spill_pages_read, 0u) << "no corrupt page came back as data";
  EXPECT_EQ(wkv_seq_save(seq.get(), dir.file("bad.wkv").c_str(), 0), WKV_ERR_CORRUPT);
  for (float v : to_f32(cold.decode(seq, q.query()))) EXPECT_TRUE(std::isfinite(v));
}
