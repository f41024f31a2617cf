#include "tools/common.hpp"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cctype>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <CLI/CLI.hpp>

#include "kernels/dtype.hpp"
#include "lib/common/status.hpp"
#include "tools/synth.hpp"

namespace wkv_tool {

void ok(const wkv::Status &st, const char *what) {
  if (!st.is_ok()) throw WkvError(std::string(what) + ": " + st.message());
}

void check(int rc, const char *call) {
  if (rc == WKV_OK) return;
  std::string msg = std::string(call) + " failed: " + wkv_status_name(rc);
  const char *detail = wkv_last_error();
  if (detail && *detail) msg += ": " + std::string(detail);
  throw WkvError(msg);
}

std::vector<std::string> split_list(const std::string &s) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= s.size()) {
    const size_t comma = std::min(s.find(',', at), s.size());
    if (comma > at) out.push_back(s.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

bool read_real_layer(const std::string &dir, uint32_t l, std::vector<uint16_t> *raw) {
  std::ifstream f(dir + "/layer" + std::to_string(l) + ".f16", std::ios::binary);
  if (!f) return false;
  const size_t n = size_t(kRealT) * kRealKV * kRealD * 2 + size_t(kRealQueries) * kRealQ * kRealD;
  raw->resize(n);
  f.read(reinterpret_cast<char *>(raw->data()), static_cast<std::streamsize>(n * 2));
  return static_cast<size_t>(f.gcount()) == n * 2;
}

uint32_t Options::dtype_id() const {
  if (dtype == "f32") return WKV_DTYPE_F32;
  if (dtype == "bf16") return WKV_DTYPE_BF16;
  return WKV_DTYPE_F16;
}

unsigned Options::resolved_threads() const {
  if (threads != 0) return static_cast<unsigned>(threads);
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : n;
}

CLI::Validator unsigned_text() {
  return CLI::Validator(
      [](std::string &text) -> std::string {
        const char *begin = text.data(), *end = text.data() + text.size();
        uint64_t value = 0;
        const auto [stop, ec] = std::from_chars(begin, end, value);
        if (ec == std::errc::result_out_of_range) return "'" + text + "' is past 2^64 - 1";
        if (ec != std::errc() || stop != end) return "'" + text + "' is not a whole number from 0";
        return {};
      },
      "UINT");
}

void add_shape_flags(CLI::App &cmd, Options *o, bool with_layers) {
  cmd.add_option("--tokens", o->tokens, "prompt tokens")->check(CLI::Range(uint64_t{1}, uint64_t{1} << 30))->capture_default_str();
  cmd.add_option("--heads", o->heads, "KV heads")->check(CLI::Range(1, 256))->capture_default_str();
  cmd.add_option("--q-heads", o->q_heads, "query heads (a multiple of --heads)")->check(CLI::Range(1, 1024))->capture_default_str();
  cmd.add_option("--head-dim", o->head_dim, "head dimension")->check(CLI::IsMember({64, 80, 96, 128, 256}))->capture_default_str();
  if (with_layers) cmd.add_option("--layers", o->layers, "layers")->check(CLI::Range(1, 4096))->capture_default_str();
  cmd.add_option("--steps", o->steps, "decoding steps")->check(CLI::Range(1, 100000))->capture_default_str();
  cmd.add_option("--dtype", o->dtype, "storage dtype")->check(CLI::IsMember({"f16", "bf16", "f32"}))->capture_default_str();
  cmd.add_option("--threads", o->threads, "threads of the engine and the baseline; 0 = all cores")->check(CLI::Range(0, 1024))->capture_default_str();
  cmd.add_option("--seed", o->seed, "seed of the synthetic context")->check(unsigned_text())->capture_default_str();
  cmd.add_flag("--json", o->json, "print one JSON object instead of the table");
}

void validate(const Options &o, const std::string &command) {
  if (o.q_heads % o.heads != 0)
    throw UsageError(command + ": --q-heads (" + std::to_string(o.q_heads) +
                     ") must be a multiple of --heads (" + std::to_string(o.heads) + ")");
  const uint64_t dims[] = {64, 80, 96, 128, 256};
  if (std::find(std::begin(dims), std::end(dims), o.head_dim) == std::end(dims))
    throw UsageError(command + ": --head-dim must be 64, 80, 96, 128 or 256, got " +
                     std::to_string(o.head_dim));
  if (o.tokens < 256)
    throw UsageError(command + ": --tokens must be at least 256 (sink, window and a few documents), got " +
                     std::to_string(o.tokens));
  if (o.tokens + o.steps > (uint64_t{1} << 31))
    throw UsageError(command + ": --tokens plus --steps must stay below 2^31");
}

namespace {

struct MethodBit {
  const char *name;
  uint32_t bit;
};
const MethodBit kMethodBits[] = {{"outliers", WKV_METHOD_OUTLIERS},
                                 {"ones", WKV_METHOD_ONES},
                                 {"spread", WKV_METHOD_SPREAD},
                                 {"tail", WKV_METHOD_TAIL}};

}  // namespace

uint32_t parse_method(const std::string &text, const std::string &flag) {
  if (text == "default") return WKV_METHOD_DEFAULT;
  if (text == "paper") return WKV_METHOD_PAPER;
  if (!text.empty() && std::isdigit(static_cast<unsigned char>(text[0]))) {
    char *end = nullptr;
    const unsigned long v = std::strtoul(text.c_str(), &end, 0);
    if (*end == '\0' && (v & ~static_cast<unsigned long>(WKV_METHOD_DEFAULT)) == 0) return static_cast<uint32_t>(v);
    throw UsageError(flag + ": '" + text + "' is not a method (a number of WKV_METHOD_* bits)");
  }
  uint32_t m = 0;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t plus = std::min(text.find('+', at), text.size());
    const std::string part = text.substr(at, plus - at);
    bool found = false;
    for (const MethodBit &b : kMethodBits)
      if (part == b.name) m |= b.bit, found = true;
    if (!found)
      throw UsageError(flag + ": '" + part +
                       "' is not a method part (default, paper, or outliers, ones, spread, tail joined by '+')");
    at = plus + 1;
  }
  return m;
}

std::string method_name(uint32_t method) {
  if (method == WKV_METHOD_DEFAULT) return "default";
  if (method == WKV_METHOD_PAPER) return "paper";
  std::string s;
  for (const MethodBit &b : kMethodBits)
    if (method & b.bit) s += (s.empty() ? "" : "+") + std::string(b.name);
  return s;
}

Session::Session(const Options &o, unsigned threads, int64_t method) {
  wkv_config c;
  wkv_config_init(&c);
  if (method >= 0) c.method = static_cast<uint32_t>(method);
  c.n_layers = static_cast<uint32_t>(o.layers);
  c.n_q_heads = static_cast<uint32_t>(o.q_heads);
  c.n_kv_heads = static_cast<uint32_t>(o.heads);
  c.head_dim = static_cast<uint32_t>(o.head_dim);
  c.dtype = o.dtype_id();
  c.device = WKV_DEVICE_CPU;
  c.threads = threads;
  c.host_budget_bytes = o.host_budget;
  if (!o.spill_dir.empty()) c.spill_dir = o.spill_dir.c_str();
  check(wkv_engine_open(&c, &engine), "wkv_engine_open");
  try {
    config.size = sizeof config;
    check(wkv_engine_config(engine, &config), "wkv_engine_config");
    check(wkv_seq_create(engine, &seq), "wkv_seq_create");
    check(wkv_plan_create(engine, &plan), "wkv_plan_create");
  } catch (...) {
    wkv_plan_destroy(plan);
    wkv_seq_destroy(seq);
    wkv_engine_close(engine);
    throw;
  }
}

bool xbuf_holds(const wkv_xbuf_view &x, uint32_t h, const void *row, const wkv_config &engine) {
  const wkv::DType dt = static_cast<wkv::DType>(engine.dtype);
  const size_t row_bytes = static_cast<size_t>(engine.head_dim) * wkv::dtype_bytes(dt);
  std::vector<uint8_t> paged;
  if (engine.page_format == WKV_PAGE_FORMAT_INT8) {
    std::vector<float> f(engine.head_dim);
    std::vector<int8_t> q(engine.head_dim);
    float scale = 0;
    paged.resize(row_bytes);
    wkv::to_float(dt, row, f.data(), engine.head_dim);
    wkv::quantize_row(f.data(), engine.head_dim, q.data(), &scale);
    wkv::dequantize_row(dt, q.data(), scale, engine.head_dim, paged.data());
  }
  // Centered keys come back against their cluster's centroid, which is not
  // known here: a row within two 8-bit steps of the row's largest
  // magnitude (and the storage dtype's rounding) in every element is it.
  std::vector<float> want, have;
  float step = 0.f;
  if (engine.page_format == WKV_PAGE_FORMAT_INT8_CENTERED) {
    want.resize(engine.head_dim);
    have.resize(engine.head_dim);
    wkv::to_float(dt, row, want.data(), engine.head_dim);
    for (float w : want) step = std::max(step, std::fabs(w));
    step = 2.f * step / 127.f;
  }
  const uint8_t *k = static_cast<const uint8_t *>(x.k);
  for (int32_t t = x.offsets[h]; t < x.offsets[h + 1]; ++t) {
    const uint8_t *got = k + static_cast<size_t>(t) * row_bytes;
    if (std::memcmp(got, row, row_bytes) == 0) return true;
    if (!paged.empty() && std::memcmp(got, paged.data(), row_bytes) == 0) return true;
    if (!want.empty()) {
      wkv::to_float(dt, got, have.data(), engine.head_dim);
      bool near = true;
      for (uint32_t i = 0; near && i < engine.head_dim; ++i)
        near = std::fabs(have[i] - want[i]) <= step + std::fabs(want[i]) * 0x1p-7f;
      if (near) return true;
    }
  }
  return false;
}

Session::~Session() {
  wkv_plan_destroy(plan);
  wkv_seq_destroy(seq);
  wkv_engine_close(engine);
}

wkv_stats Session::stats() {
  wkv_stats s;
  wkv_stats_init(&s);
  check(wkv_engine_stats(engine, &s), "wkv_engine_stats");
  return s;
}

void save_sequence(Session &s, const std::string &path) {
  Progress p("saving " + path, 1, true);
  p.update(0);
  check(wkv_seq_save(s.seq, path.c_str(), 0), "wkv_seq_save");
  p.finish();
  if (isatty(STDERR_FILENO) != 1) std::fprintf(stderr, "saved the sequence to %s\n", path.c_str());
}

namespace {

// Appends tokens [first, first + n) to layers [l0, l1), chunk by chunk and
// layer by layer within a chunk, as a runtime's chunked prefill would send
// them; each segment is clustered by the append that completes it.
double ingest_range(Session &s, const SynthContext &ctx, uint32_t l0, uint32_t l1, uint64_t first, uint64_t n,
                    const char *label) {
  constexpr uint64_t kChunk = 1024;
  const int64_t head_stride = static_cast<int64_t>(ctx.head_stride() * ctx.spec().head_dim);
  const int64_t token_stride = ctx.spec().head_dim;
  Progress p(label, n);
  double secs = 0;
  for (uint64_t done = 0; done < n;) {
    const uint32_t m = static_cast<uint32_t>(std::min(kChunk, n - done));
    auto t0 = Clock::now();
    for (uint32_t l = l0; l < l1; ++l)
      check(wkv_seq_append(s.seq, l, ctx.k_store(0, first + done), ctx.v_store(0, first + done), m, token_stride,
                           head_stride, nullptr),
            "wkv_seq_append");
    secs += seconds_since(t0);
    done += m;
    p.update(done);
  }
  p.finish();
  return secs;
}

}  // namespace

double ingest(Session &s, const SynthContext &ctx, uint32_t layer, uint64_t first, uint64_t n,
              const char *label) {
  return ingest_range(s, ctx, layer, layer + 1, first, n, label);
}

double ingest_layers(Session &s, const SynthContext &ctx, uint32_t layers, uint64_t first, uint64_t n,
                     const char *label) {
  return ingest_range(s, ctx, 0, layers, first, n, label);
}

Progress::Progress(std::string label, uint64_t total, bool tty_only)
    : label_(std::move(label)), total_(total), tty_(isatty(STDERR_FILENO) == 1), quiet_(tty_only && !tty_),
      start_(Clock::now()) {}

void Progress::update(uint64_t done) {
  if (quiet_) return;
  const double pct = total_ ? 100.0 * done / total_ : 100.0;
  if (tty_) {
    std::fprintf(stderr, "\r%s: %" PRIu64 "/%" PRIu64 " (%3.0f%%) %.1f s", label_.c_str(), done, total_,
                 pct, seconds_since(start_));
    std::fflush(stderr);
    return;
  }
  const int quarter = static_cast<int>(pct / 25.0);
  if (quarter > shown_quarter_ && done < total_) {
    shown_quarter_ = quarter;
    std::fprintf(stderr, "%s: %" PRIu64 "/%" PRIu64 " (%.0f%%) %.1f s\n", label_.c_str(), done, total_, pct,
                 seconds_since(start_));
  }
}

void Progress::finish() {
  if (quiet_) return;
  std::fprintf(stderr, "%s%s: %" PRIu64 "/%" PRIu64 " done in %.2f s\n", tty_ ? "\r" : "", label_.c_str(),
               total_, total_, seconds_since(start_));
}

double quantile(std::vector<double> v, double q) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return std::isnan(x); }), v.end());
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const double pos = q * (v.size() - 1);
  const size_t i = static_cast<size_t>(pos);
  if (i + 1 >= v.size()) return v.back();
  return v[i] + (pos - i) * (v[i + 1] - v[i]);
}

double rel_l2(const float *a, const double *ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double e = a[i] - ref[i];
    num += e * e;
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
}

std::string fixed(double x, int digits) {
  if (std::isnan(x)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return buf;
}

std::string mib(uint64_t bytes, int digits) { return fixed(bytes / 1048576.0, digits) + " MiB"; }

double decimal(float x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.7g", static_cast<double>(x));
  return std::strtod(buf, nullptr);
}

std::string Table::str() const {
  // A row shorter than the header lets its last cell run on: it does not
  // widen its column.
  const size_t cols = rows_.empty() ? 0 : rows_[0].size();
  std::vector<size_t> width;
  for (const auto &r : rows_)
    for (size_t i = 0; i < r.size(); ++i) {
      if (r.size() < cols && i + 1 == r.size()) continue;
      if (width.size() <= i) width.push_back(0);
      width[i] = std::max(width[i], r[i].size());
    }
  std::ostringstream o;
  for (const auto &r : rows_) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      line += r[i];
      if (i + 1 < r.size()) line += std::string(width[i] - std::min(width[i], r[i].size()) + 3, ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    o << line << '\n';
  }
  return o.str();
}

}  // namespace wkv_tool
