// `wavekv bench files`: save and load bandwidth of one long sequence
// against the same disk's sequential write and read bandwidth, measured by
// dd in the same run. `wavekv bench spill`: eviction to the spill file and
// restore of the same sequence against fio's O_DIRECT bandwidth on the same
// disk, same request size and queue depth, in the same run. The sequence is built in a CPU engine through the
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
#include <fstream>
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

namespace {
void declare_sequence_flags(CLI::App &cmd, Options *o) {
  cmd.add_option("--tokens", o->tokens, "tokens per layer")->check(CLI::Range(256, 1 << 24))->capture_default_str();
  cmd.add_option("--layers", o->layers, "layers")->check(CLI::Range(1, 4096))->capture_default_str();
  cmd.add_option("--heads", o->heads, "KV heads")->check(CLI::Range(1, 256))->capture_default_str();
  cmd.add_option("--q-heads", o->q_heads, "query heads (a multiple of --heads)")->check(CLI::Range(1, 1024))->capture_default_str();
  cmd.add_option("--head-dim", o->head_dim, "head dimension")->check(CLI::IsMember({64, 80, 96, 128, 256}))->capture_default_str();
  cmd.add_option("--dtype", o->dtype, "storage dtype")->check(CLI::IsMember({"f16", "bf16", "f32"}))->capture_default_str();
  cmd.add_option("--threads", o->threads, "engine threads; 0 = all cores")->check(CLI::Range(0, 1024))->capture_default_str();
  cmd.add_option("--seed", o->seed, "seed of the synthetic context")->check(unsigned_text())->capture_default_str();
  cmd.add_flag("--json", o->json, "print one JSON object instead of the table");
}
}  // namespace

void declare_bench_spill(CLI::App &cmd, Options *o) {
  o->tokens = 131072;
  o->layers = 16;
  o->heads = 2;
  o->q_heads = 8;
  o->file = ".";
  cmd.add_option("--dir", o->file, "spill directory (on the disk to measure; needs fio on PATH)")->capture_default_str();
  declare_sequence_flags(cmd, o);
}

void declare_bench_files(CLI::App &cmd, Options *o) {
  // 32 layers of 2 KV heads, d=128, f16 at 128K tokens: 4 GiB of K and V,
  // what this shape's file holds (a model of 8 KV heads holds 4 times that).
  o->tokens = 131072;
  o->layers = 32;
  o->heads = 2;
  o->q_heads = 8;
  o->file = ".";
  cmd.add_option("--dir", o->file, "directory of the files (on the disk to measure)")->capture_default_str();
  declare_sequence_flags(cmd, o);
  cmd.add_flag("--keep", o->keep, "keep the files");
}

namespace {

// Runs a program (no shell: the paths are arguments, never interpreted);
// returns its wall seconds.
// With `out`, its standard output goes to that file.
double run_timed(std::vector<std::string> args, const std::string &out = "") {
  std::vector<char *> argv;
  for (std::string &a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (!out.empty()) posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  const auto t0 = Clock::now();
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (spawned != 0)
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

// One synthetic layer's context, appended to every layer of a new sequence
// of a new CPU engine (`spill_dir` set when given); the queries of a step.
struct BenchSequence {
  std::shared_ptr<wkv::Engine> e;
  std::shared_ptr<wkv::Sequence> seq;
  std::vector<uint8_t> q;
};

BenchSequence build_sequence(const Options &o, const char *cmd, const std::string &spill_dir = "") {
  if (o.q_heads % o.heads != 0) throw UsageError(std::string(cmd) + ": --q-heads must be a multiple of --heads");
  const unsigned threads = o.resolved_threads();
  const uint32_t H = static_cast<uint32_t>(o.heads), d = static_cast<uint32_t>(o.head_dim), dt = o.dtype_id();
  const uint32_t L = static_cast<uint32_t>(o.layers);
  WorkerPool pool(threads);
  wkv_config c;
  wkv_config_init(&c);
  if (!spill_dir.empty()) c.spill_dir = spill_dir.c_str();
  c.n_layers = L;
  c.n_q_heads = static_cast<uint32_t>(o.q_heads);
  c.n_kv_heads = H;
  c.head_dim = d;
  c.dtype = dt;
  c.threads = threads;
  BenchSequence b;
  std::shared_ptr<wkv::Engine> &e = b.e;
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
  std::shared_ptr<wkv::Sequence> &seq = b.seq;
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
  std::vector<float> q32;
  std::vector<int> needle_of;
  ctx.make_queries(false, 0, &b.q, &q32, &needle_of);
  return b;
}

}  // namespace

int run_bench_files(const Options &o) {
  const unsigned threads = o.resolved_threads();
  const uint32_t H = static_cast<uint32_t>(o.heads), d = static_cast<uint32_t>(o.head_dim);
  const uint32_t L = static_cast<uint32_t>(o.layers);
  const std::string path = o.file + "/wavekv-bench-files.wkv", dd_path = o.file + "/wavekv-bench-files.dd";
  // 1. The sequence.
  BenchSequence b = build_sequence(o, "bench files");
  std::shared_ptr<wkv::Engine> e = b.e;
  std::shared_ptr<wkv::Sequence> seq = b.seq;
  const std::vector<uint8_t> &q = b.q;
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

int run_bench_spill(const Options &o) {
  const unsigned threads = o.resolved_threads();
  const uint32_t L = static_cast<uint32_t>(o.layers);
  const std::string fio_file = "wavekv-bench-spill.fio", fio_out = o.file + "/wavekv-bench-spill.json";
  BenchSequence b = build_sequence(o, "bench spill", o.file);
  wkv::Engine &e = *b.e;
  const std::vector<uint32_t> probe = {0, L - 1};
  const std::vector<uint8_t> before = decode(e, b.seq, probe, b.q);

  // 1. Evict (every page to the spill file), restore (read back, checked).
  wkv_stats s0;
  wkv_stats_init(&s0);
  e.fill_stats(&s0);
  auto t0 = Clock::now();
  ok(e.evict(*b.seq), "evicting");
  const double evict_s = seconds_since(t0);
  wkv_stats s1;
  wkv_stats_init(&s1);
  e.fill_stats(&s1);
  t0 = Clock::now();
  ok(e.restore(*b.seq), "restoring");
  const double restore_s = seconds_since(t0);
  wkv_stats s2;
  wkv_stats_init(&s2);
  e.fill_stats(&s2);
  const bool same = decode(e, b.seq, probe, b.q) == before;
  const uint64_t bytes = s1.spill_bytes_written - s0.spill_bytes_written;
  const uint64_t read = s2.spill_bytes_read - s1.spill_bytes_read;

  // 2. fio on the same directory: the same bytes, requests of 1 MiB, 8 in
  //    flight (the spill file's), written then read; O_DIRECT as the spill
  //    file is (not on tmpfs, which refuses it to both).
  const bool direct = (s1.spill_io & WKV_SPILL_IO_DIRECT) != 0;
  auto fio = [&](const char *rw) {
    run_timed({"fio", "--name=wavekv", "--directory=" + o.file, "--filename=" + fio_file, std::string("--rw=") + rw,
               "--bs=1M", "--iodepth=" + std::to_string(wkv::SpillFile::kQueueDepth), direct ? "--direct=1" : "--direct=0",
               "--ioengine=io_uring", "--size=" + std::to_string(bytes / (1 << 20) * (1 << 20)),
               "--output-format=json"},
              fio_out);
    std::ifstream in(fio_out);
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    const char *side = rw[0] == 'w' ? "write" : "read";
    if (j.is_discarded() || !j.contains("jobs") || j["jobs"].empty())
      throw WkvError("fio's output could not be read (" + fio_out + ")");
    return j["jobs"][0][side]["bw_bytes"].get<double>() / 1e9;
  };
  const double fio_write = fio("write"), fio_read = fio("read");
  ::unlink((o.file + "/" + fio_file).c_str());
  ::unlink(fio_out.c_str());

  const double gb = bytes / 1e9, write_gbps = gb / evict_s, read_gbps = read / 1e9 / restore_s;
  const std::string io = std::string(s1.spill_io & WKV_SPILL_IO_URING ? "io_uring" : "pread/pwrite") +
                         (e.spill()->registered_buffers() ? " (registered buffers)" : "") +
                         (s1.spill_io & WKV_SPILL_IO_DIRECT ? ", O_DIRECT" : ", page cache");
  if (o.json) {
    const nlohmann::ordered_json j = {
        {"command", "bench spill"},     {"tokens", o.tokens},           {"layers", L},
        {"kv_heads", o.heads},          {"head_dim", o.head_dim},       {"dtype", o.dtype},
        {"threads", threads},           {"spill_io", io},               {"bytes", bytes},
        {"decodes_as_before", same},    {"evict_s", evict_s},           {"evict_gbps", write_gbps},
        {"restore_s", restore_s},       {"restore_gbps", read_gbps},    {"fio_write_gbps", fio_write},
        {"fio_read_gbps", fio_read},    {"host_bytes_freed", (s0.pages_used - s1.pages_used) * s0.page_bytes}};
    std::cout << j.dump() << std::endl;
  } else {
    std::printf("wavekv bench spill: %llu tokens x %u layers, %lld kv heads, d=%lld, %s, CPU engine; %s (%s)\n",
                static_cast<unsigned long long>(o.tokens), L, static_cast<long long>(o.heads),
                static_cast<long long>(o.head_dim), o.dtype.c_str(), o.file.c_str(), io.c_str());
    Table t;
    t.row({"", "seconds", "GB/s", "against fio"});
    t.row({"evict (write extents)", fixed(evict_s, 2), fixed(write_gbps, 3), fixed(write_gbps / fio_write, 2) + "x"});
    t.row({direct ? "fio write (O_DIRECT, 1M x 8)" : "fio write (1M x 8)", "", fixed(fio_write, 3), ""});
    t.row({"restore (read, checksums)", fixed(restore_s, 2), fixed(read_gbps, 3), fixed(read_gbps / fio_read, 2) + "x"});
    t.row({direct ? "fio read (O_DIRECT, 1M x 8)" : "fio read (1M x 8)", "", fixed(fio_read, 3), ""});
    std::cout << t.str();
    std::printf("spilled %.3f GB (host pages freed: %.3f GB); the restored sequence decodes %s\n", gb,
                (s0.pages_used - s1.pages_used) * double(s0.page_bytes) / 1e9,
                same ? "bit for bit as before" : "DIFFERENTLY");
  }
  return same ? 0 : 1;
}

}  // namespace wkv_tool
