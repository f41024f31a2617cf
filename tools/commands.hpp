// The subcommands of the wavekv command. Each declares its flags with their
// defaults on a Flags (so that `wavekv help` lists them) and runs on the
// parsed Options; errors are thrown (UsageError, WkvError).
#pragma once

#include "tools/args.hpp"
#include "tools/common.hpp"

namespace wkv_tool {

struct Command {
  const char *name;
  const char *summary;
  void (*declare)(Flags &flags, Options *o);
  int (*run)(const Options &o);
};

void declare_demo(Flags &flags, Options *o);
int run_demo(const Options &o);

void declare_bench(Flags &flags, Options *o);
int run_bench(const Options &o);

void declare_accuracy(Flags &flags, Options *o);
int run_accuracy(const Options &o);

void declare_stats(Flags &flags, Options *o);
int run_stats(const Options &o);

}  // namespace wkv_tool
