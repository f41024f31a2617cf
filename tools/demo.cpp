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
      ->transform(CLI::AsSizeValue(false));
  cmd.add_option("--repeat", o->repeat,
                 "steps each query holds for (temporal locality, as in real decoding; 1: every step a new one)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  cmd.add_option("--spill-dir", o->spill_dir, "directory of the engine's spill file (wkv_config.spill_dir)");
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

// Whether KV head h's run of the plan's execution buffer holds `row`.
bool run_holds(const wkv_xbuf_view &x, uint32_t h, const void *row, size_t row_bytes) {
  const uint8_t *k = static_cast<const uint8_t *>(x.k);
  for (int32_t t = x.offsets[h]; t < x.offsets[h + 1]; ++t)
    if (std::memcmp(k + static_cast<size_t>(t) * row_bytes, row, row_bytes) == 0) return true;
  return false;
}

std::string hits(uint64_t hit, uint64_t of) { return std::to_string(hit) + "/" + std::to_string(of); }

}  // namespace

int run_demo(const Options &o) {
  validate(o, "demo");
  const unsigned threads = o.resolved_threads();
  const uint32_t H = static_cast<uint32_t>(o.heads), Q = static_cast<uint32_t>(o.q_heads);
  const uint32_t d = static_cast<uint32_t>(o.head_dim), dt = o.dtype_id();
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(dt);
  WorkerPool pool(threads);
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
  const double append_s = ingest_layers(s, ctx, L, 0, o.tokens, "ingesting");
  std::vector<uint8_t> q_store;
  std::vector<float> q32;
  std::vector<int> needle_of;
  ctx.make_queries(false, 0, &q_store, &q32, &needle_of);
  auto t0 = Clock::now();
  for (uint32_t l = 0; l < L; ++l)
    check(wkv_lookup(s.plan, &s.seq, 1, l, q_store.data(), 0, 0, nullptr), "wkv_lookup");
  const double finish_s = seconds_since(t0);
  const wkv_stats built = s.stats();
  const uint32_t sink = s.config.sink_tokens, window = s.config.window_tokens;

  // 3. Decode.
  ExactAttention exact(pool, dt, H, Q, d);
  std::vector<uint8_t> out_store(static_cast<size_t>(Q) * d * dtype_size(dt));
  std::vector<float> out_wkv(static_cast<size_t>(Q) * d), out_exact(static_cast<size_t>(Q) * d);
  std::vector<double> ref(static_cast<size_t>(Q) * d), sw(static_cast<size_t>(Q) * d);
  std::vector<float> sw_f(static_cast<size_t>(Q) * d);
  std::vector<double> wkv_ms, exact_ms, err_wkv, err_sw, err_exact, err_wkv_needle, err_sw_needle;
  std::vector<double> needle_share, sink_share, top_share;
  uint64_t needle_queries = 0, wkv_hits = 0, sw_hits = 0, oracle_hits = 0;
  uint64_t prev_attended = built.attended_tokens;
  std::vector<double> err_oracle, err_oracle_needle;
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
      wkv_ms.push_back(seconds_since(t0) * 1e3);
    } else {
      check(wkv_lookup(s.plan, &s.seq, 1, 0, q_store.data(), 0, 0, nullptr), "wkv_lookup");
      check(wkv_assemble(s.plan, nullptr), "wkv_assemble");
      check(wkv_attend(s.plan, out_store.data(), 0, 0, nullptr, nullptr), "wkv_attend");
      check(wkv_update(s.plan, nullptr), "wkv_update");
      wkv_ms.push_back(seconds_since(t0) * 1e3);
      wkv_xbuf_view x;
      wkv_xbuf_view_init(&x);
      check(wkv_plan_xbuf(s.plan, &x), "wkv_plan_xbuf");
      for (uint32_t j = 0; j < Q; ++j) {
        if (needle_of[j] < 0) continue;
        const Needle &nd = ctx.needles()[needle_of[j]];
        in_xbuf[j] = run_holds(x, nd.head, ctx.k_store(nd.head, nd.pos), row_bytes);
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
      wkv_ms.back() += seconds_since(t0) * 1e3;
    }
    from_storage(dt, out_store.data(), out_wkv.data(), out_wkv.size());
    // Tokens this step attended exactly, per KV head: the oracle's budget.
    const wkv_stats now = s.stats();
    const uint64_t budget = (now.attended_tokens - prev_attended) / H / L;
    prev_attended = now.attended_tokens;

    // The exact baseline, timed.
    t0 = Clock::now();
    exact.run(ctx.k_store(0, 0), ctx.v_store(0, 0), ctx.head_stride(), n, q32.data(), out_exact.data());
    exact_ms.push_back(seconds_since(t0) * 1e3 * L);  // every layer is this one's size

    // References in double: all tokens, and sink + window only.
    Probe probe;
    probe.sink_tokens = sink;
    probe.oracle_budget = std::max<uint64_t>(budget, 1);
    probe.probe_pos.assign(Q, -1);
    for (uint32_t j = 0; j < Q; ++j)
      if (needle_of[j] >= 0) probe.probe_pos[j] = static_cast<int64_t>(ctx.needles()[needle_of[j]].pos);
    attend_f64(pool, ctx.k32(0, 0), ctx.v32(0, 0), ctx.head_stride(), {{0, n}}, H, Q, d, q32.data(),
               ref.data(), &probe);
    const uint64_t w0 = n > window ? std::max<uint64_t>(n - window, sink) : sink;
    std::vector<Range> sw_ranges{{0, std::min<uint64_t>(sink, n)}};
    if (w0 < n) sw_ranges.push_back({w0, n});
    attend_f64(pool, ctx.k32(0, 0), ctx.v32(0, 0), ctx.head_stride(), sw_ranges, H, Q, d, q32.data(),
               sw.data(), nullptr);
    for (size_t i = 0; i < sw.size(); ++i) sw_f[i] = static_cast<float>(sw[i]);
    for (size_t i = 0; i < sw.size(); ++i) oracle_f[i] = static_cast<float>(probe.oracle_out[i]);

    for (uint32_t j = 0; j < Q; ++j) {
      const size_t off = static_cast<size_t>(j) * d;
      for (const std::vector<float> &ol : out_layers) err_wkv.push_back(rel_l2(&ol[off], &ref[off], d));
      const double ew = rel_l2(&out_wkv[off], &ref[off], d);
      const double es = rel_l2(&sw_f[off], &ref[off], d);
      err_wkv.push_back(ew);
      err_sw.push_back(es);
      const double eo = rel_l2(&oracle_f[off], &ref[off], d);
      err_exact.push_back(rel_l2(&out_exact[off], &ref[off], d));
      err_oracle.push_back(eo);
      if (needle_of[j] >= 0) {
        err_oracle_needle.push_back(eo);
        oracle_hits += probe.probe_in_oracle[j];
        const Needle &nd = ctx.needles()[needle_of[j]];
        ++needle_queries;
        wkv_hits += in_xbuf[j];
        sw_hits += nd.pos < sink || nd.pos >= w0;
        needle_share.push_back(probe.probe_share[j]);
        err_wkv_needle.push_back(ew);
        err_sw_needle.push_back(es);
      } else {
        sink_share.push_back(probe.sink_share[j]);
        top_share.push_back(probe.top_share[j]);
      }
    }
    prog.update(step + 1);
  }
  prog.finish();
  const wkv_stats fin = s.stats();
  if (!o.save.empty()) save_sequence(s, o.save);
  const double lookups = static_cast<double>(fin.lookups - built.lookups);
  const double att_per_head = (fin.attended_tokens - built.attended_tokens) / lookups / H;
  const double ret_per_head = (fin.retrieved_clusters - built.retrieved_clusters) / lookups / H;
  const double est_per_head = (fin.estimated_clusters - built.estimated_clusters) / lookups / H;
  const uint64_t clusters_per_head = built.clusters / H / L;
  // The spill tier while decoding: what the steps read back and estimated.
  const double decode_s = std::accumulate(wkv_ms.begin(), wkv_ms.end(), 0.0) * 1e-3;
  const uint64_t read_back = fin.spill_bytes_read - built.spill_bytes_read;
  const uint64_t kv_bytes = (fin.pages_used + fin.spill_cold_pages) * fin.page_bytes;
  const uint64_t retrievals = fin.retrieved_clusters - built.retrieved_clusters;
  const uint64_t estimated_on_disk = fin.spill_estimated - built.spill_estimated;
  const double build_s = append_s + finish_s;
  const double kmeans_s = built.kmeans_ns * 1e-9;
  const double w_med = median(wkv_ms), e_med = median(exact_ms);
  const double speedup = e_med / w_med;
  const double total_s = seconds_since(t_start);
  const uint64_t final_tokens = ctx.tokens();

  // 4. Report.
  if (o.json) {
    const nlohmann::ordered_json j = {{"command", "demo"}, {"tokens", o.tokens}, {"generated", final_tokens - o.tokens}, {"kv_heads", H}, {"q_heads", Q}, {"head_dim", d}, {"dtype", o.dtype}, {"threads", threads}, {"steps", o.steps}, {"seed", o.seed}, {"workload", o.workload}, {"repeat", o.repeat}, {"method", method_name(s.config.method)}, {"documents", ctx.documents()}, {"topics", spec.topics}, {"segments_per_head", built.segments / H}, {"clusters_per_head", clusters_per_head}, {"index_build_s", build_s}, {"append_s", append_s}, {"prompt_finish_s", finish_s}, {"kmeans_s", kmeans_s}, {"wavekv", {{"step_ms_median", w_med}, {"step_ms_p90", quantile(wkv_ms, 0.9)}, {"rel_l2_median", median(err_wkv)}, {"rel_l2_p90", quantile(err_wkv, 0.9)}, {"rel_l2_needle_median", median(err_wkv_needle)}, {"needle_hits", wkv_hits}, {"needle_queries", needle_queries}, {"attended_tokens_per_head", att_per_head}, {"retrieved_clusters_per_head", ret_per_head}, {"estimated_clusters_per_head", est_per_head}}}, {"sink_window", {{"rel_l2_median", median(err_sw)}, {"rel_l2_p90", quantile(err_sw, 0.9)}, {"rel_l2_needle_median", median(err_sw_needle)}, {"needle_hits", sw_hits}, {"needle_queries", needle_queries}, {"attended_tokens_per_head", std::min<uint64_t>(final_tokens, sink + window)}}}, {"exact", {{"step_ms_median", e_med}, {"step_ms_p90", quantile(exact_ms, 0.9)}, {"rel_l2_median", median(err_exact)}, {"rel_l2_p90", quantile(err_exact, 0.9)}, {"needle_share_median", median(needle_share)}, {"sink_share_median", median(sink_share)}, {"top_share_median", median(top_share)}, {"attended_tokens_per_head", final_tokens}}}, {"oracle_top_k", {{"rel_l2_median", median(err_oracle)}, {"rel_l2_p90", quantile(err_oracle, 0.9)}, {"rel_l2_needle_median", median(err_oracle_needle)}, {"needle_hits", oracle_hits}, {"needle_queries", needle_queries}}}, {"speedup", speedup}, {"total_s", total_s}, {"layers", L}, {"spill", {{"host_budget_bytes", o.host_budget}, {"kv_page_bytes", kv_bytes}, {"host_page_bytes", fin.pages_used * fin.page_bytes}, {"cold_pages", fin.spill_cold_pages}, {"bytes_written", fin.spill_bytes_written}, {"bytes_read", fin.spill_bytes_read}, {"bytes_read_decoding", read_back}, {"read_mb_per_s_decoding", decode_s > 0 ? read_back / decode_s / 1e6 : 0.0}, {"retrievals_estimated_on_disk", estimated_on_disk}, {"retrievals_exact", retrievals}, {"read_errors", fin.spill_read_errors}, {"io", fin.spill_io}}}};
    std::cout << j.dump() << std::endl;
    return 0;
  }
  Table t;
  t.row({"metric", "wavekv", "sink+window", "exact", "oracle top-k"});
  t.row({"tokens", std::to_string(o.tokens) + " + " + std::to_string(final_tokens - o.tokens) + " generated"});
  t.row({"shape", std::to_string(L) + " layer" + (L > 1 ? "s, " : ", ") + std::to_string(H) + " kv heads, " + std::to_string(Q) + " q heads, d=" + std::to_string(d) +
                      ", " + o.dtype + ", " + std::to_string(threads) + " threads"});
  t.row({"workload / method", o.workload + " / " + method_name(s.config.method) +
                                   (o.repeat > 1 ? ", each query for " + std::to_string(o.repeat) + " steps" : "")});
  t.row({"documents / topics", std::to_string(ctx.documents()) + " / " + std::to_string(spec.topics)});
  t.row({"clusters (per kv head)", std::to_string(clusters_per_head)});
  t.row({"index build (s)", fixed(build_s, 2) + " (k-means " + fixed(kmeans_s, 2) + ")"});
  t.row({"attended tokens (per kv head)", fixed(att_per_head, 0),
         std::to_string(std::min<uint64_t>(final_tokens, sink + window)), std::to_string(final_tokens),
         fixed(att_per_head, 0) + " per q head"});
  t.row({"  retrieved / estimated clusters", fixed(ret_per_head, 0) + " / " + fixed(est_per_head, 0)});
  t.row({"step time (ms, median)", fixed(w_med, 2), "-", fixed(e_med, 2)});
  t.row({"step time (ms, p90)", fixed(quantile(wkv_ms, 0.9), 2), "-", fixed(quantile(exact_ms, 0.9), 2)});
  t.row({"rel. L2 error (median)", fixed(median(err_wkv), 4), fixed(median(err_sw), 4),
         fixed(median(err_exact), 6), fixed(median(err_oracle), 4)});
  t.row({"rel. L2 error (p90)", fixed(quantile(err_wkv, 0.9), 4), fixed(quantile(err_sw, 0.9), 4),
         fixed(quantile(err_exact, 0.9), 6), fixed(quantile(err_oracle, 0.9), 4)});
  t.row({"rel. L2 error, needle queries", fixed(median(err_wkv_needle), 4), fixed(median(err_sw_needle), 4),
         "-", fixed(median(err_oracle_needle), 4)});
  t.row({"needle hit rate", hits(wkv_hits, needle_queries), hits(sw_hits, needle_queries),
         hits(needle_queries, needle_queries), hits(oracle_hits, needle_queries)});
  t.row({"needle share of attention", "", "", fixed(median(needle_share), 3)});
  t.row({"sink share of attention", "", "", fixed(median(sink_share), 3)});
  t.row({"top 1.8% share of attention", "", "", fixed(median(top_share), 3)});
  if (!o.spill_dir.empty() || o.host_budget) {
    const double mb = 1e6;
    t.row({"host pages / KV (MB)", fixed(fin.pages_used * fin.page_bytes / mb, 0) + " / " + fixed(kv_bytes / mb, 0) +
                                       " (budget " + fixed(o.host_budget / mb, 0) + ")"});
    t.row({"cold pages on disk", std::to_string(fin.spill_cold_pages) + " (" +
                                     fixed(fin.spill_cold_pages * fin.page_bytes / mb, 0) + " MB, io " +
                                     (fin.spill_io & WKV_SPILL_IO_URING ? "io_uring" : "pread") +
                                     (fin.spill_io & WKV_SPILL_IO_DIRECT ? "+direct" : "") + ")"});
    t.row({"spill written / read (MB)", fixed(fin.spill_bytes_written / mb, 0) + " / " +
                                            fixed(fin.spill_bytes_read / mb, 0)});
    t.row({"read back while decoding", fixed(read_back / mb, 1) + " MB, " +
                                           fixed(decode_s > 0 ? read_back / decode_s / mb : 0, 1) +
                                           " MB/s over the steps' time"});
    t.row({"retrievals estimated: on disk", std::to_string(estimated_on_disk) + " of " +
                                                std::to_string(estimated_on_disk + retrievals) + " (" +
                                                std::to_string(fin.spill_read_errors) + " read errors)"});
  }
  std::cout << t.str();
  std::printf("errors: relative L2 against exact attention in f64, per (step, q head): %zu of them; exact = the\n"
              "f32 CPU baseline (timed on layer 0, times the layers); oracle top-k = exact attention over the tokens with the highest logits for each\n"
              "q head, as many as wavekv attended exactly per kv head (the best any selection that size can do)\n",
              err_wkv.size());
  std::printf("demo took %.1f s\n", total_s);
  std::printf("speedup vs exact: %.1fx\n", speedup);
  return 0;
}

}  // namespace wkv_tool
