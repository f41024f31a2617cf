// The method's figures on a CUDA engine: tests/test_accuracy's scenario
// (accuracy_support.hpp) decoded by a CPU engine and by a CUDA engine over
// the same tokens, with every method bit the default has. The two engines
// must find the same needles and give errors of the same size (their
// k-means differ near ties, so not bit for bit). Skips where no CUDA device
// exists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>

#include "accuracy_support.hpp"
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
