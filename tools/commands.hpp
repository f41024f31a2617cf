// The subcommands of the wavekv command. Each declares its flags with their
// defaults on its CLI11 subcommand (so that --help lists them) and runs on
// the parsed Options; errors are thrown (UsageError, WkvError).
#pragma once

#include "tools/common.hpp"

namespace wkv_tool {

struct Command {
  const char *name;
  const char *parent;  // the command it belongs to (`bench files`), or null
  const char *summary;
  void (*declare)(CLI::App &cmd, Options *o);
  int (*run)(const Options &o);
};

void declare_demo(CLI::App &cmd, Options *o);
int run_demo(const Options &o);

void declare_bench(CLI::App &cmd, Options *o);
int run_bench(const Options &o);

void declare_bench_files(CLI::App &cmd, Options *o);
int run_bench_files(const Options &o);

void declare_bench_spill(CLI::App &cmd, Options *o);
int run_bench_spill(const Options &o);

void declare_bench_manager(CLI::App &cmd, Options *o);
int run_bench_manager(const Options &o);

void declare_bench_cache(CLI::App &cmd, Options *o);
int run_bench_cache(const Options &o);

void declare_accuracy(CLI::App &cmd, Options *o);
int run_accuracy(const Options &o);

void declare_stats(CLI::App &cmd, Options *o);
int run_stats(const Options &o);

// inspect and verify exit with 0 (intact), 1 (corrupt) or 2 (unreadable).
void declare_inspect(CLI::App &cmd, Options *o);
int run_inspect(const Options &o);

void declare_verify(CLI::App &cmd, Options *o);
int run_verify(const Options &o);

void declare_top(CLI::App &cmd, Options *o);
int run_top(const Options &o);

}  // namespace wkv_tool
