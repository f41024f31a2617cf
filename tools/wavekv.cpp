// The wavekv command: the demo and the benchmarks, engine statistics, and
// sequence files (inspect, verify) and a running engine's statistics file
// (top). Arguments through CLI11. Exit status: 0 success, 1 a wavekv call
// failed (inspect and verify: the file is corrupt), 2 usage (inspect and
// verify: the file cannot be read).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "tools/commands.hpp"

namespace wkv_tool {
namespace {

// Parents before their subcommands.
const Command kCommands[] = {
    {"demo", nullptr, "decode a synthetic long context; accuracy against exact attention and speed", declare_demo,
     run_demo},
    {"bench", nullptr, "decode benchmark: wavekv step time against exact CPU attention", declare_bench, run_bench},
    {"files", "bench", "save and load bandwidth of a long sequence against dd on the same disk",
     declare_bench_files, run_bench_files},
    {"spill", "bench", "evict and restore a long sequence through the spill file against fio on the same disk",
     declare_bench_spill, run_bench_spill},
    {"manager", "bench", "the buffer manager's thread against a stream of decoding steps (host only)",
     declare_bench_manager, run_bench_manager},
    {"cache", "bench", "the device cache's hit ratio on a workload's retrieval, by policy, against the optimum (CPU engine)",
     declare_bench_cache, run_bench_cache},
    {"accuracy", nullptr, "methods side by side on the needles, diffuse and real-attention workloads",
     declare_accuracy, run_accuracy},
    {"stats", nullptr, "engine statistics after a small synthetic session (text and JSON)", declare_stats,
     run_stats},
    {"inspect", nullptr, "describe a sequence file: shape, settings, clusters, pages, checksums", declare_inspect,
     run_inspect},
    {"verify", nullptr, "check every checksum of a sequence file (exit 0 intact, 1 corrupt, 2 unreadable)",
     declare_verify, run_verify},
    {"top", nullptr, "follow a running engine's statistics file (wkv_config.stats_path)", declare_top, run_top},
};

int version() {
  std::printf("wavekv library %s (%d), header %d.%d.%d (%d)\n", wkv_version_string(), wkv_version(),
              WKV_VERSION_MAJOR, WKV_VERSION_MINOR, WKV_VERSION_PATCH, WKV_VERSION_NUMBER);
  if (wkv_version() / 10000 != WKV_VERSION_MAJOR) {
    std::fprintf(stderr, "wavekv: warning: library major version differs from the header's\n");
    return 1;
  }
  return 0;
}

int dispatch(int argc, char **argv) {
  CLI::App app{"wavekv: a KV-cache storage engine for long-context LLM inference", "wavekv"};
  app.require_subcommand(1);
  app.footer(
      "Exit status: 0 success, 1 a wavekv call failed, 2 bad usage; inspect and verify: 0 intact,\n"
      "1 corrupt, 2 unreadable.\n");
  app.add_subcommand("version", "library and header versions");
  constexpr size_t kN = sizeof kCommands / sizeof kCommands[0];
  std::vector<Options> opts(kN);
  std::vector<CLI::App *> subs(kN, nullptr);
  for (size_t i = 0; i < kN; ++i) {
    CLI::App *parent = &app;
    for (size_t j = 0; j < i && kCommands[i].parent; ++j)
      if (std::string(kCommands[j].name) == kCommands[i].parent) parent = subs[j];
    subs[i] = parent->add_subcommand(kCommands[i].name, kCommands[i].summary);
    kCommands[i].declare(*subs[i], &opts[i]);
  }
  if (argc == 2 && std::string(argv[1]) == "help") {  // as --help
    std::fputs(app.help().c_str(), stdout);
    return 0;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp &e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp &e) {
    return app.exit(e);
  } catch (const CLI::ParseError &e) {
    throw UsageError(e.what());
  }
  if (app.got_subcommand("version")) return version();
  // The deepest command given: a subcommand's parent is parsed too.
  for (size_t i = kN; i-- > 0;)
    if (subs[i]->parsed()) return kCommands[i].run(opts[i]);
  throw UsageError("no command given");
}

}  // namespace
}  // namespace wkv_tool

int main(int argc, char **argv) {
  try {
    return wkv_tool::dispatch(argc, argv);
  } catch (const wkv_tool::UsageError &e) {
    std::fprintf(stderr, "wavekv: %s\n(see 'wavekv --help')\n", e.what());
    return 2;
  } catch (const wkv_tool::WkvError &e) {
    std::fprintf(stderr, "wavekv: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc &) {
    std::fprintf(stderr, "wavekv: out of memory\n");
    return 1;
  } catch (const std::exception &e) {
    std::fprintf(stderr, "wavekv: %s\n", e.what());
    return 1;
  }
}
