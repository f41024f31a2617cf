// `wavekv stats`: an engine's statistics after a small synthetic session,
// as wkv_engine_stats_json (pretty, or raw with --json) and as a table of
// wkv_engine_stats.
#include <cstdio>
#include <iostream>
#include <memory>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "tools/commands.hpp"
#include "tools/exact.hpp"
#include "tools/synth.hpp"

namespace wkv_tool {

void declare_stats(CLI::App &cmd, Options *o) {
  o->tokens = 4096;
  o->steps = 4;
  add_shape_flags(cmd, o, true);
  cmd.add_option("--save", o->save, "save the sequence to this file at the end (wkv_seq_save)");
}

namespace {

std::string stats_table(const wkv_stats &s) {
  Table t;
  t.row({"statistic", "value"});
  t.row({"device", s.device == WKV_DEVICE_CUDA ? "cuda" : "cpu"});
  t.row({"sequences", std::to_string(s.sequences)});
  t.row({"tokens (all layers)", std::to_string(s.tokens)});
  t.row({"segments", std::to_string(s.segments)});
  t.row({"clusters", std::to_string(s.clusters)});
  t.row({"host reserved", mib(s.host_bytes_reserved)});
  t.row({"host used", mib(s.host_bytes_used)});
  t.row({"host budget", s.host_budget_bytes ? mib(s.host_budget_bytes) : "unlimited"});
  t.row({"page slot", std::to_string(s.page_bytes) + " B"});
  t.row({"pages used / free", std::to_string(s.pages_used) + " / " + std::to_string(s.pages_free)});
  t.row({"steady zone", mib(s.steady_bytes)});
  t.row({"meta index", mib(s.meta_bytes)});
  t.row({"lookups", std::to_string(s.lookups)});
  const double per = s.lookups ? 1.0 / s.lookups : 0.0;
  t.row({"retrieved clusters", std::to_string(s.retrieved_clusters) + " (" +
                                   fixed(s.retrieved_clusters * per, 1) + " per lookup)"});
  t.row({"estimated clusters", std::to_string(s.estimated_clusters) + " (" +
                                   fixed(s.estimated_clusters * per, 1) + " per lookup)"});
  t.row({"attended tokens", std::to_string(s.attended_tokens) + " (" + fixed(s.attended_tokens * per, 1) +
                                " per lookup)"});
  t.row({"cache hits / misses", std::to_string(s.cache_hits) + " / " + std::to_string(s.cache_misses)});
  t.row({"device cache", mib(s.device_cache_bytes)});
  t.row({"cache admissions / evictions",
         std::to_string(s.cache_admissions) + " / " + std::to_string(s.cache_evictions)});
  t.row({"cache frames given / records dropped",
         std::to_string(s.cache_frames_given) + " / " + std::to_string(s.cache_records_dropped)});
  t.row({"k-means time", fixed(s.kmeans_ns * 1e-9, 3) + " s"});
  t.row({"growths deferred / waited for",
         std::to_string(s.growths_deferred) + " / " + std::to_string(s.growth_waits)});
  t.row({"decode graphs", std::to_string(s.decode_graphs)});
  return t.str();
}

}  // namespace

int run_stats(const Options &o) {
  validate(o, "stats");
  const unsigned threads = o.resolved_threads();
  const uint32_t H = static_cast<uint32_t>(o.heads), Q = static_cast<uint32_t>(o.q_heads);
  const uint32_t d = static_cast<uint32_t>(o.head_dim), dt = o.dtype_id();
  WorkerPool pool(threads);
  Session s(o, threads);

  // One context per layer (seeded apart), ingested, then `steps` decoding
  // steps over every layer, each appending one generated token first.
  std::vector<std::unique_ptr<SynthContext>> ctx;
  for (uint32_t l = 0; l < o.layers; ++l) {
    SynthSpec spec;
    spec.kv_heads = H;
    spec.q_heads = Q;
    spec.head_dim = d;
    spec.dtype = dt;
    spec.prompt_tokens = o.tokens;
    spec.capacity = o.tokens + o.steps;
    spec.seed = o.seed + 0x9e3779b97f4a7c15ull * l;
    spec.keep_f32 = false;
    ctx.push_back(std::make_unique<SynthContext>(spec));
    ctx[l]->generate(o.tokens, &pool);
    const std::string label = "ingesting layer " + std::to_string(l);
    ingest(s, *ctx[l], l, 0, o.tokens, label.c_str());
  }
  std::vector<uint8_t> q_store, out(static_cast<size_t>(Q) * d * dtype_size(dt));
  std::vector<float> q32;
  std::vector<int> needle_of;
  for (uint32_t step = 0; step < o.steps; ++step) {
    for (uint32_t l = 0; l < o.layers; ++l) {
      SynthContext &c = *ctx[l];
      if (step > 0) {
        const uint64_t pos = c.tokens();
        c.generate(1, nullptr);
        check(wkv_seq_append(s.seq, l, c.k_store(0, pos), c.v_store(0, pos), 1, d,
                             static_cast<int64_t>(c.head_stride() * d), nullptr),
              "wkv_seq_append");
      }
      c.make_queries(step % 2 == 1, step / 2, &q_store, &q32, &needle_of);
      check(wkv_decode(s.plan, &s.seq, 1, l, q_store.data(), 0, 0, out.data(), 0, 0, nullptr), "wkv_decode");
    }
  }
  if (!o.save.empty()) save_sequence(s, o.save);
  char *json = nullptr;
  check(wkv_engine_stats_json(s.engine, &json), "wkv_engine_stats_json");
  std::string text(json);
  wkv_free(json);
  if (o.json) {
    std::cout << text << std::endl;
    return 0;
  }
  std::cout << stats_table(s.stats()) << '\n' << nlohmann::json::parse(text).dump(2) << std::endl;
  return 0;
}

}  // namespace wkv_tool
