// Cold pages: the spill tier under live sequences (lib/engine/cold.hpp).
// A CPU engine with a spill file and a host budget smaller than its KV
// keeps taking tokens and decoding: the coldest pages go to the spill file,
// retrievals that find a page on disk are estimated for that step, and the
// pages come back for later steps. Checked through the C ABI against an
// engine that holds everything in memory: once a query's pages are back, its
// output is bit for bit the in-memory engine's; saving, evicting, restoring
// and destroying a sequence with cold pages lose nothing and leak nothing; a
// corrupt spilled page is an error for its clusters, never data.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "files_support.hpp"
#include "spill_support.hpp"
#include "wavekv/wavekv.hpp"

using namespace wkvtest;

namespace {

constexpr uint32_t kPrompt = 4000;

wkv_config cold_config(const Shape &s, const std::string &dir, uint64_t host_budget, uint64_t spill_budget = 0) {
  wkv_config c = file_config(s);
  c.host_budget_bytes = host_budget;
  c.host_chunk_bytes = 1u << 20;
  c.spill_dir = dir.empty() ? nullptr : dir.c_str();
  c.spill_budget_bytes = spill_budget;
  return c;
}

std::vector<float> to_f32(const Shape &s, const std::vector<uint8_t> &x) {
  return unpack(s.dtype, x, x.size() / (s.dtype == WKV_DTYPE_F32 ? 4 : 2));
}

// A prompt of kPrompt tokens on every layer, ended.
void prompt(wavekv::Sequence &seq, const Shape &s, Context &ctx) {
  std::vector<uint8_t> k, v;
  ctx.tokens(kPrompt, &k, &v);
  for (uint32_t l = 0; l < s.layers; ++l) seq.append(l, k.data(), v.data(), kPrompt);
  for (uint32_t l = 0; l < s.layers; ++l) seq.end_prompt(l);
}

// The pages a sequence of kPrompt tokens holds, from an engine without a
// budget.
uint64_t pages_of(const Shape &s, wkv_stats *st = nullptr) {
  ScratchDir none;
  wavekv::Engine e(cold_config(s, "", 0));
  wavekv::Sequence seq(e);
  Context ctx(s);
  prompt(seq, s, ctx);
  const wkv_stats x = e.stats();
  if (st) *st = x;
  return x.pages_used;
}

// Decodes the same query until a step estimates nothing because of the
// disk (its pages are all back), at most `steps` times, waiting for the
// pager between steps. Returns the last output.
std::vector<uint8_t> decode_until_resident(const wavekv::Engine &e, wkv_seq *seq, const Shape &s,
                                           const std::vector<uint8_t> &q, int steps, bool *resident) {
  std::vector<uint8_t> out;
  *resident = false;
  for (int i = 0; i < steps && !*resident; ++i) {
    const uint64_t before = e.stats().spill_estimated;
    out = decode_all(e, seq, s, q);
    *resident = e.stats().spill_estimated == before;
    if (!*resident) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return out;
}

// The pages wkv_seq_info says are in the spill file, summed over layers:
// each layer's at most its pages, and all of them while evicted.
uint64_t spilled_pages(const wavekv::Sequence &seq, const Shape &s, bool evicted = false) {
  uint64_t n = 0;
  for (uint32_t l = 0; l < s.layers; ++l) {
    const wkv_seq_info i = seq.info(l);
    EXPECT_EQ(i.evicted, evicted ? 1u : 0u) << "layer " << l;
    EXPECT_LE(i.spilled_pages, i.pages) << "layer " << l;
    if (evicted) {
      EXPECT_EQ(i.spilled_pages, i.pages) << "layer " << l;
    }
    n += i.spilled_pages;
  }
  return n;
}

}  // namespace

// The budget holds a third of the KV: the prompt goes in, the pages beyond
// the budget are on disk, decoding estimates what it finds there and reads
// it back, and then gives exactly the in-memory engine's output.
TEST(ColdPages, AFullBudgetSpillsColdPagesAndDecodingGoesOnExactly) {
  const Shape s;
  wkv_stats full;
  const uint64_t pages = pages_of(s, &full);
  ASSERT_GT(pages, 100u);
  const uint64_t budget = pages / 3 * full.page_bytes;

  wavekv::Engine mem(cold_config(s, "", 0));
  wavekv::Sequence ref(mem);
  Context c1(s);
  prompt(ref, s, c1);

  ScratchDir dir;
  wavekv::Engine e(cold_config(s, dir.path(), budget));
  wavekv::Sequence seq(e);
  Context c2(s);
  prompt(seq, s, c2);
  const wkv_stats st = e.stats();
  std::printf("pages %llu, budget %llu pages, cold %llu, written %llu, io 0x%llx\n", (unsigned long long)pages,
              (unsigned long long)(budget / full.page_bytes), (unsigned long long)st.spill_cold_pages,
              (unsigned long long)st.spill_pages_written, (unsigned long long)st.spill_io);
  EXPECT_LE(st.pages_used * st.page_bytes, budget);
  EXPECT_GE(st.spill_cold_pages, pages - budget / full.page_bytes);
  EXPECT_EQ(st.pages_used + st.spill_cold_pages, pages);
  EXPECT_EQ(st.spill_bytes_used, st.spill_cold_pages * ((st.page_bytes + 4095) / 4096 * 4096));
  EXPECT_EQ(st.tokens, full.tokens);
  EXPECT_EQ(spilled_pages(seq, s), st.spill_cold_pages) << "the sequence's info counts its cold pages";

  // Several queries, each until its pages are back.
  uint64_t estimated = 0;
  for (int i = 0; i < 4; ++i) {
    const std::vector<uint8_t> q = c1.query();
    const std::vector<uint8_t> want = decode_all(mem, ref.get(), s, q);
    bool resident = false;
    const std::vector<uint8_t> got = decode_until_resident(e, seq.get(), s, q, 200, &resident);
    ASSERT_TRUE(resident) << "query " << i << ": its pages never all came back";
    EXPECT_TRUE(got == want) << "query " << i << ": with every page back, the output is the in-memory one";
    const wkv_stats x = e.stats();
    EXPECT_LE(x.pages_used * x.page_bytes, budget);
    EXPECT_EQ(x.pages_used + x.spill_cold_pages, pages);
    EXPECT_EQ(spilled_pages(seq, s), x.spill_cold_pages);
    estimated = x.spill_estimated;
  }
  const wkv_stats x = e.stats();
  EXPECT_GT(estimated, 0u) << "some retrievals found their pages on disk";
  EXPECT_GT(x.spill_pages_read, 0u);
  EXPECT_EQ(x.spill_read_errors, 0u);
  EXPECT_EQ(x.spill_write_errors, 0u);
}

// Decoding while generating: appends go on past update segments (growths
// under a full budget). Against exact attention, the cold engine's error
// stays near the in-memory engine's: the only difference is clusters
// estimated for a step while their pages are on disk. Every query here is
// new (no temporal locality: the worst case for reading back), and two
// thirds of the KV is on disk.
TEST(ColdPages, GeneratingUnderAFullBudgetStaysAsAccurateAsInMemory) {
  const Shape s;
  wkv_stats full;
  const uint64_t pages = pages_of(s, &full);
  const uint64_t budget = pages / 3 * full.page_bytes;
  wavekv::Engine mem(cold_config(s, "", 0));
  ScratchDir dir;
  wavekv::Engine e(cold_config(s, dir.path(), budget));
  wavekv::Sequence ref(mem), seq(e);
  Context c1(s), c2(s);
  prompt(ref, s, c1);
  prompt(seq, s, c2);
  // The rows as stored (f16), per KV head, for exact attention.
  const uint32_t d = s.head_dim, H = s.kv_heads, G = s.q_heads / s.kv_heads;
  StoredRows rows(s);
  rows.take(kPrompt);
  std::vector<double> err_mem, err_cold;
  std::vector<uint8_t> k, v;
  for (int step = 0; step < 150; ++step) {
    c1.tokens(1, &k, &v);
    rows.take(1);
    for (uint32_t l = 0; l < s.layers; ++l) {
      ref.append(l, k.data(), v.data(), 1);
      seq.append(l, k.data(), v.data(), 1);
    }
    const std::vector<uint8_t> q = c1.query();
    const std::vector<float> qf = to_f32(s, q);
    const std::vector<float> a = to_f32(s, decode_all(mem, ref.get(), s, q));
    const std::vector<float> b = to_f32(s, decode_all(e, seq.get(), s, q));
    for (uint32_t h = 0; h < H; ++h)
      for (uint32_t g = 0; g < G; ++g) {
        const size_t at = (size_t(h) * G + g) * d;  // layer 0
        std::vector<double> exact;
        exact_attention(qf.data() + at, rows.head(h), d, &exact);
        err_mem.push_back(rel_l2(a.data() + at, exact));
        err_cold.push_back(rel_l2(b.data() + at, exact));
      }
  }
  const wkv_stats x = e.stats();
  std::printf("error against exact attention: in memory median %.4f p90 %.4f; with cold pages median %.4f p90 %.4f; "
              "estimated %llu, read %llu, written %llu\n",
              median(err_mem), quantile(err_mem, 0.9), median(err_cold), quantile(err_cold, 0.9),
              (unsigned long long)x.spill_estimated, (unsigned long long)x.spill_pages_read,
              (unsigned long long)x.spill_pages_written);
  EXPECT_GT(x.spill_estimated, 0u);
  EXPECT_LT(median(err_cold), median(err_mem) * 1.5 + 0.02);
  EXPECT_LT(quantile(err_cold, 0.9), quantile(err_mem, 0.9) * 1.5 + 0.05);
  EXPECT_LE(x.pages_used * x.page_bytes, budget);
  EXPECT_EQ(x.tokens, mem.stats().tokens);
  EXPECT_EQ(x.spill_read_errors, 0u);
}

// Saved with cold pages, a sequence's file decodes like the in-memory one;
// evicted and restored, it decodes as before; destroyed, it gives the spill
// file's space back.
TEST(ColdPages, SaveEvictRestoreAndDestroyLoseNothing) {
  const Shape s;
  wkv_stats full;
  const uint64_t pages = pages_of(s, &full);
  const uint64_t budget = pages / 3 * full.page_bytes;
  wavekv::Engine mem(cold_config(s, "", 0));
  wavekv::Sequence ref(mem);
  Context c1(s);
  prompt(ref, s, c1);
  ScratchDir dir;
  {
    wavekv::Engine e(cold_config(s, dir.path(), budget));
    {
      wavekv::Sequence seq(e);
      Context c2(s);
      prompt(seq, s, c2);
      ASSERT_GT(e.stats().spill_cold_pages, 0u);
      EXPECT_EQ(spilled_pages(seq, s), e.stats().spill_cold_pages);
      const std::vector<uint8_t> q = c1.query();
      decode_all(e, seq.get(), s, q);  // reads in flight, maybe
      seq.save(dir.file("cold.wkv"));
      // The file holds every page: it decodes in memory as the reference.
      wavekv::Sequence loaded = wavekv::Sequence::load(mem, dir.file("cold.wkv"));
      const std::vector<uint8_t> q2 = c1.query();
      EXPECT_TRUE(decode_all(mem, loaded.get(), s, q2) == decode_all(mem, ref.get(), s, q2));

      // Evicted with cold pages, restored by its next use.
      bool resident = false;
      const std::vector<uint8_t> before = decode_until_resident(e, seq.get(), s, q2, 200, &resident);
      ASSERT_TRUE(resident);
      seq.evict();
      EXPECT_EQ(e.stats().evicted_sequences, 1u);
      EXPECT_EQ(spilled_pages(seq, s, true), pages) << "evicted, every page is in the spill file";
      const std::vector<uint8_t> after = decode_until_resident(e, seq.get(), s, q2, 200, &resident);
      ASSERT_TRUE(resident);
      EXPECT_TRUE(after == before);
      EXPECT_EQ(e.stats().evicted_sequences, 0u);
      EXPECT_EQ(spilled_pages(seq, s), e.stats().spill_cold_pages) << "restored, its cold pages stay out";
    }
    const wkv_stats x = e.stats();
    EXPECT_EQ(x.spill_cold_pages, 0u);
    EXPECT_EQ(x.spill_bytes_used, 0u) << "a destroyed sequence's cold pages give their space back";
    EXPECT_EQ(x.pages_used, 0u);
  }
  EXPECT_EQ(dir.names(), std::vector<std::string>{"cold.wkv"}) << "nothing left of the spill file";
}

// A flipped bit in every spilled page: each read back fails its checksum,
// its clusters are estimated from then on (decoding goes on, finite), the
// failures are counted, and saving the sequence fails rather than writing
// bad KV; another sequence of the engine is untouched.
TEST(ColdPages, ACorruptSpilledPageIsAnErrorNeverData) {
  const Shape s;
  wkv_stats full;
  const uint64_t pages = pages_of(s, &full);
  ScratchDir dir;
  wavekv::Engine e(cold_config(s, dir.path(), pages / 3 * full.page_bytes));
  wavekv::Sequence seq(e);
  Context c2(s);
  prompt(seq, s, c2);
  const wkv_stats st = e.stats();
  ASSERT_GT(st.spill_cold_pages, 0u);
  // The spill file, through /proc (the process holds its only name).
  const int fd = reopen_spill_file(dir.path());
  ASSERT_GE(fd, 0);
  const uint64_t span = (st.page_bytes + 4095) / 4096 * 4096;
  for (uint64_t at = 100; at < st.spill_file_bytes; at += span) flip_byte(fd, at);
  ::close(fd);
  Context q(s, 11);
  for (int i = 0; i < 40 && e.stats().spill_read_errors == 0; ++i) {
    const std::vector<float> out = to_f32(s, decode_all(e, seq.get(), s, q.query()));
    for (float x : out) ASSERT_TRUE(std::isfinite(x));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const wkv_stats x = e.stats();
  EXPECT_GT(x.spill_read_errors, 0u);
  EXPECT_EQ(x.spill_pages_read, 0u) << "no corrupt page came back as data";
  EXPECT_EQ(wkv_seq_save(seq.get(), dir.file("bad.wkv").c_str(), 0), WKV_ERR_CORRUPT);
  EXPECT_NE(std::string(wkv_last_error()).find("checksum"), std::string::npos) << wkv_last_error();
  // Decoding still works, and still estimates the failed pages' clusters.
  const std::vector<float> out = to_f32(s, decode_all(e, seq.get(), s, q.query()));
  for (float v : out) EXPECT_TRUE(std::isfinite(v));
}

// A spill budget that cannot hold what must leave: the append that needs
// room fails with WKV_ERR_BUDGET, and the sequence keeps every token it had.
TEST(ColdPages, AFullSpillBudgetRefusesTheAppendAndLosesNothing) {
  const Shape s;
  wkv_stats full;
  const uint64_t pages = pages_of(s, &full);
  ScratchDir dir;
  const uint64_t span = (full.page_bytes + 4095) / 4096 * 4096;
  wavekv::Engine e(cold_config(s, dir.path(), pages / 3 * full.page_bytes, 4 * span));
  wavekv::Sequence seq(e);
  Context ctx(s);
  std::vector<uint8_t> k, v;
  ctx.tokens(kPrompt, &k, &v);
  uint64_t held = 0;
  int refused = 0;
  for (uint32_t at = 0; at < kPrompt; at += 256) {
    const uint32_t n = std::min<uint32_t>(256, kPrompt - at);
    const size_t row = size_t(s.kv_heads) * s.head_dim * 2;
    const int rc = wkv_seq_append(seq.get(), 0, k.data() + at * row, v.data() + at * row, n, 0, 0, nullptr);
    if (rc == WKV_OK) {
      held += n;
      continue;
    }
    EXPECT_EQ(rc, WKV_ERR_BUDGET) << wkv_last_error();
    ++refused;
    break;
  }
  EXPECT_EQ(refused, 1);
  EXPECT_EQ(e.stats().tokens, held);
  wkv_seq_info info;
  wkv_seq_info_init(&info);
  ASSERT_EQ(wkv_seq_info_get(seq.get(), 0, &info), WKV_OK);
  EXPECT_EQ(info.tokens, held);
  // A lookup, which ends the prompt (a growth that needs pages too), is
  // refused the same way or decodes; either way the tokens stay.
  std::vector<uint8_t> q = ctx.query(), out(q.size());
  wavekv::Plan p(e);
  wkv_seq *sp = seq.get();
  const int rc = wkv_decode(p.get(), &sp, 1, 0, q.data(), 0, 0, out.data(), 0, 0, nullptr);
  EXPECT_TRUE(rc == WKV_OK || rc == WKV_ERR_BUDGET) << wkv_status_name(rc) << ": " << wkv_last_error();
  EXPECT_EQ(e.stats().tokens, held);
}
