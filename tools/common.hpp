// What the subcommands of the wavekv command share: the flags every one of
// them takes, errors, an engine session over the C API, progress lines,
// summary statistics, and the table printer.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "wavekv/wavekv.h"

namespace CLI {
class App;
class Validator;
}
namespace wkv {
class Status;
}

namespace wkv_tool {

class SynthContext;

// A mistake on the command line; main prints it and exits with status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A failed wkv_* call; main prints it and exits with status 1.
class WkvError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws WkvError naming the call, the status and wkv_last_error() unless
// rc is WKV_OK.
void check(int rc, const char *call);
// The same for a status of the internal API (commands that drive the
// engine's parts directly): throws WkvError naming `what`.
void ok(const wkv::Status &st, const char *what);

// The flags of the subcommands: the shape and run of demo, bench and
// stats, the file of inspect, verify and top.
struct Options {
  uint64_t tokens = 0;
  uint64_t heads = 8;
  uint64_t q_heads = 32;
  uint64_t head_dim = 128;
  uint64_t steps = 0;
  uint64_t threads = 0;
  uint64_t seed = 1;
  uint64_t layers = 1;
  std::string dtype = "f16";
  std::string workload = "needles";  // demo: needles or diffuse
  std::string method = "default";    // demo: the engine's method (parse_method)
  std::string methods;               // accuracy: methods compared
  std::string workloads;             // accuracy: workloads run
  std::string real_dir;              // accuracy: the real-attention set
  bool json = false;
  std::string file;            // inspect, verify, top: the file; bench files, bench spill: the directory
  uint64_t interval_ms = 1000;  // top
  uint64_t count = 0;           // top: updates to show (0: until interrupted)
  bool once = false;            // top
  bool keep = false;            // bench files: keep the files
  std::string save;             // demo, stats: save the sequence to this file
  uint64_t host_budget = 0;     // demo: wkv_config.host_budget_bytes (0: none)
  std::string spill_dir;        // demo: wkv_config.spill_dir (empty: none)
  uint64_t repeat = 1;          // demo: steps each query holds for; bench manager, bench cache: a topic's steps
  bool compare_in_memory = false;  // demo: a pass with everything in memory first
  uint64_t frames = 0;          // bench manager: device cache frames
  uint64_t hits = 0;            // bench manager: units a step finds cached (sampled)
  uint64_t misses = 0;          // bench manager: units a step reads first
  uint64_t step_us = 0;         // bench manager: interval between steps
  std::string policy;           // bench manager, bench cache: replacement policies
  uint64_t batch = 1;           // bench cache: sequences sharing the cache
  double noise = 0;             // bench cache: the queries' noise (serving workload)
  std::string fractions;        // bench cache: cache sizes, as fractions of the KV
  double link_gbs = 0;          // bench cache: host-to-device GB/s, for the misses' transfer time
  uint64_t page_bytes = 0;      // bench cache: wkv_config.page_bytes (0: the default)
  double near = 0;              // bench cache: the +near policies' clusters, of the retrieval zone's

  uint32_t dtype_id() const;
  // threads, or the number of cores when 0.
  unsigned resolved_threads() const;
};

// Declares the shape flags above on a subcommand (layers only if
// with_layers), with their current values as defaults.
void add_shape_flags(CLI::App &cmd, Options *o, bool with_layers);
// A check of an unsigned option's text: a decimal number that fits in 64
// bits. CLI11 alone reads "-1" and a number past 2^64 - 1 as 2^64 - 1,
// silently: a seed, a count or a budget without a bound. (An option with
// a transform, such as AsSizeValue's "4GiB", is checked after it, on its
// digits.)
CLI::Validator unsigned_text();
// Checks what the flags cannot check alone; throws UsageError.
void validate(const Options &o, const std::string &command);

// A method of the engine (wkv_config.method) from its name: "default",
// "paper", bit names joined by '+' (outliers, ones, spread, tail), or a
// number. Throws UsageError naming `flag`.
uint32_t parse_method(const std::string &text, const std::string &flag);
// The name parse_method reads back: "paper", "default" or bits joined by '+'.
std::string method_name(uint32_t method);

// An engine with one sequence and one plan, closed in reverse order; with
// method >= 0 the engine's method is set (the environment still overrides).
class Session {
 public:
  Session(const Options &o, unsigned threads, int64_t method = -1);
  ~Session();
  Session(const Session &) = delete;
  Session &operator=(const Session &) = delete;

  wkv_engine *engine = nullptr;
  wkv_seq *seq = nullptr;
  wkv_plan *plan = nullptr;
  wkv_config config;  // effective, defaults and environment resolved

  wkv_stats stats();
};

// Whether KV head h's run of an execution buffer holds the K row `row`
// (head_dim elements of the engine's dtype) byte for byte: as appended, or,
// where the engine's pages are 8-bit (WKV_PAGE_FORMAT_INT8), as a page
// gives it back.
bool xbuf_holds(const wkv_xbuf_view &x, uint32_t h, const void *row, const wkv_config &engine);

// Saves the session's sequence to `path` (wkv_seq_save), with a line on
// stderr: rewritten on a terminal, once at the end otherwise.
void save_sequence(Session &s, const std::string &path);

// Appends tokens [first, first + n) of every head of ctx to `layer` in
// chunks, with a progress line; returns the wall seconds of the appends.
double ingest(Session &s, const SynthContext &ctx, uint32_t layer, uint64_t first, uint64_t n,
              const char *label);
// The same for layers [0, layers), layer by layer within each chunk, as a
// runtime's chunked prefill would send them.
double ingest_layers(Session &s, const SynthContext &ctx, uint32_t layers, uint64_t first, uint64_t n,
                     const char *label);

// Progress on stderr: one line rewritten in place on a terminal, a line per
// quarter otherwise (or nothing, if tty_only).
class Progress {
 public:
  Progress(std::string label, uint64_t total, bool tty_only = false);
  void update(uint64_t done);
  void finish();

 private:
  std::string label_;
  uint64_t total_;
  int shown_quarter_ = -1;
  bool tty_, quiet_;
  std::chrono::steady_clock::time_point start_;
};

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The q-quantile (0..1) by linear interpolation; NaN for an empty set.
double quantile(std::vector<double> v, double q);
inline double median(const std::vector<double> &v) { return quantile(v, 0.5); }

// ||a - ref|| / ||ref|| over n elements.
double rel_l2(const float *a, const double *ref, size_t n);

// A number with `digits` decimals, or "-" for NaN.
std::string fixed(double x, int digits);
// Bytes in MiB with `digits` decimals: "12.50 MiB".
std::string mib(uint64_t bytes, int digits = 2);
// A float as the decimal it was written as (0.018, not 0.017999999225).
double decimal(float x);

// The items of a comma-separated list, empty ones left out.
std::vector<std::string> split_list(const std::string &s);

// The real-attention set (its README): 6 layers, 4 query heads, 2 KV heads,
// d = 128, f16; per layer K[8192][2][128], V likewise, Q[64][4][128]. Query
// j attends to tokens 0 .. 8128 + j: the prompt is 8128 tokens, then one
// token is appended before each query.
constexpr uint32_t kRealLayers = 6, kRealQ = 4, kRealKV = 2, kRealD = 128, kRealT = 8192, kRealQueries = 64;
// Layer l's file of the set under `dir` into *raw (K, then V, then the
// queries, f16 bits); false when it is absent or short.
bool read_real_layer(const std::string &dir, uint32_t l, std::vector<uint16_t> *raw);

// Rows of a left-aligned text table: the first row is the header.
class Table {
 public:
  void row(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }
  std::string str() const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace wkv_tool
