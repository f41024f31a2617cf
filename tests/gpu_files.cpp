// Sequence files across backends, on a GPU: a file saved by a CPU engine
// loads into a CUDA engine and decodes the same within f16 rounding; saved
// again by the CUDA engine it loads into a CPU engine and decodes bit for
// bit as the first; a CUDA engine saves right after appends enqueued on a
// stream of the caller's, without the caller waiting (the save waits for
// the sequence's own work). Skips where no CUDA device exists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "files_support.hpp"
#include "gpu_support.hpp"

using namespace wkvtest;

namespace {

const Shape kShape{2, 8, 2, 128, WKV_DTYPE_F16};

wkv_config config(uint32_t device) {
  wkv_config c = file_config(kShape);
  c.device = device;
  c.segment_tokens = 1024;
  c.update_segment_tokens = 256;
  c.device_cache_bytes = 8u << 20;
  // Full retrieval: every engine's decode is then exact attention whatever
  // clusters it grows after the load (a CUDA engine's k-means differs from
  // the CPU's near ties).
  c.retrieval_frac = 1.0f;
  c.estimation_frac = 0.0f;
  return c;
}

struct Side {
  bool gpu;
  wavekv::Engine engine;
  explicit Side(uint32_t device) : gpu(device == WKV_DEVICE_CUDA), engine(config(device)) {}
  Side(uint32_t device, const wkv_config &c) : gpu(device == WKV_DEVICE_CUDA), engine(c) {}
  void append(wavekv::Sequence &s, const std::vector<uint8_t> &k, const std::vector<uint8_t> &v, uint32_t n,
              void *stream = nullptr) {
    Buf dk(gpu, k), dv(gpu, v);
    for (uint32_t l = 0; l < kShape.layers; ++l) s.append(l, dk.p, dv.p, n, 0, 0, stream);
    if (gpu) {
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // before the buffers go
    }
  }
  std::vector<float> decode(wavekv::Sequence &s, const std::vector<uint8_t> &q) {
    wavekv::Plan p(engine);
    Buf dq(gpu, q), dout(gpu, std::vector<uint8_t>(q.size()));
    std::vector<float> all;
    for (uint32_t l = 0; l < kShape.layers; ++l) {
      wkv_seq *seq = s.get();
      p.decode(&seq, 1, l, dq.p, dout.p);
      if (gpu) {
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      }
      const std::vector<float> out = unpack(kShape.dtype, dout.host(), q.size() / 2);
      all.insert(all.end(), out.begin(), out.end());
    }
    return all;
  }
};

double rel_diff(const std::vector<float> &a, const std::vector<float> &b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += double(a[i] - b[i]) * (a[i] - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace

TEST(GpuFiles, AFileMovesBetweenCpuAndCudaEngines) {
  REQUIRE_GPU();
  ScratchDir dir;
  Side cpu(WKV_DEVICE_CPU), gpu(WKV_DEVICE_CUDA), back(WKV_DEVICE_CPU);
  Context ctx(kShape, 5);
  wavekv::Sequence sc(cpu.engine);
  std::vector<uint8_t> k, v;
  ctx.tokens(3000, &k, &v);
  cpu.append(sc, k, v, 3000);
  for (uint32_t l = 0; l < kShape.layers; ++l) sc.end_prompt(l);
  ctx.tokens(300, &k, &v);  // an update segment
  cpu.append(sc, k, v, 300);
  sc.save(dir.file("cpu.wkv"));

  wavekv::Sequence sg = wavekv::Sequence::load(gpu.engine, dir.file("cpu.wkv"));
  sg.save(dir.file("gpu.wkv"));
  wavekv::Sequence sb = wavekv::Sequence::load(back.engine, dir.file("gpu.wkv"));
  for (int step = 0; step < 3; ++step) {
    const std::vector<uint8_t> q = ctx.query();
    const std::vector<float> oc = cpu.decode(sc, q), og = gpu.decode(sg, q), ob = back.decode(sb, q);
    EXPECT_EQ(ob, oc) << "CPU -> file -> CUDA -> file -> CPU is bit for bit";
    EXPECT_LT(rel_diff(og, oc), 1e-2) << "step " << step;
    ctx.tokens(200, &k, &v);  // growing on, the same on all three
    cpu.append(sc, k, v, 200);
    gpu.append(sg, k, v, 200);
    back.append(sb, k, v, 200);
  }
  EXPECT_EQ(sg.info(1).segments, sc.info(1).segments);
}

TEST(GpuFiles, ASaveRightAfterAppendsOnTheCallersStreamWaitsForThem) {
  REQUIRE_GPU();
  ScratchDir dir;
  Side gpu(WKV_DEVICE_CUDA), cpu(WKV_DEVICE_CPU);
  Context ctx(kShape, 9);
  std::vector<uint8_t> k, v;
  // Less than a segment beyond the window: all of it in the steady zone, on
  // both engines alike.
  ctx.tokens(900, &k, &v);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  wavekv::Sequence sg(gpu.engine), sc(cpu.engine);
  {
    Buf dk(true, k), dv(true, v);
    for (uint32_t l = 0; l < kShape.layers; ++l) sg.append(l, dk.p, dv.p, 900, 0, 0, stream);
    sg.save(dir.file("gpu.wkv"));  // no wait for `stream` before it
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  cpu.append(sc, k, v, 900);
  sc.save(dir.file("cpu.wkv"));
  // Every section the same as the CPU engine's, byte for byte but for the
  // superblock (the time, the device).
  const std::vector<wkv::SectionInfo> sa = sections_of(dir.file("gpu.wkv")), sb = sections_of(dir.file("cpu.wkv"));
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    ASSERT_EQ(sa[i].bytes, sb[i].bytes) << wkv::section_name(i, sa[i]);
    EXPECT_EQ(sa[i].checksum, sb[i].checksum) << wkv::section_name(i, sa[i]);
  }
  cudaStreamDestroy(stream);
}

// The spill tier on a CUDA engine: an evicted sequence's pages leave host
// memory; its next decode restores them and refills the device's page table,
// and decodes bit for bit as before (from pages and from cache frames);
// growing on after an explicit restore, it matches a CPU twin.
TEST(GpuFiles, AnEvictedSequenceDecodesTheSameOnACudaEngine) {
  REQUIRE_GPU();
  ScratchDir dir;
  wkv_config c = config(WKV_DEVICE_CUDA);
  c.spill_dir = dir.path().c_str();
  Side gpu(WKV_DEVICE_CUDA, c), cpu(WKV_DEVICE_CPU);
  Context ctx(kShape, 6);
  wavekv::Sequence sg(gpu.engine), sc(cpu.engine);
  std::vector<uint8_t> k, v;
  ctx.tokens(3000, &k, &v);
  gpu.append(sg, k, v, 3000);
  cpu.append(sc, k, v, 3000);
  const std::vector<uint8_t> q = ctx.query();
  const std::vector<float> first = gpu.decode(sg, q), again = gpu.decode(sg, q);
  const wkv_stats s0 = gpu.engine.stats();
  sg.evict();
  const wkv_stats s1 = gpu.engine.stats();
  EXPECT_EQ(s1.evicted_sequences, 1u);
  EXPECT_LT(s1.pages_used, s0.pages_used);
  EXPECT_GT(s1.spill_bytes_used, 0u);
  std::printf("evicted %llu bytes (io bits 0x%llx)\n", static_cast<unsigned long long>(s1.spill_bytes_used),
              static_cast<unsigned long long>(s1.spill_io));
  EXPECT_EQ(gpu.decode(sg, q), again);  // restored by the lookup
  EXPECT_EQ(gpu.engine.stats().evicted_sequences, 0u);
  EXPECT_EQ(gpu.engine.stats().pages_used, s0.pages_used);
  sg.evict();
  sg.restore();
  ctx.tokens(600, &k, &v);
  gpu.append(sg, k, v, 600);
  cpu.append(sc, k, v, 600);
  const std::vector<uint8_t> q2 = ctx.query();
  EXPECT_LT(rel_diff(gpu.decode(sg, q2), cpu.decode(sc, q2)), 1e-2);
  (void)first;
}
