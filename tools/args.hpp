// Command-line flags of the wavekv command: a small strict parser. Every
// subcommand declares its flags with their defaults; anything else on the
// command line (an unknown flag, a missing or malformed value, a stray
// argument) is a UsageError, which main turns into a message and exit 2.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace wkv_tool {

// A mistake on the command line; main prints it and exits with status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Flags {
 public:
  explicit Flags(std::string command) : command_(std::move(command)) {}

  // Declares a flag taking an unsigned integer in [min, max].
  void add_uint(const std::string &name, uint64_t *dst, uint64_t min, uint64_t max,
                const std::string &help);
  // Declares a flag taking one of `choices`.
  void add_choice(const std::string &name, std::string *dst, std::vector<std::string> choices,
                  const std::string &help);
  // Declares a flag taking any non-empty string.
  void add_string(const std::string &name, std::string *dst, const std::string &help);
  // Declares a flag without a value that sets *dst to true.
  void add_switch(const std::string &name, bool *dst, const std::string &help);

  // Parses argv[first..argc): `--name value` or `--name=value`. Throws
  // UsageError on anything not declared or not well formed.
  void parse(int argc, char **argv, int first);

  // One line per flag, for `wavekv help`.
  std::string usage() const;

 private:
  enum class Kind { kUint, kChoice, kString, kSwitch };
  struct Spec {
    std::string name;
    Kind kind = Kind::kSwitch;
    void *dst = nullptr;
    uint64_t min = 0, max = 0;
    std::vector<std::string> choices;
    std::string help;
    std::string default_text;
  };
  void set(const Spec &s, const std::string &value);

  std::string command_;
  std::vector<Spec> specs_;
};

}  // namespace wkv_tool
