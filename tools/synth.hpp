// A synthetic long context whose keys have the structure that matters to a
// cluster index, shared by `wavekv demo`, `bench` and `stats`.
//
// Per KV head, independently seeded (so the result does not depend on the
// thread count):
//
//   document layout   the context is a sequence of documents of doc_min ..
//                     doc_max tokens; each draws one of `topics` topics. The
//                     layout is shared by all heads; generated tokens extend
//                     the last document, then open new ones.
//   key of token s    k0 = A * w_doc + n,  n ~ N(0, 1)^d         (pre-RoPE)
//                     k  = RoPE(k0, s) + mu                       (post-RoPE)
//                     w_doc = normalise(u_topic + 0.5 * r): documents of a
//                     topic are alike but not equal. mu is one offset shared
//                     by every key, of norm mean_ratio times the per-token
//                     variation (real keys have such a common component).
//                     RoPE is rotate-half with theta 1e4.
//   sinks             the first `sinks` tokens: k = mu + S * qmean_hat + noise,
//                     aligned with the common component qmean of the queries,
//                     so that typical queries give them high scores.
//   needles           `needles` tokens at random positions of the prompt
//                     (outside the sink and the last guard tokens) get
//                     k0 += An * v_needle, v_needle a unit direction of their
//                     own; a needle query aims at exactly that key.
//   values            N(0, 1)^d.
//
// Queries of one step, post-RoPE, per query head of KV head h:
//   q = qmean_h + 0.3 * N(0, 1)^d + target, where target aims at
//   - a span (mixture): B * RoPE(w_D, c) for a document D present in the
//     context and a position c inside it (with probability 0.3, two
//     documents at 0.75 B each); the query content carries the relative
//     offset, as a trained query does, so keys of D near c score high;
//   - or a needle: Bn * RoPE(v_needle, s_needle).
// The constants (synth.cpp) are set so that exact attention is about as
// sparse as LLM heads are reported to be: over topic queries the top 2% of
// non-sink tokens hold ~94% of the non-sink mass at 32K tokens and ~88% at
// 128K; sinks take a sizeable share; a needle query puts most of its mass on
// the needle (the demo prints the sink and needle shares).
//
// Storage: keys and values of every head are kept head-major, [H][cap][d],
// in the storage dtype (what the engine and the exact baseline read) and
// optionally as f32 copies of those same rounded values (for the f64
// reference). Queries are rounded to the dtype likewise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace wkv_tool {

class WorkerPool;

// Conversions between f32 and a storage dtype (WKV_DTYPE_*).
uint32_t dtype_size(uint32_t dtype);
void to_storage(uint32_t dtype, const float *src, void *dst, size_t n);
void from_storage(uint32_t dtype, const void *src, float *dst, size_t n);

struct SynthSpec {
  uint32_t kv_heads = 8;
  uint32_t q_heads = 32;
  uint32_t head_dim = 128;
  uint32_t dtype = 1;           // WKV_DTYPE_F16
  uint64_t prompt_tokens = 0;   // tokens of the prompt (needles go there)
  uint64_t capacity = 0;        // prompt plus every token appended later
  uint64_t seed = 1;
  bool keep_f32 = true;         // keep f32 copies for a reference
  uint32_t topics = 64;
  uint32_t doc_min = 128, doc_max = 768;
  uint32_t sinks = 4;
  uint32_t needles = 8;         // per KV head
  uint32_t needle_guard = 128;  // needles stay this far from the end of the prompt
  float span_amp = 15.0f;       // B: how sharply a span query aims at its span
  float sink_amp = 26.0f;       // S: how much typical queries favour the sinks
  float value_mean = 0.0f;      // |mean value| / |per-token value variation|
};

// The diffuse workload (`wavekv demo --workload diffuse`): span queries
// aimed loosely (B = 8 rather than 15), sinks that typical queries favour
// less (S = 10 rather than 26), and values with a common component half the
// size of their per-token variation, as real values have one. The top 1.8%
// of keys then hold about a third of a query's attention, where the needles
// workload's hold nine tenths (the demo prints the median share).
void set_diffuse(SynthSpec *spec);

// One planted needle: a token of one KV head.
struct Needle {
  uint32_t head = 0;
  uint64_t pos = 0;
  std::vector<float> dir;  // unit, pre-RoPE
};

class SynthContext {
 public:
  // Pre: spec.head_dim even, capacity >= prompt_tokens.
  explicit SynthContext(const SynthSpec &spec);

  const SynthSpec &spec() const { return spec_; }
  uint64_t tokens() const { return tokens_; }
  uint32_t documents() const { return static_cast<uint32_t>(docs_.size()); }
  const std::vector<Needle> &needles() const { return needles_; }

  // Generates the next n tokens of every head (in parallel over heads on
  // `pool` if given). Pre: tokens() + n <= capacity.
  void generate(uint64_t n, WorkerPool *pool);

  // Storage rows, head-major with `head_stride()` tokens between heads.
  uint64_t head_stride() const { return spec_.capacity; }
  const void *k_store(uint32_t h, uint64_t pos) const;
  const void *v_store(uint32_t h, uint64_t pos) const;
  // The same rows as f32 (only with keep_f32).
  const float *k32(uint32_t h, uint64_t pos) const;
  const float *v32(uint32_t h, uint64_t pos) const;

  // The queries of one step at position tokens() - 1, [q_heads][d]: q_store
  // in the storage dtype, q32 the same values as f32. With needle_step,
  // KV head h's query head h*G + (round % G) aims at needle
  // (round + h) % needles of head h; needle_of[j] is the index into
  // needles() of query head j's target, or -1.
  void make_queries(bool needle_step, uint32_t round, std::vector<uint8_t> *q_store,
                    std::vector<float> *q32, std::vector<int> *needle_of);

 private:
  struct Doc {
    uint64_t begin = 0, end = 0;  // [begin, end) in positions
    uint32_t topic = 0;
  };
  struct Head {
    std::vector<float> mu, qmean;  // [d] post-RoPE
    std::vector<float> vmean;      // [d] the values' common component
    std::vector<float> topic;      // [topics][d] unit
    std::vector<float> doc_dir;    // [docs][d] unit, grows with docs_
    std::vector<uint32_t> needle_ids;  // indices into needles_ of this head
  };

  void plan_docs_until(uint64_t end);
  // cs: [n][d/2][2] cos and sin of each position's pairs.
  void gen_head(uint32_t h, uint64_t first, uint64_t n, const float *cs);
  void rope(const float *x, uint64_t pos, float *out) const;

  SynthSpec spec_;
  uint64_t tokens_ = 0;
  std::vector<double> inv_freq_;  // [d/2]
  std::vector<Doc> docs_;
  std::vector<Head> heads_;
  std::vector<Needle> needles_;
  uint64_t layout_rng_[4];
  uint64_t query_rng_[4];
  std::vector<uint8_t> k_store_, v_store_;
  std::vector<float> k32_, v32_;
};

}  // namespace wkv_tool
