// `wavekv top FILE`: follows the statistics file a running engine publishes
// (wkv_config.stats_path), re-reading it every interval. On a terminal the
// screen is redrawn with the figures and their rates; otherwise one line is
// printed per change, for logs and pipes. Exit status: 0, or 2 when --once
// finds no readable statistics file.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <thread>

#include "lib/store/io.hpp"
#include "tools/commands.hpp"

namespace wkv_tool {

void declare_top(CLI::App &cmd, Options *o) {
  cmd.add_option("file", o->file, "the statistics file an engine publishes (wkv_config.stats_path)")->required();
  cmd.add_option("--interval", o->interval_ms, "milliseconds between reads")
      ->check(CLI::Range(10, 3600000))
      ->capture_default_str();
  cmd.add_option("--count", o->count, "stop after this many updates (0: when interrupted)")
      ->check(unsigned_text())
      ->capture_default_str();
  cmd.add_flag("--once", o->once, "print the figures once and exit (2 if the file cannot be read)");
  cmd.add_flag("--json", o->json, "print each update as the file's JSON object, one per line");
}

namespace {

using nlohmann::json;

// The figures top shows, from one statistics object.
struct Figures {
  uint64_t unix_ms = 0, sequences = 0, tokens = 0, clusters = 0;
  uint64_t host_used = 0, host_reserved = 0, device_cache = 0, steady = 0, meta = 0;
  // libwavekv 0.13 (CUDA engines; absent or 0 before and on the CPU).
  uint64_t device_reserved = 0, device_used = 0, meta_device = 0, meta_host_rows = 0;
  uint64_t lookups = 0, hits = 0, misses = 0, admissions = 0, evictions = 0, backlog = 0;
  std::string device;
};

// A number of the object, or 0: the file is read, not trusted.
uint64_t number(const json &o, const char *key) {
  if (!o.is_object()) return 0;
  const auto it = o.find(key);
  if (it == o.end() || !it->is_number() || it->get<double>() < 0) return 0;
  return it->is_number_unsigned() ? it->get<uint64_t>() : static_cast<uint64_t>(it->get<double>());
}

// An engine's file nests three deep; a deeper one is no file of ours, and
// printing one thousands deep (--json) would recurse off the stack.
constexpr int kMaxDepth = 32;

bool parse(const std::string &text, Figures *f) {
  bool too_deep = false;
  const json j = json::parse(
      text,
      [&](int depth, json::parse_event_t, json &) {
        too_deep |= depth > kMaxDepth;
        return !too_deep;  // keeps nothing deeper
      },
      false);
  if (too_deep || j.is_discarded() || !j.is_object() || !j.contains("stats")) return false;
  const json &s = j["stats"];
  const json empty = json::object();
  const json &c = j.contains("config") ? j["config"] : empty;
  f->unix_ms = number(j, "unix_ms");
  f->sequences = number(s, "sequences");
  f->tokens = number(s, "tokens");
  f->clusters = number(s, "clusters");
  f->host_used = number(s, "host_bytes_used");
  f->host_reserved = number(s, "host_bytes_reserved");
  f->device_cache = number(s, "device_cache_bytes");
  f->steady = number(s, "steady_bytes");
  f->meta = number(s, "meta_bytes");
  f->device_reserved = number(s, "device_bytes_reserved");
  f->device_used = number(s, "device_bytes_used");
  f->meta_device = number(s, "meta_device_bytes");
  f->meta_host_rows = number(s, "meta_host_rows_reserved");
  f->lookups = number(s, "lookups");
  f->hits = number(s, "cache_hits");
  f->misses = number(s, "cache_misses");
  f->admissions = number(s, "cache_admissions");
  f->evictions = number(s, "cache_evictions");
  f->backlog = number(s, "manager_backlog");
  f->device = c.is_object() && c.contains("device") && c["device"].is_string() ? c["device"].get<std::string>() : "?";
  // Printed to a terminal: no control characters (escape sequences) from
  // the file, and no more than a device name needs.
  if (f->device.size() > 32) f->device.resize(32);
  for (char &ch : f->device)
    if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) > 0x7e) ch = '?';  // ASCII only
  return true;
}

// A regular file's text (a FIFO or a device is no statistics file, and
// opening a FIFO would block).
bool read_file(const std::string &path, std::string *text) {
  wkv::FileIO &io = wkv::posix_io();
  int fd = -1;
  uint64_t bytes = 0;
  if (!wkv::open_to_read(io, path, &fd, &bytes).is_ok()) return false;
  bool ok = bytes <= (64u << 20);  // an engine's file is a few KiB
  if (ok) {
    text->resize(bytes);
    ok = wkv::read_full(io, fd, text->data(), bytes, 0) == 0;
  }
  io.close(fd);
  return ok;
}

// Per second between two figures, or "-".
std::string rate(uint64_t now, uint64_t before, double secs) {
  return secs > 0 && now >= before ? fixed((now - before) / secs, 1) + "/s" : "-";
}

std::string screen(const std::string &path, const Figures &f, const Figures &prev) {
  const double secs = prev.unix_ms && f.unix_ms > prev.unix_ms ? (f.unix_ms - prev.unix_ms) / 1e3 : 0;
  const uint64_t looked = f.hits + f.misses;
  Table t;
  t.row({"wavekv top", path + " (" + f.device + " engine)"});
  t.row({"sequences", std::to_string(f.sequences)});
  t.row({"tokens", std::to_string(f.tokens) + " (all layers), " + std::to_string(f.clusters) + " clusters"});
  t.row({"device cache", mib(f.device_cache, 1)});
  // A CUDA engine's memory by where it lives (files of libwavekv 0.13 on).
  const bool placed = f.device_reserved > 0;
  if (placed) t.row({"device memory", mib(f.device_used, 1) + " used of " + mib(f.device_reserved, 1) + " reserved"});
  t.row({"host pages", mib(f.host_used, 1) + " used of " + mib(f.host_reserved, 1) + " reserved"});
  if (f.meta_host_rows) t.row({"host meta rows' pool", mib(f.meta_host_rows, 1) + " reserved"});
  t.row({"steady zone / meta index", mib(f.steady, 1) + " / " + mib(f.meta, 1) +
                                         (placed ? " (" + mib(f.meta_device, 1) + " on the device)" : "")});
  t.row({"lookups", std::to_string(f.lookups) + " (" + rate(f.lookups, prev.lookups, secs) + ")"});
  t.row({"cache hits / misses", std::to_string(f.hits) + " / " + std::to_string(f.misses) + " (" +
                                    (looked ? fixed(100.0 * f.hits / looked, 1) : std::string("-")) + "% hits)"});
  t.row({"admissions / evictions", std::to_string(f.admissions) + " / " + std::to_string(f.evictions) + " (" +
                                       rate(f.admissions, prev.admissions, secs) + ", " +
                                       rate(f.evictions, prev.evictions, secs) + ")"});
  t.row({"manager backlog", std::to_string(f.backlog) + " steps"});
  return t.str();
}

std::string line(const Figures &f) {
  return "unix_ms=" + std::to_string(f.unix_ms) + " sequences=" + std::to_string(f.sequences) +
         " tokens=" + std::to_string(f.tokens) + " host_used=" + std::to_string(f.host_used) +
         " device_cache=" + std::to_string(f.device_cache) + " device_used=" + std::to_string(f.device_used) +
         " lookups=" + std::to_string(f.lookups) +
         " hits=" + std::to_string(f.hits) + " misses=" + std::to_string(f.misses) +
         " admissions=" + std::to_string(f.admissions) + " evictions=" + std::to_string(f.evictions) +
         " backlog=" + std::to_string(f.backlog);
}

}  // namespace

int run_top(const Options &o) {
  const bool tty = isatty(STDOUT_FILENO) == 1 && !o.json && !o.once;
  std::string last;
  Figures prev;
  bool waiting = false;
  for (uint64_t shown = 0;;) {
    std::string text;
    Figures f;
    const bool ok = read_file(o.file, &text) && parse(text, &f);
    if (!ok && o.once) {
      std::fprintf(stderr, "wavekv top: '%s' is not a readable statistics file\n", o.file.c_str());
      return 2;
    }
    if (!ok && !waiting) {
      std::fprintf(stderr, "wavekv top: waiting for '%s'\n", o.file.c_str());
      waiting = true;
    }
    if (ok && text != last) {
      waiting = false;
      if (o.json) std::cout << json::parse(text).dump() << std::endl;
      else if (tty) std::cout << "\x1b[H\x1b[2J" << screen(o.file, f, prev) << std::flush;
      else if (o.once) std::cout << screen(o.file, f, prev) << std::flush;
      else std::cout << line(f) << std::endl;
      last = std::move(text);
      prev = f;
      ++shown;
      if (o.once || (o.count && shown >= o.count)) return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(o.interval_ms));
  }
}

}  // namespace wkv_tool
