// 8-bit pages (WKV_PAGE_FORMAT_INT8) on a GPU: the CUDA page writes quantize
// every row to the CPU's bytes, and the gather (from host pages on a miss,
// from the device cache's frames on a hit) writes the same execution buffer
// as the CPU engine's assemble. Skips where no CUDA device exists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "files_support.hpp"
#include "gpu_support.hpp"
#include "kernels/dtype.hpp"

using namespace wkvtest;

namespace {

wkv_config config(const Shape &s, uint32_t device) {
  wkv_config c = file_config(s);
  c.device = device;
  c.page_format = WKV_PAGE_FORMAT_INT8;
  c.device_cache_bytes = 8u << 20;
  // Full retrieval: both engines attend every cluster, in id order, so
  // that their execution buffers must agree byte for byte.
  c.retrieval_frac = 1.0f;
  c.estimation_frac = 0.0f;
  return c;
}

// A K row of head h as a page keeps it: its 8-bit values, then its scale.
std::string paged_key(uint32_t dtype, const uint8_t *row, uint32_t d) {
  std::vector<float> f(d);
  std::string key(d + 4, '\0');
  float scale = 0;
  wkv::to_float(static_cast<wkv::DType>(dtype), row, f.data(), d);
  wkv::quantize_row(f.data(), d, reinterpret_cast<int8_t *>(key.data()), &scale);
  std::memcpy(key.data() + d, &scale, 4);
  return key;
}

// The execution buffer of a plan after lookup and assemble, on the host.
struct HostXbuf {
  std::vector<int32_t> offsets;
  std::vector<uint8_t> k, v;
};

HostXbuf host_xbuf(const wavekv::Plan &p, bool device, size_t row) {
  const wkv_xbuf_view x = p.xbuf();
  HostXbuf h;
  h.offsets.resize(x.n_runs + 1);
  if (device) {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(h.offsets.data(), x.offsets, h.offsets.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  } else {
    std::memcpy(h.offsets.data(), x.offsets, h.offsets.size() * 4);
  }
  const size_t bytes = size_t(h.offsets[x.n_runs]) * row;
  h.k.resize(bytes);
  h.v.resize(bytes);
  const cudaMemcpyKind kind = device ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost;
  EXPECT_EQ(cudaMemcpy(h.k.data(), x.k, bytes, kind), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(h.v.data(), x.v, bytes, kind), cudaSuccess);
  return h;
}

TEST(GpuInt8Pages, CudaPageWritesAndGathersGiveTheCpuEnginesBytes) {
  REQUIRE_GPU();
  ScratchDir dir;
  const Shape shapes[] = {{1, 8, 2, 128, WKV_DTYPE_BF16}, {1, 4, 2, 64, WKV_DTYPE_F16},
                          {1, 4, 2, 80, WKV_DTYPE_F32}, {1, 4, 1, 256, WKV_DTYPE_F16}};
  for (const Shape &s : shapes) {
    SCOPED_TRACE(testing::Message() << "d=" << s.head_dim << ", dtype " << s.dtype);
    const uint32_t d = s.head_dim;
    const size_t row = size_t(d) * wkv::dtype_bytes(static_cast<wkv::DType>(s.dtype));
    wavekv::Engine gpu(config(s, WKV_DEVICE_CUDA)), cpu(config(s, WKV_DEVICE_CPU));
    Context ctx(s), again(s);
    wavekv::Sequence sg(gpu);
    {  // a prompt, then tokens one at a time (device rows, as a CUDA engine takes them)
      std::vector<uint8_t> hk, hv;
      auto append = [&](uint32_t n) {
        ctx.tokens(n, &hk, &hv);
        Buf dk(true, hk), dv(true, hv);
        sg.append(0, dk.p, dv.p, n);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // before the buffers go
      };
      append(1500);
      sg.end_prompt(0);
      for (int g = 0; g < 90; ++g) append(1);
    }
    // 1. Every row the CUDA engine wrote into a page is the CPU's
    //    quantization of a row appended to its head.
    std::vector<std::set<std::string>> appended(s.kv_heads);
    std::vector<uint8_t> k, v;
    auto take = [&](uint32_t tokens) {  // as they were appended
      again.tokens(tokens, &k, &v);
      for (uint32_t t = 0; t < tokens; ++t)
        for (uint32_t h = 0; h < s.kv_heads; ++h)
          appended[h].insert(paged_key(s.dtype, k.data() + (size_t(t) * s.kv_heads + h) * row, d));
    };
    take(1500);
    for (int g = 0; g < 90; ++g) take(1);
    const std::string path = dir.file("gpu.wkv");
    sg.save(path);
    wkv::FileIO &io = wkv::posix_io();
    const int fd = io.open_read(path.c_str());
    wkv::SeqFileReader reader(io, fd);
    ASSERT_TRUE(reader.open().is_ok());
    wkv::LayerSnapshot snap;
    ASSERT_TRUE(reader.read_layer(0, &snap).is_ok());
    io.close(fd);
    wkv_config cc = config(s, WKV_DEVICE_CPU);
    wkv::Config cfg;
    ASSERT_TRUE(wkv::resolve_config(&cc, &cfg).is_ok());
    const uint32_t pt = cfg.page_tokens(), slot = cfg.page_slot_bytes(), scales = cfg.page_scales_at();
    uint64_t rows = 0, found = 0;
    for (uint32_t h = 0; h < s.kv_heads; ++h) {
      const wkv::HeadSnapshot &o = snap.heads[h];
      for (size_t c = 0; c < o.size.size(); ++c)
        for (uint32_t m = 0; m < o.size[c]; ++m) {
          const uint64_t at = uint64_t(o.first_slot[c]) + m;
          const uint8_t *page = o.pages.data() + (at / pt) * slot;
          std::string key(d + 4, '\0');
          std::memcpy(key.data(), page + (at % pt) * d, d);
          std::memcpy(key.data() + d, page + scales + (at % pt) * 4, 4);
          ++rows;
          found += appended[h].count(key);
        }
    }
    EXPECT_GT(rows, 1000u);
    EXPECT_EQ(found, rows) << "K rows of the CUDA engine's pages that are no CPU quantization of an appended row";
    // 2. The same pages in a CPU engine: the same execution buffer, on a
    //    miss (from host pages) and on a hit (from the frames admitted).
    wavekv::Sequence sc = wavekv::Sequence::load(cpu, path);
    wavekv::Plan pg(gpu), pc(cpu);
    const std::vector<uint8_t> q = ctx.query();
    Buf dq(true, q), dout(true, std::vector<uint8_t>(q.size()));
    for (int pass = 0; pass < 3; ++pass) {
      SCOPED_TRACE(testing::Message() << "pass " << pass);
      wkv_seq *a = sg.get(), *b = sc.get();
      pg.lookup(&a, 1, 0, dq.p);
      pc.lookup(&b, 1, 0, q.data());
      pg.assemble();
      pc.assemble();
      const HostXbuf xg = host_xbuf(pg, true, row), xc = host_xbuf(pc, false, row);
      EXPECT_EQ(xg.offsets, xc.offsets);
      EXPECT_TRUE(xg.k == xc.k) << "K rows differ";
      EXPECT_TRUE(xg.v == xc.v) << "V rows differ";
      std::vector<uint8_t> oc(q.size());
      pg.attend(dout.p);
      pc.attend(oc.data());
      pg.update();
      pc.update();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
    const wkv_stats st = gpu.stats();
    EXPECT_GT(st.cache_hits, 0u) << "later passes read frames";
    EXPECT_GT(st.cache_misses, 0u);
  }
}

}  // namespace
