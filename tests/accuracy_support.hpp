// The accuracy scenario of tests/test_accuracy (CPU engine) and
// tests/gpu_accuracy (CUDA engine, the same figures): a synthetic context of
// documents and needles, decoded step by step with one method against exact
// attention in double.
#pragma once

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "support.hpp"
#include "wavekv/wavekv.hpp"

namespace wkvtest {

constexpr uint32_t kKV = 2, kG = 2, kQ = kKV * kG, kD = 64;

inline void unit(std::vector<float> *x) {
  double n = 0;
  for (float v : *x) n += double(v) * v;
  for (float &v : *x) v = static_cast<float>(v / std::sqrt(n));
}

// A context of documents (runs of 64..256 tokens whose keys share a
// direction, over a shared offset, with per-token noise), values with a
// common part, and a few needles per head: keys pushed far along a
// direction of their own, which one query aims at.
struct Context {
  uint32_t tokens = 0;
  std::vector<float> k, v;           // [tokens][kKV][kD]
  std::vector<HeadRows> rows;        // per head
  std::vector<std::vector<float>> doc_dir;  // per (doc, head) [kD]
  std::vector<uint32_t> doc_begin;
  struct Needle {
    uint32_t head, pos;
    std::vector<float> dir;
  };
  std::vector<Needle> needles;

  Context(uint32_t n, uint32_t needles_per_head, float value_mean, uint64_t seed) : tokens(n), rows(kKV) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> g(0.f, 1.f);
    std::uniform_int_distribution<uint32_t> len(64, 256);
    std::vector<float> offset(kKV * kD), vmean(kKV * kD);
    for (float &x : offset) x = 3.f * g(rng);
    for (float &x : vmean) x = value_mean * g(rng);
    for (uint32_t t = 0; t < n; t += len(rng)) doc_begin.push_back(t);
    for (size_t i = 0; i < doc_begin.size() * kKV; ++i) {
      std::vector<float> dir(kD);
      for (float &x : dir) x = g(rng);
      unit(&dir);
      doc_dir.push_back(dir);
    }
    std::uniform_int_distribution<uint32_t> where(300, n - 200);
    for (uint32_t h = 0; h < kKV; ++h)
      for (uint32_t i = 0; i < needles_per_head; ++i) {
        Needle nd{h, where(rng), std::vector<float>(kD)};
        for (float &x : nd.dir) x = g(rng);
        unit(&nd.dir);
        needles.push_back(nd);
      }
    k.resize(size_t(n) * kKV * kD);
    v.resize(k.size());
    size_t doc = 0;
    for (uint32_t t = 0; t < n; ++t) {
      while (doc + 1 < doc_begin.size() && doc_begin[doc + 1] <= t) ++doc;
      for (uint32_t h = 0; h < kKV; ++h) {
        float *kr = &k[(size_t(t) * kKV + h) * kD], *vr = &v[(size_t(t) * kKV + h) * kD];
        for (uint32_t i = 0; i < kD; ++i) {
          kr[i] = offset[h * kD + i] + 8.f * doc_dir[doc * kKV + h][i] + g(rng);
          vr[i] = vmean[h * kD + i] + g(rng);
        }
        for (const Needle &nd : needles)
          if (nd.head == h && nd.pos == t)
            for (uint32_t i = 0; i < kD; ++i) kr[i] += 14.f * nd.dir[i];
        for (uint32_t i = 0; i < kD; ++i) {
          kr[i] = round_to(WKV_DTYPE_F16, kr[i]);
          vr[i] = round_to(WKV_DTYPE_F16, vr[i]);
        }
        rows[h].k.insert(rows[h].k.end(), kr, kr + kD);
        rows[h].v.insert(rows[h].v.end(), vr, vr + kD);
      }
    }
  }

  // A query per q head: aimed at a document with strength `amp`, or, for
  // q head 0 of each KV head, at needle `needle` of that head when >= 0.
  std::vector<float> query(std::mt19937_64 &rng, float amp, int needle) const {
    std::normal_distribution<float> g(0.f, 1.f);
    std::uniform_int_distribution<size_t> pick(0, doc_begin.size() - 1);
    std::vector<float> q(kQ * kD);
    for (uint32_t j = 0; j < kQ; ++j) {
      const uint32_t h = j / kG;
      const size_t doc = pick(rng);
      for (uint32_t i = 0; i < kD; ++i) q[j * kD + i] = 0.3f * g(rng) + amp * doc_dir[doc * kKV + h][i];
      if (needle >= 0 && j % kG == 0) {
        const Needle &nd = needles[h * (needles.size() / kKV) + needle];
        for (uint32_t i = 0; i < kD; ++i) q[j * kD + i] = 0.3f * g(rng) + 10.f * nd.dir[i];
      }
    }
    for (float &x : q) x = round_to(WKV_DTYPE_F16, x);
    return q;
  }
};

struct Result {
  uint32_t hits = 0, needle_queries = 0;
  std::vector<double> err, needle_err;
  uint64_t attended = 0;
};

// Where an engine's tensors live: host memory for a CPU engine (the
// default, no copies), device memory for a CUDA engine (tests/gpu_accuracy).
struct Memory {
  uint32_t device = WKV_DEVICE_CPU;
  virtual ~Memory() = default;
  // A buffer of n bytes holding src (n bytes, or zeros when src is null),
  // alive until the Memory is destroyed.
  virtual void *put(const void *src, size_t n) {
    if (src)
      held.emplace_back(static_cast<const uint8_t *>(src), static_cast<const uint8_t *>(src) + n);
    else
      held.emplace_back(n, uint8_t{0});
    return held.back().data();
  }
  virtual void get(void *dst, const void *src, size_t n) { std::memcpy(dst, src, n); }
  std::vector<std::vector<uint8_t>> held;
};

// One layer of the scenario's shape in f16, with a method.
inline wkv_config accuracy_config(uint32_t method, uint32_t segment_tokens, uint32_t threads) {
  wkv_config c;
  wkv_config_init(&c);
  c.n_layers = 1;
  c.n_q_heads = kQ;
  c.n_kv_heads = kKV;
  c.head_dim = kD;
  c.dtype = WKV_DTYPE_F16;
  c.segment_tokens = segment_tokens;
  c.threads = threads;
  c.method = method;
  return c;
}

// Decodes `steps` queries over ctx with one method; a needle step aims q
// head 0 of each KV head at one of its needles.
inline Result run(const Context &ctx, uint32_t method, uint32_t steps, float amp, bool needle_steps,
                  Memory &&mem = Memory()) {
  wkv_config c = accuracy_config(method, 2048, 2);  // several segments in a short context
  c.device = mem.device;
  wavekv::Engine e(c);
  wavekv::Plan plan(e);
  wavekv::Sequence seq(e);
  wkv_seq *sp = seq.get();
  const std::vector<uint8_t> k = pack(WKV_DTYPE_F16, ctx.k), v = pack(WKV_DTYPE_F16, ctx.v);
  seq.append(0, mem.put(k.data(), k.size()), mem.put(v.data(), v.size()), ctx.tokens);
  seq.end_prompt(0);
  Result r;
  std::mt19937_64 rng(5);
  const size_t row = kD * 2;
  const uint64_t before = e.stats().attended_tokens;
  for (uint32_t s = 0; s < steps; ++s) {
    const int needle = needle_steps ? static_cast<int>(s % (ctx.needles.size() / kKV)) : -1;
    const std::vector<float> qf = ctx.query(rng, amp, needle);
    const std::vector<uint8_t> q = pack(WKV_DTYPE_F16, qf);
    std::vector<uint8_t> out(kQ * kD * 2);
    void *dq = mem.put(q.data(), q.size()), *dout = mem.put(nullptr, out.size());
    plan.lookup(&sp, 1, 0, dq);
    plan.assemble();
    plan.attend(dout);
    const wkv_xbuf_view xv = plan.xbuf();
    // The execution buffer's offsets and rows, where the test can read them
    // (a CUDA engine's verbs ran on the default stream, which get's copy
    // waits for).
    std::vector<int32_t> offsets(kKV + 1);
    mem.get(offsets.data(), xv.offsets, offsets.size() * 4);
    std::vector<uint8_t> xk(size_t(offsets[kKV]) * row);
    mem.get(xk.data(), xv.k, xk.size());
    mem.get(out.data(), dout, out.size());
    plan.update();
    const std::vector<float> of = unpack(WKV_DTYPE_F16, out, kQ * kD);
    for (uint32_t j = 0; j < kQ; ++j) {
      const uint32_t h = j / kG;
      std::vector<double> ref;
      exact_attention(&qf[j * kD], ctx.rows[h], kD, &ref);
      const double err = rel_l2(&of[j * kD], ref);
      r.err.push_back(err);
      if (needle < 0 || j % kG != 0) continue;
      const Context::Needle &nd = ctx.needles[h * (ctx.needles.size() / kKV) + needle];
      const std::vector<uint8_t> key = pack(WKV_DTYPE_F16, std::vector<float>(&ctx.rows[h].k[size_t(nd.pos) * kD],
                                                                           &ctx.rows[h].k[size_t(nd.pos + 1) * kD]));
      bool hit = false;
      for (int32_t t = offsets[h]; t < offsets[h + 1] && !hit; ++t)
        hit = std::memcmp(xk.data() + size_t(t) * row, key.data(), row) == 0;
      r.hits += hit;
      ++r.needle_queries;
      r.needle_err.push_back(err);
    }
  }
  r.attended = e.stats().attended_tokens - before;
  return r;
}

}  // namespace wkvtest
