// `wavekv demo`: a synthetic long context ingested into a CPU engine and
// decoded for a few steps, every step measured against exact attention in
// double (the reference), the exact f32 CPU baseline (the speed reference)
// and a sink + window baseline (what attention without retrieval gives).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <numeric>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "tools/commands.hpp"
#include "tools/exact.hpp"
#include "tools/synth.hpp"

namespace wkv_tool {

void declare_demo(CLI::App &cmd, Options *o) {
  o->tokens = 32768;
  o->steps = 32;
  add_shape_flags(cmd, o, true);
  cmd.add_option("--host-budget", o->host_budget,
                 "cap on the engine's host page memory (wkv_config.host_budget_bytes), e.g. 4GiB; with --spill-dir, "
                 "pages beyond it go to the spill file and decoding goes on")
      ->check(unsigned_text())
      ->transform(CLI::AsSizeValue(false));
  cmd.add_option("--repeat", o->repeat,
                 "steps each query holds for (temporal locality, as in real decoding; 1: every step a new one)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  cmd.add_option("--spill-dir", o->spill_dir, "directory of the engine's spill file (wkv_config.spill_dir)");
  cmd.add_flag("--compare-in-memory", o->compare_in_memory,
               "with --host-budget: first decode the same context and queries with everything in memory, in the same "
               "run, and print both (the anchor's engine is closed before the budgeted one opens)");
  cmd.add_option("--save", o->save, "save the sequence to this file at the end (wkv_seq_save)");
  cmd.add_option("--workload", o->workload,
                 "needles: span queries and needle queries in turn; diffuse: span queries aimed so loosely that "
                 "the top 1.8% of keys hold under half of the attention")
      ->check(CLI::IsMember({"needles", "diffuse"}))
      ->capture_default_str();
  cmd.add_option("--method", o->method,
                 "the engine's method: default, paper, or outliers, ones, spread, tail joined by '+' "
                 "(docs/accuracy.md)")
      ->capture_default_str();
}

namespace {

std::string hits(uint64_t hit, uint64_t of) { return std::to_string(hit) + "/" + std::to_string(of); }

}  // namespace

namespace {

// What one pass of the demo measured: a context generated from the seed,
// ingested into a fresh engine and decoded.
struct Pass {
  Options o;  // the pass's flags (host budget and spill directory)
  uint32_t method = 0, sink = 0, window = 0;
  uint32_t documents = 0, topics = 0;
  wkv_stats built{}, fin{};
  double append_s = 0, finish_s = 0, total_s = 0;
  uint64_t final_tokens = 0;
  std::vector<double> wkv_ms, exact_ms, err_wkv, err_sw, err_exact, err_wkv_needle, err_sw_needle;
  std::vector<double> needle_share, sink_share, top_share, err_oracle, err_oracle_needle;
  uint64_t needle_queries = 0, wkv_hits = 0, sw_hits = 0, oracle_hits = 0;

  bool spills() const { return !o.spill_dir.empty() || o.host_budget; }
  double lookups() const { return static_cast<double>(fin.lookups - built.lookups); }
  double per_head(uint64_t a, uint64_t b) const { return (a - b) / lookups() / o.heads; }
  double attended_per_head() const { return per_head(fin.attended_tokens, built.attended_tokens); }
  double retrieved_per_head() const { return per_head(fin.retrieved_clusters, built.retrieved_clusters); }
  double estimated_per_head() const { return per_head(fin.estimated_clusters, built.estimated_clusters); }
  uint64_t clusters_per_head() const { return built.clusters / o.heads / o.layers; }
  double decode_s() const { return std::accumulate(wkv_ms.begin(), wkv_ms.end(), 0.0) * 1e-3; }
  uint64_t read_back() const { return fin.spill_bytes_read - built.spill_bytes_read; }
  uint64_t kv_bytes() const { return (fin.pages_used + fin.spill_cold_pages) * fin.page_bytes; }
  uint64_t retrievals() const { return fin.retrieved_clusters - built.retrieved_clusters; }
  uint64_t estimated_on_disk() const { return fin.spill_estimated - built.spill_estimated; }
  double build_s() const { return append_s + finish_s; }
  double speedup() const { return median(exact_ms) / median(wkv_ms); }
  std::string label() const {
    if (!spills()) return o.compare_in_memory ? "wavekv, in memory" : "wavekv";
    return "wavekv, budget " + (o.host_budget ? mib(o.host_budget, 0) : std::string("none"));
  }
};

Pass run_pass(const Options &o, unsigned threads, WorkerPool &pool) {
  Pass r;
  r.o = o;
  const uint32_t H = static_cast<uint32_t>(o.heads), Q = static_cast<uint32_t>(o.q_heads);
  const uint32_t d = static_cast<uint32_t>(o.head_dim), dt = o.dtype_id();
  const auto t_start = Clock::now();

  // 1. The context.
  SynthSpec spec;
  spec.kv_heads = H;
  spec.q_heads = Q;
  spec.head_dim = d;
  spec.dtype = dt;
  spec.prompt_tokens = o.tokens;
  spec.capacity = o.tokens + o.steps;
  spec.seed = o.seed;
  spec.keep_f32 = true;
  const bool diffuse = o.workload == "diffuse";
  if (diffuse) set_diffuse(&spec);
  SynthContext ctx(spec);
  {
    Progress p("generating", o.tokens);
    for (uint64_t done = 0; done < o.tokens;) {
      const uint64_t m = std::min<uint64_t>(8192, o.tokens - done);
      ctx.generate(m, &pool);
      done += m;
      p.update(done);
    }
    p.finish();
  }

  // 2. Ingest; the first lookup ends the prompt (clusters its remainder),
  //    so it belongs to the index build.
  Session s(o, threads, parse_method(o.method, "demo: --method"));
  const uint32_t L = static_cast<uint32_t>(o.layers);
  r.append_s = ingest_layers(s, ctx, L, 0, o.tokens, "ingesting");
  std::vector<uint8_t> q_store;
  std::vector<float> q32;
  std::vector<int> needle_of;
  ctx.make_queries(false, 0, &q_store, &q32, &needle_of);
  auto t0 = Clock::now();
  for (uint32_t l = 0; l < L; ++l)
    check(wkv_lookup(s.plan, &s.seq, 1, l, q_store.data(), 0, 0, nullptr), "wkv_lookup");
  r.finish_s = seconds_since(t0);
  r.built = s.stats();
  r.method = s.config.method;
  r.sink = s.config.sink_tokens;
  r.window = s.config.window_tokens;
  r.documents = ctx.documents();
  r.topics = spec.topics;

  // 3. Decode.
  ExactAttention exact(pool, dt, H, Q, d);
  std::vector<uint8_t> out_store(static_cast<size_t>(Q) * d * dtype_size(dt));
  std::vector<float> out_wkv(static_cast<size_t>(Q) * d), out_exact(static_cast<size_t>(Q) * d);
  std::vector<double> ref(static_cast<size_t>(Q) * d), sw(static_cast<size_t>(Q) * d);
  std::vector<float> sw_f(static_cast<size_t>(Q) * d);
  uint64_t prev_attended = r.built.attended_tokens;
  std::vector<float> oracle_f(static_cast<size_t>(Q) * d);
  Progress prog("decoding", o.steps);
  for (uint32_t step = 0; step < o.steps; ++step) {
    // Each query holds for --repeat steps (temporal locality: consecutive
    // decoding steps attend to the same places).
    const uint32_t turn = step / static_cast<uint32_t>(o.repeat);
    const bool needle_step = !diffuse && turn % 2 == 1;
    if (step > 0) {
      const uint64_t pos = ctx.tokens();
      ctx.generate(1, nullptr);
      for (uint32_t l = 0; l < L; ++l)
        check(wkv_seq_append(s.seq, l, ctx.k_store(0, pos), ctx.v_store(0, pos), 1, d,
                             static_cast<int64_t>(ctx.head_stride() * d), nullptr),
              "wkv_seq_append");
      if (step % o.repeat == 0) ctx.make_queries(needle_step, turn / 2, &q_store, &q32, &needle_of);
    }
    const uint64_t n = ctx.tokens();

    // wavekv: one call, or the split path where the execution buffer is
    // inspected for the needles.
    std::vector<char> in_xbuf(Q, 0);
    t0 = Clock::now();
    if (!needle_step) {
      check(wkv_decode(s.plan, &s.seq, 1, 0, q_store.data(), 0, 0, out_store.data(), 0, 0, nullptr),
            "wkv_decode");
      r.wkv_ms.push_back(seconds_since(t0) * 1e3);
    } else {
      check(wkv_lookup(s.plan, &s.seq, 1, 0, q_store.data(), 0, 0, nullptr), "wkv_lookup");
      check(wkv_assemble(s.plan, nullptr), "wkv_assemble");
      check(wkv_attend(s.plan, out_store.data(), 0, 0, nullptr, nullptr), "wkv_attend");
      check(wkv_update(s.plan, nullptr), "wkv_update");
      r.wkv_ms.push_back(seconds_since(t0) * 1e3);
      wkv_xbuf_view x;
      wkv_xbuf_view_init(&x);
      check(wkv_plan_xbuf(s.plan, &x), "wkv_plan_xbuf");
      for (uint32_t j = 0; j < Q; ++j) {
        if (needle_of[j] < 0) continue;
        const Needle &nd = ctx.needles()[needle_of[j]];
        in_xbuf[j] = xbuf_holds(x, nd.head, ctx.k_store(nd.head, nd.pos), s.config);
      }
    }
    // The other layers (the same K and V, each stored, indexed and spilled
    // on its own): one call each, in the step's time; their errors
    // against the same reference are counted with layer 0's.
    std::vector<std::vector<float>> out_layers;
    if (L > 1) {
      std::vector<uint8_t> other(out_store.size());
      t0 = Clock::now();
      for (uint32_t l = 1; l < L; ++l) {
        check(wkv_decode(s.plan, &s.seq, 1, l, q_store.data(), 0, 0, other.data(), 0, 0, nullptr), "wkv_decode");
        out_layers.emplace_back(out_wkv.size());
        from_storage(dt, other.data(), out_layers.back().data(), out_wkv.size());
      }
      r.wkv_ms.back() += seconds_since(t0) * 1e3;
    }
    from_storage(dt, out_store.data(), out_wkv.data(), out_wkv.size());
    // Tokens this step attended exactly, per KV head: the oracle's budget.
    const wkv_stats now = s.stats();
    const uint64_t budget = (now.attended_tokens - prev_attended) / H / L;
    prev_attended = now.attended_tokens;

    // The exact baseline, timed.
    t0 = Clock::now();
    exact.run(ctx.k_store(0, 0), ctx.v_store(0, 0), ctx.head_stride(), n, q32.data(), out_exact.data());
    r.exact_ms.push_back(seconds_since(t0) * 1e3 * L);  // every layer is this one's size

    // References in double: all tokens, and sink + window only.
    Probe probe;
    probe.sink_tokens = r.sink;
    probe.oracle_budget = std::max<uint64_t>(budget, 1);
    probe.probe_pos.assign(Q, -1);
    for (uint32_t j = 0; j < Q; ++j)
      if (needle_of[j] >= 0) probe.probe_pos[j] = static_cast<int64_t>(ctx.needles()[needle_of[j]].pos);
    attend_f64(pool, ctx.k32(0, 0), ctx.v32(0, 0), ctx.head_stride(), {{0, n}}, H, Q, d, q32.data(),
               ref.data(), &probe);
    const uint64_t w0 = n > r.window ? std::max<uint64_t>(n - r.window, r.sink) : r.sink;
    std::vector<Range> sw_ranges{{0, std::min<uint64_t>(r.sink, n)}};
    if (w0 < n) sw_ranges.push_back({w0, n});
    attend_f64(pool, ctx.k32(0, 0), ctx.v32(0, 0), ctx.head_stride(), sw_ranges, H, Q, d, q32.data(),
               sw.data(), nullptr);
    for (size_t i = 0; i < sw.size(); ++i) sw_f[i] = static_cast<float>(sw[i]);
    for (size_t i = 0; i < sw.size(); ++i) oracle_f[i] = static_cast<float>(probe.oracle_out[i]);

    for (uint32_t j = 0; j < Q; ++j) {
      const size_t off = static_cast<size_t>(j) * d;
      for (const std::vector<float> &ol : out_layers) r.err_wkv.push_back(rel_l2(&ol[off], &ref[off], d));
      const double ew = rel_l2(&out_wkv[off], &ref[off], d);
      const double es = rel_l2(&sw_f[off], &ref[off], d);
      r.err_wkv.push_back(ew);
      r.err_sw.push_back(es);
      const double eo = rel_l2(&oracle_f[off], &ref[off], d);
      r.err_exact.push_back(rel_l2(&out_exact[off], &ref[off], d));
      r.err_oracle.push_back(eo);
      if (needle_of[j] >= 0) {
        r.err_oracle_needle.push_back(eo);
        r.oracle_hits += probe.probe_in_oracle[j];
        const Needle &nd = ctx.needles()[needle_of[j]];
        ++r.needle_queries;
        r.wkv_hits += in_xbuf[j];
        r.sw_hits += nd.pos < r.sink || nd.pos >= w0;
        r.needle_share.push_back(probe.probe_share[j]);
        r.err_wkv_needle.push_back(ew);
        r.err_sw_needle.push_back(es);
      } else {
        r.sink_share.push_back(probe.sink_share[j]);
        r.top_share.push_back(probe.top_share[j]);
      }
    }
    prog.update(step + 1);
  }
  prog.finish();
  r.fin = s.stats();
  if (!o.save.empty()) save_sequence(s, o.save);
  r.final_tokens = ctx.tokens();
  r.total_s = seconds_since(t_start);
  return r;
}

nlohmann::ordered_json json_of(const Pass &r) {
  const Options &o = r.o;
  const uint64_t sw_tokens = std::min<uint64_t>(r.final_tokens, r.sink + r.window);
  const wkv_stats &fin = r.fin;
  const double decode_s = r.decode_s();
  return {{"command", "demo"}, {"tokens", o.tokens}, {"generated", r.final_tokens - o.tokens}, {"kv_heads", o.heads}, {"q_heads", o.q_heads}, {"head_dim", o.head_dim}, {"dtype", o.dtype}, {"threads", o.resolved_threads()}, {"steps", o.steps}, {"seed", o.seed}, {"workload", o.workload}, {"repeat", o.repeat}, {"method", method_name(r.method)}, {"documents", r.documents}, {"topics", r.topics}, {"segments_per_head", r.built.segments / o.heads}, {"clusters_per_head", r.clusters_per_head()}, {"index_build_s", r.build_s()}, {"append_s", r.append_s}, {"prompt_finish_s", r.finish_s}, {"kmeans_s", r.built.kmeans_ns * 1e-9}, {"wavekv", {{"step_ms_median", median(r.wkv_ms)}, {"step_ms_p90", quantile(r.wkv_ms, 0.9)}, {"rel_l2_median", median(r.err_wkv)}, {"rel_l2_p90", quantile(r.err_wkv, 0.9)}, {"rel_l2_needle_median", median(r.err_wkv_needle)}, {"needle_hits", r.wkv_hits}, {"needle_queries", r.needle_queries}, {"attended_tokens_per_head", r.attended_per_head()}, {"retrieved_clusters_per_head", r.retrieved_per_head()}, {"estimated_clusters_per_head", r.estimated_per_head()}}}, {"sink_window", {{"rel_l2_median", median(r.err_sw)}, {"rel_l2_p90", quantile(r.err_sw, 0.9)}, {"rel_l2_needle_median", median(r.err_sw_needle)}, {"needle_hits", r.sw_hits}, {"needle_queries", r.needle_queries}, {"attended_tokens_per_head", sw_tokens}}}, {"exact", {{"step_ms_median", median(r.exact_ms)}, {"step_ms_p90", quantile(r.exact_ms, 0.9)}, {"rel_l2_median", median(r.err_exact)}, {"rel_l2_p90", quantile(r.err_exact, 0.9)}, {"needle_share_median", median(r.needle_share)}, {"sink_share_median", median(r.sink_share)}, {"top_share_median", median(r.top_share)}, {"attended_tokens_per_head", r.final_tokens}}}, {"oracle_top_k", {{"rel_l2_median", median(r.err_oracle)}, {"rel_l2_p90", quantile(r.err_oracle, 0.9)}, {"rel_l2_needle_median", median(r.err_oracle_needle)}, {"needle_hits", r.oracle_hits}, {"needle_queries", r.needle_queries}}}, {"speedup", r.speedup()}, {"total_s", r.total_s}, {"layers", o.layers}, {"spill", {{"host_budget_bytes", o.host_budget}, {"kv_page_bytes", r.kv_bytes()}, {"host_page_bytes", fin.pages_used * fin.page_bytes}, {"cold_pages", fin.spill_cold_pages}, {"bytes_written", fin.spill_bytes_written}, {"bytes_read", fin.spill_bytes_read}, {"bytes_read_decoding", r.read_back()}, {"read_mb_per_s_decoding", decode_s > 0 ? r.read_back() / decode_s / 1e6 : 0.0}, {"retrievals_estimated_on_disk", r.estimated_on_disk()}, {"retrievals_exact", r.retrievals()}, {"read_errors", fin.spill_read_errors}, {"io", fin.spill_io}}}};
}

// The report's table: one wavekv column per pass (the same context each
// time), then the baselines of the last pass.
std::string table_of(const std::vector<Pass> &passes) {
  const Pass &r = passes.back();
  const Options &o = r.o;
  const uint32_t L = static_cast<uint32_t>(o.layers);
  const uint64_t sw_tokens = std::min<uint64_t>(r.final_tokens, r.sink + r.window);
  // A row: the metric, each pass's value, then the baselines.
  auto row = [&](Table &t, const std::string &metric, auto value, std::vector<std::string> rest = {}) {
    std::vector<std::string> cells{metric};
    for (const Pass &p : passes) cells.push_back(value(p));
    cells.insert(cells.end(), rest.begin(), rest.end());
    t.row(cells);
  };
  Table t;
  row(t, "metric", [](const Pass &p) { return p.label(); }, {"sink+window", "exact", "oracle top-k"});
  t.row({"tokens", std::to_string(o.tokens) + " + " + std::to_string(r.final_tokens - o.tokens) + " generated"});
  t.row({"shape", std::to_string(L) + " layer" + (L > 1 ? "s, " : ", ") + std::to_string(o.heads) + " kv heads, " +
                      std::to_string(o.q_heads) + " q heads, d=" + std::to_string(o.head_dim) + ", " + o.dtype + ", " +
                      std::to_string(o.resolved_threads()) + " threads"});
  t.row({"workload / method", o.workload + " / " + method_name(r.method) +
                                   (o.repeat > 1 ? ", each query for " + std::to_string(o.repeat) + " steps" : "")});
  t.row({"documents / topics", std::to_string(r.documents) + " / " + std::to_string(r.topics)});
  row(t, "clusters (per kv head)", [](const Pass &p) { return std::to_string(p.clusters_per_head()); });
  row(t, "index build (s)",
      [](const Pass &p) { return fixed(p.build_s(), 2) + " (k-means " + fixed(p.built.kmeans_ns * 1e-9, 2) + ")"; });
  row(t, "attended tokens (per kv head)", [](const Pass &p) { return fixed(p.attended_per_head(), 0); },
      {std::to_string(sw_tokens), std::to_string(r.final_tokens), fixed(r.attended_per_head(), 0) + " per q head"});
  row(t, "  retrieved / estimated clusters",
      [](const Pass &p) { return fixed(p.retrieved_per_head(), 0) + " / " + fixed(p.estimated_per_head(), 0); });
  row(t, "step time (ms, median)", [](const Pass &p) { return fixed(median(p.wkv_ms), 2); },
      {"-", fixed(median(r.exact_ms), 2)});
  row(t, "step time (ms, p90)", [](const Pass &p) { return fixed(quantile(p.wkv_ms, 0.9), 2); },
      {"-", fixed(quantile(r.exact_ms, 0.9), 2)});
  row(t, "rel. L2 error (median)", [](const Pass &p) { return fixed(median(p.err_wkv), 4); },
      {fixed(median(r.err_sw), 4), fixed(median(r.err_exact), 6), fixed(median(r.err_oracle), 4)});
  row(t, "rel. L2 error (p90)", [](const Pass &p) { return fixed(quantile(p.err_wkv, 0.9), 4); },
      {fixed(quantile(r.err_sw, 0.9), 4), fixed(quantile(r.err_exact, 0.9), 6), fixed(quantile(r.err_oracle, 0.9), 4)});
  row(t, "rel. L2 error, needle queries", [](const Pass &p) { return fixed(median(p.err_wkv_needle), 4); },
      {fixed(median(r.err_sw_needle), 4), "-", fixed(median(r.err_oracle_needle), 4)});
  row(t, "needle hit rate", [](const Pass &p) { return hits(p.wkv_hits, p.needle_queries); },
      {hits(r.sw_hits, r.needle_queries), hits(r.needle_queries, r.needle_queries),
       hits(r.oracle_hits, r.needle_queries)});
  t.row({"needle share of attention", "", "", fixed(median(r.needle_share), 3)});
  t.row({"sink share of attention", "", "", fixed(median(r.sink_share), 3)});
  t.row({"top 1.8% share of attention", "", "", fixed(median(r.top_share), 3)});
  bool any_spill = false;
  for (const Pass &p : passes) any_spill |= p.spills();
  if (any_spill) {
    const double mb = 1e6;
    row(t, "host pages / KV (MB)", [&](const Pass &p) {
      std::string s = fixed(p.fin.pages_used * p.fin.page_bytes / mb, 0) + " / " + fixed(p.kv_bytes() / mb, 0);
      if (p.o.host_budget) s += " (budget " + fixed(p.o.host_budget / mb, 0) + ")";
      return s;
    });
    row(t, "cold pages on disk", [&](const Pass &p) {
      if (!p.spills()) return std::string("-");
      return std::to_string(p.fin.spill_cold_pages) + " (" + fixed(p.fin.spill_cold_pages * p.fin.page_bytes / mb, 0) +
             " MB, io " + (p.fin.spill_io & WKV_SPILL_IO_URING ? "io_uring" : "pread") +
             (p.fin.spill_io & WKV_SPILL_IO_DIRECT ? "+direct" : "") + ")";
    });
    row(t, "spill written / read (MB)", [&](const Pass &p) {
      if (!p.spills()) return std::string("-");
      return fixed(p.fin.spill_bytes_written / mb, 0) + " / " + fixed(p.fin.spill_bytes_read / mb, 0);
    });
    row(t, "read back while decoding", [&](const Pass &p) {
      if (!p.spills()) return std::string("-");
      const double s = p.decode_s();
      return fixed(p.read_back() / mb, 1) + " MB, " + fixed(s > 0 ? p.read_back() / s / mb : 0, 1) +
             " MB/s over the steps' time";
    });
    row(t, "retrievals estimated: on disk", [&](const Pass &p) {
      if (!p.spills()) return std::string("-");
      return std::to_string(p.estimated_on_disk()) + " of " + std::to_string(p.estimated_on_disk() + p.retrievals()) +
             " (" + std::to_string(p.fin.spill_read_errors) + " read errors)";
    });
  }
  return t.str();
}

}  // namespace

int run_demo(const Options &o) {
  validate(o, "demo");
  if (o.compare_in_memory && o.spill_dir.empty() && !o.host_budget)
    throw UsageError("demo: --compare-in-memory needs --host-budget (the pass it is compared with)");
  const unsigned threads = o.resolved_threads();
  WorkerPool pool(threads);
  const auto t_start = Clock::now();
  std::vector<Pass> passes;
  if (o.compare_in_memory) {
    // The anchor first, its engine gone before the budgeted one is made:
    // the same seed gives the same context and queries.
    Options mem = o;
    mem.host_budget = 0;
    mem.spill_dir.clear();
    mem.save.clear();
    std::fprintf(stderr, "pass 1 of 2: everything in memory\n");
    passes.push_back(run_pass(mem, threads, pool));
    std::fprintf(stderr, "pass 2 of 2: host budget %.0f MiB\n", o.host_budget / 1048576.0);
  }
  passes.push_back(run_pass(o, threads, pool));
  const Pass &r = passes.back();
  const double total_s = seconds_since(t_start);

  if (o.json) {
    nlohmann::ordered_json j = json_of(r);
    j["total_s"] = total_s;
    if (passes.size() > 1) j["in_memory"] = json_of(passes.front());
    std::cout << j.dump() << std::endl;
    return 0;
  }
  std::cout << table_of(passes);
  std::printf("errors: relative L2 against exact attention in f64, per (step, q head): %zu of them; exact = the\n"
              "f32 CPU baseline (timed on layer 0, times the layers); oracle top-k = exact attention over the tokens with the highest logits for each\n"
              "q head, as many as wavekv attended exactly per kv head (the best any selection that size can do)\n",
              r.err_wkv.size());
  if (passes.size() > 1)
    std::printf("the same context and queries (seed %llu) twice in this run: first with everything in memory, then under the budget\n",
                static_cast<unsigned long long>(o.seed));
  std::printf("demo took %.1f s\n", total_s);
  for (const Pass &p : passes)
    std::printf("speedup vs exact%s: %.1fx\n", passes.size() > 1 ? (", " + p.label()).c_str() : "", p.speedup());
  return 0;
}

}  // namespace wkv_tool
