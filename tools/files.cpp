// `wavekv inspect` and `wavekv verify`: a sequence file read with the
// engine's own reader (lib/store/seq_file.hpp), without an engine. Both
// read every section and check its checksum, then decode each layer and
// check it against itself as an import would (check_snapshot); inspect also
// describes what the file holds. The file is never trusted: whatever it
// holds, they report, and exit 0 (intact), 1 (corrupt) or 2 (unreadable:
// missing, unreadable, or a newer format than this wavekv reads).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <string>
#include <vector>

#include "lib/store/seq_file.hpp"
#include "tools/commands.hpp"

namespace wkv_tool {

void declare_inspect(CLI::App &cmd, Options *o) {
  cmd.add_option("file", o->file, "a sequence file (wkv_seq_save)")->required();
  cmd.add_flag("--json", o->json, "print one JSON object instead of the text");
}

void declare_verify(CLI::App &cmd, Options *o) {
  cmd.add_option("file", o->file, "a sequence file (wkv_seq_save)")->required();
  cmd.add_flag("--json", o->json, "print one JSON object instead of the text");
}

namespace {

using nlohmann::ordered_json;
using wkv::seqfile::Kind;

enum Verdict { kIntact = 0, kCorrupt = 1, kUnreadable = 2 };

// Cluster sizes in power-of-two bins: 1, 2-3, 4-7, ..., 64 and more.
constexpr int kBins = 7;
const char *const kBinNames[kBins] = {"1", "2-3", "4-7", "8-15", "16-31", "32-63", "64+"};
int bin_of(uint32_t size) {
  int b = 0;
  while (b + 1 < kBins && size >= (2u << b)) ++b;
  return b;
}

struct HeadStats {
  uint64_t sink = 0, tail = 0, segments = 0, clusters = 0, pages = 0, clustered = 0;
  uint32_t size_min = 0, size_median = 0, size_max = 0;
  uint64_t bins[kBins] = {};
  double fill = 0;  // clustered tokens / page slots
};

struct LayerStats {
  uint32_t layer = 0;
  uint64_t tokens = 0, tail_begin = 0;
  bool generating = false;
  std::vector<HeadStats> heads;
};

// What examining a file found.
struct Report {
  std::string path;
  Verdict verdict = kIntact;
  std::vector<std::string> errors;
  bool have_header = false;
  wkv::FileHeader header;
  uint64_t bytes = 0;
  std::vector<wkv::SectionInfo> sections;  // as far as the headers could be walked
  std::vector<std::string> state;          // per section: "ok", "corrupt: ...", or "" (not checked)
  std::vector<LayerStats> layers;          // those decoded

  void note(const wkv::Status &st) {
    errors.push_back(st.message());
    verdict = std::max(verdict, st.code() == WKV_ERR_CORRUPT ? kCorrupt : kUnreadable);
  }
};

HeadStats head_stats(const wkv::HeadSnapshot &h, const wkv::Config &cfg) {
  HeadStats s;
  const uint64_t row = cfg.row_bytes();
  s.sink = h.sink_k.size() / row;
  s.tail = h.tail_k.size() / row;
  s.segments = h.segments.size();
  s.clusters = h.size.size();
  s.pages = h.pages.size() / cfg.page_slot_bytes();
  for (const wkv::SegmentDesc &g : h.segments) s.clustered += g.tokens;
  if (s.pages) s.fill = static_cast<double>(s.clustered) / (static_cast<double>(s.pages) * cfg.page_tokens());
  std::vector<uint32_t> sizes(h.size.begin(), h.size.end());
  for (uint32_t z : sizes) ++s.bins[bin_of(z)];
  if (!sizes.empty()) {
    std::sort(sizes.begin(), sizes.end());
    s.size_min = sizes.front();
    s.size_median = sizes[sizes.size() / 2];
    s.size_max = sizes.back();
  }
  return s;
}

Report examine(const std::string &path, bool with_stats) {
  Report r;
  r.path = path;
  wkv::FileIO &io = wkv::posix_io();
  int fd = -1;
  if (const wkv::Status opened = wkv::open_to_read(io, path, &fd); !opened.is_ok()) {
    r.note(opened);
    return r;
  }
  struct Closer {
    wkv::FileIO &io;
    int fd;
    ~Closer() { io.close(fd); }
  } closer{io, fd};

  // 1. The superblock, the section headers, the trailer.
  wkv::SeqFileReader reader(io, fd);
  wkv::Status st = reader.read_header();
  r.bytes = reader.file_bytes();
  if (!st.is_ok()) {
    r.note(st);
    return r;
  }
  r.have_header = true;
  r.header = reader.header();
  st = reader.read_sections();
  if (!st.is_ok()) r.note(st);
  r.sections = reader.sections();
  r.state.assign(r.sections.size(), "");

  // 2. Each layer whose sections were all found: read and decode it (every
  //    checksum on the way), check it as an import would.
  const wkv::Config cfg = r.header.config();
  const size_t per_layer = 1 + 4ull * r.header.n_kv_heads();
  Progress progress("checking", r.bytes, true);
  wkv::LayerSnapshot snap;
  for (uint32_t l = 0; l < r.header.n_layers(); ++l) {
    const size_t first = l * per_layer;
    if (first + per_layer > r.sections.size()) break;
    st = reader.read_layer(l, &snap);
    if (st.is_ok()) {
      for (size_t i = first; i < first + per_layer; ++i) r.state[i] = "ok";
      wkv::Status checked = wkv::check_snapshot(cfg, snap);
      if (!checked.is_ok()) {
        r.note(WKV_ERROR(WKV_ERR_CORRUPT, "layer %u: %s", l, checked.message().c_str()));
      } else if (with_stats) {
        LayerStats ls;
        ls.layer = l;
        ls.tokens = snap.tokens;
        ls.tail_begin = snap.tail_begin;
        ls.generating = snap.generating;
        for (const wkv::HeadSnapshot &h : snap.heads) ls.heads.push_back(head_stats(h, cfg));
        r.layers.push_back(std::move(ls));
      }
    } else if (st.code() == WKV_ERR_CORRUPT) {
      // Which of the layer's sections: each checked on its own.
      r.note(st);
      for (size_t i = first; i < first + per_layer; ++i) {
        wkv::Status one = reader.check_section(i);
        r.state[i] = one.is_ok() ? "ok" : "corrupt: " + one.message();
        if (!one.is_ok() && one.code() != WKV_ERR_CORRUPT) r.note(one);
      }
    } else {
      r.note(st);
      break;
    }
    progress.update(r.sections[first + per_layer - 1].offset + r.sections[first + per_layer - 1].bytes);
  }
  progress.finish();
  return r;
}

const char *verdict_name(Verdict v) { return v == kIntact ? "intact" : v == kCorrupt ? "corrupt" : "unreadable"; }

std::string utc(uint64_t unix_ms) {
  const time_t t = static_cast<time_t>(unix_ms / 1000);
  struct tm tm;
  char buf[64] = "?";
  if (gmtime_r(&t, &tm)) std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

std::string hex(uint64_t x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(x));
  return buf;
}

std::string env_list(uint32_t bits) {
  std::string s;
  for (unsigned b = 0; b < 32; ++b) {
    if (!(bits & (1u << b))) continue;
    const char *name = wkv::env_override_name(b);
    s += (s.empty() ? "" : ", ") + (name ? std::string(name) : "bit " + std::to_string(b));
  }
  return s.empty() ? "none" : s;
}

std::string file_dtype(uint32_t dtype) { return dtype <= WKV_DTYPE_BF16 ? wkv::dtype_name(static_cast<wkv::DType>(dtype)) : "?"; }

ordered_json header_json(const wkv::FileHeader &h) {
  const wkv_config &c = h.cfg;
  ordered_json env = ordered_json::array();
  for (unsigned b = 0; b < 32; ++b)
    if (h.env_overrides & (1u << b)) env.push_back(wkv::env_override_name(b) ? wkv::env_override_name(b) : "?");
  return {
      {"format_version", h.format_version},
      {"library_version", h.library_version_string},
      {"device", h.device == WKV_DEVICE_CUDA ? "cuda" : "cpu"},
      {"saved_unix_ms", h.saved_unix_ms},
      {"shape",
       {{"n_layers", c.n_layers},
        {"n_q_heads", c.n_q_heads},
        {"n_kv_heads", c.n_kv_heads},
        {"head_dim", c.head_dim},
        {"dtype", file_dtype(c.dtype)}}},
      {"settings",
       {{"page_bytes", c.page_bytes},
        {"page_format", wkv::page_format_name(c.page_format)},
        {"page_tokens", h.page_tokens},
        {"page_slot_bytes", h.page_slot_bytes},
        {"segment_tokens", c.segment_tokens},
        {"update_segment_tokens", c.update_segment_tokens},
        {"cluster_tokens", c.cluster_tokens},
        {"kmeans_iters", c.kmeans_iters},
        {"sink_tokens", c.sink_tokens},
        {"window_tokens", c.window_tokens},
        {"retrieval_frac", decimal(c.retrieval_frac)},
        {"estimation_frac", decimal(c.estimation_frac)},
        {"seed", c.seed},
        {"method", method_name(c.method)},
        {"env_overrides", env}}},
  };
}

ordered_json sections_json(const Report &r) {
  ordered_json a = ordered_json::array();
  for (size_t i = 0; i < r.sections.size(); ++i) {
    const wkv::SectionInfo &s = r.sections[i];
    ordered_json e = {{"index", i}, {"kind", wkv::seqfile::kind_name(s.kind)}, {"layer", s.layer}};
    e["head"] = s.head == wkv::seqfile::kNoHead ? ordered_json() : ordered_json(s.head);
    e["offset"] = s.offset;
    e["bytes"] = s.bytes;
    e["state"] = r.state[i].empty() ? "unchecked" : r.state[i].substr(0, r.state[i].find(':'));
    if (r.state[i].size() > 3 && r.state[i] != "ok") e["error"] = r.state[i].substr(r.state[i].find(": ") + 2);
    a.push_back(std::move(e));
  }
  return a;
}

ordered_json layers_json(const Report &r) {
  ordered_json layers = ordered_json::array();
  for (const LayerStats &ls : r.layers) {
    ordered_json heads = ordered_json::array();
    for (size_t h = 0; h < ls.heads.size(); ++h) {
      const HeadStats &s = ls.heads[h];
      ordered_json hist;
      for (int b = 0; b < kBins; ++b) hist[kBinNames[b]] = s.bins[b];
      heads.push_back({{"head", h},
                       {"sink", s.sink},
                       {"tail", s.tail},
                       {"segments", s.segments},
                       {"clusters", s.clusters},
                       {"cluster_size", {{"min", s.size_min}, {"median", s.size_median}, {"max", s.size_max}}},
                       {"cluster_size_histogram", hist},
                       {"pages", s.pages},
                       {"page_fill", s.fill}});
    }
    layers.push_back({{"layer", ls.layer},
                      {"tokens", ls.tokens},
                      {"tail_begin", ls.tail_begin},
                      {"generating", ls.generating},
                      {"heads", heads}});
  }
  return layers;
}

// Unchecked text from the file (a version string) may be any bytes.
std::string dump(const ordered_json &j, int indent) {
  return j.dump(indent, ' ', false, ordered_json::error_handler_t::replace);
}

size_t sections_ok(const Report &r) { return static_cast<size_t>(std::count(r.state.begin(), r.state.end(), "ok")); }

void print_inspect_text(const Report &r) {
  Table t;
  t.row({"file", r.path + " (" + std::to_string(r.bytes) + " bytes)"});
  t.row({"state", std::string(verdict_name(r.verdict)) + (r.errors.empty() ? "" : ": " + r.errors.front())});
  if (r.have_header) {
    const wkv::FileHeader &h = r.header;
    const wkv_config &c = h.cfg;
    t.row({"format", std::to_string(h.format_version) + ", written by wavekv " + h.library_version_string + " (" +
                         (h.device == WKV_DEVICE_CUDA ? "cuda" : "cpu") + " engine) at " + utc(h.saved_unix_ms)});
    t.row({"shape", std::to_string(c.n_layers) + " layers, " + std::to_string(c.n_q_heads) + " q heads, " +
                        std::to_string(c.n_kv_heads) + " kv heads, head_dim " + std::to_string(c.head_dim) + ", " +
                        file_dtype(c.dtype)});
    t.row({"pages", std::to_string(h.page_tokens) + " tokens (" + std::to_string(c.page_bytes) +
                        " bytes of K), slots of " + std::to_string(h.page_slot_bytes) + " bytes, " +
                        (c.page_format == WKV_PAGE_FORMAT_INT8 ? "8-bit rows with a scale each"
                         : c.page_format == WKV_PAGE_FORMAT_INT8_CENTERED
                             ? "8-bit rows with a scale each, keys less their clusters' centroids"
                             : "rows in " + file_dtype(c.dtype))});
    t.row({"index", "segments of " + std::to_string(c.segment_tokens) + " prompt / " +
                        std::to_string(c.update_segment_tokens) + " generated tokens, " +
                        std::to_string(c.cluster_tokens) + " tokens per cluster, " + std::to_string(c.kmeans_iters) +
                        " k-means iterations, seed " + hex(c.seed) + ", method " +
                        method_name(c.method)});
    t.row({"zones", "sink " + std::to_string(c.sink_tokens) + ", window " + std::to_string(c.window_tokens) +
                        ", retrieval " + fixed(c.retrieval_frac, 3) + ", estimation " + fixed(c.estimation_frac, 3)});
    t.row({"environment", env_list(h.env_overrides)});
    std::string seq = "1";
    if (!r.layers.empty() && r.layers[0].layer == 0)
      seq += ": " + std::to_string(r.layers[0].tokens) + " tokens in layer 0, " +
             (r.layers[0].generating ? "generating" : "in its prompt");
    t.row({"sequences", seq});
    t.row({"checksums", std::to_string(sections_ok(r)) + " of " + std::to_string(h.section_count()) +
                            " sections intact"});
  }
  std::cout << t.str();
  if (!r.layers.empty()) {
    Table lt;
    std::string bins;
    for (int b = 0; b < kBins; ++b) bins += (b ? "/" : "") + std::string(kBinNames[b]);
    lt.row({"layer", "head", "tokens", "sink+tail", "segments", "clusters", "size min/med/max",
            "sizes " + bins, "pages", "fill"});
    for (const LayerStats &ls : r.layers)
      for (size_t h = 0; h < ls.heads.size(); ++h) {
        const HeadStats &s = ls.heads[h];
        std::string hist;
        for (int b = 0; b < kBins; ++b) hist += (b ? "/" : "") + std::to_string(s.bins[b]);
        lt.row({std::to_string(ls.layer), std::to_string(h), std::to_string(ls.tokens),
                std::to_string(s.sink) + "+" + std::to_string(s.tail), std::to_string(s.segments),
                std::to_string(s.clusters),
                std::to_string(s.size_min) + "/" + std::to_string(s.size_median) + "/" + std::to_string(s.size_max),
                hist, std::to_string(s.pages), fixed(s.fill, 3)});
      }
    std::cout << '\n' << lt.str();
  }
  for (size_t i = 1; i < r.errors.size(); ++i) std::cout << "also: " << r.errors[i] << '\n';
}

}  // namespace

int run_inspect(const Options &o) {
  const Report r = examine(o.file, true);
  if (o.json) {
    ordered_json j = {{"file", r.path}, {"bytes", r.bytes}, {"state", verdict_name(r.verdict)}};
    j["errors"] = r.errors;
    if (r.have_header) {
      j.update(header_json(r.header));
      j["sequences"] = ordered_json::array({{{"layers", layers_json(r)}}});
      j["sections"] = sections_json(r);
    }
    std::cout << dump(j, 2) << std::endl;
  } else {
    print_inspect_text(r);
  }
  return r.verdict;
}

int run_verify(const Options &o) {
  const Report r = examine(o.file, false);
  const uint64_t total = r.have_header ? r.header.section_count() : 0;
  if (o.json) {
    ordered_json j = {{"file", r.path},       {"bytes", r.bytes},          {"state", verdict_name(r.verdict)},
                      {"sections", total},    {"intact", sections_ok(r)}, {"errors", r.errors}};
    std::cout << dump(j, -1) << std::endl;
  } else if (r.verdict == kIntact) {
    std::cout << r.path << ": intact (" << total << " sections, " << r.bytes << " bytes)\n";
  } else {
    std::cout << r.path << ": " << verdict_name(r.verdict) << ": " << r.errors.front() << '\n';
    for (size_t i = 1; i < r.errors.size(); ++i) std::cout << "  also: " << r.errors[i] << '\n';
  }
  return r.verdict;
}

}  // namespace wkv_tool
