// The references wavekv is measured against, over the synthetic context's
// head-major storage ([H][head_stride][d]):
//
// - ExactAttention: the exact CPU baseline a runtime without wavekv would
//   run: every token, f32 accumulation over the storage dtype, K and V read
//   once per KV head for all G query heads of its group, split into token
//   chunks across threads as flash-decoding does and merged in log space.
//   Same thread count as the engine. Its kernel is an AVX2/F16C one of its
//   own (see exact.cpp), or kernels::attend_exact where the CPU lacks those.
// - attend_f64: exact attention in double over a set of token ranges, for
//   the accuracy reference (all tokens) and the sink + window baseline.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace wkv_tool {

// A fixed set of threads running one parallel loop at a time; the calling
// thread takes part, so `threads` is the total.
class WorkerPool {
 public:
  explicit WorkerPool(unsigned threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool &) = delete;
  WorkerPool &operator=(const WorkerPool &) = delete;

  unsigned threads() const { return static_cast<unsigned>(workers_.size()) + 1; }
  // Runs fn(i) for i in [0, n), spread over the threads; returns when done.
  void run(size_t n, const std::function<void(size_t)> &fn);

 private:
  void work();
  void drain();

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(size_t)> *fn_ = nullptr;
  size_t n_ = 0, next_ = 0, busy_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

class ExactAttention {
 public:
  // chunk_tokens: tokens per task of the split.
  ExactAttention(WorkerPool &pool, uint32_t dtype, uint32_t kv_heads, uint32_t q_heads,
                 uint32_t head_dim, uint32_t chunk_tokens = 4096);

  // Attends q [q_heads][d] (f32) over tokens [0, n) of k, v (storage dtype,
  // head-major, head_stride tokens between heads); writes out [q_heads][d].
  void run(const void *k, const void *v, uint64_t head_stride, uint64_t n, const float *q,
           float *out);

  // Whether chunks run on the baseline's own AVX2 kernel (the default where
  // the CPU has AVX2, FMA and F16C) or on kernels::attend_exact.
  bool fast() const { return fast_; }
  void use_library_kernel(bool yes);

 private:
  WorkerPool &pool_;
  uint32_t dtype_, H_, G_, d_, chunk_;
  bool fast_;
  std::vector<float> part_out_, part_lse_;
};

// Token ranges [begin, end) attended by attend_f64.
struct Range {
  uint64_t begin, end;
};

// Optional per-query-head probe of the f64 attention: the probability mass
// of tokens [0, sink_tokens) and of one token `probe_pos[j]` (-1: none);
// and, with oracle_budget > 0, the oracle top-k output: exact attention
// over only the oracle_budget tokens with the highest logits for that query
// head (the best any selection of that many tokens per head can do).
struct Probe {
  uint64_t sink_tokens = 0;
  double top_frac = 0.018;         // top_share: of the top this fraction of tokens
  std::vector<int64_t> probe_pos;  // [q_heads]
  uint64_t oracle_budget = 0;
  std::vector<double> sink_share;  // out [q_heads]
  std::vector<double> probe_share; // out [q_heads]
  std::vector<double> oracle_out;  // out [q_heads][d]
  std::vector<char> probe_in_oracle;  // out [q_heads]: probe_pos is in the oracle's set
  std::vector<double> top_share;   // out [q_heads]: mass of the ceil(top_frac n) highest logits
};

// Exact attention in double of q [q_heads][d] over the union of `ranges`
// of k32, v32 (f32, head-major, head_stride tokens between heads); writes
// out [q_heads][d].
void attend_f64(WorkerPool &pool, const float *k32, const float *v32, uint64_t head_stride,
                const std::vector<Range> &ranges, uint32_t kv_heads, uint32_t q_heads,
                uint32_t head_dim, const float *q, double *out, Probe *probe);

}  // namespace wkv_tool
