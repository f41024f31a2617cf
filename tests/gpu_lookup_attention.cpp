// Tests of the CUDA lookup and attention kernels against the CPU kernels
// (kernels/cpu_kernels.hpp) on fresh random inputs from fixed seeds. Every
// output is poisoned (all bits set: NaN for floats, an impossible id for
// integers) before each launch, so an element the kernels fail to write
// shows as a mismatch. Without a CUDA device every test is skipped, never
// passed.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention_cuda.hpp"
#include "kernels/cpu_kernels.hpp"
#include "kernels/device_layout.hpp"
#include "kernels/lookup_cuda.hpp"
#include "kernels/dtype.hpp"
#include "gpu_support.hpp"

namespace wkv::kernels {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr uint32_t kDims[] = {64, 80, 96, 128, 256};
constexpr DType kTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

using wkvtest::sanitized_case;
using wkvtest::under_racecheck;

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

#define STATUS_OK(expr)                                              \
  do {                                                               \
    const cudaError_t st_ = (expr);                                  \
    ASSERT_EQ(st_, cudaSuccess) << #expr << ": " << cudaGetErrorString(st_); \
  } while (0)

// A device array that frees itself.
template <typename T>
class DevArray {
 public:
  DevArray() = default;
  DevArray(const DevArray &) = delete;
  DevArray &operator=(const DevArray &) = delete;
  ~DevArray() {
    if (p_) cudaFree(p_);
  }
  cudaError_t alloc(size_t n) {
    n_ = n;
    return cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T));
  }
  cudaError_t upload(const std::vector<T> &v) {
    cudaError_t e = alloc(v.size());
    if (e != cudaSuccess || v.empty()) return e;
    return cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  // Every bit set: NaN for f32, f16 and bf16; 0xffffffff for integers.
  cudaError_t poison() { return cudaMemset(p_, 0xff, std::max<size_t>(n_, 1) * sizeof(T)); }
  cudaError_t download(std::vector<T> *v) const {
    v->resize(n_);
    if (n_ == 0) return cudaSuccess;
    return cudaMemcpy(v->data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
  }
  T *get() const { return p_; }
  size_t size() const { return n_; }

 private:
  T *p_ = nullptr;
  size_t n_ = 0;
};

// Fast uniform floats in [-1, 1): the attention tests draw tens of millions.
class Uniform {
 public:
  explicit Uniform(uint64_t seed) : s_(seed * 0x9e3779b97f4a7c15ull + 1) {}
  float operator()() {
    s_ ^= s_ << 13;
    s_ ^= s_ >> 7;
    s_ ^= s_ << 17;
    return static_cast<float>(static_cast<int64_t>(s_ >> 40) - (int64_t(1) << 23)) * 0x1p-23f;
  }
  uint32_t below(uint32_t n) { return static_cast<uint32_t>((((*this)() + 1.f) * 0.5f) * n) % n; }

 private:
  uint64_t s_;
};

double rel_l2(const float *got, const float *want, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double e = double(got[i]) - want[i];
    num += e * e;
    den += double(want[i]) * want[i];
  }
  if (!(num == num)) return kInf;  // NaN
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-20);
}

// The engine's zone rule (lib/engine/engine.cpp, zone_sizes) at the default
// fractions.
void zone_rule(uint32_t clusters, uint32_t *n_ret, uint32_t *n_est) {
  if (clusters == 0) {
    *n_ret = *n_est = 0;
    return;
  }
  const double r = std::ceil(static_cast<double>(0.018f) * clusters - 1e-9);
  const double e = std::floor(static_cast<double>(0.232f) * clusters + 0.5);
  *n_ret = static_cast<uint32_t>(std::min<double>(r, clusters));
  *n_est = static_cast<uint32_t>(std::min<double>(e, clusters - *n_ret));
}

// Lookup ----------------------------------------------------------------------

enum class Zones { kEngineRule, kRandom };

struct LookupSpec {
  uint32_t d = 128, G = 4;
  std::vector<uint32_t> clusters;  // per run
  Zones zones = Zones::kEngineRule;
  bool ties = false;     // centroids drawn from 3 distinct rows: many equal scores
  bool spread = false;   // runs have spreads (WKV_METHOD_SPREAD)
  bool ones = false;     // a fifth of the clusters have one member, ranked apart (WKV_METHOD_ONES)
  bool tail = false;     // runs have a value mean (WKV_METHOD_TAIL)
  // With ones: the clusters of one score near zero (centroids near the
  // origin), so that the best of them lie outside the best n_ret + n_est of
  // all and the selection takes its second round.
  bool ones_low = false;
  // The f16 copies of the centroids and value sums (DevRun::centroid16,
  // value_sum16): kF32Only none; kNarrow the copies, centroids and value
  // sums drawn as f16 values and the f32 arrays poisoned, so that only the
  // copies give the right logits and estimates; kOverflowed the copies
  // flagged out of range with their rows poisoned, so that only the f32
  // arrays do.
  enum Meta16 { kF32Only, kNarrow, kOverflowed } meta16 = kF32Only;
  // The value sums' copy where it differs from the centroids' (each copy
  // has its own overflow word: sums grow with a cluster's size, so theirs
  // may be set while the centroids' is clear).
  std::optional<Meta16> meta16_values;
  // The centroids' 8-bit copy (DevRun::centroid8, centroid8_scale; d a
  // multiple of 32), read before the f16 one: kNarrow the copy, centroids
  // drawn as its dequantized rows and the f32 array poisoned (so only the
  // copy gives the right logits, the f16 copy then best flagged);
  // kOverflowed the copy flagged, its rows zero and its scales NaN, so that
  // only the f16 copy or the f32 array does. None where unset.
  std::optional<Meta16> meta8;
  // The value sums' 8-bit copy (DevRun::value_sum8, value_sum8_scale), read
  // before their f16 copy, likewise.
  std::optional<Meta16> meta8_values;
  uint64_t seed = 1;
  // The offsets by their own kernel (a mark without a CTA counter) rather
  // than by the estimate's last CTA, as the engine has them.
  bool own_offsets = false;
};

// The engine's rule with clusters of one ranked apart.
void zone_rule_ones(uint32_t clusters, uint32_t ones, uint32_t *n_ret, uint32_t *n_one, uint32_t *n_est) {
  *n_ret = *n_one = *n_est = 0;
  if (clusters == 0) return;
  auto share = [](uint32_t n) {
    return static_cast<uint32_t>(std::min<double>(std::ceil(static_cast<double>(0.018f) * n - 1e-9), n));
  };
  *n_one = ones > 0 ? std::max<uint32_t>(1, share(ones)) : 0;
  *n_ret = share(clusters - ones) + *n_one;
  *n_est = static_cast<uint32_t>(
      std::min<double>(std::floor(static_cast<double>(0.232f) * clusters + 0.5), clusters - *n_ret));
}

struct HostRun {
  uint32_t C = 0, n_ret = 0, n_one = 0, n_est = 0, sink = 0, tail = 0;
  size_t meta_off = 0;  // first float of centroid / value_sum in the packed arrays
  size_t size_off = 0;
  uint32_t ret_off = 0, est_off = 0, scratch_off = 0;
};

struct LookupOutputs {
  std::vector<uint32_t> ret_ids, ret_pos, est_ids, run_tokens;
  std::vector<float> est_out, est_lse, logits, scores;
  std::vector<int32_t> offsets;
  std::vector<uint8_t> zones;
  // Runs with clusters of one whose retrieval zone scores above the last of
  // the best n_ret + n_est of all (the selection's one round) and the others
  // (its second round).
  uint32_t ones_within = 0, ones_outside = 0;
};

// Builds the runs of spec on the device, runs lookup_zones (with or without
// the scores scratch) and checks every output against the CPU kernels.
void check_lookup(const LookupSpec &spec, bool with_scores, LookupOutputs *keep = nullptr) {
  const uint32_t d = spec.d, G = spec.G, R = static_cast<uint32_t>(spec.clusters.size());
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::mt19937_64 rng(spec.seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<uint32_t> size_dist(1, 40), small(0, 8);

  // 1. Runs and their meta index: sizes first (the zone rule counts the
  //    clusters of one), then centroids, value sums, spreads.
  std::vector<HostRun> hr(R);
  std::vector<float> centroid, value_sum, spread, value_mean;
  std::vector<uint32_t> sizes;
  uint32_t ret_total = 0, est_total = 0, scratch_total = 0, max_clusters = 0;
  std::uniform_real_distribution<float> spread_dist(0.f, 400.f);
  for (uint32_t r = 0; r < R; ++r) {
    HostRun &h = hr[r];
    h.C = spec.clusters[r];
    h.meta_off = centroid.size();
    h.size_off = sizes.size();
    uint32_t ones = 0;
    for (uint32_t c = 0; c < h.C; ++c) {
      const bool one = spec.ones && (c % 5 == 3 || h.C == 1);
      sizes.push_back(one ? 1 : spec.ones ? size_dist(rng) + 1 : size_dist(rng));
      ones += one;
    }
    if (spec.zones == Zones::kEngineRule) {
      if (spec.ones)
        zone_rule_ones(h.C, ones, &h.n_ret, &h.n_one, &h.n_est);
      else
        zone_rule(h.C, &h.n_ret, &h.n_est);
    } else {
      const uint32_t others = h.C - ones;
      h.n_one = spec.ones && ones > 0 ? std::uniform_int_distribution<uint32_t>(1, ones)(rng) : 0;
      h.n_ret = std::uniform_int_distribution<uint32_t>(0, spec.ones ? others : h.C)(rng) + h.n_one;
      h.n_est = std::uniform_int_distribution<uint32_t>(0, h.C - h.n_ret)(rng);
      if (r % 5 == 1 && !spec.ones) h.n_ret = 0;
      if (r % 5 == 2) h.n_est = h.C - h.n_ret;
    }
    h.sink = small(rng);
    h.tail = small(rng) * 8;
    h.ret_off = ret_total;
    h.est_off = est_total;
    h.scratch_off = scratch_total;
    ret_total += h.n_ret;
    est_total += h.n_est;
    scratch_total += G * h.C;
    max_clusters = std::max(max_clusters, h.C);
    // A shared offset makes the softmax peaky, as real keys do.
    std::vector<float> mean(d), distinct(3 * static_cast<size_t>(d));
    for (float &x : mean) x = 0.5f * normal(rng);
    for (float &x : distinct) x = normal(rng);
    for (uint32_t c = 0; c < h.C; ++c) {
      const uint32_t pick = c % 3;
      const bool low = spec.ones_low && sizes[h.size_off + c] == 1;
      for (uint32_t i = 0; i < d; ++i)
        centroid.push_back(low ? 0.01f * normal(rng) : spec.ties ? distinct[pick * d + i] : mean[i] + normal(rng));
      for (uint32_t i = 0; i < d; ++i) value_sum.push_back(8.f * normal(rng));
      spread.push_back(sizes[h.size_off + c] == 1 ? 0.f : spread_dist(rng));
    }
    for (uint32_t i = 0; i < d; ++i) value_mean.push_back(normal(rng));
  }
  std::vector<float> q(static_cast<size_t>(R) * G * d);
  for (float &x : q) x = normal(rng);

  // The 8-bit copies of the centroids and of the value sums: per run
  // kMeta16Header bytes (the overflow word first), then its rows [C][d]; the
  // scales beside, [C] a run. With kNarrow the rows become the copy's
  // dequantized ones.
  auto copy8 = [&](std::vector<float> &rows, std::optional<LookupSpec::Meta16> mode, std::vector<int8_t> *out,
                   std::vector<float> *scales, std::vector<size_t> *off, std::vector<size_t> *scale_off) {
    if (!mode) return;
    off->resize(R);
    scale_off->resize(R);
    for (uint32_t r = 0; r < R; ++r) {
      (*off)[r] = out->size();
      out->resize(out->size() + kMeta16Header, 0);
      if (*mode == LookupSpec::kOverflowed) (*out)[(*off)[r]] = 1;
      (*scale_off)[r] = scales->size();
      for (uint32_t c = 0; c < hr[r].C; ++c) {
        float *row = rows.data() + hr[r].meta_off + size_t(c) * d;
        std::vector<int8_t> qrow(d);
        float s = 0.f;
        quantize_row(row, d, qrow.data(), &s);
        if (*mode == LookupSpec::kNarrow) {
          for (uint32_t i = 0; i < d; ++i) row[i] = static_cast<float>(qrow[i]) * s;
        } else {
          std::fill(qrow.begin(), qrow.end(), int8_t{0});
          s = std::numeric_limits<float>::quiet_NaN();
        }
        out->insert(out->end(), qrow.begin(), qrow.end());
        scales->push_back(s);
      }
    }
  };
  std::vector<int8_t> meta8, values8;
  std::vector<float> scale8, values8_scale;
  std::vector<size_t> meta8_off, scale8_off, values8_off, values8_scale_off;
  copy8(centroid, spec.meta8, &meta8, &scale8, &meta8_off, &scale8_off);
  copy8(value_sum, spec.meta8_values, &values8, &values8_scale, &values8_off, &values8_scale_off);

  // The f16 copies of the centroids and of the value sums: per run
  // kMeta16Header bytes (the overflow word first), then its rows.
  std::vector<size_t> meta16_off(R);
  const LookupSpec::Meta16 values16 = spec.meta16_values.value_or(spec.meta16);
  auto copy16 = [&](std::vector<float> &rows, LookupSpec::Meta16 mode) {
    std::vector<uint16_t> out;
    if (mode == LookupSpec::kF32Only) return out;
    std::vector<f16> half(rows.size());
    from_float(DType::kF16, rows.data(), half.data(), rows.size());
    if (mode == LookupSpec::kNarrow) to_float(DType::kF16, half.data(), rows.data(), rows.size());
    constexpr size_t kHead = kMeta16Header / 2;
    for (uint32_t r = 0; r < R; ++r) {
      meta16_off[r] = out.size();
      out.resize(out.size() + kHead, 0);
      if (mode == LookupSpec::kOverflowed) out[meta16_off[r]] = 1;
      for (size_t i = 0; i < size_t(hr[r].C) * d; ++i)
        out.push_back(mode == LookupSpec::kNarrow ? half[hr[r].meta_off + i].bits : uint16_t{0x7c01});  // a NaN
    }
    return out;
  };
  const std::vector<uint16_t> meta16 = copy16(centroid, spec.meta16), value_sum16 = copy16(value_sum, values16);
  // NaN rows in place of the f32 arrays that a copy stands for.
  std::vector<float> poisoned;
  const bool centroids_copied = spec.meta16 == LookupSpec::kNarrow || spec.meta8 == LookupSpec::kNarrow;
  const bool values_copied = values16 == LookupSpec::kNarrow || spec.meta8_values == LookupSpec::kNarrow;
  if (centroids_copied || values_copied)
    poisoned.assign(centroid.size(), std::numeric_limits<float>::quiet_NaN());

  // 2. Device copies.
  DevArray<float> d_centroid, d_value_sum, d_spread, d_value_mean, d_q;
  DevArray<uint16_t> d_meta16, d_value_sum16;
  DevArray<int8_t> d_meta8, d_values8;
  DevArray<float> d_scale8, d_values8_scale;
  DevArray<uint32_t> d_sizes;
  CUDA_OK(d_centroid.upload(centroids_copied ? poisoned : centroid));
  CUDA_OK(d_meta16.upload(meta16));
  CUDA_OK(d_meta8.upload(meta8));
  CUDA_OK(d_scale8.upload(scale8));
  CUDA_OK(d_values8.upload(values8));
  CUDA_OK(d_values8_scale.upload(values8_scale));
  CUDA_OK(d_value_sum16.upload(value_sum16));
  CUDA_OK(d_value_sum.upload(values_copied ? poisoned : value_sum));
  CUDA_OK(d_spread.upload(spread));
  CUDA_OK(d_value_mean.upload(value_mean));
  CUDA_OK(d_sizes.upload(sizes));
  CUDA_OK(d_q.upload(q));
  std::vector<DevRun> runs(R);
  for (uint32_t r = 0; r < R; ++r) {
    DevRun &x = runs[r];
    std::memset(&x, 0, sizeof x);
    x.centroid = d_centroid.get() + hr[r].meta_off;
    x.value_sum = d_value_sum.get() + hr[r].meta_off;
    x.centroid16 = meta16.empty() ? nullptr : reinterpret_cast<const uint8_t *>(d_meta16.get() + meta16_off[r]);
    x.centroid8 = meta8.empty() ? nullptr : reinterpret_cast<const uint8_t *>(d_meta8.get() + meta8_off[r]);
    x.centroid8_scale = meta8.empty() ? nullptr : d_scale8.get() + scale8_off[r];
    x.value_sum8 = values8.empty() ? nullptr : reinterpret_cast<const uint8_t *>(d_values8.get() + values8_off[r]);
    x.value_sum8_scale = values8.empty() ? nullptr : d_values8_scale.get() + values8_scale_off[r];
    x.value_sum16 =
        value_sum16.empty() ? nullptr : reinterpret_cast<const uint8_t *>(d_value_sum16.get() + meta16_off[r]);
    x.size = d_sizes.get() + hr[r].size_off;
    x.spread = spec.spread ? d_spread.get() + hr[r].size_off : nullptr;
    x.value_mean = spec.tail ? d_value_mean.get() + size_t(r) * d : nullptr;
    x.clusters = hr[r].C;
    x.n_ret = hr[r].n_ret;
    x.n_one = hr[r].n_one;
    x.n_est = hr[r].n_est;
    x.sink_tokens = hr[r].sink;
    x.tail_tokens = hr[r].tail;
    x.ret_off = hr[r].ret_off;
    x.est_off = hr[r].est_off;
    x.scratch_off = hr[r].scratch_off;
  }
  DevArray<DevRun> d_runs;
  CUDA_OK(d_runs.alloc(R));
  if (R > 0) {
    CUDA_OK(cudaMemcpy(d_runs.get(), runs.data(), R * sizeof(DevRun), cudaMemcpyHostToDevice));
  }

  DevArray<uint32_t> d_ret_ids, d_ret_pos, d_est_ids, d_run_tokens;
  DevArray<float> d_est_out, d_est_lse, d_logits, d_scores;
  DevArray<int32_t> d_offsets;
  DevArray<uint8_t> d_zones;
  CUDA_OK(d_zones.alloc(scratch_total / std::max(G, 1u)));
  CUDA_OK(d_zones.poison());
  CUDA_OK(d_ret_ids.alloc(ret_total));
  CUDA_OK(d_ret_pos.alloc(ret_total));
  CUDA_OK(d_est_ids.alloc(est_total));
  CUDA_OK(d_run_tokens.alloc(R));
  CUDA_OK(d_est_out.alloc(static_cast<size_t>(R) * G * d));
  CUDA_OK(d_est_lse.alloc(static_cast<size_t>(R) * G));
  CUDA_OK(d_logits.alloc(scratch_total));
  CUDA_OK(d_scores.alloc(scratch_total / G));
  CUDA_OK(d_offsets.alloc(R + 1));
  for (auto *a : {&d_ret_ids, &d_ret_pos, &d_est_ids, &d_run_tokens}) CUDA_OK(a->poison());
  for (auto *a : {&d_est_out, &d_est_lse, &d_logits, &d_scores}) CUDA_OK(a->poison());
  CUDA_OK(d_offsets.poison());

  DevLookup out{};
  out.ret_ids = d_ret_ids.get();
  out.ret_pos = d_ret_pos.get();
  out.est_ids = d_est_ids.get();
  out.run_tokens = d_run_tokens.get();
  out.est_out = d_est_out.get();
  out.est_lse = d_est_lse.get();
  out.offsets = d_offsets.get();
  out.logits = d_logits.get();
  out.zones = d_zones.get();
  // The step's end: a device word that must read the epoch afterwards, and
  // (unless own_offsets) the counter of the estimate's finished CTAs, which
  // its last CTA must leave at zero for the next launch. Two launches in a
  // row on one counter: the second sees the first's reset.
  DevArray<unsigned long long> d_done;
  DevArray<unsigned int> d_ctas;
  CUDA_OK(d_done.alloc(1));
  CUDA_OK(d_ctas.alloc(1));
  CUDA_OK(cudaMemset(d_done.get(), 0, sizeof(unsigned long long)));
  CUDA_OK(cudaMemset(d_ctas.get(), 0, sizeof(unsigned int)));
  for (unsigned long long epoch = 1; epoch <= 2; ++epoch) {
    const StepMark mark{d_done.get(), epoch, spec.own_offsets ? nullptr : d_ctas.get()};
    STATUS_OK(lookup_zones(d_runs.get(), R, G, d, scale, d_q.get(), out, with_scores ? d_scores.get() : nullptr,
                           max_clusters, nullptr, mark));
  }
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaGetLastError());
  {
    std::vector<unsigned long long> done;
    std::vector<unsigned int> ctas;
    CUDA_OK(d_done.download(&done));
    CUDA_OK(d_ctas.download(&ctas));
    EXPECT_EQ(done[0], 2u) << "the step's end was not reported";
    EXPECT_EQ(ctas[0], 0u) << "the CTA counter was not reset for the next launch";
  }

  LookupOutputs got;
  CUDA_OK(d_ret_ids.download(&got.ret_ids));
  CUDA_OK(d_ret_pos.download(&got.ret_pos));
  CUDA_OK(d_est_ids.download(&got.est_ids));
  CUDA_OK(d_run_tokens.download(&got.run_tokens));
  CUDA_OK(d_est_out.download(&got.est_out));
  CUDA_OK(d_est_lse.download(&got.est_lse));
  CUDA_OK(d_logits.download(&got.logits));
  CUDA_OK(d_scores.download(&got.scores));
  CUDA_OK(d_offsets.download(&got.offsets));
  CUDA_OK(d_zones.download(&got.zones));

  // 3. Against the CPU, run by run.
  int64_t total_tokens = 0;
  for (uint32_t r = 0; r < R; ++r) {
    SCOPED_TRACE("run " + std::to_string(r) + " of " + std::to_string(R) + ", clusters " +
                 std::to_string(hr[r].C) + ", n_ret " + std::to_string(hr[r].n_ret) + ", n_one " +
                 std::to_string(hr[r].n_one) + ", n_est " + std::to_string(hr[r].n_est));
    const HostRun &h = hr[r];
    const uint32_t C = h.C;
    const float *qr = q.data() + static_cast<size_t>(r) * G * d;
    const float *cent = centroid.data() + h.meta_off;
    const float *sp = spread.data() + h.size_off;
    std::vector<float> logits(static_cast<size_t>(G) * C), score(C);
    if (C > 0) score_clusters(qr, G, cent, C, d, scale, logits.data(), score.data(), spec.spread ? sp : nullptr);

    // Logits to 1e-4 of the magnitude of their terms.
    const float *gl = got.logits.data() + h.scratch_off;
    for (uint32_t g = 0; g < G; ++g)
      for (uint32_t c = 0; c < C; ++c) {
        double mag = 0.0, q2 = 0.0;
        for (uint32_t i = 0; i < d; ++i) mag += std::fabs(double(qr[g * d + i]) * cent[size_t(c) * d + i]);
        for (uint32_t i = 0; i < d; ++i) q2 += double(qr[g * d + i]) * qr[g * d + i];
        mag *= scale;
        if (spec.spread) mag += 0.5 * scale * scale * q2 / d * sp[c];
        const float want = logits[size_t(g) * C + c], have = gl[size_t(g) * C + c];
        ASSERT_LE(std::fabs(double(have) - want), 1e-4 * std::max(mag, 1e-3))
            << "logit g=" << g << " c=" << c << " gpu " << have << " cpu " << want;
      }

    // Zones: exactly select_zones (select_zones_split with clusters of one
    // ranked apart) over the GPU's own scores.
    const uint32_t *sz = sizes.data() + h.size_off;
    std::vector<uint32_t> want_ret(h.n_ret), want_est(h.n_est), scratch(4 * std::max(C, 1u));
    if (with_scores) {
      const float *gs = got.scores.data() + h.scratch_off / G;
      for (uint32_t c = 0; c < C; ++c)
        ASSERT_NEAR(gs[c], score[c], 1e-4 * std::max(1.f, score[c])) << "score c=" << c;
      if (C > 0 && h.n_one > 0)
        select_zones_split(gs, sz, C, h.n_ret - h.n_one, h.n_one, h.n_est, want_ret.data(), want_est.data(),
                           scratch.data());
      else if (C > 0)
        select_zones(gs, C, h.n_ret, h.n_est, want_ret.data(), want_est.data(), scratch.data());
      for (uint32_t i = 0; i < h.n_ret; ++i)
        ASSERT_EQ(got.ret_ids[h.ret_off + i], want_ret[i]) << "ret_ids[" << i << "]";
      for (uint32_t i = 0; i < h.n_est; ++i)
        ASSERT_EQ(got.est_ids[h.est_off + i], want_est[i]) << "est_ids[" << i << "]";
      if (C > 0 && h.n_one > 0 && h.n_est > 0) {
        // Which of the selection's ways the run took: one round where every
        // retrieval cluster scores strictly above the last of the best
        // n_ret + n_est (NaN ranking as -inf, as the kernel's keys do).
        auto rank = [](float x) { return std::isnan(x) ? -kInf : x; };
        std::vector<float> v(C);
        for (uint32_t c = 0; c < C; ++c) v[c] = rank(gs[c]);
        const uint32_t n_sel = h.n_ret + h.n_est;
        std::nth_element(v.begin(), v.begin() + (n_sel - 1), v.end(), std::greater<float>());
        float lowest = kInf;
        for (uint32_t id : want_ret) lowest = std::min(lowest, rank(gs[id]));
        ++(lowest > v[n_sel - 1] ? got.ones_within : got.ones_outside);
      }
    } else {
      // Without the scores the ids are checked by the caller against a run
      // with them; here only their shape.
      want_ret.assign(got.ret_ids.begin() + h.ret_off, got.ret_ids.begin() + h.ret_off + h.n_ret);
      want_est.assign(got.est_ids.begin() + h.est_off, got.est_ids.begin() + h.est_off + h.n_est);
      ASSERT_TRUE(std::is_sorted(want_ret.begin(), want_ret.end()));
      ASSERT_TRUE(std::is_sorted(want_est.begin(), want_est.end()));
      for (uint32_t id : want_ret) ASSERT_LT(id, C);
      for (uint32_t id : want_est) ASSERT_LT(id, C);
    }

    // Every cluster's zone.
    {
      std::vector<uint8_t> want_zone(C, 0);
      for (uint32_t id : want_ret) want_zone[id] = 1;
      for (uint32_t id : want_est) want_zone[id] = 2;
      const uint8_t *gz = got.zones.data() + h.scratch_off / G;
      for (uint32_t c = 0; c < C; ++c) ASSERT_EQ(gz[c], want_zone[c]) << "zone of cluster " << c;
    }

    // ret_pos and run_tokens.
    uint32_t pos = 0;
    for (uint32_t i = 0; i < h.n_ret; ++i) {
      ASSERT_EQ(got.ret_pos[h.ret_off + i], pos) << "ret_pos[" << i << "]";
      pos += sz[want_ret[i]];
    }
    ASSERT_EQ(got.run_tokens[r], h.sink + h.tail + pos);
    ASSERT_EQ(got.offsets[r], total_tokens);
    total_tokens += got.run_tokens[r];

    // The estimate per head, from the CPU logits.
    const float *vs = value_sum.data() + h.meta_off;
    for (uint32_t g = 0; g < G; ++g) {
      std::vector<float> est(d), tail_scratch(std::max(C, 1u));
      float lse = estimate_zone(logits.data() + size_t(g) * C, want_est.data(), h.n_est, vs, sz, d, est.data());
      if (spec.tail)
        estimate_tail(logits.data() + size_t(g) * C, 1, C, C, want_ret.data(), h.n_ret, want_est.data(), h.n_est, sz,
                      value_mean.data() + size_t(r) * d, d, est.data(), &lse, tail_scratch.data());
      const float *ge = got.est_out.data() + (size_t(r) * G + g) * d;
      const float gl_lse = got.est_lse[size_t(r) * G + g];
      if (lse == -kInf) {
        ASSERT_EQ(gl_lse, -kInf) << "est_lse g=" << g;
        for (uint32_t i = 0; i < d; ++i) ASSERT_EQ(ge[i], 0.f) << "est_out g=" << g << " i=" << i;
      } else {
        ASSERT_NEAR(gl_lse, lse, 1e-4 * std::max(1.f, std::fabs(lse))) << "est_lse g=" << g;
        ASSERT_LE(rel_l2(ge, est.data(), d), 1e-4) << "est_out g=" << g;
      }
    }
  }
  ASSERT_EQ(got.offsets[R], total_tokens);
  if (keep) *keep = std::move(got);
}

std::vector<uint32_t> mixed_clusters(uint64_t seed, uint32_t n_random) {
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> c = {0, 1, 2, 17, 64, 65, 3000, 0};
  std::uniform_int_distribution<uint32_t> pick(1, 3000);
  for (uint32_t i = 0; i < n_random; ++i) c.push_back(pick(rng));
  std::shuffle(c.begin(), c.end(), rng);
  return c;
}

TEST(LookupZones, MatchesCpuForEveryHeadDimAndGroup) {
  REQUIRE_GPU();
  uint64_t seed = 100;
  for (uint32_t di = 0; di < std::size(kDims); ++di)
    for (uint32_t gi = 0; gi < 5; ++gi) {
      const uint32_t d = kDims[di], G = std::array<uint32_t, 5>{1, 3, 4, 8, 16}[gi];
      ++seed;  // a case's seed whichever cases run
      if (!sanitized_case(di, gi, 5)) continue;
      SCOPED_TRACE("d=" + std::to_string(d) + " G=" + std::to_string(G));
      LookupSpec spec;
      spec.d = d;
      spec.G = G;
      spec.seed = seed;
      spec.clusters = mixed_clusters(seed, 5);
      spec.zones = seed % 2 ? Zones::kRandom : Zones::kEngineRule;
      check_lookup(spec, true);
      if (HasFatalFailure()) return;
    }
}

TEST(LookupZones, TheRefinementsMatchCpu) {
  REQUIRE_GPU();
  uint64_t seed = 500;
  for (uint32_t di = 0; di < 3; ++di)
    for (uint32_t m = 1; m < 8; ++m) {
      ++seed;
      if (!sanitized_case(di, m, 3)) continue;  // each m once, at one of the dims
      LookupSpec spec;
      spec.d = std::array<uint32_t, 3>{64, 128, 256}[di];
      spec.G = m % 2 ? 4 : 1;
      spec.spread = m & 1;
      spec.ones = m & 2;
      spec.tail = m & 4;
      spec.seed = seed;
      spec.clusters = mixed_clusters(seed, 4);
      SCOPED_TRACE("d=" + std::to_string(spec.d) + " spread " + std::to_string(spec.spread) + " ones " +
                   std::to_string(spec.ones) + " tail " + std::to_string(spec.tail));
      for (Zones z : {Zones::kEngineRule, Zones::kRandom}) {
        if (!sanitized_case(m, z == Zones::kRandom, 2)) continue;
        spec.zones = z;
        check_lookup(spec, true);
        if (HasFatalFailure()) return;
      }
    }
}

// With clusters of one ranked apart, the estimation zone is the best n_est
// of what the retrieval zone leaves: S less the retrieval zone where that
// scores above S's last member (S the best n_ret + n_est of all; one round
// of selection), else a second round. Both ways, over runs split across
// clusters of CTAs (the refinements' tests above hold runs of one CTA and
// runs past shared memory).
TEST(LookupZones, TheEstimationZoneMatchesCpuWhereverTheOnesRank) {
  REQUIRE_GPU();
  uint64_t seed = 1700;
  uint32_t within = 0, outside = 0;
  for (bool low : {false, true})
    for (Zones z : {Zones::kEngineRule, Zones::kRandom}) {
      ++seed;
      if (!sanitized_case(low, z == Zones::kRandom, 2)) continue;
      LookupSpec spec;
      spec.d = 128;
      spec.G = 4;
      spec.seed = seed;
      spec.ones = spec.tail = spec.spread = true;
      spec.ones_low = low;
      spec.zones = z;
      // Under racecheck a tenth of the clusters (the largest run still
      // splits its selection, over 2 CTAs instead of 8): racecheck tracks
      // every shared-memory access of the logits and the select.
      spec.clusters = under_racecheck() ? std::vector<uint32_t>{4100, 300, 9, 2000, 1, 70}
                                        : std::vector<uint32_t>{40000, 3000, 9, 20000, 1, 700};
      SCOPED_TRACE(std::string(low ? "ones score low" : "ones score as the rest") +
                   (z == Zones::kRandom ? ", random zones" : ", the engine's zones"));
      LookupOutputs got;
      check_lookup(spec, true, &got);
      if (HasFatalFailure()) return;
      within += got.ones_within;
      outside += got.ones_outside;
    }
  EXPECT_GT(within, 0u);
  EXPECT_GT(outside, 0u);
}

TEST(LookupZones, TheRefinementsSelectThroughTheGlobalScratch) {
  REQUIRE_GPU();
  LookupSpec spec;
  spec.d = 128;
  spec.G = 4;
  spec.seed = 9;
  spec.spread = spec.ones = spec.tail = true;
  spec.zones = Zones::kRandom;
  // 140000 clusters: slices of 17500 even split over 8 CTAs.
  spec.clusters = {kLookupSmemClusters + 1, 40000, 100, 140000};
  check_lookup(spec, true);
}

// The logits read the centroids' f16 copy, and the estimate the value
// sums', where a run has them and their overflow word is clear, the f32
// arrays where it is set (the other arrays are poisoned in each case:
// reading them would fail every logit and every estimate).
TEST(LookupZones, TheF16MetaCopiesAreReadUnlessFlagged) {
  REQUIRE_GPU();
  using M = LookupSpec::Meta16;
  auto name = [](M m) { return m == LookupSpec::kNarrow ? std::string("f16 copy") : std::string("flagged"); };
  uint64_t seed = 1300;
  uint32_t next = 0;
  for (uint32_t d : kDims)
    for (auto [centroids, values] : {std::pair{LookupSpec::kNarrow, LookupSpec::kNarrow},
                                     std::pair{LookupSpec::kOverflowed, LookupSpec::kOverflowed},
                                     std::pair{LookupSpec::kNarrow, LookupSpec::kOverflowed},
                                     std::pair{LookupSpec::kOverflowed, LookupSpec::kNarrow}}) {
      const uint32_t ci = next++;  // the case's number: dim ci / 4, pair ci % 4
      if (!sanitized_case(ci / 4, ci % 4, 4)) {
        ++seed;
        continue;
      }
      SCOPED_TRACE("d=" + std::to_string(d) + ", centroids " + name(centroids) + ", value sums " + name(values));
      LookupSpec spec;
      spec.d = d;
      spec.G = 4;
      spec.seed = ++seed;
      spec.spread = spec.ones = spec.tail = seed % 2;
      spec.meta16 = centroids;
      spec.meta16_values = values;
      spec.clusters = mixed_clusters(seed, 3);
      check_lookup(spec, true);
      if (HasFatalFailure()) return;
    }
}

// The logits read the centroids' 8-bit copy and the estimate the value
// sums' where a run has them and their overflow words are clear, before the
// f16 copies; where they are set, the f16 copies (or the f32 arrays where
// those are flagged too, or absent). The arrays not to be read are poisoned
// in each case.
TEST(LookupZones, TheEightBitMetaCopiesAreReadUnlessFlagged) {
  REQUIRE_GPU();
  using M = LookupSpec::Meta16;
  auto name = [](M m) { return m == LookupSpec::kNarrow ? std::string("copy") : std::string("flagged"); };
  uint64_t seed = 1400;
  uint32_t ci = 0;  // the case's number: dim ci / 4 (of those that hold 8-bit rows), pair ci % 4
  for (uint32_t d : kDims) {
    if (d % 32 != 0) continue;  // the engine keeps f16 rows there
    for (auto [rows8, rows16] : {std::pair{LookupSpec::kNarrow, LookupSpec::kOverflowed},
                                 std::pair{LookupSpec::kNarrow, LookupSpec::kF32Only},
                                 std::pair{LookupSpec::kOverflowed, LookupSpec::kNarrow},
                                 std::pair{LookupSpec::kOverflowed, LookupSpec::kOverflowed}}) {
      const uint32_t c = ci++;
      if (!sanitized_case(c / 4, c % 4, 4)) {
        ++seed;
        continue;
      }
      LookupSpec spec;
      spec.d = d;
      spec.G = std::array<uint32_t, 4>{4, 1, 5, 8}[seed % 4];  // passes over the query heads, a last one part-full
      SCOPED_TRACE("d=" + std::to_string(d) + ", G=" + std::to_string(spec.G) + ", 8-bit rows " + name(rows8) +
                   ", f16 rows " + (rows16 == LookupSpec::kF32Only ? std::string("none") : name(rows16)));
      spec.seed = ++seed;
      spec.spread = spec.ones = spec.tail = seed % 2;
      spec.meta8 = rows8;
      spec.meta16 = rows16;
      spec.meta8_values = rows8;
      spec.meta16_values = rows16;
      spec.clusters = mixed_clusters(seed, 3);
      check_lookup(spec, true);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(LookupZones, SmallRunsMatchCpu) {
  REQUIRE_GPU();
  for (Zones z : {Zones::kEngineRule, Zones::kRandom}) {
    LookupSpec spec;
    spec.d = 64;
    spec.G = 4;
    spec.seed = 7 + static_cast<int>(z);
    spec.clusters = {3, 0, 150, 40, 1};
    spec.zones = z;
    check_lookup(spec, true);
    if (HasFatalFailure()) return;
  }
}

TEST(LookupZones, EqualScoresBreakTiesToTheLowerId) {
  REQUIRE_GPU();
  for (uint32_t G : {1u, 4u}) {
    LookupSpec spec;
    spec.d = 96;
    spec.G = G;
    spec.seed = 31 + G;
    spec.ties = true;
    spec.zones = Zones::kRandom;
    spec.clusters = {5, 300, 2999, 64, 1000, 77, 1, 4096};
    check_lookup(spec, true);
    if (HasFatalFailure()) return;
  }
}

TEST(LookupZones, LargeRunsSelectThroughTheGlobalScratch) {
  REQUIRE_GPU();
  LookupSpec spec;
  spec.d = 128;
  spec.G = 4;
  spec.seed = 5;
  spec.zones = Zones::kRandom;
  // Split over clusters of CTAs, only the slices of 140000 (17500 each)
  // are past the shared memory's room.
  spec.clusters = {kLookupSmemClusters + 1, 65536, 100, 40000, kLookupSmemClusters, 140000};
  if (under_racecheck()) {
    // An eighth of the clusters: runs enough that the select takes one CTA
    // a run (two CTAs a run for each of 80 runs would pass any device's
    // multiprocessors), so that the run of kLookupSmemClusters + 1 selects
    // through the global scratch alone (the split form's global scratch is
    // TheRefinementsSelectThroughTheGlobalScratch's).
    spec.clusters = {kLookupSmemClusters + 1, 100, kLookupSmemClusters};
    for (uint32_t r = 0; spec.clusters.size() < 80; ++r) spec.clusters.push_back((r * 37) % 50);
  }
  check_lookup(spec, true);
}

// A large run splits every run's selection over a cluster of CTAs (on
// sm_90): of 8 CTAs with 7 runs and with 12 (slices of 5000 clusters) on a
// device of 96 multiprocessors or more; small runs leave CTAs with empty
// slices, ties cross slices, clusters of one are ranked apart across them.
TEST(LookupZones, RunsSplitOverAClusterOfCtasMatchCpu) {
  REQUIRE_GPU();
  uint64_t seed = 900;
  for (int m = 0; m < 8; ++m) {
    ++seed;
    // Under racecheck: m = 1, 2, 4, 7 (with and without ties and
    // refinements, both run sets, both groups), one zone rule each.
    if (under_racecheck() && m != 1 && m != 2 && m != 4 && m != 7) continue;
    LookupSpec spec;
    spec.d = 128;
    spec.G = m % 4 < 2 ? 4 : 8;
    spec.seed = seed;
    spec.ties = m & 1;
    spec.ones = spec.tail = spec.spread = m & 2;
    if (m < 4)
      spec.clusters = {40000, 0, 1, 7, 3000, 9, 20000};
    else
      spec.clusters = {40000, 5, 20000, 1, 0, 3000, 17000, 9, 40000, 2, 8000, 100};
    // Under racecheck a tenth of the clusters in the runs of 100 or more:
    // the runs of 4100 still split the selection, over 2 CTAs instead of 8
    // or 4 (racecheck tracks every shared-memory access of the logits and
    // the select).
    if (under_racecheck())
      for (uint32_t &c : spec.clusters) c = c >= 40000 ? 4100 : c >= 100 ? c / 10 : c;
    SCOPED_TRACE("runs " + std::to_string(spec.clusters.size()) + " ties " + std::to_string(spec.ties) +
                 " refinements " + std::to_string(spec.ones));
    for (Zones z : {Zones::kEngineRule, Zones::kRandom}) {
      if (!sanitized_case(m, z == Zones::kRandom, 2)) continue;
      spec.zones = z;
      check_lookup(spec, true);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(LookupZones, IsDeterministicAndNeedsNoScoresForSmallRuns) {
  REQUIRE_GPU();
  LookupSpec spec;
  spec.d = 80;
  spec.G = 8;
  spec.seed = 77;
  spec.zones = Zones::kRandom;
  spec.clusters = mixed_clusters(77, 6);
  LookupOutputs a, b;
  check_lookup(spec, true, &a);
  if (HasFatalFailure()) return;
  check_lookup(spec, false, &b);
  if (HasFatalFailure()) return;
  EXPECT_EQ(a.ret_ids, b.ret_ids);
  EXPECT_EQ(a.est_ids, b.est_ids);
  EXPECT_EQ(a.ret_pos, b.ret_pos);
  EXPECT_EQ(a.offsets, b.offsets);
  ASSERT_EQ(a.est_out.size(), b.est_out.size());
  EXPECT_EQ(0, std::memcmp(a.est_out.data(), b.est_out.data(), a.est_out.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.logits.data(), b.logits.data(), a.logits.size() * sizeof(float)));
}

// The engine's lookup lays out the offsets in the estimate's last CTA; a
// caller without a CTA counter gets them from a kernel of their own. Both
// are checked against the CPU, and agree to the byte.
TEST(LookupZones, TheEstimatesLastCtaLaysOutTheOffsetsAsTheirOwnKernelDoes) {
  REQUIRE_GPU();
  LookupSpec spec;
  spec.G = 4;
  spec.seed = 91;
  spec.tail = true;
  spec.clusters = mixed_clusters(91, 9);
  LookupOutputs a, b;
  check_lookup(spec, true, &a);
  if (HasFatalFailure()) return;
  spec.own_offsets = true;
  check_lookup(spec, true, &b);
  if (HasFatalFailure()) return;
  EXPECT_EQ(a.offsets, b.offsets);
  EXPECT_EQ(a.run_tokens, b.run_tokens);
  ASSERT_EQ(a.est_out.size(), b.est_out.size());
  EXPECT_EQ(0, std::memcmp(a.est_out.data(), b.est_out.data(), a.est_out.size() * sizeof(float)));
}

TEST(LookupZones, ZeroRunsWriteOffsetZero) {
  REQUIRE_GPU();
  DevArray<int32_t> offsets;
  CUDA_OK(offsets.alloc(1));
  CUDA_OK(offsets.poison());
  DevLookup out{};
  out.offsets = offsets.get();
  STATUS_OK(lookup_zones(nullptr, 0, 4, 128, 0.1f, reinterpret_cast<const float *>(16), out, nullptr, 0, nullptr));
  std::vector<int32_t> h;
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(offsets.download(&h));
  EXPECT_EQ(h[0], 0);
}

TEST(LookupZones, RejectsBadArguments) {
  REQUIRE_GPU();
  DevLookup out{};
  int32_t dummy = 0;
  out.offsets = &dummy;
  const float *q = reinterpret_cast<const float *>(16);
  EXPECT_EQ(lookup_zones(nullptr, 0, 0, 128, 0.1f, q, out, nullptr, 0, nullptr), cudaErrorNotSupported);
  EXPECT_EQ(lookup_zones(nullptr, 0, 33, 128, 0.1f, q, out, nullptr, 0, nullptr), cudaErrorNotSupported);
  EXPECT_EQ(lookup_zones(nullptr, 0, 4, 72, 0.1f, q, out, nullptr, 0, nullptr), cudaErrorNotSupported);
  EXPECT_EQ(lookup_zones(nullptr, 0, 4, 128, 0.1f, q, out, nullptr, kLookupSmemClusters + 1, nullptr),
            cudaErrorInvalidValue);
}

// Cold pages: with every page out (a null page table), each retrieval
// cluster is marked kColdCluster, counts no member, is estimated and
// reported, and stamped; the estimate then equals that of a lookup whose
// estimation zone takes the retrieval zone's place (the same clusters
// estimated, the same tail), to f32 rounding of another summation order.
// Runs of 2000 and 6000 clusters (the second split over a cluster of CTAs).
TEST(LookupZones, ColdRetrievalClustersAreEstimatedAndReported) {
  REQUIRE_GPU();
  constexpr uint32_t d = 128, G = 4, pt = 8, cap = 1000;
  const uint32_t Cs[] = {2000, 6000};
  const uint32_t R = 2;
  std::mt19937_64 rng(91);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<uint32_t> size_dist(1, 40);
  std::vector<float> centroid, value_sum, value_mean, q(size_t(R) * G * d);
  std::vector<uint32_t> sizes, first;
  std::vector<size_t> meta_off(R), size_off(R), page_off(R);
  size_t pages_total = 0;
  for (uint32_t r = 0; r < R; ++r) {
    meta_off[r] = centroid.size();
    size_off[r] = sizes.size();
    page_off[r] = pages_total;
    std::vector<float> mean(d);
    for (float &x : mean) x = 0.5f * normal(rng);
    uint32_t slot = 0;
    for (uint32_t c = 0; c < Cs[r]; ++c) {
      const uint32_t n = size_dist(rng);
      sizes.push_back(n);
      first.push_back(slot);
      slot += n;
      for (uint32_t i = 0; i < d; ++i) centroid.push_back(mean[i] + normal(rng));
      for (uint32_t i = 0; i < d; ++i) value_sum.push_back(8.f * normal(rng));
    }
    pages_total += (slot + pt - 1) / pt;
    for (uint32_t i = 0; i < d; ++i) value_mean.push_back(normal(rng));
  }
  for (float &x : q) x = normal(rng);
  DevArray<float> d_centroid, d_value_sum, d_value_mean, d_q;
  DevArray<uint32_t> d_sizes, d_first, d_stamps, d_wants;
  DevArray<uint64_t> d_pages;  // all null: every page is out
  CUDA_OK(d_centroid.upload(centroid));
  CUDA_OK(d_value_sum.upload(value_sum));
  CUDA_OK(d_value_mean.upload(value_mean));
  CUDA_OK(d_q.upload(q));
  CUDA_OK(d_sizes.upload(sizes));
  CUDA_OK(d_first.upload(first));
  CUDA_OK(d_pages.upload(std::vector<uint64_t>(pages_total, 0)));
  CUDA_OK(d_stamps.upload(std::vector<uint32_t>(sizes.size(), 0)));
  CUDA_OK(d_wants.upload(std::vector<uint32_t>(size_t(R) * (cap + 2), 0)));

  // Two lookups: `cold` with the engine's zones and every page out, `ref`
  // with no retrieval zone and an estimation zone of both zones' size.
  struct Out {
    DevArray<uint32_t> ret_ids, ret_pos, est_ids, run_tokens, est_extra;
    DevArray<float> est_out, est_lse, logits;
    DevArray<int32_t> offsets;
    DevArray<uint8_t> zones;
  } o[2];
  std::vector<uint32_t> n_ret(R), n_est(R);
  for (int k = 0; k < 2; ++k) {
    const bool cold = k == 0;
    std::vector<DevRun> runs(R);
    uint32_t ret = 0, est = 0, lg = 0;
    for (uint32_t r = 0; r < R; ++r) {
      uint32_t nr = 0, ne = 0;
      zone_rule(Cs[r], &nr, &ne);
      n_ret[r] = nr;
      n_est[r] = ne;
      DevRun &x = runs[r];
      std::memset(&x, 0, sizeof x);
      x.centroid = d_centroid.get() + meta_off[r];
      x.value_sum = d_value_sum.get() + meta_off[r];
      x.value_mean = d_value_mean.get() + size_t(r) * d;
      x.size = d_sizes.get() + size_off[r];
      x.first_slot = d_first.get() + size_off[r];
      x.pages = reinterpret_cast<const uint8_t *const *>(d_pages.get() + page_off[r]);
      x.clusters = Cs[r];
      x.n_ret = cold ? nr : 0;
      x.n_est = cold ? ne : nr + ne;
      x.sink_tokens = 4;
      x.tail_tokens = 16;
      x.ret_off = ret;
      x.est_off = est;
      x.scratch_off = lg;
      if (cold) {
        x.cold_pt = pt;
        x.stamp = 7 + r;
        x.stamps = d_stamps.get() + size_off[r];
        x.wants = d_wants.get() + size_t(r) * (cap + 2);
        x.want_cap = cap;
      }
      ret += x.n_ret;
      est += x.n_est + (cold ? x.n_ret : 0);
      lg += G * Cs[r];
    }
    Out &w = o[k];
    DevArray<DevRun> d_runs;
    CUDA_OK(d_runs.upload(runs));
    CUDA_OK(w.ret_ids.alloc(ret));
    CUDA_OK(w.ret_pos.alloc(ret));
    CUDA_OK(w.est_ids.alloc(est));
    CUDA_OK(w.run_tokens.alloc(R));
    CUDA_OK(w.est_extra.alloc(R));
    CUDA_OK(w.est_out.alloc(size_t(R) * G * d));
    CUDA_OK(w.est_lse.alloc(size_t(R) * G));
    CUDA_OK(w.logits.alloc(size_t(lg) * 2));
    CUDA_OK(w.offsets.alloc(R + 1));
    CUDA_OK(w.zones.alloc(lg / G));
    for (auto *a : {&w.ret_ids, &w.ret_pos, &w.est_ids, &w.run_tokens, &w.est_extra}) CUDA_OK(a->poison());
    for (auto *a : {&w.est_out, &w.est_lse}) CUDA_OK(a->poison());
    DevLookup out{};
    out.ret_ids = w.ret_ids.get();
    out.ret_pos = w.ret_pos.get();
    out.est_ids = w.est_ids.get();
    out.run_tokens = w.run_tokens.get();
    out.est_out = w.est_out.get();
    out.est_lse = w.est_lse.get();
    out.offsets = w.offsets.get();
    out.logits = w.logits.get();
    out.zones = w.zones.get();
    out.est_extra = cold ? w.est_extra.get() : nullptr;
    STATUS_OK(lookup_zones(d_runs.get(), R, G, d, 1.f / std::sqrt(float(d)), d_q.get(), out,
                           w.logits.get() + lg, 6000, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
  }
  std::vector<uint32_t> ret_ids, ret_pos, est_ids, run_tokens, extra, ref_est, stamps, wants;
  std::vector<float> est_out, ref_out, est_lse, ref_lse;
  CUDA_OK(o[0].ret_ids.download(&ret_ids));
  CUDA_OK(o[0].ret_pos.download(&ret_pos));
  CUDA_OK(o[0].est_ids.download(&est_ids));
  CUDA_OK(o[0].run_tokens.download(&run_tokens));
  CUDA_OK(o[0].est_extra.download(&extra));
  CUDA_OK(o[0].est_out.download(&est_out));
  CUDA_OK(o[0].est_lse.download(&est_lse));
  CUDA_OK(o[1].est_ids.download(&ref_est));
  CUDA_OK(o[1].est_out.download(&ref_out));
  CUDA_OK(o[1].est_lse.download(&ref_lse));
  CUDA_OK(d_stamps.download(&stamps));
  CUDA_OK(d_wants.download(&wants));
  uint32_t ret_at = 0, est_at = 0, ref_at = 0;
  for (uint32_t r = 0; r < R; ++r) {
    SCOPED_TRACE("run " + std::to_string(r));
    const uint32_t nr = n_ret[r], ne = n_est[r];
    ASSERT_GT(nr, 0u);
    EXPECT_EQ(run_tokens[r], 20u) << "a cold cluster counts no member";
    EXPECT_EQ(extra[r], nr);
    std::vector<uint32_t> cold_ids;
    for (uint32_t i = 0; i < nr; ++i) {
      const uint32_t e = ret_ids[ret_at + i];
      ASSERT_NE(e & kColdCluster, 0u) << "ret_ids[" << i << "]";
      EXPECT_EQ(ret_pos[ret_at + i], 0u);
      cold_ids.push_back(e & ~kColdCluster);
      EXPECT_EQ(stamps[size_off[r] + (e & ~kColdCluster)], 7 + r) << "stamped";
    }
    // Estimated: the estimation zone, then the cold clusters in id order.
    std::vector<uint32_t> mine(est_ids.begin() + est_at, est_ids.begin() + est_at + ne + nr);
    EXPECT_TRUE(std::equal(cold_ids.begin(), cold_ids.end(), mine.begin() + ne));
    std::sort(mine.begin(), mine.end());
    const std::vector<uint32_t> want(ref_est.begin() + ref_at, ref_est.begin() + ref_at + ne + nr);
    EXPECT_EQ(mine, want) << "the same clusters estimated";
    // The report: the count, the ids, the stamp.
    const uint32_t *w = wants.data() + size_t(r) * (cap + 2);
    EXPECT_EQ(w[0], 7 + r);
    EXPECT_EQ(w[1], nr);
    std::vector<uint32_t> reported(w + 2, w + 2 + std::min(nr, cap));
    std::sort(reported.begin(), reported.end());
    EXPECT_TRUE(std::equal(reported.begin(), reported.end(), cold_ids.begin()));
    for (uint32_t g = 0; g < G; ++g) {
      const size_t rh = size_t(r) * G + g;
      EXPECT_NEAR(est_lse[rh], ref_lse[rh], 1e-4f * std::max(1.f, std::fabs(ref_lse[rh])));
      for (uint32_t i = 0; i < d; ++i)
        ASSERT_NEAR(est_out[rh * d + i], ref_out[rh * d + i], 1e-4f * std::max(1.f, std::fabs(ref_out[rh * d + i])))
            << "head " << g << " dim " << i;
    }
    ret_at += nr;
    est_at += ne + nr;
    ref_at += ne + nr;
  }
}

// Attention -------------------------------------------------------------------

struct AttendSpec {
  DType t = DType::kF16;
  uint32_t d = 128, G = 4, H = 1;
  std::vector<uint32_t> tokens;  // per run, r = s * H + h
  float q_mult = 1.f;            // 30 gives extreme logits
  float k_mult = 1.f;
  bool with_est = true, with_lse = true;
  uint64_t seed = 1;
  uint32_t bound = 0;  // max_tokens as passed (0: the longest run), as a host bound may be
};

void check_attend(const AttendSpec &spec) {
  const uint32_t d = spec.d, G = spec.G, H = spec.H, R = static_cast<uint32_t>(spec.tokens.size());
  ASSERT_EQ(R % H, 0u);
  const uint32_t n_seqs = R / H, nq = H * G;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const size_t esz = dtype_bytes(spec.t);
  Uniform uni(spec.seed);

  std::vector<int32_t> offsets(R + 1, 0);
  uint32_t max_tokens = 0;
  for (uint32_t r = 0; r < R; ++r) {
    offsets[r + 1] = offsets[r] + static_cast<int32_t>(spec.tokens[r]);
    max_tokens = std::max(max_tokens, spec.tokens[r]);
  }
  if (spec.bound) max_tokens = spec.bound;
  const size_t total = static_cast<size_t>(offsets[R]);
  std::vector<float> kf(total * d), vf(total * d);
  for (float &x : kf) x = uni() * spec.k_mult;
  for (float &x : vf) x = uni();
  std::vector<uint8_t> kb(kf.size() * esz), vb(vf.size() * esz);
  from_float(spec.t, kf.data(), kb.data(), kf.size());
  from_float(spec.t, vf.data(), vb.data(), vf.size());
  std::vector<float>().swap(kf);
  std::vector<float>().swap(vf);
  std::vector<float> q(static_cast<size_t>(R) * G * d);
  for (float &x : q) x = uni() * spec.q_mult;
  std::vector<float> est_out(static_cast<size_t>(R) * G * d), est_lse(static_cast<size_t>(R) * G);
  for (float &x : est_out) x = uni();
  for (size_t i = 0; i < est_lse.size(); ++i)
    est_lse[i] = i % 3 == 0 ? -kInf : 4.f * uni() + 2.f + (spec.q_mult > 1.f ? 60.f * uni() : 0.f);

  // Strided output with gaps: head_stride and seq_stride leave elements no
  // head owns, which must stay poisoned.
  const int64_t head_stride = d + 8, seq_stride = static_cast<int64_t>(nq) * head_stride + 24;
  const size_t out_elems = static_cast<size_t>(n_seqs) * seq_stride;

  DevArray<uint8_t> d_k, d_v, d_out;
  DevArray<float> d_q, d_est_out, d_est_lse, d_lse, d_scratch;
  DevArray<int32_t> d_offsets;
  CUDA_OK(d_k.upload(kb));
  CUDA_OK(d_v.upload(vb));
  CUDA_OK(d_q.upload(q));
  CUDA_OK(d_est_out.upload(est_out));
  CUDA_OK(d_est_lse.upload(est_lse));
  CUDA_OK(d_offsets.upload(offsets));
  CUDA_OK(d_out.alloc(out_elems * esz));
  CUDA_OK(d_lse.alloc(static_cast<size_t>(n_seqs) * nq));
  const size_t scratch_floats = attend_ragged_scratch_floats(R, G, d, max_tokens);
  CUDA_OK(d_scratch.alloc(scratch_floats));
  CUDA_OK(d_out.poison());
  CUDA_OK(d_lse.poison());
  CUDA_OK(d_scratch.poison());

  STATUS_OK(attend_ragged(spec.t, d_offsets.get(), d_k.get(), d_v.get(), d_q.get(), R, H, G, d, scale, max_tokens,
                          spec.with_est ? d_est_out.get() : nullptr, spec.with_est ? d_est_lse.get() : nullptr,
                          d_out.get(), seq_stride, head_stride, spec.with_lse ? d_lse.get() : nullptr,
                          d_scratch.get(), scratch_floats, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaGetLastError());
  std::vector<uint8_t> out_b;
  std::vector<float> lse_got;
  CUDA_OK(d_out.download(&out_b));
  CUDA_OK(d_lse.download(&lse_got));
  std::vector<float> out_f(out_elems);
  to_float(spec.t, out_b.data(), out_f.data(), out_elems);
  std::vector<char> owned(out_elems, 0);

  const double tol = spec.t == DType::kF32 ? 1e-4 : 1e-2;
  std::vector<float> o(static_cast<size_t>(G) * d), l(G);
  for (uint32_t r = 0; r < R; ++r) {
    SCOPED_TRACE("run " + std::to_string(r) + " with " + std::to_string(spec.tokens[r]) + " tokens");
    const uint32_t s = r / H, h = r % H, n = spec.tokens[r];
    attend_exact(spec.t, q.data() + static_cast<size_t>(r) * G * d, G, kb.data() + size_t(offsets[r]) * d * esz,
                 vb.data() + size_t(offsets[r]) * d * esz, n, d, scale, o.data(), l.data());
    for (uint32_t g = 0; g < G; ++g) {
      float *og = o.data() + static_cast<size_t>(g) * d;
      const float no_est = -kInf;
      const float lse_want = spec.with_est
                                 ? merge_partials(og, l[g], est_out.data() + (size_t(r) * G + g) * d,
                                                  est_lse[size_t(r) * G + g], d, og)
                                 : merge_partials(og, l[g], og, no_est, d, og);
      const size_t at = static_cast<size_t>(s) * seq_stride + static_cast<size_t>(h * G + g) * head_stride;
      for (uint32_t i = 0; i < d; ++i) {
        owned[at + i] = 1;
        ASSERT_TRUE(std::isfinite(out_f[at + i])) << "out g=" << g << " i=" << i << " = " << out_f[at + i];
      }
      if (std::sqrt(std::inner_product(og, og + d, og, 0.0)) == 0.0) {
        for (uint32_t i = 0; i < d; ++i) ASSERT_EQ(out_f[at + i], 0.f) << "g=" << g << " i=" << i;
      } else {
        ASSERT_LE(rel_l2(out_f.data() + at, og, d), tol) << "out g=" << g;
      }
      if (spec.with_lse) {
        const float lg = lse_got[static_cast<size_t>(s) * nq + h * G + g];
        if (lse_want == -kInf) {
          ASSERT_EQ(lg, -kInf) << "lse g=" << g;
        } else {
          ASSERT_TRUE(std::isfinite(lg)) << "lse g=" << g << " = " << lg;
          ASSERT_NEAR(lg, lse_want, 1e-4 * std::max(1.f, std::fabs(lse_want))) << "lse g=" << g;
        }
      }
    }
  }
  // Elements no head owns are untouched (still all bits set).
  for (size_t i = 0; i < out_elems; ++i) {
    if (owned[i]) continue;
    for (size_t b = 0; b < esz; ++b) ASSERT_EQ(out_b[i * esz + b], 0xff) << "gap element " << i << " written";
  }
}

TEST(AttendRagged, MatchesCpuForEveryTypeHeadDimAndGroup) {
  REQUIRE_GPU();
  uint64_t seed = 1000;
  for (uint32_t ti = 0; ti < std::size(kTypes); ++ti)
    for (uint32_t di = 0; di < std::size(kDims); ++di)
      for (uint32_t gi = 0; gi < 3; ++gi) {
        const DType t = kTypes[ti];
        const uint32_t d = kDims[di], G = std::array<uint32_t, 3>{1, 4, 8}[gi];
        ++seed;
        if (!sanitized_case(di, 3 * ti + gi, 5)) continue;  // each (type, group) once, every dim among them
        SCOPED_TRACE(std::string(dtype_name(t)) + " d=" + std::to_string(d) + " G=" + std::to_string(G));
        AttendSpec spec;
        spec.t = t;
        spec.d = d;
        spec.G = G;
        spec.seed = seed;
        if (G == 4) {
          spec.H = 5;  // one sequence of five KV heads
          spec.tokens = {1000, 0, 70000, 1, 17};
        } else {
          spec.H = 1;  // five sequences of one KV head
          spec.tokens = {0, 1, 17, 1000, 70000};
        }
        check_attend(spec);
        if (HasFatalFailure()) return;
      }
}

// The engine's bound on a run's tokens (the retrieval at its largest
// clusters) is often many times the run's real length, and may be short of
// it for a caller's own buffer: each run is split by its real length, so
// either way every token is attended once.
TEST(AttendRagged, RunsAreSplitByTheirRealLengthNotTheBound) {
  REQUIRE_GPU();
  uint64_t seed = 2500;
  for (uint32_t bound : {40000u, 100u, 1u})
    for (uint32_t G : {1u, 4u}) {
      SCOPED_TRACE("bound " + std::to_string(bound) + " G=" + std::to_string(G));
      AttendSpec spec;
      spec.t = DType::kBF16;
      spec.G = G;
      spec.H = 2;
      spec.seed = ++seed;
      spec.tokens = {2000, 1500, 3000, 0, 64, 5000};
      spec.bound = bound;
      check_attend(spec);
      if (HasFatalFailure()) return;
    }
}

TEST(AttendRagged, ShortRunsMatchCpu) {
  REQUIRE_GPU();
  uint64_t seed = 2000;
  for (DType t : kTypes)
    for (uint32_t d : {64u, 80u, 256u})
      for (uint32_t G : {1u, 2u, 8u}) {
        SCOPED_TRACE(std::string(dtype_name(t)) + " d=" + std::to_string(d) + " G=" + std::to_string(G));
        AttendSpec spec;
        spec.t = t;
        spec.d = d;
        spec.G = G;
        spec.H = 2;
        spec.seed = ++seed;
        spec.tokens = {0, 1, 17, 100, 3, 0};
        spec.with_lse = G != 2;
        check_attend(spec);
        if (HasFatalFailure()) return;
      }
}

TEST(AttendRagged, LargeAndOddGroupsSplitHeadsOverWarps) {
  REQUIRE_GPU();
  uint64_t seed = 3000;
  for (uint32_t G : {3u, 6u, 12u, 16u, 24u, 32u}) {
    SCOPED_TRACE("G=" + std::to_string(G));
    AttendSpec spec;
    spec.t = G % 2 ? DType::kF32 : DType::kBF16;
    spec.d = G == 12 ? 96 : 128;
    spec.G = G;
    spec.H = 2;
    spec.seed = ++seed;
    spec.tokens = {5, 4000, 0, 301};
    check_attend(spec);
    if (HasFatalFailure()) return;
  }
}

TEST(AttendRagged, ExtremeLogitsStayFinite) {
  REQUIRE_GPU();
  uint64_t seed = 4000;
  for (DType t : kTypes)
    for (uint32_t d : {64u, 128u}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " d=" + std::to_string(d));
      AttendSpec spec;
      spec.t = t;
      spec.d = d;
      spec.G = 8;
      spec.H = 1;
      spec.q_mult = 30.f;
      spec.k_mult = 4.f;
      spec.seed = ++seed;
      spec.tokens = {2000, 1, 0, 9000};
      check_attend(spec);
      if (HasFatalFailure()) return;
    }
}

TEST(AttendRagged, WithoutEstimateIsPlainAttention) {
  REQUIRE_GPU();
  AttendSpec spec;
  spec.t = DType::kF32;
  spec.d = 128;
  spec.G = 4;
  spec.H = 3;
  spec.seed = 5000;
  spec.with_est = false;
  spec.tokens = {0, 10, 700, 20000, 1, 64};
  check_attend(spec);
}

TEST(AttendRagged, RejectsBadArguments) {
  REQUIRE_GPU();
  alignas(16) static float buf[64];
  int32_t *offs = reinterpret_cast<int32_t *>(buf);
  EXPECT_EQ(attend_ragged(DType::kF16, offs, buf, buf, buf, 2, 2, 0, 128, 0.1f, 10, nullptr, nullptr, buf, 0, 0,
                          nullptr, buf, 64, nullptr),
            cudaErrorNotSupported);
  EXPECT_EQ(attend_ragged(DType::kF16, offs, buf, buf, buf, 2, 2, 4, 72, 0.1f, 10, nullptr, nullptr, buf, 0, 0,
                          nullptr, buf, 64, nullptr),
            cudaErrorNotSupported);
  EXPECT_EQ(attend_ragged(DType::kF16, offs, buf, buf, buf, 3, 2, 4, 128, 0.1f, 10, nullptr, nullptr, buf, 0, 0,
                          nullptr, buf, 64, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(attend_ragged(DType::kF16, offs, buf + 1, buf, buf, 2, 2, 4, 128, 0.1f, 10, nullptr, nullptr, buf, 0, 0,
                          nullptr, buf, 64, nullptr),
            cudaErrorInvalidValue);
  // Scratch too small: checked before any launch.
  EXPECT_EQ(attend_ragged(DType::kF16, offs, buf, buf, buf, 2, 2, 4, 128, 0.1f, 10000, nullptr, nullptr, buf, 0, 0,
                          nullptr, buf, 64, nullptr),
            cudaErrorInvalidValue);
}

// merge_estimate ----------------------------------------------------------------

TEST(MergeEstimate, MatchesCpuMergeInPlace) {
  REQUIRE_GPU();
  uint64_t seed = 6000;
  for (uint32_t ti = 0; ti < std::size(kTypes); ++ti)
    for (uint32_t di = 0; di < std::size(kDims); ++di) {
      const DType t = kTypes[ti];
      const uint32_t d = kDims[di];
      if (!sanitized_case(di, ti, static_cast<uint32_t>(std::size(kTypes)))) {
        ++seed;  // the case's seed, as when it runs
        continue;
      }
      SCOPED_TRACE(std::string(dtype_name(t)) + " d=" + std::to_string(d));
      const uint32_t n_seqs = 3, nq = 8;
      const int64_t head_stride = d + 4, seq_stride = nq * head_stride + 12, lse_seq_stride = nq + 3;
      const size_t esz = dtype_bytes(t), out_elems = n_seqs * seq_stride;
      Uniform uni(++seed);
      std::vector<float> out_f(out_elems), est_out(size_t(n_seqs) * nq * d), est_lse(size_t(n_seqs) * nq);
      std::vector<float> lse(size_t(n_seqs) * lse_seq_stride);
      for (float &x : out_f) x = uni();
      for (float &x : est_out) x = uni();
      for (size_t i = 0; i < est_lse.size(); ++i) est_lse[i] = i % 4 == 1 ? -kInf : 5.f * uni();
      for (size_t i = 0; i < lse.size(); ++i) lse[i] = i % 5 == 2 || i % 4 == 1 ? -kInf : 5.f * uni();
      std::vector<uint8_t> out_b(out_elems * esz);
      from_float(t, out_f.data(), out_b.data(), out_elems);
      to_float(t, out_b.data(), out_f.data(), out_elems);  // as the caller's storage holds it

      DevArray<uint8_t> d_out;
      DevArray<float> d_lse, d_est_out, d_est_lse;
      CUDA_OK(d_out.upload(out_b));
      CUDA_OK(d_lse.upload(lse));
      CUDA_OK(d_est_out.upload(est_out));
      CUDA_OK(d_est_lse.upload(est_lse));
      STATUS_OK(merge_estimate(t, d_out.get(), seq_stride, head_stride, d_lse.get(), lse_seq_stride, d_est_out.get(),
                               d_est_lse.get(), n_seqs, nq, d, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<uint8_t> got_b;
      std::vector<float> got_lse;
      CUDA_OK(d_out.download(&got_b));
      CUDA_OK(d_lse.download(&got_lse));
      std::vector<float> got(out_elems);
      to_float(t, got_b.data(), got.data(), out_elems);
      std::vector<char> owned(out_elems, 0);
      for (uint32_t s = 0; s < n_seqs; ++s)
        for (uint32_t h = 0; h < nq; ++h) {
          const size_t at = s * seq_stride + h * head_stride, qh = size_t(s) * nq + h;
          std::vector<float> want(d);
          const float l = merge_partials(out_f.data() + at, lse[s * lse_seq_stride + h], est_out.data() + qh * d,
                                         est_lse[qh], d, want.data());
          for (uint32_t i = 0; i < d; ++i) owned[at + i] = 1;
          const float lg = got_lse[s * lse_seq_stride + h];
          if (l == -kInf) {
            ASSERT_EQ(lg, -kInf);
          } else {
            ASSERT_NEAR(lg, l, 1e-5 * std::max(1.f, std::fabs(l)));
          }
          const double n2 = std::sqrt(std::inner_product(want.begin(), want.end(), want.begin(), 0.0));
          if (n2 == 0.0) {
            for (uint32_t i = 0; i < d; ++i) ASSERT_EQ(got[at + i], 0.f);
          } else {
            ASSERT_LE(rel_l2(got.data() + at, want.data(), d), t == DType::kF32 ? 1e-5 : 1e-2) << "s=" << s << " h=" << h;
          }
        }
      for (size_t i = 0; i < out_elems; ++i) {
        if (owned[i]) continue;
        ASSERT_EQ(0, std::memcmp(&got_b[i * esz], &out_b[i * esz], esz)) << "gap " << i;
      }
      for (uint32_t s = 0; s < n_seqs; ++s)
        for (uint32_t h = nq; h < lse_seq_stride; ++h)
          ASSERT_EQ(0, std::memcmp(&got_lse[s * lse_seq_stride + h], &lse[s * lse_seq_stride + h], 4));
    }
}

}  // namespace
}  // namespace wkv::kernels
