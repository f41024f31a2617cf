#!/usr/bin/env bash
# Install what building and testing wavekv needs, on Debian or Ubuntu.
#
# Idempotent: a package counts as present when dpkg says it is installed, or
# when its telltale file (a header or a command) is found on PATH, under /usr,
# /usr/local, or under a prefix named by CMAKE_PREFIX_PATH or PKG_CONFIG_PATH
# (machines where the .deb files are unpacked under a prefix rather than
# installed). When everything is present it touches neither apt nor the network.
# When something is missing: as root with apt-get, runs `apt-get update` once and
# installs the missing packages; otherwise prints the command and exits 1.
#
# WKV_SKIP_DEPS=1 skips all checks.
set -euo pipefail

if [[ "${WKV_SKIP_DEPS:-0}" == "1" ]]; then
  exit 0
fi

# package:kind:what   (kind: cmd = a command, inc = a header under include/,
#                      glob = a file matching an absolute pattern)
readonly NEEDS=(
  "cmake:cmd:cmake"
  "g++:cmd:g++"
  "make:cmd:make"
  "pkg-config:cmd:pkg-config"
  "python3:cmd:python3"
  "libgtest-dev:inc:gtest/gtest.h"
  "libgmock-dev:inc:gmock/gmock.h"
  "liburing-dev:inc:liburing.h"
  "libnuma-dev:inc:numa.h"
  "libmimalloc-dev:inc:mimalloc.h"
  "libtbb-dev:inc:tbb/tbb.h"
  "libxxhash-dev:inc:xxhash.h"
  "libcli11-dev:inc:CLI/CLI.hpp"
  "nlohmann-json3-dev:inc:nlohmann/json.hpp"
  "clang:cmd:clang"
  "libclang-rt-14-dev:glob:lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-*.a"
  "cargo:cmd:cargo"
  "rustc:cmd:rustc"
  "golang-go:cmd:go"
  "python3-pytest:cmd:pytest-3"
  "python3-numpy:cmd:f2py3"
  "clang:cmd:clang++"
  "libclang-rt-14-dev:glob:/usr/lib/llvm-14/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a"
)

# Prefixes to look under: the system ones and those named by the environment.
prefixes=(/usr /usr/local)
IFS=':' read -r -a _cmake_prefixes <<< "${CMAKE_PREFIX_PATH:-}"
for p in "${_cmake_prefixes[@]}"; do
  [[ -n "$p" ]] && prefixes+=("$p")
done
IFS=':' read -r -a _pc_dirs <<< "${PKG_CONFIG_PATH:-}"
for d in "${_pc_dirs[@]}"; do
  [[ -z "$d" ]] && continue
  # <prefix>/lib/pkgconfig, <prefix>/lib/<arch>/pkgconfig, <prefix>/share/pkgconfig
  d="${d%/}"
  d="${d%/pkgconfig}"
  case "$d" in
    */lib/*) prefixes+=("${d%/lib/*}") ;;
    */lib | */lib64 | */share) prefixes+=("${d%/*}") ;;
  esac
done

dpkg_installed() {
  command -v dpkg-query > /dev/null 2>&1 &&
    dpkg-query -W -f='${Status}' "$1" 2> /dev/null | grep -q 'install ok installed'
}

present() {
  local pkg="$1" kind="$2" what="$3" p
  dpkg_installed "$pkg" && return 0
  case "$kind" in
    cmd) command -v "$what" > /dev/null 2>&1 && return 0 ;;
    glob) compgen -G "$what" > /dev/null && return 0 ;;
    inc)
      for p in "${prefixes[@]}"; do
        [[ -e "$p/include/$what" ]] && return 0
      done
      ;;
    glob)
      for p in "${prefixes[@]}"; do
        compgen -G "$p/$what" > /dev/null && return 0
      done
      ;;
  esac
  return 1
}

missing=()
for need in "${NEEDS[@]}"; do
  IFS=':' read -r pkg kind what <<< "$need"
  present "$pkg" "$kind" "$what" || missing+=("$pkg")
done

if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi

cmd="apt-get install -y --no-install-recommends ${missing[*]}"
echo "install-deps: missing: ${missing[*]}" >&2

if ! command -v apt-get > /dev/null 2>&1; then
  echo "install-deps: no apt-get here; install the equivalents of the packages above," >&2
  echo "  or set WKV_SKIP_DEPS=1 if they are provided some other way." >&2
  exit 1
fi
if [[ "$(id -u)" -ne 0 ]]; then
  echo "install-deps: run as root:" >&2
  echo "  sudo apt-get update && sudo $cmd" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
if ! apt-get update -q || ! $cmd; then
  echo "install-deps: apt-get failed; install the packages above by hand," >&2
  echo "  or set WKV_SKIP_DEPS=1 if they are provided some other way." >&2
  exit 1
fi
echo "install-deps: installed ${missing[*]}"
