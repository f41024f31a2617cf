// `wavekv bench`: the decode benchmark. Per layer decoding step time of
// wavekv against the exact CPU attention baseline over every token, both
// measured in the same run on the same context and threads, and the error
// of wavekv against that baseline.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "tools/commands.hpp"
#include "tools/exact.hpp"
#include "tools/synth.hpp"

namespace wkv_tool {

void declare_bench(CLI::App &cmd, Options *o) {
  o->tokens = 131072;
  o->steps = 20;
  add_shape_flags(cmd, o, false);
}

int run_bench(const Options &o) {
  validate(o, "bench");
  const unsigned threads = o.resolved_threads();
  const uint32_t H = static_cast<uint32_t>(o.heads), Q = static_cast<uint32_t>(o.q_heads);
  const uint32_t d = static_cast<uint32_t>(o.head_dim), dt = o.dtype_id();
  WorkerPool pool(threads);
  const auto t_start = Clock::now();

  // 1. The context (the demo's generator) and its ingestion.
  SynthSpec spec;
  spec.kv_heads = H;
  spec.q_heads = Q;
  spec.head_dim = d;
  spec.dtype = dt;
  spec.prompt_tokens = o.tokens;
  spec.capacity = o.tokens + o.steps + 1;
  spec.seed = o.seed;
  spec.keep_f32 = false;
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
  Session s(o, threads);
  const double append_s = ingest(s, ctx, 0, 0, o.tokens, "ingesting");
  std::vector<uint8_t> q_store;
  std::vector<float> q32;
  std::vector<int> needle_of;
  ctx.make_queries(false, 0, &q_store, &q32, &needle_of);
  auto t0 = Clock::now();
  check(wkv_lookup(s.plan, &s.seq, 1, 0, q_store.data(), 0, 0, nullptr), "wkv_lookup");
  const double finish_s = seconds_since(t0);
  const wkv_stats built = s.stats();

  // 2. One untimed step of each, so that first-touch allocations of the
  //    plan and the baseline's scratch are not measured.
  // The baseline runs its own AVX2 kernel where the CPU has one; the
  // library's kernel is timed beside it for reference.
  ExactAttention exact(pool, dt, H, Q, d), exact_lib(pool, dt, H, Q, d);
  exact_lib.use_library_kernel(true);
  const bool lib_differs = exact.fast();
  std::vector<uint8_t> out_store(static_cast<size_t>(Q) * d * dtype_size(dt));
  std::vector<float> out_wkv(static_cast<size_t>(Q) * d), out_exact(static_cast<size_t>(Q) * d);
  std::vector<float> out_lib(static_cast<size_t>(Q) * d);
  std::vector<double> ref(static_cast<size_t>(Q) * d);
  check(wkv_decode(s.plan, &s.seq, 1, 0, q_store.data(), 0, 0, out_store.data(), 0, 0, nullptr), "wkv_decode");
  exact.run(ctx.k_store(0, 0), ctx.v_store(0, 0), ctx.head_stride(), ctx.tokens(), q32.data(), out_exact.data());
  const wkv_stats warm = s.stats();

  // 3. Decoding steps: append the generated token, then wavekv and the
  //    exact baseline over the same context and queries.
  std::vector<double> wkv_ms, exact_ms, exact_lib_ms, append_ms, err;
  Progress prog("decoding", o.steps);
  for (uint32_t step = 0; step < o.steps; ++step) {
    const uint64_t pos = ctx.tokens();
    ctx.generate(1, nullptr);
    t0 = Clock::now();
    check(wkv_seq_append(s.seq, 0, ctx.k_store(0, pos), ctx.v_store(0, pos), 1, d,
                         static_cast<int64_t>(ctx.head_stride() * d), nullptr),
          "wkv_seq_append");
    append_ms.push_back(seconds_since(t0) * 1e3);
    ctx.make_queries(step % 2 == 1, step / 2, &q_store, &q32, &needle_of);

    t0 = Clock::now();
    check(wkv_decode(s.plan, &s.seq, 1, 0, q_store.data(), 0, 0, out_store.data(), 0, 0, nullptr),
          "wkv_decode");
    wkv_ms.push_back(seconds_since(t0) * 1e3);

    t0 = Clock::now();
    exact.run(ctx.k_store(0, 0), ctx.v_store(0, 0), ctx.head_stride(), ctx.tokens(), q32.data(),
              out_exact.data());
    exact_ms.push_back(seconds_since(t0) * 1e3);
    if (lib_differs) {
      t0 = Clock::now();
      exact_lib.run(ctx.k_store(0, 0), ctx.v_store(0, 0), ctx.head_stride(), ctx.tokens(), q32.data(),
                    out_lib.data());
      exact_lib_ms.push_back(seconds_since(t0) * 1e3);
    }

    from_storage(dt, out_store.data(), out_wkv.data(), out_wkv.size());
    std::copy(out_exact.begin(), out_exact.end(), ref.begin());
    for (uint32_t j = 0; j < Q; ++j)
      err.push_back(rel_l2(&out_wkv[static_cast<size_t>(j) * d], &ref[static_cast<size_t>(j) * d], d));
    prog.update(step + 1);
  }
  prog.finish();
  const wkv_stats fin = s.stats();

  // 4. Where a wavekv step goes: the same steps through the split API.
  std::vector<double> lookup_ms, assemble_ms, attend_ms, update_ms;
  for (uint32_t step = 0; step < o.steps; ++step) {
    ctx.make_queries(step % 2 == 1, step / 2, &q_store, &q32, &needle_of);
    t0 = Clock::now();
    check(wkv_lookup(s.plan, &s.seq, 1, 0, q_store.data(), 0, 0, nullptr), "wkv_lookup");
    auto t1 = Clock::now();
    check(wkv_assemble(s.plan, nullptr), "wkv_assemble");
    auto t2 = Clock::now();
    check(wkv_attend(s.plan, out_store.data(), 0, 0, nullptr, nullptr), "wkv_attend");
    auto t3 = Clock::now();
    check(wkv_update(s.plan, nullptr), "wkv_update");
    auto t4 = Clock::now();
    auto ms = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double>(b - a).count() * 1e3;
    };
    lookup_ms.push_back(ms(t0, t1));
    assemble_ms.push_back(ms(t1, t2));
    attend_ms.push_back(ms(t2, t3));
    update_ms.push_back(ms(t3, t4));
  }

  const double lookups = static_cast<double>(fin.lookups - warm.lookups);
  const double att_per_head = (fin.attended_tokens - warm.attended_tokens) / lookups / H;
  const double build_s = append_s + finish_s, kmeans_s = built.kmeans_ns * 1e-9;
  const double w_med = median(wkv_ms), e_med = median(exact_ms);
  // The baseline is the faster of the two exact kernels timed in this run.
  const double lib_med = lib_differs ? median(exact_lib_ms) : e_med;
  const bool lib_faster = lib_differs && lib_med < e_med;
  const char *base_kernel = lib_faster || !exact.fast() ? "kernels::attend_exact" : "tool avx2";
  const double ratio = (lib_faster ? lib_med : e_med) / w_med;
  const double total_s = seconds_since(t_start);
  // Bytes of K and V the baseline reads per step: its memory traffic.
  const double kv_gb = 2.0 * ctx.tokens() * H * d * dtype_size(dt) / 1e9;

  if (o.json) {
    const nlohmann::ordered_json j = {{"command", "bench"}, {"tokens", o.tokens}, {"kv_heads", H}, {"q_heads", Q}, {"head_dim", d}, {"dtype", o.dtype}, {"threads", threads}, {"steps", o.steps}, {"seed", o.seed}, {"clusters_per_head", built.clusters / H}, {"index_build_s", build_s}, {"append_s", append_s}, {"prompt_finish_s", finish_s}, {"kmeans_s", kmeans_s}, {"wavekv", {{"step_ms_median", w_med}, {"step_ms_p90", quantile(wkv_ms, 0.9)}, {"lookup_ms_median", median(lookup_ms)}, {"assemble_ms_median", median(assemble_ms)}, {"attend_ms_median", median(attend_ms)}, {"update_ms_median", median(update_ms)}, {"append_ms_median", median(append_ms)}, {"attended_tokens_per_head", att_per_head}, {"rel_l2_median", median(err)}, {"rel_l2_p90", quantile(err, 0.9)}}}, {"exact", {{"kernel", exact.fast() ? "tool avx2" : "kernels::attend_exact"}, {"baseline_kernel", base_kernel}, {"step_ms_median", e_med}, {"step_ms_p90", quantile(exact_ms, 0.9)}, {"library_kernel_step_ms_median", median(exact_lib_ms)}, {"kv_gbytes_per_step", kv_gb}}}, {"exact_over_wavekv", ratio}, {"total_s", total_s}};
    std::cout << j.dump() << std::endl;
    return 0;
  }
  std::printf("wavekv bench: %llu tokens, %u kv heads, %u q heads, d=%u, %s, %u threads, CPU engine, 1 layer\n",
              static_cast<unsigned long long>(o.tokens), H, Q, d, o.dtype.c_str(), threads);
  Table t;
  t.row({"", "median", "p90"});
  t.row({"wavekv step (ms)", fixed(w_med, 3), fixed(quantile(wkv_ms, 0.9), 3)});
  t.row({"  lookup", fixed(median(lookup_ms), 3), fixed(quantile(lookup_ms, 0.9), 3)});
  t.row({"  assemble", fixed(median(assemble_ms), 3), fixed(quantile(assemble_ms, 0.9), 3)});
  t.row({"  attend", fixed(median(attend_ms), 3), fixed(quantile(attend_ms, 0.9), 3)});
  t.row({"  update", fixed(median(update_ms), 3), fixed(quantile(update_ms, 0.9), 3)});
  t.row({"exact step (ms)", fixed(e_med, 3), fixed(quantile(exact_ms, 0.9), 3)});
  if (lib_differs)
    t.row({"  with kernels::attend_exact", fixed(median(exact_lib_ms), 3), fixed(quantile(exact_lib_ms, 0.9), 3)});
  t.row({"append 1 token (ms)", fixed(median(append_ms), 3), fixed(quantile(append_ms, 0.9), 3)});
  t.row({"rel. L2 error vs exact", fixed(median(err), 4), fixed(quantile(err, 0.9), 4)});
  std::cout << t.str();
  std::printf("index build: %.2f s (appends %.2f s + prompt finish %.2f s; k-means %.2f s), %llu clusters per kv head\n",
              build_s, append_s, finish_s, kmeans_s, static_cast<unsigned long long>(built.clusters / H));
  std::printf("attended exactly per kv head: %.0f of %llu tokens; exact baseline reads %.2f GB of K and V per step "
              "(%.1f GB/s)\n",
              att_per_head, static_cast<unsigned long long>(ctx.tokens()), kv_gb, kv_gb / (e_med * 1e-3));
  std::printf("exact baseline: the faster of the exact kernels timed, %s\n",
              lib_faster || !exact.fast() ? "the library's kernels::attend_exact"
                                          : "the tool's AVX2/F16C kernel (tools/exact.cpp)");
  std::printf("bench took %.1f s\n", total_s);
  std::printf("exact / wavekv: %.1fx\n", ratio);
  return 0;
}

}  // namespace wkv_tool
