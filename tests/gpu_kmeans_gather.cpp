// Tests of the CUDA k-means, page writes and execution-buffer gather against
// CPU references (kernels/cpu_kernels.hpp and direct computations in
// double). Every test skips, and says so, without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cpu_kernels.hpp"
#include "kernels/gather_cuda.hpp"
#include "kernels/kmeans_cuda.hpp"
#include "kernels/table_cuda.hpp"
#include "kernels/dtype.hpp"
#include "gpu_support.hpp"

namespace wkv::kernels {
namespace {

#define ASSERT_CUDA(x) ASSERT_EQ((x), cudaSuccess) << cudaGetErrorString(x)
#define ASSERT_OK(x)                                        \
  do {                                                      \
    const cudaError_t st_ = (x);                            \
    ASSERT_EQ(st_, cudaSuccess) << cudaGetErrorString(st_); \
  } while (0)

// Device memory owned by a test.
struct DevBuf {
  void *p = nullptr;
  size_t n = 0;
  DevBuf() = default;
  explicit DevBuf(size_t bytes) : n(bytes) {
    if (cudaMalloc(&p, std::max<size_t>(bytes, 16)) != cudaSuccess) p = nullptr;
  }
  DevBuf(const DevBuf &) = delete;
  DevBuf &operator=(const DevBuf &) = delete;
  ~DevBuf() { cudaFree(p); }
  template <typename T> T *as() const { return static_cast<T *>(p); }
};

// Pinned, mapped host memory owned by a test.
struct HostBuf {
  void *p = nullptr;
  explicit HostBuf(size_t bytes) {
    if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped) != cudaSuccess) p = nullptr;
  }
  HostBuf(const HostBuf &) = delete;
  HostBuf &operator=(const HostBuf &) = delete;
  ~HostBuf() { cudaFreeHost(p); }
  uint8_t *bytes() const { return static_cast<uint8_t *>(p); }
  uint8_t *device() const {
    void *d = nullptr;
    return cudaHostGetDevicePointer(&d, p, 0) == cudaSuccess ? static_cast<uint8_t *>(d) : nullptr;
  }
};

template <typename T> void upload(DevBuf &d, const std::vector<T> &h) {
  ASSERT_NE(d.p, nullptr);
  ASSERT_CUDA(cudaMemcpy(d.p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}
template <typename T> void download(std::vector<T> *h, const void *d, size_t n) {
  h->resize(n);
  ASSERT_CUDA(cudaMemcpy(h->data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
}

std::vector<float> random_vec(std::mt19937_64 &rng, size_t n, float sd = 1.f, float mean = 0.f) {
  std::normal_distribution<float> nd(mean, sd);
  std::vector<float> v(n);
  for (auto &x : v) x = nd(rng);
  return v;
}

std::vector<uint8_t> random_bytes(std::mt19937_64 &rng, size_t n) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t x = rng();
    std::memcpy(b.data() + i, &x, std::min<size_t>(8, n - i));
  }
  return b;
}

// K-means -----------------------------------------------------------------------

// One segment's input, kept as the floats its storage rounds to.
struct SegInput {
  std::vector<float> keys, values;  // [T][d], already rounded to the dtype
  uint32_t T = 0, k = 0;
  uint64_t seed = 0;
  uint32_t outliers = 0;  // split_outliers's cap and ratio
  float ratio = 0.f;
};

std::vector<float> rounded(DType t, const std::vector<float> &x) {
  std::vector<uint8_t> b(x.size() * dtype_bytes(t));
  from_float(t, x.data(), b.data(), x.size());
  std::vector<float> y(x.size());
  to_float(t, b.data(), y.data(), x.size());
  return y;
}

// Runs one batch on the device and splits its outputs per segment.
class KMeansRunner {
 public:
  KMeansRunner(DType t, uint32_t d, KMeansAssign path, uint32_t iters = 10,
               KMeansOrder order = KMeansOrder::kAuto) {
    p_.dtype = t;
    p_.head_dim = d;
    p_.iters = iters;
    p_.assign = path;
    p_.order = order;
  }
  ~KMeansRunner() { kmeans_cublas_destroy(cublas_); }

  void run(const std::vector<SegInput> &in, std::vector<SegmentClusters> *out) {
    const uint32_t S = static_cast<uint32_t>(in.size()), d = p_.head_dim;
    const uint32_t eb = dtype_bytes(p_.dtype);
    if (p_.assign == KMeansAssign::kCublas && !cublas_) ASSERT_OK(kmeans_cublas_create(&cublas_));
    std::vector<std::unique_ptr<DevBuf>> rows;
    std::vector<KMeansSegmentDesc> desc(S);
    for (uint32_t s = 0; s < S; ++s) {
      for (const std::vector<float> *src : {&in[s].keys, &in[s].values}) {
        std::vector<uint8_t> b(src->size() * eb);
        from_float(p_.dtype, src->data(), b.data(), src->size());
        rows.push_back(std::make_unique<DevBuf>(b.size()));
        upload(*rows.back(), b);
      }
      desc[s].keys = rows[2 * s]->p;
      desc[s].values = rows[2 * s + 1]->p;
      desc[s].tokens = in[s].T;
      desc[s].clusters = in[s].k;
      desc[s].seed = in[s].seed;
      desc[s].outliers = in[s].outliers;
      desc[s].outlier_ratio = in[s].ratio;
    }
    const KMeansBatchShape sh = kmeans_batch_shape(desc.data(), S);
    size_t ws_bytes = 0;
    ASSERT_OK(kmeans_batch_workspace_size(p_, sh, &ws_bytes));
    std::vector<uint64_t> tok_off(S), clu_off(S);
    kmeans_batch_offsets(desc.data(), S, tok_off.data(), clu_off.data());
    const uint64_t N = sh.total_tokens, K = clu_off[S - 1] + kmeans_out_clusters(desc[S - 1]);
    DevBuf ws(ws_bytes), n_clusters(2 * S * 4), begin((K + S) * 4), order(N * 4), size(K * 4),
        centroid(K * d * 4), value_sum(K * d * 4), spread(K * 4), value_total(size_t(S) * d * 8);
    // Poison the outputs: every entry the contract names must be written.
    for (DevBuf *b : {&n_clusters, &begin, &order, &size, &centroid, &value_sum, &spread, &value_total})
      ASSERT_CUDA(cudaMemset(b->p, 0xcd, b->n));
    KMeansBatchOut o;
    o.n_clusters = n_clusters.as<uint32_t>();
    o.n_outliers = n_clusters.as<uint32_t>() + S;
    o.spread = spread.as<float>();
    o.value_total = value_total.as<double>();
    o.begin = begin.as<uint32_t>();
    o.order = order.as<uint32_t>();
    o.size = size.as<uint32_t>();
    o.centroid = centroid.as<float>();
    o.value_sum = value_sum.as<float>();
    ASSERT_OK(kmeans_batch_cuda(p_, desc.data(), S, o, ws.p, ws_bytes, cublas_, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<uint32_t> hn, hb, ho, hs;
    std::vector<float> hc, hv, hsp;
    std::vector<double> hvt;
    download(&hn, n_clusters.p, 2 * S);
    download(&hsp, spread.p, K);
    download(&hvt, value_total.p, size_t(S) * d);
    download(&hb, begin.p, K + S);
    download(&ho, order.p, N);
    download(&hs, size.p, K);
    download(&hc, centroid.p, K * d);
    download(&hv, value_sum.p, K * d);
    out->assign(S, {});
    for (uint32_t s = 0; s < S; ++s) {
      SegmentClusters &sc = (*out)[s];
      const uint32_t k = kmeans_out_clusters(desc[s]), C = hn[s];
      ASSERT_LE(C, k);
      sc.n_clusters = C;
      sc.n_outliers = hn[S + s];
      ASSERT_LE(sc.n_outliers, in[s].outliers);
      sc.spread.assign(hsp.begin() + clu_off[s], hsp.begin() + clu_off[s] + C);
      sc.value_total.assign(hvt.begin() + size_t(s) * d, hvt.begin() + size_t(s + 1) * d);
      sc.order.assign(ho.begin() + tok_off[s], ho.begin() + tok_off[s] + in[s].T);
      sc.begin.assign(hb.begin() + clu_off[s] + s, hb.begin() + clu_off[s] + s + C + 1);
      sc.size.assign(hs.begin() + clu_off[s], hs.begin() + clu_off[s] + C);
      sc.centroid.assign(hc.begin() + clu_off[s] * d, hc.begin() + (clu_off[s] + C) * d);
      sc.value_sum.assign(hv.begin() + clu_off[s] * d, hv.begin() + (clu_off[s] + C) * d);
      // The unused tail of the segment's slots is defined too.
      for (uint32_t c = C + 1; c <= k; ++c) ASSERT_EQ(hb[clu_off[s] + s + c], in[s].T);
      for (uint32_t c = C; c < k; ++c) {
        ASSERT_EQ(hs[clu_off[s] + c], 0u);
        ASSERT_EQ(hsp[clu_off[s] + c], 0.f);
        for (uint32_t j = 0; j < d; ++j) {
          ASSERT_EQ(hc[(clu_off[s] + c) * d + j], 0.f);
          ASSERT_EQ(hv[(clu_off[s] + c) * d + j], 0.f);
        }
      }
    }
  }

  KMeansBatchParams p_;
  void *cublas_ = nullptr;
};

// Every structural promise of SegmentClusters, and the centroids and value
// sums against double sums over the members (relative tolerance tol).
void check_clusters(const SegmentClusters &sc, const SegInput &in, uint32_t d, double tol) {
  const uint32_t T = in.T, C = sc.n_clusters;
  ASSERT_GE(C, 1u);
  ASSERT_LE(C, std::clamp<uint32_t>(in.k, 1, T) + in.outliers);
  ASSERT_EQ(sc.order.size(), T);
  ASSERT_EQ(sc.begin.size(), C + 1);
  EXPECT_EQ(sc.begin[0], 0u);
  EXPECT_EQ(sc.begin[C], T);
  uint64_t total = 0;
  for (uint32_t c = 0; c < C; ++c) {
    ASSERT_GT(sc.size[c], 0u) << "empty cluster " << c;
    ASSERT_EQ(sc.begin[c + 1] - sc.begin[c], sc.size[c]);
    total += sc.size[c];
  }
  EXPECT_EQ(total, T);
  std::vector<int> seen(T, 0);
  for (uint32_t i : sc.order) {
    ASSERT_LT(i, T);
    ++seen[i];
  }
  for (uint32_t i = 0; i < T; ++i) ASSERT_EQ(seen[i], 1) << "token " << i;
  for (uint32_t c = 0; c < C; ++c) {
    for (uint32_t e = sc.begin[c] + 1; e < sc.begin[c + 1]; ++e)
      ASSERT_LT(sc.order[e - 1], sc.order[e]) << "cluster " << c << " not ascending";
    if (!sc.spread.empty()) {
      // The spread: the mean squared distance of the members to the centroid.
      double r = 0.0;
      for (uint32_t e = sc.begin[c]; e < sc.begin[c + 1]; ++e)
        for (uint32_t j = 0; j < d; ++j) {
          const double x = double(in.keys[size_t(sc.order[e]) * d + j]) - sc.centroid[size_t(c) * d + j];
          r += x * x;
        }
      ASSERT_NEAR(sc.spread[c], r / sc.size[c], 1e-4 * std::max(1.0, r / sc.size[c])) << "spread " << c;
    }
    for (uint32_t j = 0; j < d; ++j) {
      double ks = 0.0, kabs = 0.0, vs = 0.0, vabs = 0.0;
      for (uint32_t e = sc.begin[c]; e < sc.begin[c + 1]; ++e) {
        const size_t at = size_t(sc.order[e]) * d + j;
        ks += in.keys[at];
        kabs += std::fabs(in.keys[at]);
        vs += in.values[at];
        vabs += std::fabs(in.values[at]);
      }
      const double mean = ks / sc.size[c];
      ASSERT_NEAR(sc.centroid[size_t(c) * d + j], mean, tol * std::max(1.0, kabs / sc.size[c]))
          << "cluster " << c << " dim " << j;
      ASSERT_NEAR(sc.value_sum[size_t(c) * d + j], vs, tol * std::max(1.0, vabs))
          << "cluster " << c << " dim " << j;
    }
  }
}

bool same(const SegmentClusters &a, const SegmentClusters &b) {
  return a.n_clusters == b.n_clusters && a.n_outliers == b.n_outliers && a.order == b.order && a.begin == b.begin &&
         a.size == b.size && a.centroid.size() == b.centroid.size() && a.spread == b.spread &&
         a.value_total == b.value_total &&
         std::memcmp(a.centroid.data(), b.centroid.data(), a.centroid.size() * 4) == 0 &&
         std::memcmp(a.value_sum.data(), b.value_sum.data(), a.value_sum.size() * 4) == 0;
}

// Keys like post-RoPE ones: topic directions that hold for runs of tokens,
// on top of a large shared mean, plus noise.
SegInput structured_segment(std::mt19937_64 &rng, DType t, uint32_t T, uint32_t d, uint32_t k, uint64_t seed,
                            uint32_t topics = 48, uint32_t span = 24) {
  SegInput in;
  in.T = T;
  in.k = k;
  in.seed = seed;
  const auto mean = random_vec(rng, d, 3.f);
  const auto topic = random_vec(rng, size_t(topics) * d, 1.5f);
  std::normal_distribution<float> g(0.f, 1.f);
  std::uniform_int_distribution<uint32_t> pick(0, topics - 1);
  std::vector<float> keys(size_t(T) * d), values(size_t(T) * d);
  uint32_t cur = 0;
  for (uint32_t i = 0; i < T; ++i) {
    if (i % span == 0) cur = pick(rng);
    for (uint32_t j = 0; j < d; ++j) {
      keys[size_t(i) * d + j] = mean[j] + topic[size_t(cur) * d + j] + 0.5f * g(rng);
      values[size_t(i) * d + j] = g(rng);
    }
  }
  in.keys = rounded(t, keys);
  in.values = rounded(t, values);
  return in;
}

// Plants `count` needles in a segment (keys pushed far along a direction of
// their own, away from every topic), rounds the keys to the dtype again and
// returns the needles' positions.
std::vector<uint32_t> plant_needles(std::mt19937_64 &rng, DType t, uint32_t d, uint32_t count, SegInput *in) {
  std::vector<uint32_t> at;
  std::uniform_int_distribution<uint32_t> pick(0, in->T - 1);
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t p = pick(rng);
    const auto dir = random_vec(rng, d, 1.f);
    for (uint32_t j = 0; j < d; ++j) in->keys[size_t(p) * d + j] += 6.f * dir[j];
    at.push_back(p);
  }
  in->keys = rounded(t, in->keys);
  return at;
}

// Mean over tokens of the cosine between the centered key and its cluster's
// centered centroid: how well the clusters fit the keys.
double mean_cosine(const SegmentClusters &sc, const SegInput &in, uint32_t d) {
  std::vector<double> mean(d, 0.0);
  for (uint32_t i = 0; i < in.T; ++i)
    for (uint32_t j = 0; j < d; ++j) mean[j] += in.keys[size_t(i) * d + j];
  for (double &m : mean) m /= in.T;
  double total = 0.0;
  for (uint32_t c = 0; c < sc.n_clusters; ++c) {
    std::vector<double> dir(d);
    double dn = 0.0;
    for (uint32_t j = 0; j < d; ++j) {
      dir[j] = sc.centroid[size_t(c) * d + j] - mean[j];
      dn += dir[j] * dir[j];
    }
    for (uint32_t e = sc.begin[c]; e < sc.begin[c + 1]; ++e) {
      const float *key = in.keys.data() + size_t(sc.order[e]) * d;
      double dot = 0.0, kn = 0.0;
      for (uint32_t j = 0; j < d; ++j) {
        const double x = key[j] - mean[j];
        dot += x * dir[j];
        kn += x * x;
      }
      if (kn > 0 && dn > 0) total += dot / std::sqrt(kn * dn);
    }
  }
  return total / in.T;
}

const KMeansAssign kPaths[] = {KMeansAssign::kFused, KMeansAssign::kCublas};
const char *path_name(KMeansAssign p) { return p == KMeansAssign::kFused ? "fused" : "cublas"; }
double tolerance(DType t) { return t == DType::kF32 ? 1e-4 : 1e-2; }

TEST(KMeansCuda, BatchPartitionsWithExactCentroidsAndValueSums) {
  REQUIRE_GPU();
  // Mixed sizes in one batch: T not a multiple of the 128-point tile, k over
  // one 128-direction tile, k clamped to T, T = 1.
  struct Case { uint32_t T, k; };
  const Case cases[] = {{1000, 62}, {333, 20}, {4100, 300}, {64, 64}, {8, 5}, {5, 100}, {1, 7}, {257, 16}};
  std::mt19937_64 rng(101);
  for (KMeansAssign path : kPaths)
    for (DType t : {DType::kF32, DType::kF16, DType::kBF16})
      for (uint32_t d : {64u, 80u, 128u, 256u}) {
        if (d == 256 && t != DType::kF16) continue;  // one dtype is enough for the widest rows
        SCOPED_TRACE(testing::Message() << path_name(path) << " " << dtype_name(t) << " d=" << d);
        std::vector<SegInput> in;
        for (const Case &c : cases) {
          SegInput s;
          s.T = c.T;
          s.k = c.k;
          s.seed = c.T * 7 + d;
          s.keys = rounded(t, random_vec(rng, size_t(c.T) * d, 1.f, 3.f));
          s.values = rounded(t, random_vec(rng, size_t(c.T) * d, 2.f, -1.f));
          in.push_back(std::move(s));
        }
        KMeansRunner run(t, d, path);
        std::vector<SegmentClusters> out;
        ASSERT_NO_FATAL_FAILURE(run.run(in, &out));
        for (size_t s = 0; s < in.size(); ++s) {
          SCOPED_TRACE(testing::Message() << "segment " << s << " T=" << in[s].T);
          ASSERT_NO_FATAL_FAILURE(check_clusters(out[s], in[s], d, tolerance(t)));
        }
      }
}

TEST(KMeansCuda, ValueSumIsAccurateOverThousandsOfMembers) {
  REQUIRE_GPU();
  std::mt19937_64 rng(102);
  SegInput in;
  in.T = 5000;
  in.k = 1;
  in.keys = random_vec(rng, size_t(in.T) * 64);
  in.values = random_vec(rng, size_t(in.T) * 64, 0.01f, 1.f);
  KMeansRunner run(DType::kF32, 64, KMeansAssign::kFused);
  std::vector<SegmentClusters> out;
  ASSERT_NO_FATAL_FAILURE(run.run({in}, &out));
  ASSERT_EQ(out[0].n_clusters, 1u);
  for (uint32_t j = 0; j < 64; ++j) {
    double want = 0.0;
    for (uint32_t i = 0; i < in.T; ++i) want += in.values[size_t(i) * 64 + j];
    EXPECT_NEAR(out[0].value_sum[j], want, 1e-6 * std::fabs(want));
  }
}

TEST(KMeansCuda, SameSeedGivesBitIdenticalClusters) {
  REQUIRE_GPU();
  std::mt19937_64 rng(103);
  std::vector<SegInput> in;
  for (uint32_t s = 0; s < 6; ++s) in.push_back(structured_segment(rng, DType::kF16, 2048 + 300 * s, 128, 150, s));
  for (KMeansAssign path : kPaths) {
    SCOPED_TRACE(path_name(path));
    KMeansRunner run(DType::kF16, 128, path);
    std::vector<SegmentClusters> a, b;
    ASSERT_NO_FATAL_FAILURE(run.run(in, &a));
    ASSERT_NO_FATAL_FAILURE(run.run(in, &b));
    for (size_t s = 0; s < in.size(); ++s) EXPECT_TRUE(same(a[s], b[s])) << "segment " << s;
    // Other seeds give other clusters.
    auto other = in;
    for (auto &s : other) s.seed += 1000;
    std::vector<SegmentClusters> c;
    ASSERT_NO_FATAL_FAILURE(run.run(other, &c));
    int differing = 0;
    for (size_t s = 0; s < in.size(); ++s) differing += !same(a[s], c[s]);
    EXPECT_GT(differing, 0);
  }
}

// The per-segment counting sort and the batch's radix sort order the points
// alike, so the clusters are bit-identical; k = 1800 is beyond the counting
// sort's table, so there kAuto takes the radix sort too.
TEST(KMeansCuda, CountingSortAndRadixSortGiveTheSameClusters) {
  REQUIRE_GPU();
  std::mt19937_64 rng(108);
  std::vector<SegInput> in;
  const uint32_t T[] = {8192, 3000, 1, 700, 4100};
  for (uint32_t s = 0; s < 5; ++s) in.push_back(structured_segment(rng, DType::kF16, T[s], 128, T[s] / 16 + 1, s));
  for (uint32_t k : {512u, 1800u}) {
    SCOPED_TRACE(testing::Message() << "k of the first segment " << k);
    in[0].k = k;
    KMeansRunner bucket(DType::kF16, 128, KMeansAssign::kFused, 10, KMeansOrder::kAuto);
    KMeansRunner radix(DType::kF16, 128, KMeansAssign::kFused, 10, KMeansOrder::kRadix);
    std::vector<SegmentClusters> a, b;
    ASSERT_NO_FATAL_FAILURE(bucket.run(in, &a));
    ASSERT_NO_FATAL_FAILURE(radix.run(in, &b));
    for (size_t s = 0; s < in.size(); ++s) {
      EXPECT_TRUE(same(a[s], b[s])) << "segment " << s;
      ASSERT_NO_FATAL_FAILURE(check_clusters(a[s], in[s], 128, 1e-2));
    }
  }
}

TEST(KMeansCuda, IdenticalKeysFormOneCluster) {
  REQUIRE_GPU();
  SegInput in;
  in.T = 300;
  in.k = 6;
  in.keys.assign(size_t(in.T) * 64, 0.25f);
  in.values.assign(size_t(in.T) * 64, 1.f);
  KMeansRunner run(DType::kF32, 64, KMeansAssign::kFused);
  std::vector<SegmentClusters> out;
  ASSERT_NO_FATAL_FAILURE(run.run({in}, &out));
  ASSERT_EQ(out[0].n_clusters, 1u);
  std::vector<uint32_t> iota(in.T);
  std::iota(iota.begin(), iota.end(), 0u);
  EXPECT_EQ(out[0].order, iota);
  EXPECT_EQ(out[0].value_sum, std::vector<float>(64, float(in.T)));
}

TEST(KMeansCuda, HugeClustersAreSummedExactlyAndDeterministically) {
  REQUIRE_GPU();
  // Most tokens of a segment repeat one key (as repeated tokens do): their
  // cluster holds thousands of members and is summed by a whole CTA.
  std::mt19937_64 rng(105);
  const uint32_t d = 128;
  for (DType t : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(t));
    std::vector<SegInput> in;
    for (uint32_t T : {6000u, 300u, 2500u}) {
      SegInput s;
      s.T = T;
      s.k = T / 16;
      s.seed = T;
      auto keys = random_vec(rng, size_t(T) * d, 1.f, 2.f);
      for (uint32_t i = 0; i < T; ++i)
        if (i % 7 != 0) std::copy(keys.begin(), keys.begin() + d, keys.begin() + size_t(i) * d);
      s.keys = rounded(t, keys);
      s.values = rounded(t, random_vec(rng, size_t(T) * d, 1.f, 0.5f));
      in.push_back(std::move(s));
    }
    KMeansRunner run(t, d, KMeansAssign::kFused);
    std::vector<SegmentClusters> a, b;
    ASSERT_NO_FATAL_FAILURE(run.run(in, &a));
    ASSERT_NO_FATAL_FAILURE(run.run(in, &b));
    for (size_t s = 0; s < in.size(); ++s) {
      SCOPED_TRACE(testing::Message() << "segment " << s);
      ASSERT_NO_FATAL_FAILURE(check_clusters(a[s], in[s], d, tolerance(t)));
      EXPECT_TRUE(same(a[s], b[s]));
      const uint32_t biggest = *std::max_element(a[s].size.begin(), a[s].size.end());
      EXPECT_GE(biggest, in[s].T * 6 / 7);  // the repeated key's tokens stay together
    }
  }
}

TEST(KMeansCuda, RecoversPlantedDirectionsUnderALargeSharedOffset) {
  REQUIRE_GPU();
  // As the CPU test: 8 planted directions (4 and their opposites), radii
  // 0.5 to 2, shifted by an offset 1000 times a typical point; k = 32 so
  // that any start finds every group; 8 seeds run as 8 segments of a batch.
  const uint32_t groups = 8, per = 64, d = 64, T = groups * per;
  std::mt19937_64 rng(16);
  std::uniform_real_distribution<float> radius(0.5f, 2.f);
  auto unit = [&] {
    auto v = random_vec(rng, d);
    double n = 0.0;
    for (float x : v) n += double(x) * x;
    for (auto &x : v) x = static_cast<float>(x / std::sqrt(n));
    return v;
  };
  const auto offset = unit();
  std::vector<std::vector<float>> dirs;
  for (uint32_t g = 0; g < groups / 2; ++g) {
    dirs.push_back(unit());
    dirs.push_back(dirs.back());
    for (auto &x : dirs.back()) x = -x;
  }
  std::vector<float> keys(size_t(T) * d);
  std::vector<uint32_t> group(T);
  std::normal_distribution<float> noise(0.f, 0.03f);
  for (uint32_t i = 0; i < T; ++i) {
    group[i] = i % groups;
    const float r = radius(rng);
    for (uint32_t j = 0; j < d; ++j)
      keys[size_t(i) * d + j] = 1000.f * offset[j] + r * (dirs[group[i]][j] + noise(rng));
  }
  const auto values = random_vec(rng, size_t(T) * d);
  for (KMeansAssign path : kPaths) {
    SCOPED_TRACE(path_name(path));
    std::vector<SegInput> in;
    for (uint64_t seed = 1; seed <= 8; ++seed) {
      SegInput s;
      s.T = T;
      s.k = 32;
      s.seed = seed;
      s.keys = keys;
      s.values = values;
      in.push_back(s);
    }
    KMeansRunner run(DType::kF32, d, path);
    std::vector<SegmentClusters> out;
    ASSERT_NO_FATAL_FAILURE(run.run(in, &out));
    for (size_t s = 0; s < in.size(); ++s) {
      SCOPED_TRACE(testing::Message() << "seed " << in[s].seed);
      const SegmentClusters &sc = out[s];
      ASSERT_NO_FATAL_FAILURE(check_clusters(sc, in[s], d, 1e-4));
      std::vector<int> found(groups, 0);
      for (uint32_t c = 0; c < sc.n_clusters; ++c) {
        const uint32_t g = group[sc.order[sc.begin[c]]];
        found[g] = 1;
        for (uint32_t e = sc.begin[c]; e < sc.begin[c + 1]; ++e)
          ASSERT_EQ(group[sc.order[e]], g) << "cluster " << c << " mixes groups";
      }
      EXPECT_EQ(found, std::vector<int>(groups, 1));
    }
  }
}

TEST(KMeansCuda, FitsKeysAsWellAsTheCpuKMeans) {
  REQUIRE_GPU();
  const uint32_t d = 128, T = 4096, k = 256;
  for (DType t : {DType::kF32, DType::kF16}) {
    std::mt19937_64 rng(104);
    std::vector<SegInput> in;
    std::vector<double> cpu_fit;
    for (uint32_t s = 0; s < 4; ++s) {
      in.push_back(structured_segment(rng, t, T, d, k, 77 + s));
      KMeansParams kp;
      kp.n_clusters = k;
      kp.seed = in[s].seed;
      SegmentClusters cpu;
      kmeans_segment(kp, in[s].keys.data(), in[s].values.data(), T, d, &cpu);
      cpu_fit.push_back(mean_cosine(cpu, in[s], d));
    }
    for (KMeansAssign path : kPaths) {
      SCOPED_TRACE(testing::Message() << path_name(path) << " " << dtype_name(t));
      KMeansRunner run(t, d, path);
      std::vector<SegmentClusters> out;
      ASSERT_NO_FATAL_FAILURE(run.run(in, &out));
      for (size_t s = 0; s < in.size(); ++s) {
        const double qc = cpu_fit[s], qg = mean_cosine(out[s], in[s], d);
        EXPECT_GE(qg, 0.98 * qc) << "segment " << s << ": gpu " << qg << " cpu " << qc;
        EXPECT_GT(qc, 0.3);  // the data has structure to find
      }
    }
  }
}

TEST(KMeansCuda, RejectsBadArguments) {
  REQUIRE_GPU();
  KMeansBatchParams p;
  p.head_dim = 128;
  KMeansSegmentDesc seg;
  seg.tokens = 100;
  seg.clusters = 10;
  size_t bytes = 0;
  ASSERT_OK(kmeans_batch_workspace_size(p, kmeans_batch_shape(&seg, 1), &bytes));
  p.head_dim = 72;
  EXPECT_EQ(kmeans_batch_workspace_size(p, kmeans_batch_shape(&seg, 1), &bytes), cudaErrorNotSupported);
  p.head_dim = 128;
  DevBuf rows(100 * 128 * 2), ws(bytes), outb(1 << 20);
  seg.keys = rows.p;
  seg.values = rows.p;
  KMeansBatchOut o;
  o.n_clusters = o.n_outliers = o.begin = o.order = o.size = outb.as<uint32_t>();
  o.centroid = o.value_sum = o.spread = outb.as<float>();
  o.value_total = outb.as<double>();
  EXPECT_EQ(kmeans_batch_cuda(p, &seg, 1, o, ws.p, bytes - 256, nullptr, nullptr), cudaErrorInvalidValue);
  p.assign = KMeansAssign::kCublas;
  EXPECT_EQ(kmeans_batch_cuda(p, &seg, 1, o, ws.p, bytes, nullptr, nullptr), cudaErrorInvalidValue);
  p.assign = KMeansAssign::kFused;
  seg.tokens = 0;
  EXPECT_EQ(kmeans_batch_cuda(p, &seg, 1, o, ws.p, bytes, nullptr, nullptr), cudaErrorInvalidValue);
  seg.tokens = kKMeansMaxTokens + 1;
  EXPECT_EQ(kmeans_batch_cuda(p, &seg, 1, o, ws.p, bytes, nullptr, nullptr), cudaErrorInvalidValue);
  ASSERT_CUDA(cudaDeviceSynchronize());
}

// The device's split of outliers is split_outliers on the device's own
// clusters: a batch without outliers, split on the CPU, against the same
// batch split on the device. Planted outliers (keys pushed far along a
// direction of their own) are found.
TEST(KMeansCuda, SplitsOutliersAsTheCpuDoes) {
  REQUIRE_GPU();
  std::mt19937_64 rng(404);
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16})
    for (uint32_t d : {64u, 128u}) {
      SCOPED_TRACE(testing::Message() << dtype_name(t) << " d=" << d);
      std::vector<SegInput> plain;
      std::vector<std::vector<uint32_t>> planted;
      for (uint32_t T : {2000u, 777u, 64u, 9000u}) {
        SegInput in = structured_segment(rng, t, T, d, (T + 15) / 16, T + d);
        planted.push_back(plant_needles(rng, t, d, std::max(1u, T / 500), &in));
        plain.push_back(std::move(in));
      }
      std::vector<SegInput> split = plain;
      for (SegInput &in : split) {
        in.outliers = in.T / 100 + 1;
        in.ratio = 1.5f;
      }
      KMeansRunner runner(t, d, KMeansAssign::kFused);
      std::vector<SegmentClusters> base, dev;
      runner.run(plain, &base);
      if (HasFatalFailure()) return;
      runner.run(split, &dev);
      if (HasFatalFailure()) return;
      for (size_t s = 0; s < plain.size(); ++s) {
        SCOPED_TRACE("segment " + std::to_string(s));
        check_clusters(dev[s], split[s], d, tolerance(t));
        if (HasFatalFailure()) return;
        ASSERT_EQ(base[s].n_outliers, 0u);
        SegmentClusters cpu = base[s];
        split_outliers(split[s].outliers, split[s].ratio, split[s].keys.data(), split[s].values.data(), d, &cpu);
        EXPECT_GT(dev[s].n_outliers, 0u);
        ASSERT_EQ(dev[s].n_clusters, cpu.n_clusters);
        ASSERT_EQ(dev[s].n_outliers, cpu.n_outliers);
        ASSERT_EQ(dev[s].order, cpu.order);
        ASSERT_EQ(dev[s].begin, cpu.begin);
        ASSERT_EQ(dev[s].size, cpu.size);
        // Sums of the same members in the same order: the same bits.
        ASSERT_EQ(0, std::memcmp(dev[s].centroid.data(), cpu.centroid.data(), cpu.centroid.size() * 4));
        ASSERT_EQ(0, std::memcmp(dev[s].value_sum.data(), cpu.value_sum.data(), cpu.value_sum.size() * 4));
        for (uint32_t c = 0; c < cpu.n_clusters; ++c)
          ASSERT_NEAR(dev[s].spread[c], cpu.spread[c], 1e-5 * std::max(1.f, cpu.spread[c])) << "spread " << c;
        for (uint32_t j = 0; j < d; ++j)
          ASSERT_NEAR(dev[s].value_total[j], cpu.value_total[j], 1e-9 * std::max(1.0, std::fabs(cpu.value_total[j])));
        // The planted keys are clusters of one (split off, or alone already).
        std::vector<uint32_t> ones;
        for (uint32_t c = 0; c < cpu.n_clusters; ++c)
          if (cpu.size[c] == 1) ones.push_back(cpu.order[cpu.begin[c]]);
        for (uint32_t p : planted[s])
          EXPECT_NE(std::find(ones.begin(), ones.end(), p), ones.end()) << "planted outlier " << p;
      }
    }
}

// A batch of many segments of one size, as an engine's prompt batch is (its
// heads' segments side by side): every block splits at the same pace, so any
// scratch shared between segments is written by all of them at once. Each
// must still be exactly the CPU's split of its own clusters.
TEST(KMeansCuda, SegmentsOfOneBatchSplitIndependently) {
  REQUIRE_GPU();
  std::mt19937_64 rng(405);
  const DType t = DType::kBF16;
  const uint32_t d = 128, T = 2048, S = 32;
  std::vector<SegInput> plain;
  for (uint32_t s = 0; s < S; ++s) {
    SegInput in = structured_segment(rng, t, T, d, T / 16, T + d + s);
    plant_needles(rng, t, d, 8, &in);
    plain.push_back(std::move(in));
  }
  std::vector<SegInput> split = plain;
  for (SegInput &in : split) {
    in.outliers = T / 200;  // the engine's cap (kOutlierShare)
    in.ratio = 1.5f;
  }
  KMeansRunner runner(t, d, KMeansAssign::kFused);
  std::vector<SegmentClusters> base, dev;
  runner.run(plain, &base);
  if (HasFatalFailure()) return;
  for (int rep = 0; rep < 3; ++rep) {
    runner.run(split, &dev);
    if (HasFatalFailure()) return;
    for (uint32_t s = 0; s < S; ++s) {
      SCOPED_TRACE(testing::Message() << "run " << rep << " segment " << s);
      SegmentClusters cpu = base[s];
      split_outliers(split[s].outliers, split[s].ratio, split[s].keys.data(), split[s].values.data(), d, &cpu);
      EXPECT_GT(dev[s].n_outliers, 0u);
      ASSERT_EQ(dev[s].n_clusters, cpu.n_clusters);
      ASSERT_EQ(dev[s].order, cpu.order);
      ASSERT_EQ(dev[s].begin, cpu.begin);
      ASSERT_EQ(dev[s].size, cpu.size);
      ASSERT_EQ(0, std::memcmp(dev[s].centroid.data(), cpu.centroid.data(), cpu.centroid.size() * 4));
    }
  }
}

// Page writes ---------------------------------------------------------------------

TEST(WritePagesCuda, PagesMatchTheCpuLayoutByteForByte) {
  REQUIRE_GPU();
  struct Case { uint32_t row_bytes, page_tokens, T; };
  const Case cases[] = {{256, 8, 1000}, {160, 12, 37}, {512, 4, 1}, {320, 6, 4099}};
  std::mt19937_64 rng(201);
  for (const Case &c : cases) {
    SCOPED_TRACE(testing::Message() << "row_bytes " << c.row_bytes << " T " << c.T);
    const uint32_t pt = c.page_tokens, rb = c.row_bytes, slot_bytes = 2 * pt * rb;
    // Two segments: the second runs through the batched launcher.
    const uint32_t Ts[2] = {c.T, c.T / 2 + 1};
    const uint32_t pages[2] = {(Ts[0] + pt - 1) / pt, (Ts[1] + pt - 1) / pt};
    const uint32_t pool = 2 * (pages[0] + pages[1]);  // pages land at random places in a pool
    HostBuf host(size_t(pool) * slot_bytes);
    ASSERT_NE(host.p, nullptr);
    std::memset(host.p, 0x5a, size_t(pool) * slot_bytes);
    std::vector<uint32_t> perm(pool);
    std::iota(perm.begin(), perm.end(), 0u);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<uint8_t> want(size_t(pool) * slot_bytes, 0x5a);
    std::vector<std::unique_ptr<DevBuf>> keep;
    WritePagesJob jobs[2];
    uint32_t next_page = 0;
    for (int s = 0; s < 2; ++s) {
      const uint32_t T = Ts[s];
      auto k = random_bytes(rng, size_t(T) * rb), v = random_bytes(rng, size_t(T) * rb);
      std::vector<uint32_t> order(T);
      std::iota(order.begin(), order.end(), 0u);
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<uint8_t *> page_ptr(pages[s]);
      for (uint32_t p = 0; p < pages[s]; ++p) {
        const uint32_t at = perm[next_page++];
        page_ptr[p] = host.device() + size_t(at) * slot_bytes;
        for (uint32_t r = 0; r < pt && p * pt + r < T; ++r) {
          const uint32_t src = order[p * pt + r];
          std::memcpy(&want[size_t(at) * slot_bytes + size_t(r) * rb], &k[size_t(src) * rb], rb);
          std::memcpy(&want[size_t(at) * slot_bytes + size_t(pt + r) * rb], &v[size_t(src) * rb], rb);
        }
      }
      for (auto *vec : {&k, &v}) {
        keep.push_back(std::make_unique<DevBuf>(vec->size()));
        upload(*keep.back(), *vec);
      }
      keep.push_back(std::make_unique<DevBuf>(order.size() * 4));
      upload(*keep.back(), order);
      keep.push_back(std::make_unique<DevBuf>(page_ptr.size() * 8));
      upload(*keep.back(), page_ptr);
      const size_t b = keep.size();
      jobs[s].k = keep[b - 4]->as<uint8_t>();
      jobs[s].v = keep[b - 3]->as<uint8_t>();
      jobs[s].order = keep[b - 2]->as<uint32_t>();
      jobs[s].pages = keep[b - 1]->as<uint8_t *const>();
      jobs[s].tokens = T;
    }
    ASSERT_OK(write_pages_cuda(jobs[0], rb, pt, nullptr));
    DevBuf djob(sizeof(WritePagesJob));
    ASSERT_CUDA(cudaMemcpy(djob.p, &jobs[1], sizeof(WritePagesJob), cudaMemcpyHostToDevice));
    ASSERT_OK(write_pages_batch_cuda(djob.as<WritePagesJob>(), 1, Ts[1], rb, pt, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    ASSERT_EQ(0, std::memcmp(host.p, want.data(), want.size()));
  }
}

TEST(WritePagesCuda, RejectsRowsThatAreNotWholeVectors) {
  REQUIRE_GPU();
  WritePagesJob job;
  EXPECT_EQ(write_pages_cuda(job, 100, 8, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(write_pages_cuda(job, 256, 0, nullptr), cudaErrorInvalidValue);
}

// Spans (a growth's commit) ---------------------------------------------------------

// Copies from device and from mapped pinned memory, aligned and not, of
// every size up to several CTA rows, and narrowings with and without an
// out-of-range value: more spans than one launch carries.
TEST(ApplySpans, EveryCopyAndNarrowingLandsAndNothingElseChanges) {
  REQUIRE_GPU();
  std::mt19937_64 rng(77);
  constexpr size_t kSrc = 1 << 20, kDst = 4 << 20;
  const std::vector<uint8_t> dsrc_h = random_bytes(rng, kSrc), psrc_h = random_bytes(rng, kSrc);
  std::vector<float> fsrc_h = random_vec(rng, kSrc / 4, 100.f);
  DevBuf dsrc(kSrc), fsrc(kSrc), dst(kDst), flags(8);
  HostBuf psrc(kSrc);
  ASSERT_NE(psrc.p, nullptr);
  std::memcpy(psrc.p, psrc_h.data(), kSrc);
  upload(dsrc, dsrc_h);
  ASSERT_CUDA(cudaMemset(dst.p, 0xa5, kDst));
  ASSERT_CUDA(cudaMemset(flags.p, 0, 8));
  std::vector<uint8_t> want(kDst, 0xa5);
  std::vector<SpanDesc> spans;
  size_t at = 0;
  bool narrowed_bad = false;
  for (uint32_t i = 0; i < 300 && at < kDst - 70000; ++i) {
    at += rng() % 3 == 0 ? rng() % 17 : (16 - at % 16) % 16;  // aligned two times in three
    SpanDesc sp{};
    if (i % 7 == 3) {  // a narrowing of up to 4096 values; every 4th one has one out of range
      const uint32_t n = static_cast<uint32_t>(rng() % 4097);
      const size_t from = rng() % (kSrc / 4 - n);
      at = (at + 1) & ~size_t{1};
      sp = SpanDesc{dst.as<uint8_t>() + at, fsrc.as<uint8_t>() + from * 4, flags.as<uint32_t>(), n, kSpanNarrowF16};
      if (i % 4 == 3 && n > 0) {
        fsrc_h[from + n / 2] = 1e6f;
        narrowed_bad = true;
      }
      at += size_t(n) * 2;
    } else {
      const uint32_t n = static_cast<uint32_t>(i % 5 == 0 ? rng() % 65536 : rng() % 600);
      const bool pinned = i % 2 == 0;
      size_t from = rng() % (kSrc - n);
      if (rng() % 3 != 0) from &= ~size_t{15};
      const uint8_t *src = pinned ? psrc.device() + from : dsrc.as<uint8_t>() + from;
      sp = SpanDesc{dst.as<uint8_t>() + at, src, nullptr, n, kSpanCopy};
      std::memcpy(&want[at], (pinned ? psrc_h : dsrc_h).data() + from, n);
      at += n;
    }
    spans.push_back(sp);
  }
  ASSERT_GT(spans.size(), 240u);  // three launches at least
  ASSERT_TRUE(narrowed_bad);
  upload(fsrc, fsrc_h);  // the values as the spans read them
  for (const SpanDesc &sp : spans) {
    if (sp.op != kSpanNarrowF16) continue;
    const size_t to = static_cast<size_t>(sp.dst - dst.as<uint8_t>());
    const size_t from = static_cast<size_t>(sp.src - fsrc.as<uint8_t>()) / 4;
    for (uint32_t j = 0; j < sp.n; ++j) {
      const uint16_t h = float_to_f16(fsrc_h[from + j]);
      std::memcpy(&want[to + size_t(j) * 2], &h, 2);
    }
  }
  ASSERT_OK(apply_spans(spans.data(), static_cast<uint32_t>(spans.size()), nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> got;
  download(&got, dst.p, kDst);
  for (size_t i = 0; i < kDst; ++i) ASSERT_EQ(got[i], want[i]) << "byte " << i;
  std::vector<uint32_t> flag;
  download(&flag, flags.p, 1);
  EXPECT_NE(flag[0], 0u) << "an out-of-range value is flagged";

  // In range only: the flag stays clear; a bad span is refused unlaunched.
  ASSERT_CUDA(cudaMemset(flags.p, 0, 8));
  SpanDesc ok{dst.as<uint8_t>(), fsrc.as<uint8_t>(), flags.as<uint32_t>(), 64, kSpanNarrowF16};
  ASSERT_OK(apply_spans(&ok, 1, nullptr));
  download(&flag, flags.p, 1);
  EXPECT_EQ(flag[0], 0u);
  SpanDesc no_flag{dst.as<uint8_t>(), fsrc.as<uint8_t>(), nullptr, 64, kSpanNarrowF16};
  EXPECT_EQ(apply_spans(&no_flag, 1, nullptr), cudaErrorInvalidValue);
  SpanDesc no_src{dst.as<uint8_t>(), nullptr, nullptr, 64, kSpanCopy};
  EXPECT_EQ(apply_spans(&no_src, 1, nullptr), cudaErrorInvalidValue);
  SpanDesc odd{dst.as<uint8_t>(), fsrc.as<uint8_t>() + 1, flags.as<uint32_t>(), 64, kSpanNarrowF16};
  EXPECT_EQ(apply_spans(&odd, 1, nullptr), cudaErrorInvalidValue) << "a narrowing from a misaligned f32 array";

  // A refusal anywhere enqueues nothing, not even the launches before it.
  ASSERT_CUDA(cudaMemset(dst.p, 0x11, kDst));
  std::vector<SpanDesc> many(200, SpanDesc{dst.as<uint8_t>(), dsrc.as<uint8_t>(), nullptr, 4096, kSpanCopy});
  for (size_t i = 0; i < many.size(); ++i) many[i].dst += i * 4096;
  many[150].src = nullptr;
  EXPECT_EQ(apply_spans(many.data(), static_cast<uint32_t>(many.size()), nullptr), cudaErrorInvalidValue);
  ASSERT_CUDA(cudaDeviceSynchronize());
  download(&got, dst.p, 4096);
  EXPECT_EQ(got, std::vector<uint8_t>(4096, 0x11)) << "the first launch's spans were written";
}

// Rows quantized to 8 bits by spans (kSpanQuantRows8, beside copies in one
// launch) and by quantize_rows8: the CPU's quantize_row bytes and scales for
// every head dimension, the flag set only where a row is not finite (an
// infinity, a NaN), rows of zeros and below the floor with a scale of 0;
// malformed spans refused.
TEST(ApplySpans, RowQuantizationsAreTheCpusBytes) {
  REQUIRE_GPU();
  std::mt19937_64 rng(91);
  for (uint32_t d : {64u, 80u, 96u, 128u, 256u}) {
    SCOPED_TRACE("d=" + std::to_string(d));
    // More rows than a launch's warps (64 CTA rows of 8 for a span, 1024 CTAs
    // of 8 for quantize_rows8): warps take several rows each.
    constexpr uint32_t kRows = 9000;
    std::vector<float> rows_h = random_vec(rng, size_t(kRows) * d, 50.f);
    for (uint32_t j = 0; j < d; j += 16) rows_h[size_t(7) * d + j] += 4000.f;  // a shared offset, as keys have
    std::fill_n(rows_h.begin() + size_t(11) * d, d, 0.f);
    std::fill_n(rows_h.begin() + size_t(12) * d, d, 1e-31f);  // below kInt8RowFloor
    std::vector<float> finite_rows = rows_h;
    rows_h[size_t(200) * d + 3] = std::numeric_limits<float>::infinity();
    rows_h[size_t(250) * d + d - 1] = std::numeric_limits<float>::quiet_NaN();
    std::vector<int8_t> want(size_t(kRows) * d);
    std::vector<float> want_scale(kRows);
    for (uint32_t r = 0; r < kRows; ++r)
      quantize_row(rows_h.data() + size_t(r) * d, d, want.data() + size_t(r) * d, &want_scale[r]);
    DevBuf src(rows_h.size() * 4), fine(rows_h.size() * 4), q(want.size()), sc(kRows * 4), flags(16), cdst(4096),
        csrc(4096);
    upload(src, rows_h);
    upload(fine, finite_rows);
    for (int way = 0; way < 2; ++way) {  // 0: spans (the first rows, then the rest, a copy between); 1: the verb
      SCOPED_TRACE(way ? "quantize_rows8" : "spans");
      ASSERT_CUDA(cudaMemset(q.p, 0x5a, want.size()));
      ASSERT_CUDA(cudaMemset(sc.p, 0x5a, kRows * 4));
      ASSERT_CUDA(cudaMemset(flags.p, 0, 16));
      if (way == 0) {
        const uint32_t first = 637;
        std::vector<SpanDesc> spans = {
            SpanDesc{q.as<uint8_t>(), src.as<uint8_t>(), flags.as<uint32_t>(), first * d, kSpanQuantRows8,
                     sc.as<float>(), d},
            SpanDesc{cdst.as<uint8_t>(), csrc.as<uint8_t>(), nullptr, 4096, kSpanCopy},
            SpanDesc{q.as<uint8_t>() + size_t(first) * d, src.as<uint8_t>() + size_t(first) * d * 4,
                     flags.as<uint32_t>(), (kRows - first) * d, kSpanQuantRows8, sc.as<float>() + first, d}};
        ASSERT_OK(apply_spans(spans.data(), static_cast<uint32_t>(spans.size()), nullptr));
      } else {
        ASSERT_OK(quantize_rows8(src.as<float>(), kRows, d, q.as<int8_t>(), sc.as<float>(), flags.as<uint32_t>(),
                                 nullptr));
      }
      ASSERT_CUDA(cudaDeviceSynchronize());
      std::vector<uint8_t> got;
      std::vector<float> got_scale;
      std::vector<uint32_t> flag;
      download(&got, q.p, want.size());
      download(&got_scale, sc.p, kRows);
      download(&flag, flags.p, 1);
      for (size_t i = 0; i < want.size(); ++i)
        ASSERT_EQ(static_cast<int8_t>(got[i]), want[i]) << "row " << i / d << " component " << i % d;
      for (uint32_t r = 0; r < kRows; ++r) {
        uint32_t a, b;
        std::memcpy(&a, &got_scale[r], 4);
        std::memcpy(&b, &want_scale[r], 4);
        ASSERT_EQ(a, b) << "row " << r << "'s scale";
      }
      EXPECT_EQ(got_scale[11], 0.f);
      EXPECT_EQ(got_scale[12], 0.f);
      EXPECT_TRUE(std::isnan(got_scale[200]) && std::isnan(got_scale[250]));
      EXPECT_NE(flag[0], 0u) << "a row with an infinity or a NaN is flagged";
    }
    // Finite rows only: the flag stays clear.
    ASSERT_CUDA(cudaMemset(flags.p, 0, 16));
    ASSERT_OK(
        quantize_rows8(fine.as<float>(), kRows, d, q.as<int8_t>(), sc.as<float>(), flags.as<uint32_t>(), nullptr));
    std::vector<uint32_t> flag;
    download(&flag, flags.p, 1);
    EXPECT_EQ(flag[0], 0u);
  }
  // Malformed: no scales, no flag, a row of 0 or over 256, rows not whole.
  DevBuf src(4096), q(4096), sc(256), flags(16);
  const SpanDesc good{q.as<uint8_t>(), src.as<uint8_t>(), flags.as<uint32_t>(), 256, kSpanQuantRows8, sc.as<float>(),
                      64};
  EXPECT_EQ(check_spans(&good, 1), cudaSuccess);
  for (int bad = 0; bad < 5; ++bad) {
    SpanDesc sp = good;
    if (bad == 0) sp.scales = nullptr;
    if (bad == 1) sp.overflow = nullptr;
    if (bad == 2) sp.row = 0;
    if (bad == 3) sp.row = 512, sp.n = 512;
    if (bad == 4) sp.n = 255;
    EXPECT_EQ(apply_spans(&sp, 1, nullptr), cudaErrorInvalidValue) << "malformed span " << bad;
  }
  EXPECT_EQ(quantize_rows8(src.as<float>(), 4, 0, q.as<int8_t>(), sc.as<float>(), flags.as<uint32_t>(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(quantize_rows8(src.as<float>(), 4, 64, q.as<int8_t>(), nullptr, flags.as<uint32_t>(), nullptr),
            cudaErrorInvalidValue);
}

// A lookup's staging: every run of the table lands in device memory (past a
// launch's 144 runs too), and the query, strided bf16, lands as f32.
TEST(StageLookup, CopiesEveryRunAndConvertsTheQuery) {
  REQUIRE_GPU();
  std::mt19937_64 rng(5);
  for (uint32_t n : {0u, 1u, 16u, 17u, 64u, 65u, 144u, 145u, 400u}) {
    SCOPED_TRACE("runs " + std::to_string(n));
    std::vector<DevRun> runs(n);
    for (DevRun &r : runs) {
      const std::vector<uint8_t> b = random_bytes(rng, sizeof(DevRun));
      std::memcpy(&r, b.data(), sizeof(DevRun));
    }
    constexpr uint32_t seqs = 3, nq = 5, d = 96;
    constexpr int64_t head_stride = 100, seq_stride = 7 * 100;  // elements, with gaps
    const std::vector<float> qf = random_vec(rng, seq_stride * seqs);
    std::vector<uint16_t> qh(qf.size());
    for (size_t i = 0; i < qf.size(); ++i) qh[i] = float_to_bf16(qf[i]);
    DevBuf dq(qh.size() * 2), q32(size_t(seqs) * nq * d * 4), druns(std::max<size_t>(n, 1) * sizeof(DevRun));
    upload(dq, qh);
    ASSERT_CUDA(cudaMemset(druns.p, 0xee, std::max<size_t>(n, 1) * sizeof(DevRun)));
    ASSERT_CUDA(stage_lookup(DType::kBF16, dq.p, seq_stride, head_stride, seqs, nq, d, q32.as<float>(),
                             runs.data(), n, reinterpret_cast<DevRun *>(druns.p), nullptr));
    std::vector<uint8_t> want(size_t(n) * sizeof(DevRun));
    if (n > 0) std::memcpy(want.data(), runs.data(), want.size());
    std::fill(runs.begin(), runs.end(), DevRun{});  // passed by value: the host array may change at once
    ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<uint8_t> got;
    download(&got, druns.p, want.size());
    EXPECT_TRUE(got == want) << "the run table differs";
    std::vector<float> gq;
    download(&gq, q32.p, size_t(seqs) * nq * d);
    for (uint32_t s = 0; s < seqs; ++s)
      for (uint32_t h = 0; h < nq; ++h)
        for (uint32_t i = 0; i < d; ++i)
          ASSERT_EQ(gq[(size_t(s) * nq + h) * d + i], bf16_to_float(qh[s * seq_stride + h * head_stride + i]))
              << "q s=" << s << " h=" << h << " i=" << i;
  }
  // Refused unlaunched: a table without its destination, a query without
  // its f32 buffer.
  DevRun one{};
  EXPECT_EQ(stage_lookup(DType::kBF16, nullptr, 0, 0, 0, 1, 8, nullptr, &one, 1, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(stage_lookup(DType::kBF16, &one, 0, 0, 1, 1, 8, nullptr, nullptr, 0, nullptr, nullptr),
            cudaErrorInvalidValue);
}

// Gather ----------------------------------------------------------------------------

// One run of a random gather problem, on the host.
struct HostRun {
  uint32_t sink = 0, tail = 0, n_ret = 0;
  std::vector<uint32_t> first_slot, size, unit_begin, ret_ids, ret_pos;
  std::vector<uint8_t *> pages;     // device-accessible addresses
  std::vector<uint8_t *> page_host; // where the test reads the same bytes
  std::vector<uint32_t> unit_map;   // frame of each unit, or kNoCacheFrame
  std::vector<uint8_t> sink_k, sink_v, tail_k, tail_v;
};

// Units of a cluster of n members, page_tokens each (the last shorter).
uint32_t units_of(uint32_t n, uint32_t pt) { return (n + pt - 1) / pt; }

// The assembly reads every unit of a retrieval cluster from its cache frame
// when the unit map names one, from its host pages otherwise; a missed unit
// is admitted into a frame taken from the pool while it has one and mapped
// there; hits, admissions and their counts are reported, and the step's end
// last.
TEST(GatherCuda, AssemblesUnitsFromFramesAndPagesAndAdmitsMisses) {
  REQUIRE_GPU();
  struct Case { uint32_t row_bytes, page_tokens; };
  const Case cases[] = {{256, 8}, {160, 12}, {256, 16}, {512, 1}};
  std::mt19937_64 rng(301);
  for (const Case &cs : cases) {
    SCOPED_TRACE(testing::Message() << "row_bytes " << cs.row_bytes << " page_tokens " << cs.page_tokens);
    const uint32_t rb = cs.row_bytes, pt = cs.page_tokens, frame_bytes = 2 * pt * rb;
    const uint32_t R = 7;
    std::vector<HostRun> runs(R);
    uint32_t total_pages = 0, total_units = 0;
    for (uint32_t r = 0; r < R; ++r) {
      HostRun &h = runs[r];
      const uint32_t C = 20 + rng() % 200;
      uint32_t slot = 0;
      h.unit_begin.push_back(0);
      for (uint32_t c = 0; c < C; ++c) {
        // Mostly ~16 tokens; one big cluster per run spans more than 32 pages.
        const uint32_t n = c == C / 2 ? 40 * pt + 3 : 1 + rng() % 31;
        h.first_slot.push_back(slot);
        h.size.push_back(n);
        h.unit_begin.push_back(h.unit_begin.back() + units_of(n, pt));
        slot += n;
      }
      h.pages.resize((slot + pt - 1) / pt);
      total_pages += static_cast<uint32_t>(h.pages.size());
      total_units += h.unit_begin.back();
      h.unit_map.assign(h.unit_begin.back(), kNoCacheFrame);
      h.sink = rng() % 5;
      h.tail = r == 1 ? 0 : rng() % 65;
      h.n_ret = r == 2 ? 0 : (r == 3 ? C : 1 + rng() % (C / 3));
      std::vector<uint32_t> ids(C);
      std::iota(ids.begin(), ids.end(), 0u);
      std::shuffle(ids.begin(), ids.end(), rng);
      h.ret_ids.assign(ids.begin(), ids.begin() + h.n_ret);
      std::sort(h.ret_ids.begin(), h.ret_ids.end());
      uint32_t pos = 0;
      for (uint32_t id : h.ret_ids) h.ret_pos.push_back(pos), pos += h.size[id];
      h.sink_k = random_bytes(rng, size_t(h.sink) * rb);
      h.sink_v = random_bytes(rng, size_t(h.sink) * rb);
      h.tail_k = random_bytes(rng, size_t(h.tail) * rb);
      h.tail_v = random_bytes(rng, size_t(h.tail) * rb);
    }
    // Pages in mapped host memory, in a shuffled order; a cache of frames
    // with their own bytes, a third of the units mapped to one, and as many
    // free frames in the pool as half the misses.
    HostBuf host(size_t(total_pages) * frame_bytes);
    ASSERT_NE(host.p, nullptr);
    {
      const auto bytes = random_bytes(rng, size_t(total_pages) * frame_bytes);
      std::memcpy(host.p, bytes.data(), bytes.size());
    }
    std::vector<uint32_t> perm(total_pages);
    std::iota(perm.begin(), perm.end(), 0u);
    std::shuffle(perm.begin(), perm.end(), rng);
    uint32_t next = 0;
    for (HostRun &h : runs)
      for (size_t p = 0; p < h.pages.size(); ++p) {
        const size_t at = size_t(perm[next++]) * frame_bytes;
        h.pages[p] = host.device() + at;
        h.page_host.push_back(host.bytes() + at);
      }
    const uint32_t frames = total_units + 16;
    std::vector<uint8_t> cache_img = random_bytes(rng, size_t(frames) * frame_bytes);
    DevBuf cache(cache_img.size());
    ASSERT_NE(cache.p, nullptr);
    upload(cache, cache_img);
    std::vector<uint32_t> free_frames(frames);
    std::iota(free_frames.begin(), free_frames.end(), 0u);
    std::shuffle(free_frames.begin(), free_frames.end(), rng);
    uint64_t want_hits = 0, want_misses = 0;
    for (HostRun &h : runs)
      for (uint32_t id : h.ret_ids)
        for (uint32_t u = h.unit_begin[id]; u < h.unit_begin[id + 1]; ++u) {
          if (rng() % 3 == 0) {
            h.unit_map[u] = free_frames.back();
            free_frames.pop_back();
            ++want_hits;
          } else {
            ++want_misses;
          }
        }
    ASSERT_GT(want_hits, 0u);
    ASSERT_GT(want_misses, 1u);
    // The pool holds frames for half of the misses.
    const uint32_t n_pool = static_cast<uint32_t>(want_misses / 2);
    std::vector<uint32_t> pooled(free_frames.end() - n_pool, free_frames.end());

    // Device images of the runs, their unit maps (one chunk each) and the
    // lookup.
    std::vector<std::unique_ptr<DevBuf>> keep;
    auto dev = [&](const auto &vec) {
      keep.push_back(std::make_unique<DevBuf>(vec.size() * sizeof(vec[0])));
      if (!vec.empty()) upload(*keep.back(), vec);
      return keep.back()->p;
    };
    std::vector<DevRun> druns(R);
    std::vector<uint32_t *> chunk_of(R);
    std::vector<uint32_t> all_ids, all_pos;
    std::vector<int32_t> offsets(R + 1, 0);
    for (uint32_t r = 0; r < R; ++r) {
      HostRun &h = runs[r];
      ASSERT_LE(h.unit_map.size(), kUnitMapChunk);
      std::vector<uint32_t> chunk(kUnitMapChunk, kNoCacheFrame);
      std::copy(h.unit_map.begin(), h.unit_map.end(), chunk.begin());
      chunk_of[r] = static_cast<uint32_t *>(dev(chunk));
      std::vector<uint32_t *> dir{chunk_of[r]};
      DevRun &d = druns[r];
      std::memset(&d, 0, sizeof(d));
      d.size = static_cast<const uint32_t *>(dev(h.size));
      d.first_slot = static_cast<const uint32_t *>(dev(h.first_slot));
      d.unit_begin = static_cast<const uint32_t *>(dev(h.unit_begin));
      d.pages = static_cast<const uint8_t *const *>(dev(h.pages));
      d.unit_dir = static_cast<uint32_t *const *>(dev(dir));
      d.sink_k = static_cast<const uint8_t *>(dev(h.sink_k));
      d.sink_v = static_cast<const uint8_t *>(dev(h.sink_v));
      d.tail_k = static_cast<const uint8_t *>(dev(h.tail_k));
      d.tail_v = static_cast<const uint8_t *>(dev(h.tail_v));
      d.clusters = static_cast<uint32_t>(h.size.size());
      d.n_ret = h.n_ret;
      d.sink_tokens = h.sink;
      d.tail_tokens = h.tail;
      d.ret_off = static_cast<uint32_t>(all_ids.size());
      all_ids.insert(all_ids.end(), h.ret_ids.begin(), h.ret_ids.end());
      all_pos.insert(all_pos.end(), h.ret_pos.begin(), h.ret_pos.end());
      uint32_t ret_tokens = 0;
      for (uint32_t id : h.ret_ids) ret_tokens += h.size[id];
      offsets[r + 1] = offsets[r] + static_cast<int32_t>(h.sink + h.tail + ret_tokens);
    }
    const uint32_t rows = static_cast<uint32_t>(offsets[R]);
    const uint32_t guard = 64;  // rows past the end that must stay untouched
    // stats: hits, misses, tokens gathered (the kernel writes all three).
    DevBuf xk(size_t(rows + guard) * rb), xv(size_t(rows + guard) * rb), stats(24), work(16);
    ASSERT_CUDA(cudaMemset(xk.p, 0xee, xk.n));
    ASSERT_CUDA(cudaMemset(xv.p, 0xee, xv.n));
    ASSERT_CUDA(cudaMemset(stats.p, 0, 24));
    ASSERT_CUDA(cudaMemset(work.p, 0, 16));
    // The step's record in mapped host memory: admissions, hits, counts,
    // the end mark; and the pool: its seen count (mapped), its slots and
    // counts of frames published and positions taken (device). Room to log
    // every miss.
    const uint32_t hit_cap = static_cast<uint32_t>(want_hits), admit_cap = static_cast<uint32_t>(want_misses);
    const size_t rec_bytes = 128 + sizeof(AdmitEntry) * admit_cap + 4 * hit_cap;
    HostBuf rec(rec_bytes);
    ASSERT_NE(rec.p, nullptr);
    std::memset(rec.p, 0, rec_bytes);
    uint8_t *rh = rec.bytes(), *rd = rec.device();
    auto *counts_h = reinterpret_cast<uint32_t *>(rh);
    auto *done_h = reinterpret_cast<unsigned long long *>(rh + 16);
    auto *seen_h = reinterpret_cast<unsigned long long *>(rh + 72);
    auto *admits_h = reinterpret_cast<AdmitEntry *>(rh + 128);
    auto *hits_h = reinterpret_cast<uint32_t *>(rh + 128 + sizeof(AdmitEntry) * admit_cap);
    DevBuf slots(4 * n_pool);
    upload(slots, pooled);
    auto to_dev = [&](void *hp) { return rd + (static_cast<uint8_t *>(hp) - rh); };
    DevBuf counts(16);  // published (n_pool), taken (0)
    const unsigned long long counts_init[2] = {n_pool, 0};
    ASSERT_CUDA(cudaMemcpy(counts.p, counts_init, 16, cudaMemcpyHostToDevice));

    GatherArgs a;
    a.runs = static_cast<const DevRun *>(dev(druns));
    a.n_runs = R;
    a.lookup.ret_ids = static_cast<uint32_t *>(dev(all_ids));
    a.lookup.ret_pos = static_cast<uint32_t *>(dev(all_pos));
    a.lookup.offsets = static_cast<int32_t *>(dev(offsets));
    for (const HostRun &h : runs) a.max_ret = std::max(a.max_ret, h.n_ret);
    a.max_ret = std::max<uint32_t>(1, a.max_ret / 3);  // a small grid still covers every cluster
    a.row_bytes = rb;
    a.page_tokens = pt;
    a.xk = xk.as<uint8_t>();
    a.xv = xv.as<uint8_t>();
    a.cache = cache.as<uint8_t>();
    a.frame_bytes = frame_bytes;
    a.frames = frames;
    a.pool.slots = slots.as<const uint32_t>();
    a.pool.seen = reinterpret_cast<unsigned long long *>(to_dev(seen_h));
    a.pool.avail = counts.as<unsigned long long>();
    a.pool.taken = counts.as<unsigned long long>() + 1;
    a.pool.cap = n_pool;
    a.admit_cap = admit_cap;
    a.admits = reinterpret_cast<AdmitEntry *>(to_dev(admits_h));
    a.hits = reinterpret_cast<uint32_t *>(to_dev(hits_h));
    a.hit_cap = hit_cap;
    a.record_counts = reinterpret_cast<uint32_t *>(to_dev(counts_h));
    a.work = work.as<uint32_t>();
    a.stats = stats.as<unsigned long long>();
    a.mark.done = reinterpret_cast<unsigned long long *>(to_dev(done_h));
    a.mark.epoch = 77;
    ASSERT_CUDA(gather_cuda(a, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());

    // The CPU gather: cached units from their frames, the rest from pages.
    std::vector<uint8_t> wk(size_t(rows + guard) * rb, 0xee), wv(size_t(rows + guard) * rb, 0xee);
    auto member = [&](const HostRun &h, uint32_t id, uint32_t m, const uint8_t **k, const uint8_t **v) {
      const uint32_t u = h.unit_begin[id] + m / pt, f = h.unit_map[u];
      if (f != kNoCacheFrame) {
        const uint8_t *fr = cache_img.data() + size_t(f) * frame_bytes;
        *k = fr + size_t(m % pt) * rb;
        *v = fr + size_t(pt + m % pt) * rb;
      } else {
        const uint32_t slot = h.first_slot[id] + m;
        const uint8_t *page = h.page_host[slot / pt];
        *k = page + size_t(slot % pt) * rb;
        *v = page + size_t(pt + slot % pt) * rb;
      }
    };
    for (uint32_t r = 0; r < R; ++r) {
      const HostRun &h = runs[r];
      size_t row = offsets[r];
      if (!h.sink_k.empty()) std::memcpy(&wk[row * rb], h.sink_k.data(), h.sink_k.size());
      if (!h.sink_v.empty()) std::memcpy(&wv[row * rb], h.sink_v.data(), h.sink_v.size());
      row += h.sink;
      if (!h.tail_k.empty()) std::memcpy(&wk[row * rb], h.tail_k.data(), h.tail_k.size());
      if (!h.tail_v.empty()) std::memcpy(&wv[row * rb], h.tail_v.data(), h.tail_v.size());
      row += h.tail;
      for (uint32_t i = 0; i < h.n_ret; ++i) {
        const uint32_t id = h.ret_ids[i];
        for (uint32_t m = 0; m < h.size[id]; ++m) {
          const uint8_t *k, *v;
          member(h, id, m, &k, &v);
          const size_t dst = (row + h.ret_pos[i] + m) * rb;
          std::memcpy(&wk[dst], k, rb);
          std::memcpy(&wv[dst], v, rb);
        }
      }
    }
    std::vector<uint8_t> gk, gv;
    download(&gk, xk.p, xk.n);
    download(&gv, xv.p, xv.n);
    for (size_t row = 0; row < rows + guard; ++row) {
      ASSERT_EQ(0, std::memcmp(&gk[row * rb], &wk[row * rb], rb)) << "K row " << row;
      ASSERT_EQ(0, std::memcmp(&gv[row * rb], &wv[row * rb], rb)) << "V row " << row;
    }
    std::vector<unsigned long long> cnt;
    download(&cnt, stats.p, 2);
    EXPECT_EQ(cnt[0], want_hits);
    EXPECT_EQ(cnt[1], want_misses);
    // The record: every miss logged, every hit logged, the pool emptied,
    // the end last.
    EXPECT_EQ(counts_h[0], admit_cap);
    EXPECT_EQ(counts_h[1], hit_cap);
    EXPECT_EQ(counts_h[2], want_misses) << "every miss counted, frames or not";
    EXPECT_EQ(*seen_h, n_pool) << "the pool's taken count, published";
    std::vector<unsigned long long> counts_after;
    download(&counts_after, counts.p, 2);
    EXPECT_EQ(counts_after[0], 0u) << "nothing left, every reservation that failed given back";
    EXPECT_EQ(counts_after[1], n_pool);
    EXPECT_EQ(*done_h, 77u);
    std::vector<uint32_t> work_after;
    download(&work_after, work.p, 4);
    EXPECT_EQ(work_after[0] + work_after[1] + work_after[2], 0u) << "the last CTA resets the counters";
    std::multiset<uint32_t> logged(hits_h, hits_h + hit_cap), cached;
    for (const HostRun &h : runs)
      for (uint32_t id : h.ret_ids)
        for (uint32_t u = h.unit_begin[id]; u < h.unit_begin[id + 1]; ++u)
          if (h.unit_map[u] != kNoCacheFrame) cached.insert(h.unit_map[u]);
    EXPECT_EQ(logged, cached);
    // Each admission: its frame holds the unit's rows, laid out like a page,
    // and its unit map entry names the frame.
    std::vector<uint8_t> cache_after;
    download(&cache_after, cache.p, cache.n);
    std::set<uint32_t> used;
    uint32_t empty = 0;
    for (uint32_t i = 0; i < admit_cap; ++i) {
      const AdmitEntry e = admits_h[i];
      ASSERT_LT(e.run, R);
      if (e.frame == kNoCacheFrame) {
        EXPECT_EQ(e.entry, 0u);
        ++empty;
        continue;
      }
      ASSERT_NE(e.entry, 0u) << "admission " << i << " (no other step competes)";
      const HostRun &h = runs[e.run];
      const uint64_t at = e.entry - reinterpret_cast<uint64_t>(chunk_of[e.run]);
      ASSERT_EQ(at % 4, 0u);
      const uint32_t u = static_cast<uint32_t>(at / 4);
      ASSERT_LT(u, h.unit_map.size());
      EXPECT_EQ(h.unit_map[u], kNoCacheFrame) << "only missed units are admitted";
      EXPECT_TRUE(used.insert(e.frame).second);
      uint32_t id = static_cast<uint32_t>(std::upper_bound(h.unit_begin.begin(), h.unit_begin.end(), u) -
                                          h.unit_begin.begin()) - 1;
      const uint32_t j = u - h.unit_begin[id];
      const uint8_t *fr = cache_after.data() + size_t(e.frame) * frame_bytes;
      for (uint32_t m = j * pt; m < std::min(h.size[id], (j + 1) * pt); ++m) {
        const uint8_t *k, *v;
        member(h, id, m, &k, &v);
        ASSERT_EQ(0, std::memcmp(fr + size_t(m % pt) * rb, k, rb)) << "frame " << e.frame << " K row " << m;
        ASSERT_EQ(0, std::memcmp(fr + size_t(pt + m % pt) * rb, v, rb)) << "frame " << e.frame << " V row " << m;
      }
      std::vector<uint32_t> entry;
      download(&entry, reinterpret_cast<const void *>(e.entry), 1);
      EXPECT_EQ(entry[0], e.frame);
      runs[e.run].unit_map[u] = e.frame;  // for the second pass
    }
    EXPECT_EQ(empty, admit_cap - n_pool) << "the misses after the pool ran dry";
    EXPECT_EQ(used, std::set<uint32_t>(pooled.begin(), pooled.end())) << "every pooled frame taken once";

    // A second pass without admissions reads the admitted units from their
    // frames: the same bytes, more hits.
    ASSERT_CUDA(cudaMemset(xk.p, 0xee, xk.n));
    ASSERT_CUDA(cudaMemset(stats.p, 0, 24));
    GatherArgs b = a;
    b.pool = FramePool{};
    b.admit_cap = 0;
    b.admits = nullptr;
    b.hits = nullptr;
    b.record_counts = nullptr;
    b.mark = StepMark{};
    ASSERT_CUDA(gather_cuda(b, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    download(&gk, xk.p, xk.n);
    EXPECT_EQ(gk, wk);
    download(&cnt, stats.p, 2);
    EXPECT_EQ(cnt[0], want_hits + n_pool);
    EXPECT_EQ(cnt[1], want_misses - n_pool);
  }
}

TEST(GatherCuda, RejectsMisalignedRowsAndAdmissionsWithoutCounters) {
  REQUIRE_GPU();
  GatherArgs a;
  DevBuf buf(4096);
  a.runs = buf.as<DevRun>();
  a.n_runs = 1;
  a.lookup.ret_ids = a.lookup.ret_pos = buf.as<uint32_t>();
  a.lookup.offsets = buf.as<int32_t>();
  a.xk = a.xv = buf.as<uint8_t>();
  a.page_tokens = 8;
  a.row_bytes = 136;
  EXPECT_EQ(gather_cuda(a, nullptr), cudaErrorInvalidValue);
  a.row_bytes = 256;
  a.xv = buf.as<uint8_t>() + 8;
  EXPECT_EQ(gather_cuda(a, nullptr), cudaErrorInvalidValue);
  a.xv = buf.as<uint8_t>();
  a.mark.done = reinterpret_cast<unsigned long long *>(buf.p);
  EXPECT_EQ(gather_cuda(a, nullptr), cudaErrorInvalidValue) << "a mark needs the work counters";
}

// The buffer manager's clear of evicted frames' unit map entries: one
// launch stores the value at every address of a mapped array (thousands,
// in any order), and nowhere else.
TEST(TableCuda, StoreWordsAtStoresAtEveryAddressAndNowhereElse) {
  REQUIRE_GPU();
  constexpr uint32_t kWords = 20000, kValue = 0xffffffffu;
  DevBuf words(kWords * sizeof(uint32_t));
  ASSERT_NE(words.p, nullptr);
  std::vector<uint32_t> init(kWords);
  std::iota(init.begin(), init.end(), 0u);
  ASSERT_EQ(cudaMemcpy(words.p, init.data(), kWords * sizeof(uint32_t), cudaMemcpyHostToDevice), cudaSuccess);
  // Every third word, shuffled: more than one CTA's worth and past the
  // by-value launch's 480.
  std::vector<uint32_t> at;
  for (uint32_t i = 0; i < kWords; i += 3) at.push_back(i);
  std::shuffle(at.begin(), at.end(), std::mt19937(7));
  HostBuf addrs(at.size() * sizeof(uint64_t));
  ASSERT_NE(addrs.p, nullptr);
  for (size_t i = 0; i < at.size(); ++i)
    static_cast<uint64_t *>(addrs.p)[i] = reinterpret_cast<uint64_t>(words.as<uint32_t>() + at[i]);
  uint64_t *dev_addrs = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void **>(&dev_addrs), addrs.p, 0), cudaSuccess);
  EXPECT_EQ(store_words_at(dev_addrs, 0, kValue, nullptr), cudaSuccess) << "nothing to store";
  EXPECT_EQ(store_words_at(nullptr, 1, kValue, nullptr), cudaErrorInvalidValue);
  ASSERT_EQ(store_words_at(dev_addrs, static_cast<uint32_t>(at.size()), kValue, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint32_t> got(kWords);
  ASSERT_EQ(cudaMemcpy(got.data(), words.p, kWords * sizeof(uint32_t), cudaMemcpyDeviceToHost), cudaSuccess);
  for (uint32_t i = 0; i < kWords; ++i) ASSERT_EQ(got[i], i % 3 == 0 ? kValue : i) << "word " << i;
}

}  // namespace
}  // namespace wkv::kernels
