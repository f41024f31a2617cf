// `wavekv bench files`: save and load bandwidth of one long sequence
// against the same disk's sequential write and read bandwidth, measured by
// dd in the same run. The sequence is built in a CPU engine through the
// internal API (for the progress of save and load), saved durably (fsync,
// rename, directory fsync), dropped from the page cache, loaded back, and
// checked to decode bit for bit as before.
//
// Page cache: after an fsync the file's pages are clean, and
// posix_fadvise(DONTNEED) drops them, so both loads and dd's read come from
// the disk; no root, nothing else dropped.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "lib/engine/engine.hpp"
#include "lib/engine/plan.hpp"
#include "lib/engine/sequence.hpp"
#include "tools/commands.hpp"
#include "tools/exact.hpp"
#include "tools/synth.hpp"

extern char **environ;

namespace wkv_tool {

void declare_bench_files(CLI::App &cmd, Options *o) {
  // 32 layers of 2 KV heads, d=128, f16 at 128K tokens: 4 GiB of K and V,
  // what this shape's file holds (a model of 8 KV heads holds 4 times that).
  o->tokens = 131072;
  o->layers = 32;
  o->heads = 2;
  o->q_heads = 8;
  o->file = ".";
  cmd.add_option("--dir", o->file, "directory of the files (on the disk to measure)")->capture_default_str();
  cmd.add_option("--tokens", o->tokens, "tokens per layer")->check(CLI::Range(256, 1 << 24))->capture_default_str();
  cmd.add_option("--layers", o->layers, "layers")->check(CLI::Range(1, 4096))->capture_default_str();
  cmd.add_option("--heads", o->heads, "KV heads")->check(CLI::Range(1, 256))->capture_default_str();
  cmd.add_option("--q-heads", o->q_heads, "query heads (a multiple of --heads)")->check(CLI::Range(1, 1024))->capture_default_str();
  cmd.add_option("--head-dim", o->head_dim, "head dimension")->check(CLI::IsMember({64, 80, 96, 128, 256}))->capture_default_str();
  cmd.add_option("--dtype", o->dtype, "storage dtype")->check(CLI::IsMember({"f16", "bf16", "f32"}))->capture_default_str();
  cmd.add_option("--threads", o->threads, "engine threads; 0 = all cores")->capture_default_str();
  cmd.add_option("--seed", o->seed, "seed of the synthetic context")->capture_default_str();
  cmd.add_flag("--keep", o->keep, "keep the files");
  cmd.add_flag("--json", o->json, "print one JSON object instead of the table");
}

namespace {

void ok(const wkv::Status &st, const char *what) {
  if (!st.is_ok()) throw WkvError(std::string(what) + ": " + st.message());
}

// Runs a program (no shell: the paths are arguments, never interpreted);
// returns its wall seconds.
double run_timed(std::vector<std::string> args) {
  std::vector<char *> argv;
  for (std::string &a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const auto t0 = Clock::now();
  pid_t pid = 0;
  if (posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0)
    throw WkvError("cannot run " + args[0]);
  int status = 0;
  if (waitpid(pid, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw WkvError(args[0] + " failed");
  return seconds_since(t0);
}

// Drops a file's clean pages from the page cache.
void drop_cache(const std::string &path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw WkvError("cannot open " + path);
  const int r = posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  if (r != 0) throw WkvError("posix_fadvise failed on " + path);
}

uint64_t file_size(const std::string &path) {
  uint64_t n = 0;
  const int fd = wkv::posix_io().open_read(path.c_str());
  if (fd >= 0) {
    wkv::posix_io().size(fd, &n);
    wkv::posix_io().close(fd);
  }
  return n;
}

// One decoding step of every layer in `layers` (internal API): the outputs.
std::vector<uint8_t> decode(wkv::Engine &e, const std::shared_ptr<wkv::Sequence> &s, const std::vector<uint32_t> &layers,
                            const std::vector<uint8_t> &q) {
  std::shared_ptr<wkv::StepTracker> t;
  ok(e.buffers().new_tracker(&t), "a plan's tracker");
  wkv::Plan plan(e.shared_from_this(), t);
  std::vector<uint8_t> all;
  for (uint32_t l : layers) {
    std::vector<uint8_t> out(q.size());
    ok(e.lookup(plan, &s, 1, l, q.data(), 0, e.config().c.head_dim, nullptr), "lookup");
    ok(e.assemble(plan, nullptr), "assemble");
    ok(e.attend(plan, out.data(), 0, e.config().c.head_dim, nullptr, nullptr), "attend");
    all.insert(all.end(), out.begin(), out.end());
  }
  return all;
}

}  // namespace

int run_bench_files(const Options &o) {
  if (o.q_heads % o.heads != 0) throw UsageError("bench files: --q-heads must be a multiple of --heads");
  const unsigned threads = o.resolved_threads();
  const uint32_t H = static_cast<uint32_t>(o.heads), d = static_cast<uint32_t>(o.head_dim), dt = o.dtype_id();
  const uint32_t L = static_cast<uint32_t>(o.layers);
  const std::string path = o.file + "/wavekv-bench-files.wkv", dd_path = o.file + "/wavekv-bench-files.dd";
  WorkerPool pool(threads);

  // 1. One synthetic layer's context, appended to every layer.
  wkv_config c;
  wkv_config_init(&c);
  c.n_layers = L;
  c.n_q_heads = static_cast<uint32_t>(o.q_heads);
  c.n_kv_heads = H;
  c.head_dim = d;
  c.dtype = dt;
  c.threads = threads;
  std::shared_ptr<wkv::Engine> e;
  ok(wkv::Engine::open(&c, &e), "opening the engine");
  SynthSpec spec;
  spec.kv_heads = H;
  spec.q_heads = c.n_q_heads;
  spec.head_dim = d;
  spec.dtype = dt;
  spec.prompt_tokens = spec.capacity = o.tokens;
  spec.seed = o.seed;
  spec.keep_f32 = false;
  SynthContext ctx(spec);
  ctx.generate(o.tokens, &pool);
  std::shared_ptr<wkv::Sequence> seq;
  ok(wkv::Sequence::create(e, &seq), "creating the sequence");
  {
    Progress p("ingesting layers", L);
    const int64_t head_stride = static_cast<int64_t>(ctx.head_stride() * d);
    for (uint32_t l = 0; l < L; ++l) {
      for (uint64_t done = 0; done < o.tokens;) {
        const uint32_t m = static_cast<uint32_t>(std::min<uint64_t>(8192, o.tokens - done));
        ok(e->append(*seq, l, static_cast<const uint8_t *>(ctx.k_store(0, done)),
                     static_cast<const uint8_t *>(ctx.v_store(0, done)), m, d, head_stride, nullptr),
           "append");
        done += m;
      }
      ok(e->end_prompt(*seq, l, nullptr), "end of the prompt");
      p.update(l + 1);
    }
    p.finish();
  }
  std::vector<uint8_t> q;
  std::vector<float> q32;
  std::vector<int> needle_of;
  ctx.make_queries(false, 0, &q, &q32, &needle_of);
  const std::vector<uint32_t> probe = {0, L - 1};
  const std::vector<uint8_t> before = decode(*e, seq, probe, q);

  // 2. Save (durable), drop the file from the page cache, load.
  double save_s = 0, load_s = 0;
  {
    Progress p("saving layers", L);
    const auto t0 = Clock::now();
    ok(e->save(*seq, e->io(), path, 0, [&](uint64_t done, uint64_t) { p.update(done); }), "saving");
    save_s = seconds_since(t0);
    p.finish();
  }
  const uint64_t bytes = file_size(path);
  seq.reset();  // its memory is the load's
  drop_cache(path);
  {
    Progress p("loading layers", L);
    const auto t0 = Clock::now();
    ok(e->load(e->io(), path, &seq, [&](uint64_t done, uint64_t) { p.update(done); }), "loading");
    load_s = seconds_since(t0);
    p.finish();
  }
  const bool same = decode(*e, seq, probe, q) == before;

  // 3. dd on the same disk: the same bytes written (fsync at the end), then
  //    read back from the disk.
  const double dd_write_s = run_timed({"dd", "if=" + path, "of=" + dd_path, "bs=1M", "conv=fsync", "status=none"});
  drop_cache(dd_path);
  const double dd_read_s = run_timed({"dd", "if=" + dd_path, "of=/dev/null", "bs=1M", "status=none"});
  if (!o.keep) {
    ::unlink(path.c_str());
    ::unlink(dd_path.c_str());
  }

  const double gb = bytes / 1e9;
  if (o.json) {
    const nlohmann::ordered_json j = {
        {"command", "bench files"}, {"tokens", o.tokens},        {"layers", L},
        {"kv_heads", H},            {"head_dim", d},             {"dtype", o.dtype},
        {"threads", threads},       {"file_bytes", bytes},       {"decodes_as_before", same},
        {"save_s", save_s},         {"save_gbps", gb / save_s},  {"load_s", load_s},
        {"load_gbps", gb / load_s}, {"dd_write_s", dd_write_s}, {"dd_write_gbps", gb / dd_write_s},
        {"dd_read_s", dd_read_s},   {"dd_read_gbps", gb / dd_read_s}};
    std::cout << j.dump() << std::endl;
  } else {
    std::printf("wavekv bench files: %llu tokens x %u layers, %u kv heads, d=%u, %s, %u threads, CPU engine; %s\n",
                static_cast<unsigned long long>(o.tokens), L, H, d, o.dtype.c_str(), threads, o.file.c_str());
    Table t;
    t.row({"", "seconds", "GB/s", "against dd"});
    t.row({"save (fsync, rename)", fixed(save_s, 2), fixed(gb / save_s, 3), fixed(dd_write_s / save_s, 2) + "x"});
    t.row({"dd write (conv=fsync)", fixed(dd_write_s, 2), fixed(gb / dd_write_s, 3), ""});
    t.row({"load (from disk)", fixed(load_s, 2), fixed(gb / load_s, 3), fixed(dd_read_s / load_s, 2) + "x"});
    t.row({"dd read (from disk)", fixed(dd_read_s, 2), fixed(gb / dd_read_s, 3), ""});
    std::cout << t.str();
    std::printf("file: %.3f GB; the loaded sequence decodes %s\n", gb, same ? "bit for bit as before" : "DIFFERENTLY");
  }
  return same ? 0 : 1;
}

}  // namespace wkv_tool
