// The method's figures on a CUDA engine: tests/test_accuracy's scenario
// (accuracy_support.hpp) decoded by a CPU engine and by a CUDA engine over
// the same tokens, with every method bit the default has. The two engines
// must find the same needles and give errors of the same size (their
// k-means differ near ties, so not bit for bit). And the attention captured
// from a real model (shared/data/real-attention; WKV_SHARED_DIR names the
// folder holding data/): the CUDA engine's errors as the CPU engine's at the
// default budget. Skips where no CUDA device exists, or the data.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "accuracy_support.hpp"
#include "real_attention_data.hpp"
#include "gpu_support.hpp"

using namespace wkvtest;

namespace {

// Tensors in device memory, for a CUDA engine.
struct DeviceMemory : Memory {
  DeviceMemory() { device = WKV_DEVICE_CUDA; }
  ~DeviceMemory() override {
    for (void *p : owned) cudaFree(p);
  }
  void *put(const void *src, size_t n) override {
    void *p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, n), cudaSuccess);
    owned.push_back(p);
    EXPECT_EQ(src ? cudaMemcpy(p, src, n, cudaMemcpyHostToDevice) : cudaMemset(p, 0, n), cudaSuccess);
    return p;
  }
  void get(void *dst, const void *src, size_t n) override {
    EXPECT_EQ(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  std::vector<void *> owned;
};

void report(const char *what, const Result &cpu, const Result &gpu) {
  std::printf("%s: cpu %u/%u needles, median %.4f (needles %.4f); cuda %u/%u, median %.4f (needles %.4f); "
              "exact tokens %llu vs %llu\n",
              what, cpu.hits, cpu.needle_queries, median(cpu.err), cpu.needle_err.empty() ? 0.0 : median(cpu.needle_err),
              gpu.hits, gpu.needle_queries, median(gpu.err), gpu.needle_err.empty() ? 0.0 : median(gpu.needle_err),
              static_cast<unsigned long long>(cpu.attended), static_cast<unsigned long long>(gpu.attended));
}

}  // namespace

TEST(GpuAccuracy, NeedlesAreFoundAsOnTheCpuEngine) {
  REQUIRE_GPU();
  const Context ctx(6000, 6, 0.f, 11);
  const Result cpu = run(ctx, WKV_METHOD_DEFAULT, 12, 3.f, true);
  const Result gpu = run(ctx, WKV_METHOD_DEFAULT, 12, 3.f, true, DeviceMemory());
  report("needles", cpu, gpu);
  ASSERT_EQ(gpu.needle_queries, 24u);
  EXPECT_EQ(gpu.hits, cpu.hits);
  EXPECT_EQ(gpu.hits, gpu.needle_queries);
  EXPECT_LT(median(gpu.needle_err), 0.1);
  EXPECT_LT(median(gpu.err), 1.25 * median(cpu.err) + 0.005);
  // The same exact tokens (wkv_stats.attended_tokens, counted on the device).
  ASSERT_GT(gpu.attended, 0u);
  EXPECT_LE(double(gpu.attended), 1.1 * double(cpu.attended));
  EXPECT_GE(double(gpu.attended), 0.9 * double(cpu.attended));
}

TEST(GpuAccuracy, DiffuseHeadsAreEstimatedAsOnTheCpuEngine) {
  REQUIRE_GPU();
  const Context ctx(6000, 0, 0.5f, 12);
  const Result paper = run(ctx, WKV_METHOD_PAPER, 10, 0.6f, false, DeviceMemory());
  const Result cpu = run(ctx, WKV_METHOD_DEFAULT, 10, 0.6f, false);
  const Result gpu = run(ctx, WKV_METHOD_DEFAULT, 10, 0.6f, false, DeviceMemory());
  report("diffuse", cpu, gpu);
  std::printf("diffuse: cuda paper median %.4f\n", median(paper.err));
  EXPECT_LT(median(gpu.err), 1.25 * median(cpu.err) + 0.005);
  EXPECT_LT(median(gpu.err), 0.7 * median(paper.err));
}

// The real-attention set (its README): per layer, K and V [8192][2][128]
// then 64 queries [4][128], f16. The prompt is the first 8128 tokens; one
// generated token is appended before each query, as tests/test_real_attention
// does. Both engines decode the same steps; each scores the 8-bit copy of
// its centroids (the CUDA engine's on the device, the CPU engine's in its
// compact mirror) and estimates from 8-bit value sums (CUDA) or value
// means (CPU), each with a scale a row.
TEST(GpuAccuracy, RealAttentionAsOnTheCpuEngine) {
  REQUIRE_GPU();
  namespace ra = wkvtest::real_attention;
  constexpr uint32_t kLayers = ra::kLayers, kQ = ra::kQ, kKVr = ra::kKV, kDr = ra::kD, kT = ra::kT,
                     kQueries = ra::kQueries;
  const std::string dir = ra::data_dir();
  std::vector<uint16_t> raw;
  if (!ra::read_layer(0, &raw)) GTEST_SKIP() << "real attention data not found under " << dir << " (set WKV_SHARED_DIR)";

  struct Side {
    std::unique_ptr<Memory> mem;
    std::unique_ptr<wavekv::Engine> e;
    std::unique_ptr<wavekv::Plan> plan;
    std::unique_ptr<wavekv::Sequence> seq;
    std::vector<double> err;
  };
  Side side[2];
  side[0].mem = std::make_unique<Memory>();
  side[1].mem = std::make_unique<DeviceMemory>();
  for (Side &x : side) {
    wkv_config c;
    wkv_config_init(&c);
    c.device = x.mem->device;
    c.n_layers = kLayers;
    c.n_q_heads = kQ;
    c.n_kv_heads = kKVr;
    c.head_dim = kDr;
    c.dtype = WKV_DTYPE_F16;
    x.e = std::make_unique<wavekv::Engine>(c);
    x.plan = std::make_unique<wavekv::Plan>(*x.e);
    x.seq = std::make_unique<wavekv::Sequence>(*x.e);
  }
  const uint32_t prompt = kT - kQueries;
  for (uint32_t l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(ra::read_layer(l, &raw)) << "layer " << l;
    const uint16_t *K = raw.data(), *V = K + ra::kKVElems, *Q = V + ra::kKVElems;
    const std::vector<HeadRows> rows = ra::head_rows(K, V);
    for (Side &x : side)
      x.seq->append(l, x.mem->put(K, size_t(prompt) * kKVr * kDr * 2), x.mem->put(V, size_t(prompt) * kKVr * kDr * 2),
                    prompt);
    std::vector<double> layer_err[2];
    for (uint32_t j = 0; j < kQueries; ++j) {
      const size_t tok = size_t(prompt + j) * kKVr * kDr;
      const uint16_t *q = Q + size_t(j) * kQ * kDr;
      const uint32_t visible_n = prompt + j + 1;
      std::vector<std::vector<double>> ref(kQ);
      std::vector<float> qf(kDr);
      for (uint32_t h = 0; h < kQ; ++h) {
        HeadRows visible;
        const HeadRows &r = rows[h / (kQ / kKVr)];
        visible.k.assign(r.k.begin(), r.k.begin() + size_t(visible_n) * kDr);
        visible.v.assign(r.v.begin(), r.v.begin() + size_t(visible_n) * kDr);
        for (uint32_t i = 0; i < kDr; ++i) qf[i] = wkv::f16_to_float(q[h * kDr + i]);
        exact_attention(qf.data(), visible, kDr, &ref[h]);
      }
      for (int m = 0; m < 2; ++m) {
        Side &x = side[m];
        x.seq->append(l, x.mem->put(K + tok, size_t(kKVr) * kDr * 2), x.mem->put(V + tok, size_t(kKVr) * kDr * 2), 1);
        wkv_seq *sp = x.seq->get();
        void *out = x.mem->put(nullptr, size_t(kQ) * kDr * 2);
        x.plan->decode(&sp, 1, l, x.mem->put(q, size_t(kQ) * kDr * 2), out);
        std::vector<uint16_t> o(size_t(kQ) * kDr);
        x.mem->get(o.data(), out, o.size() * 2);
        for (uint32_t h = 0; h < kQ; ++h) {
          std::vector<float> of(kDr);
          for (uint32_t i = 0; i < kDr; ++i) of[i] = wkv::f16_to_float(o[h * kDr + i]);
          layer_err[m].push_back(rel_l2(of.data(), ref[h]));
        }
      }
    }
    std::printf("layer %u: median rel. L2 error cpu %.4f (p90 %.4f), cuda %.4f (p90 %.4f)\n", l,
                median(layer_err[0]), quantile(layer_err[0], 0.9), median(layer_err[1]), quantile(layer_err[1], 0.9));
    for (int m = 0; m < 2; ++m) side[m].err.insert(side[m].err.end(), layer_err[m].begin(), layer_err[m].end());
  }
  const std::vector<double> &cpu = side[0].err, &gpu = side[1].err;
  std::printf("all layers: median rel. L2 error cpu %.4f (p90 %.4f), cuda %.4f (p90 %.4f)\n", median(cpu),
              quantile(cpu, 0.9), median(gpu), quantile(gpu, 0.9));
  // The CPU engine's own bound (tests/test_real_attention) and its figures,
  // within what the two engines' k-means (which differ near ties) allow.
  EXPECT_LE(median(gpu), 0.035);
  EXPECT_LE(median(gpu), 1.15 * median(cpu) + 0.002);
  EXPECT_LE(quantile(gpu, 0.9), 1.15 * quantile(cpu, 0.9) + 0.01);
}
