#include "tools/synth.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/dtype.hpp"
#include "tools/exact.hpp"
#include "wavekv/wavekv.h"

namespace wkv_tool {
namespace {

// The generator's constants (see synth.hpp); norms are of d-vectors with
// d = head_dim, logits are q.k / sqrt(d).
constexpr float kTopicAmp = 10.0f;     // A: |topic part| of a key
constexpr float kKeyNoise = 1.0f;      // per-element std of a key's own variation
constexpr float kDocSpread = 0.5f;     // documents of a topic: u + 0.5 r
constexpr float kMeanRatio = 4.0f;     // |mu| / |per-token variation|
constexpr float kQueryMean = 5.0f;      // |qmean|
constexpr float kSinkNoise = 0.3f;
constexpr float kNeedleAmp = 16.0f;    // An
constexpr float kNeedleQueryAmp = 10.0f;  // Bn
constexpr float kQueryNoise = 0.3f;
constexpr double kRopeTheta = 1e4;

// xoshiro256** seeded through splitmix64: fast, and the same stream on
// every platform (std distributions are not).
struct Rng {
  uint64_t s[4];

  static uint64_t splitmix(uint64_t &x) {
    uint64_t z = (x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // A stream per (seed, a, b, c): independent of call order.
  Rng(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
    uint64_t x = seed ^ (a * 0xd1b54a32d192ed03ull) ^ (b * 0xabc98388fb8fac03ull) ^
                 (c * 0x8cb92ba72f3d8dd7ull);
    for (uint64_t &w : s) w = splitmix(x);
  }
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t next() {
    const uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
  }
  double uniform() { return (next() >> 11) * 0x1.0p-53; }  // [0, 1)
  uint64_t below(uint64_t n) { return static_cast<uint64_t>(uniform() * n) % n; }
  // n standard normals (Box-Muller), times `scale`, added to out.
  void add_normal(float *out, size_t n, float scale) {
    for (size_t i = 0; i < n; i += 2) {
      const double u1 = 1.0 - uniform(), u2 = uniform();
      const double r = std::sqrt(-2.0 * std::log(u1)) * scale;
      out[i] += static_cast<float>(r * std::cos(6.283185307179586 * u2));
      if (i + 1 < n) out[i + 1] += static_cast<float>(r * std::sin(6.283185307179586 * u2));
    }
  }
};

void normalise(float *x, uint32_t d, float norm) {
  double s = 0;
  for (uint32_t i = 0; i < d; ++i) s += double(x[i]) * x[i];
  const float f = s > 0 ? static_cast<float>(norm / std::sqrt(s)) : 0.f;
  for (uint32_t i = 0; i < d; ++i) x[i] *= f;
}

// Stream tags of Rng(seed, tag, ...).
enum : uint64_t { kTagHead = 1, kTagDoc = 2, kTagToken = 3, kTagLayout = 4, kTagQuery = 5 };

// Only the x86-64-v3 clone converts in hardware (F16C); the default one
// calls libgcc per element.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(WKV_NO_TARGET_CLONES)
#define WKV_TOOL_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define WKV_TOOL_CLONES
#endif

WKV_TOOL_CLONES
void f32_to_f16(const float *src, uint16_t *dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    wkv::half_t h = static_cast<wkv::half_t>(src[i]);
    std::memcpy(&dst[i], &h, 2);
  }
}

WKV_TOOL_CLONES
void f16_to_f32(const uint16_t *src, float *dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    wkv::half_t h;
    std::memcpy(&h, &src[i], 2);
    dst[i] = static_cast<float>(h);
  }
}

}  // namespace

uint32_t dtype_size(uint32_t dtype) { return dtype == WKV_DTYPE_F32 ? 4 : 2; }

void to_storage(uint32_t dtype, const float *src, void *dst, size_t n) {
  if (dtype == WKV_DTYPE_F32) {
    std::memcpy(dst, src, n * 4);
  } else if (dtype == WKV_DTYPE_F16) {
    f32_to_f16(src, static_cast<uint16_t *>(dst), n);
  } else {
    uint16_t *o = static_cast<uint16_t *>(dst);
    for (size_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, &src[i], 4);
      if ((u & 0x7fffffffu) > 0x7f800000u) {
        o[i] = static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
        continue;
      }
      u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
      o[i] = static_cast<uint16_t>(u >> 16);
    }
  }
}

void from_storage(uint32_t dtype, const void *src, float *dst, size_t n) {
  if (dtype == WKV_DTYPE_F32) {
    std::memcpy(dst, src, n * 4);
  } else if (dtype == WKV_DTYPE_F16) {
    f16_to_f32(static_cast<const uint16_t *>(src), dst, n);
  } else {
    const uint16_t *s = static_cast<const uint16_t *>(src);
    for (size_t i = 0; i < n; ++i) {
      uint32_t u = static_cast<uint32_t>(s[i]) << 16;
      std::memcpy(&dst[i], &u, 4);
    }
  }
}

void set_diffuse(SynthSpec *spec) {
  spec->span_amp = 8.0f;
  spec->sink_amp = 10.0f;
  spec->value_mean = 0.5f;
}

SynthContext::SynthContext(const SynthSpec &spec) : spec_(spec) {
  const uint32_t d = spec_.head_dim, H = spec_.kv_heads;
  inv_freq_.resize(d / 2);
  for (uint32_t i = 0; i < d / 2; ++i) inv_freq_[i] = std::pow(kRopeTheta, -2.0 * i / d);
  { Rng r(spec_.seed, kTagLayout, 0, 0); std::memcpy(layout_rng_, r.s, sizeof r.s); }
  { Rng r(spec_.seed, kTagQuery, 0, 0); std::memcpy(query_rng_, r.s, sizeof r.s); }

  // 1. Per head: the offsets, the topics.
  const float variation = std::sqrt(kTopicAmp * kTopicAmp + kKeyNoise * kKeyNoise * static_cast<float>(d));
  heads_.resize(H);
  for (uint32_t h = 0; h < H; ++h) {
    Head &hd = heads_[h];
    Rng r(spec_.seed, kTagHead, h, 0);
    hd.mu.assign(d, 0.f);
    r.add_normal(hd.mu.data(), d, 1.f);
    normalise(hd.mu.data(), d, kMeanRatio * variation);
    hd.qmean.assign(d, 0.f);
    r.add_normal(hd.qmean.data(), d, 1.f);
    normalise(hd.qmean.data(), d, kQueryMean);
    // Drawn after the rest, so that a zero mean leaves every other draw as it was.
    hd.vmean.assign(d, 0.f);
    if (spec_.value_mean > 0.f) {
      Rng rv(spec_.seed, kTagHead, h, 1);
      rv.add_normal(hd.vmean.data(), d, 1.f);
      normalise(hd.vmean.data(), d, spec_.value_mean * std::sqrt(static_cast<float>(d)));
    }
    hd.topic.assign(static_cast<size_t>(spec_.topics) * d, 0.f);
    for (uint32_t t = 0; t < spec_.topics; ++t) {
      r.add_normal(&hd.topic[static_cast<size_t>(t) * d], d, 1.f);
      normalise(&hd.topic[static_cast<size_t>(t) * d], d, 1.f);
    }
  }
  // 2. Needles: distinct positions per head, away from the sink and from the
  //    end of the prompt (the window).
  Rng lay(spec_.seed, kTagLayout, 1, 0);
  const uint64_t lo = spec_.sinks + 64;
  const uint64_t hi = spec_.prompt_tokens > spec_.needle_guard ? spec_.prompt_tokens - spec_.needle_guard : 0;
  if (hi > lo + spec_.needles) {
    for (uint32_t h = 0; h < H; ++h) {
      for (uint32_t i = 0; i < spec_.needles; ++i) {
        Needle nd;
        nd.head = h;
        for (;;) {
          nd.pos = lo + lay.below(hi - lo);
          bool taken = false;
          for (uint32_t id : heads_[h].needle_ids) taken |= needles_[id].pos == nd.pos;
          if (!taken) break;
        }
        nd.dir.assign(d, 0.f);
        lay.add_normal(nd.dir.data(), d, 1.f);
        normalise(nd.dir.data(), d, 1.f);
        heads_[h].needle_ids.push_back(static_cast<uint32_t>(needles_.size()));
        needles_.push_back(std::move(nd));
      }
    }
  }
  // 3. Storage.
  const size_t elems = static_cast<size_t>(H) * spec_.capacity * d;
  k_store_.resize(elems * dtype_size(spec_.dtype));
  v_store_.resize(elems * dtype_size(spec_.dtype));
  if (spec_.keep_f32) {
    k32_.resize(elems);
    v32_.resize(elems);
  }
}

void SynthContext::plan_docs_until(uint64_t end) {
  Rng r{0, 0, 0, 0};
  std::memcpy(r.s, layout_rng_, sizeof r.s);
  while (docs_.empty() || docs_.back().end < end) {
    Doc doc;
    doc.begin = docs_.empty() ? 0 : docs_.back().end;
    doc.end = doc.begin + spec_.doc_min + r.below(spec_.doc_max - spec_.doc_min + 1);
    doc.topic = static_cast<uint32_t>(r.below(spec_.topics));
    docs_.push_back(doc);
  }
  std::memcpy(layout_rng_, r.s, sizeof r.s);
  // Each head's direction of each new document.
  const uint32_t d = spec_.head_dim;
  for (uint32_t h = 0; h < spec_.kv_heads; ++h) {
    Head &hd = heads_[h];
    for (size_t i = hd.doc_dir.size() / d; i < docs_.size(); ++i) {
      Rng dr(spec_.seed, kTagDoc, h, i);
      std::vector<float> w(hd.topic.begin() + static_cast<size_t>(docs_[i].topic) * d,
                           hd.topic.begin() + static_cast<size_t>(docs_[i].topic + 1) * d);
      std::vector<float> noise(d, 0.f);
      dr.add_normal(noise.data(), d, 1.f);
      normalise(noise.data(), d, kDocSpread);
      for (uint32_t e = 0; e < d; ++e) w[e] += noise[e];
      normalise(w.data(), d, 1.f);
      hd.doc_dir.insert(hd.doc_dir.end(), w.begin(), w.end());
    }
  }
}

void SynthContext::rope(const float *x, uint64_t pos, float *out) const {
  const uint32_t half = spec_.head_dim / 2;
  for (uint32_t i = 0; i < half; ++i) {
    const double a = static_cast<double>(pos) * inv_freq_[i];
    const double c = std::cos(a), s = std::sin(a);
    const double x1 = x[i], x2 = x[i + half];
    out[i] = static_cast<float>(x1 * c - x2 * s);
    out[i + half] = static_cast<float>(x2 * c + x1 * s);
  }
}

void SynthContext::gen_head(uint32_t h, uint64_t first, uint64_t n, const float *cs) {
  const uint32_t d = spec_.head_dim, half = d / 2;
  const Head &hd = heads_[h];
  std::vector<float> k0(d), k(d), v(d), qhat(hd.qmean);
  normalise(qhat.data(), d, 1.f);
  size_t doc = 0;
  while (docs_[doc].end <= first) ++doc;
  const size_t esz = dtype_size(spec_.dtype);
  for (uint64_t pos = first; pos < first + n; ++pos) {
    while (docs_[doc].end <= pos) ++doc;
    Rng r(spec_.seed, kTagToken, h, pos);
    if (pos < spec_.sinks) {
      for (uint32_t e = 0; e < d; ++e) k[e] = hd.mu[e] + spec_.sink_amp * qhat[e];
      r.add_normal(k.data(), d, kSinkNoise);
    } else {
      const float *w = &hd.doc_dir[doc * d];
      for (uint32_t e = 0; e < d; ++e) k0[e] = kTopicAmp * w[e];
      r.add_normal(k0.data(), d, kKeyNoise);
      for (uint32_t id : hd.needle_ids)
        if (needles_[id].pos == pos)
          for (uint32_t e = 0; e < d; ++e) k0[e] += kNeedleAmp * needles_[id].dir[e];
      // RoPE from the table of this position: (cos, sin) per pair.
      const float *c = cs + (pos - first) * d;
      for (uint32_t i = 0; i < half; ++i) {
        const float x1 = k0[i], x2 = k0[i + half], co = c[2 * i], si = c[2 * i + 1];
        k[i] = x1 * co - x2 * si + hd.mu[i];
        k[i + half] = x2 * co + x1 * si + hd.mu[i + half];
      }
    }
    std::copy(hd.vmean.begin(), hd.vmean.end(), v.begin());
    r.add_normal(v.data(), d, 1.f);
    const size_t at = static_cast<size_t>(h) * spec_.capacity + pos;
    to_storage(spec_.dtype, k.data(), &k_store_[at * d * esz], d);
    to_storage(spec_.dtype, v.data(), &v_store_[at * d * esz], d);
    if (spec_.keep_f32) {
      from_storage(spec_.dtype, &k_store_[at * d * esz], &k32_[at * d], d);
      from_storage(spec_.dtype, &v_store_[at * d * esz], &v32_[at * d], d);
    }
  }
}

void SynthContext::generate(uint64_t n, WorkerPool *pool) {
  if (n == 0) return;
  plan_docs_until(tokens_ + n);
  const uint64_t first = tokens_;
  const uint32_t half = spec_.head_dim / 2;
  // 1. cos and sin of every (position, pair), shared by the heads.
  std::vector<float> cs(static_cast<size_t>(n) * spec_.head_dim);
  auto table = [&](size_t part, size_t parts) {
    for (uint64_t t = n * part / parts; t < n * (part + 1) / parts; ++t)
      for (uint32_t i = 0; i < half; ++i) {
        const double a = static_cast<double>(first + t) * inv_freq_[i];
        cs[t * spec_.head_dim + 2 * i] = static_cast<float>(std::cos(a));
        cs[t * spec_.head_dim + 2 * i + 1] = static_cast<float>(std::sin(a));
      }
  };
  // 2. The heads.
  auto one = [&](size_t h) { gen_head(static_cast<uint32_t>(h), first, n, cs.data()); };
  if (pool) {
    const size_t parts = pool->threads();
    pool->run(parts, [&](size_t p) { table(p, parts); });
    pool->run(spec_.kv_heads, one);
  } else {
    table(0, 1);
    for (uint32_t h = 0; h < spec_.kv_heads; ++h) one(h);
  }
  tokens_ += n;
}

const void *SynthContext::k_store(uint32_t h, uint64_t pos) const {
  return &k_store_[(static_cast<size_t>(h) * spec_.capacity + pos) * spec_.head_dim * dtype_size(spec_.dtype)];
}
const void *SynthContext::v_store(uint32_t h, uint64_t pos) const {
  return &v_store_[(static_cast<size_t>(h) * spec_.capacity + pos) * spec_.head_dim * dtype_size(spec_.dtype)];
}
const float *SynthContext::k32(uint32_t h, uint64_t pos) const {
  return &k32_[(static_cast<size_t>(h) * spec_.capacity + pos) * spec_.head_dim];
}
const float *SynthContext::v32(uint32_t h, uint64_t pos) const {
  return &v32_[(static_cast<size_t>(h) * spec_.capacity + pos) * spec_.head_dim];
}

void SynthContext::make_queries(bool needle_step, uint32_t round, std::vector<uint8_t> *q_store,
                                std::vector<float> *q32, std::vector<int> *needle_of) {
  const uint32_t d = spec_.head_dim, Q = spec_.q_heads, G = Q / spec_.kv_heads;
  Rng r{0, 0, 0, 0};
  std::memcpy(r.s, query_rng_, sizeof r.s);
  q32->assign(static_cast<size_t>(Q) * d, 0.f);
  q_store->resize(static_cast<size_t>(Q) * d * dtype_size(spec_.dtype));
  needle_of->assign(Q, -1);
  size_t present = 0;
  while (present < docs_.size() && docs_[present].begin < tokens_) ++present;
  std::vector<float> target(d), rot(d);
  for (uint32_t j = 0; j < Q; ++j) {
    const uint32_t h = j / G;
    const Head &hd = heads_[h];
    float *q = &(*q32)[static_cast<size_t>(j) * d];
    for (uint32_t e = 0; e < d; ++e) q[e] = hd.qmean[e];
    r.add_normal(q, d, kQueryNoise);
    if (needle_step && !hd.needle_ids.empty() && j == h * G + round % G) {
      const uint32_t id = hd.needle_ids[(round + h) % hd.needle_ids.size()];
      (*needle_of)[j] = static_cast<int>(id);
      rope(needles_[id].dir.data(), needles_[id].pos, rot.data());
      for (uint32_t e = 0; e < d; ++e) q[e] += kNeedleQueryAmp * rot[e];
      continue;
    }
    const int spans = r.uniform() < 0.3 ? 2 : 1;
    const float amp = spans == 2 ? 0.75f * spec_.span_amp : spec_.span_amp;
    for (int s = 0; s < spans; ++s) {
      const Doc &doc = docs_[r.below(present)];
      const uint64_t end = std::min(doc.end, tokens_);
      const uint64_t c = doc.begin + r.below(end - doc.begin);
      rope(&hd.doc_dir[(&doc - docs_.data()) * d], c, rot.data());
      for (uint32_t e = 0; e < d; ++e) q[e] += amp * rot[e];
    }
  }
  std::memcpy(query_rng_, r.s, sizeof r.s);
  to_storage(spec_.dtype, q32->data(), q_store->data(), q32->size());
  from_storage(spec_.dtype, q_store->data(), q32->data(), q32->size());
}

}  // namespace wkv_tool

#undef WKV_TOOL_CLONES
