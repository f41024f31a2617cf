#!/bin/sh
# CTest's rust_bindings: `cargo test` of wavekv-sys and wavekv, offline and
# locked, against the libwavekv.so of a build tree, with cargo's target
# directory and home inside that tree. Exits 77 (skipped) without cargo.
#
#   ctest.sh <directory of libwavekv.so> <work directory> [cargo]
set -eu
lib_dir=$1
work_dir=$2
cargo=${3:-cargo}
here=$(cd "$(dirname "$0")" && pwd)

if ! command -v "$cargo" > /dev/null 2>&1; then
  echo "rust_bindings: skipped: no cargo (Debian packages cargo and rustc;" \
       "tools/install-deps.sh installs them)"
  exit 77
fi
if [ ! -e "$lib_dir/libwavekv.so" ]; then
  echo "rust_bindings: no $lib_dir/libwavekv.so: build the wavekv target first" >&2
  exit 1
fi
lib_dir=$(cd "$lib_dir" && pwd)
mkdir -p "$work_dir"
work_dir=$(cd "$work_dir" && pwd)

# rustc and rustdoc of the same toolchain as this cargo (Debian's in
# /usr/bin, say, even when a rustup one comes first on PATH).
cargo_dir=$(dirname "$(command -v "$cargo")")
if [ -z "${RUSTC:-}" ] && [ -x "$cargo_dir/rustc" ]; then
  export RUSTC="$cargo_dir/rustc"
fi
if [ -z "${RUSTDOC:-}" ] && [ -x "$cargo_dir/rustdoc" ]; then
  export RUSTDOC="$cargo_dir/rustdoc"
fi

export WAVEKV_LIB_DIR="$lib_dir"
export CARGO_TARGET_DIR="$work_dir/target"
export CARGO_HOME="$work_dir/cargo-home"
# Doctests (the README's example) load the library at run time.
export LD_LIBRARY_PATH="$lib_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$cargo" --version
"${RUSTC:-rustc}" --version
exec "$cargo" test --offline --locked --manifest-path "$here/Cargo.toml"
