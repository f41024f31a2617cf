// `wavekv accuracy`: methods of the engine (wkv_config.method) side by side
// in one run, on the workloads that docs/accuracy.md measures them by:
//
//   needles  the demo's context (span queries and needle queries in turn)
//   diffuse  the demo's diffuse workload (--workload diffuse)
//   real     the real-attention set (keys, values and queries of a model)
//
// Every method gets its own CPU engine over the same tokens; each step runs
// every method in turn (the order rotating) on the same queries, and the
// reference (exact attention in double) is computed once for them all, so
// that the figures and the step times of one run compare like with like on
// a machine whose load varies. Step time is the lookup, assemble, attend
// and update of one step (run twice, the second timed: timed_step): wall
// time, and the process's CPU time (which other processes' load does not
// inflate).
#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "tools/commands.hpp"
#include "tools/exact.hpp"
#include "tools/synth.hpp"

namespace wkv_tool {

void declare_accuracy(CLI::App &cmd, Options *o) {
  o->tokens = 32768;
  o->steps = 32;
  o->methods = "paper,outliers,outliers+ones,spread,tail,spread+tail,default";
  o->workloads = "needles,diffuse,real";
  o->real_dir = "../shared/data/real-attention";
  add_shape_flags(cmd, o, false);
  cmd.add_option("--methods", o->methods, "methods compared, comma-separated (each as demo --method takes it)")
      ->capture_default_str();
  cmd.add_option("--workloads", o->workloads, "workloads, comma-separated: needles, diffuse, real")
      ->capture_default_str();
  cmd.add_option("--real-dir", o->real_dir, "the real-attention set (layerN.f16 files)")->capture_default_str();
}

namespace {

double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// One method's engine and what it measured on one workload.
struct Run {
  uint32_t method = 0;
  std::unique_ptr<Session> s;
  double build_s = 0;
  uint64_t attended = 0, lookups = 0, hits = 0, needle_queries = 0;
  std::vector<double> err, err_needle, wall_ms, cpu_ms;
  std::vector<std::vector<double>> layer_err;  // real: per layer
};

// One step of a run: lookup, assemble, attend, update.
void run_step(Run &r, uint32_t layer, const void *q, void *out) {
  check(wkv_lookup(r.s->plan, &r.s->seq, 1, layer, q, 0, 0, nullptr), "wkv_lookup");
  check(wkv_assemble(r.s->plan, nullptr), "wkv_assemble");
  check(wkv_attend(r.s->plan, out, 0, 0, nullptr, nullptr), "wkv_attend");
  check(wkv_update(r.s->plan, nullptr), "wkv_update");
}

// The step twice, the second timed and its exact tokens counted. Every
// engine has its own oneTBB arena; the untimed pass brings the pool's
// workers into this one, so that the time is the step's own and not the
// hand-over from the engine that ran before.
void timed_step(Run &r, uint32_t layer, const void *q, void *out) {
  run_step(r, layer, q, out);
  const wkv_stats before = r.s->stats();
  const auto w0 = Clock::now();
  const double c0 = cpu_seconds();
  run_step(r, layer, q, out);
  r.cpu_ms.push_back((cpu_seconds() - c0) * 1e3);
  r.wall_ms.push_back(seconds_since(w0) * 1e3);
  const wkv_stats now = r.s->stats();
  r.attended += now.attended_tokens - before.attended_tokens;
  r.lookups += now.lookups - before.lookups;
}

// The synthetic workloads: the demo's context, every method over it.
void run_synthetic(const Options &o, bool diffuse, WorkerPool &pool, std::vector<Run> &runs, double *top_share) {
  const unsigned threads = o.resolved_threads();
  const uint32_t H = static_cast<uint32_t>(o.heads), Q = static_cast<uint32_t>(o.q_heads);
  const uint32_t d = static_cast<uint32_t>(o.head_dim), dt = o.dtype_id();
  SynthSpec spec;
  spec.kv_heads = H;
  spec.q_heads = Q;
  spec.head_dim = d;
  spec.dtype = dt;
  spec.prompt_tokens = o.tokens;
  spec.capacity = o.tokens + o.steps;
  spec.seed = o.seed;
  spec.keep_f32 = true;
  if (diffuse) set_diffuse(&spec);
  SynthContext ctx(spec);
  for (uint64_t done = 0; done < o.tokens;) {
    const uint64_t m = std::min<uint64_t>(8192, o.tokens - done);
    ctx.generate(m, &pool);
    done += m;
  }
  std::vector<uint8_t> q_store;
  std::vector<float> q32;
  std::vector<int> needle_of;
  ctx.make_queries(false, 0, &q_store, &q32, &needle_of);
  for (Run &r : runs) {
    r.s = std::make_unique<Session>(o, threads, r.method);
    const auto t0 = Clock::now();
    ingest(*r.s, ctx, 0, 0, o.tokens, diffuse ? "ingesting (diffuse)" : "ingesting (needles)");
    check(wkv_seq_end_prompt(r.s->seq, 0, nullptr), "wkv_seq_end_prompt");
    r.build_s = seconds_since(t0);
  }
  std::vector<uint8_t> out_store(static_cast<size_t>(Q) * d * dtype_size(dt));
  std::vector<float> out(static_cast<size_t>(Q) * d);
  std::vector<double> ref(static_cast<size_t>(Q) * d);
  std::vector<double> shares;
  Progress prog(diffuse ? "decoding (diffuse)" : "decoding (needles)", o.steps);
  for (uint32_t st = 0; st < o.steps; ++st) {
    const bool needle_step = !diffuse && st % 2 == 1;
    if (st > 0) {
      const uint64_t pos = ctx.tokens();
      ctx.generate(1, nullptr);
      for (Run &r : runs)
        check(wkv_seq_append(r.s->seq, 0, ctx.k_store(0, pos), ctx.v_store(0, pos), 1, d,
                             static_cast<int64_t>(ctx.head_stride() * d), nullptr),
              "wkv_seq_append");
      ctx.make_queries(needle_step, st / 2, &q_store, &q32, &needle_of);
    }
    const uint64_t n = ctx.tokens();
    Probe probe;
    probe.probe_pos.assign(Q, -1);
    attend_f64(pool, ctx.k32(0, 0), ctx.v32(0, 0), ctx.head_stride(), {{0, n}}, H, Q, d, q32.data(), ref.data(),
               &probe);
    for (uint32_t j = 0; j < Q; ++j)
      if (needle_of[j] < 0) shares.push_back(probe.top_share[j]);
    for (size_t i = 0; i < runs.size(); ++i) {
      Run &r = runs[(i + st) % runs.size()];
      timed_step(r, 0, q_store.data(), out_store.data());
      wkv_xbuf_view x;
      wkv_xbuf_view_init(&x);
      if (needle_step) check(wkv_plan_xbuf(r.s->plan, &x), "wkv_plan_xbuf");
      from_storage(dt, out_store.data(), out.data(), out.size());
      for (uint32_t j = 0; j < Q; ++j) {
        const double e = rel_l2(&out[static_cast<size_t>(j) * d], &ref[static_cast<size_t>(j) * d], d);
        r.err.push_back(e);
        if (needle_of[j] < 0) continue;
        const Needle &nd = ctx.needles()[needle_of[j]];
        r.err_needle.push_back(e);
        ++r.needle_queries;
        r.hits += xbuf_holds(x, nd.head, ctx.k_store(nd.head, nd.pos), r.s->config);
      }
    }
    prog.update(st + 1);
  }
  prog.finish();
  *top_share = median(shares);
}

bool run_real(const Options &o, WorkerPool &pool, std::vector<Run> &runs) {
  std::vector<uint16_t> raw;
  if (!read_real_layer(o.real_dir, 0, &raw)) return false;
  Options ro = o;
  ro.layers = kRealLayers;
  ro.q_heads = kRealQ;
  ro.heads = kRealKV;
  ro.head_dim = kRealD;
  ro.dtype = "f16";
  const unsigned threads = o.resolved_threads();
  for (Run &r : runs) {
    r.s = std::make_unique<Session>(ro, threads, r.method);
    r.layer_err.assign(kRealLayers, {});
  }
  const uint32_t prompt = kRealT - kRealQueries, d = kRealD;
  const size_t kv = size_t(kRealT) * kRealKV * d;
  std::vector<float> k32(kv), v32(kv), q32(size_t(kRealQ) * d), out(size_t(kRealQ) * d);
  std::vector<double> ref(size_t(kRealQ) * d);
  std::vector<uint16_t> out_store(size_t(kRealQ) * d);
  Progress prog("real attention", kRealLayers * kRealQueries);
  for (uint32_t l = 0; l < kRealLayers; ++l) {
    if (!read_real_layer(o.real_dir, l, &raw))
      throw WkvError("accuracy: " + o.real_dir + "/layer" + std::to_string(l) + ".f16 is missing or short");
    const uint16_t *K = raw.data(), *V = K + kv, *Qs = V + kv;
    // Head-major f32 copies for the reference.
    for (uint32_t t = 0; t < kRealT; ++t)
      for (uint32_t h = 0; h < kRealKV; ++h) {
        from_storage(WKV_DTYPE_F16, K + (size_t(t) * kRealKV + h) * d, &k32[(size_t(h) * kRealT + t) * d], d);
        from_storage(WKV_DTYPE_F16, V + (size_t(t) * kRealKV + h) * d, &v32[(size_t(h) * kRealT + t) * d], d);
      }
    for (Run &r : runs) {
      const auto t0 = Clock::now();
      check(wkv_seq_append(r.s->seq, l, K, V, prompt, kRealKV * d, d, nullptr), "wkv_seq_append");
      check(wkv_seq_end_prompt(r.s->seq, l, nullptr), "wkv_seq_end_prompt");
      r.build_s += seconds_since(t0);
    }
    for (uint32_t j = 0; j < kRealQueries; ++j) {
      const size_t tok = size_t(prompt + j) * kRealKV * d;
      for (Run &r : runs) check(wkv_seq_append(r.s->seq, l, K + tok, V + tok, 1, kRealKV * d, d, nullptr), "wkv_seq_append");
      const uint16_t *q = Qs + size_t(j) * kRealQ * d;
      from_storage(WKV_DTYPE_F16, q, q32.data(), q32.size());
      attend_f64(pool, k32.data(), v32.data(), kRealT, {{0, uint64_t(prompt) + j + 1}}, kRealKV, kRealQ, d, q32.data(),
                 ref.data(), nullptr);
      for (size_t i = 0; i < runs.size(); ++i) {
        Run &r = runs[(i + j) % runs.size()];
        timed_step(r, l, q, out_store.data());
        from_storage(WKV_DTYPE_F16, out_store.data(), out.data(), out.size());
        for (uint32_t h = 0; h < kRealQ; ++h) {
          const double e = rel_l2(&out[size_t(h) * d], &ref[size_t(h) * d], d);
          r.err.push_back(e);
          r.layer_err[l].push_back(e);
        }
      }
      prog.update(l * kRealQueries + j + 1);
    }
  }
  prog.finish();
  return true;
}

std::string ratio(double x, double base) { return fixed(x / base, 2) + "x"; }

}  // namespace

int run_accuracy(const Options &o) {
  validate(o, "accuracy");
  const unsigned threads = o.resolved_threads();
  std::vector<uint32_t> methods;
  for (const std::string &m : split_list(o.methods)) methods.push_back(parse_method(m, "accuracy: --methods"));
  if (methods.empty()) throw UsageError("accuracy: --methods names no method");
  const std::vector<std::string> workloads = split_list(o.workloads);
  for (const std::string &w : workloads)
    if (w != "needles" && w != "diffuse" && w != "real")
      throw UsageError("accuracy: --workloads: '" + w + "' is not needles, diffuse or real");
  WorkerPool pool(threads);
  const auto t_start = Clock::now();
  nlohmann::ordered_json json = {
      {"command", "accuracy"}, {"tokens", o.tokens}, {"steps", o.steps}, {"threads", threads}, {"seed", o.seed}};
  std::string text;
  for (const std::string &w : workloads) {
    std::vector<Run> runs(methods.size());
    for (size_t i = 0; i < methods.size(); ++i) runs[i].method = methods[i];
    double top_share = NAN;
    if (w == "real") {
      if (!run_real(o, pool, runs)) {
        text += "real: skipped, no data under " + o.real_dir + " (--real-dir)\n\n";
        json["real"] = "skipped: no data";
        continue;
      }
    } else {
      run_synthetic(o, w == "diffuse", pool, runs, &top_share);
    }
    const double base_wall = median(runs[0].wall_ms), base_cpu = median(runs[0].cpu_ms);
    const double base_att = static_cast<double>(runs[0].attended) / runs[0].lookups;
    Table t;
    std::vector<std::string> head{"method", "median", "p90"};
    if (w == "needles") head.insert(head.end(), {"needle hits", "needle median"});
    if (w == "real")
      for (uint32_t l = 0; l < kRealLayers; ++l) head.push_back("L" + std::to_string(l) + " med/p90");
    head.insert(head.end(), {"exact tokens/step", "step ms (wall)", "step ms (cpu)", "build s"});
    t.row(head);
    nlohmann::ordered_json jw = nlohmann::ordered_json::object();
    if (w == "diffuse") jw["top_share_median"] = top_share;
    for (const Run &r : runs) {
      const double att = static_cast<double>(r.attended) / r.lookups;
      const double wall = median(r.wall_ms), cpu = median(r.cpu_ms);
      std::vector<std::string> row{method_name(r.method), fixed(median(r.err), 4), fixed(quantile(r.err, 0.9), 4)};
      nlohmann::ordered_json jr = {{"rel_l2_median", median(r.err)}, {"rel_l2_p90", quantile(r.err, 0.9)}};
      if (w == "needles") {
        row.push_back(std::to_string(r.hits) + "/" + std::to_string(r.needle_queries));
        row.push_back(fixed(median(r.err_needle), 4));
        jr["needle_hits"] = r.hits;
        jr["needle_queries"] = r.needle_queries;
        jr["rel_l2_needle_median"] = median(r.err_needle);
      }
      if (w == "real") {
        nlohmann::ordered_json jl = nlohmann::ordered_json::object();
        for (uint32_t l = 0; l < kRealLayers; ++l) {
          row.push_back(fixed(median(r.layer_err[l]), 4) + "/" + fixed(quantile(r.layer_err[l], 0.9), 4));
          jl["layer" + std::to_string(l)] = {{"rel_l2_median", median(r.layer_err[l])},
                                             {"rel_l2_p90", quantile(r.layer_err[l], 0.9)}};
        }
        jr["layers"] = std::move(jl);
      }
      row.push_back(fixed(att, 1) + " (" + ratio(att, base_att) + ")");
      row.push_back(fixed(wall, 3) + " (" + ratio(wall, base_wall) + ")");
      row.push_back(fixed(cpu, 3) + " (" + ratio(cpu, base_cpu) + ")");
      row.push_back(fixed(r.build_s, 2));
      t.row(row);
      jr["exact_tokens_per_step"] = att;
      jr["step_ms_wall_median"] = wall;
      jr["step_ms_cpu_median"] = cpu;
      jr["build_s"] = r.build_s;
      jw[method_name(r.method)] = std::move(jr);
    }
    json[w] = std::move(jw);
    text += w + (w == "real" ? " (" + std::to_string(runs[0].err.size()) + " outputs)" : "") + ":\n" + t.str();
    if (w == "diffuse") text += "top 1.8% of keys hold " + fixed(top_share, 3) + " of a query's attention (median)\n";
    text += "\n";
  }
  json["total_s"] = seconds_since(t_start);
  if (o.json) {
    std::cout << json.dump() << std::endl;
    return 0;
  }
  std::cout << text;
  std::printf("errors: relative L2 against exact attention in f64 per (step, q head); exact tokens/step: tokens\n"
              "attended exactly per step (all KV heads; ratio to the first method); step: lookup + assemble +\n"
              "attend + update, median; the methods run in turn on the same steps\n");
  std::printf("accuracy took %.1f s\n", seconds_since(t_start));
  return 0;
}

}  // namespace wkv_tool
