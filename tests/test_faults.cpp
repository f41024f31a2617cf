// Memory faults injected on purpose: a host arena chunk that cannot be had
// and engine memory that cannot be had (the CPU engine's host regions) are
// reported as statuses by the call that needed them, nothing half-done is
// left, and the engine goes on serving. (tests/gpu_head_state.cpp injects the
// CUDA engine's: device memory, and pinning, which falls back to pageable
// memory where the device can read it.)
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "lib/engine/engine.hpp"
#include "lib/engine/plan.hpp"
#include "lib/engine/sequence.hpp"
#include "engine_support.hpp"
#include "support.hpp"

using namespace wkvtest;

namespace {

constexpr uint32_t kQ = 4, kKV = 2, kD = 64;

struct Fixture {
  std::shared_ptr<wkv::Engine> e;
  std::shared_ptr<wkv::Sequence> seq;
  std::vector<HeadRows> rows{kKV};
  KeyGen gen{kKV, kD, 3};
  Fixture() {
    wkv_config c;
    wkv_config_init(&c);
    c.n_layers = 1;
    c.n_q_heads = kQ;
    c.n_kv_heads = kKV;
    c.head_dim = kD;
    c.dtype = WKV_DTYPE_F32;
    c.segment_tokens = 256;
    c.update_segment_tokens = 64;
    c.retrieval_frac = 1.0f;
    c.estimation_frac = 0.0f;
    c.host_chunk_bytes = 1u << 20;
    c.threads = 1;
    EXPECT_TRUE(wkv::Engine::open(&c, &e).is_ok());
    EXPECT_TRUE(wkv::Sequence::create(e, &seq).is_ok());
  }
  wkv::Status append(uint32_t n) {
    std::vector<float> k, v;
    gen.next(n, &k, &v);
    wkv::Status st = e->append(*seq, 0, reinterpret_cast<const uint8_t *>(k.data()),
                               reinterpret_cast<const uint8_t *>(v.data()), n, kKV * kD, kD, nullptr);
    if (st.is_ok())
      for (uint32_t t = 0; t < n; ++t)
        for (uint32_t h = 0; h < kKV; ++h) {
          const size_t off = (static_cast<size_t>(t) * kKV + h) * kD;
          rows[h].k.insert(rows[h].k.end(), k.begin() + off, k.begin() + off + kD);
          rows[h].v.insert(rows[h].v.end(), v.begin() + off, v.begin() + off + kD);
        }
    return st;
  }
  // Worst error of a full-retrieval decode against exact attention.
  double decode_error() { return wkvtest::decode_error(e, seq, rows, gen, kQ, kD); }
  uint64_t tokens() const { return seq->layer(0).tokens; }
};

}  // namespace

TEST(Faults, AHostChunkThatCannotBeHadFailsItsGrowthAndNothingElse) {
  Fixture f;
  ASSERT_TRUE(f.append(100).is_ok());
  f.e->arena().inject_chunk_failures(1);
  const wkv::Status st = f.append(400);  // completes a segment: pages needed
  EXPECT_EQ(st.code(), WKV_ERR_OUT_OF_MEMORY) << st.message();
  EXPECT_EQ(f.tokens(), 100u);
  EXPECT_EQ(f.seq->layer(0).heads[0].segments.size(), 0u);
  EXPECT_LT(f.decode_error(), 1e-5);
  ASSERT_TRUE(f.append(400).is_ok()) << "the next chunk is had";
  EXPECT_GT(f.seq->layer(0).heads[0].segments.size(), 0u);
  EXPECT_LT(f.decode_error(), 1e-5);
}

TEST(Faults, EngineMemoryThatCannotBeHadFailsTheCallThatNeededIt) {
  Fixture f;
  ASSERT_TRUE(f.append(100).is_ok());
  // Every allocation of a growth in turn: rows, meta regions, pages'
  // staging. Each failure leaves the layer as it was.
  for (uint32_t skip = 0; skip < 8; ++skip) {
    f.e->faults().arm(wkv::FaultInjector::kEngineAlloc, 1, skip);
    const uint64_t before = f.tokens();
    const wkv::Status st = f.append(300);
    f.e->faults().arm(wkv::FaultInjector::kEngineAlloc, 0);
    if (st.is_ok()) continue;  // this growth allocated fewer than skip + 1 regions
    EXPECT_EQ(st.code(), WKV_ERR_OUT_OF_MEMORY) << st.message();
    EXPECT_EQ(f.tokens(), before) << "skip " << skip;
  }
  EXPECT_LT(f.decode_error(), 1e-5);
  ASSERT_TRUE(f.append(200).is_ok());
  EXPECT_LT(f.decode_error(), 1e-5);
  wkv_stats s;
  wkv_stats_init(&s);
  f.e->fill_stats(&s);
  EXPECT_EQ(s.tokens, f.tokens());
}
