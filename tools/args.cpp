#include "tools/args.hpp"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <sstream>

namespace wkv_tool {

void Flags::add_uint(const std::string &name, uint64_t *dst, uint64_t min, uint64_t max,
                     const std::string &help) {
  Spec s;
  s.name = name;
  s.kind = Kind::kUint;
  s.dst = dst;
  s.min = min;
  s.max = max;
  s.help = help;
  s.default_text = std::to_string(*dst);
  specs_.push_back(std::move(s));
}

void Flags::add_choice(const std::string &name, std::string *dst, std::vector<std::string> choices,
                       const std::string &help) {
  Spec s;
  s.name = name;
  s.kind = Kind::kChoice;
  s.dst = dst;
  s.choices = std::move(choices);
  s.help = help;
  s.default_text = *dst;
  specs_.push_back(std::move(s));
}

void Flags::add_string(const std::string &name, std::string *dst, const std::string &help) {
  Spec s;
  s.name = name;
  s.kind = Kind::kString;
  s.dst = dst;
  s.help = help;
  s.default_text = *dst;
  specs_.push_back(std::move(s));
}

void Flags::add_switch(const std::string &name, bool *dst, const std::string &help) {
  Spec s;
  s.name = name;
  s.kind = Kind::kSwitch;
  s.dst = dst;
  s.help = help;
  specs_.push_back(std::move(s));
}

void Flags::set(const Spec &s, const std::string &value) {
  const std::string flag = "--" + s.name;
  switch (s.kind) {
    case Kind::kUint: {
      // Digits only (or 0x-prefixed hex): strtoull alone would accept
      // "-1", " 5" and "5x".
      bool hex = value.size() > 2 && value[0] == '0' && (value[1] == 'x' || value[1] == 'X');
      const std::string digits = hex ? value.substr(2) : value;
      bool ok = !digits.empty();
      for (char c : digits)
        ok = ok && (hex ? std::isxdigit(static_cast<unsigned char>(c)) : std::isdigit(static_cast<unsigned char>(c)));
      if (!ok)
        throw UsageError(command_ + ": " + flag + " wants a non-negative integer, got '" + value + "'");
      errno = 0;
      unsigned long long v = std::strtoull(value.c_str(), nullptr, hex ? 16 : 10);
      if (errno == ERANGE || v < s.min || v > s.max)
        throw UsageError(command_ + ": " + flag + " must be in [" + std::to_string(s.min) + ", " +
                         std::to_string(s.max) + "], got " + value);
      *static_cast<uint64_t *>(s.dst) = v;
      return;
    }
    case Kind::kChoice: {
      for (const std::string &c : s.choices) {
        if (c == value) {
          *static_cast<std::string *>(s.dst) = value;
          return;
        }
      }
      std::string all;
      for (const std::string &c : s.choices) all += (all.empty() ? "" : ", ") + c;
      throw UsageError(command_ + ": " + flag + " must be one of " + all + ", got '" + value + "'");
    }
    case Kind::kString:
      if (value.empty()) throw UsageError(command_ + ": " + flag + " wants a value");
      *static_cast<std::string *>(s.dst) = value;
      return;
    case Kind::kSwitch:
      *static_cast<bool *>(s.dst) = true;
      return;
  }
}

void Flags::parse(int argc, char **argv, int first) {
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a.size() < 3 || a.compare(0, 2, "--") != 0)
      throw UsageError(command_ + ": unexpected argument '" + a + "' (flags are --name value)");
    std::string name = a.substr(2), value;
    bool has_value = false;
    size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    const Spec *spec = nullptr;
    for (const Spec &s : specs_)
      if (s.name == name) spec = &s;
    if (!spec) throw UsageError(command_ + ": unknown flag --" + name);
    if (spec->kind == Kind::kSwitch) {
      if (has_value) throw UsageError(command_ + ": --" + name + " takes no value");
    } else if (!has_value) {
      if (i + 1 >= argc) throw UsageError(command_ + ": --" + name + " needs a value");
      value = argv[++i];
    }
    set(*spec, value);
  }
}

std::string Flags::usage() const {
  std::ostringstream o;
  for (const Spec &s : specs_) {
    std::string left = "  --" + s.name;
    if (s.kind == Kind::kUint) left += " N";
    if (s.kind == Kind::kString) left += " TEXT";
    if (s.kind == Kind::kChoice) {
      std::string all;
      for (const std::string &c : s.choices) all += (all.empty() ? "" : "|") + c;
      left += " " + all;
    }
    if (left.size() < 26) left.resize(26, ' ');
    else left += ' ';
    o << left << s.help;
    if (!s.default_text.empty()) o << " (" << s.default_text << ")";
    o << '\n';
  }
  return o.str();
}

}  // namespace wkv_tool
