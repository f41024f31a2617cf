// wkv_append_batch on a CUDA engine: the batch's one kernel writes every
// sequence's rows where the single-sequence verb would, across index
// growths, from device memory in any stride layout (down to 2-byte
// alignment) and from mapped host memory; the decoding outputs stay exact
// at full retrieval and agree with an engine fed one sequence at a time.
// Skips where no CUDA device exists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
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
  wavekv::Engine batched{config()}, single{config()};
  std::vector<wavekv::Sequence> bs, ss;
  std::vector<wkv_seq *> bh, sh;
  std::vector<HeadRows> rows[kN];
  std::vector<KeyGen> gens;
  cudaStream_t stream = nullptr;
  Pair() {
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
  void check(KeyGen &qgen, double *worst, double *apart) {
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
        *worst = std::max(*worst, rel_l2(&out_b[at], ref));
        std::vector<double> other(out_s.begin() + at, out_s.begin() + at + kD);
        *apart = std::max(*apart, rel_l2(&out_b[at], other));
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
  p.check(qgen, &worst, &apart);
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
    if (step % 50 < 3) p.check(qgen, &worst, &apart);
  }
  p.check(qgen, &worst, &apart);
  for (uint32_t i = 0; i < kN; ++i) {
    const wkv_seq_info b = p.bs[i].info(0), s = p.ss[i].info(0);
    EXPECT_EQ(b.tokens, 4100u + step);
    EXPECT_EQ(b.tokens, s.tokens);
    EXPECT_EQ(b.segments, s.segments);
    EXPECT_EQ(b.clustered, s.clustered);
    EXPECT_GE(b.segments, 2u + 2u) << "the prompt's two segments (2048 and 1984 tokens) and two growths";
  }
  EXPECT_LT(worst, 5e-3) << "full retrieval must match exact attention";
  EXPECT_LT(apart, 5e-3) << "the batched and the single engine must agree";
}
