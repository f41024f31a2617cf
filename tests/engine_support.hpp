// Test support through the engine's internal API: a decoding step of one
// sequence against exact attention. Header-only; needs gtest.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "lib/engine/engine.hpp"
#include "lib/engine/plan.hpp"
#include "lib/engine/sequence.hpp"
#include "support.hpp"

namespace wkvtest {

// Decodes one layer-0 query of `seq` (one per KV head's group, from gen)
// and returns the worst relative L2 error over the query heads against
// exact attention over rows, the sequence's rows per KV head (f32 engines).
inline double decode_error(const std::shared_ptr<wkv::Engine> &e, std::shared_ptr<wkv::Sequence> &seq,
                           const std::vector<HeadRows> &rows, KeyGen &gen, uint32_t q_heads, uint32_t d) {
  const uint32_t kv_heads = static_cast<uint32_t>(rows.size()), G = q_heads / kv_heads;
  std::shared_ptr<wkv::StepTracker> t;
  EXPECT_TRUE(e->buffers().new_tracker(&t).is_ok());
  wkv::Plan plan(e, t);
  std::vector<float> q;
  for (uint32_t h = 0; h < kv_heads; ++h) gen.query(h, G, &q);
  std::vector<float> out(q.size());
  wkv::Status st = e->lookup(plan, &seq, 1, 0, q.data(), q_heads * d, d, nullptr);
  if (st.is_ok()) st = e->assemble(plan, nullptr);
  if (st.is_ok()) st = e->attend(plan, out.data(), q_heads * d, d, nullptr, nullptr);
  EXPECT_TRUE(st.is_ok()) << st.message();
  double worst = 0;
  for (uint32_t h = 0; h < q_heads; ++h) {
    std::vector<double> ref;
    exact_attention(&q[h * d], rows[h / G], d, &ref);
    worst = std::max(worst, rel_l2(&out[h * d], ref));
  }
  return worst;
}

}  // namespace wkvtest
