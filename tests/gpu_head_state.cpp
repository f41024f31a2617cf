// One head state and one growth path for both backends, on a GPU: the CPU
// and CUDA engines cut the same segments with the same seeds and build (all
// but) the same clusters from the same input, and a layer exported from one
// imports into the other and decodes the same within the dtype's tolerance.
// Skips where no CUDA device exists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/device_layout.hpp"
#include "kernels/dtype.hpp"
#include "lib/engine/engine.hpp"
#include "lib/engine/plan.hpp"
#include "lib/engine/sequence.hpp"
#include "lib/index/snapshot.hpp"
#include "gpu_support.hpp"
#include "support.hpp"

using namespace wkvtest;

namespace {

constexpr uint32_t kQ = 8, kKV = 2, kD = 128, kDT = WKV_DTYPE_F16;

wkv_config config(uint32_t device, float retrieval = 0.018f, float estimation = 0.232f) {
  wkv_config c;
  wkv_config_init(&c);
  c.device = device;
  c.n_layers = 1;
  c.n_q_heads = kQ;
  c.n_kv_heads = kKV;
  c.head_dim = kD;
  c.dtype = kDT;
  c.segment_tokens = 2048;
  c.update_segment_tokens = 512;
  c.retrieval_frac = retrieval;
  c.estimation_frac = estimation;
  c.device_cache_bytes = 8u << 20;
  c.threads = 2;
  return c;
}

struct Engine {
  std::shared_ptr<wkv::Engine> e;
  bool gpu;
  wkv::Status opened;
  explicit Engine(uint32_t device, float r = 0.018f, float est = 0.232f, uint32_t flags = 0, bool expect_ok = true)
      : gpu(device == WKV_DEVICE_CUDA) {
    wkv_config c = config(device, r, est);
    c.flags = flags;
    opened = wkv::Engine::open(&c, &e);
    if (expect_ok) {
      EXPECT_TRUE(opened.is_ok()) << opened.message();
    }
  }
  std::shared_ptr<wkv::Sequence> sequence() {
    std::shared_ptr<wkv::Sequence> s;
    EXPECT_TRUE(wkv::Sequence::create(e, &s).is_ok());
    return s;
  }
  void append(wkv::Sequence &s, const std::vector<uint8_t> &k, const std::vector<uint8_t> &v, uint32_t n) {
    Buf dk(gpu, k), dv(gpu, v);
    wkv::Status st = e->append(s, 0, static_cast<uint8_t *>(dk.p), static_cast<uint8_t *>(dv.p), n, kKV * kD, kD,
                               nullptr);
    ASSERT_TRUE(st.is_ok()) << st.message();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  void end_prompt(wkv::Sequence &s) {
    ASSERT_TRUE(e->end_prompt(s, 0, nullptr).is_ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  std::vector<float> decode(const std::shared_ptr<wkv::Sequence> &s, const std::vector<float> &q) {
    std::shared_ptr<wkv::StepTracker> t;
    EXPECT_TRUE(e->buffers().new_tracker(&t).is_ok());
    wkv::Plan plan(e, t);
    Buf dq(gpu, pack(kDT, q)), dout(gpu, std::vector<uint8_t>(q.size() * 2));
    wkv::Status st = e->lookup(plan, &s, 1, 0, dq.p, kQ * kD, kD, nullptr);
    if (st.is_ok()) st = e->assemble(plan, nullptr);
    if (st.is_ok()) st = e->attend(plan, dout.p, kQ * kD, kD, nullptr, nullptr);
    EXPECT_TRUE(st.is_ok()) << st.message();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return unpack(kDT, dout.host(), q.size());
  }
  std::vector<wkv::LayerSnapshot> snapshot(wkv::Sequence &s) {
    std::vector<wkv::LayerSnapshot> out(1);
    wkv::Status st = wkv::export_layer(e->index(), s.layer(0), &out[0], nullptr);
    EXPECT_TRUE(st.is_ok()) << st.message();
    return out;
  }
  void import(wkv::Sequence &s, const std::vector<wkv::LayerSnapshot> &snap) {
    wkv::Status st = wkv::check_snapshot(e->config(), snap[0]);
    ASSERT_TRUE(st.is_ok()) << st.message();
    st = wkv::import_layer(e->index(), snap[0], &s.layer(0), nullptr);
    ASSERT_TRUE(st.is_ok()) << st.message();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
};

// One context: tokens drawn once, queries near its topics.
struct Context {
  KeyGen gen{kKV, kD, 42};
  std::vector<HeadRows> rows{kKV};
  float v_offset = 0.f, v_scale = 1.f;  // values drawn as offset + scale x
  void draw(uint32_t n, std::vector<uint8_t> *kb, std::vector<uint8_t> *vb) {
    std::vector<float> k, v;
    gen.next(n, &k, &v);
    for (float &x : k) x = round_to(kDT, x);
    for (float &x : v) x = round_to(kDT, v_offset + v_scale * x);
    *kb = pack(kDT, k);
    *vb = pack(kDT, v);
    for (uint32_t t = 0; t < n; ++t)
      for (uint32_t h = 0; h < kKV; ++h) {
        const size_t off = (size_t(t) * kKV + h) * kD;
        rows[h].k.insert(rows[h].k.end(), k.begin() + off, k.begin() + off + kD);
        rows[h].v.insert(rows[h].v.end(), v.begin() + off, v.begin() + off + kD);
      }
  }
  std::vector<float> query() {
    std::vector<float> q;
    for (uint32_t h = 0; h < kKV; ++h) gen.query(h, kQ / kKV, &q);
    for (float &x : q) x = round_to(kDT, x);
    return q;
  }
  double error(const std::vector<float> &q, const std::vector<float> &out) const {
    std::vector<double> ref;
    double worst = 0;
    for (uint32_t h = 0; h < kQ; ++h) {
      exact_attention(&q[h * kD], rows[h / (kQ / kKV)], kD, &ref);
      worst = std::max(worst, rel_l2(&out[h * kD], ref));
    }
    return worst;
  }
};

// A prompt of three 3000-token chunks drawn from ctx, appended to a
// sequence of each engine, then its end on both.
void prompt_both(Context &ctx, Engine &a, wkv::Sequence &sa, Engine &b, wkv::Sequence &sb) {
  std::vector<uint8_t> k, v;
  for (int i = 0; i < 3; ++i) {
    ctx.draw(3000, &k, &v);
    a.append(sa, k, v, 3000);
    b.append(sb, k, v, 3000);
  }
  a.end_prompt(sa);
  b.end_prompt(sb);
}

double rel_diff(const std::vector<float> &a, const std::vector<float> &b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += double(a[i] - b[i]) * (a[i] - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// The clusters of a snapshot's head as sets of member keys (K rows of its
// pages in cluster order), keyed by the member that comes first.
std::map<std::vector<uint8_t>, std::vector<std::vector<uint8_t>>> clusters_of(const wkv::LayerSnapshot &s,
                                                                              uint32_t h) {
  const wkv::HeadSnapshot &o = s.heads[h];
  const uint32_t pt = s.shape.page_tokens, slot = s.shape.page_slot_bytes;
  const size_t row = kD * 2;
  std::map<std::vector<uint8_t>, std::vector<std::vector<uint8_t>>> out;
  for (size_t c = 0; c < o.size.size(); ++c) {
    std::vector<std::vector<uint8_t>> members;
    for (uint32_t m = 0; m < o.size[c]; ++m) {
      const uint32_t sl = o.first_slot[c] + m;
      const uint8_t *k = o.pages.data() + size_t(sl / pt) * slot + size_t(sl % pt) * row;
      members.emplace_back(k, k + row);
    }
    std::sort(members.begin(), members.end());
    out[members.front()] = members;
  }
  return out;
}

}  // namespace

// The same input gives the same cuts, the same seeds and, but for near-ties
// of f16 dot products summed in another order, the same clusters; decoding
// agrees at the default budget. The measured agreement is printed.
// The device's compact copies of a head's centroids and value sums, which
// the logits and the estimate read: their overflow words clear, every row
// quantize_row's bytes and scale of the f32 row (8-bit meta rows, the
// default), no f16 copy.
void expect_meta16(const wkv::HeadState &hs) {
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const size_t C = hs.clusters(), n = C * kD;
  ASSERT_GT(n, 0u);
  EXPECT_EQ(hs.meta.centroid16.p, nullptr) << "8-bit meta rows by default: no f16 copy";
  EXPECT_EQ(hs.meta.value_sum16.p, nullptr) << "8-bit meta rows by default: no f16 copy";
  for (auto [copy, scales, rows, what] :
       {std::tuple{&hs.meta.centroid8, &hs.meta.centroid8_scale, &hs.meta.centroid, "centroid"},
        std::tuple{&hs.meta.value_sum8, &hs.meta.value_sum8_scale, &hs.meta.value_sum, "value sum"}}) {
    SCOPED_TRACE(what);
    ASSERT_NE(copy->p, nullptr) << "a CUDA engine with f16 storage keeps the copy";
    ASSERT_NE(scales->p, nullptr);
    std::vector<uint8_t> raw(wkv::kernels::kMeta16Header + n);
    std::vector<float> f32(n), got_scales(C);
    // cudaMemcpyDefault: the f32 rows may be in host memory
    // (WKV_CONFIG_HOST_META_ROWS).
    ASSERT_EQ(cudaMemcpy(raw.data(), copy->p, raw.size(), cudaMemcpyDefault), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got_scales.data(), scales->p, C * 4, cudaMemcpyDefault), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(f32.data(), rows->p, n * 4, cudaMemcpyDefault), cudaSuccess);
    uint32_t overflow;
    std::memcpy(&overflow, raw.data(), 4);
    EXPECT_EQ(overflow, 0u);
    std::vector<int8_t> want(n);
    std::vector<float> want_scales(C);
    for (size_t c = 0; c < C; ++c) wkv::quantize_row(f32.data() + c * kD, kD, want.data() + c * kD, &want_scales[c]);
    EXPECT_EQ(std::memcmp(want.data(), raw.data() + wkv::kernels::kMeta16Header, n), 0)
        << "the copy holds every cluster's row, the CPU's bytes";
    EXPECT_EQ(std::memcmp(want_scales.data(), got_scales.data(), C * 4), 0) << "and its scale";
  }
}

TEST(GpuHeadState, CpuAndCudaEnginesBuildTheSameIndex) {
  REQUIRE_GPU();
  Engine cpu(WKV_DEVICE_CPU), gpu(WKV_DEVICE_CUDA);
  Context ctx;
  auto sc = cpu.sequence(), sg = gpu.sequence();
  prompt_both(ctx, cpu, *sc, gpu, *sg);
  std::vector<uint8_t> k, v;
  ctx.draw(700, &k, &v);  // an update segment
  cpu.append(*sc, k, v, 700);
  gpu.append(*sg, k, v, 700);
  const auto snap_c = cpu.snapshot(*sc), snap_g = gpu.snapshot(*sg);
  for (uint32_t h = 0; h < kKV; ++h) expect_meta16(sg->layer(0).heads[h]);
  size_t tokens = 0, same = 0;
  for (uint32_t h = 0; h < kKV; ++h) {
    const auto &a = snap_c[0].heads[h], &b = snap_g[0].heads[h];
    ASSERT_EQ(a.segments.size(), b.segments.size());
    for (size_t i = 0; i < a.segments.size(); ++i) {
      EXPECT_EQ(a.segments[i].token_begin, b.segments[i].token_begin) << "segment cuts";
      EXPECT_EQ(a.segments[i].tokens, b.segments[i].tokens);
    }
    EXPECT_EQ(a.tail_k, b.tail_k) << "the same steady zone";
    const auto cc = clusters_of(snap_c[0], h), cg = clusters_of(snap_g[0], h);
    for (const auto &[first, members] : cg) {
      tokens += members.size();
      auto it = cc.find(first);
      if (it != cc.end() && it->second == members) same += members.size();
    }
  }
  const double agreement = double(same) / double(tokens);
  std::printf("tokens in identical clusters on the CPU and the GPU: %zu of %zu (%.4f)\n", same, tokens, agreement);
  EXPECT_GT(agreement, 0.9);
  std::vector<double> diff;
  for (int step = 0; step < 8; ++step) {
    const std::vector<float> q = ctx.query();
    const std::vector<float> oc = cpu.decode(sc, q), og = gpu.decode(sg, q);
    diff.push_back(rel_diff(og, oc));
    EXPECT_LT(ctx.error(q, og), ctx.error(q, oc) * 1.25 + 0.02) << "step " << step;
  }
  std::printf("CPU vs CUDA decode at the default budget: median relative difference %.4f\n", median(diff));
  EXPECT_LT(median(diff), 0.05);
}

// Value sums past f16's range (values 6000 + 3000 x: a cluster of 11 or
// more sums past 65504 on average) stay in the 8-bit copy, whose scale a row
// takes any finite magnitude: neither copy's word is set, and decoding agrees
// with the CPU engine (whose 8-bit value means, a scale a row, take them
// too) as at ordinary values, measured on the outputs less the offset.
TEST(GpuHeadState, ValueSumsPastF16RangeStayInTheEightBitCopy) {
  REQUIRE_GPU();
  Engine cpu(WKV_DEVICE_CPU), gpu(WKV_DEVICE_CUDA);
  Context ctx;
  ctx.v_offset = 6000.f;  // the outputs' f16 spacing is 4 there, 2% of their spread
  ctx.v_scale = 3000.f;
  auto sc = cpu.sequence(), sg = gpu.sequence();
  prompt_both(ctx, cpu, *sc, gpu, *sg);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (uint32_t h = 0; h < kKV; ++h) expect_meta16(sg->layer(0).heads[h]);
  {
    // Some sum does pass f16's range (the case the f16 copy could not hold).
    const wkv::HeadState &hs = sg->layer(0).heads[0];
    std::vector<float> sums(size_t(hs.clusters()) * kD);
    ASSERT_EQ(cudaMemcpy(sums.data(), hs.meta.value_sum.p, sums.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    float most = 0.f;
    for (float x : sums) most = std::max(most, std::fabs(x));
    EXPECT_GT(most, 65504.f);
  }
  auto centered = [&](std::vector<float> o) {
    for (float &x : o) x -= ctx.v_offset;
    return o;
  };
  std::vector<double> diff;
  for (int step = 0; step < 8; ++step) {
    const std::vector<float> q = ctx.query();
    const std::vector<float> oc = cpu.decode(sc, q), og = gpu.decode(sg, q);
    for (float x : og) ASSERT_TRUE(std::isfinite(x)) << "step " << step;
    diff.push_back(rel_diff(centered(og), centered(oc)));
  }
  std::printf("CPU vs CUDA decode, value sums past f16: median relative difference %.4f (outputs less the offset)\n",
              median(diff));
  EXPECT_LT(median(diff), 0.05);
}

// Where a region's memory lives: cudaMemoryTypeHost or cudaMemoryTypeDevice.
cudaMemoryType memory_type(const void *p) {
  cudaPointerAttributes a{};
  EXPECT_EQ(cudaPointerGetAttributes(&a, p), cudaSuccess);
  return a.type;
}

// WKV_CONFIG_HOST_META_ROWS: the f32 centroids and value sums in pinned host
// memory, everything the steps read on the device. Two CUDA engines, one
// with the flag, take the same prompt and the same generated tokens (four
// growths of update segments, whose regions grow and keep their rows); at
// every step they decode the same bits, and their snapshots (what saves
// write) are equal. A snapshot imports into a third sequence of the
// engine with the flag and decodes as the original does. Then every head's
// 8-bit copies are flagged as overflowed on both engines, so that the logits
// and the estimate read the f32 rows themselves, over PCIe on one of them:
// the same bits again. Skips where the device or driver has no host memory
// pools.
TEST(GpuHeadState, MetaRowsInHostMemoryDecodeTheSameBits) {
  REQUIRE_GPU();
  Engine dev(WKV_DEVICE_CUDA), host(WKV_DEVICE_CUDA, 0.018f, 0.232f, WKV_CONFIG_HOST_META_ROWS, false);
  if (host.opened.code() == WKV_ERR_UNSUPPORTED) GTEST_SKIP() << "skipped: " << host.opened.message();
  ASSERT_TRUE(host.opened.is_ok()) << host.opened.message();
  Context ctx;
  auto sd = dev.sequence(), sh = host.sequence();
  prompt_both(ctx, dev, *sd, host, *sh);
  std::vector<uint8_t> k, v;
  for (int step = 0; step < 8; ++step) {
    const std::vector<float> q = ctx.query();
    EXPECT_EQ(host.decode(sh, q), dev.decode(sd, q)) << "step " << step;
    ctx.draw(300, &k, &v);
    dev.append(*sd, k, v, 300);
    host.append(*sh, k, v, 300);
  }
  ASSERT_GE(sh->layer(0).heads[0].segments.size(), 6u) << "the prompt's segments and four update segments";
  for (uint32_t h = 0; h < kKV; ++h) {
    const wkv::MetaIndex &m = sh->layer(0).heads[h].meta, &md = sd->layer(0).heads[h].meta;
    EXPECT_EQ(memory_type(m.centroid.p), cudaMemoryTypeHost);
    EXPECT_EQ(memory_type(m.value_sum.p), cudaMemoryTypeHost);
    EXPECT_EQ(memory_type(m.centroid8.p), cudaMemoryTypeDevice) << "what the steps read stays on the device";
    EXPECT_EQ(memory_type(m.spread.p), cudaMemoryTypeDevice);
    EXPECT_EQ(memory_type(md.centroid.p), cudaMemoryTypeDevice) << "without the flag";
    expect_meta16(sh->layer(0).heads[h]);
  }
  // wkv_stats says where the memory lives: the same meta index, 1 KiB a
  // cluster (d = 128) less of it on the device with the flag, whose rows'
  // pool holds at least those bytes; the device's figures cover its cache.
  wkv_stats st_d{}, st_h{};
  st_d.size = st_h.size = sizeof(wkv_stats);
  dev.e->fill_stats(&st_d);
  host.e->fill_stats(&st_h);
  ASSERT_EQ(st_h.clusters, st_d.clusters);
  EXPECT_EQ(st_h.meta_bytes, st_d.meta_bytes);
  EXPECT_EQ(st_d.meta_device_bytes, st_d.meta_bytes - st_d.clusters * 3 * sizeof(uint32_t));
  EXPECT_EQ(st_h.meta_device_bytes, st_d.meta_device_bytes - st_h.clusters * 2 * kD * sizeof(float));
  EXPECT_EQ(st_d.meta_host_rows_reserved, 0u);
  EXPECT_GE(st_h.meta_host_rows_reserved, st_h.clusters * 2 * kD * sizeof(float));
  for (const wkv_stats *st : {&st_d, &st_h}) {
    EXPECT_GE(st->device_bytes_used, st->device_cache_bytes + st->meta_device_bytes);
    EXPECT_GE(st->device_bytes_reserved, st->device_bytes_used);
  }
  const auto snap_d = dev.snapshot(*sd), snap_h = host.snapshot(*sh);
  for (uint32_t h = 0; h < kKV; ++h) {
    const wkv::HeadSnapshot &a = snap_d[0].heads[h], &b = snap_h[0].heads[h];
    EXPECT_EQ(a.centroid, b.centroid);
    EXPECT_EQ(a.value_sum, b.value_sum);
    EXPECT_EQ(a.spread, b.spread);
    EXPECT_EQ(a.pages, b.pages);
  }
  // A snapshot imports into an engine with the flag: its rows in host
  // memory, its 8-bit copies made from them, and the same bits decoded.
  auto si = host.sequence();
  host.import(*si, snap_h);
  EXPECT_EQ(memory_type(si->layer(0).heads[0].meta.centroid.p), cudaMemoryTypeHost) << "an import's rows too";
  for (int step = 0; step < 2; ++step) {
    const std::vector<float> q = ctx.query();
    EXPECT_EQ(host.decode(si, q), host.decode(sh, q)) << "imported, step " << step;
  }
  // The f32 rows read by the steps: both 8-bit copies' words set on both
  // engines (which keep no f16 copies: expect_meta16).
  for (auto *s : {sd.get(), sh.get()})
    for (wkv::HeadState &hs : s->layer(0).heads) {
      ASSERT_EQ(hs.meta.centroid16.p, nullptr);
      ASSERT_EQ(hs.meta.value_sum16.p, nullptr);
      for (const wkv::Region *r : {&hs.meta.centroid8, &hs.meta.value_sum8})
        ASSERT_EQ(cudaMemset(r->p, 1, 4), cudaSuccess);
    }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int step = 0; step < 4; ++step) {
    const std::vector<float> q = ctx.query();
    EXPECT_EQ(host.decode(sh, q), dev.decode(sd, q)) << "the f32 rows read over PCIe, step " << step;
  }
}

// WKV_CONFIG_HOST_META_ROWS when memory runs out. Every allocation of a
// growth fails in turn, the pinned rows' regions among them (a head whose
// rows outgrow their region gets a larger one and keeps its rows), then
// every allocation of an import. A failed call is WKV_ERR_OUT_OF_MEMORY and
// leaves the sequence as it was: it decodes the same bits as an engine
// without the flag that took only the appends that succeeded, and its
// snapshot imports whole once memory is there again.
TEST(GpuHeadState, MetaRowsInHostMemoryOutliveFailedGrowthsAndImports) {
  REQUIRE_GPU();
  Engine dev(WKV_DEVICE_CUDA), host(WKV_DEVICE_CUDA, 0.018f, 0.232f, WKV_CONFIG_HOST_META_ROWS, false);
  if (host.opened.code() == WKV_ERR_UNSUPPORTED) GTEST_SKIP() << "skipped: " << host.opened.message();
  ASSERT_TRUE(host.opened.is_ok()) << host.opened.message();
  Context ctx;
  auto sd = dev.sequence(), sh = host.sequence();
  prompt_both(ctx, dev, *sd, host, *sh);
  uint32_t failed = 0;
  std::vector<uint8_t> k, v;
  for (uint32_t skip = 0; skip < 12; ++skip) {
    ctx.draw(600, &k, &v);  // past an update segment: a growth begins or commits
    Buf dk(true, k), dv(true, v);
    const uint64_t tokens = sh->layer(0).tokens;
    const size_t segments = sh->layer(0).heads[0].segments.size();
    host.e->faults().arm(wkv::FaultInjector::kEngineAlloc, 1, skip);
    const wkv::Status st = host.e->append(*sh, 0, static_cast<uint8_t *>(dk.p), static_cast<uint8_t *>(dv.p), 600,
                                          kKV * kD, kD, nullptr);
    host.e->faults().arm(wkv::FaultInjector::kEngineAlloc, 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (st.is_ok()) {
      dev.append(*sd, k, v, 600);
    } else {
      ++failed;
      EXPECT_EQ(st.code(), WKV_ERR_OUT_OF_MEMORY) << st.message();
      EXPECT_EQ(sh->layer(0).tokens, tokens) << "skip " << skip;
      EXPECT_EQ(sh->layer(0).heads[0].segments.size(), segments) << "skip " << skip;
    }
    ASSERT_EQ(sh->layer(0).tokens, sd->layer(0).tokens);
    const std::vector<float> q = ctx.query();
    EXPECT_EQ(host.decode(sh, q), dev.decode(sd, q)) << "skip " << skip;
  }
  EXPECT_GT(failed, 0u) << "no allocation of a growth failed";
  for (uint32_t h = 0; h < kKV; ++h)
    EXPECT_EQ(memory_type(sh->layer(0).heads[h].meta.centroid.p), cudaMemoryTypeHost);

  const auto snap = host.snapshot(*sh);
  auto si = host.sequence();
  uint32_t failed_imports = 0;
  bool imported = false;
  for (uint32_t skip = 0; skip < 16 && !imported; ++skip) {
    host.e->faults().arm(wkv::FaultInjector::kEngineAlloc, 1, skip);
    const wkv::Status st = wkv::import_layer(host.e->index(), snap[0], &si->layer(0), nullptr);
    host.e->faults().arm(wkv::FaultInjector::kEngineAlloc, 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    imported = st.is_ok();  // it needed fewer than skip + 1 allocations
    if (imported) break;
    ++failed_imports;
    EXPECT_EQ(st.code(), WKV_ERR_OUT_OF_MEMORY) << st.message();
    EXPECT_EQ(si->layer(0).tokens, 0u) << "skip " << skip;
    EXPECT_TRUE(si->layer(0).heads[0].segments.empty()) << "skip " << skip;
  }
  EXPECT_GT(failed_imports, 0u);
  if (!imported) host.import(*si, snap);
  EXPECT_EQ(memory_type(si->layer(0).heads[0].meta.centroid.p), cudaMemoryTypeHost);
  for (int step = 0; step < 2; ++step) {
    const std::vector<float> q = ctx.query();
    EXPECT_EQ(host.decode(si, q), host.decode(sh, q)) << "imported after failed imports, step " << step;
  }
}

// An f32 engine's steps read the f32 rows themselves, and so does the
// gather of centered 8-bit pages (each retrieved cluster's centroid): the
// flag is refused there rather than sending every step over PCIe.
TEST(GpuHeadState, MetaRowsInHostMemoryAreRefusedWhereStepsReadThem) {
  REQUIRE_GPU();
  for (int centered = 0; centered < 2; ++centered) {
    wkv_config c = config(WKV_DEVICE_CUDA);
    if (centered)
      c.page_format = WKV_PAGE_FORMAT_INT8_CENTERED;
    else
      c.dtype = WKV_DTYPE_F32;
    c.flags = WKV_CONFIG_HOST_META_ROWS;
    wkv_engine *e = nullptr;
    EXPECT_EQ(wkv_engine_open(&c, &e), WKV_ERR_UNSUPPORTED) << (centered ? "centered pages" : "f32");
    EXPECT_EQ(e, nullptr);
    EXPECT_NE(std::string(wkv_last_error()).find("WKV_CONFIG_HOST_META_ROWS"), std::string::npos) << wkv_last_error();
    c.flags = 0;
    EXPECT_EQ(wkv_engine_open(&c, &e), WKV_OK) << "without the flag: " << wkv_last_error();
    wkv_engine_close(e);
  }
}

// A layer moves between the backends as a snapshot: CPU to CUDA and back,
// decoding the same within f16 tolerance, and growing on after the move.
TEST(GpuHeadState, ALayerMovesBetweenCpuAndCudaAndDecodesTheSame) {
  REQUIRE_GPU();
  for (float r : {1.0f, 0.018f}) {
    SCOPED_TRACE(testing::Message() << "retrieval " << r);
    Engine cpu(WKV_DEVICE_CPU, r, r == 1.0f ? 0.0f : 0.232f), gpu(WKV_DEVICE_CUDA, r, r == 1.0f ? 0.0f : 0.232f),
        back(WKV_DEVICE_CPU, r, r == 1.0f ? 0.0f : 0.232f);
    Context ctx;
    auto sc = cpu.sequence();
    std::vector<uint8_t> k, v;
    ctx.draw(6000, &k, &v);
    cpu.append(*sc, k, v, 6000);
    cpu.end_prompt(*sc);
    ctx.draw(600, &k, &v);
    cpu.append(*sc, k, v, 600);
    auto sg = gpu.sequence();
    gpu.import(*sg, cpu.snapshot(*sc));
    auto sb = back.sequence();
    back.import(*sb, gpu.snapshot(*sg));
    for (int step = 0; step < 4; ++step) {
      const std::vector<float> q = ctx.query();
      const std::vector<float> oc = cpu.decode(sc, q), og = gpu.decode(sg, q), ob = back.decode(sb, q);
      EXPECT_EQ(ob, oc) << "CPU -> CUDA -> CPU is bit for bit";
      EXPECT_LT(rel_diff(og, oc), 1e-2) << "step " << step;
      if (r == 1.0f) {
        EXPECT_LT(ctx.error(q, og), 1e-2);
      }
      ctx.draw(300, &k, &v);  // on to the next update segment, on all three
      cpu.append(*sc, k, v, 300);
      gpu.append(*sg, k, v, 300);
      back.append(*sb, k, v, 300);
    }
    EXPECT_EQ(sg->layer(0).heads[0].segments.size(), sc->layer(0).heads[0].segments.size());
    // Imported, then grown: the f16 copy holds the clusters of both.
    for (uint32_t h = 0; h < kKV; ++h) expect_meta16(sg->layer(0).heads[h]);
  }
}

// Memory faults of a CUDA engine, injected: device memory that cannot be had
// fails the call that needed it and changes nothing; a host chunk that
// cannot be pinned stays pageable where the device reads pageable memory
// (counted in the stats), else fails its growth. The engine goes on serving.
TEST(GpuHeadState, DeviceMemoryAndPinningFailuresAreReportedAndTheEngineGoesOn) {
  REQUIRE_GPU();
  Engine gpu(WKV_DEVICE_CUDA, 1.0f, 0.0f);
  Context ctx;
  auto s = gpu.sequence();
  std::vector<uint8_t> k, v;
  ctx.draw(1000, &k, &v);
  gpu.append(*s, k, v, 1000);
  gpu.end_prompt(*s);
  uint64_t failed = 0;
  for (uint32_t skip = 0; skip < 6; ++skip) {
    gpu.e->faults().arm(wkv::FaultInjector::kEngineAlloc, 1, skip);
    std::vector<uint8_t> k2, v2;
    Context other;
    other.draw(600, &k2, &v2);  // an update segment: rows, regions, mirror
    Buf dk(true, k2), dv(true, v2);
    const uint64_t before = s->layer(0).tokens;
    const wkv::Status st = gpu.e->append(*s, 0, static_cast<uint8_t *>(dk.p), static_cast<uint8_t *>(dv.p), 600,
                                         kKV * kD, kD, nullptr);
    gpu.e->faults().arm(wkv::FaultInjector::kEngineAlloc, 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (st.is_ok()) {
      // Took the rows: keep the reference in step.
      for (uint32_t t = 0; t < 600; ++t)
        for (uint32_t h = 0; h < kKV; ++h) {
          const size_t off = (size_t(t) * kKV + h) * kD * 2;
          std::vector<float> kr(kD), vr(kD);
          wkv::to_float(wkv::DType::kF16, k2.data() + off, kr.data(), kD);
          wkv::to_float(wkv::DType::kF16, v2.data() + off, vr.data(), kD);
          ctx.rows[h].k.insert(ctx.rows[h].k.end(), kr.begin(), kr.end());
          ctx.rows[h].v.insert(ctx.rows[h].v.end(), vr.begin(), vr.end());
        }
      continue;
    }
    ++failed;
    EXPECT_EQ(st.code(), WKV_ERR_OUT_OF_MEMORY) << st.message();
    EXPECT_EQ(s->layer(0).tokens, before);
  }
  EXPECT_GT(failed, 0u);
  const std::vector<float> q = ctx.query();
  EXPECT_LT(ctx.error(q, gpu.decode(s, q)), 1e-2);

  int pageable = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, 0), cudaSuccess);
  Engine pin(WKV_DEVICE_CUDA, 1.0f, 0.0f);
  pin.e->faults().arm(wkv::FaultInjector::kPinning, 1);
  auto p = pin.sequence();
  Context c2;
  c2.draw(3000, &k, &v);
  Buf dk(true, k), dv(true, v);
  wkv::Status st = pin.e->append(*p, 0, static_cast<uint8_t *>(dk.p), static_cast<uint8_t *>(dv.p), 3000, kKV * kD,
                                 kD, nullptr);
  if (st.is_ok()) st = pin.e->end_prompt(*p, 0, nullptr);  // the first pages: the first chunk
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  wkv_stats stats;
  wkv_stats_init(&stats);
  pin.e->fill_stats(&stats);
  std::printf("pageable memory access: %d; pin fallbacks %llu; end_prompt: %s\n", pageable,
              static_cast<unsigned long long>(stats.pin_fallbacks), st.is_ok() ? "ok" : st.message().c_str());
  if (pageable) {
    ASSERT_TRUE(st.is_ok()) << st.message();
    EXPECT_EQ(stats.pin_fallbacks, 1u);
    const std::vector<float> q2 = c2.query();
    EXPECT_LT(c2.error(q2, pin.decode(p, q2)), 1e-2) << "pages read from pageable memory";
  } else {
    EXPECT_EQ(st.code(), WKV_ERR_OUT_OF_MEMORY) << st.message();
  }
}

// Decode graphs that cannot be made or launched (injected, as if the driver
// refused): the step's kernels launch one by one instead, every output is
// bit for bit an engine's without graphs, and a refused graph is tried
// again after a backoff (64 steps, doubling at each refusal in a row), so a
// plan whose shape stays replays again once the failures stop.
TEST(GpuHeadState, DecodeGraphFailuresFallBackToLaunchesAndStayExact) {
  REQUIRE_GPU();
  auto open = [](bool graphs) {
    wkvtest::ScopedEnv g("WKV_DECODE_GRAPHS", graphs ? nullptr : "0");
    return Engine(WKV_DEVICE_CUDA, 0.25f, 0.25f);
  };
  Engine on = open(true), off = open(false);
  auto s_on = on.sequence(), s_off = off.sequence();
  Context ctx;
  std::vector<uint8_t> k, v;
  ctx.draw(2100, &k, &v);
  on.append(*s_on, k, v, 2100);
  off.append(*s_off, k, v, 2100);
  on.end_prompt(*s_on);
  off.end_prompt(*s_off);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  // wkv_decode's path: the whole step where the backend runs it, else the
  // split verbs; the query and output buffers stay (a graph is made for
  // the buffers it was captured with).
  const size_t q_bytes = size_t(kQ) * kD * 2;
  Buf dq(true, std::vector<uint8_t>(q_bytes)), dout(true, std::vector<uint8_t>(q_bytes));
  // Every step's gather says it reads unit map entries (the tracker's
  // reading word, which the buffer manager's eviction relies on: a step it
  // does not see there must not read a frame), whichever path ran it: a
  // graph's replay, launches one by one, or the split verbs.
  uint32_t unmarked = 0;
  auto decode = [&](Engine &e, wkv::Plan &plan, const std::shared_ptr<wkv::Sequence> &s,
                    const std::vector<float> &q) {
    const uint64_t done_before = plan.tracker().done();
    const std::vector<uint8_t> qb = pack(kDT, q);
    EXPECT_EQ(cudaMemcpy(dq.p, qb.data(), q_bytes, cudaMemcpyHostToDevice), cudaSuccess);
    const wkv::DecodeOut whole{dout.p, kQ * kD, kD};
    wkv::Status st = e.e->lookup(plan, &s, 1, 0, dq.p, kQ * kD, kD, stream, &whole);
    if (st.is_ok() && plan.stage != wkv::Plan::Stage::kAssembled) {
      st = e.e->assemble(plan, stream);
      if (st.is_ok()) st = e.e->attend(plan, dout.p, kQ * kD, kD, nullptr, stream);
      if (st.is_ok()) st = e.e->update(plan, stream);
    }
    EXPECT_TRUE(st.is_ok()) << st.message();
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const uint64_t reading = plan.tracker().reading();
    if (reading <= done_before || reading > plan.tracker().done()) ++unmarked;
    return dout.host();
  };
  std::shared_ptr<wkv::StepTracker> t_on, t_off;
  ASSERT_TRUE(on.e->buffers().new_tracker(&t_on).is_ok());
  ASSERT_TRUE(off.e->buffers().new_tracker(&t_off).is_ok());
  {
    wkv::Plan p_on(on.e, t_on), p_off(off.e, t_off);
    // Step 40: a launch fails (retried 64 steps later). Step 150: a launch
    // fails, and the capture 64 steps later too, from inside, after the
    // graph's fork (retried 128 steps after that). The last 40 steps come
    // after every retry.
    const uint32_t kSteps = 400, kWindow = 360;
    uint32_t differ = 0;
    uint64_t window0 = 0;
    auto replays = [&] { return on.e->counters().decode_graphs.load(); };
    for (uint32_t st = 0; st < kSteps; ++st) {
      if (st == 40) on.e->faults().arm(wkv::FaultInjector::kGraph, 1);
      if (st == 150) on.e->faults().arm(wkv::FaultInjector::kGraph, 2);
      if (st == kWindow) window0 = replays();
      ctx.draw(1, &k, &v);
      on.append(*s_on, k, v, 1);
      off.append(*s_off, k, v, 1);
      const std::vector<float> q = ctx.query();
      if (decode(on, p_on, s_on, q) != decode(off, p_off, s_off, q)) ++differ;
    }
    EXPECT_EQ(differ, 0u) << "steps whose output differs from the engine without graphs";
    EXPECT_EQ(unmarked, 0u) << "steps whose gather did not write its epoch to the reading word";
    EXPECT_LE(replays(), uint64_t(kSteps) - 150) << "the failures and their backoffs kept steps from replaying";
    EXPECT_GE(replays() - window0, uint64_t(kSteps - kWindow) - 2) << "once the failures stop, the plan replays again";
    EXPECT_EQ(off.e->counters().decode_graphs.load(), 0u);
  }
  cudaStreamDestroy(stream);
}
