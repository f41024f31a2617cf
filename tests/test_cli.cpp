// The wavekv command on sequence files and statistics files, run as a
// program: `verify` exits 0 (intact), 1 (corrupt) or 2 (unreadable) and
// names what it found; `inspect` describes a file and, on every corrupted,
// truncated, hostile or random file, reports and exits non-zero without
// crashing (the ASan build runs the same); `top` reads a running engine's
// statistics file.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "files_support.hpp"
#include "real_attention_data.hpp"

extern char **environ;

using namespace wkvtest;

namespace {

struct Outcome {
  bool exited = false;  // false: killed by a signal (a crash)
  int status = -1;
  std::string out;      // stdout and stderr
};

// Runs the wavekv command (built beside the tests: WKV_CLI) with `args`.
Outcome run_cli(std::vector<std::string> args) {
  args.insert(args.begin(), WKV_CLI);
  std::vector<char *> argv;
  for (std::string &a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int fds[2];
  Outcome r;
  if (pipe(fds) != 0) return r;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  close(fds[1]);
  if (rc == 0) {
    char buf[4096];
    for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) r.out.append(buf, static_cast<size_t>(n));
    int status = 0;
    waitpid(pid, &status, 0);
    r.exited = WIFEXITED(status);
    r.status = r.exited ? WEXITSTATUS(status) : -WTERMSIG(status);
  }
  close(fds[0]);
  return r;
}

// A saved sequence of the default shape.
std::string save_one(const ScratchDir &dir, uint32_t page_format = WKV_PAGE_FORMAT_STORAGE) {
  const Shape s;
  wkv_config c = file_config(s);
  c.page_format = page_format;
  wavekv::Engine e(c);
  wavekv::Sequence seq(e);
  Context ctx(s);
  fill(seq, s, ctx);
  const std::string path = dir.file("seq.wkv");
  seq.save(path);
  return path;
}

// Both commands on a file that is not intact: a report and status 1 or 2,
// never a crash.
void expect_reported(const std::string &path, const std::string &what) {
  for (const char *cmd : {"inspect", "verify"}) {
    for (bool json : {false, true}) {
      std::vector<std::string> args = {cmd, path};
      if (json) args.push_back("--json");
      const Outcome r = run_cli(args);
      ASSERT_TRUE(r.exited) << cmd << " crashed on " << what << ":\n" << r.out;
      EXPECT_TRUE(r.status == 1 || r.status == 2) << cmd << " on " << what << ": status " << r.status << "\n"
                                                  << r.out;
      if (json) {
        const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
        EXPECT_FALSE(j.is_discarded()) << cmd << " --json on " << what << ":\n" << r.out;
      }
    }
  }
}

}  // namespace

TEST(Cli, VerifyExitsZeroOneOrTwo) {
  ScratchDir dir;
  const std::string path = save_one(dir);
  Outcome r = run_cli({"verify", path});
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("intact (18 sections"), std::string::npos) << r.out;
  r = run_cli({"verify", path, "--json"});
  EXPECT_EQ(r.status, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["state"], "intact");
  EXPECT_EQ(j["intact"], 18);

  const std::vector<wkv::SectionInfo> sections = sections_of(path);
  std::vector<uint8_t> b = read_bytes(path);
  b[sections[7].offset + wkv::seqfile::kSectionHeaderBytes + 3] ^= 4;
  write_bytes(dir.file("bad.wkv"), b);
  r = run_cli({"verify", dir.file("bad.wkv")});
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find(wkv::section_name(7, sections[7]) + ": checksum mismatch"), std::string::npos) << r.out;

  r = run_cli({"verify", dir.file("missing.wkv")});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("No such file"), std::string::npos) << r.out;
  b = read_bytes(path);
  b[8] = 3;  // format 3, its preamble checked
  repair_checksums(b);
  write_bytes(dir.file("v3.wkv"), b);
  r = run_cli({"verify", dir.file("v3.wkv")});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("format version 3"), std::string::npos) << r.out;
  b[8] = 2;  // format 2 is 8-bit pages' only
  repair_checksums(b);
  write_bytes(dir.file("v2.wkv"), b);
  r = run_cli({"verify", dir.file("v2.wkv")});
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("format 2 without 8-bit pages"), std::string::npos) << r.out;
  r = run_cli({"verify"});
  EXPECT_EQ(r.status, 2) << "usage";
  // What is not a regular file is unreadable, at once (a FIFO without a
  // writer used to block the open for good).
  ASSERT_EQ(mkfifo(dir.file("fifo").c_str(), 0600), 0);
  for (const std::string &p : {dir.file("fifo"), dir.path()}) {
    r = run_cli({"verify", p});
    EXPECT_EQ(r.status, 2) << r.out;
    EXPECT_NE(r.out.find("not a regular file"), std::string::npos) << r.out;
  }
}

TEST(Cli, InspectDescribesAFile) {
  ScratchDir dir;
  const std::string path = save_one(dir);
  Outcome r = run_cli({"inspect", path});
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char *want : {"2 layers, 4 q heads, 2 kv heads, head_dim 64, f16", "18 of 18 sections intact",
                           "sequences", "790 tokens", "size min/med/max", "fill"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  r = run_cli({"inspect", path, "--json"});
  ASSERT_EQ(r.status, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["state"], "intact");
  EXPECT_EQ(j["format_version"], 1);
  EXPECT_EQ(j["shape"]["n_kv_heads"], 2);
  EXPECT_EQ(j["settings"]["segment_tokens"], 256);
  const nlohmann::json &layers = j["sequences"][0]["layers"];
  ASSERT_EQ(layers.size(), 2u);
  EXPECT_EQ(layers[0]["tokens"], 790);
  const nlohmann::json &head = layers[0]["heads"][1];
  uint64_t in_bins = 0;
  for (const auto &[bin, n] : head["cluster_size_histogram"].items()) in_bins += n.get<uint64_t>();
  EXPECT_EQ(in_bins, head["clusters"].get<uint64_t>());
  EXPECT_GT(head["page_fill"].get<double>(), 0.5);
  EXPECT_LE(head["page_fill"].get<double>(), 1.0);
  ASSERT_EQ(j["sections"].size(), 18u);
  for (const nlohmann::json &s : j["sections"]) EXPECT_EQ(s["state"], "ok");
}

TEST(Cli, InspectNamesThePageFormat) {
  ScratchDir dir;
  Outcome r = run_cli({"inspect", save_one(dir)});
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("slots of 4096 bytes, rows in f16"), std::string::npos) << r.out;
  const std::string path = save_one(dir, WKV_PAGE_FORMAT_INT8);
  r = run_cli({"inspect", path});
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("30 tokens (2048 bytes of K), slots of 4096 bytes, 8-bit rows with a scale each"),
            std::string::npos)
      << r.out;
  r = run_cli({"inspect", path, "--json"});
  ASSERT_EQ(r.status, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["format_version"], 2);
  EXPECT_EQ(j["settings"]["page_format"], "int8");
  EXPECT_EQ(j["settings"]["page_tokens"], 30);
  r = run_cli({"verify", path});
  EXPECT_EQ(r.status, 0) << r.out;
}

TEST(Cli, EveryCorruptionIsReportedWithoutACrash) {
  ScratchDir dir;
  const std::string path = save_one(dir);
  const std::vector<uint8_t> good = read_bytes(path);
  const std::vector<wkv::SectionInfo> sections = sections_of(path);
  const std::string bad = dir.file("bad.wkv");
  for (size_t n = 0; n < sections.size(); ++n) {
    const wkv::SectionInfo &s = sections[n];
    const uint64_t payload = s.offset + wkv::seqfile::kSectionHeaderBytes;
    std::vector<uint8_t> b = good;
    b[s.offset + 17] ^= 0x20;  // its length
    write_bytes(bad, b);
    expect_reported(bad, "a flipped header bit of " + wkv::section_name(n, s));
    b = good;
    b[payload + s.bytes / 2] ^= 0x01;
    write_bytes(bad, b);
    expect_reported(bad, "a flipped payload bit of " + wkv::section_name(n, s));
    write_bytes(bad, std::vector<uint8_t>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(payload + s.bytes / 2)));
    expect_reported(bad, "a cut inside " + wkv::section_name(n, s));
  }
  // Values changed and every checksum made to match: what only the checks
  // behind the checksums can refuse.
  for (size_t n = 0; n < sections.size(); ++n) {
    const wkv::SectionInfo &s = sections[n];
    if (s.kind != wkv::seqfile::Kind::kLayer && s.kind != wkv::seqfile::Kind::kMapping) continue;
    for (uint64_t at : {0, 4, 8, 12, 20, 28}) {
      if (at >= s.bytes) continue;
      std::vector<uint8_t> b = good;
      b[s.offset + wkv::seqfile::kSectionHeaderBytes + at] ^= 0x40;
      repair_checksums(b);
      write_bytes(bad, b);
      expect_reported(bad, "a hostile " + wkv::section_name(n, s));
    }
  }
}

TEST(Cli, RandomBytesAreReportedWithoutACrash) {
  ScratchDir dir;
  const std::string path = save_one(dir);
  const std::vector<uint8_t> good = read_bytes(path);
  std::mt19937_64 rng(11);
  for (size_t size : {0, 7, 16, 255, 288, 1000, 70000}) {
    std::vector<uint8_t> b(size);
    for (uint8_t &c : b) c = static_cast<uint8_t>(rng());
    write_bytes(dir.file("random"), b);
    expect_reported(dir.file("random"), std::to_string(size) + " random bytes");
    // The same behind a valid superblock: random sections.
    if (size < 288) continue;
    std::copy(good.begin(), good.begin() + 256, b.begin());
    repair_checksums(b);
    write_bytes(dir.file("random"), b);
    expect_reported(dir.file("random"), std::to_string(size) + " random bytes after a superblock");
  }
}

TEST(Cli, TopShowsAnEnginesStatisticsFile) {
  ScratchDir dir;
  const std::string stats = dir.file("stats.json");
  Outcome r = run_cli({"top", "--once", stats});
  EXPECT_EQ(r.status, 2) << "no file yet:\n" << r.out;
  wkv_config c = file_config(Shape{});
  c.stats_path = stats.c_str();
  c.stats_interval_ms = 20;
  wavekv::Engine e(c);
  wavekv::Sequence seq(e);
  Context ctx(Shape{});
  std::vector<uint8_t> k, v;
  ctx.tokens(50, &k, &v);
  seq.append(0, k.data(), v.data(), 50);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  r = run_cli({"top", "--once", stats});
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("50 (all layers)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cache hits / misses"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("device memory"), std::string::npos) << "a CPU engine's file has none:\n" << r.out;
  r = run_cli({"top", "--once", "--json", stats});
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(nlohmann::json::parse(r.out)["stats"]["tokens"], 50);
  // Not a terminal: one line per change.
  r = run_cli({"top", "--count", "3", "--interval", "10", stats});
  ASSERT_EQ(r.status, 0) << r.out;
  size_t lines = 0;
  for (char ch : r.out) lines += ch == '\n';
  EXPECT_EQ(lines, 3u) << r.out;
  EXPECT_NE(r.out.find("tokens=50"), std::string::npos) << r.out;
  write_bytes(dir.file("junk.json"), {'{', 'x'});
  EXPECT_EQ(run_cli({"top", "--once", dir.file("junk.json")}).status, 2);
}

// What no engine writes is not shown: a file nested thousands deep (valid
// JSON, whose printing with --json recursed off the stack) is no statistics
// file, and control characters in the device's name (a terminal's escape
// sequences) are not printed.
TEST(Cli, TopShowsNothingAnEngineDoesNotWrite) {
  ScratchDir dir;
  const size_t n = 100000;
  std::string deep = "{\"stats\":{},\"x\":" + std::string(n, '[') + std::string(n, ']') + "}";
  write_bytes(dir.file("deep.json"), std::vector<uint8_t>(deep.begin(), deep.end()));
  for (bool json : {false, true}) {
    std::vector<std::string> args = {"top", "--once", dir.file("deep.json")};
    if (json) args.push_back("--json");
    const Outcome r = run_cli(args);
    ASSERT_TRUE(r.exited) << r.out;
    EXPECT_EQ(r.status, 2) << r.out;
  }
  const std::string escape = "{\"config\":{\"device\":\"cpu\\u001b[2J\"},\"stats\":{\"tokens\":7}}";
  write_bytes(dir.file("escape.json"), std::vector<uint8_t>(escape.begin(), escape.end()));
  const Outcome r = run_cli({"top", "--once", dir.file("escape.json")});
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(r.out.find('\x1b'), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cpu?[2J"), std::string::npos) << r.out;
}

// Unsigned options refuse a negative number and one past 2^64 - 1, which
// CLI11 alone would take as 2^64 - 1: a seed, an unlimited host budget, a
// count that never ends, four billion threads.
TEST(Cli, UnsignedOptionsRefuseNegativeAndOverflowingNumbers) {
  const std::vector<std::vector<std::string>> bad = {
      {"demo", "--seed", "-1"},
      {"demo", "--seed", "18446744073709551616"},
      {"demo", "--host-budget", "-1"},
      {"demo", "--host-budget", "18446744073709551616"},
      {"demo", "--host-budget", "99999999999GiB"},
      {"top", "--count", "-1", "stats.json"},
      {"bench", "cache", "--threads", "-1"},
      {"bench", "files", "--threads", "-1"},
      {"bench", "manager", "--seed", "-7"}};
  for (const std::vector<std::string> &args : bad) {
    const Outcome r = run_cli(args);
    EXPECT_EQ(r.status, 2) << args[0] << " " << args[1] << " " << args[2] << ":\n" << r.out;
  }
}

// A CUDA engine's file (libwavekv 0.13 on) says where its memory is: top
// shows the device's and the meta index's share of it, and the host rows'
// pool where there is one. The file is written here, as such an engine's
// statistics thread would (no GPU needed to read one).
TEST(Cli, TopShowsWhereACudaEnginesMemoryIs) {
  ScratchDir dir;
  const std::string path = dir.file("cuda.json");
  const nlohmann::json j = {
      {"unix_ms", 1},
      {"config", {{"device", "cuda"}}},
      {"stats",
       {{"sequences", 1},
        {"tokens", 1000},
        {"meta_bytes", 3u << 20},
        {"device_cache_bytes", 64u << 20},
        {"device_bytes_reserved", 512u << 20},
        {"device_bytes_used", 384u << 20},
        {"meta_device_bytes", 1u << 20},
        {"meta_host_rows_reserved", 2u << 20}}}};
  const std::string text = j.dump();
  write_bytes(path, std::vector<uint8_t>(text.begin(), text.end()));
  const Outcome r = run_cli({"top", "--once", path});
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("(cuda engine)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("384.0 MiB used of 512.0 MiB reserved"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(1.0 MiB on the device)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("host meta rows' pool"), std::string::npos) << r.out;
}

// `wavekv bench spill` at a small size: the sequence goes to the spill file
// and back, decodes as before, and fio's figures stand beside it. Skips
// visibly without fio (the benchmark's anchor).
TEST(Cli, BenchSpillEvictsRestoresAndComparesWithFio) {
  bool have_fio = false;
  if (const char *path = std::getenv("PATH")) {
    std::string p = path;
    for (size_t at = 0; at <= p.size() && !have_fio;) {
      const size_t colon = std::min(p.find(':', at), p.size());
      have_fio = access((p.substr(at, colon - at) + "/fio").c_str(), X_OK) == 0;
      at = colon + 1;
    }
  }
  if (!have_fio) GTEST_SKIP() << "fio is not on PATH (bench spill measures against it)";
  ScratchDir dir;
  const Outcome r = run_cli({"bench", "spill", "--dir", dir.path(), "--tokens", "4096", "--layers", "2",
                             "--threads", "2", "--json"});
  ASSERT_TRUE(r.exited) << r.out;
  ASSERT_EQ(r.status, 0) << r.out;
  const std::string last = r.out.substr(r.out.rfind('{'));
  const nlohmann::json j = nlohmann::json::parse(last, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_TRUE(j["decodes_as_before"].get<bool>());
  EXPECT_GT(j["bytes"].get<uint64_t>(), 0u);
  EXPECT_GT(j["fio_write_gbps"].get<double>(), 0.0);
  EXPECT_GT(j["fio_read_gbps"].get<double>(), 0.0);
  EXPECT_EQ(j["bytes"].get<uint64_t>(), j["host_bytes_freed"].get<uint64_t>());
  EXPECT_TRUE(dir.names().empty()) << "the spill file and fio's leave nothing behind";
}

// `wavekv bench manager` at a small size: each policy's run takes every
// step's record, admits the misses the pool could serve, and reports its
// time a record; an unknown policy is a usage error.
TEST(Cli, BenchManagerTakesEveryRecordAndReportsItsLoad) {
  const Outcome r = run_cli({"bench", "manager", "--frames", "4096", "--hits", "300", "--misses", "100", "--layers",
                             "2", "--steps", "200", "--step-us", "200", "--policy", "lru,clock", "--json"});
  ASSERT_TRUE(r.exited) << r.out;
  ASSERT_EQ(r.status, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out.substr(r.out.rfind("{\"command\"")), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  ASSERT_EQ(j["runs"].size(), 2u);
  for (const auto &run : j["runs"]) {
    EXPECT_EQ(run["records_taken"].get<uint64_t>() + run["dropped_records"].get<uint64_t>(), 200u) << run.dump();
    EXPECT_GE(run["missed"].get<uint64_t>(), 200u * 100u) << "every step reads 100 units for the first time";
    EXPECT_GT(run["admissions"].get<uint64_t>(), 0u);
    EXPECT_LE(run["admissions"].get<uint64_t>(), run["given"].get<uint64_t>());
    EXPECT_GT(run["hit_ratio"].get<double>(), 0.0) << "the working set is read again";
    EXPECT_GT(run["busy_us_a_record"].get<double>(), 0.0);
    EXPECT_GT(run["open_record_us_p99"].get<double>(), 0.0);
    EXPECT_GE(run["open_record_us_p99"].get<double>(), run["open_record_us_median"].get<double>());
    EXPECT_GT(run["evictions"].get<uint64_t>(), 0u) << "new units keep coming: the cache turns over";
    EXPECT_GT(run["victims_us_a_record"].get<double>(), 0.0);
    EXPECT_GT(run["release_us_a_record"].get<double>(), 0.0);
    EXPECT_LE(run["take_us_a_record"].get<double>() + run["victims_us_a_record"].get<double>() +
                  run["clear_us_a_record"].get<double>() + run["release_us_a_record"].get<double>() +
                  run["publish_us_a_record"].get<double>(),
              run["busy_us_a_record"].get<double>() * 1.001)
        << "the parts of the manager's time are within its busy time";
  }
  const Outcome bad = run_cli({"bench", "manager", "--policy", "mru"});
  EXPECT_EQ(bad.status, 2) << bad.out;
  EXPECT_NE(bad.out.find("not a replacement policy"), std::string::npos) << bad.out;
}

// `wavekv bench cache` at a small size. Belady's optimum reads at least as
// much of the trace from the cache as the engine's LRU and CLOCK, LRU with
// the score-aware touches (lru+near) and its buffer manager at every size; its hits never fall as the cache grows (a
// stack algorithm); no policy hits a unit read for the first time; a
// step's misses are within what it retrieves. An unknown policy or a fraction
// outside (0, 1] is a usage error.
namespace {

void expect_bounded(const nlohmann::json &j, size_t fractions, const std::vector<std::string> &policies) {
  const size_t P = policies.size();
  ASSERT_EQ(j["runs"].size(), fractions * P) << j.dump();
  EXPECT_GT(j["units_read"].get<uint64_t>(), 0u);
  const double first = j["first_read_ratio"].get<double>(), retrieved = j["retrieved_mb_per_layer_step"].get<double>();
  EXPECT_GT(retrieved, 0.0);
  double last_opt = 0;
  for (size_t f = 0; f < fractions; ++f) {
    const nlohmann::json *opt = nullptr;
    for (size_t k = 0; k < P; ++k) {
      const nlohmann::json &r = j["runs"][f * P + k];
      ASSERT_EQ(r["policy"], policies[k]);
      if (policies[k] == "opt") opt = &r;
      EXPECT_LE(r["hit_ratio"].get<double>(), 1.0 - first + 1e-12) << r.dump();
      EXPECT_LE(r["missed_mb_per_layer_step"].get<double>(), retrieved * (1 + 1e-9)) << r.dump();
      EXPECT_GT(r["link_ms_per_layer_step"].get<double>(), 0.0) << r.dump();
    }
    ASSERT_NE(opt, nullptr);
    for (size_t k = 0; k < P; ++k)
      EXPECT_GE((*opt)["hit_ratio"].get<double>(), j["runs"][f * P + k]["hit_ratio"].get<double>())
          << "opt against " << policies[k] << " at fraction " << f;
    EXPECT_GE((*opt)["hit_ratio"].get<double>(), last_opt) << opt->dump();
    last_opt = (*opt)["hit_ratio"].get<double>();
  }
  EXPECT_GT(last_opt, 0.0) << "steps read again what the steps before them read";
}

}  // namespace

// (Under the sanitizers the command's index builds are a hundred times
// slower: a shorter context there, and the real set's first layer alone.)
#if defined(WKV_SANITIZED)
constexpr const char *kCacheTokens = "2048";
constexpr const char *kRealLayersRun = "1";
#else
constexpr const char *kCacheTokens = "8192";
constexpr const char *kRealLayersRun = "6";
#endif

TEST(Cli, BenchCacheBoundsEveryPolicyByTheOptimum) {
  const Outcome r = run_cli({"bench", "cache", "--tokens", kCacheTokens, "--steps", "96", "--repeat", "4",
                             "--fractions", "0.01,0.03,0.1,0.3", "--policy", "lru,clock,engine,lru+near,opt",
                             "--near", "2", "--step-us", "0", "--threads", "2", "--json"});
  ASSERT_TRUE(r.exited) << r.out;
  ASSERT_EQ(r.status, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out.substr(r.out.rfind("{\"command\"")), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["steps"], 96);
  expect_bounded(j, 4, {"lru", "clock", "engine", "lru+near", "opt"});
  // The engine's manager hands frames ahead and the steps admit into them.
  EXPECT_GT(j["runs"][3 * 5 + 2]["hit_ratio"].get<double>(), 0.0) << j["runs"][3 * 5 + 2].dump();
  // The near touches change what LRU keeps somewhere; with none (--near 0)
  // lru+near is lru, read for read.
  bool differs = false;
  for (size_t f = 0; f < 4; ++f) differs |= j["runs"][f * 5]["missed_units"] != j["runs"][f * 5 + 3]["missed_units"];
  EXPECT_TRUE(differs) << j.dump();
  const Outcome none = run_cli({"bench", "cache", "--tokens", kCacheTokens, "--steps", "24", "--repeat", "4",
                                "--fractions", "0.03", "--policy", "lru,lru+near", "--near", "0", "--threads", "2",
                                "--json"});
  ASSERT_EQ(none.status, 0) << none.out;
  const nlohmann::json n = nlohmann::json::parse(none.out.substr(none.out.rfind("{\"command\"")), nullptr, false);
  ASSERT_FALSE(n.is_discarded()) << none.out;
  EXPECT_EQ(n["runs"][0]["missed_units"], n["runs"][1]["missed_units"]) << n.dump();

  for (const std::vector<std::string> &bad : {std::vector<std::string>{"--policy", "mru"},
                                              std::vector<std::string>{"--policy", "opt+near"},
                                              std::vector<std::string>{"--near", "-1"},
                                              std::vector<std::string>{"--fractions", "0.05,1.5"},
                                              std::vector<std::string>{"--fractions", "x"}}) {
    std::vector<std::string> args = {"bench", "cache", "--tokens", "8192", "--steps", "4"};
    args.insert(args.end(), bad.begin(), bad.end());
    const Outcome u = run_cli(args);
    EXPECT_EQ(u.status, 2) << bad[0] << " " << bad[1] << ":\n" << u.out;
  }
}

// The same bounds on the real-attention set's retrieval (the layers of a
// real model, 64 steps), where the set is present.
TEST(Cli, BenchCacheOnRealAttention) {
  const std::string dir = real_attention::data_dir();
  std::vector<uint16_t> raw;
  if (!real_attention::read_layer(0, &raw)) GTEST_SKIP() << "no real-attention data at " << dir;
  const Outcome r = run_cli({"bench", "cache", "--workload", "real", "--real-dir", dir, "--layers", kRealLayersRun,
                             "--threads", "2", "--json"});
  ASSERT_TRUE(r.exited) << r.out;
  ASSERT_EQ(r.status, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out.substr(r.out.rfind("{\"command\"")), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["steps"], 63);
  EXPECT_EQ(j["layers"], std::stoi(kRealLayersRun));
  expect_bounded(j, 4, {"lru", "clock", "opt"});
}

// The demo's small version of a context beyond host memory: two layers
// under a host budget of a fifth of their KV, with a spill directory. It
// spills, keeps decoding, and reports the spill tier's figures beside the
// accuracy ones (`wavekv demo --tokens 1048576 ...` is the full size); with
// --compare-in-memory the same context first decodes with everything in
// memory, in the same run, and both passes are reported.
TEST(Cli, DemoSpillsAContextBeyondItsHostBudgetAndKeepsDecoding) {
  ScratchDir dir;
  // Segments of 1024 tokens (the environment overrides the config, and the
  // command inherits it): small enough for the sanitizer builds.
  setenv("WKV_SEGMENT_TOKENS", "1024", 1);
  const Outcome r = run_cli({"demo", "--tokens", "8192", "--layers", "2", "--heads", "2", "--q-heads", "8",
                             "--head-dim", "64", "--steps", "6", "--repeat", "2", "--threads", "2", "--host-budget",
                             "1536KiB", "--spill-dir", dir.path(), "--compare-in-memory", "--json"});
  unsetenv("WKV_SEGMENT_TOKENS");
  ASSERT_TRUE(r.exited) << r.out;
  ASSERT_EQ(r.status, 0) << r.out;
  const size_t at = r.out.find("{\"command\"");
  ASSERT_NE(at, std::string::npos) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out.substr(at, r.out.find('\n', at) - at), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  const nlohmann::json &s = j["spill"];
  EXPECT_EQ(j["layers"].get<uint32_t>(), 2u);
  EXPECT_GT(s["kv_page_bytes"].get<uint64_t>(), 4 * s["host_budget_bytes"].get<uint64_t>());
  EXPECT_LE(s["host_page_bytes"].get<uint64_t>(), s["host_budget_bytes"].get<uint64_t>());
  EXPECT_GT(s["cold_pages"].get<uint64_t>(), 0u);
  EXPECT_GT(s["bytes_written"].get<uint64_t>(), 0u);
  EXPECT_EQ(s["read_errors"].get<uint64_t>(), 0u);
  EXPECT_GT(s["retrievals_estimated_on_disk"].get<uint64_t>() + s["retrievals_exact"].get<uint64_t>(), 0u);
  EXPECT_LT(j["wavekv"]["rel_l2_median"].get<double>(), j["sink_window"]["rel_l2_median"].get<double>());
  // The anchor: the same context and queries, nothing spilled.
  const nlohmann::json &m = j["in_memory"];
  ASSERT_TRUE(m.is_object()) << r.out;
  EXPECT_EQ(m["spill"]["host_budget_bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(m["spill"]["cold_pages"].get<uint64_t>(), 0u);
  EXPECT_EQ(m["spill"]["bytes_written"].get<uint64_t>(), 0u);
  EXPECT_EQ(m["spill"]["host_page_bytes"].get<uint64_t>(), m["spill"]["kv_page_bytes"].get<uint64_t>());
  EXPECT_EQ(m["clusters_per_head"], j["clusters_per_head"]);
  EXPECT_EQ(m["exact"]["rel_l2_median"], j["exact"]["rel_l2_median"]) << "the same context and queries";
  EXPECT_EQ(m["sink_window"]["rel_l2_median"], j["sink_window"]["rel_l2_median"]);
  EXPECT_LT(m["wavekv"]["rel_l2_median"].get<double>(), m["sink_window"]["rel_l2_median"].get<double>());
  EXPECT_TRUE(dir.names().empty()) << "the spill file leaves nothing behind";
}
