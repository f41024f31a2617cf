// `wavekv bench manager`: the buffer manager's thread against a stream of
// decoding steps, on the host. The manager runs as in an engine (its
// thread, policy, reserve, quarantine, pool); this command plays the
// device's side as a gather would: each step reads a layer's working set,
// logs the units it finds in the cache as hits, takes a frame from the pool
// for each unit it misses and maps it, then ends. Steps come every
// --step-us (a serving step's length on the GPU); the figure is the
// manager's time a record against that interval: a load at or above 1 says
// the manager falls behind, and steps find fewer free frames (the GPU's
// "frames given" drops below its misses). Unit map clears are host stores
// here, not a device kernel and its wait: the clear's share on a GPU is
// the serving benchmark's "buffer manager" line.
//
// Workload, as the serving benchmark's queries: per layer (a record key),
// the set of units the layer's last step read; the next step reads it
// again with --misses of its units replaced by units never read before
// (a query close to the last one), and every --repeat steps of the layer
// the query changes topic and the step reads --hits + --misses units
// never read. The defaults are the serving benchmark's batch 7 at 128K
// tokens (bench/RESULTS.md): a 5% cache of 230K frames, 20400 units a
// layer-step of which 2000 new, a topic held 8 steps (about 4500 misses
// a layer-step on average), 56 runs a step (7 sequences x 8 KV heads), 4
// layers, 600 us a step.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "lib/buffer/buffer_manager.hpp"
#include "lib/buffer/host_device.hpp"
#include "lib/buffer/replacement.hpp"
#include "tools/commands.hpp"

namespace wkv_tool {

namespace {

struct Result {
  std::string policy;
  uint64_t steps = 0;
  double wall_s = 0;
  uint64_t hits = 0, misses = 0;  // as the steps found them
  // What opening a step's record cost the decoding thread (us), each step:
  // the manager's lock, and the releases and publication it may do.
  std::vector<double> open_us;
  wkv::BufferManager::Stats stats;
};

Result run_policy(const Options &o, const std::string &policy) {
  // Each layer's units live in a region of the unit map; fresh ones come
  // from a cursor that wraps (a unit read again after a wrap misses, as a
  // unit evicted long ago would). The map is declared before the manager:
  // its thread clears entries in it until the manager is destroyed.
  const uint32_t L = static_cast<uint32_t>(o.layers), H = static_cast<uint32_t>(o.hits),
                 M = static_cast<uint32_t>(o.misses);
  const uint64_t region = std::max<uint64_t>(4 * (o.frames + H + M), 1u << 20);
  if (region * L > UINT32_MAX)
    throw UsageError("bench manager: --frames, --hits and --misses times --layers need more than 2^32 units");
  std::vector<uint32_t> unit_map(region * L, wkv::kNoFrame);

  wkv::HostDevice dev;
  wkv::BufferManager::Options mo;
  mo.units = static_cast<uint32_t>(o.frames);
  mo.policy = policy;
  wkv::BufferManager bm(mo, &dev);
  ok(bm.start(), "starting the buffer manager");
  std::shared_ptr<wkv::StepTracker> t;
  ok(bm.new_tracker(&t), "a tracker");
  // Each layer's step covers --heads runs (a batch's sequences times its KV
  // heads), each run a head of the cache: unit u of a layer belongs to run
  // u % heads, as the gather logs its admissions by run.
  const uint32_t R = static_cast<uint32_t>(o.heads);
  std::vector<std::vector<uint64_t>> head_words(L, std::vector<uint64_t>(R));
  for (auto &words : head_words)
    for (uint64_t &w : words) {
      uint32_t gen = 0;
      const uint32_t id = bm.head_created(&gen);
      w = (static_cast<uint64_t>(id) << 32) | gen;
    }

  std::vector<std::vector<uint32_t>> last(L);  // what each layer's last step read
  std::vector<uint64_t> cursor(L, 0);
  std::mt19937_64 rng(o.seed);
  auto fresh = [&](uint32_t l) { return static_cast<uint32_t>(l * region + cursor[l]++ % region); };

  Result r;
  r.policy = policy;
  const wkv::FramePool pool = bm.pool();
  const auto interval = std::chrono::microseconds(o.step_us);
  const auto t0 = Clock::now();
  auto next = t0;
  for (uint64_t s = 0; s < o.steps; ++s) {
    const uint32_t l = static_cast<uint32_t>(s % L);
    // What the step reads: the layer's last set with M units new, or a new
    // topic.
    std::vector<uint32_t> &reads = last[l];
    if ((s / L) % o.repeat == 0) {
      reads.clear();
      for (uint32_t i = 0; i < H + M; ++i) reads.push_back(fresh(l));
    } else {
      for (uint32_t i = 0; i < M; ++i) reads[rng() % reads.size()] = fresh(l);
    }
    const uint64_t epoch = bm.begin(*t);
    const auto opening = Clock::now();
    const wkv::StepRecord rec =
        bm.open_record(*t, epoch, head_words[l].data(), R, std::min<uint32_t>(H + M, mo.max_admits), H + M, l + 1);
    r.open_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - opening).count());
    wkv::BufferManager::reading_on_host(*t, epoch);
    uint32_t used = 0, missed = 0, hits = 0;
    bool dry = false;  // the pool ran out: the step's other misses are not admitted
    for (uint32_t u : reads) {
      const uint32_t f = __atomic_load_n(&unit_map[u], __ATOMIC_RELAXED);
      if (f != wkv::kNoFrame) {
        if (rec.header && hits < rec.hit_cap) rec.hits[hits] = f;
        ++hits;
        continue;
      }
      ++missed;
      if (!rec.header || used == rec.admit_cap || dry) continue;
      const wkv::AdmitEntry a = wkv::admit_on_host(pool, &unit_map[u], static_cast<uint32_t>((u - l * region) % R));
      rec.admits[used++] = a;
      dry = a.frame == wkv::kNoFrame;
    }
    if (rec.header) wkv::close_record_on_host(rec, pool, used, hits, missed);
    bm.end_on_host(*t, epoch);
    r.hits += hits;
    r.misses += missed;
    next += interval;
    std::this_thread::sleep_until(next);
  }
  r.wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  r.steps = o.steps;
  if (!bm.quiesce(60000)) throw WkvError("bench manager: the buffer manager did not take every record within 60 s");
  r.stats = bm.stats();
  for (const auto &words : head_words)
    for (uint64_t w : words) bm.head_destroyed(static_cast<uint32_t>(w >> 32));
  return r;
}

}  // namespace

void declare_bench_manager(CLI::App &cmd, Options *o) {
  o->frames = 230000;
  o->hits = 18400;
  o->misses = 2000;
  o->repeat = 8;
  o->layers = 4;
  o->steps = 4000;
  o->step_us = 600;
  o->policy = "lru,clock";
  o->heads = 56;
  cmd.add_option("--frames", o->frames, "device cache frames")->check(CLI::Range(64, 1 << 26))->capture_default_str();
  cmd.add_option("--hits", o->hits, "units a step reads again from its layer's last step")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  cmd.add_option("--misses", o->misses, "units a step reads for the first time (all of them at a change of topic)")
      ->check(CLI::Range(0, 16384))
      ->capture_default_str();
  cmd.add_option("--repeat", o->repeat, "steps of a layer a topic lasts")->check(CLI::Range(1, 1000000))->capture_default_str();
  cmd.add_option("--heads", o->heads, "runs a step covers (sequences x KV heads), each its own cache head")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  cmd.add_option("--layers", o->layers, "layers (record keys), stepped in turn")->check(CLI::Range(1, 4096))->capture_default_str();
  cmd.add_option("--steps", o->steps, "steps")->check(CLI::Range(1, 10000000))->capture_default_str();
  cmd.add_option("--step-us", o->step_us, "microseconds from one step's start to the next's (0: back to back)")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  cmd.add_option("--policy", o->policy, "replacement policies, comma-separated (lru, clock, slru)")->capture_default_str();
  cmd.add_option("--seed", o->seed, "seed of the workload")->check(unsigned_text())->capture_default_str();
  cmd.add_flag("--json", o->json, "print one JSON object instead of the table");
}

int run_bench_manager(const Options &o) {
  std::vector<std::string> policies;
  {
    std::stringstream ss(o.policy);
    for (std::string p; std::getline(ss, p, ',');) {
      if (!wkv::make_policy(p, 1)) throw UsageError("bench manager: --policy: '" + p + "' is not a replacement policy");
      policies.push_back(p);
    }
  }
  if (policies.empty()) throw UsageError("bench manager: --policy names no policy");
  std::vector<Result> results;
  for (const std::string &p : policies) results.push_back(run_policy(o, p));

  auto per_record_us = [](const Result &r, uint64_t ns) {
    return r.stats.records_taken ? ns / 1e3 / r.stats.records_taken : 0.0;
  };
  auto load = [&](const Result &r) {
    // The manager's time a record over the time a step had.
    const double step_us = r.wall_s * 1e6 / r.steps;
    return per_record_us(r, r.stats.busy_ns) / step_us;
  };
  if (o.json) {
    nlohmann::ordered_json runs = nlohmann::ordered_json::array();
    for (const Result &r : results) {
      const auto &s = r.stats;
      runs.push_back({{"policy", r.policy},
                      {"steps", r.steps},
                      {"wall_s", r.wall_s},
                      {"hit_ratio", double(r.hits) / std::max<uint64_t>(1, r.hits + r.misses)},
                      {"missed", s.missed},
                      {"given", s.given},
                      {"admissions", s.admissions},
                      {"evictions", s.evictions},
                      {"records_taken", s.records_taken},
                      {"dropped_records", s.dropped_records},
                      {"passes", s.passes},
                      {"busy_us_a_record", per_record_us(r, s.busy_ns)},
                      {"take_us_a_record", per_record_us(r, s.take_ns)},
                      {"victims_us_a_record", per_record_us(r, s.victims_ns)},
                      {"clear_us_a_record", per_record_us(r, s.clear_ns)},
                      {"release_us_a_record", per_record_us(r, s.release_ns)},
                      {"publish_us_a_record", per_record_us(r, s.publish_ns)},
                      {"load", load(r)},
                      {"step_releases", s.step_releases},
                      {"open_record_us_median", quantile(r.open_us, 0.5)},
                      {"open_record_us_p99", quantile(r.open_us, 0.99)}});
    }
    const nlohmann::ordered_json j = {{"command", "bench manager"}, {"frames", o.frames}, {"hits", o.hits},
                                      {"misses", o.misses},         {"repeat", o.repeat}, {"heads", o.heads}, {"layers", o.layers}, {"step_us", o.step_us},
                                      {"runs", runs}};
    std::cout << j.dump() << std::endl;
    return 0;
  }
  std::printf("wavekv bench manager: %llu frames, %llu units read again + %llu new a step, a topic for %llu steps, "
              "%llu runs a step, %llu layers, a step every %llu us, %llu steps (host device: clears are host stores)\n",
              static_cast<unsigned long long>(o.frames), static_cast<unsigned long long>(o.hits),
              static_cast<unsigned long long>(o.misses), static_cast<unsigned long long>(o.repeat),
              static_cast<unsigned long long>(o.heads), static_cast<unsigned long long>(o.layers),
              static_cast<unsigned long long>(o.step_us), static_cast<unsigned long long>(o.steps));
  Table t;
  t.row({"policy", "hit ratio", "admitted / missed", "us a record", "taking", "victims", "clearing", "releasing",
         "publishing", "records a pass", "load", "open_record us (median, p99)", "steps releasing"});
  for (const Result &r : results) {
    const auto &s = r.stats;
    t.row({r.policy, fixed(double(r.hits) / std::max<uint64_t>(1, r.hits + r.misses), 3),
           fixed(double(s.admissions) / std::max<uint64_t>(1, s.missed), 3), fixed(per_record_us(r, s.busy_ns), 1),
           fixed(per_record_us(r, s.take_ns), 1), fixed(per_record_us(r, s.victims_ns), 1),
           fixed(per_record_us(r, s.clear_ns), 1), fixed(per_record_us(r, s.release_ns), 1),
           fixed(per_record_us(r, s.publish_ns), 1), fixed(double(s.records_taken) / std::max<uint64_t>(1, s.passes), 2),
           fixed(load(r), 2), fixed(quantile(r.open_us, 0.5), 1) + ", " + fixed(quantile(r.open_us, 0.99), 1),
           fixed(100.0 * s.step_releases / std::max<uint64_t>(1, r.steps), 1) + "%"});
  }
  std::cout << t.str();
  std::printf("load: the manager's time a record over the interval between steps (1 or more: it falls behind); "
              "open_record: the decoding thread's time to open a step's record\n");
  return 0;
}

}  // namespace wkv_tool
