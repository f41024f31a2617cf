// The wavekv command: engine statistics, the demo and the decode benchmark,
// over the public C API only (plus the CPU attention kernel for the exact
// baseline). Exit status: 0 success, 1 a wavekv call failed, 2 usage.
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "tools/commands.hpp"

namespace wkv_tool {
namespace {

const Command kCommands[] = {
    {"demo", "decode a synthetic long context; accuracy against exact attention and speed", declare_demo,
     run_demo},
    {"bench", "decode benchmark: wavekv step time against exact CPU attention", declare_bench, run_bench},
    {"accuracy", "methods side by side on the needles, diffuse and real-attention workloads", declare_accuracy,
     run_accuracy},
    {"stats", "engine statistics after a small synthetic session (text and JSON)", declare_stats, run_stats},
};

void usage() {
  std::string s =
      "usage: wavekv <command> [flags]\n"
      "\n"
      "commands:\n"
      "  version                  library and header versions\n"
      "  help                     this text\n";
  for (const Command &c : kCommands) {
    std::string left = std::string("  ") + c.name;
    left.resize(27, ' ');
    s += left + c.summary + "\n";
  }
  for (const Command &c : kCommands) {
    Options o;
    Flags f(c.name);
    c.declare(f, &o);
    s += "\nwavekv " + std::string(c.name) + " flags:\n" + f.usage();
  }
  s +=
      "\n"
      "Inspecting and verifying cache files (saved sequences, spill files) comes with\n"
      "the file format, in a later issue.\n"
      "Exit status: 0 success, 1 a wavekv call failed, 2 bad usage.\n";
  std::fputs(s.c_str(), stderr);
}

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
  if (argc < 2) {
    usage();
    return 2;
  }
  const std::string cmd = argv[1];
  if (cmd == "help" || cmd == "--help" || cmd == "-h") {
    usage();
    return 2;
  }
  if (cmd == "version" || cmd == "--version") {
    if (argc > 2) throw UsageError("version: takes no arguments");
    return version();
  }
  for (const Command &c : kCommands) {
    if (cmd != c.name) continue;
    Options o;
    Flags f(c.name);
    c.declare(f, &o);
    f.parse(argc, argv, 2);
    return c.run(o);
  }
  std::fprintf(stderr, "wavekv: unknown command '%s'\n\n", cmd.c_str());
  usage();
  return 2;
}

}  // namespace
}  // namespace wkv_tool

int main(int argc, char **argv) {
  try {
    return wkv_tool::dispatch(argc, argv);
  } catch (const wkv_tool::UsageError &e) {
    std::fprintf(stderr, "wavekv %s\n(see 'wavekv help')\n", e.what());
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
