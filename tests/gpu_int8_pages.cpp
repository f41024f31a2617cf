// 8-bit pages (WKV_PAGE_FORMAT_INT8 and _INT8_CENTERED) on a GPU: the CUDA
// page writes quantize every row to the CPU's bytes, and the gather (from
// host pages on a miss, from the device cache's frames on a hit) writes the
// same execution buffer as the CPU engine's assemble. Skips where no CUDA
// device exists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "files_checks.hpp"
#include "gpu_support.hpp"
#include "kernels/dtype.hpp"
#include "kernels/kmeans_cuda.hpp"

using namespace wkvtest;

namespace {

wkv_config config(const Shape &s, uint32_t device, uint32_t page_format = WKV_PAGE_FORMAT_INT8) {
  wkv_config c = file_config(s);
  c.device = device;
  c.page_format = page_format;
  c.device_cache_bytes = 8u << 20;
  // Full retrieval: both engines attend every cluster, in id order, so
  // that their execution buffers must agree byte for byte.
  c.retrieval_frac = 1.0f;
  c.estimation_frac = 0.0f;
  return c;
}

// A token of a head as a page keeps it: its 8-bit K row and K scale, then
// its 8-bit V row and V scale.
std::string paged_slot(uint32_t dtype, const uint8_t *k, const uint8_t *v, uint32_t d) {
  std::vector<float> f(d);
  std::string key(2 * (d + 4), '\0');
  const uint8_t *rows[2] = {k, v};
  for (int r = 0; r < 2; ++r) {
    char *at = key.data() + r * (d + 4);
    float scale = 0;
    wkv::to_float(static_cast<wkv::DType>(dtype), rows[r], f.data(), d);
    wkv::quantize_row(f.data(), d, reinterpret_cast<int8_t *>(at), &scale);
    std::memcpy(at + d, &scale, 4);
  }
  return key;
}

// Gives some tokens' V rows (their first index from `first`) what a
// workload rarely holds, so that the gather's dequantization meets it: a
// zero row, a row with a NaN, a row of tiny values (subnormal in f16).
void doctor_values(std::vector<uint8_t> &v, uint64_t first, uint32_t n, uint32_t H, uint32_t d, uint32_t dtype) {
  const wkv::DType dt = static_cast<wkv::DType>(dtype);
  const size_t row = size_t(d) * wkv::dtype_bytes(dt);
  std::vector<float> x(d);
  for (uint32_t t = 0; t < n; ++t) {
    const uint64_t kind = (first + t) % 101;
    if (kind != 7 && kind != 13 && kind != 29) continue;
    for (uint32_t i = 0; i < d; ++i) x[i] = kind == 7 ? 0.0f : (kind == 29 ? 1e-6f * float(i % 7) - 3e-6f : 1.0f);
    if (kind == 13) x[3] = std::numeric_limits<float>::quiet_NaN();
    for (uint32_t h = 0; h < H; ++h) wkv::from_float(dt, x.data(), v.data() + (size_t(t) * H + h) * row, d);
  }
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

// With centered keys (WKV_PAGE_FORMAT_INT8_CENTERED) each K row is checked
// against its cluster's reference, the centroid the file holds.
TEST(GpuInt8Pages, CudaPageWritesAndGathersGiveTheCpuEnginesBytes) {
  REQUIRE_GPU();
  ScratchDir dir;
  const Shape shapes[] = {{1, 8, 2, 128, WKV_DTYPE_BF16}, {1, 4, 2, 64, WKV_DTYPE_F16},
                          {1, 4, 2, 80, WKV_DTYPE_F32}, {1, 4, 1, 256, WKV_DTYPE_F16}};
  for (const uint32_t fmt : {uint32_t{WKV_PAGE_FORMAT_INT8}, uint32_t{WKV_PAGE_FORMAT_INT8_CENTERED}}) {
    for (const Shape &s : shapes) {
      SCOPED_TRACE(testing::Message() << "page format " << fmt << ", d=" << s.head_dim << ", dtype " << s.dtype);
      const bool centered = fmt == WKV_PAGE_FORMAT_INT8_CENTERED;
      const uint32_t d = s.head_dim;
      const size_t row = size_t(d) * wkv::dtype_bytes(static_cast<wkv::DType>(s.dtype));
      wavekv::Engine gpu(config(s, WKV_DEVICE_CUDA, fmt)), cpu(config(s, WKV_DEVICE_CPU, fmt));
      Context ctx(s), again(s);
      wavekv::Sequence sg(gpu);
      {  // a prompt, then tokens one at a time (device rows, as a CUDA engine takes them)
        std::vector<uint8_t> hk, hv;
        uint64_t appended_tokens = 0;
        auto append = [&](uint32_t n) {
          ctx.tokens(n, &hk, &hv);
          doctor_values(hv, appended_tokens, n, s.kv_heads, d, s.dtype);
          appended_tokens += n;
          Buf dk(true, hk), dv(true, hv);
          sg.append(0, dk.p, dv.p, n);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // before the buffers go
        };
        append(1500);
        sg.end_prompt(0);
        for (int g = 0; g < 90; ++g) append(1);
      }
      // 1. Every token the CUDA engine wrote into a page (its K and V rows and
      //    their scales) is the CPU's quantization of a token appended to its
      //    head.
      std::vector<std::set<std::string>> appended(s.kv_heads);
      // Centered: by a token's paged V row and scale, its K rows as appended.
      std::vector<std::multimap<std::string, std::vector<float>>> by_v(s.kv_heads);
      std::vector<uint8_t> k, v;
      uint64_t taken = 0;
      auto take = [&](uint32_t tokens) {  // as they were appended
        again.tokens(tokens, &k, &v);
        doctor_values(v, taken, tokens, s.kv_heads, d, s.dtype);
        taken += tokens;
        for (uint32_t t = 0; t < tokens; ++t)
          for (uint32_t h = 0; h < s.kv_heads; ++h) {
            const size_t at = (size_t(t) * s.kv_heads + h) * row;
            const std::string key = paged_slot(s.dtype, k.data() + at, v.data() + at, d);
            appended[h].insert(key);
            if (centered) {
              std::vector<float> kf(d);
              wkv::to_float(static_cast<wkv::DType>(s.dtype), k.data() + at, kf.data(), d);
              by_v[h].emplace(key.substr(d + 4), std::move(kf));
            }
          }
      };
      take(1500);
      for (int g = 0; g < 90; ++g) take(1);
      const std::string path = dir.file("gpu.wkv");
      sg.save(path);
      const wkv::LayerSnapshot snap = layer_of(path, 0);
      ASSERT_EQ(snap.heads.size(), s.kv_heads);
      wkv_config cc = config(s, WKV_DEVICE_CPU, fmt);
      wkv::Config cfg;
      ASSERT_TRUE(wkv::resolve_config(&cc, &cfg).is_ok());
      const uint32_t pt = cfg.page_tokens(), slot = cfg.page_slot_bytes(), scales = cfg.page_scales_at();
      uint64_t rows = 0, found = 0, crossing = 0;
      for (uint32_t h = 0; h < s.kv_heads; ++h) {
        const wkv::HeadSnapshot &o = snap.heads[h];
        for (size_t c = 0; c < o.size.size(); ++c) {
          std::vector<float> ref(d);
          const bool has_ref = centered && wkv::centered_reference(o.centroid.data() + c * d, d, ref.data());
          for (uint32_t m = 0; m < o.size[c]; ++m) {
            const uint64_t at = uint64_t(o.first_slot[c]) + m, r = at % pt;
            const uint8_t *page = o.pages.data() + (at / pt) * slot;
            std::string key(2 * (d + 4), '\0');
            std::memcpy(key.data(), page + r * d, d);
            std::memcpy(key.data() + d, page + scales + r * 4, 4);
            std::memcpy(key.data() + d + 4, page + (pt + r) * d, d);
            std::memcpy(key.data() + 2 * d + 4, page + scales + (pt + r) * 4, 4);
            ++rows;
            if (!centered) {
              found += appended[h].count(key);
              continue;
            }
            // A token with this V row whose K row, less the reference, is
            // this K row and scale.
            const auto range = by_v[h].equal_range(key.substr(d + 4));
            bool hit = false;
            for (auto it = range.first; !hit && it != range.second; ++it) {
              std::string want(d + 4, '\0');
              float sc = 0;
              if (has_ref)
                wkv::quantize_row_centered(it->second.data(), ref.data(), d, reinterpret_cast<int8_t *>(want.data()),
                                           &sc);
              else
                wkv::quantize_row(it->second.data(), d, reinterpret_cast<int8_t *>(want.data()), &sc);
              std::memcpy(want.data() + d, &sc, 4);
              hit = want == key.substr(0, d + 4);
            }
            found += hit;
          }
          // Units of the cluster whose members lie in two pages.
          for (uint32_t j = 0; j * pt < o.size[c]; ++j)
            crossing += (o.first_slot[c] + j * pt) % pt + std::min(pt, o.size[c] - j * pt) > pt;
        }
      }
      EXPECT_GT(rows, 1000u);
      EXPECT_EQ(found, rows) << "tokens of the CUDA engine's pages that are no CPU quantization of an appended token";
      EXPECT_GT(crossing, 0u) << "units that cross into a second page are gathered";
      // 2. The same pages in a CPU engine: the same execution buffer, on a
      //    miss (from host pages) and on a hit (from the frames admitted).
      wavekv::Sequence sc = wavekv::Sequence::load(cpu, path);
      wavekv::Plan pg(gpu), pc(cpu);
      const std::vector<uint8_t> q = ctx.query();
      Buf dq(true, q), dout(true, std::vector<uint8_t>(q.size()));
      uint64_t hits_after_first = 0;
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
        if (pass == 0) {
          const wkv_stats st = gpu.stats();
          EXPECT_GT(st.cache_misses, 0u) << "the first pass reads host pages";
          hits_after_first = st.cache_hits;
        }
      }
      EXPECT_GT(gpu.stats().cache_hits, hits_after_first) << "later passes read frames admitted by the first";
    }
  }
}

// The CUDA page writes on rows that engines' workloads rarely hold: ties,
// zero rows, rows under the floor, NaN and infinities, tiny values beside
// large ones; against quantize_row byte for byte, tokens in a shuffled order
// over three pages.
TEST(GpuInt8Pages, PageWritesOfEdgeRowsAreTheCpusBytes) {
  REQUIRE_GPU();
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (wkv::DType dt : {wkv::DType::kF16, wkv::DType::kBF16, wkv::DType::kF32})
    for (uint32_t d : {64u, 80u, 96u, 128u, 256u}) {
      SCOPED_TRACE(testing::Message() << "d=" << d << ", dtype " << wkv::dtype_name(dt));
      const uint32_t pt = 7, tokens = 20, pages = (tokens + pt - 1) / pt;
      const size_t row = size_t(d) * wkv::dtype_bytes(dt), slot = ((2 * pt * (d + 4)) + 15) / 16 * 16;
      std::vector<uint8_t> k(tokens * row), v(tokens * row);
      std::vector<float> x(d);
      for (uint32_t t = 0; t < tokens; ++t)
        for (int kv = 0; kv < 2; ++kv) {
          const uint32_t kind = (t + 3 * kv) % 10;
          for (uint32_t i = 0; i < d; ++i) {
            switch (kind) {
              case 0: x[i] = 0.0f; break;
              case 1: x[i] = 0x1p-110f * float(i % 5); break;            // under the floor (zero in f16)
              case 2: x[i] = float(int(i % 255) - 127) + 0.5f * (i % 2 ? 1 : -1); break;  // ties near 127
              case 3: x[i] = i == 3 ? std::numeric_limits<float>::quiet_NaN() : 1.0f; break;
              case 4: x[i] = i == 5 ? std::numeric_limits<float>::infinity() : 2.0f; break;
              case 5: x[i] = i == 1 ? -std::numeric_limits<float>::infinity() : 0.5f; break;
              case 6: x[i] = i == 0 ? 1000.0f : 1e-5f * float(i); break;   // tiny beside large
              default: x[i] = normal(rng) * float(kind); break;
            }
          }
          wkv::from_float(dt, x.data(), (kv ? v : k).data() + t * row, d);
        }
      std::vector<uint32_t> order(tokens);
      for (uint32_t j = 0; j < tokens; ++j) order[j] = (j * 7 + 3) % tokens;  // a permutation of 20
      Buf dk(true, k), dv(true, v);
      Buf dorder(true, std::vector<uint8_t>(reinterpret_cast<uint8_t *>(order.data()),
                                            reinterpret_cast<uint8_t *>(order.data() + tokens)));
      Buf dpages(true, std::vector<uint8_t>(pages * slot, 0xaa));
      std::vector<uint8_t *> addr(pages);
      for (uint32_t p = 0; p < pages; ++p) addr[p] = static_cast<uint8_t *>(dpages.p) + p * slot;
      Buf daddr(true, std::vector<uint8_t>(reinterpret_cast<uint8_t *>(addr.data()),
                                           reinterpret_cast<uint8_t *>(addr.data() + pages)));
      wkv::kernels::WritePagesJob job;
      job.order = static_cast<const uint32_t *>(dorder.p);
      job.k = static_cast<const uint8_t *>(dk.p);
      job.v = static_cast<const uint8_t *>(dv.p);
      job.pages = static_cast<uint8_t *const *>(daddr.p);
      job.tokens = tokens;
      wkv::kernels::Int8PageLayout l;
      l.dtype = dt;
      l.head_dim = d;
      l.page_tokens = pt;
      l.scales_at = 2 * pt * d;
      ASSERT_EQ(wkv::kernels::write_pages_int8_many_cuda(&job, 1, l, nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<uint8_t> got = dpages.host();
      for (uint32_t j = 0; j < tokens; ++j) {
        const uint8_t *page = got.data() + (j / pt) * slot;
        const uint32_t r = j % pt;
        for (int kv = 0; kv < 2; ++kv) {
          std::vector<float> f(d);
          std::vector<int8_t> q(d);
          float scale = 0;
          wkv::to_float(dt, (kv ? v : k).data() + size_t(order[j]) * row, f.data(), d);
          wkv::quantize_row(f.data(), d, q.data(), &scale);
          const uint32_t at = (kv ? pt : 0) + r;
          EXPECT_EQ(std::memcmp(page + size_t(at) * d, q.data(), d), 0) << "slot " << j << (kv ? " V" : " K");
          EXPECT_EQ(std::memcmp(page + l.scales_at + at * 4, &scale, 4), 0) << "slot " << j << (kv ? " V" : " K");
        }
      }
    }
}

}  // namespace
